"""GPT-2's tensor-parallel plan, as data (torchllm.parallel.tp reads it).

Llama's plan where GPT-2 has the same modules; it differs in the learned position table
(sharded on the sequence dim like the token embeddings: its rows are the positions), an
attention that takes no RoPE table, and a two-matrix MLP (no w3). No pipeline plan: the stages
would need the position table beside the embedding.
"""

from torchllm.models.llama.plan import ATTENTION, TOP
from torchllm.models.spec import TPPlan

TP_PLAN = TPPlan(
    top={**TOP, "pos_embeddings": "position_embedding"},
    block={**ATTENTION, "feed_forward": "gather_input", "feed_forward.w1": "colwise",
           "feed_forward.w2": "rowwise"},
    attention_inputs=1,
)
