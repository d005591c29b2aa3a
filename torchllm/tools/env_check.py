"""What this node offers a distributed run: GPUs, NCCL, P2P/InfiniBand, all-reduce bandwidth.

    python -m torchllm.tools.env_check [--size_mb 1024] [--iters 5] [--json FILE]
        [--cpu_ranks N]     (no GPU: measure a gloo all-reduce over N local CPU processes)

With GPUs it prints their count, names and memory, NCCL's version, which GPU pairs can reach
each other directly (P2P), the InfiniBand devices in /sys/class/infiniband, the NCCL_*
variables set, and the bandwidth of an all-reduce of `--size_mb` MB over every local GPU and
over each link (GPU 0 with each other GPU). Without a GPU it says so, prints the torch/gloo
facts, and exits 0. docs/gpu.md says what to do with the answers (NCCL_P2P_DISABLE,
NCCL_IB_DISABLE, NCCL_SOCKET_IFNAME).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from torchllm.run.process_exit import exit_process

NCCL_VARS = ("NCCL_P2P_DISABLE", "NCCL_IB_DISABLE", "NCCL_SOCKET_IFNAME", "NCCL_DEBUG",
             "NCCL_NET", "NCCL_P2P_LEVEL", "NCCL_SHM_DISABLE", "GLOO_SOCKET_IFNAME")


def bus_bandwidth(nbytes: int, seconds: float, world: int) -> dict[str, float]:
    """NCCL-tests' convention: algbw = bytes / time; busbw = algbw x 2(n-1)/n for all-reduce
    (the bytes each link carries in a ring), comparable with a link's rated speed."""
    algbw = nbytes / seconds / 1e9
    return {"algbw_gbps": algbw, "busbw_gbps": algbw * 2 * (world - 1) / world}


def _allreduce_rank(rank: int, ranks: list[int], device_type: str, nbytes: int, iters: int,
                    store_path: str, out_path: str) -> None:
    world = len(ranks)
    store = dist.FileStore(store_path, world)
    if device_type == "cuda":
        device = torch.device("cuda", ranks[rank])
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", store=store, rank=rank, world_size=world,
                                device_id=device, timeout=timedelta(seconds=120))
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                                timeout=timedelta(seconds=120))
    try:
        x = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
        dist.all_reduce(x)  # warm-up: connections, NCCL's channels
        x.fill_(1.0)
        if device_type == "cuda":
            torch.cuda.synchronize(device)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(x)
        if device_type == "cuda":
            torch.cuda.synchronize(device)
        seconds = (time.perf_counter() - start) / iters
        # Every element was summed `iters` times from ones: world ** iters (exact in fp32 here).
        expected = float(world) ** iters
        ok = bool(torch.all(x == expected).item())
        if rank == 0:
            Path(out_path).write_text(json.dumps({"seconds": seconds, "correct": ok}))
    finally:
        dist.destroy_process_group()


def measure_allreduce(ranks: list[int], device_type: str, nbytes: int, iters: int) -> dict:
    """Time an all-reduce of `nbytes` over one process per entry of `ranks` (GPU indices)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        mp.start_processes(_allreduce_rank, nprocs=len(ranks), start_method="spawn",
                           args=(ranks, device_type, nbytes, iters, os.path.join(tmp, "store"),
                                 out))
        res = json.loads(Path(out).read_text())
    return {"ranks": ranks, "bytes": nbytes, "seconds": res["seconds"],
            "correct": res["correct"], **bus_bandwidth(nbytes, res["seconds"], len(ranks))}


def infiniband_devices() -> list[str]:
    root = Path("/sys/class/infiniband")
    return sorted(p.name for p in root.iterdir()) if root.is_dir() else []


def facts() -> dict:
    """Everything that needs no communication."""
    out = {
        "host": socket.gethostname(),
        "torch": torch.__version__,
        "cuda_build": torch.version.cuda,
        "gloo_available": dist.is_gloo_available(),
        "nccl_available": dist.is_nccl_available(),
        "network_interfaces": [name for _, name in socket.if_nameindex()],
        "infiniband_devices": infiniband_devices(),
        "env": {k: os.environ[k] for k in NCCL_VARS if k in os.environ},
        "gpu_count": torch.cuda.device_count() if torch.cuda.is_available() else 0,
    }
    if out["gpu_count"]:
        props = [torch.cuda.get_device_properties(i) for i in range(out["gpu_count"])]
        out["gpus"] = [{"name": p.name, "memory_gib": round(p.total_memory / 1024**3, 1),
                        "capability": f"{p.major}.{p.minor}"} for p in props]
        out["nccl_version"] = ".".join(map(str, torch.cuda.nccl.version()))
        n = out["gpu_count"]
        out["p2p"] = {f"{i}-{j}": torch.cuda.can_device_access_peer(i, j)
                      for i in range(n) for j in range(n) if i < j}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m torchllm.tools.env_check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size_mb", type=float, default=1024, help="all-reduce size (MB, 1e6 bytes)")
    p.add_argument("--iters", type=int, default=5, help="timed all-reduces (after one warm-up)")
    p.add_argument("--cpu_ranks", type=int, default=0,
                   help="without GPUs: all-reduce over this many local gloo processes (0 = skip)")
    p.add_argument("--json", default=None, help="also write the report here")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    nbytes = int(args.size_mb * 1e6) // 4 * 4
    report = facts()
    print(f"torch {report['torch']} (CUDA build {report['cuda_build']}), gloo "
          f"{report['gloo_available']}, nccl {report['nccl_available']}, host {report['host']}")
    print(f"network interfaces: {', '.join(report['network_interfaces'])} "
          "(NCCL_SOCKET_IFNAME picks one)")
    print(f"InfiniBand devices: {', '.join(report['infiniband_devices']) or 'none'}"
          + ("" if report["infiniband_devices"] else " (NCCL uses TCP sockets; NCCL_IB_DISABLE=1 "
             "silences the search)"))
    print(f"NCCL/gloo variables set: {report['env'] or 'none'}")
    n = report["gpu_count"]
    runs = []
    if n == 0:
        print("no GPU: nothing to measure over NCCL (GPU count 0)")
        if args.cpu_ranks > 1:
            runs.append(measure_allreduce(list(range(args.cpu_ranks)), "cpu", nbytes, args.iters))
    else:
        print(f"GPUs: {n} x {report['gpus'][0]['name']} ({report['gpus'][0]['memory_gib']} GiB, "
              f"sm {report['gpus'][0]['capability']}), NCCL {report['nccl_version']}")
        blocked = [k for k, v in report["p2p"].items() if not v]
        if n > 1:
            print("P2P: " + ("every pair" if not blocked else f"NOT between {', '.join(blocked)} "
                             "(NCCL routes those through host memory; if it hangs, "
                             "NCCL_P2P_DISABLE=1)"))
            runs.append(measure_allreduce(list(range(n)), "cuda", nbytes, args.iters))
            for j in range(1, n) if n > 2 else ():
                runs.append(measure_allreduce([0, j], "cuda", nbytes, args.iters))
        else:
            print("one GPU: no link to measure (the all-reduce bandwidth needs >= 2 GPUs)")
    for r in runs:
        print(f"all-reduce {r['bytes'] / 1e9:.2f} GB over ranks {r['ranks']}: "
              f"{r['seconds'] * 1e3:.1f} ms, algbw {r['algbw_gbps']:.2f} GB/s, "
              f"busbw {r['busbw_gbps']:.2f} GB/s, result {'correct' if r['correct'] else 'WRONG'}")
    report["allreduce"] = runs
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0 if all(r["correct"] for r in runs) else 1


if __name__ == "__main__":
    exit_process(main())
