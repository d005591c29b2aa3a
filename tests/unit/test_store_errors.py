"""Where saves and prepared data go, failing: an object store that stalls or refuses during a
save fails it within checkpoint.store_timeout_s with one line naming the URL, and
checkpoint.on_save_error decides (continue: training goes on and the next save lands; stop:
CheckpointSaveError, exit 4); a full disk (a real tmpfs, mounted where root may) is named as
such during a save, at the start of a run and in `prepare` (without the right to mount: writes
to /dev/full, the kernel's own ENOSPC, so these never skip where /dev/full exists).

The store is moto's server (tests/s3_server.py) behind a TCP proxy that this test switches to
"stall" (connections accepted, nothing answered) or "refuse" (the port closed)."""

from __future__ import annotations

import logging
import re
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

from torchllm import storage
from torchllm.checkpoint import Checkpointer, CheckpointSaveError
from torchllm.checkpoint.layout import complete_steps
from torchllm.train import Trainer

from conftest import SHARED, tiny_args, tiny_config
from s3_server import ENV, _bucket, _forget_clients, s3_endpoint  # noqa: F401 - fixture


class Proxy:
    """127.0.0.1:<port> -> `target`; `mode`: "pass", "stall" or "refuse"."""

    def __init__(self, target: str):
        host, port = target.rsplit("/", 1)[-1].split(":")
        self.target = (host, int(port))
        self.mode = "pass"
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.held: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _accept(self):
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return  # closed: "refuse"
            if self.mode != "pass":
                self.held.append(conn)  # accepted, never answered
                continue
            upstream = socket.create_connection(self.target)
            for a, b in ((conn, upstream), (upstream, conn)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, src, dst):
        try:
            while data := src.recv(65536):
                while self.mode == "stall":  # a connection the client reuses stalls too
                    time.sleep(0.1)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.close()
                except OSError:
                    pass

    def refuse(self):
        self.mode = "refuse"
        self.server.close()

    def close(self):
        self.server.close()
        for conn in self.held:
            conn.close()


@pytest.fixture
def proxied(s3_endpoint, monkeypatch):  # noqa: F811 - the fixture
    """(proxy, "s3://bucket"): a fresh bucket reached through the proxy."""
    proxy = Proxy(s3_endpoint)
    bucket = _bucket(s3_endpoint, monkeypatch)
    monkeypatch.setenv(ENV[0], proxy.url)
    monkeypatch.setattr(storage, "STORE_TIMEOUT_S", storage.STORE_TIMEOUT_S)  # restored after
    _forget_clients()
    yield proxy, bucket
    proxy.close()
    _forget_clients()


# The object-store tests' model: small (~1 MB saved, not ~41 MB), so that the store answers a
# save's requests well within store_timeout_s = 2 s (s3fs's 5 tries of a stalled request then
# take ~12 s, not ~17 s at 3 s) even on a loaded machine.
SMALL = ("--model.dim=64", "--model.n_layers=1", "--model.n_heads=4", "--model.n_kv_heads=2")


def switch_at(monkeypatch, changes: dict):
    """Before the save of step N, call changes[N]()."""
    save = Checkpointer.save

    def patched(self, step, *args, **kwargs):
        if step in changes:
            changes[step]()
        return save(self, step, *args, **kwargs)

    monkeypatch.setattr(Checkpointer, "save", patched)


@pytest.mark.slow
def test_a_stalled_store_fails_the_save_in_time_and_continue_keeps_training(
        proxied, tmp_path, monkeypatch, caplog):
    """Step 2's save meets a store that accepts and never answers: with store_timeout_s = 2 it
    fails in seconds (not minutes) with one line naming the step's URL and the key; training
    continues and step 3 (store answering again) is saved."""
    proxy, bucket = proxied
    remote = f"{bucket}/ckpt"

    def stall():
        proxy.mode = "stall"
        stall.t0 = time.monotonic()

    def answer():
        proxy.mode = "pass"
        stall.took = time.monotonic() - stall.t0

    switch_at(monkeypatch, {2: stall, 3: answer})
    cfg = tiny_config(tmp_path, "--checkpoint.enable", "--checkpoint.interval=1",
                      "--training.steps=3", f"--checkpoint.folder={remote}", *SMALL,
                      "--checkpoint.on_save_error=continue", "--checkpoint.store_timeout_s=2")
    with caplog.at_level(logging.ERROR, logger="torchllm"):
        losses = Trainer(cfg).train()
    assert len(losses) == 3
    assert stall.took < 40, f"the stalled save took {stall.took:.0f}s"
    (line,) = [r.getMessage() for r in caplog.records if "could not be saved" in r.getMessage()]
    assert "\n" not in line  # the step, its URL, the timeout's key and value, and what happens
    assert "step 2" in line and f"{remote}/step-2" in line, line
    assert "checkpoint.store_timeout_s = 2" in line and "continues" in line, line
    assert complete_steps(remote) == [1, 3]


def stopped_by_the_store(tmp_path, remote: str, *extra: str, capfd) -> tuple[str, float]:
    """`python -m torchllm.train`'s main (what each rank runs) with checkpoint.on_save_error =
    'stop', a save every step to `remote`, 2 steps: it must return exit code 4; (the one console
    line saying step 2 could not be saved, the seconds it took)."""
    from torchllm.train import main

    t0 = time.monotonic()
    code = main(tiny_args(tmp_path, "--checkpoint.enable", "--checkpoint.interval=1",
                          "--training.steps=2", f"--checkpoint.folder={remote}",
                          "--checkpoint.on_save_error=stop", *SMALL, *extra))
    took = time.monotonic() - t0
    out = capfd.readouterr()
    text = out.out + out.err
    assert code == 4, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    (line,) = [x for x in text.splitlines() if "could not be saved" in x]
    return line, took


@pytest.mark.slow
def test_a_refusing_store_is_a_save_error_not_a_traceback(proxied, tmp_path, monkeypatch,
                                                         capfd):
    """The store's port closes before step 2's save: botocore's EndpointConnectionError (not
    an OSError) goes through checkpoint.on_save_error: 'stop' ends the process with exit code 4
    and one line naming the step's URL."""
    proxy, bucket = proxied
    remote = f"{bucket}/ckpt"
    switch_at(monkeypatch, {2: proxy.refuse})
    line, took = stopped_by_the_store(tmp_path, remote, "--checkpoint.store_timeout_s=10",
                                      capfd=capfd)
    assert took < 60, f"the refused save took {took:.0f}s"
    # The step, its URL, the store's error, and the key and value that would keep training.
    assert "step 2" in line and f"{remote}/step-2" in line, line
    assert "EndpointConnectionError" in line, line
    assert "checkpoint.on_save_error = 'continue'" in line, line


@pytest.mark.slow
def test_a_stalled_store_with_stop_exits_4_naming_the_url(proxied, tmp_path, monkeypatch,
                                                          capfd):
    """The store accepts and never answers from step 2's save on: with store_timeout_s = 2 and
    on_save_error = 'stop' the process ends with exit code 4 in seconds, one line naming the
    step's URL and the timeout key."""
    proxy, bucket = proxied
    remote = f"{bucket}/ckpt"
    switch_at(monkeypatch, {2: lambda: setattr(proxy, "mode", "stall")})
    line, took = stopped_by_the_store(tmp_path, remote, "--checkpoint.store_timeout_s=2",
                                      capfd=capfd)
    assert took < 60, f"the stalled save took {took:.0f}s"
    assert "step 2" in line and f"{remote}/step-2" in line, line
    assert "checkpoint.store_timeout_s = 2" in line, line
    proxy.mode = "pass"  # the store answers again: step 1 is there, step 2 never completed
    assert complete_steps(remote) == [1]


# --- a full disk ---------------------------------------------------------------------------------

FULL = Path("/dev/full")  # every write fails with the kernel's ENOSPC; no root needed


@pytest.fixture
def small_disk(tmp_path):
    """mount_at(folder, size) -> (folder, mounted): a tmpfs of `size` there where mounting is
    allowed (root with the capability); elsewhere the plain folder and mounted = False, and the
    test fills its disk through /dev/full instead (skipped only without /dev/full). Unmounted
    after the test."""
    mounted = []

    def mount_at(folder, size: str):
        folder.mkdir(parents=True, exist_ok=True)
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            if not FULL.exists():
                pytest.skip(f"cannot mount a tmpfs here ({proc.stderr.strip()}) and no {FULL}")
            return folder, False
        mounted.append(folder)
        return folder, True

    yield mount_at
    for folder in mounted:
        subprocess.run(["umount", "-l", str(folder)], check=False)


def test_a_disk_that_fills_during_a_save_is_named(small_disk, tmp_path, monkeypatch):
    """The pre-save check sees room (another writer fills the disk during the save): torch's
    write fails on the real 8 MB tmpfs ("unexpected pos" or ENOSPC) and the line says "no space
    left on <folder>" with the bytes needed."""
    from torchllm.checkpoint.resume import saver
    from torchllm.storage import LocalStorage

    disk, mounted = small_disk(tmp_path / "run" / "checkpoint", "8m")
    # the launch's check and the save's (both ask the folder's storage): "plenty"
    monkeypatch.setattr(LocalStorage, "free_bytes", lambda self, folder: 1 << 40)
    if not mounted:  # DCP's own writer writes rank 0's data file into /dev/full
        save = saver.dcp.save

        def into_full(state, storage_writer):
            step = Path(storage_writer.path)
            step.mkdir(parents=True, exist_ok=True)
            (step / "__0_0.distcp").symlink_to(FULL)
            return save(state, storage_writer=storage_writer)

        monkeypatch.setattr(saver.dcp, "save", into_full)
    trainer = Trainer(tiny_config(tmp_path, "--checkpoint.enable", "--job.run_name=run",
                                  "--training.steps=1"))
    with pytest.raises(CheckpointSaveError) as err:
        trainer.train()
    msg = str(err.value)
    assert "\n" not in msg
    # The step, its folder, the disk full ("no space left": ENOSPC's words), and the bytes needed.
    assert "step 1" in msg and str(disk / "step-1") in msg, msg
    assert f"no space left on {disk}" in msg and re.search(r"[\d.]+ MB", msg), msg
    assert list(disk.iterdir()) == []  # the partial step removed


def test_a_launch_on_a_full_disk_is_refused_before_step_1(small_disk, tmp_path, capfd,
                                                         monkeypatch):
    """`python -m torchllm.train` (what each rank runs) with its checkpoint folder on a disk
    without room for one save: exit 4 with one line, before any step."""
    from torchllm.checkpoint.resume import checkpointer
    from torchllm.train import main

    disk, mounted = small_disk(tmp_path / "run" / "checkpoint", "1m")
    if not mounted:  # what a 1 MB disk reports
        monkeypatch.setattr(checkpointer, "free_bytes", lambda folder: 1 << 20)
    assert main(tiny_args(tmp_path, "--checkpoint.enable", "--job.run_name=run")) == 4
    out = capfd.readouterr()
    text = out.out + out.err
    (line,) = [x for x in text.splitlines() if "for one checkpoint" in x]
    assert f"no space left on {disk}" in line, line  # the disk, what a save needs, what is free
    assert re.search(r"[\d.]+ MB", line) and "1.0 MB free" in line, line
    assert "step     1" not in text and "Traceback" not in text


def test_prepare_on_a_full_disk_is_one_line(small_disk, tmp_path, monkeypatch, capfd):
    """`python -m torchllm.data.prepare` into a 256 KB tmpfs: exit 1 with one line naming the
    folder and what a shard needs; nothing left behind. (Without a tmpfs: prepare's main in
    this process, its first shard's bytes going to /dev/full after a partial header.)"""
    disk, mounted = small_disk(tmp_path / "disk", "256k")
    out = disk / "shards"
    args = ["--dataset", f"local:{SHARED / 'data' / 'tinyshakespeare.txt'}", "--tokenizer",
            "bytes", "--out", str(out), "--shard-tokens", "50000", "--workers", "1"]
    if mounted:
        from cli import run_module

        proc = run_module("torchllm.data.prepare", *args)
        code, err = proc.returncode, proc.stderr
    else:
        from torchllm.data import prepare

        def into_full(path, tokens):
            path.write_bytes(b"TLLMSHRD")  # a partial shard, to be removed
            with FULL.open("wb", buffering=0) as f:
                f.write(tokens.tobytes())

        monkeypatch.setattr(prepare, "write_shard", into_full)
        code, err = prepare.main(args), capfd.readouterr().err
    assert code == 1, err[-3000:]
    lines = [x for x in err.splitlines() if x.startswith("error:")]
    assert lines == [x for x in err.splitlines() if x.strip() and "tokenizing" not in x]
    # The folder, the disk full ("no space left": ENOSPC's words), a shard's size and its flag.
    assert f"no space left on {out}" in lines[0], err
    assert "0.00019 GiB" in lines[0] and "--shard-tokens 50,000" in lines[0], lines[0]
    assert "Traceback" not in err
    assert not out.exists() and list(disk.iterdir()) == []


def test_torch_saves_errno_less_short_write_counts_as_a_full_disk(small_disk, tmp_path,
                                                                   monkeypatch):
    """torch.save to a path on a full disk raises "RuntimeError: [enforce fail at
    inline_container.cc] . unexpected pos N vs M" with no errno (the error of the issue): a
    save failing with it says "no space left on <folder>"."""
    import torch

    disk, mounted = small_disk(tmp_path / "full", "64k")
    with pytest.raises(RuntimeError) as real:
        torch.save({"a": torch.zeros(100_000)}, disk / "x.pt" if mounted else FULL)
    assert "unexpected pos" in str(real.value) and not isinstance(real.value, OSError)
    trainer = Trainer(tiny_config(tmp_path, "--checkpoint.enable", "--job.run_name=run",
                                  "--training.steps=1"))

    def short_write(*args, **kwargs):
        raise real.value

    monkeypatch.setattr("torchllm.checkpoint.resume.saver.dcp.save", short_write)
    with pytest.raises(CheckpointSaveError) as err:
        trainer.train()
    folder = tmp_path / "run" / "checkpoint"
    msg = str(err.value)  # the step, its folder, the disk full, and torch's own error
    assert "step 1" in msg and str(folder / "step-1") in msg, msg
    assert f"no space left on {folder}" in msg and "inline_container.cc" in msg, msg
