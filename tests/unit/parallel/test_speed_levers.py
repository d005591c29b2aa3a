"""The speed levers of docs/gpu.md ("Speed levers"): each against the plain path on CPU, each
GPU-only one refused on CPU in one line, and the CUDA halves as `gpu` tests.

Oracles: the plain autocast step (cast_weights_once), the plain float32 loss of materialized
logits (chunked loss), eager (whole-model compile), the aten kernel actually dispatched (SDPA
backend), the data pointer autograd produced (CUDA-graph gradient ownership)."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import build_model, tiny_args, tiny_config
from torchllm.config import load_config
from torchllm.config.job_config import ConfigError
from torchllm.loss import chunked_cross_entropy_sum, cross_entropy_sum
from torchllm.models.llama.args import LlamaArgs
from torchllm.models.llama.model import Transformer
from builders.models import layout_dims
from torchllm.parallel.cast_once import CastWeightsOnce
from torchllm.parallel.levers import OwnGradients, sdpa_context

ARGS = LlamaArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=96, max_seq_len=16)


def batches(n=2, b=2, s=12, vocab=96, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, vocab, (b, s), generator=g),
             torch.randint(0, vocab, (b, s), generator=g)) for _ in range(n)]


def accumulate(model, micro, cast=None):
    """Gradients of the summed loss over `micro` micro-batches under bf16 autocast, as the
    trainer computes them (each micro-step's loss outside autocast, in float32)."""
    model.zero_grad(set_to_none=True)
    losses = []
    with cast() if cast else contextlib.nullcontext():
        for x, y in micro:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = model(x)
            loss = cross_entropy_sum(logits, y)
            loss.backward()
            losses.append(loss.item())
    return losses, {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("tied", [False, True])
def test_cast_weights_once_equals_autocast_over_micro_steps_and_steps(tied):
    """Two optimizer steps of two micro-steps each: the same losses and float32 gradients as
    autocast's per-use casts (exactly; a tied table's two gradients are summed in another order,
    so to float32 rounding), and the copies follow the weights from one step to the next."""
    args = dataclasses.replace(ARGS, tie_embeddings=tied)
    ref, model = build_model(Transformer, args), build_model(Transformer, args)
    cast = CastWeightsOnce(model)
    assert len(cast.slots) == 7 * 2 + 1  # 7 linears a block; the head (or the tied table)
    for step, micro in enumerate([batches(seed=0), batches(seed=1)]):
        losses_ref, grads_ref = accumulate(ref, micro)
        losses, grads = accumulate(model, micro, cast)
        assert losses == losses_ref, step
        for name, g in grads_ref.items():
            assert grads[name].dtype == torch.float32
            if tied and name == "tok_embeddings.weight":
                torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-6)
            else:
                assert torch.equal(grads[name], g), (step, name)
        with torch.no_grad():  # an optimizer step: both models move the same way
            for a, b in zip(ref.parameters(), model.parameters()):
                a.sub_(0.5 * a.grad.sign())
                b.sub_(0.5 * b.grad.sign())
    # outside the step the model is as built: float32 parameters, no copies attached
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert "cast_weight" not in vars(model.tok_embeddings)


def test_chunked_loss_equals_the_plain_loss_and_gradients():
    """training.chunked_loss (impl torch): the loss of hidden @ weight.T, chunk by chunk, equals
    the float32 cross entropy of the full logits in value and in both gradients (with an
    ignored target and a chunk that does not divide the tokens)."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 7, 16, generator=g, requires_grad=True)
    weight = torch.randn(40, 16, generator=g, requires_grad=True)
    targets = torch.randint(0, 40, (2, 7), generator=g)
    targets[0, 3] = -100
    plain = cross_entropy_sum(hidden @ weight.T, targets)
    plain.backward()
    ref = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    chunked = chunked_cross_entropy_sum(hidden, weight, targets, chunk_tokens=3)
    chunked.backward()
    torch.testing.assert_close(chunked, plain)
    torch.testing.assert_close(hidden.grad, ref[0])
    torch.testing.assert_close(weight.grad, ref[1])


def test_own_gradients_copies_the_first_gradient_of_a_step_once():
    """Under CUDA graphs a parameter must not keep the graph's output memory as its .grad: the
    first micro-step's gradient is copied into memory of its own, later ones add into it."""
    model = build_model(Transformer, ARGS)
    p = model.layers["0"].attention.wq.weight
    produced = []
    p.register_hook(lambda g: produced.append(g.data_ptr()))  # the pointer only: no reference
    own = OwnGradients(model)
    own.new_step()
    (x, y), (x2, y2) = batches()
    cross_entropy_sum(model(x), y).backward()
    first = p.grad
    assert p.grad.data_ptr() != produced[0]  # not autograd's (the graph's) tensor
    cross_entropy_sum(model(x2), y2).backward()
    assert p.grad is first  # accumulated in place into the owned copy
    sums = p.grad.clone()
    plain = build_model(Transformer, ARGS)
    for a, b in batches():
        cross_entropy_sum(plain(a), b).backward()
    torch.testing.assert_close(sums, plain.layers["0"].attention.wq.weight.grad)


class Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(func.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("backend,flash", [("math", False), ("flash", True), ("auto", True)])
def test_sdpa_backend_picks_the_kernel(backend, flash):
    """model.sdpa_backend decides the kernel SDPA dispatches to (CPU: flash or math), with the
    same loss to float32 rounding."""
    model = build_model(Transformer, ARGS)
    x, y = batches()[0]
    with Ops() as ops, sdpa_context(backend):
        loss = cross_entropy_sum(model(x), y)
    assert any("flash_attention" in n for n in ops.names) == flash, sorted(ops.names)
    torch.testing.assert_close(loss, cross_entropy_sum(model(x), y), rtol=1e-5, atol=1e-5)


def check(tmp_path, *extra):
    cfg = tiny_config(tmp_path, *extra)
    layout_dims(cfg, 1, "cpu")


@pytest.mark.parametrize("extra,works", [
    (["--training.chunked_loss", "--training.chunked_loss_impl=liger"], "use 'torch'"),
    (["--compile.enable", "--compile.cudagraphs"], "leave it false"),
    (["--model.sdpa_backend=cudnn"], "use 'auto', 'flash' or 'math'"),
    (["--model.sdpa_backend=efficient"], "use 'auto', 'flash' or 'math'"),
])
def test_gpu_only_levers_are_refused_on_cpu_in_one_line(tmp_path, extra, works):
    with pytest.raises(ConfigError) as e:
        check(tmp_path, *extra)
    assert "needs CUDA" in str(e.value) and works in str(e.value)
    assert len(str(e.value).splitlines()) == 1


def test_levers_that_run_on_cpu_pass_the_checks(tmp_path):
    check(tmp_path, "--training.cast_weights_once", "--training.chunked_loss",
          "--compile.enable", "--compile.granularity=model", "--model.sdpa_backend=flash")


def compiled(granularity: str):
    from torchllm.parallel.compile import apply_compile

    ccfg = dataclasses.replace(tiny_config("/nonexistent").compile, enable=True,
                               backend="aot_eager", granularity=granularity)
    model = build_model(Transformer, ARGS)
    apply_compile(model, ccfg)
    blocks = [isinstance(b, torch._dynamo.eval_frame.OptimizedModule)
              for b in model.layers.values()]
    return model, model._compiled_call_impl is not None, blocks


def test_compile_granularity_compiles_the_model_or_each_block():
    _, whole, blocks = compiled("model")
    assert whole and not any(blocks)
    _, whole, blocks = compiled("block")
    assert not whole and all(blocks)


@pytest.mark.slow
def test_whole_model_compile_accumulates_the_eager_gradients():
    """compile.granularity = 'model' (aot_eager): two micro-steps accumulate eager's
    gradients."""
    eager, (model, *_) = build_model(Transformer, ARGS), compiled("model")
    for m in (eager, model):
        for x, y in batches():
            cross_entropy_sum(m(x), y).backward()
    for (name, a), b in zip(eager.named_parameters(), model.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-4)
    torch._dynamo.reset()


@pytest.mark.slow
def test_whole_model_compile_with_grad_accumulation_matches_eager(tmp_path):
    """compile.granularity = 'model' through the Trainer: one graph for the whole model (the
    blocks are not compiled one by one), the same losses as eager over steps of two
    micro-steps each."""
    from torchllm.train import Trainer

    def run(*extra):
        trainer = Trainer(tiny_config(tmp_path / str(len(extra)), "--training.steps=2",
                                      "--training.local_batch_size=2",
                                      "--training.global_batch_size=4",
                                      "--training.seq_len=16", "--model.n_layers=2",
                                      "--model.dim=64", *extra))
        return trainer, trainer.train()

    compiled, losses = run("--compile.enable", "--compile.backend=aot_eager",
                           "--compile.granularity=model")
    assert compiled.model._compiled_call_impl is not None
    assert not any(isinstance(b, torch._dynamo.eval_frame.OptimizedModule)
                   for b in compiled.model.layers.values())
    _, eager = run()
    assert losses == pytest.approx(eager, rel=1e-5)


@pytest.mark.slow
def test_cast_weights_once_through_the_trainer(tmp_path):
    """./run_train.sh's Trainer with training.cast_weights_once (bf16, 2 micro-steps): the same
    losses and weights as plain bf16 autocast."""
    from torchllm.train import Trainer

    def run(*extra):
        trainer = Trainer(load_config(tiny_args(
            tmp_path / str(len(extra)), "--training.mixed_precision=bf16",
            "--training.steps=3", "--training.local_batch_size=2",
            "--training.global_batch_size=4", "--training.seq_len=16", "--model.n_layers=2",
            "--model.dim=64", *extra)))
        return trainer.train(), dict(trainer.model.named_parameters())

    losses, params = run("--training.cast_weights_once")
    ref_losses, ref_params = run()
    assert losses == ref_losses
    for name, p in ref_params.items():
        assert torch.equal(params[name], p), name


@pytest.mark.gpu
def test_liger_loss_equals_the_torch_chunked_loss_on_cuda():
    pytest.importorskip("liger_kernel")
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(512, 64, device="cuda", generator=g, requires_grad=True)
    weight = torch.randn(1000, 64, device="cuda", generator=g, requires_grad=True)
    targets = torch.randint(0, 1000, (512,), device="cuda", generator=g)
    targets[:7] = -100
    out = {}
    for impl in ("torch", "liger"):
        hidden.grad = weight.grad = None
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = chunked_cross_entropy_sum(hidden, weight, targets, 128, impl)
        loss.backward()
        out[impl] = loss.detach(), hidden.grad.clone(), weight.grad.clone()
    for a, b in zip(out["torch"], out["liger"]):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("granularity", ["block", "model"])
def test_cudagraphs_with_grad_accumulation_match_eager_on_cuda(tmp_path, granularity):
    """compile.cudagraphs with 2 micro-steps per step: no "accessing tensor output of CUDAGraphs
    that has been overwritten" (gradients owned, step boundaries marked), eager's losses."""
    from torchllm.train import Trainer

    def run(*extra):
        args = [a for a in tiny_args(tmp_path / str(len(extra)), "--training.steps=3",
                                     "--training.local_batch_size=2",
                                     "--training.global_batch_size=4",
                                     "--training.mixed_precision=bf16", *extra)
                if a != "--training.device=cpu"] + ["--training.device=cuda"]
        return Trainer(load_config(args)).train()

    losses = run("--compile.enable", "--compile.cudagraphs",
                 f"--compile.granularity={granularity}", "--training.cast_weights_once")
    assert losses == pytest.approx(run(), rel=2e-2)


@pytest.mark.slow
def test_bench_gpu_runs_the_cpu_levers_on_a_tiny_shape(tmp_path, monkeypatch):
    """benchmarks/bench_gpu.py on CPU (debug model, seq 32, aot_eager): every lever variant that
    exists there is a config the trainer accepts; the accumulating pair runs, each row ok, and
    cast_weights_once's losses are the plain accumulating row's (the same numbers); the CUDA-only
    ones are listed apart. (Each lever's numbers have their own test above; running all seven
    rows here cost ~100 s of the suite.)"""
    import json
    import sys

    from conftest import REPO
    from torchllm.config import load_config

    sys.path.insert(0, str(REPO / "benchmarks"))
    import bench_gpu

    names = [v for v in bench_gpu.VARIANTS if v.startswith("bf16_compile_")
             and v in bench_gpu.CPU_VARIANTS and "seq" not in v and "ac_" not in v]
    assert {"bf16_compile_accum4_cast_once", "bf16_compile_model", "bf16_compile_sdpa_math",
            "bf16_compile_chunked_loss"} <= set(names)
    assert {"bf16_compile_cudagraphs", "bf16_compile_liger_loss", "bf16_compile_sdpa_cudnn",
            "bf16_compile_flex"} <= set(bench_gpu.CUDA_ONLY)
    for name in names:  # each row's overrides load (a misspelt key or value fails here)
        load_config(["--job.config_file", str(REPO / "train_configs/debug_model.toml"),
                     *bench_gpu.VARIANTS[name]])
    ran = ["bf16_compile_accum4", "bf16_compile_accum4_cast_once"]
    # main() here (its rows run in processes of their own); one narrow block, one sequence a
    # micro-step: what is compared is the two rows' losses, whatever the model's size.
    monkeypatch.chdir(tmp_path)
    assert bench_gpu.main([
        "--device", "cpu", "--config", str(REPO / "train_configs/debug_model.toml"),
        "--seq_len", "32", "--local_batch_size", "1", "--steps", "1", "--warmup", "2",
        "--variants", ",".join(ran), "--ac", "none", "--out_dir", str(tmp_path),
        "--data.tokenizer_vocab_size=512", "--compile.backend=aot_eager", "--model.n_layers=1",
        "--model.dim=64"]) == 0
    (result,) = [json.loads(p.read_text()) for p in tmp_path.glob("gpu_cpu_*.json")]
    rows = {r["variant"]: r for r in result["rows"]}
    assert set(rows) == set(ran) and all(r["status"] == "ok" for r in rows.values()), rows
    assert rows["bf16_compile_accum4_cast_once"]["losses"] == pytest.approx(
        rows["bf16_compile_accum4"]["losses"], rel=1e-6)
