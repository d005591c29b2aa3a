"""Llama's parallel plans, as data the parallel code reads (torchllm.parallel.tp, .pipeline).

Tensor parallelism (Megatron-style, with sequence parallelism): the vocab-sharded embedding's
output is reduce-scattered onto the sequence dim; wq/wk/wv split by output columns (by heads),
wo by input rows; the FFN's w1/w3 by columns and w2 by rows; the norms run on the sequence
shards between those regions. The attention takes (x, the RoPE table).
"""

from torchllm.models.spec import PipelinePlan, TPPlan

TOP = {"tok_embeddings": "vocab_embedding", "norm": "sequence", "output": "logits"}
ATTENTION = {
    "attention_norm": "sequence",
    "attention": "attention_input",
    "attention.wq": "colwise",
    "attention.wk": "colwise",
    "attention.wv": "colwise",
    "attention.wo": "rowwise",
    "ffn_norm": "sequence",
}
SWIGLU = {
    "feed_forward": "gather_input",
    "feed_forward.w1": "colwise",
    "feed_forward.w2": "rowwise",
    "feed_forward.w3": "colwise",
}

TP_PLAN = TPPlan(top=TOP, block={**ATTENTION, **SWIGLU}, attention_inputs=2)
PIPELINE = PipelinePlan(first=("tok_embeddings",), last=("norm", "output"))
