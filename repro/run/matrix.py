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
import fnmatch
import textwrap
from typing import Any

from repro.config import ConfigError, RunConfig, SCENARIOS, coerce, default_expectation, read_toml, resolve_preset_path
from repro.run.runner import Planned, plan, trial_id

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
    if "scenario" in data and "trial" not in data:
        raise ConfigError(
            f"{path}: a scenario preset (for {data['scenario']}), not a matrix; run it with "
            f"`repro {data['scenario']} --config {path_or_name}`, or give a matrix "
            "(`repro presets` lists them)"
        )
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
        planned[-1].index = i
    return str(head.get("description", path.stem)), planned


def planned_id(p: Planned) -> str:
    return trial_id(p.index or 0, p.cfg)


def matches(tid: str, pattern: str) -> bool:
    """A shell-style glob found anywhere in the trial id ('reload-safe', 'nvfp4*identity', '07-')."""
    return fnmatch.fnmatchcase(tid, f"*{pattern}*")


def select(planned: list[Planned], patterns: list[str], name: str) -> list[Planned]:
    """The trials whose id matches any pattern (all of them without patterns). Ids keep their
    index in the full matrix, so `--list` and a filtered run name a trial the same way."""
    if not patterns:
        return planned
    chosen = [p for p in planned if any(matches(planned_id(p), pat) for pat in patterns)]
    if not chosen:
        shown = " ".join(f"--only {pat!r}" for pat in patterns)
        raise ConfigError(
            f"{shown} matches none of the {len(planned)} trials of {name}; "
            f"`repro matrix --config {name} --list` shows their ids"
        )
    return chosen


NOT_HERE = "not here"


def listing(planned: list[Planned], width: int = 80) -> list[str]:
    """One line per trial: id, expected outcome, and where it would run ("not here": the
    trial would be UNSUPPORTED; each reason follows once, wrapped at `width`). Columns are
    as wide as their longest entry, so the gpu-2 matrix fits 80 characters."""
    ids = max(len(planned_id(p)) for p in planned)
    expects = max(len(default_expectation(p.cfg)) for p in planned)
    lines = [
        f"{planned_id(p):<{ids}} expect {default_expectation(p.cfg):<{expects}} {p.device or NOT_HERE}" for p in planned
    ]
    for reason in dict.fromkeys(p.reason for p in planned if p.device is None):
        count = sum(1 for p in planned if p.device is None and p.reason == reason)
        lines += textwrap.wrap(f"{NOT_HERE} ({count} trials, UNSUPPORTED): {reason}", width, subsequent_indent="  ")
    return lines
