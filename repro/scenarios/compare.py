"""A scenario's output against its reference, element by element (torch side: the ranks).

One rule for every scenario that compares numbers: an element is wrong when
|y - y_ref| > tolerance * (|y_ref| + rms(y_ref)); the rms term keeps near-zero outputs from
counting on rounding alone. Each scenario picks its tolerance and says why (nvfp4-reload:
nvfp4_moe.TOLERANCE; piecewise-split: piecewise_split.TOLERANCE; workspace-grow:
workspace_grow.TOLERANCE). Non-finite elements are
counted apart, never as mismatches; a non-finite reference is a harness bug and raises.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor


@dataclass
class Comparison:
    numel: int
    nonfinite: int
    compared: int  # finite elements compared with the reference
    mismatches: int  # finite elements beyond the tolerance (elementwise count)
    max_abs_err: float | None
    rel_err: float | None  # ||y - y_ref|| / ||y_ref|| over the finite elements
    max_scaled_err: float | None  # max |y - y_ref| / (|y_ref| + rms(y_ref)): vs the tolerance

    def step_fields(self) -> dict[str, Any]:
        """What a StepRecord takes of it: StepRecord(..., **cmp.step_fields(), ...)."""
        return {
            "numel": self.numel,
            "nonfinite": self.nonfinite,
            "compared": self.compared,
            "mismatches": self.mismatches,
            "max_abs_err": self.max_abs_err,
            "rel_err": self.rel_err,
        }


def compare(out: Tensor, ref: Tensor, tolerance: float) -> Comparison:
    """out, ref [T, D]; elementwise bound tolerance * (|ref| + rms(ref))."""
    y, r = out.double(), ref.double()
    if not bool(torch.isfinite(r).all()):
        raise RuntimeError("the reference produced non-finite output: a harness bug, not the scenario's")
    finite = torch.isfinite(y)
    compared = int(finite.sum())
    diff = torch.where(finite, y - r, torch.zeros_like(y))
    rms = r.pow(2).mean().sqrt()
    scaled = diff.abs() / (r.abs() + rms.clamp_min(1e-30))
    beyond = (scaled > tolerance) & finite
    ref_norm = float(torch.where(finite, r, torch.zeros_like(r)).norm())
    return Comparison(
        numel=y.numel(),
        nonfinite=y.numel() - compared,
        compared=compared,
        mismatches=int(beyond.sum()),
        max_abs_err=float(diff.abs().max()) if compared else None,
        rel_err=(float(diff.norm()) / ref_norm if ref_norm > 0 else 0.0) if compared else None,
        max_scaled_err=float(scaled.max()) if compared else None,
    )
