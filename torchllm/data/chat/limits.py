"""Limits on rendering a chat template (a tokenizer_config.json is data from whoever published
it): a time limit per render, a limit on the text a render produces (its output, and every
`{{ }}` inside macros and `{% set %}` blocks), and size caps on whatever builds a large value in
one C call, which no time limit can interrupt: the operators here (`*`, `+`, `%`, `**`), every
filter, test and method a template can call (chat/bounded.py, with sizes from chat/sizes.py);
and what those build in one render adds up to at most RENDER_BUILT bytes.

The time limit: a watchdog thread (one per process, started on first use) raises
`RenderTimeout` in a thread whose render passed its deadline (CPython's
`PyThreadState_SetAsyncExc`, delivered at the template's next bytecode: a `for` loop's next
iteration), so a template's nested `range(100000)` loops stop instead of running for hours.
What it costs a render: a lock, a dict entry, one C call.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time

RENDER_SECONDS = 5.0  # per render of one conversation (prefix); a real template takes ms
RENDER_CHARS = 16 << 20  # characters a render may produce (and any one operation may build)
POW_BITS = 4096  # the largest integer `**` or `*` may build, in bits
RENDER_BUILT = 1 << 30  # bytes all the values a render builds (each capped above) may add up to


class RenderTimeout(BaseException):
    """Raised inside a render that passed its deadline (a BaseException: the template
    engine's own `except Exception` cannot swallow it)."""


class RenderLimit(Exception):
    """A render stopped by a limit (the message says which)."""


class _Watchdog:
    def __init__(self):
        self.reset()

    def reset(self) -> None:
        """Fresh state (and, after a fork, no thread and no lock the parent's thread held)."""
        self.lock = threading.Lock()
        self.wake = threading.Condition(self.lock)
        self.deadlines: dict[int, float] = {}  # thread id -> monotonic deadline
        self.pid = None  # the process whose watchdog thread runs
        self.waiting_until: float | None = None  # when the watchdog wakes next (None: never)

    def _ensure_thread(self) -> None:
        if self.pid != os.getpid():
            self.pid = os.getpid()
            threading.Thread(target=self._run, name="chat-template-watchdog",
                             daemon=True).start()

    def _run(self) -> None:
        with self.lock:
            while True:
                now = time.monotonic()
                for tid, deadline in list(self.deadlines.items()):
                    if now >= deadline:
                        del self.deadlines[tid]
                        _async_raise(tid, RenderTimeout)
                self.waiting_until = min(self.deadlines.values(), default=None)
                self.wake.wait(None if self.waiting_until is None
                               else max(self.waiting_until - now, 0.001))

    def start(self, seconds: float) -> None:
        with self.lock:
            self._ensure_thread()
            deadline = self.deadlines[threading.get_ident()] = time.monotonic() + seconds
            if self.waiting_until is None or deadline < self.waiting_until:
                self.wake.notify()  # (else it wakes before this deadline anyway: no switch)

    def stop(self) -> None:
        """End this thread's render: no timeout can arrive after this returns (one sent while
        it waits for the lock arrives inside the `with`, whose exit releases the lock)."""
        tid = threading.get_ident()
        with self.lock:
            self.deadlines.pop(tid, None)
            _async_raise(tid, None)  # clears one sent but not yet delivered


_WATCHDOG = _Watchdog()
os.register_at_fork(after_in_child=_WATCHDOG.reset)
_RENDER = threading.local()  # .produced / .built: this thread's render's characters / bytes


def count_output(size: int) -> None:
    """A `{{ }}` of `size` characters produced (at any depth: a macro's, a block's); RenderLimit
    once this thread's render has produced more than RENDER_CHARS (doubling a value through a
    macro or a `{% set %}` block in a loop stops there)."""
    produced = getattr(_RENDER, "produced", None)
    produced = (0 if produced is None else produced) + size
    if produced > RENDER_CHARS:
        raise RenderLimit(f"it produced more than {RENDER_CHARS:,} characters")
    if getattr(_RENDER, "produced", None) is not None:
        _RENDER.produced = produced


def _async_raise(tid: int, exc) -> None:
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(tid),
                                               ctypes.py_object(exc) if exc else None)


def count_built(value) -> None:
    """A value a capped operation built (a string: 1 or 4 bytes a character, a list or tuple: 8
    an item); RenderLimit once this thread's render has built more than RENDER_BUILT bytes in
    all (values each within the caps, kept: `[ns.v, [i] * 10**7]` in a loop)."""
    built = getattr(_RENDER, "built", None)
    if built is None or not isinstance(value, (str, bytes, list, tuple)):
        return
    size = len(value) * (8 if isinstance(value, (list, tuple)) else
                         1 if isinstance(value, bytes) or value.isascii() else 4)
    _RENDER.built = built + size
    if built + size > RENDER_BUILT:
        raise RenderLimit(f"the values it built add up to more than {RENDER_BUILT:,} bytes")


def limited(render) -> str:
    """`render()` (an iterator of text pieces: a Jinja template's generate) joined, within
    RENDER_SECONDS and RENDER_CHARS; RenderLimit otherwise."""
    seconds, max_chars = RENDER_SECONDS, RENDER_CHARS
    pieces, size = [], 0
    try:
        try:
            _RENDER.produced = _RENDER.built = 0
            _WATCHDOG.start(seconds)
            for piece in render():
                size += len(piece)
                if size > max_chars:
                    raise RenderLimit(f"it produced more than {max_chars:,} characters")
                pieces.append(piece)
        finally:
            _WATCHDOG.stop()
            _RENDER.produced = _RENDER.built = None
    except RenderTimeout:
        raise RenderLimit(f"it ran longer than {seconds:g} s") from None
    return "".join(pieces)
