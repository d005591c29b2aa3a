"""Apply parallelisms and speed-ups to a model, in one documented order, as its family declares."""

from __future__ import annotations

import torch
from torch import nn

from torchllm.config.job_config import ConfigError, document_masking
from torchllm import models
from torchllm.log import logger
from torchllm.models.contract import LanguageModel
from torchllm.models.lora import check_lora
from torchllm.parallel.ac import apply_ac, parse_selective_option
from torchllm.parallel.compile import apply_compile, check_components
from torchllm.parallel.context_parallel import apply_cp
from torchllm.parallel.data_parallel import apply_ddp, apply_fsdp
from torchllm.parallel.dims import ParallelDims
from torchllm.parallel.expert_parallel import apply_ep
from torchllm.parallel.float8 import apply_float8, check_float8_hardware
from torchllm.parallel.levers import check_levers
from torchllm.parallel.float8 import inductor_options as float8_inductor_options  # noqa: I001
from torchllm.parallel.pipeline import check_pipeline
from torchllm.parallel.plan import ParallelPlan
from torchllm.parallel.tp import apply_tp
from torchllm.precision import use_bf16


def build_parallel_dims(world_size: int, device_type: str, model_args, *, parallelism, model,
                        training, data, eval, float8, activation_checkpoint, lora,
                        compile) -> ParallelDims:
    """Every parallelism check that needs no process group: degrees, model shape, options. The
    layout constrains the sections it is given by name (the launcher's pre-flight check, the
    run, the memory estimate and the dry run pass the same ones); each check gets its own."""
    dims = ParallelDims.from_config(parallelism, world_size)
    dims.device_type = device_type
    dims.validate_model(model_args.n_heads, model_args.n_kv_heads, model_args.tie_embeddings)
    spec = models.get(model.name)
    dims.validate_experts(model.name, spec.n_experts(model_args))
    if dims.tp_enabled and spec.tp_plan is None:
        raise ConfigError(
            f"model.name = {model.name!r} declares no tensor-parallel plan "
            "(ModelSpec.tp_plan); set parallelism.tensor_parallel_degree = 1",
            "parallelism.tensor_parallel_degree")
    if dims.tp_enabled and training.seq_len % dims.tp:
        raise ConfigError(
            f"training.seq_len = {training.seq_len} is not a multiple of "
            f"tensor_parallel_degree = {dims.tp} (sequence parallelism splits the sequence)",
            "training.seq_len",
        )
    if dims.pp_enabled:  # schedule, micro-batches, the stages' split, what PP cannot run yet
        check_pipeline(parallelism, training, model.name,
                       eval, model_args, dims.pp)
    if dims.cp_enabled:
        check_cp_lengths(training, dims.cp, dims.tp)
        if model.dropout:  # (chunked_attention's pairs run without dropout)
            raise ConfigError(
                f"model.dropout = {model.dropout} with context_parallel_degree > 1 "
                "is not supported (attention runs chunk by chunk); set model.dropout = 0",
                "model.dropout")
    if (dims.tp_enabled and document_masking(model, data)[1]
            and spec.tp_plan.learned_positions):  # GPT-2
        raise ConfigError(
            "model.restart_positions_per_document with tensor_parallel_degree > 1 is not "
            "supported for GPT-2 (TP shards its learned position table along one shared "
            "sequence); use Llama (RoPE), or turn one of them off (conversations: with "
            "data.chat_packing = 'pad', one per window)",
            "model.restart_positions_per_document",
        )
    if dims.tp_enabled and float8.enable:
        raise ConfigError(
            "float8.enable with tensor_parallel_degree > 1 is not supported: float8 swaps the "
            "Linear modules that TP has hooked; use float8 with FSDP2/DDP, or TP without float8",
            "float8.enable",
        )
    if dims.tp_enabled and training.chunked_loss:
        raise ConfigError(
            "training.chunked_loss with tensor_parallel_degree > 1 is not supported: the chunked "
            "loss needs the whole output weight, and TP already splits the logits and the loss "
            "over the vocabulary (each rank holds 1/tp of them); turn one of them off",
            "training.chunked_loss",
        )
    if parallelism.fsdp_cpu_offload and device_type != "cuda":
        raise ConfigError(
            "parallelism.fsdp_cpu_offload = true needs CUDA: on CPU the params are in CPU "
            "memory already; set it to false",
            "parallelism.fsdp_cpu_offload",
        )
    if parallelism.ddp_comm_hook == "bf16" and device_type != "cuda":
        raise ConfigError(
            "parallelism.ddp_comm_hook = 'bf16' needs CUDA + NCCL (torch's bf16 hook has no "
            "gloo path); use 'fp16' or 'none' on CPU",
            "parallelism.ddp_comm_hook",
        )
    if model.attention == "flex" and device_type != "cuda":
        raise ConfigError(
            "model.attention = 'flex' needs CUDA (FlexAttention has no CPU backward); use "
            "model.attention = 'sdpa', which trains block_causal and sliding windows on every "
            "device with a boolean mask", "model.attention",
        )
    if activation_checkpoint.mode == "selective":
        parse_selective_option(activation_checkpoint.selective_option)
    check_lora(lora, model.name, float8.enable, dims)
    check_float8_hardware(float8, device_type)
    check_components(compile)
    check_levers(training, compile, float8, model,
                 dims, device_type)  # the speed levers (torchllm.parallel.levers)
    return dims


def check_cp_lengths(tcfg, cp: int, tp: int) -> None:
    """Context parallelism cuts every sequence into 2·cp equal chunks (and TP splits a rank's
    share again): every sequence length of the run must be a multiple of 2·cp·tp."""
    from torchllm.data.seq_len_schedule import parse_seq_len_schedule

    need = 2 * cp * tp
    for length, _ in parse_seq_len_schedule(tcfg.seq_len_schedule, tcfg.seq_len):
        if length % need:
            key = "training.seq_len_schedule" if tcfg.seq_len_schedule else "training.seq_len"
            raise ConfigError(
                f"{key}: sequence length {length} is not a multiple of 2 x "
                f"context_parallel_degree ({cp}) x tensor_parallel_degree ({tp}) = {need} "
                "(head-tail chunks per cp rank); use a multiple of it", key,
            )


def parallelize_model(model: LanguageModel, spec, parallel_dims: ParallelDims,
                      plan: ParallelPlan) -> None:
    """Apply, in place, on the meta-device model of family `spec` (its declared plans) what
    `plan` (its config sections) asks: CP -> EP -> TP -> float8 -> AC -> compile -> FSDP2 | DDP.

    Under pipeline parallelism `model` is one stage (torchllm.parallel.pipeline: the split comes
    first), and this runs once per stage on the stage's own blocks.

    The order is forced by what each step wraps or replaces:
    - CP only tells each attention module how to gather keys/values over the cp ranks; it must
      reach the plain modules before AC/compile wrap them. (The trainer splits the batch.)
    - EP, like TP, turns the expert weights into DTensors (sharded on the expert dim over the ep
      ranks) and hooks the experts' inputs/outputs with the all-to-alls; FSDP2 later shards
      each rank's experts over the remaining efsdp ranks (torchllm.parallel.expert_parallel).
    - TP: it rewrites Linear weights into DTensors and hooks their inputs/outputs, so it
      needs the plain modules, and every later step must see its sharded shapes.
    - float8 swaps nn.Linear for Float8Linear; AC and compile must wrap/trace the swapped
      modules, and FSDP2's float8 all-gather needs the float8 weight wrappers before sharding.
      (float8 with TP is refused: the swap would drop TP's hooks.)
    - AC wraps each block (or its submodules) in a checkpoint wrapper, so that compile traces
      the recomputation policy together with the block.
    - compile replaces each (wrapped) block by its compiled version.
    - FSDP2/DDP come last: they hook the outermost modules (the compiled blocks and the
      root), which keeps their communication outside the compiled graphs, and they shard or
      replicate the final parameters, whatever the steps before made of them.
    """
    pcfg, applied = plan.parallelism, []
    compiled = plan.compile.enable and "model" in plan.compile.components
    if parallel_dims.cp_enabled:
        apply_cp(model, parallel_dims.cp_group)
        applied.append(f"CP {parallel_dims.cp} (all-gather K/V, head-tail chunks)")
    if parallel_dims.ep_enabled:
        n = apply_ep(model, parallel_dims.ep_mesh())
        applied.append(f"EP {parallel_dims.ep} ({n} MoE layers, all-to-all dispatch)")
    if parallel_dims.tp_enabled:
        apply_tp(model, parallel_dims.mesh["tp"], spec.tp_plan)
        applied.append(f"TP {parallel_dims.tp} (sequence parallel)")
    if plan.float8.enable:
        names = apply_float8(model, plan.float8, parallel_dims.device_type,
                             parallel_dims.fsdp_enabled, compiled)
        applied.append(f"float8 {plan.float8.recipe} on {len(names)} linears")
    counts = apply_ac(model, plan.activation_checkpoint)
    if counts:
        applied.append(f"AC {plan.activation_checkpoint.mode} {counts}")
    if compiled:
        n = apply_compile(model, plan.compile, float8_inductor_options(plan.float8))
        applied.append(f"compiled {n} blocks" if plan.compile.granularity == "block"
                       else f"compiled the whole model ({n} blocks)")
    if parallel_dims.fsdp_enabled:
        bf16 = parallel_dims.bf16
        if bf16 is None:
            bf16 = use_bf16(plan.mixed_precision, parallel_dims.device_type)
        apply_fsdp(
            model,
            parallel_dims.fsdp_mesh(),
            param_dtype=torch.bfloat16 if bf16 else torch.float32,
            reduce_dtype=torch.bfloat16 if pcfg.fsdp_reduce_dtype == "bf16" else torch.float32,
            reshard_policy=pcfg.fsdp_reshard_after_forward,
            cpu_offload=pcfg.fsdp_cpu_offload,
            expert_mesh=parallel_dims.expert_fsdp_mesh() if parallel_dims.ep_enabled else None,
            expert_divide_factor=parallel_dims.dp_degree * parallel_dims.cp,
        )
        kind = "HSDP" if parallel_dims.dp_replicate_enabled else "FSDP2"
        cp = f" x cp={parallel_dims.cp}" if parallel_dims.cp_enabled else ""
        applied.append(
            f"{kind} replicate={parallel_dims.dp_replicate} shard={parallel_dims.dp_shard}{cp} "
            f"(reshard {pcfg.fsdp_reshard_after_forward}, params {'bf16' if bf16 else 'fp32'}, "
            f"reduce {pcfg.fsdp_reduce_dtype})"
        )
    elif parallel_dims.ddp_enabled:
        apply_ddp(model, parallel_dims.mesh["dp_replicate"], pcfg.ddp_bucket_cap_mb,
                  pcfg.ddp_comm_hook, static_buckets=plan.static_ddp_buckets)
        applied.append(f"DDP {parallel_dims.dp_replicate} (comm hook {pcfg.ddp_comm_hook})")
    if applied:
        logger.info("parallelize: %s", " -> ".join(applied))
