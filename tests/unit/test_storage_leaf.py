"""torchllm/storage.py is a leaf resolved once per location kind: it imports nothing from
torchllm, and `storage_for` makes one storage (one fsspec file system) per protocol, local paths
included, checking the protocol's package once."""

import ast
from pathlib import Path

from fsspec.implementations.local import LocalFileSystem

from torchllm import storage

from conftest import REPO


def test_storage_imports_nothing_from_torchllm():
    tree = ast.parse((REPO / "torchllm" / "storage.py").read_text())
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    names += [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module]
    assert names and not [n for n in names if n.split(".")[0] == "torchllm"]


def test_each_protocol_is_resolved_once(tmp_path, monkeypatch):
    checks = []
    missing = storage._missing.__wrapped__
    monkeypatch.setattr(storage, "_missing", lambda p: checks.append(p) or missing(p))
    storage._storage_of.cache_clear()
    try:
        a, b = storage.storage_for("memory://bucket/a"), storage.storage_for("memory://other/b")
        assert a is b and checks == ["memory"]  # one client, one package check
        local = storage.storage_for(tmp_path / "x")
        assert local is storage.storage_for(str(tmp_path)) and not local.remote
        assert isinstance(local.fs, LocalFileSystem)
        # The same operations on both: a durable write read back, a folder listed in one scan.
        for store, root in ((a, "memory://bucket/run"), (local, tmp_path / "run")):
            if not store.remote:
                Path(root, "step-1").mkdir(parents=True)
            store.write_durably(storage.join(root, "step-1", "COMPLETE"), "{}")
            assert store.read_bytes(storage.join(root, "step-1", "COMPLETE")) == b"{}"
            assert store.scan(root) == {"step-1": {"COMPLETE"}}
    finally:
        storage._storage_of.cache_clear()
