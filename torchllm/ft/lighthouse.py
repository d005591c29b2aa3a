"""Where the torchft lighthouse is, and the one-line refusal when it cannot be reached.

The lighthouse decides each step's quorum (which replica groups train it). Its address comes from
TORCHFT_LIGHTHOUSE, torchft's own variable (a launcher variable, like NGPU), default
http://localhost:29510.
"""

from __future__ import annotations

import os
import socket
import sys
from urllib.parse import urlparse

from torchllm.config.job_config import ConfigError

LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
DEFAULT_LIGHTHOUSE = "http://localhost:29510"
START_ONE = ("start one with `torchft_lighthouse --min_replicas 1 --bind 127.0.0.1:29510` (or run "
             "the groups through scripts/ft_local.sh, which starts it)")


def lighthouse_address(environ) -> str:
    return environ.get(LIGHTHOUSE_ENV) or DEFAULT_LIGHTHOUSE


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


def check_lighthouse(address: str, timeout_s: float = 2.0) -> None:
    """Refuse (ConfigError, one line) when nothing listens at the lighthouse's address."""
    url = urlparse(address if "://" in address else f"http://{address}")
    where = f"{LIGHTHOUSE_ENV}={address}" if address != DEFAULT_LIGHTHOUSE else \
        f"{address} (the default; set {LIGHTHOUSE_ENV} for another)"
    if not url.hostname or url.port is None:
        raise ConfigError(f"fault_tolerance.enable: the lighthouse address {where} is not "
                          "http://HOST:PORT", "fault_tolerance.enable")
    try:
        socket.create_connection((url.hostname, url.port), timeout=timeout_s).close()
    except OSError as e:
        raise ConfigError(
            f"fault_tolerance.enable: no torchft lighthouse reachable at {where} ({e.strerror or e}"
            f"); {START_ONE}", "fault_tolerance.enable") from None


def check_fault_tolerance(cfg, environ) -> None:
    """The launcher's and the trainer's pre-flight check (value checks ran at config load)."""
    if not cfg.fault_tolerance.enable:
        return
    check_torchft()
    check_lighthouse(lighthouse_address(environ))
