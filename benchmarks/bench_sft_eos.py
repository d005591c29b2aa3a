"""How many SFT steps does the shipped SFT config need before the model ends its replies?
(issue 63: "SFT on a small set never learns to end a reply: say how many steps").

    python benchmarks/bench_sft_eos.py [--steps 60,120,240] [--base-steps 100]
        [--conversations 240] [--questions 12] [--max-new-tokens 40] [--device cpu]
        [--work DIR] [--json benchmarks/results/sft_eos_cpu.json]

What it runs, each through the command a user types (fresh processes, offline, float32), with
benchmarks/bench_sft_isolation.py's stage 1 and conversations:

1. stage 1: `./run_train.sh` with the default config, `--base-steps` steps (reused when --work
   already holds it);
2. for each budget N in `--steps`: `CONFIG_FILE=train_configs/llama3_debug_sft.toml
   ./run_train.sh --training.steps=N --data.dataset=chat:FILE` from the base (a run of its own
   per budget: the shipped schedule decays the learning rate to 0 at the last step, as a user
   choosing N would run it), then `python -m torchllm.hf export`;
3. transformers loads each export and answers, greedily, `--questions` questions the training
   set never asks ("What is a + b?" with a in 20..29, outside the training range 0..19) and as
   many it does ask (the first user turn of training conversations), each alone, up to
   `--max-new-tokens` new tokens. A reply "ends" when the model emits `<|assistant_end|>`
   (the end-of-turn token the loss trains: docs/data.md, "Loss mask") before the limit.

The table gives, per budget, the share of replies that end (unseen / seen questions), the mean
reply length in tokens, and one unseen reply as text.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_sft_isolation import (SFT_CONFIG, common_flags, conversations, launch_env,  # noqa: E402
                                 machine, run)


def replies(hf_dir: Path, questions: list[str], max_new: int) -> list[dict]:
    """Greedy replies of the export to each question alone: its text, its length in tokens and
    whether it ended with the end-of-turn token."""
    import torch
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(str(hf_dir))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir),
                                                              dtype=torch.float32).eval()
    end = tok.convert_tokens_to_ids("<|assistant_end|>")
    if end is None or end == tok.unk_token_id:
        sys.exit(f"{hf_dir}: the export's tokenizer has no <|assistant_end|>")
    out = []
    with torch.no_grad():
        for q in questions:
            ids = tok.apply_chat_template([{"role": "user", "content": q}], tokenize=True,
                                          add_generation_prompt=True)
            ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
            x = torch.tensor([ids])
            new: list[int] = []
            for _ in range(max_new):  # greedy, one token at a time (no cache: tiny model)
                nxt = int(model(x).logits[0, -1].argmax())
                new.append(nxt)
                if nxt == end:
                    break
                x = torch.cat([x, torch.tensor([[nxt]])], dim=1)
            ended = bool(new) and new[-1] == end
            text = tok.decode(new[:-1] if ended else new, skip_special_tokens=True)
            out.append({"question": q, "ended": ended, "tokens": len(new), "reply": text.strip()})
    return out


def measure(args) -> dict:
    work = Path(args.work or tempfile.mkdtemp(prefix="bench_sft_eos-"))
    work.mkdir(parents=True, exist_ok=True)
    convs = conversations(args.conversations)
    chat = work / "chat.jsonl"
    chat.write_text("".join(json.dumps({"messages": m}) + "\n" for m in convs))
    unseen = [f"What is {20 + i % 10} + {(7 * i) % 20}?" for i in range(args.questions)]
    seen = [next(m["content"] for m in c if m["role"] == "user") for c in convs[:args.questions]]
    t0 = time.perf_counter()
    run(["./run_train.sh", *common_flags(args, work, "base", args.base_steps),
         "--checkpoint.enable=true"], env=launch_env(None))
    rows = []
    for steps in args.steps:
        t1 = time.perf_counter()
        name = f"sft_{steps}"
        run(["./run_train.sh", *common_flags(args, work, name, steps),
             f"--data.dataset=chat:{chat}", f"--checkpoint.initial_load_path={work / 'base'}",
             f"--checkpoint.interval={steps}"], env=launch_env(SFT_CONFIG))
        hf_dir = work / f"hf_{steps}"
        run([sys.executable, "-m", "torchllm.hf", "export", "--checkpoint", str(work / name),
             "--out", str(hf_dir), "--overwrite"], env=launch_env(None))
        u, s = replies(hf_dir, unseen, args.max_new_tokens), replies(hf_dir, seen, args.max_new_tokens)
        rows.append({
            "steps": steps,
            "ended_unseen": sum(r["ended"] for r in u) / len(u),
            "ended_seen": sum(r["ended"] for r in s) / len(s),
            "mean_tokens_unseen": sum(r["tokens"] for r in u) / len(u),
            "example": u[0], "unseen": u, "seen": s,
            "wall_s": round(time.perf_counter() - t1, 1),
        })
        print(f"{steps} steps: {rows[-1]['ended_unseen']:.0%} unseen / "
              f"{rows[-1]['ended_seen']:.0%} seen replies end ({rows[-1]['wall_s']} s)", flush=True)
    return {"config": SFT_CONFIG, "base_steps": args.base_steps, "conversations": len(convs),
            "questions": args.questions, "max_new_tokens": args.max_new_tokens, "rows": rows,
            "precision": "float32", "device": args.device, "machine": machine(),
            "wall_s": round(time.perf_counter() - t0, 1), "work": str(work)}


def table(r: dict) -> str:
    lines = ["| SFT steps | replies that end: unseen questions | seen questions | "
             "mean reply tokens (unseen) | an unseen reply |", "|---|---|---|---|---|"]
    for row in r["rows"]:
        ex = row["example"]
        lines.append(f"| {row['steps']} | {row['ended_unseen']:.0%} | {row['ended_seen']:.0%} | "
                     f"{row['mean_tokens_unseen']:.1f} | {ex['question']} -> \"{ex['reply']}\""
                     f"{'' if ex['ended'] else ' (no end)'} |")
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=lambda s: [int(x) for x in s.split(",")], default=[60, 120, 240],
                   help="SFT budgets, comma-separated (one run each)")
    p.add_argument("--base-steps", type=int, default=100, help="stage-1 steps")
    p.add_argument("--conversations", type=int, default=240)
    p.add_argument("--questions", type=int, default=12, help="unseen and seen questions each")
    p.add_argument("--max-new-tokens", type=int, default=40)
    p.add_argument("--device", default="cpu")
    p.add_argument("--work", help="folder for the runs (default: a new temporary one)")
    p.add_argument("--json", help="write the result here (e.g. benchmarks/results/sft_eos_cpu.json)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    result = measure(args)
    print(table(result))
    print(f"{result['machine']}, {result['precision']}; wall {result['wall_s']} s")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
