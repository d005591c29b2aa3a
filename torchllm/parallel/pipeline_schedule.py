"""The training step under pipeline parallelism: a torch.distributed.pipelining schedule runs
forward and backward of this rank's stages over the micro-batches of one local batch.

Apply order: split (pipeline.build_stage) -> per stage parallelize_model (CP -> TP ->
float8 -> AC -> compile -> FSDP2) -> materialize (pipeline.init_stage_weights) -> schedule.

Loss: the last stage computes the same float32 summed cross entropy as the non-PP step, times
dp / (tokens of the global batch), and the schedule sums it over micro-batches (scale_grads =
False): the gradient is that of the global batch's mean token loss, exactly as without PP.
The unscaled sum is reported, broadcast from the last stage over the pp group.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.distributed as dist
from torch import nn

from torchllm.log import logger
from torchllm.loss import IGNORE_INDEX
from torchllm.models import moe
from torchllm.parallel.context_parallel import ContextParallel
from torchllm.parallel.distributed import reduce_every_microstep
from torchllm.parallel.parallelize import parallelize_model
from torchllm.parallel.pipeline import (
    build_stage,
    check_pipeline,
    init_stage_weights,
    rank_model,
    rank_stages,
    schedule_class,
)
from torchllm.parallel.plan import ParallelPlan


class Pipeline:
    """This rank's stages, their schedule, and what the trainer asks of them."""

    def __init__(self, stages: list[nn.Module], stage_ids: list[int], n_stages: int,
                 schedule_name: str, n_microbatches: int, loss_fn, dims, device, model,
                 reduce_every_microstep: bool = True):
        # parallelism.fsdp_reduce_every_microstep: FSDP2 stages keep their gradients sharded
        stage_cls = sharded_grad_stage() if reduce_every_microstep else None
        if stage_cls is None:
            from torch.distributed.pipelining import PipelineStage as stage_cls

        self.stages, self.stage_ids, self.n_stages = stages, stage_ids, n_stages
        self.model, self.loss_fn, self.dims, self.device = model, loss_fn, dims, device
        self.group = dims.pp_group
        self.has_last = n_stages - 1 in stage_ids
        self.pipeline_stages = [
            stage_cls(m, i, n_stages, device, group=self.group)
            for m, i in zip(stages, stage_ids)
        ]
        self.cp = ContextParallel.from_dims(dims)  # splits sequences (cp > 1)
        self.scale = 1.0  # set per step: dp x cp degree / tokens of the global batch
        self.losses: list[torch.Tensor] = []  # unscaled loss sums of the micro-batches
        self.chunk_tokens = 0  # training.chunked_loss: tokens per chunk of the last stage's loss
        # MoE auxiliary losses (attach_moe_losses): stage -> its micro-batch's weight
        self.aux_weights: dict[int, torch.Tensor] | None = None
        cls = schedule_class(schedule_name)
        staged = self.pipeline_stages if len(stages) > 1 else self.pipeline_stages[0]
        self.n_microbatches = n_microbatches
        self.schedule = cls(staged, n_microbatches=n_microbatches, loss_fn=self._loss,
                            scale_grads=False)

    @classmethod
    def build(cls, spec, model_args, dims, plan: ParallelPlan, device, loss_fn, *, tcfg, mcfg,
              ecfg, seed: int) -> "Pipeline":
        """This rank's stages of family `spec`, each parallelized by `plan` (a ParallelPlan)
        and initialized from `seed` (job.seed), and their schedule; `tcfg`, `mcfg`, `ecfg`: the
        [training], [model] and [eval] sections (micro-batches, the chunked loss, MoE losses,
        what PP cannot run yet)."""
        pcfg = plan.parallelism
        blocks = check_pipeline(pcfg, tcfg, mcfg.name, ecfg, model_args, dims.pp)
        ids = rank_stages(pcfg.pipeline_parallel_schedule, dims.pp, dims.pp_rank)
        stages = []
        build = lambda: spec.build(model_args)  # noqa: E731
        for i in ids:
            stage = build_stage(build, spec.pipeline, blocks[i], first=i == 0,
                                last=i == len(blocks) - 1)
            parallelize_model(stage, spec, dims, plan)  # TP, float8, AC, compile, FSDP2
            init_stage_weights(stage, build, device, seed)
            stage.train()
            stages.append(stage)
        logger.info("pipeline: %s, %d stages (blocks %s), pp rank %d runs stages %s",
                    pcfg.pipeline_parallel_schedule, len(blocks),
                    [f"{b[0]}-{b[-1]}" for b in blocks], dims.pp_rank, ids)
        n_micro = tcfg.local_batch_size // pcfg.pipeline_parallel_microbatch_size
        pipeline = cls(stages, ids, len(blocks), pcfg.pipeline_parallel_schedule, n_micro,
                       loss_fn, dims, device, rank_model(stages, build, spec.pipeline),
                       reduce_every_microstep(pcfg))
        with torch.device("meta"):
            pipeline.whole = build()  # the unsplit model, for FLOP counts (never materialized)
        pipeline.attach_moe_losses(mcfg.moe_aux_loss_coef, mcfg.moe_z_loss_coef)
        pipeline.chunk_tokens = tcfg.loss_chunk_tokens if tcfg.chunked_loss else 0
        return pipeline

    def attach_moe_losses(self, aux_coef: float, z_coef: float) -> None:
        """MoE models: each stage adds its layers' auxiliary losses to the objective through its
        output (moe.AttachLoss), weighted as the trainer weights them without PP: the coefficient-
        weighted mean over all the model's MoE layers x the micro-batch's valid tokens x the
        step's scale. The weight rides with the micro-batch (`aux_weight`, per sequence)."""
        n_total = len(moe.moe_layers(self.whole))
        if not n_total or not (aux_coef or z_coef):
            return
        self.aux_weights = {}
        for stage in self.stages:
            stage.register_forward_pre_hook(self._take_aux_weight, with_kwargs=True)
            stage.register_forward_hook(functools.partial(
                self._attach_aux, layers=moe.moe_layers(stage), coefs=(aux_coef, z_coef, n_total)),
                with_kwargs=True)

    def _take_aux_weight(self, module, args, kwargs):
        self.aux_weights[id(module)] = kwargs.pop("aux_weight", None)
        return args, kwargs

    def _attach_aux(self, module, args, kwargs, output, layers, coefs):
        weight = self.aux_weights.pop(id(module), None)
        aux = moe.auxiliary_loss(layers, *coefs)  # (read and cleared in every forward)
        if aux is None or weight is None or not torch.is_grad_enabled():
            return output
        return moe.AttachLoss.apply(output, aux * weight.sum())

    def _loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        # training.chunked_loss: the last stage returned the summed loss itself (its head ran
        # chunk by chunk, never holding the logits).
        loss = logits if self.chunk_tokens else self.loss_fn(logits, targets)  # float32, summed
        self.losses.append(loss.detach())
        return loss * self.scale

    def _run(self, inputs, targets, positions, autocast, train: bool):
        # Under context parallelism this rank's share of every sequence (as without PP); the
        # layout travels as per-sequence tensors, which the schedule cuts into micro-batches
        # like the inputs, and every stage rebuilds it (positions also give it the length).
        if self.cp.degree > 1:
            inputs, targets, layout = self.cp.shard(inputs, targets, positions)
            kwargs = {"positions": layout.positions, "doc_ids": layout.doc_ids,
                      "token_index": layout.index.expand_as(targets)}
        elif positions is None:  # one document per window
            kwargs = {"positions": torch.arange(targets.shape[1], device=targets.device)
                      .expand_as(targets)}
        else:
            kwargs = {"positions": positions}
        if self.chunk_tokens:  # the last stage turns hidden states into the loss (others ignore)
            kwargs.update(targets=targets, loss_chunk_tokens=self.chunk_tokens)
        if self.aux_weights is not None:  # MoE auxiliary losses: each sequence's weight
            kwargs["aux_weight"] = (targets != IGNORE_INDEX).sum(-1) * self.scale
        first = 0 in self.stage_ids
        args = (inputs,) if first else ()
        target = targets if self.has_last else None
        before = len(self.losses)
        with autocast():
            if train:  # the loss function keeps the losses; the logits need not be kept
                self.schedule.step(*args, target=target, return_outputs=False, **kwargs)
            else:
                self.schedule.eval(*args, target=target, **kwargs)
        # The first step also runs the loss on shape-inference outputs: keep the real ones.
        del self.losses[before:len(self.losses) - self.n_microbatches]

    def forward_backward(self, batches: list[dict], scale: float, autocast) -> torch.Tensor:
        """Accumulate the gradient of `scale` x the summed token loss of every batch (one
        schedule step each); returns the unscaled loss sum on every pp rank."""
        self.scale = scale * self.cp.degree  # FSDP2 also averages over the cp ranks
        self.losses = []
        for batch in batches:
            self._run(batch["inputs"], batch["targets"], batch.get("positions"), autocast,
                      train=True)
        return self._broadcast_loss()

    @torch.no_grad()
    def eval_loss(self, inputs, targets, positions=None, autocast=contextlib.nullcontext):
        """The summed token loss of one batch (local_batch_size sequences), forward only, on
        every pp rank: the training schedule's eval(), which skips the backward actions."""
        self.scale, self.losses = 1.0, []
        for stage in self.stages:
            stage.eval()
        try:
            self._run(inputs, targets, positions, autocast, train=False)
        finally:
            for stage in self.stages:
                stage.train()
        return self._broadcast_loss()

    def _broadcast_loss(self) -> torch.Tensor:
        total = (torch.stack(self.losses).sum() if self.losses
                 else torch.zeros((), device=self.device))
        if self.group is not None:  # the last stage's sum to every pp rank (others add 0)
            dist.all_reduce(total, group=self.group)
        self.losses = []
        return self.cp.reduce_loss(total)  # each cp rank scored its share of the tokens


@functools.cache
def sharded_grad_stage():
    """torch's PipelineStage, except that an FSDP2 stage reduce-scatters the gradients of every
    micro-batch's backward (they stay sharded: 1/shard of the stage's fp32 gradients per rank).

    torch's stage turns FSDP2's gradient reduction off for each micro-batch's backward and
    reduces once after the last (`perform_reduce_grad`), so until then the stage holds its
    unsharded gradients. Here reduction stays on: each block's gradients are reduce-scattered
    as its backward ends (split backwards, as in the zero-bubble schedules, right after the
    weight part). The parameters stay gathered between micro-batches, as torch's stage keeps
    them; `perform_reduce_grad` then finds nothing left to reduce and only finalizes.
    """
    from torch.distributed.fsdp import FSDPModule, fully_shard
    from torch.distributed.pipelining import PipelineStage

    class ShardedGradStage(PipelineStage):
        def backward_maybe_with_nosync(self, backward_type, bwd_kwargs, last_backward=False):
            module = self.submod
            if not isinstance(module, FSDPModule):
                return super().backward_maybe_with_nosync(backward_type, bwd_kwargs,
                                                          last_backward)
            # torch's method turns the reduction off first: keep it on instead.
            sync = module.set_requires_gradient_sync
            module.set_requires_gradient_sync = lambda flag, **kw: sync(True, **kw)
            try:
                out = super().backward_maybe_with_nosync(backward_type, bwd_kwargs,
                                                         last_backward)
            finally:
                del module.set_requires_gradient_sync
            if backward_type == "weight":  # no FSDP2 hook fires after a weight-only backward
                for state in fully_shard.state(module)._state_ctx.all_states:
                    for group in state._fsdp_param_groups:
                        group.post_backward()
            return out

    return ShardedGradStage


__all__ = ["Pipeline", "sharded_grad_stage"]
