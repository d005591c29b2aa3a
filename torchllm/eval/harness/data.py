"""Where the shipped offline tasks (torchllm/eval/harness_tasks/) read their rows.

The rows come from torchllm's own task loader (`torchllm.eval.tasks.load_rows`), so the
harness reads exactly the copies `python -m torchllm.eval.downstream` reads: `<data_dir>/<task>/`
(`datasets.save_to_disk` format, the layout of ../shared/data/evals) or `<data_dir>/<task>.jsonl`;
HellaSwag `<data_dir>/hellaswag[.jsonl]`, else `hellaswag_data` (its official jsonl).

The folder is, in order: the CLI's --data-dir, the run's `eval.tasks_data_dir`, else
`data/evals` in the working directory (what `python -m torchllm.eval.fetch` writes), else
`../shared/data/evals` beside the project's checkout, when it exists. The shipped tasks read
these copies only: a missing one is an error naming the paths, never a Hub download.
HellaSwag's official file is `eval.hellaswag_data` when that is a file, else
`hellaswag_val.jsonl` in the folder above the task copies (../shared/data/hellaswag_val.jsonl
beside ../shared/data/evals).
This module imports neither lm-eval nor torch: a task's `custom_dataset` function calls it.
"""

from __future__ import annotations

import functools
from pathlib import Path

TASKS_DIR = Path(__file__).resolve().parents[1] / "harness_tasks"
# ../shared/data/evals beside the checkout (torchllm/eval/harness/data.py -> the project root).
SHARED_EVALS = Path(__file__).resolve().parents[4] / "shared" / "data" / "evals"
HELLASWAG_FILE = "hellaswag_val.jsonl"
# The shipped tasks (harness_tasks/<name>.yaml) and the torchllm task whose rows each reads.
LOCAL_TASKS = {"arc_easy_local": "arc_easy", "piqa_local": "piqa",
               "winogrande_local": "winogrande", "hellaswag_local": "hellaswag"}
LOCAL_TAG = "torchllm_local"  # the tag of all four


FETCHED = Path("data") / "evals"  # python -m torchllm.eval.fetch's default folder


def default_data_dir() -> str:
    """data/evals in the working directory (torchllm.eval.fetch's), else ../shared/data/evals
    beside the project's checkout, when one exists; else '' (a missing copy is an error)."""
    for folder in (FETCHED, SHARED_EVALS):
        if folder.is_dir():
            return str(folder)
    return ""


def resolve_sources(data_dir: str | None, tasks_data_dir: str = "",
                    hellaswag_data: str = "") -> dict[str, str]:
    """{data_dir, hellaswag_data} for the shipped tasks (the order is in the module doc):
    `data_dir` is the CLI's (None = unset), the others the run's eval.* values."""
    folder = data_dir if data_dir is not None else (tasks_data_dir or default_data_dir())
    if not Path(hellaswag_data or "").is_file() and folder:
        official = Path(folder).parent / HELLASWAG_FILE
        if official.is_file():
            hellaswag_data = str(official)
    return {"data_dir": folder, "hellaswag_data": hellaswag_data}


def local_dataset(name: str, data_dir: str | None = None, hellaswag_data: str | None = None,
                  **_metadata) -> dict:
    """{"validation": datasets.Dataset} of torchllm task `name` (an lm-eval `custom_dataset`).

    lm-eval passes each task's metadata as keyword arguments: the CLI puts `data_dir` and
    `hellaswag_data` there; without them (plain `lm_eval --include_path ...`) the defaults of
    `resolve_sources` apply. A task that cannot be found raises ValueError naming the paths.
    """
    import datasets

    from torchllm.eval.tasks import load_rows

    if data_dir is None or hellaswag_data is None:
        found = resolve_sources(data_dir, "", hellaswag_data or "")
        data_dir, hellaswag_data = found["data_dir"], found["hellaswag_data"]
    return {"validation": _dataset(name, data_dir, hellaswag_data)}


@functools.lru_cache(maxsize=8)
def _dataset(name: str, data_dir: str, hellaswag_data: str):
    """The rows as a Dataset, read once per process (the CLI's pre-flight check, then lm-eval)."""
    import datasets

    from torchllm.eval.tasks import load_rows

    # The shipped `_local` tasks never reach the Hub: a missing copy is an error naming it.
    return datasets.Dataset.from_list(load_rows(name, data_dir, hellaswag_data, hub=False))


def check_local_tasks(names: list[str], data_dir: str, hellaswag_data: str) -> None:
    """Read the local copies the shipped tasks among `names` need (ValueError naming the paths
    when one is missing), before lm-eval starts."""
    wanted = set(LOCAL_TASKS) if LOCAL_TAG in names else set(names) & set(LOCAL_TASKS)
    for task in sorted(wanted):
        local_dataset(LOCAL_TASKS[task], data_dir, hellaswag_data)
