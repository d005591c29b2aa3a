"""A checkpoint step, opened ONCE and checked as a whole before any tensor is read: resume, the
initial load, generate, the evals, `hf export` and `convert` all read through a `Step`, and
`Step.read` is the only read of a checkpoint's tensors in torchllm.

- which step: a step folder as named (it must be complete), or for a run or checkpoint folder
  its newest complete step saved while training was healthy (layout.resolve_checkpoint);
- the COMPLETE marker: a record `mark_complete` wrote, else `MarkerError` (layout.parse_marker); its
  file list (sizes, CRC-32s) and the identity record (run, data, tokenizer) come from it;
- the index (`.metadata`, JSON: index.py), read once and checked against the file list: every
  recorded file is a plain name inside the step folder that COMPLETE lists, and every stored
  (offset, length) lies inside that file's recorded size (index.check_reads); else `CorruptCheckpoint` (a pickle
  index from an older torchllm: `UntrustedCheckpoint`, naming the one-time conversion);
- every file against the marker's sizes and CRC-32s (`Step.verify`, integrity.check_files; a
  resume shares the files out over its ranks), else `CorruptCheckpoint`;
- the config it was written under (`Step.config`: the keys that import code are dropped);
- the tokenizer the weights were trained with (`check_tokenizer`), else a ConfigError.

`open_checkpoint(path)` does all of these and returns the `Step`. The step folder is bound once
as a Store (`Step.store`: file system + root); every read of it goes through that store.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from torchllm.checkpoint.index import (
    CorruptCheckpoint,
    DataPlanner,
    UntrustedCheckpoint,
    UntrustedRead,
    dcp_reader,
    untrusted_cause,
)
from torchllm.checkpoint.index_read import read_index
from torchllm.checkpoint.integrity import check_files
from torchllm.checkpoint.layout import (  # noqa: F401 - MarkerError, read_marker: step.py's API too
    MARKER,
    MarkerError,
    parse_marker,
    read_marker,
    recorded_sizes,
    resolve_checkpoint,
    step_of,
)
from torchllm.checkpoint.stage.tokenizer_identity import check_same_tokenizer
from torchllm.storage import Location, join, parent_of, storage_for
from torchllm.store import NOT_REGULAR, Confined, Store, as_store


# ------------------------------------------------------------------------ which step


# ------------------------------------------------------------------------ the step

# The most a step's small files may hold before they are read (Step.open reads them whole).
MAX_READ = {MARKER: 64 << 20, ".metadata": 1 << 30, "config.toml": 16 << 20}


class UnsafeStepEntry(UntrustedCheckpoint):
    """An entry of a step folder that is no regular file (a symbolic link, a FIFO, a socket, a
    device): the step is refused as a whole before anything in it is read, on every rank (an
    UntrustedCheckpoint: a resume stops instead of falling back to an older step)."""


def read_step_folder(path: Location | Store, names: tuple[str, ...]
                     ) -> tuple[Store, dict[str, int], dict[str, bytes | OSError]]:
    """The step folder `path` as a Store, its entries checked (UnsafeStepEntry, one line naming
    the entry, for a link, FIFO or other non-regular entry in it: links are never followed);
    {name: size} of its regular files, and {name: its bytes, or the OSError reading it} for
    each of `names` present, each read bounded by MAX_READ."""
    store = as_store(path)
    if not store.remote:  # an object store has no links or FIFOs (and one listing is enough)
        for name, kind in sorted(store.entries().items()):
            if kind not in ("file", "folder"):
                raise UnsafeStepEntry(
                    f"checkpoint {store.root}: {store.where(name)} is {NOT_REGULAR[kind]}; "
                    "every file of a step must be a regular file inside its folder (nothing of "
                    "this step is read)")
    sizes = store.files()
    read: dict[str, bytes | OSError] = {}
    for name in names:
        if name in sizes:
            most = MAX_READ.get(name)
            try:
                if most is not None and sizes[name] > most:  # as listed: no request more
                    raise Confined(f"{store.where(name)} is {sizes[name]:,} bytes, more than "
                                   f"the {most:,} allowed")
                read[name] = store.read_bytes(name, max_bytes=None if store.remote else most)
            except OSError as e:
                read[name] = e
    return store, sizes, read


CONFIG = "config.toml"  # the config the step was written under (resume/saver.py writes it)
# The marker's fields that say whose step this is (written by checkpoint/resume/saver.py).
IDENTITY = ("run_id", "data", "tokenizer")


class Step:
    """One complete step, opened once (`Step.open`): its folder (`path`), marker record
    (`marker`), index (`metadata`, checked against the marker's file list) and identity."""

    def __init__(self, path: Location | Store, marker: dict, metadata: Metadata,
                 config_text: str | None = None):
        self.store = as_store(path)  # the step folder, bound once (file system + root)
        self.path, self.marker, self.metadata = self.store.root, marker, metadata
        self.config_text = config_text  # the step's own config.toml, as read at open
        # Top-level keys of the saved state ("model", "optimizer", ...).
        self.states = {key.split(".", 1)[0] for key in metadata.state_dict_metadata}

    @classmethod
    def open(cls, path: Location | Store) -> Step:
        """The step folder `path` as it is, read once (its marker, index and config): the
        marker parsed (MarkerError) and the index checked against the marker's files
        (CorruptCheckpoint, UntrustedCheckpoint; integrity.UnsafeStepEntry for a link, FIFO
        or other non-regular entry in the folder); the files' checksums are `verify`'s."""
        store, present, read = read_step_folder(path, (MARKER, CONFIG))  # no link, no FIFO
        marker = parse_marker(read.get(MARKER, OSError("missing")), f"{store.root}/{MARKER}")
        sizes = recorded_sizes(marker, present, f"{store.root}/{MARKER}")
        metadata = read_index(store, sizes)  # bounded by the recorded size, reads inside it
        config = read.get(CONFIG)
        return cls(store, marker, metadata, config.decode() if isinstance(config, bytes) else None)

    @classmethod
    def find(cls, path: Location, folder_name: str = "checkpoint") -> Step:
        """The complete step `path` names (see `resolve_checkpoint`), opened."""
        return cls.open(resolve_checkpoint(path, folder_name))

    def verify(self, rank: int = 0, world: int = 1) -> str | None:
        """The first problem among this rank's share of the files against the marker's sizes
        and CRC-32s; None when they match (or the marker records none: checksums off)."""
        return check_files(self.store, self.marker, rank, world)

    @property
    def step(self) -> int | None:
        return step_of(self.path)

    @property
    def identity(self) -> dict:
        """Whose step this is, as its marker records it: {"run_id", "data", "tokenizer"}
        (None where a step saved before they were recorded has no such field)."""
        return {key: self.marker.get(key) for key in IDENTITY}

    @property
    def precision(self) -> str | None:
        """The precision the step was trained in ("bf16" or "fp32"), None when not recorded."""
        found = self.marker.get("precision")
        return found if found in ("bf16", "fp32") else None

    def read(self, state_dict: dict, no_dist: bool = False) -> None:
        """DCP's load into `state_dict` (in place), from the checked index; stored values
        through `weights_only` (index.DataPlanner)."""
        reader = dcp_reader(self.path, self.metadata, self.store.storage)
        try:
            dcp.load(state_dict, storage_reader=reader, planner=DataPlanner(reader), no_dist=no_dist)
        except CheckpointException as e:  # a refusal, on every rank: one line, not DCP's dump
            if cause := untrusted_cause(e):
                raise UntrustedRead(cause, e.failures) from None
            raise

    def tensors(self, prefix: str = "model.", what: str | None = None) -> dict[str, torch.Tensor]:
        """Every tensor whose flattened key starts with `prefix`, as plain CPU tensors keyed by
        the rest of the key ("model." -> parameter names); no model code needed: shapes and
        dtypes come from the index. `what` names them in the error when there are none."""
        tensors = {
            key: torch.empty(meta.size, dtype=meta.properties.dtype)
            for key, meta in self.metadata.state_dict_metadata.items()
            if key.startswith(prefix) and isinstance(meta, TensorStorageMetadata)
        }
        if not tensors:
            raise ValueError(f"checkpoint {self.path} holds no "
                             f"{what or f'tensors under {prefix!r}'}")
        self.read(tensors, no_dist=True)
        return {key[len(prefix):]: value for key, value in tensors.items()}

    def weights(self) -> dict[str, torch.Tensor]:
        """The model weights, keyed by parameter name."""
        return self.tensors("model.", what="model weights")

    def config_file(self) -> Path | None:
        """The config the step was written under (a local copy of it for a step on object
        storage): its own config.toml, else the run's (run/<folder>/step-N -> run/config.toml),
        else None. The step's wins: a later launch of the run (another shape, a failed resume
        of older code) may have rewritten the run's."""
        for path in (join(self.path, "config.toml"),
                     join(parent_of(parent_of(self.path)), "config.toml")):
            store = storage_for(path)
            if store.is_file(path):
                return store.local_copy(path)
        return None

    def saved_config_text(self) -> str | None:
        """The text of `config_file` (None without one): what the step was trained as."""
        if self.config_text is not None:
            return self.config_text
        path = self.config_file()
        return None if path is None else Path(path).read_text()

    def config(self, overrides: list[str] = ()):
        """The config the step was written under (`config_file`) with `overrides` on top, as
        data: the keys that import code (job.custom_import) are taken from `overrides` only,
        never from the checkpoint's file. ConfigError when there is none."""
        from torchllm.config import ConfigError, load_config

        path = self.config_file()
        if path is None:
            raise ConfigError(f"neither {join(self.path, 'config.toml')} nor the run's "
                              "config.toml exists; pass the run's config with --job.config_file")
        return load_config(["--job.config_file", str(path), *overrides], file_runs_code=False)

    def run_folder(self, job) -> Path:
        """The local run folder that wrote the step (its tokenizer cache is in data/): the
        step's grandparent, or for a step on object storage the run folder its config's [job]
        (`job`) names."""
        if storage_for(self.path).remote:
            from torchllm.config.paths import run_name

            return Path(job.dump_folder) / run_name(job)
        return Path(parent_of(parent_of(self.path)))

    def check_tokenizer(self, now: dict | None, use: str = "inference") -> None:
        """`check_same_tokenizer` of the step's recorded tokenizer against `now`."""
        check_same_tokenizer(self.marker.get("tokenizer"), now, f"checkpoint {self.path}", use)


def open_checkpoint(path: Location, folder_name: str = "checkpoint") -> Step:
    """The complete step `path` names (a run, checkpoint or step folder), checked as a resume
    checks it: opened (marker, index, reads inside the step) and every file against the
    marker's sizes and CRC-32s. One-line errors: FileNotFoundError, MarkerError,
    CorruptCheckpoint (ValueErrors naming the file), UntrustedCheckpoint."""
    step = Step.find(path, folder_name)
    problem = step.verify()
    if problem:
        raise CorruptCheckpoint(f"checkpoint {step.path} cannot be used: {problem}")
    return step
