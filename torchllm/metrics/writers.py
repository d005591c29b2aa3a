"""Where scalar metrics go besides the console: TensorBoard event files and, optionally, W&B.

Which ranks write: rank 0 only (`metrics.rank_0_only`, the default), else every rank into its
own folder (`rank_<r>`) so per-rank throughput and memory can be compared.

A resumed run writes into the same TensorBoard folder, continuing the same curves: its event file
starts with a purge at the first step it runs, so TensorBoard hides what an earlier launch logged
after the checkpoint it resumed from. A fresh start over an earlier run's events is refused
before any writer exists (torchllm.run.rundir).
"""

from __future__ import annotations

from pathlib import Path

from torchllm.log import logger


class TensorBoardWriter:
    """Scalars into `folder`, flushed after every logging step so a live TensorBoard follows.

    The event file is created at the first write (a run that fails before its first step
    leaves none). `start_step`: the step the run resumed from (0 = a fresh start); events an
    earlier launch wrote after it are purged from view.
    """

    def __init__(self, folder: Path, start_step: int = 0):
        self.folder, self.start_step = folder, start_step
        self._writer = None

    @property
    def writer(self):
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self.folder.mkdir(parents=True, exist_ok=True)
            self._writer = SummaryWriter(log_dir=str(self.folder),
                                         purge_step=self.start_step + 1 if self.start_step else None)
        return self._writer

    def write(self, step: int, scalars: dict[str, float]) -> None:
        for tag, value in scalars.items():
            self.writer.add_scalar(tag, value, step)
        self.writer.flush()

    def write_text(self, step: int, texts: dict[str, str]) -> None:
        for tag, text in texts.items():
            self.writer.add_text(tag, text, step)
        self.writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()


class WandbWriter:
    def __init__(self, wandb, project: str, run_name: str, run_dir: Path, config: dict | None,
                 rank: int, per_rank: bool):
        """`config`: the run's whole config as a dict (W&B records it with the run)."""
        self.wandb = wandb
        self.run = wandb.init(
            project=project,
            name=f"{run_name}-rank{rank}" if per_rank else run_name,
            group=run_name if per_rank else None,
            dir=str(run_dir),
            config=config,
        )

    def write(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log(scalars, step=step)

    def write_text(self, step: int, texts: dict[str, str]) -> None:
        self.run.log({tag: self.wandb.Html(f"<pre>{text}</pre>") for tag, text in texts.items()},
                     step=step)

    def close(self) -> None:
        self.run.finish()


def build_writers(mcfg, tb_folder: Path, run_name: str, run_dir: Path, rank: int,
                  start_step: int = 0, config: dict | None = None) -> list:
    """The writers this rank uses, as the [metrics] section `mcfg` says (none on ranks other
    than 0 under rank_0_only).

    `tb_folder`: the run's TensorBoard folder (torchllm.config.paths.tensorboard_folder, the
    layout the config's keys name); `start_step`: the step the run resumed from (0 for a fresh
    start); `config`: the run's config as a dict, which W&B records."""
    if mcfg.rank_0_only and rank != 0:
        return []
    per_rank = not mcfg.rank_0_only
    writers = []
    if mcfg.enable_tensorboard:
        writers.append(TensorBoardWriter(tb_folder / f"rank_{rank}" if per_rank else tb_folder,
                                         start_step))
    if mcfg.enable_wandb:
        try:
            import wandb
        except ImportError:
            logger.warning("metrics.enable_wandb = true but wandb is not installed "
                           "(pip install wandb); logging without it")
        else:
            writers.append(WandbWriter(wandb, mcfg.wandb_project, run_name, run_dir, config,
                                       rank, per_rank))
    return writers
