"""The parallel benchmark: a matrix of parallelism / AC / compile / float8 variants, each a real
multi-process training run of the Trainer, reported as throughput, step times, memory (measured
and estimated), MFU and the final loss; prints a table, writes JSON and a markdown table.

    python benchmarks/bench_parallel.py --config train_configs/debug_model.toml \\
        --matrix ddp,fsdp2 [--ac none,full,selective] [--compile off,on] \\
        [--float8 off,tensorwise] --steps 10 --warmup 3 --json benchmarks/results/X.json \\
        [--nproc 2] [--timeout 600] \\
        [--section.key=value ...]          (config overrides applied to every variant)

Each variant (the product of the lists) is checked like run_train.sh checks a config, then is
one `torchrun` launch of `benchlib.worker` (benchmarks/benchlib/worker.py; each rank `python -u -m
benchlib.worker`, on CPU as on GPU, as ./run_train.sh starts its workers) with warmup + steps
training steps; the warm-up steps (compilation, optimizer-state creation, and on CPU the two
memory-profiled steps) are not timed. A variant that cannot run (a layout the world size does
not allow, a config error, OOM, a crash, a timeout) becomes a row with the reason; the others
still run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]  # this checkout's torchllm; benchlib

from benchlib import WORKER, worker_env  # noqa: E402
from benchlib.report import (console_table, failure_reason, render_markdown,  # noqa: E402
                             summarize)
from benchlib.variants import (AC_MODES, COMPILE, FLOAT8, LAYOUTS, Variant,  # noqa: E402
                               build_matrix, parse_list)
from benchlib.rounds import MIN_ROUNDS, combine, load_average, sitting_peak  # noqa: E402
from benchlib.worker import PROFILED_STEPS  # noqa: E402
from torchllm.config import ConfigError  # noqa: E402
from torchllm.precision import cpuinfo  # noqa: E402
from torchllm.run.launch import check_config  # noqa: E402

COMMAND = "python benchmarks/bench_parallel.py"


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(prog=COMMAND, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="TOML training config")
    p.add_argument("--matrix", default="ddp,fsdp2", help=f"layouts: {', '.join(LAYOUTS)}")
    p.add_argument("--ac", default="none", help=f"activation checkpointing: {', '.join(AC_MODES)}")
    p.add_argument("--compile", default="off", help=f"torch.compile: {', '.join(COMPILE)}")
    p.add_argument("--float8", default="off", help=f"float8 recipe: {', '.join(FLOAT8)}")
    p.add_argument("--steps", type=int, default=10, help="timed steps per variant")
    p.add_argument("--warmup", type=int, default=3,
                   help=f"untimed steps first (>= {PROFILED_STEPS}: the memory-profiled ones)")
    p.add_argument("--json", required=True, help="output JSON; the markdown goes beside it (.md)")
    p.add_argument("--nproc", type=int, default=torch.cuda.device_count() or 2,
                   help="ranks per variant (default: the GPU count, else 2 CPU ranks)")
    p.add_argument("--repeats", type=int, default=MIN_ROUNDS,
                   help=f"rounds of the whole matrix, interleaved (default {MIN_ROUNDS}): each "
                        "row is the median round, with the spread and the load")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per variant")
    p.add_argument("--work_dir", default=None,
                   help="where the runs write logs and per-rank JSON "
                        "(default: outputs/bench/<json file stem>)")
    args, overrides = p.parse_known_args(argv)
    bad = [o for o in overrides if o.startswith("--") and "." not in o.split("=")[0]]
    if bad:
        p.error(f"unknown option {bad[0]}; config overrides look like --section.key=value")
    if not Path(args.config).is_file():
        p.error(f"--config {args.config}: no such file")
    if args.repeats < 1:
        p.error(f"--repeats must be >= 1 (at least {MIN_ROUNDS} for figures to publish)")
    if args.steps < 1 or args.warmup < PROFILED_STEPS:
        p.error(f"--steps must be >= 1 and --warmup >= {PROFILED_STEPS}")
    try:
        args.variants = build_matrix(
            parse_list("--matrix", args.matrix, LAYOUTS), parse_list("--ac", args.ac, AC_MODES),
            parse_list("--compile", args.compile, COMPILE),
            parse_list("--float8", args.float8, FLOAT8))
    except ValueError as e:
        p.error(str(e))
    return args, overrides


def run_variant(variant: Variant, args, overrides: list[str], out_dir: Path) -> dict:
    row = {"variant": variant.name, "layout": variant.layout, "ac": variant.ac,
           "compile": variant.compile, "float8": variant.float8}
    reason = variant.unsupported(args.nproc)
    if reason:
        return {**row, "status": "unsupported", "reason": reason}
    run_dir = out_dir / variant.name
    run_dir.mkdir(parents=True, exist_ok=True)
    for old in run_dir.glob("rank*.json"):
        old.unlink()
    config_args = [
        "--job.config_file", args.config, *overrides, *variant.overrides(args.nproc),
        f"--training.steps={args.warmup + args.steps}", "--training.stop_after_steps=0",
        f"--job.dump_folder={out_dir}", "--job.run_name=runs",  # one tokenizer cache for all
        "--job.print_config=false", "--checkpoint.enable=false",
        f"--metrics.log_freq={args.warmup + args.steps}", "--metrics.enable_tensorboard=false",
        "--metrics.progress_bar=false", "--metrics.report=false",
        # no in-training samples or HellaSwag: not what is timed, and pipeline stages lack them
        "--eval.sample_freq=0", "--eval.hellaswag_freq=0",
    ]
    try:  # what run_train.sh checks before it starts processes: a bad variant costs no launch
        check_config(config_args, args.nproc)
    except ConfigError as e:
        return {**row, "status": "failed", "reason": str(e)[:300]}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={args.nproc}", "-m", WORKER, str(run_dir), *config_args]
    load = load_average()
    print(f"[bench] {variant.name}: {' '.join(cmd[1:])}", flush=True)
    log_path = run_dir / "log.txt"
    # Its own session, so that a timeout stops torchrun's workers too, not only torchrun.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=worker_env(), start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=args.timeout)
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        log, _ = proc.communicate()
        log_path.write_text(log)
        return {**row, "status": "failed", "reason": f"timed out after {args.timeout:.0f} s",
                "log": str(log_path)}
    log_path.write_text(log)
    ranks = [json.loads(p.read_text()) for p in sorted(run_dir.glob("rank*.json"))]
    if rc != 0 or len(ranks) != args.nproc:
        return {**row, "status": "failed", "reason": failure_reason(log, rc), "log": str(log_path)}
    r0 = min(ranks, key=lambda r: r["rank"])
    return {**row, **summarize(ranks, args.warmup), "load": load,
            "dtype": r0.get("dtype"), "threads": r0.get("threads")}


def sitting_peaks(rows: list[list[dict]]) -> dict[tuple[str, int], float]:
    """{(dtype, threads): FLOP/s} for the CPU rows' dtypes and thread counts, measured now."""
    wanted = {(r["dtype"], r["threads"]) for runs in rows for r in runs
              if r["status"] == "ok" and r.get("device") == "cpu" and r.get("dtype")}
    return {(d, t): sitting_peak(getattr(torch, d), t)["flops"] for d, t in sorted(wanted)}


def main(argv: list[str] | None = None) -> int:
    args, overrides = parse_args(sys.argv[1:] if argv is None else argv)
    json_path = Path(args.json)
    out_dir = Path(args.work_dir or Path("outputs") / "bench" / json_path.stem)
    # Rounds interleaved (a, b, a, b, ...): a burst of load hits every variant, not one. The
    # CPU peak MFU divides by is measured in this sitting, right after the rounds.
    before = {"load": load_average()}
    runs: list[list[dict]] = [[] for _ in args.variants]
    for _ in range(args.repeats):
        for i, v in enumerate(args.variants):
            runs[i].append(run_variant(v, args, overrides, out_dir))
    peaks = sitting_peaks(runs)
    rows = [combine(r, peaks) for r in runs]
    result = {
        "command": f"{COMMAND} " + " ".join(sys.argv[1:] if argv is None else argv),
        "config": args.config, "overrides": overrides, "nproc": args.nproc,
        "steps": args.steps, "warmup": args.warmup, "repeats": args.repeats,
        "host": {"machine": platform.machine(), "processor": platform.processor(),
                 "cpu_model": cpuinfo("model name"), "cpu_count": os.cpu_count(),
                 "torch": torch.__version__,
                 "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
                 "load_before": before["load"], "load_after": load_average(),
                 "cpu_peak_flops": {f"{d}/{t} threads": f for (d, t), f in peaks.items()}},
        "rows": rows,
    }
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(result, indent=1) + "\n")
    json_path.with_suffix(".md").write_text(render_markdown(rows))
    print(console_table(rows))
    print(f"[bench] wrote {json_path} and {json_path.with_suffix('.md')}")
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
