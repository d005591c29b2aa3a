"""The report hook: what a run says and leaves when it ends.

- On logging and validation steps it adds `progress/tokens_seen` to TensorBoard (the report
  draws loss against tokens).
- Rank 0 keeps `RUN/report/run.json` (the header, hardware, wall time over all launches; read
  and written through a torchllm.store.Store of the run folder: a link there is never
  followed, and replaced by the new file) and,
  when the loop ends (also after an error), writes `RUN/report/report.md` and its plots
  (`metrics.report`); a report that cannot be written is one warning, never a failed run.
- When the loop ends without an error, every rank logs the end-of-run block: steps, tokens,
  wall time, final/best validation loss, where the checkpoint, events, log and report are, and
  the next commands with this run's paths filled in.
"""

from __future__ import annotations

import json
import math
import shlex
import time
from pathlib import Path

import torch

from torchllm.callbacks import Callback, StepReport
from torchllm.checkpoint.layout import complete_steps, step_dir
from torchllm.config.job_config import reads_conversations
from torchllm.config.paths import checkpoint_folder, tensorboard_folder
from torchllm.eval.in_training import Evaluator
from torchllm.log import logger, run_log_path
from torchllm.metrics.progress import format_duration
from torchllm.ranks import rank, world_size
from torchllm.report.events import INFO_NAME, MAX_BYTES, TOKENS_TAG
from torchllm.report.markdown import one_line
from torchllm.store import Store


def hardware(device: torch.device) -> str:
    world = world_size()
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        from torchllm.precision import cpuinfo

        name = f"CPU {cpuinfo('model name') or 'unknown'} ({torch.get_num_threads()} threads)"
    return f"{world} x {name}" if world > 1 else name


class RunReport(Callback):
    @classmethod
    def from_context(cls, ctx) -> "RunReport":
        return cls(ctx)

    def __init__(self, ctx):
        self.cfg, self.run_dir = ctx.cfg, Path(ctx.run_dir)
        self.store = Store(self.run_dir)  # report/run.json, report.md and the plots
        self.rank0 = rank() == 0
        self.error: BaseException | None = None
        self.losses: list[float] = []
        self.last_val: tuple[int, float] | None = None

    # -- events --------------------------------------------------------------------------
    def on_train_start(self, ctx) -> None:
        self.start = time.perf_counter()
        # This launch's tokens are its steps' own: a replica group that heals from a live one
        # takes that group's token count (its whole run so far) during its first step.
        self.launch_tokens = 0
        if self.rank0:
            info = self._info()
            # Every launch's hardware, in order, each distinct one once (a run resumed on
            # another machine or rank count shows both, not the last launch's alone).
            here = hardware(ctx.device)
            earlier = info.get("hardware_launches") or ([info["hardware"]]
                                                        if info.get("hardware") else [])
            info.update(header=ctx.header, hardware=here,
                        hardware_launches=[h for h in earlier if h != here] + [here])
            info["launches"] = info.get("launches", 0) + 1
            self._write_info(info)
            self.wall_before = info.get("wall_s", 0.0)

    def on_step_end(self, ctx, step: int, metrics: dict) -> StepReport | None:
        self.losses.append(metrics["loss"])
        self.launch_tokens += int(metrics.get("tokens", 0))
        evaluator = ctx.callback(Evaluator)
        if evaluator is not None and getattr(evaluator, "last_val", None):
            self.last_val = evaluator.last_val
        vcfg = self.cfg.validation
        val_step = vcfg.enable and (step % vcfg.freq == 0 or step == self.cfg.training.steps)
        if ctx.is_log_step(step) or val_step:
            return StepReport(scalars={TOKENS_TAG: float(ctx.train_state.tokens_seen)})
        return None

    def on_exception(self, ctx, step: int, exc: BaseException) -> None:
        self.error = exc

    def on_train_end(self, ctx) -> None:
        elapsed = time.perf_counter() - self.start
        report = None
        if self.rank0:
            info = self._info()
            info["wall_s"] = self.wall_before + elapsed
            info["checkpoint"] = str(self.checkpoint(ctx) or "none")
            self._write_info(info)
            if self.cfg.metrics.report:
                report = self.write_report()
        if self.error is None and self.losses:
            logger.info(self.end_block(ctx, elapsed, report))

    # -- pieces --------------------------------------------------------------------------
    def _info(self) -> dict:
        """What run.json holds ({} when absent, unreadable, a link, oversized, or no record)."""
        try:
            info = json.loads(self.store.read_bytes(INFO_NAME, max_bytes=MAX_BYTES))
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as e:
            logger.warning("report: ignoring %s (%s); it is written again", INFO_NAME,
                           one_line(e))
            return {}
        return info if isinstance(info, dict) else {}

    def _write_info(self, info: dict) -> None:
        try:
            self.store.write_text(INFO_NAME, json.dumps(info, indent=1))
        except OSError as e:
            logger.warning("could not write %s: %s", self.store.where(INFO_NAME), one_line(e))

    def write_report(self) -> Path | None:
        from torchllm.report import write_report

        t0 = time.perf_counter()
        try:
            path, figures = write_report([self.run_dir],  # RUN/report, via the run's Store
                                         command="the run's report hook (metrics.report)")
        except Exception as e:  # noqa: BLE001 - a report never fails the run
            logger.warning("report not written (%s: %s); python -m torchllm.report %s retries",
                           type(e).__name__, one_line(e),
                           self.run_dir)
            return None
        logger.debug("report written in %.1fs (%d plots)", time.perf_counter() - t0, len(figures))
        return path

    def checkpoint(self, ctx) -> Path | None:
        """The newest checkpoint of this run (a save still being written counts)."""
        ccfg = self.cfg.checkpoint
        if not ccfg.enable:
            return None
        folder = checkpoint_folder(self.run_dir, ccfg.folder)
        known, pending = ctx.checkpoints()  # the checkpointer's list: no second listing
        steps = list(known) if known is not None else complete_steps(folder)
        if pending is not None:
            steps.append(pending)
        return step_dir(folder, max(steps)) if steps else None

    def end_block(self, ctx, elapsed: float, report: Path | None) -> str:
        cfg, run = self.cfg, self.run_dir
        tokens = self.launch_tokens
        losses = self.losses
        lines = [
            f"done: step {ctx.step}/{cfg.training.steps}, {len(losses)} steps in "
            f"{elapsed:.1f}s, {tokens:,} tokens ({tokens / max(elapsed, 1e-9):.0f} tok/s); loss "
            f"{losses[0]:.4f} -> {losses[-1]:.4f} (min {min(losses):.4f})"]
        rows = []
        if cfg.validation.enable and self.last_val is not None:
            best = ctx.train_state.best_val_loss
            step, value = self.last_val
            rows.append(("validation", f"loss {value:.4f} at step {step} (perplexity "
                                       f"{math.exp(min(value, 50)):.2f}); best {best:.4f}"))
        elif cfg.validation.enable:
            rows.append(("validation", f"none in this launch (every {cfg.validation.freq} "
                                       "steps and after the last)"))
        else:
            rows.append(("validation", "off (--validation.enable to measure held-out loss)"))
        rows.append(("tokens", f"{ctx.train_state.tokens_seen:,} seen in all "
                               f"({tokens:,} in this launch)"))
        rows.append(("wall time", format_duration(elapsed) + " this launch"))
        ckpt = self.checkpoint(ctx)
        rows.append(("checkpoint", str(ckpt) if ckpt else
                     "none (checkpoint.enable = false: generate, evals and export need one)"))
        if cfg.metrics.enable_tensorboard:
            tb = tensorboard_folder(cfg.job, cfg.metrics, run.name)
            rows.append(("tensorboard", f"{tb}  (tensorboard --logdir {shlex.quote(str(tb.parent))})"))
        log = run_log_path()
        if log is not None:
            rows.append(("log", str(log)))
        if report is not None:
            rows.append(("report", str(report)))
        elif cfg.metrics.report and self.rank0:
            rows.append(("report", "not written (see the warning above)"))
        q = shlex.quote(str(run))
        if ckpt:
            tasks = "" if cfg.eval.tasks else " --tasks arc_easy,copa"
            # A chat-trained run answers questions; a base model completes text.
            ask = ('--chat "Hi! How are you?"' if reads_conversations(cfg.data)
                   else '--prompt "Once upon a time"')
            nxt = [f"python -m torchllm.generate --checkpoint {q} {ask}",
                   f"python -m torchllm.eval.loss --checkpoint {q}  # or --data local:FILE",
                   *evals_offline(cfg.eval, q, tasks),
                   f"python -m torchllm.hf export --checkpoint {q} "
                   f"--out {shlex.quote('hf/' + run.name)}"]
        else:
            nxt = []
        nxt.append(f"python -m torchllm.report {q}" + ("  # redraw, or add runs to compare"
                                                       if report else ""))
        rows += [("next" if i == 0 else "", cmd) for i, cmd in enumerate(nxt)]
        return "\n".join([lines[0], *(f"  {k:<12}{v}" for k, v in rows)])


def evals_offline(ecfg, q: str, tasks: str) -> list[str]:
    """The HellaSwag and downstream commands: with the run's local copies when its [eval]
    section `ecfg` names them (eval.hellaswag_data a file, eval.tasks_data_dir), else the Hub
    form and the offline one."""
    hs = ecfg.hellaswag_data
    if Path(hs).is_file():
        hellaswag = f"python -m torchllm.eval.hellaswag --checkpoint {q} --limit 200 " \
                    f"--data {shlex.quote(hs)}"
    else:
        hellaswag = (f"python -m torchllm.eval.hellaswag --checkpoint {q} --limit 200  "
                     "# downloads it; offline: --data hellaswag_val.jsonl")
    if ecfg.tasks_data_dir:
        downstream = (f"python -m torchllm.eval.downstream --checkpoint {q}{tasks} "
                      f"--data-dir {shlex.quote(ecfg.tasks_data_dir)}")
    else:
        downstream = (f"python -m torchllm.eval.downstream --checkpoint {q}{tasks}  "
                      "# downloads them; offline: --data-dir DIR (docs/evaluation.md)")
    return [hellaswag, downstream]
