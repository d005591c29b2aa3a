"""Trust at the edges (issue 61): what torchllm reads from and writes to a folder someone else
may have made goes through torchllm.store. Each test runs the command a user types.

- the report (`python -m torchllm.report RUN`, and the run's own report hook) writes through no
  planted link, escapes the text it takes from the run folder, and refuses a link, FIFO or
  oversized file among the run's files (item 1);
- a step holding a link or FIFO is refused as a whole: `hf export` writes no other files'
  weights, a resume stops on every rank instead of falling back (item 4);
- only canonical step folder names count: `step-04` beside `step-4` is ignored, never makes a
  resume delete `step-4` (item 6).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
from pathlib import Path

import pytest

from torchllm.config import to_toml

from cli import run_module, run_train
from builders.checkpoint import copy_run
from conftest import tiny_args, tiny_config
from messages import refused

# ------------------------------------------------------------------------ item 1: the report


@pytest.fixture
def made_run(tmp_path):
    """A run folder someone else made: config.toml and report/run.json, no events."""
    run = tmp_path / "dump" / "run"
    (run / "report").mkdir(parents=True)
    (run / "config.toml").write_text(to_toml(tiny_config(tmp_path / "dump",
                                                         "--job.run_name=run")))
    (run / "report" / "run.json").write_text(json.dumps({"header": "run run", "wall_s": 3.0}))
    return run


def test_the_report_writes_through_no_planted_link(made_run, tmp_path):
    """report.md.tmp (the old temp name) a link to a .pth file in site-packages, report.md a
    link to another file: neither target is written, report.md is a new file."""
    site = tmp_path / "site-packages"
    site.mkdir()
    pth, other = site / "evil.pth", tmp_path / "other.md"
    other.write_text("someone else's")
    os.symlink(pth, made_run / "report" / "report.md.tmp")
    os.symlink(other, made_run / "report" / "report.md")
    ran = run_module("torchllm.report", str(made_run))
    assert ran.returncode == 0, ran.out[-3000:]
    assert not pth.exists(), "the report was written through report.md.tmp's link"
    assert other.read_text() == "someone else's"
    report = made_run / "report" / "report.md"
    assert not report.is_symlink() and "# Report: run" in report.read_text()


def test_the_report_escapes_the_text_it_takes_from_the_run_folder(made_run):
    """run.json's header, hardware and checkpoint fields: no line of report.md starts with
    their text, no control character gets through, and the text is still shown (escaped)."""
    (made_run / "report" / "run.json").write_text(json.dumps({
        "header": "run run\nimport os; os.system('touch PWNED')\n```\n# Injected\x1b[2J",
        "hardware": "cpu\n# Fake heading", "checkpoint": "a|b\nimport sys"}))
    ran = run_module("torchllm.report", str(made_run))
    assert ran.returncode == 0, ran.out[-3000:]
    text = (made_run / "report" / "report.md").read_text()
    starts = ("import", "# Injected", "# Fake", "```")
    assert not [ln for ln in text.splitlines() if ln.startswith(starts)], text
    assert "\x1b" not in text and "\x1b" not in ran.out
    assert "import os; os.system" in text and "\\x1b[2J" in text and "# Fake heading" in text


def _link_config(run: Path, outside: Path) -> str:
    outside.write_text((run / "config.toml").read_text())
    (run / "config.toml").unlink()
    os.symlink(outside, run / "config.toml")
    return "config.toml"


def _link_info(run: Path, outside: Path) -> str:
    outside.write_text('{"header": "another run"}')
    (run / "report" / "run.json").unlink()
    os.symlink(outside, run / "report" / "run.json")
    return "report/run.json"


def _link_report_folder(run: Path, outside: Path) -> str:
    outside.mkdir()
    shutil.move(run / "report" / "run.json", outside / "run.json")
    (run / "report").rmdir()
    os.symlink(outside, run / "report")
    return "report"


def _fifo_info(run: Path, outside: Path) -> str:
    (run / "report" / "run.json").unlink()
    os.mkfifo(run / "report" / "run.json")
    return "report/run.json"


def _huge_info(run: Path, outside: Path) -> str:
    (run / "report" / "run.json").write_text(json.dumps({"header": "x" * (17 << 20)}))
    return "report/run.json"


@pytest.mark.parametrize("plant", [_link_config, _link_info, _link_report_folder, _fifo_info,
                                   _huge_info])
def test_the_report_refuses_a_link_fifo_or_huge_file_in_the_run_folder(made_run, tmp_path,
                                                                         plant):
    """Refused in one line naming the entry (exit 2); nothing written, outside or in."""
    outside = tmp_path / "outside"
    name = plant(made_run, outside)
    before = sorted(p.name for p in tmp_path.rglob("*"))
    ran = run_module("torchllm.report", str(made_run))
    refused(ran, made_run / name)
    assert sorted(p.name for p in tmp_path.rglob("*")) == before  # no report.md anywhere


@pytest.mark.slow
def test_a_runs_own_writes_follow_no_planted_link(tmp_path):
    """The run folder holds links at the temp names of the run's config.toml, report/run.json,
    report.md and lock (as a folder made by someone else may): a run with the report on writes
    none of their targets, and leaves its files in place of the links."""
    run = tmp_path / "run"
    (run / "report").mkdir(parents=True)
    lock_tmp = f"run.lock.new.{socket.gethostname()}.{os.getpid()}"  # rank 0 runs in here
    targets = {name: tmp_path / f"target{i}" for i, name in enumerate(
        (".config.toml.tmp", "report/run.tmp", "report/report.md.tmp", lock_tmp))}
    for name, target in targets.items():
        target.write_text("theirs")
        os.symlink(target, run / name)
    ran = run_train(*tiny_args(tmp_path, "--job.run_name=run", "--training.steps=2",
                               "--metrics.report=true"))
    assert ran.returncode == 0, ran.out[-3000:]
    assert {n: t.read_text() for n, t in targets.items()} == dict.fromkeys(targets, "theirs")
    for name in ("config.toml", "report/run.json", "report/report.md"):
        assert (run / name).is_file() and not (run / name).is_symlink(), name
    assert json.loads((run / "report" / "run.json").read_text())["launches"] == 1


# ------------------------------------------------------------------------ items 4 and 6: steps

CKPT = ["--checkpoint.enable", "--job.run_name=run", "--checkpoint.interval=2",
        "--checkpoint.keep_latest_k=0"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A finished 4-step run with checkpoints at steps 2 and 4 (copied by each test)."""
    root = tmp_path_factory.mktemp("trained")
    ran = run_train(*tiny_args(root, *CKPT))  # as the resumes below launch
    assert ran.returncode == 0, ran.out[-3000:]
    return root


@pytest.fixture
def root(trained, tmp_path):
    return copy_run(trained, tmp_path / "dump")


def step(root: Path, n: int) -> Path:
    return root / "run" / "checkpoint" / f"step-{n}"


def link_the_shard(folder: Path, elsewhere: Path) -> Path:
    """Move the step's largest shard out of it and link it back (the same bytes: its CRC-32
    matches COMPLETE); returns the link."""
    shard = max(folder.glob("*.distcp"), key=lambda f: f.stat().st_size)
    elsewhere.mkdir()
    shutil.move(shard, elsewhere / shard.name)
    os.symlink(elsewhere / shard.name, shard)
    return shard


def add_a_fifo(folder: Path, elsewhere: Path) -> Path:
    os.mkfifo(folder / "__9_0.distcp")
    return folder / "__9_0.distcp"


@pytest.mark.parametrize("plant", [link_the_shard, add_a_fifo])
def test_hf_export_refuses_a_step_holding_a_link_or_fifo(root, tmp_path, plant):
    entry = plant(step(root, 4), tmp_path / "elsewhere")
    out = tmp_path / "hf"
    ran = run_module("torchllm.hf", "export", "--checkpoint", str(root / "run"), "--out",
                     str(out))
    refused(ran, entry)
    assert not out.exists()


def test_a_resume_stops_at_a_step_holding_a_link_without_falling_back(root, tmp_path):
    """The newest step's shard is a link: the resume stops (exit 2, naming it) instead of
    loading it or falling back to step 2; nothing is deleted."""
    shard = link_the_shard(step(root, 4), tmp_path / "elsewhere")
    ran = run_train(*tiny_args(root, *CKPT, "--training.steps=6"))
    refused(ran, shard)
    assert "trying an earlier one" not in ran.out and "resumed from" not in ran.out
    assert step(root, 2).is_dir() and shard.is_symlink() and not step(root, 6).exists()


@pytest.mark.slow
def test_a_resume_ignores_step_folders_whose_names_are_not_canonical(root, caplog):
    """Empty `step-04`, `step-004`, `step-٤` (Arabic-Indic four) and other scripts' fours
    beside the complete `step-4`: the resume continues from step 4, deletes none of them, and
    names each. (Parsed as step 4, the one listed last decided step 4's state: with eight of
    them, step-4 is rarely last, whatever order the file system lists them in.)"""
    fours = ("step-04", "step-004", "step-0004", "step-\u0664", "step-\u06f4", "step-\u096a",
             "step-\u09ea", "step-\uff14")
    planted = [step(root, 4).with_name(name) for name in fours]
    for folder in planted:
        folder.mkdir()
    ran = run_train(*tiny_args(root, *CKPT, "--training.steps=6"))
    assert ran.returncode == 0, ran.out[-3000:]
    assert f"resumed from {step(root, 4)} (step 4)" in ran.out
    assert step(root, 4).is_dir() and step(root, 6).is_dir()
    for folder in planted:
        assert folder.is_dir(), folder
        assert [ln for ln in ran.out.splitlines() if repr(folder.name) in ln and "ignoring" in ln]
