"""Where the torchft lighthouse is, and the one-line refusal when it cannot be reached.

The lighthouse decides each step's quorum (which replica groups train it). Its address comes from
TORCHFT_LIGHTHOUSE, torchft's own variable (a launcher variable, like NGPU); unset, it is the
run's own: http://localhost:PORT, PORT in PORTS from a hash of the run's name and dump folder, so
two runs on one machine never share a lighthouse by default (their groups would refuse each
other at their first quorum, torchllm/ft/identity.py).

    python -m torchllm.ft [--section.key=value ...]      (torchllm/ft/__main__.py)

prints fault_tolerance.bind, the run's default address and its label (three lines;
scripts/ft_local.sh asks: its lighthouse binds that address too).
"""

from __future__ import annotations

import hashlib
import ipaddress
import os
import socket
import sys
from pathlib import Path
from urllib.parse import urlparse

from torchllm.config.job_config import ConfigError

LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
PORTS = range(29600, 32600)  # below Linux's ephemeral ports (32768-), above torchrun's 29500


def run_label(run: str, dump_folder) -> str:
    """The run a lighthouse serves, in one line: its name and its dump folder."""
    return f"{run} in {Path(dump_folder).resolve()}"


def default_address(run: str, dump_folder, bind: str = "127.0.0.1") -> str:
    """http://localhost:PORT, or the bound address's when it is one interface's (bind)."""
    digest = hashlib.blake2b(run_label(run, dump_folder).encode(), digest_size=8).digest()
    ip = ipaddress.ip_address(bind)
    if not (ip.is_loopback or ip.is_unspecified):
        host = f"[{bind}]" if ip.version == 6 else bind
        return f"http://{host}:{PORTS[int.from_bytes(digest, 'big') % len(PORTS)]}"
    return f"http://localhost:{PORTS[int.from_bytes(digest, 'big') % len(PORTS)]}"


def lighthouse_address(environ, run: str, dump_folder, bind: str = "127.0.0.1") -> str:
    return environ.get(LIGHTHOUSE_ENV) or default_address(run, dump_folder, bind)


def import_torchft():
    """torchft, its Rust side's log lines (a few per step, on stderr) at warnings and above
    unless RUST_LOG says otherwise (RUST_LOG=info shows them: quorums, commits, heals). The
    level is read once, when the extension loads; the environment is left as it was."""
    if "torchft" in sys.modules or "RUST_LOG" in os.environ:
        import torchft

        return torchft
    os.environ["RUST_LOG"] = "warn"
    try:
        import torchft
    finally:
        del os.environ["RUST_LOG"]
    return torchft


def check_torchft() -> None:
    """torchft is an optional dependency (the `ft` extra)."""
    try:
        import_torchft()
    except ImportError as e:
        raise ConfigError(
            f"fault_tolerance.enable = true needs torchft ({e}); install it with "
            "`pip install torchft==0.2.0` (or `pip install -e '.[ft]'`)",
            "fault_tolerance.enable") from e


def check_backend(ftcfg, device: str) -> None:
    """NCCL across the groups needs the groups on CUDA (training.device 'cpu' is refused at
    config load; 'auto' or 'cuda' on a machine without a GPU here, one line). `ftcfg`: the
    [fault_tolerance] section; `device`: training.device."""
    import torch

    from torchllm.config.sections_ft import NCCL_ON_CPU

    if ftcfg.process_group == "nccl" and not torch.cuda.is_available():
        raise ConfigError(NCCL_ON_CPU.format(where=f"training.device = "
                                             f"'{device}' and no CUDA device is "
                                             "visible"), "fault_tolerance.process_group")


def check_lighthouse(address: str, default: str, timeout_s: float = 2.0) -> None:
    """Refuse (ConfigError, one line) when nothing listens at the lighthouse's address."""
    url = urlparse(address if "://" in address else f"http://{address}")
    where = f"{LIGHTHOUSE_ENV}={address}" if address != default else \
        f"{address} (this run's default; set {LIGHTHOUSE_ENV} for another)"
    if not url.hostname or url.port is None:
        raise ConfigError(f"fault_tolerance.enable: the lighthouse address {where} is not "
                          "http://HOST:PORT", "fault_tolerance.enable")
    try:
        socket.create_connection((url.hostname, url.port), timeout=timeout_s).close()
    except OSError as e:
        raise ConfigError(
            f"fault_tolerance.enable: no torchft lighthouse reachable at {where} ({e.strerror or e}"
            f"); start one with `torchft_lighthouse --min_replicas 1 --bind 127.0.0.1:{url.port}` "
            "(or run the groups through scripts/ft_local.sh, which starts it)",
            "fault_tolerance.enable") from None


def check_fault_tolerance(ftcfg, job, device: str, environ, run: str | None = None) -> None:
    """The launcher's and the trainer's pre-flight check (value checks ran at config load) of
    the [fault_tolerance] section `ftcfg`, for the run [job] names on training.device `device`.
    `run`: the run's name (default job.run_name's; a replica group's [job] names its folder)."""
    if not ftcfg.enable:
        return
    from torchllm.config import paths
    from torchllm.ft.secret import load_secret

    run = run or paths.run_name(job)
    check_torchft()
    check_backend(ftcfg, device)
    check_lighthouse(lighthouse_address(environ, run, job.dump_folder, ftcfg.bind),
                     default_address(run, job.dump_folder, ftcfg.bind))
    load_secret(ftcfg, environ)  # the run's shared secret (ft/secret.py)


def main(argv: list[str] | None = None) -> int:
    """The bind address, the run's default lighthouse address and label (module doc); a config
    error: exit 2."""
    from torchllm.config import load_config, paths

    try:
        cfg = load_config(sys.argv[1:] if argv is None else argv)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    run = paths.run_name(cfg.job)
    print(cfg.fault_tolerance.bind)
    print(default_address(run, cfg.job.dump_folder, cfg.fault_tolerance.bind))
    print(run_label(run, cfg.job.dump_folder))
    return 0
