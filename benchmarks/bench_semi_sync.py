"""Step-synchronous replica groups vs semi-synchronous ones (DiLoCo), at equal tokens.

    python benchmarks/bench_semi_sync.py --steps 100 --sync 10 50 \\
        --json benchmarks/results/semi_sync_cpu.json [--section.key=value ...]

Each variant is one scripts/ft_local.sh run of 2 replica groups (1 CPU rank each, a lighthouse)
training the same model on the same data for --steps steps (each group its own half of every
global batch: equal tokens in every variant): step-synchronous (`semi_sync_method = "none"`,
the gradients averaged every step), then DiLoCo with each --sync value as `sync_steps`
(outer SGD, lr 0.7, Nesterov momentum 0.9), and with --fragments F, streaming DiLoCo at the
first --sync value (`num_fragments = F`: each sync sends one fragment). Measured: each group's validation loss after the
last step (the same held-out batches in every variant) and the bytes each group hands to
torchft's cross-group all-reduce: counted by the run for DiLoCo (its closing line), for
step-synchronous training the flattened gradients every step (the same count of values as one
sync: the trainable parameters and floating-point buffers) plus 4 loss statistics (float64).
Wall-clock times are printed too but depend on the machine's load. Prints a table; --json
writes the numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

VAL = re.compile(r"validation step (\d+): loss (\S+)")
SYNCS = re.compile(r"fault tolerance: (\d+) syncs \(\w+, every \d+ steps(?:, \d+ fragments)?\), "
                   r"(\d+) bytes")
DONE = re.compile(r"done: step \d+/\d+, \d+ steps in ([\d.]+)s")
STATS_BYTES = 4 * 8  # ReplicaGroups.average: loss x tokens, tokens, processed, max loss


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train_args(a, work: Path) -> list[str]:
    return ["--training.device=cpu", f"--job.dump_folder={work}", "--job.print_config=false",
            f"--training.steps={a.steps}", "--training.mixed_precision=none",
            "--data.tokenizer=bytes", "--model.dim=64", "--model.n_layers=2",
            "--model.n_heads=4", "--model.n_kv_heads=2", "--training.seq_len=64",
            "--training.local_batch_size=8", f"--lr_scheduler.warmup_steps={a.steps // 10}",
            f"--metrics.log_freq={a.steps}", "--metrics.report=false", "--eval.sample_freq=0",
            "--validation.enable", f"--validation.freq={a.steps}", "--validation.steps=8",
            "--checkpoint.enable=false", *a.overrides]


def run_variant(a, work: Path, method: str, sync_steps: int | None, fragments: int = 1) -> dict:
    logs = work / "logs"
    env = {**os.environ, "TORCHFT_LIGHTHOUSE": f"http://localhost:{free_port()}",
           "FT_LOG_DIR": str(logs)}
    extra = [] if method == "none" else [f"--fault_tolerance.semi_sync_method={method}",
                                         f"--fault_tolerance.sync_steps={sync_steps}",
                                         f"--fault_tolerance.num_fragments={fragments}"]
    start = time.monotonic()
    ran = subprocess.run([str(REPO / "scripts" / "ft_local.sh"), "2", *train_args(a, work),
                          *extra], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=a.timeout)
    wall = time.monotonic() - start
    texts = [(logs / f"replica_{r}.log").read_text(errors="replace")
             if (logs / f"replica_{r}.log").exists() else "" for r in (0, 1)]
    if ran.returncode:
        raise SystemExit(f"bench_semi_sync: {method} exited {ran.returncode}:\n"
                         f"{(ran.stdout + ran.stderr)[-2000:]}{texts[0][-2000:]}")
    val = [float(VAL.findall(t)[-1][1]) for t in texts]
    seconds = [float(DONE.search(t)[1]) for t in texts]
    return {"method": method, "sync_steps": sync_steps or 1, "fragments": fragments,
            "val_loss": val,
            "train_seconds": seconds, "wall_seconds": round(wall, 1), "texts": texts}


def with_bytes(rows: list[dict], steps: int) -> None:
    """Each row's bytes to the other groups (module doc) and syncs."""
    per_sync = None
    for row in rows:
        found = [SYNCS.search(t) for t in row.pop("texts")]
        if row["method"] != "none":
            syncs, sent = int(found[0][1]), int(found[0][2])
            row.update(syncs=syncs, bytes_sent=sent, bytes_measured=True)
            if row["fragments"] == 1:  # (a sync of every parameter)
                per_sync = sent // syncs
    for row in rows:
        if row["method"] == "none":
            row.update(syncs=steps, bytes_sent=steps * (per_sync + STATS_BYTES),
                       bytes_measured=False)


def table(rows: list[dict]) -> str:
    base = next(r for r in rows if r["method"] == "none")
    lines = ["| 2 groups, equal tokens | syncs | bytes sent per group | vs step-sync | "
             "final validation loss (group 0 / 1) | train s (group 0) |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        name = ("step-synchronous (gradients every step)" if r["method"] == "none"
                else f"DiLoCo, sync_steps {r['sync_steps']}"
                + (f", {r['fragments']} fragments" if r["fragments"] > 1 else ""))
        lines.append(
            f"| {name} | {r['syncs']} | {r['bytes_sent'] / 1e6:.1f} MB"
            f"{'' if r['bytes_measured'] else ' (computed)'} | "
            f"{r['bytes_sent'] / base['bytes_sent']:.3f} | "
            f"{r['val_loss'][0]:.4f} / {r['val_loss'][1]:.4f} | {r['train_seconds'][0]:.0f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--sync", type=int, nargs="+", default=[10, 50])
    ap.add_argument("--fragments", type=int, default=1,
                    help="F > 1: also streaming DiLoCo, F fragments, at the first --sync value")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--work_dir", type=Path)
    a, a.overrides = ap.parse_known_args(argv)
    work = a.work_dir or Path(tempfile.mkdtemp(prefix="bench-semi-sync-"))
    try:
        rows = [run_variant(a, work / "sync", "none", None)]
        rows += [run_variant(a, work / f"diloco{h}", "diloco", h) for h in a.sync]
        if a.fragments > 1:
            rows.append(run_variant(a, work / f"streaming{a.sync[0]}", "diloco", a.sync[0],
                                    a.fragments))
    finally:
        if a.work_dir is None:
            shutil.rmtree(work, ignore_errors=True)
    with_bytes(rows, a.steps)
    print(table(rows))
    if a.json:
        from torchllm.precision import cpuinfo

        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps({
            "machine": f"{cpuinfo('model name')}, {os.cpu_count()} cores, fp32",
            "load_average": os.getloadavg(),
            "args": {"steps": a.steps, "sync": a.sync, "fragments": a.fragments,
                     "overrides": a.overrides},
            "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
