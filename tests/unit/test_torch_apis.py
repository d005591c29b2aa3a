"""Every torch API the package names exists in the installed torch (issue 21, item 6).

pyproject.toml admits the torch range we run (the GPU machines' 2.11 up to the development
machines' 2.13); on each of them this test resolves every `import torch...`, `from torch...
import ...` and every attribute chain rooted at torch (or an alias of a torch module) found in
torchllm/, so an API missing from the floor fails here instead of in the middle of a run.
"""

from __future__ import annotations

import ast
import importlib
import re

import pytest
import torch

from conftest import REPO


def _resolve(path: str) -> bool:
    """Whether the dotted name `path` (torch...) exists: its longest importable prefix is
    imported (a package may shadow a submodule's name with a function), the rest looked up."""
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for name in parts[i:]:
            if not hasattr(obj, name):
                return False
            obj = getattr(obj, name)
        return True
    return False


def _chain(node: ast.AST) -> list[str] | None:
    """['a', 'b', 'c'] for the expression a.b.c, None for anything else."""
    names = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return [node.id, *reversed(names)]
    return None


def torch_names(source: str) -> set[str]:
    """The dotted torch names a module uses (per file: aliases of torch modules followed)."""
    tree = ast.parse(source)
    aliases = {"torch": "torch"}
    used: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "torch":
                    used.add(a.name)
                    aliases[a.asname or "torch"] = a.name if a.asname else "torch"
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 \
                and node.module.split(".")[0] == "torch":
            for a in node.names:
                used.add(f"{node.module}.{a.name}")
                aliases[a.asname or a.name] = f"{node.module}.{a.name}"
    for node in ast.walk(tree):
        chain = _chain(node) if isinstance(node, ast.Attribute) else None
        if chain and chain[0] in aliases:
            used.add(".".join([aliases[chain[0]], *chain[1:]]))
    # Keep the longest chains only (a.b.c covers a.b).
    return {n for n in used if not any(m.startswith(n + ".") for m in used)}


def package_torch_names() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for path in sorted((REPO / "torchllm").rglob("*.py")):
        for name in torch_names(path.read_text()):
            found.setdefault(name, []).append(str(path.relative_to(REPO)))
    return found


def test_the_scan_sees_imports_aliases_and_attribute_chains():
    names = torch_names(
        "import torch\nimport torch.distributed as dist\nfrom torch import nn\n"
        "from torch.nn import functional as F\n"
        "x = torch.ops.aten.mm.default\ndist.all_reduce(t)\nnn.init.zeros_(w)\nF.silu(x)\n"
    )
    assert {"torch.ops.aten.mm.default", "torch.distributed.all_reduce",
            "torch.nn.init.zeros_", "torch.nn.functional.silu"} <= names
    assert not _resolve("torch.optim.NoSuchOptimizer")


def test_every_torch_api_the_package_uses_exists():
    found = package_torch_names()
    assert len(found) > 100  # the scan really ran over the package
    assert "torch.optim.Muon" in found and "torch.compiler.set_stance" in found
    missing = {name: files for name, files in found.items() if not _resolve(name)}
    assert not missing, f"torch {torch.__version__} lacks: {missing}"


def test_installed_torch_is_in_the_supported_range():
    text = (REPO / "pyproject.toml").read_text()
    low, high = re.search(r'"torch>=([\d.]+),<([\d.]+)"', text).groups()
    version = tuple(int(x) for x in re.match(r"(\d+)\.(\d+)", torch.__version__).groups())
    as_tuple = lambda v: tuple(int(x) for x in v.split(".")[:2])  # noqa: E731
    if not as_tuple(low) <= version < as_tuple(high):
        pytest.fail(f"torch {torch.__version__} is outside pyproject.toml's >={low},<{high}")
