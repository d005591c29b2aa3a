"""Issue 64, components own their config: the builders of data/, models/, hf/, run/ and eval/
take their sections (plus runtime objects, or a small typed bundle such as data's Batching),
not the whole JobConfig; only the entry points named here do (measured by the command the
issue's counts come from, scripts/config_coupling.py)."""

from __future__ import annotations

import subprocess
import sys

from conftest import REPO

PACKAGES = ("torchllm/data", "torchllm/models", "torchllm/hf", "torchllm/run", "torchllm/eval")
# Entry points: each reads several sections of one config as a whole.
ENTRY_POINTS = {
    "torchllm/run/resolve.py:resolve_run",  # the run resolved once, from every section
    "torchllm/eval/loss.py:evaluate_loss",  # python -m torchllm.eval.loss: a checkpoint's config
}


def test_only_the_entry_points_of_data_models_hf_run_and_eval_take_the_whole_config():
    ran = subprocess.run([sys.executable, "scripts/config_coupling.py", "--list", *PACKAGES],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0, ran.stderr
    lines = ran.stdout.splitlines()
    found = {line.split("(", 1)[0] for line in lines[:-1]}
    assert found == ENTRY_POINTS, f"take the whole JobConfig: {sorted(found - ENTRY_POINTS)}"
    assert lines[-1].startswith(f"{len(ENTRY_POINTS)} functions in ")
