"""The memory benchmark: each rank's measured peak tensor bytes of a real training step against
`torchllm.tools.estimate_memory`'s estimate, over a matrix of layouts at a tiny shape (CPU,
gloo ranks, float32).

    python benchmarks/bench_memory.py [--layouts NAME,...] [--list] [--json PATH]
        [--timeout 600] [--work_dir DIR] [--section.key=value ...]   (overrides for every row)

Each row is one `torchrun` launch of `benchlib.worker` (the Trainer's own loop, 3 steps) on
its row's number of ranks; each rank measures the peak tensor bytes of step 2 from the CPU
allocator's own live-byte count, every thread's frees included (benchlib/tensor_memory.py), and
reports the estimate for its own pipeline rank. Prints one line per row and rank: measured,
estimated, estimate / measured. A row whose setting the trainer refuses (or that needs a missing package) is printed with the
reason instead. Exit 1 when a row failed or an estimate is outside 10% of its measurement.

The base row: the debug Llama (dim 256, 4 blocks), seq 128, local batch 4, vocab 4,096,
selective AC (`op`) and the chunked loss (TorchTitan's large-model settings); suffixed rows
change one thing (`fsdp2-ac_none`: no AC, `fsdp2-plain_loss`: the full logits, ...).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]  # this checkout's torchllm; benchlib

from benchlib import WORKER, worker_env  # noqa: E402
from benchlib.report import failure_reason  # noqa: E402
from torchllm.config import ConfigError  # noqa: E402

COMMAND = "python benchmarks/bench_memory.py"
TOLERANCE = 0.10  # |estimate / measured - 1| allowed on every rank

BASE = [
    "--model.flavor=debug", "--model.vocab_size=4096", "--data.tokenizer=bytes",
    "--training.device=cpu", "--training.mixed_precision=none",
    "--training.seq_len=128", "--training.local_batch_size=4", "--training.global_batch_size=-1",
    "--activation_checkpoint.mode=selective", "--activation_checkpoint.selective_option=op",
    "--training.chunked_loss=true", "--training.loss_chunk_tokens=128",
    "--optimizer.name=adamw", "--compile.enable=false", "--float8.enable=false",
]


def layout(shard: int = -1, replicate: int = 1, mode: str = "fsdp", **degrees: int) -> list[str]:
    out = [f"--parallelism.dp_mode={mode}", f"--parallelism.data_parallel_shard_degree={shard}",
           f"--parallelism.data_parallel_replicate_degree={replicate}"]
    return out + [f"--parallelism.{k}={v}" for k, v in degrees.items()]


@dataclass
class Row:
    nproc: int
    overrides: list[str]
    needs: str | None = None  # a module the row needs (adamw8bit: torchao)
    note: str = ""  # why a row's estimate is outside the band, when it is known to be


CP = ("a busy machine can move a cp rank's peak by a collective's buffers alive longer on "
      "gloo's thread (counted: they are tensors)")
PP = {"pipeline_parallel_degree": 2, "pipeline_parallel_microbatch_size": 1}
MOE = ["--model.name=qwen3_moe", "--model.flavor=debug", "--model.moe_aux_loss_coef=0"]
ROWS: dict[str, Row] = {
    "single": Row(1, []),
    "ddp2": Row(2, layout(mode="ddp")),
    "fsdp2": Row(2, layout()),
    "fsdp4": Row(4, layout()),
    "hsdp2x2": Row(4, layout(shard=2, replicate=2)),
    # TP refuses the chunked loss: its own loss is vocab-parallel (each rank 1/tp of the logits)
    "tp2": Row(2, layout(shard=1, tensor_parallel_degree=2) + ["--training.chunked_loss=false"]),
    "cp2": Row(2, layout(shard=1, context_parallel_degree=2), note=CP),
    "cp4": Row(4, layout(shard=1, context_parallel_degree=4), note=CP),
    "pp2-1f1b": Row(2, layout(shard=1, **PP) + ["--parallelism.pipeline_parallel_schedule=1F1B"]),
    "pp2-interleaved": Row(2, layout(shard=1, **PP) + [
        "--parallelism.pipeline_parallel_schedule=Interleaved1F1B"]),
    # (no AC: selective AC replays the profiler's record_function ops of the all-to-all and fails)
    "ep2": Row(2, layout(expert_parallel_degree=2) + MOE + ["--activation_checkpoint.mode=none"],
               note="the ranks measure apart by their own routing (the CPU path pads every "
                    "local expert to its busiest); the estimate is the worst rank under "
                    "estimate_memory's --moe_imbalance (default 2x the balanced load): a "
                    "routing further off that moves a rank outside"),
    "single-accum4": Row(1, ["--training.global_batch_size=16"]),
    "ddp2-accum4": Row(2, layout(mode="ddp") + ["--training.global_batch_size=32"]),
    "fsdp2-accum4": Row(2, layout() + ["--training.global_batch_size=32"]),
    "fsdp2-ac_none": Row(2, layout() + ["--activation_checkpoint.mode=none"]),
    "fsdp2-ac_full": Row(2, layout() + ["--activation_checkpoint.mode=full"]),
    "fsdp2-plain_loss": Row(2, layout() + ["--training.chunked_loss=false"]),
    "fsdp2-adamw8bit": Row(2, layout() + ["--optimizer.name=adamw8bit"], needs="torchao"),
    "fsdp2-muon": Row(2, layout() + ["--optimizer.name=muon"]),
    "ddp2-muon": Row(2, layout(mode="ddp") + ["--optimizer.name=muon"]),
    "ddp2-ac_none-plain_loss": Row(2, layout(mode="ddp") + [
        "--activation_checkpoint.mode=none", "--training.chunked_loss=false"]),
}


def row_args(name: str, overrides: list[str], steps: int = 3) -> list[str]:
    """The training overrides of row `name` (BASE, the row's, the user's, the run's)."""
    return [*BASE, *ROWS[name].overrides, *overrides, f"--training.steps={steps}",
            "--training.stop_after_steps=0", "--job.print_config=false",
            "--checkpoint.enable=false", "--validation.enable=false",
            # step 2 (the measured one) must not be a logging step: those keep a copy of the
            # params for the update ratios
            "--metrics.log_freq=100", "--metrics.enable_tensorboard=false",
            "--metrics.progress_bar=false", "--metrics.report=false",
            "--eval.sample_freq=0", "--eval.hellaswag_freq=0"]


def refusal(name: str, args: list[str]) -> str | None:
    """Why the row cannot run here: a missing package, or the trainer's own check's words."""
    needs = ROWS[name].needs
    if needs:
        try:
            __import__(needs)
        except ImportError as e:
            return f"skipped: needs {needs} ({e})"
    from torchllm.tools.estimate_memory import check_trainer_config

    try:
        check_trainer_config(args, ROWS[name].nproc)
    except ConfigError as e:
        return f"refused: {e}"
    return None


def run_row(name: str, overrides: list[str], work_dir: Path, timeout: float) -> list[dict]:
    """One launch of row `name`: a dict per rank (or one dict with `reason`)."""
    row = ROWS[name]
    run_dir = work_dir / name
    run_dir.mkdir(parents=True, exist_ok=True)
    for old in run_dir.glob("rank*.json"):
        old.unlink()
    args = row_args(name, overrides) + [f"--job.dump_folder={work_dir}", f"--job.run_name={name}"]
    base = {"layout": name, "overrides": [*ROWS[name].overrides, *overrides],
            "world_size": row.nproc}
    why = refusal(name, args)
    if why:
        return [{**base, "reason": why}]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={row.nproc}", "-m", WORKER, str(run_dir), *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=worker_env(OMP_NUM_THREADS="1"), start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        log, _ = proc.communicate()
        (run_dir / "log.txt").write_text(log)
        return [{**base, "reason": f"timed out after {timeout:.0f} s"}]
    (run_dir / "log.txt").write_text(log)
    ranks = [json.loads(p.read_text()) for p in sorted(run_dir.glob("rank*.json"))]
    if proc.returncode != 0 or len(ranks) != row.nproc:
        why = failure_reason(log, proc.returncode)
        # the trainer's own refusal while building (e.g. muon with sharded weights)
        kind = "refused" if "config error: " in log else "failed"
        return [{**base, "reason": f"{kind}: {why}"}]
    out = []
    for r in sorted(ranks, key=lambda r: r["rank"]):
        est = r["estimate_rank"]
        out.append({**base, "rank": r["rank"], "measured_peak_bytes": r["tensor_peak_bytes"],
                    "estimate_peak_bytes": est["peak_bytes"], "peak_phase": est["peak_phase"],
                    "measured_at": r.get("tensor_peak_ops", [])})
    return out


def within(rec: dict) -> bool:
    return abs(rec["estimate_peak_bytes"] / rec["measured_peak_bytes"] - 1) <= TOLERANCE


def table(records: list[dict]) -> str:
    mib = 2 ** 20
    lines = [f"{'layout':<24}{'rank':>5}{'measured MiB':>14}{'estimate MiB':>14}{'ratio':>8}"
             "  peak phase"]
    for r in records:
        if "reason" in r:
            lines.append(f"{r['layout']:<24}{'-':>5}  {r['reason']}")
            continue
        ratio = r["estimate_peak_bytes"] / r["measured_peak_bytes"]
        row = ROWS[r["layout"]]
        note = row.note
        flag = "" if within(r) else "  OUTSIDE 10%" + (f": {note}" if note else "")
        lines.append(f"{r['layout']:<24}{r['rank']:>5}{r['measured_peak_bytes'] / mib:>14.2f}"
                     f"{r['estimate_peak_bytes'] / mib:>14.2f}{ratio:>8.3f}  {r['peak_phase']}"
                     + flag)
    return "\n".join(lines)


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(prog=COMMAND, description=__doc__, allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layouts", default=",".join(ROWS), help="rows to run (see --list)")
    p.add_argument("--list", action="store_true", help="print the rows and their overrides")
    p.add_argument("--json", default=None, help="write the per-rank records here")
    p.add_argument("--timeout", type=float, default=600, help="seconds per row")
    p.add_argument("--work_dir", default="outputs/bench_memory",
                   help="where the runs write logs and per-rank JSON")
    args, overrides = p.parse_known_args(argv)
    bad = [o for o in overrides if not (o.startswith("--") and "." in o.split("=")[0])]
    if bad:
        p.error(f"unknown option {bad[0]}; config overrides look like --section.key=value")
    args.names = [n.strip() for n in args.layouts.split(",") if n.strip()]
    unknown = [n for n in args.names if n not in ROWS]
    if unknown or not args.names:
        p.error(f"--layouts {args.layouts!r}: unknown row {unknown[0] if unknown else ''!r}; "
                f"rows: {', '.join(ROWS)} (--list)")
    return args, overrides


def main(argv: list[str] | None = None) -> int:
    args, overrides = parse_args(sys.argv[1:] if argv is None else argv)
    if args.list:
        for name, row in ROWS.items():
            print(f"{name:<24} {row.nproc} rank(s)  {' '.join(row.overrides) or '(base)'}")
        print(f"base: {' '.join(BASE)}")
        return 0
    print(f"[bench_memory] {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cores; rows: {', '.join(args.names)}", flush=True)
    records: list[dict] = []
    for name in args.names:
        got = run_row(name, overrides, Path(args.work_dir), args.timeout)
        records += got
        print(table(got).split("\n", 1)[1], flush=True)
    print(table(records))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(records, indent=1) + "\n")
    ok = all("reason" not in r and within(r) for r in records
             if not r.get("reason", "").startswith(("skipped", "refused")))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
