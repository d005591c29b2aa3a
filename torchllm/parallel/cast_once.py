"""training.cast_weights_once: bf16 weights made once per optimizer step, as FSDP2's
MixedPrecisionPolicy(param_dtype=bf16) does, on one device.

Under autocast every use of a float32 weight casts it to bf16: once per micro-step for each
linear (a read of 4 and a write of 2 bytes per parameter), and the bf16 gradient of that cast is
cast back to float32 (written: 4 bytes) before AccumulateGrad adds it to `.grad` in float32
(12 bytes more). With gradient accumulation (llama3_1b.toml: 64 micro-steps per step) that add
is the eager `CUDAFunctor_add<float>` kernel the first H200 profile found at 3.5% of the step.

Here, inside `with cast():`, each nn.Linear's weight is a persistent bf16 leaf that holds
`weight.to(bf16)` (copied once at the start of the step), so autocast has nothing to cast; its
bf16 gradient is added into the float32 master's `.grad` by a post-accumulate hook (one kernel
reading 2 + 4 bytes and writing 4; float32 arithmetic, so the same sums as autocast's path).
A tied output head (the model's `output` is None) reads `tok_embeddings.cast_weight` the same
way (torchllm.models.head), while the embedding lookup keeps the float32 table (no cast there
under autocast either). Outside the context the model is exactly as built (evaluation,
checkpoints and the optimizer see the float32 parameters).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from torchllm.models.contract import LanguageModel


def _accumulate(master: nn.Parameter, cast: torch.Tensor) -> None:
    """Post-accumulate hook of a bf16 copy: its gradient, added into the master's (float32)."""
    grad, cast.grad = cast.grad, None
    if master.grad is None:
        master.grad = grad.to(master.dtype)
    else:
        master.grad.add_(grad)


class CastWeightsOnce:
    def __init__(self, model: LanguageModel, dtype: torch.dtype = torch.bfloat16):
        self.dtype = dtype
        self.slots: list[tuple[nn.Module, str, nn.Parameter, torch.Tensor]] = []
        for module in model.modules():
            if type(module) is nn.Linear:  # (Float8Linear is refused by check_levers)
                self._add(module, "weight", module.weight)
        emb = model.tok_embeddings  # (None: a later pipeline stage)
        if emb is not None and model.output is None:  # a tied head
            self._add(emb, "cast_weight", emb.weight)

    def _add(self, module: nn.Module, attr: str, master: nn.Parameter) -> None:
        cast = nn.Parameter(torch.empty_like(master, dtype=self.dtype),
                            requires_grad=master.requires_grad)
        if master.requires_grad:
            cast.register_post_accumulate_grad_hook(lambda t, m=master: _accumulate(m, t))
        self.slots.append((module, attr, master, cast))

    @contextlib.contextmanager
    def __call__(self):
        """The model with its linear weights as bf16 copies of this step's float32 weights."""
        with torch.no_grad():
            torch._foreach_copy_([c for *_, c in self.slots], [m for _, _, m, c in self.slots])
        try:
            for module, attr, _, cast in self.slots:
                if attr == "weight":
                    module._parameters[attr] = cast
                else:  # a plain attribute, not a registered parameter
                    module.__dict__[attr] = cast
            yield
        finally:
            for module, attr, master, _ in self.slots:
                if attr == "weight":
                    module._parameters[attr] = master
                else:
                    module.__dict__.pop(attr, None)

