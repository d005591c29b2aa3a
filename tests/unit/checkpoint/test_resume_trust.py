"""What a resume continues from (issue 42): a bad stretch never evicts the last good checkpoint,
a weights-only final save is never resumed as a full state, and a resume with other data says
so and does what checkpoint.on_data_change says. Every launch goes through the CLI's main()."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch

from torchllm.checkpoint import complete_steps
from torchllm.checkpoint.step import read_marker
from torchllm.config import ConfigError
from torchllm.data import build_data, build_tokenizer
from torchllm.data.prepare import main as prepare_cli
from torchllm.train import Trainer, main

from conftest import shared_path, tb_scalars, tiny_args, tiny_config
from messages import assert_names, raises_naming
from builders.data import data_args

CKPT = ("--checkpoint.enable", "--job.run_name=run", "--checkpoint.interval=2",
        "--checkpoint.keep_latest_k=1")


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> str:
    """A tokenizer trained once for the module (each run would train its own)."""
    where = tmp_path_factory.mktemp("tok")
    return str(build_tokenizer(tiny_config(where).data, where).path)


def folder(root: Path) -> Path:
    return root / "run" / "checkpoint"


def tb_losses(root: Path) -> dict[int, float]:
    """The loss of every step in the run's TensorBoard events, a relaunch's replacing the
    earlier launch's at the steps both logged."""
    return tb_scalars(root / "tb" / "run")


@pytest.mark.slow
def test_bad_stretch_keeps_the_last_good_checkpoint_and_a_relaunch_resumes_it(tmp_path, tok,
                                                                                capsys):
    args = lambda *more: tiny_args(tmp_path, f"--data.tokenizer={tok}", *CKPT, *more)  # noqa: E731
    assert main(args()) == 0  # steps 1-4: step-4 is the one kept
    # lr = 1e30: step 5's update blows the weights up (finite), every later loss is NaN and
    # skipped; step 6 is saved while skipping, the guard stops at 7 and saves it.
    assert main(args("--training.steps=8", "--optimizer.lr=1e30",
                     "--checkpoint.optimizer_hparams_from=config",
                     "--metrics.max_consecutive_skips=2")) == 3
    said = capsys.readouterr()
    assert "resume will continue from step-4, the last checkpoint saved before updates were " \
           "skipped" in said.out + said.err
    assert complete_steps(folder(tmp_path)) == [4, 7]  # step-6 went, step-4 stayed
    assert read_marker(folder(tmp_path) / "step-4")["healthy"] is True
    stopped = read_marker(folder(tmp_path) / "step-7")
    assert stopped["healthy"] is False and "since step 6" in stopped["unhealthy"]
    # generate / evals / export of the run read the last good step, not the blown-up weights
    from torchllm.checkpoint.step import resolve_checkpoint

    assert resolve_checkpoint(folder(tmp_path)) == folder(tmp_path) / "step-4"
    assert resolve_checkpoint(folder(tmp_path) / "step-7") == folder(tmp_path) / "step-7"

    assert main(args("--training.steps=6")) == 0  # the original lr (the checkpoint's)
    said = capsys.readouterr()
    passed_over = [x for x in (said.out + said.err).splitlines() if "step-7" in x]
    assert len(passed_over) == 1 and "guard" in passed_over[0], said  # the step, and why
    assert f"resumed from {folder(tmp_path) / 'step-4'} (step 4)" in said.out + said.err
    losses = tb_losses(tmp_path)
    assert sorted(losses) == [1, 2, 3, 4, 5, 6] and all(math.isfinite(v) for v in losses.values())
    assert complete_steps(folder(tmp_path)) == [6]
    aside = [p for p in folder(tmp_path).iterdir() if p.name.startswith("abandoned-")]
    assert [p.name for p in aside[0].iterdir()] == ["step-7"]  # kept, out of the way


@pytest.mark.slow
def test_weights_only_final_save_is_passed_over_for_the_full_state(tmp_path, tok, capsys):
    common = (f"--data.tokenizer={tok}", "--job.run_name=run")
    assert main(tiny_args(tmp_path / "straight", *common, "--training.steps=6")) == 0
    export = (*common, *CKPT, "--checkpoint.last_save_model_only=true",
              "--checkpoint.export_dtype=bfloat16")
    run = tmp_path / "split"
    assert main(tiny_args(run, *export)) == 0  # step-2 full state, step-4 weights only (bf16)
    assert complete_steps(folder(run)) == [2, 4]  # retention kept the newest full state
    assert read_marker(folder(run) / "step-4")["weights_only"] is True
    capsys.readouterr()
    assert main(tiny_args(run, *export, "--training.steps=6")) == 0
    said = capsys.readouterr()
    passed_over = [x for x in (said.out + said.err).splitlines() if "step-4 (" in x]
    assert len(passed_over) == 1 and "weights only" in passed_over[0], said  # the step, and why
    assert f"resumed from {folder(run) / 'step-2'} (step 2)" in said.out + said.err
    # Steps 3-6 continue exactly as the straight run: same step count, batches and state.
    assert tb_losses(run) == tb_losses(tmp_path / "straight")
    assert complete_steps(folder(run)) == [4, 6]  # a new full-state step-4, the new export
    aside = [p for p in folder(run).iterdir() if p.name.startswith("abandoned-")]
    assert read_marker(aside[0] / "step-4")["weights_only"] is True  # never overwritten


@pytest.mark.slow
def test_only_weights_only_checkpoints_refuse_naming_initial_load_path(tmp_path, tok):
    args = (f"--data.tokenizer={tok}", *CKPT, "--checkpoint.interval=100", "--training.steps=1",
            "--checkpoint.last_save_model_only=true")
    assert main(tiny_args(tmp_path, *args)) == 0
    with raises_naming(ConfigError, "step-1", "weights only", "checkpoint.initial_load_path = "):
        Trainer(tiny_config(tmp_path, *args, "--training.steps=2"))


# --- a resume with other data -------------------------------------------------------------

@pytest.fixture(scope="module")
def shards(tmp_path_factory, tok) -> dict[str, Path]:
    """Two shard folders (two corpora: tiny Shakespeare's halves) and a run that trained 2
    steps on the first (checkpoint step-2)."""
    root = tmp_path_factory.mktemp("shards")
    text = shared_path("data", "tinyshakespeare.txt").read_text()
    out = {}
    quarter = len(text) // 4
    for name, part in (("a", text[:quarter]), ("b", text[2 * quarter:3 * quarter])):
        (root / f"{name}.txt").write_text(part)
        out[name] = root / name
        assert prepare_cli(["--dataset", f"local:{root / f'{name}.txt'}", "--tokenizer", tok,
                            "--out", str(out[name]), "--val-tokens", "2000"]) == 0
    out["run"] = root / "dump"
    assert main(tiny_args(out["run"], f"--data.dataset=shards:{out['a']}", *CKPT,
                          "--training.steps=2")) == 0
    return out


CHANGES = {
    "seq_len": (("--training.seq_len=16",), "training.seq_len 32 -> 16"),
    "seed": (("--job.seed=7",), "job.seed 42 -> 7"),
    "mixture": (("--data.sources=shards:{a}=1,shards:{b}=1",),
                "data.dataset 'shards:{a}' -> data.sources [shards:{a} x0.5, shards:{b} x0.5]"),
    "corpus": ((), "the tokens of shards:{a} changed (re-prepared shards"),
}


@pytest.mark.slow
@pytest.mark.parametrize("change", list(CHANGES))
def test_resume_with_changed_data_says_what_changed_and_restarts_or_refuses(
        shards, tmp_path, change, capsys):
    dump = tmp_path / "dump"
    shutil.copytree(shards["run"], dump)
    data = f"--data.dataset=shards:{shards['a']}"
    if change == "corpus":  # the run's shards: folder re-prepared from the other corpus
        shutil.move(shards["a"], tmp_path / "original")
        shutil.copytree(shards["b"], shards["a"])
    try:
        extra, said = CHANGES[change]
        extra = [x.format(a=shards["a"], b=shards["b"]) for x in extra]
        said = said.format(a=shards["a"], b=shards["b"])
        args = (data, *CKPT, "--training.steps=3", *extra)
        capsys.readouterr()
        # The default (checkpoint.on_data_change = 'error'): exit 2, one line naming the key.
        assert main(tiny_args(dump, *args)) == 2
        out = capsys.readouterr()
        line = [x for x in (out.out + out.err).splitlines() if "config error" in x]
        assert len(line) == 1 and said in line[0] and "checkpoint.on_data_change = 'restart'" \
            in line[0], out
        # 'restart': the counters continue, the data reads from its beginning in its new order.
        resumed = Trainer(tiny_config(dump, *args, "--checkpoint.on_data_change=restart"))
        try:  # (main's console handler is still on stderr)
            out = capsys.readouterr()
            assert_names(out.err, folder(dump) / "step-2", said)  # the checkpoint, what changed
            assert resumed.step == 2 and resumed.train_state.tokens_seen == 2 * 4 * 32
            fresh, _ = build_data(*data_args(resumed.cfg), resumed.tokenizer, 0, 1)
            first = next(iter(fresh))
            got = next(resumed.batches)
            assert all(torch.equal(got[k], first[k]) for k in first), "not the new data's start"
        finally:
            resumed.close()
    finally:
        if change == "corpus":
            shutil.rmtree(shards["a"])
            shutil.move(tmp_path / "original", shards["a"])
