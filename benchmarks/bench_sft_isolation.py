"""Does the shipped SFT config train each conversation as if it were alone? Issue 43's table,
re-measured: the console's training loss of `train_configs/llama3_debug_sft.toml` against the
same conversations scored one at a time by transformers on the run's Hugging Face export.

    python benchmarks/bench_sft_isolation.py [--steps 60] [--base-steps 100]
        [--conversations 240] [--question "What is 2 + 2?"] [--device cpu]
        [--work DIR] [--json benchmarks/results/sft_isolation_cpu.json]

What it runs, each through the command a user types (fresh processes, offline, float32):

1. stage 1, the base model: `./run_train.sh` with the default config (debug Llama on the
   embedded corpus, its SentencePiece tokenizer trained at first use), `--base-steps` steps;
2. the SFT stage: `CONFIG_FILE=train_configs/llama3_debug_sft.toml ./run_train.sh` with
   `--data.dataset=chat:FILE` (the shipped config streams SmolTalk from the Hub; here a local
   file of arithmetic conversations written by this script, some multi-turn, some with a
   system message; the held question is not among them) and
   `--checkpoint.initial_load_path=` the base run, `--steps` steps. Everything else is the
   shipped config's: packing, masking keys, tokenizer from the base run (the 6 chat tokens grown
   at load), batch 8 x 512, AdamW, the linear schedule to 0, log_freq 10, val_fraction 0.05;
3. `python -m torchllm.hf export` of the SFT run;
4. the oracle: transformers loads the export (`AutoTokenizer` + `AutoModelForCausalLM`),
   renders each conversation alone with `apply_chat_template`, forwards it alone, and averages
   the cross-entropy of the assistant tokens (each reply's tokens and its `<|assistant_end|>`,
   found from the rendered ids) over the training conversations, token-weighted as the trainer
   weighs them. Which conversations are training ones follows the packing rule of
   docs/data.md (whole conversations in order into windows of seq_len + 1; the last
   val_fraction of the windows held out), checked against the run's own window count;
5. `python -m torchllm.generate --checkpoint RUN --chat QUESTION --temperature 0`.

"train loss" is the console's loss at the last step: the token-weighted mean over the last
logging interval (steps 51-60 of 60), the weights moving under a learning rate that decays to 0
at the last step; "alone" is the final weights'. Their ratio is ~1 when packed conversations do
not see each other (issue 43 measured 0.83 vs 4.40 with the old causal recipe).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SFT_CONFIG = "train_configs/llama3_debug_sft.toml"
HELD_QUESTION = "What is 2 + 2?"
STEP_LINE = re.compile(r"step\s+(\d+)/(\d+) \| loss ([0-9.naninf]+)")
WINDOWS_LINE = re.compile(r"(\d+) conversations \((\w+) template\) in (\d+) windows of (\d+) "
                          r"tokens \((\w+)\)")


def conversations(n: int, held: tuple[int, int] = (2, 2)) -> list[list[dict]]:
    """`n` arithmetic conversations in a fixed order: "What is a + b?" -> "a + b is c.", every
    third with a system message, every other with a follow-up turn (a product); the sum `held`
    is never asked (the greedy answer's question)."""
    pairs = [(a, b) for a in range(20) for b in range(20) if (a, b) != held]
    pairs = [pairs[(7 * i) % len(pairs)] for i in range(len(pairs))]  # 7 is coprime to 399
    out = []
    for i in range(n):
        a, b = pairs[i % len(pairs)]
        msgs = [{"role": "system", "content": "Answer in one short sentence."}] if i % 3 == 0 else []
        msgs += [{"role": "user", "content": f"What is {a} + {b}?"},
                 {"role": "assistant", "content": f"{a} + {b} is {a + b}."}]
        if i % 2:
            msgs += [{"role": "user", "content": f"And {a} times {b}?"},
                     {"role": "assistant", "content": f"{a} times {b} is {a * b}."}]
        out.append(msgs)
    return out


def run(cmd: list[str], env: dict | None = None, timeout: int = 3600) -> str:
    """Run a command in the repository; its output (stdout + stderr), or exit with its tail."""
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)
    out = proc.stdout + proc.stderr
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed (exit {proc.returncode}):\n{out[-3000:]}")
    return out


def launch_env(config: str | None) -> dict:
    env = {**os.environ, "NPROC": "1", "PYTHONPATH": str(REPO)}
    env.pop("NGPU", None)
    if config:
        env["CONFIG_FILE"] = config
    return env


def common_flags(args, work: Path, run_name: str, steps: int) -> list[str]:
    return [f"--training.device={args.device}", f"--job.dump_folder={work}",
            f"--job.run_name={run_name}", f"--training.steps={steps}",
            "--training.mixed_precision=none", "--metrics.report=false",
            "--metrics.progress_bar=false", "--job.print_config=false"]


def last_logged_loss(log: str, steps: int) -> float:
    """The console's loss at the last step (the mean over its logging interval)."""
    lines = [m for m in STEP_LINE.finditer(log) if int(m.group(2)) == steps]
    if not lines or int(lines[-1].group(1)) != steps:
        sys.exit(f"no console line for step {steps}/{steps} in the SFT run's output")
    return float(lines[-1].group(3))


def assistant_targets(ids: list[int], start: int, end: int) -> list[int]:
    """Positions t whose token is trained: every token after an `<|assistant_start|>` up to and
    including its `<|assistant_end|>` (docs/data.md, "Loss mask")."""
    out, inside = [], False
    for t, i in enumerate(ids):
        if inside:
            out.append(t)
        if i == start:
            inside = True
        elif i == end:
            inside = False
    return out


def training_split(lengths: list[int], window: int, val_fraction: float) -> tuple[int, int]:
    """(windows, number of training conversations): whole conversations packed in order into
    windows of `window` tokens, a new window where one does not fit; the last
    int(windows * val_fraction) windows are held out."""
    used, windows, first_window = 0, 0, []
    for n in lengths:
        n = min(n, window)
        if used and used + n > window:
            used = 0
        if used == 0:
            windows += 1
        first_window.append(windows - 1)
        used += n
        if used == window:
            used = 0
    held_from = windows - int(windows * val_fraction)
    return windows, sum(w < held_from for w in first_window)


def score_alone(hf_dir: Path, convs: list[list[dict]]):
    """Per conversation, alone: (its rendered ids, the summed cross-entropy of its assistant
    tokens, how many there are), by transformers on the export."""
    import torch
    import torch.nn.functional as F
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(str(hf_dir))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir),
                                                              dtype=torch.float32).eval()
    start, end = (tok.convert_tokens_to_ids(t) for t in ("<|assistant_start|>", "<|assistant_end|>"))
    if tok.unk_token_id in (start, end) or None in (start, end):
        sys.exit(f"{hf_dir}: the export's tokenizer has no <|assistant_start|>/<|assistant_end|>")
    rows = []
    with torch.no_grad():
        for msgs in convs:
            ids = tok.apply_chat_template(msgs, tokenize=True)
            ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
            targets = assistant_targets(ids, start, end)
            logits = model(torch.tensor([ids])).logits[0].float()
            t = torch.tensor(targets)
            loss = F.cross_entropy(logits[t - 1], torch.tensor(ids)[t], reduction="sum")
            rows.append((ids, float(loss), len(targets)))
    return rows


def greedy_answer(run_dir: Path, question: str, device: str) -> str:
    out = run([sys.executable, "-m", "torchllm.generate", "--checkpoint", str(run_dir),
               "--chat", question, "--temperature", "0", "--device", device],
              env=launch_env(None))
    reply = out.split("### assistant 1\n", 1)
    if len(reply) < 2:
        sys.exit(f"generate printed no reply:\n{out[-2000:]}")
    return reply[1].split("\n### ", 1)[0].strip()


def machine() -> str:
    """'N CPUs, <model name>' (Linux's /proc/cpuinfo), else the platform's processor."""
    from torchllm.precision import cpuinfo

    return f"{os.cpu_count()} CPUs, {cpuinfo('model name') or platform.processor()}"


def latest_step(run_dir: Path) -> str | None:
    """The stage-1 checkpoint the SFT run loads (its newest complete step-N)."""
    from torchllm.checkpoint.layout import complete_steps

    steps = complete_steps(run_dir / "checkpoint")
    return f"step-{steps[-1]}" if steps else None


def measure(args) -> dict:
    work = Path(args.work or tempfile.mkdtemp(prefix="bench_sft_isolation-"))
    work.mkdir(parents=True, exist_ok=True)
    convs = conversations(args.conversations)
    chat = work / "chat.jsonl"
    chat.write_text("".join(json.dumps({"messages": m}) + "\n" for m in convs))
    t0 = time.perf_counter()
    base, base_note = work / "base", None
    if not args.base:  # a stage 1 already complete in --work is relaunched: it trains nothing
        out = run(["./run_train.sh", *common_flags(args, work, "base", args.base_steps),
                   "--checkpoint.enable=true"], env=launch_env(None))
        if "run already at step" in out:
            base_note = f"stage 1 found complete in {base} (trained by an earlier launch)"
    base = Path(args.base) if args.base else base
    t1 = time.perf_counter()
    log = run(["./run_train.sh", *common_flags(args, work, "debug_sft", args.steps),
               f"--data.dataset=chat:{chat}", f"--checkpoint.initial_load_path={base}"],
              env=launch_env(SFT_CONFIG))
    t2 = time.perf_counter()
    train_loss = last_logged_loss(log, args.steps)
    packed = WINDOWS_LINE.search(log)
    if not packed:
        sys.exit("the SFT run logged no 'N conversations (...) in W windows' line")
    n_logged, kind, windows_logged, window = (packed.group(1), packed.group(2),
                                              int(packed.group(3)), int(packed.group(4)))
    hf_dir = work / "hf"
    run([sys.executable, "-m", "torchllm.hf", "export", "--checkpoint", str(work / "debug_sft"),
         "--out", str(hf_dir), "--overwrite"], env=launch_env(None))
    rows = score_alone(hf_dir, convs)
    windows, n_train = training_split([len(ids) for ids, _, _ in rows], window, args.val_fraction)
    if windows != windows_logged or int(n_logged) != len(convs):
        sys.exit(f"the run packed {n_logged} conversations into {windows_logged} windows; the "
                 f"export's rendering packs {len(convs)} into {windows}: not the same tokens")
    train, held = rows[:n_train], rows[n_train:]

    def mean(rs):
        return sum(r[1] for r in rs) / sum(r[2] for r in rs) if rs else None

    alone = mean(train)
    answer = greedy_answer(work / "debug_sft", args.question, args.device)
    return {
        "config": SFT_CONFIG, "steps": args.steps, "base_steps": None if args.base else args.base_steps,
        "base": str(base) if args.base else "default config (debug Llama, embedded corpus)",
        "base_note": base_note, "base_checkpoint": latest_step(base),
        "conversations": len(convs), "training_conversations": n_train,
        "template": kind, "windows": windows, "window_tokens": window,
        "train_loss": train_loss, "loss_alone": alone, "ratio": train_loss / alone,
        "held_out_loss_alone": mean(held), "question": args.question, "greedy_answer": answer,
        "precision": "float32", "device": args.device,
        "machine": machine(),
        "wall_s": {"base": round(t1 - t0, 1), "sft": round(t2 - t1, 1),
                   "total": round(time.perf_counter() - t0, 1)},
        "work": str(work),
    }


def table(r: dict) -> str:
    return "\n".join([
        "| run | train loss (last interval) | same conversations scored alone | ratio | "
        f"greedy answer to \"{r['question']}\" |",
        "|---|---|---|---|---|",
        f"| {r['steps']} steps, shipped SFT config | {r['train_loss']:.3f} | "
        f"{r['loss_alone']:.3f} | {r['ratio']:.3f} | \"{r['greedy_answer']}\" |",
    ])


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=60, help="SFT steps (issue 43: 60)")
    p.add_argument("--base-steps", type=int, default=100, help="stage-1 steps")
    p.add_argument("--base", help="an existing stage-1 run to start from (skips stage 1)")
    p.add_argument("--conversations", type=int, default=240)
    p.add_argument("--question", default=HELD_QUESTION)
    p.add_argument("--device", default="cpu")
    p.add_argument("--val-fraction", type=float, default=0.05,
                   help="the shipped config's data.val_fraction (for the train/held-out split)")
    p.add_argument("--work", help="folder for the runs (default: a new temporary one)")
    p.add_argument("--json", help="write the result here (e.g. benchmarks/results/"
                                  "sft_isolation_cpu.json)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    result = measure(args)
    print(table(result))
    held = result["held_out_loss_alone"]
    print(f"held-out conversations alone: {'none' if held is None else f'{held:.3f}'}; "
          f"{result['training_conversations']} of {result['conversations']} conversations "
          f"trained, {result['windows']} windows; wall {result['wall_s']}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
