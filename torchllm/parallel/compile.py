"""torch.compile per transformer block (or of the whole model: compile.granularity), and of
the loss.

Compiling each block (not the whole model) keeps compile time to one block's worth (all blocks
share the compiled code) and leaves FSDP2's per-block hooks outside the graphs, so sharding,
checkpointing and compilation compose; fullgraph=True makes any graph break an error instead
of a silent slowdown.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from torchllm.config.job_config import ConfigError
from torchllm.loss import cross_entropy_sum, fused_cross_entropy_sum
from torchllm.models.contract import LanguageModel

COMPONENTS = ("model", "loss")


def check_components(ccfg) -> None:
    unknown = [c for c in ccfg.components if c not in COMPONENTS]
    if unknown:
        raise ConfigError(
            f"compile.components has {unknown}; allowed: {', '.join(COMPONENTS)}",
            "compile.components",
        )


def apply_compile(model: LanguageModel, ccfg, inductor_options: dict | None = None) -> int:
    """Replace every block by its compiled version (in place); returns how many.

    `inductor_options` are inductor config keys for these graphs only (torch.compile's
    `options`), never set on the process-wide config; other backends take none."""
    options = dict(inductor_options or {}) if ccfg.backend == "inductor" else {}
    if getattr(ccfg, "cudagraphs", False):  # (check_levers: CUDA + inductor only)
        options["triton.cudagraphs"] = True
    options = {"options": options} if options else {}
    if getattr(ccfg, "granularity", "block") == "model":
        # One graph for the whole forward (embedding, blocks, head): nn.Module.compile keeps
        # the module (its parameter names and state dict) and compiles its call.
        model.compile(backend=ccfg.backend, fullgraph=True, **options)
        return len(model.layers)
    for name, block in list(model.layers.items()):
        model.layers[name] = torch.compile(block, backend=ccfg.backend, fullgraph=True, **options)
    return len(model.layers)


def build_loss_fn(ccfg):
    """The training loss (summed float32 cross entropy): compiled when asked (inductor fuses
    the float32 log-softmax into one pass), else the eager fused version, which reads the
    logits a chunk at a time instead of writing float32 copies of them (loss.py)."""
    if ccfg.enable and "loss" in ccfg.components:
        compiled = torch.compile(cross_entropy_sum, backend=ccfg.backend)
        # TP's vocab-sharded logits (a DTensor) take the eager vocab-parallel loss: its
        # all-reduces stay outside the graph.
        return lambda logits, targets: (
            cross_entropy_sum(logits, targets) if isinstance(logits, DTensor)
            else compiled(logits, targets))
    return fused_cross_entropy_sum
