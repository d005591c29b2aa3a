"""report.md: the summary table, the differences between runs, each run's header, the plots,
the evaluation tables and the last samples.

Text taken from a run folder (run.json's fields, config values, TensorBoard tags and samples,
folder names) is data: a line of it never starts a line of report.md and carries no control
character (`one_line` escapes them, `\n` shown as the two characters); a table cell escapes
`|`; a header or sample block is an indented code block, every line of it indented."""

from __future__ import annotations

import dataclasses
import time
import unicodedata

import numpy as np

from torchllm.metrics.header import config_changes
from torchllm.metrics.progress import format_duration
from torchllm.report.events import TOKENS_TAG, RunData

EVAL_PREFIXES = ("hellaswag/", "downstream/")


_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}
INDENT = " " * 4  # an indented code block: no fence its text could close


def one_line(value) -> str:
    """`str(value)` as one line of plain characters: control, format and line/paragraph
    separator characters (newlines, ESC, U+2028, bidirectional overrides) written as escapes."""
    out = []
    for ch in str(value):
        if unicodedata.category(ch) in ("Cc", "Cf", "Zl", "Zp", "Cs"):
            out.append(_ESCAPES.get(ch) or (f"\\x{ord(ch):02x}" if ord(ch) < 0x100
                                            else f"\\u{ord(ch):04x}"))
        else:
            out.append(ch)
    return "".join(out)


def inline(value) -> str:
    """Text from a file inside a line of markdown: one line, no backtick (inline code)."""
    return one_line(value).replace("`", "'")


def code_block(text) -> str:
    """Text from a file as an indented code block: every line indented, each `one_line`."""
    return "\n".join(INDENT + one_line(line) for line in str(text).splitlines() or [""])


def _table(header: list[str], rows: list[list[str]]) -> str:
    cells = [header, ["---"] * len(header), *rows]
    return "\n".join("| " + " | ".join(one_line(c).replace("|", "\\|") for c in row) + " |"
                     for row in cells)


def _num(value: float | None, fmt: str = "{:.4f}") -> str:
    return "–" if value is None or not np.isfinite(value) else fmt.format(value)


def _median(run: RunData, tag: str) -> float | None:
    s = run.scalars.get(tag)
    # The first logging interval holds compilation and warm-up: left out when there are more.
    return float(np.median(s.values[1:] if len(s.values) > 2 else s.values)) if s else None


def _steps(run: RunData) -> str:
    s = run.scalars.get("loss/avg")
    total = run.cfg.training.steps if run.cfg else None
    done = int(s.steps[-1]) if s is not None and len(s.steps) else None
    return f"{done if done is not None else '?'}" + (f" / {total:,}" if total else "")


def summary_rows(run: RunData) -> dict[str, str]:
    """The summary table's column for one run (row name -> cell)."""
    info, sc = run.info, run.scalars
    val = sc.get("val/loss")
    if val is None:  # a dedicated validation set: val/<name>/loss
        val = next((sc[t] for t in sorted(sc) if t.startswith("val/") and t.endswith("/loss")
                    and t.count("/") == 2), None)
    loss = sc.get("loss/avg")
    tokens = sc.get(TOKENS_TAG)
    mem = next((sc[t] for t in ("memory/max_active_gib", "memory/rss_gib") if t in sc), None)
    checkpoints = str(info.get("checkpoint") or "–")
    no_val = "none yet" if run.cfg is not None and run.cfg.validation.enable else "off"
    return {
        "steps": _steps(run),
        "tokens seen": f"{int(tokens.values[-1]):,}" if tokens is not None else "–",
        "wall time": (format_duration(info["wall_s"]) if isinstance(info.get("wall_s"),
                      (int, float)) else "–"),
        "final train loss": _num(loss.last()[1]) if loss is not None else "–",
        "final validation loss": (f"{_num(val.last()[1])} (step {val.last()[0]})"
                                  if val is not None else no_val),
        "best validation loss": (f"{_num(val.best()[1])} (step {val.best()[0]})"
                                 if val is not None else no_val),
        "tokens/s (median)": _num(_median(run, "throughput/tokens_per_s"), "{:,.0f}"),
        "MFU % (median)": _num(_median(run, "perf/mfu_pct"), "{:.1f}"),
        "peak memory GiB": _num(float(mem.values.max()) if mem is not None else None, "{:.2f}"),
        "hardware": "; ".join(map(str, info.get("hardware_launches") or
                                  [info.get("hardware", "–")])),
        "checkpoint": checkpoints,
    }


def _flat(cfg) -> dict[str, object]:
    flat = {f"{name}.{f.name}": getattr(section, f.name)
            for name, section in cfg.sections() for f in dataclasses.fields(section)}
    sources = flat.get("data.sources")
    if sources:  # a mixture: its sources and weights are the data; data.dataset is unused
        flat["data.sources"] = ", ".join(f"{s.dataset} x {s.weight:g}" for s in sources)
        flat["data.dataset"] = "(mixture: data.sources)"
    elif "data.sources" in flat:
        flat["data.sources"] = "none"
    return flat


def differences(runs: list[RunData]) -> list[list[str]]:
    """Rows [key, value in run 1, value in run 2, ...] for every config key that differs."""
    flats = [_flat(r.cfg) if r.cfg is not None else {} for r in runs]
    keys = sorted(set().union(*flats))
    rows = []
    for key in keys:
        if key in ("job.config_file", "job.run_name", "job.description"):
            continue
        values = [f.get(key, "?") for f in flats]
        if any(v != values[0] for v in values[1:]):
            rows.append([key, *(_cell(key, v) for v in values)])
    return rows


def _cell(key: str, value) -> str:
    """A value in the differences table: long ones cut at 60 characters, except the data's
    sources (what a comparison of data mixtures is about)."""
    text = str(value)
    return text if key == "data.sources" or len(text) <= 60 else text[:59] + "…"


def header_text(run: RunData) -> str:
    if run.info.get("header"):
        return str(run.info["header"])
    if run.cfg is None:
        return f"run {run.name}: (no config.toml)"
    changes = config_changes(run.cfg)
    return f"run {run.name}\n" + "\n".join(f"  {s}: {' '.join(items)}"
                                           for s, items in changes.items())


def eval_rows(run: RunData) -> list[list[str]]:
    """[tag, last value, its step, best value] for every evaluation scalar."""
    rows = []
    for tag in sorted(t for t in run.scalars if t.startswith(EVAL_PREFIXES)):
        s = run.scalars[tag]
        step, value = s.last()
        rows.append([tag, f"{value:.4f}", str(step), f"{float(np.nanmax(s.values)):.4f}"])
    return rows


def last_samples(run: RunData) -> list[tuple[str, int, str]]:
    out = []
    for tag in sorted(t for t in run.texts if t.startswith("samples/")):
        step, text = run.texts[tag][-1]
        out.append((tag, step, text))
    return out


def render_markdown(runs: list[RunData], plots: list[str], command: str, note: str = "") -> str:
    names = [r.name for r in runs]
    title = inline(" vs ".join(names))
    lines = [f"# Report: {title}", "",
             f"Written {time.strftime('%Y-%m-%d %H:%M:%S %Z')} by `{inline(command)}`.", ""]
    columns = [summary_rows(r) for r in runs]
    lines += ["## Summary", "",
              _table(["", *names], [[key, *(c[key] for c in columns)] for key in columns[0]]),
              ""]
    if len(runs) > 1:
        rows = differences(runs)
        lines += ["## Differences between the runs", "",
                  _table(["config key", *names], rows) if rows else "The configs are the same.",
                  ""]
    if note:
        lines += ["## Plots", "", note, ""]
    if plots:
        lines += ["## Plots", ""]
        lines += [f"![{p.removesuffix('.png')}]({p})" for p in plots]
        lines.append("")
    for run in runs:
        lines += [f"## Run {inline(run.name)}", "",
                  f"Folder `{inline(run.run_dir)}`, TensorBoard `{inline(run.tb_dir)}`.",
                  "", code_block(header_text(run)), ""]
        evals = eval_rows(run)
        if evals:
            lines += ["### Evaluations", "",
                      _table(["metric", "last", "at step", "best"], evals), ""]
        samples = last_samples(run)
        if samples:
            lines += ["### Last samples", ""]
            for tag, step, text in samples:
                lines += [f"step {step} ({inline(tag)}):", "", code_block(text.strip()), ""]
    return "\n".join(lines)
