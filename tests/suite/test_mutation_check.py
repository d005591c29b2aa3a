"""scripts/mutation_check.py stays usable: it lists its mutants, reports a patch that no longer
applies as stale, and plants one bug end to end. Whether every snippet still matches the current
source is checked by the mutation run itself (`--check-patches`), not on every suite run: a
refactor that changes no behaviour edits nothing under scripts/ until the mutants next run."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO

SCRIPT = REPO / "scripts" / "mutation_check.py"


def load_script():
    spec = importlib.util.spec_from_file_location("mutation_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["mutation_check"] = module  # dataclasses resolve the module by name
    spec.loader.exec_module(module)
    return module


def test_the_mutants_are_well_formed():
    mc = load_script()
    names = [m.name for m in mc.MUTANTS]
    assert len(names) == len(set(names)) and len(names) >= 10
    for m in mc.MUTANTS:
        assert m.old != m.new and m.tests and m.what, m.name
        assert all("::" in t or t.startswith("tests/") for t in m.tests), m.name


def test_a_patch_that_no_longer_applies_is_reported_stale(tmp_path):
    mc = load_script()
    m = mc.Mutant("x", "x", "pkg/mod.py", "return 1", "return 2", ("t.py::t",),
                  "Trainer.train_step")
    (tmp_path / m.path).parent.mkdir(parents=True)
    (tmp_path / m.path).write_text("# the snippet moved away\n")
    assert "Trainer" in mc.stale(m, tmp_path)  # the definition is gone: named
    (tmp_path / m.path).write_text("class Trainer:\n    def train_step(self):\n        pass\n"
                                   "\n\n# " + m.old + "\n")  # the snippet left the definition
    assert "occurs 0 times" in mc.stale(m, tmp_path)
    (tmp_path / m.path).write_text("class Trainer:\n    def train_step(self):\n        return 1\n")
    (tmp_path / "t.py").write_text("def t():\n    pass\n")
    assert mc.stale(m, tmp_path) is None
    moved = mc.Mutant("x", "x", m.path, "moved", "y", ("tests/test_nothing.py::test_gone",))
    (tmp_path / m.path).write_text("moved\n")
    assert "does not exist" in mc.stale(moved, tmp_path)


def test_a_test_id_whose_file_moved_resolves_by_its_basename(tmp_path):
    """Test modules move (scripts/test_layout.py) without an edit under scripts/mutants: an id
    `tests/test_x.py::t` whose file is gone names the one test_x.py under tests/; the id check
    still reports a test that does not exist, and a basename at two places is stale, naming
    both (the mutation run would not know which to run)."""
    mc = load_script()
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "mod.py").write_text("def f():\n    return 1\n")
    moved = tmp_path / "tests" / "unit" / "pkg" / "test_mod.py"
    moved.parent.mkdir(parents=True)
    moved.write_text("def test_f():\n    pass\n")
    m = mc.Mutant("x", "x", "pkg/mod.py", "return 1", "return 2",
                  ("tests/test_mod.py::test_f",), "f")
    assert mc.resolve(m.tests[0], tmp_path) == "tests/unit/pkg/test_mod.py::test_f"
    assert mc.stale(m, tmp_path) is None
    gone = mc.Mutant("x", "x", m.path, m.old, m.new, ("tests/test_mod.py::test_gone",), "f")
    assert "tests/test_mod.py::test_gone does not exist" in mc.stale(gone, tmp_path)
    nowhere = mc.Mutant("x", "x", m.path, m.old, m.new, ("tests/test_none.py::test_f",), "f")
    assert "tests/test_none.py::test_f does not exist" in mc.stale(nowhere, tmp_path)
    (tmp_path / "tests" / "test_mod.py").write_text("def test_other():\n    pass\n")
    assert mc.resolve(m.tests[0], tmp_path) == m.tests[0]  # the file where the id says wins
    assert "does not exist" in mc.stale(m, tmp_path)
    (tmp_path / "tests" / "test_mod.py").unlink()
    twin = tmp_path / "tests" / "e2e" / "test_mod.py"
    twin.parent.mkdir()
    twin.write_text("def test_f():\n    pass\n")
    why = mc.stale(m, tmp_path)
    assert "tests/unit/pkg/test_mod.py" in why and "tests/e2e/test_mod.py" in why, why


def test_every_test_a_mutant_names_is_one_file_under_tests():
    """The mutants name test modules by their flat path (tests/test_x.py); each resolves to
    exactly one file here, so the mutation run knows which to run."""
    mc = load_script()
    for m in mc.MUTANTS:
        for test in m.tests:
            file = mc.resolve(test).partition("::")[0]
            assert (REPO / file).is_file(), (m.name, test)
            assert len(mc.test_files(Path(file).name)) == 1, (m.name, test)


def test_cli_lists_checks_and_rejects_unknown_names():
    def run(*args):
        return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=REPO,
                              capture_output=True, text=True, timeout=60)

    listed = run("--list")
    assert listed.returncode == 0
    mc = load_script()
    for m in mc.MUTANTS:
        assert m.name in listed.stdout and m.tests[0] in listed.stdout
    only = run("--list", "--only", "clipping_ignored")
    assert only.returncode == 0 and only.stdout.count("guarded by") == 1
    # --check-patches against a tree without the source: every patch stale, named, exit 2
    first = mc.MUTANTS[0].name
    checked = run("--check-patches", "--only", first, "--root", str(REPO / "docs"))
    assert checked.returncode == 2 and f"stale  {first}" in checked.stdout, checked.stdout
    assert "0/1 patches apply" in checked.stdout
    unknown = run("--only", "no_such_mutant")
    assert unknown.returncode == 2 and "unknown mutant" in unknown.stderr


@pytest.mark.slow
def test_a_planted_bug_is_killed_in_a_copy_and_the_tree_is_untouched():
    """One real mutant end to end: the copy is patched, its test fails there, this tree not."""
    before = (REPO / "torchllm" / "models" / "llama" / "model.py").read_text()
    proc = subprocess.run([sys.executable, str(SCRIPT), "--only", "rope_interpolation_wrong"],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "killed   rope_interpolation_wrong" in proc.stdout
    assert (REPO / "torchllm" / "models" / "llama" / "model.py").read_text() == before


def test_a_function_targeted_mutant_edits_only_its_definition_wherever_it_moved(tmp_path):
    """Mutant.at confines the snippet to one definition found by the AST: the same snippet
    elsewhere in the file is left alone, moving the function keeps the mutant applying, and a
    renamed function (or a snippet gone from it) is stale, naming the definition."""
    mc = load_script()
    (tmp_path / "pkg").mkdir()
    source = ("def helper():\n    return 1 + 1\n\n\n"
              "class Model:\n    @staticmethod\n    def scale(x):\n        return 1 + 1\n")
    (tmp_path / "pkg" / "mod.py").write_text(source)
    m = mc.Mutant("x", "x", "pkg/mod.py", "1 + 1", "1 - 1", ("t.py::t",), "Model.scale")
    patched = m.patched(source)
    assert patched.count("1 + 1") == 1 and patched.endswith("        return 1 - 1\n")
    assert patched.startswith("def helper():\n    return 1 + 1\n")
    moved = source.split("\n\n\n")[1] + "\n\nCONSTANT = 3\n\n\n" + source.split("\n\n\n")[0] + "\n"
    assert m.patched(moved).count("1 - 1") == 1
    renamed = source.replace("def scale", "def scaled")
    with pytest.raises(Exception) as e:
        m.patched(renamed)
    assert "Model.scale" in str(e.value) and "'scale'" in str(e.value)
    gone = source.replace("        return 1 + 1", "        return 2")
    with pytest.raises(Exception) as e:
        m.patched(gone)
    assert "occurs 0 times" in str(e.value) and "pkg/mod.py:Model.scale" in str(e.value)
    # a module-level assignment is a definition too; the whole-file form still demands one match
    spec = mc.Mutant("y", "y", "pkg/mod.py", "3", "4", ("t.py::t",), "CONSTANT")
    assert "CONSTANT = 4" in spec.patched(moved)
    whole = mc.Mutant("z", "z", "pkg/mod.py", "1 + 1", "1 - 1", ("t.py::t",))
    assert "occurs 2 times" in mc.stale(whole, tmp_path)


def test_mutant_at_resolves_the_module_path_and_every_models_mutant_names_a_definition():
    mc = load_script()
    from mutants.base import Mutant

    assert Mutant.at("a", "a", "torchllm.models.lora:apply_lora", "x", "y", ("t",)).path == \
        "torchllm/models/lora.py"
    assert Mutant.at("a", "a", "torchllm.models.qwen3:SPEC", "x", "y", ("t",)).path == \
        "torchllm/models/qwen3/__init__.py"
    with pytest.raises(ValueError):
        Mutant.at("a", "a", "torchllm/models/lora.py", "x", "y", ("t",))
    from mutants import models as area

    assert area.MUTANTS and all(m.function for m in area.MUTANTS)
    assert {m.name for m in area.MUTANTS} <= {m.name for m in mc.MUTANTS}
