"""Fetch the evaluation data the docs use into one folder, once, so that every eval runs offline:

    python -m torchllm.eval.fetch --out data/evals                     # from the Hub (online)
    python -m torchllm.eval.fetch --out data/evals --from hellaswag=hellaswag_val.jsonl
    python -m torchllm.eval.fetch --out data/evals --tasks arc_easy,piqa

The folder is what `--data-dir` (eval.tasks_data_dir) of torchllm.eval.downstream and
torchllm.eval.harness read: `<out>/<task>/` in `datasets.save_to_disk` format for each task of
torchllm.eval.tasks (default: its DEFAULT_TASKS; sciq_lm reads sciq's copy), and HellaSwag as
`<out>/hellaswag.jsonl` in the official format (`ctx`, `endings`, `label`), which
torchllm.eval.hellaswag's `--data` reads too. `--from TASK=FILE` prepares a task from a file you
have instead of the Hub (a .jsonl with the Hub dataset's columns; HellaSwag: the official
hellaswag_val.jsonl): its rows are checked as the task reads them, then copied. A task already
in the folder is kept (`--force` fetches it again). Offline, a task to fetch from the Hub is one
line naming it and `--from`, at once (no ~25 s of retries).

What a fetch writes replaces the task's older copy whatever its form (`<task>/` or
`<task>.jsonl`: the evals read the folder first, so a new file beside an old folder would never
be read): the new copy is written whole into a hidden staging folder in `<out>`, then the older
copies are moved aside there and the new one renamed into place (`install`). A fetch that fails
before the rename leaves the older copy as it was; the staging folder is removed either way.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from torchllm.eval.tasks import DEFAULT_TASKS, LOCAL_NAME, TASKS, load_items


def local_name(task: str) -> str:
    return LOCAL_NAME.get(task, task)


def present(out: Path, task: str) -> bool:
    name = local_name(task)
    return (out / name).is_dir() or (out / f"{name}.jsonl").is_file()


def staging_folder(out: Path, task: str) -> Path:
    """A new hidden folder in `out` (the same filesystem: its contents rename into place)."""
    return Path(tempfile.mkdtemp(prefix=f".{local_name(task)}.", suffix=".staging", dir=out))


def install(out: Path, task: str, new: Path) -> Path:
    """Put `new` (`<task>.jsonl` or `<task>/`, written whole in its staging folder) in `out` as
    the task's only copy: every older copy (either form; a link is moved, never followed) is
    moved aside into the staging folder first, put back if the rename fails, and goes with the
    staging folder. Returns the installed path."""
    name, target = local_name(task), out / new.name
    aside = []
    try:
        for old in (out / name, out / f"{name}.jsonl"):
            if os.path.lexists(old):
                moved = new.parent / f"older-{old.name}"
                os.replace(old, moved)
                aside.append((moved, old))
        os.replace(new, target)
    except OSError as e:
        for moved, old in reversed(aside):
            os.replace(moved, old)
        raise ValueError(f"{task}: cannot put the new copy at {target} ({e.strerror or e}); "
                         "the older copy is kept") from None
    return target


def from_file(out: Path, task: str, path: Path) -> str:
    """Copy `path` as `<out>/<task>.jsonl` once its rows read as the task's (ValueError if not)."""
    if not path.is_file():
        raise ValueError(f"--from {task}={path}: no such file")
    if path.suffix != ".jsonl":
        raise ValueError(f"--from {task}={path}: give a .jsonl file (one JSON row a line)")
    staging = staging_folder(out, task)
    try:
        shutil.copyfile(path, staging / f"{local_name(task)}.jsonl")
        items = load_items(task, str(staging), hub=False)  # checked as an eval reads it
        if task == "hellaswag":  # lm-eval's prompt (hellaswag_local) reads these too
            with open(staging / "hellaswag.jsonl", encoding="utf-8") as f:
                first = json.loads(next(line for line in f if line.strip()))
            missing = [k for k in ("activity_label", "ctx_a", "ctx_b") if k not in first]
            if missing:
                raise ValueError(f"--from hellaswag={path}: its rows lack {', '.join(missing)} "
                                 "(the official hellaswag_val.jsonl has them; the harness's "
                                 "hellaswag_local reads them)")
        target = install(out, task, staging / f"{local_name(task)}.jsonl")
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return f"{task}: {len(items)} rows from {path} -> {target}"


def from_hub(out: Path, task: str, offline: bool) -> str:
    """Download a task's evaluation split and save it under `out`."""
    import datasets

    from torchllm.hub import offline_note

    path, subset, split = TASKS[task].hub
    try:  # offline: the Hugging Face cache only, at once
        rows = datasets.load_dataset(path, subset, split=split)
    except Exception as e:  # noqa: BLE001 - network, unknown name: one line
        first = str(e).splitlines()[0] if str(e) else ""
        raise ValueError(f"{task}: the Hub dataset {path} ({subset}, {split}) cannot be "
                         f"loaded ({type(e).__name__}: {first}){offline_note(offline)}; run "
                         f"this command on a machine with network and copy {out}, or pass "
                         f"--from {task}=FILE.jsonl") from None
    staging = staging_folder(out, task)
    try:
        if task == "hellaswag":  # the official jsonl format, which every HellaSwag reader takes
            new = staging / "hellaswag.jsonl"
            with open(new, "w", encoding="utf-8") as f:
                for row in rows:
                    f.write(json.dumps(dict(row)) + "\n")
        else:
            new = staging / local_name(task)
            rows.save_to_disk(str(new))
        target = install(out, task, new)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return f"{task}: {len(rows)} rows from {path} -> {target}"


def parse_from(values: list[str]) -> dict[str, Path]:
    out = {}
    for value in values:
        task, sep, path = value.partition("=")
        if not sep or task not in TASKS:
            raise ValueError(f"--from {value!r}: give TASK=FILE with TASK one of "
                             f"{', '.join(sorted(TASKS))}")
        out[task] = Path(path)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m torchllm.eval.fetch",
        description="Fetch (or prepare from files you have) the evaluation data into one "
                    "folder for --data-dir / eval.tasks_data_dir, so evals run offline.")
    parser.add_argument("--out", default="data/evals", help="the folder (default data/evals)")
    parser.add_argument("--tasks", default=",".join(DEFAULT_TASKS),
                        help=f"comma-separated tasks (default: {','.join(DEFAULT_TASKS)})")
    parser.add_argument("--from", dest="sources", action="append", default=[],
                        metavar="TASK=FILE", help="prepare TASK from a local .jsonl file "
                        "instead of the Hub (HellaSwag: the official hellaswag_val.jsonl)")
    parser.add_argument("--force", action="store_true", help="fetch tasks already present")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    out = Path(args.out)
    try:
        files = parse_from(args.sources)
        tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
        unknown = [t for t in tasks if t not in TASKS]
        if unknown:
            raise ValueError(f"--tasks: unknown task(s) {', '.join(unknown)}; tasks are "
                             f"{', '.join(sorted(TASKS))}")
        tasks += [t for t in files if t not in tasks]
        out.mkdir(parents=True, exist_ok=True)
        # Files first: they are here, whatever the network does.
        todo = sorted((t for t in tasks if t in files or args.force or not present(out, t)),
                      key=lambda t: t not in files)
        hub = [t for t in todo if t not in files and
               local_name(t) not in {local_name(f) for f in files}]
        offline = False
        if hub:
            from torchllm.hub import prepare_hub

            offline = prepare_hub()
        done = set()
        for task in todo:
            if local_name(task) in done:
                continue  # sciq_lm reads sciq's copy
            print(from_file(out, task, files[task]) if task in files
                  else from_hub(out, task, offline), flush=True)
            done.add(local_name(task))
        for task in tasks:
            if task not in todo:
                print(f"{task}: already in {out} (--force fetches it again)")
    except (ValueError, OSError) as e:  # OSError: a disk full or unwritable --out
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"evals read it with --data-dir {out} (or eval.tasks_data_dir = \"{out}\")")
    return 0


if __name__ == "__main__":
    sys.exit(main())
