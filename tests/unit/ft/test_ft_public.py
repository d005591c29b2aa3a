"""Replica groups through torchft's public API only (issue 65 #2-#4; docs/fault_tolerance.md).

Two in-process replica groups (two Trainers in two threads, each a real ReplicaGroups with its
real cross-group process group, identity exchange and heal transport) around a stand-in for
torchft's Manager that offers only its public calls, as torchft's main branch does: it
configures the process group with the four arguments every version passes, and its allreduce
behaves like torchft 0.2.0's (default AVG, SUM sums) or like the versions before it (default
SUM, which averaged). The groups must average their gradients and sum their token counts the
same way in both, name the live groups, and hold equal MoE routing biases after 20 steps.
"""

from __future__ import annotations

import signal
import socket
import threading

import pytest
import torch
import torch.distributed as dist

from builders.ft import log_lines  # noqa: F401 (a fixture)
from conftest import tiny_args
from messages import assert_names, raises_naming, refused
from torchllm.config import ConfigError, load_config

torchft = pytest.importorskip("torchft")

SECRET = "0123456789abcdef0123456789abcdef"
MOE = ("--model.name=qwen3_moe", "--model.moe_bias_update_rate=0.01")


class FakeManager:
    """torchft's Manager as its public calls (start_quorum, allreduce, should_commit, ...), for
    two groups in one process: `hub` holds what they share."""

    hub: dict = {}

    def __init__(self, pg, replica_id: str, checkpoint_transport, **kwargs):
        self.pg, self.transport = pg, checkpoint_transport
        self.rank = int(replica_id.rsplit("_", 1)[1])
        self.configured = False

    def register_state_dict_fn(self, *args):
        pass

    def load_state_dict(self, state):
        pass

    def start_quorum(self):
        if not self.configured:  # torchft's main branch: configure(store, replica, rank, world)
            self.pg.configure(f"127.0.0.1:{self.hub['port']}/torchft/1/0", str(self.rank),
                              self.rank, 2)
            self.configured = True

    def num_participants(self):
        return 2

    def participating_rank(self):
        return self.rank

    def allreduce(self, tensor, should_quantize=False, reduce_op=None):
        old = self.hub["semantics"] == "before 0.2"
        op = reduce_op if reduce_op is not None else \
            (dist.ReduceOp.SUM if old else dist.ReduceOp.AVG)
        if op == dist.ReduceOp.AVG and old:
            raise ValueError("ReduceOp.AVG is not supported by gloo")  # passed through as is
        divide = op == (dist.ReduceOp.SUM if old else dist.ReduceOp.AVG)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.SUM if op == dist.ReduceOp.AVG else op
        self.pg.allreduce([tensor], opts).wait()
        if divide:
            tensor /= 2
        self.hub.setdefault("ops", set()).add(str(reduce_op))
        return type("Done", (), {"wait": lambda self: tensor})()

    def should_commit(self):
        return True

    def shutdown(self, wait=True):
        self.transport.shutdown(wait=False)


@pytest.fixture
def groups(tmp_path, monkeypatch):
    """make(steps, *args) -> the two groups' Trainers after training `steps` side by side."""
    monkeypatch.setattr(torchft, "Manager", FakeManager)
    monkeypatch.setenv("TORCHLLM_FT_SECRET", SECRET)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    house = socket.socket()  # something answers at the lighthouse's address (launch check)
    house.bind(("127.0.0.1", 0))
    house.listen()
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", f"http://localhost:{house.getsockname()[1]}")
    trainers = []

    def make(steps: int, *args: str, semantics: str = "0.2.0"):
        from torchllm.train import Trainer

        FakeManager.hub = {"port": store.port, "semantics": semantics}
        for r in (0, 1):
            trainers.append(Trainer(load_config(tiny_args(
                tmp_path, "--data.tokenizer=bytes", "--checkpoint.enable=false",
                "--validation.enable=false", "--eval.sample_freq=0", f"--training.steps={steps}",
                "--fault_tolerance.enable", "--fault_tolerance.group_size=2",
                f"--fault_tolerance.replica_id={r}", *args))))
        errors = []

        def train(t):
            try:
                t.losses = t.train()
            except BaseException as e:  # noqa: BLE001 (re-raised below, in the test's thread)
                errors.append(e)

        # (the trainers' SIGTERM/SIGINT handlers: main thread only; none for these two)
        monkeypatch.setattr(signal, "signal", lambda signum, handler: signal.SIG_DFL)
        threads = [threading.Thread(target=train, args=(t,)) for t in trainers]
        for th in threads:
            th.start()
        for th in threads:
            th.join(300)
        monkeypatch.undo()
        assert not errors, errors
        return trainers

    yield make
    for t in trainers:
        t.close()
    house.close()


# -- the pieces, in one process: two groups' process groups in two threads (fast) ------------

def two_groups(work, records=(None, None)):
    """work(rank, pg) in two threads over two real cross-group process groups, configured as
    torchft's main branch does (four arguments); returns their results by rank."""
    from datetime import timedelta

    from torchllm.ft.identity import checked_group

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    pgs = [checked_group("gloo", timedelta(seconds=30)) for _ in range(2)]
    out, errors = [None, None], []

    def run(rank):
        try:
            pgs[rank].record = records[rank]
            pgs[rank].configure(f"127.0.0.1:{store.port}/torchft/1/0", str(rank), rank, 2)
            out[rank] = work(rank, pgs[rank])
        except BaseException as e:  # noqa: BLE001 (re-raised below)
            errors.append(e)

    threads = [threading.Thread(target=run, args=(r,)) for r in (0, 1)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    for pg in pgs:
        pg.abort(errored=False)
    assert not errors, errors
    return out


@pytest.mark.parametrize("semantics", ["0.2.0", "before 0.2"])
def test_means_and_sums_over_groups_are_the_same_in_either_torchft_allreduce(semantics):
    from torchllm.ft.reduce import max_over_groups, mean_over_groups, sum_over_groups

    FakeManager.hub = {"semantics": semantics}

    def work(rank, pg):
        manager = FakeManager(pg, f"torchllm_replica_{rank}", None)
        grads = [torch.full((2, 3), 1.0 + rank), torch.full((4,), 10.0 * (rank + 1)),
                 torch.full((2,), 0.5 + rank, dtype=torch.float64)]
        mean_over_groups(manager, grads)
        counts = torch.tensor([128.0 + rank, 3.0], dtype=torch.float64)
        sum_over_groups(manager, [counts])
        worst = max_over_groups(manager, torch.tensor([2.0 + rank]))
        return grads, counts, worst

    for grads, counts, worst in two_groups(work):
        assert [g.tolist() for g in grads] == [[[1.5] * 3] * 2, [15.0] * 4, [1.0, 1.0]]
        assert grads[2].dtype == torch.float64
        assert counts.tolist() == [257.0, 6.0] and worst.tolist() == [3.0]
    assert "None" not in FakeManager.hub["ops"]  # every allreduce names its op


def test_the_quorums_members_come_from_the_groups_identity_records():
    from torchllm.ft.identity import PROTOCOL

    def record(replica):
        return {"protocol": PROTOCOL, "replica": replica, "run": "r", "tokenizer": "t",
                "data": {"sources": [["d", 1.0]], "seq_len": 32},
                "config": {}}

    # (torchft's main branch passes no global ranks: ProcessGroupWrapper's `_global_ranks` None)
    out = two_groups(lambda rank, pg: (pg.members, pg.quorums, pg.refusal),
                     records=(record(3), record(1)))
    assert out == [([3, 1], 1, None), ([3, 1], 1, None)]


def test_the_buffers_kept_equal_across_groups_are_the_moe_loads_and_biases(tmp_path):
    from torchllm.ft.reduce import step_buffers
    from torchllm.train import Trainer

    t = Trainer(load_config(tiny_args(tmp_path, "--data.tokenizer=bytes", *MOE,
                                      "--checkpoint.enable=false", "--validation.enable=false")))
    try:
        names = {id(b): n for n, b in t.model.named_buffers()}
        kept = sorted(names[id(b)].rsplit(".", 1)[-1] for b in step_buffers(t.model))
        from torchllm.models.moe import moe_layers

        layers = len(moe_layers(t.model))
        assert layers and kept == ["expert_bias"] * layers + ["expert_load"] * layers
        assert "rope_cache" in {n.rsplit(".", 1)[-1] for n in names.values()}  # a constant
    finally:
        t.close()


# -- two trainers, side by side ----------------------------------------------------------

@pytest.mark.slow
def test_moe_routing_biases_stay_equal_across_groups_for_20_steps(groups):
    a, b = groups(20, *MOE)
    from torchllm.models.moe import moe_layers

    biases = [[m.expert_bias for m in moe_layers(t.model)] for t in (a, b)]
    assert biases[0] and all(x.abs().max() > 0 for x in biases[0])  # the update rule ran
    for x, y in zip(*biases):
        assert torch.equal(x, y)
    for (name, x), y in zip(a.model.state_dict().items(), b.model.state_dict().values()):
        assert torch.equal(x, y), name  # and the weights, updated from the same gradients
    assert a.losses == b.losses


@pytest.mark.slow
@pytest.mark.parametrize("semantics", ["0.2.0", "before 0.2"])
def test_gradients_are_averaged_and_tokens_summed_in_either_torchft_allreduce(
        groups, log_lines, semantics):
    from torchllm.ft import replicas

    seen = []
    average = replicas.ReplicaGroups.average

    def spy(self, stats, model):  # each group's own gradients and counts, then the result
        own = [p.grad.clone() for p in model.parameters()]
        tokens = float(stats["tokens"])
        ok = average(self, stats, model)
        seen.append((self.replica_id, own, [p.grad.clone() for p in model.parameters()], tokens,
                     float(stats["tokens"])))
        return ok

    replicas.ReplicaGroups.average = spy
    try:
        groups(1, semantics=semantics)
    finally:
        replicas.ReplicaGroups.average = average
    (_, own0, mean0, tok0, total0), (_, own1, mean1, tok1, total1) = sorted(
        seen, key=lambda s: s[0])
    for g0, g1, m0, m1 in zip(own0, own1, mean0, mean1):
        assert not torch.equal(g0, g1)  # each group its own part of the data
        torch.testing.assert_close(m0, (g0 + g1) / 2)
        assert torch.equal(m0, m1)
    assert total0 == total1 == tok0 + tok1 == 2 * 4 * 32
    assert "None" not in FakeManager.hub["ops"]  # every allreduce names its op
    assert any("quorum: 2 of 2 replica groups live (0, 1)" in line for line in log_lines), \
        log_lines


@pytest.mark.slow
def test_another_torchft_version_is_warned_about_in_one_line(groups, log_lines, monkeypatch):
    from torchllm.ft import reduce

    monkeypatch.setattr(reduce, "torchft_version", lambda: "9.9.9")
    groups(1)
    warned = [line for line in log_lines if "9.9.9" in line]
    assert len(warned) == 2, log_lines  # once per group, at its start
    assert_names(warned[0], "torchft 9.9.9", reduce.TESTED_TORCHFT)
    assert "\n" not in warned[0]


def test_the_tested_torchft_version_is_not_warned_about(monkeypatch, log_lines):
    from torchllm.ft import reduce

    monkeypatch.setattr(reduce, "torchft_version", lambda: reduce.TESTED_TORCHFT)
    assert reduce.warn_untested_torchft() is None and not log_lines


def test_the_cross_group_process_group_is_the_configured_backend(monkeypatch):
    from datetime import timedelta

    from torchllm.ft.identity import checked_group

    class NCCL(torchft.ProcessGroupGloo):  # (no GPU here: a stand-in for torchft's NCCL class)
        pass

    monkeypatch.setattr(torchft, "ProcessGroupNCCL", NCCL)
    assert isinstance(checked_group("nccl", timedelta(seconds=5)), NCCL)
    gloo = checked_group("gloo", timedelta(seconds=5))
    assert isinstance(gloo, torchft.ProcessGroupGloo) and not isinstance(gloo, NCCL)


def test_the_default_backend_across_groups_is_gloo(tmp_path):
    cfg = load_config(tiny_args(tmp_path, "--fault_tolerance.enable"))
    assert cfg.fault_tolerance.process_group == "gloo"


def test_nccl_across_groups_on_cpu_is_refused_naming_the_key(tmp_path):
    from cli import run_train

    ran = run_train(*tiny_args(tmp_path, "--fault_tolerance.enable",
                               "--fault_tolerance.process_group=nccl"))  # training.device=cpu
    refused(ran, "fault_tolerance.process_group", "nccl", "gloo", "training.device")


def test_nccl_with_training_on_cpu_is_refused_at_config_load_on_a_gpu_machine(tmp_path,
                                                                            monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with raises_naming(ConfigError, "nccl", "gloo", "training.device = 'cpu'",
                       key="fault_tolerance.process_group", one_line=True):
        load_config(tiny_args(tmp_path, "--fault_tolerance.enable",
                              "--fault_tolerance.process_group=nccl"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible")
def test_nccl_across_groups_without_a_gpu_is_refused_before_the_lighthouse(tmp_path):
    from torchllm.ft import check_fault_tolerance

    cfg = load_config(tiny_args(tmp_path, "--fault_tolerance.enable", "--training.device=auto",
                                "--fault_tolerance.process_group=nccl"))
    with raises_naming(ConfigError, "nccl", "gloo", "CUDA", key="fault_tolerance.process_group",
                       one_line=True):
        check_fault_tolerance(cfg.fault_tolerance, cfg.job, cfg.training.device,
                              {"TORCHFT_LIGHTHOUSE": "http://127.0.0.1:9"})


def test_an_unknown_backend_across_groups_is_refused(tmp_path):
    with raises_naming(ConfigError, "fault_tolerance.process_group", "mpi", "gloo", "nccl"):
        load_config(tiny_args(tmp_path, "--fault_tolerance.enable",
                              "--fault_tolerance.process_group=mpi"))
