"""The Hugging Face export carries the run's tokenizer, always, and a chat run's template:
`transformers.AutoTokenizer` on the exported files is the oracle (same ids as the run's
tokenizer on held-out text; `apply_chat_template` gives the run's own chat prompts)."""

from __future__ import annotations

import json
import os
import stat

import pytest
import torch

from torchllm.hf.tokenizer import write_tokenizer
from torchllm.data import load_tokenizer
from torchllm.data.chat.template import ChatTemplate
from torchllm.data.chat.tokens import ChatTokenizer

from conftest import shared_path, tiny_config

transformers = pytest.importorskip("transformers")

CONV = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "4, of course."},
    {"role": "user", "content": "And 3 + 3?\nQuick."},
]


def held_out_text() -> list[str]:
    lines = shared_path("data", "tinyshakespeare.txt").read_text().splitlines()[-400:]
    return ["\n".join(lines[i:i + 8]) for i in range(0, 400, 8)] + [
        "naïve café — 日本語の文 😀🎉 Ελληνικά", "  leading spaces,\ttabs\r\n\r\nand CRLF  ",
        "don't WE'LL it's 1234567 3.14159 x+=1;;", ".:.:.:.: ...::: ---", ""]


def export(tokenizer, out, chat=False):
    out.mkdir()
    config = {"max_position_embeddings": 256}
    assert write_tokenizer(tokenizer, out, config, chat)
    return transformers.AutoTokenizer.from_pretrained(str(out)), config


@pytest.mark.parametrize("name", ["gpt2", pytest.param("llama3", marks=pytest.mark.slow)])
def test_tiktoken_exports_a_tokenizer_json_with_the_runs_ids(tmp_path, name):
    file = {"gpt2": ("gpt2", "gpt2.tiktoken"), "llama3": ("llama3", "tokenizer.model")}[name]
    tok = load_tokenizer(shared_path("tokenizers", *file))
    old_umask = os.umask(0o002)
    try:
        hf, config = export(tok, tmp_path / "hf")
    finally:
        os.umask(old_umask)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        assert stat.S_IMODE((tmp_path / "hf" / f).stat().st_mode) == 0o664, f
    for text in held_out_text():
        assert hf(text, add_special_tokens=False)["input_ids"] == tok.encode(text), text
        assert hf(text)["input_ids"] == tok.encode(text, bos=True), text  # BOS, as each document
        assert hf.decode(tok.encode(text)) == text
    assert (hf.bos_token_id, hf.eos_token_id) == (tok.bos_id, tok.eos_id)
    assert (config["bos_token_id"], config["eos_token_id"]) == (tok.bos_id, tok.eos_id)
    assert len(hf) == tok.vocab_size
    for special in tok.enc.special_tokens_set:
        assert hf.convert_tokens_to_ids(special) == tok.enc.encode_single_token(special)
    assert "chat_template" not in json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text())


def jinja_tokenizer(tmp_path):
    from builders.chat import tokenizer_folder

    return load_tokenizer(tokenizer_folder(tmp_path / "src", "qwen3"))


KINDS = {
    "gpt2+chat tokens": lambda tmp: ChatTokenizer(load_tokenizer(
        shared_path("tokenizers", "gpt2", "gpt2.tiktoken"))),
    "sentencepiece+chat tokens": lambda tmp: ChatTokenizer(load_tokenizer(
        shared_path("tokenizers", "mistral-sp32k", "tokenizer.model"))),
    "own template (tokenizer.json)": jinja_tokenizer,
    "llama3 headers": lambda tmp: load_tokenizer(
        shared_path("tokenizers", "llama3", "tokenizer.model")),
}


@pytest.mark.parametrize("kind", [k if k != "llama3 headers" else pytest.param(
    k, marks=pytest.mark.slow) for k in KINDS])
def test_chat_template_in_the_export_gives_the_runs_chat_ids(tmp_path, kind):
    (tmp_path / "src").mkdir()
    tok = KINDS[kind](tmp_path)
    hf, _ = export(tok, tmp_path / "hf", chat=True)
    template = ChatTemplate(tok)
    for n in (2, 4):  # each prompt ends with a user turn: generate the assistant's reply
        prompt = hf.apply_chat_template(CONV[:n], add_generation_prompt=True, tokenize=True,
                                        return_dict=False)
        assert list(prompt) == template.prompt(CONV[:n]), kind
    whole = hf.apply_chat_template(CONV[:3], tokenize=True, return_dict=False)
    assert list(whole) == template.render(CONV[:3]).ids
    assert len(hf) == tok.vocab_size


@pytest.mark.slow
def test_sft_run_export_chats_like_torchllm_generate(tmp_path, capsys):
    """Pre-train (no chat tokens), SFT with them (the vocab grows), export: the exported
    tokenizer's chat prompt is the run's, and transformers' greedy reply is
    `python -m torchllm.generate --chat ... --temperature 0`'s, token for token."""
    from torchllm import generate
    from torchllm.hf.cli import main as hf_cli
    from torchllm.train import Trainer

    Trainer(tiny_config(tmp_path, "--checkpoint.enable", "--job.run_name=base",
                        "--training.steps=1")).train()
    (sp,) = (tmp_path / "base" / "data").glob("tokenizer_*.model")
    chat = tmp_path / "chat.jsonl"
    chat.write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": f"Count to {i}."},
        {"role": "assistant", "content": " ".join(str(k) for k in range(1, i + 1))}]}) + "\n"
        for i in range(1, 20)))
    sft = Trainer(tiny_config(tmp_path, "--checkpoint.enable", "--job.run_name=sft",
                              f"--data.tokenizer={sp}", f"--data.dataset=chat:{chat}",
                              f"--checkpoint.initial_load_path={tmp_path / 'base'}",
                              "--training.steps=2"))
    sft.train()
    assert hf_cli(["export", "--checkpoint", str(tmp_path / "sft"), "--out",
                   str(tmp_path / "hf")]) == 0
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    messages = [{"role": "user", "content": "Count to 3."}]
    template = ChatTemplate(sft.tokenizer)
    prompt = template.prompt(messages)
    assert list(hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                           return_dict=False)) == prompt
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    with torch.no_grad():
        # config.json's eos_token_id lists the end of turn: generate() stops there by itself.
        out = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False,
                             pad_token_id=sft.tokenizer.eos_id)
    reply = out[0, len(prompt):].tolist()
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["eos_token_id"] == [sft.tokenizer.eos_id, template.end_of_turn]
    capsys.readouterr()
    assert generate.main(["--checkpoint", str(tmp_path / "sft"), "--chat", "Count to 3.",
                          "--temperature", "0", "--max-new-tokens", "6", "--print-ids",
                          "--device", "cpu"]) == 0
    ids = capsys.readouterr().out.splitlines()[-1]
    assert ids == "ids: " + " ".join(map(str, reply))


def test_bytes_tokenizer_is_utf8_bytes_and_exports_with_the_same_ids(tmp_path):
    """data.tokenizer = "bytes": id b is byte b (oracle: str.encode), BOS/EOS follow; the export
    is a tokenizer.json that AutoTokenizer loads with the same ids and the run's BOS."""
    tok = load_tokenizer("bytes")
    assert (tok.vocab_size, tok.bos_id, tok.eos_id) == (258, 256, 257)
    hf, config = export(tok, tmp_path / "hf")
    for text in held_out_text():
        assert tok.encode(text) == list(text.encode("utf-8")), text
        assert tok.encode(text, bos=True, eos=True) == [256, *text.encode("utf-8"), 257]
        assert tok.decode(tok.encode(text)) == text
        assert hf(text, add_special_tokens=False)["input_ids"] == tok.encode(text), text
        assert hf(text)["input_ids"] == tok.encode(text, bos=True), text
        assert hf.decode(tok.encode(text)) == text
    assert (hf.bos_token_id, hf.eos_token_id) == (256, 257) == (
        config["bos_token_id"], config["eos_token_id"])
    assert len(hf) == 258
    from torchllm.checkpoint.stage.tokenizer_identity import tokenizer_record

    # A checkpoint records it as "bytes" (what a later stage's from_initial_load loads).
    assert tokenizer_record(tok)["name"] == "bytes"
