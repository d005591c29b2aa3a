"""Peak CPU tensor memory, measured from the allocator's own reports to the torch profiler.

RSS cannot answer "how many bytes of tensors were alive at the peak": it includes the Python
heap, libraries, and pages glibc keeps after a free. With `profile_memory=True` the profiler
records one `[memory]` event per CPU tensor allocation (+bytes) and per free (-bytes) of a block
allocated while it was on. Summing them in time order gives the net bytes allocated since the
window opened; its maximum plus the tensors already alive when it opened (counted directly) is
the peak tensor memory of the window. Costly (every allocation is recorded): use it on a few
steps that are not timed.
"""

from __future__ import annotations

import torch
from torch import nn
from torch._C._autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

from torchllm.metrics.memory import _local_bytes


def live_tensor_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of this rank's parameters, gradients, buffers and optimizer state (no duplicates)."""
    seen, total = set(), 0
    tensors = [*model.parameters(), *model.buffers()]
    tensors += [p.grad for p in model.parameters() if p.grad is not None]
    tensors += [v for s in optimizer.state.values() for v in s.values()
                if isinstance(v, torch.Tensor)]
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        key = local.untyped_storage().data_ptr()
        if key not in seen and local.device.type == "cpu":
            seen.add(key)
            total += _local_bytes(t)
    return total


STEADY = "benchlib.steady"


def net_allocation_peak(kineto_events) -> int:
    """The max of the running sum of CPU `[memory]` events (see allocation_peak)."""
    return allocation_peak(kineto_events)[0]


def ops_at(kineto_events, t_ns: int | None, n: int = 6) -> list[str]:
    """The innermost `n` ops (and record_function ranges) running at time `t_ns`."""
    if t_ns is None:
        return []
    ops = [e for e in kineto_events if e.name() not in ("[memory]", STEADY)
           and e.start_ns() <= t_ns <= e.end_ns()]
    ops.sort(key=lambda e: e.end_ns() - e.start_ns())
    return [e.name()[:80] for e in ops[:n]]


def allocation_peak(kineto_events) -> tuple[int, int | None]:
    """(max, its time) of the running sum of CPU `[memory]` events (bytes allocated minus freed).

    The sum runs over the whole window; the max is taken inside the `STEADY` ranges when there
    are any (so one-off allocations of the first step, such as DDP's initial weight broadcast,
    do not count, while what it left behind, such as the optimizer state, does). Reads the raw
    events (nanosecond timestamps): the summarized `prof.events()` folds most of them into the
    op that allocated, losing the order of allocations and frees.
    """
    mem = [e for e in kineto_events
           if e.name() == "[memory]" and e.device_type() == DeviceType.CPU]
    mem.sort(key=lambda e: e.start_ns())
    ranges = [(e.start_ns(), e.end_ns()) for e in kineto_events if e.name() == STEADY]
    running = peak = 0
    when = None
    for e in mem:
        running += e.nbytes()
        t = e.start_ns()
        if (not ranges or any(lo <= t <= hi for lo, hi in ranges)) and running > peak:
            peak, when = running, t
    return peak, when


class PeakTensorMemory:
    """`with PeakTensorMemory(baseline) as m: ...` then `m.peak_bytes`: baseline + net peak.

    `baseline` is the bytes of tensors alive when the window opens (see `live_tensor_bytes`);
    tensors allocated before and freed inside the window are not subtracted (the profiler
    does not know their size), so open it where such frees are few: a step's start, with the
    gradients already freed by `zero_grad(set_to_none=True)`.
    """

    def __init__(self, baseline_bytes: int):
        self.baseline_bytes = baseline_bytes
        self.peak_bytes: int | None = None
        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)

    @staticmethod
    def steady():
        """Mark a range (e.g. a steady-state step) as the one whose peak counts."""
        return record_function(STEADY)

    def __enter__(self) -> "PeakTensorMemory":
        self._prof.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._prof.__exit__(*exc)
        if exc[0] is None:
            events = self._prof.profiler.kineto_results.events()
            self.net_peak_bytes, when = allocation_peak(events)
            self.peak_bytes = self.baseline_bytes + self.net_peak_bytes
            self.peak_ops = ops_at(events, when)  # where in the step the peak came
