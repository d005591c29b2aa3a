"""The Hugging Face Hub, answered within seconds: reachable, or offline mode at once.

Offline, huggingface_hub retries every lookup for ~25-29 s before it fails. Before torchllm's
first Hub lookup in a process, `prepare_hub()` opens one TCP connection to the Hub's endpoint
(HF_ENDPOINT, default huggingface.co:443) with a 3 s timeout; when that fails it switches
huggingface_hub and datasets to offline mode for this process, as HF_HUB_OFFLINE=1 would: files
already in the local cache still load, a missing one fails at once. With a proxy configured
(HTTPS_PROXY) the probe is skipped (the Hub is reached through the proxy, not directly).
"""

from __future__ import annotations

import os
import socket
import sys
import urllib.parse

OFFLINE_HINT = ("offline? set HF_HUB_OFFLINE=1 (only files already in the Hugging Face cache "
                "are used; no network wait)")
_TRUE = {"1", "true", "yes", "on"}
_state: dict[str, bool | str] = {}


def offline_by_env() -> bool:
    return any(os.environ.get(k, "").lower() in _TRUE
               for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"))


def hub_reachable(timeout: float = 3.0) -> bool:
    """One TCP connection to the Hub's endpoint within `timeout` seconds (checked once)."""
    if "reachable" not in _state:
        if any(os.environ.get(k) for k in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY")):
            _state["reachable"] = True
        else:
            url = urllib.parse.urlsplit(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
            port = url.port or (443 if url.scheme == "https" else 80)
            try:
                with socket.create_connection((url.hostname, port), timeout=timeout):
                    _state["reachable"] = True
            except OSError as e:  # said as it was: a timeout, or a refusal at once
                _state["reachable"] = False
                _state["why"] = (f"did not answer within {timeout:g} s"
                                 if isinstance(e, TimeoutError) else
                                 f"could not be reached ({e.strerror or e})")
    return _state["reachable"]


def set_offline() -> None:
    """Offline mode for huggingface_hub and datasets in this process (its modules' switches,
    not the environment: a child process probes for itself). `datasets` is not imported here
    (~4 s with pandas): imported later, its config copies huggingface_hub's switch."""
    try:
        import huggingface_hub.constants as hub_constants

        hub_constants.HF_HUB_OFFLINE = True
    except ImportError:
        pass
    datasets_config = sys.modules.get("datasets.config")
    if datasets_config is not None:
        datasets_config.HF_HUB_OFFLINE = datasets_config.HF_DATASETS_OFFLINE = True


def prepare_hub() -> bool:
    """Call before a Hub lookup; returns True when it will run offline (by the environment,
    or because the Hub could not be reached: no answer within 3 s, or refused at once)."""
    if offline_by_env():
        return True
    if not hub_reachable():
        set_offline()
        return True
    return False


def offline_note(offline: bool) -> str:
    """The hint to add to a failed lookup's message."""
    if offline and not _state.get("reachable", True):
        return (f" (the Hub at {os.environ.get('HF_ENDPOINT', 'https://huggingface.co')} "
                f"{_state.get('why', 'could not be reached')}, so only the local cache was "
                "searched; set HF_HUB_OFFLINE=1 to skip this check)")
    if offline:
        return " (HF_HUB_OFFLINE is set: only the local Hugging Face cache was searched)"
    return f" ({OFFLINE_HINT})"
