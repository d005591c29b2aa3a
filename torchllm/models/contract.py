"""The model contract: what code outside models/ may touch on a model.

The trainer, the parallel plans (torchllm.parallel), the Hugging Face exporter and loader,
LoRA and the estimators (torchllm.tools, metrics.flops) read a model only through the members
named here; a family's model (models/<family>/model.py) provides every one of them, and
`ModelSpec.build` refuses one that does not (tests/unit/models/test_model_contract.py checks every
registered family). Anything else on a model -- its blocks' insides, its buffers, its position
scheme -- is the family's own: code outside models/ reaches it through a method below, or
through the family's declared data (ModelSpec: TPPlan, PipelinePlan, lora_targets, hf_adapter).

State-dict names follow the members: `tok_embeddings.weight`, `layers.<i>.<name inside the
block>`, `norm.*`, `output.weight` (what checkpoints, vocab growth and the adapters map).
"""

from __future__ import annotations

from typing import Any, Callable, Protocol, runtime_checkable

import torch
from torch import nn


@runtime_checkable
class ModelArgs(Protocol):
    """The shape a family's args dataclass reports (its other fields are the family's own)."""

    vocab_size: int  # padded vocab: rows of tok_embeddings (and output)
    dim: int  # width of the residual stream
    n_layers: int  # blocks in `layers`
    n_heads: int
    n_kv_heads: int  # = n_heads for multi-head attention
    head_dim: int
    max_seq_len: int  # the longest sequence forward accepts
    tie_embeddings: bool  # True: no `output`; the head reads tok_embeddings' table


@runtime_checkable
class LanguageModel(Protocol):
    """Token ids [batch, seq] -> logits [batch, seq, vocab] (or the summed loss with targets).

    A pipeline stage (torchllm.parallel.pipeline) is the same model with some members None:
    `tok_embeddings` on every stage but the first, `norm` and `output` on every stage but the
    last, and only its own blocks in `layers`.
    """

    args: ModelArgs
    tok_embeddings: nn.Module | None  # the token table (`.weight` [vocab_size, dim])
    layers: nn.ModuleDict  # the blocks, keyed "0" .. str(n_layers - 1), in order
    norm: nn.Module | None  # the final norm
    output: nn.Module | None  # the head (`.weight` [vocab_size, dim]); None when tied

    def forward(self, tokens: torch.Tensor, cache: Any = None,
                targets: torch.Tensor | None = None, loss_chunk_tokens: int = 4096,
                layout: Any = None, loss_impl: str = "torch") -> torch.Tensor: ...

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """Initialize every parameter and buffer in place (after `to_empty`)."""

    def init_buffers(self, device: torch.device) -> None:
        """Recompute the non-persistent buffers (e.g. a RoPE table) onto `device` after
        `to_empty`, as a single process's CPU build computes them (pipeline stages)."""

    def set_kv_gather(self, gather: Callable[[torch.Tensor, int], torch.Tensor] | None
                      ) -> None:
        """Context parallelism: `gather(t, dim)` concatenates every cp rank's keys/values
        (and key indices) along dim; every attention of the model uses it."""


def _members(protocol: type) -> tuple[str, ...]:
    """A Protocol's declared attributes, then its methods, in the order written."""
    methods = [n for n, v in vars(protocol).items() if callable(v) and not n.startswith("_")]
    return (*protocol.__annotations__, *methods)


MEMBERS = _members(LanguageModel)
ARGS_MEMBERS = _members(ModelArgs)


def missing_members(model: object) -> list[str]:
    """The contract members `model` lacks (its args' too, as `args.<name>`); [] when it has all."""
    missing = [m for m in MEMBERS if not hasattr(model, m)]
    if "args" not in missing:
        missing += [f"args.{m}" for m in ARGS_MEMBERS if not hasattr(model.args, m)]
    return missing


def check_model(model: object, family: str) -> LanguageModel:
    """`model`, or a ValueError naming the members of the contract it lacks."""
    missing = missing_members(model)
    if missing:
        raise ValueError(
            f"model {family!r}: {type(model).__name__} lacks {', '.join(missing)} of the model "
            "contract (torchllm/models/contract.py LanguageModel); add them "
            "(docs/howto_model_family.md)")
    return model  # type: ignore[return-value]


__all__ = ["ARGS_MEMBERS", "LanguageModel", "MEMBERS", "ModelArgs", "check_model",
           "missing_members"]
