"""What a dead replica group costs, with torchft and without: one group SIGKILLed mid-run.

    python benchmarks/bench_fault_tolerance.py --steps 30 --kill-at 8 --checkpoint-interval 5 \\
        --json benchmarks/results/fault_tolerance_cpu.json [--section.key=value ...]

With fault tolerance: scripts/ft_local.sh starts a lighthouse and 2 replica groups (NGPU CPU
ranks each, 1 unless set: NGPU=2 with --parallelism.dp_mode=ddp or fsdp times a group of two
ranks' heal); group 1 is SIGKILLed (its whole process group, as a node loss) when it prints step
--kill-at, and relaunched at once beside the survivor. Measured: the steps the survivor lost
(steps it had to run again; its step numbers must run 1..N once each), the seconds from the kill
to the survivor's next step, and the seconds from the relaunch to the new group's heal (it then
trains in step with the survivor).

Without: one ./run_train.sh launch (same model and data, checkpoints every
--checkpoint-interval steps) is SIGKILLed at the same step and relaunched; it resumes from its
last checkpoint. Measured: the steps lost (run again after the resume) and the seconds from the
kill until training is past the killed step again.

Heal time: from the relaunch to the relaunched group's first committed step (it printed it:
a step line is printed after the commit), beside the plain run's restart: from its relaunch to
its first step after resuming from the last checkpoint.

Per-step cost (--cost-steps; 0 skips it): without kills, 2 replica groups of --ranks CPU ranks
each (FSDP2 inside a group) train --cost-steps steps through scripts/ft_local.sh, with the
cross-group mean inside FSDP2's reduction (fault_tolerance.overlap, the default) and after
backward (overlap=false), against the same two launches side by side without torchft (the same
processes on the machine, each its own run): the median step time of each (its first 2 steps,
start-up, left out). --cost-only measures only that.

Times are wall-clock seconds from the moment this script sees a log line (polled every 0.1 s).
Prints a table (and the machine it ran on, detected at run time); --json writes the numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STEP = re.compile(r"step\s+(\d+)/\d+ \| loss \S+ \| lr \S+ \| grad_norm (\S+) \|.*?\| step (\d+)ms")


class Follower(threading.Thread):
    """Tails a log file and records when each line of interest first appears."""

    def __init__(self, path: Path):
        super().__init__(daemon=True)
        self.path, self.lines, self.stop = path, [], False  # (seconds, line)

    def run(self):
        offset, rest = 0, ""
        while not self.stop:
            if self.path.exists():
                with open(self.path, errors="replace") as f:
                    f.seek(offset)
                    chunk = f.read()
                    offset = f.tell()
                now = time.monotonic()
                rest += chunk
                *done, rest = rest.split("\n")
                self.lines += [(now, line) for line in done]
            time.sleep(0.1)

    def steps(self) -> list[tuple[float, int, int]]:
        """(seen at, step, step ms) of every step line so far."""
        return [(t, int(m[1]), int(m[3])) for t, line in list(self.lines)
                if (m := STEP.search(line))]

    def first(self, pattern: str, after: float = 0.0):
        for t, line in list(self.lines):
            if t >= after and re.search(pattern, line):
                return t, line
        return None

    def wait(self, predicate, timeout_s: float, what: str):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if value := predicate():
                return value
            time.sleep(0.1)
        raise SystemExit(f"bench_fault_tolerance: timed out waiting for {what} ({self.path})")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def last_step(f: Follower) -> int:
    return max((s for _, s, _ in f.steps()), default=0)


def train_args(a, work: Path, steps: int | None = None) -> list[str]:
    return ["--training.device=cpu", f"--job.dump_folder={work}", "--job.print_config=false",
            f"--training.steps={steps or a.steps}", "--metrics.log_freq=1", "--metrics.report=false",
            "--validation.enable=false", "--eval.sample_freq=0", "--checkpoint.enable=true",
            f"--checkpoint.interval={a.checkpoint_interval}", *a.overrides]


def with_ft(a, work: Path) -> dict:
    logs, relaunch_logs = work / "logs", work / "logs_relaunch"
    env = {**os.environ, "TORCHFT_LIGHTHOUSE": f"http://localhost:{free_port()}",
           "FT_LOG_DIR": str(logs)}
    cmd = [str(REPO / "scripts" / "ft_local.sh"), "2", *train_args(a, work)]
    g0, g1 = Follower(logs / "replica_0.log"), Follower(logs / "replica_1.log")
    g1b = Follower(relaunch_logs / "replica_1.log")
    for f in (g0, g1, g1b):
        f.start()
    procs = [subprocess.Popen(cmd, cwd=REPO, env=env, start_new_session=True,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
    try:
        g1.wait(lambda: last_step(g1) >= a.kill_at, a.timeout, f"group 1 at step {a.kill_at}")
        os.killpg(int((logs / "replica_1.pid").read_text()), signal.SIGKILL)
        # (group 1 printed step --kill-at, so both groups committed it)
        killed, at = time.monotonic(), max(last_step(g0), last_step(g1))
        procs.append(subprocess.Popen(cmd, cwd=REPO, env={**env, "FT_REPLICAS": "1",
                                                          "FT_LOG_DIR": str(relaunch_logs)},
                                      start_new_session=True, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL))
        relaunched = time.monotonic()
        next_step = g0.wait(lambda: next(((t, s) for t, s, _ in g0.steps() if s > at), None),
                            a.timeout, "the survivor's next step")
        healed = g1b.wait(lambda: g1b.first(r"healed from a live peer"), a.timeout,
                          "the relaunched group's heal")
        first = g1b.wait(lambda: next(iter(g1b.steps()), None), a.timeout,
                         "the relaunched group's first committed step")
        for p in procs:
            p.wait(timeout=a.timeout)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        time.sleep(0.3)
        for f in (g0, g1, g1b):
            f.stop = True
    steps0 = [s for _, s, _ in g0.steps()]
    if steps0 != list(range(1, a.steps + 1)):
        raise SystemExit(f"bench_fault_tolerance: the survivor's steps were {steps0}")
    reruns = len([1 for _, line in g0.lines if "not committed" in line])
    healed_step = int(re.search(r"continues at step (\d+)", healed[1])[1])
    return {"killed_at_step": a.kill_at, "survivor_steps_lost": 0, "survivor_step_attempts_rerun": reruns,
            "kill_to_next_step_s": round(next_step[0] - killed, 1),
            "relaunch_to_healed_s": round(healed[0] - relaunched, 1), "healed_at_step": healed_step,
            "relaunch_to_first_committed_step_s": round(first[0] - relaunched, 1),
            "median_step_ms": statistics.median(ms for _, _, ms in g0.steps()),
            "codes": [(logs / "replica_0.code").read_text().strip(),
                      (relaunch_logs / "replica_1.code").read_text().strip()]}


def without_ft(a, work: Path) -> dict:
    work.mkdir(parents=True, exist_ok=True)
    cmd = [str(REPO / "run_train.sh"), *train_args(a, work)]
    first, second = Follower(work / "first.log"), Follower(work / "second.log")
    first.start()
    second.start()
    with open(work / "first.log", "w") as out:
        p = subprocess.Popen(cmd, cwd=REPO, start_new_session=True, stdout=out,
                             stderr=subprocess.STDOUT)
        try:
            first.wait(lambda: last_step(first) >= a.kill_at, a.timeout, f"step {a.kill_at}")
            os.killpg(p.pid, signal.SIGKILL)
            killed, at = time.monotonic(), last_step(first)
        finally:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    with open(work / "second.log", "w") as out:
        q = subprocess.Popen(cmd, cwd=REPO, start_new_session=True, stdout=out,
                             stderr=subprocess.STDOUT)
        relaunched = time.monotonic()
        try:
            first_step = second.wait(lambda: next(iter(second.steps()), None), a.timeout,
                                     "the restart's first step")
            past = second.wait(lambda: next(((t, s) for t, s, _ in second.steps() if s > at),
                                            None), a.timeout, "a step past the killed one")
            q.wait(timeout=a.timeout)
        finally:
            if q.poll() is None:
                os.killpg(q.pid, signal.SIGKILL)
            first.stop = second.stop = True
    resumed = second.first(r"resumed from .* \(step (\d+)\)")
    resumed_step = int(re.search(r"\(step (\d+)\)", resumed[1])[1]) if resumed else 0
    return {"killed_at_step": at, "resumed_from_step": resumed_step,
            "steps_lost": at - resumed_step, "kill_to_past_kill_step_s": round(past[0] - killed, 1),
            "relaunch_to_first_step_s": round(first_step[0] - relaunched, 1),
            "median_step_ms": statistics.median(ms for _, _, ms in first.steps()),
            "code": q.returncode}


def _run_to_end(cmds: list[tuple[list[str], dict, Path]], timeout: float) -> list[int]:
    """Run the commands side by side to their end, each's output into its log; their codes."""
    procs = []
    try:
        for cmd, env, log in cmds:
            log.parent.mkdir(parents=True, exist_ok=True)
            with open(log, "w") as out:
                procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, start_new_session=True,
                                              stdout=out, stderr=subprocess.STDOUT))
        return [p.wait(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)


def _median_step_ms(logs: list[Path], steps: int) -> float:
    """The median step time over the logs' steps past the first 2 (start-up, first gathers)."""
    ms = []
    for log in logs:
        found = {int(m[1]): int(m[3]) for m in STEP.finditer(log.read_text(errors="replace"))}
        if sorted(found) != list(range(1, steps + 1)):
            raise SystemExit(f"bench_fault_tolerance: {log} printed steps {sorted(found)}")
        ms += [v for k, v in found.items() if k > min(2, steps - 1)]
    return statistics.median(ms)


def step_cost(a, work: Path) -> dict:
    """Median step ms: 2 groups through ft_local.sh (overlapped, after backward) and the same
    two launches without torchft, one after the other, on this machine (module doc)."""
    args = [*train_args(a, work, a.cost_steps), "--checkpoint.enable=false"]
    env = {**os.environ, "NGPU": str(a.ranks)}
    plain = [([str(REPO / "run_train.sh"), *args, f"--job.dump_folder={work / f'plain{i}'}"],
              env, work / f"plain{i}.log") for i in (0, 1)]
    codes = _run_to_end(plain, a.timeout)
    out = {"ranks_per_group": a.ranks, "steps": a.cost_steps,
           "without_torchft_ms": _median_step_ms([log for *_, log in plain], a.cost_steps)}
    for name, overlap in (("overlapped_ms", "true"), ("after_backward_ms", "false")):
        logs = work / name
        cmd = [str(REPO / "scripts" / "ft_local.sh"), "2", *args,
               f"--job.dump_folder={work / name}", f"--fault_tolerance.overlap={overlap}"]
        codes += _run_to_end([(cmd, {**env, "FT_LOG_DIR": str(logs), "TORCHFT_LIGHTHOUSE":
                                     f"http://localhost:{free_port()}"}, work / f"{name}.log")],
                             a.timeout)
        out[name] = _median_step_ms([logs / "replica_0.log", logs / "replica_1.log"],
                                    a.cost_steps)
    if any(codes):
        raise SystemExit(f"bench_fault_tolerance: a cost run failed (exit codes {codes}; {work})")
    base = out["without_torchft_ms"]
    for name in ("overlapped_ms", "after_backward_ms"):
        out[name.replace("_ms", "_cost_ms")] = round(out[name] - base, 1)
    return out


def cost_table(c: dict) -> str:
    r = c["ranks_per_group"]
    return "\n".join([
        f"| per step ({c['steps']} steps, 2 groups x {r} ranks) | median step | fault "
        "tolerance's cost |",
        "|---|---|---|",
        f"| without torchft (2 launches side by side) | {c['without_torchft_ms']} ms | - |",
        f"| torchft, mean inside the group's reduction (overlap) | {c['overlapped_ms']} ms | "
        f"{c['overlapped_cost_ms']:+} ms |",
        f"| torchft, mean after backward (overlap=false) | {c['after_backward_ms']} ms | "
        f"{c['after_backward_cost_ms']:+} ms |",
    ])


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def table(ft: dict, plain: dict) -> str:
    return "\n".join([
        "| | with torchft (2 groups, one killed) | without (1 launch, killed, resumed) |",
        "|---|---|---|",
        f"| killed at step | {ft['killed_at_step']} (group 1) | {plain['killed_at_step']} |",
        f"| steps lost | {ft['survivor_steps_lost']} (survivor; {ft['survivor_step_attempts_rerun']}"
        f" attempt(s) re-run on new batches) | {plain['steps_lost']} (resumed from step "
        f"{plain['resumed_from_step']}) |",
        f"| seconds from the kill to new progress | {ft['kill_to_next_step_s']} (survivor's next "
        f"step) | {plain['kill_to_past_kill_step_s']} (relaunch, load, redo) |",
        f"| seconds from relaunch to rejoined | {ft['relaunch_to_healed_s']} (healed at step "
        f"{ft['healed_at_step']}) | - |",
        f"| heal time: seconds from relaunch to its first committed step | "
        f"{ft['relaunch_to_first_committed_step_s']} | {plain['relaunch_to_first_step_s']} "
        f"(restart from the step {plain['resumed_from_step']} checkpoint) |",
        f"| median step time | {ft['median_step_ms']} ms | {plain['median_step_ms']} ms |",
    ])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--kill-at", type=int, default=8)
    ap.add_argument("--checkpoint-interval", type=int, default=5)
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--work_dir", type=Path)
    ap.add_argument("--cost-steps", type=int, default=12,
                    help="steps of each per-step cost run (0: no cost runs)")
    ap.add_argument("--ranks", type=int, default=2, help="CPU ranks per group in the cost runs")
    ap.add_argument("--cost-only", action="store_true", help="only the per-step cost runs")
    a, a.overrides = ap.parse_known_args(argv)
    work = a.work_dir or Path(tempfile.mkdtemp(prefix="bench-ft-"))
    machine = f"{cpu_name()}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}"
    result = {"machine": machine,
              "args": {"steps": a.steps, "kill_at": a.kill_at, "cost_steps": a.cost_steps,
                       "ranks": a.ranks, "checkpoint_interval": a.checkpoint_interval,
                       "heal_ngpu": os.environ.get("NGPU", "1"),
                       "overrides": a.overrides}}
    try:
        if not a.cost_only:
            result["with_torchft"] = with_ft(a, work / "ft")
            result["without_torchft"] = without_ft(a, work / "plain")
        if a.cost_steps or a.cost_only:
            result["step_cost"] = step_cost(a, work / "cost")
    finally:
        if a.work_dir is None:
            shutil.rmtree(work, ignore_errors=True)
    print(f"machine: {machine}")
    if "with_torchft" in result:
        print(table(result["with_torchft"], result["without_torchft"]))
    if "step_cost" in result:
        print(cost_table(result["step_cost"]))
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
