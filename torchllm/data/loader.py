"""The training loader: a StatefulDataLoader over an endless batch dataset, tied to its dp layout."""

from __future__ import annotations

import warnings

import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from torchllm.config.job_config import ConfigError


class TrainLoader(StatefulDataLoader):
    """Yields ready batches (the dataset batches itself); never runs out.

    `state_dict()` adds the data-parallel rank and degree to torchdata's state: the batches a
    rank reads depend on the degree, so resuming under another degree is refused rather than
    silently reading a different data order.
    """

    def __init__(self, dataset, dp_rank: int, dp_degree: int, num_workers: int,
                 prefetch_factor: int, pin_memory: bool):
        with warnings.catch_warnings():  # torchdata 0.11 calls a deprecated torch API here
            warnings.filterwarnings("ignore", message="'set_vital' is deprecated")
            super().__init__(
                dataset,
                batch_size=None,
                num_workers=num_workers,
                prefetch_factor=prefetch_factor if num_workers else None,
                pin_memory=pin_memory,
                persistent_workers=False,
                # Its own generator: each iter() draws a worker base seed, which must not come
                # from the global torch RNG (a resume calls iter() after restoring that state).
                generator=torch.Generator().manual_seed(0),
            )
        self.dp_rank, self.dp_degree = dp_rank, dp_degree

    def state_dict(self) -> dict:
        return {"dp_rank": self.dp_rank, "dp_degree": self.dp_degree,
                "num_workers": self.num_workers, "loader": super().state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Restore; the next `iter(loader)` continues right after the last saved batch."""
        saved = (state.get("dp_degree"), state.get("dp_rank"), state.get("num_workers"))
        if saved != (self.dp_degree, self.dp_rank, self.num_workers):
            raise ConfigError(
                f"the data loader state was saved with data-parallel degree {saved[0]}, rank "
                f"{saved[1]}, data.num_workers {saved[2]}; this run has degree {self.dp_degree}, "
                f"rank {self.dp_rank}, num_workers {self.num_workers}. Resume with the same "
                "parallelism and data.num_workers, or add 'dataloader' to "
                "checkpoint.exclude_from_loading to start the data order afresh"
            )
        super().load_state_dict(state["loader"])
