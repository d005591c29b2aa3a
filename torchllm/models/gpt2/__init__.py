"""GPT-2 family: args and flavors, model, HF adapter (hf.py), tensor-parallel plan (plan.py)."""

from torchllm.models.gpt2.args import GPT2Args, flavors
from torchllm.models.gpt2.config import GPT2Config
from torchllm.models.gpt2.hf import GPT2Adapter
from torchllm.models.gpt2.model import GPT2
from torchllm.models.gpt2.plan import TP_PLAN
from torchllm.models.kv_cache import KVCache
from torchllm.models.spec import ModelSpec

SPEC = ModelSpec(
    name="gpt2", model_cls=GPT2, flavors=flavors,
    config=GPT2Config,
    cache_cls=KVCache, hf_adapter=GPT2Adapter, tp_plan=TP_PLAN,
    lora_targets=("wq", "wk", "wv", "wo", "w1", "w2"),
)

__all__ = ["SPEC", "GPT2", "GPT2Args", "flavors"]
