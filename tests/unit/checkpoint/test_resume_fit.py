"""A resume reads a step in one pass: open -> fit -> read -> apply (issue 64). "fit" runs the
checks features register (torchllm/checkpoint/resume/fit.py; torchllm/checkpoint/fits.py
registers batch, data, vocabulary, LoRA and family), so checkpoint/resume imports no feature
module, and a check registered from outside refuses a resume through ./run_train.sh in one
line (exit 2), before anything is read or trained."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from torchllm.checkpoint.resume.fit import register, registered, unregister
from torchllm.config import ConfigError

from cli import run_train
from conftest import REPO, tiny_args
from messages import refused

RESUME = REPO / "torchllm" / "checkpoint" / "resume"
# What checkpoint/resume must never import: the features whose checks it runs.
FEATURES = ("torchllm.models", "torchllm.data", "torchllm.checkpoint.stage",
            "torchllm.checkpoint.fits", "torchllm.checkpoint.family")
CKPT = ("--checkpoint.enable", "--job.run_name=run", "--checkpoint.interval=2",
        "--data.tokenizer=bytes", "--metrics.progress_bar=false")


def imports_of(path: Path) -> set[str]:
    """Every module `path` imports, at its top or inside a function (relative ones resolved)."""
    package = ".".join(path.relative_to(REPO).with_suffix("").parts[:-1])
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            found |= {base} | {f"{base}.{alias.name}" for alias in node.names}
    return found


def test_checkpoint_resume_imports_no_feature_module():
    files = sorted(RESUME.glob("*.py"))
    assert len(files) >= 8, files
    bad = {f"{path.relative_to(REPO)} imports {name}" for path in files
           for name in imports_of(path) if name.startswith(FEATURES)}
    assert not bad, sorted(bad)


def test_the_features_checks_are_registered_wherever_checkpoint_is_imported():
    """Any import under torchllm.checkpoint runs the package's __init__ (fits.py) first: a
    program that only imports the resume's own modules has every check, in its order."""
    code = ("import torchllm.checkpoint.resume.restore\n"
            "from torchllm.checkpoint.resume.fit import registered\nprint(registered())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=REPO, check=True).stdout
    assert out.strip() == "['batch', 'data', 'vocabulary', 'lora', 'family']", out
    assert registered() == ["batch", "data", "vocabulary", "lora", "family"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A run that trained 2 steps (checkpoint step-2)."""
    dump = tmp_path_factory.mktemp("fit") / "dump"
    ran = run_train(*tiny_args(dump, *CKPT, "--training.steps=2"))
    assert ran.returncode == 0, ran.out[-3000:]
    return dump


@pytest.mark.parametrize("phase", ["marker", "states"])
def test_a_registered_fit_check_refuses_the_resume_in_one_line(trained, tmp_path, phase):
    dump = tmp_path / "dump"
    shutil.copytree(trained, dump)
    seen = []

    def refuse(fit):
        seen.append((fit.resume, sorted(fit.states)))
        raise ConfigError(f"checkpoint {fit.where} was refused by the test's fit check; set "
                          "checkpoint.test_refusal to go on", "checkpoint.test_refusal")

    register("test-refusal", refuse, phase=phase)
    try:
        ran = run_train(*tiny_args(dump, *CKPT, "--training.steps=3"))
    finally:
        unregister("test-refusal")
    line = refused(ran, "checkpoint.test_refusal", "step-2")
    assert "refused by the test's fit check" in line, line
    assert seen and seen[0][0] is True  # a resume, which ran the check once per try
    assert ("model" in seen[0][1]) == (phase == "states")  # states: after they were chosen
    assert not (dump / "run" / "checkpoint" / "step-3").exists()  # nothing trained on
    assert "test-refusal" not in registered()
