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
from repro.scenarios import (SCENARIO_RUN_KEYS, SCENARIOS, Gemma4Dims, MoeDims, ScenarioSpec,  # noqa: F401
                             SelftestDims)

# The presets ship inside the package (a wheel install has them too); they are plain TOML files
# on disk, so `repro presets NAME` can show them and users can copy one and pass --config FILE.
CONFIG_DIR = Path(os.environ.get("REPRO_CONFIGS") or str(importlib.resources.files("repro") / "configs"))

AFTER_FREE = ("keep", "release", "reuse", "poison")
GUARD_MODES = ("off", "warn", "raise")
DEVICES = ("auto", "cuda", "cpu")
# Collective timeouts are set past the deadline (a timedelta, in int milliseconds inside torch);
# a week is far beyond any trial and far inside what those can hold.
MAX_DEADLINE_S = 7 * 24 * 3600.0
# vLLM's Gemma 4 examples draft 1 token per step, which never feeds a draft back into the
# drafter; 3 feeds it back twice per step, the path where a wrong draft poisons the rest.
DEFAULT_NUM_SPECULATIVE_TOKENS = 3
MAX_SPECULATIVE_TOKENS = 16


class ConfigError(ValueError):
    """A bad config or flag: one line, exit code 2."""


@dataclass
class RunConfig:
    mode: str = "unfixed"
    tp: int = 1
    steps: int = 8
    seed: int = 0
    after_free: str = ""              # "" -> the scenario's default
    guard: str = "warn"
    device: str = "auto"
    deadline_s: float = 180.0         # the whole trial's budget: past it, DEADLINE (or HANG if stuck)
    stall_s: float = 60.0             # no record from any rank this long: HANG (the progress watchdog)
    forensics: bool = False
    reload_drafter: bool = False      # gemma4-mtp: reload drafter weights after capture
    num_speculative_tokens: int = 0   # gemma4-mtp: drafts per decode step; 0 -> the scenario's default
    share_gpu: bool = False           # TP ranks share one GPU over gloo (NCCL refuses two ranks on one GPU)
    identity_reload: bool = False     # nvfp4-reload: reload the same weights every step
    expect: str = ""                  # "" -> unfixed: reproduced, otherwise clean


@dataclass
class TrialConfig:
    scenario: str
    preset: str                       # preset name or path it came from
    model: Any                        # Gemma4Dims | MoeDims
    run: RunConfig

    def to_dict(self) -> dict[str, Any]:
        return {"scenario": self.scenario, "preset": self.preset,
                "model": dataclasses.asdict(self.model), "run": dataclasses.asdict(self.run)}

    @staticmethod
    def from_dict(d: dict[str, Any]) -> "TrialConfig":
        spec = SCENARIOS[d["scenario"]]
        return TrialConfig(scenario=d["scenario"], preset=d["preset"],
                           model=spec.dims(**d["model"]), run=RunConfig(**d["run"]))


def resolve_preset_path(name_or_path: str) -> Path:
    """A preset name ('gemma4-e2b') or a path to a TOML file."""
    p = Path(name_or_path)
    if p.is_dir():
        raise ConfigError(f"config {name_or_path} is a directory; give a preset name (`repro presets` "
                          "lists them) or a TOML file")
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
    return head[:limit - 3].rsplit(" ", 1)[0].rstrip(" ,;:(") + "..."


def read_toml(path: Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: malformed TOML: {e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start}); "
                          "TOML files must be UTF-8: re-save it as UTF-8") from None
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
        raise ConfigError(f"{where}: a matrix, not a scenario preset; run it with `repro matrix --config "
                          f"{name_or_path}`, or give a {scenario or 'scenario'} preset (`repro presets` lists them)")
    if unknown:
        raise ConfigError(f"{where}: unknown top-level key {sorted(unknown)[0]!r}; "
                          "allowed: scenario, description, [model], [run]")
    name = data.get("scenario")
    if name not in SCENARIOS:
        raise ConfigError(f"{where}: scenario = {name!r} is not one of {', '.join(SCENARIOS)}")
    if scenario is not None and name != scenario:
        raise ConfigError(f"{where}: preset is for scenario {name!r}, not {scenario!r}; "
                          f"use a {scenario} preset such as {SCENARIOS[scenario].default_preset}")
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
    sources = {key: f"{flag_of(key)} {value}" for key, value in run.items()
               if value is not None and not isinstance(value, bool)}
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
    at = (lambda key: (sources or {}).get(key, w))
    check(r.mode in spec.mode_names, at("mode"),
          f"mode = {r.mode!r} is not one of {', '.join(spec.mode_names)} for {spec.name}")
    check(r.tp >= 1, at("tp"), f"tp = {r.tp} must be >= 1")
    check(spec.tensor_parallel or r.tp == 1, at("tp"), f"tp = {r.tp}: {spec.name} runs one rank; use tp = 1")
    check(r.steps >= 1, at("steps"), f"steps = {r.steps} must be >= 1")
    check(r.seed >= 0, at("seed"), f"seed = {r.seed} must be >= 0")
    check(math.isfinite(r.deadline_s) and 0 < r.deadline_s <= MAX_DEADLINE_S, at("deadline_s"),
          f"deadline_s = {r.deadline_s} must be > 0 and at most {MAX_DEADLINE_S:g} seconds (one week)")
    check(math.isfinite(r.stall_s) and 0 < r.stall_s <= MAX_DEADLINE_S, at("stall_s"),
          f"stall_s = {r.stall_s} must be > 0 and at most {MAX_DEADLINE_S:g} seconds (one week)")
    check(r.guard in GUARD_MODES, at("guard"), f"guard = {r.guard!r} is not one of {', '.join(GUARD_MODES)}")
    check(r.device in DEVICES, at("device"), f"device = {r.device!r} is not one of {', '.join(DEVICES)}")
    check(not (r.share_gpu and r.device == "cpu"), at("share_gpu"),
          "share_gpu = true with device = cpu: CPU ranks always share the host over gloo; drop --share-gpu "
          "or use --device cuda")
    if r.after_free == "":
        r.after_free = spec.default_after_free
    check(r.after_free in AFTER_FREE, at("after_free"), f"after_free = {r.after_free!r} is not one of {', '.join(AFTER_FREE)}")
    for key in sorted(SCENARIO_RUN_KEYS - set(spec.run_key_names)):
        check(not getattr(r, key), at(key), f"{key} does not apply to {spec.name} (it belongs to "
              + ", ".join(s.name for s in SCENARIOS.values() if key in s.run_key_names) + ")")
    check(m.dtype in ("bfloat16", "float16", "float32"), w, f"model.dtype = {m.dtype!r} is not bfloat16, float16 or float32")
    if isinstance(m, Gemma4Dims):
        validate_gemma4(m, r, w, at)
    elif isinstance(m, MoeDims):
        validate_moe(m, r, w)
    if r.expect:
        from repro.outcome import parse_expectation
        try:
            parse_expectation(r.expect)
        except ValueError as e:
            raise ConfigError(f"{at('expect')}: expect: {e}") from None
    return cfg


def validate_gemma4(m: Gemma4Dims, r: RunConfig, w: str, at: Any = None) -> None:
    at = at or (lambda key: w)
    for key in ("vocab_size", "hidden_size", "num_centroids", "centroid_top_k"):
        check(getattr(m, key) >= 1, w, f"model.{key} = {getattr(m, key)} must be >= 1")
    check(m.vocab_size % m.num_centroids == 0, w,
          f"model.vocab_size = {m.vocab_size} is not divisible by model.num_centroids = {m.num_centroids}; "
          "token_ordering views the vocab as [num_centroids, vocab/num_centroids]")
    check(m.centroid_top_k <= m.num_centroids, w,
          f"model.centroid_top_k = {m.centroid_top_k} exceeds model.num_centroids = {m.num_centroids}")
    bs = m.batch_sizes
    check(bool(bs) and all(b >= 1 for b in bs) and bs == sorted(set(bs)), w,
          f"model.batch_sizes = {bs} must be positive, strictly increasing integers")
    check(r.tp <= m.vocab_size, w, f"tp = {r.tp} exceeds model.vocab_size = {m.vocab_size}")
    check(m.backbone_hidden_size >= m.hidden_size, w,
          f"model.backbone_hidden_size = {m.backbone_hidden_size} is smaller than model.hidden_size = "
          f"{m.hidden_size}; the drafter reads its hidden state from the target's backbone state")
    if r.num_speculative_tokens == 0:
        r.num_speculative_tokens = DEFAULT_NUM_SPECULATIVE_TOKENS
    check(1 <= r.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS, at("num_speculative_tokens"),
          f"num_speculative_tokens = {r.num_speculative_tokens} must be between 1 and {MAX_SPECULATIVE_TOKENS}")


def validate_moe(m: MoeDims, r: RunConfig, w: str) -> None:
    for key in ("num_experts", "hidden_size", "intermediate_size", "top_k", "tokens"):
        check(getattr(m, key) >= 1, w, f"model.{key} = {getattr(m, key)} must be >= 1")
    for key in ("hidden_size", "intermediate_size"):
        check(getattr(m, key) % 16 == 0, w,
              f"model.{key} = {getattr(m, key)} is not a multiple of 16 (the NVFP4 block size along K)")
    check(m.top_k <= m.num_experts, w, f"model.top_k = {m.top_k} exceeds model.num_experts = {m.num_experts}")


def default_expectation(cfg: TrialConfig) -> str:
    """unfixed reproduces; the fixed modes are clean; the documented exceptions are explicit."""
    r = cfg.run
    if r.expect:
        return r.expect
    if cfg.scenario == "gemma4-mtp":
        if r.mode == "unfixed" and r.tp == 1:
            return "clean"        # TP=1 takes a slice view of a live parameter: safe upstream too
        if r.mode == "fixed" and r.reload_drafter and r.tp > 1:
            return "reproduced"   # upstream's fix drops the cache on reload: the bug returns
    if cfg.scenario == "nvfp4-reload" and r.mode == "kernel-reuse":
        return "clean" if r.identity_reload else "MISMATCH"
    return "reproduced" if r.mode == "unfixed" else "clean"
