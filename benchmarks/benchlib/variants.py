"""The benchmark matrix: named variants and the config overrides that realize them."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

# Layouts, as overrides of [parallelism] (hsdp's and cp's degrees depend on the world).
# cp = context parallelism 2 x FSDP2 over the rest (sequences split in two; seq_len % 4 == 0).
# pp = pipeline parallelism 2 (1F1B, micro-batches of one sequence) x FSDP2 over the rest.
LAYOUTS = ("ddp", "fsdp2", "fsdp2_noreshard", "hsdp", "cp", "pp")
AC_MODES = ("none", "full", "selective")
COMPILE = ("off", "on")
FLOAT8 = ("off", "tensorwise", "rowwise")


@dataclass
class Variant:
    layout: str
    ac: str = "none"
    compile: str = "off"
    float8: str = "off"

    @property
    def name(self) -> str:
        parts = [self.layout]
        if self.ac != "none":
            parts.append(f"ac_{self.ac}")
        if self.compile == "on":
            parts.append("compile")
        if self.float8 != "off":
            parts.append(f"float8_{self.float8}")
        return "+".join(parts)

    def unsupported(self, nproc: int) -> str | None:
        """Why this layout cannot run on `nproc` ranks (decided before launching), or None."""
        if nproc < 2:
            return f"{self.layout} needs >= 2 ranks; --nproc is {nproc}"
        if self.layout == "hsdp" and (nproc < 4 or nproc % 2):
            return (f"hsdp needs an even world of >= 4 ranks (2 replicas x >= 2 shards); "
                    f"--nproc is {nproc}")
        if self.layout in ("cp", "pp") and nproc % 2:
            dim = "context" if self.layout == "cp" else "pipeline"
            return (f"{self.layout} needs an even world ({dim}_parallel_degree 2); --nproc is "
                    f"{nproc}")
        return None

    def overrides(self, nproc: int) -> list[str]:
        o = {
            "ddp": ["--parallelism.dp_mode=ddp", "--parallelism.data_parallel_shard_degree=-1",
                    "--parallelism.data_parallel_replicate_degree=1"],
            "fsdp2": ["--parallelism.dp_mode=fsdp", "--parallelism.data_parallel_shard_degree=-1",
                      "--parallelism.data_parallel_replicate_degree=1",
                      "--parallelism.fsdp_reshard_after_forward=default"],
            "fsdp2_noreshard": ["--parallelism.dp_mode=fsdp",
                                "--parallelism.data_parallel_shard_degree=-1",
                                "--parallelism.data_parallel_replicate_degree=1",
                                "--parallelism.fsdp_reshard_after_forward=never"],
            "hsdp": ["--parallelism.dp_mode=fsdp",
                     f"--parallelism.data_parallel_shard_degree={nproc // 2}",
                     "--parallelism.data_parallel_replicate_degree=2"],
            "cp": ["--parallelism.dp_mode=fsdp", "--parallelism.context_parallel_degree=2",
                   "--parallelism.data_parallel_shard_degree=-1",
                   "--parallelism.data_parallel_replicate_degree=1"],
            "pp": ["--parallelism.dp_mode=fsdp", "--parallelism.pipeline_parallel_degree=2",
                   "--parallelism.pipeline_parallel_schedule=1F1B",
                   "--parallelism.pipeline_parallel_microbatch_size=1",
                   "--parallelism.data_parallel_shard_degree=-1",
                   "--parallelism.data_parallel_replicate_degree=1"],
        }[self.layout]
        o.append(f"--activation_checkpoint.mode={self.ac}")
        o.append(f"--compile.enable={'true' if self.compile == 'on' else 'false'}")
        if self.float8 == "off":
            o.append("--float8.enable=false")
        else:
            o += ["--float8.enable=true", f"--float8.recipe={self.float8}"]
        return o


def parse_list(flag: str, value: str, allowed: tuple[str, ...]) -> list[str]:
    """'a,b' -> ['a', 'b'], each checked against `allowed` (ValueError names the flag)."""
    items = [v.strip() for v in value.split(",") if v.strip()]
    bad = [v for v in items if v not in allowed]
    if bad or not items:
        raise ValueError(f"{flag} {value!r}: use a comma-separated list of {', '.join(allowed)}")
    return items


def build_matrix(layouts, ac, compile_, float8) -> list[Variant]:
    return [Variant(*combo) for combo in itertools.product(layouts, ac, compile_, float8)]
