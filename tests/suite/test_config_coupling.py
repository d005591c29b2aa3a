"""scripts/config_coupling.py, issue 64's measure of functions that take the whole JobConfig:
the entry points it names (ENTRY_POINTS, each with its reason) are functions that still take
it, and its report shows them apart from the others."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from cli import run_script
from conftest import REPO


def _script():
    spec = importlib.util.spec_from_file_location("config_coupling",
                                                  REPO / "scripts" / "config_coupling.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_named_entry_point_still_takes_the_whole_config():
    coupling = _script()
    found = {f"{Path(path).relative_to(REPO).as_posix()}:{name}"
             for path, name, _ in coupling.scan([REPO / "torchllm"])}
    stale = sorted(set(coupling.ENTRY_POINTS) - found)
    assert not stale, f"named entry points that no longer take the whole JobConfig: {stale}"
    assert all(why.strip() for why in coupling.ENTRY_POINTS.values())  # a reason each


def test_the_report_marks_entry_points_and_counts_them_apart():
    ran = run_script("scripts/config_coupling.py", "--list", "torchllm")
    assert ran.returncode == 0, ran.out
    lines = ran.stdout.splitlines()
    marked = [ln for ln in lines if "[entry point: " in ln]
    assert any(ln.startswith("torchllm/train.py:__init__(") for ln in marked), marked
    unmarked = [ln for ln in lines[:-1] if "[entry point: " not in ln]
    assert not any(ln.startswith("torchllm/train.py:") for ln in unmarked), unmarked
    total, named = len(lines) - 1, len(marked)
    assert lines[-1].startswith(f"{total} functions in "), lines[-1]
    assert f"({named} named entry points, {total - named} others)" in lines[-1], lines[-1]


def test_only_the_named_entry_points_take_the_whole_config():
    """Issue 64: builders take their sections; a function that takes the whole JobConfig is an
    entry point, named with its reason, or it is coupling to undo."""
    coupling = _script()
    found = {f"{Path(path).relative_to(REPO).as_posix()}:{name}"
             for path, name, _ in coupling.scan([REPO / "torchllm"])}
    others = sorted(found - set(coupling.ENTRY_POINTS))
    assert not others, f"functions that take the whole JobConfig but are no entry point: {others}"
    assert len(found) <= 11, sorted(found)  # (87 before issue 64's change, then 17)
