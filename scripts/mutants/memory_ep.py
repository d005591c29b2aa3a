"""Mutants of the memory estimate's terms that bench_memory's per-allocation peaks corrected
(issue 62: the ep2 row's routing, the plain loss's root, the chunked loss's weight product,
SDPA's unrepeated KV heads, FSDP2's embedding prefetch, CP's attention under op AC) and of the
op policy that no longer caches a custom Function's inner kernels, and of FlexAttention's
BlockMask built block by block; scripts/mutation_check.py
runs them."""

from __future__ import annotations

from mutants.base import Mutant

RECORDED = ("tests/test_estimate_memory_recorded.py::"
            "test_every_recorded_row_is_estimated_within_10_percent_on_every_rank")
MOE_CLI = ("tests/test_estimate_memory_recorded.py::"
           "test_moe_routing_assumption_is_echoed_and_is_the_users_to_change")
SCALING = "tests/test_memory_scaling.py::"
FLEX = "tests/test_attention.py::test_flex_block_mask_under_cp_is_built_per_block"

MUTANTS = [
    Mutant.at(
        "estimate_moe_experts_balanced",
        "the estimate counts perfectly balanced experts again (ep2 rank 1: 0.86): no padding to "
        "the busiest expert, no imbalance between the ranks' received tokens",
        "torchllm.tools.memory_phases:rank_memory",
        "    routing = (expert_routing(model_args, n_experts, tokens, dims.ep, moe_imbalance,",
        "    routing = None and (expert_routing(model_args, n_experts, tokens, dims.ep, "
        "moe_imbalance,",
        (RECORDED, MOE_CLI),
    ),
    Mutant.at(
        "estimate_moe_imbalance_unsaid",
        "the estimate assumes a routing imbalance without echoing it",
        "torchllm.tools.estimate_memory:assumptions",
        "    if moe:",
        "    if False:",
        (MOE_CLI,),
    ),
    Mutant.at(
        "estimate_plain_loss_root_gathered",
        "the estimate keeps the root's head gathered through a loss outside the model "
        "(fsdp2-plain_loss 1.054)",
        "torchllm.tools.memory_phases:rank_memory",
        '            and pcfg.fsdp_reshard_after_forward != "never"):',
        '            and pcfg.fsdp_reshard_after_forward != "never" and False):',
        (RECORDED,),
    ),
    Mutant.at(
        "estimate_chunked_loss_weight_product_uncounted",
        "the chunked loss's backward without the [vocab, dim] product beside the head's "
        "gradient (fsdp2-ac_none 0.98, ep2 2 MiB low)",
        "torchllm.tools.activation_bytes:loss_bytes",
        "                max(chunk * FP32, weight_product) + chunk * act + vocab * dim * FP32",
        "                chunk * FP32 + chunk * act + vocab * dim * FP32",
        (RECORDED,),
    ),
    Mutant.at(
        "estimate_sdpa_kv_repeated",
        "the estimate counts k and v repeated to every query head though SDPA's enable_gqa "
        "shares them (fsdp2-ac_none 1.02)",
        "torchllm.tools.activation_bytes:activation_bytes_per_block",
        "    if _SDPA_GQA and kv_dim < dim:",
        "    if False:",
        (RECORDED,),
    ),
    Mutant.at(
        "estimate_fsdp_embedding_prefetch_uncounted",
        "the first block's backward without FSDP2's prefetched embedding (cp2, fsdp2-ac_full)",
        "torchllm.tools.memory_phases:rank_memory",
        '            **({"prefetched_params": embedding * act} if dims.fsdp_enabled and own_group',
        '            **({"prefetched_params": embedding * act} if False and own_group',
        (RECORDED,),
    ),
    Mutant.at(
        "ac_op_caches_custom_function_kernels",
        "selective op AC caches the kernels inside CP's chunked attention again: every chunk "
        "pair's output, and on the float32 path every tile's scores (S x S/cp)",
        "torchllm.parallel.ac:_op_policy",
        "        if chunked_attention_running():",
        "        if False:",
        (SCALING + "test_op_ac_keeps_no_chunk_pair_of_cp_attention",),
    ),
    Mutant.at(
        "ac_op_recomputes_tp_collectives",
        "selective op AC recomputes TP's reduce-scatters run inside DTensor's redistribute "
        "(no grad there): the recompute communicates again (tp2 measured 51.6 instead of 53.6)",
        "torchllm.parallel.ac:_op_policy",
        "        if chunked_attention_running():",
        "        if not torch.is_grad_enabled():",
        (SCALING + "test_op_ac_keeps_tp_collectives_inside_functions",),
    ),
    Mutant.at(
        "flex_block_mask_from_dense_grid",
        "FlexAttention's BlockMask from torch's create_block_mask again: every (query, key) pair "
        "evaluated, an S x S/cp grid under CP",
        "torchllm.models.flex_mask:block_mask",
        "    from torch.nn.attention.flex_attention import BlockMask\n",
        "    from torch.nn.attention.flex_attention import BlockMask, create_block_mask\n"
        "    return create_block_mask(mask_mod, None if q_doc is None else q_doc.shape[0], None,\n"
        "                             q_index.shape[0], kv_index.shape[0], device=q_index.device)\n",
        (FLEX,),
    ),
    Mutant.at(
        "flex_block_full_from_first_key",
        "a block pair counted full when its first key precedes the queries (its last may not): "
        "future keys attended",
        "torchllm.models.flex_mask:block_mask",
        "    full = k_hi <= q_lo  # every key before every query",
        "    full = k_lo <= q_lo",
        (FLEX, "tests/test_attention.py::test_flex_block_mask_equals_dense_mask"),
    ),
]
