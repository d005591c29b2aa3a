"""Pipeline parallelism: the model's blocks split into stages, one or two per pp rank.

The split (`stage_blocks`): stage boundaries fall between transformer blocks. Automatic: the
embedding and the output head count as one block each, and the n_layers + 2 units are cut into
equal shares (rounded), every stage keeping at least one block; so with 8 blocks on 2 stages
each stage holds 4, and on 4 stages the first and last hold 1-2 blocks and the middle ones 2-3.
`pipeline_parallel_layers_per_stage = L` gives every stage exactly L blocks;
`pipeline_parallel_split_points = ["layers.2", ...]` names the first block of stages 1, 2, ...

A stage (`build_stage`) is the whole model built on the meta device with the other stages'
blocks deleted: `layers` stays a ModuleDict keyed by the original block index, the first stage
keeps the embedding, the last the final norm and the output head (the others set them to None;
the family declares these parts: ModelSpec.pipeline, models/spec.py's PipelinePlan),
so every parameter keeps the unsplit model's name. DCP checkpoints therefore load across PP and
non-PP layouts, and a PP checkpoint loads into a plain model for generation or export.

Stages live on ranks as torch.distributed.pipelining expects: stage s on pp rank s % pp for
the looped schedules (1F1B, GPipe: one stage per rank; Interleaved1F1B, InterleavedZeroBubble:
two), rank r holding stages r and 2·pp-1-r for the V-shaped ZBVZeroBubble.
"""

from __future__ import annotations

import torch
from torch import nn

from torchllm import models
from torchllm.config.job_config import ConfigError
from torchllm.models.contract import LanguageModel
from torchllm.parallel.init import seeded_full_state

# Schedules that put several (here: two) stages on every rank.
MULTI_STAGE = ("Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble")
V_SHAPED = ("ZBVZeroBubble",)


def stages_per_rank(schedule: str) -> int:
    return 2 if schedule in MULTI_STAGE else 1


def rank_stages(schedule: str, pp: int, pp_rank: int) -> list[int]:
    """The stage indices pp rank `pp_rank` runs, in order."""
    if schedule in V_SHAPED:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + i * pp for i in range(stages_per_rank(schedule))]


def schedule_class(name: str):
    """The installed torch's class for schedule `name`, or a ConfigError naming those it has."""
    from torch.distributed.pipelining import schedules

    try:
        return schedules.get_schedule_class(name)
    except (ValueError, AttributeError):
        known = [s for s in ("1F1B", "Interleaved1F1B", "GPipe", "ZBVZeroBubble",
                             "InterleavedZeroBubble") if _known(schedules, s)]
        raise ConfigError(
            f"parallelism.pipeline_parallel_schedule = {name!r} is not in this torch "
            f"({torch.__version__}); use one of {known}",
            "parallelism.pipeline_parallel_schedule",
        ) from None


def _known(schedules, name: str) -> bool:
    try:
        schedules.get_schedule_class(name)
        return True
    except (ValueError, AttributeError):
        return False


def stage_blocks(n_layers: int, n_stages: int, layers_per_stage: int = 0,
                 split_points: list[str] | tuple[str, ...] = ()) -> list[list[int]]:
    """The block indices of each stage (see the module docstring for the rule)."""
    key = "parallelism.pipeline_parallel_split_points"
    if split_points:
        if len(split_points) != n_stages - 1:
            raise ConfigError(
                f"{key} = {list(split_points)}: {n_stages} stages need {n_stages - 1} split "
                f"points (the first block of every stage after the first)", key)
        starts = []
        for point in split_points:
            name, _, index = point.partition(".")
            if name != "layers" or not index.isdigit():
                raise ConfigError(f"{key}: {point!r} is not a block name; use 'layers.<i>' "
                                  f"with 0 < i < n_layers ({n_layers})", key)
            starts.append(int(index))
        bounds = [0, *starts, n_layers]
        if any(b >= c for b, c in zip(bounds, bounds[1:])):
            raise ConfigError(
                f"{key} = {list(split_points)}: split points must increase strictly within "
                f"1..{n_layers - 1} (n_layers = {n_layers}) so that every stage keeps a block",
                key)
    elif layers_per_stage:
        lkey = "parallelism.pipeline_parallel_layers_per_stage"
        if layers_per_stage < 0 or layers_per_stage * n_stages != n_layers:
            raise ConfigError(
                f"{lkey} = {layers_per_stage}: {n_stages} stages x {layers_per_stage} blocks "
                f"!= n_layers ({n_layers}); use 0 (automatic) or a value with stages x value = "
                f"n_layers", lkey)
        bounds = [i * layers_per_stage for i in range(n_stages + 1)]
    else:
        if n_layers < n_stages:
            raise ConfigError(
                f"the model has {n_layers} blocks, fewer than the {n_stages} pipeline stages "
                f"(pipeline_parallel_degree x stages per rank); every stage needs a block: "
                f"use a smaller pipeline_parallel_degree or a deeper model",
                "parallelism.pipeline_parallel_degree")
        units = n_layers + 2  # the embedding and the head count as one block each
        bounds = [0]
        for s in range(1, n_stages):
            cut = int(s * units / n_stages + 0.5) - 1  # minus the embedding's unit
            bounds.append(min(max(cut, bounds[-1] + 1), n_layers - (n_stages - s)))
        bounds.append(n_layers)
    return [list(range(a, b)) for a, b in zip(bounds, bounds[1:])]


def check_pipeline(pcfg, tcfg, model_name: str, ecfg, model_args, pp: int) -> list[list[int]]:
    """Every pipeline check that needs no process group, of the [parallelism] and [training]
    sections, the family `model_name` and the [eval] section (in-training evals need the whole
    model); returns the stages' blocks."""
    name = pcfg.pipeline_parallel_schedule
    schedule_class(name)
    n_stages = pp * stages_per_rank(name)
    mb = pcfg.pipeline_parallel_microbatch_size
    mkey = "parallelism.pipeline_parallel_microbatch_size"
    if mb < 1 or tcfg.local_batch_size % mb:
        raise ConfigError(
            f"{mkey} = {mb} does not divide training.local_batch_size = "
            f"{tcfg.local_batch_size}; use a divisor of it", mkey)
    n_micro = tcfg.local_batch_size // mb
    # Every schedule needs as many micro-batches as ranks to fill the pipeline; the looped
    # interleaved ones walk them in n // pp rounds of equal size (torch's own check).
    rounds = max(1, n_micro // pp)
    if n_micro < pp or (name in MULTI_STAGE and name not in V_SHAPED and n_micro % rounds):
        need = (f"a number of micro-batches >= {pp} that splits into {rounds} equal rounds"
                if n_micro >= pp else f"at least {pp} micro-batches")
        raise ConfigError(
            f"{name} on {pp} pipeline ranks needs {need} per step, got "
            f"training.local_batch_size ({tcfg.local_batch_size}) / {mkey} ({mb}) = {n_micro}; "
            "use a multiple of pp micro-batches (local_batch_size / micro-batch size)", mkey)
    unsupported = [
        (models.get(model_name).pipeline is None, "model.name",
         f"model.name = {model_name!r} is not pipeline-parallel yet; use llama "
         "or qwen3 (RoPE models whose stages drop the embedding / head)"),
        (pcfg.expert_parallel_degree > 1, "parallelism.expert_parallel_degree",
         "expert_parallel_degree > 1 with pipeline_parallel_degree > 1 is not supported yet; "
         "shard the experts with FSDP2 (data_parallel_shard_degree) under PP, or use EP "
         "without PP"),
        (model_args.tie_embeddings, "model.tie_embeddings",
         "model.tie_embeddings = true cannot be split: the embedding (first stage) and the "
         "output head (last stage) would share a weight; set it to false"),
        (ecfg.sample_freq or ecfg.hellaswag_freq, "eval.sample_freq",
         "in-training samples and HellaSwag (eval.sample_freq, eval.hellaswag_freq) need the "
         "whole model; with pipeline_parallel_degree > 1 set them to 0 and run "
         "python -m torchllm.generate / the HellaSwag eval on the saved checkpoint"),
    ]
    for bad, key, message in unsupported:
        if bad:
            raise ConfigError(message, key)
    return stage_blocks(model_args.n_layers, n_stages, pcfg.pipeline_parallel_layers_per_stage,
                        pcfg.pipeline_parallel_split_points)


def build_stage(build: callable, plan, blocks: list[int], first: bool, last: bool
                ) -> LanguageModel:
    """The model on the meta device with only `blocks` (and the embedding if `first`, the final
    norm and head if `last`: `plan`, the family's PipelinePlan, names them); parameter names
    stay those of the whole model."""
    with torch.device("meta"):
        model = build()
    for name in list(model.layers.keys()):
        if int(name) not in blocks:
            del model.layers[name]
    for part in () if first else plan.first:
        setattr(model, part, None)
    for part in () if last else plan.last:
        setattr(model, part, None)
    return model


def rank_model(stages: list[LanguageModel], build: callable, plan) -> LanguageModel:
    """One module holding every parameter of this rank's stages under its unsplit name (for
    the optimizer, clipping and checkpoints): the stage itself, or for two stages per rank a
    meta shell whose parts are the stages' own modules (never run forward)."""
    if len(stages) == 1:
        return stages[0]
    with torch.device("meta"):
        union = build()
    for part in (*plan.first, *plan.last):
        setattr(union, part, next((getattr(s, part) for s in stages
                                   if getattr(s, part) is not None), None))
    layers = {k: v for s in stages for k, v in s.layers.items()}
    union.layers = nn.ModuleDict({k: layers[k] for k in sorted(layers, key=int)})
    return union


@torch.no_grad()
def init_stage_weights(stage: LanguageModel, build: callable, device: torch.device,
                       seed: int) -> None:
    """Materialize `stage` with the weights a single process initializes with `seed`: every
    rank builds and seeds the whole model on CPU (as torchllm.parallel.init does on rank 0) and
    keeps its stage's parameters; sharded ones are cut locally into this rank's shard."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )

    stage.to_empty(device=device)
    stage.init_buffers(device)
    full_state = seeded_full_state(build, seed)
    keys = get_model_state_dict(stage).keys()
    set_model_state_dict(stage, {k: full_state[k] for k in keys},
                         options=StateDictOptions(full_state_dict=True, strict=True))


__all__ = ["build_stage", "check_pipeline", "init_stage_weights", "rank_model", "rank_stages",
           "schedule_class", "stage_blocks", "stages_per_rank"]
