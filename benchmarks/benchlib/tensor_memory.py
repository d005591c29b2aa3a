"""Peak CPU tensor memory, measured from the CPU allocator's own count of live tensor bytes.

RSS cannot answer "how many bytes of tensors were alive at the peak": it includes the Python
heap, libraries, and pages glibc keeps after a free. torch's default CPU allocator keeps a count
of the bytes it has handed out and not yet taken back (c10's ProfiledCPUMemoryReporter); with
`FLAGS_caffe2_report_cpu_memory_usage` on (`count_every_thread`) it updates that count on every
allocation and free, whichever thread makes it, and with `profile_memory=True` the profiler
records it (`total_allocated`) on each allocation and free of the thread it watches. The maximum
of that count inside the measured range, less its value when the window opened, plus the
tensors already alive then (counted directly), is the peak tensor memory of the window.

Without the flag the count moves only on the profiled thread: a tensor whose last reference
dies on a gloo worker thread (an asynchronous collective's buffer) was never subtracted, and a
rank could measure 4-50 MiB high (issue 62). What it still cannot see: memory that is not a
tensor of the CPU allocator (oneDNN scratch, gloo's own buffers, numpy arrays), and a peak that
rises and falls on another thread between two allocations of the watched one. Costly (every
allocation is recorded): use it on a few steps that are not timed.
"""

from __future__ import annotations

import ctypes
import os

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile, record_function

from torchllm.metrics.memory import _local_bytes

FLAG = "FLAGS_caffe2_report_cpu_memory_usage"


def count_every_thread() -> bool:
    """Turn on the CPU allocator's count on every thread (c10's flag, a global of libc10); from
    then on every tensor it allocates is counted until freed, on any thread. Call it before the
    tensors to measure exist (a block allocated before is never subtracted when freed). False
    where this torch has no such flag (then only the profiled thread's frees are seen)."""
    try:
        lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so"))
        ctypes.c_bool.in_dll(lib, FLAG).value = True
    except (OSError, ValueError):
        return False
    return True


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


def _events(results):
    """Every event of the profiler's tree (ops, record_function ranges, allocations)."""
    stack = list(results.experimental_event_tree())
    while stack:
        e = stack.pop()
        yield e
        stack.extend(e.children)


def ops_at(events, t_ns: int | None, n: int = 6) -> list[str]:
    """The innermost `n` ops (and record_function ranges) running at time `t_ns`."""
    if t_ns is None:
        return []
    ops = [e for e in events if e.name not in ("[memory]", STEADY)
           and e.start_time_ns <= t_ns <= e.end_time_ns]
    ops.sort(key=lambda e: e.end_time_ns - e.start_time_ns)
    return [e.name[:80] for e in ops[:n]]


def allocation_peak(events) -> tuple[int, int | None]:
    """(max, its time) of the CPU allocator's live bytes since the window opened.

    The count (`total_allocated` of each CPU allocation or free the profiler recorded) is the
    allocator's own, moved by every thread's frees under `count_every_thread`; its value before
    the window's first event is subtracted. The max is taken inside the `STEADY` ranges when
    there are any (so one-off allocations of the first step, such as DDP's initial weight
    broadcast, do not count, while what it left behind, such as the optimizer state, does).
    """
    mem = sorted((e for e in events if e.name == "[memory]"
                  and e.extra_fields.device.type == "cpu"), key=lambda e: e.start_time_ns)
    if not mem:
        return 0, None
    ranges = [(e.start_time_ns, e.end_time_ns) for e in events if e.name == STEADY]
    f = mem[0].extra_fields
    opened = f.total_allocated - f.alloc_size
    peak, when = 0, None
    for e in mem:
        t, running = e.start_time_ns, e.extra_fields.total_allocated - opened
        if (not ranges or any(lo <= t <= hi for lo, hi in ranges)) and running > peak:
            peak, when = running, t
    return peak, when


def live_at(events, t_ns: int | None, top: int = 24) -> list[tuple[int, str]]:
    """What was alive at `t_ns` among the window's allocations, as (bytes, where) summed by
    where each was made (the innermost ops of its allocation, innermost first), largest first:
    the per-allocation view of a peak (which phase, which tensors). Allocations freed on another
    thread are not seen as freed (the profiler records its own thread's frees), nor those made
    before the window opened."""
    if t_ns is None:
        return []
    live: dict[int, tuple[int, str]] = {}
    mem = sorted((e for e in events if e.name == "[memory]" and e.start_time_ns <= t_ns
                  and e.extra_fields.device.type == "cpu"), key=lambda e: e.start_time_ns)
    for e in mem:
        f = e.extra_fields
        if f.alloc_size < 0:
            live.pop(f.ptr, None)
            continue
        names, parent = [], e.parent
        while parent is not None and len(names) < 3:
            if parent.name != STEADY:
                names.append(parent.name[:60])
            parent = parent.parent
        live[f.ptr] = (f.alloc_size, " < ".join(names))
    by_where: dict[str, int] = {}
    for size, where in live.values():
        by_where[where] = by_where.get(where, 0) + size
    return sorted(((b, w) for w, b in by_where.items()), reverse=True)[:top]


def net_allocation_peak(results) -> int:
    """The max of the allocator's live bytes since the window opened (see allocation_peak)."""
    return allocation_peak(list(_events(results)))[0]


class PeakTensorMemory:
    """`with PeakTensorMemory(baseline) as m: ...` then `m.peak_bytes`: baseline + net peak.

    `baseline` is the bytes of tensors alive when the window opens (see `live_tensor_bytes`).
    Opening one turns on `count_every_thread`; tensors allocated before that and freed inside
    the window are not subtracted (the allocator never counted them), so call it before the
    model is built where that matters (benchlib.worker does), or open the window where such
    frees are few: a step's start, with the gradients already freed by `zero_grad`.
    """

    def __init__(self, baseline_bytes: int):
        self.baseline_bytes = baseline_bytes
        self.peak_bytes: int | None = None
        self.every_thread = count_every_thread()
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
            events = list(_events(self._prof.profiler.kineto_results))
            self.net_peak_bytes, when = allocation_peak(events)
            self.peak_bytes = self.baseline_bytes + self.net_peak_bytes
            self.peak_ops = ops_at(events, when)  # where in the step the peak came
            self.peak_live = live_at(events, when)  # what the window's allocations held there
            # every CPU tensor alive at the peak, as the allocator counts them (all of them
            # when count_every_thread ran before any was made)
            first = next((e.extra_fields for e in sorted(
                (e for e in events if e.name == "[memory]"), key=lambda e: e.start_time_ns)), None)
            self.allocator_peak_bytes = (None if first is None else
                                         first.total_allocated - first.alloc_size
                                         + self.net_peak_bytes)
