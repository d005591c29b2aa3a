"""Why a launch stops before training.steps: a signal, a step budget, a time limit, or the
validation loss reaching validation.stop_at_loss.

Preemption (SIGTERM from SLURM/Kubernetes) and Ctrl-C finish the current step, save and exit 0;
`training.stop_after_steps` and `training.time_limit_minutes` do the same. A validation loss at
or below `validation.stop_at_loss` ends the run as its last step would (the final save with its
export options, the report). Ranks see signals
and clocks at slightly different moments, so they agree (any rank stopping stops all): every
rank saves the same step and none waits forever in a collective.
"""

from __future__ import annotations

import signal
import time

import torch

from torchllm.log import logger
from torchllm.parallel import any_rank


_received: list[int] = []  # the stop signals this process's last training received


def stop_signal() -> int | None:
    """The SIGTERM/SIGINT that stopped the last training in this process, if one did (the
    launcher, running a one-process training in its own process, reports it as torchrun's
    agent would)."""
    return _received[-1] if _received else None


class StopConditions:
    def __init__(self, tcfg, device: torch.device, start_time: float):
        self.tcfg, self.device, self.start_time = tcfg, device, start_time
        self.stop_signal: int | None = None
        self.stop_signal_time = 0.0
        self.target_reached: str | None = None  # why the run is done early (target_loss)
        _received.clear()  # (a training before this one in the same process)

    def target_loss(self, step: int, loss: float, target: float) -> None:
        """A validation at `step` measured `loss` (the same on every rank: reduced over them);
        at or below `target` (validation.stop_at_loss, 0 = off) the run is done after this step."""
        if target and loss <= target and self.target_reached is None:
            self.target_reached = (f"validation.stop_at_loss = {target} reached (validation loss "
                                   f"{loss:.4f} at step {step})")

    def on_signal(self, signum, frame) -> None:
        """SIGTERM or Ctrl-C: stop after this step. A second Ctrl-C (later than 1 s) stops now."""
        if self.stop_signal is not None and signum == signal.SIGINT:
            # One Ctrl-C reaches a worker twice (from the terminal, and forwarded by torchrun).
            if time.monotonic() - self.stop_signal_time > 1.0:
                raise KeyboardInterrupt
            return
        self.stop_signal, self.stop_signal_time = signum, time.monotonic()
        _received.append(signum)
        logger.warning("received %s: stopping after this step", signal.Signals(signum).name)

    def install_signal_handlers(self):
        """Handle SIGTERM/SIGINT from now on; returns the function that restores the previous
        handlers (call it when training ends)."""
        previous = {s: signal.signal(s, self.on_signal) for s in (signal.SIGTERM, signal.SIGINT)}

        def restore() -> None:
            for s, handler in previous.items():
                signal.signal(s, handler)

        return restore

    def reason(self, steps_this_launch: int, slowest_step: float) -> str | None:
        """Why this launch should stop now, agreed over the ranks; None to go on."""
        tcfg, reason = self.tcfg, None
        if self.stop_signal is not None:
            reason = f"signal {signal.Signals(self.stop_signal).name}"
        elif tcfg.stop_after_steps and steps_this_launch >= tcfg.stop_after_steps:
            reason = f"training.stop_after_steps = {tcfg.stop_after_steps} reached"
        elif tcfg.time_limit_minutes:
            # Leave room for two more slow steps and the final save before the limit.
            elapsed = time.perf_counter() - self.start_time
            if elapsed + 2 * slowest_step + 60 > 60 * tcfg.time_limit_minutes:
                reason = f"training.time_limit_minutes = {tcfg.time_limit_minutes} nearly reached"
        if any_rank(reason is not None, self.device) and reason is None:
            reason = "another rank is stopping"
        return reason
