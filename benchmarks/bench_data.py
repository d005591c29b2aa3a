"""Data-loader speed: tokens/s from shards and from local parquet vs what a training step eats.

    PYTHONPATH=. python benchmarks/bench_data.py [--out outputs/bench_data.json] [--steps 10]

The corpus is CPython's embedded docs, repeated to --tokens tokens, with a SentencePiece tokenizer
trained on it (no download). The loader must deliver at least 10x the tokens/s of a debug-model
training step, so the step never waits for data; the trainer's own data-wait share of step time
is reported too. Prints a table and writes the numbers as JSON.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from torchllm.config import load_config
from torchllm.data import Batching, build_data, build_tokenizer
from torchllm.data.prepare import prepare
from torchllm.data.sources.embedded import embedded_documents
from torchllm.train import Trainer

REPO = Path(__file__).resolve().parents[1]


def loader_tokens_per_s(cfg, tokenizer, batches: int) -> tuple[float, float]:
    """(tokens/s over `batches` batches after the first, seconds to build and yield the first)."""
    t0 = time.perf_counter()
    batching = Batching.of(cfg.training, cfg.job, cfg.model)
    loader, _ = build_data(cfg.data, cfg.validation, batching, tokenizer, 0, 1)
    it = iter(loader)
    first = next(it)
    startup = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(batches):
        next(it)
    elapsed = time.perf_counter() - t0
    return batches * first["inputs"].numel() / elapsed, startup


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(REPO / "outputs" / "bench_data.json"))
    p.add_argument("--tokens", type=int, default=2_000_000, help="corpus size, roughly")
    p.add_argument("--batches", type=int, default=200, help="batches timed per loader")
    p.add_argument("--steps", type=int, default=10, help="training steps timed")
    args = p.parse_args()
    torch.set_num_threads(2)

    work = Path(tempfile.mkdtemp(prefix="bench_data_"))
    base = ["--job.config_file", str(REPO / "train_configs" / "debug_model.toml"),
            f"--job.dump_folder={work}", "--job.print_config=false"]
    cfg = load_config(base)
    tokenizer = build_tokenizer(cfg.data, work / "tok")
    tok_path = str(next((work / "tok").glob("*.model")))

    docs = embedded_documents()
    per_pass = sum(len(tokenizer.encode(d)) + 2 for d in docs)
    repeats = max(1, args.tokens // per_pass)
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": docs * repeats}), work / "corpus.parquet")
    t0 = time.perf_counter()
    index = prepare(load_config([*base, f"--data.dataset=local:{work / 'corpus.parquet'}"]).data,
                    tok_path, work / "shards", shard_tokens=500_000, val_tokens=50_000,
                    workers=2, progress=False)
    prepare_s = time.perf_counter() - t0
    corpus_tokens = sum(s["tokens"] for s in index["splits"].values())

    rows = []
    for name, dataset in (("shards", f"shards:{work / 'shards'}"),
                          ("local parquet", f"local:{work / 'corpus.parquet'}")):
        for workers in (0, 2):
            c = load_config([*base, f"--data.dataset={dataset}", f"--data.tokenizer={tok_path}",
                             f"--data.num_workers={workers}"])
            tps, startup = loader_tokens_per_s(c, tokenizer, args.batches)
            rows.append({"source": name, "num_workers": workers, "tokens_per_s": tps,
                         "startup_s": startup})

    # What training consumes: the debug model's step on the shards, data wait included.
    trainer = Trainer(load_config([*base, f"--data.dataset=shards:{work / 'shards'}",
                                   f"--data.tokenizer={tok_path}",
                                   f"--training.steps={args.steps + 2}"]))
    trainer.train_step()  # warm-up
    step_times, data_times = [], []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        m = trainer.train_step()
        step_times.append(time.perf_counter() - t0)
        data_times.append(m["data_time"])
    step_s = sum(step_times) / len(step_times)
    tokens_per_step = trainer.global_batch * cfg.training.seq_len
    step_tps = tokens_per_step / step_s
    data_pct = 100 * sum(data_times) / sum(step_times)

    print(f"corpus: {corpus_tokens:,} tokens; prepare (2 workers) took {prepare_s:.1f}s")
    print(f"{'source':<14} {'workers':>7} {'tokens/s':>12} {'x step':>8} {'startup s':>10}")
    for r in rows:
        r["x_training_step"] = r["tokens_per_s"] / step_tps
        print(f"{r['source']:<14} {r['num_workers']:>7} {r['tokens_per_s']:>12,.0f} "
              f"{r['x_training_step']:>7.0f}x {r['startup_s']:>10.2f}")
    print(f"debug-model step: {step_s * 1000:.0f} ms for {tokens_per_step:,} tokens = "
          f"{step_tps:,.0f} tokens/s; data wait {data_pct:.2f}% of step time")
    result = {
        "corpus_tokens": corpus_tokens, "prepare_s": prepare_s, "loaders": rows,
        "step_ms": step_s * 1000, "step_tokens_per_s": step_tps,
        "data_wait_pct_of_step": data_pct, "threads": torch.get_num_threads(),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
