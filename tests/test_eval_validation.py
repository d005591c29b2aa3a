"""Validation loss against a hand computation, held-out batches, and the in-training hooks."""

from __future__ import annotations

import math

import pytest
import torch

from torchllm.config import ConfigError
from torchllm.eval.validation import validate
from torchllm.loss import IGNORE_INDEX
from torchllm.models.llama.args import LlamaArgs
from torchllm.models.llama.model import Transformer
from torchllm.train import Trainer

from conftest import build_model, tiny_config
from test_eval_hellaswag import write_tiny_jsonl


def tiny_model():
    return build_model(Transformer, LlamaArgs(dim=32, n_layers=1, n_heads=2, vocab_size=64,
                                              max_seq_len=16))


def test_validate_is_the_token_weighted_mean_in_eval_mode_without_grad():
    model = tiny_model()
    g = torch.Generator().manual_seed(0)
    batches = [{"inputs": torch.randint(0, 64, (2, 16), generator=g),
                "targets": torch.randint(0, 64, (2, 16), generator=g)} for _ in range(3)]
    batches[1]["targets"][0, :10] = IGNORE_INDEX  # padding counts for nothing
    modes = []
    model.register_forward_pre_hook(
        lambda m, _: modes.append((m.training, torch.is_grad_enabled())))

    m = validate(model, batches, steps=2, device=torch.device("cpu"))
    assert modes == [(False, False)] * 2  # only `steps` batches, eval mode, no autograd
    assert model.training  # restored
    assert all(p.grad is None for p in model.parameters())
    # Oracle: per-token negative log-likelihoods in float64, pooled over both batches.
    nll = []
    with torch.no_grad():
        for b in batches[:2]:
            logp = model(b["inputs"]).double().log_softmax(-1)
            for (i, j), t in zip(torch.cartesian_prod(torch.arange(2), torch.arange(16)).tolist(),
                                 b["targets"].flatten().tolist()):
                if t != IGNORE_INDEX:
                    nll.append(-logp[i, j, t].item())
    assert m["val/tokens"] == len(nll) == 54
    assert m["val/loss"] == pytest.approx(sum(nll) / len(nll), rel=1e-5)
    assert m["val/perplexity"] == pytest.approx(math.exp(m["val/loss"]))


def test_trainer_runs_every_hook_and_keeps_the_best_validation_loss(tmp_path):
    data = write_tiny_jsonl(tmp_path / "hs.jsonl")
    trainer = Trainer(tiny_config(
        tmp_path, "--training.steps=4", "--validation.enable", "--validation.freq=2",
        "--validation.steps=2", "--eval.sample_freq=3", "--eval.max_new_tokens=4",
        "--eval.hellaswag_freq=4", f"--eval.hellaswag_data={data}", "--eval.hellaswag_limit=3",
        "--model.max_seq_len=64",
    ))
    assert trainer.train_state.best_val_loss == math.inf
    reports = {}
    after_step = trainer.evaluator.after_step
    trainer.evaluator.after_step = lambda step, last: reports.setdefault(
        step, after_step(step, last))
    trainer.train()
    assert sorted(s for s, r in reports.items() if "val/loss" in r.scalars) == [2, 4]
    assert [s for s, r in reports.items() if r.texts] == [3]
    assert reports[3].texts["samples/0"].startswith("**The meaning of life is**")
    assert reports[4].scalars["hellaswag/acc"] in (0, 1 / 3, 2 / 3, 1)
    assert trainer.train_state.best_val_loss == min(reports[s].scalars["val/loss"] for s in (2, 4))
    # Evaluation results reach TensorBoard next to the training scalars.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tb" / trainer.run_name(trainer.cfg)),
                              size_guidance={"tensors": 0, "scalars": 0})
    events.Reload()
    val = events.Scalars("val/loss")
    assert [e.step for e in val] == [2, 4]
    assert [e.value for e in val] == pytest.approx([reports[s].scalars["val/loss"] for s in (2, 4)])
    assert "samples/0/text_summary" in events.Tags()["tensors"]
    # The same batches every time: validating again right away reproduces the step-4 loss.
    assert trainer.evaluator.validation(4)["val/loss"] == pytest.approx(
        reports[4].scalars["val/loss"], rel=1e-6)


@pytest.mark.parametrize("flags, key", [
    (["--validation.enable", "--data.val_fraction=0"], "validation.enable"),
    (["--validation.enable", "--validation.dataset=nope"], "validation.dataset = 'nope'"),
    (["--eval.hellaswag_freq=2", "--eval.hellaswag_data=/no/such.jsonl"], "eval.hellaswag_data"),
])
def test_bad_evaluation_config_fails_at_start(tmp_path, flags, key):
    with pytest.raises(ConfigError, match=key):
        Trainer(tiny_config(tmp_path, *flags))


def test_eval_keys_are_validated(tmp_path):
    for flag, key in (("--eval.top_p=0", "eval.top_p"),
                      ("--eval.temperature=-1", "eval.temperature"),
                      ("--validation.freq=0", "validation.freq"),
                      ("--eval.hellaswag_limit=0", "eval.hellaswag_limit")):
        with pytest.raises(ConfigError, match=key):
            tiny_config(tmp_path, flag)


def test_validation_split_reads_that_hugging_face_split(tmp_path):
    """validation.split on a Hub-style folder (train/validation files) validates on its split."""
    import json

    folder = tmp_path / "hub_like"
    folder.mkdir()
    for split, word in (("train", "apple"), ("validation", "zebra")):
        rows = [{"text": f"{word} number {i} " * 20} for i in range(12)]
        (folder / f"{split}.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    cfg = tiny_config(tmp_path, f"--data.dataset=hf:{folder}", "--data.val_documents=4",
                      "--data.tokenizer_vocab_size=300", "--validation.enable",
                      "--validation.split=validation")
    trainer = Trainer(cfg)
    text = "".join(trainer.tokenizer.decode(b["inputs"].flatten().tolist())
                   for b in trainer.evaluator.val_batches)
    assert "zebra" in text and "apple" not in text
    held_out = "".join(trainer.tokenizer.decode(b["inputs"].flatten().tolist())
                       for b in trainer.val_loader)
    assert "apple" in held_out  # without the split key, validation is held out of training
    with pytest.raises(ConfigError, match="validation.split = 'validation' applies to Hugging"):
        Trainer(tiny_config(tmp_path / "e", "--validation.enable",
                            "--validation.split=validation"))
