"""ParallelPlan: the config sections parallelize_model applies to a model, and nothing more.

parallel/ takes a module and its options, never the whole JobConfig (docs/architecture.md,
"components"): whoever holds the config (the trainer's build_model, the dry run, a test) names
the four sections and the precision here, and the plan travels instead of the config.
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

    def without_compile(self) -> ParallelPlan:
        """The same plan with compile.enable off (the dry run: tracing happens at the first call,
        not when the plan is applied)."""
        return dataclasses.replace(self, compile=dataclasses.replace(self.compile, enable=False))
