"""The train module: what one optimizer step does to the model, apart from the loop around it.

It owns the model (or this rank's pipeline stages), the optimizer, the LR schedule, the parallel
plan acting at run time (context parallelism, the speed levers) and the loss, including a
family's own loss terms (MoE: load balancing, models.moe.family_loss). The loop
(torchllm.train.Trainer) owns the data, the cadence, the callbacks and checkpointing, and calls:

    module.train_batch(micro_batches)   forward + backward of one global batch -> (loss sum, tokens)
    module.clip_grads()                 the gradient norm, clipped to training.max_norm
    module.optim_step()                 the update (the loop's guard decides whether it runs)
    module.lr_step(); module.zero_grad()
    module.pieces()                     model, optimizer and LR schedule: the first pieces of the
                                        run's one training state (checkpoint/training_state.py),
                                        which the loop's checkpoints save and a heal copies
    module.state_dict() / load_state_dict()   those pieces under the keys a checkpoint step
                                        holds them (checkpoint.state's wrappers)
"""

from __future__ import annotations

import contextlib

import torch

from torchllm.checkpoint.training_state import MODEL, OPTIMIZER, Piece, TrainingState
from torchllm.loss import IGNORE_INDEX
from torchllm.models.moe import family_loss
from torchllm.optim import build_lr_scheduler, build_optimizer
from torchllm.parallel import (
    ContextParallel,
    ParallelPlan,
    clip_grad_norm_,
    dp_sum,
    gradient_sync,
    register_float8_scale_precompute,
)
from torchllm.parallel.levers import StepLevers


class TrainModule:
    def __init__(self, model, pipeline, loss_fn, plan: ParallelPlan, parallel_dims,
                 device: torch.device, bf16: bool, lr_scale, *, tcfg, mcfg, ocfg, lrcfg):
        """The loop builds what it hands over (torchllm.train): `model` and `pipeline`
        (parallel.build_model: this rank's model, parallelized by `plan` and materialized, and
        under PP its stages' schedule, else None), `loss_fn` (parallel.build_loss_fn).
        `lr_scale`: the batch-size ramp's LR factor by step (optim.batch_ramp). Sections:
        [training] `tcfg`, [model] `mcfg` (the SDPA kernels, the family's loss terms),
        [optimizer] `ocfg`, [lr_scheduler] `lrcfg`; [parallelism], [compile] and [float8] are
        the plan's."""
        self.tcfg, self.plan = tcfg, plan
        self.parallel_dims, self.device, self.bf16 = parallel_dims, device, bf16
        self.dp_degree = parallel_dims.dp_degree
        self.cp = ContextParallel.from_dims(parallel_dims)  # splits sequences (cp > 1)
        self.loss_fn = loss_fn
        # Model: built on meta, parallelized, materialized with a single process's initial
        # weights; under pipeline parallelism, this rank's stages (and their schedule).
        self.model, self.pipeline = model, pipeline
        self.model.train()
        # Speed levers acting at run time: bf16 weights cast once per step, the SDPA kernels,
        # CUDA-graph step boundaries (torchllm.parallel.levers).
        self.levers = StepLevers(self.model, bf16, device.type,
                                 cast_weights_once=tcfg.cast_weights_once,
                                 sdpa_backend=mcfg.sdpa_backend,
                                 cudagraphs=plan.compile.cudagraphs)
        # The family's loss path: the token loss plus its own terms (MoE: auxiliary losses).
        self.family_loss = family_loss(self.model, mcfg)
        self.optimizer = build_optimizer(self.model, ocfg, device)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, lrcfg, tcfg.steps, lr_scale)
        register_float8_scale_precompute(self.optimizer, self.model, plan.float8,
                                         parallel_dims.fsdp_enabled)

    def precision_name(self) -> str:
        fsdp = self.parallel_dims.fsdp_enabled
        return "fp32" if not self.bf16 else "bf16 FSDP2 params" if fsdp else "bf16 autocast"

    def autocast(self):
        # Under FSDP2, MixedPrecisionPolicy(param_dtype=bf16) already runs the matmuls in bf16
        # (and keeps fp32 master weights), so autocast would only add casts.
        if not self.bf16 or self.parallel_dims.fsdp_enabled:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=torch.bfloat16)

    def train_batch(self, micro_batches) -> tuple[torch.Tensor, torch.Tensor]:
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
            with gradient_sync(self.model, i == len(batches) - 1, self.plan.parallelism):
                loss = self.micro_loss(inputs, targets, layout)
                total = self.family_loss(loss, targets)  # + the family's terms (MoE)
                # Data-parallel gradient averaging divides by dp_degree; undo it so the
                # gradient is exactly that of the global mean.
                # (FSDP2 also averages over the cp ranks, each holding part of the tokens.)
                (total * (self.dp_degree * self.cp.degree / global_tokens)).backward()
            loss_sum += loss.detach()
            del loss, total
        return self.cp.reduce_loss(loss_sum), n_tokens

    def micro_loss(self, inputs, targets, layout) -> torch.Tensor:
        """The summed float32 token loss of one micro-batch."""
        if self.tcfg.chunked_loss:  # the model returns the summed loss
            with self.autocast():
                return self.model(inputs, targets=targets, layout=layout,
                                  loss_chunk_tokens=self.tcfg.loss_chunk_tokens,
                                  loss_impl=self.tcfg.chunked_loss_impl)
        with self.autocast():
            logits = self.model(inputs, layout=layout)
        return self.loss_fn(logits, targets)  # float32, outside autocast

    def clip_grads(self) -> torch.Tensor:
        """The gradients' total norm (a device tensor), clipped to training.max_norm."""
        return clip_grad_norm_(self.model.parameters(), self.tcfg.max_norm,  # DTensor-aware
                               pp_group=self.parallel_dims.pp_group)

    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def optim_step(self) -> None:
        self.optimizer.step()

    def lr_step(self) -> None:
        self.lr_scheduler.step()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def pieces(self) -> list[Piece]:
        """The module's part of the run's training state: model, optimizer, LR schedule."""
        return [Piece("model", self.model, MODEL),
                Piece("optimizer", self.optimizer, OPTIMIZER, model=self.model),
                Piece("lr_scheduler", self.lr_scheduler)]

    def _states(self) -> dict:
        return TrainingState(self.pieces()).saved_states()

    def state_dict(self) -> dict:
        """The training state under a checkpoint step's keys: model, optimizer, lr_scheduler."""
        return {key: state.state_dict() for key, state in self._states().items()}

    def load_state_dict(self, sd: dict) -> None:
        for key, state in self._states().items():
            state.load_state_dict(sd[key])
