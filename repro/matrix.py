"""`repro matrix`: every scenario x mode x lifecycle with its expected outcome, from one TOML file.

    [matrix]                     # defaults for every trial
    description = "..."
    device = "cpu"               # any [run] key
    [[trial]]
    scenario = "gemma4-mtp"
    preset = "gemma4-tiny"
    mode = "unfixed"             # any other [run] key: tp, after_free, reload_drafter, expect, ...
    expect = "STALE_CAPTURE"
"""
from __future__ import annotations

import dataclasses
from typing import Any

from repro.config import ConfigError, RunConfig, SCENARIOS, coerce, read_toml, resolve_preset_path
from repro.runner import Planned, plan

TRIAL_KEYS = {"scenario", "preset", "set"}


def run_overrides(table: dict[str, Any], where: str) -> dict[str, Any]:
    defaults = RunConfig()
    allowed = [f.name for f in dataclasses.fields(RunConfig)]
    out = {}
    for key, value in table.items():
        if key in TRIAL_KEYS or key == "description":
            continue
        if key not in allowed:
            raise ConfigError(f"{where}: unknown key {key!r}; allowed: scenario, preset, set, {', '.join(allowed)}")
        out[key] = coerce(where, key, value, getattr(defaults, key))
    return out


def load_matrix(path_or_name: str, gpus: int) -> tuple[str, list[Planned]]:
    path = resolve_preset_path(path_or_name)
    data = read_toml(path)
    unknown = set(data) - {"matrix", "trial"}
    if unknown:
        raise ConfigError(f"{path}: unknown top-level key {sorted(unknown)[0]!r}; allowed: [matrix], [[trial]]")
    head = data.get("matrix", {})
    trials = data.get("trial", [])
    if not isinstance(trials, list) or not trials:
        raise ConfigError(f"{path}: no [[trial]] entries; a matrix needs at least one")
    base = run_overrides(head, f"{path} [matrix]")
    planned = []
    for i, t in enumerate(trials):
        where = f"{path} [[trial]] #{i + 1}"
        scenario = t.get("scenario")
        if scenario not in SCENARIOS:
            raise ConfigError(f"{where}: scenario = {scenario!r} is not one of {', '.join(SCENARIOS)}")
        sets = t.get("set", [])
        if not isinstance(sets, list):
            raise ConfigError(f"{where}: set must be a list of 'SECTION.KEY=VALUE' strings")
        try:
            planned.append(plan(scenario, t.get("preset"), {**base, **run_overrides(t, where)}, sets, gpus))
        except ConfigError as e:
            raise ConfigError(f"{where}: {e}") from None
    return str(head.get("description", path.stem)), planned
