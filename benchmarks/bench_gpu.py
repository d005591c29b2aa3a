"""Single-GPU throughput of the Trainer: tokens/s, MFU, peak memory vs the estimator, loss.

    python benchmarks/bench_gpu.py [--config train_configs/llama3_1b.toml] [--seq_len 2048]
        [--local_batch_size 4 | --batches 4,8,16] [--variants bf16_compile,bf16_compile_float8]
        [--peer transformers] [--rounds 2] [--ac auto]
        [--steps 15] [--warmup 5] [--timeout 240] [--tokenizer PATH] [--out_dir benchmarks/results]
        [--section.key=value ...]          (overrides applied to every variant)

`--peer transformers` adds a plain `transformers.LlamaForCausalLM` loop on the same shape (the
config's model: dims, heads, SwiGLU width, RoPE, vocab; random tokens; fp32 master weights, bf16
autocast, SDPA, each decoder layer compiled, float32 cross entropy, clip 1.0, fused AdamW on
CUDA; `--peer_precision` / `--peer_compile` change that, e.g. fp32 and none for a CPU smoke
run) in its own process per round, alternating with torchllm's variants (even rounds torchllm
first, odd rounds the peer first). Each variant's row gets the ratio torchllm / peer tokens/s:
the geometric mean of the rounds' ratios and its 95% interval (bench_throughput.paired_ratio).

Each variant is one process running `benchlib.worker` (the Trainer's own loop, observed:
see benchmarks/benchlib/worker.py) for warmup + steps steps on one device (the variants' table:
benchlib/gpu_variants.py; the peer's loop: benchlib/gpu_peer.py). Offline: the data is the
embedded corpus (CPython's docs) and the tokenizer is trained on it unless --tokenizer names a
file (e.g. the Llama 3 tokenizer.model); the model keeps the config's vocab (128,256 padded to
2^17 for the 1B), so the matmul shapes are the real ones either way.
`--ac auto` picks, per variant, the least activation checkpointing whose estimated peak
(torchllm.tools.estimate_memory) fits in 90% of the device's memory: none, selective (op), full.

Writes `<out_dir>/gpu_<device>_<date>.json` and the markdown table beside it (`.md`):
tokens/s/GPU, MFU against the data-sheet bf16 peak (torchllm.metrics.flops), measured peak
(`max_memory_allocated`) against the estimate, first and last loss. Exit code 1 if a variant
failed (its row says why).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import statistics
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]  # this checkout's torchllm; benchlib

from bench_throughput import paired_ratio  # noqa: E402  (the CPU peer's ratio and interval)
from benchlib import WORKER, worker_env  # noqa: E402
from benchlib.gpu_peer import peer_worker  # noqa: E402
from benchlib.gpu_variants import (CPU_VARIANTS, CUDA_ONLY, VARIANT_AC,  # noqa: E402
                                   VARIANT_ACCUM, VARIANT_SEQ, VARIANTS)
from benchlib.report import failure_reason, summarize  # noqa: E402
from torchllm import models  # noqa: E402
from torchllm.config import load_config  # noqa: E402
from torchllm.tools.estimate_memory import estimate_memory  # noqa: E402
from torchllm.tools.model_info import tokenizer_vocab_hint  # noqa: E402

GiB = 1024**3
AC_CHOICES = ("auto", "none", "selective", "full")
PEERS = ("transformers",)


def device_slug(device: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'h100_80gb_hbm3'; CPU -> 'cpu'."""
    if device != "cuda":
        return "cpu"
    name = torch.cuda.get_device_name(0).lower().replace("nvidia", "")
    return re.sub(r"[^a-z0-9]+", "_", name).strip("_")


def pick_ac(config_args: list[str], requested: str, total: int | None) -> tuple[str, dict]:
    """The AC mode to run and its estimate (auto: the least AC whose estimated peak fits in
    90% of `total` device bytes; None = no limit known)."""
    modes = ["none", "selective", "full"] if requested == "auto" else [requested]
    for mode in modes:
        cfg = load_config([*config_args, f"--activation_checkpoint.mode={mode}",
                           "--activation_checkpoint.selective_option=op"])
        args = models.model_args(cfg.model, cfg.training, cfg.data,
                                 tokenizer_vocab_hint(cfg.data))
        est = estimate_memory(cfg, args, 1)
        if total is None or est["peak_bytes"] <= 0.9 * total or mode == modes[-1]:
            return mode, est
    raise AssertionError("unreachable")


def base_args(args, overrides: list[str], work: Path, batch: int, seq: int) -> list[str]:
    return ["--job.config_file", args.config, f"--training.device={args.device}",
            f"--training.seq_len={seq}", f"--training.local_batch_size={batch}",
            "--training.global_batch_size=-1", f"--training.steps={args.warmup + args.steps}",
            "--data.dataset=embedded", f"--data.tokenizer={args.tokenizer}",
            "--data.num_workers=0", "--lr_scheduler.warmup_steps=2",
            f"--job.dump_folder={work}", "--job.run_name=runs", "--job.print_config=false",
            "--checkpoint.enable=false", "--metrics.enable_tensorboard=false",
            "--metrics.progress_bar=false", f"--metrics.log_freq={args.warmup + args.steps}",
            "--validation.enable=false", *overrides]


def run_logged(cmd: list[str], run_dir: Path, timeout: float) -> tuple[int | None, str]:
    """Run `cmd` in its own session, its output to run_dir/log.txt; (exit code or None on
    timeout, log)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=worker_env(WORLD_SIZE="1"), start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=timeout)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        proc.kill()
        log, _ = proc.communicate()
        code = None
    (run_dir / "log.txt").write_text(log)
    return code, log


def run_variant(name: str, args, base: list[str], work: Path) -> dict:
    config_args = [*base, *VARIANTS[name]]
    if name in VARIANT_ACCUM:  # micro-steps per optimizer step
        batch = int(next(a for a in base if a.startswith("--training.local_batch_size="))
                    .split("=")[1])
        config_args.append(f"--training.global_batch_size={batch * VARIANT_ACCUM[name]}")
    total = torch.cuda.get_device_properties(0).total_memory if args.device == "cuda" else None
    ac, est = pick_ac(config_args, VARIANT_AC.get(name, args.ac), total)
    row = {"variant": name, "ac": ac, "estimate_peak_bytes": est["peak_bytes"]}
    run_dir = work / name
    run_dir.mkdir(parents=True, exist_ok=True)
    for old in run_dir.glob("rank*.json"):
        old.unlink()
    cmd = [sys.executable, "-m", WORKER, str(run_dir), *config_args,
           f"--activation_checkpoint.mode={ac}", "--activation_checkpoint.selective_option=op"]
    print(f"[bench_gpu] {name} (AC {ac}): {' '.join(cmd[3:])}", flush=True)
    code, log = run_logged(cmd, run_dir, args.timeout)
    if code is None:
        return {**row, "status": "failed", "reason": f"timed out after {args.timeout:.0f} s"}
    ranks = [json.loads(p.read_text()) for p in run_dir.glob("rank*.json")]
    if code != 0 or not ranks:
        return {**row, "status": "failed", "reason": failure_reason(log, code)}
    res = summarize(ranks, args.warmup)
    peak = res.get("measured_peak_bytes")
    # The run's own estimate: its model args come from the real tokenizer (pick_ac's may not).
    est = res["estimate"]
    row["estimate_peak_bytes"] = est["peak_bytes"]
    return {
        **row, "status": "ok", "tokens_per_s_gpu": res["tokens_per_s_device"],
        "mfu_pct": res.get("mfu_pct"), "tflops": res["tflops"],
        "step_time_median_s": res["step_time_median_s"],
        "peak_bytes": peak, "peak_over_estimate": peak / est["peak_bytes"] if peak else None,
        "first_loss": ranks[0]["losses"][0], "last_loss": ranks[0]["losses"][-1],
        "losses": ranks[0]["losses"], "peak_flops": ranks[0]["peak_flops"],
        "flops_per_token": res["flops_per_token"], "params": res["params"],
    }


def run_peer(args, base: list[str], work: Path) -> dict:
    run_dir = work / "peer_transformers"
    run_dir.mkdir(parents=True, exist_ok=True)
    out = run_dir / "result.json"
    out.unlink(missing_ok=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--peer_worker", str(out),
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--peer_precision",
           args.peer_precision, "--peer_compile", args.peer_compile, *base]
    print(f"[bench_gpu] peer transformers ({args.peer_precision}, compile "
          f"{args.peer_compile})", flush=True)
    code, log = run_logged(cmd, run_dir, args.timeout)
    row = {"variant": f"peer_{args.peer}", "ac": "none", "estimate_peak_bytes": None}
    if code is None:
        return {**row, "status": "failed", "reason": f"timed out after {args.timeout:.0f} s"}
    if code != 0 or not out.exists():
        return {**row, "status": "failed", "reason": failure_reason(log, code)}
    res = json.loads(out.read_text())
    return {**row, "status": "ok", "tokens_per_s_gpu": res["tokens_per_s"],
            "step_time_median_s": res["step_time_median_s"], "peak_bytes": res["peak_bytes"],
            "peak_over_estimate": None, "first_loss": res["losses"][0],
            "last_loss": res["losses"][-1], "losses": res["losses"], "vocab": res["vocab"]}


def merge_rounds(rounds: list[dict]) -> dict:
    """One row from a variant's rounds: the last ok round's numbers, tokens/s the median of
    the ok rounds' (each listed), failed if any round failed."""
    failed = [r for r in rounds if r["status"] != "ok"]
    if failed:
        return failed[0]
    row = dict(rounds[-1])
    row["round_tokens_per_s"] = [r["tokens_per_s_gpu"] for r in rounds]
    row["tokens_per_s_gpu"] = statistics.median(row["round_tokens_per_s"])
    if row.get("flops_per_token") and row.get("peak_flops"):
        row["mfu_pct"] = 100 * row["tokens_per_s_gpu"] * row["flops_per_token"] / row["peak_flops"]
    return row


def run_shape(args, names: list[str], overrides: list[str], work: Path, batch: int,
              seq: int) -> list[dict]:
    """The variants at (batch, seq) and the peer, `args.rounds` times, who goes first
    alternating; each variant's row carries its ratio to the peer of the same round."""
    base = base_args(args, overrides, work, batch, seq)
    runs = {n: [] for n in names + (["peer"] if args.peer else [])}
    for r in range(args.rounds):
        order = list(runs) if r % 2 == 0 else list(runs)[::-1]
        for name in order:
            res = run_peer(args, base, work) if name == "peer" else run_variant(name, args, base,
                                                                                 work)
            runs[name].append({**res, "batch": batch, "seq_len": seq})
    rows = {n: merge_rounds(rs) for n, rs in runs.items()}
    if args.peer and rows["peer"]["status"] == "ok":
        peer_runs = runs["peer"]
        for name in names:
            if rows[name]["status"] != "ok":
                continue
            ratios = [ours["tokens_per_s_gpu"] / peer["tokens_per_s_gpu"]
                      for ours, peer in zip(runs[name], peer_runs)]
            rows[name]["round_ratios"] = ratios
            rows[name]["ratio_to_peer"], rows[name]["ratio_to_peer_ci95"] = paired_ratio(ratios)
        ours = next((rows[n] for n in names if rows[n]["status"] == "ok"), None)
        if ours and ours.get("peak_flops"):  # the same model: torchllm's FLOPs per token
            rows["peer"]["mfu_pct"] = (100 * rows["peer"]["tokens_per_s_gpu"]
                                       * ours["flops_per_token"] / ours["peak_flops"])
    return list(rows.values())


def markdown(result: dict) -> str:
    head = (f"Single-device throughput, {result['device_name']}, torch {result['torch']}, "
            f"{result['config']} at seq {result['seq_len']} x local batch "
            f"{','.join(map(str, result['batches']))}, {result['steps']} timed steps after "
            f"{result['warmup']} warm-up, {result['rounds']} round(s). MFU against "
            f"{result['peak_note']}.")
    if result.get("peer"):
        head += (f" Peer: {result['peer_note']}; / peer = torchllm / peer tokens/s, geometric "
                 "mean of the rounds' ratios (95% interval).")
    lines = ["| variant | batch | seq | AC | tok/s/GPU | MFU % | step ms | peak GiB | est GiB "
             "| peak/est | first loss | last loss | / peer |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lead = f"| {r['variant']} | {r['batch']} | {r['seq_len']} | {r['ac']} |"
        if r["status"] != "ok":
            lines.append(f"{lead} failed: {r['reason']} | | | | | | | | |")
            continue
        mfu = f"{r['mfu_pct']:.1f}" if r.get("mfu_pct") is not None else "-"
        peak = f"{r['peak_bytes'] / GiB:.2f}" if r["peak_bytes"] else "-"
        est = f"{r['estimate_peak_bytes'] / GiB:.2f}" if r["estimate_peak_bytes"] else "-"
        ratio = f"{r['peak_over_estimate']:.2f}" if r["peak_over_estimate"] else "-"
        vs = "-"
        if r.get("ratio_to_peer") is not None:
            ci = r["ratio_to_peer_ci95"]
            vs = f"{r['ratio_to_peer']:.3f}" + (f" ({ci[0]:.3f}-{ci[1]:.3f})" if ci else "")
        lines.append(f"{lead} {r['tokens_per_s_gpu']:,.0f} | {mfu} | "
                     f"{1000 * r['step_time_median_s']:.1f} | {peak} | {est} | {ratio} | "
                     f"{r['first_loss']:.3f} | {r['last_loss']:.3f} | {vs} |")
    return head + "\n\n" + "\n".join(lines) + "\n"


def parse_args(argv: list[str]):
    p = argparse.ArgumentParser(description=__doc__, allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(REPO / "train_configs/llama3_1b.toml"))
    p.add_argument("--seq_len", type=int, default=2048)
    p.add_argument("--local_batch_size", type=int, default=4)
    p.add_argument("--batches", default=None,
                   help="comma-separated local batch sizes (replaces --local_batch_size)")
    p.add_argument("--variants", default="bf16_compile,bf16_compile_float8",
                   help=f"comma-separated: {', '.join(VARIANTS)}")
    p.add_argument("--peer", default=None, choices=PEERS,
                   help="also run this plain training loop on the same shape")
    p.add_argument("--peer_precision", default="bf16", choices=("bf16", "fp32"))
    p.add_argument("--peer_compile", default=None, choices=("inductor", "aot_eager", "none"),
                   help="torch.compile backend of the peer's layers (default: inductor on "
                   "CUDA, none on CPU)")
    p.add_argument("--rounds", type=int, default=None,
                   help="runs of each variant (and the peer), alternating who goes first "
                   "(default: 2 with --peer, else 1)")
    p.add_argument("--ac", default="auto", choices=AC_CHOICES)
    p.add_argument("--steps", type=int, default=15, help="timed steps")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first (compilation)")
    p.add_argument("--timeout", type=float, default=240, help="seconds per variant")
    p.add_argument("--tokenizer", default="auto", help="tokenizer file; auto = train one")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   choices=("cuda", "cpu"))
    p.add_argument("--out_dir", default=str(REPO / "benchmarks/results"))
    p.add_argument("--work_dir", default=None, help="logs (default: <out_dir>/bench_gpu_work)")
    p.add_argument("--peer_worker", default=None, help=argparse.SUPPRESS)  # internal
    args, overrides = p.parse_known_args(argv)
    if args.peer_worker:  # the peer's own process: its config is in the overrides
        args.peer_compile = args.peer_compile or "none"
        return args, [], overrides
    names = [v for v in args.variants.split(",") if v]
    bad = [v for v in names if v not in VARIANTS]
    if bad or not names:
        p.error(f"--variants {args.variants!r}: use a comma-separated list of "
                f"{', '.join(VARIANTS)}")
    try:
        args.batch_list = [int(b) for b in (args.batches or str(args.local_batch_size))
                           .split(",") if b]
    except ValueError:
        args.batch_list = []
    if not args.batch_list or min(args.batch_list) < 1:
        p.error(f"--batches {args.batches!r}: use comma-separated positive integers, e.g. 4,8,16")
    if args.warmup < 2 or args.steps < 1:
        p.error("--warmup must be >= 2 (the worker profiles steps 1-2) and --steps >= 1")
    args.rounds = args.rounds or (2 if args.peer else 1)
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    args.peer_compile = args.peer_compile or ("inductor" if args.device == "cuda" else "none")
    if args.device == "cpu":  # one line, naming what works instead
        cuda_only = [f"--variants {v} ({CUDA_ONLY[v]})" for v in names if v in CUDA_ONLY]
        cuda_only += [f"{o} (CUDA graphs)" for o in overrides if "cudagraphs" in o]
        cuda_only += [f"{o} (float8 matmuls)" for o in overrides
                      if o.startswith("--float8.enable") and not o.endswith("=false")]
        if cuda_only:
            p.exit(2, f"bench_gpu.py: {', '.join(cuda_only)} needs CUDA; on CPU use --variants "
                      f"{','.join(CPU_VARIANTS)} (compile backends inductor, aot_eager, eager)\n")
    return args, names, overrides


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args, names, overrides = parse_args(argv)
    if args.peer_worker:
        peer_worker(args.peer_worker, overrides, args.steps, args.warmup, args.peer_precision,
                    args.peer_compile)
        return 0
    out_dir = Path(args.out_dir)
    work = Path(args.work_dir or out_dir / "bench_gpu_work")
    rows = []
    for batch in args.batch_list:
        for seq in dict.fromkeys(VARIANT_SEQ.get(n, args.seq_len) for n in names):
            same = [n for n in names if VARIANT_SEQ.get(n, args.seq_len) == seq]
            rows += run_shape(args, same, overrides, work, batch, seq)
    ok = [r for r in rows if r["status"] == "ok" and r.get("peak_flops")]
    dev_name = torch.cuda.get_device_name(0) if args.device == "cuda" else platform.processor()
    result = {
        "command": "python benchmarks/bench_gpu.py " + " ".join(argv),
        "device_name": dev_name or "cpu", "torch": torch.__version__,
        "config": os.path.relpath(args.config, REPO), "seq_len": args.seq_len,
        "local_batch_size": args.batch_list[0], "batches": args.batch_list,
        "steps": args.steps, "warmup": args.warmup, "rounds": args.rounds,
        "overrides": overrides, "peer": args.peer,
        "peak_note": (f"{ok[0]['peak_flops'] / 1e12:.3g} TFLOP/s" if ok and ok[0]["peak_flops"]
                      else "no known peak"),
        "rows": rows,
    }
    if args.peer:
        result["peer_note"] = (f"transformers {transformers_version()} LlamaForCausalLM, "
                               f"{args.peer_precision}, compile {args.peer_compile}")
    if args.device == "cuda":
        result["peak_note"] += " (data-sheet dense bf16)"
    else:
        result["peak_note"] += " (this CPU's measured fp32 matmul rate)"
    stem = f"gpu_{device_slug(args.device)}_{datetime.date.today().isoformat()}"
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / f"{stem}.json"
    json_path.write_text(json.dumps(result, indent=1) + "\n")
    json_path.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))
    print(f"[bench_gpu] wrote {json_path} and {json_path.with_suffix('.md')}")
    return 0 if all(r["status"] == "ok" for r in rows) else 1


def transformers_version() -> str:
    try:
        import transformers
    except ImportError:
        return "(not installed)"
    return transformers.__version__


if __name__ == "__main__":
    sys.exit(main())
