"""The run's first collective: one all-reduce that turns a misconfigured network (a hang, an
NCCL error, a transport that corrupts data) into one error naming the settings to check."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

NCCL_HINT = (
    "check the network settings NCCL uses: NCCL_P2P_DISABLE=1 (GPUs without NVLink/P2P "
    "between them), NCCL_IB_DISABLE=1 (no InfiniBand: use TCP sockets), NCCL_SOCKET_IFNAME=<iface> "
    "(the interface the nodes reach each other on, e.g. eth0; see `ip addr`), and NCCL_DEBUG=INFO "
    "for NCCL's own log; `python -m torchllm.tools.env_check` prints what this node has"
)


class FirstCollectiveError(RuntimeError):
    """The first collective of a run timed out or failed: usually the network, not the code."""


def first_collective(device: torch.device, timeout_s: float, group=None) -> None:
    """All-reduce one number over `group` (default: the world) as the run's first collective.

    A misconfigured network shows up here as a hang or an NCCL error; this turns both into a
    FirstCollectiveError after `timeout_s` seconds that names the settings to check
    (NCCL_HINT). The caller owns the timeout (e.g. a config value); it is not read here.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return
    size = dist.get_world_size(group)
    where = f"rank {dist.get_rank()} of {dist.get_world_size()}, backend {dist.get_backend(group)}"
    try:
        t = torch.ones(1, device=device)
        work = dist.all_reduce(t, group=group, async_op=True)
        deadline = time.monotonic() + timeout_s
        while not work.is_completed():
            if time.monotonic() > deadline:
                raise FirstCollectiveError(
                    f"the first all-reduce ({where}) did not complete in {timeout_s:g} s: a rank "
                    f"is missing or the ranks cannot reach each other; {NCCL_HINT}")
            time.sleep(0.01)
        work.wait()
        total = t.item()
    except FirstCollectiveError:
        raise
    except Exception as e:  # NCCL/gloo errors: "unhandled system error", connection refused...
        raise FirstCollectiveError(f"the first all-reduce ({where}) failed: {e}; {NCCL_HINT}"
                                   ) from e
    if total != size:
        raise FirstCollectiveError(
            f"the first all-reduce ({where}) summed {size} ones to {total:g}: the transport "
            f"corrupts data; {NCCL_HINT}")
