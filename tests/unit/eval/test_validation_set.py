"""A dedicated validation set, through the commands a user types (issue 53):

    ./run_train.sh --data.dataset=local:novel.txt --validation.dataset=local:val.txt ...
    python -m torchllm.eval.loss --checkpoint RUN

The header names the validation set as it is scored (file, tokens, windows, and the cut the
automatic validation.max_tokens budget makes); nothing of the novel is held out of training;
eval.loss without --data scores the same tokens and gets the run's validation loss; a SIGTERM
in the middle of a long validation ends it, saves, exits 0, and the relaunch resumes.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from cli import run_module, run_train
from conftest import REPO
from builders.data import ARGS, SEQ, SHAKESPEARE, header_validation, texts  # noqa: F401

pytestmark = pytest.mark.slow


def env() -> dict:
    """The stop-signal test's process: ./run_train.sh with one process."""
    e = {**os.environ, "PYTHONPATH": str(REPO), "NPROC": "1", "HF_HUB_OFFLINE": "1",
         "OMP_NUM_THREADS": "1"}
    e.pop("NGPU", None)
    e.pop("CONFIG_FILE", None)
    return e


def train_args(tmp: Path, *extra: str) -> list[str]:
    novel, val = tmp / "novel.txt", tmp / "val.txt"
    return [f"--job.dump_folder={tmp}", "--job.run_name=r", f"--data.dataset=local:{novel}",
            f"--validation.dataset=local:{val}", *ARGS, *extra]


def train(tmp: Path, *extra: str) -> str:
    """`./run_train.sh ARGS` (in this process: tests/cli.py); its console."""
    r = run_train(*train_args(tmp, *extra))
    assert r.returncode == 0, r.out[-4000:]
    return r.out


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("valset")
    texts(tmp)
    return tmp, train(tmp, "--training.steps=4")


def test_the_header_names_the_validation_set_as_it_is_scored(run):
    tmp, out = run
    val = header_validation(out)
    # the file, the tokens scored, the windows, of how many, and the key that set the budget
    # (where in the file they lie: test_validation_spread.py)
    m = re.search(r"validation local:(\S+): ([\d,]+) tokens\D+([\d,]+) windows\D+([\d,]+) "
                  r"windows.*validation.max_tokens = 0", val)
    assert m, val
    assert m.group(1) == str(tmp / "val.txt")
    tokens, windows, of = (int(g.replace(",", "")) for g in m.groups()[1:])
    assert tokens == windows * SEQ and of == (len((tmp / "val.txt").read_bytes()) + 2) // (SEQ + 1)
    # The budget: a few percent of the run's compute, nowhere near the file's 100,000 bytes.
    assert windows * (SEQ + 1) < 5_000
    # Each validation scored what the header said.
    scored = re.findall(r"validation step \d+: loss [\d.]+ \| perplexity [\d.]+ \| ([\d,]+) "
                        r"tokens", out)
    assert scored and all(int(s.replace(",", "")) == tokens for s in scored)


def test_nothing_is_held_out_of_training_for_a_dedicated_validation_set(run):
    tmp, out = run
    assert "validation is its last" not in out
    # bytes tokenizer: every byte of the novel, BOS and EOS are training tokens
    n = len((tmp / "novel.txt").read_bytes()) + 2
    # the header wraps long lines (a long tmp path under xdist): compare with words joined
    flat = " ".join(re.sub(r"^\[rank0\]:", "", line).strip() for line in out.split("\n"))
    assert f"local:{tmp / 'novel.txt'}: train 1 document, {n:,} tokens" in flat, flat[-3000:]


def test_eval_loss_scores_what_the_run_validated_on(run):
    tmp, out = run
    proc = run_module("torchllm.eval.loss", "--checkpoint", str(tmp / "r"))
    said = proc.out
    assert proc.returncode == 0, said[-3000:]
    header = re.search(r"([\d,]+) tokens scored", header_validation(out)).group(1)
    last = re.findall(r"validation step 4: loss ([\d.]+) \|", out)[-1]
    m = re.search(r"loss ([\d.]+) \| perplexity .* \| ([\d,]+) tokens,", said)
    assert m, said
    assert m.group(2) == header and f"data local:{tmp / 'val.txt'}" in said
    assert m.group(1) == last  # the run's val/loss, not the novel's held-out split


def wait_for(path: Path, pattern: str, proc, timeout: float = 300) -> str:
    end = time.time() + timeout
    while time.time() < end:
        out = path.read_text()
        if re.search(pattern, out):
            return out
        assert proc.poll() is None, out[-3000:]
        time.sleep(0.05)
    raise AssertionError(f"no {pattern!r} in {timeout} s:\n{path.read_text()[-3000:]}")


@pytest.mark.e2e  # a real ./run_train.sh: the test signals its process
def test_a_stop_signal_during_a_long_validation_saves_and_exits_0(tmp_path):
    texts(tmp_path)
    log = tmp_path / "out.txt"
    with open(log, "w") as f:
        # ~1,800 windows: 450 batches; the SIGTERM comes at the first progress line (10%).
        proc = subprocess.Popen(
            ["./run_train.sh", *train_args(tmp_path, "--training.steps=3",
                                           "--validation.max_tokens=60000")],
            cwd=REPO, env=env(), stdout=f, stderr=subprocess.STDOUT, text=True)
        try:
            wait_for(log, r"validation step 2: \d+/\d+ batches \(", proc)
            proc.send_signal(signal.SIGTERM)
            code = proc.wait(timeout=300)
        finally:
            if proc.poll() is None:
                proc.kill()
    out = log.read_text()
    assert code == 0, out[-4000:]
    # the validation named, that the stop ended it, and how far it got
    m = re.search(r"validation step 2\b.*\bstop.*?(\d+) of (\d+) batches", out)
    assert m and int(m.group(1)) < int(m.group(2)), out[-3000:]
    assert "validation step 2: loss" not in out  # a partial validation is no measurement
    assert (tmp_path / "r" / "checkpoint" / "step-2" / "COMPLETE").is_file()
    # The same command, relaunched (a smaller validation, to be quick; in this process), resumes
    # at step 2.
    again = train(tmp_path, "--training.steps=3", "--validation.max_tokens=2000")
    assert re.search(r"resum\w+ .*step 2", again), again[-3000:]
    assert "step     3/3" in again and "step     1/3" not in again
