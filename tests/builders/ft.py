"""Shared test builders (tests/builders/ft.py): imported by the test modules that use them."""

from __future__ import annotations

import logging
import os
import re
import socket
from pathlib import Path

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


STEP = re.compile(r"step\s+(\d+)/(\d+) \| loss \S+ \| lr \S+ \| grad_norm (\S+)")


def steps_of(log: Path | str) -> dict[int, str]:
    """step -> its printed grad norm (the last line printed for it), in a log or its text."""
    if isinstance(log, Path):
        log = log.read_text(errors="replace") if log.exists() else ""
    return {int(m[1]): m[3] for m in STEP.finditer(log)}


def listening(port: int) -> list[str]:
    """The local addresses (hex, as /proc/net/tcp* writes them) listening on `port`."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not os.path.exists(table):
            continue
        with open(table) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                address, hexport = local.split(":")
                if state == "0A" and int(hexport, 16) == port:
                    found.append(address)
    return found


@pytest.fixture
def log_lines():
    """The lines torchllm's logger writes (its console), info and up."""
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    handler, log = Keep(), logging.getLogger("torchllm")
    level = log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)  # (the quorum lines are info)
    yield lines
    log.removeHandler(handler)
    log.setLevel(level)
