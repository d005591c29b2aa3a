"""Callbacks: optional behaviour hung off the training loop through one small interface.

The loop in `train.py` knows the events below and nothing about the features behind them
(validation, samples, downstream evals, profilers, guards, ...). A feature is a `Callback`
subclass with a `from_trainer(trainer)` constructor that returns None when its config turns it
off; `train.CALLBACKS` lists the classes, in the order their events run.

Events (every rank calls every event; a callback that does distributed work must therefore do
it on every rank):
- `on_train_start(trainer)`            after loading, before the first step
- `on_step_end(trainer, step, metrics)` after each optimizer step; may return an `EvalReport`-like
                                        object with `.scalars` (TensorBoard) and `.texts`
- `on_exception(trainer, step, exc)`   a step raised (e.g. out of memory); the exception re-raises
- `on_train_end(trainer)`              always, also after an exception (like `finally`)

A callback with state that must survive a restart implements `state_dict()` /
`load_state_dict()` and sets `checkpoint_key`; the trainer saves it with the checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class StepReport:
    """What a callback reports after a step: TensorBoard scalars and text, by tag."""

    scalars: dict[str, float] = field(default_factory=dict)
    texts: dict[str, str] = field(default_factory=dict)

    def update(self, other: "StepReport | None") -> None:
        if other is not None:
            self.scalars.update(other.scalars)
            self.texts.update(other.texts)


class Callback:
    """Base class: every event is a no-op; override the ones a feature needs."""

    checkpoint_key: str | None = None  # set (and implement state_dict) to be checkpointed

    @classmethod
    def from_trainer(cls, trainer: Any) -> "Callback | None":
        """Build from a Trainer (its cfg, model, device, ...); None when the config disables it."""
        raise NotImplementedError

    def on_train_start(self, trainer: Any) -> None:
        pass

    def on_step_end(self, trainer: Any, step: int, metrics: dict) -> StepReport | None:
        return None

    def on_exception(self, trainer: Any, step: int, exc: BaseException) -> None:
        pass

    def on_train_end(self, trainer: Any) -> None:
        pass


def build_callbacks(classes, trainer: Any) -> list[Callback]:
    """Instantiate each enabled callback class (in order) for `trainer`."""
    return [cb for cb in (cls.from_trainer(trainer) for cls in classes) if cb is not None]
