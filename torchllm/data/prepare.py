"""Tokenize a dataset once into fixed-size shards, so training reads tokens instead of text.

    python -m torchllm.data.prepare --dataset local:corpus/ --tokenizer tok.model --out DIR \
        [--shard-tokens 100_000_000] [--val-tokens N] [--workers 2]

Documents are read in order, tokenized with BOS/EOS in worker processes (order preserved) and
appended to a stream. The first --val-tokens tokens (default: one shard's worth) form the
validation split; the rest is the training split (a document cut by the split starts it with
its tail), cut into shards of exactly --shard-tokens tokens (the last may be shorter).
See torchllm/data/shards.py for the format.
"""

from __future__ import annotations

import argparse
import itertools
import multiprocessing as mp
import sys
from pathlib import Path

import numpy as np

from torchllm.config.job_config import ConfigError
from torchllm.config.sections import Data
from torchllm.data.shards import token_dtype, write_doc_starts, write_index, write_shard
from torchllm.data.sources import documents
from torchllm.data.tokenizer import load_tokenizer

_worker_tokenizer = None


def _init_worker(spec: str) -> None:
    global _worker_tokenizer  # one tokenizer per worker process, loaded once
    _worker_tokenizer = load_tokenizer(spec)


def _encode(texts: list[str]) -> list[list[int]]:
    return [_worker_tokenizer.encode(t, bos=True, eos=True) for t in texts]


class SplitWriter:
    """Accumulates one split's tokens and writes a shard each time shard_tokens are collected."""

    def __init__(self, out: Path, split: str, shard_tokens: int, dtype: np.dtype):
        self.out, self.split, self.shard_tokens, self.dtype = out, split, shard_tokens, dtype
        self.buffer = np.empty(shard_tokens, dtype=dtype)
        self.filled, self.total = 0, 0
        self.doc_starts: list[int] = []
        self.shards: list[dict] = []

    def add(self, ids: list[int]) -> None:
        self.doc_starts.append(self.total)
        arr = np.asarray(ids, dtype=self.dtype)
        while len(arr):
            take = min(len(arr), self.shard_tokens - self.filled)
            self.buffer[self.filled : self.filled + take] = arr[:take]
            self.filled += take
            self.total += take
            arr = arr[take:]
            if self.filled == self.shard_tokens:
                self.flush()

    def flush(self) -> None:
        if self.filled:
            name = f"{self.split}_{len(self.shards):06d}.bin"
            write_shard(self.out / name, self.buffer[: self.filled])
            self.shards.append({"file": name, "tokens": self.filled})
            self.filled = 0

    def finish(self) -> dict:
        self.flush()
        docs = f"{self.split}_docs.npy"
        write_doc_starts(self.out / docs, np.array(self.doc_starts, dtype=np.int64))
        return {"tokens": self.total, "documents": len(self.doc_starts), "shards": self.shards,
                "doc_starts": docs}


def prepare(dcfg: Data, tokenizer_spec: str, out: Path, shard_tokens: int, val_tokens: int,
            workers: int, docs_per_task: int = 64, progress: bool = True) -> dict:
    """Write the shards and index.json; returns the index."""
    from tqdm import tqdm

    tokenizer = load_tokenizer(tokenizer_spec)
    dtype = token_dtype(tokenizer.vocab_size)
    out.mkdir(parents=True, exist_ok=True)
    val = SplitWriter(out, "val", shard_tokens, dtype)
    train = SplitWriter(out, "train", shard_tokens, dtype)
    texts = documents(dcfg)
    tasks = iter(lambda: list(itertools.islice(texts, docs_per_task)), [])
    bar = tqdm(unit="tok", unit_scale=True, disable=not progress, desc="tokenizing")
    with mp.get_context("spawn").Pool(workers, _init_worker, (tokenizer_spec,)) as pool:
        for encoded in pool.imap(_encode, tasks):
            for ids in encoded:
                bar.update(len(ids))
                if val.total < val_tokens:  # a document may straddle the split
                    head = val_tokens - val.total
                    val.add(ids[:head])
                    ids = ids[head:]
                if ids:
                    train.add(ids)
    bar.close()
    splits = {"val": val.finish(), "train": train.finish()}
    if splits["train"]["tokens"] == 0:
        raise ConfigError(
            f"prepare: {dcfg.dataset} produced {splits['val']['tokens']} tokens, all taken by "
            f"the validation split (--val-tokens {val_tokens}); lower --val-tokens"
        )
    index = {
        "format": "torchllm-shards",
        "version": 1,
        "dataset": dcfg.dataset,
        "tokenizer": tokenizer_spec,
        "vocab_size": tokenizer.vocab_size,
        "bos_id": tokenizer.bos_id,
        "eos_id": tokenizer.eos_id,
        "dtype": dtype.name,
        "shard_tokens": shard_tokens,
        "splits": splits,
    }
    write_index(out, index)
    return index


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m torchllm.data.prepare", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", required=True,
                   help="embedded, a registry name, hf:NAME or local:PATH (as data.dataset)")
    p.add_argument("--tokenizer", required=True, help="tokenizer file or Hub name")
    p.add_argument("--out", required=True, help="folder to write shards and index.json into")
    p.add_argument("--shard-tokens", type=lambda s: int(s.replace("_", "")), default=100_000_000)
    p.add_argument("--val-tokens", type=lambda s: int(s.replace("_", "")), default=None,
                   help="tokens held out for validation (default: one shard)")
    p.add_argument("--workers", type=int, default=max(1, (mp.cpu_count() or 2) - 1))
    p.add_argument("--text-column", default="text")
    p.add_argument("--hf-subset", default="")
    p.add_argument("--hf-split", default="")
    args = p.parse_args(argv)
    if args.shard_tokens < 1 or args.workers < 1:
        p.error("--shard-tokens and --workers must be positive")
    tokenizer = args.tokenizer
    if Path(tokenizer).exists():
        tokenizer = str(Path(tokenizer).resolve())  # index.json must work from any directory
    dcfg = Data(dataset=args.dataset, text_column=args.text_column, hf_subset=args.hf_subset,
                hf_split=args.hf_split)
    val_tokens = args.shard_tokens if args.val_tokens is None else args.val_tokens
    try:
        index = prepare(dcfg, tokenizer, Path(args.out), args.shard_tokens, val_tokens,
                        args.workers)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for name, split in index["splits"].items():
        print(f"{name}: {split['tokens']:,} tokens, {split['documents']:,} documents, "
              f"{len(split['shards'])} shards ({index['dtype']})")
    print(f"wrote {Path(args.out) / 'index.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
