"""The scenario registry is the one place scenario facts live; everything else agrees with it."""
import dataclasses
import inspect

import pytest

from repro import config, runner
from repro.cli import app
from repro.scenarios import SCENARIOS, load_scenario


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_module_mode_table_matches_the_registry(name):
    """Each scenario module's own MODES (mode -> fix flags) is what its registry entry says."""
    spec, module = SCENARIOS[name], load_scenario(name)
    assert tuple(module.MODES) == spec.mode_names
    for mode in spec.modes:
        assert dataclasses.asdict(module.MODES[mode.name]) == mode.fixes, (name, mode.name)
    assert callable(module.run)


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_presets_named_by_the_registry_are_for_that_scenario(name):
    spec = SCENARIOS[name]
    for preset in {spec.default_preset, spec.cpu_preset}:
        cfg = config.validate(config.load_preset(preset, name))
        assert isinstance(cfg.model, spec.dims) and cfg.run.mode in spec.mode_names


def test_run_keys_are_run_config_fields_and_off_by_default():
    fields = {f.name: f.default for f in dataclasses.fields(config.RunConfig)}
    for key in config.SCENARIO_RUN_KEYS:
        assert fields[key] is False or fields[key] == 0     # a switch off, or "the scenario's default"


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

