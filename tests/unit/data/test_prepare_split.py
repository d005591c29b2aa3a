"""`prepare`'s validation split (proportional by default) and the empty/tiny-input errors of
`prepare` and SentencePiece training."""

import json

import numpy as np
import pytest

from torchllm.config import ConfigError
from torchllm.config.sections import Data
from torchllm.data.prepare import main as prepare_cli
from torchllm.data.prepare import prepare
from torchllm.data.sources.shards import open_split
from torchllm.data.tokenizer import load_tokenizer
from torchllm.data.tokenizer_training import train_sentencepiece
from torchllm.tools.train_tokenizer import main as tokenizer_cli

from conftest import shared_path
from messages import assert_names


def docs_of(split, bos, eos) -> list[list[int]]:
    """The documents of a split, as token lists (cut at each BOS)."""
    tokens = split.read(0, len(split)).tolist()
    out, cur = [], []
    for t in tokens:
        if t == bos and cur:
            out.append(cur)
            cur = []
        cur.append(t)
    return out + ([cur] if cur else [])


def write_jsonl(path, texts):
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


@pytest.fixture(scope="module")
def sp_path():
    return shared_path("tokenizers", "mistral-sp32k", "tokenizer.model")


def texts(n, seed=0):
    rng = np.random.default_rng(seed)
    words = "the river ran quietly past old stone walls while birds sang above".split()
    return [f"doc{i:04d} " + " ".join(rng.choice(words, int(rng.integers(5, 60))))
            for i in range(n)]


def test_default_split_is_proportional_whole_documents(tmp_path, sp_path, monkeypatch):
    import torchllm.data.prepare as prepare_module

    def no_processes(method):  # --workers 1 tokenizes in the process itself
        raise AssertionError(f"--workers 1 started a {method} pool")

    monkeypatch.setattr(prepare_module.mp, "get_context", no_processes)
    corpus = texts(400)
    src = write_jsonl(tmp_path / "c.jsonl", corpus + ["", "   \n"])  # empty ones are skipped
    tok = load_tokenizer(sp_path)
    encoded = [tok.encode(t, bos=True, eos=True) for t in corpus]
    out = tmp_path / "s"
    assert prepare_cli(["--dataset", f"local:{src}", "--tokenizer", str(sp_path), "--out",
                        str(out), "--shard-tokens", "5000", "--workers", "1",
                        "--val-fraction", "0.02"]) == 0
    val, train = open_split(out, "val"), open_split(out, "train")
    val_docs = docs_of(val, tok.bos_id, tok.eos_id)
    train_docs = docs_of(train, tok.bos_id, tok.eos_id)
    # Oracle: whole documents, each in exactly one split, order kept within each split.
    assert sorted(map(tuple, val_docs + train_docs)) == sorted(map(tuple, encoded))
    assert [d for d in encoded if d in val_docs] == val_docs
    assert val_docs[0] == encoded[0] and len(val_docs) >= 3  # the first, then spread out
    assert encoded.index(val_docs[-1]) > 200
    total = sum(map(len, encoded))
    fraction = len(val) / total
    assert 0.02 <= fraction <= 0.02 + max(map(len, encoded)) / total

    # The cap: no more than --val-max-tokens tokens (the last document cut there).
    capped = tmp_path / "capped"
    prepare(Data(dataset=f"local:{src}"), str(sp_path), capped, 5000, None, 1, progress=False,
            val_fraction=0.5, val_max_tokens=300)
    assert len(open_split(capped, "val")) == 300
    assert len(open_split(capped, "val")) + len(open_split(capped, "train")) == total


@pytest.mark.slow
def test_a_big_document_cannot_swell_the_validation_split(tmp_path, sp_path):
    """200 documents of ~500 bytes and one of 500 kB (the 101st) at the default --val-fraction:
    validation stays within 0.005 of the tokens (+ one 2,048-token document of slack), and the
    big document is cut, not lost: its head in validation, the rest in training."""
    rng = np.random.default_rng(1)
    words = "the river ran quietly past old stone walls while birds sang above".split()
    small = [f"doc{i:04d} " + " ".join(rng.choice(words, 90)) for i in range(200)]
    big = "big " + " ".join(rng.choice(words, 100_000))
    corpus = small[:100] + [big] + small[100:]
    assert all(450 < len(t) < 650 for t in small) and len(big) > 500_000
    tok = load_tokenizer(sp_path)
    encoded = [tok.encode(t, bos=True, eos=True) for t in corpus]
    out = tmp_path / "s"
    assert prepare_cli(["--dataset", f"local:{write_jsonl(tmp_path / 'c.jsonl', corpus)}",
                        "--tokenizer", str(sp_path), "--out", str(out), "--shard-tokens",
                        "50000", "--workers", "1"]) == 0
    val, train = open_split(out, "val"), open_split(out, "train")
    total = sum(map(len, encoded))
    assert len(val) + len(train) == total
    assert len(encoded[100]) > 0.5 * total  # the big one is most of the corpus
    assert 0 < len(val) <= 0.005 * total + 2048, (len(val), total)
    # Every token is somewhere: the big document's head in validation (cut there), its tail in
    # training, and every small document whole in exactly one split.
    v, t, doc = val.read(0, len(val)).tolist(), train.read(0, len(train)).tolist(), encoded[100]
    i = next(k for k in range(len(v)) if v[k : k + 8] == doc[:8])
    h = next((k for k in range(1, len(v) - i) if v[i + k] == tok.bos_id), len(v) - i)
    assert 0 < h < len(doc) and v[i : i + h] == doc[:h]
    j = next(k for k in range(len(t)) if t[k : k + 8] == doc[h : h + 8])
    assert t[j : j + len(doc) - h] == doc[h:]
    rest = [v[:i] + v[i + h :], t[:j] + t[j + len(doc) - h :]]
    whole = [tuple(d) for r in rest for d in split_at(r, tok.bos_id)]
    assert sorted(whole) == sorted(map(tuple, encoded[:100] + encoded[101:]))


def split_at(tokens: list[int], bos: int) -> list[list[int]]:
    starts = [k for k, x in enumerate(tokens) if x == bos] + [len(tokens)]
    assert not tokens or starts[0] == 0
    return [tokens[a:b] for a, b in zip(starts, starts[1:])]


def test_one_document_corpus_and_explicit_val_tokens(tmp_path, sp_path):
    text = shared_path("data", "tinyshakespeare.txt")  # one .txt file = one document
    tok = load_tokenizer(sp_path)
    oracle = tok.encode(text.read_text(), bos=True, eos=True)
    out = tmp_path / "s"
    index = prepare(Data(dataset=f"local:{text}"), str(sp_path), out, 100_000, None, 1,
                    progress=False)
    val, train = open_split(out, "val"), open_split(out, "train")
    assert len(val) == round(0.005 * len(oracle)) and index["splits"]["val"]["documents"] == 1
    assert np.concatenate([val.read(0, len(val)), train.read(0, len(train))]).tolist() == oracle
    # --val-tokens N: exactly the first N tokens, as before.
    src = write_jsonl(tmp_path / "c.jsonl", texts(30))
    prepare(Data(dataset=f"local:{src}"), str(sp_path), tmp_path / "n", 10_000, 123, 1,
            progress=False)
    assert len(open_split(tmp_path / "n", "val")) == 123


def test_empty_sources_say_they_are_empty(tmp_path, sp_path, capsys):
    (tmp_path / "empty.txt").write_text("\n \n")
    assert prepare_cli(["--dataset", f"local:{tmp_path / 'empty.txt'}", "--tokenizer",
                        str(sp_path), "--out", str(tmp_path / "s"), "--workers", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: prepare:") and "is empty" in err and "validation" not in err

    with pytest.raises(ConfigError) as e:
        train_sentencepiece([], 512, tmp_path / "t.model", source="data.dataset = 'x'")
    assert_names(e.value, "data.dataset = 'x'")  # the source with no text
    assert "INTERNAL" not in str(e.value)
    with pytest.raises(ConfigError) as e:
        train_sentencepiece(["just a few words, not enough for a vocabulary"], 4096,
                            tmp_path / "t.model")
    msg = str(e.value)
    assert "INTERNAL" not in msg and "\n" not in msg
    assert_names(msg, "4096")  # the size asked for (and, below, the largest that works)
    assert e.value.key == "data.tokenizer_vocab_size"
    most = int(msg.split("data.tokenizer_vocab_size <= ")[1].split()[0])
    train_sentencepiece(["just a few words, not enough for a vocabulary"], most,
                        tmp_path / "t.model")  # the number it names does work
    assert load_tokenizer(tmp_path / "t.model").vocab_size == most

    assert tokenizer_cli(["--input", str(tmp_path / "empty.txt"), "--vocab-size",
                          "300", "--out", str(tmp_path / "tok")]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: ")  # one line: what could not be made, from which file
    assert_names(err, "SentencePiece", tmp_path / "empty.txt")
