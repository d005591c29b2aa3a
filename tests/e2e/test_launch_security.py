"""What a launch exposes on the network: its rendezvous id is random unless RDZV_ID gives one, a
single-node launch (--standalone, or a loopback endpoint) is rewritten to listen on loopback
(torchrun's rendezvous store, the workers' store, gloo), and several nodes without RDZV_ID are
refused. (A running 2-rank launch's sockets, all on 127.0.0.1: test_launcher.py.)"""

from __future__ import annotations

import os
import subprocess

import pytest

from conftest import REPO, tiny_args
from s3_server import free_port
from torchllm.config import ConfigError
from torchllm.run.launch import secure_rendezvous


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
    assert c.local_addr == "127.0.0.1"  # the workers' store, too, on loopback
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
