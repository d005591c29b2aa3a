"""validation.stop_at_loss: the run ends after the first validation at or below the target, as
its last step would (final checkpoint, report), and the console says why."""

from __future__ import annotations

import re

import pytest

from cli import run_train
from conftest import tiny_args


def test_stop_conditions_take_the_first_validation_at_or_below_the_target():
    import torch

    from torchllm.config import load_config
    from torchllm.run.stopping import StopConditions

    stops = StopConditions(load_config([]).training, torch.device("cpu"), 0.0)
    stops.target_loss(2, 1.9, 0.0)  # 0 = off
    stops.target_loss(4, 1.8801, 1.88)  # above
    assert stops.target_reached is None
    stops.target_loss(6, 1.88, 1.88)  # at: reached
    stops.target_loss(8, 1.5, 1.88)  # a later one does not replace the first
    reason = stops.target_reached  # the key and target, the loss and the step that reached it
    assert "validation.stop_at_loss = 1.88" in reason and "1.8800" in reason, reason
    assert re.search(r"step 6\b", reason) and "1.5" not in reason, reason


def test_stop_at_loss_needs_validation_and_a_non_negative_value():
    from torchllm.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"validation.stop_at_loss = 1.5 .*validation.enable"):
        load_config(["--validation.stop_at_loss=1.5"])
    with pytest.raises(ConfigError, match=r"validation.stop_at_loss = -1.0"):
        load_config(["--validation.enable=true", "--validation.stop_at_loss=-1"])


@pytest.mark.slow
def test_run_train_sh_stops_at_the_target_with_a_final_checkpoint_and_report(tmp_path):
    # Validation every 2 steps of 8; any loss is below 1000: the first validation (step 2) ends
    # the run. The checkpoint interval (100) would save nothing before step 8: the step-2
    # checkpoint is the final save of a run that is done.
    args = tiny_args(tmp_path, "--training.steps=8", "--validation.enable=true",
                     "--validation.freq=2", "--validation.steps=2",
                     "--validation.stop_at_loss=1000", "--checkpoint.enable=true",
                     "--checkpoint.interval=100", "--metrics.report=true", "--job.run_name=r")
    proc = run_train(*args)
    out = proc.out
    assert proc.returncode == 0, out[-4000:]
    lines = [x for x in out.splitlines() if "stopping at step" in x]  # step, key, value
    line = lines[0] if lines else out[-3000:]
    assert "step 2:" in line and "validation.stop_at_loss = 1000.0" in line, line
    assert "step     3/8" not in out and "step 3/8" not in out, out[-3000:]
    run = tmp_path / "r"
    saved = sorted(p.name for p in (run / "checkpoint").glob("step-*"))
    assert saved == ["step-2"], saved
    assert (run / "checkpoint" / "step-2" / "COMPLETE").is_file()
    assert (run / "report" / "report.md").is_file()
