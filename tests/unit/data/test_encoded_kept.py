"""A corpus encoded once per process and tokenizer file (torchllm.data.token_stream
.encoded_documents): the next build on the same text and file gets the same tokens without
encoding again; another file, another content at the same path, or other text is encoded anew,
and the arrays handed out are the caller's own."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import tiny_config
from torchllm.data import build_tokenizer
from torchllm.data.chat.tokens import ChatTokenizer
from torchllm.data.sources.embedded import embedded_documents
from torchllm.data.token_stream import _encoded, encoded_documents
from torchllm.data.tokenizer import load_tokenizer
from torchllm.data.tokenizer_training import train_sentencepiece


def by_hand(texts, tokenizer):
    """The oracle: every document encoded with BOS and EOS, concatenated, and its offsets."""
    docs = [tokenizer.encode(t, bos=True, eos=True) for t in texts]
    return (np.array([i for d in docs for i in d], dtype=np.int64),
            np.cumsum([0] + [len(d) for d in docs[:-1]]))


class Counting:
    """A tokenizer's encode calls counted (what the process pays when it encodes)."""

    def __init__(self, monkeypatch, cls):
        self.calls = 0
        encode = cls.encode

        def counted(tok, *args, **kwargs):
            self.calls += 1
            return encode(tok, *args, **kwargs)

        monkeypatch.setattr(cls, "encode", counted)


@pytest.fixture(autouse=True)
def nothing_kept():
    _encoded.clear()
    yield
    _encoded.clear()


def test_the_same_text_and_file_is_encoded_once_and_equals_the_encoding_by_hand(
        tmp_path, monkeypatch):
    texts = list(embedded_documents())[:40]
    cfg = tiny_config(tmp_path)
    tokenizer = build_tokenizer(cfg.data, tmp_path / "data")
    want = by_hand(texts, tokenizer)
    counting = Counting(monkeypatch, type(tokenizer))
    for _ in range(2):
        tokens, starts = encoded_documents(texts, tokenizer)
        assert np.array_equal(tokens, want[0]) and np.array_equal(starts, want[1])
        assert tokens.dtype == np.int64
    assert counting.calls == len(texts)  # the second build encoded nothing
    # A fresh object of the same file, with the chat tokens added: the same tokens, kept.
    again = ChatTokenizer(load_tokenizer(tokenizer.path))
    tokens, _ = encoded_documents(texts, again)
    assert np.array_equal(tokens, want[0]) and counting.calls == len(texts)
    tokens[:] = -1  # the caller's own copy: what is kept is untouched
    assert np.array_equal(encoded_documents(texts, tokenizer)[0], want[0])
    # Other text: encoded.
    few = by_hand(texts[:5], tokenizer)[0]
    before = counting.calls
    assert np.array_equal(encoded_documents(texts[:5], tokenizer)[0], few)
    assert counting.calls == before + 5


def test_another_file_or_new_content_at_the_same_path_is_encoded_anew(tmp_path):
    texts = list(embedded_documents())[:40]
    path = tmp_path / "tok.model"
    train_sentencepiece(texts, 400, path)
    first = load_tokenizer(path)
    assert np.array_equal(encoded_documents(texts, first)[0], by_hand(texts, first)[0])
    train_sentencepiece(texts, 512, path)  # the same path, another vocabulary
    second = load_tokenizer(path)
    want = by_hand(texts, second)[0]
    assert not np.array_equal(want, by_hand(texts, first)[0])
    assert np.array_equal(encoded_documents(texts, second)[0], want)
