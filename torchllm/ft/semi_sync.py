"""Semi-synchronous replica groups: each trains `sync_steps` steps alone, then the groups sync.

    fault_tolerance.semi_sync_method = "diloco"     the groups average their parameter change
                                                    since the last sync (the pseudo-gradient,
                                                    params then - params now) and apply it with
                                                    the outer optimizer, SGD with Nesterov
                                                    momentum (DiLoCo, arXiv 2311.08105)
                                     = "local_sgd"  the groups' parameters are averaged
                                                    (LocalSGD, arXiv 1805.09767)

Between syncs no gradient crosses between groups: each group's own steps (its inner optimizer,
the loss guard judging its own loss) run as a single group's would. A sync is one torchft
all-reduce of the parameters' size, every `sync_steps` steps instead of the gradients' every
step. The quorum is taken at the start of each interval, right after a sync, when every group
holds the same weights: a relaunched group waits there, heals from a live one (weights, inner
and outer optimizer state, the parameters at the last sync, data position) and trains the
interval with it. A sync that cannot commit (a group died during the interval) is run again
after a new quorum without it, with the same parameter changes; a group relaunched meanwhile
may join that quorum and heal there, after its source's update of the sync's step (the heal
says so: `pending_sync`): it does not train that step, and joins the sync counting for nothing
(zeros, weight 0: ft/reduce.py), so the mean stays the live groups'. Checkpoints are taken at sync
points only (SyncPointCheckpointer below): there the parameters at the last sync are the weights,
so a checkpoint holds the outer optimizer's momentum (key `outer_optimizer`) beside them.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from torchllm.checkpoint.training_state import OPTIMIZER, Piece
from torchllm.config.job_config import ConfigError
from torchllm.ft.fragments import due, fragment_of
from torchllm.ft.reduce import mean_over_groups
from torchllm.ft.replicas import GroupCheckpointer, ReplicaGroups
from torchllm.log import logger

# Test-only (tests/integration/test_ft_semi_sync_heal.py): a file that a sync about to run again
# removes and then waits for before its new quorum, and that a launch's first quorum creates: a
# relaunch then joins the retried sync's quorum whatever the machine's load.
RETRY_MARKER = "TORCHLLM_FT_TEST_RETRY_MARKER"
MARKER_WAIT_S = 300.0


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _like(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """`local` as a tensor of `param`'s kind (a DTensor shard placed like the parameter)."""
    if isinstance(param, DTensor):
        return DTensor.from_local(local, param.device_mesh, param.placements,
                                  shape=param.shape, stride=param.stride(), run_check=False)
    return local


class OuterStep:
    """The state of semi-synchronous training and its sync.

    `anchor`: the (local) parameters at the last sync; `outer`: DiLoCo's outer optimizer over
    the trainable parameters (None for LocalSGD); `fragment`: each parameter's and buffer's
    fragment (ft/fragments.py; all 0 with one). `sync(average, fragments)` syncs those
    fragments, where `average({fragment: tensors})` averages each fragment's tensors in place
    over the live groups and returns whether the groups commit: nothing changes here unless
    they do."""

    def __init__(self, model: torch.nn.Module, method: str, lr: float = 0.7,
                 momentum: float = 0.9, nesterov: bool = True, num_fragments: int = 1):
        self.method, self.num_fragments = method, num_fragments
        named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        self.params = [p for _, p in named]
        # Buffers an update rule writes (MoE routing bias) are averaged at each sync too.
        persistent = set(model.state_dict())
        buffers = [(name, b) for name, b in model.named_buffers()
                   if name in persistent and b.is_floating_point()]
        self.buffers = [b for _, b in buffers]
        self.fragment = fragment_of([n for n, _ in named], num_fragments)
        self.buffer_fragment = fragment_of([n for n, _ in buffers], num_fragments) \
            if buffers else []
        self.anchor = [_local(p).detach().clone() for p in self.params]
        self.outer = torch.optim.SGD(self.params, lr=lr, momentum=momentum,
                                     nesterov=nesterov) if method == "diloco" else None
        self.settings = {"lr": lr, "momentum": momentum, "nesterov": nesterov}

    @torch.no_grad()
    def reset_anchor(self, fragments=None) -> None:
        """The current parameters (of `fragments`, default all) become the last sync's (after a
        sync, a load or a heal)."""
        for a, p, f in zip(self.anchor, self.params, self.fragment):
            if fragments is None or f in fragments:
                a.copy_(_local(p))

    def apply_settings(self) -> None:
        """The outer optimizer's settings from the config (a checkpoint's are not kept)."""
        if self.outer is not None:
            for group in self.outer.param_groups:
                group.update(self.settings)

    @torch.no_grad()
    def sync(self, average, fragments=None) -> bool:
        frags = list(range(self.num_fragments)) if fragments is None else list(fragments)
        index = {f: [i for i, g in enumerate(self.fragment) if g == f] for f in frags}
        params = {f: [self.params[i] for i in index[f]] for f in frags}
        buffers = {f: [b for b, g in zip(self.buffers, self.buffer_fragment) if g == f]
                   for f in frags}
        averaged = {f: [b.detach().clone() for b in buffers[f]] for f in frags}
        sent = {}
        for f in frags:
            if self.method == "local_sgd":
                sent[f] = [_local(p).detach().clone() for p in params[f]]
            else:
                # The pseudo-gradient: how far this group's H steps moved each parameter (as a
                # gradient: last sync - now), averaged over the groups, then applied from the
                # last sync's parameters by the outer optimizer.
                anchor = [self.anchor[i] for i in index[f]]
                pseudo = [a - _local(p) for a, p in zip(anchor, params[f])]
                sent[f] = pseudo
        if not average({f: sent[f] + averaged[f] for f in frags}):
            return False
        if self.method == "local_sgd":
            for f in frags:
                for p, avg in zip(params[f], sent[f]):
                    _local(p).copy_(avg)
        else:
            for p in self.params:  # (a fragment not synced now: no grad, no outer step)
                p.grad = None
            for f in frags:
                for i, g in zip(index[f], sent[f]):
                    _local(self.params[i]).copy_(self.anchor[i])
                    self.params[i].grad = _like(self.params[i], g)
            self.outer.step()
            self.outer.zero_grad(set_to_none=True)
        for f in frags:
            for b, avg in zip(buffers[f], averaged[f]):
                b.copy_(avg)
        self.reset_anchor(frags)
        return True

    # -- what a heal copies (the outer_optimizer piece's form: local tensors, sent as data) --

    def momentum(self) -> list[torch.Tensor]:
        if self.outer is None:
            return []
        bufs = [self.outer.state.get(p, {}).get("momentum_buffer") for p in self.params]
        if all(b is None for b in bufs):
            return []
        # (a fragment not synced yet has none: zeros, which SGD's first step treats the same)
        return [_local(b) if b is not None else torch.zeros_like(_local(p))
                for b, p in zip(bufs, self.params)]

    def state_dict(self) -> dict:
        return {"anchor": list(self.anchor), "momentum": self.momentum()}

    @torch.no_grad()
    def load_state_dict(self, sd: dict) -> None:
        anchor, momentum = sd.get("anchor"), sd.get("momentum")
        if problem := self._misfit(anchor, "anchor") or \
                (self._misfit(momentum, "momentum") if momentum else None):
            raise ConfigError(f"fault tolerance: a heal from a live peer refused: {problem}",
                              "fault_tolerance.semi_sync_method")
        for a, theirs in zip(self.anchor, anchor):
            a.copy_(theirs)
        if self.outer is not None:
            for p, theirs in zip(self.params, momentum or []):
                state = self.outer.state[p]
                if "momentum_buffer" in state and state["momentum_buffer"] is not None:
                    _local(state["momentum_buffer"]).copy_(theirs)
                else:
                    state["momentum_buffer"] = _like(p, theirs.to(_local(p).device).clone())

    def _misfit(self, tensors, what: str) -> str | None:
        if not isinstance(tensors, list) or len(tensors) != len(self.anchor):
            return (f"the peer's semi-synchronous state ({what}) has "
                    f"{len(tensors) if isinstance(tensors, list) else 'no'} tensors, this "
                    f"group {len(self.anchor)}: are both on the same semi_sync_method?")
        for i, (mine, theirs) in enumerate(zip(self.anchor, tensors)):
            if not isinstance(theirs, torch.Tensor) or theirs.shape != mine.shape \
                    or theirs.dtype != mine.dtype:
                got = (f"{list(theirs.shape)} {theirs.dtype}" if isinstance(theirs, torch.Tensor)
                       else type(theirs).__name__)
                return (f"{what} of parameter {i} is {got} in the peer's, "
                        f"{list(mine.shape)} {mine.dtype} here")
        return None


class SemiSyncGroups(ReplicaGroups):
    """Replica groups that sync every `sync_steps` steps (module doc) instead of every step."""

    def __init__(self, ftcfg, *args, **kwargs):
        super().__init__(ftcfg, *args, **kwargs)
        self.ftcfg, self.sync_steps = ftcfg, ftcfg.sync_steps
        self.state: OuterStep | None = None
        self.last_step = 0  # training.steps: the last step is a sync point too
        self.quorum_taken = False  # this launch's first step takes a quorum wherever it is
        self.bytes_sent, self.syncs = 0, 0
        self.marker = os.environ.get(RETRY_MARKER) or None
        self.pending = 0  # the step of the sync this group runs again (sent with a heal)
        self.joining = 0  # the step of a sync this group healed into (it counts for nothing)
        self.num_fragments = ftcfg.num_fragments  # (streaming DiLoCo: ft/fragments.py)
        self.uncounted: set[int] = set()  # fragments healed unsynced: nothing in their next sync
        self.save_every = 0  # checkpoint.interval (0: off): every fragment syncs at those steps

    def register_state(self, state, model: torch.nn.Module) -> None:
        """DiLoCo's outer optimizer, one piece of the training state: a checkpoint saves its
        momentum (DCP tensors, key `outer_optimizer`), a heal sends the outer step's state (the
        momentum and the parameters at the last sync, which a checkpoint taken at a sync point
        need not: they are its weights). LocalSGD has no state of its own."""
        ft = self.ftcfg
        self.state = OuterStep(model, ft.semi_sync_method, ft.outer_lr, ft.outer_momentum,
                               ft.outer_nesterov, ft.num_fragments)
        if self.state.outer is not None:
            state.add_piece(Piece("outer_optimizer", self.state.outer, OPTIMIZER, model=model,
                                  peer=self.state))

    def batch_note(self, live: int) -> str:
        """No step averages gradients here: each group's step trains on its own batch, and
        a sync averages the live groups' `sync_steps` steps of change."""
        return (f"each group trains its own {self.group_batch} sequences a step; every "
                f"{self.sync_steps} steps the {live} groups' parameter changes are averaged "
                f"({self.ftcfg.semi_sync_method})")

    def attach(self, ctx, state) -> None:
        self.last_step = ctx.cfg.training.steps
        ckpt = ctx.cfg.checkpoint
        self.save_every = ckpt.interval if ckpt.enable else 0
        self.state.reset_anchor()  # the loaded weights were saved at a sync point
        self.state.apply_settings()
        super().attach(ctx, state)
        # torchft compares the groups' count of commits (one per sync) to decide who heals.
        syncs = ctx.step // self.sync_steps
        self.manager.load_state_dict({"step": syncs, "batches_committed": syncs})
        # A heal also says whether its source waits to run a sync again (after the step's
        # update): the receiver then joins that sync instead of training the step.
        self.manager.register_state_dict_fn("torchllm_sync", self._load_pending,
                                            lambda: {"pending_sync": self.pending})

    def _load_pending(self, sd) -> None:
        pending = sd.get("pending_sync") if isinstance(sd, dict) else None
        if type(pending) is not int or pending < 0:
            raise ConfigError("fault tolerance: a heal from a live peer refused: its "
                              f"pending_sync is {pending!r}, not a step (replica groups must "
                              "run the same torchllm)", "fault_tolerance.semi_sync_method")
        self.joining = pending

    def due(self, step: int) -> list[int]:
        """The fragments that sync after `step` (every one at the last and at checkpoint steps)."""
        full = step == self.last_step or bool(self.save_every and step % self.save_every == 0)
        return due(step, self.sync_steps, self.num_fragments, full)

    def is_sync_point(self, step: int) -> bool:
        """Every fragment synced after `step`: the groups hold the same weights."""
        return len(self.due(step)) == self.num_fragments

    def begin_step(self) -> bool:
        """A quorum at the start of each interval (and of this launch) only. False: this group
        healed from one that runs the sync of the step again, after the step's update: the
        step is not trained here, the group only joins its sync (end_step)."""
        step = self.heal.train_state.step
        if not self.quorum_taken or (step - 1) % self.sync_steps == 0:
            if not self.quorum_taken and self.marker:  # (test-only: RETRY_MARKER)
                Path(self.marker).touch()
            healed_before = self.heal.healed_at
            super().begin_step()
            self.quorum_taken = True
            step = self.heal.train_state.step  # (a heal's: a relaunch's own was its launch's)
            if self.heal.healed_at != healed_before and step > 1:
                # The fragments its source had not synced at that point: the source's change
                # since their last sync came with the heal, and counts in the source's share.
                synced = self.due(step if self.joining else step - 1)
                self.uncounted = set(range(self.num_fragments)) - set(synced)
            if self.joining:
                logger.info("fault tolerance: replica group %d healed while the live groups run "
                            "the sync of step %d again: it joins the sync of step %d without a "
                            "change of its own (the mean is the live groups'), then trains on "
                            "from step %d", self.replica_id, self.joining, self.joining,
                            self.joining + 1)
                return False
        return True

    def average(self, stats: dict, model: torch.nn.Module) -> bool:
        return True  # between syncs each group trains on its own gradients (and prints its loss)

    def end_step(self) -> None:
        """After the step's update: at a sync point, the sync (again after a new quorum until
        the live groups commit it)."""
        step = self.heal.train_state.step
        fragments = self.due(step)
        if not fragments:
            return
        while not self.state.sync(lambda sent: self._average(sent, step), fragments):
            self.pending = step  # (a group that heals at the new quorum joins the sync)
            if self.marker:  # (test-only: RETRY_MARKER)
                Path(self.marker).unlink(missing_ok=True)
            logger.warning("fault tolerance: the sync at step %d not committed (a replica group "
                           "failed during it): a new quorum, then the sync again", step)
            if self.marker:
                deadline = time.monotonic() + MARKER_WAIT_S
                while not os.path.exists(self.marker) and time.monotonic() < deadline:
                    time.sleep(0.2)
            super().begin_step()
        self.pending = self.joining = 0
        self.uncounted -= set(fragments)
        self.syncs += len(fragments)
        self.committed_here += 1

    def _average(self, sent: dict, step: int) -> bool:
        """Each fragment's tensors averaged in place over the live groups (counted unless this
        group healed into the sync or since the fragment's last sync); whether they commit."""
        for fragment, tensors in sent.items():
            self._mean(tensors, step, not self.joining and fragment not in self.uncounted)
        return self.manager.should_commit()

    def _mean(self, tensors: list[torch.Tensor], step: int, counted: bool) -> None:
        """`tensors` averaged in place over the live groups (torchft's public allreduce, its op
        explicit: ft/reduce.py); `counted` False: this group's share is not counted."""
        self.bytes_sent += sum(t.numel() * t.element_size() for t in tensors)
        if counted:
            mean_over_groups(self.manager, tensors)
            return
        # Healed into this sync: its copy of a peer's change is not counted. Unless no group in
        # the quorum is counted (every one healed into it, their sources gone since): then
        # they all average their copies (each sees the same count, so all take this branch).
        copies = [t.clone() for t in tensors]
        for t in tensors:
            t.zero_()
        if not mean_over_groups(self.manager, tensors, weight=0.0):
            logger.warning("fault tolerance: no live replica group trained the interval of the "
                           "sync at step %d (the groups it healed from are gone): the sync "
                           "averages the copies of their changes", step)
            for t, mine in zip(tensors, copies):
                t.copy_(mine)
            self.bytes_sent += sum(t.numel() * t.element_size() for t in tensors)
            mean_over_groups(self.manager, tensors)

    def gate(self, checkpointer):
        return SyncPointCheckpointer(checkpointer, self)

    def close(self) -> None:
        fragments = f", {self.num_fragments} fragments" if self.num_fragments > 1 else ""
        logger.info("fault tolerance: %d syncs (%s, every %d steps%s), %d bytes sent to the "
                    "other replica groups' all-reduce", self.syncs, self.ftcfg.semi_sync_method,
                    self.sync_steps, fragments, self.bytes_sent)
        super().close()


class SyncPointCheckpointer(GroupCheckpointer):
    """Saves at sync points only: between syncs each group's weights are its own. A save asked
    for between them (a stop signal, the time limit) is skipped with a warning, unless it is
    one the loss guard marked unhealthy (kept for inspection, never resumed from)."""

    def save(self, step: int, last: bool = False, model_only: bool = False,
             unhealthy: str | None = None) -> None:
        if self.replicas.is_sync_point(step) or unhealthy is not None or model_only:
            super().save(step, last=last, model_only=model_only, unhealthy=unhealthy)
            return
        logger.warning("fault tolerance: step %d not saved: it is between syncs (every "
                       "fault_tolerance.sync_steps = %d steps), when the groups' weights differ; "
                       "a relaunch resumes from the last sync point's checkpoint or heals from a "
                       "live group", step, self.replicas.sync_steps)
