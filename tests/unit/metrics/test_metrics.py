"""Monitoring: TensorBoard events vs what the trainer computed, norms and update ratios, the
FLOPs/MFU formula for the 1B reference, progress display, W&B wiring, profiler traces."""

import dataclasses
import io
import json
import math
import sys
import types
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from torchllm.config import ConfigError, load_config
from torchllm.data import build_tokenizer
from torchllm.metrics.flops import flops_per_token, gpu_peak_flops, mfu_stats, parameter_counts
from torchllm.metrics.memory import GiB
from torchllm.metrics.norms import grad_norms, l2_norm, track_update, watched_groups
from torchllm.metrics.progress import Progress, format_duration
from torchllm.config.paths import tensorboard_folder
from torchllm.metrics.writers import build_writers
from torchllm.models import model_args
from torchllm.models.llama.args import LlamaArgs
from torchllm.models.llama.model import Transformer
from torchllm.optim import lr_factor
from torchllm.metrics import LossGuard, TrainingStopped
from torchllm.train import Trainer, main

from conftest import REPO, tiny_args, tiny_config
from messages import assert_names, raises_naming

GROUPS = ("embeddings", "output", "first_block", "last_block")
CPU_TAGS = {
    "loss/avg", "loss/max", "loss/interval", "optim/lr", "grad_norm/total",
    *(f"{kind}/{g}" for kind in ("grad_norm", "param_norm", "update_ratio") for g in GROUPS),
    "throughput/tokens_per_s", "throughput/tokens_per_s_device", "throughput/trained_tokens_per_s",
    "time/step_s", "time/data_s", "time/data_pct", "perf/tflops", "perf/mfu_pct",
    "memory/rss_gib", "memory/params_gib", "memory/grads_gib", "memory/optimizer_gib",
    "guard/nonfinite", "guard/spikes", "guard/skipped_steps",
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """tiny_config with a tokenizer trained once for the module (training one takes seconds)."""
    folder = tmp_path_factory.mktemp("tokenizer")
    path = build_tokenizer(tiny_config(folder).data, folder).path

    def make(tmp_path, *extra):
        return tiny_config(tmp_path, f"--data.tokenizer={path}", *extra)

    return make


@pytest.fixture
def log_text(caplog):
    """The torchllm logger's records as text (main() stops its propagation to the root logger,
    where caplog listens, so listen on it directly)."""
    from torchllm.log import logger

    logger.addHandler(caplog.handler)
    yield lambda: caplog.text
    logger.removeHandler(caplog.handler)


def read_scalars(folder) -> dict[str, list[tuple[int, float]]]:
    acc = EventAccumulator(str(folder))
    acc.Reload()
    return {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}


def test_tensorboard_events_match_what_the_trainer_computed(tmp_path, tiny):
    cfg = tiny(tmp_path, "--metrics.log_freq=2", "--job.run_name=tbrun", "--training.steps=3",
                      "--model.max_seq_len=32", "--optimizer.lr=1e-3")
    trainer = Trainer(cfg)
    written = {}  # step -> scalars the logger wrote
    log = trainer.metrics.log

    def spy(step, m, step_time):
        out = log(step, m, step_time)
        if out is not None:
            written[step] = out
        return out

    trainer.metrics.log = spy
    losses = trainer.train()

    events = read_scalars(tmp_path / "tb" / "tbrun")
    # The report hook's x-axis: tokens trained on so far (4 windows of 32 tokens a step).
    assert events.pop("progress/tokens_seen") == [(s, 128.0 * s) for s in (1, 2, 3)]
    assert set(events) == CPU_TAGS
    assert sorted(written) == [1, 2, 3]  # step 1, every log_freq, and the last step
    for tag, series in events.items():
        assert [s for s, _ in series] == [1, 2, 3], tag
        for step, value in series:  # event files store float32
            assert value == pytest.approx(written[step][tag], rel=1e-6, abs=1e-12), (tag, step)

    # Against independent oracles, not the logger's own arithmetic.
    for step in (1, 2, 3):
        ev = {tag: dict(series)[step] for tag, series in events.items()}
        assert ev["loss/avg"] == pytest.approx(losses[step - 1], rel=1e-6)
        assert ev["loss/max"] == ev["loss/avg"]  # one rank
        assert ev["optim/lr"] == pytest.approx(1e-3 * lr_factor(step, 3, 2, "cosine", 0.1))
        assert ev["throughput/tokens_per_s_device"] == ev["throughput/tokens_per_s"]
        assert 0 <= ev["time/data_pct"] <= 100 and ev["time/data_s"] <= ev["time/step_s"]
        assert ev["perf/tflops"] == pytest.approx(
            ev["throughput/tokens_per_s"] * trainer.flops_per_token / 1e12, rel=1e-5)
        assert ev["perf/mfu_pct"] == pytest.approx(
            100 * ev["perf/tflops"] * 1e12 / trainer.peak_flops, rel=1e-5)
        # The four groups are disjoint parts of the model (4 layers): their squared norms
        # add up to at most the total's, and each update is small next to its weights.
        parts = sum(ev[f"grad_norm/{g}"] ** 2 for g in GROUPS)
        assert 0 < parts <= ev["grad_norm/total"] ** 2 * (1 + 1e-5)
        assert all(0 < ev[f"update_ratio/{g}"] < 0.1 for g in GROUPS)
        n_bytes = sum(p.numel() * 4 for p in trainer.model.parameters())
        assert ev["memory/params_gib"] == pytest.approx(n_bytes / GiB, rel=1e-6)
        assert ev["memory/grads_gib"] == ev["memory/params_gib"]
        assert ev["memory/rss_gib"] > ev["memory/params_gib"]
        assert ev["guard/nonfinite"] == ev["guard/skipped_steps"] == 0
    # AdamW keeps two fp32 moments per parameter (plus a step count per tensor).
    assert dict(events["memory/optimizer_gib"])[3] >= 2 * dict(events["memory/params_gib"])[3]
    # The parameters' norms after the last step are those of the trained model.
    emb = trainer.model.tok_embeddings.weight
    assert dict(events["param_norm/embeddings"])[3] == pytest.approx(emb.norm().item(), rel=1e-5)


def test_console_loss_is_the_mean_over_the_logging_interval(tmp_path, tiny, log_text, caplog):
    """Logged every 4 steps, the console's loss at step 4 stands for steps 2-4 (their mean:
    every step has the same token count), not step 4 alone; TensorBoard keeps step 4's own."""
    import re

    cfg = tiny(tmp_path, "--metrics.log_freq=4", "--job.run_name=iv", "--training.steps=5")
    caplog.set_level("INFO", logger="torchllm")
    losses = Trainer(cfg).train()
    console = {int(step): float(loss) for step, loss in
               re.findall(r"step +(\d+)/5 \| loss ([\d.]+)", log_text())}
    assert sorted(console) == [1, 4, 5]
    assert console[1] == pytest.approx(losses[0], abs=1e-4)
    assert console[4] == pytest.approx(sum(losses[1:4]) / 3, abs=1e-4)
    assert abs(console[4] - losses[3]) > 1e-3  # the test tells the mean from the step's value
    assert console[5] == pytest.approx(losses[4], abs=1e-4)
    assert dict(read_scalars(tmp_path / "tb" / "iv")["loss/avg"])[4] == pytest.approx(
        losses[3], rel=1e-6)


def test_group_norms_and_update_ratio_against_sgd():
    """Plain SGD moves W by exactly lr·g, so ‖ΔW‖/‖W‖ = lr·‖g‖/‖W‖."""
    torch.manual_seed(0)
    model = Transformer(LlamaArgs(dim=32, n_layers=3, n_heads=2, vocab_size=64, max_seq_len=8))
    model.init_weights()
    model(torch.randint(0, 64, (2, 8))).square().mean().backward()
    groups = watched_groups(model)
    assert set(groups) == set(GROUPS)
    assert groups["first_block"] == list(model.layers["0"].parameters())
    assert groups["last_block"] == list(model.layers["2"].parameters())

    flat = lambda ts: torch.cat([t.detach().flatten() for t in ts])  # noqa: E731
    norms = grad_norms(groups)
    for g, params in groups.items():
        assert norms[f"grad_norm/{g}"] == pytest.approx(flat(p.grad for p in params).norm().item())

    before = {g: flat(params) for g, params in groups.items()}
    lr, out = 0.05, {}
    with track_update(groups, out):
        torch.optim.SGD(model.parameters(), lr=lr).step()
    for g, params in groups.items():
        expected = lr * flat(p.grad for p in params).norm() / before[g].norm()
        assert out[f"update_ratio/{g}"] == pytest.approx(expected.item(), rel=1e-4)
        assert out[f"param_norm/{g}"] == pytest.approx(flat(params).norm().item(), rel=1e-6)


def test_tied_embeddings_have_no_output_group():
    model = Transformer(LlamaArgs(dim=32, n_layers=1, n_heads=2, vocab_size=64, max_seq_len=8,
                                  tie_embeddings=True))
    groups = watched_groups(model)
    assert "output" not in groups
    assert groups["first_block"] == groups["last_block"]
    assert l2_norm([]) == 0.0


def test_flops_and_mfu_of_the_1b_reference_by_hand():
    cfg = load_config(["--job.config_file", str(REPO / "train_configs" / "llama3_1b.toml")])
    with torch.device("meta"):
        model = Transformer(model_args(cfg.model, cfg.training, cfg.data))
    assert parameter_counts(model)["params"] == 1_241_581_568
    # Tied embeddings: the table is not counted as a non-embedding parameter, but its output
    # matmul runs, so N = every parameter: 6N = 7,449,489,408. Attention scores and values:
    # 12 · 16 layers · 32 heads · 64 head_dim · 2048 tokens = 805,306,368.
    assert flops_per_token(model, 2048) == 7_449_489_408 + 805_306_368 == 8_254_795_776
    # 40,000 tokens/s on one H100 SXM (989 bf16 TFLOPS dense).
    stats = mfu_stats(40_000, 8_254_795_776, gpu_peak_flops("NVIDIA H100 80GB HBM3"))
    assert stats["tflops"] == pytest.approx(330.19183104)
    assert stats["mfu_pct"] == pytest.approx(33.386434888)
    assert "mfu_pct" not in mfu_stats(40_000, 8_254_795_776, None)


@pytest.mark.parametrize("name, peak", [
    ("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H100 PCIe", 756e12), ("NVIDIA H100 NVL", 835e12),
    ("NVIDIA H200", 989e12), ("NVIDIA A100-SXM4-80GB", 312e12), ("NVIDIA B200", 2250e12),
    ("AMD Instinct MI300X", 1307e12),
])
def test_peak_flops_table(name, peak):
    assert gpu_peak_flops(name) == peak


def test_unknown_device_warns_and_reports_no_mfu():
    with pytest.warns(UserWarning, match="unknown peak FLOPS"):
        assert gpu_peak_flops("Imaginary GPU 9000") is None


def test_progress_bar_on_a_terminal_and_plain_otherwise():
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    term, pipe = Terminal(), io.StringIO()
    for stream in (term, pipe):
        # min_interval=0: tqdm redraws at each step regardless of its 10 Hz limit
        progress = Progress(10, live=True, stream=stream, min_interval=0)
        for step in (1, 2, 3):
            progress.update(step)
        assert progress.eta_s() is not None and progress.eta_s() >= 0
        progress.close()
    assert pipe.getvalue() == ""
    drawn = term.getvalue()
    assert "\r[#########.....................] 3/10 30% ETA 00:00" in drawn, repr(drawn)
    assert "\r[###" in drawn and "1/10 10% ETA ?" in drawn  # no ETA before a step was timed
    assert drawn.endswith(" " * 40 + "\r"), repr(drawn)  # closed: the row is cleared
    off = Terminal()
    Progress(10, live=False, stream=off).update(1)
    assert off.getvalue() == ""
    assert format_duration(3725) == "1:02:05" and format_duration(65) == "1:05"


def run_writers(cfg, name: str, rank: int) -> list:
    """build_writers as the Trainer calls it: run `name` under cfg's dump folder."""
    return build_writers(cfg.metrics, tensorboard_folder(cfg.job, cfg.metrics, name), name,
                         Path(cfg.job.dump_folder) / name, rank,
                         config=dataclasses.asdict(cfg))


def test_writer_folders_per_rank(tmp_path):
    cfg = tiny_config(tmp_path, "--metrics.rank_0_only=false")
    (writer,) = run_writers(cfg, "r", rank=1)
    assert writer.folder == tmp_path / "tb" / "r" / "rank_1"
    writer.close()
    assert run_writers(tiny_config(tmp_path), "r", rank=1) == []
    assert run_writers(tiny_config(tmp_path, "--metrics.enable_tensorboard=false"), "r",
                       rank=0) == []


def test_wandb_is_used_when_enabled_and_optional(tmp_path, monkeypatch, log_text):
    calls = []

    class Run:
        def log(self, scalars, step):
            calls.append(("log", step, dict(scalars)))

        def finish(self):
            calls.append(("finish",))

    fake = types.SimpleNamespace(init=lambda **kw: calls.append(("init", kw)) or Run())
    monkeypatch.setitem(sys.modules, "wandb", fake)
    cfg = tiny_config(tmp_path, "--metrics.enable_wandb", "--metrics.enable_tensorboard=false",
                      "--metrics.wandb_project=proj")
    (writer,) = run_writers(cfg, "r", rank=0)
    writer.write(3, {"loss/avg": 1.5})
    writer.close()
    init = calls[0][1]
    assert (init["project"], init["name"], init["config"]["metrics"]["wandb_project"]) == (
        "proj", "r", "proj")
    assert calls[1:] == [("log", 3, {"loss/avg": 1.5}), ("finish",)]

    monkeypatch.setitem(sys.modules, "wandb", None)  # not installed: import fails
    assert run_writers(cfg, "r", rank=0) == []
    assert_names(log_text(), "metrics.enable_wandb", "pip install wandb")  # the key, the fix


def test_profiler_writes_one_trace_per_window(tmp_path, tiny, log_text):
    cfg = tiny(tmp_path, "--profiling.enable_profiling", "--profiling.profile_freq=2",
                      "--profiling.profiler_warmup=0", "--profiling.profiler_active=1",
                      "--profiling.enable_memory_snapshot", "--job.run_name=prof")
    Trainer(cfg).train()
    traces = sorted((tmp_path / "prof" / "profile_traces").glob("*/*.json"))
    assert [t.relative_to(tmp_path / "prof" / "profile_traces").as_posix() for t in traces] == [
        "iteration_2/rank0_trace.json", "iteration_4/rank0_trace.json"]
    for trace in traces:
        events = json.loads(trace.read_text())["traceEvents"]
        assert any("aten::mm" in e.get("name", "") for e in events)
    if not torch.cuda.is_available():  # snapshots are CUDA-only: warned about, none written
        assert not (tmp_path / "prof" / "memory_snapshot").exists()
        assert_names(log_text(), "profiling.enable_memory_snapshot", "CUDA")


@pytest.mark.parametrize("flag, names", [  # the key = value, and what is allowed
    ("--profiling.profiler_active=5", ("profiling.profiler_active = 5", ">= 1")),
    ("--metrics.loss_spike_factor=0.5", ("metrics.loss_spike_factor = 0.5", "0 (off)", "> 1")),
    ("--metrics.loss_spike_window=0", ("metrics.loss_spike_window = 0", ">= 1")),
    ("--metrics.guard_policy=ignore", ("metrics.guard_policy", "'ignore'", "'warn'", "'skip_step'",
                                       "'stop'")),
], ids=lambda v: v if isinstance(v, str) else "")
def test_bad_monitoring_config_is_a_clear_error(tmp_path, flag, names):
    with raises_naming(ConfigError, *names):
        tiny_config(tmp_path, "--profiling.profile_freq=4", "--profiling.profiler_warmup=1", flag)


def test_cuda_memory_metrics_and_snapshots_when_a_gpu_is_present(tmp_path, tiny):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    trainer = Trainer(tiny(tmp_path, "--training.device=cuda", "--training.steps=2",
                           "--profiling.enable_memory_snapshot",
                           "--profiling.memory_snapshot_freq=2", "--job.run_name=gpu"))
    m = {}
    log = trainer.metrics.log
    trainer.metrics.log = lambda step, mm, t: m.update(log(step, mm, t) or {})
    trainer.train()
    assert 0 < m["memory/max_active_gib"] <= m["memory/max_reserved_gib"]
    assert m["memory/ooms"] == 0 and math.isfinite(m["memory/max_active_pct"])
    trainer.profiler.start()
    trainer.profiler.on_oom(3)
    trainer.profiler.stop()
    folder = tmp_path / "gpu" / "memory_snapshot"
    for name in ("iteration_2", "oom_step_3"):
        assert (folder / name / "rank0_memory_snapshot.pickle").stat().st_size > 0


def poison_step(monkeypatch, bad_step: int) -> None:
    """Make the trainer's step `bad_step` (a fresh run's `bad_step`-th batch of its train
    module) produce a NaN loss and NaN gradients."""
    from torchllm.train_module import TrainModule

    train_batch = TrainModule.train_batch

    def poisoned(self, micro_batches):
        loss_sum, n_tokens = train_batch(self, micro_batches)
        self.batches_trained = getattr(self, "batches_trained", 0) + 1
        if self.batches_trained == bad_step:
            for p in self.model.parameters():
                p.grad.fill_(float("nan"))
            loss_sum = loss_sum * float("nan")
        return loss_sum, n_tokens

    monkeypatch.setattr(TrainModule, "train_batch", poisoned)


def adam_steps(trainer) -> int:
    """How many updates AdamW applied (its per-parameter step count)."""
    return int(next(iter(trainer.optimizer.state.values()))["step"])


def test_guard_warn_applies_the_nan_update(tmp_path, tiny, monkeypatch, log_text):
    poison_step(monkeypatch, 2)
    trainer = Trainer(tiny(tmp_path, "--metrics.guard_policy=warn", "--training.steps=3"))
    losses = trainer.train()
    assert_names(log_text(), "step 2", "nan", "guard_policy = warn")  # the step, value, policy
    assert adam_steps(trainer) == 3
    # The NaN update reached the weights, so every later step is non-finite too.
    assert not torch.isfinite(trainer.model.tok_embeddings.weight).all()
    assert math.isfinite(losses[0]) and all(math.isnan(x) for x in losses[1:])
    assert trainer.guard.counts == {"nonfinite": 2, "spikes": 0, "skipped_steps": 0}


def test_guard_skip_step_drops_only_that_update(tmp_path, tiny, monkeypatch, log_text):
    poison_step(monkeypatch, 2)
    cfg = tiny(tmp_path, "--metrics.guard_policy=skip_step", "--metrics.log_freq=2",
               "--job.run_name=skip", "--training.steps=3")
    trainer = Trainer(cfg)
    losses = trainer.train()
    assert_names(log_text(), "step 2", "nan", "guard_policy = skip_step")
    assert math.isnan(losses[1]) and all(math.isfinite(x) for i, x in enumerate(losses) if i != 1)
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    assert adam_steps(trainer) == 2  # steps 1 and 3: the optimizer never saw step 2
    assert trainer.lr_scheduler.last_epoch == 3  # the schedule advanced through step 2
    assert trainer.guard.counts == {"nonfinite": 1, "spikes": 0, "skipped_steps": 1}
    events = read_scalars(tmp_path / "tb" / "skip")
    assert dict(events["guard/skipped_steps"]) == {1: 0.0, 2: 1.0, 3: 1.0}
    assert 2 not in dict(events["update_ratio/embeddings"])  # no update, no ratio


@pytest.mark.slow
def test_guard_stop_saves_and_exits_non_zero(tmp_path, tiny, monkeypatch, log_text, capsys):
    poison_step(monkeypatch, 2)
    trainer = Trainer(tiny(tmp_path / "a", "--metrics.guard_policy=stop"))
    saved = []
    trainer.guard.save_checkpoint = saved.append
    with raises_naming(TrainingStopped, "step 2", "nan"):
        trainer.train()
    assert saved == [2] and adam_steps(trainer) == 1 and trainer.step == 2
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())

    assert main(tiny_args(tmp_path / "b", f"--data.tokenizer={trainer.tokenizer.path}",
                          "--metrics.guard_policy=stop")) == 3
    # main() installs its own console handler: the reason is on stderr.
    assert_names(capsys.readouterr().err, "guard", "step 2", "nan")


def test_loss_spike_and_consecutive_skips():
    mcfg = types.SimpleNamespace(guard_policy="skip_step", loss_spike_factor=3.0,
                                 loss_spike_window=3, max_consecutive_skips=2)
    guard = LossGuard(mcfg)
    assert all(guard.check(s, 2.0, 1.0) for s in (1, 2, 3))
    assert guard.check(4, 5.9, 1.0)  # under 3 x the mean of 2.0
    mean = (2.0 + 2.0 + 5.9) / 3
    assert not guard.check(5, 3 * mean + 0.01, 1.0)  # a spike: dropped
    assert guard.counts == {"nonfinite": 0, "spikes": 1, "skipped_steps": 1}
    assert guard.check(6, 2.0, 1.0)  # a good step resets the run of skips
    assert not guard.check(7, 2.0, float("inf"))
    with raises_naming(TrainingStopped, "step 8", "metrics.max_consecutive_skips = 2"):
        guard.check(8, float("nan"), 1.0)
    mcfg.loss_spike_factor = 0  # off: no spike is ever flagged
    assert LossGuard(mcfg).problem(1e9, 1.0) is None
