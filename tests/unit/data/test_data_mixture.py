"""Data mixtures: realized token fractions, per-source epochs, rank parity, exact resume, config."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from torchllm.config import ConfigError
from torchllm.data import build_data
from torchllm.data.mixture import MixtureBatches, source_schedule
from torchllm.metrics.mixture_log import MixtureLog

from conftest import tiny_config
from messages import assert_names, raises_naming
from builders.data import data_args, TOK, assert_batches_equal, take, write_jsonl

SEQ = 16
LETTERS = {"a": "abcdefghij", "b": "klmnopqrst", "c": "uvwxyz"}


def texts(kind: str, n: int, seed: int) -> list[str]:
    """Documents of one source: only its own letters, so every window shows where it came from."""
    rng = np.random.default_rng(seed)
    return ["".join(rng.choice(list(LETTERS[kind]), rng.integers(20, 60))) for _ in range(n)]


def origin(row: torch.Tensor) -> int:
    """Which source a window (inputs row) came from, read from its tokens alone."""
    chars = {chr(int(t) - 3) for t in row if int(t) > 2}
    found = [i for i, k in enumerate(LETTERS) if chars & set(LETTERS[k])]
    assert len(found) == 1, chars
    return found[0]


@pytest.fixture
def corpora(tmp_path):
    return {k: write_jsonl(tmp_path / f"{k}.jsonl", texts(k, n, seed))
            for (k, n, seed) in (("a", 200, 0), ("b", 25, 1), ("c", 60, 2))}


def mix_cfg(tmp_path, spec: str, *extra, batch=4):
    return tiny_config(tmp_path, f"--data.sources={spec}", f"--training.seq_len={SEQ}",
                       f"--training.local_batch_size={batch}", *extra)


def origins(batches) -> np.ndarray:
    return np.array([origin(row) for b in batches for row in b["inputs"]])


@pytest.mark.parametrize("weights", [(0.7, 0.3), (0.5, 0.3, 0.2), (0.98, 0.01, 0.01)])
def test_schedule_is_within_two_windows_of_target_on_every_stretch(weights):
    w = np.array(weights)
    schedule = np.tile(source_schedule(w), 2)  # across the period boundary too
    counts = np.zeros((len(schedule) + 1, len(w)))
    counts[1:][np.arange(len(schedule)), schedule] = 1
    counts = np.cumsum(counts, axis=0)
    for length in (1, 7, 100, 400, 2500):  # every stretch of this many consecutive slots
        got = counts[length:] - counts[:-length]
        assert np.abs(got - length * w).max() < 2, length


@pytest.mark.parametrize("weights", ["0.7,{b}=0.3", "0.5,{b}=0.3,{c}=0.2"])
def test_realized_fractions_within_one_percent_over_any_100_batches(tmp_path, corpora, weights):
    spec = f"local:{corpora['a']}=" + weights.format(b=f"local:{corpora['b']}",
                                                     c=f"local:{corpora['c']}")
    cfg = mix_cfg(tmp_path, spec)
    loader, _ = build_data(*data_args(cfg), TOK, 0, 1)
    batches = take(loader, 300)
    src = origins(batches).reshape(300, 4)
    target = np.array([s.weight for s in cfg.data.sources])
    target /= target.sum()
    per_batch = np.stack([(src == s).sum(axis=1) for s in range(len(target))], axis=1)
    run = np.concatenate([np.zeros((1, len(target))), np.cumsum(per_batch, axis=0)])
    fractions = (run[100:] - run[:-100]) / 400  # every 100 consecutive batches
    assert np.abs(fractions - target).max() <= 0.01
    # The TensorBoard numbers (computed from the schedule) equal what the batches contained.
    assert (loader.dataset.served(300 * 4) == run[-1]).all()


def test_each_source_has_its_own_epochs_and_wraps_with_a_log_line(tmp_path, corpora, caplog):
    cfg = mix_cfg(tmp_path, f"local:{corpora['a']}=0.5,local:{corpora['b']}=0.5",
                  "--data.val_fraction=0")
    ds = build_data(*data_args(cfg), TOK, 0, 1)[0].dataset
    small, big = (src.windows_per_epoch for src in ds.sources[::-1])
    assert small < big / 4
    with caplog.at_level("INFO"):
        batches = [ds.batch(n) for n in range(small // 2 + 2)]  # ~small windows of each source
    rows = [row for b in batches for row in b["inputs"]]
    a = [tuple(r.tolist()) for r in rows if origin(r) == 0]
    b = [tuple(r.tolist()) for r in rows if origin(r) == 1]
    stream_b = ds.sources[1].stream
    all_b = {tuple(stream_b.window(i, SEQ + 1)[0][:-1].tolist()) for i in range(small)}
    # Source b: its first `small` windows are each of its windows once (epoch 0), then epoch 1
    # starts over in another order; source a is still inside its first epoch (no repeats).
    assert len(b) > small and set(b[:small]) == all_b and len(set(b[:small])) == small
    assert b[small:] != b[: len(b) - small]
    assert len(set(a)) == len(a)
    assert_names(caplog.text, f"data source 1 (local:{corpora['b']})", "epoch 1")  # b wrapped


def test_ranks_concatenate_to_one_rank(tmp_path, corpora):
    spec = f"local:{corpora['a']}=0.6,local:{corpora['c']}=0.4"
    ranks = [build_data(*data_args(mix_cfg(tmp_path, spec, batch=2)), TOK, r, 2)[0].dataset for r in range(2)]
    single = build_data(*data_args(mix_cfg(tmp_path, spec, batch=4)), TOK, 0, 1)[0].dataset
    for n in range(40):
        parts = [ds.batch(n) for ds in ranks]
        joined = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
        assert_batches_equal([joined], [single.batch(n)])


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("dp", [1, 2])
def test_resume_is_exact(tmp_path, corpora, workers, dp):
    spec = f"local:{corpora['a']}=0.5,local:{corpora['b']}=0.3,local:{corpora['c']}=0.2"
    cfg = mix_cfg(tmp_path, spec, f"--data.num_workers={workers}", batch=2)
    for rank in range(dp):
        loader, _ = build_data(*data_args(cfg), TOK, rank, dp)
        assert isinstance(loader.dataset, MixtureBatches)
        it = iter(loader)
        for _ in range(20):  # past source b's first epoch (its wrap happens before and after)
            next(it)
        state = loader.state_dict()
        after = [next(it) for _ in range(12)]
        resumed, _ = build_data(*data_args(cfg), TOK, rank, dp)
        resumed.load_state_dict(state)
        assert_batches_equal(take(resumed, 12), after)


def test_bad_sources_are_config_errors(tmp_path, corpora):
    with raises_naming(ConfigError, "data.sources[1].weight = 0.0", "> 0", key="data.sources"):
        build_data(*data_args(mix_cfg(tmp_path, f"local:{corpora['a']}=1,local:{corpora['b']}=0")), TOK, 0, 1)
    with raises_naming(ConfigError, "data.sources[1] (hx:x)", "'hx:x'", "local:"):  # and the kinds
        build_data(*data_args(mix_cfg(tmp_path, f"local:{corpora['a']}=1,hx:x=1")), TOK, 0, 1)
    with pytest.raises(ConfigError, match=r"data.sources\[0\] \(local:/nope.txt\)"):
        build_data(*data_args(mix_cfg(tmp_path, "local:/nope.txt=1")), TOK, 0, 1)


def test_trainer_trains_on_a_mixture_and_logs_tokens_per_source(tmp_path, corpora):
    from torchllm.train import Trainer

    toml = tmp_path / "mix.toml"
    toml.write_text(f'[[data.sources]]\ndataset = "local:{corpora["a"]}"\nweight = 0.75\n\n'
                    f'[[data.sources]]\ndataset = "local:{corpora["c"]}"\nweight = 0.25\n')
    cfg = tiny_config(tmp_path, f"--job.config_file={toml}", "--training.seq_len=32",
                      "--training.global_batch_size=8", "--metrics.log_freq=2")
    trainer = Trainer(cfg)
    log = trainer.callback(MixtureLog)
    assert log is not None and trainer.grad_accum_steps == 2
    losses = trainer.train()
    assert len(losses) == 4 and all(np.isfinite(losses))
    assert log.batches == 8  # 4 steps x 2 micro-batches
    report = log.on_step_end(trainer.context, 6, {})  # 2 more micro-batches: 10 x 4 = 40 windows
    served = trainer.train_loader.dataset.served(40)
    assert report.scalars["data/source0/tokens"] == served[0] * 32 == 30 * 32
    assert report.scalars["data/source1/fraction"] == 0.25


def test_a_mixture_validates_each_source_on_its_own(tmp_path, corpora):
    """val/loss/<i>_<name>: each source's own held-out windows (validation.steps x global
    batch of them), against a plain loop over that source alone."""
    import torch.nn.functional as F

    from torchllm.train import Trainer

    args = ["--training.seq_len=32", "--training.global_batch_size=8", "--validation.enable",
            "--validation.steps=1", "--data.val_fraction=0.2"]
    cfg = tiny_config(tmp_path, f"--data.sources=local:{corpora['a']}=0.75,"
                      f"local:{corpora['c']}=0.25", *args, "--training.steps=1")
    trainer = Trainer(cfg)
    trainer.train()
    m = trainer.evaluator.validation(1)
    model = trainer.model.eval()
    for i, name in ((0, "a"), (1, "c")):
        alone = tiny_config(tmp_path, f"--data.dataset=local:{corpora[name]}", *args)
        windows = build_data(*data_args(alone), trainer.tokenizer, 0, 1)[1].dataset
        rows = [windows[j] for j in range(min(len(windows), 8))]
        with torch.no_grad():
            logits = model(torch.stack([r["inputs"] for r in rows]))
        targets = torch.stack([r["targets"] for r in rows])
        want = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-100)
        assert m[f"val/loss/{i}_{name}.jsonl"] == pytest.approx(want.item(), rel=1e-5)
    assert m["val/loss/0_a.jsonl"] != pytest.approx(m["val/loss/1_c.jsonl"], rel=1e-3)


def test_sources_config_tables_cli_and_round_trip(tmp_path):
    from torchllm.config import load_config, to_toml
    from torchllm.config.sections import DataSource

    toml = tmp_path / "m.toml"
    toml.write_text('[[data.sources]]\ndataset = "local:a.txt"\nweight = 7\n\n'
                    '[[data.sources]]\ndataset = "shards:/b"\nweight = 0.3\n')
    cfg = load_config([f"--job.config_file={toml}"])
    expected = [DataSource("local:a.txt", 7.0), DataSource("shards:/b", 0.3)]
    assert cfg.data.sources == expected
    (tmp_path / "written.toml").write_text(to_toml(cfg))  # the run's config.toml reads back
    assert load_config([f"--job.config_file={tmp_path / 'written.toml'}"]).data.sources == expected
    cli = load_config([f"--job.config_file={toml}", "--data.sources=local:x=y.txt=0.5,embedded=1"])
    assert cli.data.sources == [DataSource("local:x=y.txt", 0.5), DataSource("embedded", 1.0)]
    with raises_naming(ConfigError, "data.sources", "local:a.txt", "DATASET=WEIGHT"):
        load_config(["--data.sources=local:a.txt"])
    toml.write_text('[[data.sources]]\ndataset = "a"\nwieght = 1\n')
    with raises_naming(ConfigError, "m.toml", "data.sources", "'wieght'", "dataset, weight"):
        load_config([f"--job.config_file={toml}"])
    toml.write_text('[[data.sources]]\ndataset = "a"\nweight = "x"\n')
    with raises_naming(ConfigError, "m.toml", "'weight'", "float", "'x'"):
        load_config([f"--job.config_file={toml}"])


@pytest.mark.slow
def test_three_stage_lifecycle_with_the_shipped_configs(tmp_path):
    """Pre-train (the quick start: no chat tokens) -> the mid-training config (a mixture; its
    chat tokens grow the vocab at load) -> the SFT config (a local chat file instead of the
    Hub), each stage a new run that takes only the weights."""
    import json

    from conftest import REPO, shared_path
    from torchllm.config import load_config
    from torchllm.train import Trainer

    shared_path("data", "tinyshakespeare.txt")
    small = ["--training.steps=2", "--training.seq_len=32", "--training.local_batch_size=2",
             "--metrics.log_freq=1", f"--job.dump_folder={tmp_path}", "--job.print_config=false"]
    Trainer(load_config(small + ["--job.run_name=debug_model", "--checkpoint.enable=true",
                                 "--data.tokenizer_vocab_size=512",
                                 "--model.flavor=debug"])).train()
    tok = tmp_path / "debug_model" / "data" / "tokenizer_embedded_sp512.model"
    assert tok.is_file()
    mid = Trainer(load_config(small + [
        f"--job.config_file={REPO / 'train_configs' / 'llama3_debug_midtrain.toml'}",
        f"--checkpoint.initial_load_path={tmp_path / 'debug_model'}",  # its tokenizer too
        f"--data.sources=embedded=0.7,local:{shared_path('data', 'tinyshakespeare.txt')}=0.3"]))
    assert mid.step == 0  # weights only: a fresh step counter, optimizer and data order
    assert mid.cfg.data.tokenizer == str(tok)  # data.tokenizer = "from_initial_load"
    assert mid.model_args.vocab_size == 576  # 512 + 6 chat tokens, padded to 64
    mid.train()
    chat = tmp_path / "chat.jsonl"
    chat.write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": f"Count to {i}."},
        {"role": "assistant", "content": " ".join(str(k) for k in range(1, i + 1))}]}) + "\n"
        for i in range(1, 30)))
    sft = Trainer(load_config(small + [
        f"--job.config_file={REPO / 'train_configs' / 'llama3_debug_sft.toml'}",
        f"--data.dataset=chat:{chat}",
        f"--checkpoint.initial_load_path={tmp_path / 'debug_midtrain'}"]))
    assert sft.step == 0 and sft.model_args.vocab_size == mid.model_args.vocab_size
    assert all(torch.isfinite(torch.tensor(sft.train())))
