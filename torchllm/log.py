"""The `torchllm` logger.

Every rank logs; which ranks reach the console is the launcher's choice: run_train.sh passes
LOG_RANK to torchrun's --local-ranks-filter (default rank 0), and torchrun's `--role rank --tee`
puts `[rankN]:` in front of each line.
"""

from __future__ import annotations

import logging
import warnings

logger = logging.getLogger("torchllm")

# Library lines that say nothing about the run, at the level below which they are dropped:
# torchao's "Failed to load ..._C_mxfp8 / _C_cutlass_90a" for kernels of other GPU generations
# (logged on import), and torch's note on torchao registering an Enum with the pytree.
QUIET_LOGGERS = {"torchao": logging.ERROR, "torch.utils._pytree": logging.ERROR}
# Warnings repeated on every checkpoint save/load of a single-process run.
QUIET_WARNINGS = [("torch.distributed is disabled, unavailable or uninitialized", UserWarning)]


def quiet_library_noise() -> None:
    """Drop the library log lines and warnings above (nothing else)."""
    for name, level in QUIET_LOGGERS.items():
        logging.getLogger(name).setLevel(level)
    for message, category in QUIET_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)


quiet_library_noise()  # at import: every entry point (train, generate, hf, hellaswag) gets it


def init_logger() -> None:
    logger.handlers.clear()
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    quiet_library_noise()
