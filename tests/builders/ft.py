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
    """Holds the survivor back (SIGSTOP `stop_s`, 3 s by default, SIGCONT 0.3 s: under the 10 s
    heartbeat timeout, so it stays in the quorum) once it is `past` steps past the kill, until
    the relaunch has healed: the
    relaunch's start-up on a loaded machine (the whole suite on 2 cores) must not outlast the
    survivor's remaining steps, or the survivor finishes alone and the relaunch has no peer."""

    def __init__(self, pgid: int, survivor_log: Path, relaunch_log: Path, past: int,
                 stop_s: float = 3.0):
        super().__init__(daemon=True)
        self.stop_s = stop_s  # (under the 10 s heartbeat timeout)
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
                self.done.wait(self.stop_s)
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


class KilledRun:
    """What kill_and_relaunch leaves: each launch's console (`outs`, first launch first), its
    return code, and the two groups' logs (group 1's split at the relaunch marker)."""

    def __init__(self, logs: Path, procs: list, outs: list[str]):
        self.logs, self.procs, self.outs = logs, procs, outs
        self.log0 = (logs / "replica_0.log").read_text(errors="replace")
        self.killed_log, self.marker, self.log1 = \
            (logs / "replica_1.log").read_text(errors="replace").partition(RELAUNCHED)

    def codes(self) -> list[str]:
        """Each group's exit code as ft_local.sh recorded it."""
        return [(self.logs / f"replica_{r}.code").read_text().strip() for r in (0, 1)]


def kill_and_relaunch(tmp_path: Path, args: list[str], kill_at: int, env: dict | None = None,
                      wait_s: float = 300, timeout_s: float = 600, past: int = 0,
                      before_kill=None, before_relaunch=None, after_relaunch=None,
                      stop_s: float = 3.0) -> KilledRun:
    """Two replica groups through scripts/ft_local.sh; group 1's whole process group SIGKILLed
    once it printed step `kill_at`, then relaunched beside the survivor (FT_REPLICAS=1, the same
    log folder), the survivor throttled from `past` steps after the kill until the relaunch has
    healed (Throttle). `before_kill(env)`, `before_relaunch()` and `after_relaunch(step_at_kill,
    kill_time)` run at those moments. Returns when both launches have ended (the relaunch first: the first launch
    waits for it before it stops the lighthouse)."""
    import subprocess

    from conftest import REPO, wait_for

    logs = tmp_path / "logs"
    env = {**os.environ, "TORCHFT_LIGHTHOUSE": f"http://localhost:{free_port()}",
           "FT_LOG_DIR": str(logs), "TORCHLLM_FORK_WORKERS": "1",
           "FT_HEARTBEAT_TIMEOUT_MS": "10000", **(env or {})}
    env.pop("FT_JOIN_TIMEOUT_MS", None)
    script = [str(REPO / "scripts" / "ft_local.sh"), "2", *args]
    launch = dict(cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                  start_new_session=True)
    procs = [subprocess.Popen(script, env=env, **launch)]
    throttle = None
    try:
        wait_for(lambda: kill_at in steps_of(logs / "replica_1.log"), wait_s,
                 what=f"group 1 at step {kill_at}")
        if before_kill is not None:
            before_kill(env)
        os.killpg(int((logs / "replica_1.pid").read_text()), signal.SIGKILL)  # all its ranks
        killed, before = time.monotonic(), max(steps_of(logs / "replica_0.log"))
        if before_relaunch is not None:
            before_relaunch()
        procs.append(subprocess.Popen(script, env={**env, "FT_REPLICAS": "1"}, **launch))
        throttle = Throttle(int((logs / "replica_0.pid").read_text()), logs / "replica_0.log",
                            logs / "replica_1.log", before + past, stop_s)
        throttle.start()
        if after_relaunch is not None:
            after_relaunch(before, killed)
        outs = [p.communicate(timeout=timeout_s)[0].decode(errors="replace")
                for p in procs[::-1]][::-1]
    finally:
        if throttle is not None:
            throttle.done.set()
            throttle.join()
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    return KilledRun(logs, procs, outs)


def assert_same_state(run_root: Path, groups=("debug_model-replica0", "debug_model-replica1"),
                      must_hold: str = "optimizer.", keys: tuple[str, ...] = ("",)) -> None:
    """The groups' last checkpoints hold the same tensors, key by key, of the keys starting with
    one of `keys` (default every key: weights, optimizer state, and what else the training state
    saves); one key starts with `must_hold`. (run_train.sh's config file, debug_model.toml, names
    the run; each group has its own folder.)"""
    import torch

    from torchllm.checkpoint import open_checkpoint

    a, b = (open_checkpoint(run_root / g).tensors("") for g in groups)
    assert a.keys() == b.keys() and any(k.startswith(must_hold) for k in a), sorted(a)[:20]
    compared = [k for k in a if k.startswith(keys)]
    assert compared
    for key in compared:
        assert torch.equal(a[key], b[key]), key


def assert_group_of_two_heals(tmp_path: Path, layout: list[str], layout_line: str,
                              reduction: str, steps: int = 20, kill_at: int = 2) -> None:
    """Two replica groups of NGPU=2 CPU ranks (`layout`: the flags of the layout inside a group)
    through ft_local.sh, group 1 SIGKILLed after step `kill_at` and relaunched: both exit 0 (a
    relaunch whose collectives do not pair with its peer's aborts the survivor), each log names
    the layout (`layout_line`) and the cross-group mean inside its reduction (`reduction`:
    FSDP2's, DDP's), the relaunch heals and trains in step (the same grad norms), and both
    groups end with the same weights and optimizer state. The survivor is held back from the
    kill on (its steps take ~0.5 s, a relaunch's start-up ~30 s)."""
    from conftest import tiny_args

    args = tiny_args(tmp_path, f"--training.steps={steps}", "--data.tokenizer=bytes",
                     "--validation.enable=false", "--eval.sample_freq=0",
                     "--training.local_batch_size=2", "--checkpoint.interval=1000",
                     "--lr_scheduler.warmup_steps=2", *layout)
    run = kill_and_relaunch(tmp_path, args, kill_at, env={"NGPU": "2"}, wait_s=420,
                            timeout_s=900)
    log0, log1 = run.log0, run.log1
    assert run.marker and kill_at in steps_of(run.killed_log), run.killed_log[-2000:]
    assert run.codes() == ["0", "0"], run.outs[0] + log0[-3000:] + run.outs[1] + log1[-3000:]
    for log in (log0, log1):
        assert layout_line in log, log[-3000:]
        assert f"inside {reduction}'s reduction" in log, log[-3000:]
    assert sorted(steps_of(log0)) == list(range(1, steps + 1))
    healed = int(re.search(r"healed from a live peer: continues at step (\d+)", log1)[1])
    assert kill_at < healed <= steps
    g0, g1 = steps_of(log0), steps_of(log1)
    assert sorted(g1) == list(range(healed, steps + 1))
    assert [g1[s] for s in g1] == [g0[s] for s in g1]  # in step: the same grad norms
    # Both end with the same weights and optimizer state (every group saves the last step).
    assert_same_state(tmp_path)
