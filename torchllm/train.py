"""The loop: read it top to bottom, like nanoGPT's train.py.

The Trainer owns the data, the step's cadence, callbacks and checkpointing; what a step does to
the weights is the train module's (train_module.py). Callbacks, the run header, eval, report
and fault tolerance read the run through a TrainContext (callbacks.py), never the Trainer.

    ./run_train.sh [--section.key=value ...]          (torchrun -> python -m torchllm.train)
    python -m torchllm.train --help                   (every config key, by section)
"""

from __future__ import annotations

import dataclasses
import gc
import sys
import time

from torchllm import models
from torchllm.callbacks import StepReport, TrainContext, build_callbacks
from torchllm.checkpoint import Checkpointer, TrainState, TrainingState
from torchllm.config import JobConfig, to_toml
from torchllm.config.paths import tensorboard_folder
from torchllm.data import Batching, build_data, holds_out
from torchllm.data.fingerprint import data_fingerprint
from torchllm.data.seq_len_schedule import SeqLenSchedule
from torchllm.device import (
    configure_device, determinism_settings, restore_determinism, seed_everything,
)
from torchllm.eval.downstream import DownstreamEval
from torchllm.eval.in_training import Evaluator, validation_loader
from torchllm.ft import ReplicasBelowMinimum, build_replicas
from torchllm.hf.load import load_initial_weights
from torchllm.log import logger
from torchllm.metrics import LossGuard, MetricsLogger, Profiler
from torchllm.metrics.flops import Peak, flops_per_token, parameter_counts
from torchllm.metrics.header import context_header, data_warnings
from torchllm.metrics.mixture_log import MixtureLog
from torchllm.metrics.moe_stats import MoEBiasBalancer, MoEStats
from torchllm.metrics.reduce import to_host
from torchllm.optim.batch_ramp import BatchSizeRamp, global_batch_size
from torchllm.models.lora import added_tokens
from torchllm.parallel import ParallelPlan, build_loss_fn, build_model, set_comm_timeout
from torchllm.report.hook import RunReport
from torchllm.run import process
from torchllm.run.process_exit import exit_process
from torchllm.run.resolve import Run, resolve_run
from torchllm.config.paths import run_name
from torchllm.run.rundir import write_run_config
from torchllm.run.stopping import StopConditions
from torchllm.train_module import TrainModule


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
        dp_rank, dp_degree = self.parallel_dims.dp_rank, self.parallel_dims.dp_degree

        # Global batch = local batch x dp degree x accumulation steps.
        per_pass = tcfg.local_batch_size * dp_degree
        self.global_batch = global_batch = global_batch_size(tcfg, dp_degree)
        self.grad_accum_steps = global_batch // per_pass
        # Recipes: micro-steps per step (batch-size ramp) and sequence length per step.
        self.batch_ramp = BatchSizeRamp(tcfg, per_pass, global_batch)
        self.seq_len_schedule = SeqLenSchedule(tcfg.seq_len_schedule, tcfg.seq_len, tcfg.steps)

        seed_everything(cfg.job.seed, cfg.job.deterministic)
        configure_device(self.device, tcfg)  # CUDA: this rank's GPU, TF32; CPU: memory reuse
        # Fault tolerance (torchllm/ft; no-op when off): replica groups, each its part of the data.
        self.replicas = build_replicas(cfg.fault_tolerance, cfg.job, tcfg.device, global_batch)
        self.batching = Batching.of(tcfg, cfg.job, cfg.model)  # the windows data and eval cut
        self.train_loader, self.val_loader = build_data(
            cfg.data, cfg.validation, self.batching, self.tokenizer,
            *self.replicas.data_shard(dp_rank, dp_degree))

        spec = models.get(cfg.model.name)
        self.model_args = models.model_args(cfg.model, tcfg, cfg.data, self.tokenizer.vocab_size)
        self.start_time = time.perf_counter()
        # The parallel plan, the loss and the model (built on meta, parallelized, materialized;
        # under PP this rank's stages), handed to the train module with its sections: model,
        # optimizer, LR schedule, parallel plan and loss are what a step does (train_module).
        plan = ParallelPlan.of(parallelism=cfg.parallelism, float8=cfg.float8,
                               activation_checkpoint=cfg.activation_checkpoint,
                               compile=cfg.compile, training=tcfg,
                               fault_tolerance=cfg.fault_tolerance)
        loss_fn = build_loss_fn(cfg.compile)
        model, pipeline = build_model(spec, self.model_args, self.parallel_dims, plan,
                                      self.device, loss_fn, added_tokens(self.tokenizer),
                                      mcfg=cfg.model, lcfg=cfg.lora, seed=cfg.job.seed,
                                      tcfg=tcfg, ecfg=cfg.eval)
        self.module = m = TrainModule(model, pipeline, loss_fn, plan, self.parallel_dims,
                                      self.device, self.bf16, self.batch_ramp.lr_scale,
                                      tcfg=tcfg, mcfg=cfg.model, ocfg=cfg.optimizer,
                                      lrcfg=cfg.lr_scheduler)
        self.model, self.optimizer, self.lr_scheduler = m.model, m.optimizer, m.lr_scheduler

        counts = parameter_counts(self.model)
        # MFU counts the whole model's FLOPs over all ranks (under PP: not one rank's stages).
        self.flops_per_token = flops_per_token(m.pipeline.whole if m.pipeline else self.model,
                                               tcfg.seq_len)
        self.peak = Peak(self.device, self.bf16, tcfg.tf32)  # MFU's denominator
        # Everything a resumed run needs lives in the checkpoint: weights, optimizer, schedule,
        # data position, counters and RNG states.
        self.train_state = TrainState()
        # Signals, step budget, time limit: when this launch stops early (ranks agree).
        self.stops = StopConditions(tcfg, self.device, self.start_time)
        tokenizer = run.tokenizer_record
        # What each checkpoint records and replica groups compare (torchllm/ft/identity.py); the
        # data fingerprint says what the data position means (a resume compares it).
        self.run_info = {"config_toml": to_toml(cfg), "global_batch_size": global_batch,
                         "precision": self.precision, "tokenizer": tokenizer,
                         "data": data_fingerprint(cfg.data, cfg.validation, tokenizer["base_sha256"],
                                                  seq_len=tcfg.seq_len, seed=cfg.job.seed)}
        self.context = self._context(counts)
        logger.info(self.context.header)
        if dp_rank == 0:  # a source read hundreds of times, a validation split of nothing
            for warning in data_warnings(cfg.data, cfg.validation, holds_out(cfg.data, cfg.validation),
                                         self.train_loader.dataset, self.val_loader.dataset,
                                         global_batch, tcfg.steps):
                logger.warning("data: %s", warning)
        # A guard that stops the run saves first (when checkpointing is on) for inspection.
        self.guard = LossGuard(cfg.metrics, save_checkpoint=self.save_dropped_step)
        # Profiler, validation, samples, HellaSwag, ...: each on its own schedule.
        self.callbacks = build_callbacks(CALLBACKS, self.context)
        self.state = self._training_state()
        self.checkpointer = self.replicas.gate(Checkpointer(  # FT: the lowest live group saves
            cfg.checkpoint, self.run_dir, state=self.state, dp_rank=dp_rank, device=self.device,
            run_info=self.run_info, load_hf=load_initial_weights, fresh=cfg.job.overwrite))
        if cfg.checkpoint.enable or cfg.checkpoint.initial_load_path:
            self.checkpointer.load()
        # Only now: a launch that cannot resume leaves the run's config.toml as it was.
        write_run_config(to_toml(cfg), self.run_dir)
        # After loading: a resumed run continues its TensorBoard curves from its step.
        self.metrics = MetricsLogger(
            cfg.metrics, tcfg.steps, self.model, self.optimizer, self.device, run_name(cfg.job),
            self.run_dir, tensorboard_folder(cfg.job, cfg.metrics, run_name(cfg.job)),
            self.flops_per_token, self.peak, self.guard, group=self.parallel_dims.dp_group,
            start_step=self.step,
            config=dataclasses.asdict(cfg) if cfg.metrics.enable_wandb else None,  # (W&B's)
        )
        # Created after loading: the iterator starts where the restored loader state points.
        self.batches = iter(self.train_loader)
        self.replicas.attach(self.context, self.state)  # what a heal copies: the same state
        self.comm_timeout_set = False  # comm.init_timeout_seconds until the first step ends

    def _training_state(self) -> TrainingState:
        """The run's one training state (checkpoint/training_state.py): what each checkpoint
        saves and a heal copies, each piece added once, in the order a checkpoint holds them."""
        state = TrainingState(self.module.pieces())  # model, optimizer, LR schedule
        state.add("dataloader", self.train_loader)  # (its rank's part: peer_state_dict)
        state.add("train_state", self.train_state)
        state.add("loss_guard", self.guard)
        for cb in self.callbacks:
            if cb.checkpoint_key:
                state.add(cb.checkpoint_key, cb)
        self.replicas.register_state(state, self.model)  # (DiLoCo: the outer optimizer)
        state.add_rng()
        return state

    def _context(self, counts: dict[str, int]) -> TrainContext:
        """The run as callbacks, the header, eval, report and fault tolerance may read it."""
        cfg, dims = self.cfg, self.parallel_dims
        # The validation set(s) as a validation will score them: the header names them.
        val_batches = validation_loader(
            cfg.data, cfg.validation, cfg.training, self.batching, self.tokenizer, self.val_loader,
            dims.dp_rank, dims.dp_degree, self.global_batch)[0] if cfg.validation.enable else None
        ctx = TrainContext(
            cfg, self.run_dir, self.device, dims, self.tokenizer, self.model_args, self.module,
            self.train_loader, self.val_loader, val_batches, self.batch_ramp, self.global_batch,
            self.grad_accum_steps, self.train_state, self.stops, self.run_info,
            is_log_step=lambda step: self.metrics.is_log_step(step),
            checkpoints=lambda: (self.checkpointer.steps,
                                 (self.checkpointer.pending or {}).get("step")),
            callback=self.callback, restart_batches=self.restart_batches)
        # config changes, model, layout, data
        return dataclasses.replace(ctx, header=context_header(ctx, counts))

    def restart_batches(self) -> None:
        """A new iterator at the loader's position (a heal just restored it)."""
        self.train_loader.close(self.batches)
        self.batches = iter(self.train_loader)

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

    def train_step(self) -> dict[str, float] | None:
        """One optimizer step over the step's micro-batches; returns its metrics (None: a
        semi-synchronous replica group healed after the step's update, which it did not train:
        it only joined the step's sync).

        The host waits for the device once per step (logging steps aside): after backward and
        clipping, for the loss, token count and grad norm together, which the guard needs
        before it lets the update through.
        """
        if not self.replicas.begin_step():  # the live replica groups of this step (ft)
            self.replicas.end_step()  # healed into the step's sync: it only joins the sync
            return None
        t0 = time.perf_counter()
        micro_batches = [self.seq_len_schedule.cut(next(self.batches), self.step)
                         for _ in range(self.batch_ramp.accum_steps(self.step))]
        data_time = time.perf_counter() - t0
        processed = sum(int(b["processed_tokens"]) for b in micro_batches)  # the loader's count
        with self.module.levers.step():
            loss_sum, n_tokens = self.module.train_batch(micro_batches)
        # reduced over dp ranks: the loss, the trained and the processed token counts
        stats = self.metrics.loss_stats(self.step, loss_sum, n_tokens, processed)
        # FT: gradients and loss averaged over the live replica groups; a step a group died in
        if not self.replicas.average(stats, self.model):  # runs again, on the next batches
            self.module.zero_grad()
            return self.train_step()
        m = self.metrics.before_clip(self.step)
        stats["grad_norm"] = self.module.clip_grads()
        m.update(to_host(stats))  # the step's one device-to-host copy
        m.update(tokens=int(m["tokens"]), trained_tokens=int(m["trained_tokens"]),
                 lr=self.module.lr, data_time=data_time)
        self.train_state.tokens_seen += m["tokens"]  # counted even if the guard stops here
        # The guard may drop this update (the LR schedule still advances) or stop the run.
        m["skipped"] = not self.guard.check(self.step, m["loss"], m["grad_norm"])
        if not m["skipped"]:
            self.checkpointer.wait_for_staging()  # an async save must copy the weights first
            with self.metrics.around_update(self.step, m):
                self.module.optim_step()
        self.module.lr_step()
        self.module.zero_grad()
        self.replicas.end_step()  # FT semi-synchronous: every sync_steps, the groups sync
        if not self.comm_timeout_set:  # every rank got through a step: the shorter timeout
            set_comm_timeout(self.parallel_dims, self.cfg.comm.train_timeout_seconds)
            self.comm_timeout_set = True
        return m

    def save_dropped_step(self, step: int) -> None:
        """Save `step` as a step whose update was dropped (the guard stopping the run): the LR
        schedule advances past it, so a resume continues exactly like a skipped step."""
        self.module.lr_step()
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
            cb.on_train_start(self.context)
        try:
            while self.step < tcfg.steps:
                self.train_state.step += 1
                if self.step % tcfg.gc_freq == 0:
                    gc.collect(1)
                t0 = time.perf_counter()
                m = self.train_step()
                if m is not None:  # (None: a replica group that only joined the step's sync)
                    step_time = time.perf_counter() - t0
                    slowest_step = max(slowest_step, step_time)
                    losses.append(m["loss"])
                    self.metrics.log(self.step, m, step_time)
                    report = StepReport()
                    for cb in self.callbacks:
                        report.update(cb.on_step_end(self.context, self.step, m))
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
                cb.on_exception(self.context, self.step, e)
            raise
        finally:
            gc.enable()
            restore_signals()
            for cb in self.callbacks:
                cb.on_train_end(self.context)
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
