"""Benchmark harness: a matrix of parallelism / AC / compile / float8 variants, each a real
multi-process training run of the Trainer, reported as throughput, step times, memory (measured
and estimated), MFU and the final loss. Entry point: `python -m torchllm.bench --help`."""
