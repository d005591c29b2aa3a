"""Model code and the registry that names it. Importing this package registers every family."""

from torchllm.models import gpt2, llama, qwen3  # noqa: F401  (registers every family)
from torchllm.models.registry import ModelSpec, get, model_args, padded_vocab_size, register

__all__ = ["ModelSpec", "get", "model_args", "padded_vocab_size", "register"]
