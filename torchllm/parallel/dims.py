"""ParallelDims: which parallel dimensions a run uses, validated against the world size."""

from __future__ import annotations

from dataclasses import dataclass

from torchllm.config.job_config import ConfigError


@dataclass
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    tp: int
    world_size: int

    @classmethod
    def from_config(cls, pcfg, world_size: int) -> "ParallelDims":
        dims = cls(
            dp_replicate=pcfg.data_parallel_replicate_degree,
            dp_shard=pcfg.data_parallel_shard_degree,
            tp=pcfg.tensor_parallel_degree,
            world_size=world_size,
        )
        dims.validate()
        return dims

    def validate(self) -> None:
        for name, value in (("data_parallel_replicate_degree", self.dp_replicate),
                            ("tensor_parallel_degree", self.tp)):
            if value < 1:
                raise ConfigError(f"parallelism.{name} = {value}: must be >= 1")
        if self.dp_shard == -1:
            rest = self.world_size // (self.dp_replicate * self.tp)
            self.dp_shard = max(rest, 1)
        elif self.dp_shard < 1:
            raise ConfigError(
                f"parallelism.data_parallel_shard_degree = {self.dp_shard}: must be >= 1 or -1"
            )
        product = self.dp_replicate * self.dp_shard * self.tp
        if product != self.world_size:
            raise ConfigError(
                f"parallelism degrees replicate={self.dp_replicate} x shard={self.dp_shard} x "
                f"tp={self.tp} = {product}, but the world size is {self.world_size}; make the "
                "product equal the number of processes (NGPU)"
            )
        if self.world_size > 1:
            raise ConfigError(
                f"world size {self.world_size}: multi-process training is not available yet; "
                "run with NGPU=1"
            )

    @property
    def dp_degree(self) -> int:
        return self.dp_replicate * self.dp_shard
