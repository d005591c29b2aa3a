"""Console progress: steps done of the total and an ETA.

On a terminal a one-line bar is redrawn in place (at most 10 times a second) and cleared around
log lines. When the output is not a terminal (CI logs, torchrun's piped output) nothing is
drawn: the periodic log lines carry `step N/total` and the ETA instead.
"""

from __future__ import annotations

import sys
import time


def format_duration(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class Progress:
    def __init__(self, total: int, live: bool, stream=None):
        self.total = total
        self.stream = stream or sys.stderr
        self.live = live and self.stream.isatty()
        self.first: tuple[int, float] | None = None  # (step, time) when timing started
        self.step = 0
        self.drawn_at = 0.0

    def update(self, step: int) -> None:
        """Call after each step. Timing starts after the first step (warm-up, compilation)."""
        now = time.perf_counter()
        self.step = step
        if self.first is None:
            self.first = (step, now)
        if self.live and (now - self.drawn_at > 0.1 or step == self.total):
            self.draw()
            self.drawn_at = now

    def eta_s(self) -> float | None:
        """Seconds left at the average pace since timing started; None until it can tell."""
        if self.first is None or self.step <= self.first[0]:
            return None
        pace = (time.perf_counter() - self.first[1]) / (self.step - self.first[0])
        return pace * (self.total - self.step)

    def draw(self) -> None:
        width = 30
        filled = width * self.step // max(self.total, 1)
        eta = self.eta_s()
        text = (f"[{'#' * filled}{'.' * (width - filled)}] {self.step}/{self.total} "
                f"{100 * self.step / max(self.total, 1):.0f}%"
                f" ETA {format_duration(eta) if eta is not None else '?'}")
        self.stream.write("\r\033[K" + text)
        self.stream.flush()

    def clear(self) -> None:
        """Erase the bar so a log line can take the row; the next update redraws it."""
        if self.live:
            self.stream.write("\r\033[K")
            self.stream.flush()
            self.drawn_at = 0.0

    def close(self) -> None:
        self.clear()
