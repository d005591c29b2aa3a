"""Realized tokens per data source of a mixture, logged as the run goes (a loop callback over
torchllm.data.mixture.MixtureBatches, which counts what each source served)."""

from __future__ import annotations

from torchllm.callbacks import Callback, StepReport
from torchllm.data.mixture import MixtureBatches
from torchllm.log import logger


class MixtureLog(Callback):
    """Realized tokens per source, every metrics.log_freq steps: `data/source<i>/tokens` and
    `data/source<i>/fraction` (of all training tokens so far) in TensorBoard."""

    @classmethod
    def from_context(cls, ctx) -> "MixtureLog | None":
        ds = getattr(ctx.train_loader, "dataset", None)
        return cls(ds, ctx) if isinstance(ds, MixtureBatches) else None

    def __init__(self, mixture: MixtureBatches, ctx):
        self.mixture, self.ramp = mixture, ctx.batch_ramp
        self.slots_per_batch = mixture.batch_size * mixture.dp_degree
        self.window_tokens = ctx.cfg.training.seq_len
        self.log_freq = ctx.cfg.metrics.log_freq
        self.batches = 0  # batches (micro-batches) this rank has consumed
        for i, (name, w) in enumerate(zip(mixture.names, mixture.weights)):
            logger.info("data source %d: %s, weight %.4f", i, name, w)

    def on_train_start(self, ctx) -> None:
        # A resumed run consumed the batches of every earlier step (the loader state says so).
        self.batches = sum(self.ramp.accum_steps(s) for s in range(1, ctx.step + 1))

    def on_step_end(self, ctx, step: int, metrics: dict) -> StepReport | None:
        self.batches += self.ramp.accum_steps(step)
        if step % self.log_freq:
            return None
        served = self.mixture.served(self.batches * self.slots_per_batch)
        scalars = {}
        for i, count in enumerate(served):
            scalars[f"data/source{i}/tokens"] = float(count * self.window_tokens)
            scalars[f"data/source{i}/fraction"] = float(count / served.sum())
        return StepReport(scalars=scalars)

    def on_train_end(self, ctx) -> None:
        for s, n in sorted(self.mixture.rollovers.items()):
            if n > 1:
                logger.info("data source %d (%s) ran out %d times in this launch", s,
                            self.mixture.names[s], n)
