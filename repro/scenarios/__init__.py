"""Scenario registry: every scenario's ScenarioSpec, by name, read by every generic layer.

config (run keys, presets, validation, expectations), footprint, the runner (preset choice,
trial ids), the CLI (one command per scenario), the report (run keys) and the workers (which
module to import) all ask the specs below.

A scenario is a spec (repro/scenarios/spec.py says what it holds) in a torch-free module and
`run(ctx: repro.worker.WorkerContext) -> None` in the module the spec names, plus one entry in
BUILTIN.

This module stays torch-free: the parent imports it. Scenario modules import torch and touch
CUDA, so they are imported lazily, inside workers only (load_scenario).
"""
from __future__ import annotations

import importlib
from types import ModuleType

from repro.scenarios import gemma4_mtp_spec, nvfp4_moe_spec, selftest_spec
from repro.scenarios.spec import ModeSpec, RunKeySpec, ScenarioSpec  # noqa: F401

BUILTIN = (gemma4_mtp_spec.SPEC, nvfp4_moe_spec.SPEC, selftest_spec.SPEC)
SCENARIOS: dict[str, ScenarioSpec] = {s.name: s for s in BUILTIN}

# Every scenario-only [run] key; a trial of another scenario must leave it off.
SCENARIO_RUN_KEYS = frozenset(k for s in SCENARIOS.values() for k in s.run_key_names)


def load_scenario(name: str) -> ModuleType:
    return importlib.import_module(SCENARIOS[name].module)

