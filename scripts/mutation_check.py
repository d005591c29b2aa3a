"""Plant named bugs in a temporary copy of the repo and check that the tests that claim to catch
them go red.

    python scripts/mutation_check.py                 # every mutant; exit 1 if any survives
    python scripts/mutation_check.py --list          # names, files and the tests that guard them
    python scripts/mutation_check.py --only NAME     # one mutant (repeat --only for several)
    python scripts/mutation_check.py --check-patches # only check that every patch still applies

Each mutant is a text patch (an exact snippet of the source and its replacement, confined to
one named function, method, class or assignment when the mutant names one: mutants/base.py)
applied to a copy of the working tree (tracked and untracked, not ignored files) in a temporary folder; its
tests then run there with PYTHONPATH pointing at the copy. A mutant "survives" when those tests
pass: the bug would ship green. A patch whose snippet is no longer in the source is reported as
stale (exit 2): update the snippet when the code it mutates changes. The test suite does not check
the snippets (a refactor that changes no behaviour edits nothing under scripts/): this script
does, when it runs (`--check-patches` alone checks them in seconds). Run it before resolving an
issue that adds an oracle test, and add a mutant for the bug the new test guards against (see
tests/README.md).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


sys.path.insert(0, str(REPO / "scripts"))  # the mutants package beside this script
from mutants import MUTANTS, Mutant  # noqa: E402  (one module per area: scripts/mutants/)
from mutants.base import Stale  # noqa: E402


def by_name() -> dict[str, Mutant]:
    return {m.name: m for m in MUTANTS}


def test_files(name: str, root: Path = REPO) -> list[Path]:
    """The files named `name` under root/tests (caches and data folders' copies aside)."""
    return sorted(p for p in (root / "tests").rglob(name)
                  if p.is_file() and "__pycache__" not in p.parts)


def resolve(test: str, root: Path = REPO) -> str:
    """A mutant's test id as pytest takes it under `root`: as written when its file exists,
    else by the file's basename under tests/ (`tests/test_x.py::t` -> `tests/unit/x/test_x.py::t`:
    scripts/test_layout.py moves test modules and keeps basenames unique, so a move edits
    nothing under scripts/mutants); unchanged when no file or several have that name."""
    file, sep, rest = test.partition("::")
    if (root / file).is_file():
        return test
    found = test_files(Path(file).name, root)
    return found[0].relative_to(root).as_posix() + sep + rest if len(found) == 1 else test


def stale(mutant: Mutant, root: Path = REPO) -> str | None:
    """Why the patch does not apply to the source under `root`, or None when it does."""
    path = root / mutant.path
    if not path.is_file():
        return f"{mutant.path} does not exist"
    try:
        mutant.patched(path.read_text())
    except (Stale, SyntaxError) as e:
        return str(e)
    for test in mutant.tests:
        file, _, name = resolve(test, root).partition("::")
        if not (root / file).is_file() and len(found := test_files(Path(file).name, root)) > 1:
            return (f"test {test}: {Path(file).name} is at several places under tests/ ("
                    f"{', '.join(p.relative_to(root).as_posix() for p in found)}): name one")
        source = (root / file).read_text() if (root / file).is_file() else ""
        if f"def {name.split('[')[0]}(" not in source:
            return f"test {test} does not exist"
    return None


def copy_tree(dest: Path) -> Path:
    """The working tree's tracked and untracked (not ignored) files, copied under dest/repo."""
    files = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO, capture_output=True, check=True,
    ).stdout.decode().split("\0")
    root = dest / "repo"
    for rel in filter(None, files):
        src = REPO / rel
        if src.is_file():
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, root / rel)
    shared = REPO.parent / "shared"  # tests read data beside the checkout (conftest.SHARED)
    if shared.exists():
        (dest / "shared").symlink_to(shared)
    return root


def run_mutant(mutant: Mutant, timeout: int) -> tuple[str, str]:
    """('killed' | 'SURVIVED' | 'stale' | 'error', detail)."""
    why = stale(mutant)
    if why:
        return "stale", why
    with tempfile.TemporaryDirectory(prefix=f"mutant-{mutant.name}-") as tmp:
        root = copy_tree(Path(tmp))
        path = root / mutant.path
        path.write_text(mutant.patched(path.read_text()))
        env = {**os.environ, "PYTHONPATH": str(root), "PYTHONDONTWRITEBYTECODE": "1"}
        cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
               "-o", "addopts=", *(resolve(t, root) for t in mutant.tests)]
        try:
            proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True,
                                  timeout=timeout)
        except subprocess.TimeoutExpired:
            return "killed", f"tests timed out after {timeout}s (a hang counts as caught)"
    tail = (proc.stdout + proc.stderr).strip().splitlines()[-1:] or [""]
    if proc.returncode == 0:
        if " passed" not in tail[0]:
            return "error", f"no test ran: {tail[0]}"
        return "SURVIVED", tail[0]
    if proc.returncode == 1:
        return "killed", tail[0]
    return "error", f"pytest exit {proc.returncode}: {tail[0]}"  # collection/usage problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument("--only", action="append", metavar="NAME", help="run only this mutant")
    parser.add_argument("--check-patches", action="store_true",
                        help="only check that every patch applies to the current source")
    parser.add_argument("--root", type=Path, default=REPO, metavar="DIR",
                        help="with --check-patches: the source tree to check (default: this repo)")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per mutant's tests")
    args = parser.parse_args(argv)
    mutants = MUTANTS
    if args.only:
        unknown = sorted(set(args.only) - set(by_name()))
        if unknown:
            print(f"unknown mutant(s) {unknown}; known: {', '.join(by_name())}", file=sys.stderr)
            return 2
        mutants = [by_name()[n] for n in args.only]
    if args.list:
        for m in mutants:
            print(f"{m.name:34s} {m.where}: {m.what}")
            for test in m.tests:
                at = resolve(test)
                print(f"{'':34s}   guarded by {test}" + (f" (at {at.partition('::')[0]})"
                                                         if at != test else ""))
        return 0
    if args.check_patches:
        bad = [(m.name, why) for m in mutants if (why := stale(m, args.root))]
        for name, why in bad:
            print(f"stale  {name}: {why}")
        print(f"{len(mutants) - len(bad)}/{len(mutants)} patches apply")
        return 2 if bad else 0
    results = {}
    for m in mutants:
        t0 = time.perf_counter()
        status, detail = run_mutant(m, args.timeout)
        results[m.name] = status
        print(f"{status:8s} {m.name} ({time.perf_counter() - t0:.0f}s): {detail}", flush=True)
    survived = [n for n, s in results.items() if s == "SURVIVED"]
    broken = [n for n, s in results.items() if s in ("stale", "error")]
    print(f"{len(results) - len(survived) - len(broken)}/{len(results)} mutants killed"
          + (f"; survived: {', '.join(survived)}" if survived else "")
          + (f"; stale or errored: {', '.join(broken)}" if broken else ""))
    return 1 if survived else 2 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
