"""Run by torchrun from tests/integration/test_checkpoint_dist.py: rank 1 alone fails to apply the
first checkpoint it loads (a rank-local failure after DCP's collective read), then every rank's
resumed step is written, gathered, by rank 0.

    torchrun --nproc_per_node=2 tests/checkpoint_fault_worker.py OUT.json [--section.key=value ...]
"""

from __future__ import annotations

import json
import sys

import torch.distributed as dist

from torchllm.checkpoint.state import RNGState
from torchllm.config import load_config
from torchllm.parallel import destroy_distributed
from torchllm.run.process_exit import exit_process
from torchllm.train import Trainer


def main(out: str, args: list[str]) -> None:
    real = RNGState.load_state_dict
    calls = []

    def fail_first_on_rank_1(self, state):
        calls.append(state)
        if dist.get_rank() == 1 and len(calls) == 1:
            raise OSError("simulated rank-local failure")
        real(self, state)

    RNGState.load_state_dict = fail_first_on_rank_1
    trainer = Trainer(load_config(args))
    steps = [None] * dist.get_world_size()
    dist.all_gather_object(steps, trainer.step)
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(steps, f)
    destroy_distributed()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
    exit_process(0)  # not sys.exit: see torchllm.run.process_exit
