"""Run by torchrun from tests/test_checkpoint_dist.py: build a Trainer (which resumes from the
run's latest checkpoint) and, on rank 0, write the full loaded model and optimizer state.

    torchrun --nproc_per_node=N tests/checkpoint_worker.py OUT.pt [--section.key=value ...]

OUT holds {"model.<fqn>": tensor, "optimizer.state.<fqn>.<name>": tensor}: the same flattened
keys as a DCP checkpoint, so a test compares it with what the checkpoint holds.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)

from torchllm.config import load_config
from torchllm.parallel import destroy_distributed
from torchllm.process_exit import exit_process
from torchllm.train import Trainer


def main(out: str, args: list[str]) -> None:
    trainer = Trainer(load_config(args))
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model = get_model_state_dict(trainer.model, options=full)
    optim = get_optimizer_state_dict(trainer.model, trainer.optimizer, options=full)
    if dist.get_rank() == 0:
        flat = {f"model.{k}": v for k, v in model.items()}
        for fqn, state in optim["state"].items():
            flat.update({f"optimizer.state.{fqn}.{k}": v for k, v in state.items()})
        torch.save(flat, out)
    destroy_distributed()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
    exit_process(0)  # not sys.exit: see torchllm.process_exit
