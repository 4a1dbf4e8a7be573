"""Trial configuration: TOML presets -> dataclasses, CLI overrides, validation.

A preset file names its scenario, a [model] table (real model dimensions) and a [run]
table (mode, tp, steps, ...). Every validation error is a ConfigError whose text is one
line naming the file, the key, the bad value and what is allowed; the CLI prints it and
exits 2.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import math
import os
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# The scenario facts live in the registry; re-exported here for config's readers.
from repro.outcome import AfterFreeKnob, Device, GuardMode, parse_expectation
from repro.scenarios import SCENARIO_RUN_KEYS, SCENARIOS, ScenarioSpec  # noqa: F401

# The presets ship inside the package (a wheel install has them too); they are plain TOML files
# on disk, so `repro presets NAME` can show them and users can copy one and pass --config FILE.
CONFIG_DIR = Path(os.environ.get("REPRO_CONFIGS") or str(importlib.resources.files("repro") / "configs"))

# Collective timeouts are set past the deadline (a timedelta, in int milliseconds inside torch);
# a week is far beyond any trial and far inside what those can hold.
MAX_DEADLINE_S = 7 * 24 * 3600.0


class ConfigError(ValueError):
    """A bad config or flag: one line, exit code 2."""


@dataclass
class CommonRun:
    """The [run] keys of every scenario; RunConfig adds each scenario's own (RunKeySpec)."""

    mode: str = "unfixed"
    tp: int = 1
    steps: int = 8
    seed: int = 0
    # The closed sets below hold plain strings, their enum's values: coerce types a value by its
    # default's type, and the records keep the same JSON.
    after_free: str = ""  # an AfterFreeKnob; "" -> the scenario's default
    guard: str = GuardMode.WARN.value  # a GuardMode
    device: str = Device.AUTO.value  # a Device
    deadline_s: float = 180.0  # the whole trial's budget: past it, DEADLINE (or HANG if stuck)
    stall_s: float = 60.0  # no record from any rank this long: HANG (the progress watchdog)
    forensics: bool = False
    share_gpu: bool = False  # TP ranks share one GPU over gloo (NCCL refuses two ranks on one GPU)
    expect: str = ""  # "" -> unfixed: reproduced, otherwise clean


def run_fields(specs: list[ScenarioSpec]) -> list[tuple[str, Any, Any]]:
    """CommonRun's fields with every scenario's run keys, each after its RunKeySpec.after key
    (and after the scenario keys already placed there), so a trial's config lists its [run]
    keys in the order schema repro.report/1 fixed."""
    common = [f.name for f in dataclasses.fields(CommonRun)]
    fields: list[tuple[str, Any, Any]] = [
        (f.name, f.type, dataclasses.field(default=f.default)) for f in dataclasses.fields(CommonRun)
    ]
    for key in (k for s in specs for k in s.run_keys):
        at = [name for name, _, _ in fields].index(key.after) + 1
        while at < len(fields) and fields[at][0] not in common:
            at += 1
        fields.insert(at, (key.name, key.type, dataclasses.field(default=key.type())))
    return fields


# One dataclass for every [run] key, the scenarios' too: presets, --set, matrices and trial
# records treat them alike, and a trial of another scenario carries them off (validate checks).
RunConfig = dataclasses.make_dataclass("RunConfig", run_fields(list(SCENARIOS.values())))
RunConfig.__module__ = __name__  # pickles (Ray) find it here; make_dataclass takes no module= before 3.12


@dataclass
class TrialConfig:
    scenario: str
    preset: str  # preset name or path it came from
    model: Any  # the scenario's dims (ScenarioSpec.dims)
    run: RunConfig

    def to_dict(self) -> dict[str, Any]:
        return {
            "scenario": self.scenario,
            "preset": self.preset,
            "model": dataclasses.asdict(self.model),
            "run": dataclasses.asdict(self.run),
        }

    @staticmethod
    def from_dict(d: dict[str, Any]) -> "TrialConfig":
        spec = SCENARIOS[d["scenario"]]
        return TrialConfig(
            scenario=d["scenario"], preset=d["preset"], model=spec.dims(**d["model"]), run=RunConfig(**d["run"])
        )


def bare_config(spec: ScenarioSpec) -> TrialConfig:
    """A scenario that names no preset: its dims' defaults, its first mode, the common [run] defaults."""
    return TrialConfig(scenario=spec.name, preset="", model=spec.dims(), run=RunConfig(mode=spec.mode_names[0]))


def resolve_preset_path(name_or_path: str) -> Path:
    """A preset name ('gemma4-e2b') or a path to a TOML file."""
    p = Path(name_or_path)
    if p.is_dir():
        raise ConfigError(
            f"config {name_or_path} is a directory; give a preset name (`repro presets` lists them) or a TOML file"
        )
    if p.suffix == ".toml" or p.parent != Path("."):
        if not p.is_file():
            raise ConfigError(f"config file {name_or_path} does not exist")
        return p
    candidate = CONFIG_DIR / f"{name_or_path}.toml"
    if not candidate.is_file():
        known = ", ".join(preset_names())
        raise ConfigError(f"config preset {name_or_path!r} not found in {CONFIG_DIR}; known: {known}")
    return candidate


def preset_names() -> list[str]:
    return sorted(f.stem for f in CONFIG_DIR.glob("*.toml"))


def describe_presets(limit: int = 44) -> list[tuple[str, str, str]]:
    """(name, what it is for: a scenario or 'matrix', its description's first sentence, cut at
    `limit` characters: what the listing has room for)."""
    rows = []
    for name in preset_names():
        data = read_toml(CONFIG_DIR / f"{name}.toml")
        kind = data.get("scenario") or ("matrix" if "trial" in data else "?")
        text = " ".join(str(data.get("description") or data.get("matrix", {}).get("description") or "").split())
        rows.append((name, kind, first_sentence(text, limit)))
    return rows


def first_sentence(text: str, limit: int = 44) -> str:
    """Up to `limit` characters, cut at a word, so a listing fits 80 columns."""
    head = text.split(". ", 1)[0].rstrip(".")
    if len(head) <= limit:
        return head
    return head[: limit - 3].rsplit(" ", 1)[0].rstrip(" ,;:(") + "..."


def read_toml(path: Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: malformed TOML: {e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"{path}: not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start}); "
            "TOML files must be UTF-8: re-save it as UTF-8"
        ) from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror}") from None


def _type_name(t: Any) -> str:
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(t, str(t))


def coerce(where: str, key: str, value: Any, default: Any) -> Any:
    """Check a TOML (or --set) value against the type of the dataclass default."""
    expected = type(default)
    if isinstance(default, list):
        if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            raise ConfigError(f"{where}: {key} = {value!r} must be a list of integers")
        return list(value)
    if expected is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: {key} = {value!r} must be true or false")
        return value
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, bool) or not isinstance(value, expected):
        raise ConfigError(f"{where}: {key} = {value!r} must be {_type_name(expected)}")
    return value


def fill(cls: type, table: dict[str, Any], where: str, section: str) -> Any:
    obj = cls()
    allowed = [f.name for f in dataclasses.fields(cls)]
    for key, value in table.items():
        if key not in allowed:
            raise ConfigError(f"{where}: unknown key [{section}].{key}; allowed: {', '.join(allowed)}")
        setattr(obj, key, coerce(where, f"[{section}].{key}", value, getattr(obj, key)))
    return obj


def load_preset(name_or_path: str, scenario: str | None = None) -> TrialConfig:
    path = resolve_preset_path(name_or_path)
    where = str(path)
    data = read_toml(path)
    unknown = set(data) - {"scenario", "description", "model", "run"}
    if "trial" in data and "scenario" not in data:
        raise ConfigError(
            f"{where}: a matrix, not a scenario preset; run it with `repro matrix --config "
            f"{name_or_path}`, or give a {scenario or 'scenario'} preset (`repro presets` lists them)"
        )
    if unknown:
        raise ConfigError(
            f"{where}: unknown top-level key {sorted(unknown)[0]!r}; allowed: scenario, description, [model], [run]"
        )
    name = data.get("scenario")
    if name not in SCENARIOS:
        raise ConfigError(f"{where}: scenario = {name!r} is not one of {', '.join(SCENARIOS)}")
    if scenario is not None and name != scenario:
        raise ConfigError(
            f"{where}: preset is for scenario {name!r}, not {scenario!r}; "
            f"use a {scenario} preset such as {SCENARIOS[scenario].default_preset}"
        )
    for section in ("model", "run"):
        if not isinstance(data.get(section, {}), dict):
            raise ConfigError(f"{where}: [{section}] must be a table")
    spec = SCENARIOS[name]
    model = fill(spec.dims, data.get("model", {}), where, "model")
    run = fill(RunConfig, data.get("run", {}), where, "run")
    preset = path.stem if path.parent.resolve() == CONFIG_DIR.resolve() else str(path)
    return TrialConfig(scenario=name, preset=preset, model=model, run=run)


def parse_set(item: str) -> tuple[str, str, Any]:
    """'model.vocab_size=1024' -> ('model', 'vocab_size', 1024); the value is read as TOML."""
    if "=" not in item or "." not in item.split("=", 1)[0]:
        raise ConfigError(f"--set {item!r}: expected SECTION.KEY=VALUE, e.g. run.steps=3 or model.hidden_size=128")
    lhs, rhs = item.split("=", 1)
    section, key = lhs.strip().split(".", 1)
    if section not in ("model", "run"):
        raise ConfigError(f"--set {item!r}: section {section!r} is not 'model' or 'run'")
    try:
        value = tomllib.loads(f"v = {rhs.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = rhs.strip()  # bare words like unfixed read as strings
    return section, key.strip(), value


def apply_overrides(cfg: TrialConfig, run: dict[str, Any], sets: list[str]) -> TrialConfig:
    """CLI flags (already typed; None = not given) and --set items override the preset."""
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model), run=dataclasses.replace(cfg.run))
    for key, value in run.items():
        if value is not None:
            setattr(cfg.run, key, value)
    for item in sets:
        section, key, value = parse_set(item)
        target = cfg.model if section == "model" else cfg.run
        allowed = [f.name for f in dataclasses.fields(target)]
        if key not in allowed:
            raise ConfigError(f"--set {item!r}: unknown key [{section}].{key}; allowed: {', '.join(allowed)}")
        setattr(target, key, coerce("--set", f"[{section}].{key}", value, getattr(target, key)))
    return cfg


def flag_of(key: str) -> str:
    """The command-line flag of a [run] key: deadline_s -> --deadline, share_gpu -> --share-gpu."""
    return "--" + key.removesuffix("_s").replace("_", "-")


def override_sources(run: dict[str, Any], sets: list[str]) -> dict[str, str]:
    """[run] key -> where the command line set it ("--tp 0", "--set run.tp=0"): an error in a
    value the user typed names the flag, not the preset it overrode."""
    sources = {
        key: f"{flag_of(key)} {value}"
        for key, value in run.items()
        if value is not None and not isinstance(value, bool)
    }
    sources.update({key: flag_of(key) for key, value in run.items() if isinstance(value, bool)})
    for item in sets:
        section, key, _ = parse_set(item)
        if section == "run":
            sources[key] = f"--set {item}"
    return sources


def check(cond: bool, where: str, message: str) -> None:
    if not cond:
        raise ConfigError(f"{where}: {message}")


def validate(cfg: TrialConfig, sources: dict[str, str] | None = None) -> TrialConfig:
    """Semantic checks; fills scenario defaults (after_free). Returns the resolved config.
    sources: [run] keys the command line set (override_sources), named in their errors."""
    spec = SCENARIOS[cfg.scenario]
    r, m, w = cfg.run, cfg.model, cfg.preset
    at = lambda key: (sources or {}).get(key, w)
    check(
        r.mode in spec.mode_names,
        at("mode"),
        f"mode = {r.mode!r} is not one of {', '.join(spec.mode_names)} for {spec.name}",
    )
    check(r.tp >= 1, at("tp"), f"tp = {r.tp} must be >= 1")
    check(spec.tensor_parallel or r.tp == 1, at("tp"), f"tp = {r.tp}: {spec.name} runs one rank; use tp = 1")
    check(r.steps >= 1, at("steps"), f"steps = {r.steps} must be >= 1")
    check(r.seed >= 0, at("seed"), f"seed = {r.seed} must be >= 0")
    check(
        math.isfinite(r.deadline_s) and 0 < r.deadline_s <= MAX_DEADLINE_S,
        at("deadline_s"),
        f"deadline_s = {r.deadline_s} must be > 0 and at most {MAX_DEADLINE_S:g} seconds (one week)",
    )
    check(
        math.isfinite(r.stall_s) and 0 < r.stall_s <= MAX_DEADLINE_S,
        at("stall_s"),
        f"stall_s = {r.stall_s} must be > 0 and at most {MAX_DEADLINE_S:g} seconds (one week)",
    )
    check(r.guard in tuple(GuardMode), at("guard"), f"guard = {r.guard!r} is not one of {', '.join(GuardMode)}")
    check(r.device in tuple(Device), at("device"), f"device = {r.device!r} is not one of {', '.join(Device)}")
    check(
        not (r.share_gpu and r.device == Device.CPU),
        at("share_gpu"),
        "share_gpu = true with device = cpu: CPU ranks always share the host over gloo; drop --share-gpu "
        "or use --device cuda",
    )
    if r.after_free == "":
        r.after_free = spec.default_after_free
    check(
        r.after_free in tuple(AfterFreeKnob),
        at("after_free"),
        f"after_free = {r.after_free!r} is not one of {', '.join(AfterFreeKnob)}",
    )
    for key in sorted(SCENARIO_RUN_KEYS - set(spec.run_key_names)):
        check(
            not getattr(r, key),
            at(key),
            f"{key} does not apply to {spec.name} (it belongs to "
            + ", ".join(s.name for s in SCENARIOS.values() if key in s.run_key_names)
            + ")",
        )
    check(
        m.dtype in ("bfloat16", "float16", "float32"),
        w,
        f"model.dtype = {m.dtype!r} is not bfloat16, float16 or float32",
    )
    spec.validate(m, r, lambda ok, key, message: check(ok, at(key) if key else w, message))
    if r.expect:
        try:
            parse_expectation(r.expect)
        except ValueError as e:
            raise ConfigError(f"{at('expect')}: expect: {e}") from None
    return cfg


def default_expectation(cfg: TrialConfig) -> str:
    """unfixed reproduces; the fixed modes are clean; a scenario's exceptions are its spec's."""
    r = cfg.run
    if r.expect:
        return r.expect
    return SCENARIOS[cfg.scenario].expectation(r) or ("reproduced" if r.mode == "unfixed" else "clean")
