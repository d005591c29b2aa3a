"""Checkpoints are data, never code (issue 42): a `.metadata`, a `.distcp` value or a pickled
state that would run code is refused by every command that reads a checkpoint, with one line
naming the file; and every reader verifies the CRC-32s the COMPLETE marker recorded.

Each poisoned checkpoint's payload is first shown to run under a plain unpickler (it writes a
marker file, then returns the real value), and the marker's CRC-32s are updated, so only the
restricted unpickler stands between the payload and the command."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import pickle
import random
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata

from torchllm.checkpoint.integrity import folder_checksums
from torchllm.checkpoint.layout import MARKER, dcp_writer
from torchllm.checkpoint.reader import CorruptCheckpoint, dcp_reader
from torchllm.checkpoint.safe_load import UntrustedCheckpoint, load_bytes
from torchllm.checkpoint.state import PickledState, TrainState
from torchllm.train import Trainer

from conftest import REPO, tiny_args, tiny_config

CKPT = ["--checkpoint.enable", "--job.run_name=run", "--checkpoint.interval=2",
        "--training.steps=2"]
REFUSED = "is not a checkpoint file torchllm trusts"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A finished 2-step run with its checkpoint at step 2 (copied by each test)."""
    root = tmp_path_factory.mktemp("trained")
    Trainer(tiny_config(root, *CKPT)).train()
    return root


@pytest.fixture
def run(trained, tmp_path):
    shutil.copytree(trained, tmp_path / "root")
    return tmp_path / "root"


def step_of(root: Path) -> Path:
    return root / "run" / "checkpoint" / "step-2"


def reseal(step: Path) -> None:
    """Record the files' current sizes and CRC-32s in COMPLETE, as a careful attacker would."""
    record = json.loads((step / MARKER).read_text())
    record["files"] = folder_checksums(step)
    (step / MARKER).write_text(json.dumps(record))


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
    path = step / ".metadata"
    poisoned = payload(marker) + path.read_bytes()
    got = runs_under_plain_pickle(lambda: pickle.loads(poisoned), marker)
    assert isinstance(got, Metadata) and got.state_dict_metadata
    path.write_bytes(poisoned)
    reseal(step)
    return path


def saved_value(step: Path, key: str, fqn: str):
    sd = {key: {fqn: None}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(sd, checkpoint_id=str(step), no_dist=True)
    return sd[key][fqn]


def replace_value(step: Path, fqn: str, saved: bytes) -> Path:
    """Point the `.metadata` entry of the bytes value `fqn` at `saved` (a torch.save) appended
    to the .distcp file that holds it; returns that file."""
    metadata = pickle.loads((step / ".metadata").read_bytes())  # the test's own, trusted
    index = next(i for i in metadata.storage_data if i.fqn == fqn)
    info = metadata.storage_data[index]
    shard = step / info.relative_path
    offset = shard.stat().st_size
    with open(shard, "ab") as f:
        f.write(saved)
    metadata.storage_data[index] = dataclasses.replace(info, offset=offset, length=len(saved))
    (step / ".metadata").write_bytes(pickle.dumps(metadata))
    reseal(step)
    return shard


def torch_saved(value) -> bytes:
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def poison_pickled_state(step: Path, marker: Path) -> Path:
    """train_state.pickle: an inner pickle that runs the payload, then returns the counters."""
    real = saved_value(step, "train_state", "pickle")
    poisoned = payload(marker) + real
    got = runs_under_plain_pickle(lambda: pickle.loads(poisoned), marker)
    assert got == pickle.loads(real) and got["step"] == 2
    return replace_value(step, "train_state.pickle", torch_saved(poisoned))


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


def command(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "NGPU": "1"}
    return subprocess.run(list(args), cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)


def generate(root: Path) -> subprocess.CompletedProcess:
    return command(sys.executable, "-m", "torchllm.generate", "--checkpoint", str(root / "run"),
                   "--prompt", "To be", "--max-new-tokens", "2", "--device", "cpu")


def export(root: Path) -> subprocess.CompletedProcess:
    return command(sys.executable, "-m", "torchllm.hf", "export", "--checkpoint",
                   str(root / "run"), "--out", str(root / "hf"))


def run_train(root: Path, *extra: str) -> subprocess.CompletedProcess:
    return command("./run_train.sh", *tiny_args(root, *CKPT, "--metrics.progress_bar=false",
                                                *extra))


def refused_naming(proc: subprocess.CompletedProcess, path: Path, why: str = REFUSED) -> None:
    """The command failed (exit 2), and said why in one line naming `path`."""
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-3000:]
    lines = [line for line in out.splitlines() if str(path) in line and why in line]
    assert lines, out[-3000:]
    assert "Traceback" not in out, out[-3000:]


@pytest.mark.slow
def test_generate_and_export_refuse_a_metadata_that_runs_code(run, tmp_path):
    marker = tmp_path / "PWNED"
    metadata = poison_metadata(step_of(run), marker)
    refused_naming(generate(run), metadata)
    refused_naming(export(run), metadata)
    assert not (run / "hf").exists()
    assert not marker.exists()


@pytest.mark.slow
@pytest.mark.parametrize("entry", ["metadata", "pickled_state"])
def test_run_train_sh_resume_refuses_a_checkpoint_that_runs_code(run, tmp_path, entry):
    marker = tmp_path / "PWNED"
    step = step_of(run)
    path = (poison_metadata if entry == "metadata" else poison_pickled_state)(step, marker)
    proc = run_train(run, "--training.steps=4")
    refused_naming(proc, path)
    assert not marker.exists()
    assert not (run / "run" / "checkpoint" / "step-4").exists()


@pytest.mark.slow
def test_initial_load_path_refuses_a_metadata_that_runs_code(run, tmp_path):
    marker = tmp_path / "PWNED"
    metadata = poison_metadata(step_of(run), marker)
    fresh = tmp_path / "fresh"
    shutil.copytree(run / "run" / "data", fresh / "run" / "data")  # its tokenizer, cached
    proc = run_train(fresh, f"--checkpoint.initial_load_path={step_of(run)}")
    refused_naming(proc, metadata)
    assert not marker.exists()


@pytest.mark.slow
def test_generate_and_export_refuse_a_flipped_byte(run):
    shard = flip_a_byte(step_of(run))
    for proc in (generate(run), export(run)):
        refused_naming(proc, shard, "is corrupted: CRC-32")
    assert not (run / "hf").exists()


def test_convert_and_inference_loading_refuse_a_flipped_byte_or_code(run, tmp_path):
    from torchllm.hf.convert import main as convert
    from torchllm.eval.loading import load_for_inference

    step = step_of(run)
    out = tmp_path / "w.safetensors"
    assert convert(["to-file", str(run / "run"), str(out)]) == 0  # the clean checkpoint
    shard = flip_a_byte(step)
    with pytest.raises(CorruptCheckpoint, match=f"{shard} is corrupted"):
        load_for_inference(run / "run", "cpu")
    out.unlink()
    assert convert(["to-file", str(run / "run"), str(out)]) == 2 and not out.exists()
    flip_a_byte(step)  # back as saved
    marker = tmp_path / "PWNED"
    metadata = poison_metadata(step, marker)
    with pytest.raises(UntrustedCheckpoint, match=f"{metadata} {REFUSED}.*os.system"):
        load_for_inference(run / "run", "cpu")
    assert convert(["to-file", str(run / "run"), str(out)]) == 2 and not out.exists()
    assert not marker.exists()


@pytest.mark.parametrize("poison", [poison_rng_value, poison_pickled_state],
                         ids=["torch_saved_value", "pickled_state"])
def test_dcp_reads_of_poisoned_values_are_refused_naming_the_file(run, tmp_path, poison):
    from torch.distributed.checkpoint.api import CheckpointException

    from torchllm.checkpoint.safe_load import untrusted_cause

    marker = tmp_path / "PWNED"
    step = step_of(run)
    shard = poison(step, marker)
    key, fqn = ("rng_rank0", "python") if poison is poison_rng_value else ("train_state", "pickle")
    with pytest.raises(CheckpointException) as e:
        dcp.load({key: {fqn: None}}, storage_reader=dcp_reader(step), no_dist=True)
    assert f"{shard} (value {key}.{fqn}) {REFUSED}" in untrusted_cause(e.value)
    assert not marker.exists()


def test_restricted_metadata_reads_what_plain_pickle_reads(trained):
    """The allow-list covers a real checkpoint's .metadata: the same Metadata as pickle's."""
    step = step_of(trained)
    ours = dcp_reader(step).read_metadata()
    plain = pickle.loads((step / ".metadata").read_bytes())
    assert ours.state_dict_metadata == plain.state_dict_metadata
    assert ours.storage_data == plain.storage_data and ours.planner_data == plain.planner_data
    assert ours.storage_meta.load_id  # set as DCP's own reader sets it


def test_fsspec_checkpoints_are_read_through_the_allow_list(tmp_path):
    """A checkpoint written by DCP's fsspec writer (object stores) reads back; poisoned, it is
    refused."""
    url = f"file://{tmp_path}/step-1"
    state = {"model": {"w": torch.arange(6.0).reshape(2, 3)}, "train_state": {"step": 7}}
    dcp.save(state, storage_writer=dcp_writer(url), no_dist=True)
    loaded = {"model": {"w": torch.zeros(2, 3)}, "train_state": {"step": 0}}
    dcp.load(loaded, storage_reader=dcp_reader(url), no_dist=True)
    assert torch.equal(loaded["model"]["w"], state["model"]["w"])
    assert loaded["train_state"]["step"] == 7
    marker = tmp_path / "PWNED"
    path = tmp_path / "step-1" / ".metadata"
    path.write_bytes(payload(marker) + path.read_bytes())
    with pytest.raises(UntrustedCheckpoint, match="os.system"):
        dcp_reader(url).read_metadata()
    assert not marker.exists()


def test_pickled_state_loads_plain_pickles_of_data_and_refuses_code(tmp_path):
    state = TrainState(step=5, tokens_seen=640, best_val_loss=float("inf"))
    saved = PickledState(state).state_dict()  # as every checkpoint so far wrote it
    assert saved["pickle"] == pickle.dumps(state.state_dict())
    restored = TrainState()
    PickledState(restored).load_state_dict(saved)
    assert restored == state
    marker = tmp_path / "PWNED"
    poisoned = payload(marker) + saved["pickle"]
    runs_under_plain_pickle(lambda: pickle.loads(poisoned), marker)
    with pytest.raises(UntrustedCheckpoint, match="TrainState.*os.system"):
        PickledState(TrainState()).load_state_dict({"pickle": poisoned})
    assert not marker.exists()


def test_pickled_state_with_tensors_loads_and_their_storage_is_data_only(tmp_path):
    """A scheduler state holding tensors (AdamW8bit's: a tensor lr) loads; the storage bytes a
    tensor's pickle carries go through weights_only (plain pickle's _load_from_bytes runs
    anything in them)."""
    state = {"lr": torch.tensor(1e-3), "base_lrs": [torch.ones(2)], "step": 3}
    holder = type("Holder", (), {"state_dict": lambda self: state,
                                 "load_state_dict": lambda self, sd: setattr(self, "got", sd)})
    restored = holder()
    PickledState(restored).load_state_dict(PickledState(holder()).state_dict())
    assert restored.got["step"] == 3 and torch.equal(restored.got["lr"], state["lr"])
    marker = tmp_path / "PWNED"
    # torch.storage._load_from_bytes(<torch.save of a value whose unpickling runs code>)
    poisoned = (b"\x80\x04ctorch.storage\n_load_from_bytes\n"
                + pickle.dumps(torch_saved(_Evil(marker, 1)), protocol=4)[2:-1] + b"\x85R.")
    runs_under_plain_pickle(lambda: pickle.loads(poisoned), marker)
    with pytest.raises((UntrustedCheckpoint, ValueError)):
        PickledState(holder()).load_state_dict({"pickle": poisoned})
    assert not marker.exists()


def test_stored_values_load_as_data_only(tmp_path):
    """NumPy's RNG state (an array) and plain values load; a value that would call eval is
    refused."""
    rng = np.random.get_state()
    got = load_bytes(torch_saved(rng), "x")
    assert got[0] == rng[0] and np.array_equal(got[1], rng[1]) and got[2:] == rng[2:]
    assert load_bytes(torch_saved(random.getstate()), "x") == random.getstate()
    marker = tmp_path / "PWNED"
    evil = torch_saved(_Evil(marker, 1))
    runs_under_plain_pickle(lambda: torch.load(io.BytesIO(evil), weights_only=False), marker)
    with pytest.raises(UntrustedCheckpoint, match="where.bin"):
        load_bytes(evil, "where.bin")
    assert not marker.exists()
