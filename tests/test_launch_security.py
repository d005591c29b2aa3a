"""What a launch exposes on the network: a single-node ./run_train.sh listens on loopback only
(torchrun's rendezvous store, the workers' store, gloo), and its rendezvous id is random unless
RDZV_ID gives one; several nodes without RDZV_ID are refused."""

from __future__ import annotations

import ipaddress
import os
import signal
import socket
import subprocess
import time

import pytest

from conftest import REPO, tiny_args
from s3_server import free_port
from torchllm.config import ConfigError
from torchllm.run.launch import secure_rendezvous


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


def run_listeners(proc, timeout=240) -> set[tuple[str, int]]:
    """The listening sockets of `proc`'s process tree once both ranks train (step 2 logged)."""
    end, out = time.monotonic() + timeout, ""
    while "step     2/" not in out:
        assert proc.poll() is None and time.monotonic() < end, out[-3000:]
        time.sleep(0.3)
        out = proc.log.read_text()
    mine = socket_inodes(tree(proc.pid))
    return {addr for inode, addr in listening().items() if inode in mine}


def start(tmp_path, name, **env):
    log = tmp_path / f"{name}.log"
    env = {**os.environ, "NGPU": "2", "PYTHONPATH": str(REPO), **env}
    for key in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "RDZV_ID"):
        env.pop(key, None)
    with open(log, "w") as out:
        proc = subprocess.Popen(
            ["./run_train.sh", *tiny_args(tmp_path, f"--job.run_name={name}",
                                          "--training.steps=100000",
                                          "--training.local_batch_size=2",
                                          "--metrics.progress_bar=false")],
            cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    proc.log = log
    return proc


def stop(proc) -> None:
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 0, proc.log.read_text()[-3000:]


@pytest.mark.slow
@pytest.mark.e2e  # the launcher's process and its workers' sockets
def test_a_single_node_launch_listens_on_loopback_only_with_a_random_rendezvous_id(tmp_path):
    """2 ranks of ./run_train.sh, by default and with RDZV_ENDPOINT=127.0.0.1:PORT: every
    listening socket of the launcher and its workers is on 127.0.0.1 (torch's own TCPStore binds
    every interface), and the rendezvous is not under the old fixed id `torchllm`."""
    import torch.distributed as dist

    endpoint = {"RDZV_ENDPOINT": f"127.0.0.1:{free_port()}"}
    for name, env in (("standalone", {}), ("endpoint", endpoint)):
        proc = start(tmp_path, name, **env)
        try:
            found = run_listeners(proc)
            assert found, "no listener found: the run's sockets were not read"
            assert {ip for ip, _ in found} == {"127.0.0.1"}, (name, found)
            if env:  # the rendezvous store at the endpoint: the old guessable key is absent
                port = int(env["RDZV_ENDPOINT"].rsplit(":", 1)[1])
                assert ("127.0.0.1", port) in found
                client = dist.TCPStore("127.0.0.1", port, is_master=False)
                assert not client.check(["torch.rendezvous.torchllm"])
        finally:
            if proc.poll() is None:
                stop(proc)


def test_the_rendezvous_id_is_random_unless_given_and_required_on_several_nodes():
    from torch.distributed.run import parse_args

    def rewritten(*argv):
        args = parse_args([*argv, "-m", "torchllm.train"])
        return args, secure_rendezvous(args)

    (a, local_a), (b, local_b) = rewritten("--standalone"), rewritten("--standalone")
    assert local_a and local_b and not a.standalone
    assert a.rdzv_backend == "c10d" and a.rdzv_endpoint == "127.0.0.1:0"
    assert a.local_addr == "127.0.0.1"
    assert a.rdzv_id != b.rdzv_id and len(a.rdzv_id) == 32  # 128 random bits each
    # No rendezvous option on one node: torchrun makes it a c10d rendezvous on a free port, as
    # --standalone (torch.distributed.run.run); here too.
    plain, local_plain = rewritten("--nproc_per_node=2")
    assert local_plain and plain.rdzv_backend == "c10d"
    assert plain.rdzv_endpoint == "127.0.0.1:0" and len(plain.rdzv_id) == 32
    static, local_static = rewritten("--master_addr=10.1.2.3", "--master_port=29511")
    assert not local_static and static.rdzv_backend == "static"  # the user's MASTER_ADDR/PORT
    one_node = ("--rdzv_backend=c10d", "--rdzv_endpoint=localhost:29555")
    (c, local_c), (d, _) = rewritten(*one_node), rewritten(*one_node)
    assert local_c and c.rdzv_id != d.rdzv_id and len(c.rdzv_id) == 32
    given, local = rewritten(*one_node, "--rdzv_id=mine")
    assert given.rdzv_id == "mine"
    remote = ("--nnodes=2", "--rdzv_backend=c10d", "--rdzv_endpoint=10.1.2.3:29555")
    args, local = rewritten(*remote, "--rdzv_id=secret")
    assert not local and args.local_addr is None and args.rdzv_id == "secret"
    with pytest.raises(ConfigError, match="RDZV_ID") as err:  # the variable to set
        rewritten(*remote)
    assert "\n" not in str(err.value)


@pytest.mark.slow
@pytest.mark.e2e  # run_train.sh's NNODES / RDZV_ENDPOINT, through the launcher
def test_several_nodes_without_rdzv_id_is_one_line_and_exit_2(tmp_path):
    env = {**os.environ, "NNODES": "2", "RDZV_ENDPOINT": f"127.0.0.1:{free_port()}",
           "PYTHONPATH": str(REPO)}
    env.pop("RDZV_ID", None)
    proc = subprocess.run(["./run_train.sh", *tiny_args(tmp_path)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.startswith("run_train:") and "RDZV_ID" in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
