"""What data a run reads, recorded in each checkpoint's marker (its `data` field), so that a
resume knows whether the saved data position still points into the same data order.

The loader's position is a count of batches (torchllm.data.windows, mixture): batch n is a pure
function of n, the windows (training.seq_len), the seed, the sources and their weights, and the
tokens themselves. When any of them changed, continuing at batch n reads an unrelated part of
a different order. The fingerprint holds each of them:

    sources           [[dataset, weight], ...] (weights normalized), "mixture": [[data.sources]]
    content           each source's own content identity (Source.content_identity,
                      torchllm.data.content): a full content hash of its files (local:, chat:,
                      shards:), its text, or a streamed dataset's name, subset and split
    seq_len, seed, shuffle_windows, tokenizer_sha256
    reads             {config key: value} of the settings that choose which of those tokens
                      train and which validate (READS: the text or conversation column, how
                      chats are laid out, how much is held out, what validation reads instead)

Each data/validation key, decided (docs/data.md#loaders-and-exact-resume has the list):
data.dataset / sources (`sources`), shuffle_windows, hf_subset / hf_split (in a Hub source's
`content`), tokenizer / tokenizer_vocab_size / tokenizer_train_chars / chat_tokens (the
tokenizer's SHA-256 and the vocabulary check, checkpoint/stage), READS below; not recorded:
num_workers and prefetch_factor (the same batches), validation.enable / freq / stop_at_loss
(when, not what), validation.steps and validation.max_tokens (how many of the same validation
windows are read, a budget that may follow the run's length; the config-change warning names
them). The holdout is recorded as it applies: a dedicated validation.dataset holds nothing out
of the training data (torchllm.data.training_data), so data.val_fraction and data.val_documents
are then 0, and a validation.dataset equal to data.dataset is recorded as "" (the held-out
split). A record written before `reads` (a field missing) is not compared: that checkpoint
resumes as before, its config changes named by the resume's warning.

`changes(saved, now)` says what differs, in words; checkpoint.on_data_change decides what a
resume does about it (`data_fit`, the resume's fit check: torchllm/checkpoint/fits.py registers
it; docs/checkpointing.md).
"""

from __future__ import annotations

from torchllm.config.job_config import ConfigError
from torchllm.log import logger

# The settings that choose which tokens train and validate (module doc), by config key.
READS = ("data.text_column", "data.chat_column", "data.chat_packing", "data.val_fraction",
         "data.val_documents", "validation.dataset", "validation.split")


def data_fingerprint(dcfg, vcfg, tokenizer_sha256: str | None, *, seq_len: int,
                     seed: int) -> dict:
    """The fingerprint (module doc) of the data the [data] section `dcfg` reads (`vcfg`: the
    [validation] section; `seq_len`, `seed`: training.seq_len, job.seed)."""
    from torchllm.data.dataset import parse_data

    if dcfg.sources:
        total = sum(s.weight for s in dcfg.sources)
        sources = [[s.dataset, round(s.weight / total, 6)] for s in dcfg.sources]
    else:
        sources = [[dcfg.dataset, 1.0]]
    content = parse_data(dcfg).content_identity()
    return {"sources": sources, "mixture": bool(dcfg.sources), "content": content,
            "seq_len": seq_len, "seed": seed,
            "shuffle_windows": dcfg.shuffle_windows, "tokenizer_sha256": tokenizer_sha256,
            "reads": reads(dcfg, vcfg)}


def reads(dcfg, vcfg) -> dict:
    """READS' values as they apply: the holdout a dedicated validation.dataset zeroes, and
    validation.dataset "" when validation reads the held-out split (module doc)."""
    from torchllm.data import dedicated_validation, training_data

    applied = {"data": training_data(dcfg, vcfg), "validation": vcfg}
    out = {}
    for key in READS:
        section, name = key.split(".")
        out[key] = getattr(applied[section], name)
    if not dedicated_validation(dcfg, vcfg):
        out["validation.dataset"] = ""
    return out


def differ(saved: str, now: str) -> bool:
    """Two content identities differ; one written before identities had a scheme (a sample
    digest, or "stream") is not compared (torchllm.data.content)."""
    return ":" in str(saved) and saved != now


def _sources(fp: dict) -> str:
    if not fp.get("mixture"):
        return f"data.dataset {fp['sources'][0][0]!r}"
    return "data.sources [" + ", ".join(f"{d} x{w:g}" for d, w in fp["sources"]) + "]"


def changes(saved: dict, now: dict) -> list[str]:
    """What differs between two fingerprints, one phrase each ([] when the same data)."""
    out = []
    if (saved.get("sources"), saved.get("mixture")) != (now.get("sources"), now.get("mixture")):
        out.append(f"{_sources(saved)} -> {_sources(now)}")
    elif which := [d for (d, _), a, b in zip(now["sources"], saved.get("content") or [],
                                             now.get("content") or []) if differ(a, b)]:
        out.append(f"the tokens of {', '.join(which) or 'the data'} changed (re-prepared shards "
                   "or edited files)")
    for key, name in (("seq_len", "training.seq_len"), ("seed", "job.seed"),
                      ("shuffle_windows", "data.shuffle_windows"),
                      ("tokenizer_sha256", "tokenizer (SHA-256)")):
        if saved.get(key) != now.get(key):
            a, b = saved.get(key), now.get(key)
            if key == "tokenizer_sha256":
                a, b = (str(v)[:12] if v else v for v in (a, b))
            out.append(f"{name} {a} -> {b}")
    was, now_reads = saved.get("reads"), now.get("reads") or {}
    if isinstance(was, dict):  # absent: a record from before `reads`, not compared
        out += [f"{key} {was.get(key)!r} -> {now_reads.get(key)!r}" for key in READS
                if key in was and was[key] != now_reads.get(key)]
    return out


def data_fit(fit) -> None:
    """The resume's fit check for the data identity (torchllm/checkpoint/resume/fit.py): on a
    resume whose data differs from the checkpoint's, a ConfigError (on_data_change = 'error')
    or the data position left out of the load (its order restarts)."""
    saved, now = fit.step.marker.get("data"), fit.run_info.get("data")
    if not fit.resume or not saved or not now or "dataloader" in fit.exclude:
        return  # a checkpoint from before fingerprints: nothing to compare
    if saved.get("tokenizer_sha256") != now.get("tokenizer_sha256"):
        return  # another tokenizer: the identity check next names both files
    what = "; ".join(changes(saved, now))
    if not what:
        return
    if fit.cfg.on_data_change == "error":
        raise ConfigError(
            f"checkpoint {fit.where} was saved reading other data ({what}): its data position "
            "does not point into this data order; resume with the data it was saved with, or "
            "set checkpoint.on_data_change = 'restart' to read this data from its beginning "
            "(step and token counters kept)", "checkpoint.on_data_change")
    logger.warning("the data changed since %s (%s): reading it from its beginning in its "
                   "new order (data position reset; step, token counters and LR schedule "
                   "kept; checkpoint.on_data_change = 'restart')", fit.where, what)
    fit.exclude = [*fit.exclude, "dataloader"]
