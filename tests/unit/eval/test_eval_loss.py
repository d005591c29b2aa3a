"""python -m torchllm.eval.loss: a checkpoint's loss on the windows in-training validation reads
(the run's held-out split, or any data source read whole), with perplexity and bits per byte."""

import copy
import json
import math

import pytest
import torch
import torch.nn.functional as F

from torchllm.data import build_data
from torchllm.eval.loading import load_for_inference
from torchllm.eval.loss import evaluate_loss, main
from torchllm.train import Trainer

from conftest import tiny_config
from builders.data import data_args, corpus_texts


@pytest.mark.slow
def test_checkpoint_loss_equals_in_training_validation_on_the_same_windows(tmp_path, capsys):
    text = tmp_path / "val.txt"
    text.write_text("\n".join(corpus_texts(60, seed=3)))
    trainer = Trainer(tiny_config(tmp_path, "--job.run_name=r", "--checkpoint.enable",
                                  "--validation.enable", "--validation.freq=4",
                                  f"--validation.dataset=local:{text}"))
    trainer.train()
    step, in_training = trainer.evaluator.last_val
    assert step == 4
    model, cfg, tok = load_for_inference(tmp_path / "r", "cpu")
    # The dedicated file, read whole: the numbers training logged for the same checkpoint.
    got = evaluate_loss(model, cfg, tok, torch.device("cpu"), data=f"local:{text}")
    assert got["loss"] == pytest.approx(in_training, rel=1e-6)
    assert got["perplexity"] == pytest.approx(math.exp(in_training), rel=1e-6)
    assert got["bits_per_byte"] == pytest.approx(
        got["loss"] * got["tokens"] / math.log(2) / got["bytes"], rel=1e-9)
    assert 0 < got["bytes"] <= len(text.read_bytes()) and got["tokens"] > 0
    # Without data: what the run validated on (its validation.dataset, the same budget).
    assert evaluate_loss(model, cfg, tok, torch.device("cpu"))["loss"] == pytest.approx(
        in_training, rel=1e-6)
    # The run's own data.dataset: its held-out split (validation.steps batches), against a
    # plain loop over the same batches, not validate(). (Training held nothing out of it: the
    # run validated on its validation.dataset.)
    held = evaluate_loss(model, cfg, tok, torch.device("cpu"), data=cfg.data.dataset, steps=3)
    own = copy.deepcopy(cfg)
    own.validation.dataset = ""
    val = build_data(*data_args(own), tok, 0, 1)[1]
    total, count = 0.0, 0
    with torch.no_grad():
        for _, batch in zip(range(3), val):
            logits = model(batch["inputs"]).float()
            total += F.cross_entropy(logits.flatten(0, 1), batch["targets"].flatten(),
                                     ignore_index=-100, reduction="sum").item()
            count += int((batch["targets"] != -100).sum())
    assert held["tokens"] == count and held["loss"] == pytest.approx(total / count, rel=1e-5)
    # The CLI prints them and writes JSON; a bad spec is one line, exit code 2.
    assert main(["--checkpoint", str(tmp_path / "r"), "--data", f"local:{text}", "--json",
                 str(tmp_path / "loss.json"), "--device", "cpu"]) == 0
    printed = capsys.readouterr().out
    assert f"loss {in_training:.4f} | perplexity " in printed and "bits per byte" in printed
    assert json.loads((tmp_path / "loss.json").read_text())["loss"] == pytest.approx(got["loss"])
    assert main(["--checkpoint", str(tmp_path / "r"), "--data", "local:/nope.txt"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "/nope.txt" in err[0]
