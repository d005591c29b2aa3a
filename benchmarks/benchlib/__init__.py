"""What the benchmarks in benchmarks/ share: one training run observed per rank (`worker`, the
Trainer's own loop), its rows and tables (`report`), the parallel benchmark's matrix
(`variants`), peak CPU tensor memory (`tensor_memory`), bench_gpu.py's variants table
(`gpu_variants`) and its transformers peer (`gpu_peer`), bench_time_to_loss.py's nanoGPT
contender (`nanogpt`).

The scripts run as `python benchmarks/bench_<name>.py`, so benchmarks/ is on sys.path and this
package imports as `benchlib`; a worker process gets the same path from `worker_env()`.
"""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BENCHMARKS = REPO / "benchmarks"
WORKER = "benchlib.worker"  # `python -m benchlib.worker OUT_DIR [--section.key=value ...]`


def worker_env(**extra: str) -> dict[str, str]:
    """The environment of a worker process: this checkout's torchllm and benchlib first."""
    path = [str(REPO), str(BENCHMARKS), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path), **extra}
