"""GPU memory promised to the trials running at once (`repro matrix --jobs N` on CUDA).

Concurrent trials share the GPUs (repro/run/runner.py rotates each job slot's CUDA_VISIBLE_DEVICES
so TP=1 trials spread over them). Without a ledger, four trials that each grow to tens of GiB
start together and the later allocations fail with an out-of-memory error that belongs to the
neighbours, not to the trial: a wrong verdict. So a CUDA trial first claims the memory its
scenario expects one rank to reach (ScenarioSpec.peak, else the footprint) on every GPU its
ranks use, and waits while that does not fit beside what the running trials were promised.
A trial alone on its GPUs is never held back (the footprint check refuses what cannot fit at
all), and claims are served in the order they were made, so a large trial is not starved by
small ones behind it.

Torch-free (the parent's): the totals come from NVML (repro/env/gpus.py).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

# Of each GPU's total, what the ledger hands out: the CUDA context of every process (~0.5 GiB
# each on an H200), the allocator's rounding and fragmentation are not in the estimates.
USABLE = 0.9
POLL_S = 0.2


@dataclass
class Claim:
    need: dict[int, int]  # GPU (index among the visible ones) -> bytes promised
    waited_s: float = 0.0
    ticket: int = 0


@dataclass
class MemoryLedger:
    totals: list[int]  # bytes of each visible GPU, in CUDA order
    promised: dict[int, int] = field(default_factory=dict)
    holders: dict[int, int] = field(default_factory=dict)  # GPU -> running trials on it
    _next: int = 0  # the next ticket handed out
    _serving: list[int] = field(default_factory=list)  # tickets waiting, oldest first
    _cond: threading.Condition = field(default_factory=threading.Condition)

    def capacity(self, gpu: int) -> int:
        return int(self.totals[gpu] * USABLE)

    def fits(self, need: dict[int, int]) -> bool:
        return all(
            self.holders.get(g, 0) == 0 or self.promised.get(g, 0) + n <= self.capacity(g) for g, n in need.items()
        )

    def claim(self, need: dict[int, int], stop: threading.Event | None = None) -> Claim | None:
        """Wait until `need` fits (or nothing runs on those GPUs), then promise it; None when
        `stop` was set while waiting (nothing promised)."""
        need = {g: n for g, n in need.items() if 0 <= g < len(self.totals)}
        started = time.monotonic()
        with self._cond:
            ticket, self._next = self._next, self._next + 1
            self._serving.append(ticket)
            try:
                while self._serving[0] != ticket or not self.fits(need):
                    if stop is not None and stop.is_set():
                        return None
                    self._cond.wait(POLL_S)
            finally:
                self._serving.remove(ticket)
                self._cond.notify_all()
            for g, n in need.items():
                self.promised[g] = self.promised.get(g, 0) + n
                self.holders[g] = self.holders.get(g, 0) + 1
        return Claim(need, time.monotonic() - started, ticket)

    def release(self, claim: Claim) -> None:
        with self._cond:
            for g, n in claim.need.items():
                self.promised[g] -= n
                self.holders[g] -= 1
            self._cond.notify_all()


def trial_gpus(slot: int, lanes: int, tp: int, share_gpu: bool) -> list[int]:
    """The visible GPU of each rank of a trial in job slot `slot` (runner.lane_env rotates the
    GPUs by the slot; rank r takes the r-th of them, or the first when the ranks share it)."""
    if lanes <= 0:
        return []
    first = slot % lanes
    return [first] * tp if share_gpu else [(first + r) % lanes for r in range(tp)]


def need_on(gpus: list[int], per_rank: int) -> dict[int, int]:
    """Bytes per GPU for ranks placed on `gpus` that each expect `per_rank`."""
    need: dict[int, int] = {}
    for g in gpus:
        need[g] = need.get(g, 0) + per_rank
    return need
