"""LoRA on conversations from a base without chat tokens (lora.train_new_tokens): the rows of the
tokens the chat template adds train (PEFT's trainable_token_indices), every other row and weight
stays bit-identical, the run learns to end its replies, and `hf export --adapter` writes them so
that peft loads the adapter, on its own base folder and on the base run's export resized."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from torchllm.checkpoint import open_checkpoint
from torchllm.config import load_config
from torchllm.models.lora import is_adapter_key
from torchllm.train import Trainer

from conftest import REPO, tiny_args
from builders.chat import write_chat
from builders.models import peft_model

CONFIG = "train_configs/llama3_debug_sft_lora.toml"
STEPS = 12

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A plain base run (no chat tokens), then the shipped LoRA config on chat data from it:
    default (new rows train) and --lora.train_new_tokens=false (the rows stay frozen)."""
    tmp = tmp_path_factory.mktemp("lora_tokens")
    Trainer(load_config(tiny_args(tmp, "--job.run_name=base", "--data.dataset=embedded",
                                  "--training.steps=2", "--checkpoint.enable"))).train()
    data = write_chat(tmp / "sft.jsonl", [
        [{"role": "user", "content": f"Name a {w}."}, {"role": "assistant", "content": a}]
        for w, a in (("fruit", "An apple."), ("color", "Blue."), ("tool", "A hammer."))] * 4)
    out = {"tmp": tmp}
    for name, extra in (("rows", ()), ("frozen", ("--lora.train_new_tokens=false",))):
        trainer = Trainer(load_config(tiny_args(
            tmp, f"--job.config_file={REPO / CONFIG}", f"--job.run_name={name}",
            f"--checkpoint.initial_load_path={tmp / 'base'}", "--optimizer.lr=1e-2",
            "--lr_scheduler.warmup_steps=1", f"--data.dataset=chat:{data}",
            "--data.val_fraction=0", f"--training.steps={STEPS}",
            f"--checkpoint.interval={STEPS}", *extra)))
        losses = trainer.train()
        out[name] = (trainer, losses)
    return out


def end_of_turn_hits(trainer) -> tuple[int, int]:
    """(positions where the model's argmax is the reply's <|assistant_end|>, such positions)."""
    end = trainer.tokenizer.added["<|assistant_end|>"]
    batch = trainer.train_loader.dataset.batch(0)
    where = batch["targets"] == end
    with torch.no_grad():
        trainer.model.eval()
        logits = trainer.model(batch["inputs"], positions=batch.get("positions"),
                               doc_ids=batch.get("doc_ids"))
    return int((logits.argmax(-1)[where] == end).sum()), int(where.sum())


def test_new_token_rows_train_and_the_run_learns_to_end_its_replies(runs):
    rows, losses = runs["rows"]
    frozen, frozen_losses = runs["frozen"]
    trained = {n for n, p in rows.model.named_parameters() if p.requires_grad}
    assert {n for n in trained if ".lora_" not in n} == {"tok_embeddings.token_delta",
                                                        "output.token_delta"}
    assert not any(".lora_" not in n for n, p in frozen.model.named_parameters()
                   if p.requires_grad)
    assert losses[0] == pytest.approx(frozen_losses[0], rel=1e-6)  # the same start
    assert losses[-1] < 0.5 * frozen_losses[-1], (losses, frozen_losses)
    hits, total = end_of_turn_hits(rows)
    assert total > 0 and hits == total
    assert end_of_turn_hits(frozen)[0] < total  # frozen rows: the reply does not end


def test_only_the_added_rows_change_and_every_other_weight_is_bit_identical(runs):
    tmp = runs["tmp"]
    base = open_checkpoint(tmp / "base").weights()
    tuned = open_checkpoint(tmp / "rows").weights()
    frozen = open_checkpoint(tmp / "frozen").weights()
    plain = {k for k in tuned if not is_adapter_key(k)}
    assert plain == base.keys()
    for key in plain:  # the tables grew (same rows in both runs), nothing else moved
        assert torch.equal(tuned[key], frozen[key]), key
        if key not in ("tok_embeddings.weight", "output.weight"):
            assert torch.equal(tuned[key], base[key]), key
    vocab = runs["rows"][0].tokenizer.vocab_size
    moved = {}
    for key in ("tok_embeddings.token_delta", "output.token_delta"):
        assert tuned[key].shape == (6, tuned["tok_embeddings.weight"].shape[1])
        moved[key] = int((tuned[key].abs().amax(1) > 0).sum())
    # The head's rows all train (the softmax reaches every id); the embedding's those the
    # conversations read (no system turn here).
    assert moved["output.token_delta"] == 6 and moved["tok_embeddings.token_delta"] >= 3
    assert base["tok_embeddings.weight"].shape[0] < vocab


def test_adapter_export_loads_in_peft_on_its_base_and_on_the_base_run_resized(runs):
    """`hf export --adapter`: trainable_token_indices in adapter_config.json; peft on OUT/base
    and on the base run's own export (fewer rows: resized as docs/lora.md says) gives
    torchllm's logits; the merged export too; the folder moves (relative base path)."""
    peft = pytest.importorskip("peft")
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoModelForCausalLM

    from torchllm.hf.cli import main as hf_main

    tmp = runs["tmp"]
    run, adapter, merged, original = (tmp / n for n in ("rows", "adapter", "merged", "base_hf"))
    for args in (["--checkpoint", str(run), "--out", str(adapter), "--adapter"],
                 ["--checkpoint", str(run), "--out", str(merged)],
                 ["--checkpoint", str(tmp / "base"), "--out", str(original)]):
        assert hf_main(["export", *args]) == 0
    config = json.loads((adapter / "adapter_config.json").read_text())
    vocab = runs["rows"][0].tokenizer.vocab_size
    ids = list(range(vocab - 6, vocab))
    assert config["trainable_token_indices"] == {"embed_tokens": ids, "lm_head": ids}
    assert config["base_model_name_or_path"] == "base"
    tokens = torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(0))
    tokens[:, -6:] = torch.tensor(ids)  # the added tokens are read too
    with torch.no_grad():
        ours = torchllm_logits_of(run, tokens)
        on_base = peft_model(adapter / "base", adapter)(tokens).logits
        small = AutoModelForCausalLM.from_pretrained(original, dtype=torch.float32)
        assert small.get_input_embeddings().weight.shape[0] < vocab
        small.resize_token_embeddings(vocab)
        on_resized = peft.PeftModel.from_pretrained(small, adapter).eval()(tokens).logits
        as_merged = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32)(
            tokens).logits
    for theirs in (on_base, on_resized, as_merged):
        assert (ours - theirs).abs().max() < 1e-5
    moved = tmp / "elsewhere" / "adapter"
    shutil.copytree(adapter, moved)
    shutil.rmtree(adapter)
    cwd = os.getcwd()
    os.chdir(moved)
    try:
        with torch.no_grad():
            auto = AutoPeftModelForCausalLM.from_pretrained(str(moved), dtype=torch.float32)
            assert (ours - auto.eval()(tokens).logits).abs().max() < 1e-5
    finally:
        os.chdir(cwd)


def torchllm_logits_of(run, tokens: torch.Tensor) -> torch.Tensor:
    from torchllm.eval.loading import load_for_inference

    model, _, tok = load_for_inference(run, "cpu")
    return model(tokens)[..., : tok.vocab_size]
