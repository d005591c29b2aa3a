"""chat:hf:NAME streams (issue 29): conversations from a Hugging Face dataset are read as they
arrive, through the same reader as Hub text, packed into whole-conversation windows; a mixture
of a Hub text stream and a Hub chat stream resumes exactly. The Hub code path (`datasets`
streaming + split_dataset_by_node) runs on local jsonl folders."""

from __future__ import annotations

import json
import random

import pytest
import torch

from torchllm.config import ConfigError
from torchllm.data import build_data
from torchllm.data.chat.template import ChatTemplate
from torchllm.data.chat.tokens import ChatTokenizer
from torchllm.data.packing.chat import IGNORE
from torchllm.data.sources.hf import StreamWindows
from torchllm.data.mixture import MixtureBatches

from conftest import tiny_config
from builders.data import data_args, TOK, make_hf_folder, resumed_equals_straight, take

CHAT_TOK = ChatTokenizer(TOK)
SEQ = 64
WORDS = "the keeper rang a bell twice while boats came in over grey water at night".split()


def conversations(n: int, seed: int) -> list[list[dict]]:
    """Conversations of 15 to ~110 byte tokens (some longer than a window: cut), each unique."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        messages = [{"role": "user", "content": f"q{seed}-{i} " + " ".join(
            rng.choice(WORDS) for _ in range(rng.randint(0, 4)))},
                    {"role": "assistant", "content": " ".join(
                        rng.choice(WORDS) for _ in range(rng.randint(1, 12 if i % 9 else 20)))}]
        if i % 4 == 0:
            messages.insert(0, {"role": "system", "content": "be brief"})
        out.append(messages)
    return out


def make_chat_folder(tmp_path, files: int = 4, per_file: int = 10, broken_tail: bool = False):
    """A local folder `datasets` streams like a Hub chat dataset (jsonl parts, `messages`).
    broken_tail: the last file ends with a line that is not JSON (read whole, it fails)."""
    folder = tmp_path / "chat_hub"
    folder.mkdir()
    convs = conversations(files * per_file, seed=11)
    for f in range(files):
        rows = convs[f * per_file:(f + 1) * per_file]
        text = "".join(json.dumps({"messages": m, "id": f}) + "\n" for m in rows)
        if broken_tail and f == files - 1:
            text += "{this line is not json\n"
        (folder / f"part-{f}.jsonl").write_text(text)
    return folder, convs


def chat_mix(tmp_path, *extra, batch=2, **folder):
    text_folder, _ = make_hf_folder(tmp_path)
    chat_folder, convs = make_chat_folder(tmp_path, **folder)
    cfg = tiny_config(tmp_path, f"--data.sources=hf:{text_folder}=0.7,chat:hf:{chat_folder}=0.3",
                      f"--training.seq_len={SEQ}", f"--training.local_batch_size={batch}",
                      "--data.val_documents=3", "--validation.enable", *extra)  # (held out)
    return cfg, convs


def packed_windows(convs: list[list[dict]], window: int) -> list[tuple[list[int], list[int]]]:
    """Oracle, written out here: each conversation rendered, cut to one window, laid greedily
    into windows of whole conversations padded with EOS; targets = the next token where it is
    an assistant token, else IGNORE. Returns (inputs, targets) per window."""
    template = ChatTemplate(CHAT_TOK)
    windows, current = [], []
    for m in convs:
        r = template.render(m)
        piece = list(zip(r.ids, r.trained))[:window]
        if current and len(current) + len(piece) > window:
            windows.append(current)
            current = []
        current = current + piece
    windows.append(current)
    out = []
    for w in windows:
        w = w + [(TOK.eos_id, False)] * (window - len(w))
        ids = [i for i, _ in w]
        out.append((ids[:-1], [i if t else IGNORE for i, t in w[1:]]))
    return out


def test_a_chat_stream_serves_whole_conversations_in_stream_order(tmp_path):
    cfg, convs = chat_mix(tmp_path, batch=4)
    loader, val = build_data(*data_args(cfg), CHAT_TOK, 0, 1)
    ds = loader.dataset
    assert isinstance(ds, MixtureBatches) and all(isinstance(s, StreamWindows)
                                                  for s in ds.sources)
    batches = take(loader, 30)
    rows = [(b["inputs"][r].tolist(), b["targets"][r].tolist())
            for b in batches for r in range(4)]
    which = [int(ds.schedule[g]) for g in range(len(rows))]
    from_chat = [row for row, s in zip(rows, which) if s == 1]
    expected = packed_windows(convs[3:], SEQ + 1)  # the first 3 are held out
    n = len(expected) - 1  # the epoch's last window may hold the next epoch's first turns
    assert 10 < n < len(from_chat), (n, len(from_chat))  # a whole epoch was served
    assert from_chat[:n] == expected[:n]
    assert any(t != IGNORE for _, ts in from_chat for t in ts)  # assistant tokens are trained
    # Validation: the held-out conversations' windows (chat source: the second part).
    val_windows = list(val.dataset.datasets[1])
    assert [(w["inputs"].tolist(), w["targets"].tolist()) for w in val_windows] == \
        packed_windows(convs[:3], SEQ + 1)


@pytest.mark.parametrize("workers,dp", [(0, 1), (2, 2)])
def test_a_text_and_chat_stream_mixture_resumes_exactly(tmp_path, workers, dp):
    """Oracle: a straight run's batches. 7 batches, the loader state (pickled, as a checkpoint
    holds it), a new loader from that state: its next 40 batches (past the end of each
    stream's part: epoch 2 of both) equal the straight run's."""
    cfg, _ = chat_mix(tmp_path, f"--data.num_workers={workers}")
    for rank in range(dp):
        after = resumed_equals_straight(cfg, CHAT_TOK, rank, dp)
        assert any((b["targets"] == IGNORE).any() for b in after)  # chat windows among them


def test_a_chat_hub_dataset_is_streamed_not_read_whole(tmp_path):
    """The last file of the chat dataset ends in a line that is not JSON: reading the dataset
    whole at start fails on it; streaming reads only what the batches need."""
    cfg, _ = chat_mix(tmp_path, broken_tail=True, per_file=20)
    loader, _ = build_data(*data_args(cfg), CHAT_TOK, 0, 1)
    assert isinstance(loader.dataset.sources[1], StreamWindows)
    batches = take(loader, 5)
    assert any((b["targets"] == IGNORE).any() for b in batches)
    with pytest.raises(Exception, match="JSON|Trailing data"):  # the stream reaches the line
        take(loader, 200)


def test_a_chat_stream_without_assistant_turns_is_one_error_at_start(tmp_path):
    folder = tmp_path / "chat_hub"
    folder.mkdir()
    (folder / "part-0.jsonl").write_text("".join(
        json.dumps({"messages": [{"role": "user", "content": f"hi {i}"}]}) + "\n"
        for i in range(40)))
    cfg = tiny_config(tmp_path, f"--data.dataset=chat:hf:{folder}", f"--training.seq_len={SEQ}",
                      "--data.val_documents=3")
    with pytest.raises(ConfigError, match=rf"chat:hf:{folder}: none of the first 32 "
                                          "conversations has an assistant turn"):
        build_data(*data_args(cfg), CHAT_TOK, 0, 1)
