"""Whether one opened step fits this run: the list of small checks that features register.

A resume reads a step in four phases, `open -> fit -> read -> apply` (restore.py); "fit" is
this module's. Each check is a function of one `Fit` (the step, this run's record, what the
resume is asked to load) that either says nothing, refuses (a ConfigError: one line naming
the key to change), or adjusts the load: leaves a state out (`exclude`), swaps in templates to
read into (`states`), adds an action run at apply (`on_apply`), or leaves a hint for a later
check's refusal (`hints`). Checks run in the order registered, in two phases: "marker" checks
before the state dicts are built (they see only the marker and config), "states" checks after.

This module and the rest of checkpoint/resume import no feature: the features (the vocabulary
stage, LoRA, the data identity, the global batch, the model family) register their checks in
torchllm/checkpoint/fits.py, which the checkpoint package imports first (any import of
torchllm.checkpoint.* runs it), so the checks are in place wherever a resume can happen.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

PHASES = ("marker", "states")


@dataclass
class Fit:
    """One step about to be read, as the fit checks see it (and may adjust it)."""

    step: Any  # checkpoint/step.Step, opened
    cfg: Any  # the checkpoint config section
    run_info: dict  # this run's record: tokenizer, data, config_toml, global_batch_size
    resume: bool  # this run's own step (else a new run's initial load)
    exclude: list[str]  # the states not to load
    states: dict[str, dict] = field(default_factory=dict)  # key -> state dict to read into
    on_apply: list[Callable[[dict], None]] = field(default_factory=list)  # run on `states`
    hints: list[tuple[str, str]] = field(default_factory=list)  # (message, key) to refuse with

    @property
    def where(self) -> str:
        return str(self.step.path)


Check = Callable[[Fit], None]
CHECKS: dict[str, list[tuple[str, Check]]] = {phase: [] for phase in PHASES}


def register(name: str, check: Check, phase: str = "states") -> Check:
    """Add `check` to the fit (a name registered again replaces its check, in its place)."""
    if phase not in PHASES:
        raise ValueError(f"fit check {name!r}: phase {phase!r} is not one of {PHASES}")
    unregister(name)
    CHECKS[phase].append((name, check))
    return check


def unregister(name: str) -> None:
    for phase in PHASES:
        CHECKS[phase][:] = [(n, c) for n, c in CHECKS[phase] if n != name]


def registered() -> list[str]:
    """The names of the registered checks, in the order they run."""
    return [name for phase in PHASES for name, _ in CHECKS[phase]]


def run_checks(fit: Fit, phase: str) -> None:
    for _, check in list(CHECKS[phase]):
        check(fit)
