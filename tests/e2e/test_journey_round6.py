"""The journey, round 6 (issue 63): numbers and messages that say what they are."""

from __future__ import annotations

import json
import re
import socket
from pathlib import Path

import pytest

from cli import DEBUG_CONFIG, run_train
from conftest import REPO, tiny_args

import torchllm.hub as hub
from torchllm.eval.downstream import DownstreamResult, TaskResult
from builders.docs import documented_tags  # noqa: F401


def test_every_scalar_a_run_writes_is_in_the_metrics_docs_table(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    r = run_train(*tiny_args(tmp_path, "--training.steps=2", "--job.run_name=tags"))
    assert r.returncode == 0, r.out[-3000:]
    tags = set()
    for events in (tmp_path / "tb").rglob("events.out.tfevents.*"):
        acc = EventAccumulator(str(events), size_guidance={"scalars": 0})
        acc.Reload()
        tags |= set(acc.Tags()["scalars"])
    assert "loss/interval" in tags and "loss/avg" in tags, sorted(tags)
    patterns = documented_tags()
    missing = sorted(t for t in tags if not any(p.match(t) for p in patterns))
    assert not missing, f"TensorBoard tags missing from docs/metrics.md's table: {missing}"


def test_a_centered_accuracy_a_hair_below_chance_prints_as_zero():
    result = DownstreamResult({"copa": TaskResult("copa", "mc", 0, 10, 0.4999999, 0.5)})
    table = result.table()
    assert "-0.0000" not in table and "0.0000" in table, table


@pytest.fixture
def fresh_probe(monkeypatch):
    monkeypatch.setattr(hub, "_state", {})
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    for key in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "HF_HUB_OFFLINE",
                "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(key, raising=False)


def test_an_offline_hub_is_described_as_it_answered(fresh_probe, monkeypatch):
    # refused at once (nothing listens on port 9): not "did not answer within 3 s"
    assert not hub.hub_reachable()
    note = hub.offline_note(True)
    assert "could not be reached" in note and "within" not in note, note

    def times_out(*a, **k):
        raise socket.timeout("timed out")

    monkeypatch.setattr(hub, "_state", {})
    monkeypatch.setattr(socket, "create_connection", times_out)
    assert not hub.hub_reachable()
    assert "did not answer within 3 s" in hub.offline_note(True)


def write_user_dir(tmp_path: Path) -> Path:
    """A user's own working directory outside the clone: a TOML and a text folder of theirs."""
    import pydoc_data.topics

    user = tmp_path / "work"
    (user / "data").mkdir(parents=True)
    (user / "data" / "x.txt").write_text("\n\n".join(pydoc_data.topics.topics.values()))
    (user / "my.toml").write_text(
        '[job]\ndump_folder = "./outputs"\nrun_name = "mine"\n\n'
        '[data]\ndataset = "local:data/x.txt"\ntokenizer_vocab_size = 512\n')
    return user


@pytest.mark.e2e
def test_paths_resolve_where_the_user_stands_not_in_the_clone(tmp_path):
    import os
    import subprocess

    user = write_user_dir(tmp_path)
    before = set((REPO / "outputs").glob("*")) if (REPO / "outputs").is_dir() else set()
    p = subprocess.run(
        [str(REPO / "run_train.sh"), "--training.device=cpu", "--model.flavor=debug",
         "--training.steps=2", "--training.seq_len=32", "--training.local_batch_size=2",
         "--metrics.report=false", "--training.mixed_precision=none",
         "--checkpoint.enable=true", "--checkpoint.interval=2"],
        cwd=user, env={**os.environ, "CONFIG_FILE": "my.toml", "NGPU": "1"},
        capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    assert (user / "outputs" / "mine" / "checkpoint" / "step-2").is_dir(), os.listdir(user)
    after = set((REPO / "outputs").glob("*")) if (REPO / "outputs").is_dir() else set()
    assert after == before, f"the run wrote into the clone: {after - before}"


def test_a_path_not_found_names_where_it_looked(tmp_path):
    user = write_user_dir(tmp_path)
    r = run_train(*tiny_args(tmp_path, "--data.dataset=local:my_texts/"),
                  config=REPO / DEBUG_CONFIG, cwd=user)
    assert r.returncode == 2, r.out[-3000:]
    assert str(user / "my_texts") in r.out, r.out[-2000:]
    r = run_train(config="nope.toml", cwd=user)
    assert r.returncode == 2 and str(user / "nope.toml") in r.out, r.out[-2000:]


@pytest.mark.slow
def test_a_resume_on_another_rank_count_continues_the_global_batch_order_exactly(tmp_path):
    """2 ranks x 2 sequences stop at step 2; 1 rank x 4 resumes to step 4; 2 ranks x 2 resume
    to step 6: every step trains on the batch an uninterrupted 1 x 4 run trains on (the global
    order does not depend on the layout)."""
    import os
    import subprocess

    from conftest import tb_scalars

    common = ["--training.steps=6", "--checkpoint.enable=true", "--checkpoint.interval=2",
              "--data.shuffle_windows=true", "--training.stop_after_steps=2"]
    two = tmp_path / "two"

    def two_ranks():
        p = subprocess.run(["./run_train.sh", *tiny_args(two, *common,
                                                         "--training.local_batch_size=2")],
                           cwd=REPO, env={**os.environ, "NGPU": "2", "PYTHONPATH": str(REPO)},
                           capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
        return p.stdout + p.stderr

    straight = run_train(*tiny_args(tmp_path / "straight", *common[:-1],
                                    "--training.local_batch_size=4"))
    assert straight.returncode == 0, straight.out[-3000:]
    two_ranks()
    one = run_train(*tiny_args(two, *common, "--training.local_batch_size=4"))
    assert one.returncode == 0, one.out[-3000:]
    assert "data order continued on another layout" in one.out, one.out[-3000:]
    assert "data order continued on another layout" in two_ranks()
    want = tb_scalars(tmp_path / "straight" / "tb" / "debug_model")
    got = tb_scalars(two / "tb" / "debug_model")
    assert set(got) == set(want) == set(range(1, 7)), got
    for step in range(3, 7):  # the weights differ by summation order only
        assert got[step] == pytest.approx(want[step], rel=1e-4), (step, got, want)


def test_a_healed_groups_summary_counts_this_launchs_tokens(tmp_path):
    """A replica group that heals takes the live group's token count (its whole run) during
    its first step: the end-of-run block counts the tokens this launch's steps trained."""
    from types import SimpleNamespace

    import torch

    from conftest import tiny_config
    from torchllm.checkpoint.state import TrainState
    from torchllm.report.hook import RunReport

    cfg = tiny_config(tmp_path, "--checkpoint.enable=false", "--metrics.enable_tensorboard=false")
    state = TrainState()
    # the TrainContext fields the report reads
    ctx = SimpleNamespace(cfg=cfg, run_dir=tmp_path / "run", train_state=state, step=0,
                          device=torch.device("cpu"), header="", callback=lambda cls: None,
                          is_log_step=lambda step: False, checkpoints=lambda: (None, None))
    hook = RunReport.from_context(ctx)
    hook.on_train_start(ctx)
    state.tokens_seen = 90_000  # healed: the live group's count arrives with its state
    for step in (13, 14):
        state.tokens_seen += 512
        ctx.step = step
        hook.on_step_end(ctx, step, {"loss": 3.0, "tokens": 512})
    block = hook.end_block(ctx, elapsed=2.0, report=None)
    assert "1,024 tokens (512 tok/s)" in block and "(1,024 in this launch)" in block, block
    assert "91,024 seen in all" in block, block


def test_the_report_reads_a_relaunchs_events_without_tensorboards_purge_message(tmp_path,
                                                                                caplog):
    """A resumed launch re-logs the steps after its checkpoint: the report reads the events as
    the viewer shows them, and TensorBoard's "TensorFlow restart ... Purging" is not printed."""
    from torch.utils.tensorboard import SummaryWriter

    from torchllm.report.events import read_events

    for steps in (range(1, 5), range(3, 6)):  # a first launch to 4, a resume from step 2
        # (torchllm's writer marks a resumed launch's first step as the viewer's purge point)
        writer = SummaryWriter(str(tmp_path), purge_step=steps[0] if steps[0] > 1 else None)
        for step in steps:
            writer.add_scalar("loss/avg", float(step), step)
        writer.close()
    with caplog.at_level("WARNING"):
        scalars, _ = read_events(tmp_path)
    assert list(scalars["loss/avg"].steps) == [1, 2, 3, 4, 5]
    assert not [r for r in caplog.records if "urging" in r.getMessage()], caplog.text


def test_the_reports_hardware_line_names_every_launchs_machine(tmp_path, monkeypatch):
    from types import SimpleNamespace

    import torch

    from conftest import tiny_config
    from torchllm.checkpoint.state import TrainState
    from torchllm.report import hook
    from torchllm.report.events import RunData
    from torchllm.report.markdown import summary_rows

    cfg = tiny_config(tmp_path)
    ctx = SimpleNamespace(cfg=cfg, run_dir=tmp_path / "run", train_state=TrainState(),
                          device=torch.device("cpu"), header="")  # what the report reads
    for machine in ("2 x CPU A", "CPU B", "CPU B"):  # three launches, on two machines
        monkeypatch.setattr(hook, "hardware", lambda device, m=machine: m)
        hook.RunReport.from_context(ctx).on_train_start(ctx)
    info = json.loads((tmp_path / "run" / "report" / "run.json").read_text())
    row = summary_rows(RunData("run", tmp_path / "run", cfg, info=info))["hardware"]
    assert "2 x CPU A" in row and row.count("CPU B") == 1, row


def test_every_report_plot_label_fits_in_its_figure(tmp_path):
    """No axis label or title of a report plot is cut off at the figure's edge."""
    import numpy as np
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from conftest import tiny_config
    from torchllm.report.events import RunData, Series
    from torchllm.report.plots import PLOTS, draw

    steps = np.arange(1, 11)
    tags = {t.split("|")[0].replace("*", "0") for p in PLOTS for panel in p.panels
            for t in panel.tags}
    run = RunData("run", tmp_path, tiny_config(tmp_path),
                  scalars={t: Series(steps, np.linspace(1.0, 2.0, 10)) for t in tags})
    for plot in PLOTS:
        fig = draw(plot, [run])
        FigureCanvasAgg(fig).draw()  # laid out as png() saves it
        renderer = fig.canvas.get_renderer()
        box = fig.bbox
        for ax in fig.axes:
            for label in (ax.xaxis.label, ax.yaxis.label):
                extent = label.get_window_extent(renderer)
                assert box.x0 - 1 <= extent.x0 and extent.x1 <= box.x1 + 1 and \
                    box.y0 - 1 <= extent.y0 and extent.y1 <= box.y1 + 1, \
                    (plot.file, label.get_text())
