"""Single-process checks of the parallel package: config validation, AC, compile, float8, clipping.

The real multi-process layouts are in test_parallel_multiprocess.py.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from torchllm.config import ConfigError, load_config
from torchllm.models.llama.args import LlamaArgs
from torchllm.models.llama.model import Transformer
from torchllm.parallel import clip_grad_norm_
from torchllm.parallel.ac import apply_ac
from torchllm.parallel.compile import apply_compile
from torchllm.parallel.float8 import apply_float8

from messages import raises_naming
from builders.models import EmulatedFloat8Matmul, layout_dims  # noqa: F401

ARGS = LlamaArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128, max_seq_len=16,
                 hidden_dim=128)


def tiny_model(args: LlamaArgs = ARGS) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(args)
    model.init_weights()
    return model


def loss_and_grads(model: nn.Module, tokens: torch.Tensor):
    loss = nn.functional.cross_entropy(model(tokens).flatten(0, 1).float(),
                                       tokens.roll(-1, 1).flatten())
    loss.backward()
    return loss.detach(), {n.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", ""):
                           p.grad for n, p in model.named_parameters()}


def dims_for(world: int, *flags: str, device_type: str = "cpu", args: LlamaArgs = ARGS):
    return layout_dims(load_config(list(flags)), world, device_type, args)


# -- ParallelDims ----------------------------------------------------------------------------
def test_degrees_resolve_and_name_their_dims():
    d = dims_for(8, "--parallelism.data_parallel_replicate_degree=2",
                 "--parallelism.tensor_parallel_degree=2")
    assert (d.dp_replicate, d.dp_shard, d.tp, d.dp_degree) == (2, 2, 2, 4)
    assert d.fsdp_enabled and d.dp_replicate_enabled and d.tp_enabled and not d.ddp_enabled
    d = dims_for(4, "--parallelism.dp_mode=ddp")
    assert (d.dp_replicate, d.dp_shard) == (4, 1) and d.ddp_enabled and not d.fsdp_enabled
    d = dims_for(1)
    assert (d.dp_degree, d.dp_rank, d.dp_enabled) == (1, 0, False)
    assert d.build_mesh(torch.device("cpu")) is None  # one process: no process group at all


@pytest.mark.parametrize("world, flags, message", [
    (4, ["--parallelism.data_parallel_shard_degree=3"], "= 3, but the world size is 4"),
    (2, ["--parallelism.tensor_parallel_degree=0"], "tensor_parallel_degree = 0: must be >= 1"),
    (4, ["--parallelism.dp_mode=ddp", "--parallelism.data_parallel_replicate_degree=2"],
     "dp_mode = 'ddp' cannot shard"),
    (4, ["--parallelism.data_parallel_replicate_degree=2",
         "--parallelism.tensor_parallel_degree=2"], "use FSDP2 \\+ TP instead"),
    (4, ["--parallelism.tensor_parallel_degree=4"], "does not divide the model's n_kv_heads = 2"),
    (2, ["--parallelism.tensor_parallel_degree=2", "--model.tie_embeddings=true"],
     "tied embeddings is not supported"),
    (2, ["--parallelism.tensor_parallel_degree=2", "--training.seq_len=15"],
     "seq_len = 15 is not a multiple"),
    (2, ["--parallelism.tensor_parallel_degree=2", "--float8.enable"], "float8.enable with"),
    (2, ["--parallelism.tensor_parallel_degree=2", "--training.chunked_loss"],
     "chunked_loss with tensor_parallel_degree"),
    (2, ["--parallelism.fsdp_cpu_offload"], "fsdp_cpu_offload = true needs CUDA"),
    (2, ["--parallelism.dp_mode=ddp", "--parallelism.ddp_comm_hook=bf16"], "needs CUDA \\+ NCCL"),
    (1, ["--activation_checkpoint.mode=selective", "--activation_checkpoint.selective_option=x"],
     "use 'op', 'ffn', 'attention', or a positive integer"),
    (1, ["--compile.components=model,graph"], "compile.components = 'model,graph' must be one of"),
    (1, ["--float8.enable"], "compute capability 8.9"),
])
def test_bad_layouts_are_config_errors(world, flags, message):
    args = ARGS
    if "--model.tie_embeddings=true" in flags:
        args = LlamaArgs(**{**ARGS.__dict__, "tie_embeddings": True})
    with pytest.raises(ConfigError, match=message):
        dims_for(world, *flags, args=args)


def test_trainer_rejects_a_bad_layout_before_any_process_group(tmp_path, monkeypatch):
    from torchllm.train import Trainer

    from conftest import tiny_config

    monkeypatch.setenv("WORLD_SIZE", "3")
    with raises_naming(ConfigError, "shard=2", "= 2", "3"):  # the degrees, their product, the world
        Trainer(tiny_config(tmp_path, "--parallelism.data_parallel_shard_degree=2"))
    assert not torch.distributed.is_initialized()


# -- activation checkpointing ----------------------------------------------------------------
def saved_activation_bytes(model: nn.Module, tokens: torch.Tensor) -> int:
    """Bytes autograd keeps for backward (parameters excluded) during one forward."""
    params = {p.data_ptr() for p in model.parameters()}
    total = 0

    def pack(t):
        nonlocal total
        if t.data_ptr() not in params:
            total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(tokens)
    return total


def test_every_ac_mode_keeps_losses_and_gradients_and_saves_memory():
    tokens = torch.randint(0, ARGS.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    ref_loss, ref_grads = loss_and_grads(tiny_model(), tokens)
    none_bytes = saved_activation_bytes(tiny_model(), tokens)
    cases = {("full", "op"): {"block": 2}, ("selective", "op"): {"block_op": 2},
             ("selective", "2"): {"block": 1}, ("selective", "ffn"): {"feed_forward": 2},
             ("selective", "attention"): {"attention": 2}}
    for (mode, option), expected_counts in cases.items():
        cfg = load_config([f"--activation_checkpoint.mode={mode}",
                           f"--activation_checkpoint.selective_option={option}"])
        model = tiny_model()
        assert apply_ac(model, cfg.activation_checkpoint) == expected_counts
        loss, grads = loss_and_grads(model, tokens)
        torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0, msg=f"{mode}/{option}")
        for name, grad in ref_grads.items():
            torch.testing.assert_close(grads[name], grad, rtol=1e-6, atol=1e-7,
                                       msg=f"{mode}/{option} {name}")
        assert saved_activation_bytes(model, tokens) < none_bytes, (mode, option)
    assert apply_ac(tiny_model(), load_config([]).activation_checkpoint) == {}


# -- compile -----------------------------------------------------------------------------------
@pytest.mark.slow
def test_compiled_blocks_match_eager():
    tokens = torch.randint(0, ARGS.vocab_size, (2, 16), generator=torch.Generator().manual_seed(2))
    args = LlamaArgs(**{**ARGS.__dict__, "n_layers": 1})
    ref_loss, ref_grads = loss_and_grads(tiny_model(args), tokens)
    model = tiny_model(args)
    # aot_eager: Dynamo + AOT autograd without inductor's C++ codegen (minutes on a small CPU)
    ccfg = load_config(["--compile.enable", "--compile.backend=aot_eager"]).compile
    assert apply_compile(model, ccfg) == 1
    assert type(model.layers["0"]).__name__ == "OptimizedModule"
    loss, grads = loss_and_grads(model, tokens)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-5, msg=name)


# -- float8 --------------------------------------------------------------------------------
def test_float8_needs_capable_hardware_or_emulate():
    if torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9):
        pytest.skip("this GPU runs float8")
    cfg = load_config(["--float8.enable"])
    with pytest.raises(ConfigError, match="compute capability 8.9"):
        apply_float8(tiny_model(), cfg.float8, "cuda" if torch.cuda.is_available() else "cpu",
                     fsdp_enabled=False)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_float8_swaps_exactly_the_eligible_linears_and_trains_emulated(recipe):
    pytest.importorskip("torchao")
    from torchao.float8.float8_linear import Float8Linear

    # FFN width 72 is not a multiple of 16: w1/w2/w3 stay; the output layer is filtered by name.
    args = LlamaArgs(**{**ARGS.__dict__, "hidden_dim": 72})
    ref = tiny_model(args)
    model = tiny_model(args)
    cfg = load_config(["--float8.enable", "--float8.emulate", f"--float8.recipe={recipe}"])
    converted = apply_float8(model, cfg.float8, "cpu", fsdp_enabled=False)
    expected = {f"layers.{i}.attention.{w}" for i in range(2) for w in ("wq", "wk", "wv", "wo")}
    assert set(converted) == expected
    float8 = {n for n, m in model.named_modules() if isinstance(m, Float8Linear)}
    assert float8 == expected
    plain = {n for n, m in model.named_modules() if type(m) is nn.Linear}
    ffn = {f"layers.{i}.feed_forward.{w}" for i in range(2) for w in ("w1", "w2", "w3")}
    assert plain == ffn | {"output"}
    # One emulated training step: float8 rounding moves the loss and grads a little, not a lot.
    tokens = torch.randint(0, args.vocab_size, (2, 16), generator=torch.Generator().manual_seed(3))
    ref_loss, ref_grads = loss_and_grads(ref, tokens)
    loss, grads = loss_and_grads(model, tokens)
    assert loss.item() == pytest.approx(ref_loss.item(), rel=2e-2)
    assert loss.item() != ref_loss.item()  # the float8 casts really ran
    for name, grad in ref_grads.items():
        rel = (grads[name] - grad).norm() / grad.norm()
        assert rel < 0.35, (name, rel)  # e4m3 keeps 3 mantissa bits
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    assert torch.isfinite(model.layers["0"].attention.wq.weight).all()


def test_float8_tensorwise_equals_a_hand_written_emulation():
    """Loss and every gradient of the float8 model equal those of the same model whose eligible
    linears run EmulatedFloat8Matmul, to fp32 summation-order differences (1e-5). A scale off by
    10%, or from the wrong tensor, rounds other elements and moves the gradients by ~1e-2."""
    pytest.importorskip("torchao")
    model, ref = tiny_model(), tiny_model()
    cfg = load_config(["--float8.enable", "--float8.emulate", "--float8.recipe=tensorwise"])
    converted = apply_float8(model, cfg.float8, "cpu", fsdp_enabled=False)
    assert len(converted) == 2 * 7  # attention and FFN linears of both blocks
    for name in converted:
        linear = ref.get_submodule(name)
        linear.forward = lambda x, w=linear.weight: EmulatedFloat8Matmul.apply(x, w)
    tokens = torch.randint(0, ARGS.vocab_size, (2, 16), generator=torch.Generator().manual_seed(3))
    ref_loss, ref_grads = loss_and_grads(ref, tokens)
    loss, grads = loss_and_grads(model, tokens)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
    for name, grad in ref_grads.items():
        rel = ((grads[name] - grad).norm() / grad.norm()).item()
        assert rel < 1e-5, (name, rel)


# -- clipping ------------------------------------------------------------------------------
def test_clip_grad_norm_matches_torch_on_plain_tensors():
    a, b = tiny_model(), tiny_model()
    tokens = torch.randint(0, ARGS.vocab_size, (2, 16), generator=torch.Generator().manual_seed(4))
    loss_and_grads(a, tokens)
    loss_and_grads(b, tokens)
    expected = torch.nn.utils.clip_grad_norm_(a.parameters(), 0.1)
    got = clip_grad_norm_(b.parameters(), 0.1)
    torch.testing.assert_close(got, expected)
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pb.grad, pa.grad)
    assert clip_grad_norm_(b.parameters(), 0.0) == pytest.approx(0.1, rel=1e-5)  # 0 = no clipping


@pytest.mark.slow
def test_trainer_applies_ac_and_compile_from_config(tmp_path):
    """The same losses through parallelize_model with full AC and compiled blocks and loss."""
    from torchllm.train import Trainer

    from conftest import tiny_config

    common = ("--training.steps=2", "--training.seq_len=16", "--job.run_name=t")
    plain = Trainer(tiny_config(tmp_path, *common))
    plain_losses = [plain.train_step()["loss"] for _ in range(2)]
    wrapped = Trainer(tiny_config(tmp_path, *common, "--activation_checkpoint.mode=full",
                                  "--compile.enable", "--compile.backend=aot_eager"))
    for block in wrapped.model.layers.values():  # compile(checkpoint_wrapper(block))
        assert type(block).__name__ == "OptimizedModule"
        assert type(block._orig_mod).__name__ == "CheckpointWrapper"
    assert wrapped.module.loss_fn is not plain.module.loss_fn  # the loss is compiled too
    losses = [wrapped.train_step()["loss"] for _ in range(2)]
    assert losses == pytest.approx(plain_losses, rel=1e-5)


def test_the_plan_of_a_runs_sections_keeps_ddp_buckets_static_under_fault_tolerance():
    """ParallelPlan.of: one constructor from the sections (the trainer, the estimate, the dry
    run); a fault-tolerant run's DDP buckets never rebuild (a relaunched group's match its
    peers'), a plain run's may."""
    from torchllm.parallel import ParallelPlan

    def plan(*flags):
        cfg = load_config(["--activation_checkpoint.mode=full", *flags])
        return ParallelPlan.of(parallelism=cfg.parallelism, float8=cfg.float8,
                               activation_checkpoint=cfg.activation_checkpoint,
                               compile=cfg.compile, training=cfg.training,
                               fault_tolerance=cfg.fault_tolerance)

    plain, ft = plan(), plan("--fault_tolerance.enable=true")
    assert not plain.static_ddp_buckets and ft.static_ddp_buckets
    assert plain.activation_checkpoint.mode == "full"
    assert plain.mixed_precision == load_config([]).training.mixed_precision
