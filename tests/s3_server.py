"""A real S3 endpoint for tests: moto's standalone server on 127.0.0.1 (a free port), in its own
process, reached over HTTP by s3fs exactly as a real bucket would be.

    def test_x(s3):            # s3 = "s3://<a fresh bucket>"; AWS_* set for this test only
    (s3_module: the same for a module-scoped fixture)
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import uuid

import pytest

ENV = ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")
UNSET = ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def s3_endpoint():
    """One moto server per test module; stopped after its last test."""
    pytest.importorskip("s3fs", reason='the object-storage tests need pip install -e ".[test]"')
    pytest.importorskip("moto.server", reason='the object-storage tests need moto[server]')
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p",
                             str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert proc.poll() is None, "moto server exited at start"
                assert time.monotonic() < deadline, "moto server did not start in 60 s"
                time.sleep(0.2)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _forget_clients() -> None:
    """Drop cached file-system objects: they hold the endpoint they were made with."""
    import s3fs

    from torchllm import storage

    storage._storage_of.cache_clear()
    s3fs.S3FileSystem.clear_instance_cache()


def _bucket(endpoint: str, monkeypatch) -> str:
    """A fresh bucket on `endpoint`, with the AWS_* variables pointing at it (through
    `monkeypatch`, so they are restored after); returns "s3://bucket"."""
    for key, value in zip(ENV, (endpoint, "testing", "testing", "us-east-1")):
        monkeypatch.setenv(key, value)
    for key in UNSET:
        monkeypatch.delenv(key, raising=False)
    _forget_clients()
    import s3fs

    bucket = f"t-{uuid.uuid4().hex[:12]}"
    s3fs.S3FileSystem().mkdir(bucket)
    return f"s3://{bucket}"


@pytest.fixture
def s3(s3_endpoint, monkeypatch) -> str:
    """A fresh bucket on the module's server, as "s3://bucket"; the AWS_* variables point at
    the server for this test only (torchrun's ranks inherit them)."""
    yield _bucket(s3_endpoint, monkeypatch)
    _forget_clients()


@pytest.fixture(scope="module")
def s3_module(s3_endpoint) -> str:
    """As `s3`, for a module-scoped fixture: one bucket and the variables for the module."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        yield _bucket(s3_endpoint, monkeypatch)
        _forget_clients()
