"""Config loading, overrides and validation: every bad input is one ConfigError line."""

import pytest

from repro.config import ConfigError, apply_overrides, default_expectation, load_preset, parse_set, validate
from repro.outcome import Outcome, parse_expectation
from repro.scenarios.gemma4_mtp_spec import Gemma4Dims
from repro.scenarios.nvfp4_moe_spec import MoeDims


def write(tmp_path, text, name="c.toml"):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def test_real_presets_validate():
    e2b = validate(load_preset("gemma4-e2b"))
    assert isinstance(e2b.model, Gemma4Dims)
    assert (e2b.model.vocab_size, e2b.model.hidden_size, e2b.model.num_centroids, e2b.model.centroid_top_k) == (
        262144,
        256,
        2048,
        32,
    )
    assert e2b.model.batch_sizes == [1, 2, 4, 8, 16, 32, 64]
    assert e2b.run.after_free == "release"
    assert validate(load_preset("gemma4-e4b")).model.backbone_hidden_size == 2560


def test_scenario_default_after_free_filled():
    cfg = validate(load_preset("gemma4-tiny"))
    assert cfg.run.after_free == "release"


def test_overrides_and_set():
    cfg = apply_overrides(
        load_preset("gemma4-tiny"), {"tp": 3, "steps": None, "mode": "fixed"}, ["model.vocab_size=8000", "run.seed=5"]
    )
    cfg = validate(cfg)
    assert (cfg.run.tp, cfg.run.mode, cfg.model.vocab_size, cfg.run.seed) == (3, "fixed", 8000, 5)
    assert cfg.run.steps == load_preset("gemma4-tiny").run.steps  # None = not given


def test_overrides_do_not_mutate_preset_object():
    base = load_preset("gemma4-tiny")
    apply_overrides(base, {"tp": 4}, ["model.hidden_size=32"])
    assert base.run.tp == 2 and base.model.hidden_size == 64


def test_parse_set_reads_toml_values():
    assert parse_set("model.batch_sizes=[1,2]") == ("model", "batch_sizes", [1, 2])
    assert parse_set("run.mode=fixed") == ("run", "mode", "fixed")


def test_round_trip_dict():
    from repro.config import TrialConfig

    cfg = validate(load_preset("gemma4-tiny"))
    assert TrialConfig.from_dict(cfg.to_dict()).to_dict() == cfg.to_dict()


BAD = [
    ("unknown key", "[run]\nstepz = 3", "unknown key [run].stepz"),
    ("wrong type", '[run]\nsteps = "five"', "must be an integer"),
    ("negative steps", "[run]\nsteps = -1", "steps = -1 must be >= 1"),
    ("zero tp", "[run]\ntp = 0", "tp = 0 must be >= 1"),
    ("unknown mode", '[run]\nmode = "halfway"', "mode = 'halfway' is not one of unfixed, fixed, reload-safe"),
    ("unknown after_free", '[run]\nafter_free = "shred"', "after_free = 'shred' is not one of"),
    ("vocab not divisible", "[model]\nvocab_size = 4001", "not divisible by model.num_centroids"),
    ("top_k too large", "[model]\ncentroid_top_k = 4096", "exceeds model.num_centroids"),
    ("batch sizes unsorted", "[model]\nbatch_sizes = [4, 2]", "strictly increasing"),
    ("bool for int", "[run]\nseed = true", "must be an integer"),
    ("negative deadline", "[run]\ndeadline_s = -3", "deadline_s = -3.0 must be > 0"),
    ("unknown guard", '[run]\nguard = "loud"', "guard = 'loud' is not one of off, warn, raise"),
    ("wrong lifecycle key", "[run]\nidentity_reload = true", "identity_reload does not apply to gemma4-mtp"),
    ("bad expectation", '[run]\nexpect = "works"', "expectation 'works' is not one of"),
    ("bad dtype", '[model]\ndtype = "int4"', "model.dtype = 'int4'"),
]


@pytest.mark.parametrize("name,body,needle", BAD, ids=[b[0] for b in BAD])
def test_bad_inputs_name_key_value_and_allowed(tmp_path, name, body, needle):
    path = write(tmp_path, 'scenario = "gemma4-mtp"\n' + body + "\n")
    with pytest.raises(ConfigError) as e:
        validate(load_preset(path))
    msg = str(e.value)
    assert needle in msg
    assert "\n" not in msg
    assert str(tmp_path) in msg  # names the file


def test_missing_file():
    with pytest.raises(ConfigError, match="does not exist"):
        load_preset("/nonexistent/x.toml")


def test_unknown_preset_lists_known():
    with pytest.raises(ConfigError, match="known: .*gemma4-e2b"):
        load_preset("gemma5")


def test_malformed_toml(tmp_path):
    with pytest.raises(ConfigError, match="malformed TOML"):
        load_preset(write(tmp_path, 'scenario = "gemma4-mtp"\n[run\nsteps = 1'))


def test_unknown_scenario(tmp_path):
    with pytest.raises(ConfigError, match="scenario = 'llama' is not one of"):
        load_preset(write(tmp_path, 'scenario = "llama"\n'))


def test_preset_for_other_scenario():
    with pytest.raises(ConfigError, match="preset is for scenario 'gemma4-mtp', not 'nvfp4-reload'"):
        load_preset("gemma4-tiny", scenario="nvfp4-reload")


def test_bad_set_syntax():
    with pytest.raises(ConfigError, match="expected SECTION.KEY=VALUE"):
        apply_overrides(load_preset("gemma4-tiny"), {}, ["tp2"])
    with pytest.raises(ConfigError, match=r"unknown key \[model\].vocab"):
        apply_overrides(load_preset("gemma4-tiny"), {}, ["model.vocab=3"])


def test_moe_k_must_be_multiple_of_16(tmp_path):
    path = write(tmp_path, 'scenario = "nvfp4-reload"\n[model]\nhidden_size = 100\n')
    with pytest.raises(ConfigError, match="hidden_size = 100 is not a multiple of 16"):
        validate(load_preset(path))
    assert isinstance(load_preset(write(tmp_path, 'scenario = "nvfp4-reload"\n', "m.toml")).model, MoeDims)


def test_default_expectations():
    def exp(mode, **run):
        cfg = validate(apply_overrides(load_preset("gemma4-tiny"), {"mode": mode, **run}, []))
        return parse_expectation(default_expectation(cfg))

    assert Outcome.ILLEGAL_ADDRESS in exp("unfixed") and Outcome.CLEAN not in exp("unfixed")
    assert exp("unfixed", tp=1) == [Outcome.CLEAN]  # TP=1 control
    assert exp("fixed") == [Outcome.CLEAN]
    assert Outcome.ILLEGAL_ADDRESS in exp("fixed", reload_drafter=True)  # upstream fix breaks on reload
    assert exp("reload-safe", reload_drafter=True) == [Outcome.CLEAN]
    assert exp("fixed", expect="NONFINITE,MISMATCH") == [Outcome.MISMATCH, Outcome.NONFINITE]


def test_parse_expectation_rejects_empty():
    with pytest.raises(ValueError):
        parse_expectation(" , ")
