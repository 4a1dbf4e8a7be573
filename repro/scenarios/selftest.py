"""Harness self-test: every step all-gathers a small tensor across ranks (gloo or NCCL).

No CUDA graph and no bug: it exists so the process isolation (deadlines, a rank dying while
its peer waits in a collective, segfaults, SIGKILL) can be exercised on any machine.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from repro.rank.dist import all_gather_dim0
from repro.outcome import StepRecord
from repro.scenarios.selftest_spec import SPEC

if TYPE_CHECKING:
    from repro.rank.worker import WorkerContext


@dataclass(frozen=True)
class Fixes:
    """No bug, so nothing to fix: the one mode has no flags."""


# The fix flags of each mode are the spec's (ModeSpec.fixes); Fixes names and documents them.
MODES = {m.name: Fixes(**m.fixes) for m in SPEC.modes}


def run(ctx: WorkerContext) -> None:
    for step in range(ctx.cfg.run.steps):
        ctx.begin_step(step)
        start = time.perf_counter()
        mine = torch.full((4,), float(ctx.rank + step), device=ctx.device)
        gathered = all_gather_dim0(mine, ctx.tp)  # [world*4]
        expected = torch.cat([torch.full((4,), float(r + step)) for r in range(ctx.tp.world_size)])
        wrong = int((gathered.cpu() != expected).sum())
        ctx.step(
            StepRecord(
                step=step,
                rank=ctx.rank,
                batch=4,
                replayed=False,
                numel=gathered.numel(),
                compared=gathered.numel(),
                mismatches=wrong,
                seconds=time.perf_counter() - start,
                label="all-gather",
            )
        )
