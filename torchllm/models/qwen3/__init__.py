"""Qwen3 family, dense ("qwen3") and mixture-of-experts ("qwen3_moe"): args and flavors, model,
HF adapters (hf.py), parallel plans (plan.py)."""

from torchllm.models.kv_cache import KVCache
from torchllm.models.qwen3.args import Qwen3Args, flavors, moe_flavors
from torchllm.models.qwen3.config import Qwen3Config
from torchllm.models.qwen3.hf import Qwen3Adapter, Qwen3MoeAdapter
from torchllm.models.qwen3.model import Qwen3
from torchllm.models.qwen3.plan import PIPELINE, TP_PLAN
from torchllm.models.spec import ModelSpec

SPEC = ModelSpec(
    name="qwen3", model_cls=Qwen3, flavors=flavors, config=Qwen3Config, cache_cls=KVCache,
    hf_adapter=Qwen3Adapter, tp_plan=TP_PLAN, pipeline=PIPELINE, qk_norm=True,
    lora_targets=("wq", "wk", "wv", "wo", "w1", "w2", "w3"),
)
# MoE: LoRA on the attention's linears (the experts are batched weights, not nn.Linear layers).
MOE_SPEC = ModelSpec(
    name="qwen3_moe", model_cls=Qwen3, flavors=moe_flavors, config=Qwen3Config,
    cache_cls=KVCache, hf_adapter=Qwen3MoeAdapter, tp_plan=TP_PLAN, pipeline=PIPELINE, moe=True,
    qk_norm=True,
    lora_targets=("wq", "wk", "wv", "wo"),
)

__all__ = ["MOE_SPEC", "SPEC", "Qwen3", "Qwen3Args", "flavors", "moe_flavors"]
