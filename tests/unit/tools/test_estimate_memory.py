"""The memory estimator against measured CPU tensor memory, and the measurement itself."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from conftest import REPO, tiny_config

sys.path.insert(0, str(REPO / "benchmarks"))  # benchlib: the benchmarks' measurements
from benchlib.tensor_memory import PeakTensorMemory  # noqa: E402
from benchlib.worker import StepRecorder  # noqa: E402
from torchllm import models  # noqa: E402
from torchllm.config import load_config  # noqa: E402
from torchllm.tools import activation_bytes as ab  # noqa: E402
from torchllm.tools import estimate_memory as em  # noqa: E402
from torchllm.parallel.plan import ParallelPlan  # noqa: E402
from torchllm.tools.model_info import model_info  # noqa: E402
from torchllm.train import Trainer  # noqa: E402
from builders.memory import measure  # noqa: F401

MB = 1_000_000


def test_peak_tensor_memory_counts_known_allocations():
    with PeakTensorMemory(baseline_bytes=123) as m:
        a = torch.empty(MB, dtype=torch.uint8)
        b = torch.empty(2 * MB, dtype=torch.uint8)
        del a
        c = torch.empty(MB // 2, dtype=torch.uint8)
    assert m.net_peak_bytes == 3 * MB  # a + b alive together; b + c is less
    assert m.peak_bytes == 3 * MB + 123
    del b, c


def test_peak_tensor_memory_only_counts_the_steady_range():
    with PeakTensorMemory(baseline_bytes=0) as m:
        first = torch.empty(4 * MB, dtype=torch.uint8)  # a one-off peak before the range
        kept = torch.empty(MB, dtype=torch.uint8)  # left behind: still counted
        del first
        with m.steady():
            x = torch.empty(2 * MB, dtype=torch.uint8)
            del x
    assert m.net_peak_bytes == 3 * MB
    del kept


VOCAB_8K = ("--training.local_batch_size=8", "--training.seq_len=128", "--model.vocab_size=8192",
            "--model.dim=64")


# The measurement is exact and repeatable on CPU (tensor bytes, not allocator pools), so the band
# is the estimator's own accuracy (measured: -1.7% tiny, +1.5% activations, +3.5% full AC)
# plus a margin; forgetting the attention activations moves it to 0.81 (the old ±20% passed it).
@pytest.mark.parametrize("extra, phase, loss_constants", [
    # tiny batch: params + grads + moments dominate; the measured peak is in the first block's
    # backward (benchlib's peak_ops: MulBackward0), every later gradient already there
    pytest.param((), "last block backward", None, id="tiny"),
    pytest.param(("--training.local_batch_size=8", "--training.seq_len=128"), "loss backward",
                 None, marks=pytest.mark.slow, id="activations"),
    pytest.param(("--training.local_batch_size=8", "--training.seq_len=128",
                  "--activation_checkpoint.mode=full"), None, None, marks=pytest.mark.slow,
                 id="full_ac"),
    # Qwen3: its ModelSpec declares QK-norm (q and k kept before and after their norms, heads x
    # head_dim != dim; measured 0.9997).
    pytest.param(("--training.local_batch_size=8", "--training.seq_len=128",
                  "--model.name=qwen3"), "loss backward", None, marks=pytest.mark.slow,
                 id="qwen3_qk_norm"),
    # A vocabulary large enough for the loss's tensors to matter, on each loss path, on a
    # narrow model (dim 64: the logits are a third of the peak instead of a sixth, and bf16,
    # emulated on CPU, costs 2 s a step instead of 15): fp32 (log-softmax kept; measured
    # 1.007), bf16 autocast (plain kernels at this size; float32 residual stream, weight
    # copies; 1.006, 0.51 if the estimate took the chunked rule for them), bf16 with the chunked
    # cross entropy (what larger logits take: `loss._PLAIN_MAX_BYTES` lowered to 0 here; 0.999),
    # chunked_loss (nothing kept; 0.98).
    pytest.param(VOCAB_8K, "loss backward", None, marks=pytest.mark.slow, id="vocab_8k_fp32"),
    pytest.param((*VOCAB_8K, "--training.mixed_precision=bf16"), "loss backward", None,
                 marks=pytest.mark.slow, id="vocab_8k_bf16"),
    # The fused loss's float32 scratch (a few `loss._CHUNK_BYTES` chunks, which the estimate
    # leaves out) is < 1% of the peak at the sizes that take this path, but 15% of this small
    # model's; chunks scaled down with the logits keep it the fraction it is there.
    pytest.param((*VOCAB_8K, "--training.mixed_precision=bf16"), "loss backward",
                 {"_PLAIN_MAX_BYTES": 0, "_CHUNK_BYTES": 256 << 10}, marks=pytest.mark.slow,
                 id="vocab_8k_bf16_chunked_cross_entropy"),
    pytest.param((*VOCAB_8K, "--training.chunked_loss", "--training.loss_chunk_tokens=256"),
                 None, None, marks=pytest.mark.slow, id="vocab_8k_chunked"),
])
def test_estimate_within_5_percent_of_measured_on_debug(tmp_path, extra, phase, loss_constants,
                                                        monkeypatch):
    for name, value in (loss_constants or {}).items():  # (the trainer and the estimator read
        monkeypatch.setattr(f"torchllm.loss.{name}", value)  # the same rule)
    measured, estimate = measure(tmp_path, *extra)
    assert 0.95 <= estimate["peak_bytes"] / measured <= 1.05, (estimate, measured)
    if phase:
        assert estimate["peak_phase"] == phase


def test_fsdp_shards_state_and_ddp_adds_buckets():
    def est(world, *extra):
        cfg = load_config(["--model.flavor=125M", "--training.seq_len=256", *extra])
        args = models.model_args(cfg.model, cfg.training, cfg.data)
        return em.estimate_memory(cfg, args, world)["terms_bytes"]

    one, fsdp4 = est(1), est(4)
    ddp4 = est(4, "--parallelism.dp_mode=ddp")
    assert fsdp4["optimizer"] * 4 == pytest.approx(one["optimizer"], abs=16)
    assert ddp4["optimizer"] == one["optimizer"] and ddp4["ddp_buckets"] == one["params"]
    assert fsdp4["gathered_params"] > 0 == one["gathered_params"]
    full = est(1, "--activation_checkpoint.mode=full")
    assert full["activations"] < one["activations"]


@pytest.mark.parametrize("schedule, in_flight", [
    ("1F1B", [4, 3, 2, 1]),  # pp - r forwards before rank r's first backward
    ("GPipe", [8, 8, 8, 8]),  # every micro-batch's forward first
])
def test_pipeline_ranks_split_the_model_and_keep_the_schedules_forwards(schedule, in_flight):
    """Under PP each rank holds its stages only (the ranks' parameters add up to the whole
    model's, the embedding on the first, head and logits on the last) and the activations of
    the forwards its schedule keeps (the bench's pp row checks the total against a measurement)."""
    pp_args = ["--model.flavor=125M", "--model.tie_embeddings=false", "--training.seq_len=256",
               "--training.local_batch_size=8", "--training.mixed_precision=none",
               "--parallelism.pipeline_parallel_degree=4",
               f"--parallelism.pipeline_parallel_schedule={schedule}",
               "--parallelism.pipeline_parallel_microbatch_size=1"]
    cfg = load_config(pp_args)
    args = models.model_args(cfg.model, cfg.training, cfg.data)
    dims = em.ParallelDims.from_config(cfg.parallelism, 4)
    with torch.device("meta"):
        model = models.get(cfg.model.name).build(args)
    ranks = em.pipeline_ranks(cfg.parallelism, cfg.training, cfg.model.name, cfg.eval, args, dims)
    assert [r["in_flight"] for r in ranks] == in_flight
    assert sorted(b for r in ranks for b in r["blocks"]) == list(range(args.n_layers))
    assert [(r["first"], r["last"]) for r in ranks] == [
        (True, False), (False, False), (False, False), (False, True)]
    plan = ParallelPlan.of(parallelism=cfg.parallelism, float8=cfg.float8,
                           activation_checkpoint=cfg.activation_checkpoint, compile=cfg.compile,
                           training=cfg.training)
    per_rank = [em.rank_memory(plan, cfg.training, cfg.lora, cfg.model.name, args, model, dims, 4,
                               r) for r in ranks]
    whole = em.estimate_memory(load_config(pp_args[:4]), args, 1)["terms_bytes"]
    assert sum(m["terms_bytes"]["params"] for m in per_rank) == whole["params"]
    assert [m["terms_bytes"]["logits"] > 0 for m in per_rank] == [False, False, False, True]
    one_forward = ab.activation_bytes_per_block(models.get(cfg.model.name), args, 256, 4,
                                                 "none", "")
    middle = per_rank[1]  # no embedding / head: blocks x in-flight micro-batches
    assert middle["terms_bytes"]["activations"] == (
        len(ranks[1]["blocks"]) * one_forward * in_flight[1])
    result = em.estimate_memory(cfg, args, 4)
    assert result["pp"] == 4 and result["peak_bytes"] == max(
        max(m["phases_bytes"].values()) for m in per_rank)


def test_logits_term_follows_the_loss_path():
    def logits(*extra):
        cfg = load_config(["--model.flavor=1B", "--training.seq_len=512",
                           "--training.local_batch_size=2", *extra])
        args = models.model_args(cfg.model, cfg.training, cfg.data)
        return em.estimate_memory(cfg, args, 8)["terms_bytes"]["logits"], args.vocab_size

    tokens = 2 * 512
    kept, vocab = logits("--training.mixed_precision=bf16")
    assert kept == tokens * vocab * 2  # the fused loss keeps the bf16 logits only
    kept, vocab = logits("--training.mixed_precision=none")
    assert kept == tokens * vocab * 4  # the float32 log-softmax
    assert logits("--training.chunked_loss")[0] == 0


def test_cli_reports_params_and_flops_of_the_shared_code(capsys):
    argv = ["--job.config_file", "train_configs/llama3_1b.toml", "--world_size", "8", "--json"]
    assert em.main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    cfg = load_config(argv[:2])
    info = model_info(cfg.model, cfg.training, cfg.data)
    assert out["params"] == info["params"] and out["flops_per_token"] == info["flops_per_token"]
    assert out["world_size"] == 8 and out["peak_phase"] in out["phases_bytes"]
    assert out["peak_bytes"] == max(out["phases_bytes"].values())


def test_cli_prints_readable_tables_by_default(capsys):
    """estimate_memory and model_info print tables whose numbers are the --json ones."""
    from torchllm.tools import model_info as mi

    argv = ["--job.config_file", "train_configs/llama3_1b.toml", "--world_size", "8"]
    assert em.main(list(argv)) == 0
    table = capsys.readouterr().out
    assert em.main([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert not table.lstrip().startswith("{")
    phases = table.split("  phase ")[1].splitlines()[1:]
    rows = {ln[2:34].strip(): ln for ln in phases if ln.startswith("  ")}
    for phase, n in out["phases_bytes"].items():
        assert f"{n / 2**30:.3f}" in rows[phase], (phase, table)
    assert "<- peak" in rows[out["peak_phase"]]
    assert table.splitlines()[-1] == (f"peak {out['peak_gib']:.2f} GiB per rank "
                                      f"({out['peak_phase']}), reserved ~{out['reserved_gib']:.2f} GiB")
    assert mi.main(["--job.config_file", "train_configs/debug_model.toml"]) == 0
    info_table = capsys.readouterr().out
    assert mi.main(["--job.config_file", "train_configs/debug_model.toml", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert f"parameters       {info['params']:,} (" in info_table
    # Oracle: the tensors' sizes, summed, are the parameters of a model built here.
    cfg = load_config(["--job.config_file", "train_configs/debug_model.toml"])
    with torch.device("meta"):
        args = models.model_args(cfg.model, cfg.training, cfg.data, 4096)
        model = models.get(cfg.model.name).build(args)
    column = [int(ln.split()[-1].replace(",", "")) for ln in info_table.splitlines()
              if ln.startswith("  ") and ln.split()[-1].replace(",", "").isdigit()
              and "[" in ln]
    assert sum(column) == sum(p.numel() for p in model.parameters())


def test_cli_bad_override_is_a_one_line_error(capsys):
    assert em.main(["--training.no_such_key=1"]) == 2
    assert "config error" in capsys.readouterr().err
