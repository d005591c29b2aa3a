"""Qwen3's parallel plans, as data: Llama's, plus QK-norm and (MoE) replicated experts.

QK-norm (`attention.q_norm` / `k_norm`, one RMSNorm of size head_dim shared by all heads) runs
on the head-sharded q/k. A mixture-of-experts MLP is replicated over tp instead of split (see
torchllm.parallel.tp); expert parallelism is the way to split experts.
"""

from torchllm.models.llama.plan import ATTENTION, PIPELINE, SWIGLU, TOP
from torchllm.models.spec import TPPlan

QK_NORM = {"attention.q_norm": "head_norm", "attention.k_norm": "head_norm"}

TP_PLAN = TPPlan(
    top=TOP,
    block={**ATTENTION, **SWIGLU, **QK_NORM},
    moe_block={**ATTENTION, "feed_forward": "replicated_moe", **QK_NORM},
    attention_inputs=2,
)

__all__ = ["PIPELINE", "TP_PLAN"]
