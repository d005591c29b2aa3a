"""Tokenizers in all three formats on real files from ../shared, and the training CLI."""

import json

import pytest

from torchllm.config import ConfigError
from torchllm.data.tokenizer import (
    GPT2_PATTERN,
    SentencePieceTokenizer,
    TiktokenTokenizer,
    load_tokenizer,
)
from torchllm.data.tokenizer_json import HFTokenizer
from torchllm.tools.train_tokenizer import main as tokenizer_cli

from conftest import shared_path
from messages import raises_naming


@pytest.fixture(scope="module")
def shakespeare():
    return shared_path("data", "tinyshakespeare.txt").read_text()[:20_000]


def test_sentencepiece_round_trip_matches_sentencepiece(shakespeare):
    import sentencepiece as spm

    path = shared_path("tokenizers", "mistral-sp32k", "tokenizer.model")
    tok = load_tokenizer(path)
    assert isinstance(tok, SentencePieceTokenizer)
    assert (tok.vocab_size, tok.bos_id, tok.eos_id) == (32000, 1, 2)
    ids = tok.encode(shakespeare, bos=True, eos=True)
    assert ids[0] == 1 and ids[-1] == 2
    assert ids[1:-1] == spm.SentencePieceProcessor(model_file=str(path)).encode(shakespeare)
    assert tok.decode(ids[1:-1]) == shakespeare


def test_gpt2_tiktoken_matches_known_ids_and_round_trips(shakespeare):
    tok = load_tokenizer(shared_path("tokenizers", "gpt2", "gpt2.tiktoken"))
    assert isinstance(tok, TiktokenTokenizer)
    assert tok.vocab_size == 50257 and tok.bos_id == tok.eos_id == 50256
    assert tok.encode("Hello world", eos=True) == [15496, 995, 50256]  # published GPT-2 ids
    assert tok.decode(tok.encode(shakespeare)) == shakespeare
    # Special-token text inside a document stays text.
    assert 50256 not in tok.encode("a <|endoftext|> b")


def test_llama3_tiktoken_specials_and_round_trip(shakespeare):
    tok = load_tokenizer(shared_path("tokenizers", "llama3", "tokenizer.model"))
    assert isinstance(tok, TiktokenTokenizer)
    assert (tok.vocab_size, tok.bos_id, tok.eos_id) == (128256, 128000, 128001)
    assert tok.encode("Hello world", bos=True) == [128000, 9906, 1917]  # published Llama 3 ids
    assert tok.decode([128009]) == "<|eot_id|>"
    ids = tok.encode(shakespeare)
    assert max(ids) < 128000 and tok.decode(ids) == shakespeare


def test_tokenizer_json_agrees_with_tiktoken(tmp_path, shakespeare):
    """A tokenizer.json made from GPT-2's ranks by transformers' converter (an independent BPE
    implementation) encodes real text exactly as our tiktoken loader does."""
    from transformers.convert_slow_tokenizer import TikTokenConverter

    ranks = shared_path("tokenizers", "gpt2", "gpt2.tiktoken")
    converted = TikTokenConverter(vocab_file=str(ranks), pattern=GPT2_PATTERN,
                                  extra_special_tokens=["<|endoftext|>"]).converted()
    converted.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>"}))
    hf = load_tokenizer(tmp_path)  # the folder, as a Hub snapshot would be laid out
    assert isinstance(hf, HFTokenizer)
    tt = load_tokenizer(ranks)
    assert (hf.vocab_size, hf.bos_id, hf.eos_id) == (tt.vocab_size, tt.bos_id, tt.eos_id)
    assert hf.encode(shakespeare, bos=True, eos=True) == tt.encode(shakespeare, bos=True, eos=True)
    assert hf.decode(hf.encode(shakespeare)) == shakespeare


def test_bad_tokenizer_files_are_one_line_errors(tmp_path):
    with raises_naming(ConfigError, tmp_path / "missing.model"):
        load_tokenizer(tmp_path / "missing.model")
    junk = tmp_path / "junk.model"
    junk.write_bytes(b"\x00\x01 not a model")
    with raises_naming(ConfigError, junk, "SentencePiece"):  # the file, what it should be
        load_tokenizer(junk)
    odd = tmp_path / "odd.tiktoken"
    odd.write_text("YQ== 0\nYg== 1\n")
    with raises_naming(ConfigError, odd, "2 BPE ranks"):  # the file, what it holds
        load_tokenizer(odd)
    bad_json = tmp_path / "tokenizer.json"
    bad_json.write_text("{}")
    with raises_naming(ConfigError, bad_json, "tokenizer.json"):
        load_tokenizer(bad_json)


def test_train_cli_writes_a_working_model(tmp_path, capsys):
    corpus = tmp_path / "a.jsonl"
    text = shared_path("data", "tinyshakespeare.txt").read_text()[:100_000]
    corpus.write_text("\n".join(json.dumps({"text": p}) for p in text.split("\n\n")))
    assert tokenizer_cli(["--input", str(corpus), "--vocab-size", "400",
                          "--out", str(tmp_path / "tok")]) == 0
    assert "400 pieces" in capsys.readouterr().out
    tok = load_tokenizer(tmp_path / "tok" / "tokenizer.model")
    assert tok.vocab_size == 400 and tok.decode(tok.encode(text[:500])) == text[:500]
    assert tokenizer_cli(["--input", str(tmp_path / "none.txt"), "--vocab-size", "400",
                          "--out", str(tmp_path / "tok2")]) == 2
