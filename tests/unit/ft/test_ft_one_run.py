"""Replica groups of one run only (torchllm/ft/identity.py, docs/fault_tolerance.md).

Two groups that differ in their run or in the config that shapes training refuse each other at
their first quorum, on both sides, in one line naming each difference (exit 2), before a heal or
a gradient crosses; scripts/ft_local.sh does not reuse a lighthouse it started for another run;
each run has a lighthouse port of its own by default. Slow: real ./run_train.sh groups.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

from conftest import REPO, shared_path, tiny_args, wait_for
from messages import assert_names
from builders.ft import free_port
from torchllm.config import ConfigError, load_config

pytest.importorskip("torchft")

ARGS = ("--data.tokenizer=bytes", "--validation.enable=false", "--eval.sample_freq=0",
        "--checkpoint.enable=false", "--training.steps=3")


def gpt2() -> str:
    """Another tokenizer than ARGS' bytes (skips without the shared test data)."""
    return f"--data.tokenizer={shared_path('tokenizers', 'gpt2', 'gpt2.tiktoken')}"


def lighthouse(port: int) -> subprocess.Popen:
    proc = subprocess.Popen(["torchft_lighthouse", "--min_replicas", "1", "--bind",
                             f"127.0.0.1:{port}", "--heartbeat_timeout_ms", "5000",
                             "--join_timeout_ms", "60000"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for(lambda: _answers(port), 30, what="the lighthouse")
    return proc


def _answers(port: int) -> bool:
    import socket

    try:
        socket.create_connection(("127.0.0.1", port), 1).close()
        return True
    except OSError:
        return False


def two_groups(tmp_path, group0: tuple, group1: tuple) -> list[tuple[int, str]]:
    """Groups 0 and 1 (of group_size 2, both needed to train) launched by ./run_train.sh at one
    lighthouse, with their own overrides: [(exit code, console)] of each."""
    port = free_port()
    env = {**os.environ, "TORCHFT_LIGHTHOUSE": f"http://localhost:{port}", "NGPU": "1",
           "TORCHLLM_FT_SECRET": "the-shared-secret-of-this-test-run"}
    house = lighthouse(port)
    procs = []
    try:
        for r, extra in enumerate((group0, group1)):
            args = tiny_args(tmp_path, *ARGS, "--fault_tolerance.enable",
                             "--fault_tolerance.group_size=2",
                             "--fault_tolerance.min_replica_size=2",
                             f"--fault_tolerance.replica_id={r}", *extra)
            procs.append(subprocess.Popen([str(REPO / "run_train.sh"), *args], cwd=REPO, env=env,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
        return [(p.wait(timeout=400), p.stdout.read().decode(errors="replace")) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        house.kill()
        house.wait()


def refusal_line(out: str) -> str:
    """The one console line of a group's refusal (no traceback, no step trained)."""
    lines = [line for line in out.splitlines() if "(the peer's -> this group's)" in line]
    assert len(lines) == 1 and "Traceback" not in out and "step 1/" not in out, out[-4000:]
    return lines[0]


@pytest.mark.slow
def test_two_runs_on_one_lighthouse_refuse_each_other_naming_the_runs(tmp_path):
    ran = two_groups(tmp_path, ("--job.run_name=alpha",), ("--job.run_name=beta",))
    for code, out in ran:  # both sides: exit 2, one line naming both runs and the key
        assert code == 2, out[-4000:]
        assert_names(refusal_line(out), "job.run_name", "'alpha'", "'beta'")


@pytest.mark.slow
def test_a_group_of_another_seed_tokenizer_and_width_is_refused_on_both_sides(tmp_path):
    # Same run name; group 1 differs in seed, tokenizer and model width (issues 9 and 13: they
    # trained apart, or died of a gloo abort / a timeout naming nothing).
    ran = two_groups(tmp_path, (), ("--job.seed=7", gpt2(), "--model.dim=128"))
    for code, out in ran:
        assert code == 2, out[-4000:]
        line = refusal_line(out)
        assert_names(line, "job.seed", "data.tokenizer", "model.dim", "128", "256")
        assert "EnforceNotMet" not in out and "SIGABRT" not in out


def _ft_local(tmp_path, name: str, env: dict, *extra: str) -> subprocess.Popen:
    args = tiny_args(tmp_path, *ARGS, f"--job.run_name={name}", *extra)
    return subprocess.Popen([str(REPO / "scripts" / "ft_local.sh"), "2", *args], cwd=REPO,
                            env={**env, "FT_LOG_DIR": str(tmp_path / f"logs_{name}")},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)


@pytest.mark.slow
def test_ft_local_does_not_reuse_the_lighthouse_of_another_run(tmp_path):
    port = free_port()
    env = {**os.environ, "TORCHFT_LIGHTHOUSE": f"http://localhost:{port}",
           "FT_LIGHTHOUSE_RECORDS": str(tmp_path / "records"), "FT_REPLICAS": "0"}
    # Run alpha's group 0 waits for group 1 (min_replica_size 2) at alpha's lighthouse.
    alpha = _ft_local(tmp_path, "alpha", env, "--fault_tolerance.min_replica_size=2")
    try:
        wait_for(lambda: _answers(port), 120, what="alpha's lighthouse")
        beta = _ft_local(tmp_path, "beta", env)
        out = beta.communicate(timeout=120)[0].decode(errors="replace")
        assert beta.returncode == 2, out
        assert_names(out, "alpha", "beta", env["TORCHFT_LIGHTHOUSE"])
        assert not (tmp_path / "logs_beta" / "replica_0.log").exists()  # no group started
    finally:
        pid = tmp_path / "logs_alpha" / "replica_0.pid"
        for group in ([int(pid.read_text())] if pid.exists() else []) + [alpha.pid]:
            try:
                os.killpg(group, signal.SIGKILL)
            except ProcessLookupError:
                pass
        alpha.wait()


# -- in-process ------------------------------------------------------------------------------

def test_each_run_has_a_lighthouse_of_its_own_by_default(tmp_path):
    from cli import run_module
    from torchllm.ft import check_fault_tolerance

    addresses = {}
    for name in ("alpha", "beta"):
        ran = run_module("torchllm.ft", *tiny_args(tmp_path, f"--job.run_name={name}"))
        assert ran.returncode == 0, ran.stderr
        addresses[name] = ran.stdout.strip().splitlines()[-2]
    assert addresses["alpha"] != addresses["beta"]
    # The trainer's pre-flight check looks there (nothing listens: refused naming it).
    cfg = load_config(tiny_args(tmp_path, "--fault_tolerance.enable", "--job.run_name=beta"))
    if _answers(int(addresses["beta"].rsplit(":", 1)[1])):
        pytest.skip("something listens on beta's port")
    with pytest.raises(ConfigError) as e:
        check_fault_tolerance(cfg.fault_tolerance, cfg.job, cfg.training.device, {})
    assert addresses["beta"] in str(e.value)


def _trainer(tmp_path: Path, *extra: str):
    from torchllm.train import Trainer

    return Trainer(load_config(tiny_args(tmp_path, *ARGS, *extra)))


def test_identity_records_name_each_difference_and_travel_as_plain_bytes(tmp_path):
    from torchllm.ft.identity import decode, encode, group_record, refusal

    a = _trainer(tmp_path / "a")
    b = _trainer(tmp_path / "b", "--job.seed=7", gpt2(), "--model.dim=128")
    try:
        here, there = group_record(a.context, "alpha"), group_record(b.context, "beta")
        same = group_record(_close(_trainer(tmp_path / "c")).context, "alpha")
    finally:
        a.close()
        b.close()
    assert decode(encode(here)) == here and refusal(decode(encode(same)), here, "L") is None
    why = refusal(decode(encode(there)), here, "http://lh:1")
    assert "\n" not in why
    assert_names(why, "job.run_name", "job.seed", "data.tokenizer", "model.dim", "http://lh:1")
    garbage = encode({"not": "a record"})
    assert_names(refusal(decode(garbage), here, "L"), "unreadable")


def _close(trainer):
    trainer.close()
    return trainer


def test_a_heal_into_another_width_is_refused_naming_the_weight(tmp_path):
    from torchllm.ft import HealState

    def heal_of(t):
        return HealState(t.state, lambda: None)  # the trainer's one training state

    live, other = _trainer(tmp_path / "a"), _trainer(tmp_path / "b", "--model.dim=128")
    try:
        with pytest.raises(ConfigError) as e:
            heal_of(other).load_state_dict(heal_of(live).state_dict())
    finally:
        live.close()
        other.close()
    assert_names(str(e.value), "256", "128", "model")
    assert "\n" not in str(e.value)


def test_every_group_of_a_run_names_the_run_not_its_folder(tmp_path):
    from torchllm.ft import replica_job
    from torchllm.ft.rundir import group_run

    for name in ("alpha", "beta-replica1"):  # (a run may end in what a folder adds)
        for r in (0, 1):
            cfg = load_config(tiny_args(
                tmp_path, "--fault_tolerance.enable", "--fault_tolerance.group_size=2",
                f"--fault_tolerance.replica_id={r}", f"--job.run_name={name}"))
            job = replica_job(cfg.job, cfg.fault_tolerance)
            assert job.run_name == f"{name}-replica{r}"
            assert group_run(job, cfg.fault_tolerance) == name
