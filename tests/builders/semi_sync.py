"""Two semi-synchronous replica groups in one process (tests/unit/ft/test_ft_semi_sync.py,
test_ft_streaming.py): one thread each, torchft's all-reduce replaced by an in-process mean
(`Exchange`, `Manager`), a `SemiSyncGroups` built around a small model with the trainer's
calls (begin_step, end_step) driven by the test."""

from __future__ import annotations

import threading

import torch


class Exchange:
    """What the live groups' torchft all-reduce does, between threads: the mean."""

    def __init__(self):
        self.barrier, self.slots, self.quorums = threading.Barrier(2, timeout=60), [None, None], 0


class Manager:
    _quorum_id = 1

    def __init__(self, exchange: Exchange, rank: int):
        self.exchange, self.rank = exchange, rank

    def allreduce(self, tensor, reduce_op=None):
        ex = self.exchange
        ex.slots[self.rank] = tensor
        ex.barrier.wait()
        mean = (ex.slots[0] + ex.slots[1]) / 2
        ex.barrier.wait()
        tensor.copy_(mean)
        return type("Work", (), {"wait": lambda self: None})()

    def should_commit(self):
        return True

    def start_quorum(self):
        self.exchange.quorums += 1

    def num_participants(self):
        return 2

    def participating_rank(self):
        return self.rank


def semi_sync_groups(model, method: str, rank: int, exchange: Exchange, sync_steps: int, steps: int,
            fragments: int = 1):
    from torchllm.ft.semi_sync import OuterStep, SemiSyncGroups

    g = object.__new__(SemiSyncGroups)
    g.replica_id = rank
    g.manager, g.min_replica_size, g.committed_here = Manager(exchange, rank), 1, 0
    g.heal = type("H", (), {"healed_at": None, "train_state": type("T", (), {"step": 0})()})()
    g.quorums, g.members, g.group_rank, g.group_world, g.group_size = 1, [0, 1], 0, 1, 2
    g.pg = type("P", (), {"refusal": None, "quorums": 1, "members": [0, 1]})()
    g.transport = type("X", (), {"refusal": None, "sent_to": []})()
    g.ftcfg = type("F", (), {"semi_sync_method": method})()
    g.sync_steps, g.last_step, g.quorum_taken = sync_steps, steps, False
    g.bytes_sent, g.syncs, g.pending, g.joining, g.marker = 0, 0, 0, 0, None
    g.num_fragments, g.uncounted, g.save_every = fragments, set(), 0
    g.state = OuterStep(model, method, lr=0.7, momentum=0.9, nesterov=True,
                        num_fragments=fragments)
    return g


def small_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def batches(steps: int):
    torch.manual_seed(1)
    return [[(torch.randn(6, 8), torch.randn(6, 4)) for _ in range(steps)] for _ in range(2)]


def inner_step(model, opt, batch):
    x, y = batch
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def end_steps(groups, exchange):
    errors = []

    def run(g):
        try:
            g.end_step()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
            exchange.barrier.abort()

    threads = [threading.Thread(target=run, args=(g,)) for g in groups]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
