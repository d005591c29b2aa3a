"""CPU tests of the GPU tests' harness (tests/gpu_harness.py) and of benchmarks/bench_gpu.py."""

from __future__ import annotations

import datetime
import json
import math
import os
import sys

import pytest
import torch

from conftest import REPO
from conftest import _process_state, state_changes
from gpu_harness import (CPU_STEPS, LR, STEPS, VOCAB, check_steps, compare_curves, ddp_model,
                         float8_config, initial_state, make_batches, materialize, meta_model,
                         one_rank_group, prepare_compile, prepare_float8, prepare_fsdp,
                         prepared_model, reference_curve, restored_process_state,
                         saved_checkpoint_keys, teacher_forced_gaps, train_curve)
from torchllm import models
from torchllm.config import load_config
from messages import assert_names, raises_naming


@pytest.mark.slow
def test_reference_curve_learns_the_synthetic_stream():
    ref = reference_curve(STEPS)
    assert len(ref) == STEPS and all(math.isfinite(v) for v in ref)
    assert ref[0] == pytest.approx(math.log(VOCAB), abs=0.6)  # a fresh model is ~uniform
    # and it learns (a flat curve would compare nothing): ~6.7 -> ~5.4 on this stream
    assert sum(ref[-4:]) / 4 < sum(ref[:4]) / 4 - 0.5


@pytest.fixture
def one_thread():
    """The reference on one thread: 20x faster on this loaded machine class (golden curves)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_teacher_forced_oracle_passes_rounding_and_fails_a_compiled_rope_bug(one_thread,
                                                                            monkeypatch):
    """The oracle on CPU, the path under test standing in for a CUDA one. Rounding: the same
    steps in float64 (fp32 rounding is all that differs) pass the fp32 tolerance, and so does
    the compiled model (aot_eager), whose RoPE is another function (apply_rope's compiled branch,
    `_rotate_pairs`, the one inductor runs on a GPU). Planted bug: that compiled branch rotating
    by -angle (the eager reference is untouched) fails it, in the very first step."""
    import torchllm.models.llama.model as llama

    with restored_process_state():
        model = prepared_model("cpu")
        model.double()
        check_steps(teacher_forced_gaps(model, "cpu", steps=CPU_STEPS), "fp32")
        compiled = teacher_forced_gaps(prepared_model("cpu", prepare_compile("aot_eager")), "cpu",
                                       steps=2)
        check_steps(compiled, "fp32")
    rotate = llama._rotate_pairs
    monkeypatch.setattr(llama, "_rotate_pairs", lambda x, cos, sin: rotate(x, cos, -sin))
    with restored_process_state():
        gaps = teacher_forced_gaps(prepared_model("cpu", prepare_compile("aot_eager")), "cpu",
                                   steps=2)
    with raises_naming(AssertionError, "(1, 'loss'"):  # the first step and quantity off
        check_steps(gaps, "fp32")
    assert min(g["grads"] for g in gaps) > 10 * max(g["grads"] for g in compiled) + 0.5


def test_restored_process_state_undoes_what_cuda_paths_change():
    """What the first GPU run's grouped_mm module left behind (TRITON_CACHE_DIR,
    TRITON_PTXAS_PATH, float32 matmul precision 'highest' -> 'high' through the Trainer's TF32
    switch), plus a dynamo and an inductor key; oracle: the suite's own state guard."""
    import torch._dynamo.config
    import torch._inductor.config

    before = _process_state()
    with restored_process_state():
        os.environ["TRITON_CACHE_DIR"] = "/tmp/triton-cache-of-a-test"
        os.environ["TRITON_PTXAS_PATH"] = "/usr/local/cuda/bin/ptxas"
        torch.backends.cuda.matmul.allow_tf32 = True
        torch._inductor.config.max_autotune = not torch._inductor.config.max_autotune
        torch._dynamo.config.recompile_limit += 1
        assert len(state_changes(before, _process_state())) == 5
    assert state_changes(before, _process_state()) == []
    assert torch.backends.cuda.matmul.allow_tf32 is False
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("medium")  # allow_tf32 reads True here, as at 'high'
    try:
        with restored_process_state():
            torch.backends.cuda.matmul.allow_tf32 = False
        assert torch.get_float32_matmul_precision() == "medium"
    finally:
        torch.set_float32_matmul_precision(precision)


def test_only_tests_marked_gpu_skip_without_cuda(monkeypatch):
    """A checkout in a folder named `gpu` made every test's keywords contain 'gpu': the whole
    suite skipped there. The skip follows the marker only."""
    import conftest

    class Item:
        def __init__(self, marked):
            self.nodeid = f"gpu/tests/test_x.py::test_{marked}"  # (a checkout named gpu)
            self.keywords = {"gpu": 1, "tests": 1}  # the folder's name, as pytest adds it
            self.marked, self.markers = marked, []

        def get_closest_marker(self, name):
            return pytest.mark.gpu.mark if self.marked and name == "gpu" else None

        def add_marker(self, marker):
            self.markers.append(marker)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    items = [Item(True), Item(False)]
    conftest.pytest_collection_modifyitems(None, items)
    assert [len(i.markers) for i in items] == [1, 0]


def test_compare_curves_catches_drift_and_nan():
    ref = [6.0, 5.0, 4.0]
    assert compare_curves(ref, [6.01, 5.01, 4.01], "bf16") < 0.01
    with pytest.raises(AssertionError, match="step, ref, got"):
        compare_curves(ref, [6.0, 5.0, 4.6], "bf16")
    with pytest.raises(AssertionError):
        compare_curves(ref, [6.0, float("nan"), 4.0], "float8")
    with pytest.raises(AssertionError, match="3 steps"):
        compare_curves(ref + [3.0], ref, "fp32")


@pytest.mark.slow
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
def test_bench_gpu_cpu_path_reports_what_a_direct_run_measures(tmp_path, monkeypatch):
    """benchmarks/bench_gpu.py end to end on CPU with the debug model and the transformers peer
    (fp32, 2 rounds): its losses are a direct Trainer run's, its MFU is tokens/s x FLOPs/token /
    peak, its peak memory near the estimate; the peer's row is read back, and the variant's
    ratio is the geometric mean of the rounds' paired ratios, printed in the table."""
    from torchllm.train import Trainer

    # main() here, not `python bench_gpu.py` (~5 CPU-s of imports): its runs are processes of
    # their own either way, the peer's `bench_gpu.py --peer_worker` the script run as a user does.
    argv = ["--device", "cpu", "--config", str(REPO / "train_configs/debug_model.toml"),
            "--seq_len", "32", "--local_batch_size", "2", "--steps", "1", "--warmup", "2",
            "--variants", "fp32", "--peer", "transformers", "--peer_precision", "fp32",
            "--rounds", "2", "--out_dir", str(tmp_path), "--data.tokenizer_vocab_size=512"]
    monkeypatch.chdir(tmp_path)
    assert bench_gpu_module().main(argv) == 0
    stem = f"gpu_cpu_{datetime.date.today().isoformat()}"
    result = json.loads((tmp_path / f"{stem}.json").read_text())
    table = (tmp_path / f"{stem}.md").read_text()
    row, peer = result["rows"]
    assert row["variant"] == "fp32" and peer["variant"] == "peer_transformers"
    assert row["status"] == "ok" and len(row["losses"]) == 3
    tokenizer = tmp_path / "bench_gpu_work/runs/data/tokenizer_embedded_sp512.model"
    direct = Trainer(load_config([
        "--job.config_file", str(REPO / "train_configs/debug_model.toml"),
        "--training.device=cpu", "--training.seq_len=32", "--training.local_batch_size=2",
        "--training.steps=3", "--data.tokenizer_vocab_size=512", "--data.num_workers=0",
        "--lr_scheduler.warmup_steps=2", f"--job.dump_folder={tmp_path / 'direct'}",
        "--job.print_config=false", "--metrics.enable_tensorboard=false",
        "--metrics.progress_bar=false", "--training.mixed_precision=none",
        # what the bench's runs leave out too (after the last step: no loss changes)
        "--checkpoint.enable=false", "--validation.enable=false", "--metrics.report=false",
        # the tokenizer the bench's runs trained (the same file a direct run would train)
        f"--data.tokenizer={tokenizer}"]))
    assert direct.train() == pytest.approx(row["losses"], rel=1e-5)
    assert row["mfu_pct"] == pytest.approx(
        100 * row["tokens_per_s_gpu"] * row["flops_per_token"] / row["peak_flops"], rel=1e-6)
    assert 0.5 < row["peak_over_estimate"] < 1.5
    # the peer trained (a fresh model: ~ln(vocab)) and its rounds pair with the variant's
    assert peer["status"] == "ok" and len(peer["losses"]) == 3 and peer["vocab"] == 512
    assert peer["first_loss"] == pytest.approx(math.log(512), abs=1.0)
    ratios = [a / b for a, b in zip(row["round_tokens_per_s"], peer["round_tokens_per_s"])]
    assert len(ratios) == 2 and row["round_ratios"] == pytest.approx(ratios)
    assert row["ratio_to_peer"] == pytest.approx(math.sqrt(ratios[0] * ratios[1]))
    low, high = row["ratio_to_peer_ci95"]
    assert low < row["ratio_to_peer"] < high
    assert f"| fp32 | 2 | 32 | none | {row['tokens_per_s_gpu']:,.0f} |" in table
    assert f"| {row['ratio_to_peer']:.3f} ({low:.3f}-{high:.3f}) |" in table
    assert f"| peer_transformers | 2 | 32 | none | {peer['tokens_per_s_gpu']:,.0f} |" in table


def bench_gpu_module():
    sys.path.insert(0, str(REPO / "benchmarks"))
    import bench_gpu

    return bench_gpu


@pytest.mark.parametrize("config", ["debug_model", "llama3_1b"])
def test_bench_gpu_peer_is_torchllms_model_shape(config):
    """The peer's transformers Llama has exactly torchllm's parameters (count and each matrix's
    shape by role) for the same config: the same matmuls per token."""
    from torchllm.models.llama.model import Transformer
    from torchllm.tools.model_info import tokenizer_vocab_hint

    bench_gpu_module()  # benchmarks/ on sys.path: bench_gpu.py's peer lives in benchlib
    from benchlib.gpu_peer import peer_model

    cfg = load_config(["--job.config_file", str(REPO / f"train_configs/{config}.toml"),
                       "--training.device=cpu", "--data.tokenizer_vocab_size=512"])
    peer, vocab = peer_model(cfg, torch.device("meta"))
    with torch.device("meta"):
        ours = Transformer(models.model_args(cfg.model, cfg.training, cfg.data,
                                             tokenizer_vocab_hint(cfg.data)))
    assert vocab == ours.args.vocab_size
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert count(peer) == count(ours)
    assert peer.model.layers[0].mlp.gate_proj.weight.shape == \
        ours.layers["0"].feed_forward.w1.weight.shape
    assert peer.model.layers[0].self_attn.k_proj.weight.shape == \
        ours.layers["0"].attention.wk.weight.shape


@pytest.mark.parametrize("bad", [["--variants", "fp32,bf16_compile_float8"],
                                 ["--variants", "bf16_compile_float8_rowwise"],
                                 ["--variants", "bf16", "--compile.backend=cudagraphs"],
                                 ["--variants", "bf16", "--float8.enable"]])
def test_bench_gpu_on_cpu_refuses_cuda_only_options_in_one_line(bad, capsys):
    bench_gpu = bench_gpu_module()
    with pytest.raises(SystemExit) as e:
        bench_gpu.parse_args(["--device", "cpu", *bad])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1
    assert_names(err, "CUDA", "--variants bf16_compile,bf16,fp32")  # why, and what to pass
    assert bad[-1].split(",")[-1] in err


def test_bench_gpu_picks_the_least_activation_checkpointing_that_fits():
    bench_gpu = bench_gpu_module()
    from torchllm.tools.estimate_memory import estimate_memory

    base = ["--job.config_file", str(REPO / "train_configs/llama3_1b.toml"),
            "--training.device=cuda", "--training.seq_len=2048", "--training.local_batch_size=4"]

    def est(mode):
        cfg = load_config([*base, f"--activation_checkpoint.mode={mode}"])
        args = models.model_args(cfg.model, cfg.training, cfg.data, 4096)
        return estimate_memory(cfg, args, 1)["peak_bytes"]

    assert est("none") > est("selective") > est("full")
    assert bench_gpu.pick_ac(base, "auto", est("none") / 0.9 + 1)[0] == "none"
    assert bench_gpu.pick_ac(base, "auto", est("none") / 0.9 - 1)[0] == "selective"
    assert bench_gpu.pick_ac(base, "auto", est("selective") / 0.9 - 1)[0] == "full"
    assert bench_gpu.pick_ac(base, "none", 1)[0] == "none"  # asked for: no choice made

@pytest.mark.slow
def test_every_preparation_keeps_the_reference_weights_on_cpu(tmp_path):
    """CPU smoke test of what the GPU tests apply (float8 emulated, aot_eager instead of
    inductor, FSDP2 / DDP on a 1-rank gloo group): the first step's loss, computed from the
    copied initial weights, must be the reference's (a weight not copied changes it)."""
    import torch.distributed as dist

    batches = make_batches(steps=1)
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
    finally:
        dist.destroy_process_group()



def test_checkpoint_check_on_cpu_async_equals_sync(tmp_path):
    """The GPU test's checkpoint comparison, with CPU's async mode instead of pinned memory."""
    sync = saved_checkpoint_keys(tmp_path / "sync", "cpu", "disabled")
    assert any(k.startswith("optimizer.") for k in sync) and "model.norm.weight" in sync
    assert sync == saved_checkpoint_keys(tmp_path / "async", "cpu", "async")
