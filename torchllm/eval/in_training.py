"""Evaluation during training: validation loss, text samples and HellaSwag on their schedules."""

from __future__ import annotations

import contextlib
import copy
import re
import time
from typing import Callable, ContextManager, Iterable

import torch
from torch import nn

from torchllm.callbacks import Callback, StepReport
from torchllm.config import ConfigError
from torchllm.data import Batching, Tokenizer, build_data, whole_stream
from torchllm.data.dataset import as_key, parse_dataset
from torchllm.data.token_stream import count
from torchllm.data.windows import ValWindows
from torchllm.eval import hellaswag
from torchllm.eval.generation import completion_text, generate
from torchllm.eval.validation import ValidationStopped, validate
from torchllm.log import logger
from torchllm.loss import IGNORE_INDEX
from torchllm.optim.batch_ramp import global_batch_size
from torchllm.parallel import any_rank


class HeldOutBatches:
    """This data-parallel rank's batches of a fixed held-out set: the first `n` windows of
    `windows` (a map-style dataset of window dicts), rank r taking the r-th contiguous share of
    ceil(n / dp degree), in batches of `batch_size`.

    Every rank runs the same number of full-size batches (sharded models run collectives in
    forward, pipeline schedules want whole batches): places past the end of a share are filled
    with copies of window 0 whose targets are all IGNORE_INDEX, which count for nothing. So the
    windows scored, and the token-weighted loss summed over the ranks, are the same whatever the
    number of ranks or the batch size. Iterating again starts over.
    """

    per_source: list = []  # a mixture's [(label, HeldOutBatches)]: one validation loss each
    tag = "val"  # TensorBoard tags <tag>/loss, ...: val/<name> for a dedicated validation set

    def __init__(self, windows, n: int, batch_size: int, dp_rank: int, dp_degree: int,
                 label: str = "", note: str = ""):
        self.windows, self.n, self.batch_size = windows, n, batch_size
        share = -(-n // dp_degree)
        self.ids = range(min(n, dp_rank * share), min(n, (dp_rank + 1) * share))
        self.batches = -(-share // batch_size)
        self.label, self.note = label, note  # what the run header calls the set; a remark

    def __len__(self) -> int:
        return self.batches

    def scored_tokens(self) -> int:
        """The target tokens one validation scores, over all ranks: those of the first n
        windows (what val/tokens and eval.loss report)."""
        return sum(int((self.windows[i]["targets"] != IGNORE_INDEX).sum())
                   for i in range(self.n))

    def describe(self) -> str:
        """The run header's validation part: the set as a validation scores it (its scored
        tokens and windows, each mixture source's too)."""
        text = self.size()
        if self.per_source:
            text += " (" + "; ".join(f"{b.label} {b.size()}" for _, b in self.per_source) + ")"
        return f"validation {self.label}: {text}"

    def size(self) -> str:
        text = f"{self.scored_tokens():,} tokens scored in {count(self.n, 'window')}"
        return f"{text}, {self.note}" if self.note else text

    def padding(self) -> dict[str, torch.Tensor]:
        row = {k: v.clone() for k, v in self.windows[0].items()}
        row["targets"].fill_(IGNORE_INDEX)
        return row

    def __iter__(self):
        for b in range(self.batches):
            rows = [self.windows[i] for i in self.ids[b * self.batch_size:
                                                      (b + 1) * self.batch_size]]
            rows += [self.padding() for _ in range(self.batch_size - len(rows))]
            yield {k: torch.stack([r[k] for r in rows]) for k in rows[0]}


def validation_loader(dcfg, vcfg, tcfg, batching: Batching, tokenizer: Tokenizer, val_loader,
                      dp_rank: int, dp_degree: int, global_batch: int | None = None
                      ) -> tuple[Iterable, int]:
    """(this rank's batches, batches per validation) of the held-out set: the first
    validation.steps x global batch windows of the training data's held-out split (all of it
    when smaller; `val_loader`: build_data's held-out loader, whose dataset holds the whole
    split on every rank), or of the Hugging Face split validation.split names, or a dedicated
    validation.dataset read whole up to its token budget (`token_budget`). See HeldOutBatches
    for how the ranks share it; its `describe()` is the run header's validation part.

    `global_batch`: sequences per optimizer step (default: training.global_batch_size resolved
    for `dp_degree`), so the held-out set is the same for every layout with that global batch.
    With validation.split, the first data.val_documents documents of that Hugging Face split
    are the validation set (e.g. a dataset's official "validation" split).

    `dcfg`, `vcfg`, `tcfg`: the [data], [validation] and [training] sections; `batching`: the
    windows build_data cuts (a validation.split's are built here).
    """
    local = tcfg.local_batch_size
    if global_batch is None:
        global_batch = global_batch_size(tcfg, dp_degree)
    name = vcfg.dataset or dcfg.dataset
    if not vcfg.enable or (name == dcfg.dataset and not vcfg.split):
        windows = val_loader.dataset
        n = min(len(windows), vcfg.steps * global_batch)
        what = (f"held-out split of {dcfg.dataset}" if not dcfg.sources else
                f"held-out splits of the {len(dcfg.sources)} sources")
        batches = HeldOutBatches(windows, n, local, dp_rank, dp_degree, what,
                                 held_out_note(len(windows), n))
        parts = getattr(windows, "datasets", None)  # a mixture: each source's held-out split
        if vcfg.enable and dcfg.sources and parts and len(parts) == len(dcfg.sources):
            batches.per_source = [
                (source_label(i, src.dataset),
                 HeldOutBatches(part, min(len(part), vcfg.steps * global_batch), local,
                                dp_rank, dp_degree, source_label(i, src.dataset)))
                for i, (src, part) in enumerate(zip(dcfg.sources, parts)) if len(part)]
        return batches, len(batches)
    other = copy.deepcopy(dcfg)
    other.dataset = name
    key = "validation.split" if vcfg.split else "validation.dataset"
    if vcfg.split:
        if not parse_dataset(other).splits_by_name:
            raise ConfigError(
                f"validation.split = {vcfg.split!r} applies to Hugging Face datasets (hf:... or "
                f"a named one), not {name!r}; for local files or shards point validation.dataset "
                "at the validation data instead", key,
            )
        other.hf_split = vcfg.split
    try:
        if vcfg.split:
            windows = build_data(other, vcfg, batching, tokenizer, dp_rank, dp_degree)[1].dataset
            n = min(len(windows), vcfg.steps * global_batch)
        else:
            budget, why = token_budget(vcfg, tcfg, global_batch)
            stream = whole_stream(other, tokenizer, budget)
            whole = ValWindows(stream, tcfg.seq_len)
            windows = SpreadWindows(whole, budget // whole.window)
            n = len(windows)
    except ConfigError as e:
        said = str(as_key(e, key))
        raise ConfigError(said if said.startswith(f"{key} = ") else
                          f"{key} = {vcfg.split or name!r}: {said}", key) from None
    note = ""
    if vcfg.split:
        label = f"{name} split {vcfg.split!r}"
        note = held_out_note(len(windows), n)
    else:
        label = name
        if getattr(stream, "truncated", False):  # a stream: read in order, its size unknown
            note = f"its first {budget:,} tokens only (a stream, read from its start): {why}"
        elif n < len(windows.whole):
            note = (f"spread evenly over all its {count(len(windows.whole), 'window')} "
                    f"({len(stream):,} tokens): {why}")
        else:
            note = f"all of it ({len(stream):,} tokens)"
    batches = HeldOutBatches(windows, n, local, dp_rank, dp_degree, label, note)
    if not vcfg.split:
        batches.tag = f"val/{set_label(name)}"
    return batches, len(batches)


def spread_ids(available: int, n: int) -> list[int]:
    """n window ids spread evenly over `available` windows (all of them when n >= available):
    window floor(i * available / n) for i < n, the first at 0. A pure function of the two
    counts, so every rank and every layout scores the same windows."""
    if n >= available:
        return list(range(available))
    return [i * available // n for i in range(max(n, 0))]


class SpreadWindows(torch.utils.data.Dataset):
    """A dedicated validation set's scored windows: `n` of `whole`'s (a ValWindows of the whole
    set) spread evenly over it (spread_ids), in set order; `whole` keeps the set's size."""

    def __init__(self, whole, n: int):
        self.whole, self.ids = whole, spread_ids(len(whole), n)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.whole[self.ids[i]]


def set_label(spec: str) -> str:
    """A dedicated validation set's TensorBoard name: its spec's last part, e.g. 'val.jsonl',
    'fineweb-edu' (tags val/<name>/loss, perplexity, tokens)."""
    tail = spec.rstrip("/").rsplit("/", 1)[-1].rsplit(":", 1)[-1]
    return re.sub(r"[^0-9A-Za-z_.-]+", "_", tail)[:40] or "set"


# In-training validation's share of the run's compute when validation.max_tokens = 0 (auto):
# a forward pass costs about a third of a training step per token.
AUTO_VALIDATION_SHARE = 0.05


def token_budget(vcfg, tcfg, global_batch: int) -> tuple[int, str]:
    """(tokens read from a dedicated validation.dataset, why that many): validation.max_tokens,
    or with 0 (auto) the tokens whose validations (every validation.freq steps and after the
    last) cost about AUTO_VALIDATION_SHARE of the training steps' compute, at least one global
    batch of windows (`vcfg`, `tcfg`: the [validation] and [training] sections)."""
    if vcfg.max_tokens:
        return vcfg.max_tokens, f"validation.max_tokens = {vcfg.max_tokens:,}"
    validations = tcfg.steps // vcfg.freq + (tcfg.steps % vcfg.freq != 0)
    train_tokens = tcfg.steps * global_batch * tcfg.seq_len
    budget = int(3 * AUTO_VALIDATION_SHARE * train_tokens / max(validations, 1))
    budget = max(budget, global_batch * (tcfg.seq_len + 1))
    return budget, (f"validation.max_tokens = 0 (auto): {validations} validation"
                    f"{'s' if validations != 1 else ''} ~{AUTO_VALIDATION_SHARE:.0%} of the "
                    "run's compute; set it to read more")


def held_out_note(available: int, n: int) -> str:
    """The header's remark on a held-out split scored in part (validation.steps)."""
    if n >= available:
        return ""
    return f"the first {n:,} of its {available:,} windows: validation.steps x global batch"


def source_label(i: int, spec: str) -> str:
    """A mixture source's TensorBoard name: its index and its spec's last part, e.g.
    '1_tinyshakespeare', '0_docs.jsonl' (val/loss/<label>)."""
    tail = spec.rstrip("/").rsplit("/", 1)[-1].rsplit(":", 1)[-1]
    return f"{i}_{re.sub(r'[^0-9A-Za-z_.-]+', '_', tail)[:40]}"


EvalReport = StepReport  # what one step's evaluation produced


class Evaluator(Callback):
    """Runs each enabled evaluation when its frequency divides the step (and validation also
    after the last step). Every rank must call `after_step`: the work is split over `group`."""

    @classmethod
    def from_context(cls, ctx) -> "Evaluator":
        cfg, dims = ctx.cfg, ctx.parallel_dims
        val_batches = ctx.val_batches  # built for the run header
        if val_batches is None:
            val_batches, _ = validation_loader(
                cfg.data, cfg.validation, cfg.training,
                Batching.of(cfg.training, cfg.job, cfg.model), ctx.tokenizer, ctx.val_loader,
                dims.dp_rank, dims.dp_degree, ctx.global_batch)
        evaluator = cls(cfg.validation, cfg.eval, ctx.module.model, ctx.tokenizer, ctx.device,
                        val_batches, ctx.module.autocast, group=dims.dp_group,
                        val_steps=len(val_batches), pipeline=ctx.module.pipeline,
                        seed=cfg.job.seed, last_step=cfg.training.steps)
        evaluator.stop_requested = lambda: ctx.stops.stop_signal is not None
        return evaluator

    # Whether a stop signal arrived (the trainer's StopConditions); a validation then ends at
    # its next batch, agreed over the ranks, and the run saves and exits after this step.
    stop_requested: Callable[[], bool] = staticmethod(lambda: False)
    PROGRESS_MIN_BATCHES = 20  # validations of this many batches or more log each tenth

    def on_step_end(self, ctx, step: int, metrics: dict) -> EvalReport:
        report = self.after_step(step, self.last_step)
        loss = report.scalars.get(self.loss_tag)  # val/loss, or val/<name>/loss
        if loss is not None:
            self.last_val = (step, loss)  # the end-of-run block shows it
            ctx.train_state.best_val_loss = min(ctx.train_state.best_val_loss, loss)
            ctx.stops.target_loss(step, loss, self.vcfg.stop_at_loss)
        return report

    @property
    def loss_tag(self) -> str:
        """The validation loss's TensorBoard tag: val/loss for a held-out split, val/<name>/loss
        for a dedicated validation.dataset (HeldOutBatches.tag)."""
        return f"{getattr(self.val_batches, 'tag', 'val')}/loss"

    def __init__(
        self,
        vcfg,
        ecfg,
        model: nn.Module,
        tokenizer: Tokenizer,
        device: torch.device,
        val_batches: Iterable[dict[str, torch.Tensor]],
        autocast: Callable[[], ContextManager] = contextlib.nullcontext,
        group=None,
        val_steps: int | None = None,
        pipeline=None,
        *,
        seed: int,
        last_step: int,
    ):
        """`vcfg`, `ecfg`: the [validation] and [eval] sections; `val_steps`: batches per
        validation (default validation.steps); `pipeline`: the trainer's pipeline stages
        (pp > 1), which compute the validation loss; `seed`: job.seed (the samples'); `last_step`:
        training.steps (validation also runs after it)."""
        self.pipeline = pipeline
        self.last_val: tuple[int, float] | None = None  # (step, loss) of the last validation
        self.vcfg, self.ecfg, self.seed, self.last_step = vcfg, ecfg, seed, last_step
        self.model, self.tokenizer, self.device = model, tokenizer, device
        self.val_batches, self.autocast, self.group = val_batches, autocast, group
        self.val_steps = vcfg.steps if val_steps is None else val_steps
        if vcfg.enable and next(iter(val_batches), None) is None:
            raise ConfigError(
                "validation.enable = true but the validation data has no window of "
                "training.seq_len + 1 tokens; give it more tokens (data.val_fraction, "
                "validation.dataset / max_tokens) or lower training.seq_len",
                "validation.enable",
            )
        self.hellaswag_examples = None
        if ecfg.hellaswag_freq:
            # Loaded once at start, so a bad path fails now rather than hours into the run.
            try:
                self.hellaswag_examples = hellaswag.load_examples(
                    ecfg.hellaswag_data, ecfg.hellaswag_limit,
                    hint="set it to an official-format .jsonl file (--eval.hellaswag_data=FILE)",
                )
            except (FileNotFoundError, ValueError) as e:
                raise ConfigError(f"eval.hellaswag_data: {e}", "eval.hellaswag_data") from None

    def after_step(self, step: int, last_step: int) -> EvalReport:
        report = EvalReport()
        vcfg, ecfg = self.vcfg, self.ecfg
        if vcfg.enable and (step % vcfg.freq == 0 or step == last_step):
            report.scalars.update(self.validation(step))
        if ecfg.sample_freq and step % ecfg.sample_freq == 0:
            report.texts.update(self.samples(step))
        if ecfg.hellaswag_freq and step % ecfg.hellaswag_freq == 0:
            report.scalars.update(self.hellaswag(step))
        return report

    def validation(self, step: int) -> dict[str, float]:
        t0 = time.perf_counter()

        def stop() -> bool:
            return any_rank(bool(self.stop_requested()), self.device)

        def progress(done: int, steps: int) -> None:
            tenth = max(steps // 10, 1)
            if steps >= self.PROGRESS_MIN_BATCHES and done % tenth == 0:
                spent = time.perf_counter() - t0
                logger.info("validation step %d: %d/%d batches (%d%%), %.1fs, ~%.0fs left",
                            step, done, steps, 100 * done // steps, spent,
                            spent * (steps - done) / done)

        try:
            m = validate(self.model, self.val_batches, self.val_steps, self.device,
                         self.group, self.autocast, self.pipeline, stop=stop, progress=progress)
        except ValidationStopped as e:
            logger.warning("validation step %d stopped by the stop signal after %d of %d "
                           "batches (not recorded); saving and stopping", step, e.done, e.steps)
            return {}
        tag = getattr(self.val_batches, "tag", "val")
        logger.info("validation step %d: loss %.4f | perplexity %.2f | %s tokens%s | %.1fs", step,
                    m["val/loss"], m["val/perplexity"], f"{int(m['val/tokens']):,}",
                    "" if tag == "val" else f" of {self.val_batches.label} ({tag}/loss)",
                    time.perf_counter() - t0)
        if tag != "val":  # a dedicated set: its tags name it
            return {f"{tag}/{key.removeprefix('val/')}": v for key, v in m.items()}
        per_source = getattr(self.val_batches, "per_source", [])
        for label, batches in per_source:  # a mixture: each source's own held-out windows
            one = validate(self.model, batches, len(batches), self.device, self.group,
                           self.autocast, self.pipeline)
            m[f"val/loss/{label}"] = one["val/loss"]
        if per_source:
            logger.info("validation step %d by source: %s", step, " | ".join(
                f"{label} {m[f'val/loss/{label}']:.4f}" for label, _ in per_source))
        return m

    def samples(self, step: int) -> dict[str, str]:
        """Complete eval.prompts; the same seed every time, so samples compare across steps."""
        e = self.ecfg
        prompts = [self.tokenizer.encode(p, bos=True) for p in e.prompts]
        with self.autocast():
            # A fixed number of forward passes (no early stop): sharded ranks stay in step.
            outputs = generate(self.model, prompts, e.max_new_tokens, e.temperature, e.top_k,
                               e.top_p, self.seed, self.tokenizer.eos_id,
                               stop_early=False, device=self.device)
        texts = {}
        for i, (prompt, prompt_ids, ids) in enumerate(zip(e.prompts, prompts, outputs)):
            # Decoded after the prompt, as the whole sequence decodes: cut at EOS, no specials.
            completion = completion_text(self.tokenizer, prompt_ids, ids)
            texts[f"samples/{i}"] = f"**{prompt}**{completion}"  # TensorBoard renders markdown
            logger.info("sample step %d [%d]: %r -> %r", step, i, prompt, completion)
        return texts

    def hellaswag(self, step: int) -> dict[str, float]:
        t0 = time.perf_counter()
        result = hellaswag.evaluate(self.model, self.tokenizer, self.hellaswag_examples,
                                    self.device, self.ecfg.hellaswag_batch_size, self.group,
                                    self.autocast)
        logger.info("hellaswag step %d: acc %.4f | acc_norm %.4f | %d examples | %.1fs "
                    "(random ~%.2f)", step, result.acc, result.acc_norm, result.n,
                    time.perf_counter() - t0, hellaswag.RANDOM_BASELINE)
        return result.scalars()
