"""Qwen3 family: dense ("qwen3") and mixture-of-experts ("qwen3_moe")."""

from torchllm.models.qwen3.args import Qwen3Args, flavors, moe_flavors
from torchllm.models.qwen3.model import Qwen3
from torchllm.models.registry import ModelSpec, register
from torchllm.parallel.parallelize import parallelize_llama

register(ModelSpec(name="qwen3", model_cls=Qwen3, flavors=flavors,
                   parallelize_fn=parallelize_llama,
                   lora_targets=("wq", "wk", "wv", "wo", "w1", "w2", "w3")))
# MoE: the attention's linears (the experts are batched weights, not nn.Linear layers).
register(ModelSpec(name="qwen3_moe", model_cls=Qwen3, flavors=moe_flavors,
                   parallelize_fn=parallelize_llama, lora_targets=("wq", "wk", "wv", "wo")))

__all__ = ["Qwen3", "Qwen3Args", "flavors", "moe_flavors"]
