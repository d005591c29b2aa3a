"""`opt()`: a config field with its default and one-line help (the help feeds --help and docs);
`Range`: the values a float field allows (checked for every float key when the config loads)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Range:
    """Finite numbers from `lo` to `hi` (open ends where said), plus the values in `also`
    (e.g. 0 = off). nan and inf are never in a Range: a float key that meant "off" or "no limit"
    by inf says so with a finite value instead. `text` overrides the generated description."""

    lo: float = -math.inf
    hi: float = math.inf
    lo_open: bool = False
    hi_open: bool = False
    also: tuple[float, ...] = ()
    text: str = ""

    def __contains__(self, x: float) -> bool:
        if x in self.also:
            return True
        if not math.isfinite(x):
            return False
        above = x > self.lo if self.lo_open else x >= self.lo
        below = x < self.hi if self.hi_open else x <= self.hi
        return above and below

    def __str__(self) -> str:
        if self.text:
            return self.text
        lo, hi = math.isfinite(self.lo), math.isfinite(self.hi)
        if lo and hi:
            return (f"in {'(' if self.lo_open else '['}{self.lo:g}, "
                    f"{self.hi:g}{')' if self.hi_open else ']'}")
        if lo:
            return f"{'>' if self.lo_open else '>='} {self.lo:g} and finite"
        if hi:
            return f"{'<' if self.hi_open else '<='} {self.hi:g} and finite"
        return "a finite number"


ANY = Range()
POSITIVE = Range(lo=0, lo_open=True)
NON_NEGATIVE = Range(lo=0)
FRACTION = Range(0, 1)  # [0, 1]
BELOW_ONE = Range(0, 1, hi_open=True)  # [0, 1): betas, momentum, dropout, held-out fractions


def opt(default, help: str, allowed: Range | None = None):
    """A dataclass field with a default and a help string (lists get a default_factory).

    `allowed`: the Range of a float field (float fields must declare one; tests check)."""
    metadata = {"help": help} if allowed is None else {"help": help, "allowed": allowed}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=metadata)
    return field(default=default, metadata=metadata)
