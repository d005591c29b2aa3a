"""Tokenize a dataset once into fixed-size shards, so training reads tokens instead of text.

    python -m torchllm.data.prepare --dataset local:corpus/ --tokenizer tok.model --out DIR|URL \
        [--shard-tokens 100_000_000] [--val-fraction 0.005] [--val-max-tokens 10_000_000]
        [--val-tokens N] [--workers 2]

Documents are read in order, tokenized with BOS/EOS in --workers processes (order preserved;
with 1, in this one) and each appended to one of two splits, cut into shards of exactly
--shard-tokens tokens (the last may be shorter). See torchllm/data/sources/shards.py for the
format.

The validation split is proportional by default: a document goes to it whenever the split holds
less than --val-fraction of the tokens read so far (so the first document always does, and then
about every 1/fraction-th token's document), until it reaches --val-max-tokens. A document longer
than 2,048 tokens that does not fit in the fraction is cut: validation gets its first tokens, up
to the fraction, training the rest (so validation stays within the fraction + 2,048 tokens,
whatever the document sizes). A corpus of a single document gives its first tokens to
validation instead. --val-tokens N takes exactly the
first N tokens instead (a document cut there starts the training split with its tail).
Documents with no text (empty or whitespace only) are skipped.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import itertools
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

from torchllm.config.job_config import ConfigError
from torchllm.config.sections import Data
from torchllm.data.sources.shards import INDEX, SHARD_FILE, storage_of, token_dtype, write_doc_starts, \
    write_index, write_shard
from torchllm.data.dataset import documents
from torchllm.data.tokenizer import load_tokenizer, tokenizer_sha256
from torchllm.storage import Location, as_location, is_url, join

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


class ValSplit:
    """Decides, document by document, which tokens go to the validation split.

    Proportional: a document goes to validation while the split holds less than `fraction` of
    the tokens read (counting the document). It goes whole when it fits in the split's room
    (ceil(fraction x tokens read) - validation tokens) or is at most WHOLE_DOCUMENT tokens long;
    a longer one gives validation only its first `room` tokens and training the rest. So the
    split ends within fraction x total + WHOLE_DOCUMENT tokens, whatever the document sizes.
    """

    WHOLE_DOCUMENT = 2048  # tokens: a document this short may go to validation whole

    def __init__(self, val_tokens: int | None, fraction: float, max_tokens: int):
        self.val_tokens, self.fraction, self.max_tokens = val_tokens, fraction, max_tokens
        self.seen = 0  # tokens read so far, both splits

    def take(self, n: int, val_total: int) -> int:
        """How many of the next document's n tokens (from its start) go to validation."""
        self.seen += n
        if self.val_tokens is not None:  # exactly the first val_tokens tokens
            return max(0, min(n, self.val_tokens - val_total))
        cap = self.max_tokens - val_total
        if val_total >= self.fraction * self.seen or cap <= 0:
            return 0
        room = int(-(-self.fraction * self.seen // 1)) - val_total  # ceil(fraction x seen) - val
        if n <= max(room, self.WHOLE_DOCUMENT):
            return min(n, cap)  # a whole document, up to the cap
        return min(room, cap)  # a long document: only as far as the fraction allows


TMP_PREFIX = ".prepare-tmp-"  # the folder inside --out a run writes into before the swap


def check_out(out: Location, overwrite: bool) -> None:
    """--out must be new or empty, or (with overwrite) hold only an earlier prepare's files."""
    if is_url(out):
        entries = list(storage_of(out).files(out))
    elif out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file; name a folder")
    else:
        entries = [p.name for p in out.iterdir() if not p.name.startswith(TMP_PREFIX)] \
            if out.is_dir() else []
    if not entries:
        return
    foreign = sorted(n for n in entries if n != INDEX and not SHARD_FILE.fullmatch(n))
    if foreign:
        raise ConfigError(f"--out {out} holds files prepare does not write "
                          f"({', '.join(foreign[:3])}{', ...' if len(foreign) > 3 else ''}); "
                          "choose a new or empty folder")
    if not overwrite:
        raise ConfigError(f"--out {out} already holds shards ({len(entries)} files); pass "
                          "--overwrite to replace them, or choose a new or empty folder")


def swap_in(tmp: Path, out: Location) -> None:
    """Replace out's shard files by tmp's. The old index goes first and the new one comes
    last, so no moment has an index listing shards of another corpus (on a store: uploads,
    the index object last)."""
    storage = storage_of(out)
    storage.remove_file(join(out, INDEX))
    for old in storage.files(out):
        if SHARD_FILE.fullmatch(old):
            storage.remove_file(join(out, old))
    for new in sorted(tmp.iterdir(), key=lambda p: p.name == INDEX):
        if storage.remote:
            storage.upload(new, join(out, new.name))
            new.unlink()
        else:
            new.replace(out / new.name)
    tmp.rmdir()


def prepare(dcfg: Data, tokenizer_spec: str, out: Location, shard_tokens: int,
            val_tokens: int | None, workers: int, docs_per_task: int = 64,
            progress: bool = True, val_fraction: float = 0.005,
            val_max_tokens: int = 10_000_000, overwrite: bool = False) -> dict:
    """Write the shards and index.json; returns the index.

    val_tokens = None: the proportional split (val_fraction, at least one document, at most
    val_max_tokens); else exactly the first val_tokens tokens. Everything is written into a
    temporary folder inside `out` (for an object-store URL: a local temporary folder) and
    swapped in at the end: a run that fails leaves `out` as it was. A used `out` is refused
    unless overwrite.
    """
    out = as_location(out)
    check_out(out, overwrite)
    created = not is_url(out) and not out.exists()
    tmp = (Path(tempfile.mkdtemp(prefix=TMP_PREFIX)) if is_url(out)
           else out / f"{TMP_PREFIX}{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    try:
        index = _prepare(dcfg, tokenizer_spec, tmp, shard_tokens, val_tokens, workers,
                         docs_per_task, progress, val_fraction, val_max_tokens)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if created:
            shutil.rmtree(out, ignore_errors=True)  # nothing else was ever in it
        raise
    try:
        swap_in(tmp, out)
    finally:
        if is_url(out):  # the local staging copy (uploaded, or not: the store keeps no index)
            shutil.rmtree(tmp, ignore_errors=True)
    return index


def _prepare(dcfg: Data, tokenizer_spec: str, out: Path, shard_tokens: int,
             val_tokens: int | None, workers: int, docs_per_task: int, progress: bool,
             val_fraction: float, val_max_tokens: int) -> dict:
    from tqdm import tqdm

    tokenizer = load_tokenizer(tokenizer_spec)
    dtype = token_dtype(tokenizer.vocab_size)
    val = SplitWriter(out, "val", shard_tokens, dtype)
    train = SplitWriter(out, "train", shard_tokens, dtype)
    split = ValSplit(val_tokens, val_fraction, val_max_tokens)
    texts = (t for t in documents(dcfg) if t.strip())
    tasks = iter(lambda: list(itertools.islice(texts, docs_per_task)), [])
    bar = tqdm(unit="tok", unit_scale=True, disable=not progress, desc="tokenizing")
    # The first document waits for the second: a one-document corpus is split inside it.
    first: list[int] | None = None
    n_docs = 0

    def add(ids: list[int]) -> None:
        head = split.take(len(ids), val.total)
        if head:  # a document may straddle the split
            val.add(ids[:head])
        if ids[head:]:
            train.add(ids[head:])

    with contextlib.ExitStack() as stack:
        if workers > 1:
            pool = stack.enter_context(
                mp.get_context("spawn").Pool(workers, _init_worker, (tokenizer_spec,)))
            batches = pool.imap(_encode, tasks)
        else:  # one worker would only take turns with this process: encode here
            batches = ([tokenizer.encode(t, bos=True, eos=True) for t in task] for task in tasks)
        for encoded in batches:
            for ids in encoded:
                bar.update(len(ids))
                n_docs += 1
                if n_docs == 1:
                    first = ids
                    continue
                if first is not None:
                    add(first)
                    first = None
                add(ids)
    bar.close()
    if n_docs == 0:
        raise ConfigError(f"prepare: {dcfg.dataset} is empty (no document has any text)",
                          "data.dataset")
    if first is not None:  # a single document: its first tokens are the validation split
        n = len(first)
        head = (min(n, val_tokens) if val_tokens is not None
                else min(max(1, round(val_fraction * n)), val_max_tokens))
        val.add(first[:head])
        train.add(first[head:])
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
        # The tokenizer file's SHA-256 (None: no file, "bytes" or a Hub name): a run training
        # on these shards must use this very tokenizer, not one of the same size.
        "tokenizer_sha256": tokenizer_sha256(tokenizer),
        "vocab_size": tokenizer.vocab_size,
        "bos_id": tokenizer.bos_id,
        "eos_id": tokenizer.eos_id,
        "dtype": dtype.name,
        "shard_tokens": shard_tokens,
        "splits": splits,
    }
    write_index(out, index)
    return index


def no_space(out: str, shard_tokens: int, e: OSError) -> str:
    """One line for a disk that filled up: where (the staging folder for a URL), what one
    shard needs, what is free now (the partial output is already removed)."""
    where = Path(tempfile.gettempdir()) if is_url(out) else Path(out).absolute()
    probe = where
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    free = shutil.disk_usage(probe).free / 2**30
    staged = f" (the local staging folder for {out})" if is_url(out) else ""
    return (f"no space left on {where}{staged} writing {e.filename or 'a shard'}: needs "
            f"~{shard_tokens * 4 / 2**30:.2g} GiB per shard (--shard-tokens {shard_tokens:,}, "
            f"up to 4 bytes a token), {free:.2g} GiB free; the partial output was removed")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m torchllm.data.prepare", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", required=True,
                   help="embedded, a registry name, hf:NAME or local:PATH (as data.dataset)")
    p.add_argument("--tokenizer", required=True, help="tokenizer file or Hub name")
    p.add_argument("--out", required=True, help="folder to write shards and index.json into "
                   "(new or empty), or an object-store URL (s3://bucket/prefix; the shards are "
                   "staged in a local temporary folder, then uploaded, index.json last)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the shards of an earlier prepare in --out (only once this one "
                   "has finished)")
    p.add_argument("--shard-tokens", type=lambda s: int(s.replace("_", "")), default=100_000_000)
    p.add_argument("--val-fraction", type=float, default=0.005,
                   help="fraction of the tokens held out for validation, in whole documents "
                   "(at least one; a longer one than 2,048 tokens is cut to the fraction)")
    p.add_argument("--val-max-tokens", type=lambda s: int(s.replace("_", "")),
                   default=10_000_000, help="cap on the proportional validation split")
    p.add_argument("--val-tokens", type=lambda s: int(s.replace("_", "")), default=None,
                   help="hold out exactly the first N tokens instead")
    p.add_argument("--workers", type=int, default=max(1, (mp.cpu_count() or 2) - 1),
                   help="tokenizer processes (1: tokenize in this process; default: cores - 1)")
    p.add_argument("--text-column", default="text")
    p.add_argument("--hf-subset", default="")
    p.add_argument("--hf-split", default="")
    args = p.parse_args(argv)
    if args.shard_tokens < 1 or args.workers < 1 or args.val_max_tokens < 1:
        p.error("--shard-tokens, --val-max-tokens and --workers must be positive")
    if not 0 < args.val_fraction < 1:
        p.error(f"--val-fraction {args.val_fraction}: must be between 0 and 1 (e.g. 0.005)")
    if args.val_tokens is not None and args.val_tokens < 1:
        p.error(f"--val-tokens {args.val_tokens}: must be positive")
    tokenizer = args.tokenizer
    if Path(tokenizer).exists():
        tokenizer = str(Path(tokenizer).resolve())  # index.json must work from any directory
    dcfg = Data(dataset=args.dataset, text_column=args.text_column, hf_subset=args.hf_subset,
                hf_split=args.hf_split)
    try:
        index = prepare(dcfg, tokenizer, args.out, args.shard_tokens, args.val_tokens,
                        args.workers, val_fraction=args.val_fraction,
                        val_max_tokens=args.val_max_tokens, overwrite=args.overwrite)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        if e.errno != errno.ENOSPC:
            raise
        print(f"error: {no_space(args.out, args.shard_tokens, e)}", file=sys.stderr)
        return 1
    for name, split in index["splits"].items():
        print(f"{name}: {split['tokens']:,} tokens, {split['documents']:,} documents, "
              f"{len(split['shards'])} shards ({index['dtype']})")
    print(f"wrote {join(as_location(args.out), INDEX)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
