"""benchmarks/bench_time_to_loss.py: torchllm's "same recipe" contender is nanoGPT's recipe as
the reference loop runs it (same model size, schedule within one step's offset, optimizer, split),
and the benchmark runs end to end (three contenders, table and JSON) on a shortened recipe."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import REPO, shared_path
from test_bench import benchmark_script

pytest.importorskip("transformers")  # the reference loop's model (imported here: it sets env)


def shakespeare():
    path = shared_path("data", "tinyshakespeare.txt")  # skips with a reason when absent
    return path


def test_same_recipe_is_the_reference_model_schedule_and_split(tmp_path):
    from torchllm.config import load_config
    from torchllm.optim.lr_schedule import lr_factor
    from torchllm.train import Trainer

    bench = benchmark_script("bench_time_to_loss")
    text = shakespeare()
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
def test_the_benchmark_runs_its_three_contenders_and_writes_the_table(tmp_path):
    text = tmp_path / "shakespeare_head.txt"  # its first 200 kB: a shorter held-out 10%
    text.write_text(shakespeare().read_text()[:200_000])
    out_json, out_md = tmp_path / "t.json", tmp_path / "t.md"
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "bench_time_to_loss.py"), "--steps", "4",
         "--rounds", "1", "--target", "10", "--text", str(text), "--json", str(out_json),
         "--md", str(out_md)], cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out_json.read_text())
    rows = {row["contender"]: row for row in result["rows"]}
    assert set(rows) == {"reference", "same", "speedrun"}
    for name, row in rows.items():
        (curve,) = row["curves"]
        assert curve and curve[-1][1] == 4, (name, curve)  # validated at the (shortened) end
        assert 0 < row["time_to_target_s"][0] <= row["wall_s"][0]
        assert 1.0 < row["final_val"][0] < 6.0  # a loss in nats over ~65-258 symbols
    assert rows["reference"]["vs_reference"] == pytest.approx(1.0)
    assert "| speedrun |" in out_md.read_text() and "| speedrun |" in proc.stdout
