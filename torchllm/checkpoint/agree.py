"""How the Checkpointer's ranks agree: every decision that ranks could see differently (which
checkpoint loads, whether a save failed or finished) is gathered over a small gloo group of CPU
tensors, so ranks never hang or diverge and never sync a device for it."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


class RankAgreement:
    """Needs `self.group` (None in one process) and `self.world`."""

    def _gather(self, obj: Any) -> list:
        """Every rank's `obj`, on every rank (rank order)."""
        if self.group is None:
            return [obj]
        out = [None] * self.world
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def _all(self, flag: bool) -> bool:
        """True on every rank when `flag` is true on every rank."""
        if self.group is None:
            return flag
        t = torch.tensor([int(flag)])
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return bool(t.item())

    def _one(self, messages: list[str | None]) -> str | None:
        """The gathered messages as one line, each prefixed with the ranks that reported it."""
        by_text: dict[str, list[int]] = {}
        for r, m in enumerate(messages):
            if m:
                by_text.setdefault(m, []).append(r)
        if self.world == 1:
            return next(iter(by_text), None)
        return "; ".join(f"rank{'s' if len(rs) > 1 else ''} {','.join(map(str, rs))}: {m}"
                         for m, rs in by_text.items()) or None
