"""The GPU tests' harness: the fp32 CPU reference, the loop, the comparison, the preparations.

Shared by tests/integration/test_gpu.py (marked `gpu`) and tests/unit/benchmarks/test_gpu_harness.py
(its CPU tests). See tests/integration/test_gpu.py and docs/gpu.md for the oracle (teacher-forced
steps) and the tolerances.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from conftest import IMPORT_SET_ENV, build_model
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
    return [one_step(model, opt, device, x, y, autocast, context, keep_grads=False)[0]
            for x, y in batches]


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

def cuda_gaps(kind: str, autocast=None, prepare=None, context=None, model=None) -> list[dict]:
    """The teacher-forced gaps of a CUDA path built from the reference's initial weights (TF32
    only for kind 'tf32'); the process-wide switches are restored afterwards."""
    with restored_process_state():
        torch.backends.cuda.matmul.allow_tf32 = kind == "tf32"
        torch.backends.cudnn.allow_tf32 = kind == "tf32"
        model = model if model is not None else prepared_model("cuda", prepare)
        return teacher_forced_gaps(model, "cuda", autocast, context)


def saved_checkpoint_keys(tmp_path, device: str, mode: str) -> set[str]:
    """Train 4 steps saving every 2 with checkpoint.async_mode = `mode`; assert the step-4
    checkpoint holds the trainer's live weights bit for bit; return the saved entries."""
    from conftest import tiny_config
    from torchllm.checkpoint import Step
    from torchllm.train import Trainer

    trainer = Trainer(tiny_config(tmp_path, f"--training.device={device}", "--checkpoint.enable",
                                  "--checkpoint.interval=2", f"--checkpoint.async_mode={mode}",
                                  "--job.run_name=run"))
    trainer.train()  # closes the checkpointer: an async save has finished
    # read as every torchllm reader does (the index is JSON data: DCP's own loader cannot)
    saved = Step.open(tmp_path / "run" / "checkpoint" / "step-4").tensors(prefix="")
    live = trainer.model.state_dict()
    assert live
    for name, tensor in live.items():
        assert torch.equal(saved[f"model.{name}"].cpu(), tensor.detach().cpu()), (mode, name)
    return set(saved)


# -- the teacher-forced oracle (device-agnostic) ---------------------------------------------
# Free-running curves compare the end of a chaotic process: the reference's loss rises at step
# 18, and a 1e-6 difference from step 1 came out as 2e-3 there (first GPU run). Instead each
# compared step starts from the reference's own state before that step (weights and AdamW
# moments), runs ONE step on the path under test, and compares what that step produced: the
# loss (forward), every gradient (backward) and every update (optimizer). A rounding difference
# stays the size of one step's rounding; a bug shows in the step it happens.
#
# Per-step tolerances, worst relative error (loss: |got-ref|/|ref|; gradients and updates: the
# worst tensor's ||got-ref|| / ||ref||, update = weights after - weights before). Each is set
# from the precision's unit roundoff u and >= 3x the largest gap measured on CPU over the 20
# steps (docs/gpu.md has the table; the GPU tests record CUDA's in gpu_check.sh's junit xml).
# Adam's update divides by sqrt(v): at step 1 it is ~lr·sign(g), so the few elements whose
# gradient is near zero amplify rounding; the update gap is the loosest of the three.
STEP_TOLERANCE = {
    # float32, u = 6e-8: the same step in float64 differs by loss 8e-8, grads 2e-6, update 8e-4.
    "fp32": {"loss": 1e-5, "grads": 1e-4, "update": 5e-3},
    # TF32 matmul inputs, u = 4.9e-4 (8x finer than bf16, and only in matmuls): bf16's / 5.
    "tf32": {"loss": 1e-3, "grads": 2e-2, "update": 1e-1},
    # bf16, u = 3.9e-3: CPU autocast measured loss 3e-4, grads 2.5e-2, update 0.19.
    "bf16": {"loss": 3e-3, "grads": 1e-1, "update": 5e-1},
    # float8 e4m3 forward / e5m2 gradients (u = 6e-2 / 0.125) on top of bf16: CPU-emulated
    # tensorwise loss 2.8e-3, grads 0.40, update 0.62; rowwise 2.2e-3, 0.32, 0.63. (A random
    # update direction would be ~1.4: the update check is weak here, loss and grads are not.)
    "float8": {"loss": 2e-2, "grads": 8e-1, "update": 1.0},
}


def clean_name(name: str) -> str:
    for wrapper in ("_orig_mod.", "_checkpoint_wrapped_module.", "module."):
        name = name.replace(wrapper, "")
    return name


def _local(t: torch.Tensor) -> torch.Tensor:
    """A parameter / gradient / state as a plain tensor (1 rank: the local shard is whole)."""
    return t.to_local() if hasattr(t, "to_local") else t


def _like(param: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """`value` (whole, on CPU) as optimizer state of `param`: device, dtype, DTensor-ness."""
    local = value.to(_local(param).device, _local(param).dtype, copy=True)  # AdamW updates it
    if hasattr(param, "to_local"):
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False)
    return local


@dataclasses.dataclass
class StepRecord:
    """One reference step: the state it started from and what it produced (CPU float32)."""
    weights: dict[str, torch.Tensor]
    moments: dict[str, dict[str, torch.Tensor]]  # AdamW state before the step; {} at step 0
    loss: float
    grads: dict[str, torch.Tensor]
    after: dict[str, torch.Tensor]


def _snapshot(model) -> dict[str, torch.Tensor]:
    return {clean_name(n): _local(p).detach().float().cpu().clone()
            for n, p in model.named_parameters()}


def _moments(model, opt) -> dict[str, dict[str, torch.Tensor]]:
    return {clean_name(n): {k: _local(v).detach().float().cpu().clone()
                            for k, v in opt.state[p].items()}
            for n, p in model.named_parameters() if p in opt.state}


def one_step(model, opt, device, x, y, autocast=None, context=None,
             keep_grads: bool = True) -> tuple[float, dict]:
    """The reference loop's step (train_curve): loss, gradients (read before the update;
    {} without keep_grads)."""
    x, y = x.to(device), y.to(device)
    with (torch.autocast(torch.device(device).type, dtype=autocast) if autocast
          else contextlib.nullcontext()), (context() if context else contextlib.nullcontext()):
        logits = model(x)
    loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
    loss.backward()
    grads = {clean_name(n): _local(p.grad).detach().float().cpu().clone()
             for n, p in model.named_parameters()} if keep_grads else {}
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item(), grads


_STEPS: dict[int, list[StepRecord]] = {}


def reference_steps(steps: int = STEPS) -> list[StepRecord]:
    """The CPU fp32 eager reference (train_curve's loop), every step's state and results
    recorded (once per session and length)."""
    from torchllm.models.llama.model import Transformer

    longer = [n for n in _STEPS if n >= steps]
    if longer:  # the batches of a shorter run are the first ones of a longer run
        return _STEPS[min(longer)][:steps]
    if steps not in _STEPS:
        model = build_model(Transformer, debug_args(), seed=0)
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
        records = []
        for x, y in make_batches(steps):
            weights, moments = _snapshot(model), _moments(model, opt)
            loss, grads = one_step(model, opt, "cpu", x, y)
            records.append(StepRecord(weights, moments, loss, grads, _snapshot(model)))
        _STEPS[steps] = records
    return _STEPS[steps]


def load_step_state(model, opt, record: StepRecord) -> None:
    """Put the reference's state before a step into the path's model and optimizer."""
    opt.state.clear()
    with torch.no_grad():
        for name, p in model.named_parameters():
            name = clean_name(name)
            _local(p).copy_(record.weights[name].to(_local(p).dtype))
            if record.moments:
                opt.state[p] = {k: (v.clone() if k == "step" else _like(p, v))
                                for k, v in record.moments[name].items()}


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def _worst(got: dict, ref: dict) -> tuple[float, str]:
    assert got.keys() == ref.keys(), sorted(set(got) ^ set(ref))
    return max((_rel(got[k], ref[k]), k) for k in ref)


def teacher_forced_gaps(model, device, autocast=None, context=None,
                        steps: int = STEPS) -> list[dict]:
    """Run each reference step on `model` (the path under test) from the reference's state
    before it; return per step the relative gaps of loss, gradients and updates, with the
    tensor each worst gap is in."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    gaps = []
    for i, (record, (x, y)) in enumerate(zip(reference_steps(steps), make_batches(steps))):
        load_step_state(model, opt, record)
        loss, grads = one_step(model, opt, device, x, y, autocast, context)
        after = _snapshot(model)
        grad_gap, grad_at = _worst(grads, record.grads)
        update_gap, update_at = _worst({k: after[k] - record.weights[k] for k in after},
                                       {k: record.after[k] - record.weights[k] for k in after})
        gaps.append({"step": i + 1, "loss": abs(loss - record.loss) / abs(record.loss),
                     "grads": grad_gap, "grads_at": grad_at, "update": update_gap,
                     "update_at": update_at, "finite": math.isfinite(loss)})
    return gaps


def worst_gaps(gaps: list[dict]) -> dict[str, float]:
    return {q: max(g[q] for g in gaps) for q in ("loss", "grads", "update")}


def check_steps(gaps: list[dict], kind: str) -> dict[str, float]:
    """Assert every step's gaps are within STEP_TOLERANCE[kind]; returns the worst gaps (the
    GPU tests record them in the junit xml: docs/gpu.md)."""
    tol = STEP_TOLERANCE[kind]
    bad = [(g["step"], q, g[q], g.get(f"{q}_at", "")) for g in gaps for q in tol
           if not g["finite"] or not g[q] <= tol[q]]
    assert not bad, (f"{kind}: {len(bad)} step quantities outside {tol}; first (step, quantity,"
                     f" relative gap, tensor) = {bad[0]}")
    return worst_gaps(gaps)


# -- leave the process as found (tests/conftest.py's module guard checks it) -----------------

@contextlib.contextmanager
def restored_process_state():
    """Undo what CUDA paths change process-wide: TF32 switches (the Trainer's tf32 default sets
    allow_tf32, i.e. float32_matmul_precision 'high'), inductor's TRITON_CACHE_DIR and
    TRITON_PTXAS_PATH (any variable, in fact), and dynamo / inductor config keys; dynamo's
    compiled code is dropped."""
    import torch._dynamo
    import torch._inductor.config as inductor_config

    env = dict(os.environ)
    precision = torch.get_float32_matmul_precision()
    switches = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
                torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic)
    configs = [(m, m.get_config_copy()) for m in (torch._dynamo.config, inductor_config)]
    try:
        yield
    finally:
        for key in set(os.environ) - set(env) - set(IMPORT_SET_ENV):
            del os.environ[key]
        os.environ.update({k: v for k, v in env.items() if k not in IMPORT_SET_ENV})
        (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
         torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic) = switches
        torch.set_float32_matmul_precision(precision)  # after allow_tf32: it sets this too
        for module, saved in configs:
            changed = {k: v for k, v in saved.items() if module.get_config_copy().get(k) != v}
            for key, value in changed.items():
                setattr(module, key, value)
        torch._dynamo.reset()
