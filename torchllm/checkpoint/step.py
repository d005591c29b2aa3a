"""A checkpoint step, opened ONCE and checked as a whole before any tensor is read: resume, the
initial load, generate, the evals, `hf export` and `convert` all read through a `Step`, and
`Step.read` is the only read of a checkpoint's tensors in torchllm.

- which step: a step folder as named (it must be complete), or for a run or checkpoint folder
  its newest complete step saved while training was healthy (`resolve_checkpoint`);
- the COMPLETE marker: a record `mark_complete` wrote, else `MarkerError` (`read_marker`); its
  file list (sizes, CRC-32s) and the identity record (run, data, tokenizer) come from it;
- the index (`.metadata`, JSON: index.py), read once and checked against the file list: every
  recorded file is a plain name inside the step folder that COMPLETE lists, and every stored
  (offset, length) lies inside that file's recorded size; else `CorruptCheckpoint` (a pickle
  index from an older torchllm: `UntrustedCheckpoint`, naming the one-time conversion);
- every file against the marker's sizes and CRC-32s (`Step.verify`; a resume shares the files
  out over its ranks), else `CorruptCheckpoint`;
- the config it was written under (`Step.config`: the keys that import code are dropped);
- the tokenizer the weights were trained with (`check_tokenizer`), else a ConfigError.

`open_checkpoint(path)` does all of these and returns the `Step`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from torchllm.checkpoint.index import (
    INDEX,
    CorruptCheckpoint,
    DataPlanner,
    UntrustedRead,
    dcp_reader,
    untrusted_cause,
)
from torchllm.checkpoint.index_read import read_index
from torchllm.checkpoint.integrity import check_files, read_step_folder
from torchllm.checkpoint.layout import MARKER, complete_steps, step_dir, step_of
from torchllm.checkpoint.stage.tokenizer_identity import check_same_tokenizer
from torchllm.log import logger
from torchllm.storage import Location, as_location, join, parent_of, shown, storage_for


class MarkerError(ValueError):
    """A COMPLETE marker that cannot be read or holds no record: its step is not used."""


def read_marker(path: Location) -> dict:
    """The COMPLETE marker's record; MarkerError (one line naming the marker) when it cannot be
    read, is empty or cut short, or is not the record `mark_complete` writes. Such a step is
    unusable: without its record the files' checksums cannot be verified."""
    marker = join(as_location(path), MARKER)
    try:
        data = storage_for(marker).read_bytes(marker)
    except OSError as e:
        data = e
    return parse_marker(data, marker)


def parse_marker(data: bytes | OSError, where) -> dict:
    """The record in a COMPLETE marker's bytes (`read_marker`)."""
    if isinstance(data, OSError):
        raise MarkerError(f"marker {where} cannot be read ({data.strerror or data})")
    try:
        record = json.loads(data.decode())
    except ValueError as e:  # empty, cut short, or not text at all
        what = "empty" if not data.strip() else f"damaged (not a JSON record: {e})"
        raise MarkerError(f"marker {where} is {what}") from None
    except RecursionError:
        raise MarkerError(f"marker {where} is damaged (nested too deeply)") from None
    if not isinstance(record, dict) or "step" not in record:
        raise MarkerError(f"marker {where} is damaged (no step record in it)")
    return record


# ------------------------------------------------------------------------ which step


def resolve_checkpoint(path: Location, folder_name: str = "checkpoint") -> Location:
    """A complete step folder from a step folder, a checkpoint folder, or a run folder (each a
    local path or a URL)."""
    path = as_location(path)
    store = storage_for(path)
    if step_of(path) is not None:
        if not store.is_file(join(path, MARKER)):
            if not store.is_dir(path):
                raise FileNotFoundError(f"checkpoint path {shown(path)} is not a folder")
            raise FileNotFoundError(f"checkpoint {shown(path)} is incomplete (no {MARKER} "
                                    "marker)")
        return path
    if not store.is_dir(path):
        raise FileNotFoundError(f"checkpoint path {shown(path)} is not a folder")
    for folder in (path, join(path, folder_name)):
        steps = complete_steps(folder)
        if steps:
            return _newest_healthy(folder, steps)
    raise FileNotFoundError(
        f"no complete checkpoint under {path} (looked for step-<N>/{MARKER} in {path} and "
        f"{join(path, folder_name)})"
    )


def _newest_healthy(folder: Location, steps: list[int]) -> Location:
    """A run's newest step whose weights were saved while training was healthy (inference and
    export of a run folder; a step named explicitly is read as it is): a step saved while the
    loss guard skipped updates holds the weights that made them. The newest step when none is."""
    for step in reversed(steps):
        path = step_dir(folder, step)
        try:
            unhealthy = read_marker(path).get("healthy") is False
        except MarkerError:
            unhealthy = False  # the reader names the marker's problem
        if not unhealthy:
            if step != steps[-1]:
                logger.warning("reading %s: the newer steps %s were saved while the loss guard "
                               "skipped updates (name one to read it anyway)", path,
                               [s for s in steps if s > step])
            return path
    return step_dir(folder, steps[-1])


# ------------------------------------------------------------------------ the step

CONFIG = "config.toml"  # the config the step was written under (resume/saver.py writes it)
# The marker's fields that say whose step this is (written by checkpoint/resume/saver.py).
IDENTITY = ("run_id", "data", "tokenizer")


class Step:
    """One complete step, opened once (`Step.open`): its folder (`path`), marker record
    (`marker`), index (`metadata`, checked against the marker's file list) and identity."""

    def __init__(self, path: Location, marker: dict, metadata: Metadata,
                 config_text: str | None = None):
        self.path, self.marker, self.metadata = as_location(path), marker, metadata
        self.config_text = config_text  # the step's own config.toml, as read at open
        # Top-level keys of the saved state ("model", "optimizer", ...).
        self.states = {key.split(".", 1)[0] for key in metadata.state_dict_metadata}

    @classmethod
    def open(cls, path: Location) -> Step:
        """The step folder `path` as it is, read once (its marker, index and config): the
        marker parsed (MarkerError) and the index checked against the marker's files
        (CorruptCheckpoint, UntrustedCheckpoint; integrity.UnsafeStepEntry for a link, FIFO
        or other non-regular entry in the folder); the files' checksums are `verify`'s."""
        path = as_location(path)
        present, read = read_step_folder(path, (MARKER, CONFIG))  # no link, no FIFO
        marker = parse_marker(read.get(MARKER, OSError("missing")), f"{path}/{MARKER}")
        sizes = _recorded_sizes(marker, present, f"{path}/{MARKER}")
        metadata = read_index(path, sizes)  # bounded by the recorded size
        _check_reads(f"{path}/{INDEX}", metadata, sizes)
        config = read.get(CONFIG)
        return cls(path, marker, metadata, config.decode() if isinstance(config, bytes) else None)

    @classmethod
    def find(cls, path: Location, folder_name: str = "checkpoint") -> Step:
        """The complete step `path` names (see `resolve_checkpoint`), opened."""
        return cls.open(resolve_checkpoint(path, folder_name))

    def verify(self, rank: int = 0, world: int = 1) -> str | None:
        """The first problem among this rank's share of the files against the marker's sizes
        and CRC-32s; None when they match (or the marker records none: checksums off)."""
        return check_files(self.path, self.marker, rank, world)

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
        reader = dcp_reader(self.path, self.metadata)
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

    def run_folder(self, cfg) -> Path:
        """The local run folder that wrote the step (its tokenizer cache is in data/): the
        step's grandparent, or for a step on object storage the run folder its config names."""
        if storage_for(self.path).remote:
            from torchllm.config.paths import run_name

            return Path(cfg.job.dump_folder) / run_name(cfg.job)
        return Path(parent_of(parent_of(self.path)))

    def check_tokenizer(self, now: dict | None, use: str = "inference") -> None:
        """`check_same_tokenizer` of the step's recorded tokenizer against `now`."""
        check_same_tokenizer(self.marker.get("tokenizer"), now, f"checkpoint {self.path}", use)


def _recorded_sizes(marker: dict, present: dict[str, int], where: str) -> dict[str, int]:
    """{file: bytes} of the step: as COMPLETE records them (a file it does not list is no part
    of the step), or with checksums off (no list) as the folder holds them (`present`)."""
    files = marker.get("files")
    if not files:
        return present
    if not isinstance(files, dict) or not all(
            isinstance(f, dict) and type(f.get("bytes")) is int for f in files.values()):
        raise MarkerError(f"marker {where} is damaged (its file list is not "
                          "{name: {bytes, crc32}})")
    return {name: f["bytes"] for name, f in files.items()}


def _check_reads(where: str, metadata: Metadata, sizes: dict[str, int]) -> None:
    """Every read the index `where` records stays inside the step: a file COMPLETE lists (a
    plain name: no folder, no `..`), and an (offset, length) within its recorded size."""
    for index, info in metadata.storage_data.items():
        name, at, length = info.relative_path, info.offset, info.length
        what = f"checkpoint index {where}: the entry of {index.fqn!r}"
        if name in ("", ".", "..") or "/" in name or "\\" in name or name not in sizes \
                or name == INDEX:
            raise CorruptCheckpoint(f"{what} reads {name!r}, which is not a file of the step "
                                    f"(COMPLETE lists {sorted(sizes)})")
        if at < 0 or length < 0 or at + length > sizes[name]:
            raise CorruptCheckpoint(f"{what} reads bytes {at}..{at + length} of {name}, which "
                                    f"has {sizes[name]} bytes")


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
