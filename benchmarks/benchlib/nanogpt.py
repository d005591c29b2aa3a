"""nanoGPT's own code as a contender of bench_time_to_loss.py: a scratch copy of a checkout's
files, prepared by its own prepare.py and run with its README's CPU command line, each
validation line timed as it arrives (run_streaming, which the other contenders share)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path


NANOGPT_VAL = re.compile(r"^step (\d+): train loss [0-9.]+, val loss ([0-9.]+)")

NANOGPT_FILES = ("train.py", "model.py", "configurator.py", "config/train_shakespeare_char.py",
                 "data/shakespeare_char/prepare.py")


def run_streaming(name: str, cmd: list[str], env: dict, cwd: Path, parse) -> dict:
    """Run `cmd`, timing each validation line (parse(line) -> (step, loss) or None) from the
    launch to the moment the line arrives; returns the wall time and [(seconds, step, loss)]."""
    start = time.time()
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, bufsize=1)
    curve, tail = [], []
    for line in proc.stdout:
        found = parse(line)
        if found is not None:
            curve.append((time.time() - start, *found))
        tail = (tail + [line])[-60:]
    rc = proc.wait()
    end = time.time()
    if rc != 0:
        raise SystemExit(f"{name}: {' '.join(cmd[:3])} ... exited {rc}:\n{''.join(tail)}")
    return {"wall": end - start, "curve": curve}


def nanogpt_line(line: str):
    m = NANOGPT_VAL.match(line.strip())
    return (int(m.group(1)), float(m.group(2))) if m else None


def nanogpt_missing(checkout: Path | None) -> str | None:
    """Why the nanogpt contender cannot run (None when it can)."""
    if checkout is None:
        return "no --nanogpt DIR given (a checkout of github.com/karpathy/nanoGPT)"
    missing = [f for f in NANOGPT_FILES if not (checkout / f).is_file()]
    if missing:
        return f"--nanogpt {checkout} lacks {', '.join(missing)}"
    return None


def prepare_nanogpt(checkout: Path, text: Path, work: Path) -> Path:
    """A scratch copy of nanoGPT's files with `text` as its input.txt, prepared by its own
    prepare.py (train.bin, val.bin, meta.pkl): the folder to run train.py in."""
    for f in NANOGPT_FILES:
        (work / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(checkout / f, work / f)
    data = work / "data" / "shakespeare_char"
    shutil.copyfile(text, data / "input.txt")  # present: prepare.py does not download
    subprocess.run([sys.executable, "prepare.py"], cwd=data, check=True, capture_output=True)
    return work


def nanogpt_args(r: dict, out_dir: Path, full_steps: int) -> list[str]:
    """The README's CPU command line (for `r`'s steps), its checkpoints written to out_dir;
    a run shorter than the recipe's `full_steps` also shortens the eval interval and warm-up."""
    return ["train.py", "config/train_shakespeare_char.py", "--device=cpu", "--compile=False",
            "--eval_iters=20", "--log_interval=1", f"--block_size={r['block']}",
            f"--batch_size={r['batch']}", f"--n_layer={r['n_layer']}", f"--n_head={r['n_head']}",
            f"--n_embd={r['n_embd']}", f"--max_iters={r['steps']}",
            f"--lr_decay_iters={r['steps']}", "--dropout=0.0", f"--out_dir={out_dir}"] + (
        [f"--eval_interval={r['eval_interval']}", f"--warmup_iters={r['warmup']}"]
        if r["steps"] != full_steps else [])  # a shortened smoke run only


def run_nanogpt(work: Path, r: dict, out_dir: Path, full_steps: int) -> dict:
    # Unbuffered: each line reaches the pipe when printed, as on a terminal.
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return run_streaming("nanogpt", [sys.executable, *nanogpt_args(r, out_dir, full_steps)], env, work,
                         nanogpt_line)
