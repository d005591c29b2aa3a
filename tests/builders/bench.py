"""Shared test builders (tests/builders/bench.py): imported by the test modules that use them."""

from __future__ import annotations

from conftest import REPO


def benchmark_script(name: str):
    """benchmarks/<name>.py as a module (the folder is scripts, not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
