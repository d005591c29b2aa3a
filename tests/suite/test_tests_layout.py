"""The tests' layout (scripts/test_layout.py, tests/README.md "Layout"): no test module sits flat
in tests/, basenames are unique (pytest imports a test module by its basename; the mutants'
ids `tests/test_x.py::t` resolve by it), every module is in its LAYOUT row's folder, every row
names a module that exists, and the script places a new flat module by its row and refuses one
no row names, before moving any."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys

from conftest import REPO

SCRIPT = REPO / "scripts" / "test_layout.py"


def layout(*args, root=REPO):
    return subprocess.run([sys.executable, str(root / "scripts" / "test_layout.py"), *args],
                          cwd=root, capture_output=True, text=True, timeout=120)


def laid_out_tree(root, *, flat=(), missing=()):
    """A copy of the script under `root` and a tests/ tree holding an empty module for each of
    its LAYOUT rows, in the row's folder (those in `flat`: flat in tests/; `missing`: none)."""
    (root / "scripts").mkdir()
    shutil.copy(SCRIPT, root / "scripts")
    for package in ("data", "models"):
        (root / "torchllm" / package).mkdir(parents=True)
        (root / "torchllm" / package / "__init__.py").write_text("")
    spec = importlib.util.spec_from_file_location("test_layout_script", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    tests = root / "tests"
    for name, folder in script.LAYOUT.items():
        if name not in missing:
            where = tests if name in flat else tests / folder
            where.mkdir(parents=True, exist_ok=True)
            (where / name).write_text("def test_x():\n    pass\n")
    return tests


def test_no_test_module_is_flat_and_every_basename_is_unique():
    flat = sorted(p.name for p in (REPO / "tests").glob("test_*.py"))
    assert not flat, f"flat in tests/: {flat}; add each to LAYOUT, run scripts/test_layout.py"
    names = [p.name for p in (REPO / "tests").rglob("test_*.py")
             if "__pycache__" not in p.parts]
    assert len(names) > 100 and len(names) == len(set(names)), \
        sorted({n for n in names if names.count(n) > 1})


def test_every_test_module_is_in_its_rows_folder():
    checked = layout("--check")
    assert checked.returncode == 0, checked.stderr
    assert " 0 out of place" in checked.stdout


def test_a_new_flat_module_is_placed_by_its_row_and_an_unknown_one_stops_every_move(tmp_path):
    tests = laid_out_tree(tmp_path, flat=("test_data.py",))  # a row: unit/data
    (tests / "test_brand_new.py").write_text("def test_y():\n    pass\n")

    refused = layout(root=tmp_path)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    line = next(l for l in refused.stderr.splitlines() if "test_brand_new.py" in l)
    assert "tests/test_brand_new.py" in line and "LAYOUT" in line
    assert "unit/data" in line and "unit/models" in line and "e2e" in line  # where it may go
    assert (tests / "test_data.py").is_file()  # nothing moved
    assert not (tests / "unit" / "data" / "test_data.py").exists()
    assert layout("--check", root=tmp_path).returncode == 1

    (tests / "test_brand_new.py").unlink()
    placed = layout(root=tmp_path)
    assert placed.returncode == 0, placed.stderr
    assert (tests / "unit" / "data" / "test_data.py").is_file()
    assert not (tests / "test_data.py").exists()
    assert layout("--check", root=tmp_path).returncode == 0

    (tests / "e2e" / "test_data.py").write_text("def test_z():\n    pass\n")  # a twin basename
    twins = layout("--check", root=tmp_path)
    assert twins.returncode == 1
    assert "tests/e2e/test_data.py" in twins.stderr and "tests/unit/data/test_data.py" in \
        twins.stderr


def test_check_names_a_row_whose_module_is_gone(tmp_path):
    """A module removed or renamed leaves its LAYOUT row behind: --check names the row."""
    laid_out_tree(tmp_path)
    assert layout("--check", root=tmp_path).returncode == 0
    (tmp_path / "tests" / "unit" / "models" / "test_gpt2.py").unlink()
    stale = layout("--check", root=tmp_path)
    assert stale.returncode == 1, stale.stdout + stale.stderr
    line = next(ln for ln in stale.stderr.splitlines() if "test_gpt2.py" in ln)
    assert "LAYOUT" in line and "unit/models" in line, line
    assert " 1 out of place" in stale.stdout, stale.stdout
