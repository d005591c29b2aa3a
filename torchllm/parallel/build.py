"""The model a rank trains: built on meta, parallelized, materialized (or its pipeline stages)."""

from __future__ import annotations

import torch

from torchllm.models.lora import build_with_lora
from torchllm.parallel.init import init_model_weights
from torchllm.parallel.parallelize import parallelize_model
from torchllm.parallel.pipeline_schedule import Pipeline
from torchllm.parallel.plan import ParallelPlan


def build_model(spec, model_args, parallel_dims, plan: ParallelPlan, device, loss_fn,
                new_tokens=None, *, mcfg, lcfg, seed: int, tcfg=None, ecfg=None):
    """(model, pipeline). Without pipeline parallelism: the model built on the meta device (no
    memory), parallelized by `plan` as its family declares (parallelize_model), then
    materialized with the initial weights of a single CPU process with this `seed`, sharded or
    not; pipeline is None (`new_tokens`: lora.added_tokens of the run's tokenizer, rows LoRA
    trains). With it: the union of this rank's stages (parameters under the unsplit model's
    names) and the Pipeline that runs their schedule.

    Sections: [model] `mcfg`, [lora] `lcfg`, and under PP [training] `tcfg` and [eval] `ecfg`;
    the layout and speed-ups are the plan's ([parallelism], [float8], ...)."""
    if parallel_dims.pp_enabled:
        pipeline = Pipeline.build(spec, model_args, parallel_dims, plan, device, loss_fn,
                                  tcfg=tcfg, mcfg=mcfg, ecfg=ecfg, seed=seed)
        return pipeline.model, pipeline
    float8 = plan.float8.enable
    with torch.device("meta"):  # (lora.enable: with adapters, base frozen; models/lora.py)
        model = build_with_lora(spec, model_args, lcfg, mcfg, float8, new_tokens)
    parallelize_model(model, spec, parallel_dims, plan)
    init_model_weights(model, lambda: build_with_lora(spec, model_args, lcfg, mcfg, float8,
                                                      new_tokens),
                       device, seed, plan.parallelism.fsdp_cpu_offload)
    return model, None
