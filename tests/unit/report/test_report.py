"""The run report (torchllm.report): plots drawn from a real run's TensorBoard events, several
runs on shared axes, and what the end of a run leaves and says (train.log, the end block)."""

import struct
from pathlib import Path

import numpy as np
import pytest

from torchllm.report import write_report
from torchllm.train import Trainer, main

from torchllm.config import load_config
from conftest import tiny_args, tiny_config
from messages import assert_names

pytest.importorskip("matplotlib")


def raw_scalars(folder: Path) -> dict[str, dict[int, float]]:
    """Oracle: every scalar in the event files, read record by record with the protobuf alone
    (not the EventAccumulator the report uses): {tag: {step: value}}, later records win."""
    from tensorboard.compat.proto import event_pb2

    out: dict[str, dict[int, float]] = {}
    for path in sorted(folder.glob("events.out.tfevents.*")):
        data = path.read_bytes()
        pos = 0
        while pos < len(data):
            (length,) = struct.unpack("<Q", data[pos:pos + 8])
            record = data[pos + 12:pos + 12 + length]
            pos += 12 + length + 4
            event = event_pb2.Event.FromString(record)
            for v in event.summary.value:
                if v.HasField("simple_value"):
                    out.setdefault(v.tag, {})[event.step] = v.simple_value
                elif v.HasField("tensor") and v.tensor.float_val:
                    out.setdefault(v.tag, {})[event.step] = v.tensor.float_val[0]
    return out


def interval_means(losses):
    """The console's loss at the logging steps 1, 2, 4, 6 of a 6-step run (log_freq 2)."""
    return [losses[0], losses[1], np.mean(losses[2:4]), np.mean(losses[4:6])]


def line(fig, label):
    found = [ln for ax in fig.axes for ln in ax.lines if ln.get_label() == label]
    assert len(found) == 1, [ln.get_label() for ax in fig.axes for ln in ax.lines]
    return np.asarray(found[0].get_xdata(), float), np.asarray(found[0].get_ydata(), float)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two tiny runs (different learning rates) with validation every 3 steps: (dir, losses)."""
    root = tmp_path_factory.mktemp("runs")
    out = {}
    for name, lr in (("a", "1e-3"), ("b", "3e-3")):
        trainer = Trainer(tiny_config(root, "--metrics.report=true", "--training.steps=6",
                                      "--metrics.log_freq=2",
                                      "--validation.enable", "--validation.freq=3",
                                      "--validation.steps=2", f"--optimizer.lr={lr}",
                                      f"--job.run_name={name}"))
        out[name] = (root / name, trainer.train())
    return out


@pytest.mark.slow
def test_the_run_writes_a_report_whose_plots_are_the_events_values(runs):
    run, losses = runs["a"]
    report = run / "report"
    assert {"report.md", "loss.png", "lr.png", "throughput.png", "grad_norm.png"} <= \
        {p.name for p in report.iterdir()}
    text = (report / "report.md").read_text()
    events = raw_scalars(run.parent / "tb" / "a")
    final_val = events["val/loss"][6]
    assert f"| final validation loss | {final_val:.4f} (step 6) |" in text
    assert "| steps | 6 / 6 |" in text and "![loss](loss.png)" in text
    assert "    run a\n      config" in text  # the run header (an indented code block)

    _, figures = write_report([run], tmp_path_out := run / "redrawn")
    assert (tmp_path_out / "report.md").is_file()
    # Train loss against tokens seen: the console's numbers, each log interval's mean of the
    # trainer's own step losses (logging steps 1, 2, 4, 6: steps 1 | 2 | 3-4 | 5-6; embedded
    # text: every step the same tokens), 4 sequences x 32 tokens per step.
    x, y = line(figures["loss.png"], "train")
    assert y == pytest.approx(interval_means(losses), rel=1e-6)
    assert x.tolist() == [128 * s for s in (1, 2, 4, 6)]
    x, y = line(figures["loss.png"], "validation")
    assert x.tolist() == [128 * 3, 128 * 6]
    assert y.tolist() == [events["val/loss"][3], events["val/loss"][6]]
    x, y = line(figures["lr.png"], "optim/lr")
    assert x.tolist() == [1, 2, 4, 6] and y.tolist() == [events["optim/lr"][s] for s in x]
    x, y = line(figures["throughput.png"], "throughput/tokens_per_s")
    assert y.tolist() == [events["throughput/tokens_per_s"][s] for s in x] and len(x) == 4


@pytest.mark.slow
def test_several_runs_share_the_axes_and_their_differences_are_tabulated(runs):
    a, b = runs["a"][0], runs["b"][0]
    path, figures = write_report([a, b])
    assert path == a.parent / "reports" / "a_vs_b" / "report.md"
    ax = figures["loss.png"].axes[0]  # one axes: both runs' curves on it
    assert {ln.get_label() for ln in ax.lines} == {"a: train", "a: validation", "b: train",
                                                   "b: validation"}
    _, yb = line(figures["loss.png"], "b: train")
    assert yb == pytest.approx(interval_means(runs["b"][1]), rel=1e-6)
    text = path.read_text()
    assert "| optimizer.lr | 0.001 | 0.003 |" in text
    assert "## Run a" in text and "## Run b" in text


def test_differences_show_a_mixtures_sources_and_weights(tmp_path):
    """A mixture run beside a single-source one: data.dataset is not 'embedded' (unused in a
    mixture) and data.sources lists each source with its weight, whole, not a repr."""
    from types import SimpleNamespace

    from torchllm.report.markdown import differences

    long = "local:" + "a_long_folder_name/" * 4
    mix = load_config(tiny_args(tmp_path, f"--data.sources=embedded=0.7,{long}=0.3"))
    one = load_config(tiny_args(tmp_path))
    rows = {r[0]: r[1:] for r in differences([SimpleNamespace(cfg=one), SimpleNamespace(cfg=mix)])}
    assert rows["data.dataset"] == ["embedded", "(mixture: data.sources)"]
    assert rows["data.sources"] == ["none", f"embedded x 0.7, {long} x 0.3"]


def test_report_cli_says_what_is_wrong_in_one_line(tmp_path, capsys):
    from torchllm.report.__main__ import main as report_main

    assert report_main([str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "does not exist" in err[0]


def test_next_lines_use_the_runs_local_eval_copies(tmp_path, capfd):
    """The end block's eval commands with eval.hellaswag_data a local file and
    eval.tasks_data_dir set: they pass those copies (no download, no comment), quoted, and each
    command's flags are its CLI's (it fails on the checkpoint, not on an argument); without
    them (a Hub name, a missing file), the Hub form says it downloads."""
    import shlex

    from torchllm.eval import downstream, hellaswag
    from torchllm.report.hook import evals_offline

    hs = tmp_path / "my evals" / "hellaswag_val.jsonl"
    hs.parent.mkdir()
    hs.write_text("{}\n")
    tasks = tmp_path / "task copies"
    run = tmp_path / "no run"
    cfg = tiny_config(tmp_path, f"--eval.hellaswag_data={hs}", f"--eval.tasks_data_dir={tasks}")
    lines = evals_offline(cfg.eval, shlex.quote(str(run)), " --tasks arc_easy,copa")
    assert [shlex.split(ln) for ln in lines] == [
        ["python", "-m", "torchllm.eval.hellaswag", "--checkpoint", str(run), "--limit", "200",
         "--data", str(hs)],
        ["python", "-m", "torchllm.eval.downstream", "--checkpoint", str(run), "--tasks",
         "arc_easy,copa", "--data-dir", str(tasks)]]
    for cli, line in zip((hellaswag, downstream), lines):
        assert cli.main(shlex.split(line)[3:]) == 2
        err = capfd.readouterr().err
        assert_names(err, run, "folder")  # the path given, and what it must be
        assert "unrecognized" not in err  # the flag the line passes is the CLI's
    for where in (str(tmp_path / "missing.jsonl"), "Rowan/hellaswag"):
        cfg = tiny_config(tmp_path, f"--eval.hellaswag_data={where}")
        hub_hs, hub_tasks = evals_offline(cfg.eval, "RUN", "")
        assert hub_hs.endswith("--limit 200  # downloads it; offline: --data hellaswag_val.jsonl")
        assert hub_tasks.endswith("# downloads them; offline: --data-dir DIR (docs/evaluation.md)")


@pytest.mark.slow
def test_train_log_stdout_stderr_and_the_end_block(tmp_path, capfd):
    """main(): training lines on stdout, warnings on stderr, both in RUN/train.log, appended
    (one marker line per launch) when the run resumes; the end block names this run's paths."""
    args = tiny_args(tmp_path, "--metrics.report=true", "--job.run_name=r", "--checkpoint.enable",
                     "--training.steps=2",
                     "--validation.enable", "--validation.steps=1")
    assert main(args) == 0
    out = capfd.readouterr()
    run = tmp_path / "r"
    assert "step     2/2 | loss" in out.out and "| loss" not in out.err
    assert "done: step 2/2, 2 steps" in out.out
    block = out.out[out.out.index("done: step 2/2"):]
    assert f"checkpoint  {run / 'checkpoint' / 'step-2'}" in block
    assert "validation  loss " in block and "at step 2" in block
    assert f"report      {run / 'report' / 'report.md'}" in block
    assert f"log         {run / 'train.log'}" in block
    assert f'python -m torchllm.generate --checkpoint {run} --prompt "' in block  # a base model
    assert f"python -m torchllm.hf export --checkpoint {run} --out hf/r" in block
    # The evals that download say so, with the offline form (none configured here).
    assert "--limit 200  # downloads it; offline: --data hellaswag_val.jsonl" in block
    assert "# downloads them; offline: --data-dir DIR" in block
    # A second launch resumes (steps 3-4) and warns about a leftover: the warning is on stderr.
    (tmp_path / "r" / "checkpoint" / "step-9").mkdir()  # an incomplete save
    assert main([*args, "--training.steps=4"]) == 0
    out2 = capfd.readouterr()
    log = (run / "train.log").read_text()
    assert log.count("==== launch ") == 2
    assert "step     2/2 | loss" in log and "step     4/4 | loss" in log
    assert log.index("step     2/2") < log.index("==== launch ", 1) < log.index("step     4/4")
    warnings = [ln for ln in out2.err.splitlines() if ln.strip()]
    assert warnings and all(ln.split(" ", 1)[1] in log for ln in warnings)
    assert "precision:" in log.split("==== launch ")[2]  # logged before the folder was known


@pytest.mark.slow
def test_without_matplotlib_the_report_has_its_tables_and_says_why_no_plots(runs, tmp_path,
                                                                            monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` fails
    path, figures = write_report([runs["a"][0]], tmp_path / "out")
    text = path.read_text()
    assert figures == {} and not list((tmp_path / "out").glob("*.png"))
    assert_names(text, "matplotlib", "pip install matplotlib")  # why no plots, and the fix
    assert "| final validation loss |" in text


def test_mixture_and_eval_scalars_get_their_plots_and_tables(tmp_path):
    from torchllm.report.events import RunData, Series
    from torchllm.report.markdown import render_markdown
    from torchllm.report.plots import render

    steps = np.array([10, 20, 30])
    run = RunData("mix", tmp_path, None, scalars={
        "data/source0/fraction": Series(steps, np.array([0.7, 0.71, 0.7])),
        "data/source1/fraction": Series(steps, np.array([0.3, 0.29, 0.3])),
        "hellaswag/acc_norm": Series(np.array([20, 30]), np.array([0.26, 0.31])),
        "downstream/core": Series(np.array([30]), np.array([0.05])),
    })
    figures = render([run])
    assert set(figures) == {"mixture.png", "evals.png"}
    x, y = line(figures["mixture.png"], "data/source1/fraction")
    assert x.tolist() == [10, 20, 30] and y.tolist() == [0.3, 0.29, 0.3]
    assert line(figures["evals.png"], "hellaswag/acc_norm")[1].tolist() == [0.26, 0.31]
    text = render_markdown([run], list(figures), "test")
    assert "| hellaswag/acc_norm | 0.3100 | 30 | 0.3100 |" in text
    assert "| downstream/core | 0.0500 | 30 | 0.0500 |" in text
    assert "| final validation loss | off |" in text
