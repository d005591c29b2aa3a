"""How many functions take the whole JobConfig (issue 64, "components own their config").

    python scripts/config_coupling.py [--list] [PATH ...]     (default: torchllm/)

A function counts when one of its parameters is annotated JobConfig (or "JobConfig"), or is not
annotated and the body reads a JobConfig section through it (`param.model`, `param.training`,
... any [section] name; a parameter named `trainer` is not a config): the whole bag arrives,
whatever it is called (cfg, config, job_config). Methods count like functions. Measured by the
AST alone: nothing is imported. Issue 64 measured 66 functions in 34 modules another way; this
script is the measure its before/after numbers use.

Some functions take the whole config because the whole config is their subject: the loader
that fills it key by key, the serializer and the header line that walk every section, and
the entry points that hand each piece its own sections. They are named in ENTRY_POINTS with
the reason, still counted, and shown apart (`[entry point: ...]` with --list), so that an
entry point is a decision someone wrote down, not a parameter renamed out of the measure's
sight. Every other function should take its section(s) plus runtime objects.
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

_LOADER = ("the loader builds the config: it sets a key of any section by name, suggests the "
           "closest of all keys, and selects the [model] / [optimizer] entry classes")
# "path:function" -> why it takes the whole JobConfig (see the module docstring).
ENTRY_POINTS = {
    "torchllm/config/loader.py:_all_keys": _LOADER,
    "torchllm/config/loader.py:_section": _LOADER,
    "torchllm/config/loader.py:_set": _LOADER,
    "torchllm/config/loader.py:_select_entries": _LOADER,
    "torchllm/config/loader.py:to_toml": "writes every section: the run's config.toml",
    "torchllm/metrics/header.py:config_changes": "every key of every section that differs from "
    "its default (the header's and the report's 'changed' lines)",
    "torchllm/tools/dry_run.py:dry_run": "the tool's report: the Trainer's checks, the memory "
    "estimate and the communication of the whole config",
    "torchllm/tools/estimate_memory.py:estimate_memory": "the estimate of the run a whole config "
    "describes (dry_run, bench_memory, the CLI); each term's function gets its sections",
    "torchllm/train.py:__init__": "the loop: resolves the run, then builds every component (the "
    "parallel plan, the model, the train module, data, callbacks) from its sections",
    "torchllm/run/resolve.py:resolve_run": "decides the run (folders, tokenizer, stage) once, "
    "from every section",
    "torchllm/eval/loss.py:evaluate_loss": "the body of `python -m torchllm.eval.loss`, on a "
    "checkpoint's whole config",
}


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


ROOT = Path(__file__).resolve().parents[1]


def entry_point(path: str, name: str) -> str | None:
    """The reason ENTRY_POINTS gives for `path`'s function `name` (None: not named)."""
    where = Path(path).resolve()
    rel = where.relative_to(ROOT) if where.is_relative_to(ROOT) else Path(path)
    return ENTRY_POINTS.get(f"{rel.as_posix()}:{name}")


def main(argv: list[str]) -> int:
    show = "--list" in argv
    paths = [Path(a) for a in argv if a != "--list"] or [Path("torchllm")]
    found = scan(paths)
    if show:
        for path, name, params in found:
            why = entry_point(path, name)
            print(f"{path}:{name}({', '.join(params)})"
                  + (f"  [entry point: {why}]" if why else ""))
    modules = {path for path, _, _ in found}
    named = sum(1 for path, name, _ in found if entry_point(path, name))
    print(f"{len(found)} functions in {len(modules)} modules take the whole JobConfig "
          f"({named} named entry points, {len(found) - named} others)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
