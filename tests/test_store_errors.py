"""An object store that stalls or refuses during a save: the save fails within
checkpoint.store_timeout_s with one line naming the URL, and checkpoint.on_save_error decides
(continue: training goes on and the next save lands; stop: CheckpointSaveError, exit 4).

The store is moto's server (tests/s3_server.py) behind a TCP proxy that this test switches to
"stall" (connections accepted, nothing answered) or "refuse" (the port closed)."""

from __future__ import annotations

import logging
import socket
import threading
import time

import pytest

from torchllm.checkpoint import storage
from torchllm.checkpoint.checkpointer import Checkpointer, CheckpointSaveError
from torchllm.checkpoint.layout import complete_steps
from torchllm.train import Trainer

from conftest import tiny_config
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
    """Step 2's save meets a store that accepts and never answers: with store_timeout_s = 3 it
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
                      "--training.steps=3", f"--checkpoint.folder={remote}",
                      "--checkpoint.on_save_error=continue", "--checkpoint.store_timeout_s=3")
    with caplog.at_level(logging.ERROR, logger="torchllm"):
        losses = Trainer(cfg).train()
    assert len(losses) == 3
    assert stall.took < 40, f"the stalled save took {stall.took:.0f}s"
    (line,) = [r.getMessage() for r in caplog.records if "could not be saved" in r.getMessage()]
    assert "\n" not in line
    assert line.startswith(f"checkpoint step 2 could not be saved to {remote}/step-2: ")
    assert "(no answer within checkpoint.store_timeout_s = 3 s)" in line
    assert "training continues" in line
    assert complete_steps(remote) == [1, 3]


@pytest.mark.slow
def test_a_refusing_store_is_a_save_error_not_a_traceback(proxied, tmp_path, monkeypatch):
    """The store's port closes before step 2's save: botocore's EndpointConnectionError (not
    an OSError) goes through checkpoint.on_save_error: 'stop' raises CheckpointSaveError (exit
    4 in a launch) with one line naming the step's URL."""
    proxy, bucket = proxied
    remote = f"{bucket}/ckpt"
    switch_at(monkeypatch, {2: proxy.refuse})
    cfg = tiny_config(tmp_path, "--checkpoint.enable", "--checkpoint.interval=1",
                      "--training.steps=2",
                      f"--checkpoint.folder={remote}", "--checkpoint.store_timeout_s=10")
    trainer = Trainer(cfg)
    t0 = time.monotonic()
    with pytest.raises(CheckpointSaveError) as err:
        trainer.train()
    msg = str(err.value)
    assert "\n" not in msg and time.monotonic() - t0 < 60
    assert msg.startswith(f"checkpoint step 2 could not be saved to {remote}/step-2: "
                          "EndpointConnectionError: Could not connect to the endpoint URL"), msg
    assert "checkpoint.on_save_error = 'continue' keeps training" in msg
