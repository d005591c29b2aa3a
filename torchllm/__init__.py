"""torchllm: config-driven pre-training of Llama-style language models in plain PyTorch."""

__version__ = "0.1.0"
