"""Scenario registry: every scenario's ScenarioSpec, by name, read by every generic layer.

config (run keys, presets, validation, expectations), footprint, the runner (preset choice,
trial ids), the CLI (one command per scenario), the records (extra trial fields), the report
(lines, columns, charts) and the workers (which module to import) all ask the specs below.

A scenario is a spec (repro/scenarios/spec.py says what it holds) in a torch-free module and
`run(ctx: repro.rank.worker.WorkerContext) -> None` in the module the spec names. The built-in ones
are listed here; any installed package adds its own through the `repro.scenarios` entry-point
group (`name = "package.module:SPEC"`), read in every process, ranks included, so a plugin
scenario is known wherever the registry is.

nvfp4 (the NVFP4 reference), specdec (speculative bookkeeping) and compare (output against its
reference) are helpers the scenario modules share: torch, and no scenarios of their own.

This module stays torch-free: the parent imports it. Scenario modules import torch and touch
CUDA, so they are imported lazily, inside workers only (load_scenario).
"""

from __future__ import annotations

import importlib
import importlib.metadata
from types import ModuleType
from typing import Any

from repro.scenarios import (
    gemma4_mtp_spec,
    nvfp4_moe_spec,
    piecewise_split_spec,
    selftest_spec,
    sleep_wake_spec,
    workspace_grow_spec,
)
from repro.scenarios.spec import ScenarioSpec

# A scenario plugin's building blocks, importable from the registry's path too.
from repro.scenarios.spec import CpuCost, ModeSpec, RecordField, RunKeySpec, StepColumn  # noqa: F401

BUILTIN = (
    gemma4_mtp_spec.SPEC,
    nvfp4_moe_spec.SPEC,
    selftest_spec.SPEC,
    workspace_grow_spec.SPEC,
    sleep_wake_spec.SPEC,
    piecewise_split_spec.SPEC,
)
ENTRY_POINT_GROUP = "repro.scenarios"


def plugin_specs() -> list[ScenarioSpec]:
    return [ep.load() for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)]


def by_name(specs: list[ScenarioSpec]) -> dict[str, ScenarioSpec]:
    registry: dict[str, ScenarioSpec] = {}
    for spec in specs:
        if not isinstance(spec, ScenarioSpec):
            raise TypeError(f"entry point group {ENTRY_POINT_GROUP!r} gave {spec!r}, not a ScenarioSpec")
        if spec.name in registry:
            raise ValueError(
                f"scenario {spec.name!r} is registered twice ({registry[spec.name].module}, {spec.module}); rename one"
            )
        registry[spec.name] = spec
    return registry


SCENARIOS: dict[str, ScenarioSpec] = by_name([*BUILTIN, *plugin_specs()])

# Every scenario-only [run] key; a trial of another scenario must leave it off.
SCENARIO_RUN_KEYS = frozenset(k for s in SCENARIOS.values() for k in s.run_key_names)


def load_scenario(name: str) -> ModuleType:
    return importlib.import_module(SCENARIOS[name].module)


def record_fields() -> list[RecordField]:
    """Every scenario's extra trial fields, in registry order: every trial carries them all."""
    return [f for s in SCENARIOS.values() for f in s.record_fields]


def trial_measures(scenario: str, steps: list[Any]) -> dict[str, Any]:
    """The trial's values of every record field: its scenario's measures from its steps, None
    for what it did not measure and for other scenarios' fields."""
    measures: dict[str, Any] = {f.name: None for f in record_fields()}
    spec = SCENARIOS.get(scenario)
    if spec is not None and steps:
        measures.update(spec.measure(steps))
    return measures


def step_columns() -> list[StepColumn]:
    """Every scenario's steps-table columns; a trial shows those its steps recorded."""
    return [c for s in SCENARIOS.values() for c in s.step_columns]
