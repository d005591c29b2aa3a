"""Llama 3 family."""

from torchllm.models.llama.args import LlamaArgs, flavors
from torchllm.models.llama.model import Transformer
from torchllm.models.registry import ModelSpec, register
from torchllm.parallel.parallelize import parallelize_llama

register(
    ModelSpec(name="llama3", model_cls=Transformer, flavors=flavors,
              parallelize_fn=parallelize_llama,
              lora_targets=("wq", "wk", "wv", "wo", "w1", "w2", "w3"))
)

__all__ = ["LlamaArgs", "Transformer", "flavors"]
