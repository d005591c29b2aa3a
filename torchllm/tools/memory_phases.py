"""The phases of one rank's training step and the terms each holds (bytes), for
torchllm/tools/estimate_memory.py: what the pipeline ranks hold (`pipeline_ranks`) and, for one
of them, every phase as a dict of terms that add up to the phase (`rank_memory`).

Phases (the largest is the peak; each lists only the terms alive in it):
  forward             the state, the gathered/kept params, every saved activation, the loss's
                      kept tensors and its forward scratch
  loss backward       the same with the loss backward's scratch (logits' gradients, the head's)
  first block backward  the state, the head's gradients (the root's, unsharded under FSDP2,
                      until the end of backward), every saved activation, the block's rebuilt
                      activations (AC) and its backward's working tensors; FSDP2: the block
                      and its prefetched neighbour gathered
  second block backward (FSDP2) the same less the first block's activations, plus its
                      gradients sharded and its reduce-scatter's input (unsharded) still alive
  last block backward the state, every gradient but the embedding's, the first block's
                      activations, rebuilt activations and working tensors (the peak when
                      gradients outweigh activations: full AC, small batches)
  optimizer           the state and the gradients
With accumulation (or PP micro-batches) the gradients of earlier micro-steps are alive in every
phase: sharded under FSDP2 (reduce-scatter every micro-step,
parallelism.fsdp_reduce_every_microstep), unsharded without it.
"""

from __future__ import annotations

from torchllm import models
from torchllm.models.contract import LanguageModel
from torchllm.models.moe import MoE
from torchllm.optim.spec import adamw_state_bytes
from torchllm.parallel.dims import ParallelDims
from torchllm.parallel.pipeline import check_pipeline, rank_stages, stages_per_rank
from torchllm.parallel.plan import ParallelPlan
from torchllm.tools.activation_bytes import (FP32, activation_bytes_per_block,
                                             backward_workspace_bytes, expert_routing,
                                             lora_activation_bytes, loss_bytes)

# The busiest expert's load as a multiple of the balanced one that the estimate plans for
# (estimate_memory --moe_imbalance): the debug MoE's fresh router, without the auxiliary loss,
# measured 0.7-3.5x per layer on the bench's ep2 row (the worst rank's layers ~2.5x on average).
MOE_IMBALANCE = 2.0


def moe_params(model: LanguageModel) -> dict[str, int]:
    """Parameters of each block's MoE layer (router + experts), by block name; 0 when dense."""
    return {name: sum(p.numel() for m in block.modules() if isinstance(m, MoE)
                      for p in m.parameters())
            for name, block in model.layers.items()}


def pipeline_ranks(pcfg, tcfg, model_name: str, ecfg, model_args,
                   dims: ParallelDims) -> list[dict]:
    """What each pipeline rank holds: its blocks, the embedding (first stage) and the head (last
    stage), and at most how many (micro-batch, stage) forwards it keeps for backward at once.

    The in-flight count follows the schedule (torch.distributed.pipelining): GPipe runs every
    micro-batch's forward before any backward; 1F1B's rank r runs pp - r forwards before its
    first backward; the interleaved and zero-bubble schedules warm up (v - 1) x pp + 2 x
    (pp - 1 - r) forwards over their v stages per rank (torch's warm-up count; zero-bubble's
    deferred weight gradients are not counted). Without PP: one rank, one forward, everything.
    `pcfg`, `tcfg`, `ecfg`: the [parallelism], [training] and [eval] sections (the pipeline's
    own check, parallel/pipeline.py:check_pipeline, reads them)."""
    n_layers = model_args.n_layers
    if not dims.pp_enabled:
        return [{"pp_rank": 0, "blocks": list(range(n_layers)), "first": True, "last": True,
                 "in_flight": 1, "micro_batch": tcfg.local_batch_size,
                 "accumulates": False}]
    schedule, pp = pcfg.pipeline_parallel_schedule, dims.pp
    stages = check_pipeline(pcfg, tcfg, model_name, ecfg, model_args, pp)
    v = stages_per_rank(schedule)
    n_micro = tcfg.local_batch_size // pcfg.pipeline_parallel_microbatch_size
    ranks = []
    for r in range(pp):
        mine = rank_stages(schedule, pp, r)
        if schedule == "GPipe":
            pairs = n_micro
        elif v == 1:
            pairs = min(n_micro, pp - r)
        else:
            pairs = min(n_micro * v, (v - 1) * pp + 2 * (pp - 1 - r) + 1)
        blocks = [b for s in mine for b in stages[s]]
        ranks.append({"pp_rank": r, "blocks": blocks, "first": 0 in mine,
                      "last": len(stages) - 1 in mine,
                      "in_flight": pairs / len(mine),  # in units of this rank's whole blocks
                      "micro_batch": pcfg.pipeline_parallel_microbatch_size,
                      # earlier micro-batches' gradients exist while later ones run
                      "accumulates": n_micro > 1})
    return ranks


def optimizer_bytes(state_bytes, named, divisor) -> int:
    """The optimizer's state for (name, param) pairs, each param split `divisor(name)` ways
    along its first dim (FSDP2 and TP shards), by the optimizer's own count (OptimizerSpec)."""
    total = 0
    for name, p in named:
        d = divisor(name)
        shape = (max(1, p.shape[0] // d), *p.shape[1:]) if p.ndim else (1,)
        total += state_bytes(name, tuple(shape))
    return total


def rank_memory(plan: ParallelPlan, tcfg, lcfg, model_name: str, model_args,
                model: LanguageModel, dims: ParallelDims, act: int, rank: dict,
                state_bytes=None, accum: int = 1, moe_imbalance: float = MOE_IMBALANCE) -> dict:
    """Terms and phases of one rank holding `rank` (see pipeline_ranks) of the model of family
    `model_name`, laid out by `plan` ([parallelism], [float8], [activation_checkpoint],
    [compile]) and trained as [training] `tcfg` says, with the [lora] section `lcfg`;
    `state_bytes`: the optimizer's bytes per parameter (OptimizerSpec.state_bytes); `accum`:
    gradient-accumulation micro-steps per optimizer step; `moe_imbalance`: the busiest expert's
    load over the balanced one (activation_bytes.expert_routing)."""
    pcfg, ac = plan.parallelism, plan.activation_checkpoint
    state_bytes = state_bytes or adamw_state_bytes
    tp = dims.tp
    fsdp_shard = dims.dp_shard * dims.cp  # FSDP2 shards over dp_shard x cp, TP splits again
    shard = fsdp_shard * tp if dims.fsdp_enabled else tp
    blocks = [str(b) for b in rank["blocks"]]
    mine = [model.layers[b] for b in blocks]
    n_blocks = len(mine)
    # TP splits all but the MoE layers (replicated by TP: parallel/tp.py).
    moe_by_block = moe_params(model)
    moe = moe_by_block["0"]
    # Under EP a rank gathers and differentiates its own experts only (the router: all of it).
    experts_of = [m for m in model.layers["0"].modules() if isinstance(m, MoE)]
    expert_params = sum(p.numel() for m in experts_of for p in m.experts.parameters())
    moe_local = moe - expert_params + expert_params // dims.ep
    block_params = sum(p.numel() for p in model.layers["0"].parameters())
    block_split = block_params - moe
    in_blocks = {id(p) for p in model.layers.parameters()}
    if rank["first"] and rank["last"]:  # the whole model: every parameter outside the blocks
        root_named = [(n, p) for n, p in model.named_parameters() if id(p) not in in_blocks]
    else:  # a pipeline rank: the embedding on the first stage, final norm and head on the last
        keep = ["tok_embeddings"] * rank["first"] + ["norm", "output"] * rank["last"]
        root_named = [(n, p) for n, p in model.named_parameters()
                      if id(p) not in in_blocks and n.split(".")[0] in keep]
    root_params = sum(p.numel() for _, p in root_named)
    emb = model.tok_embeddings.weight
    embedding = emb.numel() if rank["first"] and any(p is emb for _, p in root_named) else 0
    block_named = [(f"layers.{b}.{n}", p) for b in blocks
                   for n, p in model.layers[b].named_parameters()]
    moe_names = {f"layers.{b}.{mn}.{pn}" for b in blocks
                 for mn, m in model.layers[b].named_modules() if isinstance(m, MoE)
                 for pn, _ in m.named_parameters()}

    def divisor(name: str) -> int:
        return shard // tp if name in moe_names else shard

    def local(named, trained_only=False) -> int:  # fp32 bytes of these params on this rank
        return sum(p.numel() * FP32 // divisor(n) for n, p in named
                   if p.requires_grad or not trained_only)

    trained_named = [(n, p) for n, p in root_named + block_named if p.requires_grad]
    terms = {"params": local(root_named + block_named)}
    grads = local(trained_named)
    terms["optimizer"] = optimizer_bytes(state_bytes, trained_named, divisor)
    terms["ddp_buckets"] = grads if dims.ddp_enabled else 0
    gathered_block = block_split * act // tp + moe_local * act  # one block's, gathered
    # The root's (final norm, head; the embedding when tied or on a pipeline stage): FSDP2 never
    # reshards the root after forward. An untied embedding is its own FSDP2 group, resharded
    # after its forward unless reshard_after_forward = never (parallel/data_parallel.py).
    own_group = (model.output is not None and rank["first"] and rank["last"]
                 and pcfg.fsdp_reshard_after_forward != "never")
    gathered_root = (root_params - embedding * own_group) * act // tp
    kept, terms["gathered_params"] = 0, 0
    if dims.fsdp_enabled:  # blocks kept gathered after forward: the last (default), all, none
        kept = {"never": n_blocks, "always": 0}.get(pcfg.fsdp_reshard_after_forward, 1)
        if rank["accumulates"] and dims.pp_enabled:  # a pipeline stage stays gathered
            kept = n_blocks  # between its micro-batches (torch's PipelineStage)
        terms["gathered_params"] = gathered_root + kept * gathered_block
    # Gradients of earlier micro-steps (accumulation, pipeline micro-batches): sharded when
    # FSDP2 reduce-scatters every micro-step, else every local gradient unsharded.
    accumulates = accum > 1 or rank["accumulates"]
    every_step = getattr(pcfg, "fsdp_reduce_every_microstep", False)
    unsharded_grads = sum(p.numel() * FP32 // (tp if n not in moe_names else dims.ep)
                          for n, p in trained_named)
    if accumulates:
        terms["accumulated_grads"] = (grads if not dims.fsdp_enabled or every_step
                                      else unsharded_grads)

    # Tokens of one forward: the local batch, or one pipeline micro-batch; cp splits sequences.
    tokens = rank["micro_batch"] * tcfg.seq_len // dims.cp
    autocast = act != FP32 and not dims.fsdp_enabled  # (FSDP2 runs bf16 params instead)
    spec = models.get(model_name)
    ccfg, f8 = plan.compile, plan.float8
    compiled = ccfg.enable and "model" in ccfg.components and ac.mode == "none"
    float8 = compiled and f8.enable and f8.recipe == "tensorwise"

    stream = tokens * model_args.dim * act // tp  # the residual stream, sequence-parallel

    n_experts = spec.n_experts(model_args)
    routing = (expert_routing(model_args, n_experts, tokens, dims.ep, moe_imbalance,
                              padded=act == FP32) if n_experts else None)

    def saved(mode: str, option: str = "") -> int:  # one block's saved bytes on this rank
        per = activation_bytes_per_block(spec, model_args, tokens, act, mode, option, autocast,
                                         compiled and mode == "none", float8, cp=dims.cp,
                                         routing=routing)
        return per // tp  # sequence parallel and TP's head split: 1/tp of each

    # What selective 'op' saves under TP beyond 1/tp of a block's: w2's output before its
    # reduce-scatter (a partial sum over every token: [tokens, dim], not split), and the outputs
    # of wo's and w2's reduce-scatters ([tokens / tp, dim] each: the policy keeps them so that
    # the recompute does not communicate, parallel/ac.py). Measured on tp2: +3.0 MiB of 3.3.
    tp_op = (tokens * model_args.dim * act * (tp - 1) // tp + 2 * stream
             if tp > 1 and ac.mode == "selective" and ac.selective_option == "op" else 0)
    per_block = saved(ac.mode, ac.selective_option) + lora_activation_bytes(
        model, lcfg, ac.mode, tokens, act) // tp
    if ac.mode == "selective" and ac.selective_option.isdigit():
        checkpointed = n_blocks // int(ac.selective_option)
        acts = checkpointed * saved("full") + (n_blocks - checkpointed) * per_block
        rebuilt = saved("none")
    else:
        acts = n_blocks * (per_block + tp_op)
        rebuilt = 0 if ac.mode == "none" else max(0, saved("none") - per_block)
    # The embedding output (first block's input), the final norm's x*rstd and its output
    # (under TP the output projection keeps its input gathered over the sequence: all of it).
    edges = (rank["first"] + rank["last"]) * stream + rank["last"] * stream * tp
    terms["activations"] = int((acts + edges) * rank["in_flight"])  # pipeline: forwards kept
    terms["recompute"] = rebuilt
    # (no AC: the block's saved FFN tensors are freed as its gradients appear: half of it)
    terms["backward_workspace"] = (backward_workspace_bytes(model_args, tokens, act) // tp
                                   // (2 if ac.mode == "none" else 1))

    # The loss's tensors on the last stage: kept per forward in flight, and the scratch of the
    # loss's forward and backward (see loss_bytes); TP splits the logits by vocabulary.
    compiled_loss = (ccfg.enable and "loss" in ccfg.components
                     and not tcfg.chunked_loss and not dims.pp_enabled)
    kept_loss, loss_forward, loss_backward = loss_bytes(
        tcfg, act, tokens, model_args, pipelined=dims.pp_enabled, compiled=compiled_loss, tp=tp)
    terms["logits"] = int(kept_loss * rank["in_flight"]) if rank["last"] else 0
    if not rank["last"]:
        loss_forward = loss_backward = 0
    terms["loss_forward"], terms["loss_backward"] = loss_forward, loss_backward

    # Autocast's bf16 copies of the matmul weights, saved by forward for backward (not the
    # embedding, which is looked up); float8 (tensorwise, compiled) keeps none of the blocks'.
    split_sum = sum(p.numel() for n, p in block_named if n not in moe_names)
    moe_sum = sum(p.numel() for n, p in block_named if n in moe_names)
    terms["autocast_weights"] = (
        (root_params - embedding * (model.output is not None)) * act // tp
        + (0 if float8 else split_sum * act // tp + moe_sum * act)) if autocast else 0

    # The head's gradients (final norm, output; with tied embeddings the table), computed in
    # the loss backward and alive, unsharded under FSDP2, until the end of backward.
    head_named = [(n, p) for n, p in root_named if p.requires_grad and p is not emb
                  or (p is emb and model.output is None and rank["last"])]
    head_grads = sum(p.numel() * FP32 // tp for _, p in head_named)
    grad_block = sum(p.numel() for p in model.layers["0"].parameters() if p.requires_grad)
    block_grads_unsharded = (grad_block - moe) * FP32 // tp + moe_local * FP32
    # (sharded, the experts too: over ep, then the remaining dp_shard x cp / ep ranks)
    block_grads_local = (block_grads_unsharded if not dims.fsdp_enabled else
                         ((grad_block - moe) * FP32 // tp + moe * FP32) / fsdp_shard)
    t = terms
    state = {k: t[k] for k in ("params", "optimizer", "ddp_buckets") if t[k]}
    state.update({k: t[k] for k in ("gathered_params", "autocast_weights", "accumulated_grads")
                  if t.get(k)})
    # A loss outside the model (all but the chunked one, which reads the head's weight inside
    # the root's forward) runs after FSDP2 has resharded the root, and its backward before the
    # logits' gradient reaches the head, whose pre-backward gathers it again (measured on
    # fsdp2-plain_loss: the root's 4 MiB absent at the log-softmax backward's peak).
    loss_state = dict(state)
    if (dims.fsdp_enabled and not tcfg.chunked_loss and not dims.pp_enabled
            and pcfg.fsdp_reshard_after_forward != "never"):
        loss_state["gathered_params"] = state.get("gathered_params", 0) - gathered_root
    phases = {
        "forward": {**loss_state, "activations": t["activations"], "logits": t["logits"],
                    "loss_forward": loss_forward},
        "loss backward": {**loss_state, "activations": t["activations"], "logits": t["logits"],
                          "loss_backward": loss_backward},
    }
    # FSDP2 in a block's backward: the block and its prefetched neighbour gathered. (The
    # block's own gradients are not counted: at its peak, in the FFN's backward, only w2's
    # exists, as without FSDP2.)
    fsdp_block = {"prefetched_params": max(0, 2 - kept) * gathered_block} if dims.fsdp_enabled \
        else {}
    if not accumulates:
        phases["first block backward"] = {
            **state, "head_grads": head_grads, "activations": t["activations"],
            "recompute": rebuilt, "backward_workspace": t["backward_workspace"], **fsdp_block}
        # Every block's gradients but the last one's to go (under FSDP2: reduce-scattered,
        # sharded), its own unsharded ones, the head's; one block's activations left. Without
        # AC or FSDP2 its own gradients appear while all it saved is alive (with AC, as the
        # rebuilt activations are freed).
        own = 1 if ac.mode == "none" and not dims.fsdp_enabled else 0
        phases["last block backward"] = {
            **state, "head_grads": head_grads,
            "grads": int(max(0, n_blocks - 1 + own) * block_grads_local),
            "activations": per_block + tp_op + rank["first"] * stream,
            "recompute": rebuilt, "backward_workspace": t["backward_workspace"],
            **({"block_grads_unsharded": block_grads_unsharded} if dims.fsdp_enabled else {}),
            # FSDP2 prefetches the next group of the backward: an untied embedding resharded
            # after forward is gathered during the first block's backward (measured on cp2)
            **({"prefetched_params": embedding * act} if dims.fsdp_enabled and own_group
               else {})}
    else:  # earlier micro-steps' gradients are in the state already; FSDP2 reduce-scattering
        # every micro-step computes the head's unsharded gradients afresh in each (the root's
        # reduce-scatter is at the end of backward)
        fresh_head = head_grads if dims.fsdp_enabled and every_step else 0
        phases["first block backward"] = {
            **state, "head_grads": fresh_head, "activations": t["activations"],
            "recompute": rebuilt, "backward_workspace": t["backward_workspace"], **fsdp_block}
    if dims.fsdp_enabled and n_blocks > 1:
        # The next block: the first one's activations freed, its gradients reduce-scattered
        # (sharded; under accumulation added to the state's) while the reduce-scatter's input
        # (its unsharded gradients) stays alive until the next reduce-scatter is waited for
        # (torch's FSDP2); it is resharded: max(2, kept - 1) blocks gathered (measured: the
        # FSDP2 rows peak here).
        first = phases["first block backward"]
        phases["second block backward"] = {
            **first, "gathered_params": gathered_root + max(2, kept - 1) * gathered_block,
            "prefetched_params": 0, "grads": 0 if accumulates else int(block_grads_local),
            "reduce_scatter_input": block_grads_unsharded,
            "activations": t["activations"] - per_block - tp_op}
    phases["optimizer"] = {**state, "grads": grads} if not accumulates else dict(state)
    for k in ("gathered_params", "autocast_weights"):  # forward's; gone by the step
        phases["optimizer"].pop(k, None)
    phases = {name: {k: int(v) for k, v in p.items() if v} for name, p in phases.items()}
    totals = {name: sum(p.values()) for name, p in phases.items()}
    terms = {k: int(v) for k, v in terms.items()}
    terms["grads"] = grads
    return {"pp_rank": rank["pp_rank"], "tokens": tokens, "terms_bytes": terms,
            "phases": phases, "phases_bytes": totals, "peak_phase": max(totals, key=totals.get)}
