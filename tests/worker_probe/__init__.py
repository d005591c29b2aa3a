"""An optimizer that records which process builds it: AdamW, plus a JSON file per rank saying how
the worker started (its command line, sys.argv, pid, parent, thread count).
tests/e2e/test_launch_path.py imports it through the config (`job.custom_import = "worker_probe"`,
tests/ on PYTHONPATH)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

from torchllm.optim import OptimizerSpec, get, register

PROBE_ENV = "TORCHLLM_TEST_WORKER_PROBE"  # the files' prefix: PREFIX.<rank>.json
ADAMW = get("adamw")


def probe_adamw(model, ocfg, device):
    prefix = os.environ.get(PROBE_ENV)
    if prefix:
        Path(f"{prefix}.{os.environ.get('RANK', '0')}.json").write_text(json.dumps({
            "argv": sys.orig_argv, "sys_argv": sys.argv, "pid": os.getpid(), "ppid": os.getppid(),
            "threads": torch.get_num_threads()}))
    return ADAMW.build(model, ocfg, device)


register(OptimizerSpec(name="probe_adamw", build=probe_adamw, keys=ADAMW.keys,
                       hparams=ADAMW.hparams))
