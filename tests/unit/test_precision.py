"""mixed_precision = "auto" follows the hardware, and MFU is measured against a true peak."""

from __future__ import annotations

import logging

import pytest
import torch

from conftest import tiny_config
from torchllm import precision
from torchllm.metrics import flops
from torchllm.train import Trainer
from messages import assert_names


@pytest.fixture
def fresh_probe():
    precision.cpu_native_bf16.cache_clear()
    yield
    precision.cpu_native_bf16.cache_clear()


def fake_speeds(monkeypatch, fp32: float, bf16: float) -> list:
    calls = []

    def matmul_flops(dtype, **kw):
        calls.append(dtype)
        return bf16 if dtype == torch.bfloat16 else fp32

    monkeypatch.setattr(precision, "matmul_flops", matmul_flops)
    return calls


@pytest.mark.parametrize("flags, speeds, expected", [
    ({"avx512f", "avx512_bf16"}, (200e9, 800e9), True),   # native and 4x faster
    ({"avx512f", "amx_bf16"}, (200e9, 800e9), True),
    ({"avx512f", "avx512_bf16"}, (200e9, 210e9), False),  # native on paper, not in practice
    ({"avx2", "fma"}, (200e9, 800e9), False),             # emulated bf16: never, no probe
    (None, (200e9, 800e9), True),                         # flags unknown: the probe decides
    (None, (200e9, 20e9), False),
])
def test_auto_precision_on_cpu_follows_flags_and_probe(monkeypatch, fresh_probe, flags, speeds,
                                                       expected):
    monkeypatch.setattr(precision, "cpu_flags", lambda: flags)
    calls = fake_speeds(monkeypatch, *speeds)
    bf16, why = precision.resolve_bf16("auto", "cpu")
    assert bf16 is expected, why
    assert why.startswith("auto: ")
    if flags is not None and not flags & {"avx512_bf16", "amx_bf16"}:
        assert calls == [] and "no native bf16" in why


def test_a_probe_slowed_by_load_is_repeated_before_fp32(monkeypatch, fresh_probe):
    # Native bf16 flags; the first probe (3 rounds x 2 dtypes) lands on a loaded moment.
    monkeypatch.setattr(precision, "cpu_flags", lambda: {"avx512f", "amx_bf16"})
    calls = []

    def matmul_flops(dtype, **kw):
        calls.append(dtype)
        loaded = len(calls) <= 6
        return 200e9 if dtype == torch.float32 else (202e9 if loaded else 800e9)

    monkeypatch.setattr(precision, "matmul_flops", matmul_flops)
    bf16, why = precision.resolve_bf16("auto", "cpu")
    assert bf16 is True
    assert_names(why, "4.0x", "2 probes")  # the measured speed-up, over how many probes
    assert len(calls) == 12
    # A CPU where bf16 really is no faster: every probe says so, then fp32.
    precision.cpu_native_bf16.cache_clear()
    calls.clear()
    fake_speeds(monkeypatch, 200e9, 202e9)
    bf16, why = precision.resolve_bf16("auto", "cpu")
    assert bf16 is False and f"in {precision.PROBE_ATTEMPTS} probes" in why, why


def test_a_recorded_precision_is_kept_by_auto_without_a_probe(monkeypatch, fresh_probe):
    calls = fake_speeds(monkeypatch, 200e9, 800e9)  # the probe would say bf16
    monkeypatch.setattr(precision, "cpu_flags", lambda: {"avx512f", "avx512_bf16"})
    assert precision.resolve_bf16("auto", "cpu", recorded="fp32")[0] is False
    assert precision.resolve_bf16("auto", "cuda", recorded="fp32")[0] is False
    assert precision.resolve_bf16("auto", "cpu", recorded="bf16")[0] is True
    bf16, why = precision.resolve_bf16("bf16", "cpu", recorded="fp32")
    assert bf16 is True and "overriding the fp32" in why
    assert calls == []
    # Moved to a CPU without native bf16: the recorded bf16 would be emulated, 17-100x slower.
    monkeypatch.setattr(precision, "cpu_flags", lambda: {"avx2"})
    bf16, why = precision.resolve_bf16("auto", "cpu", recorded="bf16")
    assert bf16 is False and "no native bf16" in why


def test_explicit_and_cuda_choices_need_no_probe(monkeypatch, fresh_probe):
    calls = fake_speeds(monkeypatch, 1.0, 1.0)
    assert precision.resolve_bf16("bf16", "cpu")[0] is True
    assert precision.resolve_bf16("none", "cuda")[0] is False
    assert precision.resolve_bf16("auto", "cuda") == (True, "auto: CUDA")
    assert calls == []


def _vote_rank(rank: int, tmp_path) -> None:
    """Rank 1's CPU measures bf16 4x faster, rank 0's CPU has no native bf16 (no probe)."""
    import json

    from torchllm import precision as p

    p.cpu_native_bf16.cache_clear()
    p.cpu_flags = lambda: {"avx512f", "avx512_bf16"} if rank == 1 else {"avx2"}
    p.matmul_flops = lambda dtype, **kw: 800e9 if dtype == torch.bfloat16 else 200e9
    (tmp_path / f"rank{rank}.json").write_text(json.dumps(p.resolve_bf16("auto", "cpu")))


def test_auto_precision_is_the_same_on_every_rank(tmp_path):
    """Ranks whose CPU or probe disagree all train in fp32 (in different precisions they would
    fail at their first collective); the one that measured bf16 faster says why it did not."""
    import json

    from conftest import spawn_gloo

    spawn_gloo(_vote_rank, tmp_path)
    (bf16_0, why_0), (bf16_1, why_1) = (json.loads((tmp_path / f"rank{r}.json").read_text())
                                        for r in (0, 1))
    assert bf16_0 is bf16_1 is False
    assert_names(why_0, "AVX512_BF16")  # rank 0: the CPU feature it lacks
    assert_names(why_1, "4.0x", "another rank", "fp32")  # rank 1: its own speed-up, overruled


def best_mm_flops(dtype, size=768, trials=5, reps=4) -> float:
    """An independent timing of this CPU's matmuls (another size than the probe's)."""
    import time

    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    torch.mm(a, b)
    best = 0.0
    for _ in range(trials):
        start = time.perf_counter()
        for _ in range(reps):
            torch.mm(a, b)
        best = max(best, 2 * size**3 * reps / (time.perf_counter() - start))
    return best


def test_auto_on_this_cpu_agrees_with_an_independent_timing(fresh_probe):
    """CPUs differ: AVX512_BF16 on paper is not always fast bf16 (an Intel Xeon with the flag
    ran bf16 matmuls at 0.5x fp32; an AMD EPYC at ~4x). Whatever this CPU is, auto must agree
    with a timing of our own, where that timing is clear of the threshold."""
    flags = precision.cpu_flags() or set()
    if not flags & {"avx512_bf16", "amx_bf16"}:
        assert precision.resolve_bf16("auto", "cpu")[0] is False
        return
    ratio = best_mm_flops(torch.bfloat16) / best_mm_flops(torch.float32)
    if abs(ratio - precision.BF16_MIN_SPEEDUP) < 0.4:
        pytest.skip(f"bf16/fp32 matmul ratio {ratio:.2f} is too close to the threshold to judge")
    bf16, why = precision.resolve_bf16("auto", "cpu")
    assert bf16 is (ratio > precision.BF16_MIN_SPEEDUP), (ratio, why)


def test_trainer_logs_its_precision_choice(tmp_path, monkeypatch, fresh_probe, caplog):
    caplog.set_level(logging.INFO)
    monkeypatch.setattr(precision, "cpu_flags", lambda: {"avx2"})
    trainer = Trainer(tiny_config(tmp_path, "--training.mixed_precision=auto"))
    assert trainer.bf16 is False and trainer.module.precision_name() == "fp32"
    assert_names(caplog.text, "precision: fp32", "auto", "AVX512_BF16")


def test_gpu_peak_follows_the_matmul_dtype(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA H100 80GB HBM3")
    cuda = torch.device("cuda", 0)
    assert flops.Peak(cuda, bf16=True).flops == 989e12
    assert flops.Peak(cuda, bf16=False, tf32=True).flops == 989e12 / 2  # the TF32 peak
    assert flops.Peak(cuda, bf16=False, tf32=False).flops is None  # plain fp32: no MFU


def test_cpu_peak_is_measured_in_the_training_dtype(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHLLM_CACHE_DIR", str(tmp_path))
    seen = []
    monkeypatch.setattr(flops, "matmul_flops", lambda dtype, **kw: seen.append(dtype) or 1e9)
    flops.Peak(torch.device("cpu"), bf16=True)
    first = len(seen)
    flops.Peak(torch.device("cpu"), bf16=False)
    assert first and set(seen[:first]) == {torch.bfloat16} and set(seen[first:]) == {torch.float32}


def test_cpu_peak_is_measured_once_per_machine_and_never_raised(monkeypatch, tmp_path, caplog):
    """Measured once and cached (per CPU model, threads, dtype); a faster step does not move it
    (MFU would read ~100% by construction): one warning names the re-measuring command."""
    monkeypatch.setenv("TORCHLLM_CACHE_DIR", str(tmp_path))
    readings = iter([2e9, 5e9])
    # (quiet: tests/unit/metrics/test_cpu_peak)
    monkeypatch.setattr(flops, "_checked", lambda dtype, cache: {
        "flops": next(readings), "measured": "now", "quiet": True})
    peak = flops.Peak(torch.device("cpu"), bf16=False)
    assert peak.flops == 2e9 and (tmp_path / "cpu_peak_flops.json").is_file()
    assert flops.Peak(torch.device("cpu"), bf16=False).flops == 2e9  # cached: not measured
    with caplog.at_level("WARNING", logger="torchllm"):
        assert peak.check(1e9) == 2e9
        assert peak.check(3e9) == 2e9 and peak.check(4e9) == 2e9  # never raised to fit a step
    warned = [r.getMessage() for r in caplog.records if "MFU over 100%" in r.getMessage()]
    assert len(warned) == 1 and "python -m torchllm.tools.cpu_peak --remeasure" in warned[0]
    from torchllm.tools.cpu_peak import main

    main(["--remeasure", "--dtype", "float32"])  # on request: measured again, cached
    assert flops.Peak(torch.device("cpu"), bf16=False).flops == 5e9


def test_mfu_is_against_the_cached_peak(tmp_path, monkeypatch):
    """Every MFU a run logs divides its achieved FLOP/s by the machine's cached peak, however
    fast a step was (here a peak far below the step's: MFU over 100%, reported as such)."""
    import json

    cache = tmp_path / "cache"
    monkeypatch.setenv("TORCHLLM_CACHE_DIR", str(cache))
    cache.mkdir()
    key = flops.cpu_peak_key(torch.float32)
    (cache / "cpu_peak_flops.json").write_text(json.dumps({key: {"flops": 1e6, "quiet": True,
                                                                 "measured": "then"}}))
    monkeypatch.setattr(flops, "matmul_flops", lambda *a, **k: pytest.fail("measured again"))
    trainer = Trainer(tiny_config(tmp_path, "--training.mixed_precision=none",
                                  "--training.steps=3", "--metrics.log_freq=1"))
    logged = []
    log = trainer.metrics.log

    def spy(step, m, step_time):
        out = log(step, m, step_time)
        if out is not None:
            logged.append((out["perf/mfu_pct"], out["perf/tflops"]))
        return out

    trainer.metrics.log = spy
    trainer.train()
    assert len(logged) == 3
    for mfu, tflops in logged:
        assert mfu == pytest.approx(100 * tflops * 1e12 / 1e6, rel=1e-9) and mfu > 100


def test_measuring_the_peak_leaves_the_training_rng_alone():
    """The CPU peak is re-measured whenever a step beats it, i.e. at load-dependent moments: a
    measurement drawing from the global RNG made the saved RNG state (and any dropout after it)
    depend on machine load (seen as an async-vs-sync checkpoint mismatch on a busy machine)."""
    torch.manual_seed(7)
    before = torch.get_rng_state()
    precision.matmul_flops(torch.float32, size=64, trials=1, seconds=0.001)
    assert torch.equal(torch.get_rng_state(), before)
