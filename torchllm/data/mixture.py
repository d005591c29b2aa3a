"""Data mixtures: `[[data.sources]]` (dataset + weight) read as one endless, resumable batch order.

A mixture is a source of sources: `Mixture` holds each entry's Dataset (torchllm/data/dataset.py:
a source x a packing) and reads them through `MixtureBatches` (the schedule, epochs, resume).

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

from torchllm.config.job_config import ConfigError
from torchllm.data.sources.base import Context
from torchllm.data.windows import IndexedBatches
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
    `read(ids)` (a batch dict of those windows), e.g. torchllm.data.windows.TokenWindows, or
    streamed ones (`sequential`, `take(k)`: the next k windows;
    torchllm.data.sources.hf.StreamWindows); each `describe()`s its size (None: unknown).
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
        self.rollovers: dict[int, int] = {}  # source -> new epochs started in this launch

    @classmethod
    def alone(cls, windows, name: str, ctx: Context) -> tuple["MixtureBatches", object]:
        """(a mixture of one source, its validation windows): `windows(ctx)` gives the
        (source, validation) pair for the source's context (ctx.seed is then the run's, and
        source 0's seed derives from it, as in a mixture)."""
        source, val = windows(ctx.with_seed(source_seed(ctx.seed, 0)))
        return cls([source], [name], np.ones(1), ctx.batch_size, ctx.dp_rank, ctx.dp_degree), val

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
                # Once per source per launch (a tiny source can roll over every step); the
                # count is logged at the end of the run (MixtureLog).
                self.rollovers[s] = self.rollovers.get(s, 0) + 1
                if self.rollovers[s] == 1:
                    logger.info("data source %d (%s) ran out after epoch %d: starting epoch %d "
                                "in a new order (later epochs are counted, not logged)", s,
                                self.names[s], epoch - 1, epoch)
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

    def position_is_a_count(self) -> bool:
        """A streamed source's position is its own offset, not a count of batches."""
        return not self._streams()

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

    def describe(self, global_batch: int, steps: int) -> str:
        """The run header's data line: each source's size and the epochs the run makes of it."""
        parts = []
        for name, weight, src in zip(self.names, self.weights, self.sources):
            share = f" x{float(weight):.2g}" if len(self.names) > 1 else ""
            size = src.describe()
            if size is None:  # a Hub stream: read in order, its size unknown until read
                windows = steps * global_batch * float(weight)
                parts.append(f"{name}{share}: streamed (size unknown until read); "
                             f"~{windows:,.0f} windows")
                continue
            epochs = steps * global_batch * float(weight) / max(src.windows_per_epoch, 1)
            parts.append(f"{name}{share}: train {size}; {epochs:.3g} epochs")
        return f"{steps:,} steps x {global_batch} windows; " + " | ".join(parts)


class MixtureVal(torch.utils.data.ConcatDataset):
    """The validation windows of a mixture: each source's own held-out split, one after the
    other (in-training evaluation also scores each source's part, `datasets`)."""

    def describe(self) -> str:
        return ""  # the header names no validation size for a mixture


def source_config(dcfg, i: int):
    """data config of source i alone (its dataset in data.dataset)."""
    one = copy.copy(dcfg)
    one.dataset, one.sources = dcfg.sources[i].dataset, []
    return one


def _in_source(error: ConfigError, dcfg, i: int) -> ConfigError:
    """`error` of source i, prefixed with which source it is (once)."""
    where = f"data.sources[{i}] ({dcfg.sources[i].dataset})"
    said = str(error) if str(error).startswith(f"{where}:") else f"{where}: {error}"
    return ConfigError(said, error.key or "data.sources")


class Mixture:
    """`[[data.sources]]`: each entry's Dataset, read together by weight (the interface of a
    Dataset, torchllm/data/dataset.py, but a mixture is never a source of another one)."""

    splits_by_name = False

    def __init__(self, dcfg, parts: list):
        self.dcfg, self.spec = dcfg, dcfg.dataset
        self.parts, self.weights = parts, normalized_weights(dcfg.sources)
        self.chat = any(p.chat for p in parts)

    def __repr__(self) -> str:
        return f"Mixture({self.parts!r})"

    @classmethod
    def parse(cls, dcfg, parse_one) -> "Mixture":
        """`parse_one(data config)` each entry (its dataset in data.dataset): a Dataset."""
        normalized_weights(dcfg.sources)  # every entry has a dataset and a weight > 0
        parts = []
        for i in range(len(dcfg.sources)):
            try:
                parts.append(parse_one(source_config(dcfg, i)))
            except ConfigError as e:
                raise _in_source(e, dcfg, i) from None
        return cls(dcfg, parts)

    def preflight(self) -> None:
        for i, part in enumerate(self.parts):
            try:
                part.preflight()
            except ConfigError as e:
                raise _in_source(e, self.dcfg, i) from None

    def content_identity(self) -> list[str]:
        """Each entry's identity, in data.sources order."""
        return [c for part in self.parts for c in part.content_identity()]

    def tokenizer_source(self):
        return self.parts[0]  # 'auto' trains on (or, for shards, loads the tokenizer of) the first

    def texts(self):
        return self.parts[0].texts()

    def windows(self, ctx: Context):
        raise ConfigError("a mixture cannot be a source of another mixture", "data.sources")

    def batches(self, ctx: Context):
        """(MixtureBatches, validation windows): each source's own held-out split, one after
        the other."""
        sources, vals = [], []
        for i, part in enumerate(self.parts):
            # Each source its own seed, so equal sources still read in different orders.
            try:
                source, val = part.windows(ctx.with_seed(source_seed(ctx.seed, i)))
            except ConfigError as e:
                raise _in_source(e, self.dcfg, i) from None
            sources.append(source)
            vals.append(val)
        train = MixtureBatches(sources, [s.dataset for s in self.dcfg.sources], self.weights,
                               ctx.batch_size, ctx.dp_rank, ctx.dp_degree)
        return train, MixtureVal(vals)

    def whole_stream(self, tokenizer, max_tokens: int):
        raise ConfigError("a mixture cannot be read whole", "validation.dataset")
