"""The training loader over an endless batch dataset, tied to its dp layout.

torchdata's StatefulDataLoader when it is installed (it checkpoints loader workers' positions).
Without torchdata (e.g. an offline GPU image) and with data.num_workers = 0, a plain in-process
DataLoader does: the dataset itself then holds the exact position (it updates its state as it
yields each batch, and nothing is prefetched).
"""

from __future__ import annotations

import warnings

import torch

from torchllm.config.job_config import ConfigError
from torchllm.data.packing.chat import processed_tokens
from torchllm.log import logger


def _stateful_loader_class():
    """torchdata's StatefulDataLoader, or None when torchdata is not installed."""
    try:
        from torchdata.stateful_dataloader import StatefulDataLoader
    except ImportError:
        return None
    return StatefulDataLoader


class TrainLoader:
    """Yields ready batches (the dataset batches itself); never runs out.

    `state_dict()` adds the data-parallel rank and degree to the loader's state: the batches a
    rank reads depend on the degree, so resuming under another degree is refused rather than
    silently reading a different data order.

    Each batch carries its own `processed_tokens` (a 0-dim tensor): the input tokens the model
    processes, all of them but a packed chat batch's padding (`packed_chat`: the data reads
    conversations); throughput, MFU and tokens seen count these.
    """

    def __init__(self, dataset, dp_rank: int, dp_degree: int, num_workers: int,
                 prefetch_factor: int, pin_memory: bool, packed_chat: bool = False):
        self.dataset, self.dp_rank, self.dp_degree = dataset, dp_rank, dp_degree
        self.packed_chat = packed_chat
        self.num_workers = num_workers
        stateful = _stateful_loader_class()
        self.stateful = stateful is not None  # torchdata's loader (else an in-process one)
        if stateful is None and num_workers:
            raise ConfigError(
                f"data.num_workers = {num_workers} needs torchdata (its StatefulDataLoader "
                "resumes loader workers exactly), which is not installed; install torchdata or "
                "set data.num_workers = 0", "data.num_workers",
            )
        kwargs = dict(batch_size=None, num_workers=num_workers, pin_memory=pin_memory,
                      prefetch_factor=prefetch_factor if num_workers else None,
                      persistent_workers=False,
                      # Its own generator: each iter() draws a worker base seed, which must not
                      # come from the global torch RNG (a resume calls iter() after restoring it).
                      generator=torch.Generator().manual_seed(0))
        if stateful is None:
            self.loader = torch.utils.data.DataLoader(dataset, **kwargs)
            return
        with warnings.catch_warnings():  # torchdata 0.11 calls a deprecated torch API here
            warnings.filterwarnings("ignore", message="'set_vital' is deprecated")
            self.loader = stateful(dataset, **kwargs)

    def __iter__(self):
        return CountedBatches(iter(self.loader), self.packed_chat)

    def close(self, iterator) -> None:
        """Stop the worker processes behind `iterator` (one of this loader's) now. Left to the
        garbage collector, an iterator held in a reference cycle (a Trainer's) is finalized
        after its queues and joins each worker until torch's 5 s timeout: 5 s per worker in
        every process that builds Trainers (notebooks, tests). A no-op without workers."""
        iterator = getattr(iterator, "inner", iterator)  # (CountedBatches: the loader's own)
        shutdown = getattr(iterator, "_shutdown_workers", None)  # what its __del__ calls
        if shutdown is not None:
            shutdown()

    def state_dict(self) -> dict:
        state = (self.loader.state_dict() if self.stateful
                 else {"dataset_state": self.dataset.state_dict()})
        return {"dp_rank": self.dp_rank, "dp_degree": self.dp_degree,
                "num_workers": self.num_workers,
                "batch_size": getattr(self.dataset, "batch_size", None), "loader": state}

    def peer_state_dict(self) -> dict:
        """What a peer replica group may take of this loader's state (a heal): the position
        without this rank's identity (`dp_rank`: the receiver keeps its own part of the data,
        at the same count). ConfigError when the position is this group's own (a streamed
        source's offset): a relaunched group could not take it from a peer."""
        if not getattr(self.dataset, "position_is_a_count", lambda: False)():
            raise ConfigError(
                "fault_tolerance.enable with a streamed data source is not supported: a "
                "stream's position is its own group's, and a relaunched group could not take "
                "it from a peer; use window sources (local files, shards:, embedded, mixtures "
                "of them)", "fault_tolerance.enable")
        state = self.state_dict()
        del state["dp_rank"]  # the sender's
        return state

    def load_peer_state_dict(self, state: dict) -> None:
        """A peer's position (peer_state_dict), read into this rank's own part of the data."""
        self.load_state_dict({**state, "dp_rank": self.dp_rank})

    def load_state_dict(self, state: dict) -> None:
        """Restore; the next `iter(loader)` continues right after the last saved batch (on
        another data-parallel layout: at the same place in the global batch order)."""
        saved = (state.get("dp_degree"), state.get("dp_rank"), state.get("num_workers"))
        if saved[2] == self.num_workers and (saved[0], saved[1]) != (self.dp_degree,
                                                                     self.dp_rank):
            if self._relayout(state):
                return
        if saved != (self.dp_degree, self.dp_rank, self.num_workers):
            raise ConfigError(
                f"the data loader state was saved with data-parallel degree {saved[0]}, rank "
                f"{saved[1]}, data.num_workers {saved[2]}; this run has degree {self.dp_degree}, "
                f"rank {self.dp_rank}, num_workers {self.num_workers}. Resume with the same "
                "parallelism and data.num_workers, or add 'dataloader' to "
                "checkpoint.exclude_from_loading to start the data order afresh (the batches "
                "trained so far are then read again)"
            )
        if self.stateful:
            self.loader.load_state_dict(state["loader"])
            return
        # Without torchdata: the dataset's own state, which torchdata also records (with
        # num_workers = 0) under the same key.
        if "dataset_state" not in state["loader"]:
            raise ConfigError(
                "the data loader state has no dataset position readable without torchdata; "
                "install torchdata to resume it, or add 'dataloader' to "
                "checkpoint.exclude_from_loading to start the data order afresh"
            )
        self.dataset.load_state_dict(state["loader"]["dataset_state"])

    def _relayout(self, state: dict) -> bool:
        """Continue the global batch order from a position saved on another data-parallel
        layout; False when it cannot be (the caller refuses in one line).

        Batch n of rank r reads windows [(n * degree + r) * batch, ...) of one order that does
        not depend on the layout (data/windows.py, data/mixture.py), so `yielded` batches of
        `batch` sequences on `degree` ranks are the first yielded * batch * degree windows of
        that order, whoever read them: this layout continues at that window. It needs the
        position to be the dataset's count alone (no loader workers, no streamed source) and
        the count to fall on a batch of this layout."""
        dataset_state = state.get("loader", {}).get("dataset_state")
        batch = state.get("batch_size")
        mine = getattr(self.dataset, "batch_size", None)
        if self.num_workers or not isinstance(dataset_state, dict) or \
                set(dataset_state) != {"yielded"} or not isinstance(batch, int) or not mine:
            return False
        windows = int(dataset_state["yielded"]) * batch * int(state["dp_degree"])
        per_batch = mine * self.dp_degree
        if windows % per_batch:
            return False
        self.dataset.load_state_dict({"yielded": windows // per_batch})
        if self.dp_rank == 0:
            logger.info("data order continued on another layout: saved on %d data-parallel "
                        "ranks x %d sequences, now %d x %d, from sequence %d of the global "
                        "order", state["dp_degree"], batch, self.dp_degree, mine, windows)
        return True


class CountedBatches:
    """The loader's batches, each with its `processed_tokens` (TrainLoader's doc)."""

    def __init__(self, inner, packed_chat: bool):
        self.inner, self.packed_chat = inner, packed_chat

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        batch = next(self.inner)
        batch["processed_tokens"] = torch.tensor(processed_tokens(batch, self.packed_chat))
        return batch
