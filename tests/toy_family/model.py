"""Llama with a fused SwiGLU: w2(silu(gate) * up) where [gate; up] = w13 x."""

import torch.nn.functional as F
from torch import nn

from torchllm.models.llama import model as llama


class FusedSwiGLU(nn.Module):
    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w13 = nn.Linear(dim, 2 * hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)

    def forward(self, x):
        gate, up = self.w13(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)

    def init_weights(self, out_scale: float) -> None:
        llama._init_linear(self.w13)
        llama._init_linear(self.w2, out_scale)


class ToyBlock(llama.TransformerBlock):
    def build_mlp(self, layer_id: int, args) -> nn.Module:
        return FusedSwiGLU(args.dim, args.ffn_hidden_dim)


class ToyTransformer(llama.Transformer):
    block_cls = ToyBlock
