"""One run per folder: an exclusive lock file in the run folder, and workers that die with torchrun.

The lock is `<run folder>/run.lock`, taken by the process that runs rank 0: its JSON (host, pid,
the pid's start time, so a reused pid is not mistaken for the holder, and when the run started)
is written to a file of its own, then hard-linked to `run.lock`, which fails if the lock exists:
a lock file is never seen empty or half-written. A daemon thread touches the file every
`heartbeat_s` seconds; its modification time is the heartbeat. The process releases the lock on
every way out of `torchllm.run.process.main` (`release_held_locks`; workers end with `os._exit`,
which skips `atexit`), and on SIGTERM before training installs its own handler.

A lock left behind is stale, and is taken over with a warning, when
- the holder ran on this host and its process is gone (or the pid now names another process), or
- the holder ran on another host and its heartbeat is older than `stale_s` (`job.lock_stale_minutes`;
  that host's clock and this one's must roughly agree, as they do under NTP).
Otherwise the launch fails at start with a `RunLockedError` naming the holder. Of several launches
that find one stale lock, exactly one takes it over (`RunLock._take_over`); the others find its
new lock and fail. A lock file that is not a JSON object with a host and a positive integer pid
fails the launch too: "unreadable lock file X: delete it if no run uses this folder"; so does
a lock that is a symbolic link or no regular file (it is read with O_NOFOLLOW, never waited on,
at most MAX_LOCK_BYTES), and the file written before the link is created new (a link planted at
its name is never written through: storage.create_new).

`set_parent_death_signal()` asks Linux to SIGKILL this process when its parent (torchrun) dies,
so orphaned workers never write on beside a relaunch.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import json
import os
import signal
import socket
import stat
import threading
import time
from pathlib import Path

from torchllm.config import ConfigError
from torchllm.log import logger
from torchllm.storage import create_new

LOCK_NAME = "run.lock"
MAX_LOCK_BYTES = 1 << 16  # a lock is a short JSON record
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


class RunLockedError(ConfigError):
    """Another live run holds the run folder."""


def _stat_fields(pid: int) -> list[str] | None:
    """/proc/PID/stat's fields from the third on (state, ppid, ...), or None if unreadable."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may hold spaces, so split after its closing ')'.
    return stat.rsplit(")", 1)[1].split()


def process_start_time(pid: int) -> str | None:
    """The kernel's start time of `pid` (clock ticks since boot), or None if not running/knowable."""
    fields = _stat_fields(pid)
    return None if fields is None else fields[19]  # field 22


def pid_alive(pid: int, start_time: str | None) -> bool:
    """Whether `pid` still names the process that took the lock (same start time, if recorded).
    A zombie has exited: it holds nothing, though its pid answers until its parent reaps it
    (an orphaned worker in a container whose first process never reaps stays one)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # alive, owned by someone else
    fields = _stat_fields(pid)
    if fields is not None and fields[0] in ("Z", "X"):
        return False
    now = None if fields is None else fields[19]
    return start_time is None or now is None or now == start_time


ATTEMPTS = 10  # tries to create the lock, each after finding a stale one or losing a takeover
CLAIM_STUCK_S = 60.0  # a takeover claim this old was left by a launch that died taking over
_held: set[RunLock] = set()  # the locks this process holds (release_held_locks)


def _identity(path: Path) -> tuple[int, int, int] | None:
    """(inode, mtime in ns, size) of `path`: which lock file it is, as judged; None if absent."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_mtime_ns, st.st_size


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
        return self._read()[0]

    def _read(self) -> tuple[dict | None, tuple[int, int, int] | None]:
        """The lock's contents (as holder()) and identity (as _identity), read from one open file.
        Raises RunLockedError if it is not a JSON object with a host and a positive integer pid
        (the lock is written whole, so that is no lock being written: see the module docstring)."""
        try:  # no link followed, no FIFO waited on, at most MAX_LOCK_BYTES read
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except FileNotFoundError:
            return None, None
        except OSError as e:  # ELOOP: a symbolic link
            raise RunLockedError(f"unreadable lock file {self.path} ({e.strerror}: a link is "
                                 "never followed): delete it if no run uses this folder",
                                 "job.run_name") from None
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            raw = f.read(MAX_LOCK_BYTES + 1) if stat.S_ISREG(st.st_mode) else b""
        try:
            info = json.loads(raw)
        except ValueError:
            info = None
        pid = info.get("pid") if isinstance(info, dict) else None
        if not (isinstance(info, dict) and isinstance(info.get("host"), str)
                and type(pid) is int and pid > 0):
            raise RunLockedError(f"unreadable lock file {self.path}: delete it if no run uses "
                                 "this folder", "job.run_name")
        info["heartbeat_age_s"] = time.time() - st.st_mtime
        return info, (st.st_ino, st.st_mtime_ns, st.st_size)

    def is_ours(self, info: dict) -> bool:
        return info.get("host") == socket.gethostname() and info.get("pid") == os.getpid()

    def stale_reason(self, info: dict) -> str | None:
        """Why the lock `info` is stale, or None when its holder may still be running."""
        if info.get("host") == socket.gethostname():
            if not pid_alive(info["pid"], info.get("pid_start")):
                return f"process {info['pid']} on this host is gone"
            return None
        if info["heartbeat_age_s"] > self.stale_s:
            return (f"no heartbeat for {info['heartbeat_age_s']:.0f} s "
                    f"(> job.lock_stale_minutes = {self.stale_s / 60:g})")
        return None

    def acquire(self) -> None:
        """Take the lock, taking over a stale one; raises RunLockedError if a live run holds it."""
        for attempt in range(ATTEMPTS):
            if self._create():
                self.held = True
                _held.add(self)
                self._start_heartbeat()
                atexit.register(self.release)
                return
            info, ident = self._read()
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
            if not self._take_over(ident, info, reason):
                time.sleep(0.01 * (attempt + 1))  # another launch is taking it over: back off
        raise RunLockedError(f"could not take the lock {self.path} (it changed hands {ATTEMPTS} "
                             "times while trying); is another launch starting into the same "
                             "folder?", "job.run_name")

    @contextlib.contextmanager
    def kept_on_success(self):
        """Take the lock for the body (a check that this launch may use the folder) and keep it
        afterwards; if the body fails, release it again and re-raise."""
        self.acquire()
        try:
            yield self
        except BaseException:
            self.release()
            raise

    def _create(self) -> bool:
        """Create the lock, whole: a hard link to a written file. False if a lock exists."""
        info = {
            "host": socket.gethostname(), "pid": os.getpid(),
            "pid_start": process_start_time(os.getpid()),
            "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        }
        tmp = self.path.with_name(f"{LOCK_NAME}.new.{socket.gethostname()}.{os.getpid()}")
        with os.fdopen(create_new(tmp), "w") as f:  # a link planted at its name: not followed
            f.write(json.dumps(info))
        try:
            os.link(tmp, self.path)
        except FileExistsError:
            return False
        except OSError:  # a filesystem without hard links: exclusive create, then write
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                return False
            with os.fdopen(fd, "w") as f:
                json.dump(info, f)
        finally:
            tmp.unlink(missing_ok=True)
        return True

    def _take_over(self, ident: tuple[int, int, int], info: dict, reason: str) -> bool:
        """Remove the stale lock file `ident` (as judged); whether this launch removed it.

        Of the launches that judged it stale, one goes on: the one that creates the claim file
        named by its identity (O_EXCL). A launch that read the lock before a takeover ended and
        claims it after must not remove the new lock: the file is renamed aside only while it
        is still the one judged, and checked again after the rename (a lock created in between
        is linked back)."""
        claim = self.path.with_name(f"{LOCK_NAME}.takeover.{ident[0]}.{ident[1]}")
        try:
            os.close(os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
        except FileExistsError:
            try:
                age = time.time() - claim.stat().st_mtime
            except FileNotFoundError:  # that takeover just ended
                age = 0.0
            if age > CLAIM_STUCK_S:
                raise RunLockedError(
                    f"the stale lock {self.path} has a takeover claim {claim} left by a launch "
                    f"that died {age:.0f} s ago: delete both if no run uses this folder",
                    "job.run_name") from None
            return False
        try:
            if _identity(self.path) != ident:
                return False  # renewed, released or taken over since it was read
            logger.warning("taking over the stale lock %s of host %s pid %s: %s",
                           self.path, info.get("host"), info.get("pid"), reason)
            aside = self.path.with_name(f"{LOCK_NAME}.stale.{os.getpid()}")
            try:
                os.rename(self.path, aside)
            except FileNotFoundError:
                return False
            if _identity(aside) != ident:  # a new lock, created in between: put it back
                try:
                    os.link(aside, self.path)
                except FileExistsError:
                    pass
                aside.unlink()
                return False
            aside.unlink()
            return True
        finally:
            claim.unlink(missing_ok=True)

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
        _held.discard(self)
        if not self.held:
            return
        self.held = False
        try:
            info = self.holder()
        except RunLockedError:  # not ours any more (overwritten): leave it
            return
        if info is not None and self.is_ours(info):
            try:
                self.path.unlink()
            except FileNotFoundError:
                pass


def release_held_locks() -> None:
    """Release every lock this process holds: for ways out that skip `atexit` (os._exit)."""
    for lock in list(_held):
        lock.release()


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
