"""Model code and the registry that names it. Importing this package registers every family.

A family is one folder (models/<family>/) whose `__init__` defines its ModelSpec; adding one
is that folder and one line here (docs/howto_model_family.md).
"""

from torchllm.models import gpt2, llama, qwen3
from torchllm.models.registry import (
    ModelSpec, adapter_for_hf, adapter_for_model, check_family, get, hf_adapters, model_args,
    padded_vocab_size, register, spec_of,
)

register(llama.SPEC)
register(gpt2.SPEC)
register(qwen3.SPEC)
register(qwen3.MOE_SPEC)

__all__ = ["ModelSpec", "adapter_for_hf", "adapter_for_model", "check_family", "get",
           "hf_adapters", "model_args", "padded_vocab_size", "register", "spec_of"]
