"""Where scalar metrics go besides the console: TensorBoard event files and, optionally, W&B.

Which ranks write: rank 0 only (`metrics.rank_0_only`, the default), else every rank into its
own folder (`rank_<r>`) so per-rank throughput and memory can be compared.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from torchllm.log import logger


class TensorBoardWriter:
    """Scalars into `folder`, flushed after every logging step so a live TensorBoard follows."""

    def __init__(self, folder: Path):
        from torch.utils.tensorboard import SummaryWriter

        folder.mkdir(parents=True, exist_ok=True)
        self.folder = folder
        self.writer = SummaryWriter(log_dir=str(folder))

    def write(self, step: int, scalars: dict[str, float]) -> None:
        for tag, value in scalars.items():
            self.writer.add_scalar(tag, value, step)
        self.writer.flush()

    def write_text(self, step: int, texts: dict[str, str]) -> None:
        for tag, text in texts.items():
            self.writer.add_text(tag, text, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbWriter:
    def __init__(self, wandb, project: str, run_name: str, run_dir: Path, config, rank: int,
                 per_rank: bool):
        self.wandb = wandb
        self.run = wandb.init(
            project=project,
            name=f"{run_name}-rank{rank}" if per_rank else run_name,
            group=run_name if per_rank else None,
            dir=str(run_dir),
            config=dataclasses.asdict(config),
        )

    def write(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log(scalars, step=step)

    def write_text(self, step: int, texts: dict[str, str]) -> None:
        self.run.log({tag: self.wandb.Html(f"<pre>{text}</pre>") for tag, text in texts.items()},
                     step=step)

    def close(self) -> None:
        self.run.finish()


def build_writers(cfg, run_name: str, run_dir: Path, rank: int) -> list:
    """The writers this rank uses (none on ranks other than 0 under rank_0_only)."""
    mcfg = cfg.metrics
    if mcfg.rank_0_only and rank != 0:
        return []
    per_rank = not mcfg.rank_0_only
    writers = []
    if mcfg.enable_tensorboard:
        folder = Path(cfg.job.dump_folder) / mcfg.tb_folder / run_name
        writers.append(TensorBoardWriter(folder / f"rank_{rank}" if per_rank else folder))
    if mcfg.enable_wandb:
        try:
            import wandb
        except ImportError:
            logger.warning("metrics.enable_wandb = true but wandb is not installed "
                           "(pip install wandb); logging without it")
        else:
            writers.append(WandbWriter(wandb, mcfg.wandb_project, run_name, run_dir, cfg, rank,
                                       per_rank))
    return writers
