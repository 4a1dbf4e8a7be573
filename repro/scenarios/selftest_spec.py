"""selftest's facts for the parent: no model, one mode, no bug.

Torch-free (the parent imports it); the ranks' code is repro/scenarios/selftest.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from repro.scenarios.spec import ModeSpec, ScenarioSpec


@dataclass
class SelftestDims:
    """The harness self-test has no model; one field so presets stay uniform."""

    dtype: str = "float32"


SPEC = ScenarioSpec(
    name="selftest",
    module="repro.scenarios.selftest",
    modes=(ModeSpec("clean", {}, "no bug: ranks all-gather every step"),),
    default_after_free="keep",
    dims=SelftestDims,
    default_preset="selftest",
    cpu_preset="selftest",
    help="Check the harness itself: ranks all-gather every step; no graphs, no bug.",
    steps_help="Steps: each all-gathers across the ranks.",
    # One mode; no weights or inputs to seed; no capture, so nothing freed under it to
    # guard, poison or trace.
    unused_run_keys=("mode", "seed", "after_free", "guard", "forensics"),
)
