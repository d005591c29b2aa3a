"""Callbacks: optional behaviour hung off the training loop through one small interface.

The loop in `train.py` knows the events below and nothing about the features behind them
(validation, samples, downstream evals, profilers, guards, ...). A feature is a `Callback`
subclass with a `from_context(ctx)` constructor that returns None when its config turns it
off; `train.CALLBACKS` lists the classes, in the order their events run.

What a callback (and metrics' header, eval, report, fault tolerance) may read of the run is
`TrainContext`: a frozen record the loop builds once, naming each thing; none of them is handed
the Trainer.

Events (every rank calls every event; a callback that does distributed work must therefore do
it on every rank):
- `on_train_start(ctx)`                after loading, before the first step
- `on_step_end(ctx, step, metrics)`    after each optimizer step; may return an `EvalReport`-like
                                       object with `.scalars` (TensorBoard) and `.texts`
- `on_exception(ctx, step, exc)`       a step raised (e.g. out of memory); the exception re-raises
- `on_train_end(ctx)`                  always, also after an exception (like `finally`)

A callback with state that must survive a restart implements `state_dict()` /
`load_state_dict()` and sets `checkpoint_key`; the trainer saves it with the checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable


@dataclass
class StepReport:
    """What a callback reports after a step: TensorBoard scalars and text, by tag."""

    scalars: dict[str, float] = field(default_factory=dict)
    texts: dict[str, str] = field(default_factory=dict)

    def update(self, other: "StepReport | None") -> None:
        if other is not None:
            self.scalars.update(other.scalars)
            self.texts.update(other.texts)


@dataclass(frozen=True)
class TrainContext:
    """What the loop lets callbacks, the run header, eval, report and fault tolerance read.

    Read-only as a record (no field is reassigned); `train_state` is the one mutable object
    handed out: its counters (best_val_loss) are the run's, saved with each checkpoint.
    Things built after the callbacks (the metrics logger, the checkpointer) are reached through
    the functions at the end, which the loop binds.
    """

    cfg: Any  # JobConfig: the run's resolved config
    run_dir: Path
    device: Any  # torch.device
    parallel_dims: Any  # torchllm.parallel.ParallelDims
    tokenizer: Any
    model_args: Any  # the family's args dataclass
    module: Any  # torchllm.train_module.TrainModule: model, pipeline, optimizer, autocast
    train_loader: Any  # torchllm.data.loader.TrainLoader (its .dataset: the batch source)
    val_loader: Any
    val_batches: Any  # the validation set(s) as a validation scores them; None: validation off
    batch_ramp: Any  # torchllm.optim.batch_ramp.BatchSizeRamp: micro-batches per step
    global_batch: int
    grad_accum_steps: int
    train_state: Any  # torchllm.checkpoint.TrainState: step, tokens_seen, best_val_loss
    stops: Any  # torchllm.run.stopping.StopConditions: stop signals, the validation target
    run_info: dict  # what each checkpoint records and replica groups compare
    header: str = ""  # the run header the loop logged (config changes, model, layout, data)
    # Bound by the loop: whether metrics log at a step; (the complete steps the checkpointer
    # knows, None before it listed; a pending save's step or None); the attached callback of a
    # class, or None; a new batch iterator at the loader's restored position (a heal loaded it).
    is_log_step: Callable[[int], bool] = lambda step: False
    checkpoints: Callable[[], tuple[list[int] | None, int | None]] = lambda: (None, None)
    callback: Callable[[type], Any] = lambda cls: None
    restart_batches: Callable[[], None] = lambda: None

    @property
    def step(self) -> int:
        return self.train_state.step


class Callback:
    """Base class: every event is a no-op; override the ones a feature needs."""

    checkpoint_key: str | None = None  # set (and implement state_dict) to be checkpointed

    @classmethod
    def from_context(cls, ctx: TrainContext) -> "Callback | None":
        """Build from the run's context; None when the config disables it."""
        raise NotImplementedError

    def on_train_start(self, ctx: TrainContext) -> None:
        pass

    def on_step_end(self, ctx: TrainContext, step: int, metrics: dict) -> StepReport | None:
        return None

    def on_exception(self, ctx: TrainContext, step: int, exc: BaseException) -> None:
        pass

    def on_train_end(self, ctx: TrainContext) -> None:
        pass


def build_callbacks(classes, ctx: TrainContext) -> list[Callback]:
    """Instantiate each enabled callback class (in order) for the run `ctx` describes."""
    return [cb for cb in (cls.from_context(ctx) for cls in classes) if cb is not None]
