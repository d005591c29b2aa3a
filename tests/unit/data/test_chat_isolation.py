"""Packed conversations are independent: chat data trains with document masking and positions
restarted per conversation (model.attn_mask_type / restart_positions_per_document unset =
block_causal + restart for chat: sources), so a packed window's loss is each conversation's loss
scored alone. Oracles: the same model on each conversation alone (torchllm), and transformers on
the Hugging Face export of a `./run_train.sh` run of the shipped SFT config."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
import torch
import torch.nn.functional as F

from torchllm import models
from torchllm.config import ConfigError
from torchllm.data import build_data, build_tokenizer
from torchllm.models.attention import TokenLayout

from cli import run_train
from conftest import REPO, tiny_args, tiny_config
from builders.data import data_args


def write_convs(path, n: int = 24):
    """Conversations of varied length: some with a system turn, some multi-turn."""
    rows = []
    for i in range(n):
        msgs = [{"role": "system", "content": "Be brief."}] if i % 3 == 0 else []
        for t in range(1 + i % 2):
            msgs += [{"role": "user", "content": f"Q{i}.{t}: add {i} and {t}?"},
                     {"role": "assistant", "content": f"{i + t}, that is {i}+{t}."}]
        rows.append(json.dumps({"messages": msgs}))
    path.write_text("\n".join(rows) + "\n")
    return path


def segments(positions: torch.Tensor) -> list[tuple[int, int]]:
    """(start, end) of each document of a window (a new one where the position is 0)."""
    starts = [int(i) for i in torch.nonzero(positions == 0)] + [len(positions)]
    return list(zip(starts[:-1], starts[1:]))


def ce(logits, targets):
    return F.cross_entropy(logits.float().flatten(0, -2), targets.flatten(), reduction="none",
                           ignore_index=-100).view(targets.shape)


def test_packed_conversations_train_as_if_each_were_alone(tmp_path):
    data = write_convs(tmp_path / "chat.jsonl")
    args = (f"--data.dataset=chat:{data}", "--data.tokenizer=bytes", "--training.seq_len=160",
            "--data.val_fraction=0", "--training.local_batch_size=2")
    cfg = tiny_config(tmp_path, *args)
    tok = build_tokenizer(cfg.data, tmp_path / "data")
    batch = next(iter(build_data(*data_args(cfg), tok, 0, 1)[0]))
    model_args = models.model_args(cfg.model, cfg.training, cfg.data, tok.vocab_size)
    assert (model_args.attn_mask_type, model_args.restart_positions_per_document) == (
        "block_causal", True)  # chat data: the unset keys isolate the conversations
    torch.manual_seed(0)
    model = models.get(cfg.model.name).build(model_args)
    model.init_weights()
    model.eval()

    def packed(inputs, positions):
        return ce(model(inputs, layout=TokenLayout.from_positions(positions)), batch["targets"])

    def alone(inputs):  # no layout: one document, positions from 0
        return model(inputs[None])[0]

    with torch.no_grad():
        ours, theirs = _per_target(batch, packed, alone)
        assert torch.allclose(ours, theirs, atol=1e-5), (ours - theirs).abs().max()
        # The old recipe (causal, positions running on over the window) fails this oracle.
        model.args = dataclasses.replace(model.args, attn_mask_type="causal",
                                         restart_positions_per_document=False)
        old = packed(batch["inputs"], batch["positions"])[batch["targets"] != -100]
        assert (old - theirs).abs().max() > 1e-2

    # Asking for cross-conversation attention with packing is a one-line error naming the key.
    for flag, key in (("--model.attn_mask_type=causal", "model.attn_mask_type = 'causal'"),
                      ("--model.restart_positions_per_document=false",
                       "model.restart_positions_per_document = false")):
        bad = tiny_config(tmp_path, *args, flag)
        with pytest.raises(ConfigError, match="data.chat_packing = 'pad'") as e:
            build_data(*data_args(bad), tok, 0, 1)
        assert key in str(e.value) and "\n" not in str(e.value)
    # One conversation per window is independent under plain causal attention too.
    build_data(*data_args(tiny_config(tmp_path, *args, "--model.attn_mask_type=causal",
                           "--data.chat_packing=pad")), tok, 0, 1)


def _per_target(batch, packed, alone_logits):
    """Per-target losses of the packed windows, and of each conversation forwarded alone."""
    kept = batch["targets"] != -100
    ours = packed(batch["inputs"], batch["positions"])[kept]
    theirs, windows_with_two = [], 0
    for inputs, targets, positions in zip(batch["inputs"], batch["targets"], batch["positions"]):
        docs = [(a, b) for a, b in segments(positions) if (targets[a:b] != -100).any()]
        windows_with_two += len(docs) >= 2
        for a, b in docs:
            losses = ce(alone_logits(inputs[a:b]), targets[a:b])
            theirs.append(losses[targets[a:b] != -100])
    assert windows_with_two >= 2  # the batch really packs several conversations per window
    return ours, torch.cat(theirs)


@pytest.mark.slow
def test_run_train_sh_sft_config_loss_is_transformers_loss_of_each_conversation_alone(tmp_path):
    """The shipped SFT config through ./run_train.sh on a local chat file (3 steps), exported
    to Hugging Face: transformers scoring each conversation of a packed batch alone (assistant
    tokens only) gives the loss torchllm's trained model computes on the packed batch."""
    from torchllm.hf.cli import main as hf_cli
    from torchllm.eval.loading import load_for_inference

    transformers = pytest.importorskip("transformers")
    data = write_convs(tmp_path / "chat.jsonl")
    proc = run_train(*tiny_args(
        tmp_path, "--metrics.progress_bar=false", f"--data.dataset=chat:{data}",
        "--data.tokenizer=bytes", "--checkpoint.initial_load_path=", "--training.steps=3",
        "--training.seq_len=160", "--data.val_fraction=0",
        "--model.vocab_pad_multiple=8"),  # 264 ids, no padding rows: the export's softmax
        config="train_configs/llama3_debug_sft.toml")
    assert proc.returncode == 0, proc.out[-3000:]
    run = tmp_path / "debug_sft"
    assert hf_cli(["export", "--checkpoint", str(run), "--out", str(tmp_path / "hf")]) == 0

    model, cfg, tok = load_for_inference(run, "cpu")
    assert (model.args.attn_mask_type, model.args.restart_positions_per_document) == (
        "block_causal", True)
    loader = iter(build_data(*data_args(cfg), tok, 0, 1)[0])
    served = [next(loader) for _ in range(3)]  # the 3 steps' batches, in the run's order
    batch = served[0]
    # Tokens seen count the tokens the model processed: every input but the packing's padding
    # (the EOS id, which the chat template never writes), not only the trained ones.
    processed = sum(int((b["inputs"] != tok.eos_id).sum()) for b in served)
    trained = sum(int((b["targets"] != -100).sum()) for b in served)
    assert trained < processed < sum(b["inputs"].numel() for b in served)
    assert re.search(rf"tokens +{processed:,} seen", proc.stdout), proc.stdout[-2000:]
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    assert hf.config.vocab_size == tok.vocab_size == 264

    def packed(inputs, positions):
        return ce(model(inputs, layout=TokenLayout.from_positions(positions)), batch["targets"])

    with torch.no_grad():
        ours, theirs = _per_target(batch, packed, lambda ids: hf(ids[None]).logits[0])
        assert abs(ours.mean() - theirs.mean()) < 1e-4, (ours.mean(), theirs.mean())
        assert torch.allclose(ours, theirs, atol=1e-4)
        model.args = dataclasses.replace(model.args, attn_mask_type="causal",
                                         restart_positions_per_document=False)
        old = packed(batch["inputs"], batch["positions"])[batch["targets"] != -100]
        assert abs(old.mean() - theirs.mean()) > 1e-3  # the old recipe's loss is not theirs


def test_the_sft_isolation_benchmarks_oracle_trains_what_the_trainer_trains(tmp_path):
    """benchmarks/bench_sft_isolation.py scores conversations alone from the export's rendering:
    its target positions are the trainer's loss mask (chat/template.py), and its packing count
    (which conversations are training ones) is window_rows'."""
    import sys

    from torchllm.data.chat.template import ChatTemplate
    from torchllm.data.packing.chat import window_rows

    sys.path.insert(0, str(REPO / "benchmarks"))
    from bench_sft_isolation import assistant_targets, conversations, training_split

    data = write_convs(tmp_path / "chat.jsonl")
    tok = build_tokenizer((tiny_config(tmp_path, f"--data.dataset=chat:{data}",
                                      "--data.tokenizer=bytes")).data, tmp_path / "data")
    template = ChatTemplate(tok)
    start, end = tok.added["<|assistant_start|>"], tok.added["<|assistant_end|>"]
    rendered = [template.render(m) for m in conversations(60)]
    for r in rendered:
        assert assistant_targets(r.ids, start, end) == [t for t, on in enumerate(r.trained) if on]
    for window in (64, 97, 160):  # short windows: some conversations cut, some windows full
        for val_fraction in (0.05, 0.25):
            rows, n_train = training_split([len(r.ids) for r in rendered], window, val_fraction)
            tokens, _, positions, _ = window_rows(rendered, window, "pack", tok.eos_id)
            held_from = len(tokens) - int(len(tokens) * val_fraction)
            starts = (positions[:, :-1] == 0) & (positions[:, 1:] == 1)  # a conversation's BOS
            assert rows == len(tokens) and starts.sum() == len(rendered)
            assert n_train == starts[:held_from].sum() < len(rendered)
