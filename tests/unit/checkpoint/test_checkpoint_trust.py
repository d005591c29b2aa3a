"""Checkpoints are data, never code (issue 42; issue 52: no home-made unpickler): a `.metadata`
pickle (never unpickled: refused, naming the one-time conversion) or a `.distcp` value that
would run code is refused by every command that reads a checkpoint, with one line naming the
file; and every reader verifies the CRC-32s the COMPLETE marker recorded.

Each poisoned checkpoint's payload is first shown to run under a plain unpickler (it writes a
marker file, then returns the real value), and the marker's CRC-32s are updated, so only the
reader stands between the payload and the command."""

from __future__ import annotations

import dataclasses
import io
import json
import pickle
import random
import re
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata

from torchllm.checkpoint.index import (
    UntrustedCheckpoint,
    dcp_reader,
    dcp_writer,
    decode_index,
    encode_index,
    load_value,
)
from torchllm.checkpoint.state import JSONState, TrainState
from torchllm.checkpoint.step import CorruptCheckpoint, Step

import cli
from builders.checkpoint import copy_run, trained_once
from conftest import tiny_args
from checkpoint_edits import reseal
from messages import refused

# (validation off in the trained run and its resumes alike: it decides what is held out)
CKPT = ["--checkpoint.enable", "--validation.enable=false", "--job.run_name=run",
        "--checkpoint.interval=2",
        "--training.steps=2"]
CONVERT = "torchllm.checkpoint.convert_legacy"  # the command a refused index names


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A finished 2-step run with its checkpoint at step 2 (copied by each test)."""
    return trained_once(tmp_path_factory, *CKPT)


@pytest.fixture
def run(trained, tmp_path):
    return copy_run(trained, tmp_path / "root")


def step_of(root: Path) -> Path:
    return root / "run" / "checkpoint" / "step-2"


def payload(marker: Path) -> bytes:
    """Pickle opcodes that call os.system("touch MARKER") and drop the result; what follows
    them (a whole pickle) is then the value the unpickling returns."""
    return b"cos\nsystem\n(V" + f"touch {marker}".encode() + b"\ntR0"


def runs_under_plain_pickle(load, marker: Path):
    """The poisoned bytes do run the payload under a plain unpickler (and still return the
    real value): the tests below can fail."""
    assert not marker.exists()
    value = load()
    assert marker.exists(), "the payload did not run: the test would prove nothing"
    marker.unlink()
    return value


def poison_metadata(step: Path, marker: Path) -> Path:
    """The step's index as a pickle (as DCP writes it) with the payload in front."""
    path = step / ".metadata"
    poisoned = payload(marker) + pickle.dumps(Step.open(step).metadata)
    got = runs_under_plain_pickle(lambda: pickle.loads(poisoned), marker)
    assert isinstance(got, Metadata) and got.state_dict_metadata
    path.write_bytes(poisoned)
    reseal(step)
    return path


def saved_value(step: Path, key: str, fqn: str):
    sd = {key: {fqn: None}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        Step.open(step).read(sd, no_dist=True)
    return sd[key][fqn]


def replace_value(step: Path, fqn: str, saved: bytes) -> Path:
    """Point the `.metadata` entry of the bytes value `fqn` at `saved` (a torch.save) appended
    to the .distcp file that holds it; returns that file."""
    metadata = Step.open(step).metadata
    index = next(i for i in metadata.storage_data if i.fqn == fqn)
    info = metadata.storage_data[index]
    shard = step / info.relative_path
    offset = shard.stat().st_size
    with open(shard, "ab") as f:
        f.write(saved)
    metadata.storage_data[index] = dataclasses.replace(info, offset=offset, length=len(saved))
    (step / ".metadata").write_text(encode_index(metadata))
    reseal(step)
    return shard


def torch_saved(value) -> bytes:
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def poison_pickled_state(step: Path, marker: Path) -> Path:
    """train_state.json: a torch.save'd value whose unpickling runs the payload, then returns
    the counters' JSON text."""
    real = saved_value(step, "train_state", "json")
    saved = torch_saved(_Evil(marker, real))
    got = runs_under_plain_pickle(lambda: torch.load(io.BytesIO(saved), weights_only=False),
                                  marker)
    assert got == real and json.loads(got)["step"] == 2
    return replace_value(step, "train_state.json", saved)


class _Evil:
    """torch.save's pickle of this calls eval: the payload, then the real value."""

    def __init__(self, marker: Path, real):
        self.source = f"(__import__('os').system('touch {marker}'), {real!r})[1]"

    def __reduce__(self):
        return eval, (self.source,)


def poison_rng_value(step: Path, marker: Path) -> Path:
    """rng_rank0.python: a torch.save'd value whose unpickling runs the payload."""
    real = saved_value(step, "rng_rank0", "python")
    saved = torch_saved(_Evil(marker, real))
    got = runs_under_plain_pickle(
        lambda: torch.load(io.BytesIO(saved), weights_only=False), marker)
    assert got == real
    return replace_value(step, "rng_rank0.python", saved)


def flip_a_byte(step: Path) -> Path:
    shard = step / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x10
    shard.write_bytes(bytes(data))
    return shard


def generate(root: Path) -> cli.Ran:
    return cli.run_module("torchllm.generate", "--checkpoint", str(root / "run"), "--prompt",
                          "To be", "--max-new-tokens", "2", "--device", "cpu")


def export(root: Path) -> cli.Ran:
    return cli.run_module("torchllm.hf", "export", "--checkpoint", str(root / "run"), "--out",
                          str(root / "hf"))


def run_train(root: Path, *extra: str) -> cli.Ran:
    return cli.run_train(*tiny_args(root, *CKPT, "--metrics.progress_bar=false", *extra))


@pytest.mark.slow
def test_generate_and_export_refuse_a_metadata_that_runs_code(run, tmp_path):
    marker = tmp_path / "PWNED"
    metadata = poison_metadata(step_of(run), marker)
    refused(generate(run), metadata, CONVERT)
    refused(export(run), metadata, CONVERT)
    assert not (run / "hf").exists()
    assert not marker.exists()


@pytest.mark.slow
@pytest.mark.parametrize("entry", ["metadata", "pickled_state"])
def test_run_train_sh_resume_refuses_a_checkpoint_that_runs_code(run, tmp_path, entry):
    marker = tmp_path / "PWNED"
    step = step_of(run)
    path = (poison_metadata if entry == "metadata" else poison_pickled_state)(step, marker)
    refused(run_train(run, "--training.steps=4"), path,
                   CONVERT if entry == "metadata" else "train_state.json")
    assert not marker.exists()
    assert not (run / "run" / "checkpoint" / "step-4").exists()


@pytest.mark.slow
def test_initial_load_path_refuses_a_metadata_that_runs_code(run, tmp_path):
    marker = tmp_path / "PWNED"
    metadata = poison_metadata(step_of(run), marker)
    fresh = tmp_path / "fresh"
    shutil.copytree(run / "run" / "data", fresh / "run" / "data")  # its tokenizer, cached
    refused(run_train(fresh, f"--checkpoint.initial_load_path={step_of(run)}"),
                   metadata, CONVERT)
    assert not marker.exists()


@pytest.mark.slow
def test_generate_and_export_refuse_a_flipped_byte(run):
    shard = flip_a_byte(step_of(run))
    for r in (generate(run), export(run)):
        refused(r, shard, "CRC-32")  # the check that failed
    assert not (run / "hf").exists()


def test_convert_and_inference_loading_refuse_a_flipped_byte_or_code(run, tmp_path):
    from torchllm.hf.convert import main as convert
    from torchllm.eval.loading import load_for_inference

    step = step_of(run)
    out = tmp_path / "w.safetensors"
    assert convert(["to-file", str(run / "run"), str(out)]) == 0  # the clean checkpoint
    shard = flip_a_byte(step)
    with pytest.raises(CorruptCheckpoint, match=re.escape(str(shard))):
        load_for_inference(run / "run", "cpu")
    out.unlink()
    assert convert(["to-file", str(run / "run"), str(out)]) == 2 and not out.exists()
    flip_a_byte(step)  # back as saved
    marker = tmp_path / "PWNED"
    metadata = poison_metadata(step, marker)
    with pytest.raises(UntrustedCheckpoint, match=f"{re.escape(str(metadata))}.*{CONVERT}"):
        load_for_inference(run / "run", "cpu")
    assert convert(["to-file", str(run / "run"), str(out)]) == 2 and not out.exists()
    assert not marker.exists()


@pytest.mark.parametrize("poison", [poison_rng_value, poison_pickled_state],
                         ids=["torch_saved_value", "pickled_state"])
def test_dcp_reads_of_poisoned_values_are_refused_naming_the_file(run, tmp_path, poison):
    from torch.distributed.checkpoint.api import CheckpointException

    from torchllm.checkpoint.index import untrusted_cause

    marker = tmp_path / "PWNED"
    step = step_of(run)
    shard = poison(step, marker)
    key, fqn = ("rng_rank0", "python") if poison is poison_rng_value else ("train_state", "json")
    with pytest.raises(CheckpointException) as e:
        Step.open(step).read({key: {fqn: None}}, no_dist=True)
    cause = untrusted_cause(e.value)
    assert cause and str(shard) in cause and f"{key}.{fqn}" in cause, cause
    assert not marker.exists()


def test_json_index_holds_what_dcp_pickles(tmp_path):
    """The JSON index rebuilds the very Metadata DCP's own writer pickles (its test's own read
    of that pickle, trusted here)."""
    from torch.distributed.checkpoint import FileSystemWriter

    state = {"model": {"w": torch.arange(6.0).reshape(2, 3)}, "train_state": {"step": 7},
             "rng": {"numpy": np.random.get_state()}}
    dcp.save(state, storage_writer=FileSystemWriter(str(tmp_path / "dcp")), no_dist=True)
    plain = pickle.loads((tmp_path / "dcp" / ".metadata").read_bytes())
    ours = decode_index(encode_index(plain).encode(), "x", tmp_path)
    assert ours.state_dict_metadata == plain.state_dict_metadata
    assert ours.storage_data == plain.storage_data and ours.planner_data == plain.planner_data


def test_fsspec_checkpoints_are_read_as_data(tmp_path):
    """A checkpoint written by the fsspec writer (object stores) has a JSON index and reads
    back through it; a pickle index there is refused without being unpickled."""
    url = f"file://{tmp_path}/step-1"
    state = {"model": {"w": torch.arange(6.0).reshape(2, 3)}, "train_state": {"step": 7}}
    dcp.save(state, storage_writer=dcp_writer(url), no_dist=True)
    path = tmp_path / "step-1" / ".metadata"
    metadata = decode_index(path.read_bytes(), str(path), url)
    loaded = {"model": {"w": torch.zeros(2, 3)}, "train_state": {"step": 0}}
    dcp.load(loaded, storage_reader=dcp_reader(url, metadata), no_dist=True)
    assert torch.equal(loaded["model"]["w"], state["model"]["w"])
    assert loaded["train_state"]["step"] == 7
    marker = tmp_path / "PWNED"
    path.write_bytes(payload(marker) + pickle.dumps(metadata))
    with pytest.raises(UntrustedCheckpoint, match="convert_legacy"):
        decode_index(path.read_bytes(), str(path), url)
    assert not marker.exists()


def test_json_state_loads_data_and_never_unpickles(tmp_path):
    state = TrainState(step=5, tokens_seen=640, best_val_loss=float("inf"))
    saved = JSONState(state).state_dict()
    restored = TrainState()
    JSONState(restored).load_state_dict(saved)
    assert restored == state
    marker = tmp_path / "PWNED"
    poisoned = payload(marker) + pickle.dumps(state.state_dict())  # as older checkpoints
    runs_under_plain_pickle(lambda: pickle.loads(poisoned), marker)
    with pytest.raises(UntrustedCheckpoint, match="TrainState.*convert_legacy"):
        JSONState(TrainState()).load_state_dict({"pickle": poisoned})
    assert not marker.exists()


def test_json_state_with_tensors_loads(tmp_path):
    """A scheduler state holding tensors (AdamW8bit's: a tensor lr) loads as tensors."""
    state = {"lr": torch.tensor(1e-3), "base_lrs": [torch.ones(2)], "step": 3}
    holder = type("Holder", (), {"state_dict": lambda self: state,
                                 "load_state_dict": lambda self, sd: setattr(self, "got", sd)})
    restored = holder()
    JSONState(restored).load_state_dict(JSONState(holder()).state_dict())
    assert restored.got["step"] == 3 and torch.equal(restored.got["lr"], state["lr"])
    assert torch.equal(restored.got["base_lrs"][0], torch.ones(2))


def test_stored_values_load_as_data_only(tmp_path):
    """NumPy's RNG state (an array) and plain values load; a value that would call eval is
    refused."""
    rng = np.random.get_state()
    got = load_value(torch_saved(rng), "x")
    assert got[0] == rng[0] and np.array_equal(got[1], rng[1]) and got[2:] == rng[2:]
    assert load_value(torch_saved(random.getstate()), "x") == random.getstate()
    marker = tmp_path / "PWNED"
    evil = torch_saved(_Evil(marker, 1))
    runs_under_plain_pickle(lambda: torch.load(io.BytesIO(evil), weights_only=False), marker)
    with pytest.raises(UntrustedCheckpoint, match="where.bin"):
        load_value(evil, "where.bin")
    assert not marker.exists()
