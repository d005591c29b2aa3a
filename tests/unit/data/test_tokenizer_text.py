"""Training a SentencePiece tokenizer on real-shaped text: CRLF files without blank lines (one
huge paragraph), wikitext dumps whose blank lines hold a space, a single-file corpus, short and
long documents mixed. Every character reaches the trainer; nothing is dropped silently."""

from __future__ import annotations

import numpy as np
import pytest

from torchllm.data.tokenizer import load_tokenizer
from torchllm.data.tokenizer_training import CHUNK_CHARS, train_sentencepiece, training_chunks
from torchllm.tools.train_tokenizer import main as tokenizer_cli

from cli import run_train
from conftest import tiny_args

WORDS = ("the of and to a in that was he his it with had for as her not but at she on said "
         "be by which have from they this were all him my one so there their would an when "
         "been could what no out if we into more very little them time upon only about now "
         "night sea letter house garden window morning lady captain river thought hand").split()


def prose(n_chars: int, seed: int) -> str:
    """Sentences of common English words, one long run of text."""
    rng = np.random.default_rng(seed)
    out, size = [], 0
    while size < n_chars:
        words = list(rng.choice(WORDS, int(rng.integers(5, 18))))
        sentence = " ".join(words).capitalize() + rng.choice([".", ".", "!", "?", ";"]) + " "
        out.append(sentence)
        size += len(sentence)
    return "".join(out)[:n_chars]


def novel_like(n_chars: int = 200_000) -> bytes:
    """A Gutenberg-style novel: lines wrapped at ~70 characters, CRLF endings, no blank line
    anywhere (so the whole file is one paragraph), a few accented words."""
    text = prose(n_chars, seed=1).replace(" lady ", " fiancée ").replace(" sea ", " mer—sea ")
    lines, line = [], ""
    for word in text.split(" "):
        if len(line) + len(word) > 70:
            lines.append(line)
            line = ""
        line = f"{line} {word}" if line else word
    return "\r\n".join(lines + [line, ""]).encode()


def wikitext_like(n_articles: int = 40) -> str:
    """wikitext-103 raw: ' = Title = ' headings, paragraphs, and blank lines that hold a space."""
    parts = []
    for a in range(n_articles):
        parts += [f" = Article {a} = ", " "]
        for s in range(3):
            parts += [f" = = Section {s} = = ", " ", " " + prose(900, seed=100 * a + s), " "]
    return "\n".join(parts) + "\n"


def test_chunks_are_the_text_exactly_and_bounded():
    texts = ["", "a", "x" * 10_000, "word " * 3000, "One. Two! Three? " * 1000,
             novel_like(30_000).decode(), wikitext_like(3), prose(50_000, seed=3),
             "\n" * 9000, "line\r\n" * 2000 + "y" * 5000]
    for text in texts:
        chunks = list(training_chunks(text))
        assert "".join(chunks) == text
        assert all(0 < len(c) <= CHUNK_CHARS for c in chunks)
    # A long line is cut after a sentence end when there is one in reach, else at a space.
    chunks = list(training_chunks(prose(20_000, seed=4)))
    assert all(c[-2] in ".!?;" and c[-1] == " " for c in chunks[:-1] if "." in c)
    assert all(c.endswith(" ") for c in list(training_chunks("word " * 3000))[:-1])


def test_nothing_is_silently_dropped(tmp_path):
    """Short documents and one 200k-character paragraph whose last part alone holds 'ж' and
    'ø': both end up as pieces of the vocabulary (byte fallback would cover them otherwise)."""
    short = [prose(300, seed=s) for s in range(20)]
    long = prose(200_000, seed=7)
    long = long[:-2000] + long[-2000:].replace("e", "ж").replace("o", "ø")
    path = train_sentencepiece(short + [long], 600, tmp_path / "t.model")
    tok = load_tokenizer(path)
    for char in "жø":
        assert tok.sp.piece_to_id(char) != tok.sp.unk_id(), char
    sample = long[-3000:]
    assert tok.decode(tok.encode(sample)) == sample
    assert not any(tok.sp.id_to_piece(i).startswith("<0x") for i in tok.encode(sample))


@pytest.mark.parametrize("shape", ["novel", "wikitext"])
def test_the_train_cli_on_a_single_real_shaped_file(tmp_path, shape, capsys):
    path = tmp_path / f"{shape}.txt"
    if shape == "novel":
        path.write_bytes(novel_like())
    else:
        path.write_text(wikitext_like())
    assert tokenizer_cli(["--input", str(path), "--vocab-size", "800",
                          "--out", str(tmp_path / "tok")]) == 0, capsys.readouterr().err
    tok = load_tokenizer(tmp_path / "tok" / "tokenizer.model")
    assert tok.vocab_size == 800
    text = path.read_text()  # universal newlines, as `datasets` reads a .txt file
    assert tok.decode(tok.encode(text)) == text
    # Learnt from the file, not byte fallback: the text takes far fewer pieces than characters.
    assert len(tok.encode(text)) < len(text) / 2.5


@pytest.mark.slow
def test_run_train_sh_auto_tokenizer_on_a_novel_and_a_wikitext_dump(tmp_path):
    corpus = tmp_path / "my_texts"
    corpus.mkdir()
    (corpus / "novel.txt").write_bytes(novel_like())
    (corpus / "wiki.txt").write_text(wikitext_like())
    proc = run_train(*tiny_args(tmp_path, "--metrics.progress_bar=false",
                                f"--data.dataset=local:{corpus}", "--data.tokenizer=auto",
                                "--training.steps=2"))
    out = proc.out
    assert proc.returncode == 0, out[-3000:]
    assert "step     2/2" in out and "INTERNAL" not in out
    (model,) = tmp_path.glob("*/data/tokenizer_*my_texts*_sp512.model")
    tok = load_tokenizer(model)
    wiki = (corpus / "wiki.txt").read_text()
    assert tok.vocab_size == 512 and len(tok.encode(wiki)) < len(wiki) / 2


def test_too_many_distinct_characters_for_the_vocab_is_a_one_line_error(tmp_path):
    from torchllm.config import ConfigError

    text = "".join(chr(0x4E00 + i) for i in range(300)) + " " + prose(5000, seed=9)
    with pytest.raises(ConfigError) as e:
        train_sentencepiece([text], 400, tmp_path / "t.model", source="data.dataset = 'x'")
    msg = str(e.value)
    need = int(msg.rsplit(">= ", 1)[1])  # "set data.tokenizer_vocab_size >= N": the size to set
    assert msg.startswith("data.dataset = 'x'") and "400" in msg, msg  # the source, the size
    assert "INTERNAL" not in msg and "\n" not in msg
    assert e.value.key == "data.tokenizer_vocab_size" and f"{e.value.key} >= {need}" in msg
    assert load_tokenizer(train_sentencepiece([text], need, tmp_path / "t.model")).vocab_size \
        == need  # the size it names does work
