"""One run per folder: an exclusive lock file in the run folder, and workers that die with torchrun.

The lock is `<run folder>/run.lock`, created atomically (O_CREAT | O_EXCL) by the process that
runs rank 0, holding JSON: host, pid, the pid's start time (so a reused pid is not mistaken for
the holder) and when the run started. A daemon thread touches the file every `heartbeat_s`
seconds; its modification time is the heartbeat.

A lock left behind is stale, and is taken over with a warning, when
- the holder ran on this host and its process is gone (or the pid now names another process), or
- the holder ran on another host and its heartbeat is older than `stale_s` (`job.lock_stale_minutes`;
  that host's clock and this one's must roughly agree, as they do under NTP).
Otherwise the launch fails at start with a `RunLockedError` naming the holder.

`set_parent_death_signal()` asks Linux to SIGKILL this process when its parent (torchrun) dies,
so orphaned workers never write on beside a relaunch.
"""

from __future__ import annotations

import atexit
import ctypes
import json
import os
import signal
import socket
import threading
import time
from pathlib import Path

from torchllm.config import ConfigError
from torchllm.log import logger

LOCK_NAME = "run.lock"
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


class RunLockedError(ConfigError):
    """Another live run holds the run folder."""


def process_start_time(pid: int) -> str | None:
    """The kernel's start time of `pid` (clock ticks since boot), or None if not running/knowable."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # Field 22; the command name (field 2) may hold spaces, so split after its closing ')'.
    return stat.rsplit(")", 1)[1].split()[19]


def pid_alive(pid: int, start_time: str | None) -> bool:
    """Whether `pid` still names the process that took the lock (same start time, if recorded)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # alive, owned by someone else
    now = process_start_time(pid)
    return start_time is None or now is None or now == start_time


class RunLock:
    """An exclusive, stale-aware lock on one run folder (see the module docstring)."""

    def __init__(self, run_dir: Path, stale_s: float, heartbeat_s: float | None = None):
        self.path = Path(run_dir) / LOCK_NAME
        self.stale_s = stale_s
        self.heartbeat_s = heartbeat_s or max(1.0, min(60.0, stale_s / 4))
        self.held = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def holder(self) -> dict | None:
        """The lock file's contents plus its heartbeat age in seconds, or None without a lock."""
        try:
            info = json.loads(self.path.read_text())
            info["heartbeat_age_s"] = time.time() - self.path.stat().st_mtime
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            # Half-written (the writer died between create and write) or unreadable: judge by age.
            try:
                age = time.time() - self.path.stat().st_mtime
            except FileNotFoundError:
                return None
            return {"host": "?", "pid": -1, "heartbeat_age_s": age}
        return info

    def is_ours(self, info: dict) -> bool:
        return info.get("host") == socket.gethostname() and info.get("pid") == os.getpid()

    def stale_reason(self, info: dict) -> str | None:
        """Why the lock `info` is stale, or None when its holder may still be running."""
        if info.get("host") == socket.gethostname() and info.get("pid", -1) > 0:
            if not pid_alive(info["pid"], info.get("pid_start")):
                return f"process {info['pid']} on this host is gone"
            return None
        if info["heartbeat_age_s"] > self.stale_s:
            return (f"no heartbeat for {info['heartbeat_age_s']:.0f} s "
                    f"(> job.lock_stale_minutes = {self.stale_s / 60:g})")
        return None

    def acquire(self) -> None:
        """Take the lock, taking over a stale one; raises RunLockedError if a live run holds it."""
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                info = self.holder()
                if info is None:
                    continue  # released in between: try again
                if self.is_ours(info):
                    self.held = True  # this process already holds it (e.g. a second Trainer)
                    return
                reason = self.stale_reason(info)
                if reason is None:
                    raise RunLockedError(
                        f"run folder {self.path.parent} is in use by another run (host "
                        f"{info.get('host')}, pid {info.get('pid')}, started "
                        f"{info.get('started', '?')}); wait for it to end, or choose another "
                        f"job.run_name / job.dump_folder (the lock is {self.path})",
                        "job.run_name",
                    )
                logger.warning("taking over the stale lock %s of host %s pid %s: %s",
                               self.path, info.get("host"), info.get("pid"), reason)
                try:
                    # Renaming, not unlinking: of two launches taking over at once, one wins.
                    os.rename(self.path, self.path.with_name(f"{LOCK_NAME}.stale.{os.getpid()}"))
                    os.unlink(self.path.with_name(f"{LOCK_NAME}.stale.{os.getpid()}"))
                except FileNotFoundError:
                    pass
                continue
            info = {
                "host": socket.gethostname(), "pid": os.getpid(),
                "pid_start": process_start_time(os.getpid()),
                "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            }
            with os.fdopen(fd, "w") as f:
                json.dump(info, f)
            self.held = True
            self._start_heartbeat()
            atexit.register(self.release)
            return
        raise RunLockedError(f"could not take the lock {self.path} (it changed hands three "
                             "times while trying); is another launch starting into the same "
                             "folder?", "job.run_name")

    def _start_heartbeat(self) -> None:
        def beat():
            while not self._stop.wait(self.heartbeat_s):
                try:
                    os.utime(self.path)
                except OSError:
                    pass

        self._thread = threading.Thread(target=beat, name="run-lock-heartbeat", daemon=True)
        self._thread.start()

    def release(self) -> None:
        """Remove the lock if this process still holds it (safe to call more than once)."""
        self._stop.set()
        if not self.held:
            return
        self.held = False
        info = self.holder()
        if info is not None and self.is_ours(info):
            try:
                self.path.unlink()
            except FileNotFoundError:
                pass


def set_parent_death_signal(expected_parent: int | None = None,
                            sig: int = signal.SIGKILL) -> bool:
    """Linux: deliver `sig` to this process when its parent dies. Returns whether it is set.

    Called by workers started by torchrun: a worker whose torchrun was killed (kill -9, OOM
    killer, a node agent) would otherwise train and save on, beside the run that replaces it.
    `expected_parent`: the parent's pid when known (the launcher exports it); if the parent is
    already another process, it died before this call and the signal is sent now.
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False  # not Linux
    # The parent may have died before prctl: then we were re-parented already (to init or a
    # subreaper) and no signal will come.
    if expected_parent is not None and os.getppid() != expected_parent:
        os.kill(os.getpid(), sig)
    return True
