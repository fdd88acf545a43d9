"""The out-of-memory ceiling of a run: the smallest batch size that ran out of memory, and the
largest that has run below it.

Pure: no torch, no I/O. A run has one, owned by its back-pressure controller whether or not
back-pressure is enabled, and saved in the controller's state (keys `ceiling`, `ok_max`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class OomCeiling:
    failed: int | None = None   # smallest batch size that ran out of memory (None: none did)
    ok_max: int | None = None   # largest batch size that ran below `failed`

    def out_of_memory(self, b: int) -> None:
        self.failed = b if self.failed is None else min(self.failed, b)
        if self.ok_max is not None and self.ok_max >= self.failed:
            self.ok_max = None          # a size that once fit no longer does

    def ran(self, b: int) -> None:
        if (self.failed is None or b < self.failed) and b > (self.ok_max or 0):
            self.ok_max = b

    def largest(self, lo: int, hi: int) -> int:
        """Largest batch size in [lo, hi] below the ceiling (lo when even lo failed)."""
        if self.failed is None:
            return hi
        return max(lo, min(hi, self.failed - 1))

    def bound(self, b: int, lo: int, hi: int) -> int:
        """b within [lo, hi] and below the ceiling; a size above any that has run goes only
        halfway to the ceiling (bisection), so an increase costs at most one more failure."""
        b = min(max(b, lo), self.largest(lo, hi))
        if self.failed is not None and b > (self.ok_max or 0):
            known = self.ok_max or lo - 1
            b = min(b, max(known + 1, (known + self.failed) // 2, lo))
        return b
