"""Dry-run a training layout for a world you don't have: checks, memory, communication.

    python -m torchllm.tools.dry_run --job.config_file X --world_size 64 [--section.key=value ...]
        [--fake]          also parallelize the real model (on the meta device) as rank 0 of a
                          fake process group of world_size ranks: mesh and sharding mistakes
                          fail here, and the local shard sizes are checked against the estimate
        [--fake_step]     and then materialize rank 0's shards on CPU and run one forward and
                          backward through every hook (small models; see --max_gib)
        [--max_gib 8]     refuse --fake_step when the estimated per-rank peak is larger
        [--gpu_gib 80]    device memory of the target GPUs: exit 1 when the estimate's reserved
                          figure (the allocated peak + the caching allocator's margin) is over it
        [--json FILE]     write the whole report as JSON

The run is assumed to be a GPU job (`training.device = cuda`: bf16 under mixed_precision =
auto, float8 assumed on SM89+ GPUs) unless the config or an override says `cpu`. It runs every
check the Trainer runs before touching a process group (config rules, parallel degrees, model
shape vs TP, option combinations, batch divisibility), the per-rank memory estimate of
`torchllm.tools.estimate_memory`, and the bytes each rank sends per optimizer step on each
parallel dimension (ring algorithms: an all-gather or reduce-scatter of B bytes over n ranks
sends B(n-1)/n per rank, an all-reduce twice that):

  dp_shard      FSDP2 all-gathers the params (param dtype; float8 linears in 1 byte with the
                float8 all-gather) in every micro-step's forward and, for resharded blocks, again
                in backward; reduce-scatters the gradients (reduce dtype) every micro-step
                (once per step with parallelism.fsdp_reduce_every_microstep = false)
  dp_replicate  HSDP all-reduces each shard's gradients across replicas; DDP all-reduces the
                whole gradient (fp32, or 2 bytes with ddp_comm_hook = bf16/fp16)
  tp            sequence parallel: per block and micro-step, 2 all-gathers + 2 reduce-scatters
                of the [tokens, dim] activations in forward and as many in backward; the
                embedding's reduce-scatter and the head's all-gather (and their backward), and
                the vocab-parallel loss's 3 all-reduces of one float32 per token (the logits
                stay sharded)
The fake process group (torch's `fake` backend) communicates nothing: values after a
collective are garbage, shapes and code paths are real.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys

import torch
import torch.distributed as dist

from torchllm import models
from torchllm.config import ConfigError, load_config
from torchllm.parallel import ParallelPlan, build_parallel_dims, parallelize_model
from torchllm.parallel.data_parallel import reshard_after_forward
from torchllm.parallel.distributed import reduce_every_microstep
from torchllm.parallel.float8 import float8_module_filter, uses_float8_all_gather
from torchllm.precision import use_bf16 as bf16_params
from torchllm.run.process_exit import exit_process
from torchllm.tools.estimate_memory import estimate_memory, levers, verdict
from torchllm.tools.model_info import tokenizer_vocab_hint

GiB = 1024**3


def for_target(tcfg, fcfg) -> None:
    """The [training] and [float8] sections as the target cluster sees them, in place: CUDA
    unless cpu was asked for; float8's hardware check is about the cluster's GPUs, so it is
    emulated here."""
    if tcfg.device == "auto":
        tcfg.device = "cuda"
    if fcfg.enable:
        fcfg.emulate = True


def check_batch(tcfg, dp_degree: int) -> int:
    """The Trainer's global-batch rule for the [training] section; returns the
    gradient-accumulation steps."""
    per_pass = tcfg.local_batch_size * dp_degree
    global_batch = per_pass if tcfg.global_batch_size == -1 else tcfg.global_batch_size
    if global_batch % per_pass:
        raise ConfigError(
            f"training.global_batch_size = {global_batch} is not a multiple of local_batch_size "
            f"({tcfg.local_batch_size}) x data-parallel degree ({dp_degree}) = {per_pass}",
            "training.global_batch_size")
    return global_batch // per_pass


def comm_volume(spec, model_args, dims, accum: int, pcfg, tcfg, fcfg) -> dict[str, dict[str, int]]:
    """Bytes each rank sends per optimizer step, per parallel dimension (module docstring), for
    family `spec` under the [parallelism], [training] and [float8] sections."""
    with torch.device("meta"):
        model = spec.build(model_args)
    act = 2 if bf16_params(tcfg.mixed_precision, tcfg.device) else 4
    reduce = 2 if pcfg.fsdp_reduce_dtype == "bf16" else 4
    keep = float8_module_filter(fcfg.filter_fqns)
    f8_names = {f"{n}.weight" for n, m in model.named_modules() if fcfg.enable and keep(m, n)}
    f8_gather = uses_float8_all_gather(fcfg, dims.fsdp_enabled)

    def gathered(named) -> float:  # bytes of params as FSDP2 all-gathers them (per TP shard)
        return sum(p.numel() * (1 if f8_gather and n in f8_names else act)
                   for n, p in named) / dims.tp

    total_params = sum(p.numel() for p in model.parameters())
    out: dict[str, dict[str, int]] = {}
    if dims.fsdp_enabled:
        s = dims.dp_shard
        frac = (s - 1) / s
        fwd = gathered(model.named_parameters())
        # Backward gathers again every FSDP unit resharded after forward: all of them but the
        # blocks kept by the reshard policy (the root and embedding units included: measured
        # with FSDP2's own collectives in tests/unit/tools/test_cluster_tools.py).
        blocks = list(model.layers.items())
        kept = sum(gathered(b.named_parameters(prefix=f"layers.{k}"))
                   for i, (k, b) in enumerate(blocks)
                   if not reshard_after_forward(pcfg.fsdp_reshard_after_forward, i, len(blocks)))
        bwd = 0 if pcfg.fsdp_reshard_after_forward == "never" else fwd - kept
        reductions = accum if reduce_every_microstep(pcfg) else 1
        out["dp_shard"] = {
            "all_gather_bytes": int(accum * (fwd + bwd) * frac),
            "reduce_scatter_bytes": int(reductions * total_params / dims.tp * reduce * frac),
        }
        if dims.dp_replicate_enabled:
            r = dims.dp_replicate
            out["dp_replicate"] = {"all_reduce_bytes": int(
                total_params / dims.tp / s * reduce * 2 * (r - 1) / r)}
    elif dims.ddp_enabled:
        r = dims.dp_replicate
        grad = 2 if pcfg.ddp_comm_hook in ("bf16", "fp16") else 4
        out["dp_replicate"] = {"all_reduce_bytes": int(total_params * grad * 2 * (r - 1) / r)}
    if dims.tp_enabled:
        t = dims.tp
        frac = (t - 1) / t
        tokens = tcfg.local_batch_size * tcfg.seq_len
        hidden = tokens * model_args.dim * act * frac
        n_layers = model_args.n_layers
        out["tp"] = {
            # blocks: 4 in forward, 4 in backward; embedding + head: 2 each way
            "all_gather_bytes": int(accum * (4 * n_layers + 2) * hidden),
            "reduce_scatter_bytes": int(accum * (4 * n_layers + 2) * hidden),
            # the loss: row max, sum of exponentials, target logit (ring: 2 (t-1)/t)
            "all_reduce_bytes": int(accum * 3 * tokens * 4 * 2 * frac),
        }
    return out


def sharded_model(spec, model_args, dims, plan: ParallelPlan):
    """Rank 0's real model under the real parallelize_model, on the meta device (no memory)."""
    with torch.device("meta"):
        model = spec.build(model_args)
    # compile off: tracing happens at the first call, not here
    parallelize_model(model, spec, dims, plan.without_compile())
    return model


def local_param_bytes(model) -> int:
    """fp32 bytes of this rank's parameters (local shards of DTensors)."""
    return sum((p.to_local() if hasattr(p, "to_local") else p).numel() * 4
               for p in model.parameters())


def fake_step(model, model_args, tcfg) -> dict:
    """Materialize rank 0's shards on CPU and run a forward + backward of a [training]
    section's batch shape (values: see docstring)."""
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights(buffer_device=torch.device("cpu"))
    x = torch.randint(0, model_args.vocab_size, (tcfg.local_batch_size, tcfg.seq_len))
    logits = model(x)
    expected = (tcfg.local_batch_size, tcfg.seq_len, model_args.vocab_size)
    if tuple(logits.shape) != expected:
        raise RuntimeError(f"logits shape {tuple(logits.shape)}, expected {expected}")
    logits.float().mean().backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    if missing:
        raise RuntimeError(f"no gradient reached {missing[:3]}")
    return {"logits_shape": list(expected), "params_with_grad": sum(1 for _ in model.parameters())}


def dry_run(cfg, world_size: int, fake: bool = False, step: bool = False,
            max_gib: float = 8.0) -> dict:
    """The tool's report (an entry point, scripts/config_coupling.py: the Trainer's checks,
    the memory estimate and the communication of the whole config, as the target sees it)."""
    cfg = copy.deepcopy(cfg)
    for_target(cfg.training, cfg.float8)
    model_args = models.model_args(cfg.model, cfg.training, cfg.data,
                                   tokenizer_vocab_hint(cfg.data))
    dims = build_parallel_dims(world_size, cfg.training.device, model_args,
                               parallelism=cfg.parallelism, model=cfg.model, training=cfg.training,
                               data=cfg.data, eval=cfg.eval, float8=cfg.float8,
                               activation_checkpoint=cfg.activation_checkpoint, lora=cfg.lora,
                               compile=cfg.compile)
    spec = models.get(cfg.model.name)
    accum = check_batch(cfg.training, dims.dp_degree)
    estimate = estimate_memory(cfg, model_args, world_size)
    report = {
        "world_size": world_size,
        "device": cfg.training.device,
        "layout": {"dp_replicate": dims.dp_replicate, "dp_shard": dims.dp_shard, "tp": dims.tp,
                   "fsdp": dims.fsdp_enabled, "ddp": dims.ddp_enabled},
        "grad_accum_steps": accum,
        "memory": estimate,
        "comm_bytes_per_step": comm_volume(spec, model_args, dims, accum, cfg.parallelism,
                                           cfg.training, cfg.float8),
        "config": cfg,  # (main's verdict names the levers it has left; not in the JSON)
    }
    if not (fake or step):
        return report
    if step and estimate["peak_gib"] > max_gib:
        raise ConfigError(f"--fake_step: the estimated per-rank peak is {estimate['peak_gib']} "
                          f"GiB > --max_gib {max_gib}; use --fake alone (no memory), a smaller "
                          "flavor, or raise --max_gib")
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        dims.build_mesh(torch.device("cpu"))
        dims.device_type = cfg.training.device  # dtype decisions follow the target device
        model = sharded_model(spec, model_args, dims, ParallelPlan.of(
            parallelism=cfg.parallelism, float8=cfg.float8,
            activation_checkpoint=cfg.activation_checkpoint, compile=cfg.compile,
            training=cfg.training))
        local = local_param_bytes(model)
        report["fake"] = {"rank0_param_bytes": local,
                          "estimate_param_bytes": estimate["terms_bytes"]["params"],
                          "ratio": round(local / estimate["terms_bytes"]["params"], 4)}
        if step:
            report["fake"]["step"] = fake_step(model, model_args, cfg.training)
    finally:
        dims.mesh = dims.dp_flat_mesh = None
        dist.destroy_process_group()
    return report


def summary(r: dict) -> str:
    lay, mem = r["layout"], r["memory"]
    lines = [
        f"OK: world {r['world_size']} ({r['device']}) = replicate {lay['dp_replicate']} x shard "
        f"{lay['dp_shard']} x tp {lay['tp']}; {r['grad_accum_steps']} micro-steps per step",
        f"memory per rank: {mem['peak_gib']} GiB at '{mem['peak_phase']}' ("
        + " + ".join(f"{k} {v / GiB:.2f}" for k, v in mem["peak_terms_bytes"].items())
        + f" GiB), reserved ~{mem['reserved_gib']} GiB",
    ]
    for dim, vols in r["comm_bytes_per_step"].items():
        lines.append(f"comm per rank per step, {dim}: "
                     + ", ".join(f"{k[:-6]} {v / 1e9:.3f} GB" for k, v in vols.items()))
    if "fake" in r:
        f = r["fake"]
        lines.append(f"fake process group: parallelized; rank 0 holds {f['rank0_param_bytes'] / GiB:.3f} "
                     f"GiB of fp32 params (estimate {f['estimate_param_bytes'] / GiB:.3f}, "
                     f"ratio {f['ratio']})")
        if "step" in f:
            lines.append(f"fake step: forward + backward ran, logits {f['step']['logits_shape']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m torchllm.tools.dry_run", description=__doc__,
                                allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world_size", type=int, required=True, help="GPUs of the target job")
    p.add_argument("--fake", action="store_true", help="parallelize on a fake process group")
    p.add_argument("--fake_step", action="store_true", help="--fake + one forward/backward")
    p.add_argument("--max_gib", type=float, default=8.0, help="--fake_step memory limit")
    p.add_argument("--gpu_gib", type=float, default=80.0,
                   help="memory per GPU of the target (80 = H100); exit 1 when the estimate exceeds it")
    p.add_argument("--json", default=None, help="write the report here")
    args, overrides = p.parse_known_args(sys.argv[1:] if argv is None else argv)
    if args.world_size < 1:
        p.error(f"--world_size {args.world_size}: must be >= 1")
    try:
        report = dry_run(load_config(overrides), args.world_size, args.fake, args.fake_step,
                         args.max_gib)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    cfg = report.pop("config")
    report["fits"], line = verdict(report["memory"], args.gpu_gib,
                                   levers(cfg.activation_checkpoint, cfg.training, report["memory"]))
    print(summary(report))
    print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0 if report["fits"] else 1


if __name__ == "__main__":
    exit_process(main())
