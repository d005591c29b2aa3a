"""estimate_memory as a user sizes a cluster with it: the assumptions it prints, the peak's terms
adding up, the optimizer's own state, TP dividing the activations in every phase, the reserved
figure and the --gpu_gib verdict (dry_run's too), and the trainer's refusals in its words."""

from __future__ import annotations

import json

import pytest
import torch

from cli import run_module
from messages import assert_names, refused
from torchllm import models
from torchllm.config import ConfigError, load_config
from torchllm.optim import build_optimizer
from torchllm.optim import registry as optim_registry
from builders.models import layout_dims
from torchllm.tools import estimate_memory as em

GPU = "--training.device=cuda"


def estimate(*args: str) -> tuple[int, dict, str]:
    ran = run_module("torchllm.tools.estimate_memory", *args, "--json")
    return ran.returncode, json.loads(ran.stdout) if ran.returncode in (0, 1) else {}, ran.stderr


def test_assumptions_are_echoed_with_where_they_came_from():
    """`--model.flavor=8B` alone takes the auto-trained tokenizer's 4,096 words and, on a CPU
    host, float32 activations: the estimate says so (and the flavor's own vocabulary once
    model.vocab_size names it)."""
    rc, out, _ = estimate("--model.flavor=8B", "--world_size", "8", "--training.device=cpu")
    said = out["assumptions"]
    assert rc == 0 and out["vocab_size"] == 4096
    assert_names(said["vocabulary"], "4,096", "data.tokenizer_vocab_size", "model.vocab_size")
    assert_names(said["device"], "cpu", "training.device")
    assert_names(said["dtypes"], "float32")
    rc, out, _ = estimate("--model.flavor=8B", "--world_size", "8", GPU,
                          "--model.vocab_size=128256", "--activation_checkpoint.mode=selective",
                          "--training.global_batch_size=64", "--training.local_batch_size=2")
    said = out["assumptions"]
    assert_names(said["vocabulary"], "128,256", "model.vocab_size")
    assert_names(said["dtypes"], "bf16")
    assert_names(said["activation checkpointing"], "selective", "op")
    assert_names(said["accumulation"], "4 micro-step")
    assert_names(said["reshard"], "fsdp_reshard_after_forward", "every micro-step")
    assert_names(said["loss"], "cross entropy")
    assert_names(said["optimizer"], "adamw", "declared")


def test_the_peak_phase_terms_add_up_in_the_json_and_the_table():
    args = ("--model.flavor=1B", "--world_size", "8", GPU, "--training.seq_len=4096")
    rc, out, _ = estimate(*args)
    assert rc == 0
    assert sum(out["peak_terms_bytes"].values()) == out["peak_bytes"]
    for r in out["ranks"]:  # every phase of every rank is the sum of its terms
        assert all(sum(r["phases"][p].values()) == n for p, n in r["phases_bytes"].items())
    table = run_module("torchllm.tools.estimate_memory", *args).stdout
    block = table.split("peak phase: ")[1].split("= peak (allocated)")[0].splitlines()[1:]
    shown = [float(ln.split()[-1]) for ln in block if ln.strip()]
    assert len(shown) == len(out["peak_terms_bytes"])
    assert sum(shown) == pytest.approx(out["peak_bytes"] / 2**30, abs=0.001 * len(shown))


def test_tensor_parallel_divides_the_activations_in_every_phase():
    """An activation-bound layout (8B, seq 8192, no AC): TP 2 holds half the activations in
    forward and the loss backward too (they were added before the division: 0.97x)."""
    base = ("--model.flavor=8B", GPU, "--model.vocab_size=128256", "--training.seq_len=8192",
            "--training.local_batch_size=1", "--parallelism.data_parallel_shard_degree=1")
    _, one, _ = estimate(*base, "--world_size", "1")
    _, two, _ = estimate(*base, "--world_size", "2", "--parallelism.tensor_parallel_degree=2")
    for phase in ("forward", "loss backward"):
        assert two["phases_bytes"][phase] <= 0.55 * one["phases_bytes"][phase], phase
    assert two["peak_bytes"] <= 0.55 * one["peak_bytes"]
    assert two["peak_terms_bytes"]["activations"] * 2 == pytest.approx(
        one["peak_terms_bytes"]["activations"], rel=0.01)


def state_bytes(opt: torch.optim.Optimizer) -> int:
    opts = getattr(opt, "optimizers", [opt])
    return sum(v.numel() * v.element_size() for o in opts for s in o.state.values()
               for v in s.values() if torch.is_tensor(v) and v.numel() > 1)


@pytest.mark.parametrize("name", ["adamw", "muon", "adamw8bit"])
def test_optimizer_term_is_the_optimizers_own_state(tmp_path, name):
    """Oracle: the state the real optimizer allocates for the debug model (adamw, muon: after
    a step; adamw8bit: torchao's own buffers, without compiling its step)."""
    args = ["--model.flavor=debug", "--training.device=cpu", f"--optimizer.name={name}",
            "--model.vocab_size=8192"]
    cfg = load_config(args)
    margs = models.model_args(cfg.model, cfg.training, cfg.data)
    model = models.get("llama3").build(margs)
    if name == "adamw8bit":
        pytest.importorskip("torchao")
        opt = build_optimizer(model, cfg.optimizer, torch.device("cpu"))
        real = sum(b.numel() * b.element_size() if not hasattr(b, "codes")
                   else b.codes.numel() + b.scale.numel() * 4
                   for g in opt.param_groups for p in g["params"]
                   for b in (opt._new_buffer(p, True), opt._new_buffer(p, False)))
    else:
        opt = build_optimizer(model, cfg.optimizer, torch.device("cpu"))
        model(torch.randint(0, margs.vocab_size, (1, 8))).sum().backward()
        opt.step()
        real = state_bytes(opt)
    est = em.estimate_memory(cfg, margs, 1)["terms_bytes"]["optimizer"]
    assert est == pytest.approx(real, rel=0.01), (name, est, real)
    adamw = em.estimate_memory(load_config(args[:2] + args[3:]), margs, 1)["terms_bytes"]
    assert est < adamw["optimizer"] if name != "adamw" else est == adamw["optimizer"]
    assert optim_registry.get(name).state_bytes is not None


def test_fsdp_accumulation_keeps_sharded_gradients_unless_asked():
    args = ("--model.flavor=1B", "--world_size", "8", GPU, "--training.local_batch_size=1",
            "--training.global_batch_size=32")
    _, every, _ = estimate(*args)
    _, once, _ = estimate(*args, "--parallelism.fsdp_reduce_every_microstep=false")
    terms = every["ranks"][0]["phases"]["forward"]
    assert terms["accumulated_grads"] == every["terms_bytes"]["grads"]  # 1/8 of them
    assert once["ranks"][0]["phases"]["forward"]["accumulated_grads"] == pytest.approx(
        8 * terms["accumulated_grads"], rel=0.01)


def test_the_trainers_refusals_in_its_words():
    argv = ["--model.flavor=debug", GPU, "--float8.enable=true", "--float8.emulate=true",
            "--parallelism.tensor_parallel_degree=2", "--parallelism.data_parallel_shard_degree=1"]
    cfg = load_config(argv)
    with pytest.raises(ConfigError) as trainer:
        layout_dims(cfg, 2, "cuda")
    ran = run_module("torchllm.tools.estimate_memory", *argv, "--world_size", "2")
    line = refused(ran, "float8.enable", "tensor_parallel_degree")
    assert str(trainer.value) in line
    ran = run_module("torchllm.tools.dry_run", *argv, "--world_size", "2")
    refused(ran, str(trainer.value))


def test_reserved_margin_decides_the_verdict_and_dry_run_names_only_levers_left():
    args = ("--model.flavor=1B", "--world_size", "8", GPU, "--training.seq_len=4096",
            "--activation_checkpoint.mode=full")
    _, out, _ = estimate(*args)
    assert out["reserved_gib"] >= out["peak_gib"] * (1 + em.RESERVED_MARGIN) - 0.001
    between = round((out["peak_gib"] + out["reserved_gib"]) / 2, 3)  # over the peak only
    ran = run_module("torchllm.tools.estimate_memory", *args, "--gpu_gib", str(between))
    assert ran.returncode == 1 and "DOES NOT FIT" in ran.stdout
    assert run_module("torchllm.tools.estimate_memory", *args, "--gpu_gib",
                      str(out["reserved_gib"] + 0.01)).returncode == 0
    ran = run_module("torchllm.tools.dry_run", *args, "--gpu_gib", str(between))
    assert ran.returncode == 1
    advice = [ln for ln in ran.stdout.splitlines() if "DOES NOT FIT" in ln][0]
    assert "activation_checkpoint" not in advice  # full AC is on already
    assert_names(advice, "local_batch_size", "reserved")
