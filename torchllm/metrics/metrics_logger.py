"""MetricsLogger: what the trainer reports every `metrics.log_freq` steps, and where it goes.

The trainer calls, within a step:  loss_stats → before_clip → around_update(optimizer.step),
then `log(step, metrics, step_time)` after it. Work beyond the loss reduction (per-group norms,
update ratios, state sizes, the max over ranks) happens on logging steps only, and on every rank
alike, since some of it is collective. Tags, units and formulas: docs/metrics.md.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from torchllm.log import logger
from torchllm.metrics.flops import mfu_stats
from torchllm.metrics.memory import GiB, memory_stats, reset_peak, training_state_bytes
from torchllm.metrics.norms import grad_norms, track_update, watched_groups
from torchllm.metrics.progress import Progress, format_duration
from torchllm.metrics.reduce import loss_stats
from torchllm.metrics.writers import build_writers
from torchllm.ranks import rank, world_size


class MetricsLogger:
    def __init__(self, mcfg, steps: int, model: torch.nn.Module,
                 optimizer: torch.optim.Optimizer, device: torch.device, run_name: str,
                 run_dir: Path, tb_folder: Path, flops_per_token: int, peak, guard, group=None,
                 start_step: int = 0, config: dict | None = None):
        """`mcfg`: the [metrics] section; `steps`: training.steps; `tb_folder`: the run's
        TensorBoard folder (torchllm.config.paths.tensorboard_folder); `peak`: a flops.Peak (or
        None: no MFU); `group`: the data-parallel process group (None = the default group, if
        any); `start_step`: the step the run resumed from (0 = a fresh start); `config`: the
        run's config as a dict (W&B records it)."""
        self.log_freq, self.total_steps = mcfg.log_freq, steps
        self.model, self.optimizer, self.device, self.group = model, optimizer, device, group
        self.flops_per_token, self.peak, self.guard = flops_per_token, peak, guard
        self.groups = watched_groups(model)
        self.writers = build_writers(mcfg, tb_folder, run_name, run_dir, rank(), start_step,
                                     config)
        self.progress = Progress(steps, live=mcfg.progress_bar and rank() == 0)
        self.interval = self._empty_interval()

    @staticmethod
    def _empty_interval() -> dict[str, float]:
        return {"steps": 0, "time": 0.0, "data_time": 0.0, "tokens": 0, "trained": 0,
                "loss_sum": 0.0}

    def is_log_step(self, step: int) -> bool:
        return step % self.log_freq == 0 or step in (1, self.total_steps)

    def loss_stats(self, step: int, loss_sum: torch.Tensor, n_tokens: torch.Tensor | int,
                   processed: torch.Tensor | int | None = None) -> dict[str, torch.Tensor]:
        """The dp-reduced loss, trained and processed token counts (+ the max over ranks on
        logging steps), as device tensors: the trainer copies them to the host together with
        the grad norm."""
        return loss_stats(loss_sum, n_tokens, self.is_log_step(step), self.group, processed)

    def before_clip(self, step: int) -> dict[str, float]:
        """On logging steps: raw per-group gradient norms and the training state's size."""
        if not self.is_log_step(step):
            return {}
        out = grad_norms(self.groups)
        for name, n in training_state_bytes(self.model, self.optimizer).items():
            out[f"memory/{name}_gib"] = n / GiB
        return out

    def around_update(self, step: int, out: dict):
        """Wrap optimizer.step(): on logging steps adds param norms and update ratios to `out`."""
        if not self.is_log_step(step):
            return contextlib.nullcontext()
        return track_update(self.groups, out)

    def scalars(self, m: dict) -> dict[str, float]:
        """Every tag written for a logging step (interval averages over the steps since the
        last log for times and throughput; values of this step for everything else)."""
        iv = self.interval
        world = world_size()
        tokens_per_s = iv["tokens"] / iv["time"]
        out = {"loss/avg": m["loss"]}
        if "loss_max" in m:
            out["loss/max"] = m["loss_max"]
        out["optim/lr"] = m["lr"]
        out["grad_norm/total"] = m["grad_norm"]
        out.update({k: v for k, v in m.items() if "/" in k})
        out.update({
            "throughput/tokens_per_s": tokens_per_s,
            "throughput/tokens_per_s_device": tokens_per_s / world,
            "throughput/trained_tokens_per_s": iv["trained"] / iv["time"],
            "time/step_s": iv["time"] / iv["steps"],
            "time/data_s": iv["data_time"] / iv["steps"],
            "time/data_pct": 100 * iv["data_time"] / iv["time"],
        })
        achieved = tokens_per_s / world * self.flops_per_token
        peak = self.peak.check(achieved) if self.peak is not None else None
        out.update({f"perf/{k}": v for k, v in
                    mfu_stats(tokens_per_s / world, self.flops_per_token, peak).items()})
        out.update({f"memory/{k}": v for k, v in memory_stats(self.device).items()})
        out.update({f"guard/{k}": v for k, v in self.guard.counts.items()})
        return {k: float(v) for k, v in out.items()}

    def interval_loss(self) -> float:
        """The loss over every step since the last log (token-weighted: total / tokens)."""
        iv = self.interval
        return iv["loss_sum"] / iv["trained"] if iv["trained"] else float("nan")

    def console_line(self, step: int, s: dict[str, float], skipped: bool,
                     loss: float | None = None) -> str:
        """`loss`: the console's loss, the interval's mean (default: this step's)."""
        parts = [
            f"step {step:>5}/{self.total_steps}",
            f"loss {s['loss/avg'] if loss is None else loss:.4f}",
            f"lr {s['optim/lr']:.2e}",
            f"grad_norm {s['grad_norm/total']:.3f}",
            f"tok/s/device {s['throughput/tokens_per_s_device']:,.0f}",
            f"step {1000 * s['time/step_s']:.0f}ms (data {s['time/data_pct']:.0f}%)",
        ]
        if "perf/mfu_pct" in s:
            parts.append(f"mfu {s['perf/mfu_pct']:.1f}%")
        if "memory/rss_gib" in s:
            parts.append(f"rss {s['memory/rss_gib']:.2f}GiB")
        else:
            parts.append(f"mem {s['memory/max_active_gib']:.1f}GiB "
                         f"({s['memory/max_active_pct']:.0f}%) "
                         f"reserved {s['memory/max_reserved_gib']:.1f}GiB")
        eta = self.progress.eta_s()
        if eta is not None and step < self.total_steps:
            parts.append(f"eta {format_duration(eta)}")
        if skipped:
            parts.append("update skipped")
        return " | ".join(parts)

    def log(self, step: int, m: dict, step_time: float) -> dict[str, float] | None:
        """Account for one finished step; on logging steps write every scalar and return them."""
        iv = self.interval
        iv["steps"] += 1
        iv["time"] += step_time
        iv["data_time"] += m["data_time"]
        iv["tokens"] += m["tokens"]
        trained = m.get("trained_tokens", m["tokens"])
        iv["trained"] += trained
        iv["loss_sum"] += m["loss"] * trained
        self.progress.update(step)
        if not self.is_log_step(step):
            return None
        scalars = self.scalars(m)
        # The console's loss is the interval's mean (steps since the last log), so a noisy
        # step does not stand for log_freq steps; TensorBoard's loss/avg is this step's own,
        # loss/interval the console's (the report's loss plot draws it).
        scalars["loss/interval"] = self.interval_loss()
        self.progress.clear()
        logger.info(self.console_line(step, scalars, m.get("skipped", False),
                                      loss=scalars["loss/interval"]))
        for writer in self.writers:
            writer.write(step, scalars)
        self.interval = self._empty_interval()
        reset_peak(self.device)  # the next line's peaks are those of its own interval
        return scalars

    def log_eval(self, step: int, scalars: dict[str, float], texts: dict[str, str]) -> None:
        """Evaluation results (validation, HellaSwag scalars; generated samples as text)."""
        for writer in self.writers:
            if scalars:
                writer.write(step, scalars)
            if texts:
                writer.write_text(step, texts)

    def close(self) -> None:
        self.progress.close()
        for writer in self.writers:
            writer.close()
