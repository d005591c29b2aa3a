"""The one way a checkpoint is read: resume, the initial load, generate, the evals, `hf export`
and `convert` all go through here, so what keeps a bad checkpoint out is checked once:

- which step: a step folder as named (it must be complete), or for a run or checkpoint folder
  its newest complete step saved while training was healthy (`resolve_checkpoint`);
- the COMPLETE marker: a record `mark_complete` wrote, else `MarkerError` (`read_marker`);
- every file against the marker's sizes and CRC-32s (`CheckpointReader.verify`; a resume
  shares the files out over its ranks), else `CorruptCheckpoint`;
- every pickle through the allow-list (`dcp_reader`: safe_load's readers, for `.metadata` and
  each stored value), else `safe_load.UntrustedCheckpoint`;
- the tokenizer the weights were trained with (`check_same_tokenizer`: resume, initial load,
  inference), else a ConfigError naming both.

`open_checkpoint(path)` does the first four and returns a `CheckpointReader` that loads state
dicts and tensors, and finds the config and run folder the step was written under.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from torchllm.checkpoint.integrity import check_files
from torchllm.checkpoint.layout import MARKER, complete_steps, step_dir, step_of
from torchllm.checkpoint.tokenizer_identity import check_same_tokenizer
from torchllm.checkpoint.safe_load import SafeFileSystemReader, safe_fsspec_reader
from torchllm.log import logger
from torchllm.storage import Location, as_location, join, parent_of, storage_for


class MarkerError(ValueError):
    """A COMPLETE marker that cannot be read or holds no record: its step is not used."""


class CorruptCheckpoint(ValueError):
    """A checkpoint file differs from what its COMPLETE marker recorded when it was saved."""


def read_marker(path: Location) -> dict:
    """The COMPLETE marker's record; MarkerError (one line naming the marker) when it cannot be
    read, is empty or cut short, or is not the record `mark_complete` writes. Such a step is
    unusable: without its record the files' checksums cannot be verified."""
    marker = join(as_location(path), MARKER)
    try:
        data = storage_for(marker).read_bytes(marker)
    except OSError as e:
        raise MarkerError(f"marker {marker} cannot be read ({e.strerror or e})") from None
    try:
        record = json.loads(data.decode())
    except ValueError as e:  # empty, cut short, or not text at all
        what = "empty" if not data.strip() else f"damaged (not a JSON record: {e})"
        raise MarkerError(f"marker {marker} is {what}") from None
    if not isinstance(record, dict) or "step" not in record:
        raise MarkerError(f"marker {marker} is damaged (no step record in it)")
    return record


def dcp_reader(path: Location):
    """DCP's reader for a step folder or prefix, whose pickles are data only (safe_load:
    allow-listed types): the only reader any DCP load here gets."""
    store = storage_for(path)
    if store.remote:
        return safe_fsspec_reader(str(path), **store.options)
    return SafeFileSystemReader(str(path))


def read_metadata(path: Location) -> Metadata:
    """A step's DCP `.metadata`, read through the allow-list."""
    return dcp_reader(path).read_metadata()


def saved_keys(path: Location) -> set[str]:
    """Top-level keys of a DCP checkpoint (reads only its metadata file)."""
    return {key.split(".", 1)[0] for key in read_metadata(path).state_dict_metadata}


# ------------------------------------------------------------------------ which step


def resolve_checkpoint(path: Location, folder_name: str = "checkpoint") -> Location:
    """A complete step folder from a step folder, a checkpoint folder, or a run folder (each a
    local path or a URL)."""
    path = as_location(path)
    store = storage_for(path)
    if step_of(path) is not None:
        if not store.is_file(join(path, MARKER)):
            if not store.is_dir(path):
                raise FileNotFoundError(f"checkpoint path {path} is not a folder")
            raise FileNotFoundError(f"checkpoint {path} is incomplete (no {MARKER} marker)")
        return path
    if not store.is_dir(path):
        raise FileNotFoundError(f"checkpoint path {path} is not a folder")
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


# ------------------------------------------------------------------------ the reader


class CheckpointReader:
    """One complete step: its folder (`path`) and marker record (`marker`)."""

    def __init__(self, path: Location, marker: dict):
        self.path, self.marker = as_location(path), marker
        self._metadata: Metadata | None = None

    @classmethod
    def at(cls, step: Location) -> CheckpointReader:
        """The step folder `step` as it is, its marker read (MarkerError); files not checked."""
        return cls(step, read_marker(step))

    @classmethod
    def find(cls, path: Location, folder_name: str = "checkpoint") -> CheckpointReader:
        """The complete step `path` names (see `resolve_checkpoint`), its marker read; files not
        checked (what a launch reads before training: the marker's records)."""
        return cls.at(resolve_checkpoint(path, folder_name))

    def verify(self, rank: int = 0, world: int = 1) -> str | None:
        """The first problem among this rank's share of the files against the marker's sizes
        and CRC-32s; None when they match (or the marker records none: a seed checkpoint)."""
        return check_files(self.path, self.marker, rank, world)

    @property
    def metadata(self) -> Metadata:
        if self._metadata is None:
            self._metadata = read_metadata(self.path)
        return self._metadata

    @property
    def step(self) -> int | None:
        return step_of(self.path)

    @property
    def precision(self) -> str | None:
        """The precision the step was trained in ("bf16" or "fp32"), None when not recorded."""
        found = self.marker.get("precision")
        return found if found in ("bf16", "fp32") else None

    def keys(self) -> set[str]:
        """Top-level keys of the saved state ("model", "optimizer", ...)."""
        return {key.split(".", 1)[0] for key in self.metadata.state_dict_metadata}

    def load(self, state_dict: dict, no_dist: bool = False) -> None:
        """DCP's load into `state_dict` (in place), through the allow-list."""
        dcp.load(state_dict, storage_reader=dcp_reader(self.path), no_dist=no_dist)

    def tensors(self, prefix: str = "model.", what: str | None = None) -> dict[str, torch.Tensor]:
        """Every tensor whose flattened key starts with `prefix`, as plain CPU tensors keyed by
        the rest of the key ("model." -> parameter names); no model code needed: shapes and
        dtypes come from the metadata. `what` names them in the error when there are none."""
        tensors = {
            key: torch.empty(meta.size, dtype=meta.properties.dtype)
            for key, meta in self.metadata.state_dict_metadata.items()
            if key.startswith(prefix) and isinstance(meta, TensorStorageMetadata)
        }
        if not tensors:
            raise ValueError(f"checkpoint {self.path} holds no "
                             f"{what or f'tensors under {prefix!r}'}")
        self.load(tensors, no_dist=True)
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


def open_checkpoint(path: Location, folder_name: str = "checkpoint") -> CheckpointReader:
    """The complete step `path` names (a run, checkpoint or step folder), checked as a resume
    checks it: its COMPLETE marker read, every file against the marker's sizes and CRC-32s, and
    its .metadata read through the restricted unpickler (safe_load). One-line errors:
    FileNotFoundError, MarkerError or CorruptCheckpoint (ValueErrors naming the file),
    safe_load.UntrustedCheckpoint."""
    reader = CheckpointReader.find(path, folder_name)
    problem = reader.verify()
    if problem:
        raise CorruptCheckpoint(f"checkpoint {reader.path} cannot be used: {problem}")
    reader.metadata  # noqa: B018 - read through the allow-list now: refused before any use
    return reader
