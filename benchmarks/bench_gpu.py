"""Single-GPU throughput of the Trainer: tokens/s, MFU, peak memory vs the estimator, loss.

    python benchmarks/bench_gpu.py [--config train_configs/llama3_1b.toml] [--seq_len 2048]
        [--local_batch_size 4] [--variants bf16_compile,bf16_compile_float8] [--ac auto]
        [--steps 15] [--warmup 5] [--timeout 240] [--tokenizer PATH] [--out_dir benchmarks/results]
        [--section.key=value ...]          (overrides applied to every variant)

Each variant is one process running `torchllm.bench.worker` (the Trainer's own loop, observed:
see torchllm/bench/worker.py) for warmup + steps steps on one device. Offline: the data is the
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
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from torchllm import models  # noqa: E402
from torchllm.bench.__main__ import failure_reason  # noqa: E402
from torchllm.bench.report import summarize  # noqa: E402
from torchllm.config import load_config  # noqa: E402
from torchllm.tools.estimate_memory import estimate_memory  # noqa: E402
from torchllm.tools.model_info import tokenizer_vocab_hint  # noqa: E402

GiB = 1024**3
VARIANTS = {
    "bf16_compile": ["--training.mixed_precision=bf16", "--compile.enable=true",
                     "--float8.enable=false"],
    "bf16_compile_float8": ["--training.mixed_precision=bf16", "--compile.enable=true",
                            "--float8.enable=true", "--float8.recipe=tensorwise"],
    "bf16": ["--training.mixed_precision=bf16", "--compile.enable=false", "--float8.enable=false"],
    "fp32": ["--training.mixed_precision=none", "--compile.enable=false", "--float8.enable=false"],
}
AC_CHOICES = ("auto", "none", "selective", "full")


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
        est = estimate_memory(cfg, models.model_args(cfg, tokenizer_vocab_hint(cfg)), 1)
        if total is None or est["peak_bytes"] <= 0.9 * total or mode == modes[-1]:
            return mode, est
    raise AssertionError("unreachable")


def run_variant(name: str, args, base: list[str], work: Path) -> dict:
    config_args = [*base, *VARIANTS[name]]
    total = torch.cuda.get_device_properties(0).total_memory if args.device == "cuda" else None
    ac, est = pick_ac(config_args, args.ac, total)
    row = {"variant": name, "ac": ac, "estimate_peak_bytes": est["peak_bytes"]}
    run_dir = work / name
    run_dir.mkdir(parents=True, exist_ok=True)
    for old in run_dir.glob("rank*.json"):
        old.unlink()
    cmd = [sys.executable, "-m", "torchllm.bench.worker", str(run_dir), *config_args,
           f"--activation_checkpoint.mode={ac}", "--activation_checkpoint.selective_option=op"]
    print(f"[bench_gpu] {name} (AC {ac}): {' '.join(cmd[3:])}", flush=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]), "WORLD_SIZE": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        log, _ = proc.communicate()
        (run_dir / "log.txt").write_text(log)
        return {**row, "status": "failed", "reason": f"timed out after {args.timeout:.0f} s"}
    (run_dir / "log.txt").write_text(log)
    ranks = [json.loads(p.read_text()) for p in run_dir.glob("rank*.json")]
    if proc.returncode != 0 or not ranks:
        return {**row, "status": "failed", "reason": failure_reason(log, proc.returncode)}
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


def markdown(result: dict) -> str:
    head = (f"Single-device throughput, {result['device_name']}, torch {result['torch']}, "
            f"{result['config']} at seq {result['seq_len']} x local batch "
            f"{result['local_batch_size']}, {result['steps']} timed steps after "
            f"{result['warmup']} warm-up. MFU against {result['peak_note']}.\n\n")
    lines = ["| variant | AC | tok/s/GPU | MFU % | step ms | peak GiB | est GiB | peak/est "
             "| first loss | last loss |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        if r["status"] != "ok":
            lines.append(f"| {r['variant']} | {r['ac']} | failed: {r['reason']} "
                         "| | | | | | | |")
            continue
        mfu = f"{r['mfu_pct']:.1f}" if r["mfu_pct"] is not None else "-"
        peak = f"{r['peak_bytes'] / GiB:.2f}" if r["peak_bytes"] else "-"
        ratio = f"{r['peak_over_estimate']:.2f}" if r["peak_over_estimate"] else "-"
        lines.append(f"| {r['variant']} | {r['ac']} | {r['tokens_per_s_gpu']:,.0f} | {mfu} | "
                     f"{1000 * r['step_time_median_s']:.1f} | {peak} | "
                     f"{r['estimate_peak_bytes'] / GiB:.2f} | {ratio} | {r['first_loss']:.3f} | "
                     f"{r['last_loss']:.3f} |")
    return head + "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(REPO / "train_configs/llama3_1b.toml"))
    p.add_argument("--seq_len", type=int, default=2048)
    p.add_argument("--local_batch_size", type=int, default=4)
    p.add_argument("--variants", default="bf16_compile,bf16_compile_float8",
                   help=f"comma-separated: {', '.join(VARIANTS)}")
    p.add_argument("--ac", default="auto", choices=AC_CHOICES)
    p.add_argument("--steps", type=int, default=15, help="timed steps")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first (compilation)")
    p.add_argument("--timeout", type=float, default=240, help="seconds per variant")
    p.add_argument("--tokenizer", default="auto", help="tokenizer file; auto = train one")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   choices=("cuda", "cpu"))
    p.add_argument("--out_dir", default=str(REPO / "benchmarks/results"))
    p.add_argument("--work_dir", default=None, help="logs (default: <out_dir>/bench_gpu_work)")
    args, overrides = p.parse_known_args(sys.argv[1:] if argv is None else argv)
    names = [v for v in args.variants.split(",") if v]
    bad = [v for v in names if v not in VARIANTS]
    if bad or not names:
        p.error(f"--variants {args.variants!r}: use a comma-separated list of "
                f"{', '.join(VARIANTS)}")
    if args.warmup < 2 or args.steps < 1:
        p.error("--warmup must be >= 2 (the worker profiles steps 1-2) and --steps >= 1")
    out_dir = Path(args.out_dir)
    work = Path(args.work_dir or out_dir / "bench_gpu_work")
    base = ["--job.config_file", args.config, f"--training.device={args.device}",
            f"--training.seq_len={args.seq_len}",
            f"--training.local_batch_size={args.local_batch_size}",
            "--training.global_batch_size=-1", f"--training.steps={args.warmup + args.steps}",
            "--data.dataset=embedded", f"--data.tokenizer={args.tokenizer}",
            "--data.num_workers=0", "--lr_scheduler.warmup_steps=2",
            f"--job.dump_folder={work}", "--job.run_name=runs", "--job.print_config=false",
            "--checkpoint.enable=false", "--metrics.enable_tensorboard=false",
            "--metrics.progress_bar=false", f"--metrics.log_freq={args.warmup + args.steps}",
            "--validation.enable=false", *overrides]
    rows = [run_variant(n, args, base, work) for n in names]
    ok = [r for r in rows if r["status"] == "ok"]
    dev_name = torch.cuda.get_device_name(0) if args.device == "cuda" else platform.processor()
    result = {
        "command": "python benchmarks/bench_gpu.py " + " ".join(
            sys.argv[1:] if argv is None else argv),
        "device_name": dev_name or "cpu", "torch": torch.__version__,
        "config": os.path.relpath(args.config, REPO), "seq_len": args.seq_len,
        "local_batch_size": args.local_batch_size, "steps": args.steps, "warmup": args.warmup,
        "overrides": overrides,
        "peak_note": (f"{ok[0]['peak_flops'] / 1e12:.3g} TFLOP/s" if ok and ok[0]["peak_flops"]
                      else "no known peak"),
        "rows": rows,
    }
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
    return 0 if len(ok) == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
