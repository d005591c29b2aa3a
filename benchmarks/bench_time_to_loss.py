"""Time to quality on CPU: wall-clock seconds to a validation loss of 1.88 on tiny Shakespeare.

    python benchmarks/bench_time_to_loss.py [--rounds 2] [--target 1.88] [--nanogpt DIR]
        [--text ../shared/data/tinyshakespeare.txt] [--contenders nanogpt,speedrun,reference,same]
        [--json benchmarks/results/time_to_loss_cpu.json] [--md benchmarks/results/time_to_loss_cpu.md]

The anchor is nanoGPT's published CPU run (README: `config/train_shakespeare_char.py` with
`--device=cpu --compile=False --eval_iters=20 --log_interval=1 --block_size=64 --batch_size=12
--n_layer=4 --n_head=4 --n_embd=128 --max_iters=2000 --lr_decay_iters=2000 --dropout=0.0`,
"~3 minutes ... a loss of only 1.88"). Contenders, each a fresh process, timed from the launch
of its command to the moment its first validation line at or below the target reaches the
console (start-up, data, every validation on the way included), run alternately (nanogpt,
speedrun, reference, same, nanogpt, ...) so they share the machine's moments:

- nanogpt: nanoGPT's own code (`--nanogpt DIR`: a checkout holding train.py, model.py,
  configurator.py, config/train_shakespeare_char.py, data/shakespeare_char/prepare.py; never
  copied into this repository). Its files are copied to a scratch folder, --text is placed as
  its input.txt (no download) and its own prepare.py writes train.bin / val.bin once, before the
  rounds (not on the clock: nanoGPT prepares data once per dataset); then `python train.py` with
  the README's command line. Its validation lines are `step N: train loss X, val loss Y`
  (every 250 steps, the mean over 20 random batches of 12 x 64: about +-0.02 of noise). Without
  --nanogpt (or without its files) it is skipped, with the reason in the table.
- reference: this file's own plain loop (`--reference-worker`): `transformers`' GPT-2 (4 x 128,
  4 heads, dropout 0, SDPA attention) on characters, nanoGPT's recipe: random 12 x 64 windows of
  the first 90% of the text, AdamW (0.9, 0.99), weight decay 0.1 on 2-D weights, lr 1e-3 with
  100 linear warmup steps then cosine to 1e-4 at step 2000, clipping at 1.0, fp32, 2000 steps.
- same: torchllm's `./run_train.sh` with the same model (`model.name = "gpt2"` and the `[model]`
  shape keys), tokenizer (`data.tokenizer = "bytes"`: one token per character of this ASCII
  text), split (`data.val_fraction = 0.1`), batch, steps, optimizer, schedule and precision.
- speedrun: `CONFIG_FILE=train_configs/speedrun_shakespeare_cpu.toml ./run_train.sh`, the fastest
  recipe this project has for the same split (see the config's comments); it stops at the
  target (`validation.stop_at_loss`).

The torchllm contenders and the reference validate on the whole held-out 10% (non-overlapping
windows), the reference and `same` every 250 steps as nanoGPT does, the speedrun where its config
says. The baseline (the "x baseline" column) is nanogpt when it ran, else the reference; its time
is its time to the target, or, where its recipe ends just above it (nanoGPT's own code ends at
1.8802 on some seeds), the time of its last validation: what it publishes. Reported per
contender: the time to the first validation at or below the target, its final validation loss
and wall time, and the validation loss it had reached by the baseline's time.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent)]  # benchlib
from benchlib.nanogpt import (nanogpt_missing, prepare_nanogpt, run_nanogpt,  # noqa: E402
                              run_streaming)

REPO = Path(__file__).resolve().parent.parent
TEXT = REPO.parent / "shared" / "data" / "tinyshakespeare.txt"
PACKAGED_TEXT = REPO / "torchllm" / "data" / "assets" / "tinyshakespeare.txt"  # the config's

# nanoGPT's CPU recipe (its README's command line over config/train_shakespeare_char.py).
RECIPE = dict(n_layer=4, n_head=4, n_embd=128, block=64, batch=12, steps=2000, lr=1e-3,
              min_lr=1e-4, warmup=100, beta1=0.9, beta2=0.99, weight_decay=0.1, clip=1.0,
              eval_interval=250, val_fraction=0.1)


# --- the reference loop (runs in its own process) -----------------------------------------------

def recipe(steps: int | None = None) -> dict:
    """nanoGPT's recipe; `steps` shortens it (smoke tests), evaluating at the end at least."""
    r = dict(RECIPE)
    if steps is not None:
        r.update(steps=steps, eval_interval=min(r["eval_interval"], steps),
                 warmup=min(r["warmup"], steps // 2))
    return r


def reference_model(vocab_size: int, r: dict = RECIPE):
    """`transformers`' GPT-2 in the recipe's shape: dropout 0, SDPA attention, tied output."""
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel._from_config(GPT2Config(
        vocab_size=vocab_size, n_positions=r["block"], n_embd=r["n_embd"], n_layer=r["n_layer"],
        n_head=r["n_head"], resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        activation_function="gelu_new", bos_token_id=None, eos_token_id=None),
        attn_implementation="sdpa")


def reference_lr(it: int, r: dict = RECIPE) -> float:
    """nanoGPT's get_lr: linear warmup, then cosine from lr to min_lr at the last step."""
    if it < r["warmup"]:
        return r["lr"] * (it + 1) / (r["warmup"] + 1)
    ratio = (it - r["warmup"]) / (r["steps"] - r["warmup"])
    return r["min_lr"] + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (r["lr"] - r["min_lr"])


def reference_worker(text_path: Path, seed: int, r: dict) -> None:
    """nanoGPT's recipe as a plain loop; prints one JSON line per validation."""
    import torch
    import torch.nn.functional as F

    torch.manual_seed(seed)
    text = text_path.read_text(encoding="utf-8")
    chars = sorted(set(text))
    data = torch.tensor(_char_ids(text, chars), dtype=torch.long)
    n = int(len(data) * (1 - r["val_fraction"]))
    train, val = data[:n], data[n:]
    model = reference_model(len(chars), r)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": r["weight_decay"]},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=r["lr"], betas=(r["beta1"], r["beta2"]))

    def loss_of(x, y):
        logits = model(input_ids=x, use_cache=False).logits
        return F.cross_entropy(logits.view(-1, logits.size(-1)), y.reshape(-1))

    @torch.no_grad()
    def validate() -> float:  # the whole held-out part, non-overlapping windows
        model.eval()
        block = r["block"]
        starts = torch.arange(0, len(val) - block - 1, block)
        total, count = 0.0, 0
        for chunk in starts.split(64):
            x = torch.stack([val[s:s + block] for s in chunk.tolist()])
            y = torch.stack([val[s + 1:s + 1 + block] for s in chunk.tolist()])
            total += loss_of(x, y).item() * y.numel()
            count += y.numel()
        model.train()
        return total / count

    for it in range(r["steps"] + 1):
        if it % r["eval_interval"] == 0 and it > 0:
            print(json.dumps({"time": time.time(), "step": it, "val": validate()}), flush=True)
        if it == r["steps"]:
            break
        for group in opt.param_groups:
            group["lr"] = reference_lr(it, r)
        ix = torch.randint(len(train) - r["block"], (r["batch"],))
        x = torch.stack([train[i:i + r["block"]] for i in ix.tolist()])
        y = torch.stack([train[i + 1:i + 1 + r["block"]] for i in ix.tolist()])
        loss = loss_of(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), r["clip"])
        opt.step()
        opt.zero_grad(set_to_none=True)


def _char_ids(text: str, chars: list[str]) -> list[int]:
    index = {c: i for i, c in enumerate(chars)}
    return [index[c] for c in text]


# --- the torchllm contenders ----------------------------------------------------------------------

def same_recipe_args(text: Path, r: dict = RECIPE) -> list[str]:
    """nanoGPT's recipe as run_train.sh overrides (GPT-2 4 x 128, bytes = characters here)."""
    return [
        "--model.name=gpt2", "--model.flavor=debug", f"--model.dim={r['n_embd']}",
        f"--model.n_layers={r['n_layer']}", f"--model.n_heads={r['n_head']}",
        "--model.vocab_pad_multiple=1",
        f"--data.dataset=local:{text}", "--data.tokenizer=bytes",
        f"--data.val_fraction={r['val_fraction']}",
        f"--training.seq_len={r['block']}", f"--training.local_batch_size={r['batch']}",
        f"--training.steps={r['steps']}", f"--training.max_norm={r['clip']}",
        "--training.mixed_precision=none",
        "--optimizer.name=adamw", f"--optimizer.lr={r['lr']}", f"--optimizer.beta1={r['beta1']}",
        f"--optimizer.beta2={r['beta2']}", f"--optimizer.weight_decay={r['weight_decay']}",
        "--optimizer.decay_embeddings=true",
        f"--lr_scheduler.warmup_steps={r['warmup']}", "--lr_scheduler.decay_type=cosine",
        f"--lr_scheduler.min_lr_ratio={r['min_lr'] / r['lr']}",
        "--validation.enable=true", f"--validation.freq={r['eval_interval']}",
        "--validation.steps=100000",  # every held-out window
        "--eval.sample_freq=0", "--checkpoint.enable=false", "--metrics.log_freq=250",
    ]


# A validation on the console: torchllm's `validation step N: loss X | ...` and nanoGPT's
# `step N: train loss X, val loss Y`.
TORCHLLM_VAL = re.compile(r"validation step (\d+): loss ([0-9.]+)")


def torchllm_line(line: str):
    m = TORCHLLM_VAL.search(line)
    return (int(m.group(1)), float(m.group(2))) if m else None


def run_torchllm(name: str, args: list[str], config: Path | None, folder: Path) -> dict:
    env = dict(os.environ, NGPU="1")
    if config is not None:
        env["CONFIG_FILE"] = str(config)
    cmd = [str(REPO / "run_train.sh"), f"--job.dump_folder={folder}",
           f"--job.run_name={name}_{time.time_ns()}", *args]
    return run_streaming(name, cmd, env, REPO, torchllm_line)


def run_reference(text: Path, seed: int, steps: int | None) -> dict:
    cmd = [sys.executable, __file__, "--reference-worker", "--text", str(text), "--seed",
           str(seed)] + (["--steps", str(steps)] if steps else [])

    def parse(line: str):
        if not line.startswith("{"):
            return None
        row = json.loads(line)
        return row["step"], row["val"]

    return run_streaming("reference", cmd, dict(os.environ), REPO, parse)


def time_to(curve, target: float) -> float | None:
    return next((t for t, _, v in curve if v <= target), None)


def val_at(curve, seconds: float | None) -> float | None:
    """The validation loss a run had reported by `seconds` after its launch."""
    if seconds is None:
        return None
    seen = [v for t, _, v in curve if t <= seconds]
    return min(seen) if seen else None


# --- the table ------------------------------------------------------------------------------------

def baseline_time(run: dict, target: float) -> float:
    """The baseline recipe's time: to the target, or (nanoGPT's recipe ending just above it,
    as its own code does on some seeds: 1.8802) its last validation, which is what it
    publishes."""
    reached = time_to(run["curve"], target)
    if reached is not None:
        return reached
    return run["curve"][-1][0] if run["curve"] else run["wall"]


def summarize(results: dict[str, list[dict]], target: float, baseline: str) -> list[dict]:
    base_times = [baseline_time(r, target) for r in results.get(baseline, [])]
    base_median = statistics.median(base_times) if base_times else None
    rows = []
    for name, runs in results.items():
        times = [time_to(r["curve"], target) for r in runs]
        reached = [t for t in times if t is not None]
        median = statistics.median(reached) if runs and len(reached) == len(runs) else None
        ours = times
        if name == baseline:
            median, ours = base_median, base_times
        rows.append({
            "contender": name, "runs": len(runs), "time_to_target_s": times,
            "median_time_to_target_s": median,
            "vs_baseline": (median / base_median) if median and base_median else None,
            # each round's time over the baseline's in the same round (rounds alternate)
            "vs_baseline_by_round": [None if t is None else t / b
                                     for t, b in zip(ours, base_times)],
            "final_val": [r["curve"][-1][2] if r["curve"] else None for r in runs],
            "wall_s": [r["wall"] for r in runs],
            "val_at_baseline_time": [val_at(r["curve"], base_median) for r in runs],
            "curves": [r["curve"] for r in runs],
        })
    return rows


def fmt(values, spec: str) -> str:
    return ", ".join("-" if v is None else format(v, spec) for v in values)


def markdown(rows: list[dict], target: float, machine: str, baseline: str,
             skipped: dict[str, str]) -> str:
    lines = [f"Time to validation loss {target} on tiny Shakespeare ({machine}); seconds from "
             "the command's launch to its validation line, each contender a fresh process, "
             "rounds alternating.", "",
             f"Baseline: {baseline}. Its time is its time to the target, or its last validation "
             "where its recipe ends above it (what nanoGPT publishes).", "",
             f"| contender | time to {target} (s) | median | x {baseline} | x {baseline} by round "
             "| final val | wall (s) | val at baseline's time |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = "-" if r["vs_baseline"] is None else f"{r['vs_baseline']:.2f}x"
        median = "-" if r["median_time_to_target_s"] is None else \
            f"{r['median_time_to_target_s']:.1f}"
        lines.append(f"| {r['contender']} | {fmt(r['time_to_target_s'], '.1f')} | {median} | "
                     f"{ratio} | {fmt(r['vs_baseline_by_round'], '.2f')} | "
                     f"{fmt(r['final_val'], '.4f')} | {fmt(r['wall_s'], '.1f')} | "
                     f"{fmt(r['val_at_baseline_time'], '.4f')} |")
    for name, why in skipped.items():
        lines.append(f"| {name} | skipped: {why} | - | - | - | - | - | - |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reference-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--text", type=Path, default=TEXT)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--target", type=float, default=1.88)
    p.add_argument("--steps", type=int, default=None,
                   help="shorten every contender to N steps (a smoke test, not a measurement)")
    p.add_argument("--contenders", default="nanogpt,speedrun,reference,same")
    p.add_argument("--nanogpt", type=Path, default=None,
                   help="a checkout of github.com/karpathy/nanoGPT (the nanogpt contender)")
    p.add_argument("--json", type=Path, default=REPO / "benchmarks/results/time_to_loss_cpu.json")
    p.add_argument("--md", type=Path, default=REPO / "benchmarks/results/time_to_loss_cpu.md")
    args = p.parse_args(argv)
    if args.reference_worker:
        reference_worker(args.text, args.seed, recipe(args.steps))
        return 0
    if not args.text.is_file():
        raise SystemExit(f"--text {args.text} does not exist (tiny Shakespeare: "
                         "../shared/data/tinyshakespeare.txt)")
    contenders = args.contenders.split(",")
    unknown = sorted(set(contenders) - {"nanogpt", "reference", "same", "speedrun"})
    if unknown:
        raise SystemExit(f"--contenders: unknown {', '.join(unknown)} (allowed: nanogpt, "
                         "reference, same, speedrun)")
    skipped = {}
    if "nanogpt" in contenders and (why := nanogpt_missing(args.nanogpt)):
        skipped["nanogpt"] = why
        contenders.remove("nanogpt")
        print(f"nanogpt skipped: {why}", flush=True)
    baseline = "nanogpt" if "nanogpt" in contenders else "reference"
    from torchllm.precision import cpu_flags, cpuinfo

    flags = cpu_flags() or set()
    machine = (f"{cpuinfo('model name') or 'unknown CPU'}, {os.cpu_count()} cores, "
               f"{'native bf16' if flags & {'amx_bf16', 'avx512_bf16'} else 'no native bf16'}")
    speedrun = REPO / "train_configs" / "speedrun_shakespeare_cpu.toml"
    r = recipe(args.steps)
    results: dict[str, list[dict]] = {name: [] for name in contenders}
    load = []  # the machine's 1-minute load average before each run (shared machines)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if "nanogpt" in contenders:
            (work / "nanogpt").mkdir()
            prepare_nanogpt(args.nanogpt, args.text, work / "nanogpt")
        for rnd in range(args.rounds):
            for name in contenders:
                seed = [f"--job.seed={args.seed + rnd}"]
                load.append((rnd + 1, name, os.getloadavg()[0]))
                if name == "nanogpt":
                    out = run_nanogpt(work / "nanogpt", r, work / f"nanogpt_out_{rnd}",
                                      RECIPE["steps"])
                elif name == "reference":
                    out = run_reference(args.text, args.seed + rnd, args.steps)
                elif name == "same":
                    out = run_torchllm(name, same_recipe_args(args.text, r) + seed, None, work)
                else:  # speedrun
                    short = ([f"--training.steps={args.steps}", f"--validation.freq={args.steps}",
                              f"--lr_scheduler.warmup_steps={args.steps // 2}"]
                             if args.steps else [])
                    # The config's own dataset (the packaged copy) when --text is that text.
                    data = ([] if args.text.read_bytes() == PACKAGED_TEXT.read_bytes()
                            else [f"--data.dataset=local:{args.text}"])
                    out = run_torchllm(name, [*data, *seed, *short,
                                              f"--validation.stop_at_loss={args.target}"],
                                       speedrun, work)
                results[name].append(out)
                last = out["curve"][-1] if out["curve"] else (None, None, None)
                print(f"round {rnd + 1} {name:9s} wall {out['wall']:6.1f}s  final val {last[2]}  "
                      f"time to {args.target}: {time_to(out['curve'], args.target)}", flush=True)
    rows = summarize(results, args.target, baseline)
    table = markdown(rows, args.target, str(machine), baseline, skipped)
    print(table)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({
        "machine": str(machine), "target": args.target, "recipe": RECIPE, "baseline": baseline,
        "skipped": skipped, "load_average_before_each_run": load,
        "date": time.strftime("%Y-%m-%d"), "rows": rows}, indent=1))
    args.md.write_text(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
