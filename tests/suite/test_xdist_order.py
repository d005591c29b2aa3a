"""The order xdist's workers are handed test files (conftest.heavy_files_first): the heaviest
first, so that the last files to start are light ones and the two workers finish together."""

from __future__ import annotations

import types

import pytest

import conftest
from conftest import QUICK_S, SLOW_S, heavy_files_first


class Item:
    """What heavy_files_first reads of a collected test: its node id and its slow marker."""

    def __init__(self, nodeid: str, slow: bool = False):
        self.nodeid, self.slow = nodeid, slow

    def get_closest_marker(self, name: str):
        return object() if name == "slow" and self.slow else None

    def __repr__(self):
        return self.nodeid


def test_heavy_files_start_first_each_file_whole_and_in_its_order():
    many_quick = [Item(f"tests/unit/test_many.py::test_{i}") for i in range(20)]  # 20 x 0.5
    items = [*many_quick,
             Item("tests/unit/test_b.py::test_one"),
             Item("tests/integration/test_kill.py::test_relaunch", slow=True),  # one slow test
             Item("tests/unit/test_b.py::test_two"),
             Item("tests/unit/test_c.py::test_one"), Item("tests/unit/test_c.py::test_two"),
             Item("tests/e2e/test_docs.py::test_a", slow=True),
             Item("tests/e2e/test_docs.py::test_b[x]", slow=True)]
    ordered = heavy_files_first(items)
    assert sorted(map(id, ordered)) == sorted(map(id, items))  # the same items, each once
    files = [i.nodeid.split("::")[0] for i in ordered]
    # 2 slow (30 s), 1 slow (15 s), 20 quick (10 s), then test_b and test_c (1 s each) in the
    # order they were collected; xdist's default (by number of tests) put test_kill.py last.
    assert list(dict.fromkeys(files)) == [
        "tests/e2e/test_docs.py", "tests/integration/test_kill.py", "tests/unit/test_many.py",
        "tests/unit/test_b.py", "tests/unit/test_c.py"]
    assert files == sorted(files, key=files.index)  # each file's tests together
    assert [i.nodeid for i in ordered if "test_many" in i.nodeid] == [i.nodeid for i in many_quick]
    assert [i.nodeid for i in ordered if "test_b.py" in i.nodeid] == [
        "tests/unit/test_b.py::test_one", "tests/unit/test_b.py::test_two"]
    assert SLOW_S > 20 * QUICK_S  # one slow test outweighs a file of 20 quick ones


def test_xdist_keeps_the_workers_order_on_the_controller_only(monkeypatch):
    """The controller (no PYTEST_XDIST_WORKER) turns off xdist's re-sorting of files by their
    number of tests; a worker leaves the option alone (it sorts its items instead)."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # (pytest_configure's thread share: left alone)
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    controller = types.SimpleNamespace(option=types.SimpleNamespace(loadscopereorder=True))
    conftest.pytest_configure(controller)
    assert controller.option.loadscopereorder is False
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")
    worker = types.SimpleNamespace(option=types.SimpleNamespace(loadscopereorder=True))
    conftest.pytest_configure(worker)
    assert worker.option.loadscopereorder is True
    without_xdist = types.SimpleNamespace(option=types.SimpleNamespace())
    conftest.pytest_configure(without_xdist)  # (-p no:xdist: no such option, nothing to do)
    assert not hasattr(without_xdist.option, "loadscopereorder")


@pytest.mark.parametrize("worker", [True, False])
def test_only_xdist_workers_reorder_their_items(monkeypatch, worker):
    items = [Item("tests/unit/test_a.py::t"), Item("tests/unit/test_z.py::t", slow=True)]
    if worker:
        monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw1")
    else:
        monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    collected = list(items)
    conftest.pytest_collection_modifyitems(None, collected)
    assert collected == (items[::-1] if worker else items)
