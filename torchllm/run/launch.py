"""The launcher run_train.sh runs: check the config, run torchrun, and end like a scheduler expects.

    python -m torchllm.run [torchrun options] -- [--section.key=value ...]

1. The config is loaded and checked first (every value, the model flavor, the parallel layout for
   this world size, the device, the dataset spec): a mistake is one line and exit code 2, before
   any process starts.
2. torchrun runs `torchllm.train` in this process (its agent is this process): CPU workers are
   forked from it (fork_workers), CUDA workers are `python -u -m torchllm.train`. Workers report
   how they ended through torchllm.run.failures; a failure on any rank is printed here once (the
   first error, where it happened) instead of torchrun's traceback. Exit code: the failing worker's
   (2 config error, 3 stopped by the loss guard, 1 any other error).
3. SIGTERM (what SLURM and Kubernetes send) or SIGINT to this process: torchrun forwards it to
   every worker, which finish their step, save (when checkpointing is on) and exit 0; the
   launcher then exits 0. Workers get torchrun's grace period (30 s by default; newer torch reads
   TORCH_ELASTIC_SHUTDOWN_TIMEOUT) before SIGKILL.
4. Rendezvous: a single-node launch (`--standalone`, or a loopback RDZV_ENDPOINT) listens on
   127.0.0.1 only: torchrun's stores bind there (torch's TCPStore binds every interface unless
   handed a bound socket) and gloo/NCCL use `lo`. Any c10d rendezvous without `--rdzv_id` gets a
   random one on a single node and is refused (one line) on several: whoever reaches the store
   and knows the id can run code in the launcher (torchrun unpickles the rendezvous state), so
   a multi-node launch needs a trusted network and a secret RDZV_ID shared by its nodes.
"""

from __future__ import annotations

import logging
import contextlib
import importlib
import ipaddress
import os
import secrets
import shutil
import signal
import socket
import sys
import tempfile
import threading
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
WORKER_MODULE = "torchllm.train"  # what each worker runs (`python -m`, or forked: its main)
LOOPBACK = "127.0.0.1"


def check_config(train_args: list[str], world_size: int | None):
    """Everything about the config that can be checked without a process group; ConfigError."""
    from torchllm import models, optim
    from torchllm.run.tokenizer import stage_tokenizer
    from torchllm.data.dataset import check_data
    from torchllm.device import resolve_device
    from torchllm.ft import check_fault_tolerance
    from torchllm.parallel import build_parallel_dims

    cfg = load_config(train_args)
    model_args = models.model_args(cfg)
    optim.get(cfg.optimizer.name)  # a registered optimizer (job.custom_import may add one)
    device = resolve_device(cfg.training.device)
    if world_size is not None:
        build_parallel_dims(cfg, world_size, device.type, model_args)
    check_data(cfg)  # every dataset spec, by the code the trainer parses them with
    check_fault_tolerance(cfg, os.environ)  # torchft installed, its lighthouse reachable
    stage_tokenizer(cfg)  # a stage's tokenizer (from_initial_load, or auto): recorded there
    return cfg


# Workers of a CPU launch are forked from this process, which has imported torch and torchllm
# for the config check already: a worker then starts in ~0.1 s instead of spending ~4 CPU-s
# importing them again (torchrun's usual `python -m` per worker; CUDA launches keep it: CUDA
# does not survive a fork). TORCHLLM_FORK_WORKERS=0 turns it off.
FORK_ENV = "TORCHLLM_FORK_WORKERS"
SIGNALLED_WORKER_EXIT_S = 2.0  # a forked worker stopped by a signal ends this long after returning


def fork_workers(cfg, drawing_bar: bool) -> bool:
    """Whether this launch forks its workers: CPU training on Linux, no progress bar thread in
    this process (a thread holding a lock at fork would hold it forever in the worker)."""
    from torchllm.device import resolve_device  # ('auto' as the workers will resolve it)

    return (os.environ.get(FORK_ENV, "1") != "0" and sys.platform.startswith("linux")
            and not drawing_bar and resolve_device(cfg.training.device).type == "cpu")


def _forked_worker(main, argv: list[str], threads: int) -> None:
    """A forked worker: what `python -u -m MODULE ARGV` does, in a copy of this process, where
    `main(argv)` is that module's main (an exit code). Returns on success (torchrun waits for
    every worker's return value), also when stopped by a signal (then the process ends shortly
    after); a failure leaves through os._exit with the worker's exit code, as the module run by
    `python -m` would."""
    import torch

    from torchllm.run.process_exit import exit_process
    from torchllm.run.stopping import signal_received

    for stream in (sys.stdout, sys.stderr):  # python -u: every line reaches torchrun's tee
        stream.reconfigure(line_buffering=True, write_through=True)
    # The launcher ran on one thread (a fork never inherits a busy OpenMP pool); the worker uses
    # what a fresh process would: OMP_NUM_THREADS (torchrun's, for several workers) or the cores.
    omp = os.environ.get("OMP_NUM_THREADS", "")
    torch.set_num_threads(int(omp) if omp.isdigit() and int(omp) > 0 else threads)
    code = main(argv)
    if code != 0:
        exit_process(code)
    if signal_received():
        # Stopped by SIGTERM/SIGINT, after saving. Either the launcher got it and torchrun is
        # closing the workers (it reads no return value then, and would SIGKILL a worker
        # waiting for it to), or it reached this worker alone and torchrun still polls (a worker
        # gone without its return value would leave it waiting forever): return the result
        # (torch's wrapper hands it to torchrun) and end a moment later either way.
        threading.Timer(SIGNALLED_WORKER_EXIT_S, exit_process, (0,)).start()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()


def run_forked(args, main, argv: list[str], threads: int) -> None:
    """torchrun (torch.distributed.run.run, after secure_rendezvous has set the rendezvous up)
    with workers forked from this process, each running `main(argv)`: the code `main` needs is
    imported here, once, before the fork. This process must still be on one thread (`threads`:
    what it had before, which the workers get back)."""
    import torch
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args

    torch.multiprocessing._set_thread_name("pt_elastic")  # (as torch.distributed.run.run)
    if args.master_port is None:
        args.master_port = 29500
    config, _, _ = config_from_args(args)
    config.start_method = "fork"
    importlib.import_module("torch._dynamo")  # (torch.optim.Optimizer's constructor imports it)
    elastic_launch(config=config, entrypoint=_forked_worker)(main, argv, threads)


def torchrun_forked(torchrun_argv: list[str], main=None) -> None:
    """`torchrun TORCHRUN_ARGV` (its options, then `-m MODULE args` or `SCRIPT args`) with the
    rendezvous run_train.sh's launcher sets up (secure_rendezvous, loopback_stores) and workers
    forked from this process (run_forked), each running `main(args)`: MODULE's own `main` unless
    given. Raises what torchrun raises (ChildFailedError: a worker failed)."""
    import torch
    from torch.distributed.run import parse_args

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # until the workers are forked: see _forked_worker
    args = parse_args(torchrun_argv)
    if main is None:
        main = importlib.import_module(args.training_script).main  # before the fork
    local = secure_rendezvous(args)
    with loopback_stores() if local else contextlib.nullcontext():
        run_forked(args, main, list(args.training_script_args), threads)


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
    one. torchrun's failures name only the ranks it saw end first (workers forked: the first
    one, often a rank that only lost its peers), so every rank's file is looked for beside
    theirs: <log dir>/<run>/attempt_<n>/<local rank>/error.json."""
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
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # until the workers are forked: see _forked_worker
    try:
        local = secure_rendezvous(args)
        cfg = check_config(train_args, _world_size(args))
    except ConfigError as e:
        print(f"{PREFIX} config error: {e}", file=sys.stderr)
        return 2

    # torchrun's own line per failed or signalled worker: the summary below replaces it.
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)
    status_dir = tempfile.mkdtemp(prefix="torchllm-status-")
    os.environ[STATUS_DIR_ENV] = status_dir
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
            if fork_workers(cfg, bar is not None):
                # the module torchrun would run (`-m`), by name as there
                worker = importlib.import_module(WORKER_MODULE)
                run_forked(args, worker.main, train_args, threads)
            else:
                torch.set_num_threads(threads)
                run(args)
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
        shutil.rmtree(status_dir, ignore_errors=True)


