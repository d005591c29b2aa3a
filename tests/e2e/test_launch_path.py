"""One launch path on CPU as on GPU: `./run_train.sh` with one process trains in the launcher's
own process (no torchrun agent); with several, torchrun starts each worker the standard way
(`python -u -m torchllm.train ARGS`), and a rank killed from outside is named on the console
with its signal, from torchrun's record of it. The same for the parallel benchmark's launches.

tests/worker_probe is an optimizer (AdamW) that records, in the process that builds it, how that
process started (its command line, sys.argv, pid)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, wait_for
from messages import launcher_lines

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

TINY = ["--training.device=cpu", "--training.seq_len=32", "--training.local_batch_size=2",
        "--data.tokenizer_vocab_size=512", "--metrics.log_freq=1", "--metrics.report=false",
        "--metrics.progress_bar=false", "--lr_scheduler.warmup_steps=1",
        "--job.custom_import=worker_probe", "--optimizer.name=probe_adamw"]


def env(tmp_path, ngpu: int, **extra: str) -> dict:
    return {**os.environ, "NGPU": str(ngpu), "LOG_RANK": "0",
            "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")]),
            "TORCHLLM_TEST_WORKER_PROBE": str(tmp_path / "probe"), **extra}


@contextlib.contextmanager
def running(cmd: list[str], **popen):
    """`cmd` started from the repository root; killed on the way out if it is still running
    (a failed assertion must not leave a launch behind)."""
    proc = subprocess.Popen(cmd, cwd=REPO, text=True, **popen)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def training(tmp_path, args: list[str], env_: dict):
    """./run_train.sh ARGS, its console in tmp_path/out.txt, running until its step 2."""
    with open(tmp_path / "out.txt", "w") as log, running(
            ["./run_train.sh", *args], env=env_, stdout=log, stderr=subprocess.STDOUT) as proc:
        wait_for(lambda: "step     2/" in (tmp_path / "out.txt").read_text(), 300,
                 what="step 2")
        yield proc


def test_one_process_trains_in_the_launchers_process_and_sigterm_saves_and_exits_0(tmp_path):
    args = [f"--job.dump_folder={tmp_path}", "--job.run_name=r", "--training.steps=100000",
            "--checkpoint.enable", "--checkpoint.interval=100000", *TINY]
    with training(tmp_path, args, env(tmp_path, 1)) as proc:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=300)
    out = (tmp_path / "out.txt").read_text()
    assert code == 0, out[-3000:]
    probe = json.loads((tmp_path / "probe.0.json").read_text())
    # run_train.sh execs the launcher: the trainer is that process, not a child of it.
    assert probe["pid"] == proc.pid, probe
    assert "torchllm.run" in probe["argv"], probe  # the launcher's command line ...
    # ... and the trainer's own sys.argv, as `python -m torchllm.train ARGS` sets it.
    assert probe["sys_argv"][0].endswith(os.path.join("torchllm", "train.py")), probe
    assert probe["sys_argv"][-len(TINY):] == TINY and "--" not in probe["sys_argv"], probe
    # The stop: the step finished, saved, exit 0, said by the launcher naming the signal.
    assert launcher_lines(out, "SIGTERM"), out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    (step_dir,) = (tmp_path / "r" / "checkpoint").iterdir()
    assert (step_dir / "COMPLETE").is_file()


def rank_pid(marker: str, rank: int) -> int | None:
    """The pid of torchrun's worker with RANK=`rank` whose command line holds `marker`."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if (any(marker.encode() in a for a in cmdline) and f"RANK={rank}".encode() in environ
                and any(e.startswith(b"TORCHELASTIC_RUN_ID=") for e in environ)):
            return int(pid)
    return None


def test_two_ranks_are_torchrun_workers_and_a_killed_rank_1_is_named_with_its_signal(tmp_path):
    args = [f"--job.dump_folder={tmp_path}", "--training.steps=100000", *TINY]
    tmp = tmp_path / "tmp"  # the launch's TMPDIR: torchrun's tee folder goes, even on a failure
    tmp.mkdir()
    with training(tmp_path, args, env(tmp_path, 2, TMPDIR=str(tmp))) as proc:
        probes = [json.loads((tmp_path / f"probe.{r}.json").read_text()) for r in (0, 1)]
        for probe in probes:  # torchrun's `python -u -m torchllm.train ARGS`, its agent here
            assert probe["argv"][1:4] == ["-u", "-m", "torchllm.train"], probe
            assert probe["sys_argv"][-len(TINY):] == TINY and "--" not in probe["sys_argv"]
            assert probe["ppid"] == proc.pid, probe
        rank1 = rank_pid(str(tmp_path), 1)
        assert rank1 == probes[1]["pid"], (rank1, probes)
        os.kill(rank1, signal.SIGKILL)
        code = proc.wait(timeout=300)
    out = (tmp_path / "out.txt").read_text()
    assert code == 1, out[-3000:]
    assert launcher_lines(out, "rank 1", "SIGKILL"), out[-3000:]
    assert "Traceback" not in out and "ChildFailedError" not in out, out[-3000:]
    assert not [p.name for p in tmp.iterdir() if p.name.startswith("torchelastic_")]


def test_the_benchmark_names_a_killed_rank_1_with_its_signal(tmp_path):
    work = tmp_path / "work"
    with running(
        [sys.executable, "benchmarks/bench_parallel.py", "--config",
         "train_configs/debug_model.toml", "--matrix", "ddp", "--nproc", "2", "--repeats", "1",
         "--steps", "100000",
         "--warmup", "2", "--json", str(tmp_path / "res.json"), "--work_dir", str(work),
         "--training.seq_len=32", "--training.local_batch_size=2",
         "--data.tokenizer_vocab_size=512", "--training.device=cpu"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    ) as proc:
        rank1 = wait_for(lambda: rank_pid(str(work), 1), 300, what="the benchmark's rank 1")
        cmdline = Path(f"/proc/{rank1}/cmdline").read_bytes().split(b"\0")
        assert cmdline[1:4] == [b"-u", b"-m", b"benchlib.worker"], cmdline  # torchrun's start
        os.kill(rank1, signal.SIGKILL)
        out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 1, out[-3000:]
    (row,) = json.loads((tmp_path / "res.json").read_text())["rows"]
    assert row["status"] == "failed" and "rank 1" in row["reason"], row
    assert "SIGKILL" in row["reason"] and "rank 0" not in row["reason"], row
    # the console's table: the same reason
    assert any(row["reason"] in line for line in out.splitlines()), out[-3000:]


@pytest.fixture(scope="module")
def typed(tmp_path_factory):
    """`./run_train.sh` as README shows it (the default config, 5 steps, saving), the script
    itself as a process, its console not on a terminal and its TMPDIR a folder of its own:
    (the run's folder, the Ran)."""
    from cli import run_train

    folder = tmp_path_factory.mktemp("typed")
    (folder / "tmp").mkdir()  # torchrun's temporary files go here, and must not stay
    ran = run_train("--training.steps=5", f"--job.dump_folder={folder}", "--metrics.log_freq=1",
                    "--checkpoint.enable", env={"TMPDIR": folder / "tmp"}, process=True,
                    timeout=300)
    return folder, ran


def losses(out: str) -> list[float]:
    return [float(x) for x in re.findall(r" step +\d+/\d+ \| loss ([0-9.]+)", out)]


def test_run_train_sh_end_to_end(typed):
    folder, proc = typed
    out = proc.out
    assert proc.returncode == 0, out
    # `./run_train.sh > out.txt` keeps the step lines: they are on stdout.
    assert "step     5/5" in proc.stdout and "done: step 5/5, 5 steps" in proc.stdout
    assert "| loss " not in proc.stderr and "\x1b[K" not in out  # not a terminal: no bar
    assert (folder / "debug_model" / "config.toml").is_file()
    log = (folder / "debug_model" / "train.log").read_text()
    assert log.startswith("==== launch ") and "step     5/5" in log
    assert "![loss](loss.png)" in (folder / "debug_model" / "report" / "report.md").read_text()
    assert list((folder / "tmp").iterdir()) == []  # no torchelastic_* tee folder left
    found = losses(proc.stdout)
    assert len(found) == 5 and found[-1] < found[0]


def test_the_tests_in_process_launch_is_what_run_train_sh_runs(typed, tmp_path):
    """tests/cli.py's run_train (what most tests call) against ./run_train.sh itself: the same
    losses, files and exit codes, for a run and for a config error."""
    from cli import run_train

    folder, typed = typed
    called = run_train("--training.steps=5", f"--job.dump_folder={tmp_path}",
                       "--metrics.log_freq=1", "--checkpoint.enable")
    assert typed.returncode == called.returncode == 0, (typed.out[-2000:], called.out[-2000:])
    assert losses(typed.stdout) == losses(called.stdout) and len(losses(typed.stdout)) == 5
    steps = sorted(p.name for p in (folder / "debug_model/checkpoint").iterdir())
    assert steps == sorted(p.name for p in (tmp_path / "debug_model/checkpoint").iterdir())
    assert steps
    bad = ["--training.steps=four"]
    typed, called = (run_train(f"--job.dump_folder={tmp_path / 'bad'}", *bad, process=p)
                     for p in (1, 0))
    assert typed.returncode == called.returncode == 2
    assert "training.steps" in typed.stderr and "training.steps" in called.stderr
