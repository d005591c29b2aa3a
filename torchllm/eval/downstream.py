"""CORE-style downstream evaluation: per-task accuracy over several tasks and one centered score.

    python -m torchllm.eval.downstream --checkpoint RUN [--tasks arc_easy,copa:5,winogrande] \
        [--data-dir ../shared/data/evals] [--limit 100] [--shots 0] [--json OUT] \
        [--section.key=value ...]                                  (overrides of the run's config)
    torchrun --nproc_per_node 2 -m torchllm.eval.downstream ...        (split over ranks)

Each task's rows become `Item`s (torchllm.eval.tasks). A K-shot prompt puts K other rows of the
same task, each with its right answer, before the question; which rows is a pure function of
(seed, row index), so every rank and every run builds the same prompt. Scoring reuses HellaSwag's
padded forward (`hellaswag.score_rows`) and its split over data-parallel ranks
(`reduce.rank_batches`): option rows of a batch of items go through one forward pass.

The aggregate is nanochat's CORE: each task's accuracy is centered, (acc - chance) / (1 - chance)
(0 = random guessing, 1 = perfect), and the centered values are averaged over the tasks.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, ContextManager

import numpy as np
import torch
import torch.distributed as dist

from torchllm.callbacks import Callback, StepReport
from torchllm.config import ConfigError
from torchllm.data.tokenizer import Tokenizer
from torchllm.eval.continuation import encode_continuation
from torchllm.eval.hellaswag import score_rows
from torchllm.eval.loading import CHECKPOINT_HELP, OVERRIDES_HELP, inference_device, \
    init_distributed, load_for_inference, parse_args_and_overrides
from torchllm.eval.reduce import gather_objects, rank_and_world, rank_batches, sum_over_ranks
from torchllm.eval.tasks import DEFAULT_TASKS, TASKS, Item, chance, load_items, parse_task
from torchllm.log import init_logger, logger
from torchllm.models.contract import LanguageModel
from torchllm.run.process_exit import exit_process

SHOT_SEPARATOR = "\n\n"


def fewshot_indices(n_rows: int, index: int, shots: int, seed: int) -> list[int]:
    """`shots` distinct rows other than `index`, drawn with a generator seeded by (seed, index)."""
    others = n_rows - 1
    if shots > others:
        raise ValueError(f"{shots}-shot needs {shots + 1} rows; the task has {n_rows}")
    picks = np.random.default_rng([seed, index]).choice(others, size=shots, replace=False)
    return [int(p) + (p >= index) for p in picks]  # skip the row itself


def with_shots(items: list[Item], index: int, shots: int, seed: int) -> Item:
    """Item `index` with `shots` solved examples of the same task before each of its contexts."""
    item = items[index]
    if shots == 0:
        return item
    solved = []
    for j in fewshot_indices(len(items), index, shots, seed):
        ctx, cont = items[j].option(items[j].gold)
        solved.append(ctx + cont)
    prefix = SHOT_SEPARATOR.join(solved) + SHOT_SEPARATOR
    return Item(tuple(prefix + c for c in item.contexts), item.continuations, item.gold)


def encode_options(tokenizer: Tokenizer, item: Item,
                   max_len: int) -> list[tuple[list[int], list[int]]]:
    """(context ids, continuation ids) per option, split from the whole string's encoding
    (torchllm.eval.continuation); contexts drop their oldest tokens first."""
    return [encode_continuation(tokenizer, *item.option(i), max_len)
            for i in range(item.num_options)]


def unsigned_zero(value: float, digits: int) -> float:
    """`value`, with a value that rounds to zero at `digits` decimals as +0.0 (a table of
    centered accuracies printed -0.0000 for a task a hair below chance)."""
    return round(value, digits) + 0.0 if round(value, digits) == 0 else value


@dataclass
class TaskResult:
    name: str
    kind: str
    shots: int
    n: int
    acc: float
    chance: float
    predictions: list[dict] = field(default_factory=list)

    @property
    def centered(self) -> float:
        return (self.acc - self.chance) / (1.0 - self.chance)


@dataclass
class DownstreamResult:
    tasks: dict[str, TaskResult]

    @property
    def core(self) -> float:
        """The mean centered accuracy over the tasks (0 = chance, 1 = perfect)."""
        return sum(t.centered for t in self.tasks.values()) / len(self.tasks)

    def scalars(self) -> dict[str, float]:
        """TensorBoard-ready scalars."""
        out = {"downstream/core": self.core}
        for name, t in self.tasks.items():
            out[f"downstream/{name}/acc"] = t.acc
            out[f"downstream/{name}/centered"] = t.centered
        return out

    def table(self) -> str:
        """The console's table (a centered accuracy that rounds to zero prints 0.0000, not
        -0.0000)."""
        lines = [f"{'task':<16}{'type':<8}{'shots':>6}{'n':>7}{'acc':>8}{'chance':>8}"
                 f"{'centered':>10}"]
        for t in self.tasks.values():
            lines.append(f"{t.name:<16}{t.kind:<8}{t.shots:>6}{t.n:>7}{t.acc:>8.4f}"
                         f"{t.chance:>8.3f}{unsigned_zero(t.centered, 4):>10.4f}")
        lines.append(f"CORE (mean centered accuracy over {len(self.tasks)} tasks): "
                     f"{unsigned_zero(self.core, 4):.4f}"
                     "   (0 = random guessing)")
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {"core": self.core, "tasks": {
            n: {"type": t.kind, "shots": t.shots, "n": t.n, "acc": t.acc, "chance": t.chance,
                "centered": t.centered, "predictions": t.predictions}
            for n, t in self.tasks.items()}}


def evaluate_task(
    model: LanguageModel,
    tokenizer: Tokenizer,
    name: str,
    items: list[Item],
    shots: int,
    device: torch.device,
    limit: int = -1,
    seed: int = 0,
    batch_size: int = 8,
    group=None,
    autocast: Callable[[], ContextManager] = contextlib.nullcontext,
) -> TaskResult:
    """Score the first `limit` items (-1 = all); shots come from all of the task's other items.

    Item i is scored on rank i % world; counts are summed and predictions gathered over `group`,
    so every rank returns what a single process would.
    """
    kind = TASKS[name].kind
    n = len(items) if limit == -1 else min(limit, len(items))
    max_len = model.args.max_seq_len
    was_training = model.training
    model.eval()
    predictions = []
    try:
        for idx in rank_batches(n, batch_size, group):
            prompts = [with_shots(items, i, shots, seed) for i in (idx or [0])]  # [0]: a dummy
            options = [encode_options(tokenizer, p, max_len) for p in prompts]
            rows = [row for opts in options for row in opts]
            _, means, greedy = score_rows(model, rows, device, autocast, greedy_match=True)
            start = 0
            for i, opts in zip(idx, options):
                m = means[start : start + len(opts)].tolist()
                if kind == "lm":  # right when greedy decoding reproduces the continuation
                    pred = 0 if bool(greedy[start]) else -1
                else:  # mc and schema: the option whose continuation has the lowest mean loss
                    pred = min(range(len(opts)), key=m.__getitem__)
                predictions.append({"index": i, "gold": items[i].gold, "pred": pred,
                                    "mean_loss": m})
                start += len(opts)
    finally:
        model.train(was_training)
    counts = torch.tensor([len(predictions), sum(p["pred"] == p["gold"] for p in predictions)],
                          dtype=torch.float64, device=device)
    total, correct = (int(c) for c in sum_over_ranks(counts, group).tolist())
    gathered = sorted((p for part in gather_objects(predictions, group) for p in part),
                      key=lambda p: p["index"])
    return TaskResult(name, kind, shots, total, correct / total, chance(kind, items[:n]), gathered)


def load_tasks(entries: list[str], default_shots: int, data_dir: str = "",
               hellaswag_data: str = "") -> dict[str, tuple[list[Item], int]]:
    """{name: (items, shots)} for `eval.tasks`-style entries ('name' or 'name:K')."""
    out = {}
    for entry in entries:
        name, shots = parse_task(entry, default_shots)
        items = load_items(name, data_dir, hellaswag_data)
        fewshot_indices(len(items), 0, shots, 0)  # fails now when the task is too small
        out[name] = (items, shots)
    return out


def evaluate(model, tokenizer, tasks: dict[str, tuple[list[Item], int]], device, limit=-1,
             seed=0, batch_size=8, group=None, autocast=contextlib.nullcontext) -> DownstreamResult:
    return DownstreamResult({
        name: evaluate_task(model, tokenizer, name, items, shots, device, limit, seed,
                            batch_size, group, autocast)
        for name, (items, shots) in tasks.items()
    })


class DownstreamEval(Callback):
    """Every `eval.tasks_freq` steps, the CORE-style evaluation of `eval.tasks` (all dp ranks)."""

    @classmethod
    def from_context(cls, ctx) -> "DownstreamEval | None":
        e = ctx.cfg.eval
        if not e.tasks_freq or not e.tasks:
            return None
        try:  # loaded once at start: a bad name or path fails now, not hours into the run
            tasks = load_tasks(e.tasks, e.tasks_fewshot, e.tasks_data_dir, e.hellaswag_data)
        except ValueError as err:
            raise ConfigError(f"eval.tasks: {err}", "eval.tasks") from None
        return cls(ctx.cfg, tasks, ctx.parallel_dims.dp_group)

    def __init__(self, cfg, tasks, group=None):
        self.cfg, self.tasks, self.group = cfg, tasks, group

    def on_step_end(self, ctx, step: int, metrics: dict) -> StepReport | None:
        e = self.cfg.eval
        if step % e.tasks_freq:
            return None
        t0 = time.perf_counter()
        result = evaluate(ctx.module.model, ctx.tokenizer, self.tasks, ctx.device,
                          e.tasks_limit, self.cfg.job.seed, e.tasks_batch_size, self.group,
                          ctx.module.autocast)
        accs = " | ".join(f"{n} {t.acc:.3f}" for n, t in result.tasks.items())
        logger.info("downstream step %d: CORE %.4f | %s | %.1fs", step, result.core, accs,
                    time.perf_counter() - t0)
        return StepReport(scalars=result.scalars())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m torchllm.eval.downstream",
        description="CORE-style downstream accuracy of a checkpoint, per task and centered.",
        epilog=OVERRIDES_HELP, allow_abbrev=False,
    )
    add = parser.add_argument
    add("--checkpoint", required=True, help=CHECKPOINT_HELP)
    add("--tasks", help=f"comma-separated, 'name' or 'name:K' (K-shot); default eval.tasks, "
                        f"else {','.join(DEFAULT_TASKS)}; known: {', '.join(TASKS)}")
    add("--data-dir", help="folder of local task copies (default: eval.tasks_data_dir)")
    add("--limit", type=int, help="rows per task (-1 = all; default eval.tasks_limit)")
    add("--shots", type=int, help="shots for tasks without ':K' (default eval.tasks_fewshot)")
    add("--batch-size", type=int, help="items per forward (default eval.tasks_batch_size)")
    add("--seed", type=int, help="few-shot example seed (default job.seed)")
    add("--json", help="write the per-task results and CORE score to this file")
    add("--device", default="auto", help="auto (CUDA when available), cpu or cuda")
    init_logger()
    try:
        args, overrides = parse_args_and_overrides(parser, argv, hints={"--data": (
            "the folder of task copies is --data-dir DIR (HellaSwag: DIR/hellaswag.jsonl), "
            "HellaSwag's official file --eval.hellaswag_data=FILE")})
        device = inference_device(args.device)
        init_distributed(device)
        model, cfg, tokenizer = load_for_inference(args.checkpoint, device, overrides)
        e = cfg.eval
        entries = args.tasks.split(",") if args.tasks else (e.tasks or list(DEFAULT_TASKS))
        data_dir = e.tasks_data_dir if args.data_dir is None else args.data_dir
        shots = e.tasks_fewshot if args.shots is None else args.shots
        tasks = load_tasks(entries, shots, data_dir, e.hellaswag_data)
    except (FileNotFoundError, ValueError) as err:  # ConfigError is a ValueError
        logger.error("error: %s", err)
        return 2
    limit = e.tasks_limit if args.limit is None else args.limit
    seed = cfg.job.seed if args.seed is None else args.seed
    result = evaluate(model, tokenizer, tasks, device, limit, seed,
                      args.batch_size or e.tasks_batch_size)
    if rank_and_world()[0] == 0:
        print(f"checkpoint {args.checkpoint}")
        print(result.table())
        if args.json:
            out = {**result.to_json(), "checkpoint": str(args.checkpoint), "seed": seed}
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(out, indent=1))
            print(f"wrote {args.json}")
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    exit_process(main())
