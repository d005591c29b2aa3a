"""The `torchllm` logger.

Every rank logs; which ranks reach the console is the launcher's choice: run_train.sh passes
LOG_RANK to torchrun's --local-ranks-filter (default rank 0), and torchrun's `--role rank --tee`
puts `[rankN]:` in front of each line.
"""

from __future__ import annotations

import logging

logger = logging.getLogger("torchllm")


def init_logger() -> None:
    logger.handlers.clear()
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
