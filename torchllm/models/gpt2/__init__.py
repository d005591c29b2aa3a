"""GPT-2 family, registered as "gpt2" with the same parallelize function as Llama."""

from torchllm.models.gpt2.args import GPT2Args, flavors
from torchllm.models.gpt2.model import GPT2
from torchllm.models.registry import ModelSpec, register
from torchllm.parallel.parallelize import parallelize_llama

register(ModelSpec(name="gpt2", model_cls=GPT2, flavors=flavors, parallelize_fn=parallelize_llama,
                   lora_targets=("wq", "wk", "wv", "wo", "w1", "w2")))

__all__ = ["GPT2", "GPT2Args", "flavors"]
