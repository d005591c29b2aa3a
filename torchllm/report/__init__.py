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
from torchllm.report.plots import render

REPORT = "report.md"


def default_out(run_dirs: list[Path]) -> Path:
    """RUN/report for one run; DUMP/reports/<a>_vs_<b>... beside the first run for several."""
    if len(run_dirs) == 1:
        return run_dirs[0] / "report"
    return run_dirs[0].parent / "reports" / "_vs_".join(p.name for p in run_dirs)


def write_report(run_dirs: list[str | Path], out: str | Path | None = None,
                 command: str = "python -m torchllm.report") -> tuple[Path, dict]:
    """Write report.md and the plots; (path of report.md, {plot file: Figure}). ValueError for
    a folder that is not a run; without matplotlib, report.md without plots (and a warning)."""
    dirs = [Path(d) for d in run_dirs]
    runs: list[RunData] = [load_run(d) for d in dirs]
    names = [r.name for r in runs]
    for r in runs:  # the same name twice (two dump folders): tell them apart by path
        if names.count(r.name) > 1:
            r.name = str(r.run_dir)
    out_dir = Path(out) if out is not None else default_out(dirs)
    try:
        figures, note = render(runs, out_dir), ""
    except ImportError as e:  # matplotlib missing: the tables still, and one line saying so
        out_dir.mkdir(parents=True, exist_ok=True)
        figures, note = {}, str(e)
        logger.warning("report: %s", note)
    path = out_dir / REPORT
    text = render_markdown(runs, list(figures), command, note)
    tmp = path.with_suffix(".md.tmp")
    tmp.write_text(text)
    tmp.replace(path)
    return path, figures
