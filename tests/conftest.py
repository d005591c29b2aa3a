"""Shared test helpers: tiny configs that train in milliseconds on CPU."""

from __future__ import annotations

import os
import sys
import time
import tempfile
from pathlib import Path

import pytest
import torch

from torchllm.config import load_config

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
# The test modules sit in unit/<package>/, integration/, e2e/ and suite/ (scripts/test_layout.py)
# and import the helpers here (conftest, cli, messages, builders/...) by name: tests/ on sys.path
# whatever pytest's import mode (its default, prepend, already puts it there for this file).
TESTS = Path(__file__).resolve().parent
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))
# `torchrun` for the tests' multi-rank launches of their worker scripts: torch's own, each rank a
# fresh `python -u SCRIPT` as for a user (this interpreter's torch, not whichever is on PATH).
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]

# The suite's runs (and the ranks they launch) cache the CPU peak MFU divides by in a folder of
# their own, not in the user's ~/.cache/torchllm (a peak measured under the suite's load).
if "TORCHLLM_CACHE_DIR" not in os.environ:
    os.environ["TORCHLLM_CACHE_DIR"] = tempfile.mkdtemp(prefix="torchllm-test-cache-")


def pytest_configure(config):
    """Under pytest-xdist, each worker's share of the cores: N workers on N cores each running
    torch with N threads (and each training subprocess they launch too) oversubscribe the machine,
    and torch's OpenMP threads spin-waiting for a core made the suite slower than one worker."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1 and "OMP_NUM_THREADS" not in os.environ:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        threads = max(1, (cores or 1) // workers)
        os.environ["OMP_NUM_THREADS"] = str(threads)  # the subprocesses tests launch
        torch.set_num_threads(threads)
    if hasattr(config.option, "loadscopereorder") and "PYTEST_XDIST_WORKER" not in os.environ:
        # xdist's controller hands out files in the workers' collection order (heavy_files_first)
        # instead of re-sorting them by their number of tests, which put the heaviest files of
        # one or two tests (a kill-and-relaunch, the journey) last, two of them queued on one
        # worker while the other ran out of files.
        config.option.loadscopereorder = False


# A file's weight in the order xdist's workers are handed files (heavy_files_first): its
# tests' seconds, roughly (a slow test is one over ~10 s; most others take well under 1 s).
SLOW_S, QUICK_S = 15.0, 0.5


def heavy_files_first(items: list) -> list:
    """The items file by file, the heaviest files first (SLOW_S a slow-marked test, QUICK_S
    another), each file's tests in their order, equal weights in collection order: handed out
    in this order (`--dist loadfile`), the last files to start are the light ones, so that the
    workers finish together (the longest-first rule) instead of one of them running a heavy
    file alone at the end."""
    files: dict[str, list] = {}  # in collection order
    for item in items:
        files.setdefault(item.nodeid.split("::")[0], []).append(item)
    order = sorted(files.values(), key=lambda tests: -sum(  # (stable: equal weights keep it)
        SLOW_S if item.get_closest_marker("slow") else QUICK_S for item in tests))
    return [item for tests in order for item in tests]


def pytest_collection_modifyitems(config, items):
    """Under xdist, each worker's items heavy files first (every worker sorts the same
    collection the same way, as xdist requires). Tests marked `gpu` skip, with the reason,
    where no CUDA device is visible."""
    if "PYTEST_XDIST_WORKER" in os.environ:
        items[:] = heavy_files_first(items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run scripts/gpu_check.sh on a GPU machine)")
    for item in items:
        if item.get_closest_marker("gpu"):  # not `"gpu" in item.keywords`: a folder named gpu
            item.add_marker(skip)           # (a checkout at ~/gpu) is a keyword too


# Variables libraries set once for the process, not state a test leaves behind: pytest's own,
# inductor's private one (once anything is compiled), and KMP_DUPLICATE_LIB_OK, which
# threadpoolctl sets at import (scipy imports it the first time `datasets` streams local files)
# and inductor's C++ builder sets when it finds an OpenMP library.
IMPORT_SET_ENV = ("PYTEST_CURRENT_TEST", "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR",
                  "KMP_DUPLICATE_LIB_OK")


def _process_state() -> dict:
    """What one test module may not leave changed for the next: torch's compiler configs (a
    deleted or flipped key broke a dozen later tests once), logging handlers and levels, the
    environment, the working directory, and torch's process-wide switches."""
    import logging
    import os
    import warnings

    import torch._dynamo.config
    import torch._functorch.config
    import torch._inductor.config

    def config(module) -> dict:  # read each key as code does: a deleted key reads "<deleted>"
        with warnings.catch_warnings():  # reading a deprecated key warns
            warnings.simplefilter("ignore")
            return {key: getattr(module, key, "<deleted>") for key in module.get_config_copy()}

    loggers = {"": logging.getLogger(), "torch": logging.getLogger("torch")}
    return {
        "torch._inductor.config": config(torch._inductor.config),
        "torch._dynamo.config": config(torch._dynamo.config),
        "torch._functorch.config": config(torch._functorch.config),
        "logging": {name or "root": (list(lg.handlers), lg.level, lg.propagate, lg.disabled)
                    for name, lg in loggers.items()},
        "logging.disable": logging.root.manager.disable,
        "os.environ": {k: v for k, v in os.environ.items() if k not in IMPORT_SET_ENV},
        "cwd": os.getcwd(),
        "torch": {
            "default_dtype": torch.get_default_dtype(),
            "num_threads": torch.get_num_threads(),
            "deterministic": torch.are_deterministic_algorithms_enabled(),
            "grad_enabled": torch.is_grad_enabled(),
            "matmul_precision": torch.get_float32_matmul_precision(),
            "process_group": torch.distributed.is_available() and torch.distributed.is_initialized(),
        },
    }


def state_changes(before: dict, after: dict) -> list[str]:
    """The entries of two `_process_state()` snapshots that differ, one line each."""
    changes = []
    for section, old in before.items():
        new = after[section]
        if isinstance(old, dict):
            for key in sorted(set(old) | set(new), key=str):
                if old.get(key, "<absent>") != new.get(key, "<absent>"):
                    changes.append(f"{section}[{key!r}]: {old.get(key, '<absent>')!r} -> "
                                   f"{new.get(key, '<absent>')!r}")
        elif old != new:
            changes.append(f"{section}: {old!r} -> {new!r}")
    return changes


@pytest.fixture(scope="module", autouse=True)
def _module_leaves_process_state_as_found(request):
    """Fail the module (an error at its last test's teardown) that changed shared process state,
    so a leak fails where it is introduced instead of in whichever test runs next. Patch torch
    config keys with `torch._inductor.config.patch(...)` (a context manager) and environment
    variables with `monkeypatch`, which restore them."""
    before = _process_state()
    yield
    changes = state_changes(before, _process_state())
    if changes:
        pytest.fail(f"{request.module.__name__} left process state changed:\n  "
                    + "\n  ".join(changes), pytrace=False)


@pytest.fixture(autouse=True)
def _torchllm_logger_propagates():
    """main() installs a console handler and stops propagation; undo it so caplog sees logs."""
    yield
    from torchllm.log import logger

    logger.handlers.clear()
    logger.propagate = True


def build_model(model_cls, args, seed: int = 0):
    """The production path on CPU: build on meta, to_empty, seed, init_weights."""
    with torch.device("meta"):
        model = model_cls(args)
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    model.init_weights()
    return model


def tiny_args(tmp_path, *extra: str) -> list[str]:
    """CLI overrides for a fast debug run writing under tmp_path.

    The device is pinned to CPU: tolerances are tuned for fp32 CPU numerics, and 'auto' would
    switch a GPU machine's run to CUDA + bf16 (and N processes onto GPUs it may not have)."""
    return [
        "--training.device=cpu",
        f"--job.dump_folder={tmp_path}",
        "--job.print_config=false",
        "--model.flavor=debug",
        "--training.steps=4",
        "--training.seq_len=32",
        "--training.local_batch_size=4",
        "--data.tokenizer_vocab_size=512",
        "--lr_scheduler.warmup_steps=2",
        "--metrics.log_freq=1",
        # The CPU parity oracles (reference loops, one process vs many) are float32; bf16 runs
        # are tested explicitly. ("auto" picks bf16 on CPUs with native bf16 matmul.)
        "--training.mixed_precision=none",
        # The end-of-run report (matplotlib: ~1 s a run) is tested where it is the subject
        # (test_report.py opts in; run_train.sh tests with their own args keep the default).
        "--metrics.report=false",
        *extra,
    ]


def tiny_config(tmp_path, *extra: str):
    return load_config(tiny_args(tmp_path, *extra))


def wait_for(predicate, timeout: float, what: str, every: float = 0.2):
    """Poll `predicate` every `every` seconds until it returns something truthy (returned);
    AssertionError naming `what` after `timeout` seconds (tests that watch a running launch)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def process_state(pid: int) -> str | None:
    """The state letter in /proc/PID/stat (R, S, T, Z: a zombie, ...); None: no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[0]  # (the command name before it may hold spaces)


def tb_scalars(folder: Path, tag: str = "loss/avg") -> dict[int, float]:
    """{step: value} of a scalar in a run's TensorBoard folder, as the viewer shows it after
    relaunches: a later events file replaces the steps from its first one on. The files are
    taken in the order they were written (their first event's time): TensorBoard takes them in
    name order, which two writers of one process in the same second get wrong once its
    unpadded writer counter gains a digit (`...vm.123.10` before `...vm.123.9`)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    files = []
    for path in Path(folder).glob("events.out.tfevents.*"):
        events = EventAccumulator(str(path), size_guidance={"scalars": 0})
        events.Reload()
        if tag in events.Tags()["scalars"]:
            files.append((events.FirstEventTimestamp(), path.name, events.Scalars(tag)))
    values: dict[int, float] = {}
    for _, _, scalars in sorted(files, key=lambda f: f[:2]):
        first = scalars[0].step
        values = {step: v for step, v in values.items() if step < first}
        values.update((e.step, e.value) for e in scalars)
    return dict(sorted(values.items()))


def shared_path(*parts: str) -> Path:
    """A file in ../shared, or skip the test with the reason when it is absent."""
    path = SHARED.joinpath(*parts)
    if not path.exists():
        pytest.skip(f"{path} is not present (../shared is only beside the project's checkout)")
    return path


def _gloo_rank(rank: int, world: int, tmp_path, fn, args) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rendezvous_{fn.__name__}",
                            rank=rank, world_size=world)
    try:
        fn(rank, tmp_path, *args)
    finally:
        dist.destroy_process_group()


def spawn_gloo(fn, tmp_path, *args, world: int = 2) -> None:
    """Run `fn(rank, tmp_path, *args)` in `world` spawned processes joined in one gloo group
    (file rendezvous in tmp_path); `fn` must be a module-level function (it is pickled)."""
    import torch.multiprocessing as mp

    mp.start_processes(_gloo_rank, args=(world, tmp_path, fn, args), nprocs=world, join=True,
                       start_method=preloaded_forkserver())


def preloaded_forkserver() -> str:
    """multiprocessing's fork server, with torch and torchllm imported once in it: each process
    forked from it starts in ~0.1 s instead of importing them again as a spawned one does (~4
    CPU-s); unlike a fork of this process, it carries no OpenMP pool or thread of the test."""
    import multiprocessing as mp

    mp.set_forkserver_preload(["torch", "torch._dynamo", "torchllm.train", "conftest"])
    return "forkserver"
