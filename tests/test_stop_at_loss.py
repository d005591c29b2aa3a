"""validation.stop_at_loss: the run ends after the first validation at or below the target, as
its last step would (final checkpoint, report), and the console says why."""

from __future__ import annotations

import os
import subprocess

import pytest

from conftest import REPO, tiny_args


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
    assert stops.target_reached == ("validation.stop_at_loss = 1.88 reached (validation loss "
                                    "1.8800 at step 6)")


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
    env = {**os.environ, "NGPU": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    args = tiny_args(tmp_path, "--training.steps=8", "--validation.enable=true",
                     "--validation.freq=2", "--validation.steps=2",
                     "--validation.stop_at_loss=1000", "--checkpoint.enable=true",
                     "--checkpoint.interval=100", "--metrics.report=true", "--job.run_name=r")
    proc = subprocess.run(["./run_train.sh", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "stopping at step 2: validation.stop_at_loss = 1000.0 reached (validation loss" in out
    assert "step     3/8" not in out and "step 3/8" not in out, out[-3000:]
    run = tmp_path / "r"
    saved = sorted(p.name for p in (run / "checkpoint").glob("step-*"))
    assert saved == ["step-2"], saved
    assert (run / "checkpoint" / "step-2" / "COMPLETE").is_file()
    assert (run / "report" / "report.md").is_file()
