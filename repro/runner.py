"""Parent-side orchestration: resolve device and preset, run trials in isolation, build the report.

Never touches CUDA: GPU facts come from NVML (repro.doctor), trials run in worker processes.
"""
from __future__ import annotations

import datetime as dt
import shlex
from concurrent.futures import ThreadPoolExecutor
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from repro import doctor
from repro.config import SCENARIOS, TrialConfig, apply_overrides, load_preset, validate
from repro.isolate import Interrupted, run_trial, unsupported_record
from repro.outcome import Report, TrialRecord


@dataclass
class Planned:
    cfg: TrialConfig
    device: str | None                # None: cannot run here (see reason)
    reason: str = ""
    fault: dict[str, Any] | None = None


@dataclass
class RunResult:
    report: Report
    interrupted: bool = False
    records: list[TrialRecord] = field(default_factory=list)


def resolve_device(requested: str, tp: int, gpus: int) -> tuple[str | None, str]:
    """auto -> cuda when NVML sees GPUs, else cpu (gloo, no graphs). Returns (device, reason)."""
    if requested == "cpu" or (requested == "auto" and gpus == 0):
        return "cpu", ""
    if gpus == 0:
        return None, "device = cuda but no CUDA GPU is visible (NVML found none)"
    if tp > gpus:
        return None, f"tp = {tp} needs {tp} GPUs, {gpus} visible; run on a machine with {tp} GPUs or use --device cpu"
    return "cuda", ""


def plan(scenario: str, preset: str | None, run: dict[str, Any], sets: list[str], gpus: int) -> Planned:
    """Load the preset (the CPU preset when no preset was named and the run lands on CPU)."""
    spec = SCENARIOS[scenario]
    requested = run.get("device") or "auto"
    tp = run.get("tp") or 1
    if preset is None:
        device, _ = resolve_device(requested, tp, gpus)
        preset = spec.cpu_preset if device == "cpu" else spec.default_preset
    cfg = validate(apply_overrides(load_preset(preset, scenario), run, sets))
    device, reason = resolve_device(cfg.run.device, cfg.run.tp, gpus)
    return Planned(cfg=cfg, device=device, reason=reason)


def environment() -> dict[str, Any]:
    env = doctor.collect()
    env["summary"] = doctor.summary_line(env)
    return env


def trial_id(index: int, cfg: TrialConfig) -> str:
    r = cfg.run
    parts = [f"{index:02d}", cfg.scenario, r.mode, f"tp{r.tp}", r.after_free]
    if r.reload_drafter:
        parts.append("reload")
    if r.identity_reload:
        parts.append("identity")
    return "-".join(parts)


def run_planned(planned: list[Planned], out_root: Path, on_start: Callable[[str, Planned], None] | None = None,
                on_tick: Callable[[str, int], None] | None = None,
                on_done: Callable[[TrialRecord], None] | None = None,
                wrapper: list[str] | None = None) -> RunResult:
    stamp = dt.datetime.now(dt.timezone.utc)
    run_dir = out_root / stamp.strftime("%Y%m%d-%H%M%S-%f")
    # The inventory imports torch (seconds); take it while the first trial's ranks start.
    with ThreadPoolExecutor(max_workers=1) as pool:
        env = pool.submit(environment)
        result = run_all(planned, run_dir, on_start, on_tick, on_done, wrapper)
        result.report.environment = env.result()
    result.report.command = shlex.join(sys.argv)
    result.report.created = stamp.isoformat(timespec="seconds")
    return result


def run_all(planned: list[Planned], run_dir: Path, on_start, on_tick, on_done,
            wrapper: list[str] | None) -> RunResult:
    report = Report(environment={}, trials=[])
    for i, p in enumerate(planned):
        tid = trial_id(i, p.cfg)
        if on_start:
            on_start(tid, p)
        if p.device is None:
            trial = unsupported_record(tid, p.cfg, p.reason)
        else:
            try:
                trial = run_trial(p.cfg, p.device, run_dir, tid, fault=p.fault, wrapper=wrapper, on_tick=on_tick)
            except Interrupted as e:
                report.trials.append(e.trial)
                report.interrupted = True
                return RunResult(report=report, interrupted=True)
        report.trials.append(trial)
        if on_done:
            on_done(trial)
    return RunResult(report=report)
