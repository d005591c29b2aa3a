"""The `torchllm` logger.

Every rank logs; which ranks reach the console is the launcher's choice: run_train.sh passes
LOG_RANK to torchrun's --local-ranks-filter (default rank 0), and torchrun's `--role rank --tee`
puts `[rankN]:` in front of each line.

The trainer's console (`init_logger(split_streams=True)`): training lines go to stdout, warnings
and errors to stderr, so `./run_train.sh > train.txt` keeps the step lines. Rank 0's lines are
also appended to `RUN/train.log` (each launch starts with a `==== launch ...` line); other ranks
append only their errors there, prefixed `[rankN]`. Lines logged before the run folder is known
(the precision line) are kept and written when it opens (`open_run_log`).
"""

from __future__ import annotations

import logging
import os
import sys
import time
import warnings
from pathlib import Path

logger = logging.getLogger("torchllm")

# Library lines that say nothing about the run, at the level below which they are dropped:
# torchao's "Failed to load ..._C_mxfp8 / _C_cutlass_90a" for kernels of other GPU generations
# (logged on import), and torch's note on torchao registering an Enum with the pytree.
QUIET_LOGGERS = {"torchao": logging.ERROR, "torch.utils._pytree": logging.ERROR}
# Warnings repeated on every checkpoint save/load of a single-process run.
QUIET_WARNINGS = [("torch.distributed is disabled, unavailable or uninitialized", UserWarning)]
FORMAT = ("%(asctime)s %(message)s", "%H:%M:%S")
RUN_LOG = "train.log"


def quiet_library_noise() -> None:
    """Drop the library log lines and warnings above (nothing else)."""
    for name, level in QUIET_LOGGERS.items():
        logging.getLogger(name).setLevel(level)
    for message, category in QUIET_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)


quiet_library_noise()  # at import: every entry point (train, generate, hf, hellaswag) gets it


class _Below(logging.Filter):
    def __init__(self, level: int):
        super().__init__()
        self.level = level

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno < self.level


class RunLogHandler(logging.Handler):
    """Appends to RUN/train.log once `open()` names the run folder; keeps earlier records until
    then (and drops them if no folder ever opens, e.g. a config error)."""

    def __init__(self, argv: list[str]):
        super().__init__()
        self.argv = argv
        self.setFormatter(logging.Formatter(FORMAT[0], "%Y-%m-%d %H:%M:%S"))
        self.pending: list[logging.LogRecord] = []
        self.file = None
        self.prefix = ""

    def open(self, run_dir: Path, rank: int) -> None:
        """Rank 0 writes every line; other ranks their errors only, prefixed [rankN]."""
        if rank != 0:
            self.setLevel(logging.ERROR)
            self.prefix = f"[rank{rank}] "
        self.file = open(Path(run_dir) / RUN_LOG, "a", encoding="utf-8")  # noqa: SIM115
        if rank == 0:
            stamp = time.strftime("%Y-%m-%d %H:%M:%S %Z")
            self.file.write(f"==== launch {stamp}: pid {os.getpid()}, "
                            f"{os.environ.get('WORLD_SIZE', '1')} process(es), args: "
                            f"{' '.join(self.argv) or '(none)'} ====\n")
        for record in self.pending:
            if record.levelno >= self.level:
                self.emit(record)
        self.pending = []

    def emit(self, record: logging.LogRecord) -> None:
        if self.file is None:
            self.pending.append(record)
            return
        try:
            self.file.write(self.prefix + self.format(record) + "\n")
            self.file.flush()
        except (OSError, ValueError):  # disk full / closed: the console still has the line
            pass

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None
        self.pending = []
        super().close()


def init_logger(split_streams: bool = False, argv: list[str] | None = None) -> None:
    """Console handler(s) on the torchllm logger. `split_streams` (the trainer): INFO lines on
    stdout, warnings and errors on stderr, plus a RunLogHandler for RUN/train.log; otherwise
    everything on stderr (CLIs whose stdout is their answer: generate, evals)."""
    close_run_log()
    logger.handlers.clear()
    fmt = logging.Formatter(*FORMAT)
    if split_streams:
        out = logging.StreamHandler(sys.stdout)
        out.addFilter(_Below(logging.WARNING))
        err = logging.StreamHandler(sys.stderr)
        err.setLevel(logging.WARNING)
        for handler in (out, err):
            handler.setFormatter(fmt)
            logger.addHandler(handler)
        logger.addHandler(RunLogHandler(sys.argv[1:] if argv is None else argv))
    else:
        handler = logging.StreamHandler()
        handler.setFormatter(fmt)
        logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    quiet_library_noise()


def _run_log() -> RunLogHandler | None:
    return next((h for h in logger.handlers if isinstance(h, RunLogHandler)), None)


def file_only(message: str, level: int = logging.ERROR) -> None:
    """`message` written to RUN/train.log only, not the console (a line the launcher prints on
    the console itself)."""
    handler = _run_log()
    if handler is not None:
        handler.handle(logger.makeRecord(logger.name, level, __file__, 0, message, None, None))


def open_run_log(run_dir: Path, rank: int) -> None:
    """Start writing RUN/train.log (a no-op unless init_logger(split_streams=True) ran)."""
    handler = _run_log()
    if handler is not None and handler.file is None:
        handler.open(run_dir, rank)


def run_log_path() -> Path | None:
    """The train.log being written, if any."""
    handler = _run_log()
    return Path(handler.file.name) if handler is not None and handler.file is not None else None


def close_run_log() -> None:
    handler = _run_log()
    if handler is not None:
        logger.removeHandler(handler)
        handler.close()
