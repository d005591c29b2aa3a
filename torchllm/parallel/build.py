"""The model a rank trains: built on meta, parallelized, materialized (or its pipeline stages)."""

from __future__ import annotations

import torch

from torchllm.models.lora import build_with_lora
from torchllm.parallel.init import init_model_weights
from torchllm.parallel.parallelize import parallelize_model
from torchllm.parallel.pipeline_schedule import Pipeline
from torchllm.parallel.plan import ParallelPlan


def build_model(spec, model_args, parallel_dims, cfg, device, loss_fn, new_tokens=None):
    """(model, pipeline). Without pipeline parallelism: the model built on the meta device (no
    memory), parallelized as its family declares (parallelize_model), then materialized with the initial
    weights of a single CPU process with this seed, sharded or not; pipeline is None
    (`new_tokens`: lora.added_tokens of the run's tokenizer, rows LoRA trains). With it:
    the union of this rank's stages (parameters under the unsplit model's names) and the
    Pipeline that runs their schedule.

    An entry point (scripts/config_coupling.py): the model a rank trains reads the family
    ([model]), LoRA ([lora]), the layout and speed-ups (a ParallelPlan of [parallelism],
    [float8], [activation_checkpoint], [compile], training.mixed_precision and whether fault
    tolerance fixes DDP's buckets), the seed
    ([job]) and, under PP, [training] and [eval]; each piece gets its own sections."""
    plan = ParallelPlan(cfg.parallelism, cfg.float8, cfg.activation_checkpoint, cfg.compile,
                        cfg.training.mixed_precision,
                        static_ddp_buckets=cfg.fault_tolerance.enable)
    if parallel_dims.pp_enabled:
        pipeline = Pipeline.build(spec, model_args, parallel_dims, plan, device, loss_fn,
                                  tcfg=cfg.training, mcfg=cfg.model, ecfg=cfg.eval,
                                  seed=cfg.job.seed)
        return pipeline.model, pipeline
    with torch.device("meta"):  # (lora.enable: with adapters, base frozen; models/lora.py)
        model = build_with_lora(spec, model_args, cfg.lora, cfg.model, cfg.float8.enable,
                                new_tokens)
    parallelize_model(model, spec, parallel_dims, plan)
    init_model_weights(model, lambda: build_with_lora(spec, model_args, cfg.lora, cfg.model,
                                                      cfg.float8.enable, new_tokens),
                       device, cfg.job.seed, cfg.parallelism.fsdp_cpu_offload)
    return model, None
