"""Console progress: steps done of the total and an ETA, drawn by tqdm.

On a terminal a one-line bar (`[####......] N/total P% ETA mm:ss`) is redrawn in place by tqdm
(at most 10 times a second) and cleared around log lines. When the output is not a terminal (CI
logs, torchrun's piped output) nothing is drawn: the periodic log lines carry `step N/total` and
the ETA instead.

Under run_train.sh the workers' output is a pipe, but the launcher's may be a terminal: then
`torchllm.run.launch` sets TORCHLLM_PROGRESS_FILE, rank 0 writes "step total" there (at most 10
times a second) and the launcher's tqdm bar follows it between the lines it relays (ConsoleBar).

The ETA is the average pace since the first step (tqdm with `smoothing=0` and `initial` = the
first step, so warm-up and compilation are not counted); `Progress.eta_s` is the same pace for
the log lines, which are printed whether or not a bar is drawn.
"""

from __future__ import annotations

import os
import sys
import threading
import time

from tqdm import tqdm

PROGRESS_FILE_ENV = "TORCHLLM_PROGRESS_FILE"
BAR_FORMAT = "[{bar:30}] {n}/{total} {percentage:.0f}% ETA {remaining}"


def new_bar(total: int, first_step: int, stream, min_interval: float = 0.1) -> tqdm:
    """The bar both the trainer (on a terminal) and the launcher draw: '#' done, '.' to go."""
    return tqdm(total=total, initial=first_step, file=stream, bar_format=BAR_FORMAT, ascii=".#",
                smoothing=0, mininterval=min_interval, leave=False)


def format_duration(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class Progress:
    def __init__(self, total: int, live: bool, stream=None, min_interval: float = 0.1):
        self.total = total
        self.stream = stream or sys.stderr
        self.live = live and self.stream.isatty()
        self.min_interval = min_interval
        # Under torchllm.run.launch on a terminal: the launcher draws the bar from this file.
        self.file = os.environ.get(PROGRESS_FILE_ENV) if live and not self.live else None
        self.first: tuple[int, float] | None = None  # (step, time) when timing started
        self.step = 0
        self.reported_at = 0.0
        self.bar: tqdm | None = None
        self.cleared = False

    def update(self, step: int) -> None:
        """Call after each step. Timing starts after the first step (warm-up, compilation)."""
        now = time.perf_counter()
        self.step = step
        if self.first is None:
            self.first = (step, now)
        if self.live:
            self.draw()
        elif self.file and (now - self.reported_at > self.min_interval or step == self.total):
            self.report()
            self.reported_at = now

    def draw(self) -> None:
        if self.bar is None:  # drawn from the first step on (tqdm draws when it is made)
            self.bar = new_bar(self.total, self.step, self.stream, self.min_interval)
        elif self.cleared:  # a log line took the row: bring the bar back below it now
            self.bar.n = self.step
            self.bar.refresh()
        else:  # tqdm redraws at most every min_interval seconds
            self.bar.update(self.step - self.bar.n)
        self.cleared = False

    def report(self) -> None:
        """Hand the bar's numbers to the launcher (atomically: it may read at any time)."""
        tmp = f"{self.file}.tmp"
        try:
            with open(tmp, "w") as f:
                f.write(f"{self.step} {self.total}")
            os.replace(tmp, self.file)
        except OSError:
            self.file = None  # the launcher is gone: plain lines only

    def eta_s(self) -> float | None:
        """Seconds left at the average pace since timing started; None until it can tell."""
        if self.first is None or self.step <= self.first[0]:
            return None
        pace = (time.perf_counter() - self.first[1]) / (self.step - self.first[0])
        return pace * (self.total - self.step)

    def clear(self) -> None:
        """Erase the bar so a log line can take the row; the next update redraws it."""
        if self.bar is not None:
            self.bar.clear()
            self.cleared = True

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()  # leave=False: the row is cleared
            self.bar = None


class ConsoleBar:
    """The launcher's terminal: relays torchrun's lines (as sys.stdout) and, between them,
    redraws the tqdm bar from the step rank 0 writes (see the module docstring)."""

    def __init__(self, path: str, stream):
        self.path, self.stream = path, stream
        self.lock = threading.Lock()
        self.bar: tqdm | None = None
        self.shown = False
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True, name="progress-bar")

    def __getattr__(self, name):  # fileno, isatty, encoding, ...: the terminal's
        return getattr(self.stream, name)

    def write(self, text: str, stream=None) -> int:
        with self.lock:
            if self.shown:  # the line takes the bar's row; the bar comes back below it
                self.bar.clear()
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
                step, total = (int(x) for x in f.read().split())
        except (OSError, ValueError):
            return
        with self.lock:
            if self.bar is None:  # timing starts at the first step seen (tqdm's initial)
                self.bar = new_bar(total, step, self.stream)
            elif not self.shown or step != self.bar.n:
                self.bar.n = step
                self.bar.refresh()
            self.shown = True

    def close(self) -> None:
        self.stopped.set()
        self.thread.join(timeout=1)
        with self.lock:
            if self.bar is not None:
                self.bar.close()  # leave=False: the row is cleared
                self.bar = None
                self.shown = False


class _Relay:
    def __init__(self, bar: ConsoleBar, stream):
        self.bar, self.stream = bar, stream

    def __getattr__(self, name):
        return getattr(self.stream, name)

    def write(self, text: str) -> int:
        return self.bar.write(text, self.stream)
