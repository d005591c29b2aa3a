"""The run lock under races and odd files, and its release on the ways a launch ends at start-up
(torchllm.run.runlock; the basic cases are in test_run_safety.py)."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from torchllm.run.runlock import LOCK_NAME, RunLock, RunLockedError

from cli import run_module
from conftest import REPO, process_state, tiny_args, wait_for

ENV = {**os.environ, "PYTHONPATH": str(REPO)}

# One racer: per line "<folder> <start time>" on stdin, it tries to take the folder's lock at that
# time and answers "won" or "refused <message>"; it releases on the next line ("release").
RACER = """
import sys, time
from torchllm.run.runlock import RunLock, RunLockedError
for line in sys.stdin:
    folder, start = line.split()
    lock = RunLock(folder, stale_s=600)
    time.sleep(max(0.0, float(start) - time.time() - 0.01))
    while time.time() < float(start):
        pass
    try:
        lock.acquire()
        print("won", flush=True)
    except RunLockedError as e:
        print("refused", e, flush=True)
    sys.stdin.readline()
    lock.release()
    print("released", flush=True)
"""


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_racing_launches_take_over_a_stale_lock_once(tmp_path):
    """Several launches find one stale lock at the same moment: exactly one takes it over; the
    others fail naming it, and no file of theirs is left in the folder."""
    racers = [subprocess.Popen([sys.executable, "-c", RACER], cwd=REPO, env=ENV, text=True,
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE) for _ in range(6)]
    gone = dead_pid()
    try:
        for trial in range(40):
            folder = tmp_path / str(trial)
            folder.mkdir()
            # Left by a dead run: on this host (its pid is gone), or on another (no heartbeat).
            stale = ({"host": socket.gethostname(), "pid": gone} if trial % 2 else
                     {"host": "elsewhere", "pid": 7})
            (folder / LOCK_NAME).write_text(json.dumps(stale))
            old = time.time() - 3600
            os.utime(folder / LOCK_NAME, (old, old))
            start = time.time() + 0.1
            for r in racers:
                r.stdin.write(f"{folder} {start}\n")
                r.stdin.flush()
            answers = [r.stdout.readline().strip() for r in racers]
            winners = [r.pid for r, a in zip(racers, answers) if a == "won"]
            assert len(winners) == 1, (trial, answers)
            holder = json.loads((folder / LOCK_NAME).read_text())
            assert holder["pid"] == winners[0]
            for a in answers:
                assert a == "won" or (a.startswith("refused ") and (
                    f"in use by another run (host {socket.gethostname()}, pid {winners[0]}"
                    in a or "changed hands" in a)), a
            assert sorted(os.listdir(folder)) == [LOCK_NAME]  # no claim, aside or temp file
            for r in racers:
                r.stdin.write("release\n")
                r.stdin.flush()
            assert [r.stdout.readline().strip() for r in racers] == ["released"] * len(racers)
            assert not (folder / LOCK_NAME).exists()
    finally:
        for r in racers:
            r.kill()
            r.wait()


def test_a_takeover_judged_on_an_earlier_read_leaves_the_new_lock(tmp_path):
    """The interleaving behind two winners: launch B reads the stale lock, launch A takes it over
    (its new lock is in place), then B goes on to take over what it judged stale."""
    path = tmp_path / LOCK_NAME
    path.write_text(json.dumps({"host": "elsewhere", "pid": 7}))
    old = time.time() - 3600
    os.utime(path, (old, old))
    late = RunLock(tmp_path, stale_s=600)
    info, ident = late._read()
    reason = late.stale_reason(info)
    assert reason.startswith("no heartbeat for ")
    first = RunLock(tmp_path, stale_s=600)
    first.acquire()
    mine = path.read_text()
    assert json.loads(mine)["pid"] == os.getpid()
    assert late._take_over(ident, info, reason) is False
    assert path.read_text() == mine
    assert sorted(os.listdir(tmp_path)) == [LOCK_NAME]
    first.release()
    assert not path.exists()


def test_a_takeover_claim_left_by_a_dead_launch_is_named(tmp_path):
    path = tmp_path / LOCK_NAME
    path.write_text(json.dumps({"host": "elsewhere", "pid": 7}))
    old = time.time() - 3600
    os.utime(path, (old, old))
    st = path.stat()
    claim = tmp_path / f"{LOCK_NAME}.takeover.{st.st_ino}.{st.st_mtime_ns}"
    claim.touch()
    os.utime(claim, (old, old))  # the launch that claimed the takeover died before finishing
    with pytest.raises(RunLockedError) as e:
        RunLock(tmp_path, stale_s=600).acquire()
    # both files named, the claim's age, and what to do (delete them)
    said = str(e.value)
    assert str(path) in said and str(claim) in said and "delete" in said, said
    assert re.search(r"\b36\d\d s\b", said), said
    claim.unlink()
    lock = RunLock(tmp_path, stale_s=600)
    lock.acquire()
    lock.release()


def test_a_lock_held_by_a_zombie_is_taken_over(tmp_path):
    """A process that took the lock and exited without releasing it, not yet reaped by its
    parent (here: this test): its pid still answers, but it holds nothing."""
    holder = subprocess.Popen([sys.executable, "-c", (
        "import os, sys; from torchllm.run.runlock import RunLock; "
        "RunLock(sys.argv[1], stale_s=600).acquire(); os._exit(0)"), str(tmp_path)], env=ENV)
    try:
        wait_for(lambda: process_state(holder.pid) == "Z", 60, what="the lock holder to exit")
        assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == holder.pid
        lock = RunLock(tmp_path, stale_s=600)
        lock.acquire()  # not "in use by another run"
        assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
        lock.release()
    finally:
        holder.wait()


@pytest.mark.parametrize("content", [
    "", "{\"host\": \"h\", \"pi", "[1, 2]", "\"run\"", "null",
    '{"host": "h", "pid": "123"}', '{"host": "h", "pid": 1.5}', '{"host": "h", "pid": true}',
    '{"host": "h", "pid": 0}', '{"pid": 123}',
], ids=["empty", "cut", "list", "string", "null", "pid-str", "pid-float", "pid-bool",
        "pid-0", "no-host"])
def test_an_unreadable_lock_file_is_named_and_kept(tmp_path, content):
    path = tmp_path / LOCK_NAME
    path.write_text(content)
    old = time.time() - 3600  # an hour without heartbeat: it is not a live run's lock either
    os.utime(path, (old, old))
    with pytest.raises(RunLockedError) as e:
        RunLock(tmp_path, stale_s=600).acquire()
    said = str(e.value)  # one line naming the file and what to do (delete it)
    assert str(path) in said and "delete" in said and "\n" not in said, said
    assert e.value.key == "job.run_name"
    assert path.read_text() == content  # left for the user to judge
    lock = RunLock(tmp_path, stale_s=600)
    path.unlink()  # deleted, as the message says: the next launch takes the folder
    lock.acquire()
    lock.release()


@pytest.mark.slow
def test_a_launch_that_fails_at_start_up_frees_the_run_folder(tmp_path):
    """A worker ends with os._exit (no atexit) and its Trainer never finished building: the lock
    must still go, or a relaunch from another host is refused for job.lock_stale_minutes."""
    # A folder without a checkpoint in it (a missing one is refused before the lock is taken;
    # the tokenizer is named, so nothing reads the folder before the Trainer does).
    (tmp_path / "not-a-checkpoint").mkdir()
    # In this process (atexit cannot run before the check below, as under os._exit): only what
    # main() and the Trainer release on their way out frees the folder.
    proc = run_module("torchllm.train", *tiny_args(tmp_path), "--job.run_name=r",
                      "--data.tokenizer=train",
                      f"--checkpoint.initial_load_path={tmp_path / 'not-a-checkpoint'}")
    assert proc.returncode == 1, proc.out[-3000:]
    # The checkpoint is looked up after the run folder was prepared and its lock taken
    # (the run's config.toml is written only once a checkpoint loaded: none here).
    assert str(tmp_path / "not-a-checkpoint") in proc.stderr, proc.out[-3000:]
    assert (tmp_path / "r").is_dir() and not (tmp_path / "r" / "config.toml").exists()
    assert not (tmp_path / "r" / LOCK_NAME).exists()


@pytest.mark.slow
@pytest.mark.e2e  # a real `python -m torchllm.train`: the test signals its process
def test_sigterm_at_start_up_frees_the_run_folder(tmp_path):
    """torchrun stops the other ranks with SIGTERM when one fails at start-up (before training
    handles the signal): rank 0 dies of it as before, but frees the run folder first."""
    lock = tmp_path / "r" / LOCK_NAME
    proc = subprocess.Popen(
        [sys.executable, "-m", "torchllm.train", *tiny_args(tmp_path), "--job.run_name=r",
         "--training.steps=100000"], cwd=REPO, env=ENV,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 120
        while not lock.exists() and proc.poll() is None and time.time() < deadline:
            time.sleep(0.002)
        assert lock.exists(), "the launch never took the lock"
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == -signal.SIGTERM, err[-3000:]  # not training yet: no clean stop
    assert not lock.exists()
