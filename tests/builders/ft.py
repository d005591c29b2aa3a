"""Shared test builders (tests/builders/ft.py): imported by the test modules that use them."""

from __future__ import annotations

import logging
import os
import re
import signal
import socket
import threading
import time
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


RELAUNCHED = "=== ft_local: replica group 1 relaunched"


class Throttle(threading.Thread):
    """Holds the survivor back (SIGSTOP 3 s, SIGCONT 0.3 s: under the 10 s heartbeat timeout, so
    it stays in the quorum) once it is 3 steps past the kill, until the relaunch has healed: the
    relaunch's start-up on a loaded machine (the whole suite on 2 cores) must not outlast the
    survivor's remaining steps, or the survivor finishes alone and the relaunch has no peer."""

    def __init__(self, pgid: int, survivor_log: Path, relaunch_log: Path, past: int):
        super().__init__(daemon=True)
        self.pgid, self.survivor_log, self.relaunch_log, self.past = pgid, survivor_log, relaunch_log, past
        self.done = threading.Event()

    def healed(self) -> bool:
        text = self.relaunch_log.read_text(errors="replace") if self.relaunch_log.exists() else ""
        return "healed from a live peer" in text.partition(RELAUNCHED)[2]

    def run(self):
        while not self.done.is_set() and not self.healed():
            if max(steps_of(self.survivor_log), default=0) < self.past:
                time.sleep(0.2)
                continue
            # (torchrun starts each worker in a session of its own: the group's ranks are the
            # launcher's process group's descendants, each in its own process group)
            groups = process_groups_under(self.pgid)
            try:
                for pgid in groups:
                    os.killpg(pgid, signal.SIGSTOP)
                self.done.wait(3.0)
            finally:
                for pgid in groups:
                    try:
                        os.killpg(pgid, signal.SIGCONT)
                    except ProcessLookupError:
                        pass
            self.done.wait(0.3)


def process_groups_under(pgid: int) -> list[int]:
    """`pgid` and the process groups of its members' descendants (from /proc)."""
    parent, group = {}, {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            parent[int(entry)], group[int(entry)] = int(fields[1]), int(fields[2])
    inside = {p for p, g in group.items() if g == pgid}
    grew = True
    while grew:
        more = {p for p, pp in parent.items() if pp in inside} - inside
        inside |= more
        grew = bool(more)
    return sorted({pgid} | {group[p] for p in inside})
