"""One benchmark variant on one rank: the Trainer's own loop, observed, never re-implemented.

    torchrun --nproc_per_node N -m benchlib.worker OUT_DIR [--section.key=value ...]
    (PYTHONPATH: the checkout and benchmarks/, as benchlib.worker_env() sets it)

The launcher (`python benchmarks/bench_parallel.py`) starts this under torchrun with the variant's
overrides. It wraps three of the Trainer's methods to record, per step, the wall time and the
loss the trainer logs, the training-state bytes (read between backward and zero_grad), and on
CPU the peak tensor memory of step 2 (steps 1-2 are profiled, so that what step 1 leaves
behind counts; both are warm-up, not timed; the CPU allocator counts every thread's frees from
the worker's start: benchlib/tensor_memory.py).
Each rank writes `rank{R}.json` to OUT_DIR; the launcher aggregates them.
"""

from __future__ import annotations

import json
import resource
import sys
from pathlib import Path

import torch

from benchlib.tensor_memory import (PeakTensorMemory, count_every_thread,
                                   live_tensor_bytes)
from torchllm.log import init_logger
from torchllm.metrics.memory import training_state_bytes
from torchllm.parallel import destroy_distributed
from torchllm.ranks import rank, world_size
from torchllm.run.process_exit import exit_process
from torchllm.tools.estimate_memory import estimate_memory
from torchllm.train import Trainer, trainer_from_args

PROFILED_STEPS = 2  # step 1 creates the optimizer state; step 2 is the steady state


class StepRecorder:
    """Wraps a Trainer's train_step, metrics.before_clip and metrics.log to record each step."""

    def __init__(self, trainer: Trainer):
        self.trainer = trainer
        self.step_times: list[float] = []
        self.losses: list[float] = []
        self.state_bytes: dict[str, int] = {}
        self.cuda_peak = {"allocated": 0, "reserved": 0}
        self.tensor_memory: PeakTensorMemory | None = None
        self._wrap("train_step", trainer, self._train_step)
        self._wrap("before_clip", trainer.metrics, self._before_clip)
        self._wrap("log", trainer.metrics, self._log)

    def _wrap(self, name: str, obj, wrapper) -> None:
        original = getattr(obj, name)
        setattr(obj, name, lambda *a, **k: wrapper(original, *a, **k))

    def _train_step(self, original):
        step, cpu = self.trainer.step, self.trainer.device.type == "cpu"
        if cpu and step == 1:
            baseline = live_tensor_bytes(self.trainer.model, self.trainer.optimizer)
            self.tensor_memory = PeakTensorMemory(baseline).__enter__()
        try:
            if self.tensor_memory and step == PROFILED_STEPS:
                with self.tensor_memory.steady():
                    return original()
            return original()
        finally:
            if self.tensor_memory and step == min(PROFILED_STEPS, self.trainer.cfg.training.steps):
                self.tensor_memory.__exit__(None, None, None)

    def _before_clip(self, original, step):
        for k, v in training_state_bytes(self.trainer.model, self.trainer.optimizer).items():
            self.state_bytes[k] = max(self.state_bytes.get(k, 0), v)
        return original(step)

    def _log(self, original, step, m, step_time):
        self.step_times.append(step_time)
        self.losses.append(m["loss"])
        device = self.trainer.device
        if device.type == "cuda":
            # Read before the logger resets the peaks on its logging steps.
            self.cuda_peak["allocated"] = max(self.cuda_peak["allocated"],
                                              torch.cuda.max_memory_allocated(device))
            self.cuda_peak["reserved"] = max(self.cuda_peak["reserved"],
                                             torch.cuda.max_memory_reserved(device))
        return original(step, m, step_time)


def result(trainer: Trainer, rec: StepRecorder, world_size: int) -> dict:
    tcfg = trainer.cfg.training
    out = {
        "rank": rank(),
        "world_size": world_size,
        "device": str(trainer.device),
        "step_times_s": rec.step_times,
        "losses": rec.losses,
        "tokens_per_step": trainer.global_batch * tcfg.seq_len,
        "flops_per_token": trainer.flops_per_token,
        "peak_flops": trainer.peak_flops,
        "dtype": str(trainer.peak.cpu.dtype).removeprefix("torch.")
        if getattr(trainer.peak, "cpu", None) is not None else None,
        "threads": torch.get_num_threads(),
        # A CPU peak measured on a busy machine gives no MFU in the tables (flops.CPUPeak).
        "peak_quiet": getattr(trainer.peak.cpu, "quiet", True),
        "state_bytes": rec.state_bytes,
        "rss_peak_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "estimate": estimate_memory(trainer.cfg, trainer.model_args, world_size),
    }
    # This rank's own estimate: that of its pipeline stage (pp is the mesh's outer dimension).
    pp = out["estimate"]["pp"]
    out["estimate_rank"] = out["estimate"]["ranks"][rank() // (world_size // pp)]
    if trainer.device.type == "cuda":
        out["cuda_max_allocated_bytes"] = rec.cuda_peak["allocated"]
        out["cuda_max_reserved_bytes"] = rec.cuda_peak["reserved"]
    elif rec.tensor_memory is not None and rec.tensor_memory.peak_bytes is not None:
        out["tensor_peak_bytes"] = rec.tensor_memory.peak_bytes
        out["tensor_peak_ops"] = rec.tensor_memory.peak_ops
        out["tensor_peak_live"] = rec.tensor_memory.peak_live
        out["allocator_peak_bytes"] = rec.tensor_memory.allocator_peak_bytes
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    out_dir, rest = Path(argv[0]), argv[1:]
    init_logger()
    count_every_thread()  # before any tensor: every free counted, on every thread
    trainer = trainer_from_args(rest)
    if trainer is None:
        return 2
    try:
        rec = StepRecorder(trainer)
        trainer.train()
        world = world_size()
        res = result(trainer, rec, world)
    finally:
        destroy_distributed()
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"rank{res['rank']}.json").write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    exit_process(main())
