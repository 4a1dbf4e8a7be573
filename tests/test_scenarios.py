"""The scenario registry (each scenario's spec) is the one place scenario facts live; the rest agrees with it."""

import dataclasses
import inspect
import os
import subprocess
import sys

import pytest

from conftest import REPO
from repro import config
from repro.run import runner
from repro.cli import app
from repro.scenarios import SCENARIOS, load_scenario, record_fields, trial_measures


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_module_mode_table_matches_the_registry(name):
    """Each scenario module's MODES (mode -> fix flags, built from its spec) has every mode with
    exactly the flags its Fixes declares."""
    spec, module = SCENARIOS[name], load_scenario(name)
    assert tuple(module.MODES) == spec.mode_names
    for mode in spec.modes:
        assert dataclasses.asdict(module.MODES[mode.name]) == mode.fixes, (name, mode.name)
    assert callable(module.run)


def test_spec_modules_stay_torch_free():
    """The parent imports every spec (the registry does); only the modules they name import torch."""
    code = (
        "import sys, repro.scenarios, repro.config, repro.run.footprint, repro.report.view, repro.report.charts\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m in "
        + repr([s.module for s in SCENARIOS.values()])
        + "))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert out.stdout.strip() == "[]"


def test_run_keys_keep_the_places_of_schema_1():
    """A trial's config lists its [run] keys in one order; the first scenarios' keys sit where
    reports of schema repro.report/1 always had them (RunKeySpec.after)."""
    names = [f.name for f in dataclasses.fields(config.RunConfig)]
    assert names[:10] == [
        "mode",
        "tp",
        "steps",
        "seed",
        "after_free",
        "guard",
        "device",
        "deadline_s",
        "stall_s",
        "forensics",
    ]
    assert names.index("reload_drafter") + 1 == names.index("num_speculative_tokens")
    assert names.index("num_speculative_tokens") + 1 == names.index("share_gpu")
    # identity_reload right after share_gpu, as schema 1 had it; later scenarios' keys after it,
    # in registry order, before expect.
    assert names.index("share_gpu") + 1 == names.index("identity_reload")
    assert names[-4:] == ["identity_reload", "resize_in_place", "sleep_level", "expect"]


def test_every_trial_carries_every_record_field():
    """Other scenarios' fields are null, so every trial of a report has the same keys."""
    names = [f.name for f in record_fields()]
    assert names == ["acceptance_rate", "mean_accepted_length", "lossless", "tokens_per_s"]
    assert trial_measures("selftest", []) == dict.fromkeys(names)
    assert trial_measures("gemma4-mtp", []) == dict.fromkeys(names)


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_presets_named_by_the_registry_are_for_that_scenario(name):
    spec = SCENARIOS[name]
    for preset in {spec.default_preset, spec.cpu_preset}:
        cfg = config.validate(config.load_preset(preset, name))
        assert isinstance(cfg.model, spec.dims) and cfg.run.mode in spec.mode_names


def test_run_keys_are_run_config_fields_and_off_by_default():
    fields = {f.name: f.default for f in dataclasses.fields(config.RunConfig)}
    for key in config.SCENARIO_RUN_KEYS:
        assert fields[key] is False or fields[key] == 0  # a switch off, or "the scenario's default"


def test_cli_has_one_command_per_scenario_with_its_modes_and_run_keys():
    commands = {c.name: c for c in app.registered_commands}
    for spec in SCENARIOS.values():
        assert spec.name in commands
        if not spec.command:
            continue
        params = set(inspect.signature(commands[spec.name].callback).parameters)
        assert set(spec.run_key_names) <= params
        assert ("tp" in params) == spec.tensor_parallel
        others = config.SCENARIO_RUN_KEYS - set(spec.run_key_names)
        assert not others & params, f"{spec.name} offers another scenario's run key"


def test_trial_id_tags_come_from_the_registry():
    cfg = config.validate(config.apply_overrides(config.load_preset("gemma4-tiny"), {"reload_drafter": True}, []))
    assert runner.trial_id(3, cfg) == "03-gemma4-mtp-unfixed-tp2-release-reload"
    # A number's tag carries its value (the switch-only rule would leave the level out).
    cfg = config.validate(config.apply_overrides(config.load_preset("sleep-wake-tiny"), {"sleep_level": 2}, []))
    assert runner.trial_id(0, cfg) == "00-sleep-wake-unfixed-tp1-reuse-level2"
