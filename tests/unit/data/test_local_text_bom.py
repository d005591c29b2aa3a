"""A UTF-8 byte-order mark starting a local .txt file is not text: it never reaches the
tokenizer (it would become a vocabulary piece and a token of every such document)."""

from __future__ import annotations

from torchllm.data.dataset import documents

from conftest import tiny_config

BOM = b"\xef\xbb\xbf"


def test_a_bom_starting_a_local_text_file_is_not_read(tmp_path):
    texts = ["First file,\nwith a BOM.\n", "Second \ufeff keeps an inner U+FEFF.\n"]
    (tmp_path / "a.txt").write_bytes(BOM + texts[0].encode())
    (tmp_path / "b.txt").write_bytes(texts[1].encode())
    cfg = tiny_config(tmp_path, f"--data.dataset=local:{tmp_path}/*.txt")
    # Oracle: Python's own BOM-aware codec on each file.
    expected = [(tmp_path / f).read_bytes().decode("utf-8-sig") for f in ("a.txt", "b.txt")]
    assert list(documents(cfg.data)) == expected == texts
