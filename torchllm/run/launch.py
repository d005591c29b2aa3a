"""The launcher run_train.sh runs: check the config, start the workers, and end like a scheduler
expects.

    python -m torchllm.run [torchrun options] -- [--section.key=value ...]

1. The config is loaded and checked first (every value, the model flavor, the parallel layout for
   this world size, the device, the dataset spec): a mistake is one line and exit code 2, before
   any process starts.
2. One process (NGPU=1 on one node, world size 1): `torchllm.train`'s main runs in this process,
   with its own sys.argv, no agent and no rendezvous. Several: torchrun's agent runs here
   (torch.distributed.run.run) and starts each worker the standard way, `python -u -m
   torchllm.train ARGS`, on CPU as on CUDA. Workers report how they ended through
   torchllm.run.failures; a failure on any rank is printed here once (the first error, where it
   happened) instead of torchrun's traceback, and a rank that died without a word (killed) is
   named with torchrun's record of it (ChildFailedError: its signal or exit code). Exit code: the
   failing worker's (2 config error, 3 stopped by the loss guard, 1 any other error).
3. SIGTERM (what SLURM and Kubernetes send) or SIGINT to this process: torchrun forwards it to
   every worker (or the one process gets it itself), which finish their step, save (when
   checkpointing is on) and exit 0; the launcher then exits 0. Workers get torchrun's grace
   period (30 s by default; newer torch reads TORCH_ELASTIC_SHUTDOWN_TIMEOUT) before SIGKILL.
4. Rendezvous: a single-node launch (`--standalone`, or a loopback RDZV_ENDPOINT) listens on
   127.0.0.1 only: torchrun's stores bind there (torch's TCPStore binds every interface unless
   handed a bound socket) and gloo/NCCL use `lo`. Any c10d rendezvous without `--rdzv_id` gets a
   random one on a single node and is refused (one line) on several: whoever reaches the store
   and knows the id can run code in the launcher (torchrun unpickles the rendezvous state), so
   a multi-node launch needs a trusted network and a secret RDZV_ID shared by its nodes.
5. The run lock: rank 0 takes the run folder's lock as it prepares the folder
   (torchllm.run.rundir); torchrun's workers die with this process (a parent-death signal), so a
   killed launcher leaves a stale lock that the next launch takes over, never a live run.
"""

from __future__ import annotations

import logging
import contextlib
import ipaddress
import os
import secrets
import shutil
import signal
import socket
import sys
import tempfile
from pathlib import Path

from torchllm.config import ConfigError, help_text, load_config
from torchllm.run.failures import (
    LAUNCHER_PID_ENV,
    STATUS_DIR_ENV,
    failure_report,
    read_statuses,
)
from torchllm.metrics.progress import PROGRESS_FILE_ENV, ConsoleBar

PREFIX = "run_train:"
WORKER_MODULE = "torchllm.train"  # what each worker runs (`python -u -m`; one process: its main)
LOOPBACK = "127.0.0.1"
ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"  # where @record writes a failed worker's traceback


def check_config(train_args: list[str], world_size: int | None):
    """Everything about the config that can be checked without a process group; ConfigError."""
    from torchllm import models, optim
    from torchllm.run.tokenizer import stage_tokenizer
    from torchllm.data.dataset import check_data
    from torchllm.device import resolve_device
    from torchllm.ft import check_fault_tolerance
    from torchllm.parallel import build_parallel_dims

    cfg = load_config(train_args)
    model_args = models.model_args(cfg.model, cfg.training, cfg.data)
    optim.get(cfg.optimizer.name)  # a registered optimizer (job.custom_import may add one)
    device = resolve_device(cfg.training.device)
    if world_size is not None:
        build_parallel_dims(world_size, device.type, model_args, parallelism=cfg.parallelism,
                            model=cfg.model, training=cfg.training, data=cfg.data, eval=cfg.eval,
                            float8=cfg.float8, activation_checkpoint=cfg.activation_checkpoint,
                            lora=cfg.lora, compile=cfg.compile)
    check_data(cfg.data, cfg.validation)  # every dataset spec, by the code the trainer parses them with
    check_fault_tolerance(cfg.fault_tolerance, cfg.job, cfg.training.device, os.environ)  # torchft installed, its lighthouse reachable
    stage_tokenizer(cfg.data, cfg.checkpoint)  # a stage's tokenizer (from_initial_load, or auto): recorded there
    return cfg


def _world_size(args) -> int | None:
    """nproc_per_node x nnodes when both are fixed numbers (elastic ranges: unknown)."""
    try:
        return int(args.nproc_per_node) * int(args.nnodes)
    except ValueError:
        return None


def resolve_nproc(torchrun_args: list[str]) -> list[str]:
    """`--nproc_per_node=devices` (run_train.sh's default) -> the number of CUDA devices, or 1
    without any. Several processes on one node get OMP_NUM_THREADS=1 unless it is set (what
    torchrun does anyway, with a banner): set it to cores / processes for CPU runs."""
    out = []
    for arg in torchrun_args:
        if arg == "--nproc_per_node=devices":
            import torch

            arg = f"--nproc_per_node={torch.cuda.device_count() or 1}"
        out.append(arg)
        nproc = arg.removeprefix("--nproc_per_node=")
        if arg.startswith("--nproc_per_node=") and nproc.isdigit() and int(nproc) > 1:
            os.environ.setdefault("OMP_NUM_THREADS", "1")
    return out


def _is_loopback(host: str) -> bool:
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _max_nodes(nnodes: str) -> int | None:
    try:
        return int(str(nnodes).split(":")[-1])
    except ValueError:
        return None


def secure_rendezvous(args) -> bool:
    """Rewrite torchrun's parsed `args` in place: `--standalone` (or one node without a master
    port or endpoint, which torchrun treats the same) becomes a c10d rendezvous on 127.0.0.1;
    a c10d rendezvous without an id gets a random one (single node) or is refused (ConfigError:
    several nodes must share one secret id). True when the launch is on one machine (a
    loopback endpoint): its listeners must then bind loopback only."""
    if args.standalone or (args.rdzv_backend == "static" and not args.rdzv_endpoint
                           and args.master_port is None and _max_nodes(args.nnodes) == 1):
        # (torchrun's own rule, torch.distributed.run.run: one node and no master port given
        # is a c10d rendezvous on a free port, as --standalone)
        args.standalone = False
        args.rdzv_backend, args.rdzv_endpoint = "c10d", f"{LOOPBACK}:0"
    if args.rdzv_backend == "static":  # MASTER_ADDR/MASTER_PORT: no id, a trusted network
        return False
    single = _max_nodes(args.nnodes) == 1
    if args.rdzv_id in ("", "none"):
        if not single:
            raise ConfigError(
                "RDZV_ID is not set: a multi-node c10d rendezvous needs the same secret id on "
                "every node (e.g. export RDZV_ID=$(python -c 'import secrets; "
                "print(secrets.token_hex(16))') before starting them); whoever reaches "
                f"{args.rdzv_endpoint} and knows the id can run code in the launcher", "RDZV_ID")
        args.rdzv_id = secrets.token_hex(16)
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    if not _is_loopback(parse_rendezvous_endpoint(args.rdzv_endpoint, 29400)[0]):
        return False
    if args.local_addr is None:
        args.local_addr = LOOPBACK  # the workers' MASTER_ADDR, where the agent's store listens
    return True


@contextlib.contextmanager
def loopback_stores():
    """While torchrun runs here: every TCPStore server this process starts listens on
    127.0.0.1 (torch's libuv server binds all interfaces unless given `master_listen_fd`), and
    the workers' gloo and NCCL sockets use the loopback interface."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    os.environ.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)  # else rank 0 hosts one on *
    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend as c10d_backend

    base = dist.TCPStore

    class LoopbackTCPStore(base):
        def __init__(self, host_name, port, world_size=None, is_master=False, *args,
                     master_listen_fd=None, **kwargs):
            if is_master and master_listen_fd is None:
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                try:
                    sock.bind((LOOPBACK, port))
                    sock.listen(socket.SOMAXCONN)
                except OSError as e:  # (torch's c10d backend retries as a client on these)
                    sock.close()
                    raise RuntimeError(f"cannot listen on {LOOPBACK}:{port}: {e}") from e
                port, master_listen_fd = sock.getsockname()[1], sock.detach()
            super().__init__(host_name, port, world_size, is_master, *args,
                             master_listen_fd=master_listen_fd, **kwargs)

    dist.TCPStore = c10d_backend.TCPStore = LoopbackTCPStore
    try:
        yield
    finally:
        dist.TCPStore = c10d_backend.TCPStore = base


def kept_error_files(failures: dict) -> dict[int, str]:
    """rank -> torchrun's error file (@record's traceback) of each rank of this node that wrote
    one. torchrun's failures name only the ranks it saw end in one poll (often a rank that
    only lost its peers, the root cause ending a moment later), so every rank's file is looked
    for beside theirs: <log dir>/<run>/attempt_<n>/<local rank>/error.json."""
    found = {}
    for rank, failure in failures.items():
        attempt, first_rank = Path(failure.error_file).parent.parent, rank - failure.local_rank
        for local in attempt.glob("*/error.json"):
            if local.parent.name.isdigit():
                found[first_rank + int(local.parent.name)] = str(local)
    return found


def _how(failure) -> str:
    if failure.exitcode < 0:
        try:
            return f"signal {signal.Signals(-failure.exitcode).name}"
        except ValueError:
            return f"signal {-failure.exitcode}"
    return f"exit code {failure.exitcode}"


def run_in_process(train_args: list[str], status_dir: str, log_dir: str | None) -> int:
    """One process: `python -m torchllm.train TRAIN_ARGS` in this one, which imported torch and
    torchllm for the config check already (no agent, no second interpreter). Its sys.argv is the
    trainer's, as `python -m` sets it; on a terminal it draws its own progress bar. LOG_DIR
    keeps @record's error file (the traceback) as torchrun would: LOG_DIR/error.json."""
    import importlib

    from torchllm.run.stopping import stop_signal

    worker = importlib.import_module(WORKER_MODULE)
    error_file = None
    if log_dir is not None:
        os.makedirs(log_dir, exist_ok=True)
        error_file = os.path.join(log_dir, "error.json")
        os.environ[ERROR_FILE_ENV] = error_file
    launcher_argv, sys.argv = sys.argv, [worker.__file__, *train_args]
    try:
        code = worker.main(train_args)
    finally:
        sys.argv = launcher_argv
        os.environ.pop(ERROR_FILE_ENV, None)
    signum = stop_signal()
    if code == 0 and signum is not None:
        print(f"{PREFIX} stopped by {signal.Signals(signum).name}: the run finished its step, "
              "saved (if checkpointing is on) and exited cleanly", file=sys.stderr, flush=True)
    elif code != 0:
        kept = {0: error_file} if error_file and os.path.isfile(error_file) else {}
        lines, _ = failure_report(read_statuses(status_dir), {0: f"exit code {code}"}, kept)
        print("\n".join(f"{PREFIX} {line}" for line in lines), file=sys.stderr, flush=True)
    return code


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        print(f"{PREFIX} usage: python -m torchllm.run [torchrun options] -- [overrides]",
              file=sys.stderr)
        return 2
    sep = argv.index("--")
    torchrun_args, train_args = argv[:sep], argv[sep + 1:]
    if "--help" in train_args or "-h" in train_args:
        print(help_text())
        return 0

    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    torchrun_args = resolve_nproc(torchrun_args)
    args = parse_args([*torchrun_args, "-m", WORKER_MODULE, *train_args])
    try:
        local = secure_rendezvous(args)
        check_config(train_args, _world_size(args))
    except ConfigError as e:
        print(f"{PREFIX} config error: {e}", file=sys.stderr)
        return 2

    status_dir = tempfile.mkdtemp(prefix="torchllm-status-")
    os.environ[STATUS_DIR_ENV] = status_dir
    if _world_size(args) == 1 and not args.max_restarts:
        try:
            return run_in_process(train_args, status_dir, args.log_dir)
        finally:
            os.environ.pop(STATUS_DIR_ENV, None)
            shutil.rmtree(status_dir, ignore_errors=True)

    # torchrun's own line per failed or signalled worker: the summary below replaces it.
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)
    os.environ[LAUNCHER_PID_ENV] = str(os.getpid())  # workers die with this process
    kept_logs = args.log_dir is not None  # --log-dir (run_train.sh's LOG_DIR): the user's
    if args.log_dir is None:  # torchrun's tee files: here, removed below (not /tmp/torchelastic_*)
        args.log_dir = os.path.join(status_dir, "torchrun")
    bar, streams = None, (sys.stdout, sys.stderr)
    if sys.stdout.isatty():  # rank 0 reports its step, this process draws the bar
        os.environ[PROGRESS_FILE_ENV] = os.path.join(status_dir, "progress")
        bar = ConsoleBar(os.environ[PROGRESS_FILE_ENV], sys.stdout).start()
        sys.stdout = bar  # torchrun relays the workers' lines through it
        if sys.stderr.isatty():
            sys.stderr = bar.relay(sys.stderr)
    try:
        with loopback_stores() if local else contextlib.nullcontext():
            run(args)  # workers: `python -u -m torchllm.train TRAIN_ARGS`
        return 0
    except ChildFailedError as e:
        failed = {rank: _how(f) for rank, f in e.failures.items()}
        error_files = kept_error_files(e.failures) if kept_logs else {}
        lines, code = failure_report(read_statuses(status_dir), failed, error_files)
        print("\n".join(f"{PREFIX} {line}" for line in lines), file=sys.stderr, flush=True)
        return code
    except SignalException as e:
        name = signal.Signals(e.sigval).name
        statuses = read_statuses(status_dir)
        clean = [s for s in statuses if s["code"] == 0]
        if len(clean) == int(args.nproc_per_node) and len(statuses) == len(clean):
            print(f"{PREFIX} stopped by {name}: every rank finished its step, saved (if "
                  "checkpointing is on) and exited cleanly", file=sys.stderr, flush=True)
            return 0
        lines, _ = failure_report(statuses, {})
        done = ", ".join(str(s["rank"]) for s in clean) or "none"
        print(f"{PREFIX} stopped by {name}, but not every rank exited cleanly (clean: {done})",
              file=sys.stderr)
        if any(s["code"] != 0 for s in statuses):
            print("\n".join(f"{PREFIX} {line}" for line in lines), file=sys.stderr)
        return 128 + e.sigval
    finally:
        if bar is not None:
            bar.close()
            sys.stdout, sys.stderr = streams
            os.environ.pop(PROGRESS_FILE_ENV, None)
        os.environ.pop(STATUS_DIR_ENV, None)
        os.environ.pop(LAUNCHER_PID_ENV, None)
        shutil.rmtree(status_dir, ignore_errors=True)


