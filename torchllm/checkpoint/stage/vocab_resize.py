"""Growing the vocabulary at a stage boundary: a base model trained without chat tokens goes on
to mid-training / SFT with them.

A new run that starts from another run's weights (`checkpoint.initial_load_path`) with the same
base vocabulary plus added tokens (`data.chat_tokens`) gets the saved embedding and output rows
for the old ids and, for every row past them (the added tokens and the padding up to
`model.vocab_pad_multiple`), a draw around the mean of the saved rows with their covariance
(scaled by 1e-9), as transformers' `resize_token_embeddings` does (`grow_rows`). The rows are
grown on the full tensors read from the checkpoint, with one seeded generator, before they are
distributed (FSDP / TP shards), so every layout grows the same way.

Anything else (a vocabulary that shrinks, another base vocabulary, resuming the same run with
another vocabulary) stays an error that names both tokenizers.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from torchllm.checkpoint.stage.tokenizer_identity import check_same_tokenizer
from torchllm.config.job_config import ConfigError
from torchllm.log import logger

VOCAB_KEYS = ("tok_embeddings.weight", "output.weight")


def _describe(record: dict | None, path: Path, rows: int) -> str:
    if record:
        chat = " + 6 chat tokens" if record.get("chat_tokens") else ""
        return f"{record['name']}{chat} ({record['vocab_size']} ids, {rows} rows)"
    name = "not recorded"
    try:  # checkpoints written before the marker recorded it: the step's config names it
        data = tomllib.loads((path / "config.toml").read_text()).get("data", {})
        name = f"data.tokenizer = {data.get('tokenizer')!r}" + (
            ", data.chat_tokens = true" if data.get("chat_tokens") else "")
    except (OSError, ValueError):
        pass
    return f"{name} ({rows} rows)"


def _rows(metadata, sd: dict) -> tuple[list[str], int, int] | None:
    """(vocab keys present in both, saved rows, expected rows), or None when the vocab tensors
    differ in more than their row count (another model: structure_mismatch says so)."""
    saved = metadata.state_dict_metadata
    keys = [k for k in VOCAB_KEYS if k in sd and f"model.{k}" in saved]
    if not keys:
        return None
    shapes = {(tuple(saved[f"model.{k}"].size), tuple(sd[k].shape)) for k in keys}
    if len({(s[0], e[0]) for s, e in shapes}) != 1 or any(s[1:] != e[1:] for s, e in shapes):
        return None
    (saved_shape, expected_shape), *_ = shapes
    return keys, saved_shape[0], expected_shape[0]


def plan_growth(path: Path, metadata, marker: dict, sd: dict, now: dict | None,
                resume: bool) -> tuple[list[str], int]:
    """([vocab keys to grow], saved vocab size) for loading checkpoint `path` into the model
    state dict `sd`; ([], 0) when nothing grows. ConfigError (naming both tokenizers) for
    another tokenizer (tokenizer_identity.check_same_tokenizer: by its file's SHA-256, whatever
    its size), a vocabulary that shrinks, another base vocabulary, or a resume with another
    vocabulary."""
    saved = marker.get("tokenizer")
    check_same_tokenizer(saved, now, f"checkpoint {path}", "resume" if resume else "initial load")
    found = _rows(metadata, sd)
    if found is None or now is None:
        return [], 0
    keys, saved_rows, rows = found
    saved_vocab = saved["vocab_size"] if saved else min(saved_rows, now["base_vocab_size"])
    if saved_rows == rows and (saved is None or saved_vocab >= now["vocab_size"]):
        return [], 0  # the same vocabulary (or one the marker does not describe)
    if saved:
        same_base = saved["base_vocab_size"] == now["base_vocab_size"] and (
            None in (saved["base_sha256"], now["base_sha256"])
            or saved["base_sha256"] == now["base_sha256"])
    else:  # written before markers recorded the tokenizer: the rows must fit the base
        same_base = now["chat_tokens"] and now["base_vocab_size"] <= saved_rows < rows
    was = (f"checkpoint {path} does not fit this model's vocabulary: it was trained with "
           f"tokenizer {_describe(saved, path, saved_rows)}")
    is_ = f"this run's is {_describe(now, path, rows)}"
    if resume:
        raise ConfigError(f"{was}, {is_} (data.tokenizer, data.chat_tokens or model.vocab_size "
                          "changed?): a run resumes with its own vocabulary; relaunch with the "
                          "run's settings, or start a new run (another job.run_name) from it with "
                          "checkpoint.initial_load_path to grow the vocabulary", "data.tokenizer")
    if saved_rows > rows or saved_vocab > now["vocab_size"]:
        raise ConfigError(f"{was}, {is_}: the vocabulary cannot shrink; use the checkpoint's "
                          "tokenizer (data.tokenizer, data.chat_tokens as it had) and "
                          "model.vocab_size", "data.tokenizer")
    if not same_base or saved_vocab < now["base_vocab_size"]:
        raise ConfigError(f"{was}, {is_}: another base vocabulary; only added tokens "
                          "(data.chat_tokens) can grow it, so use the checkpoint's tokenizer "
                          "as data.tokenizer", "data.tokenizer")
    return keys, saved_vocab


def grow_rows(saved: torch.Tensor, saved_vocab: int, rows: int,
              generator: torch.Generator | None = None) -> torch.Tensor:
    """`saved`'s first `saved_vocab` rows, then rows up to `rows` drawn as transformers'
    `resize_token_embeddings` (`_init_added_embeddings_weights_with_mean`) draws them: from
    N(mean, 1e-9 * covariance) of the kept rows (float32), or the mean where that covariance is
    not positive definite. Distinct rows, so the added tokens do not start identical; the same
    `generator` (default: seeded 0) gives the same rows on every rank, and transformers' own
    after `torch.manual_seed` of that seed."""
    keep = saved[:saved_vocab]
    flat = keep.reshape(saved_vocab, -1).float()
    mean = flat.mean(0)
    centered = flat - mean
    covariance = 1e-9 * (centered.T @ centered / saved_vocab)
    scale, info = torch.linalg.cholesky_ex(covariance)
    added = rows - saved_vocab
    if int(info) == 0:  # positive definite: MultivariateNormal(mean, covariance).sample()
        if generator is None:
            generator = torch.Generator().manual_seed(0)
        noise = torch.randn(added, flat.shape[1], generator=generator)
        new = mean + (scale @ noise.unsqueeze(-1)).squeeze(-1)
    else:
        new = mean.expand(added, -1)
    return torch.cat([keep, new.to(saved.dtype).reshape(added, *keep.shape[1:])])


def full_templates(metadata, sd: dict, keys: list[str]) -> dict[str, torch.Tensor]:
    """Plain CPU tensors of the saved (full) shapes to read `keys` into, whatever the layout."""
    saved = metadata.state_dict_metadata
    return {k: torch.empty(tuple(saved[f"model.{k}"].size),
                           dtype=saved[f"model.{k}"].properties.dtype) for k in keys}


def place(grown: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`grown` (full, every rank the same) laid out as the model's tensor `like`: a DTensor
    is cut locally into this rank's shard (no communication), a plain tensor is moved."""
    if isinstance(like, DTensor):
        full = grown.to(device=like.device_mesh.device_type, dtype=like.dtype)
        return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None)
    return grown.to(device=like.device, dtype=like.dtype)


def grow_vocab(model_sd: dict, targets: dict, saved_vocab: int, vocab_size: int) -> None:
    """Replace the saved rows read whole in `model_sd` by the grown ones, each laid out as its
    model tensor in `targets` (`plan_growth` chose them)."""
    generator = torch.Generator().manual_seed(0)  # the same rows on every rank
    for key, like in targets.items():  # embedding first, then output (as transformers)
        saved_rows, rows = model_sd[key].shape[0], like.shape[0]
        model_sd[key] = place(grow_rows(model_sd[key], saved_vocab, rows, generator), like)
    logger.info("vocabulary grown at load: %d -> %d ids (%d -> %d rows with padding); rows "
                "from id %d drawn around the mean of the saved rows in %s", saved_vocab,
                vocab_size, saved_rows, rows, saved_vocab, ", ".join(targets))


def vocab_fit(fit) -> None:
    """The resume's fit check for a vocabulary stage (torchllm/checkpoint/resume/fit.py): the
    same tokenizer (`plan_growth` refuses another), and for a new run whose vocabulary adds
    tokens to the checkpoint's, the saved embedding / output rows read whole (plain tensors
    replace the model's in the states to read) and grown at apply."""
    if "model" not in fit.states:
        return
    sd, now = fit.states["model"], fit.run_info.get("tokenizer")
    keys, saved_vocab = plan_growth(fit.step.path, fit.step.metadata, fit.step.marker, sd, now,
                                    fit.resume)
    if not keys:
        return
    if "optimizer" in fit.states:
        raise ConfigError(
            f"checkpoint {fit.where} has a smaller vocabulary than this run, and its optimizer "
            "state cannot grow with the embeddings: set checkpoint.initial_load_model_only "
            "= true (a new stage takes the weights only)", "checkpoint.initial_load_model_only")
    targets = {k: sd[k] for k in keys}
    sd.update(full_templates(fit.step.metadata, sd, keys))
    fit.on_apply.append(
        lambda states: grow_vocab(states["model"], targets, saved_vocab, now["vocab_size"]))
