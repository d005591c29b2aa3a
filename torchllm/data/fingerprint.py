"""What data a run reads, recorded in each checkpoint's marker (its `data` field), so that a
resume knows whether the saved data position still points into the same data order.

The loader's position is a count of batches (torchllm.data.windows, mixture): batch n is a pure
function of n, the windows (training.seq_len), the seed, the sources and their weights, and the
tokens themselves. When any of them changed, continuing at batch n reads an unrelated part of
a different order. The fingerprint holds each of them:

    sources           [[dataset, weight], ...] (weights normalized), "mixture": [[data.sources]]
    content           a digest of each source's training tokens: their count, the document
                      count, the length of each part (shard file) and evenly spaced samples of
                      the tokens (a re-prepared or edited corpus changes it; a streamed source
                      is identified by its name only)
    seq_len, seed, shuffle_windows, tokenizer_sha256

`changes(saved, now)` says what differs, in words; checkpoint.on_data_change decides what a
resume does about it (torchllm.checkpoint.loading; docs/checkpointing.md).
"""

from __future__ import annotations

import hashlib

import numpy as np

SAMPLES, SAMPLE_TOKENS = 32, 32  # token samples per source's training stream


def stream_digest(stream) -> str:
    """A digest of a TokenStream's tokens: lengths, document count and sampled tokens."""
    h = hashlib.sha256()
    n = len(stream)
    docs = np.searchsorted(stream.doc_starts, [stream.start, stream.end])
    lengths = np.diff(stream.part_starts)
    h.update(np.array([n, docs[1] - docs[0], *lengths], dtype=np.int64).tobytes())
    width = min(SAMPLE_TOKENS, n)
    for a in np.unique(np.linspace(0, n - width, SAMPLES).astype(np.int64)) if n else []:
        h.update(np.asarray(stream.read(int(a), int(a) + width), dtype=np.int64).tobytes())
    return h.hexdigest()[:16]


def _streams(dataset) -> list:
    """The training token stream of each source of a loader's dataset (None: a streamed one)."""
    if hasattr(dataset, "sources"):  # a mixture (or a single non-indexed kind as a mixture)
        return [getattr(src, "stream", None) for src in dataset.sources]
    return [getattr(dataset, "stream", None)]


def data_fingerprint(job_config, dataset, tokenizer_sha256: str | None) -> dict:
    """The fingerprint (module doc) of the data `dataset` (the training loader's) reads."""
    dcfg = job_config.data
    if dcfg.sources:
        total = sum(s.weight for s in dcfg.sources)
        sources = [[s.dataset, round(s.weight / total, 6)] for s in dcfg.sources]
    else:
        sources = [[dcfg.dataset, 1.0]]
    content = [stream_digest(s) if s is not None else "stream" for s in _streams(dataset)]
    return {"sources": sources, "mixture": bool(dcfg.sources), "content": content,
            "seq_len": job_config.training.seq_len, "seed": job_config.job.seed,
            "shuffle_windows": dcfg.shuffle_windows, "tokenizer_sha256": tokenizer_sha256}


def _sources(fp: dict) -> str:
    if not fp.get("mixture"):
        return f"data.dataset {fp['sources'][0][0]!r}"
    return "data.sources [" + ", ".join(f"{d} x{w:g}" for d, w in fp["sources"]) + "]"


def changes(saved: dict, now: dict) -> list[str]:
    """What differs between two fingerprints, one phrase each ([] when the same data)."""
    out = []
    if (saved.get("sources"), saved.get("mixture")) != (now.get("sources"), now.get("mixture")):
        out.append(f"{_sources(saved)} -> {_sources(now)}")
    elif saved.get("content") != now.get("content"):
        which = [d for (d, _), a, b in zip(now["sources"], saved.get("content") or [],
                                           now.get("content") or []) if a != b]
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
    return out
