"""Data mixtures: `[[data.sources]]` (dataset + weight) read as one endless, resumable batch order.

Every window has the same number of tokens, so token fractions are window fractions. The run's
windows are numbered by a global slot g (batch n of rank r holds slots (n·D + r)·B + i, i < B, as
in torchllm.data.windows, so D ranks concatenate to one rank with batch B·D). Which source fills
slot g is fixed by a schedule of PERIOD slots built once from the weights: each source gets its
weight's share of the period (largest remainders), spread by always serving the source furthest
behind its target. Any prefix of the schedule is within one window of every target, so any run
of consecutive slots is within two windows of its target fractions.

Each source reads its own windows in its own order: the j-th window it serves is window
j mod N of its epoch j div N (N = its windows per epoch), in the permutation torchllm.data.windows
gives that epoch for the source's own seed. So each source has its own epoch counter, and a
source that runs out wraps to a new permuted epoch (logged) while the others go on. Batch n is a
pure function of n: the resumable state is one count, exactly like the single-source loader.

A streamed source (a Hugging Face stream: `sequential`) cannot be read by window index: it
serves its windows in stream order, the next ones each time the schedule picks it, and its own
position (the stream's state and unbatched tokens) joins the count in the state. Which slots it
fills is still fixed by the schedule; what a rank reads from it depends on the dp degree, as
for a single stream.
"""

from __future__ import annotations

import copy

import numpy as np
import torch

from torchllm.callbacks import Callback, StepReport
from torchllm.config.job_config import ConfigError
from torchllm.data.windows import IndexedBatches, WindowBatches, window_batch
from torchllm.log import logger

PERIOD = 10_000  # slots per period of the source schedule (weights are rounded to 1/PERIOD)


def source_seed(seed: int, i: int) -> int:
    """Source i's own seed, so equal sources still read in different orders."""
    return seed + 1_000_003 * (i + 1)


def normalized_weights(sources) -> np.ndarray:
    weights = np.array([s.weight for s in sources], dtype=np.float64)
    for i, s in enumerate(sources):
        if not s.dataset:
            raise ConfigError(f"data.sources[{i}] has no dataset; every [[data.sources]] table "
                              "needs dataset = \"...\" (any data.dataset value)", "data.sources")
        if not s.weight > 0:
            raise ConfigError(f"data.sources[{i}].weight = {s.weight} ({s.dataset}): weights "
                              "must be > 0 (they are normalized to sum to 1)", "data.sources")
    return weights / weights.sum()


def source_schedule(weights: np.ndarray, period: int = PERIOD) -> np.ndarray:
    """The source of each slot of one period (see the module doc)."""
    quotas = np.floor(weights * period).astype(np.int64)
    remainders = weights * period - quotas
    quotas[np.argsort(-remainders, kind="stable")[: period - quotas.sum()]] += 1
    schedule = np.empty(period, dtype=np.int64)
    served = np.zeros(len(weights), dtype=np.int64)
    for g in range(period):
        behind = quotas * (g + 1) / period - served
        behind[served == quotas] = -np.inf  # a source never exceeds its quota
        s = int(np.argmax(behind))
        schedule[g], served[s] = s, served[s] + 1
    return schedule


class MixtureBatches(IndexedBatches):
    """Endless batches for one data-parallel rank from several window sources (module doc).

    `sources` are objects with `windows_per_epoch`, `epoch_order(epoch)` (window ids) and
    `read(ids)` (a batch dict of those windows), e.g. `StreamSource` below, or streamed ones
    (`sequential`, `take(k)`: the next k windows; torchllm.data.hf_stream.StreamWindows).
    """

    def __init__(self, sources: list, names: list[str], weights: np.ndarray, batch_size: int,
                 dp_rank: int, dp_degree: int):
        self.sources, self.names, self.weights = sources, names, weights
        self.batch_size, self.dp_rank, self.dp_degree = batch_size, dp_rank, dp_degree
        self.schedule = source_schedule(weights)
        self.quotas = np.bincount(self.schedule, minlength=len(sources))
        # occurrence[g]: how many earlier slots of the period went to the same source
        self.occurrence = np.zeros(PERIOD, dtype=np.int64)
        for s in range(len(sources)):
            where = np.flatnonzero(self.schedule == s)
            self.occurrence[where] = np.arange(len(where))
        self.prefix = np.zeros((PERIOD + 1, len(sources)), dtype=np.int64)  # served before g
        np.add.at(self.prefix[1:], (np.arange(PERIOD), self.schedule), 1)
        self.prefix = np.cumsum(self.prefix, axis=0)
        self.yielded = 0
        self._orders: dict[int, tuple[int, np.ndarray]] = {}

    def served(self, slots: int) -> np.ndarray:
        """Windows each source served in slots [0, slots) of the run (all ranks together)."""
        cycles, rest = divmod(slots, PERIOD)
        return cycles * self.quotas + self.prefix[rest]

    def window_id(self, s: int, j: int) -> int:
        """The window source s serves as its j-th (its own epochs, each a new permutation)."""
        src = self.sources[s]
        epoch, k = divmod(j, src.windows_per_epoch)
        cached = self._orders.get(s)
        if cached is None or cached[0] != epoch:
            if k == 0 and epoch > 0 and self.dp_rank == 0:
                logger.info("data source %d (%s) ran out after epoch %d: starting epoch %d in a "
                            "new order", s, self.names[s], epoch - 1, epoch)
            cached = self._orders[s] = (epoch, src.epoch_order(epoch))
        return int(cached[1][k])

    def batch(self, n: int) -> dict[str, torch.Tensor]:
        """Batch n of the run (counting from 0) for this rank."""
        first = (n * self.dp_degree + self.dp_rank) * self.batch_size
        slots = np.arange(first, first + self.batch_size)
        cycles, pos = np.divmod(slots, PERIOD)
        which = self.schedule[pos]
        j = cycles * self.quotas[which] + self.occurrence[pos]
        rows: list = [None] * self.batch_size
        for s in np.unique(which):
            idx = np.flatnonzero(which == s)
            src = self.sources[s]
            if getattr(src, "sequential", False):  # a stream: its next windows, in order
                part = src.take(len(idx))
                if part is None:
                    raise RuntimeError(
                        f"data source {s} ({self.names[s]}) has no documents for this loader "
                        "worker; the dataset needs at least as many files as data.num_workers x "
                        "data-parallel degree, or set data.num_workers = 0")
            else:
                part = src.read([self.window_id(int(s), int(j[i])) for i in idx])
            for r, i in enumerate(idx):
                rows[i] = {k: v[r] for k, v in part.items()}
        return {k: torch.stack([row[k] for row in rows]) for k in rows[0]}

    def _streams(self) -> dict[str, object]:
        return {str(s): src for s, src in enumerate(self.sources)
                if getattr(src, "sequential", False)}

    def __iter__(self):
        for src in self._streams().values():
            src.restart()  # from its saved position (a fresh iterator, e.g. in a loader worker)
        return super().__iter__()

    def state_dict(self) -> dict:
        state = {"yielded": self.yielded}
        streams = {s: src.state_dict() for s, src in self._streams().items()}
        if streams:  # window sources alone: just the count, as before streams could mix
            state["streams"] = streams
        return state

    def load_state_dict(self, state: dict) -> None:
        self.yielded = int(state["yielded"])
        streams = self._streams()
        if set(state.get("streams", {})) != set(streams):
            raise ConfigError(
                f"the data loader state was saved with streamed mixture sources "
                f"{sorted(state.get('streams', {}))}, this mixture's are {sorted(streams)}; "
                "resume with the same data.sources, or add 'dataloader' to "
                "checkpoint.exclude_from_loading to start the data order afresh")
        for s, src in streams.items():
            src.load_state_dict(state["streams"][s])


class StreamSource:
    """A packed token stream (embedded, local:, shards:) as a mixture source."""

    def __init__(self, stream, seq_len: int, seed: int, shuffle_windows: bool, name: str):
        # One-window batches of one rank: epoch_order is then the whole epoch's window order.
        self.order = WindowBatches(stream, seq_len, 1, 0, 1, seed, shuffle_windows, name)
        self.stream, self.window = stream, seq_len + 1
        self.windows_per_epoch = self.order.batches_per_epoch

    def epoch_order(self, epoch: int) -> np.ndarray:
        return self.order.epoch_order(epoch)

    def read(self, ids) -> dict[str, torch.Tensor]:
        return window_batch(self.stream, ids, self.window)


def source_config(dcfg, i: int):
    """data config of source i alone (its dataset in data.dataset)."""
    one = copy.copy(dcfg)
    one.dataset, one.sources = dcfg.sources[i].dataset, []
    return one


class MixtureLog(Callback):
    """Realized tokens per source, every metrics.log_freq steps: `data/source<i>/tokens` and
    `data/source<i>/fraction` (of all training tokens so far) in TensorBoard."""

    @classmethod
    def from_trainer(cls, trainer) -> "MixtureLog | None":
        ds = getattr(trainer.train_loader, "dataset", None)
        return cls(ds, trainer) if isinstance(ds, MixtureBatches) else None

    def __init__(self, mixture: MixtureBatches, trainer):
        self.mixture, self.ramp = mixture, trainer.batch_ramp
        self.slots_per_batch = mixture.batch_size * mixture.dp_degree
        self.window_tokens = trainer.cfg.training.seq_len
        self.log_freq = trainer.cfg.metrics.log_freq
        self.batches = 0  # batches (micro-batches) this rank has consumed
        for i, (name, w) in enumerate(zip(mixture.names, mixture.weights)):
            logger.info("data source %d: %s, weight %.4f", i, name, w)

    def on_train_start(self, trainer) -> None:
        # A resumed run consumed the batches of every earlier step (the loader state says so).
        self.batches = sum(self.ramp.accum_steps(s) for s in range(1, trainer.step + 1))

    def on_step_end(self, trainer, step: int, metrics: dict) -> StepReport | None:
        self.batches += self.ramp.accum_steps(step)
        if step % self.log_freq:
            return None
        served = self.mixture.served(self.batches * self.slots_per_batch)
        scalars = {}
        for i, count in enumerate(served):
            scalars[f"data/source{i}/tokens"] = float(count * self.window_tokens)
            scalars[f"data/source{i}/fraction"] = float(count / served.sum())
        return StepReport(scalars=scalars)
