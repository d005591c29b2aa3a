"""Guards against a diverging run: non-finite loss or gradient norm, and loss spikes.

Policies (`metrics.guard_policy`):
  warn       log the event with its step and apply the update anyway;
  skip_step  drop the update: the optimizer does not step (its moments and step count are
             untouched) while the LR schedule still advances, so the schedule stays a function
             of the step number, as after a resume; after `max_consecutive_skips` skipped steps
             in a row the run stops, since the problem is not transient;
  stop       save a checkpoint (when the trainer gave a hook) and raise TrainingStopped, which
             the trainer turns into a non-zero exit with the reason. The stopping step counts
             as a dropped update (its counters too), and the trainer's hook saves it as one
             (the LR schedule advanced past it).

A checkpoint saved while updates are being skipped (or by a stop) is marked unhealthy (see
`unhealthy()`): a resume prefers the last checkpoint saved before the skipping began, and
retention never deletes that one for the unhealthy ones (torchllm.checkpoint.resume.checkpointer). A
resume from the stop's own save (when it is the only checkpoint) continues exactly like
`skip_step`.

The loss given to `check` must be the same on every rank (the dp-reduced loss): then every rank
takes the same decision and replicas never diverge.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Callable, NoReturn

from torchllm.log import logger


class TrainingStopped(RuntimeError):
    """Raised by the `stop` policy; the message is the reason."""


class LossGuard:
    def __init__(self, mcfg, save_checkpoint: Callable[[int], None] | None = None):
        """`save_checkpoint(step)` is called before stopping; `step` is the step whose update
        was not applied (model and optimizer hold the state after step - 1); the hook saves it
        as a dropped step (LR schedule advanced), like `skip_step` would have."""
        self.policy = mcfg.guard_policy
        self.spike_factor = mcfg.loss_spike_factor
        self.max_consecutive_skips = mcfg.max_consecutive_skips
        self.save_checkpoint = save_checkpoint
        self.recent = deque(maxlen=mcfg.loss_spike_window)  # losses of applied updates
        self.counts = {"nonfinite": 0, "spikes": 0, "skipped_steps": 0}
        self.consecutive_skips = 0
        self.skipping_since: int | None = None  # first step of the current run of skips
        self.stopped = False

    def unhealthy(self) -> str | None:
        """Why a checkpoint saved now must not be a resume candidate, or None: updates are
        being skipped (the weights gave a bad step and nothing changed them since), or the guard
        stopped the run."""
        if not self.consecutive_skips and not self.stopped:
            return None
        since = f" since step {self.skipping_since}" if self.skipping_since else ""
        what = "the guard stopped the run" if self.stopped else "updates were being skipped"
        return f"saved when {what} ({self.consecutive_skips} skipped in a row{since})"

    def state_dict(self) -> dict:
        """The running loss window and counters: a resumed run must judge spikes the same way."""
        return {"recent": list(self.recent), "counts": dict(self.counts),
                "consecutive_skips": self.consecutive_skips,
                "skipping_since": self.skipping_since}

    def load_state_dict(self, sd: dict) -> None:
        self.recent.clear()
        self.recent.extend(sd["recent"])
        self.counts.update(sd["counts"])
        self.consecutive_skips = sd["consecutive_skips"]
        self.skipping_since = sd.get("skipping_since")

    def problem(self, loss: float, grad_norm: float) -> tuple[str, str] | None:
        """(kind, description) of what is wrong with this step, or None."""
        if not math.isfinite(loss) or not math.isfinite(grad_norm):
            return "nonfinite", f"non-finite loss {loss} or gradient norm {grad_norm}"
        if self.spike_factor and len(self.recent) == self.recent.maxlen:
            mean = sum(self.recent) / len(self.recent)
            if loss > self.spike_factor * mean:
                return "spikes", (
                    f"loss spike {loss:.4f} > {self.spike_factor:g} x running mean {mean:.4f} "
                    f"(last {len(self.recent)} steps)"
                )
        return None

    def check(self, step: int, loss: float, grad_norm: float) -> bool:
        """Whether to apply this step's update; logs events, raises TrainingStopped on `stop`."""
        found = self.problem(loss, grad_norm)
        if found is None:
            self.consecutive_skips, self.skipping_since = 0, None
            self.recent.append(loss)
            return True
        kind, what = found
        self.counts[kind] += 1
        if self.policy == "warn":
            logger.warning("guard: step %d: %s; update applied (guard_policy = warn)", step, what)
            if math.isfinite(loss):
                self.recent.append(loss)
            return True
        self.counts["skipped_steps"] += 1  # skip_step drops it; stop saves it as dropped
        self.consecutive_skips += 1
        if self.skipping_since is None:
            self.skipping_since = step
        if self.policy == "skip_step":
            limit = self.max_consecutive_skips
            if limit and self.consecutive_skips >= limit:
                self.stop(step, f"{what}; {self.consecutive_skips} steps in a row skipped "
                                f"(metrics.max_consecutive_skips = {limit})")
            logger.warning("guard: step %d: %s; update dropped (guard_policy = skip_step)",
                           step, what)
            return False
        self.stop(step, what)

    def stop(self, step: int, what: str) -> NoReturn:
        reason = f"step {step}: {what}"
        logger.error("guard: %s; stopping", reason)
        self.stopped = True
        if self.save_checkpoint is not None:
            self.save_checkpoint(step)
        raise TrainingStopped(reason)
