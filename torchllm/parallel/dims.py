"""ParallelDims: which parallel dimensions a run uses, validated, and the DeviceMesh they span.

Validation is pure arithmetic on the config and runs before any process-group work, so a bad
layout fails in milliseconds with a message instead of a hang. `build_mesh` then creates the
process group (CUDA + NCCL when GPUs exist, CPU + gloo otherwise) and one named mesh.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from torchllm.config.job_config import ConfigError
from torchllm.parallel.first_collective import first_collective


@dataclass
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    tp: int
    world_size: int
    dp_mode: str = "fsdp"
    cp: int = 1
    ep: int = 1  # expert parallel: borrows ranks from dp_shard x cp (see expert_parallel.py)
    pp: int = 1  # pipeline stages' ranks: the outermost mesh dim
    device_type: str = "cpu"  # set by build_mesh
    # The run's precision (torchllm.run.resolve decides it once): FSDP2's param dtype. None
    # (tools that build a model from a config alone): training.mixed_precision decides.
    bf16: bool | None = field(default=None, repr=False)
    mesh: object = field(default=None, repr=False)  # DeviceMesh once build_mesh ran (world > 1)
    dp_flat_mesh: object = field(default=None, repr=False)  # its flattened "dp" dim
    dp_shard_cp_mesh: object = field(default=None, repr=False)  # flattened dp_shard x cp
    expert_mesh: object = field(default=None, repr=False)  # (dp_replicate, efsdp, ep), ep > 1

    @classmethod
    def from_config(cls, pcfg, world_size: int) -> "ParallelDims":
        dims = cls(
            dp_replicate=pcfg.data_parallel_replicate_degree,
            dp_shard=pcfg.data_parallel_shard_degree,
            tp=pcfg.tensor_parallel_degree,
            world_size=world_size,
            dp_mode=pcfg.dp_mode,
            cp=pcfg.context_parallel_degree,
            ep=pcfg.expert_parallel_degree,
            pp=pcfg.pipeline_parallel_degree,
        )
        dims.validate()
        return dims

    def validate(self) -> None:
        """Resolve dp_shard = -1, check the product and the supported combinations."""
        for name, value in (("data_parallel_replicate_degree", self.dp_replicate),
                            ("tensor_parallel_degree", self.tp),
                            ("context_parallel_degree", self.cp),
                            ("expert_parallel_degree", self.ep),
                            ("pipeline_parallel_degree", self.pp)):
            if value < 1:
                raise ConfigError(f"parallelism.{name} = {value}: must be >= 1",
                                  f"parallelism.{name}")
        if self.dp_shard == -1:
            self.dp_shard = max(self.world_size // (self.pp * self.dp_replicate * self.cp * self.tp), 1)
        elif self.dp_shard < 1:
            raise ConfigError(
                f"parallelism.data_parallel_shard_degree = {self.dp_shard}: must be >= 1 or -1",
                "parallelism.data_parallel_shard_degree",
            )
        product = self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp
        if product != self.world_size:
            pp = f"pp={self.pp} x " if self.pp > 1 else ""
            raise ConfigError(
                f"parallelism degrees {pp}replicate={self.dp_replicate} x shard={self.dp_shard} x "
                f"cp={self.cp} x tp={self.tp} = {product}, but the world size is "
                f"{self.world_size}; make the product equal the number of processes "
                "(NGPU x NNODES)"
            )
        self.validate_ep()
        if self.dp_mode == "ddp" and self.cp > 1:
            raise ConfigError(
                "parallelism.dp_mode = 'ddp' does not compose with context_parallel_degree > 1: "
                "the cp ranks' gradients are reduced by FSDP2 over dp_shard x cp; use "
                "dp_mode = 'fsdp'", "parallelism.dp_mode",
            )
        if self.dp_mode == "ddp":
            if self.dp_replicate > 1 and self.dp_shard > 1:
                raise ConfigError(
                    f"parallelism.dp_mode = 'ddp' cannot shard: replicate={self.dp_replicate} x "
                    f"shard={self.dp_shard} is HSDP; use dp_mode = 'fsdp' for it, or one of the "
                    "two degrees for plain DDP",
                    "parallelism.dp_mode",
                )
            # DDP replicates over every data-parallel rank: the dp degree lives on dp_replicate.
            self.dp_replicate, self.dp_shard = self.dp_replicate * self.dp_shard, 1
        if self.tp > 1 and self.dp_replicate > 1 and self.dp_shard * self.cp == 1:
            raise ConfigError(
                f"DDP (data_parallel_replicate_degree = {self.dp_replicate}) does not compose "
                "with tensor_parallel_degree > 1; use FSDP2 + TP instead "
                f"(data_parallel_shard_degree = {self.dp_replicate}, replicate = 1, dp_mode = "
                "'fsdp'), or HSDP + TP with both dp degrees > 1",
                "parallelism.tensor_parallel_degree",
            )

    def validate_ep(self) -> None:
        """EP borrows its ranks from dp_shard x cp (TorchTitan's layout): each group of `ep`
        consecutive ranks there splits the experts; the efsdp = dp_shard x cp / ep groups
        shard (FSDP2) each expert shard like any weight, dp_replicate replicates it (HSDP)."""
        if self.ep == 1:
            return
        key = "parallelism.expert_parallel_degree"
        if self.dp_mode == "ddp":
            raise ConfigError(
                f"{key} = {self.ep} with dp_mode = 'ddp': expert parallelism borrows FSDP2's "
                "ranks (its expert weights are sharded DTensors); use dp_mode = 'fsdp'", key)
        if self.tp > 1:
            raise ConfigError(
                f"{key} = {self.ep} with tensor_parallel_degree = {self.tp} is not supported; "
                "use expert parallelism with FSDP2 (data_parallel_shard_degree) only", key)
        if (self.dp_shard * self.cp) % self.ep:
            raise ConfigError(
                f"{key} = {self.ep} does not divide data_parallel_shard_degree ({self.dp_shard}) "
                f"x context_parallel_degree ({self.cp}) = {self.dp_shard * self.cp}, the ranks "
                "it borrows; use a divisor of it", key)

    def validate_experts(self, model_name: str, n_experts: int) -> None:
        """EP needs a mixture-of-experts model whose experts split evenly over the ep ranks."""
        if self.ep == 1:
            return
        key = "parallelism.expert_parallel_degree"
        if not n_experts:
            raise ConfigError(
                f"{key} = {self.ep} with model {model_name!r}, which has no experts; use a "
                "mixture-of-experts model (e.g. model.name = 'qwen3_moe') or set it to 1", key)
        if n_experts % self.ep:
            raise ConfigError(
                f"{key} = {self.ep} does not divide the model's n_experts = {n_experts}; use a "
                "degree that divides it", key)

    @property
    def efsdp(self) -> int:
        """Expert data parallel: the dp_shard x cp ranks over which one expert shard is FSDP2-
        sharded (dp_replicate replicates it on top, as for every weight)."""
        return self.dp_shard * self.cp // self.ep

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    def validate_model(self, n_heads: int, n_kv_heads: int, tie_embeddings: bool) -> None:
        """TP splits attention by heads: every rank needs whole query and KV heads."""
        if self.tp == 1:
            return
        for name, heads in (("n_heads", n_heads), ("n_kv_heads", n_kv_heads)):
            if heads % self.tp:
                raise ConfigError(
                    f"parallelism.tensor_parallel_degree = {self.tp} does not divide the model's "
                    f"{name} = {heads}; use a TP degree that divides both n_heads ({n_heads}) and "
                    f"n_kv_heads ({n_kv_heads})",
                    "parallelism.tensor_parallel_degree",
                )
        if tie_embeddings:
            raise ConfigError(
                "tensor parallelism with tied embeddings is not supported (the output projection "
                "reads the row-sharded embedding table); set model.tie_embeddings = false, or "
                "use FSDP2 (data_parallel_shard_degree) without TP",
                "parallelism.tensor_parallel_degree",
            )

    # -- which dims are on ----------------------------------------------------------------
    @property
    def dp_degree(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def dp_enabled(self) -> bool:
        return self.dp_degree > 1

    @property
    def dp_replicate_enabled(self) -> bool:
        return self.dp_replicate > 1

    @property
    def dp_shard_enabled(self) -> bool:
        return self.dp_shard > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def fsdp_enabled(self) -> bool:
        """FSDP2 (HSDP when replicate > 1 too) shards the model over dp_shard x cp."""
        return self.dp_shard * self.cp > 1

    @property
    def ddp_enabled(self) -> bool:
        return self.dp_replicate_enabled and not self.fsdp_enabled

    # -- the mesh ---------------------------------------------------------------------------
    def build_mesh(self, device: torch.device, timeout_s: float | None = None):
        """Init the process group (once; collectives time out after `timeout_s`, default
        torch's) and the named mesh; a no-op for a single process.

        Dims: pp x dp_replicate x dp_shard x cp x tp (size-1 dims included so names always
        resolve; pp outermost, as TorchTitan: a stage's ranks are contiguous), plus flattened ones: `dp` = dp_replicate x dp_shard (data loading, loss
        reduction: cp ranks read the same batch) and `dp_shard_cp` = dp_shard x cp (FSDP2
        shards over it, so gradients are also reduced over cp, as TorchTitan does).
        """
        self.device_type = device.type
        if self.world_size == 1:
            return None
        from torch.distributed.device_mesh import init_device_mesh

        if not dist.is_initialized():
            kwargs = {} if timeout_s is None else {"timeout": timedelta(seconds=timeout_s)}
            if device.type == "cuda":
                torch.cuda.set_device(device)
                dist.init_process_group("nccl", device_id=device, **kwargs)
            else:
                dist.init_process_group("gloo", **kwargs)
            # The first collective: a network that cannot connect the ranks fails here, with a
            # message naming the NCCL settings to check, instead of hanging in the first step.

            first_collective(device, timeout_s if timeout_s is not None else 1800.0)
        self.mesh = init_device_mesh(
            device.type,
            (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp),
            mesh_dim_names=("pp", "dp_replicate", "dp_shard", "cp", "tp"),
        )
        self.dp_flat_mesh = self.mesh["dp_replicate", "dp_shard"]._flatten(mesh_dim_name="dp")
        self.dp_shard_cp_mesh = self.mesh["dp_shard", "cp"]._flatten(mesh_dim_name="dp_shard_cp")
        if self.ep_enabled:  # the same ranks, the dp_shard x cp index split as efsdp x ep
            self.expert_mesh = init_device_mesh(
                device.type, (self.dp_replicate, self.efsdp, self.ep),
                mesh_dim_names=("dp_replicate", "efsdp", "ep"),
            )
        if timeout_s is not None:  # the mesh's own groups do not inherit the default's timeout
            self.set_timeout(timeout_s)
        return self.mesh

    def set_timeout(self, seconds: float) -> None:
        """Set the collective timeout of the default group and every group of the mesh."""
        from torch.distributed.distributed_c10d import _set_pg_timeout

        groups = [None, self.dp_group, self.dp_shard_cp_mesh.get_group(),
                  *(self.mesh.get_group(d) for d in range(self.mesh.ndim))]
        if self.expert_mesh is not None:
            groups += [self.expert_mesh.get_group(d) for d in range(self.expert_mesh.ndim)]
        for group in groups:
            _set_pg_timeout(timedelta(seconds=seconds), group)

    @property
    def dp_rank(self) -> int:
        return self.dp_flat_mesh.get_local_rank() if self.mesh is not None else 0

    @property
    def dp_group(self):
        """The data-parallel process group (size 1 under pure TP); None for a single process."""
        return self.dp_flat_mesh.get_group() if self.mesh is not None else None

    @property
    def pp_group(self):
        """The pipeline process group (a rank's peers holding the other stages); None without
        pipeline parallelism."""
        return self.mesh["pp"].get_group() if self.mesh is not None and self.pp > 1 else None

    @property
    def pp_rank(self) -> int:
        return self.mesh["pp"].get_local_rank() if self.mesh is not None and self.pp > 1 else 0

    @property
    def cp_group(self):
        """The context-parallel process group; None without context parallelism."""
        return self.mesh["cp"].get_group() if self.mesh is not None and self.cp > 1 else None

    def ep_mesh(self):
        """The 1-D mesh the experts are split over (expert_parallel_degree ranks)."""
        return self.expert_mesh["ep"]

    def expert_fsdp_mesh(self):
        """What FSDP2 shards each expert shard over: efsdp, or (dp_replicate, efsdp) for HSDP."""
        if self.dp_replicate_enabled:
            return self.expert_mesh["dp_replicate", "efsdp"]
        return self.expert_mesh["efsdp"]

    def fsdp_mesh(self):
        """The mesh FSDP2 shards over: 2-D (replicate, shard x cp) for HSDP, else shard x cp."""
        if not self.cp_enabled:
            return self.mesh["dp_replicate", "dp_shard"] if self.dp_replicate_enabled \
                else self.mesh["dp_shard"]
        if self.dp_replicate_enabled:
            return self.mesh["dp_replicate", "dp_shard_cp"]
        return self.dp_shard_cp_mesh


def destroy_distributed() -> None:
    """Tear down the default process group, if this process created one."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()

