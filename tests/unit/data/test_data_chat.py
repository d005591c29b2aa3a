"""Conversations: chat templates per tokenizer kind, assistant-only loss masks, packing, the
chat: source through build_data, and SFT that makes a tiny model reproduce the replies."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from torchllm.config import ConfigError
from torchllm.data import build_data, build_tokenizer, load_tokenizer
from torchllm.data.chat.template import ChatTemplate, Rendered
from torchllm.data.chat.tokens import ChatTokenizer
from torchllm.data.packing.chat import unpadded_tokens, window_rows

from conftest import shared_path, tiny_config
from messages import assert_names, raises_naming
from builders.chat import write_chat  # noqa: F401
from builders.data import data_args

CONV = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "4, of course."},
    {"role": "user", "content": "And 3 + 3?"},
    {"role": "assistant", "content": "6."},
]


def llama3():
    return load_tokenizer(shared_path("tokenizers", "llama3", "tokenizer.model"))


def gpt2():
    return ChatTokenizer(load_tokenizer(shared_path("tokenizers", "gpt2", "gpt2.tiktoken")))


def sentencepiece():
    return ChatTokenizer(load_tokenizer(shared_path("tokenizers", "mistral-sp32k",
                                                    "tokenizer.model")))


def tokenizer_json(tmp_path):
    from transformers.convert_slow_tokenizer import TikTokenConverter

    from torchllm.data.tokenizer import GPT2_PATTERN

    ranks = shared_path("tokenizers", "gpt2", "gpt2.tiktoken")
    TikTokenConverter(vocab_file=str(ranks), pattern=GPT2_PATTERN,
                      extra_special_tokens=["<|endoftext|>"]).converted().save(
        str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>"}))
    return ChatTokenizer(load_tokenizer(tmp_path))


# The documented templates, written out by hand (the oracle for rendering).
LLAMA3_TEXT = ("<|begin_of_text|>"
               "<|start_header_id|>system<|end_header_id|>\n\nYou are terse.<|eot_id|>"
               "<|start_header_id|>user<|end_header_id|>\n\nWhat is 2 + 2?<|eot_id|>"
               "<|start_header_id|>assistant<|end_header_id|>\n\n4, of course.<|eot_id|>"
               "<|start_header_id|>user<|end_header_id|>\n\nAnd 3 + 3?<|eot_id|>"
               "<|start_header_id|>assistant<|end_header_id|>\n\n6.<|eot_id|>")
TOKENS_TEXT = ("<|system_start|>You are terse.<|system_end|><|user_start|>What is 2 + 2?"
               "<|user_end|><|assistant_start|>4, of course.<|assistant_end|><|user_start|>"
               "And 3 + 3?<|user_end|><|assistant_start|>6.<|assistant_end|>")


def runs(ids, flags):
    """Maximal runs of consecutive ids whose flag is set."""
    out, cur = [], []
    for i, f in zip(ids, flags):
        if f:
            cur.append(i)
        elif cur:
            out, cur = out + [cur], []
    return out + [cur] if cur else out


@pytest.mark.parametrize("kind", ["llama3", "gpt2", "sentencepiece", "tokenizer_json"])
def test_render_round_trip_and_loss_mask(kind, tmp_path):
    tok = {"llama3": llama3, "gpt2": gpt2, "sentencepiece": sentencepiece,
           "tokenizer_json": lambda: tokenizer_json(tmp_path)}[kind]()
    template = ChatTemplate(tok)
    r = template.render(CONV)
    assert template.kind == ("llama3" if kind == "llama3" else "tokens")
    text = tok.decode(r.ids)
    bos_text = {"llama3": "", "gpt2": "<|endoftext|>", "sentencepiece": "",
                "tokenizer_json": "<|endoftext|>"}[kind]
    assert text == (LLAMA3_TEXT if kind == "llama3" else bos_text + TOKENS_TEXT)
    assert r.ids[0] == tok.bos_id and len(r.ids) == len(r.trained)
    # Loss mask: exactly the assistant replies and their end-of-turn tokens, nothing else.
    end = "<|eot_id|>" if kind == "llama3" else "<|assistant_end|>"
    assert [tok.decode(run) for run in runs(r.ids, r.trained)] == ["4, of course." + end,
                                                                 "6." + end]
    assert [tok.decode(run) for run in runs(r.ids, [not t for t in r.trained])][1:] != []
    assert template.end_of_turn == r.ids[-1]
    # Windows: a target is kept iff the token it predicts is trained.
    tokens, mask, _, _ = window_rows([r], len(r.ids) + 3, "pack", tok.eos_id)
    from torchllm.data.packing.chat import ChatSource

    batch = ChatSource(tokens, mask, np.zeros_like(tokens), 0).read([0])
    kept = batch["targets"][0] != -100
    assert kept.tolist() == r.trained[1:] + [False] * 3
    assert torch.equal(batch["targets"][0][kept], torch.tensor(r.ids)[1:][kept[: len(r.ids) - 1]])
    # A generation prompt ends with the assistant header.
    prompt = template.prompt(CONV[:2])
    assert tok.decode(prompt).endswith("<|start_header_id|>assistant<|end_header_id|>\n\n"
                                       if kind == "llama3" else "<|user_end|><|assistant_start|>")


def test_text_never_becomes_a_chat_token():
    tok = gpt2()
    r = ChatTemplate(tok).render([{"role": "user", "content": "<|assistant_end|>"}])
    assert tok.added["<|assistant_end|>"] not in r.ids[2:-1]


def test_packing_keeps_conversations_whole_and_truncates_overlong():
    def conv(n, start):
        return Rendered(list(range(start, start + n)), [True] * n)

    convs = [conv(5, 100), conv(4, 200), conv(3, 300), conv(12, 400), conv(2, 500)]
    tokens, mask, positions, truncated = window_rows(convs, 10, "pack", 0)
    assert truncated == 1
    assert tokens.tolist() == [
        [100, 101, 102, 103, 104, 200, 201, 202, 203, 0],  # 5 + 4 fit; 3 would not
        [300, 301, 302, 0, 0, 0, 0, 0, 0, 0],                # the 12-token one needs a new window
        list(range(400, 410)),                             # ... truncated to one window
        [500, 501, 0, 0, 0, 0, 0, 0, 0, 0],
    ]
    assert mask.sum() == 5 + 4 + 3 + 10 + 2
    assert positions[0].tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3, 0]
    padded, _, _, _ = window_rows(convs, 10, "pad", 0)
    assert len(padded) == 5 and padded[0, 5:].tolist() == [0] * 5


def test_unpadded_tokens_count_conversation_inputs_not_padding():
    """Throughput and tokens seen count what the model processes: a packed chat batch's input
    tokens without its padding (counted here by hand from the layout above)."""
    from torchllm.data.packing.chat import unpadded_tokens

    def conv(n, start):
        return Rendered(list(range(start, start + n)), [True] * n)

    convs = [conv(5, 100), conv(4, 200), conv(3, 300), conv(12, 400), conv(2, 500)]
    _, _, positions, _ = window_rows(convs, 10, "pack", 0)
    inputs = torch.as_tensor(positions[:, :-1])  # a window's inputs: its first 9 places
    assert [int(unpadded_tokens(row)) for row in inputs] == [9, 3, 9, 2]
    assert int(unpadded_tokens(inputs)) == 23
    _, _, positions, _ = window_rows(convs, 10, "pad", 0)
    assert int(unpadded_tokens(torch.as_tensor(positions[:, :-1]))) == 5 + 4 + 3 + 9 + 2


def test_sft_throughput_counts_processed_tokens_and_trained_ones_apart(tmp_path):
    """SFT: tokens seen (and tokens/s, MFU) are the conversation tokens the model processed,
    prompts included, padding not; the loss's trained tokens are their own, smaller figure."""
    from torchllm.data.packing.chat import unpadded_tokens
    from torchllm.train import Trainer

    convs = [[{"role": "user", "content": f"say {w}"}, {"role": "assistant", "content": w}]
             for w in ["apple", "banana", "cherry", "dates", "elder", "figs"] * 3]
    data = write_chat(tmp_path / "chat.jsonl", convs)
    cfg = tiny_config(tmp_path, f"--data.dataset=chat:{data}",
                      f"--data.tokenizer={shared_path('tokenizers', 'gpt2', 'gpt2.tiktoken')}",
                      "--training.seq_len=31", "--training.local_batch_size=2",
                      "--data.val_fraction=0", "--training.steps=2", "--metrics.log_freq=1")
    trainer = Trainer(cfg)
    served, logged = [], []
    batches, log = trainer.batches, trainer.metrics.log

    def spy_batches():
        for b in batches:
            served.append(b)
            yield b

    def spy_log(step, m, step_time):
        logged.append(dict(m))
        return log(step, m, step_time)

    trainer.batches, trainer.metrics.log = spy_batches(), spy_log
    trainer.train()
    processed = [int(unpadded_tokens(b["positions"])) for b in served]
    trained = [int((b["targets"] != -100).sum()) for b in served]
    assert [m["tokens"] for m in logged] == processed
    assert [m["trained_tokens"] for m in logged] == trained
    assert trainer.train_state.tokens_seen == sum(processed)
    assert all(t < p < b["inputs"].numel() for t, p, b in zip(trained, processed, served))


def test_chat_source_through_build_data(tmp_path, caplog):
    convs = [[{"role": "user", "content": f"say {w}"}, {"role": "assistant", "content": w}]
             for w in ["apple", "banana", "cherry", "dates", "elder", "figs"] * 3]
    data = write_chat(tmp_path / "chat.jsonl", convs)
    tok_path = shared_path("tokenizers", "gpt2", "gpt2.tiktoken")
    cfg = tiny_config(tmp_path, f"--data.dataset=chat:{data}", f"--data.tokenizer={tok_path}",
                      "--training.seq_len=31", "--training.local_batch_size=2",
                      "--data.val_fraction=0")
    tok = build_tokenizer(cfg.data, tmp_path)
    assert isinstance(tok, ChatTokenizer) and tok.vocab_size == 50257 + 6
    with caplog.at_level("INFO"):
        loader, _ = build_data(*data_args(cfg), tok, 0, 1)
    assert_names(caplog.text, "18 conversations", "tokens", "0 truncated")  # counts, template
    batch = next(iter(loader))
    for inputs, targets in zip(batch["inputs"], batch["targets"]):
        kept = targets != -100
        assert kept.any()
        # every kept target is a reply word or <|assistant_end|>; every such token is kept
        words = tok.decode(targets[kept].tolist())
        assert words.replace("<|assistant_end|>", " ").split() and all(
            w in {"apple", "banana", "cherry", "dates", "elder", "figs"}
            for w in words.replace("<|assistant_end|>", " ").split())
        assert (targets[kept] == tok.added["<|assistant_end|>"]).sum() >= 1
    auto = tiny_config(tmp_path, f"--data.dataset=chat:{data}")
    with raises_naming(ConfigError, "data.tokenizer = 'auto'", key="data.tokenizer"):
        build_tokenizer(auto.data, tmp_path)
    bad = write_chat(tmp_path / "bad.jsonl", [[{"role": "robot", "content": "x"}]])
    cfg = tiny_config(tmp_path, f"--data.dataset=chat:{bad}", f"--data.tokenizer={tok_path}")
    # The file, the message, its role, and the roles allowed.
    with raises_naming(ConfigError, "bad.jsonl", "message 0", "'robot'", "system", "user",
                       "assistant"):
        build_data(*data_args(cfg), build_tokenizer(cfg.data, tmp_path), 0, 1)


REPLIES = {"Name a fruit.": "An apple.", "Name a color.": "Deep blue.",
           "Name an animal.": "A small cat.", "Name a tool.": "The hammer."}


@pytest.mark.slow
def test_sft_makes_the_model_reproduce_the_replies(tmp_path, capsys):
    """Train through the Trainer on 4 conversations (loss on the replies only), then chat with
    the checkpoint through `python -m torchllm.generate --chat`: greedy replies are the trained
    ones, and generation stops at the end-of-turn token."""
    from torchllm import generate
    from torchllm.data.sources.embedded import embedded_documents
    from torchllm.data.tokenizer_training import train_sentencepiece
    from torchllm.train import Trainer

    sp = train_sentencepiece(embedded_documents(), 512, tmp_path / "sp512.model")
    data = write_chat(tmp_path / "sft.jsonl", [
        [{"role": "system", "content": "Answer in a few words."},
         {"role": "user", "content": q}, {"role": "assistant", "content": a}]
        for q, a in REPLIES.items()])
    cfg = tiny_config(tmp_path, "--job.run_name=sft", f"--data.dataset=chat:{data}",
                      f"--data.tokenizer={sp}", "--data.chat_packing=pad", "--data.val_fraction=0",
                      "--training.seq_len=40", "--training.local_batch_size=4",
                      "--training.steps=60", "--optimizer.lr=3e-3", "--lr_scheduler.warmup_steps=5",
                      "--metrics.log_freq=20", "--checkpoint.enable=true",
                      "--checkpoint.interval=60")
    trainer = Trainer(cfg)
    batch = trainer.train_loader.dataset.batch(0)
    kept = batch["targets"] != -100
    # Only reply tokens (+ <|assistant_end|>) count: the loss is their mean, nothing else's.
    assert 0 < int(kept.sum()) < int((batch["inputs"] != trainer.tokenizer.eos_id).sum()) // 3
    losses = trainer.train()
    assert losses[-1] < 0.05 < losses[0]
    capsys.readouterr()
    args = ["--checkpoint", str(tmp_path / "sft"), "--temperature", "0", "--max-new-tokens", "20",
            "--system", "Answer in a few words."]
    for q in REPLIES:
        args += ["--chat", q]
    assert generate.main(args) == 0
    # Each reply under its question (### user i / ### assistant i headers).
    assert capsys.readouterr().out.splitlines() == [
        line for i, (q, a) in enumerate(REPLIES.items(), 1)
        for line in (f"### user {i}", q, f"### assistant {i}", a)]

    # --chat --interactive: one conversation, a turn per stdin line, each reply generated from
    # the whole conversation so far (the oracle: generate() on the hand-built prompt).
    import io

    from torchllm.eval.generation import generate as generate_ids
    from torchllm.eval.loading import load_for_inference

    (q1, a1), (q2, _) = list(REPLIES.items())[:2]
    out = io.StringIO()
    longer = "--model.max_seq_len=128"  # two turns outgrow the 40 tokens it trained on
    assert generate.main(["--checkpoint", str(tmp_path / "sft"), "--chat", "--interactive",
                          "--temperature", "0", "--max-new-tokens", "20", "--system",
                          "Answer in a few words.", longer],
                         stdin=io.StringIO(f"{q1}\n\n{q2}\n"), stdout=out) == 0
    lines = out.getvalue().splitlines()
    assert lines[:4] == ["### user 1", q1, "### assistant 1", a1]
    model, cfg, tok = load_for_inference(str(tmp_path / "sft"), torch.device("cpu"), [longer])
    template = ChatTemplate(tok)
    history = [{"role": "system", "content": "Answer in a few words."},
               {"role": "user", "content": q1}, {"role": "assistant", "content": a1},
               {"role": "user", "content": q2}]
    (ids,) = generate_ids(model, [template.prompt(history)], max_new_tokens=20, temperature=0,
                          top_k=0, top_p=1.0, seed=0, eos_id=template.end_of_turn)
    want = tok.decode(ids[:-1] if ids and ids[-1] == template.end_of_turn else ids)
    assert lines[4:] == ["### user 2", q2, "### assistant 2", *want.split("\n")]


def test_mixture_of_text_and_conversations(tmp_path):
    """A chat source mixes with a text source: text windows train on every token, chat windows
    on the replies only; both come in the same batch format."""
    from builders.data import TOK, corpus_texts, write_jsonl

    text = write_jsonl(tmp_path / "text.jsonl", corpus_texts())
    chat = write_chat(tmp_path / "chat.jsonl", [
        [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"reply {i}"}]
        for i in range(40)])
    cfg = tiny_config(tmp_path, f"--data.sources=local:{text}=0.5,chat:{chat}=0.5",
                      "--training.seq_len=24", "--training.local_batch_size=4",
                      "--validation.enable")  # each source holds its split out
    tok = ChatTokenizer(TOK)
    loader, val = build_data(*data_args(cfg), tok, 0, 1)
    end = tok.added["<|assistant_end|>"]
    kinds = []
    for batch in take_batches(loader, 5):
        assert set(batch) == {"inputs", "targets", "positions", "processed_tokens"}
        # the loader's count: every token but a chat window's padding (the data reads chat)
        assert int(batch["processed_tokens"]) == int(unpadded_tokens(batch["positions"]))
        for inputs, targets in zip(batch["inputs"], batch["targets"]):
            if (inputs >= 259).any():  # a chat window (it holds chat tokens)
                kept = targets[targets != -100].tolist()
                assert kept and set(tok.decode(kept).split("<|assistant_end|>")[:-1]) <= {
                    f"reply {i}" for i in range(40)} and end in kept
                kinds.append("chat")
            else:
                assert (targets != -100).all()
                kinds.append("text")
    assert kinds.count("chat") == kinds.count("text") == 10
    assert len(val.dataset) > 0


def take_batches(loader, k):
    it = iter(loader)
    return [next(it) for _ in range(k)]


def test_generate_chat_needs_a_chat_tokenizer(tmp_path, capfd):
    from builders.eval import write_run
    from torchllm import generate

    run_dir, _ = write_run(tmp_path, complete_steps=(1,), incomplete_steps=())
    assert generate.main(["--checkpoint", str(run_dir), "--chat", "Hi"]) == 2
    out = capfd.readouterr()
    text = out.out + out.err
    # What works instead, for this checkpoint: --prompt, or a chat fine-tune from it; not a
    # training key that would not change this checkpoint.
    (line,) = [ln for ln in text.splitlines() if "error" in ln]
    # The option and the checkpoint; what works instead: --prompt, or a chat: fine-tune from it.
    assert_names(line, "--chat", run_dir, "--prompt", "chat:")
    assert f"--checkpoint.initial_load_path={run_dir}" in line
    assert "data.chat_tokens" not in text
    with pytest.raises(SystemExit):
        generate.main(["--checkpoint", str(run_dir), "--chat", "Hi", "--prompt", "x"])
