"""The trainer: read it top to bottom, like nanoGPT's train.py.

    ./run_train.sh [--section.key=value ...]          (torchrun -> python -m torchllm.train)
    python -m torchllm.train --help                   (every config key, by section)
"""

from __future__ import annotations

import contextlib
import gc
import sys
import time

import torch

from torchllm import models
from torchllm.callbacks import StepReport, build_callbacks
from torchllm.checkpoint import Checkpointer, TrainState
from torchllm.config import JobConfig, to_toml
from torchllm.config.job_config import reads_conversations
from torchllm.data import build_data
from torchllm.data.fingerprint import data_fingerprint
from torchllm.data.packing.chat import processed_tokens
from torchllm.data.seq_len_schedule import SeqLenSchedule
from torchllm.device import (
    configure_device, determinism_settings, restore_determinism, seed_everything,
)
from torchllm.eval.downstream import DownstreamEval
from torchllm.eval.in_training import Evaluator, validation_loader
from torchllm.ft import ReplicasBelowMinimum, build_replicas
from torchllm.hf.load import load_initial_weights
from torchllm.log import logger
from torchllm.loss import IGNORE_INDEX
from torchllm.metrics import LossGuard, MetricsLogger, Profiler
from torchllm.metrics.flops import Peak, flops_per_token, parameter_counts
from torchllm.metrics.header import data_warnings, trainer_header
from torchllm.metrics.mixture_log import MixtureLog
from torchllm.metrics.moe_stats import MoEBiasBalancer, MoEStats
from torchllm.metrics.reduce import to_host
from torchllm.models.lora import added_tokens
from torchllm.models.moe import auxiliary_loss, moe_layers
from torchllm.optim import build_lr_scheduler, build_optimizer
from torchllm.optim.batch_ramp import BatchSizeRamp, global_batch_size
from torchllm.parallel import (
    ContextParallel,
    build_loss_fn,
    build_model,
    clip_grad_norm_,
    dp_sum,
    gradient_sync,
    register_float8_scale_precompute,
    set_comm_timeout,
)
from torchllm.parallel.levers import StepLevers
from torchllm.report.hook import RunReport
from torchllm.run import process
from torchllm.run.process_exit import exit_process
from torchllm.run.resolve import Run, resolve_run
from torchllm.run.rundir import run_name, write_run_config
from torchllm.run.stopping import StopConditions


# Optional behaviour, attached to the loop through torchllm.callbacks (each class decides from
# the config whether it is on). Their events run in this order.
# RunReport (last): tokens seen for the plots, the end-of-run block and RUN/report/report.md.
CALLBACKS = (Profiler, Evaluator, DownstreamEval, MixtureLog, MoEStats, MoEBiasBalancer,
             RunReport)


class Trainer:
    def __init__(self, cfg: JobConfig, run: Run | None = None):
        """`run`: the run resolved from `cfg` (torchllm.run.resolve.resolve_run; resolved here
        when not given). The Trainer owns its folder's lock from then on."""
        # Process-wide state a Trainer changes is given back by close(), or here if building
        # fails (a notebook's or a test's next Trainer must not inherit a half-built one's).
        self.determinism = determinism_settings()
        self.run_lock = None
        try:
            self._build(run if run is not None else resolve_run(cfg))
        except BaseException:
            if self.run_lock is not None:
                self.run_lock.release()
            restore_determinism(self.determinism)
            raise

    def _build(self, run: Run) -> None:
        # The run as torchllm.run.resolve decided it: config (a stage's tokenizer concrete),
        # device, process layout, folder (locked), precision and tokenizer.
        self.run_lock = run.lock
        self.cfg = cfg = run.cfg
        tcfg = cfg.training
        self.device, self.parallel_dims, self.run_dir = run.device, run.parallel_dims, run.folder
        self.bf16, self.precision, self.tokenizer = run.bf16, run.precision, run.tokenizer
        self.dp_degree = self.parallel_dims.dp_degree
        self.dp_rank = self.parallel_dims.dp_rank
        self.cp = ContextParallel.from_dims(self.parallel_dims)  # splits sequences (cp > 1)

        # Global batch = local batch x dp degree x accumulation steps.
        per_pass = tcfg.local_batch_size * self.dp_degree
        self.global_batch = global_batch = global_batch_size(tcfg, self.dp_degree)
        self.grad_accum_steps = global_batch // per_pass
        # Recipes: micro-steps per step (batch-size ramp) and sequence length per step.
        self.batch_ramp = BatchSizeRamp(tcfg, per_pass, global_batch)
        self.seq_len_schedule = SeqLenSchedule(tcfg.seq_len_schedule, tcfg.seq_len, tcfg.steps)

        seed_everything(cfg.job.seed, cfg.job.deterministic)
        configure_device(self.device, tcfg)  # CUDA: this rank's GPU, TF32; CPU: memory reuse
        # Fault tolerance (torchllm/ft; no-op when off): replica groups, each its part of the data.
        self.replicas = build_replicas(cfg, self.parallel_dims, global_batch)
        self.train_loader, self.val_loader = build_data(
            cfg, self.tokenizer, *self.replicas.data_shard(self.dp_rank, self.dp_degree))
        self.chat_data = reads_conversations(cfg.data)  # packed conversations: padding

        spec = models.get(cfg.model.name)
        self.model_args = models.model_args(cfg, self.tokenizer.vocab_size)
        self.start_time = time.perf_counter()
        self.loss_fn = build_loss_fn(cfg.compile)
        # Model: built on meta, parallelized, materialized with a single process's initial
        # weights; under pipeline parallelism, this rank's stages (and their schedule).
        self.model, self.pipeline = build_model(spec, self.model_args, self.parallel_dims,
                                                cfg, self.device, self.loss_fn,
                                                added_tokens(self.tokenizer))
        self.model.train()
        # Speed levers acting at run time: bf16 weights cast once per step, the SDPA kernels,
        # CUDA-graph step boundaries (torchllm.parallel.levers).
        self.levers = StepLevers(cfg, self.model, self.bf16, self.device.type)
        self.moe_layers = moe_layers(self.model)  # [] unless the model has MoE blocks

        self.optimizer = build_optimizer(self.model, cfg.optimizer, self.device)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, cfg.lr_scheduler, tcfg.steps,
                                               self.batch_ramp.lr_scale)
        register_float8_scale_precompute(self.optimizer, self.model, cfg.float8,
                                         self.parallel_dims.fsdp_enabled)

        counts = parameter_counts(self.model)
        # MFU counts the whole model's FLOPs over all ranks (under PP: not one rank's stages).
        self.flops_per_token = flops_per_token(
            self.pipeline.whole if self.pipeline else self.model, tcfg.seq_len)
        self.peak = Peak(self.device, self.bf16, tcfg.tf32)  # MFU's denominator
        # The validation set(s) as a validation will score them: the header names them.
        self.val_batches = validation_loader(
            cfg, self.tokenizer, self.val_loader, self.dp_rank, self.dp_degree,
            global_batch)[0] if cfg.validation.enable else None
        self.header = trainer_header(self, counts)  # config changes, model, layout, data
        logger.info(self.header)
        if self.dp_rank == 0:  # a source read hundreds of times, a validation split of nothing
            for warning in data_warnings(cfg, self.train_loader.dataset, self.val_loader.dataset,
                                         global_batch, tcfg.steps):
                logger.warning("data: %s", warning)
        # Everything a resumed run needs lives in the checkpoint: weights, optimizer, schedule,
        # data position, counters and RNG states.
        self.train_state = TrainState()
        # A guard that stops the run saves first (when checkpointing is on) for inspection.
        self.guard = LossGuard(cfg.metrics, save_checkpoint=self.save_dropped_step)
        # Profiler, validation, samples, HellaSwag, ...: each on its own schedule.
        self.callbacks = build_callbacks(CALLBACKS, self)
        stateful = {cb.checkpoint_key: cb for cb in self.callbacks if cb.checkpoint_key}
        tokenizer = run.tokenizer_record
        # What each checkpoint records and replica groups compare (torchllm/ft/identity.py); the
        # data fingerprint says what the data position means (a resume compares it).
        self.run_info = {"config_toml": to_toml(cfg), "global_batch_size": global_batch,
                         "precision": self.precision, "tokenizer": tokenizer,
                         "data": data_fingerprint(cfg, tokenizer["base_sha256"])}
        self.checkpointer = self.replicas.gate(Checkpointer(  # FT: the lowest live group saves
            cfg.checkpoint, self.run_dir, self.model, self.optimizer, self.lr_scheduler,
            dataloader=self.train_loader, train_state=self.train_state, dp_rank=self.dp_rank,
            others={"loss_guard": self.guard, **stateful, **self.replicas.saved_states(self.model)},
            device=self.device, run_info=self.run_info, load_hf=load_initial_weights,
            fresh=cfg.job.overwrite))
        if cfg.checkpoint.enable or cfg.checkpoint.initial_load_path:
            self.checkpointer.load()
        # Only now: a launch that cannot resume leaves the run's config.toml as it was.
        write_run_config(cfg, self.run_dir)
        # After loading: a resumed run continues its TensorBoard curves from its step.
        self.metrics = MetricsLogger(
            cfg, self.model, self.optimizer, self.device, self.run_name(cfg), self.run_dir,
            self.flops_per_token, self.peak, self.guard, group=self.parallel_dims.dp_group,
            start_step=self.step,
        )
        # Created after loading: the iterator starts where the restored loader state points.
        self.batches = iter(self.train_loader)
        self.replicas.attach(self, {"loss_guard": self.guard, **stateful})  # what a peer heals
        # Signals, step budget, time limit: when this launch stops early (ranks agree).
        self.stops = StopConditions(tcfg, self.device, self.start_time)
        self.comm_timeout_set = False  # comm.init_timeout_seconds until the first step ends

    def close(self) -> None:
        """Finish pending saves, close the writers, free the run folder for the next launch.
        train() calls it; code that drives train_step() itself (tests, benchmarks) should too."""
        self.metrics.close()
        self.checkpointer.close()
        self.train_loader.close(self.batches)
        if self.run_lock is not None:
            self.run_lock.release()
        restore_determinism(self.determinism)

    def callback(self, cls):
        """The attached callback of class `cls` (e.g. trainer.callback(Evaluator)), or None."""
        return next((cb for cb in self.callbacks if isinstance(cb, cls)), None)

    @property
    def evaluator(self) -> Evaluator | None:
        return self.callback(Evaluator)

    @property
    def profiler(self) -> Profiler | None:
        return self.callback(Profiler)

    @property
    def peak_flops(self) -> float | None:
        """The matmul peak (FLOP/s) MFU is measured against, in the dtype training runs in."""
        return self.peak.flops

    @property
    def step(self) -> int:
        return self.train_state.step

    run_name = staticmethod(run_name)

    def precision_name(self) -> str:
        fsdp = self.parallel_dims.fsdp_enabled
        return "fp32" if not self.bf16 else "bf16 FSDP2 params" if fsdp else "bf16 autocast"

    def autocast(self):
        # Under FSDP2, MixedPrecisionPolicy(param_dtype=bf16) already runs the matmuls in bf16
        # (and keeps fp32 master weights), so autocast would only add casts.
        if not self.bf16 or self.parallel_dims.fsdp_enabled:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=torch.bfloat16)

    def forward_backward(self, micro_batches) -> tuple[torch.Tensor, torch.Tensor]:
        """Accumulate the gradient of the global batch's mean token loss; returns (sum, tokens),
        both device tensors: nothing here waits for the device."""
        # Normalize by the token count of the whole global batch, so that the step's loss is
        # the mean over all its tokens however it is split into micro-batches. The count stays
        # on the device (its all-reduce queues behind nothing the host must wait for).
        batches = [{k: v.to(self.device, non_blocking=True) for k, v in b.items()
                    if k in ("inputs", "targets", "positions")} for b in micro_batches]
        n_tokens = sum((b["targets"] != IGNORE_INDEX).sum() for b in batches)
        global_tokens = dp_sum(n_tokens, self.parallel_dims)
        if self.pipeline is not None:  # the schedule runs every micro-batch through the stages
            return self.pipeline.forward_backward(batches, self.dp_degree / global_tokens,
                                                  self.autocast), n_tokens
        loss_sum = torch.zeros((), device=self.device)
        for i, batch in enumerate(batches):
            # Where tokens sit in their documents (block_causal masks, per-document positions);
            # under context parallelism, this rank's share of the tokens.
            inputs, targets, layout = self.cp.shard(batch["inputs"], batch["targets"],
                                                    batch.get("positions"))
            self.levers.micro_step()
            # DDP reduces gradients on the last micro-step only; FSDP2 every one (gradient_sync)
            with gradient_sync(self.model, i == len(batches) - 1, self.cfg.parallelism):
                if self.cfg.training.chunked_loss:  # the model returns the summed loss
                    with self.autocast():
                        loss = self.model(inputs, targets=targets, layout=layout,
                                          loss_chunk_tokens=self.cfg.training.loss_chunk_tokens,
                                          loss_impl=self.cfg.training.chunked_loss_impl)
                else:
                    with self.autocast():
                        logits = self.model(inputs, layout=layout)
                    loss = self.loss_fn(logits, targets)  # float32, outside autocast
                    del logits
                # MoE load balancing: the layers' auxiliary losses, weighted by this micro-batch's
                # tokens so that the step optimizes their token-weighted mean (None: no MoE).
                aux = auxiliary_loss(self.moe_layers, self.cfg.model.moe_aux_loss_coef,
                                     self.cfg.model.moe_z_loss_coef)
                total = loss if aux is None else loss + aux * (targets != IGNORE_INDEX).sum()
                # Data-parallel gradient averaging divides by dp_degree; undo it so the
                # gradient is exactly that of the global mean.
                # (FSDP2 also averages over the cp ranks, each holding part of the tokens.)
                (total * (self.dp_degree * self.cp.degree / global_tokens)).backward()
            loss_sum += loss.detach()
            del loss, total
        return self.cp.reduce_loss(loss_sum), n_tokens

    def train_step(self) -> dict[str, float]:
        """One optimizer step over grad_accum_steps micro-batches; returns its metrics.

        The host waits for the device once per step (logging steps aside): after backward and
        clipping, for the loss, token count and grad norm together, which the guard needs
        before it lets the update through.
        """
        self.replicas.begin_step()  # the live replica groups of this step (fault tolerance)
        t0 = time.perf_counter()
        micro_batches = [self.seq_len_schedule.cut(next(self.batches), self.step)
                         for _ in range(self.batch_ramp.accum_steps(self.step))]
        data_time = time.perf_counter() - t0
        processed = sum(processed_tokens(b, self.chat_data) for b in micro_batches)  # host-side
        with self.levers.step():
            loss_sum, n_tokens = self.forward_backward(micro_batches)
        # reduced over dp ranks: the loss, the trained and the processed token counts
        stats = self.metrics.loss_stats(self.step, loss_sum, n_tokens, processed)
        # FT: gradients and loss averaged over the live replica groups; a step a group died in
        if not self.replicas.average(stats, self.model):  # runs again, on the next batches
            self.optimizer.zero_grad(set_to_none=True)
            return self.train_step()
        m = self.metrics.before_clip(self.step)

        max_norm = self.cfg.training.max_norm
        stats["grad_norm"] = clip_grad_norm_(self.model.parameters(), max_norm,  # DTensor-aware
                                             pp_group=self.parallel_dims.pp_group)
        m.update(to_host(stats))  # the step's one device-to-host copy
        m.update(tokens=int(m["tokens"]), trained_tokens=int(m["trained_tokens"]),
                 lr=self.optimizer.param_groups[0]["lr"], data_time=data_time)
        self.train_state.tokens_seen += m["tokens"]  # counted even if the guard stops here
        # The guard may drop this update (the LR schedule still advances) or stop the run.
        m["skipped"] = not self.guard.check(self.step, m["loss"], m["grad_norm"])
        if not m["skipped"]:
            self.checkpointer.wait_for_staging()  # an async save must copy the weights first
            with self.metrics.around_update(self.step, m):
                self.optimizer.step()
        self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.replicas.end_step()  # FT semi-synchronous: every sync_steps, the groups sync
        if not self.comm_timeout_set:  # every rank got through a step: the shorter timeout
            set_comm_timeout(self.parallel_dims, self.cfg.comm.train_timeout_seconds)
            self.comm_timeout_set = True
        return m

    def save_dropped_step(self, step: int) -> None:
        """Save `step` as a step whose update was dropped (the guard stopping the run): the LR
        schedule advances past it, so a resume continues exactly like a skipped step."""
        self.lr_scheduler.step()
        self.checkpointer.save(step, unhealthy=self.guard.unhealthy())
        self.checkpointer.explain_resume(step)

    def train(self) -> list[float]:
        """Run up to training.steps optimizer steps; returns the loss of every step run here."""
        tcfg = self.cfg.training
        if self.cfg.checkpoint.create_seed_checkpoint:
            self.checkpointer.save(0, model_only=True)
            logger.info("seed checkpoint written; exiting")
            return []
        if self.step >= tcfg.steps > 0:
            logger.warning("run already at step %d of %d: raise training.steps to continue, or "
                           "--job.overwrite / another --job.run_name to start over", self.step,
                           tcfg.steps)
        losses: list[float] = []
        slowest_step = 0.0
        # SIGTERM (preemption) / Ctrl-C: finish the current step, save, exit 0.
        restore_signals = self.stops.install_signal_handlers()
        # Automatic GC pauses at random moments cost whole steps; collect on our schedule.
        gc.disable()
        for cb in self.callbacks:
            cb.on_train_start(self)
        try:
            while self.step < tcfg.steps:
                self.train_state.step += 1
                if self.step % tcfg.gc_freq == 0:
                    gc.collect(1)
                t0 = time.perf_counter()
                m = self.train_step()
                step_time = time.perf_counter() - t0
                slowest_step = max(slowest_step, step_time)
                losses.append(m["loss"])
                self.metrics.log(self.step, m, step_time)
                report = StepReport()
                for cb in self.callbacks:
                    report.update(cb.on_step_end(self, self.step, m))
                self.metrics.log_eval(self.step, report.scalars, report.texts)

                self.checkpointer.poll()
                # The validation target reached ends the run as its last step would.
                reached = self.stops.target_reached
                last = self.step == tcfg.steps or reached is not None
                reason = reached or (None if last else self.stops.reason(len(losses),
                                                                         slowest_step))
                if reason or self.checkpointer.should_save(self.step, last=last):
                    self.checkpointer.save(self.step, last=last, unhealthy=self.guard.unhealthy())
                if reason:
                    logger.warning("stopping at step %d: %s", self.step, reason)
                    break
        except ReplicasBelowMinimum:  # too few live replica groups: save and stop (exit 0)
            self.train_state.step -= 1  # the step that quorum was for never ran
            self.checkpointer.save(self.step, unhealthy=self.guard.unhealthy())
        except BaseException as e:
            for cb in self.callbacks:
                cb.on_exception(self, self.step, e)
            raise
        finally:
            gc.enable()
            restore_signals()
            for cb in self.callbacks:
                cb.on_train_end(self)
            self.close()
        return losses


def trainer_from_args(argv: list[str]) -> Trainer | None:
    """A Trainer from CLI overrides, or None after logging a config error (exit code 2)."""
    return process.trainer_from_args(Trainer, argv)


def main(argv: list[str] | None = None) -> int:
    """Train; returns the exit code (see torchllm.run.process.main)."""
    return process.main(Trainer, sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    exit_process(main())
