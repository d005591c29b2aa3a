"""A CPU launch forks its workers from the launcher (torch and torchllm imported once, not once
more per worker); the forked worker trains exactly as a `python -m torchllm.train` worker does.

tests/worker_probe is an optimizer (AdamW) that records, in the worker that builds it, how that
worker started. TORCHLLM_FORK_WORKERS=0 is torchrun's own worker start, the oracle."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO

TINY = ["--training.steps=3", "--training.seq_len=32", "--training.local_batch_size=2",
        "--data.tokenizer_vocab_size=512", "--metrics.log_freq=1", "--metrics.report=false",
        "--lr_scheduler.warmup_steps=1", "--job.custom_import=worker_probe",
        "--optimizer.name=probe_adamw"]


def launch(tmp_path, name: str, **env) -> tuple[dict, list[str]]:
    """run_train.sh on one CPU process; (the worker's probe, its step lines)."""
    probe = tmp_path / name
    full = {**os.environ, "NGPU": "1", "PYTHONPATH": os.pathsep.join([str(REPO),
            str(REPO / "tests")]), "TORCHLLM_TEST_WORKER_PROBE": str(probe), **env}
    full.pop("OMP_NUM_THREADS", None)  # a user's shell: the worker picks its thread count
    proc = subprocess.run(["./run_train.sh", f"--job.dump_folder={tmp_path}",
                           f"--job.run_name={name}", *TINY], cwd=REPO, env=full,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    steps = [line[line.index("step "):line.index("| tok/s")] for line in proc.stdout.splitlines()
             if "| loss " in line]  # step, loss, lr, grad norm
    return json.loads((tmp_path / f"{name}.0.json").read_text()), steps


@pytest.mark.slow
def test_a_cpu_launch_forks_its_worker_which_trains_as_a_fresh_process_would(tmp_path):
    forked, forked_steps = launch(tmp_path, "forked")
    spawned, spawned_steps = launch(tmp_path, "spawned", TORCHLLM_FORK_WORKERS="0")
    # The forked worker is a copy of the launcher (its command line); the other is torchrun's
    # `python -u -m torchllm.train`.
    assert "torchllm.run" in forked["argv"] and "torchllm.train" not in forked["argv"], forked
    assert spawned["argv"][-len(TINY):] == TINY and "torchllm.train" in spawned["argv"]
    # The launcher ran single-threaded until the fork; the worker has a fresh process's threads.
    assert forked["threads"] == spawned["threads"] == len(os.sched_getaffinity(0)), (
        forked, spawned)
    assert forked_steps == spawned_steps and len(forked_steps) == 3, (forked_steps, spawned_steps)


PROBE_MODULE = '''
import json, os, sys
import torch

def main(argv):
    out, fail_rank = argv
    rank = int(os.environ["RANK"])
    with open(f"{out}.{rank}.json", "w") as f:
        json.dump({"argv": open("/proc/self/cmdline").read().split("\\0"),
                   "ppid": os.getppid(), "threads": torch.get_num_threads()}, f)
    return 3 if rank == int(fail_rank) else 0
'''


@pytest.mark.slow
def test_the_forked_launcher_runs_a_modules_main_in_forked_workers(tmp_path):
    """`python -m torchllm.run.forked` (bench_parallel.py's CPU launches): torchrun whose
    workers are copies of the launcher running MODULE's main(args), its exit code theirs."""
    (tmp_path / "probe_main.py").write_text(PROBE_MODULE)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(tmp_path)]),
           "OMP_NUM_THREADS": "1"}

    def launch(*argv):
        return subprocess.run([sys.executable, "-m", "torchllm.run.forked", "--standalone",
                               "--nproc_per_node=2", *argv], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=300)

    ok = launch("-m", "probe_main", str(tmp_path / "ok"), "-1")
    assert ok.returncode == 0, ok.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"ok.{r}.json").read_text()) for r in (0, 1)]
    for probe in ranks:  # a copy of the launcher, not torchrun's `python -u -m probe_main`
        assert "torchllm.run.forked" in probe["argv"] and "-u" not in probe["argv"], probe
        assert probe["threads"] == 1  # OMP_NUM_THREADS, as a fresh worker would have
    assert ranks[0]["ppid"] == ranks[1]["ppid"]
    failed = launch("-m", "probe_main", str(tmp_path / "failed"), "1")
    assert failed.returncode == 1 and "exitcode  : 3" in failed.stderr, failed.stderr[-3000:]
    script = launch(str(tmp_path / "probe_main.py"))
    assert script.returncode == 1 and script.stderr.strip().splitlines() == [
        "python -m torchllm.run.forked: name the workers' module with -m MODULE (its main(args) "
        "runs in each forked worker); for a script use torchrun"], script.stderr
