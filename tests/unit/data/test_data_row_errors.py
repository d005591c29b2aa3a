"""Rows that are not what a source needs are one line naming the file and row (issue 52,
"Unclear errors"): a null or non-string `text` in .jsonl or .parquet (was a TypeError
traceback), and an empty chat: file named as chat:, the way it was written (was local:)."""

from __future__ import annotations

import json

import pytest

from torchllm.config import ConfigError
from torchllm.data import build_data
from torchllm.data.chat.tokens import ChatTokenizer

from conftest import tiny_config
from builders.data import data_args, TOK, corpus_texts
from messages import assert_names


def error_of(tmp_path, dataset, tok=TOK) -> str:
    with pytest.raises(ConfigError) as e:
        build_data(*data_args(tiny_config(tmp_path, f"--data.dataset={dataset}")), tok, 0, 1)
    assert "\n" not in str(e.value)
    return str(e.value)


@pytest.mark.parametrize("bad,shown", [(None, "null"), (5, "int 5"), (["a"], "list ['a']")],
                         ids=["null", "int", "list"])
def test_a_jsonl_row_whose_text_is_not_a_string_is_named_by_file_and_line(tmp_path, bad, shown):
    rows = tmp_path / "rows.jsonl"
    lines = [json.dumps({"text": t}) for t in corpus_texts(300)]
    lines[149] = json.dumps({"text": bad})
    rows.write_text("\n".join(lines) + "\n")
    error = error_of(tmp_path, f"local:{rows}")
    assert_names(error, f"{rows} line 150", "'text'", shown)  # file and line, column, value


def test_a_parquet_row_whose_text_is_null_is_named_by_file_and_row(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    texts = corpus_texts(50)
    texts[7] = None
    path = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"text": texts}), path)
    error = error_of(tmp_path, f"local:{path}")
    assert_names(error, f"{path} row 7", "'text'", "null")


@pytest.mark.parametrize("content", ["", "\n\n"], ids=["empty", "blank"])
def test_an_empty_chat_file_is_named_as_chat(tmp_path, content):
    chat = tmp_path / "chat.jsonl"
    chat.write_text(content)
    error = error_of(tmp_path, f"chat:{chat}", ChatTokenizer(TOK))
    assert f"'chat:{chat}'" in error and "empty" in error and "local:" not in error, error
