"""The toy family's flavors: Llama's args (the fused MLP needs no new field)."""

from torchllm.models.llama.args import LlamaArgs

flavors = {"debug": LlamaArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=96,
                              vocab_size=2048)}
