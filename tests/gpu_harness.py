"""The GPU tests' harness: the fp32 CPU reference, the loop, the comparison, the preparations.

Shared by tests/test_gpu.py (marked `gpu`) and tests/test_gpu_harness.py (its CPU tests).
See tests/test_gpu.py for the oracle and the tolerances.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from conftest import build_model
from torchllm import models
from torchllm.config import load_config

STEPS, BATCH, SEQ, VOCAB, LR = 20, 4, 32, 512, 3e-3
CPU_STEPS = 4  # the CPU tests of the harness: this machine class is slow
TOLERANCE = {"fp32": (1e-3, 1e-3), "tf32": (1e-2, 1e-2), "bf16": (3e-2, 5e-2),
             "float8": (6e-2, 1e-1)}

# -- the harness (CPU-testable) -------------------------------------------------------------

def debug_args():
    return dataclasses.replace(models.get("llama3").flavors["debug"], vocab_size=VOCAB,
                               max_seq_len=SEQ)


def make_batches(steps: int = STEPS, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Sequences start + stride·t (mod vocab), start and stride (1..4) random per row: the next
    token follows from the last two, so a model can learn it in a few steps."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        start = torch.randint(0, VOCAB, (BATCH, 1), generator=g)
        stride = torch.randint(1, 5, (BATCH, 1), generator=g)
        seq = (start + stride * torch.arange(SEQ + 1)) % VOCAB
        out.append((seq[:, :-1].contiguous(), seq[:, 1:].contiguous()))
    return out


def initial_state() -> dict[str, torch.Tensor]:
    from torchllm.models.llama.model import Transformer

    return {k: v.clone() for k, v in build_model(Transformer, debug_args(), seed=0)
            .state_dict().items()}


def meta_model():
    from torchllm.models.llama.model import Transformer

    with torch.device("meta"):
        return Transformer(debug_args())


def materialize(model, device, state: dict) -> None:
    """to_empty + buffers, then the reference's initial weights (local shard = whole at 1 rank)."""
    model.to_empty(device=device)
    model.init_weights(buffer_device=torch.device(device))
    with torch.no_grad():
        for name, p in model.named_parameters():
            name = name.replace("_orig_mod.", "").replace("_checkpoint_wrapped_module.", "")
            local = p.to_local() if hasattr(p, "to_local") else p
            local.copy_(state[name].to(local.dtype))


def train_curve(model, device, batches, autocast: torch.dtype | None = None,
                lr: float = LR, context=None) -> list[float]:
    """The reference loop: AdamW, float32 cross entropy outside autocast, no clipping."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    losses = []
    for x, y in batches:
        x, y = x.to(device), y.to(device)
        with (torch.autocast(torch.device(device).type, dtype=autocast) if autocast
              else contextlib.nullcontext()), (context() if context else contextlib.nullcontext()):
            logits = model(x)
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def compare_curves(ref: list[float], got: list[float], kind: str) -> float:
    """Assert |got - ref| <= atol + rtol·|ref| at every step; returns the worst relative gap."""
    rtol, atol = TOLERANCE[kind]
    assert len(got) == len(ref), f"{len(got)} steps vs the reference's {len(ref)}"
    bad = [(i, r, g) for i, (r, g) in enumerate(zip(ref, got))
           if not math.isfinite(g) or abs(g - r) > atol + rtol * abs(r)]
    assert not bad, (f"{kind}: {len(bad)} of {len(ref)} steps outside rtol {rtol} atol {atol}; "
                     f"first (step, ref, got) = {bad[0]}")
    return max(abs(g - r) / abs(r) for r, g in zip(ref, got))


_REF: dict[str, list[float]] = {}


def reference_curve(steps: int = STEPS) -> list[float]:
    """The CPU fp32 eager curve (computed once per session and length). Its model is built
    directly (not through `materialize`), so a preparation that loses weights shows."""
    from torchllm.models.llama.model import Transformer

    if steps not in _REF:
        _REF[steps] = train_curve(build_model(Transformer, debug_args(), seed=0), "cpu",
                                  make_batches(steps))
    return _REF[steps]

# -- what each CUDA path applies to the model (shared with the CPU smoke test) -------------

def float8_config(recipe: str, all_gather: bool = True, emulate: bool = False):
    pytest.importorskip("torchao", reason="torchao wheel not installed (see scripts/gpu_check.sh)")
    if not emulate:
        from torchllm.parallel.float8 import float8_supported

        if not float8_supported("cuda"):
            pytest.skip(f"float8 needs compute capability 8.9+, this GPU has "
                        f"{torch.cuda.get_device_capability()}")
    return load_config(["--float8.enable", f"--float8.recipe={recipe}", f"--float8.emulate={str(emulate).lower()}",
                        f"--float8.enable_fsdp_float8_all_gather={str(all_gather).lower()}"]).float8


def prepare_compile(backend: str):
    from torchllm.parallel.compile import apply_compile

    return lambda model: apply_compile(model, SimpleNamespace(backend=backend))


def prepare_float8(f8):
    from torchllm.parallel.float8 import apply_float8

    return lambda model: apply_float8(model, f8, "cuda" if not f8.emulate else "cpu",
                                      fsdp_enabled=False)


def prepare_fsdp(mesh, param_dtype, f8=None):
    from torchllm.parallel.data_parallel import apply_fsdp
    from torchllm.parallel.float8 import apply_float8

    def prepare(model):
        if f8 is not None:
            apply_float8(model, f8, "cuda" if not f8.emulate else "cpu", fsdp_enabled=True)
        apply_fsdp(model, mesh, param_dtype=param_dtype, reduce_dtype=torch.float32)
    return prepare


def ddp_model(mesh, device: str, hook: str):
    """DDP's reducer is built on the materialized model (it broadcasts rank 0's weights)."""
    from torchllm.parallel.data_parallel import apply_ddp

    model = meta_model()
    materialize(model, device, initial_state())
    apply_ddp(model, mesh, bucket_cap_mb=1, comm_hook=hook)
    return model


def prepared_model(device: str, prepare=None):
    model = meta_model()
    if prepare:
        prepare(model)
    materialize(model, device, initial_state())
    return model


def one_rank_group(backend: str, store_dir):
    """A 1-rank process group and its 1-D mesh: FSDP2's / DDP's real code paths."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    device = "cuda" if backend == "nccl" else "cpu"
    kwargs = {"device_id": torch.device("cuda", 0)} if backend == "nccl" else {}
    if backend == "nccl":
        torch.cuda.set_device(0)
    dist.init_process_group(backend, store=dist.FileStore(str(store_dir / "store"), 1), rank=0,
                            world_size=1, **kwargs)
    return init_device_mesh(device, (1,))

def cuda_curve(kind: str, autocast=None, prepare=None, context=None, model=None) -> list[float]:
    """Train a copy of the reference's initial weights on CUDA (TF32 only for kind 'tf32')."""
    torch.backends.cuda.matmul.allow_tf32 = kind == "tf32"
    torch.backends.cudnn.allow_tf32 = kind == "tf32"
    try:
        model = model if model is not None else prepared_model("cuda", prepare)
        return train_curve(model, "cuda", make_batches(), autocast, context=context)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False


def saved_checkpoint_keys(tmp_path, device: str, mode: str) -> set[str]:
    """Train 4 steps saving every 2 with checkpoint.async_mode = `mode`; assert the step-4
    checkpoint holds the trainer's live weights bit for bit; return the saved entries."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from conftest import tiny_config
    from torchllm.train import Trainer

    trainer = Trainer(tiny_config(tmp_path, f"--training.device={device}", "--checkpoint.enable",
                                  "--checkpoint.interval=2", f"--checkpoint.async_mode={mode}",
                                  "--job.run_name=run"))
    trainer.train()  # closes the checkpointer: an async save has finished
    dcp_to_torch_save(tmp_path / "run" / "checkpoint" / "step-4", tmp_path / "step4.pt")
    saved = _flatten(torch.load(tmp_path / "step4.pt", weights_only=False))
    live = trainer.model.state_dict()
    assert live
    for name, tensor in live.items():
        assert torch.equal(saved[f"model.{name}"].cpu(), tensor.detach().cpu()), (mode, name)
    return set(saved)


def _flatten(d, prefix=""):
    out = {}
    for k, v in (d.items() if isinstance(d, dict) else enumerate(d)):
        if isinstance(v, (dict, list)):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out
