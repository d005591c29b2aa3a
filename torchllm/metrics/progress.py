"""Console progress: steps done of the total and an ETA.

On a terminal a one-line bar is redrawn in place (at most 10 times a second) and cleared around
log lines. When the output is not a terminal (CI logs, torchrun's piped output) nothing is
drawn: the periodic log lines carry `step N/total` and the ETA instead.

Under run_train.sh the workers' output is a pipe, but the launcher's may be a terminal: then
`torchllm.run.launch` sets TORCHLLM_PROGRESS_FILE, rank 0 writes "step total eta" there (at most
10 times a second) and the launcher draws the bar between the lines it relays (ConsoleBar).
"""

from __future__ import annotations

import os
import sys
import threading
import time

PROGRESS_FILE_ENV = "TORCHLLM_PROGRESS_FILE"


def bar_text(step: int, total: int, eta: float | None) -> str:
    width = 30
    filled = width * step // max(total, 1)
    return (f"[{'#' * filled}{'.' * (width - filled)}] {step}/{total} "
            f"{100 * step / max(total, 1):.0f}%"
            f" ETA {format_duration(eta) if eta is not None else '?'}")


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
        # Under torchllm.run.launch on a terminal: the launcher draws the bar from this file.
        self.file = os.environ.get(PROGRESS_FILE_ENV) if live and not self.live else None
        self.first: tuple[int, float] | None = None  # (step, time) when timing started
        self.step = 0
        self.drawn_at = 0.0

    def update(self, step: int) -> None:
        """Call after each step. Timing starts after the first step (warm-up, compilation)."""
        now = time.perf_counter()
        self.step = step
        if self.first is None:
            self.first = (step, now)
        if (self.live or self.file) and (now - self.drawn_at > 0.1 or step == self.total):
            self.draw() if self.live else self.report()
            self.drawn_at = now

    def report(self) -> None:
        """Hand the bar's numbers to the launcher (atomically: it may read at any time)."""
        eta = self.eta_s()
        tmp = f"{self.file}.tmp"
        try:
            with open(tmp, "w") as f:
                f.write(f"{self.step} {self.total} {-1 if eta is None else eta:.1f}")
            os.replace(tmp, self.file)
        except OSError:
            self.file = None  # the launcher is gone: plain lines only

    def eta_s(self) -> float | None:
        """Seconds left at the average pace since timing started; None until it can tell."""
        if self.first is None or self.step <= self.first[0]:
            return None
        pace = (time.perf_counter() - self.first[1]) / (self.step - self.first[0])
        return pace * (self.total - self.step)

    def draw(self) -> None:
        self.stream.write("\r\033[K" + bar_text(self.step, self.total, self.eta_s()))
        self.stream.flush()

    def clear(self) -> None:
        """Erase the bar so a log line can take the row; the next update redraws it."""
        if self.live:
            self.stream.write("\r\033[K")
            self.stream.flush()
            self.drawn_at = 0.0

    def close(self) -> None:
        self.clear()


class ConsoleBar:
    """The launcher's terminal: relays torchrun's lines (as sys.stdout) and, between them,
    redraws the bar from the file rank 0 writes (see the module docstring)."""

    def __init__(self, path: str, stream):
        self.path, self.stream = path, stream
        self.lock = threading.Lock()
        self.shown = False
        self.last = ""
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True, name="progress-bar")

    def __getattr__(self, name):  # fileno, isatty, encoding, ...: the terminal's
        return getattr(self.stream, name)

    def write(self, text: str, stream=None) -> int:
        with self.lock:
            if self.shown:  # the line takes the bar's row; the bar comes back below it
                self.stream.write("\r\033[K")
                self.stream.flush()
                self.shown = False
            return (stream or self.stream).write(text)

    def relay(self, stream) -> "_Relay":
        """A stand-in for another stream on the same terminal (stderr): clears the bar too."""
        return _Relay(self, stream)

    def flush(self) -> None:
        self.stream.flush()

    def start(self) -> "ConsoleBar":
        self.thread.start()
        return self

    def _run(self) -> None:
        while not self.stopped.wait(0.2):
            self.draw()

    def draw(self) -> None:
        try:
            with open(self.path) as f:
                step, total, eta = f.read().split()
            text = bar_text(int(step), int(total), None if float(eta) < 0 else float(eta))
        except (OSError, ValueError):
            return
        with self.lock:
            if not self.shown or text != self.last:
                self.stream.write("\r\033[K" + text)
                self.stream.flush()
                self.shown, self.last = True, text

    def close(self) -> None:
        self.stopped.set()
        self.thread.join(timeout=1)
        with self.lock:
            if self.shown:
                self.stream.write("\r\033[K")
                self.stream.flush()
                self.shown = False


class _Relay:
    def __init__(self, bar: ConsoleBar, stream):
        self.bar, self.stream = bar, stream

    def __getattr__(self, name):
        return getattr(self.stream, name)

    def write(self, text: str) -> int:
        return self.bar.write(text, self.stream)
