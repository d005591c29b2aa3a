"""run_train.sh as a scheduler and a user meet it, with real torchrun launches (tiny settings):
a failure on one rank is printed once on the console; SIGTERM saves and exits 0; a second launch
into a running run's folder is refused; workers die with their torchrun; a dead run's lock is
taken over."""

import json
import os
import re
import signal
import subprocess

import pytest

from conftest import REPO, tiny_args, wait_for

pytestmark = pytest.mark.slow


def launcher_lines(out: str, *words: str) -> list[str]:
    """The launcher's console lines (`run_train:`) that name every one of `words`."""
    return [line for line in out.splitlines()
            if line.startswith("run_train:") and all(w in line for w in words)]


def launch(tmp_path, *extra, ngpu=1, log_rank="0", wait=True, out=None, env=None):
    env = {**os.environ, "NGPU": str(ngpu), "LOG_RANK": log_rank, "PYTHONPATH": str(REPO),
           **(env or {})}
    cmd = ["./run_train.sh", *tiny_args(tmp_path, "--training.local_batch_size=2",
                                        "--metrics.progress_bar=false"), *extra]
    if wait:
        return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=300)
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                            text=True)


@pytest.mark.e2e  # the launcher's process and its workers
def test_an_error_on_rank_1_is_printed_once_on_rank_0s_console(tmp_path):
    # Rank 1 alone fails: its TensorBoard folder's name is taken by a file.
    (tmp_path / "tb" / "r").mkdir(parents=True)
    (tmp_path / "tb" / "r" / "rank_1").write_text("")
    proc = launch(tmp_path, "--job.run_name=r", "--metrics.rank_0_only=false", ngpu=2,
                  log_rank="0", env={"LOG_DIR": str(tmp_path / "logs")})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert out.count("File exists") == 1, out
    message = f"FileExistsError: [Errno 17] File exists: '{tmp_path / 'tb' / 'r' / 'rank_1'}'"
    assert launcher_lines(out, "rank 1", message), out  # the rank and its exception, once
    assert launcher_lines(out, "torchllm/metrics/writers.py:"), out  # where it was raised
    assert "Traceback" not in out and "ChildFailedError" not in out
    # torchrun's error file for rank 1 (TORCHELASTIC_ERROR_FILE, kept by LOG_DIR) holds the
    # worker's exception and traceback (@record), and the console line names it.
    (error_file,) = (tmp_path / "logs").glob("*/attempt_0/1/error.json")
    assert launcher_lines(out, str(error_file)), out
    error = json.loads(error_file.read_text())["message"]
    assert error["message"] == message
    assert "Traceback" in error["extraInfo"]["py_callstack"]
    assert "torchllm/metrics/writers.py" in error["extraInfo"]["py_callstack"]


@pytest.mark.e2e
def test_sigterm_reaches_every_worker_which_save_and_exit_0(tmp_path):
    log = open(tmp_path / "out.txt", "w")
    proc = launch(tmp_path, "--job.run_name=r", "--training.steps=10000", "--checkpoint.enable",
                  "--checkpoint.interval=100000", ngpu=2, wait=False, out=log)
    wait_for(lambda: "step     2/" in (tmp_path / "out.txt").read_text(), 240,
             what="step 2", every=0.5)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 0, (tmp_path / "out.txt").read_text()
    out = (tmp_path / "out.txt").read_text()
    assert launcher_lines(out, "SIGTERM"), out  # said by the launcher, naming the signal
    assert "Traceback" not in out and "SignalException" not in out
    (step_dir,) = (tmp_path / "r" / "checkpoint").iterdir()
    assert (step_dir / "COMPLETE").is_file()  # both ranks saved the same step


@pytest.mark.e2e
def test_one_run_per_folder_and_workers_die_with_torchrun(tmp_path):
    log = open(tmp_path / "out.txt", "w")
    # Two ranks: rank 0 (the lock's holder) is torchrun's worker, a child of the launcher.
    first = launch(tmp_path, "--job.run_name=r", "--training.steps=10000", ngpu=2, wait=False,
                   out=log)
    lock = tmp_path / "r" / "run.lock"
    try:
        wait_for(lambda: "step     1/" in (tmp_path / "out.txt").read_text(), 240,
                 what="step 1", every=0.5)
        worker = json.loads(lock.read_text())["pid"]
        assert worker != first.pid  # (one process trains in the launcher's: test_launch_path)
        # Paused, it still holds the lock (a live pid) without training on while the second
        # launch starts; it runs again before torchrun dies.
        os.kill(worker, signal.SIGSTOP)
        try:
            second = launch(tmp_path, "--job.run_name=r", "--training.steps=1")
        finally:
            os.kill(worker, signal.SIGCONT)
        assert second.returncode == 2, second.stdout + second.stderr
        # one line: the folder in use, and the process that holds it
        assert any(re.search(rf"\bpid {worker}\b", line)
                   for line in launcher_lines(second.stderr, str(tmp_path / "r"))), second.stderr
    finally:
        first.send_signal(signal.SIGKILL)  # torchrun dies without passing anything on
        first.wait()

    def gone():
        try:
            os.kill(worker, 0)
            # A zombie is dead too (its parent is gone; init reaps it soon).
            return open(f"/proc/{worker}/stat").read().rsplit(")", 1)[1].split()[0] == "Z"
        except (ProcessLookupError, FileNotFoundError):
            return True

    wait_for(gone, timeout=30, what="the orphaned worker to die", every=0.5)
    assert lock.exists()  # left behind by the killed run
    third = launch(tmp_path, "--job.run_name=r", "--training.steps=1", "--job.overwrite")
    out = third.stdout + third.stderr
    assert third.returncode == 0, out
    # the stale lock taken over, and the dead process it named
    assert any(str(lock) in line and re.search(rf"\b{worker}\b", line)
               for line in out.splitlines()), out
    assert not lock.exists()  # released at the end


def test_every_ranks_error_file_is_found_when_torchrun_names_only_the_first_failure(tmp_path):
    """torchrun's failures can name only the ranks it saw end in one poll, often one that only
    lost its peers: the root cause's traceback file is found beside it."""
    from types import SimpleNamespace

    from torchllm.run.launch import kept_error_files

    attempt = tmp_path / "logs" / "run_abc" / "attempt_0"
    for local in (0, 1, 2):
        (attempt / str(local)).mkdir(parents=True)
    for local in (0, 1):  # local rank 2 ended without an error file (killed)
        (attempt / str(local) / "error.json").write_text("{}")
    # Node 1 of a 2 x 3 launch: global ranks 3, 4, 5; torchrun reports only rank 3.
    seen = {3: SimpleNamespace(local_rank=0, error_file=str(attempt / "0" / "error.json"))}
    assert kept_error_files(seen) == {3: str(attempt / "0" / "error.json"),
                                      4: str(attempt / "1" / "error.json")}
