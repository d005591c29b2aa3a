"""benchmarks/bench_memory.py: its rows, its options, and the estimate within 10% of what each
rank of a real multi-rank training step measured (a representative subset of the rows)."""

from __future__ import annotations

import json
import sys
import threading

import pytest
import torch

from cli import run_script
from conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import bench_memory  # noqa: E402
from benchlib.tensor_memory import PeakTensorMemory  # noqa: E402

MB = 1_000_000

NAMED = ["single", "ddp2", "fsdp2", "fsdp4", "hsdp2x2", "tp2", "cp2", "cp4", "pp2-1f1b",
         "pp2-interleaved", "ep2", "fsdp2-accum4", "fsdp2-ac_full", "fsdp2-ac_none",
         "fsdp2-plain_loss", "fsdp2-adamw8bit", "fsdp2-muon"]


def test_list_names_every_row_and_bad_names_are_refused():
    ran = run_script("benchmarks/bench_memory.py", "--list")
    assert ran.returncode == 0
    listed = [ln.split()[0] for ln in ran.stdout.splitlines() if "rank(s)" in ln]
    assert set(NAMED) <= set(listed) and listed == list(bench_memory.ROWS)
    assert all(bench_memory.ROWS[n].nproc <= 4 for n in listed)  # 2-core machines
    ran = run_script("benchmarks/bench_memory.py", "--layouts", "fsdp2,fsdp3")
    assert ran.returncode == 2 and "fsdp3" in ran.stderr and "--list" in ran.stderr
    ran = run_script("benchmarks/bench_memory.py", "--layouts", "fsdp2", "--steps=3")
    assert ran.returncode == 2 and "--section.key=value" in ran.stderr


def test_refused_rows_carry_the_trainers_words(tmp_path):
    """A row the trainer refuses is reported with its reason, without a launch."""
    bench_memory.ROWS["tp2-chunked"] = bench_memory.Row(
        2, bench_memory.layout(shard=1, tensor_parallel_degree=2))
    try:
        got = bench_memory.run_row("tp2-chunked", [], tmp_path, timeout=60)
    finally:
        del bench_memory.ROWS["tp2-chunked"]
    assert len(got) == 1 and got[0]["reason"].startswith("refused: ")
    assert "training.chunked_loss" in got[0]["reason"]


def test_a_free_on_another_thread_is_subtracted():
    """A tensor whose last reference dies on a thread the profiler does not watch (as an
    asynchronous gloo collective's buffer does on gloo's thread) is no longer counted alive:
    the allocator's own count moves on every thread (was: 8 MB, both tensors alive)."""
    with PeakTensorMemory(baseline_bytes=0) as m:
        box = [torch.empty(4 * MB, dtype=torch.uint8)]
        other = threading.Thread(target=box.clear)  # the only reference, dropped there
        other.start()
        other.join()
        b = torch.empty(4 * MB, dtype=torch.uint8)
    assert m.net_peak_bytes == 4 * MB
    del b


# FSDP2 (asynchronous gloo collectives: its reduce-scatter buffers die on gloo's thread) and a
# pipeline (each stage its own estimate); ~15 s a row on a quiet 2-core machine. The other rows
# are the benchmark's table (docs/performance.md): the suite's time budget holds two launches.
SUBSET = "fsdp2,pp2-1f1b"
# fsdp2 measures the same on every rank and run (71.35 MiB, quiet or at load 20), and its
# estimate agrees within 0.5%: a tighter band there catches a block's worth of error (the
# embedding kept gathered, a block's gradients counted twice: 1.06-1.09).
TIGHT = {"fsdp2": 0.04}


@pytest.mark.slow
def test_estimate_within_10_percent_of_every_ranks_measured_peak(tmp_path):
    out = tmp_path / "mem.json"
    ran = run_script("benchmarks/bench_memory.py", "--layouts", SUBSET, "--json", str(out),
                     "--work_dir", str(tmp_path / "runs"), process=True, timeout=600)
    records = json.loads(out.read_text())
    assert [r["layout"] for r in records] == ["fsdp2"] * 2 + ["pp2-1f1b"] * 2, (
        ran.stdout[-3000:])
    for r in records:
        assert {"layout", "overrides", "world_size", "rank", "measured_peak_bytes",
                "estimate_peak_bytes"} <= set(r)
        ratio = r["estimate_peak_bytes"] / r["measured_peak_bytes"]
        band = TIGHT.get(r["layout"], 0.1)
        assert 1 - band <= ratio <= 1 + band, (r, ran.stdout[-2000:])
    # ranks doing the same work measure the same: no free is lost on gloo's thread
    fsdp = [r["measured_peak_bytes"] for r in records if r["layout"] == "fsdp2"]
    assert abs(fsdp[0] - fsdp[1]) <= 0.02 * fsdp[0], fsdp
    # the pipeline ranks are estimated for their own stage: the last one holds the head
    pp = [r for r in records if r["layout"] == "pp2-1f1b"]
    assert pp[0]["estimate_peak_bytes"] != pp[1]["estimate_peak_bytes"]
    assert ran.returncode == 0, ran.stdout[-2000:]
