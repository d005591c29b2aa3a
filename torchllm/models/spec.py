"""What a model family declares: the `ModelSpec` the registry names, and the plans the parallel
code reads.

A family is one folder (`torchllm/models/<family>/`): its args and flavors, its model, its
Hugging Face adapter, and the declared data below. The parallel code (torchllm.parallel) and
the tools read these declarations and never probe a model's attributes; models import nothing
from parallel/.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from torch import nn

from torchllm.models.contract import LanguageModel, check_model

# The tensor-parallel styles a TPPlan may name; torchllm.parallel.tp says what each does.
TP_STYLES = (
    "vocab_embedding",      # token table sharded by vocab rows; output sharded on the sequence
    "position_embedding",   # learned position table [seq, dim]: output sharded on dim 0
    "sequence",             # a norm run on the sequence-sharded residual stream
    "logits",               # the output head: logits sharded by vocabulary (a DTensor)
    "attention_input",      # the attention: x all-gathered from the sequence shards, its other
                            # (attention_inputs - 1) inputs passed as they are
    "gather_input",         # a module whose one input is all-gathered from the sequence shards
    "colwise",              # a linear split by output features (heads, MLP width)
    "rowwise",              # a linear split by input features; output reduce-scattered
    "head_norm",            # a norm run on head-sharded q/k [b, s, h, d] (QK-norm)
    "replicated_moe",       # a mixture of experts replicated over tp (gathered in, cut back out)
)


@dataclass(frozen=True)
class TPPlan:
    """Tensor parallelism as data: module name -> style (one of TP_STYLES).

    `top` names modules of the model, `block` (and `moe_block`, for the blocks whose MLP is a
    mixture of experts: `args.is_moe_layer(i)`) modules inside each `layers.<i>`. The order of
    each mapping is the order the styles are applied in. `attention_inputs` is the number of
    positional inputs the block's attention takes (x, then e.g. the RoPE table): all but the
    first pass through unchanged.
    """

    top: Mapping[str, str]
    block: Mapping[str, str]
    moe_block: Mapping[str, str] | None = None
    attention_inputs: int = 1

    def __post_init__(self):
        for plan in (self.top, self.block, self.moe_block or {}):
            bad = sorted(set(plan.values()) - set(TP_STYLES))
            if bad:
                raise ValueError(f"TPPlan: unknown style(s) {bad}; known: {', '.join(TP_STYLES)}")

    def block_plan(self, args, layer_id: int) -> Mapping[str, str]:
        if self.moe_block is not None and args.is_moe_layer(layer_id):
            return self.moe_block
        return self.block

    @property
    def learned_positions(self) -> bool:
        """A learned position table, sharded along one sequence shared by every document."""
        return "position_embedding" in self.top.values()


@dataclass(frozen=True)
class PipelinePlan:
    """How the model splits into pipeline stages: the blocks (`layers`, a ModuleDict keyed by
    block index) are cut between stages; `first` are the model's modules only the first stage
    keeps (the embedding), `last` those only the last keeps (final norm, head)."""

    first: tuple[str, ...] = ("tok_embeddings",)
    last: tuple[str, ...] = ("norm", "output")


@dataclass(frozen=True)
class ModelSpec:
    name: str
    model_cls: Callable[[Any], nn.Module]
    flavors: dict[str, Any]
    # The family's own [model] keys: a dataclass of opt() fields (models/<family>/config.py),
    # each a field of its args that the key replaces (unset = the flavor's value); None: none.
    config: type | None
    # The generation cache: cache_cls(max_len), passed to model(tokens, cache) when decoding.
    cache_cls: Callable[[int], Any]
    # To / from transformers (config.json, checks, state-dict mapping); None: no HF interop.
    hf_adapter: Any = None
    # Tensor parallelism; None: the family cannot run with tensor_parallel_degree > 1.
    tp_plan: TPPlan | None = None
    # Pipeline parallelism; None: the family cannot run with pipeline_parallel_degree > 1.
    pipeline: PipelinePlan | None = None
    # A mixture-of-experts family: args.n_experts experts per MoE layer (expert parallelism).
    moe: bool = False
    # Attention RMS-normalizes each query and key head (QK-norm): what its blocks keep for
    # backward (torchllm/tools/estimate_memory.py counts the normed copies).
    qk_norm: bool = False
    # The linear layers (their names inside a block) lora.target_modules may name (models/lora.py).
    lora_targets: tuple[str, ...] = ()

    @property
    def shape_keys(self) -> tuple[str, ...]:
        """The names of the family's own [model] keys."""
        return tuple(f.name for f in dataclasses.fields(self.config)) if self.config else ()

    def build(self, args) -> LanguageModel:
        """The family's model for `args`; refused (ValueError) if it lacks a member of the
        model contract (models/contract.py)."""
        return check_model(self.model_cls(args), self.name)

    def n_experts(self, args) -> int:
        return args.n_experts if self.moe else 0
