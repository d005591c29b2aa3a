"""python -m torchllm.report RUN [RUN ...] [--out DIR]: see torchllm.report."""

from __future__ import annotations

import argparse
import sys

from torchllm.run.process_exit import exit_process


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(
        prog="python -m torchllm.report",
        description="report.md + PNG plots of one run, or of several on shared axes "
                    "(the stages of one lifecycle, or runs to compare).")
    parser.add_argument("runs", nargs="+", help="run folders (job.dump_folder/<run name>)")
    parser.add_argument("--out", help="output folder (default: RUN/report for one run, "
                                      "DUMP/reports/<a>_vs_<b> for several)")
    args = parser.parse_args(argv)
    from torchllm.report import write_report
    from torchllm.report.markdown import one_line

    try:
        path, figures = write_report(args.runs, args.out,
                                     "python -m torchllm.report " + " ".join(argv))
    except (ValueError, OSError) as e:  # not a run, or a link / FIFO / oversized file in it
        print(f"report: {one_line(e)}", file=sys.stderr)
        return 2
    print(f"wrote {one_line(path)} ({len(figures)} plots: {', '.join(figures)})")
    return 0


if __name__ == "__main__":
    exit_process(main())
