"""Each parallel degree divides the memory it claims, measured per rank on real gloo ranks:
tensor parallelism the logits and their gradient, context parallelism attention (per-rank peaks
from the CPU allocator's live-byte count, every thread's frees included: benchmarks/benchlib/
tensor_memory.py), FSDP2's gradients under accumulation and in pipeline stages (the gradient
bytes FSDP2 holds between micro-steps, read from its own fields: a peak does not say which
tensors it holds). Plus the vocab-parallel loss's value and gradient, and the selective-AC op
policy's trade (every second matmul output kept)."""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

import pytest
import torch

from conftest import spawn_gloo, tiny_config
from torchllm.metrics.memory import _local_bytes

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from benchlib.tensor_memory import (PeakTensorMemory, count_every_thread,  # noqa: E402
                                   live_tensor_bytes)

STEP = ("--metrics.log_freq=1000", "--training.steps=100", "--lr_scheduler.warmup_steps=2")
# Logits dominate: a 16k vocabulary over 32-wide hidden states.
LOGITS = (*STEP, "--model.dim=32", "--model.n_layers=1", "--model.n_heads=2",
          "--model.n_kv_heads=2", "--model.vocab_pad_multiple=16384", "--training.seq_len=64",
          "--training.local_batch_size=4", "--training.global_batch_size=4")
# Attention dominates: long windows, a narrow model, one KV head (the gathered keys stay small).
ATTENTION = (*STEP, "--model.dim=64", "--model.n_layers=2", "--model.n_heads=8",
             "--model.n_kv_heads=1", "--model.hidden_dim=64", "--training.local_batch_size=1",
             "--training.global_batch_size=1")
# Weights dominate: a wide model over short windows.
WEIGHTS = (*STEP, "--model.dim=256", "--model.n_layers=2", "--model.n_heads=4",
           "--model.n_kv_heads=4", "--model.hidden_dim=512", "--training.seq_len=16",
           "--training.local_batch_size=1")


def gradient_bytes(modules) -> int:
    """Bytes of every gradient this rank holds for the FSDP2 parameters of `modules`: the sharded
    gradients, and the unsharded ones FSDP2 keeps while it skips reduce-scatters (its own
    fields: a gradient held only by C++ has no Python object to find otherwise)."""
    from torch.distributed.fsdp import fully_shard

    total = 0
    for module in modules:
        for state in fully_shard.state(module)._state_ctx.all_states:
            for group in state._fsdp_param_groups:
                for param in group.fsdp_params:
                    unsharded = getattr(param, "_unsharded_param", None)
                    for grad in (param.sharded_param.grad, param.unsharded_accumulated_grad,
                                 None if unsharded is None else unsharded.grad):
                        total += 0 if grad is None else _local_bytes(grad)
    return total


def _measure(rank: int, tmp_path, args: list[str], micro_steps: int) -> None:
    """One step's forward + backward over `micro_steps` micro-batches after a warm-up step: this
    rank's peak tensor bytes (baseline: params, grads, optimizer state alive before, + the net
    peak of the step) and the gradient bytes it holds after; written by every rank."""
    from torchllm.train import Trainer

    count_every_thread()  # before the model: every free the allocator sees, on any thread
    trainer = Trainer(tiny_config(tmp_path, *args))
    try:
        trainer.train_step()  # creates the optimizer state; frees the gradients
        batches = [next(trainer.batches) for _ in range(micro_steps)]
        # FSDP2 runs: the gradient bytes held between micro-steps (each begins with
        # levers.micro_step) or, under PP, after each micro-batch's backward.
        stages = getattr(trainer.module.pipeline, "stages", [trainer.model])
        between, micro_step = [], trainer.module.levers.micro_step
        if trainer.parallel_dims.fsdp_enabled:
            trainer.module.levers.micro_step = lambda: (between.append(gradient_bytes(stages)),
                                                 micro_step())
            for stage in getattr(trainer.module.pipeline, "pipeline_stages", ()):
                stage.backward_maybe_with_nosync = _recording(stage.backward_maybe_with_nosync,
                                                              between, stages)
        baseline = live_tensor_bytes(trainer.model, trainer.optimizer)
        with PeakTensorMemory(baseline) as mem:
            loss, _ = trainer.module.train_batch(batches)
        grads = sum(_local_bytes(p.grad) for p in trainer.model.parameters() if p.grad is not None)
        result = {"peak": mem.peak_bytes, "net": mem.net_peak_bytes, "baseline": baseline,
                  "grads": grads, "loss": float(loss), "between": between}
    finally:
        trainer.close()
    (tmp_path / f"{rank}.json").write_text(json.dumps(result))


def _recording(backward, between: list, stages):
    """A pipeline stage's micro-batch backward that records the gradient bytes after it."""
    def run(*args, **kwargs):
        out = backward(*args, **kwargs)
        between.append(gradient_bytes(stages))
        return out

    return run


def _rank(rank: int, tmp_path, args: list[str], micro_steps: int) -> None:
    """A spawned gloo rank: the launcher's environment, one thread (2 ranks share the CPU)."""
    import os

    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(WORLD_SIZE=str(dist.get_world_size()), RANK=str(rank),
                      LOCAL_RANK=str(rank))
    _measure(rank, tmp_path, args, micro_steps)


def per_rank(tmp_path, name: str, args, world: int, micro_steps: int = 1) -> list[dict]:
    folder = tmp_path / name
    folder.mkdir()
    if world == 1:
        _measure(0, folder, list(args), micro_steps)
    else:
        spawn_gloo(_rank, folder, list(args), micro_steps, world=world)
    return [json.loads((folder / f"{r}.json").read_text()) for r in range(world)]


@pytest.mark.slow
def test_tp_shards_the_logits_and_their_gradient(tmp_path):
    """TP 2 holds at most 0.6x TP 1's per-rank peak where logits dominate (each rank holds
    [tokens, vocab / tp] logits and gradient; gathering them costs the whole vocabulary)."""
    one = per_rank(tmp_path, "tp1", LOGITS, 1)[0]
    two = per_rank(tmp_path, "tp2", (*LOGITS, "--parallelism.tensor_parallel_degree=2"), 2)
    assert two[0]["loss"] == two[1]["loss"]  # every tp rank reports the same loss
    assert two[0]["loss"] == pytest.approx(one["loss"], rel=1e-5)
    for r in two:
        assert r["peak"] <= 0.6 * one["peak"], (r["peak"], one["peak"])


@pytest.mark.slow
def test_cp_divides_attention_memory_with_no_quadratic_term(tmp_path):
    """CP 2 holds at most 0.6x CP 1's per-rank peak where attention dominates, and doubling the
    window at most doubles a CP rank's step memory (+10%): nothing of size S x S/cp (a dense
    mask, an index grid) is built."""
    cp = "--parallelism.context_parallel_degree=2"
    one = per_rank(tmp_path, "cp1", (*ATTENTION, "--training.seq_len=2048"), 1)[0]
    two = per_rank(tmp_path, "cp2", (*ATTENTION, "--training.seq_len=2048", cp), 2)
    assert two[0]["loss"] == pytest.approx(one["loss"], rel=1e-5)
    for r in two:
        assert r["peak"] <= 0.6 * one["peak"], (r["peak"], one["peak"])
    half = per_rank(tmp_path, "cp2_half", (*ATTENTION, "--training.seq_len=1024", cp), 2)
    for short, long in zip(half, two):
        assert long["net"] <= 2.2 * short["net"], (short["net"], long["net"])


@pytest.mark.parametrize("path", ["cpu_flash", "float32_matmuls"])
def test_op_ac_keeps_no_chunk_pair_of_cp_attention(path, monkeypatch):
    """Under selective 'op' AC a CP rank's chunked attention keeps nothing beyond its output
    after forward (as full AC): the policy caches no op inside the custom Function (was: every
    chunk pair's output, 3.5x the output here on the CPU flash path, and on the float32 path of
    GPUs every tile's scores, 23x: S x S/cp)."""
    from torch.profiler import ProfilerActivity, profile
    from torch.utils.checkpoint import checkpoint

    import torchllm.models.chunked_attention as ca
    from torchllm.parallel.ac import _op_policy_context

    if path == "float32_matmuls":  # the non-CPU path, run on CPU
        monkeypatch.setattr(ca, "_cpu_flash", lambda q: False)
    q = torch.randn(1, 4, 512, 32, requires_grad=True)  # rank 0 of cp 2: two 256-token chunks
    k, v = (torch.randn(1, 4, 1024, 32, requires_grad=True) for _ in range(2))
    mask = ca.ChunkedMask(rank=0, degree=2)

    def attend(q, k, v):
        return ca.chunked_attention(q * 1.0, k * 1.0, v * 1.0, mask)

    kept = {}
    for policy in ("full", "op"):
        fn = {"context_fn": _op_policy_context} if policy == "op" else {}
        # (the profiler's own allocation and free events, all on this thread: what forward left
        # alive; not PeakTensorMemory, whose allocator flag would stay on for later tests)
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            out = checkpoint(attend, q, k, v, use_reentrant=False, **fn)
        kept[policy] = sum(e.nbytes() for e in prof.profiler.kineto_results.events()
                           if e.name() == "[memory]")
        out.sum().backward()  # (and backward still runs from what was kept)
        del out
    out_bytes = q.numel() * 4
    assert out_bytes <= kept["op"] <= kept["full"] + 4096, kept


def test_op_ac_keeps_tp_collectives_inside_functions(monkeypatch):
    """The 'op' policy still keeps what runs without grad inside other autograd Functions: TP's
    reduce-scatter outputs (DTensor's redistribute; recomputed they would communicate again) and
    their kernels (float8's _scaled_mm); only the chunked attention's kernels are recomputed."""
    from types import SimpleNamespace

    from torch.utils.checkpoint import CheckpointPolicy

    import torchllm.models.chunked_attention as ca
    from torchllm.parallel.ac import _op_policy

    c10d = getattr(torch.ops, "_c10d_functional", None)
    if c10d is None or not hasattr(c10d, "reduce_scatter_tensor"):
        pytest.skip("this torch has no functional reduce_scatter_tensor")
    policy, ctx = _op_policy(), SimpleNamespace(is_recompute=False)
    attention = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    with torch.no_grad():
        assert policy(ctx, c10d.reduce_scatter_tensor.default) == CheckpointPolicy.MUST_SAVE
        assert policy(ctx, attention) == CheckpointPolicy.MUST_SAVE
        monkeypatch.setattr(ca, "_running", [1])  # inside a chunked attention's forward
        assert policy(ctx, attention) == CheckpointPolicy.PREFER_RECOMPUTE


@pytest.mark.slow
def test_fsdp2_accumulation_keeps_gradients_sharded(tmp_path):
    """FSDP 2 with 4 micro-steps holds the gradient bytes it holds with 1: between micro-steps
    only the sharded gradients (each micro-step reduce-scatters), not the whole model's fp32
    gradients until the last one (2x the shard here)."""
    one = per_rank(tmp_path, "accum1", (*WEIGHTS, "--training.global_batch_size=2"), 2, 1)
    four = per_rank(tmp_path, "accum4", (*WEIGHTS, "--training.global_batch_size=8"), 2, 4)
    for a, b in zip(one, four):
        assert b["grads"] == a["grads"] > 0  # sharded after the step either way
        held = b["between"][1:]  # after micro-steps 1, 2, 3
        assert held == [a["grads"]] * 3, (held, a["grads"])


@pytest.mark.slow
def test_selective_op_ac_saves_every_second_matmul():
    """activation_checkpoint selective 'op' keeps every second matmul output of a block (and the
    attention outputs), as TorchTitan's policy does: at most 75% of the bytes that keeping every
    matmul output holds for backward, with the same loss and gradients as no AC."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.profiler import ProfilerActivity, profile
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    from torchllm.config import load_config
    from torchllm.models.llama.args import LlamaArgs
    from torchllm.models.llama.model import Transformer
    from torchllm.parallel.ac import _save_list, apply_ac

    args = LlamaArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=4, vocab_size=64,
                     max_seq_len=128, hidden_dim=256)
    tokens = torch.randint(0, 64, (2, 128), generator=torch.Generator().manual_seed(0))

    def model():
        torch.manual_seed(0)
        m = Transformer(args)
        m.init_weights()
        return m

    def every_matmul():  # the policy 'op' had: every matmul output saved
        save = _save_list()
        return create_selective_checkpoint_contexts(
            lambda ctx, op, *a, **k: CheckpointPolicy.MUST_SAVE if op in save
            else CheckpointPolicy.PREFER_RECOMPUTE)

    def kept_for_backward(m) -> tuple[int, torch.Tensor, list]:
        gc.collect()  # (an earlier test's garbage freed inside the window would count negative)
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            hidden = m.norm(run_blocks(m))  # the blocks' saved tensors stay alive with it
        kept = sum(e.nbytes() for e in prof.profiler.kineto_results.events()
                   if e.name() == "[memory]")
        loss = m.output(hidden).float().logsumexp(-1).sum()
        loss.backward()
        return kept, loss.detach(), [p.grad.clone() for p in m.parameters()]

    def run_blocks(m):
        h, rope = m.tok_embeddings(tokens), m.rope_cache[:tokens.shape[1]]
        for block in m.layers.values():
            h = block(h, rope)
        return h

    plain = model()
    _, ref_loss, ref_grads = kept_for_backward(plain)
    selective = model()
    apply_ac(selective, load_config(["--activation_checkpoint.mode=selective",
                                     "--activation_checkpoint.selective_option=op"])
             .activation_checkpoint)
    kept, loss, grads = kept_for_backward(selective)
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    everything = model()
    for name, block in list(everything.layers.items()):
        everything.layers[name] = checkpoint_wrapper(block, preserve_rng_state=False,
                                                     context_fn=every_matmul)
    kept_all, _, _ = kept_for_backward(everything)
    assert kept <= 0.75 * kept_all, (kept, kept_all)


@pytest.mark.slow
def test_pipeline_stage_gradients_stay_sharded_under_fsdp2(tmp_path):
    """PP 2 x FSDP 2: after each micro-batch's backward a stage holds its sharded gradients,
    not its unsharded fp32 gradients until the schedule's last backward (2x the shard here)."""
    args = (*WEIGHTS, "--model.tie_embeddings=false", "--parallelism.pipeline_parallel_degree=2",
            "--parallelism.data_parallel_shard_degree=2", "--training.local_batch_size=4",
            "--parallelism.pipeline_parallel_microbatch_size=1", "--training.global_batch_size=8")
    for r in per_rank(tmp_path, "pp_fsdp", args, 4):
        held = r["between"]  # one per micro-batch's backward
        assert len(held) == 4 and r["grads"] > 0, r
        assert held == [r["grads"]] * 4, (held, r["grads"])


def _vocab_parallel_rank(rank: int, tmp_path) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from torchllm.loss import IGNORE_INDEX, cross_entropy_sum, fused_cross_entropy_sum

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2,))
    g = torch.Generator().manual_seed(0)
    results = {}
    for vocab, dtype in ((37, torch.float32), (64, torch.bfloat16)):  # 37: uneven shards
        logits = (4 * torch.randn(3, 5, vocab, generator=g)).to(dtype)
        targets = torch.randint(0, vocab, (3, 5), generator=g)
        targets[0, :2] = IGNORE_INDEX
        targets[2, 4] = vocab - 1  # the last column: on the last rank
        whole = logits.clone().requires_grad_()
        want = cross_entropy_sum(whole, targets)
        want.backward()
        sharded = distribute_tensor(logits, mesh, [Shard(2)]).requires_grad_()
        got = fused_cross_entropy_sum(sharded, targets)
        got.backward()
        grad = sharded.grad.full_tensor()
        results[f"{vocab}"] = {"loss": [float(got), float(want)],
                               "grad": float((grad.float() - whole.grad.float()).abs().max()),
                               "scale": float(whole.grad.float().abs().max())}
    (tmp_path / f"{rank}.json").write_text(json.dumps(results))


@pytest.mark.slow
def test_vocab_parallel_loss_equals_the_gathered_loss(tmp_path):
    """TP's loss on vocab-sharded logits (2 gloo ranks): the summed cross entropy and its
    gradient equal the whole logits' (ignored targets, uneven shards, bf16 logits)."""
    spawn_gloo(_vocab_parallel_rank, tmp_path)
    for rank in range(2):
        for vocab, r in json.loads((tmp_path / f"{rank}.json").read_text()).items():
            got, want = r["loss"]
            assert got == pytest.approx(want, rel=1e-6), vocab
            rounding = 1e-6 if vocab == "37" else 1e-2  # float32; bf16 gradients
            assert r["grad"] <= rounding * r["scale"], (vocab, r)
