"""Run by torchrun from tests/integration/test_parallel_multiprocess.py: several training variants
in one process group, so that the cost of starting N Python processes is paid once.

    torchrun --nproc_per_node=N tests/parallel_worker.py SPEC.json OUT.json

SPEC: {"runs": {name: [cli args]}, "steps": int, "count_sync": [name, ...],
"record_dtypes": [name, ...], "record_qk_norm": [name, ...], "validate": [name, ...],
"train": [name, ...], "ep_layer": PATH} (train runs: Trainer.train(), as `python -m
torchllm.train` would, its checkpoints and events written; OUT holds nothing of them; ep_layer,
optional: also expert_parallel_worker's layer cases, saved there). OUT
(rank 0): {name: {"loss": [...], "grad_norm": [...], "all_reduce_dtypes": {dtype: calls}
(record_dtypes runs), "qk_norm": [{param: values} per rank] (record_qk_norm runs), "val": every
rank's in-training validation after the last step (validate runs: {"val/loss", "val/tokens",
...} per rank)}, "sync_counts": {name: {...}},
"host_syncs": {name: [event, ...]}} (see test_host_syncs.step_events).
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections import Counter
from unittest import mock

import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from torchllm.config import load_config
from torchllm.parallel import destroy_distributed, gradient_sync
from torchllm.run.process_exit import exit_process
from torchllm.train import Trainer

from builders.metrics import step_events


def reduce_collectives(trainer: Trainer, n_micro: int, always_sync: bool = False) -> int:
    """All-reduce / reduce-scatter calls issued by one forward_backward over n_micro batches."""
    batches = [next(trainer.batches) for _ in range(n_micro)]
    patch = mock.patch("torchllm.train_module.gradient_sync",
                       lambda model, enabled, pcfg: gradient_sync(model, True, pcfg)) if always_sync else None
    if patch:
        patch.start()
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            trainer.module.train_batch(batches)
    finally:
        if patch:
            patch.stop()
    trainer.optimizer.zero_grad(set_to_none=True)
    names = Counter(e.name for e in prof.events())
    return sum(n for name, n in names.items()
               if name.startswith("gloo:") and ("reduce" in name))


def recording_all_reduce_dtypes(counts: Counter):
    """Patch torch.distributed.all_reduce (what DDP comm hooks call) to count the dtypes it
    reduces; the default reducer's own all-reduces (no hook) go through C++ and are not seen."""
    all_reduce = dist.all_reduce

    def recording(tensor, *args, **kwargs):
        counts[str(tensor.dtype)] += 1
        return all_reduce(tensor, *args, **kwargs)

    return mock.patch.object(dist, "all_reduce", recording)


def qk_norm_weights(model) -> dict[str, list[float]]:
    """The QK-norm weights as this rank holds them (a TP Replicate DTensor's local copy)."""
    return {name: (p.to_local() if hasattr(p, "to_local") else p).detach().flatten().tolist()
            for name, p in model.named_parameters() if "q_norm" in name or "k_norm" in name}


def main(spec_path: str, out_path: str) -> None:
    spec = json.loads(open(spec_path).read())
    results: dict = {"sync_counts": {}}
    for name, args in spec["runs"].items():
        trainer = Trainer(load_config(args))
        if name in spec.get("train", []):
            trainer.train()
            trainer.close()
            continue
        dtypes: Counter = Counter()
        with (recording_all_reduce_dtypes(dtypes) if name in spec.get("record_dtypes", [])
              else contextlib.nullcontext()):
            metrics = [trainer.train_step() for _ in range(spec["steps"])]
        results[name] = {k: [m[k] for m in metrics] for k in ("loss", "grad_norm")}
        results[name]["precision"] = trainer.module.precision_name()
        if name in spec.get("record_dtypes", []):
            results[name]["all_reduce_dtypes"] = dict(dtypes)
        if name in spec.get("record_qk_norm", []):  # every rank's copy of the replicated weights
            mine = qk_norm_weights(trainer.model)
            ranks = [None] * dist.get_world_size()
            dist.all_gather_object(ranks, mine)
            results[name]["qk_norm"] = ranks
        if name in spec.get("validate", []):  # what the Evaluator logs at the last step
            ranks = [None] * dist.get_world_size()
            dist.all_gather_object(ranks, trainer.evaluator.validation(spec["steps"]))
            results[name]["val"] = ranks
        if name in spec.get("count_sync", []):
            results["sync_counts"][name] = {
                "one_micro_step": reduce_collectives(trainer, 1),
                "three_micro_steps": reduce_collectives(trainer, 3),
                "three_micro_steps_always_sync": reduce_collectives(trainer, 3, always_sync=True),
            }
            results["host_syncs"] = results.get("host_syncs", {})
            results["host_syncs"][name] = step_events(trainer)
        trainer.close()
        del trainer
    if spec.get("ep_layer"):  # in this launch's process group: no launch of its own
        from torch.distributed.device_mesh import init_device_mesh

        import torch
        from expert_parallel_worker import CASES, run

        mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("ep",))
        layers = {case: run(case, mesh) for case in CASES}
        if dist.get_rank() == 0:
            torch.save(layers, spec["ep_layer"])
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)
    destroy_distributed()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    exit_process(0)  # not sys.exit: see torchllm.run.process_exit
