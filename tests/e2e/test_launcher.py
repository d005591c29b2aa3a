"""run_train.sh as a scheduler and a user meet it, with real torchrun launches (tiny settings):
a failure on one rank is printed once on the console; a single-node launch listens on loopback
only; SIGTERM saves and exits 0; a second launch into a running run's folder is refused; workers
die with their torchrun; a dead run's lock is taken over.

Three 2-rank launches in all: the rank-1 failure; one run shared by the loopback and SIGTERM
tests (`two_ranks`: its sockets read, then stopped); the run whose torchrun is killed. The
second and third launches into that run's folder are the launcher's checks before any rank
starts, called in this process (tests/cli.py's run_train: what the script execs)."""

import ipaddress
import json
import os
import re
import signal
import subprocess

import pytest

from cli import run_train
from conftest import REPO, process_state, tiny_args, wait_for
from messages import launcher_lines

pytestmark = pytest.mark.slow


def args(tmp_path, *extra: str) -> list[str]:
    """run_train.sh's overrides for these tests' runs under `tmp_path`."""
    return [*tiny_args(tmp_path, "--training.local_batch_size=2", "--metrics.progress_bar=false"),
            *extra]


def launch(tmp_path, *extra, ngpu=1, log_rank="0", wait=True, out=None, env=None):
    mine = ("RDZV_ID", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")  # the launcher's defaults
    env = {**{k: v for k, v in os.environ.items() if k not in mine}, "NGPU": str(ngpu),
           "LOG_RANK": log_rank, "PYTHONPATH": str(REPO), **(env or {})}
    cmd = ["./run_train.sh", *args(tmp_path, *extra)]
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


def _hex_addr(field: str) -> tuple[str, int]:
    """A /proc/net/tcp{,6} 'ADDR:PORT' (little-endian hex words) as (ip, port)."""
    addr, port = field.split(":")
    raw = bytes.fromhex(addr)
    raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return str(ipaddress.ip_address(raw)), int(port, 16)


def listening() -> dict[str, tuple[str, int]]:
    """{socket inode: (ip, port)} of every listening TCP socket of this network namespace."""
    out = {}
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(name) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A":  # TCP_LISTEN
                    out[fields[9]] = _hex_addr(fields[1])
    return out


def tree(pid: int) -> list[int]:
    """`pid` and its descendants."""
    children: dict[int, list[int]] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def socket_inodes(pids: list[int]) -> set[str]:
    inodes = set()
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    return inodes


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """A 2-rank ./run_train.sh as a user starts it on one node (no rendezvous settings), saving
    only when stopped, running at its step 2. The tests below read it in order (its sockets,
    then a SIGTERM); one run alone starts it too, and whatever is left running is killed."""
    tmp_path = tmp_path_factory.mktemp("two_ranks")
    log = open(tmp_path / "out.txt", "w")
    proc = launch(tmp_path, "--job.run_name=r", "--training.steps=10000", "--checkpoint.enable",
                  "--checkpoint.interval=100000", ngpu=2, wait=False, out=log)
    proc.folder = tmp_path
    try:
        wait_for(lambda: "step     2/" in (tmp_path / "out.txt").read_text() or proc.poll(), 240,
                 what="step 2", every=0.5)
        assert proc.poll() is None, (tmp_path / "out.txt").read_text()[-3000:]
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()


@pytest.mark.e2e  # the launcher's process and its workers' sockets
def test_a_single_node_launch_listens_on_loopback_only(two_ranks):
    """Every listening socket of the launcher and its workers is on 127.0.0.1 (torch's own
    TCPStore binds every interface). (The id: a random one unless RDZV_ID gives one, and a
    given endpoint's launch is rewritten the same way: test_launch_security.py.)"""
    mine = socket_inodes(tree(two_ranks.pid))
    found = {addr for inode, addr in listening().items() if inode in mine}
    assert found, "no listener found: the run's sockets were not read"
    assert {ip for ip, _ in found} == {"127.0.0.1"}, found


@pytest.mark.e2e
def test_sigterm_reaches_every_worker_which_save_and_exit_0(two_ranks):
    two_ranks.send_signal(signal.SIGTERM)
    out_file = two_ranks.folder / "out.txt"
    assert two_ranks.wait(timeout=120) == 0, out_file.read_text()[-3000:]
    out = out_file.read_text()
    assert launcher_lines(out, "SIGTERM"), out  # said by the launcher, naming the signal
    assert "Traceback" not in out and "SignalException" not in out
    (step_dir,) = (two_ranks.folder / "r" / "checkpoint").iterdir()
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
        try:  # (the launcher's check, before any rank starts: in this process)
            second = run_train(*args(tmp_path, "--job.run_name=r", "--training.steps=1"))
        finally:
            os.kill(worker, signal.SIGCONT)
        assert second.returncode == 2, second.out
        # one line: the folder in use, and the process that holds it
        assert any(re.search(rf"\bpid {worker}\b", line)
                   for line in launcher_lines(second.stderr, str(tmp_path / "r"))), second.stderr
    finally:
        first.send_signal(signal.SIGKILL)  # torchrun dies without passing anything on
        first.wait()

    # (a zombie is dead too: its parent is gone, and it holds no lock)
    wait_for(lambda: process_state(worker) in (None, "Z"), timeout=30,
             what="the orphaned worker to die", every=0.5)
    assert lock.exists()  # left behind by the killed run
    third = run_train(*args(tmp_path, "--job.run_name=r", "--training.steps=1",
                            "--job.overwrite"))
    out = third.out
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
