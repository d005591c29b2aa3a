"""Speed levers of one training step, each behind a config key (docs/gpu.md, "Speed levers"):

  training.cast_weights_once   linear weights cast to bf16 once per optimizer step (cast_once.py)
  training.chunked_loss_impl   the chunked loss's kernel: torch | liger (torchllm.loss)
  compile.granularity          block | model (torchllm.parallel.compile)
  compile.cudagraphs           CUDA graphs for the compiled graphs (CUDA only)
  model.sdpa_backend           which SDPA kernels attention may use

`check_levers` refuses what cannot work here in one line naming what does; `StepLevers` is what
the trainer wraps a step (`step()`) and each micro-step (`micro_step()`) in.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from torchllm.config.job_config import ConfigError
from torchllm.parallel.cast_once import CastWeightsOnce

SDPA_BACKENDS = {"cudnn": "CUDNN_ATTENTION", "flash": "FLASH_ATTENTION",
                 "efficient": "EFFICIENT_ATTENTION", "math": "MATH"}
CUDA_ONLY_SDPA = ("cudnn", "efficient")


def single_device(dims) -> bool:
    return not (dims.fsdp_enabled or dims.ddp_enabled or dims.tp_enabled or dims.pp_enabled
                or dims.cp_enabled or dims.ep_enabled)


def check_levers(tcfg, ccfg, fcfg, mcfg, dims, device_type: str) -> None:
    """Every lever the [training], [compile] and [model] sections ask for must work on this
    device and layout, and with [float8] `fcfg` (else a one-line ConfigError)."""
    if tcfg.cast_weights_once:
        if not single_device(dims):
            raise ConfigError(
                "training.cast_weights_once is for one device: under FSDP2 its mixed-precision "
                "policy casts the gathered weights already, and DDP/TP/PP hook the weights it "
                "swaps; set it to false", "training.cast_weights_once")
        if fcfg.enable:
            raise ConfigError(
                "training.cast_weights_once with float8.enable: float8 casts the weights itself; "
                "turn one of them off", "training.cast_weights_once")
    if tcfg.chunked_loss_impl == "liger":
        from torchllm.loss import liger_available

        if device_type != "cuda":
            raise ConfigError(
                "training.chunked_loss_impl = 'liger' needs CUDA (Triton kernels); use 'torch', "
                "which runs the same chunked loss on every device", "training.chunked_loss_impl")
        if not liger_available():
            raise ConfigError(
                "training.chunked_loss_impl = 'liger' needs liger-kernel (pip install "
                "liger-kernel); or use 'torch'", "training.chunked_loss_impl")
        if dims.pp_enabled:
            raise ConfigError(
                "training.chunked_loss_impl = 'liger' does not run in pipeline stages yet; use "
                "'torch'", "training.chunked_loss_impl")
        if not tcfg.chunked_loss:
            raise ConfigError(
                "training.chunked_loss_impl = 'liger' needs training.chunked_loss = true (the "
                "loss computed inside the model)", "training.chunked_loss_impl")
    if ccfg.granularity == "model" and ccfg.enable and "model" in ccfg.components:
        if not single_device(dims):
            raise ConfigError(
                "compile.granularity = 'model' is for one device: FSDP2/DDP/TP/PP hooks would "
                "break the single graph; use 'block'", "compile.granularity")
    if ccfg.cudagraphs:
        if device_type != "cuda":
            raise ConfigError(
                "compile.cudagraphs = true needs CUDA (CUDA graphs); on CPU leave it false "
                "(compile.enable with compile.granularity = 'block' or 'model' works here)",
                "compile.cudagraphs")
        if not ccfg.enable or ccfg.backend != "inductor":
            raise ConfigError(
                "compile.cudagraphs = true needs compile.enable = true and compile.backend = "
                "'inductor'", "compile.cudagraphs")
    backend = mcfg.sdpa_backend
    if backend in CUDA_ONLY_SDPA and device_type != "cuda":
        raise ConfigError(
            f"model.sdpa_backend = '{backend}' needs CUDA; on CPU use 'auto', 'flash' or 'math'",
            "model.sdpa_backend")
    if backend != "auto" and mcfg.attention != "sdpa":
        raise ConfigError(
            f"model.sdpa_backend = '{backend}' applies to model.attention = 'sdpa' (it is "
            f"'{mcfg.attention}'); leave it 'auto'", "model.sdpa_backend")


def sdpa_context(backend: str):
    """The SDPA kernels attention may use for `backend` (auto: torch's own choice)."""
    if backend == "auto":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([getattr(SDPBackend, SDPA_BACKENDS[backend])])


class OwnGradients:
    """Under CUDA graphs, a parameter's first gradient of a step would be the graph's own output
    memory (AccumulateGrad keeps the tensor it is given when .grad is None), which the next
    micro-step's replay overwrites: "accessing tensor output of CUDAGraphs that has been
    overwritten by a subsequent run". A post-accumulate hook copies such a gradient into memory
    of its own once per step; later micro-steps add into that copy in place."""

    def __init__(self, model: nn.Module):
        self.owned: dict[nn.Parameter, torch.Tensor] = {}
        self.handles = [p.register_post_accumulate_grad_hook(self._own)
                        for p in model.parameters() if p.requires_grad]

    def _own(self, p: torch.Tensor) -> None:
        if self.owned.get(p) is not p.grad:
            p.grad = p.grad.clone()
            self.owned[p] = p.grad

    def new_step(self) -> None:
        self.owned.clear()


class StepLevers:
    """What the trainer wraps its steps in for the levers that act at run time."""

    def __init__(self, model: nn.Module, bf16: bool, device_type: str, *,
                 cast_weights_once: bool, sdpa_backend: str, cudagraphs: bool):
        """The levers training.cast_weights_once, model.sdpa_backend and compile.cudagraphs
        ask for."""
        self.cast = CastWeightsOnce(model) if cast_weights_once and bf16 else None
        self.sdpa_backend = sdpa_backend
        self.cudagraphs = cudagraphs and device_type == "cuda"
        self.grads = OwnGradients(model) if self.cudagraphs else None

    @contextlib.contextmanager
    def step(self):
        """Around the forward and backward passes of one optimizer step."""
        if self.grads is not None:
            self.grads.new_step()
        with sdpa_context(self.sdpa_backend), (self.cast() if self.cast else
                                               contextlib.nullcontext()):
            yield

    def micro_step(self) -> None:
        """Before each micro-step's forward: a new CUDA-graph generation (the previous
        micro-step's graph outputs have been consumed: the loss is summed, gradients owned)."""
        if self.cudagraphs:
            torch.compiler.cudagraph_mark_step_begin()
