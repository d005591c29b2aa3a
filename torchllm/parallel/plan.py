"""ParallelPlan: the config sections parallelize_model applies to a model, and nothing more.

parallel/ takes a module and its options, never the whole JobConfig (docs/architecture.md,
"components"): whoever holds the config (the trainer, the memory estimate, the dry run, a test)
builds the plan once from its sections (ParallelPlan.of), and the plan travels instead of the
config.
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class ParallelPlan:
    """What parallelize_model (and a pipeline's stages) apply: the [parallelism] options (FSDP2's
    reshard policy and dtypes, DDP's buckets and hook, the pipeline schedule), [float8],
    [activation_checkpoint], [compile], and training.mixed_precision (FSDP2's param dtype when
    the run has not decided it: ParallelDims.bf16 None). `static_ddp_buckets`: DDP never
    rebuilds its buckets (fault tolerance: a relaunched group's buckets match its peers')."""
    parallelism: Any
    float8: Any
    activation_checkpoint: Any
    compile: Any
    mixed_precision: str
    static_ddp_buckets: bool = False

    @classmethod
    def of(cls, *, parallelism, float8, activation_checkpoint, compile, training,
           fault_tolerance=None) -> ParallelPlan:
        """The plan of a run's sections: [parallelism], [float8], [activation_checkpoint],
        [compile], [training] (its mixed_precision) and, when given, [fault_tolerance] (on:
        DDP's buckets are static)."""
        return cls(parallelism, float8, activation_checkpoint, compile,
                   training.mixed_precision,
                   static_ddp_buckets=bool(fault_tolerance is not None
                                           and fault_tolerance.enable))

    def without_compile(self) -> ParallelPlan:
        """The same plan with compile.enable off (the dry run: tracing happens at the first call,
        not when the plan is applied)."""
        return dataclasses.replace(self, compile=dataclasses.replace(self.compile, enable=False))
