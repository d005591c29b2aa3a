"""Downstream tasks for the CORE-style evaluation: where each task's rows come from, and how a row
becomes an `Item` that one of the three scorers in `torchllm.eval.downstream` understands.

Task types (one scorer each):
    mc        multiple choice: one context, several continuations; the answer is the continuation
              with the lowest mean loss per token
    schema    several contexts, one shared continuation; the answer is the context under which the
              continuation has the lowest mean loss (Winograd-style schemas)
    lm        language modeling: one context, one continuation; right when greedy decoding from
              the context reproduces the continuation exactly

Rows come from, in order: `<data_dir>/<task>` in `datasets.save_to_disk` format (e.g. the copies
in ../shared/data/evals/), a `<data_dir>/<task>.jsonl` file, or the Hub dataset below (online).
HellaSwag reads `<data_dir>/hellaswag/` or `<data_dir>/hellaswag.jsonl` (the official jsonl
format), else `eval.hellaswag_data` (its official jsonl, or a Hub name), as
torchllm.eval.hellaswag does.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable


@dataclass(frozen=True)
class Item:
    """One evaluation question: contexts x continuations (one of them has several entries)."""

    contexts: tuple[str, ...]
    continuations: tuple[str, ...]
    gold: int  # index of the right context (schema) or continuation (mc); 0 for lm

    @property
    def num_options(self) -> int:
        return max(len(self.contexts), len(self.continuations))

    def option(self, i: int) -> tuple[str, str]:
        """(context, continuation) of option i."""
        ctx = self.contexts[i] if len(self.contexts) > 1 else self.contexts[0]
        cont = self.continuations[i] if len(self.continuations) > 1 else self.continuations[0]
        return ctx, cont


def _qa(question: str, choices: list[str], gold: int, prefix: str = "") -> Item:
    ctx = f"{prefix}Question: {question}\nAnswer:"
    return Item((ctx,), tuple(" " + c for c in choices), gold)


def _letter_choices(row: dict, question_key: str) -> Item:
    """ARC / OpenBookQA / CommonsenseQA: choices{text,label} and an answerKey letter."""
    labels = list(row["choices"]["label"])
    return _qa(row[question_key], list(row["choices"]["text"]), labels.index(row["answerKey"]))


def _piqa(row: dict) -> Item:
    return _qa(row["goal"], [row["sol1"], row["sol2"]], int(row["label"]))


def _winogrande(row: dict) -> Item:
    """The blank '_' is filled with each option (the contexts); the rest is the continuation."""
    cut = row["sentence"].index("_")
    prefix, suffix = row["sentence"][:cut], row["sentence"][cut + 1 :]
    contexts = tuple(prefix + row[f"option{i}"] for i in (1, 2))
    return Item(contexts, (" " + suffix.strip(),), int(row["answer"]) - 1)


def _boolq(row: dict) -> Item:
    ctx = f"{row['passage']}\nQuestion: {row['question']}?\nAnswer:"
    return Item((ctx,), (" no", " yes"), int(bool(row["answer"])))


def _copa(row: dict) -> Item:
    """'The man turned on the faucet therefore' + ' water flowed from the spout.'"""
    joiner = {"cause": "because", "effect": "therefore"}[row["question"]]
    ctx = row["premise"].rstrip(".") + " " + joiner
    lower = lambda s: s[:1].lower() + s[1:]  # noqa: E731
    return Item((ctx,), tuple(" " + lower(row[f"choice{i}"]) for i in (1, 2)), int(row["label"]))


def _social_iqa(row: dict) -> Item:
    choices = [row["answerA"], row["answerB"], row["answerC"]]
    return _qa(row["question"], choices, int(row["label"]) - 1, prefix=row["context"] + "\n")


def _sciq_prefix(row: dict) -> str:
    return row["support"].strip() + "\n" if row["support"].strip() else ""


def _sciq(row: dict, index: int) -> Item:
    """The right answer's position rotates with the row index (the copy always lists it last)."""
    choices = [row["distractor1"], row["distractor2"], row["distractor3"]]
    gold = index % 4
    choices.insert(gold, row["correct_answer"])
    return _qa(row["question"], choices, gold, prefix=_sciq_prefix(row))


def _sciq_lm(row: dict) -> Item:
    ctx = f"{_sciq_prefix(row)}Question: {row['question']}\nAnswer:"
    return Item((ctx,), (" " + row["correct_answer"],), 0)


def _lambada(row: dict) -> Item:
    ctx, last = row["text"].rsplit(" ", 1)
    return Item((ctx,), (" " + last,), 0)


def _hellaswag(row: dict) -> Item:
    return Item((row["ctx"],), tuple(" " + e for e in row["endings"]), int(row["label"]))


@dataclass(frozen=True)
class TaskSpec:
    kind: str  # mc | schema | lm
    hub: tuple[str, str | None, str]  # (path, subset, split) for datasets.load_dataset
    to_item: Callable[[dict, int], Item]


def chance(kind: str, items: list[Item]) -> float:
    """Accuracy of random guessing: the mean of 1 / options (ARC has 3-5 options), 0 for lm."""
    return 0.0 if kind == "lm" else sum(1.0 / it.num_options for it in items) / len(items)


def _ignore_index(fn):
    return lambda row, index: fn(row)


TASKS: dict[str, TaskSpec] = {
    "arc_easy": TaskSpec("mc", ("allenai/ai2_arc", "ARC-Easy", "validation"),
                         _ignore_index(lambda r: _letter_choices(r, "question"))),
    "arc_challenge": TaskSpec("mc", ("allenai/ai2_arc", "ARC-Challenge", "validation"),
                              _ignore_index(lambda r: _letter_choices(r, "question"))),
    "piqa": TaskSpec("mc", ("ybisk/piqa", None, "validation"), _ignore_index(_piqa)),
    "winogrande": TaskSpec("schema", ("allenai/winogrande", "winogrande_xl", "validation"),
                           _ignore_index(_winogrande)),
    "openbookqa": TaskSpec("mc", ("allenai/openbookqa", "main", "validation"),
                           _ignore_index(lambda r: _letter_choices(r, "question_stem"))),
    "boolq": TaskSpec("mc", ("google/boolq", None, "validation"), _ignore_index(_boolq)),
    "copa": TaskSpec("mc", ("aps/super_glue", "copa", "validation"), _ignore_index(_copa)),
    "commonsense_qa": TaskSpec("mc", ("tau/commonsense_qa", None, "validation"),
                               _ignore_index(lambda r: _letter_choices(r, "question"))),
    "social_iqa": TaskSpec("mc", ("allenai/social_i_qa", None, "validation"),
                           _ignore_index(_social_iqa)),
    "sciq": TaskSpec("mc", ("allenai/sciq", None, "validation"), _sciq),
    "sciq_lm": TaskSpec("lm", ("allenai/sciq", None, "validation"), _ignore_index(_sciq_lm)),
    "lambada": TaskSpec("lm", ("EleutherAI/lambada_openai", "default", "test"),
                        _ignore_index(_lambada)),
    "hellaswag": TaskSpec("mc", ("Rowan/hellaswag", None, "validation"),
                          _ignore_index(_hellaswag)),
}
# Local folder names that differ from the task name (the ../shared copy of sciq_lm is sciq's).
LOCAL_NAME = {"sciq_lm": "sciq"}
# The downstream CLI's tasks when neither --tasks nor eval.tasks names any: the 11 tasks with a
# local copy in ../shared/data/evals (sciq_lm reads sciq's), and HellaSwag (lambada: Hub only).
DEFAULT_TASKS = ("arc_easy", "arc_challenge", "piqa", "winogrande", "openbookqa", "boolq", "copa",
                 "commonsense_qa", "social_iqa", "sciq", "sciq_lm", "hellaswag")


def parse_task(entry: str, default_shots: int) -> tuple[str, int]:
    """'arc_easy' or 'arc_easy:5' (5-shot) -> (name, shots); raises ValueError naming the task."""
    name, sep, shots = entry.partition(":")
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; tasks are {', '.join(sorted(TASKS))}")
    if not sep:
        return name, default_shots
    if not shots.isdigit():
        raise ValueError(f"task {entry!r}: the shot count after ':' must be an integer >= 0")
    return name, int(shots)


def _read_jsonl(path: Path) -> list[dict]:
    rows = []
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                if raw.strip():
                    rows.append(json.loads(raw.decode("utf-8")))
            except ValueError as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
                raise ValueError(f"line {lineno} is not valid UTF-8 JSON ({e})") from None
    return rows


def _read_local(name: str, path: Path, read: Callable[[Path], list[dict]]) -> list[dict]:
    """Rows of a local task copy; a damaged copy is one line naming the task and the path."""
    try:
        return read(path)
    except Exception as e:  # ArrowInvalid, JSONDecodeError, FileNotFoundError, ...
        raise ValueError(
            f"task {name}: the local copy {path} cannot be read ({type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}); restore the copy, or remove it to "
            "load the Hub dataset") from None


def _hellaswag_rows(local: Path | None, source: str, hub: bool = True) -> list[dict] | None:
    """HellaSwag's rows from `<data_dir>/hellaswag.jsonl`, else from `eval.hellaswag_data` ('' =
    the Hub dataset); None for a `<data_dir>/hellaswag/` folder (read as any task's). A source
    that cannot be found or loaded is one line naming the paths looked at and the key to set."""
    from torchllm.eval.hellaswag import load_examples

    if local is not None and local.is_dir():
        return None
    jsonl = local.with_suffix(".jsonl") if local is not None else None
    if jsonl is not None and jsonl.is_file():
        return load_examples(str(jsonl))  # format errors name the file and line
    if source and Path(source).is_file():
        return load_examples(source)
    looked = (f"neither {local}/ nor {jsonl} exists" if local is not None
              else "no folder of local copies (eval.tasks_data_dir / --data-dir is empty)")
    put = f"put the official hellaswag_val.jsonl at {jsonl}" if jsonl is not None \
        else "set --data-dir (eval.tasks_data_dir) to a folder with hellaswag.jsonl"
    if not hub and not source:
        raise ValueError(f"task hellaswag: {looked}, and this task reads local copies only; "
                         f"{put}, or {FETCH_HINT}")
    source = source or TASKS["hellaswag"].hub[0]  # '' = the Hub dataset
    try:
        return load_examples(source, hint="")
    except FileNotFoundError:
        what = f"eval.hellaswag_data = {source!r} does not exist"
    except (OSError, ValueError) as e:
        what = f"eval.hellaswag_data: {e}"
    raise ValueError(f"task hellaswag: {looked}, and {what}; {put}, or pass "
                     "--eval.hellaswag_data=PATH/hellaswag_val.jsonl (the official file)")


FETCH_HINT = "python -m torchllm.eval.fetch --out data/evals fetches them (docs/evaluation.md)"


def load_rows(name: str, data_dir: str = "", hellaswag_data: str = "",
              hub: bool = True) -> list[dict]:
    """Every row of a task's evaluation split (see the module doc for where they come from);
    hub=False: the local copies only (a missing one is an error naming the paths, at once)."""
    import datasets

    from torchllm.hub import offline_note, prepare_hub

    spec = TASKS[name]
    local = Path(data_dir) / LOCAL_NAME.get(name, name) if data_dir else None
    if name == "hellaswag":
        rows = _hellaswag_rows(local, hellaswag_data, hub)
        if rows is not None:
            return rows
    if local is not None and local.is_dir():
        return _read_local(name, local,
                           lambda p: [dict(r) for r in datasets.load_from_disk(str(p))])
    if local is not None and local.with_suffix(".jsonl").is_file():
        return _read_local(name, local.with_suffix(".jsonl"), _read_jsonl)
    if not hub:
        where = (f"neither {local}/ nor {local.with_suffix('.jsonl')} exists" if local is not None
                 else "no folder of local copies is set (--data-dir / eval.tasks_data_dir)")
        raise ValueError(f"task {name}: {where}, and this task reads local copies only; "
                         f"{FETCH_HINT}")
    path, subset, split = spec.hub
    offline = prepare_hub()  # offline: fail at once rather than retry the Hub for ~25 s
    try:
        return [dict(r) for r in datasets.load_dataset(path, subset, split=split)]
    except Exception as e:  # offline, unknown name: many exception types, one clear line
        where = f"{local} is missing and " if local is not None else ""
        first = str(e).splitlines()[0] if str(e) else ""
        raise ValueError(
            f"task {name}: {where}the Hub dataset {path} ({subset}, {split}) cannot be loaded "
            f"({type(e).__name__}: {first}){offline_note(offline)}; set eval.tasks_data_dir "
            "(--data-dir) to a folder of local copies (<task>/ in datasets.save_to_disk "
            f"format, or <task>.jsonl): {FETCH_HINT}"
        ) from None


def load_items(name: str, data_dir: str = "", hellaswag_data: str = "",
               hub: bool = True) -> list[Item]:
    spec = TASKS[name]
    rows = load_rows(name, data_dir, hellaswag_data, hub)
    items = []
    for i, row in enumerate(rows):
        try:
            items.append(spec.to_item(row, i))
        except (KeyError, TypeError, ValueError, AttributeError, IndexError) as e:
            raise ValueError(f"task {name}: row {i} does not have the task's columns "
                             f"({type(e).__name__}: {e}); it has "
                             f"{sorted(row) if isinstance(row, dict) else type(row).__name__}"
                             ) from None
    if not items:
        raise ValueError(f"task {name} has no rows")
    return items
