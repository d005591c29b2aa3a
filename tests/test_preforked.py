"""tests/preforked.py: a command forked from the preloaded fork server gives what the same
command run by subprocess.run gives (the oracle), byte for byte."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import preforked
from conftest import REPO

pytestmark = pytest.mark.skipif(os.environ.get(preforked.FRESH_ENV) == "1",
                                reason=f"{preforked.FRESH_ENV}=1: every command runs fresh")

SCRIPT = """
import os, sys
print("argv", sys.argv[1:], "cwd", os.getcwd(), "path0", sys.path[0])
print("env", os.environ.get("PREFORKED_PROBE"), "stdin", repr(sys.stdin.read()))
os.write(1, b"fd 1 from C\\n")
print("to stderr", file=sys.stderr)
how = sys.argv[1]
if how == "raise":
    def inner():
        raise ValueError("boom")
    inner()
if how == "message":
    sys.exit("a one-line error")
sys.exit(int(how))
"""


@pytest.mark.parametrize("how", ["0", "3", "raise", "message"])
def test_a_forked_command_gives_what_a_fresh_one_gives(tmp_path, how):
    script = tmp_path / "probe.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "PREFORKED_PROBE": "x", "PYTHONPATH": str(REPO)}
    env.pop("PYTHONUNBUFFERED", None)
    if how in ("3", "message"):  # `python -u`'s streams (their order with a C-level write)
        env["PYTHONUNBUFFERED"] = "1"
    kwargs = dict(cwd=tmp_path, env=env, input="in\n", capture_output=True, text=True,
                  timeout=60)
    argv = [sys.executable, str(script), how]
    assert preforked.forkable(argv, kwargs["env"])
    fresh, forked = subprocess.run(argv, **kwargs), preforked.run(argv, **kwargs)
    assert (forked.returncode, forked.stdout, forked.stderr) == (
        fresh.returncode, fresh.stdout, fresh.stderr)
    assert "env x stdin 'in\\n'" in forked.stdout and "to stderr" in forked.stderr


def test_merged_output_timeout_and_what_runs_fresh(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(SCRIPT)
    argv = [sys.executable, str(script), "0"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}  # (not a PYTHONPATH of the caller's)
    assert preforked.forkable(argv, env)
    merged = preforked.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           env=env)
    assert "to stderr" in merged.stdout and merged.stderr is None
    (tmp_path / "sleeper.py").write_text("import time\ntime.sleep(60)\n")
    with pytest.raises(subprocess.TimeoutExpired):
        preforked.run([sys.executable, str(tmp_path / "sleeper.py")], capture_output=True,
                      timeout=1, env=env)
    assert preforked.forkable([sys.executable, "-m", "torchllm.train"], env)
    assert not preforked.forkable(["./run_train.sh"], env)
    assert not preforked.forkable([sys.executable, "-c", "pass"], env)
    assert not preforked.forkable([sys.executable, "-m", "torchllm.train"],
                                  {**env, "PYTHONPATH": str(tmp_path)})  # another checkout
    assert preforked.forkable([sys.executable, "-m", "torchllm.train"],
                              {**env, "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'tests'}"})
    assert not preforked.forkable([sys.executable, "-m", "torchllm.train"],
                                  {**env, preforked.FRESH_ENV: "1"})
