"""What a training step keeps in memory per token: one transformer block's activations (by AC
mode, autocast, compile and float8), the LoRA adapters' and the output head and loss's.
Used by torchllm/tools/estimate_memory.py (which adds parameters, gradients, optimizer state and
the phases); each count was checked against saved-tensor hooks or measured peaks (see
tests/unit/tools/test_estimate_memory*.py)."""

from __future__ import annotations

import math

from torchllm import loss as loss_module
from torchllm.loss import plain_kernels
from torchllm.models.attention import _SDPA_GQA
from torchllm.models.contract import LanguageModel
from torchllm.models.lora import LoRALinear
from torchllm.models.moe import padded_capacity

FP32 = 4


def activation_bytes_per_block(spec, args, tokens: int, act: int, mode: str, option: str,
                              autocast: bool = False, compiled: bool = False,
                              float8: bool = False, cp: int = 1,
                              routing: tuple[int, int] | None = None) -> int:
    """Bytes one transformer block keeps for backward, for `tokens` = batch x seq tokens, of the
    family whose ModelSpec is `spec` (its declared QK-norm and experts) with these args.

    Counted from what autograd saves in the Llama block's forward (torchllm/models/llama/
    model.py; checked with saved-tensor hooks), in units of dim per token:
      attention: block input, x*rstd and the normed input (2), q, k and v as SDPA gets them
        (k, v repeated to all heads: 7 x dim in all; with SDPA's enable_gqa, torch >= 2.5, not
        repeated: 5 x dim + 2 x kv width, as the bench's fsdp2-ac_none row measures), the
        re-laid-out output feeding wo
      FFN: the residual h, x*rstd and the normed input: 3 x dim; then w1 x, silu(w1 x), w3 x
        and their product: 4 x hidden
    plus per-row float32 statistics (two RMSNorm rstd, SDPA's logsumexp per head).
    Qwen3 (QK-norm, head_dim x heads != dim; checked the same way): its attention keeps q and k
    before and after their norms, q, k, v as SDPA gets them (GQA: k, v not repeated) and the
    output: 4 x (q width + kv width) + the rstd of each q and k head. A MoE layer (instead of
    the FFN's 4 x hidden) keeps on the token's rank, per routed copy (k per token), the expert
    output back from the experts and its float32 weighted copy (index_add saves it), plus
    router scores; on the experts' rank (`routing` = (rows, received): expert_routing) each
    received copy as the experts read it (dim) and, per row the experts compute (the CPU path
    pads every local expert to its busiest one's capacity), its padded slot (dim) and
    4 x moe_hidden_dim (checked against the ep2 row's per-allocation peak,
    benchlib/tensor_memory.live_at). Without `routing`: perfectly balanced experts.
    `act` is the activation element size (2 under bf16, 4 in fp32); `autocast`: bf16 by
    autocast over float32 weights (not FSDP2's bf16 parameters), see the end; `compiled`: the
    block compiled (compile.enable, AC none), `float8`: its linears in float8 (tensorwise), see
    compiled_block_bytes.
    With AC, a checkpointed region keeps only its input (and, for "op", every second
    matmul's output, the 1st, 3rd, ... of the block's forward: in a Llama block wq, wv, w1 and
    w2 of wq wk wv wo w1 w3 w2, and the attention output with its logsumexp).
    Context parallelism (`cp` ranks, `tokens` this rank's share): attention keeps the keys and
    values gathered from every cp rank, not repeated to all heads (models/chunked_attention.py).
    """
    dim, kv_dim, hidden = args.dim, args.n_kv_heads * args.head_dim, args.ffn_hidden_dim
    stats = tokens * FP32 * (args.n_heads + 2)
    attention, ffn = 7 * dim, 3 * dim + 4 * hidden
    if _SDPA_GQA and kv_dim < dim:  # SDPA's enable_gqa: k, v not repeated to all heads (CPU;
        attention = 5 * dim + 2 * kv_dim  # CUDA repeats them under a document mask)
    qk_norm, n_experts = spec.qk_norm, spec.n_experts(args)
    if cp > 1:  # k, v: gathered over the window (cp x tokens), KV heads only
        attention = 5 * dim + 2 * kv_dim * cp
    if qk_norm:
        attention = 3 * dim + 4 * (args.n_heads * args.head_dim + kv_dim)
        stats += tokens * FP32 * (args.n_heads + args.n_kv_heads)
    experts = 0
    if n_experts and args.moe_every == 1:  # every block's MLP is a MoE
        k = args.n_experts_per_tok
        rows, received = routing or (tokens * k, tokens * k)
        ffn = 3 * dim + k * dim  # the residual, norms; each copy's output back from the experts
        experts = (rows * (dim + 4 * args.moe_hidden_dim) + received * dim) * act
        stats += tokens * FP32 * (2 * n_experts + k * dim)
    if mode == "full":
        return tokens * dim * act
    if mode == "selective" and option == "op":
        # block input; the 1st, 3rd, ... matmul outputs (wq, wv, w1, w2: k, wo, w3 are
        # recomputed); SDPA output (+ its logsumexp) (measured:
        # tests/integration/test_memory_scaling.py).
        # Under CP the attention is a custom Function whose inner kernels the policy does not
        # cache (parallel/ac.py): its output is rebuilt in backward, not kept.
        if cp > 1:
            return tokens * (3 * dim + kv_dim + hidden) * act
        return tokens * (4 * dim + kv_dim + hidden) * act + tokens * FP32 * args.n_heads
    if mode == "selective" and option == "ffn":
        return tokens * (attention + 3 * dim) * act + stats  # the FFN keeps only its input
    if mode == "selective" and option == "attention":  # attention keeps its input
        return tokens * (3 * dim + ffn) * act + tokens * FP32 * 2 + experts
    dense = not qk_norm and not n_experts
    if autocast and compiled and dense:
        return compiled_block_bytes(args, tokens, act, float8)
    if autocast and dense:
        # Under autocast the residual stream and the norms stay float32 (block input, residual,
        # x*rstd, the norms' outputs: 5 x dim) and each matmul keeps its own bf16 copy of its
        # input (the normed inputs, the attention output) beside q, k, v (GQA: not repeated)
        # and the FFN's 4 x hidden (measured with saved-tensor hooks, debug Llama on CPU).
        return tokens * (5 * dim * FP32 + (7 * dim + 2 * kv_dim + 4 * hidden) * act) + stats
    return tokens * (attention + ffn) * act + stats + experts


def expert_routing(args, n_experts: int, tokens: int, ep: int, imbalance: float,
                   padded: bool) -> tuple[int, int]:
    """(rows the rank's experts compute, routed copies they receive) of one MoE layer, for
    `tokens` tokens on each of the `ep` ranks, when the busiest expert gets `imbalance` x the
    balanced load (every local expert assumed that busy: the worst rank). No token picks an
    expert twice, so an expert gets at most ep x tokens, a rank at most min(k, local experts)
    copies of each token. `padded`: the CPU path (models/moe.py: every local expert padded to
    padded_capacity of the busiest load); else the grouped matmul's rows, the copies received."""
    k, n_local = args.n_experts_per_tok, n_experts // ep
    busiest = min(math.ceil(imbalance * ep * tokens * k / n_experts), ep * tokens)
    received = min(n_local * busiest, ep * tokens * min(k, n_local))
    return (n_local * padded_capacity(busiest) if padded else received), received



def compiled_block_bytes(args, tokens: int, act: int, float8: bool = False) -> int:
    """What a compiled dense Llama block keeps for backward under bf16 autocast, no AC.

    Inductor's partitioner saves the smallest set of tensors backward can rebuild the rest from,
    recomputing cheap elementwise work (norms, casts, SiLU, the float32 residual adds): listed
    with saved-tensor hooks on a compiled block (CPU, dim 256, 4 heads, 1 KV head, SwiGLU 1024:
    10,008 bytes per token, exactly this count), per token:
      float32: the block input (the attention norm's backward) and both norms' rstd
      act: q (after RoPE), k, v, SDPA's output and its logsumexp (float32 per head), as SDPA
        saves them; the w1 and w3 outputs (SiLU's and the product's backward)
      each matmul's input for its weight gradient: the two normed inputs, the attention
        output as wo reads it (a re-laid-out copy), SiLU(w1 x) * w3 x: 3 x dim + hidden in act
    Under float8 (tensorwise; listed the same way with torchao's Float8Linear, 6,936 bytes per
    token) no matmul input is kept, in float8 or otherwise: backward casts them again from the
    tensors above, and one dim-wide act tensor remains instead (2 x dim + hidden less: on the
    Llama 3.2 1B shape 24,576 bytes per token and block, the H200's measured difference).
    Eager autocast keeps more: the float32 residual h and the norms' float32 outputs, and a
    bf16 copy of each matmul input beside its float32 source (activation_bytes_per_block)."""
    dim, kv_dim, hidden = args.dim, args.n_kv_heads * args.head_dim, args.ffn_hidden_dim
    matmul_inputs = dim if float8 else 3 * dim + hidden
    return tokens * (dim * FP32 + (2 * dim + 2 * kv_dim + 2 * hidden + matmul_inputs) * act
                     + FP32 * (2 + args.n_heads))



def backward_workspace_bytes(args, tokens: int, act: int) -> int:
    """The working tensors of one block's backward beyond what forward saved: the gradients
    flowing through its FFN (two [tokens, hidden] at once) (measured on CPU, debug Llama: the
    peak inside a block's backward is this above the saved and rebuilt tensors)."""
    return 2 * tokens * args.ffn_hidden_dim * act


def lora_activation_bytes(model: LanguageModel, lcfg, ac_mode: str, tokens: int, act: int) -> int:
    """What one block's adapters keep for backward (the [lora] section `lcfg` enabled, AC mode
    `ac_mode` none): each A's output (rank per token) for B, and with lora.dropout each dropped
    input and its mask (1 byte)."""
    if not lcfg.enable or ac_mode != "none":
        return 0
    wrapped = [m for m in model.layers["0"].modules() if isinstance(m, LoRALinear)]
    dropout = lcfg.dropout > 0
    return sum(tokens * (m.rank * act + dropout * m.in_features * (act + 1)) for m in wrapped)



def loss_bytes(tcfg, act: int, tokens: int, model_args, pipelined: bool,
               compiled: bool = False, tp: int = 1) -> tuple[int, int, int]:
    """(kept for backward, extra at the end of the loss's forward, extra in its backward) for
    the output head and loss of `tokens` tokens, by loss path (torchllm/loss.py; measured):
      chunked_loss  nothing kept; one chunk's logits, their float32 copy and log-softmax in
                    forward; in backward the float32 head-weight gradient, the hidden states'
                    gradient and the larger of: a chunk's float32 softmax beside its gradient,
                    or that gradient beside the chunk's head-weight gradient before it is added
                    (a [vocab, dim] product in the activations' dtype, and its float32 copy)
      bf16 logits   up to loss._PLAIN_MAX_BYTES in float32 (loss.plain_kernels): as float32
                    logits, plus the bf16 logits beside their float32 copy in forward (their
                    bf16 gradient comes after the float32 ones are freed); larger: the
                    chunked cross entropy keeps the logits and backward writes their gradient
                    once (float32 a few MiB at a time)
      fp32 logits   log-softmax keeps its float32 output (the logits are freed after the loss,
                    unless a pipeline stage keeps its output); in forward both exist at once;
                    backward adds d(log-softmax) and d(logits)
      compiled      (`compiled`: the loss compiled, no pipeline) the logits in their dtype are
                    kept, their gradient written once in backward
      tensor parallel (`tp` > 1: the head's output sharded by vocabulary, loss.py's
                    vocab-parallel cross entropy) each rank keeps its [tokens, vocab/tp] logits
                    and a float32 log-sum-exp per token; backward writes their gradient and,
                    beside it, one chunk of softmax (loss._CHUNK_BYTES: all of a small shard)"""
    vocab, dim = model_args.vocab_size, model_args.dim
    if tp > 1 and not tcfg.chunked_loss:
        local = tokens * -(-vocab // tp)
        chunk = min(local * FP32, max(loss_module._CHUNK_BYTES, FP32 * -(-vocab // tp)))
        return local * act + tokens * FP32, 0, local * act + chunk
    if tcfg.chunked_loss:
        chunk = min(tcfg.loss_chunk_tokens, tokens) * vocab
        weight_product = vocab * dim * (act + (FP32 if act != FP32 else 0))
        return (0, chunk * (act + 2 * FP32),
                max(chunk * FP32, weight_product) + chunk * act + vocab * dim * FP32
                + tokens * dim * act)
    vocab_tokens = tokens * vocab
    if compiled:
        # compile.components has "loss": inductor fuses the float32 log-softmax into its
        # kernels (no float32 copy of the logits); forward keeps the logits as the head wrote
        # them and two float32 numbers per token, backward writes their gradient once.
        return vocab_tokens * act + 2 * tokens * FP32, 0, vocab_tokens * act
    if act != FP32 and not plain_kernels(vocab_tokens):
        return vocab_tokens * act, 0, vocab_tokens * act
    extra = 0 if act == FP32 else vocab_tokens * act  # bf16 logits beside their float32 copy
    kept = vocab_tokens * FP32 * (2 if pipelined else 1)
    return kept, vocab_tokens * FP32 * (0 if pipelined else 1) + extra, 2 * vocab_tokens * FP32
