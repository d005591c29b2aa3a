"""How the Checkpointer's ranks agree: every decision that ranks could see differently (which
checkpoint loads, whether a save failed or finished) is gathered over a small gloo group of CPU
tensors, so ranks never hang or diverge and never sync a device for it."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


class RankAgreement:
    """Agreement over `group` (None in one process) of `world` ranks; `rank` is this one."""

    def __init__(self, group, world: int, rank: int):
        self.group, self.world, self.rank = group, world, rank

    @classmethod
    def of_this_job(cls) -> RankAgreement:
        """A gloo group of every rank (training's own group never carries these)."""
        if not dist.is_initialized():
            return cls(None, 1, 0)
        return cls(dist.new_group(backend="gloo"), dist.get_world_size(), dist.get_rank())

    def gather(self, obj: Any) -> list:
        """Every rank's `obj`, on every rank (rank order)."""
        if self.group is None:
            return [obj]
        out = [None] * self.world
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def all(self, flag: bool) -> bool:
        """True on every rank when `flag` is true on every rank."""
        if self.group is None:
            return flag
        t = torch.tensor([int(flag)])
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return bool(t.item())

    def one(self, messages: list[str | None]) -> str | None:
        """The gathered messages as one line, each prefixed with the ranks that reported it."""
        by_text: dict[str, list[int]] = {}
        for r, m in enumerate(messages):
            if m:
                by_text.setdefault(m, []).append(r)
        if self.world == 1:
            return next(iter(by_text), None)
        return "; ".join(f"rank{'s' if len(rs) > 1 else ''} {','.join(map(str, rs))}: {m}"
                         for m, rs in by_text.items()) or None

    def first_answer(self, obj: Any) -> Any:
        """Rank 0's `obj`, on every rank (the others pass anything)."""
        return self.gather(obj)[0]
