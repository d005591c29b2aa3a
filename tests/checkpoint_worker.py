"""Run by torchrun from tests/integration/test_checkpoint_dist.py: build a Trainer (which resumes
from the run's latest checkpoint) and, on rank 0, write the full loaded model and optimizer state.

    torchrun --nproc_per_node=N tests/checkpoint_worker.py OUT.pt [--section.key=value ...]
    torchrun --nproc_per_node=N tests/checkpoint_worker.py --jobs JOBS.json

JOBS.json lists several runs for one launch, in order: {"train": [overrides]} trains a run to
its end (as `python -m torchllm.train` would), {"load": [overrides], "out": OUT.pt} loads and
writes as above. One launch instead of one per run: each launch costs seconds of start-up.

OUT holds {"model.<fqn>": tensor, "optimizer.state.<fqn>.<name>": tensor}: the same flattened
keys as a DCP checkpoint, so a test compares it with what the checkpoint holds.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)

from torchllm.config import load_config
from torchllm.parallel import destroy_distributed
from torchllm.run.process_exit import exit_process
from torchllm.train import Trainer


def dump(out: str, args: list[str]) -> None:
    trainer = Trainer(load_config(args))
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model = get_model_state_dict(trainer.model, options=full)
    optim = get_optimizer_state_dict(trainer.model, trainer.optimizer, options=full)
    if dist.get_rank() == 0:
        flat = {f"model.{k}": v for k, v in model.items()}
        for fqn, state in optim["state"].items():
            flat.update({f"optimizer.state.{fqn}.{k}": v for k, v in state.items()})
        torch.save(flat, out)
    trainer.close()


def main(argv: list[str]) -> None:
    if argv[0] == "--jobs":
        for job in json.loads(Path(argv[1]).read_text()):
            if "train" in job:
                Trainer(load_config(job["train"])).train()
            else:
                dump(job["out"], job["load"])
    else:
        dump(argv[0], argv[1:])
    destroy_distributed()


if __name__ == "__main__":
    main(sys.argv[1:])
    exit_process(0)  # not sys.exit: see torchllm.run.process_exit
