"""Llama 3 family: args and flavors, model, HF adapter (hf.py), parallel plans (plan.py)."""

from torchllm.models.kv_cache import KVCache
from torchllm.models.llama.args import LlamaArgs, flavors
from torchllm.models.llama.config import LlamaConfig
from torchllm.models.llama.hf import LlamaAdapter
from torchllm.models.llama.model import Transformer
from torchllm.models.llama.plan import PIPELINE, TP_PLAN
from torchllm.models.spec import ModelSpec

SPEC = ModelSpec(
    name="llama3", model_cls=Transformer, flavors=flavors,
    config=LlamaConfig,
    cache_cls=KVCache, hf_adapter=LlamaAdapter, tp_plan=TP_PLAN, pipeline=PIPELINE,
    lora_targets=("wq", "wk", "wv", "wo", "w1", "w2", "w3"),
)

__all__ = ["SPEC", "LlamaArgs", "Transformer", "flavors"]
