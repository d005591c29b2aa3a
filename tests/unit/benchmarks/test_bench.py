"""The benchmark harness: the matrix, the row summary, the tables, and a real 2-rank run."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

from conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))  # the scripts and benchlib, as they import
from bench_parallel import parse_args  # noqa: E402
from benchlib.report import (failure_reason, markdown_table, percentile,  # noqa: E402
                             render_markdown, summarize)
from benchlib.variants import Variant, build_matrix, parse_list  # noqa: E402
from messages import assert_names
from builders.bench import benchmark_script  # noqa: F401


def test_matrix_is_the_product_of_the_lists_with_readable_names():
    names = [v.name for v in build_matrix(["ddp", "fsdp2"], ["none", "full"], ["off"],
                                          ["off", "tensorwise"])]
    assert names == ["ddp", "ddp+float8_tensorwise", "ddp+ac_full", "ddp+ac_full+float8_tensorwise",
                     "fsdp2", "fsdp2+float8_tensorwise", "fsdp2+ac_full",
                     "fsdp2+ac_full+float8_tensorwise"]


def test_layouts_become_parallelism_overrides():
    assert "--parallelism.dp_mode=ddp" in Variant("ddp").overrides(2)
    assert "--parallelism.fsdp_reshard_after_forward=never" in Variant("fsdp2_noreshard").overrides(2)
    hsdp = Variant("hsdp").overrides(8)
    assert "--parallelism.data_parallel_replicate_degree=2" in hsdp
    assert "--parallelism.data_parallel_shard_degree=4" in hsdp
    assert "hsdp needs" in Variant("hsdp").unsupported(2)
    assert Variant("hsdp").unsupported(4) is None and Variant("ddp").unsupported(2) is None
    assert "--parallelism.context_parallel_degree=2" in Variant("cp").overrides(4)
    assert_names(Variant("cp").unsupported(3), "context_parallel_degree 2", "--nproc is 3")
    assert Variant("cp").unsupported(2) is None
    assert "--parallelism.pipeline_parallel_degree=2" in Variant("pp").overrides(4)
    assert_names(Variant("pp").unsupported(3), "pipeline_parallel_degree 2", "--nproc is 3")
    assert Variant("pp").unsupported(2) is None


def test_bad_lists_and_flags_are_errors():
    with pytest.raises(ValueError, match="--matrix 'ddp,zero3'"):
        parse_list("--matrix", "ddp,zero3", ("ddp", "fsdp2"))
    config = str(REPO / "train_configs" / "debug_model.toml")
    for bad in (["--warmup", "1"], ["--stepz", "3"], ["--config", "missing.toml"]):
        with pytest.raises(SystemExit):
            parse_args(["--config", config, "--json", "o.json", *bad])
    args, overrides = parse_args(["--config", config, "--json", "o.json",
                                  "--training.seq_len=32", "--compile", "off,on"])
    assert overrides == ["--training.seq_len=32"] and len(args.variants) == 4


def test_failure_reason_picks_the_telling_line():
    log = "noise\n[rank1]: config error: float8.enable needs a CUDA GPU\nTraceback...\n"
    assert failure_reason(log, 1) == "float8.enable needs a CUDA GPU"
    log = "x\ntorch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2 GiB\n"
    assert failure_reason(log, 1).startswith("torch.OutOfMemoryError: CUDA out of memory")
    assert failure_reason("nothing useful", 7) == "exit code 7"


TORCHRUN_SUMMARY = """[rank0]: RuntimeError: Connection closed by peer [127.0.0.1]:5
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
benchlib.worker FAILED
------------------------------------------------------------
Failures:
  <NO_OTHER_FAILURES>
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-28_17:00:00
  host      : h
  rank      : 1 (local_rank: 1)
  exitcode  : {code} (pid: 4242)
  error_file: <N/A>
  traceback : {traceback}
============================================================
"""


def test_failure_reason_names_torchruns_root_cause_rank_and_how_it_ended():
    killed = TORCHRUN_SUMMARY.format(code=-9, traceback="Signal 9 (SIGKILL) received by PID 4242")
    # Rank 0's error is the echo of rank 1's death: the killed rank and its signal are the reason.
    reason = failure_reason(killed, 1)
    assert_names(reason, "rank 1", "SIGKILL")
    assert "rank 0" not in reason
    failed = "[rank1]: ValueError: bad shard\n" + TORCHRUN_SUMMARY.format(
        code=1, traceback="To enable traceback see: ...")
    reason = failure_reason(failed, 1)
    assert_names(reason, "rank 1", "exit code 1", "ValueError: bad shard")
    assert "\n" not in reason


def test_percentile_matches_numpy():
    values = [0.3, 0.1, 0.7, 0.2, 0.5, 0.9, 0.4]
    for q in (0, 50, 90, 100):
        assert percentile(values, q) == pytest.approx(np.percentile(values, q))


def fake_rank(rank, times, state):
    return {"rank": rank, "world_size": 2, "device": "cpu", "step_times_s": times,
            "losses": [5.0, 4.0, 3.5], "tokens_per_step": 1000, "flops_per_token": 10**6,
            "peak_flops": 1e11, "state_bytes": state, "rss_peak_bytes": 10**8,
            "tensor_peak_bytes": 2 * 10**6,
            "estimate": {"params": 10, "peak_bytes": 2.2 * 10**6}}


def test_summary_drops_warmup_and_derives_throughput():
    state = {"params": 100, "grads": 100, "optimizer": 200}
    row = summarize([fake_rank(1, [9.0, 0.5, 0.25], state),
                     fake_rank(0, [9.0, 0.5, 0.5], state)], warmup=1)
    assert row["tokens_per_s"] == pytest.approx(2000 / 1.0)  # rank 0: 2 steps in 1 s
    assert row["tokens_per_s_device"] == pytest.approx(1000)
    assert row["step_time_median_s"] == 0.5 and row["final_loss"] == 3.5
    assert row["mfu_pct"] == pytest.approx(100 * 1000 * 10**6 / 1e11)
    assert row["estimate_over_measured"] == pytest.approx(1.1)
    assert [m["state_total_bytes"] for m in row["per_rank"]] == [400, 400]


def test_a_peak_measured_on_a_busy_machine_gives_no_mfu_in_the_table():
    """docs/performance.md's committed CPU MFU (78.9-96.8%) divided by a peak measured under
    load: such a peak (flops.CPUPeak.quiet False) now leaves the MFU column empty."""
    state = {"params": 1, "grads": 1, "optimizer": 2}
    busy = [{**fake_rank(0, [1, 1, 1], state), "peak_quiet": False}]
    row = summarize(busy, warmup=1)
    assert "mfu_pct" not in row and row["peak_quiet"] is False and row["tflops"] > 0
    assert "| - |" in markdown_table([{"variant": "ddp", **row}])
    assert "mfu_pct" in summarize([fake_rank(0, [1, 1, 1], state)], warmup=1)


def test_markdown_has_a_row_per_variant_and_failures_say_why():
    state = {"params": 1, "grads": 1, "optimizer": 2}
    ok = {"variant": "ddp", **summarize([fake_rank(0, [1, 1, 1], state)], warmup=1)}
    failed = {"variant": "hsdp", "status": "unsupported", "reason": "hsdp needs 4 ranks"}
    md = markdown_table([ok, failed]).splitlines()
    assert md[0].startswith("| variant | status | tok/s/dev")
    assert len(md) == 4 and md[2].startswith("| ddp | ok | 500 | 1,000 |")
    assert "| hsdp | unsupported: hsdp needs 4 ranks |" in md[3]


@pytest.mark.slow
def test_two_rank_matrix_end_to_end(tmp_path, monkeypatch, capsys):
    """ddp, fsdp2 and pp (2 stages) really train on 2 gloo ranks; hsdp (needs 4) and float8
    (needs a GPU) are rows with their reasons; the same data and seed give ddp and fsdp2 the
    same loss; the memory estimate is within 0.85-1.1 of the measured peak for each. (The harness's
    main in this process: it launches a torchrun per variant, as from the command line.)"""
    from bench_parallel import main

    out = tmp_path / "res.json"
    argv = ["--config", "train_configs/debug_model.toml",
            "--matrix", "ddp,fsdp2,hsdp,pp", "--float8", "off,tensorwise", "--steps", "2",
            "--warmup", "2", "--nproc", "2", "--repeats", "1", "--json", str(out),
            "--work_dir", str(tmp_path / "w"),
            "--training.seq_len=32", "--training.local_batch_size=2",
            "--data.tokenizer_vocab_size=512", "--training.device=cpu",
            "--training.mixed_precision=none"]  # layouts compared in fp32 (auto: bf16 here)
    monkeypatch.chdir(REPO)  # (the relative config path, as the documented command's)
    code = main(argv)
    printed = capsys.readouterr().out
    assert code == 1, printed[-6000:]  # some rows failed
    # torchrun's own workers (`python -u -m benchlib.worker`), on CPU as on GPU
    assert "[bench] ddp: -m torch.distributed.run --standalone --nproc_per_node=2 -m " in printed
    rows = {r["variant"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"ddp", "fsdp2", "hsdp", "pp", "ddp+float8_tensorwise",
                         "fsdp2+float8_tensorwise", "hsdp+float8_tensorwise",
                         "pp+float8_tensorwise"}
    ddp, fsdp, pp = rows["ddp"], rows["fsdp2"], rows["pp"]
    assert ddp["status"] == fsdp["status"] == pp["status"] == "ok"
    assert rows["hsdp"]["status"] == "unsupported" and "4 ranks" in rows["hsdp"]["reason"]
    assert rows["fsdp2+float8_tensorwise"]["status"] == "failed"
    assert "float8" in rows["fsdp2+float8_tensorwise"]["reason"]
    assert "log" not in rows["fsdp2+float8_tensorwise"]  # refused by the config check: no launch
    assert ddp["final_loss"] == pytest.approx(fsdp["final_loss"], rel=1e-4)
    for row in (ddp, fsdp, pp):  # pp: the estimate of the pipeline rank that peaks
        assert row["timed_steps"] == 2 and row["tokens_per_s"] > 0
        # Measured 2026-12-06 at load ~20 (the allocator's count, every thread's frees:
        # benchlib/tensor_memory.py): ddp 1.015, pp 1.016, fsdp2 0.920. fsdp2 peaks at this
        # shape (tiny activations) in the last block's backward on collective buffers the
        # estimate leaves out: the block's all-gather output beside its copied-out params, and
        # gloo's copy of the previous block's reduce-scatter input while that is in flight
        # (3 MiB each, per the per-allocation view; the second one depends on whether that
        # reduce-scatter has finished: ~1.0 when it has). Counting the whole model per pp rank
        # gave 1.83.
        assert 0.85 <= row["estimate_over_measured"] <= 1.1, row["variant"]
    # FSDP2 keeps 1/world of the params, grads and optimizer state (up to shard padding).
    d, f = ddp["per_rank"][0]["state_total_bytes"], fsdp["per_rank"][0]["state_total_bytes"]
    assert f / d == pytest.approx(0.5, rel=0.01)
    md = out.with_suffix(".md").read_text()
    assert md == render_markdown(json.loads(out.read_text())["rows"])
    assert "| hsdp | unsupported: hsdp needs" in md
    assert "| fsdp2 | " in md.split("p+g+opt bytes per rank / ddp")[1]  # the ratio table
    assert "ddp+float8_tensorwise" in printed  # the printed table


def test_performance_doc_tables_come_from_the_committed_json():
    """Every results table in docs/performance.md is the harness's rendering of a JSON file."""
    doc = (REPO / "docs" / "performance.md").read_text()
    results = sorted((REPO / "benchmarks" / "results").glob("cpu_*.json"))
    assert results
    for path in results:
        rows = json.loads(path.read_text())["rows"]
        assert render_markdown(rows) in doc, f"{path.name}'s tables are not in the doc"


def test_throughput_table_measures_against_the_faster_dtype():
    """CPUs differ: where bf16 matmuls are slower than fp32 (AVX512_BF16 without fast units),
    the limit column is fp32's, not bf16's (which would put a row over 100%)."""
    bench = benchmark_script("bench_throughput")
    row = {"shape": "small", "precision": "fp32", "mode": "eager", "torchllm_tok_s": 1000.0,
           "hf_tok_s": 800.0, "ratio": 1.25, "ratio_ci95": [1.2, 1.3], "flops_per_token": 150e6,
           "torchllm_mfu_pct": 50.0, "hf_mfu_pct": 40.0}
    for peaks, dtype, pct in (({"fp32": 300e9, "bf16": 150e9}, "fp32", "50.0"),
                              ({"fp32": 300e9, "bf16": 1200e9}, "bf16", "12.5")):
        table = bench.markdown([row], peaks, 2)
        assert f"the limit is {dtype}'s" in table and f"% of the {dtype} limit" in table
        assert table.splitlines()[4].endswith(f"| {pct} |"), table
        assert "| 1.250x | 1.200-1.300 |" in table, table


def test_throughput_ratio_is_paired_with_a_t_interval():
    """The ratio is the geometric mean of the rounds' ratios, its interval Student's t on the
    logarithms (scipy as the oracle); a single round gives no interval; between tabled degrees
    of freedom the interval is wider, never narrower, than the exact one."""
    stats = pytest.importorskip("scipy.stats")
    bench = benchmark_script("bench_throughput")
    assert bench.paired_ratio([1.04]) == (pytest.approx(1.04), None)
    twelve = [1.0 + 0.01 * (i % 5) for i in range(12)]  # 11 degrees of freedom: not tabled
    for ratios in ([1.01, 0.99], [1.02, 0.995, 1.01, 1.0, 1.03], twelve):
        logs = np.log(ratios)
        n = len(logs)
        half = stats.t.ppf(0.975, n - 1) * logs.std(ddof=1) / np.sqrt(n)
        mean, (lo, hi) = bench.paired_ratio(ratios)
        assert mean == pytest.approx(np.exp(logs.mean()), rel=1e-12)
        exact = (np.exp(logs.mean() - half), np.exp(logs.mean() + half))
        if n - 1 in bench._T975:
            assert lo == pytest.approx(exact[0], rel=1e-4)
            assert hi == pytest.approx(exact[1], rel=1e-4)
        else:
            assert lo < exact[0] and hi > exact[1] and hi / lo < 1.01 * exact[1] / exact[0]


def test_blocked_cpu_attention_of_the_attention_benchmark_equals_sdpa():
    """benchmarks/bench_cpu_attention.py times SDPA's flash kernel against attention built from
    batched matmuls by blocks of query rows: the two must compute the same thing (float64,
    grouped-query heads, a sequence that is not a multiple of the block)."""
    bench = benchmark_script("bench_cpu_attention")
    for block in (7, 16, 64):  # several blocks, two, one
        errors = bench.max_errors(block)
        assert max(errors) < 1e-12, (block, errors)


def test_attention_benchmark_prints_and_writes_its_table(tmp_path, monkeypatch, capsys):
    """The command docs/performance.md names runs to its table and JSON (its printing once
    unpacked every field of a row as a (forward, backward) pair and crashed on the first)."""
    bench = benchmark_script("bench_cpu_attention")
    monkeypatch.setattr(bench, "SHAPES", [(1, 24, 4, 2, 8)])
    out = tmp_path / "attention.json"
    assert bench.main(["--dtypes", "fp32,bf16", "--blocks", "8,16", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["dtype"] for r in rows] == ["fp32", "bf16"]
    for r in rows:
        assert set(r) == {"dtype", "shape", "sdpa_ms", "block_8_ms", "block_16_ms"}
        assert all(len(r[k]) == 2 and min(r[k]) > 0 for k in r if k.endswith("_ms"))
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) == 3 and printed[1].startswith("fp32") and printed[2].startswith("bf16")


def test_rounds_are_interleaved_and_a_row_is_their_median_with_the_spread_and_load(
        tmp_path, monkeypatch, capsys):
    """Each variant runs in every round, the rounds interleaved (a burst of load hits every
    variant); a row is the median round's, with every round's tokens/s, the spread and the load
    around each run; MFU on CPU divides by a peak measured in this sitting."""
    import bench_parallel

    order, speeds = [], {"ddp": iter([900.0, 1000.0, 1300.0]), "fsdp2": iter([500.0, 450.0, 520.0])}

    def fake_run(variant, args, overrides, out_dir):
        order.append(variant.name)
        tps = next(speeds[variant.name])
        return {"variant": variant.name, "status": "ok", "device": "cpu", "dtype": "float32",
                "threads": 1, "tokens_per_s": tps, "tokens_per_s_device": tps / 2,
                "step_time_median_s": 1000 / tps, "step_time_p90_s": 1000 / tps,
                "flops_per_token": 1e6, "final_loss": 1.0, "load": 0.5, "per_rank": [
                    {"state_total_bytes": 1, "rss_peak_bytes": 1}], "estimate": {"peak_bytes": 1}}

    monkeypatch.setattr(bench_parallel, "run_variant", fake_run)
    monkeypatch.setattr(bench_parallel, "sitting_peak",
                        lambda dtype, threads: {"flops": 1e10})
    out = tmp_path / "r.json"
    code = bench_parallel.main(["--config", str(REPO / "train_configs/debug_model.toml"),
                                "--matrix", "ddp,fsdp2", "--json", str(out)])
    assert code == 0, capsys.readouterr().out
    assert order == ["ddp", "fsdp2"] * 3
    result = json.loads(out.read_text())
    assert result["repeats"] == 3 and result["host"]["load_before"] is not None
    ddp = {r["variant"]: r for r in result["rows"]}["ddp"]
    assert ddp["tokens_per_s"] == 1000.0 and ddp["tokens_per_s_rounds"] == [900.0, 1000.0, 1300.0]
    assert ddp["spread_pct"] == pytest.approx(40.0) and ddp["load"] == [0.5] * 3
    assert ddp["mfu_pct"] == pytest.approx(100 * 500.0 * 1e6 / 1e10)
    assert ddp["peak_source"] == "measured in this sitting"
