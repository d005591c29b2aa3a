"""How many functions take the whole JobConfig (issue 64, "components own their config").

    python scripts/config_coupling.py [--list] [PATH ...]     (default: torchllm/)

A function counts when one of its parameters is annotated JobConfig (or "JobConfig"), or is not
annotated and the body reads a JobConfig section through it (`param.model`, `param.training`,
... any [section] name; a parameter named `trainer` is not a config): the whole bag arrives,
whatever it is called (cfg, config, job_config). Methods count like functions. Measured by the
AST alone: nothing is imported. Issue 64 measured 66 functions in 34 modules another way; this
script is the measure its before/after numbers use.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

SECTIONS = {"job", "model", "training", "optimizer", "lr_scheduler", "parallelism", "comm",
            "activation_checkpoint", "compile", "float8", "lora", "data", "metrics",
            "profiling", "checkpoint", "validation", "eval", "fault_tolerance"}
# Objects with attributes named like sections that are not the config (the Trainer bag is
# counted by its own measure, issue 64 #1).
NOT_A_CONFIG = {"trainer"}


def _annotation(arg: ast.arg) -> str:
    return ast.unparse(arg.annotation) if arg.annotation is not None else ""


def whole_config_params(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    args = [*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs]
    named = {a.arg: _annotation(a) for a in args if a.arg not in ("self", "cls")}
    hits = [n for n, ann in named.items() if "JobConfig" in ann]
    unannotated = {n for n, ann in named.items()
                   if (not ann or ann in ("Any", "object")) and n not in NOT_A_CONFIG}
    for node in ast.walk(fn):
        if (isinstance(node, ast.Attribute) and node.attr in SECTIONS
                and isinstance(node.value, ast.Name) and node.value.id in unannotated
                and node.value.id not in hits):
            hits.append(node.value.id)
    return hits


def scan(paths: list[Path]) -> list[tuple[str, str, list[str]]]:
    found = []
    for root in paths:
        files = [root] if root.is_file() else sorted(root.rglob("*.py"))
        for path in files:
            tree = ast.parse(path.read_text(), str(path))
            for node in ast.walk(tree):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    params = whole_config_params(node)
                    if params:
                        found.append((str(path), node.name, params))
    return found


def main(argv: list[str]) -> int:
    show = "--list" in argv
    paths = [Path(a) for a in argv if a != "--list"] or [Path("torchllm")]
    found = scan(paths)
    if show:
        for path, name, params in found:
            print(f"{path}:{name}({', '.join(params)})")
    modules = {path for path, _, _ in found}
    print(f"{len(found)} functions in {len(modules)} modules take the whole JobConfig")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
