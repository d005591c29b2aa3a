"""Every CUDA path against a plain fp32 reference (tests marked `gpu` skip without CUDA).

    pytest -m gpu tests/test_gpu.py            (scripts/gpu_check.sh runs this on a GPU machine)

The oracle is a plain PyTorch loop: the debug Llama (vocab 512), initialized once on CPU with a
fixed seed, trained in fp32 eager on CPU for STEPS AdamW steps on a learnable synthetic stream
(arithmetic token progressions), so the loss falls by several nats. Each CUDA path trains a copy
of the same initial weights on the same batches and its loss curve must stay within its stated
tolerance of the reference at every step (`compare_curves`):

| path                                   | per-step tolerance |loss - ref| <= atol + rtol·ref |
| fp32 on CUDA (TF32 off) / inductor     | rtol 1e-3, atol 1e-3                               |
| TF32 matmuls                           | rtol 1e-2, atol 1e-2                               |
| bf16 (autocast, FSDP2 bf16 params, DDP bf16 hook, flash / cuDNN SDPA) | rtol 3e-2, atol 5e-2  |
| float8 (tensorwise, rowwise, FSDP2 float8 all-gather) | rtol 6e-2, atol 1e-1                 |

These are first settings, written before any GPU run (see docs/gpu.md); a session with a GPU
tightens them to what it measures. The harness itself (batches, loop, comparison) runs on CPU in
the tests at the bottom, which are not marked `gpu`.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import pickle
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from conftest import REPO, build_model, tiny_args, tiny_config
from torchllm import models
from torchllm.config import load_config

STEPS, BATCH, SEQ, VOCAB, LR = 20, 4, 32, 512, 3e-3
CPU_STEPS = 4  # the CPU tests of the harness: this machine class is slow
TOLERANCE = {"fp32": (1e-3, 1e-3), "tf32": (1e-2, 1e-2), "bf16": (3e-2, 5e-2),
             "float8": (6e-2, 1e-1)}

gpu = pytest.mark.gpu


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
              else _null()), (context() if context else _null()):
            logits = model(x)
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def _null():
    import contextlib

    return contextlib.nullcontext()


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
    """The CPU fp32 eager curve (computed once per session and length)."""
    if steps not in _REF:
        model = meta_model()
        materialize(model, "cpu", initial_state())
        _REF[steps] = train_curve(model, "cpu", make_batches(steps))
    return _REF[steps]


# -- CPU tests of the harness (not marked gpu) ----------------------------------------------

def test_reference_curve_learns_the_synthetic_stream():
    ref = reference_curve(CPU_STEPS)
    assert len(ref) == CPU_STEPS and all(math.isfinite(v) for v in ref)
    assert ref[0] == pytest.approx(math.log(VOCAB), abs=0.6)  # a fresh model is ~uniform
    # and it learns (a flat curve would compare nothing): GPU runs take STEPS steps
    assert ref[-1] < ref[0] - 0.3


def test_compare_curves_catches_drift_and_nan():
    ref = [6.0, 5.0, 4.0]
    assert compare_curves(ref, [6.01, 5.01, 4.01], "bf16") < 0.01
    with pytest.raises(AssertionError, match="step, ref, got"):
        compare_curves(ref, [6.0, 5.0, 4.6], "bf16")
    with pytest.raises(AssertionError):
        compare_curves(ref, [6.0, float("nan"), 4.0], "float8")
    with pytest.raises(AssertionError, match="3 steps"):
        compare_curves(ref + [3.0], ref, "fp32")


def test_harness_on_cpu_bf16_autocast_within_tolerance_and_wrong_lr_is_caught():
    """The same comparison a GPU run makes, on CPU: bf16 autocast stays within the bf16
    tolerance of the fp32 reference, and a run with a wrong learning rate does not."""
    state, batches, ref = initial_state(), make_batches(CPU_STEPS), reference_curve(CPU_STEPS)
    model = meta_model()
    materialize(model, "cpu", state)
    compare_curves(ref, train_curve(model, "cpu", batches, torch.bfloat16), "bf16")
    model = meta_model()
    materialize(model, "cpu", state)
    with pytest.raises(AssertionError, match="outside"):
        compare_curves(ref, train_curve(model, "cpu", batches, lr=3 * LR), "bf16")


@pytest.mark.slow
def test_bench_gpu_cpu_path_reports_what_a_direct_run_measures(tmp_path):
    """benchmarks/bench_gpu.py end to end on CPU with the debug model: its losses are a direct
    Trainer run's, its MFU is tokens/s x FLOPs/token / peak, its peak memory near the estimate."""
    from torchllm.train import Trainer

    cmd = [sys.executable, str(REPO / "benchmarks/bench_gpu.py"), "--device", "cpu",
           "--config", str(REPO / "train_configs/debug_model.toml"), "--seq_len", "32",
           "--local_batch_size", "2", "--steps", "1", "--warmup", "2", "--variants", "fp32",
           "--out_dir", str(tmp_path), "--data.tokenizer_vocab_size=512"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    subprocess.run(cmd, check=True, env=env, timeout=600, cwd=tmp_path)
    stem = f"gpu_cpu_{datetime.date.today().isoformat()}"
    result = json.loads((tmp_path / f"{stem}.json").read_text())
    assert "| fp32 | none |" in (tmp_path / f"{stem}.md").read_text()
    (row,) = result["rows"]
    assert row["status"] == "ok" and len(row["losses"]) == 3
    direct = Trainer(load_config([
        "--job.config_file", str(REPO / "train_configs/debug_model.toml"),
        "--training.device=cpu", "--training.seq_len=32", "--training.local_batch_size=2",
        "--training.steps=3", "--data.tokenizer_vocab_size=512", "--data.num_workers=0",
        "--lr_scheduler.warmup_steps=2", f"--job.dump_folder={tmp_path / 'direct'}",
        "--job.print_config=false", "--metrics.enable_tensorboard=false",
        "--metrics.progress_bar=false", "--training.mixed_precision=none"]))
    assert direct.train() == pytest.approx(row["losses"], rel=1e-5)
    assert row["mfu_pct"] == pytest.approx(
        100 * row["tokens_per_s_gpu"] * row["flops_per_token"] / row["peak_flops"], rel=1e-6)
    assert 0.5 < row["peak_over_estimate"] < 1.5


def test_bench_gpu_picks_the_least_activation_checkpointing_that_fits():
    sys.path.insert(0, str(REPO / "benchmarks"))
    import bench_gpu
    from torchllm.tools.estimate_memory import estimate_memory

    base = ["--job.config_file", str(REPO / "train_configs/llama3_1b.toml"),
            "--training.device=cuda", "--training.seq_len=2048", "--training.local_batch_size=4"]

    def est(mode):
        cfg = load_config([*base, f"--activation_checkpoint.mode={mode}"])
        return estimate_memory(cfg, models.model_args(cfg, 4096), 1)["peak_bytes"]

    assert est("none") > est("selective") > est("full")
    assert bench_gpu.pick_ac(base, "auto", est("none") / 0.9 + 1)[0] == "none"
    assert bench_gpu.pick_ac(base, "auto", est("none") / 0.9 - 1)[0] == "selective"
    assert bench_gpu.pick_ac(base, "auto", est("selective") / 0.9 - 1)[0] == "full"
    assert bench_gpu.pick_ac(base, "none", 1)[0] == "none"  # asked for: no choice made


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


def test_every_preparation_keeps_the_reference_weights_on_cpu(tmp_path):
    """CPU smoke test of what the GPU tests apply (float8 emulated, aot_eager instead of
    inductor, FSDP2 / DDP on a 1-rank gloo group): the first step's loss, computed from the
    copied initial weights, must be the reference's (a weight not copied changes it)."""
    import torch.distributed as dist

    batches = make_batches(steps=2)
    ref = reference_curve(CPU_STEPS)[0]
    mesh = one_rank_group("gloo", tmp_path)
    try:
        f8 = float8_config("tensorwise", all_gather=True, emulate=True)
        f8_rowwise = float8_config("rowwise", emulate=True)
        cases = {
            "compile": (prepared_model("cpu", prepare_compile("aot_eager")), 1e-5),
            "float8": (prepared_model("cpu", prepare_float8(f8)), 5e-2),
            "float8_rowwise": (prepared_model("cpu", prepare_float8(f8_rowwise)), 5e-2),
            "fsdp2": (prepared_model("cpu", prepare_fsdp(mesh, torch.float32)), 1e-5),
            "fsdp2_float8": (prepared_model("cpu", prepare_fsdp(mesh, torch.float32, f8)), 5e-2),
            "ddp_fp16_hook": (ddp_model(mesh, "cpu", "fp16"), 1e-5),
        }
        for name, (model, rtol) in cases.items():
            losses = train_curve(model, "cpu", batches)
            assert losses[0] == pytest.approx(ref, rel=rtol), name
            assert math.isfinite(losses[1]), name
    finally:
        dist.destroy_process_group()


# -- GPU tests ------------------------------------------------------------------------------

def cuda_curve(kind: str, autocast=None, prepare=None, context=None, model=None) -> list[float]:
    """Train a copy of the reference's initial weights on CUDA (TF32 only for kind 'tf32')."""
    torch.backends.cuda.matmul.allow_tf32 = kind == "tf32"
    torch.backends.cudnn.allow_tf32 = kind == "tf32"
    try:
        model = model if model is not None else prepared_model("cuda", prepare)
        return train_curve(model, "cuda", make_batches(), autocast, context=context)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False


@pytest.fixture(scope="module")
def one_rank_mesh(tmp_path_factory):
    import torch.distributed as dist

    yield one_rank_group("nccl", tmp_path_factory.mktemp("nccl"))
    dist.destroy_process_group()


@gpu
def test_fp32_cuda_matches_cpu_reference():
    compare_curves(reference_curve(), cuda_curve("fp32"), "fp32")


@gpu
def test_tf32_matches_reference():
    compare_curves(reference_curve(), cuda_curve("tf32"), "tf32")


@gpu
def test_bf16_autocast_matches_reference():
    compare_curves(reference_curve(), cuda_curve("bf16", autocast=torch.bfloat16), "bf16")


@gpu
def test_inductor_compile_matches_reference():
    prepare = prepare_compile("inductor")
    compare_curves(reference_curve(), cuda_curve("fp32", prepare=prepare), "fp32")
    compare_curves(reference_curve(),
                   cuda_curve("bf16", autocast=torch.bfloat16, prepare=prepare), "bf16")


@gpu
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_float8_matches_reference(recipe):
    curve = cuda_curve("bf16", autocast=torch.bfloat16, prepare=prepare_float8(float8_config(recipe)))
    compare_curves(reference_curve(), curve, "float8")


@gpu
def test_fsdp2_bf16_params_matches_reference(one_rank_mesh):
    curve = cuda_curve("bf16", prepare=prepare_fsdp(one_rank_mesh, torch.bfloat16))
    compare_curves(reference_curve(), curve, "bf16")


@gpu
def test_fsdp2_float8_all_gather_matches_reference(one_rank_mesh):
    f8 = float8_config("tensorwise", all_gather=True)
    curve = cuda_curve("bf16", prepare=prepare_fsdp(one_rank_mesh, torch.bfloat16, f8))
    compare_curves(reference_curve(), curve, "float8")


@gpu
def test_ddp_bf16_comm_hook_matches_reference(one_rank_mesh):
    curve = cuda_curve("bf16", autocast=torch.bfloat16,
                       model=ddp_model(one_rank_mesh, "cuda", "bf16"))
    compare_curves(reference_curve(), curve, "bf16")


def sdpa_backends():
    from torch.nn.attention import SDPBackend

    return {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}


@gpu
@pytest.mark.parametrize("backend", ["flash", "cudnn", "efficient"])
def test_sdpa_kernel_matches_math_in_fp64(backend):
    """Causal attention forward and backward of one fused kernel in bf16 against the math
    kernel on float64 copies: ||out - ref|| / ||ref|| < 1e-2 (bf16 operands)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(2, 8, 256, 64, device="cuda", generator=g, dtype=torch.bfloat16)
               .requires_grad_() for _ in range(3))
    grad = torch.randn(2, 8, 256, 64, device="cuda", generator=g, dtype=torch.bfloat16)
    try:
        with sdpa_kernel(sdpa_backends()[backend]):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            out.backward(grad)
    except RuntimeError as e:
        pytest.skip(f"{backend} SDPA is not available here: {str(e).splitlines()[0]}")
    ref_in = [t.detach().double().requires_grad_() for t in (q, k, v)]
    with sdpa_kernel(SDPBackend.MATH):
        ref = F.scaled_dot_product_attention(*ref_in, is_causal=True)
        ref.backward(grad.double())
    for got, want in [(out, ref)] + [(t.grad, r.grad) for t, r in zip((q, k, v), ref_in)]:
        rel = (got.double() - want).norm() / want.norm()
        assert rel < 1e-2, f"{backend}: relative error {rel:.2e}"


@gpu
@pytest.mark.parametrize("backend", ["flash", "cudnn"])
def test_model_with_fused_sdpa_matches_reference(backend):
    from torch.nn.attention import sdpa_kernel

    try:
        curve = cuda_curve("bf16", autocast=torch.bfloat16,
                           context=lambda: sdpa_kernel(sdpa_backends()[backend]))
    except RuntimeError as e:
        if "No available kernel" not in str(e):
            raise
        pytest.skip(f"{backend} SDPA is not available here")
    compare_curves(reference_curve(), curve, "bf16")


@gpu
def test_async_with_pinned_mem_checkpoint_equals_sync(tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from torchllm.train import Trainer

    saved = {}
    for mode in ("disabled", "async_with_pinned_mem"):
        trainer = Trainer(tiny_config(
            tmp_path / mode, "--training.device=cuda", "--job.deterministic",
            "--checkpoint.enable", "--checkpoint.interval=2", f"--checkpoint.async_mode={mode}",
            "--job.run_name=run"))
        trainer.train()
        saved[mode] = {}
        for step in (2, 4):
            out = tmp_path / f"{mode}_{step}.pt"
            dcp_to_torch_save(tmp_path / mode / "run" / "checkpoint" / f"step-{step}", out)
            saved[mode][step] = torch.load(out, weights_only=False)
    a, b = saved["disabled"], saved["async_with_pinned_mem"]
    for step in (2, 4):
        flat_a, flat_b = _flatten(a[step]), _flatten(b[step])
        assert flat_a.keys() == flat_b.keys()
        for key in flat_a:
            va, vb = flat_a[key], flat_b[key]
            assert (torch.equal(va, vb) if isinstance(va, torch.Tensor) else va == vb), key


def _flatten(d, prefix=""):
    out = {}
    for k, v in (d.items() if isinstance(d, dict) else enumerate(d)):
        if isinstance(v, (dict, list)):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


@gpu
def test_cuda_memory_stats_nonzero_and_within_the_estimate(tmp_path):
    """The trainer's CUDA peak (max_memory_allocated, read every step before the logger
    resets it) is > 0 and at most the estimator's peak + 20%."""
    from torchllm.bench.worker import StepRecorder
    from torchllm.metrics.memory import memory_stats
    from torchllm.tools.estimate_memory import estimate_memory
    from torchllm.train import Trainer

    cfg = tiny_config(tmp_path, "--training.device=cuda", "--model.flavor=125M",
                      "--model.vocab_size=32000", "--training.seq_len=512",
                      "--training.local_batch_size=8", "--training.steps=3")
    trainer = Trainer(cfg)
    rec = StepRecorder(trainer)
    trainer.train()
    peak = rec.cuda_peak["allocated"]
    estimate = estimate_memory(cfg, trainer.model_args, 1)["peak_bytes"]
    assert 0 < peak <= 1.2 * estimate, f"measured {peak / 2**30:.2f} GiB, estimate " \
        f"{estimate / 2**30:.2f} GiB"
    assert peak >= 0.5 * estimate, "the estimate is more than twice the measurement"
    stats = memory_stats(trainer.device)
    assert stats["max_reserved_gib"] > 0 and stats["ooms"] == 0


@gpu
def test_memory_snapshot_written(tmp_path):
    from torchllm.train import Trainer

    Trainer(tiny_config(tmp_path, "--training.device=cuda", "--job.run_name=run",
                        "--profiling.enable_memory_snapshot",
                        "--profiling.memory_snapshot_freq=2")).train()
    path = tmp_path / "run" / "memory_snapshot" / "iteration_2" / "rank0_memory_snapshot.pickle"
    with open(path, "rb") as f:
        snapshot = pickle.load(f)
    assert snapshot["segments"] and snapshot["device_traces"]


@gpu
def test_trainer_bf16_compile_runs_and_learns(tmp_path):
    """The whole Trainer on CUDA with bf16 + inductor (the throughput run's settings)."""
    from torchllm.train import Trainer

    losses = Trainer(load_config(tiny_args(tmp_path, "--training.device=cuda",
                                           "--training.mixed_precision=bf16", "--compile.enable",
                                           "--training.steps=20"))).train()
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0] - 1.0
