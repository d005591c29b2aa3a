"""One run per folder (the lock), runs that don't mix (fresh start vs resume, TensorBoard curves),
how a worker's failure is summarized, and enum-like options checked when the config loads."""

import dataclasses
import json
import logging
import os
import socket
import subprocess
import sys
import time
import typing

import pytest

from torchllm.config import ConfigError, JobConfig, load_config
from torchllm.config.loader import field_types
from torchllm.run.failures import failure_report, summary
from torchllm.run.runlock import LOCK_NAME, RunLock, RunLockedError

from cli import run_module, run_train
from conftest import REPO, tiny_args, tiny_config


@pytest.fixture
def log_text(caplog):
    caplog.set_level(logging.INFO, logger="torchllm")
    return lambda: caplog.text


HOLD = """
import sys, time
from torchllm.run.runlock import RunLock
RunLock(sys.argv[1], stale_s=600).acquire()
print("locked", flush=True)
time.sleep(120)
"""


def test_lock_refuses_a_live_holder_and_takes_over_a_dead_ones(tmp_path, log_text):
    # a process: the lock's subject is another live (then killed) process holding it
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], cwd=REPO,
                              stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert holder.stdout.readline().strip() == "locked"
        info = json.loads((tmp_path / LOCK_NAME).read_text())
        assert (info["host"], info["pid"]) == (socket.gethostname(), holder.pid)
        with pytest.raises(RunLockedError, match=f"in use by another run .*pid {holder.pid}"):
            RunLock(tmp_path, stale_s=600).acquire()
    finally:
        holder.kill()
        holder.wait()
    lock = RunLock(tmp_path, stale_s=600)
    lock.acquire()  # the holder is gone: taken over
    assert f"taking over the stale lock {tmp_path / LOCK_NAME}" in log_text()
    assert f"process {holder.pid} on this host is gone" in log_text()
    assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
    lock.acquire()  # the same process again (e.g. a second Trainer): still ours
    lock.release()
    assert not (tmp_path / LOCK_NAME).exists()


def test_lock_of_another_host_is_stale_only_without_heartbeat(tmp_path):
    path = tmp_path / LOCK_NAME
    path.write_text(json.dumps({"host": "elsewhere", "pid": 1, "started": "then"}))
    with pytest.raises(RunLockedError, match="host elsewhere, pid 1"):
        RunLock(tmp_path, stale_s=600).acquire()
    old = time.time() - 601
    os.utime(path, (old, old))  # no heartbeat for longer than lock_stale_minutes
    lock = RunLock(tmp_path, stale_s=600, heartbeat_s=0.05)
    lock.acquire()
    os.utime(path, (old, old))
    time.sleep(0.5)  # the heartbeat thread renews the modification time
    assert time.time() - path.stat().st_mtime < 5
    lock.release()


def test_a_reused_pid_is_not_the_holder(tmp_path):
    # The parent process is alive, but started at another time than the lock says: stale.
    (tmp_path / LOCK_NAME).write_text(json.dumps(
        {"host": socket.gethostname(), "pid": os.getppid(), "pid_start": "1"}))
    lock = RunLock(tmp_path, stale_s=600)
    lock.acquire()
    lock.release()


def test_trainer_takes_the_run_folder_lock(tmp_path):
    from torchllm.train import Trainer

    run_dir = tmp_path / "r"
    run_dir.mkdir()
    (run_dir / LOCK_NAME).write_text(json.dumps({"host": "elsewhere", "pid": 7}))
    with pytest.raises(RunLockedError, match="job.run_name / job.dump_folder"):
        Trainer(tiny_config(tmp_path, "--job.run_name=r"))


def test_a_trainer_that_fails_to_build_gives_back_what_it_took(tmp_path):
    """Building fails after the seed (deterministic) and the run lock: both are given back, so
    the next Trainer in this process (a notebook, a test) neither inherits deterministic
    kernels nor finds the run folder locked by itself."""
    import torch

    from torchllm.train import Trainer

    (tmp_path / "bad.txt").write_bytes(b"caf\xe9 " * 100)  # latin-1, not UTF-8: build_data fails
    assert not torch.are_deterministic_algorithms_enabled()
    # A bytes tokenizer: no 'auto' one is trained on the file (failing there, before the
    # Trainer takes the lock and sets the seed).
    with pytest.raises(Exception, match="bad.txt"):
        Trainer(tiny_config(tmp_path, "--job.run_name=r", "--job.deterministic",
                            "--data.tokenizer=bytes",
                            f"--data.dataset=local:{tmp_path / 'bad.txt'}"))
    assert not torch.are_deterministic_algorithms_enabled()
    assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ
    assert not (tmp_path / "r" / LOCK_NAME).exists()
    Trainer(tiny_config(tmp_path, "--job.run_name=r", "--training.steps=1")).close()


def scalars(folder, tag):
    """(step, value) pairs of `tag` as TensorBoard shows them (purges applied)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


@pytest.mark.slow
def test_resume_continues_the_curves_and_a_fresh_start_is_refused(tmp_path):
    from torchllm.train import Trainer

    ckpt = ["--checkpoint.enable", "--checkpoint.interval=2", "--checkpoint.keep_latest_k=0",
            "--metrics.log_freq=2", "--job.run_name=r"]
    first = Trainer(tiny_config(tmp_path, *ckpt)).train()  # logs steps 1, 2, 4
    assert not (tmp_path / "r" / LOCK_NAME).exists()  # released when training ends
    # A crash after step 4's log, before its checkpoint: resuming from step 2 re-runs 3 and 4.
    import shutil

    shutil.rmtree(tmp_path / "r" / "checkpoint" / "step-4")
    second = Trainer(tiny_config(tmp_path, *ckpt)).train()
    assert len(second) == 2
    got = scalars(tmp_path / "tb" / "r", "loss/avg")
    assert [s for s, _ in got] == [1, 2, 4]  # step 4 once: the first launch's is purged
    assert [v for _, v in got] == pytest.approx([first[0], first[1], second[1]])

    # A fresh start (no checkpointing) over those outputs: refused, naming what to do.
    with pytest.raises(ConfigError, match="previous run's outputs .*--job.run_name.*"
                                          "--job.overwrite"):
        Trainer(tiny_config(tmp_path, "--job.run_name=r", "--metrics.log_freq=2"))
    fresh = Trainer(tiny_config(tmp_path, "--job.run_name=r", "--metrics.log_freq=2",
                                "--job.overwrite")).train()
    assert not (tmp_path / "r" / "checkpoint").exists()
    got = scalars(tmp_path / "tb" / "r", "loss/avg")  # approx() takes no nested pairs
    assert [s for s, _ in got] == [1, 2, 4]
    assert [v for _, v in got] == pytest.approx([fresh[0], fresh[1], fresh[3]])


def test_failure_report_names_the_root_cause_once():
    statuses = [
        {"rank": 0, "code": 1, "time": 5.0, "echo": True,
         "error": "RuntimeError: Connection closed by peer", "where": "x.py:1 in f"},
        {"rank": 1, "code": 1, "time": 6.0, "echo": False,
         "error": "FileExistsError: [Errno 17] File exists: 'a'", "where": "torchllm/m.py:3 in g"},
        {"rank": 2, "code": 1, "time": 7.0, "echo": False,
         "error": "FileExistsError: [Errno 17] File exists: 'a'", "where": "torchllm/m.py:3 in g"},
    ]
    lines, code = failure_report(statuses, {3: "signal SIGTERM"})
    assert code == 1
    assert lines[0] == "ranks 1, 2 failed: FileExistsError: [Errno 17] File exists: 'a'"
    assert lines[1] == ("  at torchllm/m.py:3 in g (traceback: LOG_RANK=1 shows that rank's "
                        "console)")
    assert lines[2] == "  then ranks 0, 3 stopped because of it"
    # torchrun's error file (@record's traceback) kept (LOG_DIR): the line names it.
    kept, _ = failure_report(statuses, {3: "signal SIGTERM"}, {1: "/logs/1/error.json"})
    assert kept[1] == "  at torchllm/m.py:3 in g (traceback: /logs/1/error.json)"
    config = [{"rank": 0, "code": 2, "time": 1.0, "error": summary(ConfigError("bad x")),
               "where": "torchllm/c.py:1 in f"}]
    assert failure_report(config, {}) == (["rank 0 failed: config error: bad x"], 2)
    lines, code = failure_report([], {0: "signal SIGKILL"})
    assert code == 1 and "rank 0: signal SIGKILL" in lines[0]
    # Only echoes were reported: the rank that died without a word is the root cause.
    lines, code = failure_report(statuses[:1], {1: "signal SIGABRT"})
    assert code == 1
    assert lines[0] == ("rank 1 died without reporting an error (rank 1: signal SIGABRT); "
                        "LOG_RANK=1 shows its console")
    assert lines[1] == ("  then rank 0 stopped because of it "
                        "(RuntimeError: Connection closed by peer)")
    both = [dict(statuses[0], rank=1, error="RuntimeError: Connection reset by peer"),
            statuses[0]]
    lines, code = failure_report(both, {})
    assert code == 1 and len(lines) == 1
    assert lines[0].startswith("ranks 0, 1 lost the connection to each other and none reported")


def enum_fields():
    """(dotted key, allowed values, is a list) of every Literal-typed config field."""
    out = []
    for section, obj in JobConfig().sections():
        for f in dataclasses.fields(obj):
            tp = field_types(type(obj))[f.name]
            is_list = typing.get_origin(tp) is list
            inner = typing.get_args(tp)[0] if is_list else tp
            if typing.get_origin(inner) is typing.Union:
                inner = typing.get_args(inner)[0]
            if typing.get_origin(inner) is typing.Literal:
                out.append((f"{section}.{f.name}", typing.get_args(inner), is_list))
    return out


# Every string option that is NOT a choice among fixed values (paths, names, free text, specs
# checked by their own parsers). A new enum-like option must be a Literal, not be added here.
NEEDS = {"fault_tolerance.semi_sync_method": ("--fault_tolerance.enable",)}
FREE_FORM = {
    "job.config_file", "job.dump_folder", "job.run_name", "job.description", "model.name",
    "model.flavor", "training.seq_len_schedule", "activation_checkpoint.selective_option",
    "float8.filter_fqns", "data.dataset", "data.tokenizer", "data.text_column", "data.hf_subset",
    "data.hf_split", "metrics.tb_folder", "metrics.wandb_project", "profiling.traces_folder",
    "profiling.memory_snapshot_folder", "checkpoint.folder", "checkpoint.initial_load_path",
    "checkpoint.local_mirror", "lora.target_modules",  # the family's layer names: checked at build
    "validation.dataset", "validation.split", "eval.prompts", "eval.hellaswag_data",
    "data.chat_column", "eval.tasks_data_dir",
    "eval.tasks",  # 'name' or 'name:K': parsed and checked by torchllm.eval.downstream
    "parallelism.pipeline_parallel_split_points",  # block names: checked by check_pipeline
    "job.custom_import",  # a module name: imported (and named if it cannot be) when the config loads
    "optimizer.name",  # a registered OptimizerSpec (optim/registry.py, job.custom_import may add
                       # one): checked at launch, test_optimizer_plugin.py
    "fault_tolerance.bind",  # an address: the heal transport binds it (ft/transport.py)
    "fault_tolerance.secret_env", "fault_tolerance.secret_file",  # a variable's name, a path
}


def test_every_enum_like_option_is_checked_when_the_config_loads():
    enums = enum_fields()
    keys = {k for k, _, _ in enums}
    assert {"compile.backend", "compile.components", "checkpoint.exclude_from_loading",
            "training.device", "checkpoint.async_mode"} <= keys
    for key, allowed, _ in enums:
        with pytest.raises(ConfigError, match=f"{key} = 'bogus' must be one of"):
            load_config([f"--{key}=bogus"])
        # every declared value is accepted (with the keys it needs: semi-sync syncs groups)
        load_config([f"--{key}={allowed[-1]}", *NEEDS.get(key, ())])
    strings = set()
    for section, obj in JobConfig().sections():
        for f in dataclasses.fields(obj):
            tp = field_types(type(obj))[f.name]
            if str in (tp, *typing.get_args(tp)):
                strings.add(f"{section}.{f.name}")
    assert strings - keys - FREE_FORM == set(), "an enum-like option declared as plain str"
    with pytest.raises(ConfigError, match="selective_option = 2x: use 'op', 'ffn'"):
        load_config(["--activation_checkpoint.selective_option=2x"])
    assert load_config(["--activation_checkpoint.selective_option=2"])


def test_config_docs_list_the_allowed_values():
    docs = (REPO / "docs" / "config.md").read_text()
    assert "'inductor' \\| 'aot_eager' \\| 'eager' \\| 'cudagraphs'" in docs
    assert "list of 'model' \\| 'loss'" in docs


def test_launcher_config_error_is_one_line_before_torchrun(tmp_path):
    for flag, named in [
        ("--compile.backend=inductr", ("compile.backend", "'inductr'", "'inductor'")),
        ("--parallelism.tensor_parallel_degree=2", ("tp=2", "world size is 1")),
        # a missing local file is named before any rank starts (a fresh clone without ../shared)
        (f"--data.dataset=local:{tmp_path}/gone.txt",
         ("data.dataset", f"local:{tmp_path}/gone.txt")),
    ]:
        r = run_train(*tiny_args(tmp_path), flag)
        assert r.returncode == 2, r.out
        assert r.stdout == ""
        lines = r.stderr.strip().splitlines()
        # the launcher's own line (not a rank's failure): before any rank started
        assert len(lines) == 1 and lines[0].startswith("run_train: config error: "), lines
        assert all(n in lines[0] for n in named), (named, lines[0])


def test_one_ctrl_c_delivered_twice_is_one_stop_request():
    import signal
    import types

    from torchllm.run.stopping import StopConditions

    t = StopConditions(types.SimpleNamespace(), None, 0.0)
    t.on_signal(signal.SIGINT, None)  # from the terminal
    t.on_signal(signal.SIGINT, None)  # the same Ctrl-C, forwarded by torchrun
    assert t.stop_signal == signal.SIGINT
    t.stop_signal_time -= 2  # a second Ctrl-C, later: stop now
    with pytest.raises(KeyboardInterrupt):
        t.on_signal(signal.SIGINT, None)


def test_launcher_counts_the_devices_itself(monkeypatch):
    import torch

    from torchllm.run.launch import resolve_nproc

    monkeypatch.setenv("OMP_NUM_THREADS", "x")  # recorded, so undone even when it was unset
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert resolve_nproc(["--nproc_per_node=devices", "--standalone"]) == [
        "--nproc_per_node=1", "--standalone"]
    assert "OMP_NUM_THREADS" not in os.environ  # one process keeps every core
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert resolve_nproc(["--nproc_per_node=devices"]) == ["--nproc_per_node=4"]
    assert os.environ["OMP_NUM_THREADS"] == "1"
    monkeypatch.setenv("OMP_NUM_THREADS", "8")  # the user's setting wins
    assert resolve_nproc(["--nproc_per_node=2"]) == ["--nproc_per_node=2"]
    assert os.environ["OMP_NUM_THREADS"] == "8"


def neighbour(dump):
    """A dump folder holding another run's checkpoint and TensorBoard events; returns a
    snapshot function (every file under the dump folder with its content)."""
    (dump / "other" / "checkpoint" / "step-2").mkdir(parents=True)
    (dump / "other" / "checkpoint" / "step-2" / "COMPLETE").write_text("2")
    (dump / "tb" / "other").mkdir(parents=True)
    (dump / "tb" / "other" / "events.out.tfevents.1.host").write_text("curves")
    return lambda: {p.relative_to(dump): p.read_text() for p in dump.rglob("*") if p.is_file()}


BAD_RUN_NAMES = ["..", ".", "", "a/b", "../../x", "/abs/run"]


def test_run_name_is_one_folder_name_and_other_runs_survive(tmp_path):
    from torchllm.train import main

    dump = tmp_path / "sub" / "dump"
    snapshot = neighbour(dump)
    before = snapshot()
    for name in BAD_RUN_NAMES:
        with pytest.raises(ConfigError) as e:
            tiny_config(dump, f"--job.run_name={name}", "--job.overwrite")
        assert e.value.key == "job.run_name" and repr(name) in str(e.value), e.value
        assert "\n" not in str(e.value)
        # The real entry point: exit 2, nothing deleted, nothing made outside the dump folder.
        assert main(tiny_args(dump, f"--job.run_name={name}", "--job.overwrite")) == 2, name
        assert snapshot() == before, name
        assert sorted(os.listdir(tmp_path)) == ["sub"] and os.listdir(tmp_path / "sub") == [
            "dump"]
    with pytest.raises(ConfigError, match="job.run_name.*'tb'.*metrics.tb_folder"):
        tiny_config(dump, "--job.run_name=tb")
    stem = tmp_path / "...toml"  # the run name defaults to the config file's stem: '..'
    stem.write_text("")
    with pytest.raises(ConfigError, match=r"'\.\.'.*job.config_file"):
        tiny_config(dump, f"--job.config_file={stem}")
    assert tiny_config(dump, "--job.run_name=r.1_x").job.run_name == "r.1_x"


@pytest.mark.parametrize("key, where", [("checkpoint.folder", "the run folder"),
                                        ("metrics.tb_folder", "job.dump_folder"),
                                        ("profiling.traces_folder", "the run folder")])
def test_folder_keys_stay_below_their_folder(tmp_path, key, where):
    for value in ["..", "", ".", "../x", "a/../../x", "/tmp/elsewhere", "./"]:
        with pytest.raises(ConfigError) as e:
            tiny_config(tmp_path, f"--{key}={value}")
        assert e.value.key == key and repr(value) in str(e.value), e.value
        assert where in str(e.value), e.value  # what it must stay below
    assert tiny_config(tmp_path, f"--{key}=a/b").value(key) == "a/b"


def test_launcher_refuses_a_bad_run_name_in_one_line(tmp_path):
    snapshot = neighbour(tmp_path)
    before = snapshot()
    args = tiny_args(tmp_path, "--job.run_name=..", "--job.overwrite")
    for r in (run_train(*args), run_module("torchllm.train", *args)):
        assert r.returncode == 2, r.out
        lines = r.out.strip().splitlines()
        assert len(lines) == 1 and "job.run_name" in lines[0] and "'..'" in lines[0], lines
        assert snapshot() == before


def test_overwrite_deletes_only_this_runs_folders_and_says_what(tmp_path, log_text):
    import torch

    from torchllm.config.paths import run_folders
    from torchllm.run.rundir import prepare_run_dir

    snapshot = neighbour(tmp_path)
    before = snapshot()
    (tmp_path / "r" / "checkpoint" / "step-4").mkdir(parents=True)
    (tmp_path / "r" / "checkpoint" / "step-4" / "COMPLETE").write_text("4")
    (tmp_path / "r" / "notes.txt").write_text("mine")
    (tmp_path / "tb" / "r").mkdir(parents=True)
    (tmp_path / "tb" / "r" / "events.out.tfevents.2.host").write_text("old curves")
    def prepare(*args):
        cfg = tiny_config(tmp_path, "--job.run_name=r", *args)
        return prepare_run_dir(run_folders(cfg.job, cfg.checkpoint, cfg.metrics),
                               torch.device("cpu"), stale_s=60,
                               overwrite=cfg.job.overwrite, resumes=cfg.checkpoint.enable,
                               replica=False)

    with pytest.raises(ConfigError, match="previous run's outputs"):
        prepare()
    lock = prepare("--job.overwrite")
    lock.release()
    assert lock.path.parent == tmp_path / "r"
    assert not (tmp_path / "r" / "checkpoint").exists() and not (tmp_path / "tb" / "r").exists()
    assert (tmp_path / "r" / "notes.txt").read_text() == "mine"  # not an output: kept
    after = snapshot()
    assert {k: v for k, v in after.items() if k in before} == before  # the neighbour survives
    assert f"job.overwrite: deleted run 'r''s previous outputs: {tmp_path / 'r' / 'checkpoint'} " \
           f"(1 item(s): step-4); {tmp_path / 'tb' / 'r'} (1 item(s): " \
           "events.out.tfevents.2.host)" in log_text()
