"""benchmarks/bench_revisions.py: this tree against an earlier revision, side by side."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO

TINY = ("--training.seq_len=32 --training.local_batch_size=2 --data.tokenizer_vocab_size=512 "
        "--lr_scheduler.warmup_steps=1 --training.global_batch_size=-1")


def checkout_copy(dest: Path) -> Path:
    """What the benchmark runs of a checkout: the package, the launcher, the configs."""
    for part in ("torchllm", "train_configs"):
        shutil.copytree(REPO / part, dest / part, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy2(REPO / "run_train.sh", dest / "run_train.sh")
    return dest


@pytest.mark.slow
def test_both_trees_run_their_own_code_and_the_ratio_is_after_over_before(tmp_path):
    """--before as another checkout's folder (a revision is checked out to one the same way:
    the mutation run's copy of the repository is no git clone)."""
    before = checkout_copy(tmp_path / "other")
    out = tmp_path / "rev.json"
    ran = subprocess.run(
        [sys.executable, "benchmarks/bench_revisions.py", "--before", str(before), "--configs",
         "debug_model", "--steps", "4", "--rounds", "1", "--overrides", TINY, "--json", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=600)
    assert ran.returncode == 0, ran.stdout[-2000:] + ran.stderr[-2000:]
    got = json.loads(out.read_text())
    # each tree imported its own package: the other checkout and this repository
    assert got["code"] == {"before": str(before.resolve() / "torchllm"),
                           "after": str(REPO.resolve() / "torchllm")}
    (row,) = got["rows"]
    assert row["config"] == "debug_model"
    for side in ("before", "after"):
        assert row[f"{side}_step_ms"] > 0 and row[f"{side}_cpu_s"] > 0
    assert row["step_ratio"] == round(row["after_step_ms"] / row["before_step_ms"], 3)
    assert row["cpu_ratio"] == round(row["after_cpu_s"] / row["before_cpu_s"], 3)
    assert "| debug_model |" in ran.stdout and "machine: CPU " in ran.stdout  # the class, named


def test_a_revision_that_does_not_exist_is_named(tmp_path):
    ran = subprocess.run([sys.executable, "benchmarks/bench_revisions.py", "--before",
                          "no-such-rev-xyz"], cwd=REPO, capture_output=True, text=True)
    assert ran.returncode == 2 and "no-such-rev-xyz" in ran.stderr and "--before" in ran.stderr
