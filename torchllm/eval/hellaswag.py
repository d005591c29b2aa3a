"""HellaSwag: pick the most likely of 4 endings; acc (summed loss) and acc_norm (mean loss).

    python -m torchllm.eval.hellaswag --checkpoint DIR [--data PATH] [--limit N] [--json OUT] \
        [--section.key=value ...]                                  (overrides of the run's config)
    torchrun --nproc_per_node 2 -m torchllm.eval.hellaswag --checkpoint DIR   (split over ranks)

Each example becomes 4 rows, the tokens of ctx + " " + ending encoded whole (split into context
and ending by torchllm.eval.continuation), right-padded to the longest row; only ending tokens
are scored. A random model scores about 25% on both metrics.
"""

from __future__ import annotations

import argparse
import contextlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, ContextManager

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from torchllm.data.tokenizer import Tokenizer
from torchllm.eval.continuation import encode_continuation
from torchllm.eval.loading import (
    CHECKPOINT_HELP,
    OVERRIDES_HELP,
    inference_device,
    init_distributed,
    load_for_inference,
    parse_args_and_overrides,
)
from torchllm.eval.reduce import gather_objects, rank_and_world, rank_batches, sum_over_ranks
from torchllm.log import init_logger, logger
from torchllm.loss import whole_logits
from torchllm.models.contract import LanguageModel
from torchllm.run.process_exit import exit_process

RANDOM_BASELINE = 0.25  # 4 endings
REQUIRED_KEYS = ("ctx", "endings", "label")
# What to do about a source that cannot be read, as this module's CLI says it.
SOURCE_HINT = "pass an official-format .jsonl file with --data FILE (or --eval.hellaswag_data=FILE)"


def _check_example(ex: dict, where: str) -> dict:
    missing = [k for k in REQUIRED_KEYS if k not in ex]
    if missing:
        raise ValueError(f"{where}: missing {', '.join(missing)}; HellaSwag rows need "
                         f"{', '.join(REQUIRED_KEYS)} (the official jsonl format)")
    if not isinstance(ex["endings"], list) or len(ex["endings"]) != 4:
        raise ValueError(f"{where}: 'endings' must be a list of 4 strings")
    try:
        label = int(ex["label"])  # the Hub copy stores labels as strings
    except (TypeError, ValueError):
        raise ValueError(f"{where}: 'label' = {ex['label']!r} is not an integer 0-3") from None
    if not 0 <= label <= 3:
        raise ValueError(f"{where}: 'label' = {label} is not in 0-3")
    return {**ex, "label": label}


def load_examples(source: str, limit: int = -1, hint: str = SOURCE_HINT) -> list[dict]:
    """Examples from an official-format .jsonl file, or from a Hub dataset (its validation split).

    A local folder of jsonl/parquet files also works as a Hub source, through `datasets`.
    `limit` keeps the first N (-1 = all). `hint` ends the error of a source that cannot be found.
    """
    path = Path(source)
    if path.suffix == ".jsonl" or path.is_file():
        if not path.is_file():
            raise FileNotFoundError(f"HellaSwag file {path} does not exist"
                                    + (f"; {hint}" if hint else ""))
        examples = []
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if limit != -1 and len(examples) >= limit:
                    break
                if not line.strip():
                    continue
                where = f"{path}:{lineno}"
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{where}: not valid JSON ({e})") from None
                examples.append(_check_example(row, where))
    else:
        from torchllm.hub import offline_note, prepare_hub

        # A Hub name offline: fail at once rather than retry the Hub for ~25 s (a local
        # dataset folder needs no probe).
        offline = False if path.exists() else prepare_hub()
        try:
            import datasets

            rows = datasets.load_dataset(source, split="validation")
        except Exception as e:  # offline, unknown name, no validation split: one clear line
            first = str(e).splitlines()[0] if str(e) else ""
            raise ValueError(f"could not load HellaSwag from {source!r} ({type(e).__name__}: "
                             f"{first}){offline_note(offline)}"
                             + (f"; {hint}" if hint else "")) from None
        if limit != -1:
            rows = rows.select(range(min(limit, len(rows))))
        examples = [_check_example(row, f"{source} row {i}") for i, row in enumerate(rows)]
    if not examples:
        raise ValueError(f"HellaSwag source {source} has no examples")
    return examples


def render_example(
    tokenizer: Tokenizer, example: dict, max_len: int
) -> list[tuple[list[int], list[int]]]:
    """The 4 (context ids, ending ids) pairs, split from the encoding of ctx + " " + ending;
    the context loses its oldest tokens past max_len."""
    return [encode_continuation(tokenizer, example["ctx"], " " + ending, max_len)
            for ending in example["endings"]]


@torch.no_grad()
def score_rows(
    model: nn.Module,
    rows: list[tuple[list[int], list[int]]],
    device: torch.device,
    autocast: Callable[[], ContextManager] = contextlib.nullcontext,
    greedy_match: bool = False,
) -> tuple[torch.Tensor, ...]:
    """Summed and mean cross-entropy of each row's ending tokens, in one padded forward pass.

    With `greedy_match`, also whether every ending token is the argmax prediction (a bool per
    row): exactly when greedy decoding from the context reproduces the ending.
    """
    length = max(len(c) + len(e) for c, e in rows)
    tokens = torch.zeros(len(rows), length, dtype=torch.long)
    mask = torch.zeros(len(rows), length, dtype=torch.bool)
    for i, (ctx, end) in enumerate(rows):
        tokens[i, : len(ctx) + len(end)] = torch.tensor(ctx + end)
        mask[i, len(ctx) : len(ctx) + len(end)] = True
    tokens, mask = tokens.to(device), mask.to(device)
    with autocast():
        logits = whole_logits(model(tokens))  # (TP: gathered over the vocabulary)
    # Position t predicts token t+1: score the predictions of the ending tokens only.
    losses = F.cross_entropy(
        logits[:, :-1].float().flatten(0, 1), tokens[:, 1:].flatten(), reduction="none"
    ).view(len(rows), -1)
    target_mask = mask[:, 1:]
    sums = (losses * target_mask).sum(dim=1)
    if not greedy_match:
        return sums, sums / target_mask.sum(dim=1)
    hits = (logits[:, :-1].argmax(dim=-1) == tokens[:, 1:]) | ~target_mask
    return sums, sums / target_mask.sum(dim=1), hits.all(dim=1)


@dataclass
class HellaSwagResult:
    n: int
    acc: float
    acc_norm: float
    predictions: list[dict] = field(default_factory=list)

    def scalars(self) -> dict[str, float]:
        """TensorBoard-ready scalars."""
        return {"hellaswag/acc": self.acc, "hellaswag/acc_norm": self.acc_norm}

    def table(self) -> str:
        lines = [
            f"HellaSwag, {self.n} examples",
            f"{'metric':<10}{'value':>8}",
            f"{'acc':<10}{self.acc:>8.4f}   (lowest summed loss over the ending)",
            f"{'acc_norm':<10}{self.acc_norm:>8.4f}   (lowest mean loss per ending token)",
            f"a random model scores ~{RANDOM_BASELINE:.2f} on both (4 endings); "
            "only scores clearly above it are signal",
        ]
        return "\n".join(lines)


def evaluate(
    model: LanguageModel,
    tokenizer: Tokenizer,
    examples: list[dict],
    device: torch.device,
    batch_size: int = 4,
    group=None,
    autocast: Callable[[], ContextManager] = contextlib.nullcontext,
) -> HellaSwagResult:
    """Score `examples` split over the ranks of `group` (example i on rank i % world).

    Counts are summed over ranks and predictions gathered, so every rank returns the same
    result as a single process. Ranks with fewer batches run a discarded extra one, so sharded
    models see the same number of forward passes everywhere.
    """
    max_len = model.args.max_seq_len
    was_training = model.training
    model.eval()
    predictions = []
    try:
        for idx in rank_batches(len(examples), batch_size, group):
            batch = [examples[i] for i in idx] or examples[:1]  # a rank out of work: a dummy
            rows = [row for ex in batch for row in render_example(tokenizer, ex, max_len)]
            sums, means = score_rows(model, rows, device, autocast)
            for j, i in enumerate(idx):
                s, m = sums[4 * j : 4 * j + 4].tolist(), means[4 * j : 4 * j + 4].tolist()
                predictions.append({
                    "index": i,
                    "ind": examples[i].get("ind"),
                    "label": examples[i]["label"],
                    "pred": min(range(4), key=s.__getitem__),
                    "pred_norm": min(range(4), key=m.__getitem__),
                    "sum_loss": s,
                    "mean_loss": m,
                })
    finally:
        model.train(was_training)
    counts = torch.tensor(
        [len(predictions), sum(p["pred"] == p["label"] for p in predictions),
         sum(p["pred_norm"] == p["label"] for p in predictions)],
        dtype=torch.float64, device=device,
    )
    n, correct, correct_norm = (int(c) for c in sum_over_ranks(counts, group).tolist())
    gathered = sorted((p for part in gather_objects(predictions, group) for p in part),
                      key=lambda p: p["index"])
    return HellaSwagResult(n=n, acc=correct / n, acc_norm=correct_norm / n, predictions=gathered)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m torchllm.eval.hellaswag",
        description="HellaSwag accuracy of a checkpoint (a random model scores ~25%).",
        epilog=OVERRIDES_HELP, allow_abbrev=False,
    )
    add = parser.add_argument
    add("--checkpoint", required=True, help=CHECKPOINT_HELP)
    add("--data", help="official-format .jsonl or Hub dataset (default: eval.hellaswag_data)")
    add("--limit", type=int, default=-1, help="score the first N examples (-1 = all)")
    add("--json", help="write acc, acc_norm, n and the per-example predictions to this file")
    add("--batch-size", type=int, help="examples per forward (default: eval.hellaswag_batch_size)")
    add("--device", default="auto", help="auto (CUDA when available), cpu or cuda")
    init_logger()
    try:
        args, overrides = parse_args_and_overrides(parser, argv)
        device = inference_device(args.device)
        init_distributed(device)
        model, cfg, tokenizer = load_for_inference(args.checkpoint, device, overrides)
        source = args.data or cfg.eval.hellaswag_data
        examples = load_examples(source, args.limit)
    except (FileNotFoundError, ValueError) as e:  # ConfigError is a ValueError
        logger.error("error: %s", e)
        return 2
    batch_size = args.batch_size or cfg.eval.hellaswag_batch_size
    result = evaluate(model, tokenizer, examples, device, batch_size)
    rank, _ = rank_and_world()
    if rank == 0:
        print(f"checkpoint {args.checkpoint} | data {source}")
        print(result.table())
        if args.json:
            out = {"acc": result.acc, "acc_norm": result.acc_norm, "n": result.n,
                   "random_baseline": RANDOM_BASELINE, "checkpoint": str(args.checkpoint),
                   "data": source, "predictions": result.predictions}
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(out, indent=1))
            print(f"wrote {args.json}")
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    exit_process(main())
