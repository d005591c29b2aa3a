"""benchmarks/bench_time_to_loss.py: torchllm's "same recipe" contender is nanoGPT's recipe as
the reference loop runs it (same model size, schedule within one step's offset, optimizer, split),
the benchmark runs end to end (three contenders, table and JSON) on a shortened recipe, the
nanogpt contender is skipped with its reason without --nanogpt, and with a checkout it runs
train.py with the README's command line on data its own prepare.py wrote, timed to its lines."""

from __future__ import annotations

import json

import pytest

from conftest import REPO, shared_path
from builders.bench import benchmark_script
from messages import assert_names

pytest.importorskip("transformers")  # the reference loop's model (imported here: it sets env)


def shakespeare():
    path = shared_path("data", "tinyshakespeare.txt")  # skips with a reason when absent
    return path


def shakespeare_head(tmp_path):
    """Its first 50 kB: a shorter held-out 10% (5 kB, ~76 windows), and each torchllm process
    encodes a twentieth of the text (all of it: ~5 CPU-s)."""
    text = tmp_path / "shakespeare_head.txt"
    text.write_text(shakespeare().read_text()[:50_000])
    return text


def test_same_recipe_is_the_reference_model_schedule_and_split(tmp_path):
    from torchllm.config import load_config
    from torchllm.optim.lr_schedule import lr_factor
    from torchllm.train import Trainer

    bench = benchmark_script("bench_time_to_loss")
    text = shakespeare_head(tmp_path)
    r = bench.RECIPE
    cfg = load_config([*bench.same_recipe_args(text), f"--job.dump_folder={tmp_path}",
                       "--job.run_name=same", "--metrics.enable_tensorboard=false"])
    trainer = Trainer(cfg)
    try:
        assert trainer.tokenizer.vocab_size == 258 and trainer.model_args.vocab_size == 258
        ours = sum(p.numel() for p in trainer.model.parameters())
        reference = sum(p.numel() for p in bench.reference_model(258).parameters())
        assert ours == reference  # GPT-2 4 x 128, 64 positions, biases, tied output
        group = trainer.optimizer.param_groups[0]
        assert (group["betas"], trainer.cfg.training.max_norm) == ((r["beta1"], r["beta2"]), 1.0)
        assert (trainer.global_batch, cfg.training.seq_len) == (r["batch"], r["block"])
        # nanoGPT's iteration it is torchllm's step it + 1 (1-based): one step of warmup apart.
        for step in range(1, r["steps"] + 1):
            ours = r["lr"] * lr_factor(step, r["steps"], cfg.lr_scheduler.warmup_steps,
                                       cfg.lr_scheduler.decay_type, cfg.lr_scheduler.min_lr_ratio)
            assert ours == pytest.approx(bench.reference_lr(step - 1), abs=r["lr"] / 100), step
        # Validation windows (65 tokens, 64 targets each) cover the text's last 10% as nanoGPT
        # splits it, all but less than one window (and the document's EOS) of it.
        n = len(text.read_text())
        windows = sum(b["targets"].shape[0] for b in trainer.val_loader)
        assert 0 <= (n - int(n * 0.9)) - windows * 65 < 65 + 2, (windows, n)
    finally:
        trainer.close()


@pytest.mark.slow
def test_the_benchmark_runs_its_three_contenders_and_writes_the_table(tmp_path, monkeypatch,
                                                                    capsys):
    text = shakespeare_head(tmp_path)
    out_json, out_md = tmp_path / "t.json", tmp_path / "t.md"
    # main() here (not `python bench_time_to_loss.py`: ~4 CPU-s of imports); each contender is
    # still the process the benchmark launches (a failed one: SystemExit with its output's tail).
    monkeypatch.chdir(REPO)
    assert benchmark_script("bench_time_to_loss").main([
        "--steps", "4", "--rounds", "1", "--target", "10", "--text", str(text),
        "--json", str(out_json), "--md", str(out_md)]) == 0
    stdout = capsys.readouterr().out
    result = json.loads(out_json.read_text())
    rows = {row["contender"]: row for row in result["rows"]}
    assert set(rows) == {"reference", "same", "speedrun"}
    assert list(result["skipped"]) == ["nanogpt"]  # why: the option to pass, and what it takes
    assert_names(result["skipped"]["nanogpt"], "--nanogpt", "github.com/karpathy/nanoGPT")
    (row,) = [ln for ln in out_md.read_text().splitlines() if ln.startswith("| nanogpt |")]
    assert_names(row, "skipped", "--nanogpt")  # the table's row for it says so
    for name, row in rows.items():
        (curve,) = row["curves"]
        assert curve and curve[-1][1] == 4, (name, curve)  # validated at the (shortened) end
        assert 0 < row["time_to_target_s"][0] <= row["wall_s"][0]
        assert 1.0 < row["final_val"][0] < 6.0  # a loss in nats over ~65-258 symbols
    assert result["baseline"] == "reference"
    assert rows["reference"]["vs_baseline"] == pytest.approx(1.0)
    assert "| speedrun |" in out_md.read_text() and "| speedrun |" in stdout


# A stand-in for nanoGPT's files: prepare.py must find input.txt (else it would download) and
# writes what train.py reads; train.py records its command line and prints nanoGPT's lines.
FAKE_PREPARE = """
import os
here = os.path.dirname(__file__)
text = open(os.path.join(here, 'input.txt')).read()
open(os.path.join(here, 'train.bin'), 'w').write(str(len(text)))
"""
FAKE_TRAIN = """
import os, sys, time
n = open(os.path.join('data', 'shakespeare_char', 'train.bin')).read()
open(os.environ['FAKE_ARGV'], 'w').write(' '.join(sys.argv[1:]) + ' ' + n)
print('tokens per iteration will be: 768')
for step, val in ((0, 4.1649), (2, 2.5), (4, 1.87)):
    time.sleep(0.2)
    print(f'step {step}: train loss {val + 0.01:.4f}, val loss {val:.4f}')
    print(f'iter {step}: loss {val:.4f}, time 50.00ms, mfu 0.00%')
"""


def test_nanogpt_contender_runs_its_train_py_on_its_prepared_data(tmp_path, monkeypatch):
    checkout = tmp_path / "nanoGPT"
    bench = benchmark_script("bench_time_to_loss")
    from benchlib import nanogpt
    for f in nanogpt.NANOGPT_FILES:
        (checkout / f).parent.mkdir(parents=True, exist_ok=True)
        (checkout / f).write_text("")
    assert bench.nanogpt_missing(checkout) is None
    (checkout / "data/shakespeare_char/prepare.py").write_text(FAKE_PREPARE)
    (checkout / "train.py").write_text(FAKE_TRAIN)
    text = tmp_path / "text.txt"
    text.write_text("First Citizen:\nBefore we proceed any further, hear me speak.\n")
    out_json, argv = tmp_path / "t.json", tmp_path / "argv.txt"
    monkeypatch.chdir(REPO)
    monkeypatch.setenv("FAKE_ARGV", str(argv))  # (train.py runs in a process of its own)
    assert bench.main(["--contenders", "nanogpt", "--rounds", "1", "--text", str(text),
                       "--nanogpt", str(checkout), "--json", str(out_json),
                       "--md", str(tmp_path / "t.md")]) == 0
    recorded = argv.read_text()
    assert recorded.startswith(
        "config/train_shakespeare_char.py --device=cpu --compile=False --eval_iters=20 "
        "--log_interval=1 --block_size=64 --batch_size=12 --n_layer=4 --n_head=4 --n_embd=128 "
        "--max_iters=2000 --lr_decay_iters=2000 --dropout=0.0 --out_dir="), recorded
    assert recorded.endswith(f" {len(text.read_text())}")  # prepare.py read our text
    assert not (checkout / "data/shakespeare_char/input.txt").exists()  # the checkout untouched
    (row,) = json.loads(out_json.read_text())["rows"]
    assert [(step, loss) for _, step, loss in row["curves"][0]] == [(0, 4.1649), (2, 2.5),
                                                                    (4, 1.87)]
    times = [t for t, _, _ in row["curves"][0]]
    assert 0 < times[0] < times[1] < times[2] <= row["wall_s"][0]
    assert times[2] - times[0] >= 0.35  # timed as each line arrived, not at the end
    assert row["time_to_target_s"] == [times[2]] and row["vs_baseline"] == pytest.approx(1.0)
    assert row["vs_baseline_by_round"] == [pytest.approx(1.0)]


def test_nanogpt_missing_says_why(tmp_path):
    bench = benchmark_script("bench_time_to_loss")
    from benchlib import nanogpt  # on sys.path once the benchmark is loaded
    assert_names(bench.nanogpt_missing(None), "--nanogpt")
    assert_names(bench.nanogpt_missing(tmp_path), f"--nanogpt {tmp_path}", *nanogpt.NANOGPT_FILES)
    assert nanogpt.nanogpt_line("step 250: train loss 1.9637, val loss 2.0700\n") == (250, 2.07)
    assert nanogpt.nanogpt_line("iter 250: loss 1.9637, time 50.00ms, mfu 0.00%") is None
    assert bench.torchllm_line("[rank0]:20:14:53 validation step 600: loss 1.8755 | perplexity "
                               "6.52 | 110,000 tokens | 3.1s") == (600, 1.8755)
