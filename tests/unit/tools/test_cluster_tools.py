"""Cluster ergonomics without a cluster: the first-collective guard, env_check, dry_run."""

from __future__ import annotations

import json
import multiprocessing as mp
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from conftest import REPO, preloaded_forkserver
from torchllm import models
from torchllm.config import ConfigError, load_config
from messages import assert_names


def _first_collective_rank(rank: int, store_path: str, late_s: float, timeout_s: float, q):
    from torchllm.parallel import FirstCollectiveError, first_collective

    store = dist.FileStore(store_path, 2)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2,
                            timeout=timedelta(seconds=30))
    try:
        if rank == 1:
            time.sleep(late_s)  # a rank that is not there yet (a hung node, a wrong interface)
        try:
            first_collective(torch.device("cpu"), timeout_s=timeout_s)
            q.put((rank, "ok"))
        except FirstCollectiveError as e:
            q.put((rank, str(e)))
        # The late rank's all-reduce meets rank 0's pending one; then both agree to finish.
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_two_ranks(tmp_path, late_s: float, timeout_s: float) -> dict:
    ctx = mp.get_context(preloaded_forkserver())
    q = ctx.Queue()
    procs = [ctx.Process(target=_first_collective_rank,
                         args=(r, str(tmp_path / "store"), late_s, timeout_s, q))
             for r in range(2)]
    for p in procs:
        p.start()
    out = dict(q.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    return out


@pytest.mark.slow
def test_first_collective_passes_when_every_rank_joins(tmp_path):
    assert run_two_ranks(tmp_path, late_s=0, timeout_s=30) == {0: "ok", 1: "ok"}


@pytest.mark.slow
def test_first_collective_timeout_names_the_nccl_settings(tmp_path):
    out = run_two_ranks(tmp_path, late_s=4, timeout_s=1)
    message = out[0]
    assert_names(message, "1 s", "rank 0 of 2")  # the timeout, which rank of how many
    for var in ("NCCL_P2P_DISABLE", "NCCL_IB_DISABLE", "NCCL_SOCKET_IFNAME", "env_check"):
        assert var in message
    assert out[1] == "ok"  # the late rank met rank 0's pending all-reduce


def test_first_collective_is_a_no_op_without_a_process_group():
    from torchllm.parallel import first_collective

    assert not dist.is_initialized()
    first_collective(torch.device("cpu"), timeout_s=0.1)


# -- env_check ------------------------------------------------------------------------------

def test_bus_bandwidth_follows_the_nccl_tests_convention():
    from torchllm.tools.env_check import bus_bandwidth

    bw = bus_bandwidth(nbytes=10**9, seconds=0.1, world=8)
    assert bw["algbw_gbps"] == pytest.approx(10.0)
    assert bw["busbw_gbps"] == pytest.approx(10.0 * 2 * 7 / 8)


@pytest.mark.slow
def test_env_check_without_gpu_reports_and_measures_gloo(tmp_path, capsys):
    from torchllm.tools import env_check

    out = tmp_path / "env.json"
    assert env_check.main(["--cpu_ranks", "2", "--size_mb", "4", "--iters", "2",
                           "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "no GPU" in text and "gloo True" in text
    report = json.loads(out.read_text())
    assert report["gpu_count"] == 0
    (run,) = report["allreduce"]
    # The result check is world ** iters from ones: a wrong all-reduce reads "WRONG" and exits 1.
    assert run["ranks"] == [0, 1] and run["correct"] and run["bytes"] == 4_000_000
    assert run["busbw_gbps"] == pytest.approx(run["bytes"] / run["seconds"] / 1e9)


# -- dry_run --------------------------------------------------------------------------------

LLAMA3_VOCAB = "--model.vocab_size=128256"


def dry(world: int, *overrides: str, **kw) -> dict:
    from torchllm.tools.dry_run import dry_run

    return dry_run(load_config(list(overrides)), world, **kw)


@pytest.mark.parametrize("flavor, world, layout", [
    ("8B", 8, ()),
    ("8B", 64, ("--parallelism.tensor_parallel_degree=8",)),
    ("8B", 512, ("--parallelism.data_parallel_replicate_degree=8",)),  # HSDP 8 x 64
    ("70B", 128, ("--parallelism.tensor_parallel_degree=8",)),
    ("70B", 512, ("--parallelism.tensor_parallel_degree=8",
                  "--parallelism.data_parallel_replicate_degree=4")),  # HSDP + TP
])
def test_dry_run_big_layouts_shard_like_the_estimate(flavor, world, layout):
    """The real parallelize_model on a fake process group of `world` ranks (meta device): rank 0's
    parameter shards must hold what the analytic estimator says (FSDP2 pads dim 0 a little)."""
    from torchllm.tools import estimate_memory as em

    args = (f"--model.flavor={flavor}", LLAMA3_VOCAB, "--model.tie_embeddings=false",
            "--training.local_batch_size=1", "--training.seq_len=8192", *layout)
    r = dry(world, *args, fake=True)
    assert r["fake"]["ratio"] == pytest.approx(1.0, abs=0.01)
    assert r["fake"]["rank0_param_bytes"] > 0
    # The dry run's memory is the estimator's for the target (CUDA: bf16 activations).
    cfg = load_config([*args, "--training.device=cuda"])
    direct = em.estimate_memory(cfg, models.model_args(cfg.model, cfg.training, cfg.data), world)
    assert r["memory"]["peak_bytes"] == direct["peak_bytes"]
    assert r["memory"]["activation_bytes"] == 2
    assert r["layout"]["dp_replicate"] * r["layout"]["dp_shard"] * r["layout"]["tp"] == world


def count_fsdp_collective_bytes(monkeypatch) -> dict:
    """Bytes each rank sends in FSDP2's all-gathers / reduce-scatters (ring: (n-1)/n).

    FSDP2 calls torch.distributed's all_gather_into_tensor / reduce_scatter_tensor (torch 2.11)
    or their *_single successors (2.13); whichever exist are wrapped, nested calls counted once.
    """
    sent = {"all_gather_bytes": 0, "reduce_scatter_bytes": 0}
    depth = [0]

    def wrap(name, key, full_index, full_names):
        original = getattr(dist, name, None)
        if original is None:
            return

        def counting(*a, **k):
            if depth[0] == 0:
                full = a[full_index] if len(a) > full_index else next(
                    k[n] for n in full_names if n in k)
                n = dist.get_world_size(k.get("group"))
                sent[key] += full.numel() * full.element_size() * (n - 1) // n
            depth[0] += 1
            try:
                return original(*a, **k)
            finally:
                depth[0] -= 1
        monkeypatch.setattr(dist, name, counting)

    for name in ("all_gather_into_tensor", "all_gather_single"):  # (output, input): full = out
        wrap(name, "all_gather_bytes", 0, ("output_tensor", "output"))
    for name in ("reduce_scatter_tensor", "reduce_scatter_single"):  # full = input
        wrap(name, "reduce_scatter_bytes", 1, ("input", "input_tensor"))
    return sent


@pytest.mark.parametrize("world, extra", [
    (4, ()),
    pytest.param(4, ("--parallelism.fsdp_reshard_after_forward=always",),
                 marks=pytest.mark.slow),
    (8, ("--parallelism.fsdp_reduce_dtype=bf16", "--parallelism.data_parallel_shard_degree=8")),
    # tensorwise: the linears' weights are all-gathered in float8
    pytest.param(4, ("--float8.enable",), marks=pytest.mark.slow),
])
def test_dry_run_fake_step_fsdp_traffic_matches_the_count(monkeypatch, world, extra):
    """A forward + backward of the debug model on a fake process group, with FSDP2's own
    collectives counted: the dry run's per-dim bytes must be what FSDP2 really sends."""
    sent = count_fsdp_collective_bytes(monkeypatch)
    r = dry(world, "--training.seq_len=32", "--training.local_batch_size=2", *extra,
            fake=True, step=True)
    assert r["fake"]["step"]["logits_shape"][:2] == [2, 32]
    predicted = r["comm_bytes_per_step"]["dp_shard"]
    for key in sent:
        assert sent[key] > 0
        assert predicted[key] == pytest.approx(sent[key], rel=0.01), key


def test_dry_run_fake_step_fsdp_x_tp_at_world_8():
    r = dry(8, "--training.seq_len=32", "--training.local_batch_size=2",
            "--parallelism.tensor_parallel_degree=2", "--model.tie_embeddings=false",
            fake=True, step=True)
    assert r["layout"] == {"dp_replicate": 1, "dp_shard": 4, "tp": 2, "fsdp": True, "ddp": False}
    assert set(r["comm_bytes_per_step"]) == {"dp_shard", "tp"}
    assert r["fake"]["ratio"] == pytest.approx(1.0, abs=0.02)


def test_dry_run_ddp_all_reduce_volume():
    """DDP all-reduces every fp32 gradient once per step; a bf16 hook halves it."""
    base = ("--parallelism.dp_mode=ddp", "--training.global_batch_size=64")
    r = dry(8, *base)
    n = r["memory"]["params"]
    assert r["comm_bytes_per_step"] == {"dp_replicate": {"all_reduce_bytes": int(n * 4 * 2 * 7 / 8)}}
    assert r["grad_accum_steps"] == 1
    hook = dry(8, *base, "--parallelism.ddp_comm_hook=bf16")
    assert hook["comm_bytes_per_step"]["dp_replicate"]["all_reduce_bytes"] == int(n * 2 * 2 * 7 / 8)


@pytest.mark.parametrize("world, overrides, says", [
    (6, ("--parallelism.tensor_parallel_degree=4",), "world size is 6"),
    (8, ("--parallelism.tensor_parallel_degree=8", "--model.flavor=8B", LLAMA3_VOCAB,
         "--model.tie_embeddings=false", "--training.seq_len=100"), "training.seq_len = 100"),
    (8, ("--training.global_batch_size=12",), "training.global_batch_size = 12"),
    (8, ("--parallelism.tensor_parallel_degree=2", "--model.flavor=1B"), "tied embeddings"),
])
def test_dry_run_cli_rejects_bad_layouts_with_the_key(capsys, world, overrides, says):
    from torchllm.tools.dry_run import main

    assert main(["--world_size", str(world), *overrides]) == 2
    assert says in capsys.readouterr().err


def test_dry_run_cli_prints_the_summary_and_json(tmp_path, capsys):
    from torchllm.tools.dry_run import main

    out = tmp_path / "r.json"
    assert main(["--job.config_file", str(REPO / "train_configs/llama3_1b.toml"),
                 "--world_size", "64", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert_names(text, "OK", "world 64", "replicate 1", "shard 64", "tp 1")  # the layout it checked
    assert json.loads(out.read_text())["comm_bytes_per_step"]["dp_shard"]["all_gather_bytes"] > 0
    # The same layout with a batch that cannot fit an 80 GB GPU: said, and exit code 1.
    assert main(["--job.config_file", str(REPO / "train_configs/llama3_1b.toml"),
                 "--world_size", "64", "--training.seq_len=16384"]) == 1
    assert "DOES NOT FIT" in capsys.readouterr().out
    with pytest.raises(ConfigError, match="--max_gib"):
        dry(64, "--model.flavor=8B", fake=True, step=True, max_gib=1)


def test_env_check_without_gpu_exits_0_and_says_so(capsys):
    from torchllm.tools import env_check

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert env_check.main([]) == 0
    out = capsys.readouterr().out
    assert "no GPU" in out and "network interfaces" in out and "InfiniBand devices" in out
