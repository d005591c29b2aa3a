"""Replica groups of one run only: what a group says about itself, and the check at each quorum.

Every time the live groups change, torchft configures a new process group over them; before
anything else travels on it (a heal, a gradient), each group sends its identity record to the
others: a JSON object in a fixed-size byte tensor (RECORD_BYTES, one gloo all-gather; data,
never code, so no pickle) with

    run       the run's name (job.run_name; each group's folder is <run>-replica<R>)
    data      the data fingerprint (torchllm.data.fingerprint: sources, their content, seq_len,
              job.seed, shuffle_windows), as its checkpoints record it
    tokenizer its file's SHA-256 (else its name: bytes, a Hub name)
    config    what else shapes the updates: the model's resolved shape (model.*), the batch,
              precision, optimizer, LR schedule, steps, group_size and ranks per group

A group that differs from a peer in any of them refuses, in one line naming each difference (the
peer's value -> this group's), and the peer refuses the same way: both exit 2, before a heal
copies a stranger's state or an all-reduce mixes two models (of two widths: a gloo abort).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging

import torch

from torchllm.data.fingerprint import changes

PROTOCOL = "torchllm-ft-identity/1"
RECORD_BYTES = 16384  # the tensor each group sends: its record's JSON, zero-padded
SHOWN = 8  # differences named in the refusal (then "and N more")


class GroupsDiffer(Exception):
    """A peer in this quorum is another run's or trains another config (the one-line why)."""


def _flat(prefix: str, obj) -> dict[str, str]:
    """A config section or args dataclass as {"prefix.field": "value"} (nested ones inlined)."""
    out = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            out.update(_flat(f"{prefix}.{f.name}", value))
        else:
            out[f"{prefix}.{f.name}"] = str(value)[:80]
    return out


def group_record(ctx, run: str) -> dict:
    """This group's identity record (module doc), from the run's TrainContext (callbacks.py)."""
    cfg, info = ctx.cfg, ctx.run_info
    tokenizer = info["tokenizer"]
    config = {"model.name": cfg.model.name, **_flat("model", ctx.model_args),
              "training.local_batch_size": str(cfg.training.local_batch_size),
              "training.global_batch_size": str(info["global_batch_size"]),
              "training.steps": str(cfg.training.steps),
              "training.mixed_precision (precision)": info["precision"],
              **_flat("optimizer", cfg.optimizer), **_flat("lr_scheduler", cfg.lr_scheduler),
              "fault_tolerance.group_size": str(cfg.fault_tolerance.group_size),
              **{f"fault_tolerance.{k}": str(getattr(cfg.fault_tolerance, k)) for k in (
                  "overlap", "semi_sync_method", "sync_steps", "num_fragments", "outer_lr",
                  "outer_momentum", "outer_nesterov")},
              "ranks per group (NGPU)": str(ctx.parallel_dims.world_size)}
    return {"protocol": PROTOCOL, "replica": cfg.fault_tolerance.replica_id, "run": run,
            "data": {k: v for k, v in info["data"].items() if k != "tokenizer_sha256"},
            "tokenizer": tokenizer.get("base_sha256") or str(tokenizer.get("name")),
            "config": config}


def encode(record: dict) -> torch.Tensor:
    """The record as RECORD_BYTES uint8 (a long list of data files: their identities hashed)."""
    raw = json.dumps(record, sort_keys=True).encode()
    if len(raw) > RECORD_BYTES:
        content = json.dumps(record["data"].get("content"), sort_keys=True).encode()
        digest = "digest:" + hashlib.blake2b(content, digest_size=16).hexdigest()
        raw = json.dumps({**record, "data": {**record["data"], "content": [digest]}},
                         sort_keys=True).encode()
    raw = raw[:RECORD_BYTES]  # (still too long: unreadable to the peer, which refuses)
    out = torch.zeros(RECORD_BYTES, dtype=torch.uint8)
    out[:len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    return out


def decode(tensor: torch.Tensor) -> dict | None:
    """A peer's record, or None when it is not one (another protocol, cut short, not JSON)."""
    raw = bytes(tensor.numpy().tobytes()).rstrip(b"\0")
    try:
        record = json.loads(raw.decode())
    except (UnicodeDecodeError, ValueError):
        return None
    ok = isinstance(record, dict) and record.get("protocol") == PROTOCOL and all(
        isinstance(record.get(k), dict) for k in ("data", "config"))
    return record if ok else None


def differences(there: dict, here: dict) -> list[str]:
    """What differs, one phrase each, as "what there -> here" ([] for groups of one run)."""
    out = []
    if there["run"] != here["run"]:
        out.append(f"job.run_name {there['run']!r} -> {here['run']!r}")
    out += changes(there["data"], here["data"])  # sources, content, seq_len, job.seed, ...
    if there["tokenizer"] != here["tokenizer"]:
        out.append(f"data.tokenizer {str(there['tokenizer'])[:16]} -> "
                   f"{str(here['tokenizer'])[:16]}")
    a, b = there["config"], here["config"]
    out += [f"{k} {a.get(k, '(none)')} -> {b.get(k, '(none)')}"
            for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
    return out


def refusal(there: dict | None, here: dict, lighthouse: str) -> str | None:
    """The one-line refusal of a quorum with the peer whose record is `there` (None: agreed)."""
    if there is None:
        what, who = ["its identity record is unreadable (another torchllm version?)"], "a peer"
    else:
        what = differences(there, here)
        who = f"replica group {there.get('replica')} of run {there['run']!r}"
    if not what:
        return None
    more = f" and {len(what) - SHOWN} more" if len(what) > SHOWN else ""
    return (f"fault tolerance: {who}, in this quorum at the lighthouse {lighthouse}, is not of "
            f"this run and config (replica group {here['replica']} of run {here['run']!r}): "
            f"{'; '.join(what[:SHOWN])}{more} (the peer's -> this group's). Replica groups heal "
            "from and average with groups of their own run and config only: launch every group "
            "of a run with the same config (scripts/ft_local.sh does), and give each run its own "
            "lighthouse (unset TORCHFT_LIGHTHOUSE: a run's default port comes from its name)")


class _DropRefusalTraceback(logging.Filter):
    """torchft logs the exception its quorum thread caught with a traceback; ours is a refusal,
    said once in one line by the trainer."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and isinstance(record.exc_info[1], GroupsDiffer))


def checked_group(backend: str, timeout):
    """torchft's reconfigurable process group across the groups (fault_tolerance.process_group:
    gloo, or NCCL on CUDA) that exchanges identity records at each configure (a new quorum): on
    a difference it keeps the refusal (`.refusal`) and raises, so torchft skips the heal and the
    step; ReplicaGroups.begin_step then stops the run. Only ProcessGroup's public calls: torchft
    calls `configure(store_addr, replica_id, rank, world_size, ...)` with each new quorum (the
    arguments after those four differ between torchft versions), and the records say who is in
    it: `.members`, the replica ids in quorum rank order; `.quorums`, how many were configured."""
    import torchft
    from torch.distributed.distributed_c10d import AllgatherOptions

    logging.getLogger("torchft.manager").addFilter(_DropRefusalTraceback())
    base = torchft.ProcessGroupNCCL if backend == "nccl" else torchft.ProcessGroupGloo
    device = torch.device("cuda") if backend == "nccl" else torch.device("cpu")

    class Checked(base):
        record: dict | None = None  # this group's (ReplicaGroups.attach)
        lighthouse = ""
        refusal: str | None = None
        members: list = []
        quorums = 0

        def configure(self, store_addr, replica_id, rank, world_size, *args, **kwargs):
            super().configure(store_addr, replica_id, rank, world_size, *args, **kwargs)
            self.quorums += 1
            if self.record is None:
                self.members = []
                return
            if world_size < 2:
                self.members = [self.record["replica"]]
                return
            mine = encode(self.record).to(device)
            gathered = [torch.zeros_like(mine) for _ in range(world_size)]
            self.allgather([gathered], [mine], AllgatherOptions()).wait()  # before any heal
            records = [decode(t.cpu()) for t in gathered]
            self.members = [r.get("replica") if r else None for r in records]
            for peer, there in enumerate(records):
                why = None if peer == rank else refusal(there, self.record, self.lighthouse)
                if why:
                    self.refusal = why
                    raise GroupsDiffer(why)

    return Checked(timeout=timeout)
