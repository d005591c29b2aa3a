"""From the ranks' JSON files to one row per variant; rows to a console table and markdown."""

from __future__ import annotations

import re
import signal
import statistics

from torchllm.metrics.flops import mfu_stats

MiB = 1024**2


# torchrun's ChildFailedError summary: the root cause's rank and how it ended (torch's
# _FAILURE_FORMAT_TEMPLATE: "rank : R (local_rank: L)", "exitcode : C (pid: P)").
_ROOT_CAUSE = re.compile(r"Root Cause \(first observed failure\):\s*\[\d+\]:.*?"
                         r"rank\s*:\s*(\d+).*?exitcode\s*:\s*(-?\d+)", re.S)


def root_cause(log: str) -> tuple[int, str] | None:
    """(rank, 'signal SIGKILL' or 'exit code N') of the failure torchrun saw first, from its
    ChildFailedError summary in `log`; None when there is none."""
    found = _ROOT_CAUSE.search(log)
    if not found:
        return None
    rank, code = int(found[1]), int(found[2])
    if code < 0:
        try:
            return rank, f"signal {signal.Signals(-code).name}"
        except ValueError:
            return rank, f"signal {-code}"
    return rank, f"exit code {code}"


def failure_reason(log: str, returncode: int) -> str:
    """The most telling line of a failed run's output: a config error, OOM, or the last error;
    with the rank torchrun saw fail first (a rank killed by a signal: that rank and signal)."""
    cause = root_cause(log)
    if cause and cause[1].startswith("signal"):  # other ranks' errors are echoes of its death
        return f"rank {cause[0]} died: {cause[1]}"
    prefix = f"rank {cause[0]} ({cause[1]}): " if cause else ""
    # The failed rank's own lines first (torchrun's `[rankN]:` prefix), then anyone's.
    own = "\n".join(ln for ln in log.splitlines() if cause and f"[rank{cause[0]}]:" in ln)
    for text in filter(None, (own, log)):
        for pattern in (r"config error: (.*)", r"(\S*OutOfMemoryError.*)",
                        r"((?!ChildFailedError)\w+Error: .*\S)"):
            found = re.findall(pattern, text)
            if found:
                return (prefix + found[-1].strip())[:300]
    return f"rank {cause[0]}: {cause[1]}" if cause else f"exit code {returncode}"


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated q-th percentile (q in 0..100), as numpy's default."""
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summarize(ranks: list[dict], warmup: int) -> dict:
    """One variant's row from its per-rank results; the first `warmup` steps are dropped.

    Step times are rank 0's (every step ends in collectives, so ranks agree to within the
    skew of the last one). Memory is reported per rank.
    """
    r0 = min(ranks, key=lambda r: r["rank"])
    timed = r0["step_times_s"][warmup:]
    if not timed:
        raise ValueError(f"no timed steps: {len(r0['step_times_s'])} run, {warmup} warm-up")
    world = r0["world_size"]
    tokens_per_s = r0["tokens_per_step"] * len(timed) / sum(timed)
    per_device = tokens_per_s / world
    row = {
        "status": "ok",
        "world_size": world,
        "device": r0["device"],
        "timed_steps": len(timed),
        "tokens_per_s": tokens_per_s,
        "tokens_per_s_device": per_device,
        "step_time_median_s": statistics.median(timed),
        "step_time_p90_s": percentile(timed, 90),
        **mfu_stats(per_device, r0["flops_per_token"],
                    r0["peak_flops"] if r0.get("peak_quiet", True) else None),
        "peak_quiet": r0.get("peak_quiet", True),
        "final_loss": r0["losses"][-1],
        "params": r0["estimate"]["params"],
        "flops_per_token": r0["flops_per_token"],
        "estimate": r0["estimate"],
        "per_rank": [],
    }
    for r in sorted(ranks, key=lambda r: r["rank"]):
        mem = {"rank": r["rank"], "rss_peak_bytes": r["rss_peak_bytes"],
               "state_bytes": r["state_bytes"],
               "state_total_bytes": sum(r["state_bytes"].values())}
        for key in ("tensor_peak_bytes", "cuda_max_allocated_bytes", "cuda_max_reserved_bytes"):
            if key in r:
                mem[key] = r[key]
        row["per_rank"].append(mem)
    measured = [m.get("tensor_peak_bytes", m.get("cuda_max_allocated_bytes"))
                for m in row["per_rank"]]
    if all(v is not None for v in measured):
        row["measured_peak_bytes"] = max(measured)
        row["estimate_over_measured"] = r0["estimate"]["peak_bytes"] / max(measured)
    return row


COLUMNS = [
    ("variant", lambda r: r["variant"]),
    ("status", lambda r: r["status"]),
    ("tok/s/dev", lambda r: f"{r['tokens_per_s_device']:,.0f}"),
    ("tok/s", lambda r: f"{r['tokens_per_s']:,.0f}"),
    ("rounds", lambda r: str(r.get("rounds", 1))),
    ("spread %", lambda r: f"{r['spread_pct']:.0f}" if "spread_pct" in r else "-"),
    ("step med ms", lambda r: f"{1000 * r['step_time_median_s']:.1f}"),
    ("step p90 ms", lambda r: f"{1000 * r['step_time_p90_s']:.1f}"),
    ("MFU %", lambda r: f"{r['mfu_pct']:.1f}" if "mfu_pct" in r else "-"),
    ("peak MiB/rank", lambda r: f"{r['measured_peak_bytes'] / MiB:.1f}"
        if "measured_peak_bytes" in r else "-"),
    ("est MiB", lambda r: f"{r['estimate']['peak_bytes'] / MiB:.1f}"),
    ("est/meas", lambda r: f"{r['estimate_over_measured']:.2f}"
        if "estimate_over_measured" in r else "-"),
    ("p+g+opt MiB/rank", lambda r: f"{max(m['state_total_bytes'] for m in r['per_rank']) / MiB:.1f}"),
    ("RSS MiB/rank", lambda r: f"{max(m['rss_peak_bytes'] for m in r['per_rank']) / MiB:.0f}"),
    ("final loss", lambda r: f"{r['final_loss']:.4f}"),
]


def cells(row: dict) -> list[str]:
    if row["status"] != "ok":
        return [row["variant"], f"{row['status']}: {row['reason']}"] + [""] * (len(COLUMNS) - 2)
    return [fmt(row) for _, fmt in COLUMNS]


def markdown_table(rows: list[dict]) -> str:
    header = [name for name, _ in COLUMNS]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells(row)) + " |")
    return "\n".join(lines) + "\n"


def console_table(rows: list[dict]) -> str:
    table = [[name for name, _ in COLUMNS]] + [cells(r) for r in rows]
    ok = [table[0]] + [cells(r) for r in rows if r["status"] == "ok"]
    widths = [max(len(r[i]) for r in ok) for i in range(len(COLUMNS))]
    lines = []
    for r, status in zip(table, ["header"] + [r["status"] for r in rows]):
        if status not in ("header", "ok"):
            lines.append(f"{r[0]:<{widths[0]}}  {r[1]}")
        else:
            lines.append("  ".join(c.rjust(w) if i > 1 else c.ljust(w)
                                   for i, (c, w) in enumerate(zip(r, widths))))
    return "\n".join(lines)


def relative_table(rows: list[dict]) -> str:
    """Each successful variant against the first one: the ratios a reader compares."""
    ok = [r for r in rows if r["status"] == "ok"]
    if len(ok) < 2:
        return ""
    base = ok[0]

    def state(r):
        return max(m["state_total_bytes"] for m in r["per_rank"])

    lines = [f"| variant | step time / {base['variant']} | tok/s / {base['variant']} | "
             f"p+g+opt bytes per rank / {base['variant']} | peak tensor memory / "
             f"{base['variant']} |", "|---|---|---|---|---|"]
    for r in ok:
        peak = (f"{r['measured_peak_bytes'] / base['measured_peak_bytes']:.2f}"
                if "measured_peak_bytes" in r and "measured_peak_bytes" in base else "-")
        lines.append(f"| {r['variant']} | {r['step_time_median_s'] / base['step_time_median_s']:.2f}"
                     f" | {r['tokens_per_s'] / base['tokens_per_s']:.2f} | "
                     f"{state(r) / state(base):.3f} | {peak} |")
    return "\n".join(lines) + "\n"


def render_markdown(rows: list[dict]) -> str:
    """The harness's markdown file: the results table, then the ratios to the first variant."""
    relative = relative_table(rows)
    return markdown_table(rows) + ("\n" + relative if relative else "")
