"""CUDA-only paths whose failure can be reproduced (or guarded) on CPU (issue 21)."""

from __future__ import annotations

import pytest
import torch

from torchllm.config import ConfigError
from torchllm.device import resolve_device

from messages import raises_naming


def test_auto_device_refuses_a_local_rank_beyond_the_visible_gpus(monkeypatch):
    """4 processes on a 1-GPU machine: a clear error instead of 'invalid device ordinal'."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert resolve_device("auto") == torch.device("cuda", 0)
    monkeypatch.setenv("LOCAL_RANK", "1")
    for name in ("auto", "cuda"):
        with raises_naming(ConfigError, "LOCAL_RANK 1", "1 GPU", "'cpu'", key="training.device"):
            resolve_device(name)
    assert resolve_device("cpu") == torch.device("cpu")


class _OpRecorder(torch.utils._python_dispatch.TorchDispatchMode):
    """Every aten op run inside, with whether any argument is a boolean tensor."""

    def __init__(self):
        super().__init__()
        self.ops: list[tuple[str, bool]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        flat = torch.utils._pytree.tree_leaves((args, kwargs or {}))
        bool_arg = any(isinstance(a, torch.Tensor) and a.dtype == torch.bool for a in flat)
        self.ops.append((str(func.overloadpacket.__name__), bool_arg))
        return func(*args, **(kwargs or {}))


# Ops that make the host wait for the device: data-dependent shapes (boolean-mask indexing goes
# through nonzero) and reading a value back.
SYNCING = ("nonzero", "_local_scalar_dense", "masked_select", "item")


def syncing_ops(recorder: _OpRecorder) -> list[str]:
    return [name for name, bool_arg in recorder.ops
            if name in SYNCING or (bool_arg and name in ("index", "index_put", "index_put_"))]


def test_chunked_loss_backward_has_no_data_dependent_ops():
    from torchllm.loss import IGNORE_INDEX, chunked_cross_entropy_sum, cross_entropy_sum

    torch.manual_seed(0)
    hidden = torch.randn(2, 9, 16, requires_grad=True)
    weight = torch.randn(40, 16, requires_grad=True)
    targets = torch.randint(0, 40, (2, 9))
    targets[0, :3] = IGNORE_INDEX
    loss = chunked_cross_entropy_sum(hidden, weight, targets, 4)
    recorder = _OpRecorder()
    with recorder:
        grads = torch.autograd.grad(loss, (hidden, weight))
    assert recorder.ops and not syncing_ops(recorder), syncing_ops(recorder)
    # ... and the gradient is still the plain cross entropy's (the oracle)
    plain = torch.autograd.grad(cross_entropy_sum(hidden @ weight.T, targets), (hidden, weight))
    for g, ref in zip(grads, plain):
        torch.testing.assert_close(g, ref)


class _ScaledMatmul(torch.autograd.Function):
    """y = x @ w.T through float8 `_scaled_mm` (as torchao's Float8Linear does); the backward
    is the high-precision one."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        one = torch.tensor(1.0)
        return torch._scaled_mm(x.to(torch.float8_e4m3fn), w.to(torch.float8_e4m3fn).t(),
                                scale_a=one, scale_b=one, out_dtype=torch.float32)

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        return grad @ w, grad.t() @ x


def test_selective_ac_op_policy_saves_float8_matmuls_and_tp_reduce_scatter():
    from torch.utils.checkpoint import checkpoint

    from torchllm.parallel.ac import _op_policy_context, _save_list

    assert torch.ops._c10d_functional.reduce_scatter_tensor.default in _save_list()
    x = torch.randn(16, 32, requires_grad=True)
    w = torch.randn(16, 32, requires_grad=True)

    class Count(torch.utils._python_dispatch.TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.calls += func is torch.ops.aten._scaled_mm.default
            return func(*args, **(kwargs or {}))

    with Count():
        y = checkpoint(lambda a, b: _ScaledMatmul.apply(a, b).sin(), x, w,
                       use_reentrant=False, context_fn=_op_policy_context)
        y.sum().backward()
    assert Count.calls == 1  # saved in forward, not recomputed in backward


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("compiled", [False, True])
def test_float8_warns_without_compile_and_rowwise_compile_emulates_eager_casts(
        recipe, compiled, caplog, monkeypatch):
    """Rowwise float8 + compile needs inductor's `emulate_precision_casts` in the compiled
    blocks; it is passed to their compile, and inductor's global config is left as it was."""
    pytest.importorskip("torchao")
    import torch._inductor.config as inductor_config

    from torchllm.config import load_config
    from torchllm.log import logger
    from torchllm.models.llama.args import LlamaArgs
    from torchllm.models.llama.model import Transformer
    from torchllm.parallel.dims import ParallelDims
    from torchllm.models import get
    from torchllm.parallel.parallelize import parallelize_model
    from torchllm.parallel.plan import ParallelPlan

    from conftest import build_model

    compile_flags = ["--compile.enable", "--compile.backend=inductor"] if compiled else []
    cfg = load_config(["--float8.enable", "--float8.emulate", f"--float8.recipe={recipe}",
                       "--training.device=cpu", *compile_flags])
    model = build_model(Transformer, LlamaArgs(dim=64, n_layers=1, n_heads=4, vocab_size=64,
                                               max_seq_len=16))
    before = inductor_config.emulate_precision_casts
    compile_calls, real_compile = [], torch.compile
    monkeypatch.setattr(torch, "compile", lambda *a, **kw: compile_calls.append(kw)
                        or real_compile(*a, **kw))
    logger.addHandler(caplog.handler)
    try:
        dims = ParallelDims(dp_replicate=1, dp_shard=1, tp=1, world_size=1)
        dims.device_type = "cpu"
        parallelize_model(model, get("llama3"), dims, ParallelPlan(
            cfg.parallelism, cfg.float8, cfg.activation_checkpoint, cfg.compile,
            cfg.training.mixed_precision))
    finally:
        logger.removeHandler(caplog.handler)
    assert ("float8 casts run unfused" in caplog.text) == (not compiled)
    assert inductor_config.emulate_precision_casts == before  # the process-wide key untouched
    if compiled:
        assert len(compile_calls) == 1 and compile_calls[0]["backend"] == "inductor"
        options = compile_calls[0].get("options", {})  # the block's own inductor config
        assert options.get("emulate_precision_casts", False) == (recipe == "rowwise")


def _tiny(family: str, n_layers: int = 3):
    from conftest import build_model

    if family == "gpt2":
        from torchllm.models.gpt2.args import GPT2Args
        from torchllm.models.gpt2.model import GPT2

        return build_model(GPT2, GPT2Args(dim=32, n_layers=n_layers, n_heads=4, vocab_size=64,
                                          max_seq_len=32))
    from torchllm.models.llama.args import LlamaArgs
    from torchllm.models.llama.model import Transformer

    return build_model(Transformer, LlamaArgs(dim=32, n_layers=n_layers, n_heads=4, n_kv_heads=2,
                                              vocab_size=64, max_seq_len=32))


@pytest.mark.parametrize("family", ["llama3", "gpt2"])
def test_sampling_with_fullgraph_compiled_blocks_runs_eagerly(family):
    """The KV cache is keyed by module: through the compiled blocks every layer (and length)
    recompiled until FailOnRecompileLimitHit. Oracle: the same model, never compiled."""
    from types import SimpleNamespace

    from torchllm.eval.generation import generate
    from torchllm.parallel.compile import apply_compile

    torch._dynamo.reset()
    model = _tiny(family)
    expected = generate(model, [[1, 2, 3], [4]], 6, temperature=0.8, seed=1)
    apply_compile(model, SimpleNamespace(backend="eager"))  # fullgraph=True, as in training
    with torch._dynamo.config.patch(recompile_limit=2):
        model(torch.randint(0, 64, (2, 8))).sum().backward()  # a training step compiles
        assert generate(model, [[1, 2, 3], [4]], 6, temperature=0.8, seed=1) == expected
    torch._dynamo.reset()


def test_generate_computes_on_the_given_device_not_the_first_parameters():
    """fsdp_cpu_offload keeps parameters on CPU while the model computes on the GPU. Stand-in on
    CPU: the model's class (FSDP2 subclasses it too) whose first parameter lives on the meta
    device."""
    from torchllm.eval.generation import generate

    inner = _tiny("llama3")

    class Offloaded(type(inner)):
        def __init__(self):
            torch.nn.Module.__init__(self)
            self.offloaded = torch.nn.Parameter(torch.empty(1, device="meta"))
            self.inner, self.args = inner, inner.args

        def forward(self, *args, **kwargs):
            return self.inner(*args, **kwargs)

    expected = generate(inner, [[1, 2, 3]], 5)
    assert generate(Offloaded(), [[1, 2, 3]], 5, device=torch.device("cpu")) == expected


def test_in_training_samples_use_the_trainers_device(monkeypatch):
    from torchllm.config import load_config
    from torchllm.eval import in_training

    seen = {}

    def fake_generate(model, prompts, *args, **kwargs):
        seen.update(kwargs)
        return [[] for _ in prompts]

    class Tok:
        bos_id, eos_id = 1, 0

        def encode(self, text, bos=False):
            return [1, 2]

        def decode(self, ids):
            return "x"

    monkeypatch.setattr(in_training, "generate", fake_generate)
    cfg = load_config(["--eval.sample_freq=1", "--validation.enable=false"])
    evaluator = in_training.Evaluator(cfg.validation, cfg.eval, _tiny("llama3"), Tok(),
                                      torch.device("cpu"), [], seed=cfg.job.seed,
                                      last_step=cfg.training.steps)
    evaluator.samples(1)
    assert seen["device"] == torch.device("cpu")


@pytest.mark.parametrize("family", ["llama3", "gpt2"])
def test_unsharded_init_draws_on_the_cpu_generator_whatever_the_device(family):
    """Single-GPU/DDP models were initialized on the CUDA generator, so their weights differed
    from the CPU/FSDP2 init. Stand-in for CUDA: the meta device (no values, but every random op
    shows which device it ran on). Oracle for the values: conftest.build_model on CPU."""
    from torchllm.parallel.init import init_model_weights

    reference = _tiny(family)  # seed 0, on CPU
    build = lambda: type(reference)(reference.args)  # noqa: E731
    devices = []

    class RandomOps(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket.__name__ in ("normal_", "uniform_", "bernoulli_", "random_"):
                devices.append(args[0].device.type)
            return func(*args, **(kwargs or {}))

    with torch.device("meta"):
        model = build()
    with RandomOps():
        init_model_weights(model, build, torch.device("meta"), seed=0)
    assert devices and set(devices) == {"cpu"}, set(devices)
    assert all(t.device.type == "meta" for t in [*model.parameters(), *model.buffers()])

    with torch.device("meta"):
        model = build()
    init_model_weights(model, build, torch.device("cpu"), seed=0)
    for (name, got), want in zip(model.state_dict().items(), reference.state_dict().values()):
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=name)
    for got, want in zip(model.buffers(), reference.buffers()):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
