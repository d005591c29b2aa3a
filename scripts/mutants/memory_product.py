"""Mutants of 'each degree divides what it claims' (issue 62, the product half): TP's vocab-
sharded logits, CP's chunk-pair attention, FSDP2's sharded gradients under accumulation, and
selective AC's every-second-matmul policy (scripts/mutation_check.py runs them)."""

from __future__ import annotations

from mutants.base import Mutant

SCALING = "tests/test_memory_scaling.py"

MUTANTS = [
    Mutant.at(
        "fsdp_accumulation_no_sync_default", "FSDP2 under gradient accumulation skips the reduce-scatter until the last micro-step again: every rank holds the whole model's unsharded fp32 gradients",
        "torchllm.parallel.distributed:gradient_sync",
        "    every_step = isinstance(model, FSDPModule) and reduce_every_microstep(pcfg)",
        "    every_step = False",
        (f"{SCALING}::test_fsdp2_accumulation_keeps_gradients_sharded",),
    ),
    Mutant.at(
        "pp_stage_no_sync", "pipeline stages under FSDP2 turn the reduce-scatter off for every micro-batch's backward again (torch's stage): a stage holds its unsharded fp32 gradients",
        "torchllm.parallel.pipeline_schedule:Pipeline.__init__",
        "        stage_cls = sharded_grad_stage() if reduce_every_microstep else None",
        "        stage_cls = None",
        (f"{SCALING}::test_pipeline_stage_gradients_stay_sharded_under_fsdp2",),
    ),
    Mutant.at(
        "tp_gathers_full_logits", "TP's output projection gathers the logits over the vocabulary: every tp rank holds the whole [tokens, vocab] logits and their gradient",
        "torchllm.parallel.tp:_style",
        "ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1),\n                               use_local_output=False)",
        "ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())",
        (f"{SCALING}::test_tp_shards_the_logits_and_their_gradient",),
    ),
    Mutant.at(
        "cp_dense_mask", "context parallelism builds the dense (S/cp x S) mask from global indices again instead of attending chunk pairs",
        "torchllm.models.attention:build_masks",
        '    cp_rank = getattr(kv_gather, "rank", None) if backend == "sdpa" else None',
        "    cp_rank = None",
        (f"{SCALING}::test_cp_divides_attention_memory_with_no_quadratic_term",),
    ),
    Mutant.at(
        "ac_op_saves_every_matmul", "selective AC 'op' keeps every matmul output again (~1.6x TorchTitan's bytes)",
        "torchllm.parallel.ac:_op_policy",
        "            if seen[ctx.is_recompute] % 2 == 0:",
        "            if False:",
        (f"{SCALING}::test_selective_op_ac_saves_every_second_matmul",),
    ),
    Mutant.at(
        "vocab_parallel_target_column", "the vocab-parallel loss looks up the target's logit at the global id on every rank instead of its column in the rank's shard",
        "torchllm.loss:_VocabParallelCrossEntropy.forward",
        "        own = targets - start  # the target's column in this rank's shard, if it has it",
        "        own = targets  # the target's column in this rank's shard, if it has it",
        (f"{SCALING}::test_vocab_parallel_loss_equals_the_gathered_loss",),
    ),
    Mutant.at(
        "chunked_attention_no_lse_merge", "context-parallel chunk pairs are averaged instead of merged by their log-sum-exp",
        "torchllm.models.chunked_attention:_ChunkedAttention._forward",
        "            out = sum(torch.exp(p_lse - lse)[..., None] * o.nan_to_num(0.0) for o, p_lse in parts)",
        "            out = sum(o.nan_to_num(0.0) for o, p_lse in parts) / len(parts)",
        ("tests/test_attention.py::test_chunked_attention_equals_the_dense_mask_on_every_cp_rank",),
    ),
]
