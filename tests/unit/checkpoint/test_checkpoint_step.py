"""A checkpoint is data that cannot run code, and its reads cannot leave it (issue 52, items 1-3):
a checkpoint's config.toml never imports code, no pickle in a checkpoint is unpickled (an older
torchllm's is refused, naming the one-time conversion, which then makes it load), and a `Step`
is checked as a whole before any tensor is read: every recorded read inside a file COMPLETE
lists, within its recorded size."""

from __future__ import annotations

import json
import logging
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from torchllm.checkpoint import CorruptCheckpoint, UntrustedCheckpoint, open_checkpoint
from torchllm.checkpoint.index import INDEX
from torchllm.checkpoint.integrity import folder_checksums
from torchllm.checkpoint.layout import MARKER
from torchllm.train import Trainer

from cli import run_module
from conftest import REPO, tiny_config
from checkpoint_edits import edit_index, reseal
from messages import refused

CKPT = ["--checkpoint.enable", "--job.run_name=run", "--checkpoint.interval=2",
        "--training.steps=2"]
LEGACY = REPO / "tests" / "legacy_checkpoint" / "run"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A finished 2-step run with its checkpoint at step 2 (copied by each test)."""
    root = tmp_path_factory.mktemp("trained")
    Trainer(tiny_config(root, *CKPT)).train()
    return root / "run"


def step2(run: Path) -> Path:
    return run / "checkpoint" / "step-2"


# ------------------------------------------------------------------------ item 1: custom_import


def test_a_downloaded_checkpoint_config_never_imports_code(trained, tmp_path, monkeypatch):
    """`custom_import` in a checkpoint's config.toml (COMPLETE resealed): hf export, generate and
    the evals, run from the folder above, never import it; the user's own flag still does."""
    dl = tmp_path / "dl" / "run"
    shutil.copytree(trained, dl)
    pwned = tmp_path / "PWNED"
    (dl / "payload.py").write_text(f"open({str(pwned)!r}, 'w').close()\n")
    config = step2(dl) / "config.toml"
    config.write_text(config.read_text().replace("[job]\n",
                                                 '[job]\ncustom_import = "dl.run.payload"\n', 1))
    reseal(step2(dl))
    # The folder above the download is importable, as `python -m` run from there makes it.
    monkeypatch.syspath_prepend(str(tmp_path))
    proc = run_module("torchllm.hf", "export", "--checkpoint", str(dl), "--out",
                      str(tmp_path / "x"))
    assert proc.returncode == 0, proc.out[-3000:]
    assert not pwned.exists(), "hf export imported the checkpoint's custom_import"
    assert "job.custom_import" in proc.out  # said, not silently dropped
    # generate and the evals load through load_for_inference
    from torchllm.eval.loading import load_for_inference

    monkeypatch.chdir(tmp_path)
    try:
        load_for_inference("dl/run", "cpu")
        assert not pwned.exists(), "load_for_inference imported the checkpoint's custom_import"
        load_for_inference("dl/run", "cpu", ["--job.custom_import=dl.run.payload"])
        assert pwned.exists()  # the user's own command line is honoured
    finally:  # the payload's modules, imported from this test's folder
        for name in [m for m in sys.modules if m == "dl" or m.startswith("dl.")]:
            del sys.modules[name]


# ------------------------------------------------------------------------ item 2: no pickle


def poison_index(step: Path, pwned: Path) -> Path:
    """A pickle `.metadata` that uses only a name the old allow-list let through (pathlib's
    PosixPath: its BUILD makes `PosixPath.parent` a constant for the whole process), then calls
    os.system. Under plain pickle both happen (checked in a child process)."""
    evil = (b"\x80\x04cpathlib\nPosixPath\nN}(Vparent\nVx\nu\x86b0"
            b"cos\nsystem\n(V" + f"touch {pwned}".encode() + b"\ntR0N.")
    probe = subprocess.run([sys.executable, "-c", "import pickle, sys, pathlib; "
                            "pickle.loads(sys.stdin.buffer.read()); "
                            "print(pathlib.Path('/a/b').parent)"],
                           input=evil, capture_output=True, timeout=60)
    assert probe.stdout.strip() == b"x" and pwned.exists(), "the payload proves nothing"
    pwned.unlink()
    path = step / INDEX
    path.write_bytes(evil)
    reseal(step)
    return path


def test_a_pickle_index_is_refused_naming_the_conversion(trained, tmp_path):
    """hf export refuses it in one line naming the file and the conversion command; read in
    this process, it changes no class and runs nothing."""
    from pathlib import PosixPath

    run = tmp_path / "run"
    shutil.copytree(trained, run)
    pwned = tmp_path / "PWNED"
    index = poison_index(step2(run), pwned)
    try:  # hf export runs in this process too: what it reads must change no class either
        proc = run_module("torchllm.hf", "export", "--checkpoint", str(run), "--out",
                          str(tmp_path / "x"))
        refused(proc, str(index), "convert_legacy --checkpoint")
        assert "parent" not in PosixPath.__dict__, "hf export's read rewrote pathlib.PosixPath"
        assert not pwned.exists() and not (tmp_path / "x").exists()
        with pytest.raises(UntrustedCheckpoint, match="convert_legacy"):
            open_checkpoint(run)
        assert "parent" not in PosixPath.__dict__, "the index rewrote pathlib.PosixPath"
        assert not pwned.exists()
    finally:
        if "parent" in PosixPath.__dict__:  # (only on code that unpickles it)
            delattr(PosixPath, "parent")


def test_an_older_checkpoint_is_refused_then_converted_once_and_loads(tmp_path):
    """A step written by the older torchllm (pickled index and states): refused by generate in
    one line naming the conversion; converted by that command, it loads and resumes exactly
    (test_golden_curves resumes the converted golden checkpoint)."""
    run = tmp_path / "run"
    shutil.copytree(LEGACY, run)
    step = run / "checkpoint" / "step-3"
    assert (step / INDEX).read_bytes()[:1] == b"\x80"  # a pickle, as the older code wrote
    with pytest.raises(UntrustedCheckpoint) as e:
        open_checkpoint(run)
    assert str(step / INDEX) in str(e.value) and "convert_legacy" in str(e.value)
    proc = run_module("torchllm.checkpoint.convert_legacy", "--checkpoint", str(run))
    assert proc.returncode == 0 and "converted" in proc.stdout, proc.out[-3000:]
    opened = open_checkpoint(run)  # checksums match the rewritten marker
    assert "train_state.json" in opened.metadata.state_dict_metadata
    assert len(opened.weights()) > 0
    again = run_module("torchllm.checkpoint.convert_legacy", "--checkpoint", str(step))
    assert again.returncode == 0 and "already" in again.stdout, again.out[-3000:]


def test_json_state_round_trips_and_never_unpickles(tmp_path):
    import torch

    from torchllm.checkpoint.state import JSONState, TrainState

    state = {"lr": torch.tensor([1e-3]), "t": (1, 2), "b": b"\x00\x01", 3: {"x": float("inf")}}
    holder = type("Holder", (), {"state_dict": lambda self: state,
                                 "load_state_dict": lambda self, sd: setattr(self, "got", sd)})
    got = holder()
    JSONState(got).load_state_dict(JSONState(holder()).state_dict())
    assert got.got["t"] == (1, 2) and got.got["b"] == b"\x00\x01" and got.got[3]["x"] == \
        float("inf") and torch.equal(got.got["lr"], state["lr"])
    pwned = tmp_path / "PWNED"
    evil = b"cos\nsystem\n(V" + f"touch {pwned}".encode() + b"\ntR0" + pickle.dumps({"step": 1})
    with pytest.raises(UntrustedCheckpoint, match="convert_legacy"):
        JSONState(TrainState()).load_state_dict({"pickle": evil})
    assert not pwned.exists()


# ------------------------------------------------------------------------ item 3: reads stay inside


def test_an_index_reading_outside_the_step_is_refused_before_any_tensor(trained, tmp_path):
    """A chunk path `../..` into another run's step: hf export refuses in one line, exports
    nothing (it exported the other run's weights)."""
    run, other = tmp_path / "run", tmp_path / "other_run"
    shutil.copytree(trained, run)
    shutil.copytree(trained, other)

    def elsewhere(index):
        index["storage"][0]["file"] = "../../../other_run/checkpoint/step-2/__0_0.distcp"

    edit_index(step2(run), elsewhere)
    proc = run_module("torchllm.hf", "export", "--checkpoint", str(run), "--out",
                      str(tmp_path / "x"))
    refused(proc, str(step2(run) / INDEX), "../other_run/checkpoint/step-2/__0_0.distcp")
    assert not (tmp_path / "x").exists()


def test_an_over_long_read_is_refused_before_reading(trained, tmp_path, caplog):
    """A length of 3 GB: a resume refuses the step in one line (it read 3.3 GB before), and so
    does generate's loader; a chunk file COMPLETE does not list is refused too."""
    run = tmp_path / "root" / "run"
    shutil.copytree(trained, run)

    def huge(index):
        index["storage"][0]["length"] = 3 * 10**9

    edit_index(step2(run), huge)
    with pytest.raises(CorruptCheckpoint) as e:
        open_checkpoint(run)
    assert "0..3000000000" in str(e.value) and "__0_0.distcp" in str(e.value), str(e.value)
    with caplog.at_level(logging.WARNING, logger="torchllm"), \
            pytest.raises(RuntimeError) as e:
        Trainer(tiny_config(tmp_path / "root", *CKPT, "--training.steps=4")).train()
    assert str(run / "checkpoint") in str(e.value) and "[2]" in str(e.value), str(e.value)
    assert [r for r in caplog.records if "0..3000000000" in r.getMessage()
            and "__0_0.distcp" in r.getMessage()], caplog.text

    def unlisted(index):
        index["storage"][0]["file"] = "extra.distcp"

    shutil.rmtree(run)
    shutil.copytree(trained, run)
    shutil.copy(step2(run) / "__0_0.distcp", step2(run) / "extra.distcp")  # not in COMPLETE
    index = json.loads((step2(run) / INDEX).read_text())
    unlisted(index)
    (step2(run) / INDEX).write_text(json.dumps(index))
    record = json.loads((step2(run) / MARKER).read_text())
    record["files"] = {k: v for k, v in folder_checksums(step2(run)).items()
                       if k != "extra.distcp"}
    (step2(run) / MARKER).write_text(json.dumps(record))
    with pytest.raises(CorruptCheckpoint) as e:
        open_checkpoint(run)
    # the file named, and the files the step has (COMPLETE's list)
    assert "'extra.distcp'" in str(e.value) and "__0_0.distcp" in str(e.value), str(e.value)
