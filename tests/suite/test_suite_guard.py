"""The suite's own guard (tests/conftest.py): a test module that leaves shared process state
changed fails itself, not whichever test happens to run next."""

from __future__ import annotations

import re
from pathlib import Path

pytest_plugins = ["pytester"]

LEAKS = '''
import logging
import os


def test_changes_an_inductor_key():
    # set and never restored (pytest 9's monkeypatch undo used to delete such a key instead:
    # the guard reads a deleted key as "<deleted>"; either way the key is named)
    import torch._inductor.config as inductor_config

    inductor_config.emulate_precision_casts = not inductor_config.emulate_precision_casts


def test_adds_a_root_handler():
    logging.getLogger().addHandler(logging.NullHandler())


def test_sets_an_environment_variable():
    os.environ["TORCHLLM_GUARD_PROBE"] = "1"
'''

CLEAN = '''
import torch._inductor.config as inductor_config


def test_patches_through_torch():
    with inductor_config.patch(emulate_precision_casts=True):
        assert inductor_config.emulate_precision_casts


def test_uses_monkeypatch_for_the_environment(monkeypatch):
    monkeypatch.setenv("TORCHLLM_GUARD_PROBE", "1")
'''


def test_a_module_that_leaks_state_fails_and_a_clean_one_passes(pytester):
    pytester.makeconftest((Path(__file__).resolve().parents[1] / "conftest.py").read_text())
    pytester.makepyfile(test_leaks=LEAKS, test_clean=CLEAN)
    result = pytester.runpytest_subprocess("-p", "no:randomly", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=5, errors=1)  # the leaking module's last teardown
    out = result.stdout.str()
    assert "ERROR test_leaks.py::test_sets_an_environment_variable" in out
    assert re.search(r"\btest_leaks\b(?!\.py)", out), out  # the guard names the module
    assert "emulate_precision_casts" in out
    assert "NullHandler" in out and "TORCHLLM_GUARD_PROBE" in out
    assert "test_clean left" not in out
