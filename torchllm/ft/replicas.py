"""The training loop's view of fault tolerance: one small object with four calls.

    replicas.begin_step()          this step's quorum: which replica groups train it (a group
                                   that is behind heals from a live peer here, before its batch;
                                   a peer of another run or config is refused first, identity.py);
                                   False: this group healed after the step's update (into a
                                   semi-synchronous sync the live groups run again): the trainer
                                   does not train the step, only ends it (end_step: its sync)
    replicas.average(stats, model) gradients (and the buffers an update rule writes: MoE
                                   routing loads and biases) averaged over the live groups, the
                                   loss statistics summed, then the groups agree to commit;
                                   False: a group died during the step, which then runs again
                                   on the next batches
    replicas.gate(checkpointer)    only the lowest live group saves (every group saves the last)
    replicas.data_shard(r, n)      the part of the data this group's rank reads

`SingleGroup` (fault tolerance off) does nothing; `ReplicaGroups` drives torchft's Manager
through its public calls only (ft/reduce.py).
Inside a group the usual parallelisms (DDP, FSDP2, TP, CP) work as always: torchft owns the
dimension across groups (FSDP2 inside + torchft across = HSDP).
"""

from __future__ import annotations

import logging
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from torchllm.config.job_config import ConfigError
from torchllm.ft.heal import HealState
from torchllm.ft.identity import checked_group, group_record
from torchllm.ft.lighthouse import import_torchft
from torchllm.ft.overlap import OverlappedMean
from torchllm.ft.reduce import (max_over_groups, mean_over_groups, reset_step_loads, step_buffers,
                                sum_over_groups, warn_untested_torchft)
from torchllm.ft.secret import load_secret
from torchllm.ft.transport import DropRefusalTraces, data_transport
from torchllm.log import logger

STARTUP_WAIT_S = 60.0  # a group finding fewer than min_replica_size live groups at launch waits


class ReplicasBelowMinimum(Exception):
    """Fewer live replica groups than fault_tolerance.min_replica_size: stop cleanly (exit 0)."""


class SingleGroup:
    """Fault tolerance off: the run is one group; every call is a no-op."""

    group_size = 1

    def data_shard(self, dp_rank: int, dp_degree: int) -> tuple[int, int]:
        return dp_rank, dp_degree

    def attach(self, ctx, state) -> None:
        pass

    def begin_step(self) -> bool:
        return True  # (whether this group trains the step: module doc)

    def average(self, stats: dict, model: torch.nn.Module) -> bool:
        return True

    def end_step(self) -> None:
        pass  # semi-synchronous groups sync here (semi_sync.py)

    def register_state(self, state, model: torch.nn.Module) -> None:
        pass  # pieces of the training state of its own (semi_sync.py: the outer optimizer)

    def gate(self, checkpointer):
        return checkpointer

    def close(self) -> None:
        pass


class ReplicaGroups(SingleGroup):
    """One replica group of `group_size`, kept in step with the live others by torchft."""

    # The gradient mean inside FSDP2's / DDP's reduction (ft/overlap.py; attach installs it).
    overlap_wanted = False
    overlap: OverlappedMean | None = None

    def __init__(self, ftcfg, group_rank: int, group_world: int, group_batch: int,
                 run: str, lighthouse: str, timeout_s: float = 60.0):
        torchft = import_torchft()
        warn_untested_torchft()  # one line: another version's behaviour may differ
        self.run = run  # the run's name: only groups of this run (and config) are peers
        self.replica_id, self.group_size = ftcfg.replica_id, ftcfg.group_size
        self.min_replica_size = ftcfg.min_replica_size
        self.group_rank, self.group_world, self.group_batch = group_rank, group_world, group_batch
        # (every step's gradients only: not semi-synchronous groups')
        self.overlap_wanted = ftcfg.overlap and ftcfg.semi_sync_method == "none"
        for name in ("torchft", "torchft_quorums", "torchft_commits"):  # a line per step else
            logging.getLogger(name).setLevel(logging.WARNING)
        if group_world > 1:  # torchrun's store (MASTER_ADDR/PORT) holds the manager's address
            store_addr, store_port, self.store = None, None, None
        else:  # one process: a store of its own, on loopback
            self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
            store_addr, store_port = "127.0.0.1", self.store.port
        timeout = timedelta(seconds=timeout_s)
        # Each new quorum's groups exchange identity records first (identity.py), over
        # fault_tolerance.process_group (gloo, or NCCL on CUDA).
        self.pg = checked_group(ftcfg.process_group, timeout)
        self.pg.lighthouse = lighthouse
        # A heal travels as data, to and from groups with the run's secret only (transport.py).
        self.transport = data_transport(ftcfg.bind, load_secret(ftcfg, os.environ), timeout)
        logging.getLogger("torchft.manager").addFilter(DropRefusalTraces())
        self.manager = torchft.Manager(
            pg=self.pg, load_state_dict=None, state_dict=None,
            min_replica_size=self.min_replica_size,
            # The quorum is settled before the step's batch is drawn: a group that heals
            # then trains the step with the healed weights and data position.
            use_async_quorum=False,
            # Every group builds the same initial weights (job.seed); a group behind (a
            # relaunch, a resume from an older checkpoint) heals from the most advanced one.
            init_sync=False,
            timeout=timeout, quorum_timeout=timeout, connect_timeout=timeout,
            rank=group_rank, world_size=group_world, store_addr=store_addr,
            store_port=store_port, lighthouse_addr=lighthouse,
            replica_id=f"torchllm_replica_{self.replica_id}",
            max_retries=20,  # consecutive steps that could not commit: then the run fails
            checkpoint_transport=self.transport,
        )
        self.heal: HealState | None = None
        self.members: list[int] = []
        self.quorums = 0  # the process group's quorums seen (a new one: a console line)
        self.committed_here = 0  # steps committed by this launch

    def data_shard(self, dp_rank: int, dp_degree: int) -> tuple[int, int]:
        """Group r's rank i reads part r x dp_degree + i of group_size x dp_degree parts."""
        return self.replica_id * dp_degree + dp_rank, self.group_size * dp_degree

    def attach(self, ctx, state) -> None:
        """After the loop loaded its checkpoint: what a peer heals from (`state`: the run's one
        training state, checkpoint/training_state.py, the list its checkpoints save), and the
        step the lighthouse compares (a group behind the most advanced one heals). `ctx`: the
        run's TrainContext (torchllm.callbacks); its restart_batches gives the loop a new
        iterator at the loader's just restored position."""
        self.heal = HealState(state, ctx.restart_batches)
        self.pg.record = group_record(ctx, self.run)  # what this group's peers must agree on
        self.manager.register_state_dict_fn("torchllm", self.heal.load_state_dict,
                                            self.heal.state_dict)
        self.manager.load_state_dict({"step": ctx.step, "batches_committed": ctx.step})
        if self.overlap_wanted:
            self.overlap = OverlappedMean(self.manager)
            kind = self.overlap.install(ctx.module.model, ctx.parallel_dims,
                                        ctx.cfg.parallelism.ddp_comm_hook)
            if kind:
                logger.info("fault tolerance: gradients averaged across replica groups inside "
                            "%s's reduction (overlapped with backward)", kind)

    def begin_step(self) -> bool:
        deadline = time.monotonic() + STARTUP_WAIT_S
        while True:
            healed_before = self.heal.healed_at
            self.manager.start_quorum()  # blocks for the quorum; heals this group if behind
            if self.pg.refusal:  # a peer of another run or config: no heal, no step (exit 2)
                raise ConfigError(self.pg.refusal, "fault_tolerance.enable")
            if self.transport.refusal:  # a heal without the run's secret: nothing loaded
                raise ConfigError(self.transport.refusal, "fault_tolerance.secret_env")
            self._note_quorum(healed_before)
            live = self.manager.num_participants()
            if live >= self.min_replica_size:
                if self.overlap is not None:  # this step's backward crosses groups
                    self.overlap.active = True
                return True
            if self.committed_here or time.monotonic() > deadline:
                why = (f"{live} live replica group(s) ({', '.join(map(str, self.members))}), "
                       f"fewer than fault_tolerance.min_replica_size = {self.min_replica_size}")
                logger.warning("stopping after step %d: %s (the lowest live group saves it)",
                               self.heal.train_state.step - 1, why)
                raise ReplicasBelowMinimum(why)
            time.sleep(1.0)  # at launch: the other groups may still be starting

    def _note_quorum(self, healed_before) -> None:
        """One console line per quorum change: who left or joined, how many remain, the batch."""
        if self.heal.healed_at != healed_before:
            logger.info("fault tolerance: replica group %d healed from a live peer: continues at "
                        "step %d with its weights, optimizer, LR schedule and data position",
                        self.replica_id, self.heal.healed_at)
        if self.pg.quorums == self.quorums:  # torchft configures its group on a new quorum
            return
        self.quorums = self.pg.quorums
        order = list(self.pg.members)  # replica ids in quorum rank order (identity records)
        members = sorted(set(order) - {None})
        left = sorted(set(self.members) - set(members))
        joined = sorted(set(members) - set(self.members)) if self.members else []
        # A group relaunched before the others noticed it was gone keeps its place: it shows
        # as the group that healed from this one (the transport names its quorum rank).
        healed = sorted({order[r] for r in self.transport.sent_to if r < len(order)}
                        - set(joined) - {None})
        self.transport.sent_to = []
        change = "; ".join([*(f"replica group {r} left" for r in left),
                            *(f"replica group {r} joined" for r in joined),
                            *(f"replica group {r} rejoined (relaunched)" for r in healed)])
        if not change:
            change = "new quorum" if self.members else "quorum"
        self.members = members
        logger.info("fault tolerance: %s: %d of %d replica groups live (%s); %s", change,
                    len(members), self.group_size, ", ".join(map(str, members)),
                    self.batch_note(len(members)))

    def batch_note(self, live: int) -> str:
        """What one step trains on, said at each quorum: the live groups' batches together
        (every step's gradients are averaged over them)."""
        return (f"effective global batch {live * self.group_batch} sequences "
                f"({live} x {self.group_batch})")

    def average(self, stats: dict, model: torch.nn.Module) -> bool:
        """Average the gradients over the live groups (and sum the loss statistics), then ask
        the groups to commit this step; False: a group failed during it (run it again)."""
        # (torchft's public allreduce, its op explicit: ft/reduce.py), with the buffers that
        # change outside the gradients (the MoE routing loads and biases)
        if self.overlap is not None:  # the hooks averaged theirs during backward (overlap.py)
            self.overlap.active = False
            grads = self.overlap.after_backward(model)
        else:
            grads = [p.grad for p in model.parameters() if p.grad is not None]
        mean_over_groups(self.manager, grads + step_buffers(model))
        # The loss over every live group's tokens: sums of (loss x tokens), tokens, processed.
        sums = torch.stack([stats["loss"] * stats["trained_tokens"], stats["trained_tokens"],
                            stats["tokens"]]).double()
        sum_over_groups(self.manager, [sums])
        if "loss_max" in stats:
            worst = stats["loss_max"].double().reshape(1)
            stats["loss_max"] = max_over_groups(self.manager, worst)[0]
        stats.update(loss=sums[0] / sums[1], trained_tokens=sums[1], tokens=sums[2])
        if self.manager.should_commit():
            self.committed_here += 1
            return True
        reset_step_loads(model)  # the step runs again on new batches: their loads only
        logger.warning("fault tolerance: step %d not committed (a replica group failed during "
                       "it): running it again", self.heal.train_state.step)
        return False

    def saves(self, last: bool) -> bool:
        """The lowest live group saves; at the last step every group does (each group's run
        folder then ends with the final model)."""
        return last or self.manager.participating_rank() == 0

    def gate(self, checkpointer):
        return GroupCheckpointer(checkpointer, self)

    def close(self) -> None:
        self.manager.shutdown(wait=False)


class GroupCheckpointer:
    """A Checkpointer whose saves happen only in the group that saves (ReplicaGroups.saves)."""

    def __init__(self, inner, replicas: ReplicaGroups):
        self.inner, self.replicas = inner, replicas

    def save(self, step: int, last: bool = False, model_only: bool = False,
             unhealthy: str | None = None) -> None:
        if self.replicas.saves(last):
            self.inner.save(step, last=last, model_only=model_only, unhealthy=unhealthy)

    def close(self) -> None:
        """The trainer's last call on its checkpointer: finish the save, then leave the groups
        (torchft's Manager and its servers shut down)."""
        try:
            self.inner.close()
        finally:
            self.replicas.close()

    def __getattr__(self, name):
        return getattr(self.inner, name)
