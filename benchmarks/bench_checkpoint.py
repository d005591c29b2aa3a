"""How long training is blocked by a checkpoint save, and how fast saves and loads are.

    python benchmarks/bench_checkpoint.py [--flavor 125M] [--folder DIR] [--json OUT.json]

Builds a Llama flavor (default 125M: ~128M parameters, ~1.5 GB of fp32 weights + AdamW state)
on CPU, then measures, with the same Checkpointer the trainer uses:
  - the disk's own sequential write speed (dd-style: 1 MiB blocks, fsync at the end),
  - a synchronous save (time, MB/s) and a load (time, MB/s),
  - the CRC-32 checksums the COMPLETE marker records (part of every save) and that a load
    verifies (checkpoint.checksums): their time over the whole checkpoint,
  - an async save: the time the training loop is blocked (the save() call plus waiting for
    staging before the next optimizer step, while a real forward/backward runs in between),
    and the time until the checkpoint is complete on disk.
Target: blocked by an async save <= 10% of a synchronous save. Prints a table, writes JSON.

`--s3` adds rows for a local S3 server (moto's, started on 127.0.0.1 for the run; needs
`pip install -e ".[test]"`): a sync save and a load through s3fs (MB/s against the local disk's),
and the training loop's blocked time of an async save straight to the store and of one written
to a local mirror and uploaded in the background (checkpoint.local_mirror).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from torchllm.checkpoint import Checkpointer, TrainState
from torchllm.checkpoint.integrity import folder_checksums, verify_files
from torchllm.loss import cross_entropy_sum
from torchllm.models.llama.args import flavors
from torchllm.models.llama.model import Transformer


def disk_write_speed(folder: Path, nbytes: int) -> float:
    """MB/s of writing `nbytes` sequentially in 1 MiB blocks and fsync-ing, like dd conv=fsync."""
    block = os.urandom(1 << 20)
    path = folder / "dd.bin"
    start = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(nbytes >> 20):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    elapsed = time.perf_counter() - start
    path.unlink()
    return nbytes / elapsed / 1e6


def checkpoint_config(**overrides) -> SimpleNamespace:
    cfg = dict(enable=True, folder="checkpoint", interval=1, keep_latest_k=0,
               async_mode="disabled", load_step=-1, exclude_from_loading=[],
               initial_load_path="", initial_load_model_only=True, last_save_model_only=False,
               export_dtype="float32", create_seed_checkpoint=False, checksums=True,
               on_save_error="stop", optimizer_hparams_from="checkpoint",
               allow_global_batch_change=False, local_mirror="")
    cfg.update(overrides)
    return SimpleNamespace(**cfg)


def async_save(ccfg, run_dir, model, optimizer, forward_backward) -> tuple[float, float]:
    """(seconds the training loop is blocked, seconds until complete) of one async save."""
    asyn = Checkpointer(ccfg, run_dir, model, optimizer, train_state=TrainState())
    t0 = time.perf_counter()
    asyn.save(1)
    blocked = time.perf_counter() - t0
    forward_backward()  # the next training step runs while staging proceeds
    t1 = time.perf_counter()
    asyn.wait_for_staging()
    blocked += time.perf_counter() - t1
    optimizer.step()
    asyn.wait()
    total = time.perf_counter() - t0
    asyn.close()
    return blocked, total


def s3_rows(root: Path, model, optimizer, forward_backward, size: int) -> dict:
    """Sync save, load and async saves (direct, local mirror) against a local moto server."""
    import subprocess
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from s3_server import free_port

    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p",
                               str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        os.environ.update(AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}", AWS_ACCESS_KEY_ID="bench",
                          AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1")
        import s3fs

        for _ in range(300):
            try:
                s3fs.S3FileSystem(skip_instance_cache=True).mkdir("bench")
                break
            except Exception:  # noqa: BLE001 - the server is still starting
                time.sleep(0.2)
        url = "s3://bench/ckpt"
        sync = Checkpointer(checkpoint_config(folder=f"{url}/sync"), root / "s3sync", model,
                            optimizer, train_state=TrainState())
        t0 = time.perf_counter()
        sync.save(1)
        save_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        sync.load()
        load_s = time.perf_counter() - t0
        blocked, total = async_save(checkpoint_config(folder=f"{url}/async", async_mode="async"),
                                    root / "s3async", model, optimizer, forward_backward)
        mblocked, mtotal = async_save(
            checkpoint_config(folder=f"{url}/mirror", async_mode="async",
                              local_mirror="mirror"),
            root / "s3mirror", model, optimizer, forward_backward)
    finally:
        server.terminate()
        server.wait(timeout=30)
    return dict(s3_sync_save_s=save_s, s3_sync_save_MBps=size / save_s / 1e6, s3_load_s=load_s,
                s3_load_MBps=size / load_s / 1e6, s3_async_blocked_s=blocked,
                s3_async_total_s=total, s3_mirror_blocked_s=mblocked, s3_mirror_total_s=mtotal)


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--flavor", default="125M", choices=sorted(flavors))
    parser.add_argument("--folder", default=None, help="where to write (default: a temp dir)")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--json", default="benchmarks/results/checkpoint.json")
    parser.add_argument("--s3", action="store_true", help="add rows for a local S3 server")
    args = parser.parse_args()

    torch.manual_seed(0)
    model_args = flavors[args.flavor].with_overrides(max_seq_len=args.seq_len)
    model = Transformer(model_args)
    model.init_weights()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, model_args.vocab_size, (1, args.seq_len + 1))

    def forward_backward() -> None:
        loss = cross_entropy_sum(model(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()

    forward_backward()
    optimizer.step()  # materialize AdamW state so the checkpoint has its real size
    n_params = sum(p.numel() for p in model.parameters())

    root = Path(args.folder or tempfile.mkdtemp(prefix="torchllm-bench-ckpt-"))
    root.mkdir(parents=True, exist_ok=True)
    results: dict = {"flavor": args.flavor, "params": n_params, "folder": str(root)}
    try:
        sync = Checkpointer(checkpoint_config(), root / "sync", model, optimizer,
                            train_state=TrainState())
        t0 = time.perf_counter()
        sync.save(1)
        sync_s = time.perf_counter() - t0
        step1 = root / "sync" / "checkpoint" / "step-1"
        size = folder_bytes(step1)
        t0 = time.perf_counter()
        sync.load()
        load_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        files = folder_checksums(step1)
        checksum_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        assert verify_files(step1, files, sorted(files)) is None
        verify_s = time.perf_counter() - t0

        results["disk_write_MBps"] = disk_write_speed(root, min(size, 2 << 30))

        blocked, async_total = async_save(checkpoint_config(async_mode="async"),
                                          root / "async", model, optimizer, forward_backward)
        if args.s3:
            results.update(s3_rows(root, model, optimizer, forward_backward, size))

        results.update(
            checkpoint_MB=size / 1e6,
            sync_save_s=sync_s,
            sync_save_MBps=size / sync_s / 1e6,
            load_s=load_s,
            load_MBps=size / load_s / 1e6,
            checksum_s=checksum_s,
            checksum_pct_of_sync_save=100 * checksum_s / sync_s,
            verify_s=verify_s,
            verify_pct_of_load=100 * verify_s / load_s,
            async_blocked_s=blocked,
            async_total_s=async_total,
            async_blocked_pct_of_sync=100 * blocked / sync_s,
            target_met=blocked <= 0.10 * sync_s,
        )
    finally:
        if args.folder is None:
            shutil.rmtree(root, ignore_errors=True)

    rows = [
        ("parameters", f"{n_params:,}"),
        ("checkpoint size", f"{results['checkpoint_MB']:.0f} MB"),
        ("disk write (dd-style, fsync)", f"{results['disk_write_MBps']:.0f} MB/s"),
        ("sync save", f"{sync_s:.2f} s ({results['sync_save_MBps']:.0f} MB/s)"),
        ("load", f"{load_s:.2f} s ({results['load_MBps']:.0f} MB/s)"),
        ("checksums at save (in sync save)", f"{checksum_s:.2f} s "
         f"({results['checksum_pct_of_sync_save']:.0f}% of the sync save)"),
        ("checksum check at load (in load)", f"{verify_s:.2f} s "
         f"({results['verify_pct_of_load']:.0f}% of the load)"),
        ("async save: training blocked", f"{blocked:.3f} s "
         f"({results['async_blocked_pct_of_sync']:.1f}% of sync; target <= 10%)"),
        ("async save: until complete", f"{async_total:.2f} s"),
    ]
    if args.s3:
        r = results
        rows += [
            ("S3 (local moto server): sync save", f"{r['s3_sync_save_s']:.2f} s "
             f"({r['s3_sync_save_MBps']:.0f} MB/s; local disk {results['sync_save_MBps']:.0f})"),
            ("S3: load", f"{r['s3_load_s']:.2f} s ({r['s3_load_MBps']:.0f} MB/s; local disk "
             f"{results['load_MBps']:.0f})"),
            ("S3: async save, training blocked", f"{r['s3_async_blocked_s']:.3f} s (complete "
             f"after {r['s3_async_total_s']:.2f} s)"),
            ("S3: local mirror + upload, blocked", f"{r['s3_mirror_blocked_s']:.3f} s "
             f"(complete after {r['s3_mirror_total_s']:.2f} s)"),
        ]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
