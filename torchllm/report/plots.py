"""The report's PNG plots, drawn with matplotlib from the runs' TensorBoard scalars.

Several runs (the stages of one lifecycle, or runs to compare) share each figure's axes: one
colour per run, the training curve solid, validation dashed with dots. Loss is drawn against
tokens seen (steps for runs that logged no token counts); the rest against steps. The training
loss is the console's: each log interval's token-weighted mean (loss/interval), not the single
logged step.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

from torchllm.report.events import RunData

MISSING = "no plots: matplotlib is not installed (pip install matplotlib)"


@dataclass(frozen=True)
class Panel:
    ylabel: str
    tags: tuple[str, ...]  # exact tags, or a prefix ending in "*"
    by_tokens: bool = False
    logy: bool = False


@dataclass(frozen=True)
class Plot:
    file: str
    title: str
    panels: tuple[Panel, ...]


PLOTS = (
    # Training: the console's numbers, each log interval's mean (loss/interval; a run logged
    # before that tag existed: its single logged steps, loss/avg).
    # (The explanation is in the title: a y label longer than the panel is cut off.)
    Plot("loss.png", "Loss (train: each log interval's mean, as the console; validation dashed)",
         (Panel("loss (nats/token)", ("loss/interval|loss/avg", "val/loss|val/*/loss"),
                by_tokens=True),)),
    Plot("lr.png", "Learning rate", (Panel("learning rate", ("optim/lr",)),)),
    Plot("grad_norm.png", "Gradient norm (before clipping)",
         (Panel("grad norm", ("grad_norm/total",), logy=True),)),
    Plot("throughput.png", "Throughput",
         (Panel("tokens/s", ("throughput/tokens_per_s",)), Panel("MFU %", ("perf/mfu_pct",)))),
    Plot("memory.png", "Memory",
         (Panel("GiB", ("memory/max_active_gib", "memory/max_reserved_gib", "memory/rss_gib")),)),
    Plot("evals.png", "Evaluations",
         (Panel("accuracy", ("hellaswag/acc", "hellaswag/acc_norm", "downstream/core")),)),
    Plot("mixture.png", "Data mixture: fraction of tokens per source",
         (Panel("fraction", ("data/source*/fraction",)),)),
)


def _matching(run: RunData, pattern: str) -> list[str]:
    """The run's tags `pattern` names: one tag, or with a `*` each tag with something in its
    place (val/*/loss: val/<set>/loss, not val/loss)."""
    if "*" not in pattern:
        return [pattern] if pattern in run.scalars else []
    head, tail = pattern.split("*", 1)
    return sorted(t for t in run.scalars if t.startswith(head) and t.endswith(tail)
                  and len(t) > len(head) + len(tail))


def _tags(run: RunData, patterns: tuple[str, ...]) -> list[str]:
    out = []
    for p in patterns:
        if "|" in p:  # alternatives: the first the run has
            out += next((got for alt in p.split("|") if (got := _matching(run, alt))), [])
        else:
            out += _matching(run, p)
    return out


def _label(run: RunData, tag: str, several: bool) -> str:
    name = {"loss/interval": "train", "loss/avg": "train", "val/loss": "validation"}.get(tag, tag)
    if tag.startswith("val/") and tag.endswith("/loss") and tag != "val/loss":
        name = f"validation {tag[4:-5]}"  # a dedicated validation set, by its name
    return f"{run.name}: {name}" if several else name


def draw(plot: Plot, runs: list[RunData]):
    """The matplotlib Figure for `plot`, or None when no run has any of its tags. Each line's
    label is '<run>: <tag>' (several runs) or the tag; its data are the logged points."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    if not any(_tags(run, panel.tags) for run in runs for panel in plot.panels):
        return None
    several = len(runs) > 1
    fig = Figure(figsize=(8, 3.2 * len(plot.panels)), layout="constrained")
    axes = fig.subplots(len(plot.panels), 1, squeeze=False)[:, 0]
    for ax, panel in zip(axes, plot.panels):
        # Against tokens only when every run drawn here logged its token counts.
        by_tokens = panel.by_tokens and all(run.tokens_at(run.scalars[t].steps) is not None
                                            for run in runs for t in _tags(run, panel.tags))
        for i, run in enumerate(runs):
            for j, tag in enumerate(_tags(run, panel.tags)):
                series = run.scalars[tag]
                x = run.tokens_at(series.steps) if by_tokens else series.steps
                val = tag.startswith("val/")
                style = "--" if val else ("-", ":", "-.")[j % 3] if several else "-"
                ax.plot(x, series.values, style,
                        color=f"C{i}" if several else f"C{j}",
                        marker="o" if val or len(x) < 3 else None, markersize=3,
                        label=_label(run, tag, several))
        ax.set_xlabel("tokens seen" if by_tokens else "step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel(panel.ylabel)
        if panel.logy:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
    fig.suptitle(plot.title)
    return fig


def render(runs: list[RunData]) -> dict[str, object]:
    """Draw every plot some run has data for; {file name: Figure}. ImportError (with MISSING's
    advice) without matplotlib."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ImportError(MISSING) from None
    figures = {}
    for plot in PLOTS:
        fig = draw(plot, runs)
        if fig is not None:
            figures[plot.file] = fig
    return figures


def png(fig) -> bytes:
    """The figure as PNG bytes (written through the report folder's Store)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    return buf.getvalue()
