"""Sequence-length schedule: short sequences for most of the run, the full length at the end.

Format of training.seq_len_schedule: "LEN:UNTIL,LEN:UNTIL,..." — train at LEN for the steps up to
fraction UNTIL of training.steps (step s uses the first entry with s <= round(UNTIL x steps));
UNTILs increase and the last is 1.0. E.g. with seq_len = 4096, "2048:0.9,4096:1.0" trains 90% of
the steps at 2048 and the rest at 4096.

The loader keeps reading windows of training.seq_len (the longest); a step at LEN cuts each
window into seq_len / LEN consecutive pieces. Tokens per step, the data order and the loader
state are therefore unchanged by the schedule, which is what keeps a resume exact, and RoPE
(model.max_seq_len defaults to training.seq_len) covers every length.
"""

from __future__ import annotations

import torch

from torchllm.config.job_config import ConfigError

KEY = "training.seq_len_schedule"


def parse_seq_len_schedule(text: str, seq_len: int) -> list[tuple[int, float]]:
    """[(LEN, UNTIL), ...]; empty text = [(seq_len, 1.0)]."""
    if not text.strip():
        return [(seq_len, 1.0)]
    entries = []
    for part in text.split(","):
        try:
            length, until = part.split(":")
            entries.append((int(length), float(until)))
        except ValueError:
            raise ConfigError(f"{KEY} = {text!r}: entry {part!r} is not LEN:UNTIL "
                              "(e.g. '2048:0.9,4096:1.0')", KEY) from None
    for length, _ in entries:
        if length < 1 or seq_len % length:
            raise ConfigError(f"{KEY} = {text!r}: length {length} does not divide training."
                              f"seq_len = {seq_len} (windows are cut into LEN pieces)", KEY)
    untils = [u for _, u in entries]
    if any(b <= a for a, b in zip(untils, untils[1:])) or untils[0] <= 0 or untils[-1] != 1.0:
        raise ConfigError(f"{KEY} = {text!r}: UNTIL fractions must increase, be > 0 and end "
                          "at 1.0", KEY)
    return entries


class SeqLenSchedule:
    """The sequence length of every step, and the cut of a loader batch to it."""

    def __init__(self, text: str, seq_len: int, steps: int):
        self.seq_len, self.steps = seq_len, steps
        self.entries = parse_seq_len_schedule(text, seq_len)

    def at(self, step: int) -> int:
        """Sequence length of step `step` (1-based)."""
        for length, until in self.entries:
            if step <= round(until * self.steps):
                return length
        return self.entries[-1][0]

    def cut(self, batch: dict[str, torch.Tensor], step: int) -> dict[str, torch.Tensor]:
        """[B, seq_len] tensors -> [B x seq_len / LEN, LEN]; input/target pairs are kept (a
        0-dim count, the batch's processed_tokens, stays as it is)."""
        length = self.at(step)
        if length == batch["inputs"].shape[1]:
            return batch
        return {k: v.reshape(-1, length) if v.dim() else v for k, v in batch.items()}
