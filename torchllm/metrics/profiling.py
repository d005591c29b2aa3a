"""[profiling]: torch profiler traces and CUDA memory snapshots, around the training loop.

A training-loop callback: start() before the first step, step(n) after each, on_oom(n) when step
n runs out of memory, and stop() at the end.

Traces: every `profile_freq` steps the profiler waits, warms up for `profiler_warmup` steps and
records the last `profiler_active` steps of the window; each rank writes
`<run>/<traces_folder>/iteration_<step>/rank<r>_trace.json` (open in Perfetto or
chrome://tracing). Memory snapshots (CUDA only): the allocator's history is recorded from the
start and dumped every `memory_snapshot_freq` steps and when a step runs out of memory, as
`<run>/<memory_snapshot_folder>/<iteration_N|oom_step_N>/rank<r>_memory_snapshot.pickle`
(open at https://pytorch.org/memory_viz).
"""

from __future__ import annotations

from pathlib import Path

import torch

from torchllm.callbacks import Callback
from torchllm.log import logger

# Allocation events kept in the CUDA allocator's history (a ring buffer, as in PyTorch's docs).
MEMORY_HISTORY_ENTRIES = 100_000


class Profiler(Callback):
    @classmethod
    def from_context(cls, ctx) -> "Profiler":
        from torchllm.ranks import rank

        return cls(ctx.cfg.profiling, ctx.run_dir, ctx.device, rank())

    def on_train_start(self, ctx) -> None:
        self.start()

    def on_step_end(self, ctx, step: int, metrics: dict) -> None:
        self.step(step)

    def on_exception(self, ctx, step: int, exc: BaseException) -> None:
        if isinstance(exc, torch.OutOfMemoryError):
            self.on_oom(step)

    def on_train_end(self, ctx) -> None:
        self.stop()

    def __init__(self, pcfg, run_dir: Path, device: torch.device, rank: int):
        self.cfg, self.run_dir, self.device, self.rank = pcfg, Path(run_dir), device, rank
        self.step_num = 0
        self.torch_profiler = None
        self.snapshots = pcfg.enable_memory_snapshot and device.type == "cuda"
        if pcfg.enable_memory_snapshot and not self.snapshots:
            logger.warning("profiling.enable_memory_snapshot: memory snapshots need CUDA; "
                           "none will be written on %s", device.type)

    def start(self) -> None:
        """Call before the first step."""
        cfg = self.cfg
        if cfg.enable_profiling:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            wait = cfg.profile_freq - cfg.profiler_warmup - cfg.profiler_active
            self.torch_profiler = torch.profiler.profile(
                activities=activities,
                schedule=torch.profiler.schedule(
                    wait=wait, warmup=cfg.profiler_warmup, active=cfg.profiler_active
                ),
                on_trace_ready=self.save_trace,
            )
            self.torch_profiler.start()
        if self.snapshots:
            torch.cuda.memory._record_memory_history(max_entries=MEMORY_HISTORY_ENTRIES)

    def step(self, step: int) -> None:
        """Call after every training step (`step` is the trainer's, which names the files)."""
        self.step_num = step
        if self.torch_profiler is not None:
            self.torch_profiler.step()
        freq = self.cfg.memory_snapshot_freq
        if self.snapshots and freq and step % freq == 0:
            self.dump_snapshot(f"iteration_{step}")

    def save_trace(self, prof) -> None:
        folder = self.run_dir / self.cfg.traces_folder / f"iteration_{self.step_num}"
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"rank{self.rank}_trace.json"
        prof.export_chrome_trace(str(path))
        logger.info("profiler trace written to %s", path)

    def dump_snapshot(self, name: str) -> Path:
        folder = self.run_dir / self.cfg.memory_snapshot_folder / name
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"rank{self.rank}_memory_snapshot.pickle"
        torch.cuda.memory._dump_snapshot(str(path))
        logger.info("CUDA memory snapshot written to %s", path)
        return path

    def on_oom(self, step: int) -> None:
        """Call when `step` raised torch.OutOfMemoryError: dumps what filled the memory."""
        if self.snapshots:
            self.dump_snapshot(f"oom_step_{step}")

    def stop(self) -> None:
        """Call after the last step, also when training ends with an exception."""
        if self.torch_profiler is not None:
            self.torch_profiler.stop()
            self.torch_profiler = None
        if self.snapshots:
            torch.cuda.memory._record_memory_history(enabled=None)
