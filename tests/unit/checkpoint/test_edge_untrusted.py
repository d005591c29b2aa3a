"""Trust at the edges (issue 61): a checkpoint's bytes are data, read bounded, and refused in
one line through the user's command.

- convert_legacy verifies the old step's CRC-32s before it reseals (item 11), reads its pickles
  with an allow-list (item 14: nothing runs, a name outside it is refused), and writes the new
  step beside the old one, swapped in only when complete: interrupted anywhere, the step stays
  complete and a resume never deletes it (item 7);
- a tensor chunk that names code stops the resume on the spot: no fallback, the step kept
  as found (item 8); `hf export` of it says so in one line;
- an index is read no further than COMPLETE's recorded size (a 64 MB sparse `.metadata`, a
  recorded 3 GB), and only a file that starts like a pickle is called one (item 14);
- an index nested 200,000 deep, a size of 2**70, a `torch.qint8` weight, a `complex64` weight
  at resume, a raw pickle value: one line each, naming the file and the value; a COMPLETE
  nested 200,000 deep is a damaged marker (the resume falls back) (item 15).
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from torchllm.checkpoint import open_checkpoint
from torchllm.checkpoint import convert_legacy
from torchllm.checkpoint.index import INDEX, UntrustedCheckpoint, encode_index
from torchllm.checkpoint.layout import MARKER, scan_steps
from torchllm.checkpoint.step import Step

import cli
from builders.checkpoint import copy_run, trained_once
from conftest import REPO, tiny_args
from checkpoint_edits import edit_index, reseal
from messages import refused

# (validation off in the trained run and its resumes alike: it decides what is held out)
CKPT = ["--checkpoint.enable", "--validation.enable=false", "--job.run_name=run",
        "--checkpoint.interval=2",
        "--checkpoint.keep_latest_k=0", "--metrics.progress_bar=false"]
LEGACY = REPO / "tests" / "legacy_checkpoint" / "run"
CONVERT = "torchllm.checkpoint.convert_legacy"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A finished 4-step run with checkpoints at steps 2 and 4 (copied by each test)."""
    return trained_once(tmp_path_factory, *CKPT)


@pytest.fixture
def run(trained, tmp_path):
    return copy_run(trained, tmp_path / "root")


def step(root: Path, n: int) -> Path:
    return root / "run" / "checkpoint" / f"step-{n}"


def torch_saved(value) -> bytes:
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


class _Evil:
    """torch.save's pickle of this calls eval (touching `marker`) when a plain unpickler reads
    it."""

    def __init__(self, marker: Path):
        self.source = f"(__import__('os').system('touch {marker}'), 0)[1]"

    def __reduce__(self):
        return eval, (self.source,)


def replace_entry(folder: Path, fqn: str, saved: bytes, dtype: str | None = None) -> Path:
    """Point the index entry of `fqn` (a tensor or value) at `saved`, appended to the file
    holding it (its recorded dtype set to `dtype`); COMPLETE resealed. Returns that file."""
    metadata = Step.open(folder).metadata
    index = next(i for i in metadata.storage_data if i.fqn == fqn)
    info = metadata.storage_data[index]
    shard = folder / info.relative_path
    offset = shard.stat().st_size
    with open(shard, "ab") as f:
        f.write(saved)
    metadata.storage_data[index] = dataclasses.replace(info, offset=offset, length=len(saved))
    record = json.loads(encode_index(metadata))
    if dtype is not None:
        record["tensors"][fqn]["dtype"] = dtype
    (folder / INDEX).write_text(json.dumps(record))
    reseal(folder)
    return shard


def a_weight(folder: Path) -> str:
    return next(k for k in Step.open(folder).metadata.state_dict_metadata
                if k.startswith("model.") and k.endswith("weight"))


def export(root: Path) -> cli.Ran:
    return cli.run_module("torchllm.hf", "export", "--checkpoint", str(root / "run"), "--out",
                          str(root / "hf"))


def resume(root: Path, steps: int = 6) -> cli.Ran:
    return cli.run_train(*tiny_args(root, *CKPT, f"--training.steps={steps}"))


def legacy_copy(tmp_path: Path) -> Path:
    shutil.copytree(LEGACY, tmp_path / "run")
    return tmp_path / "run" / "checkpoint" / "step-3"


# ------------------------------------------------------------------------ convert_legacy


def test_convert_legacy_refuses_a_step_whose_files_changed(tmp_path):
    """One flipped bit in a chunk: refused (exit 2, the file and both CRC-32s named), nothing
    resealed, the step left as it was (it resealed the change, which then passed every check)."""
    old = legacy_copy(tmp_path)
    shard = old / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x10
    shard.write_bytes(bytes(data))
    before = {p.name: p.read_bytes() for p in old.iterdir()}
    refused(cli.run_module(CONVERT, "--checkpoint", str(old)), shard, "CRC-32")
    assert {p.name: p.read_bytes() for p in old.iterdir()} == before


@pytest.mark.parametrize("payload", ["os_system", "class_attribute"])
def test_convert_legacy_builds_data_only(tmp_path, payload):
    """A legacy `.metadata` that calls os.system, or that sets an attribute of an allowed class
    (as pathlib.PosixPath once was rewritten): convert_legacy refuses it in one line naming the
    file and what it found; nothing ran, no class changed, the step is left as it was."""
    from torch.distributed.checkpoint.metadata import Metadata

    old = legacy_copy(tmp_path)
    pwned = tmp_path / "PWNED"
    index = old / INDEX
    if payload == "os_system":
        index.write_bytes(b"cos\nsystem\n(V" + f"touch {pwned}".encode() + b"\ntR0"
                          + index.read_bytes())
        named = "os.system"
    else:
        index.write_bytes(b"\x80\x04ctorch.distributed.checkpoint.metadata\nMetadata\n"
                          b"N}(V__eq__\nVx\nu\x86b0" + index.read_bytes()[2:])
        named = "Metadata"
    reseal(old)
    try:
        refused(cli.run_module(CONVERT, "--checkpoint", str(old)), index, named)
        assert not pwned.exists() and "__eq__" in Metadata.__dict__ \
            and Metadata.__dict__["__eq__"] != "x"
    finally:
        if Metadata.__dict__.get("__eq__") == "x":  # (only on code that unpickles it)
            del Metadata.__eq__
    assert (old / MARKER).is_file() and index.read_bytes()[:1] != b"{"


def _interrupt(monkeypatch, where: str, old: Path) -> None:
    """Make convert_legacy stop (KeyboardInterrupt) at `where`."""
    def stop(*args, **kwargs):
        raise KeyboardInterrupt(where)

    if where == "writing":  # the new step's files written, its marker not yet
        monkeypatch.setattr(convert_legacy, "folder_checksums", stop)
    elif where == "swapped":  # the new step in place, the old one not yet removed
        real_sync = convert_legacy._fsync_folder
        monkeypatch.setattr(convert_legacy, "_fsync_folder", lambda path: (
            stop() if Path(path) == old.parent else real_sync(path)))
    else:  # "renames": no atomic exchange, stopped between its two renames
        monkeypatch.setattr(convert_legacy, "_exchange", lambda a, b: False)
        real = Path.rename

        def rename(self, target):
            if self.name.endswith(convert_legacy.CONVERTING):
                stop()
            return real(self, target)

        monkeypatch.setattr(Path, "rename", rename)


@pytest.mark.parametrize("where", ["writing", "swapped", "renames"])
def test_an_interrupted_conversion_never_loses_the_step(tmp_path, monkeypatch, where):
    """convert_legacy stopped while writing, after its swap, or between two renames: the step
    is complete (the old or the new one; between renames the old one set aside, not deleted),
    a resume's scan never calls it partial (it deleted the step: the marker was removed first
    and written last), and running the command again converts it."""
    old = legacy_copy(tmp_path)
    _interrupt(monkeypatch, where, old)
    with pytest.raises(KeyboardInterrupt):
        convert_legacy.main(["--checkpoint", str(tmp_path / "run")])
    monkeypatch.undo()
    folder = old.parent
    if where == "renames":
        aside = folder / (old.name + convert_legacy.OLD)
        assert not old.exists() and (aside / MARKER).is_file() and (aside / INDEX).is_file()
    else:
        assert scan_steps(folder) == {3: "complete"}
        try:
            open_checkpoint(old)  # the new step, complete
        except UntrustedCheckpoint as e:  # the old step, as it was: convert it
            assert "convert_legacy" in str(e)
    proc = cli.run_module(CONVERT, "--checkpoint", str(tmp_path / "run"))
    assert proc.returncode == 0, proc.out[-3000:]
    assert len(open_checkpoint(old).weights()) > 0
    assert sorted(p.name for p in folder.iterdir()) == ["step-3"]


# ------------------------------------------------------------------------ chunks and values


@pytest.mark.slow
def test_a_weight_chunk_that_names_code_stops_the_resume(run, tmp_path):
    """A model weight's chunk replaced by a torch.save that calls eval: the resume stops (exit
    2, one line naming the file, the tensor and `eval`) instead of falling back to step 2 and
    saving over the tampered step-4; `hf export` says the same in one line."""
    pwned = tmp_path / "PWNED"
    newest = step(run, 4)
    fqn = a_weight(newest)
    shard = replace_entry(newest, fqn, torch_saved(_Evil(pwned)))
    tampered = shard.read_bytes()
    line = refused(resume(run), shard, fqn, "eval")
    assert "weights_only" not in line
    assert shard.read_bytes() == tampered and not step(run, 6).exists()
    refused(export(run), shard, "eval")
    assert not (run / "hf").exists() and not pwned.exists()


@pytest.mark.slow
def test_a_raw_pickle_value_is_refused_naming_the_global(run, tmp_path):
    """A stored value that is a bare pickle calling os.system: one line naming `os.system`,
    never PyTorch's advice to load it with weights_only=False."""
    pwned = tmp_path / "PWNED"
    shard = replace_entry(step(run, 4), "rng_rank0.python",
                          b"cos\nsystem\n(V" + f"touch {pwned}".encode() + b"\ntR.")
    ran = resume(run)
    refused(ran, shard, "rng_rank0.python", "os.system")
    assert "weights_only" not in ran.out and not pwned.exists()


@pytest.mark.slow
def test_a_complex_weight_stops_the_resume(run):
    """A float32 weight stored as complex64 (index and chunk agree, COMPLETE resealed): exit 2,
    one line naming the index, the tensor and complex64 (it loaded, or fell back)."""
    newest = step(run, 4)
    fqn = a_weight(newest)
    shape = Step.open(newest).metadata.state_dict_metadata[fqn].size
    replace_entry(newest, fqn, torch_saved(torch.zeros(shape, dtype=torch.complex64)),
                  dtype="torch.complex64")
    refused(resume(run), newest / INDEX, fqn, "complex64")
    assert not step(run, 6).exists()


@pytest.mark.slow
def test_a_deeply_nested_marker_is_a_damaged_one(run):
    """COMPLETE nested 200,000 deep: a damaged marker like any other (a warning naming it, the
    resume falls back to step 2), not a RecursionError."""
    marker = step(run, 4) / MARKER
    marker.write_text("[" * 200_000 + "]" * 200_000)
    ran = resume(run)
    assert ran.returncode == 0, ran.out[-3000:]
    assert "Traceback" not in ran.out
    assert [x for x in ran.out.splitlines() if str(marker) in x and "nested" in x], ran.out[-3000:]
    assert f"resumed from {step(run, 2)}" in ran.out


# ------------------------------------------------------------------------ the index


def test_an_index_is_read_no_further_than_its_recorded_size(run):
    """A 64 MB sparse `.metadata` (COMPLETE records 80 KB), then a COMPLETE recording 3 GB:
    refused before reading, one line naming the file and its size; then 4 KB of zeros (resealed):
    a damaged index. None is called a pickle nor advised to convert_legacy."""
    index = step(run, 4) / INDEX
    os.truncate(index, 64 << 20)
    line = refused(export(run), index, "67,108,864")
    assert "convert_legacy" not in line and "pickle" not in line
    record = json.loads((step(run, 4) / MARKER).read_text())
    record["files"][INDEX]["bytes"] = 3 * 10**9
    (step(run, 4) / MARKER).write_text(json.dumps(record))
    line = refused(export(run), index, "3,000,000,000")
    assert "convert_legacy" not in line
    index.write_bytes(bytes(4096))  # the recorded size, zeros: no pickle
    reseal(step(run, 4))
    line = refused(export(run), index, "neither")
    assert "convert_legacy" not in line
    assert not (run / "hf").exists()


FIELDS = {
    "nested": (None, "nested too deeply"),
    "size": (lambda t: t.update(size=[2**70]), str(2**70)),
    "bytes": (lambda t: t.update(size=[2**40, 2**40]), str([2**40, 2**40])),
    "qint8": (lambda t: t.update(dtype="torch.qint8"), "torch.qint8"),
}


@pytest.mark.parametrize("field", list(FIELDS))
def test_index_fields_beyond_what_a_checkpoint_holds_are_one_line(run, field):
    """An index field nested 200,000 deep, a tensor size of 2**70 or of 2**40 x 2**40 (more
    bytes than the step has), a torch.qint8 weight: `hf export` refuses in one line naming the
    index and the value (were tracebacks: RecursionError, overflows, an INTERNAL ASSERT)."""
    change, named = FIELDS[field]
    newest = step(run, 4)
    fqn = a_weight(newest)
    if field == "nested":
        text = (newest / INDEX).read_text()
        (newest / INDEX).write_text(text[:-1] + ',"deep":' + "[" * 200_000 + "]" * 200_000
                                    + "}")
        reseal(newest)
    else:
        edit_index(newest, lambda index: change(index["tensors"][fqn]))
    line = refused(export(run), newest / INDEX, named)
    assert field == "nested" or fqn in line
    assert not (run / "hf").exists()


def test_a_legacy_state_builds_plain_values_only(tmp_path):
    """A legacy small state (`<key>.pickle`) is unpickled by the allow-list: plain values load,
    a global is refused naming it."""
    from torchllm.checkpoint.legacy_pickle import LegacyRefused, legacy_state

    assert legacy_state(pickle.dumps({"step": 3, "x": [1.5, (2, "a")]}), "s") == \
        {"step": 3, "x": [1.5, (2, "a")]}
    pwned = tmp_path / "PWNED"
    with pytest.raises(LegacyRefused, match="where.pickle names os.system"):
        legacy_state(b"cos\nsystem\n(V" + f"touch {pwned}".encode() + b"\ntR.", "where.pickle")
    assert not pwned.exists()
