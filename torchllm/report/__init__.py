"""A run you can read at a glance: `RUN/report/report.md` and PNG plots.

    python -m torchllm.report outputs/debug_model                     # one run
    python -m torchllm.report outputs/pre outputs/mid outputs/sft     # stages / runs compared

Written at the end of every training run by the `RunReport` hook (rank 0), and on demand by
the command above from what the runs left: TensorBoard events, config.toml, report/run.json.
"""

from __future__ import annotations

from pathlib import Path

from torchllm.log import logger
from torchllm.report.events import RunData, load_run
from torchllm.report.markdown import render_markdown
from torchllm.report.plots import png, render
from torchllm.store import Store

REPORT = "report.md"


def _out_store(run_dirs: list[Path], out: str | Path | None) -> tuple[Path, str]:
    """(the Store root, the report folder's name below it; "" for the root itself): the
    folder the user named (--out), else RUN/report for one run and DUMP/reports/<a>_vs_<b>...
    beside the first run for several, through its parent (a run folder, the dump folder), so that
    a link planted at `report` (or `reports/...`) is refused, never followed."""
    if out is not None:
        return Path(out), ""
    if len(run_dirs) == 1:
        return run_dirs[0], "report"
    return run_dirs[0].parent, "reports/" + "_vs_".join(p.name for p in run_dirs)


def write_report(run_dirs: list[str | Path], out: str | Path | None = None,
                 command: str = "python -m torchllm.report") -> tuple[Path, dict]:
    """Write report.md and the plots; (path of report.md, {plot file: Figure}). ValueError for
    a folder that is not a run, torchllm.store.Confined (an OSError naming it) for a link, FIFO
    or oversized file where the run's files are read or the report is written; without
    matplotlib, report.md without plots (and a warning).

    Every file is written through a Store of the report folder's parent: a new temporary file
    (exclusive, no link followed) renamed into place."""
    dirs = [Path(d) for d in run_dirs]
    runs: list[RunData] = [load_run(d) for d in dirs]
    names = [r.name for r in runs]
    for r in runs:  # the same name twice (two dump folders): tell them apart by path
        if names.count(r.name) > 1:
            r.name = str(r.run_dir)
    root, folder = _out_store(dirs, out)
    store = Store(root)

    def name(file: str) -> str:
        return f"{folder}/{file}" if folder else file

    try:
        figures, note = render(runs), ""
    except ImportError as e:  # matplotlib missing: the tables still, and one line saying so
        figures, note = {}, str(e)
        logger.warning("report: %s", note)
    for file, fig in figures.items():
        store.write_bytes(name(file), png(fig))
    text = render_markdown(runs, list(figures), command, note)
    return Path(store.write_text(name(REPORT), text)), figures
