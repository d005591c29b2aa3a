"""Validation loss against a hand computation, held-out batches, the in-training hooks, and the
same held-out windows and value whatever the parallel layout (1 process, FSDP2, DDP, EP, PP)."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from torchllm.config import ConfigError
from torchllm.eval.in_training import HeldOutBatches
from torchllm.eval.validation import validate
from torchllm.loss import IGNORE_INDEX
from torchllm.models.llama.args import LlamaArgs
from torchllm.models.llama.model import Transformer
from torchllm.config.paths import run_name
from torchllm.train import Trainer

from conftest import REPO, build_model, tiny_args, tiny_config
from builders.eval import write_tiny_jsonl

from messages import raises_naming


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

    events = EventAccumulator(str(tmp_path / "tb" / run_name(trainer.cfg.job)),
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
    with raises_naming(ConfigError, "validation.split = 'validation'", "hf:", "validation.dataset",
                       key="validation.split"):
        Trainer(tiny_config(tmp_path / "e", "--validation.enable",
                            "--validation.split=validation"))


@pytest.mark.parametrize("n, batch", [(7, 2), (12, 4), (1, 3)])
def test_held_out_windows_are_shared_out_whole_in_equal_full_batches(n, batch):
    """Ranks r of 1..3 together score exactly windows 0..n-1, each once, in the same number of
    full-size batches; the filler rows score nothing."""
    windows = [{"inputs": torch.full((4,), i), "targets": torch.full((4,), i),
                "positions": torch.arange(4)} for i in range(20)]
    for world in (1, 2, 3):
        shares = [list(HeldOutBatches(windows, n, batch, r, world)) for r in range(world)]
        assert len({len(s) for s in shares}) == 1  # every rank: the same number of batches
        assert all(b["inputs"].shape == (batch, 4) for s in shares for b in s)
        scored = [int(row[0]) for s in shares for b in s for row in b["targets"]
                  if (row != IGNORE_INDEX).any()]
        assert scored == list(range(n)), world
        fillers = sum(int((b["targets"] == IGNORE_INDEX).all(1).sum()) for s in shares for b in s)
        assert fillers == len(shares[0]) * batch * world - n


# The held-out set is the first validation.steps x global batch windows of the split, wherever
# it runs: 2 steps of global batch 4 on 1 process (2 x 2 accumulated) and on 2 gloo ranks.
VAL_STEPS, VAL_BATCHES, GLOBAL, SEQ = 2, 3, 4, 16
LAYOUT = (f"--training.steps={VAL_STEPS}", f"--training.seq_len={SEQ}",
          f"--training.global_batch_size={GLOBAL}", "--validation.enable",
          f"--validation.steps={VAL_BATCHES}", "--job.deterministic", "--job.run_name=val_layout",
          "--model.tie_embeddings=false", "--lr_scheduler.warmup_steps=1", "--optimizer.lr=3e-4")
MOE = ("--model.name=qwen3_moe", "--model.moe_aux_loss_coef=0")
LAYOUTS = {
    "fsdp2": ["--training.local_batch_size=2"],
    "ddp_accumulate": ["--parallelism.dp_mode=ddp", "--training.local_batch_size=1"],
    "pp2": ["--parallelism.pipeline_parallel_degree=2", "--training.local_batch_size=4"],
    "ep2": [*MOE, "--parallelism.expert_parallel_degree=2", "--training.local_batch_size=2"],
}


def one_process_validation(tmp, *extra) -> dict:
    """val/* after VAL_STEPS steps in one process, checked against a plain loop over the first
    VAL_BATCHES x GLOBAL windows of the held-out split."""
    trainer = Trainer(tiny_config(tmp, *LAYOUT, *extra))
    for _ in range(VAL_STEPS):
        trainer.train_step()
    got = trainer.evaluator.validation(VAL_STEPS)
    total, count = 0.0, 0
    trainer.model.eval()
    with torch.no_grad():
        for i in range(VAL_BATCHES * GLOBAL):
            window = trainer.val_loader.dataset[i]
            logits = trainer.model(window["inputs"][None])
            total += F.cross_entropy(logits[0].double(), window["targets"],
                                     reduction="sum").item()
            count += window["targets"].numel()
    trainer.close()
    assert got["val/tokens"] == count == VAL_BATCHES * GLOBAL * SEQ
    assert got["val/loss"] == pytest.approx(total / count, rel=1e-6)
    return got


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    """One process (dense, 2 x 2 accumulated; MoE, 4), then one launch of 2 gloo ranks running
    every layout (tests/parallel_worker.py, forked by builders.launch.fork_ranks)."""
    from builders.launch import fork_ranks, launch_failure

    tmp = tmp_path_factory.mktemp("val_layouts")  # the first run trains the shared tokenizer
    single = {"dense": one_process_validation(tmp, "--training.local_batch_size=2"),
              "moe": one_process_validation(tmp, *MOE, "--training.local_batch_size=4")}
    spec = {"runs": {name: tiny_args(tmp, *LAYOUT, *args) for name, args in LAYOUTS.items()},
            "steps": VAL_STEPS, "validate": list(LAYOUTS)}
    (tmp / "spec.json").write_text(json.dumps(spec))
    proc = fork_ranks(REPO / "tests" / "parallel_worker.py", 2, str(tmp / "spec.json"),
                      str(tmp / "out.json"), logs=tmp / "launch_logs")
    assert proc.returncode == 0, launch_failure(proc)
    return single, json.loads((tmp / "out.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_validation_is_the_same_on_every_layout(layouts, name):
    """fp32: the same held-out tokens and val/loss (rel 1e-5) on every rank of every layout as
    in one process; counted once per data-parallel rank (pp peers hold the same batch)."""
    single, ranks = layouts
    want = single["moe" if name == "ep2" else "dense"]
    for got in ranks[name]["val"]:
        assert got["val/tokens"] == want["val/tokens"], (name, got, want)
        assert got["val/loss"] == pytest.approx(want["val/loss"], rel=1e-5), (name, got, want)
