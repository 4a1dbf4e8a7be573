"""Parent-side orchestration: resolve device and preset, run trials in isolation, build the report.

Never touches CUDA and never imports torch: GPU facts come from NVML (repro.env.gpus), torch's
from rank 0 of a trial; trials run in worker processes.
"""

from __future__ import annotations

import datetime as dt
import importlib.metadata
import shlex
import os
import queue
import sys
import threading
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from repro.env import gpus, inventory
from repro.config import SCENARIOS, TrialConfig, apply_overrides, bare_config, load_preset, validate
from repro.run.footprint import expected_peak_bytes, fit_reason, gib
from repro.run.interrupts import Interrupts, Terminated, checkpoint
from repro.run.isolate import POLL_S, Interrupted, run_trial, unsupported_record
from repro.run.launch import RankServer, child_env
from repro.run.ledger import MemoryLedger, need_on, trial_gpus
from repro.outcome import Device, Report, TrialRecord


@dataclass
class Planned:
    cfg: TrialConfig
    device: str | None  # None: cannot run here (see reason)
    reason: str = ""
    fault: dict[str, Any] | None = None
    index: int | None = None  # its place in the full plan, kept when a subset runs


@dataclass
class RunResult:
    report: Report
    interrupted: bool = False
    run_dir: Path | None = None  # the folder this run's trials wrote to


def resolve_device(requested: str, tp: int, gpus: int, share_gpu: bool = False) -> tuple[str | None, str]:
    """auto -> cuda when NVML sees GPUs, else cpu (gloo, no graphs). Returns (device, reason).

    share_gpu: the ranks may share one GPU (over gloo), so tp > gpus is allowed on CUDA.
    """
    if requested == Device.CPU or (requested == Device.AUTO and gpus == 0):
        return Device.CPU, ""
    if gpus == 0:
        return None, "device = cuda but no CUDA GPU is visible (NVML found none)"
    if tp > gpus and not share_gpu:
        return None, (
            f"tp = {tp} needs {tp} GPUs, {gpus} visible; run on a machine with {tp} GPUs, "
            "use --share-gpu (ranks share one GPU over gloo, not NCCL) or --device cpu"
        )
    return Device.CUDA, ""


def plan(
    scenario: str,
    preset: str | None,
    run: dict[str, Any],
    sets: list[str],
    gpus: int,
    sources: dict[str, str] | None = None,
) -> Planned:
    """Load the preset (the CPU preset when no preset was named and the run lands on CPU; the
    scenario's bare defaults when it has no such preset).
    sources: which [run] keys the command line set (config.override_sources), for errors."""
    spec = SCENARIOS[scenario]
    requested = run.get("device") or Device.AUTO
    tp = run.get("tp") or 1
    if preset is None:
        device, _ = resolve_device(requested, tp, gpus, bool(run.get("share_gpu")))
        preset = (spec.cpu_preset if device == Device.CPU else spec.default_preset) or None
    base = load_preset(preset, scenario) if preset is not None else bare_config(spec)
    cfg = validate(apply_overrides(base, run, sets), sources)
    device, reason = resolve_device(cfg.run.device, cfg.run.tp, gpus, cfg.run.share_gpu)
    if device is not None:
        reason = fit_reason(cfg, device)
        device = None if reason else device
    return Planned(cfg=cfg, device=device, reason=reason)


def environment() -> dict[str, Any]:
    """Host, GPUs (NVML), vLLM, variables; torch's facts are added once a rank reported them."""
    return inventory.collect(include_torch=False)


def with_runtime(env: dict[str, Any], trials: list[TrialRecord]) -> dict[str, Any]:
    """The environment with torch/CUDA/NCCL as rank 0 of the first trial that got that far saw
    them; when none did, torch's installed version from package metadata (no import)."""
    reported = next((t.runtime for t in trials if t.runtime), None)
    env = {**env, "torch": reported or installed_torch()}
    env["summary"] = inventory.inventory_line(env)
    return env


def installed_torch() -> dict[str, Any]:
    try:
        version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        version = None
    return {
        "version": version,
        "cuda": None,
        "nccl": None,
        "cuda_built": None,
        "graph_check_input_liveness": None,
        "error": "no rank reported torch's facts (from package metadata)" if version else "torch is not installed",
    }


def trial_id(index: int, cfg: TrialConfig) -> str:
    r = cfg.run
    parts = [f"{index:02d}", cfg.scenario, r.mode, f"tp{r.tp}", r.after_free]
    for k in SCENARIOS[cfg.scenario].run_keys:
        value = getattr(r, k.name)
        if k.tag and value is True:
            parts.append(k.tag)  # a switch that is on: 'reload'
        elif k.tag and k.type is int and value:
            parts.append(f"{k.tag}{value}")  # a number: 'level2'
    return "-".join(parts)


def lane_env(slot: int, lanes: list[str]) -> dict[str, str] | None:
    """Concurrent slot k sees the GPUs rotated by k, so TP=1 trials spread over every GPU."""
    k = slot % len(lanes) if lanes else 0
    if k == 0:
        return None  # identity: leave the environment as it is
    return {"CUDA_VISIBLE_DEVICES": ",".join(lanes[k:] + lanes[:k])}


def run_planned(
    planned: list[Planned],
    out_root: Path,
    on_start: Callable[[str, Planned], None] | None = None,
    on_tick: Callable[[str, int], None] | None = None,
    on_done: Callable[[TrialRecord], None] | None = None,
    wrapper: list[str] | None = None,
    jobs: int = 1,
    server: RankServer | None = None,
    interrupts: Interrupts | None = None,
) -> RunResult:
    """Run every planned trial, `jobs` at a time; the report keeps the plan's order.

    Ranks are forked from one rank server per run (torch imported once; repro/rank/server.py):
    `server` when the caller started it (and closes it), else one started here. Under a
    wrapper program every rank is a fresh interpreter (the wrapper must exec it).
    interrupts: the CLI's signal flag (repro/run/interrupts.py), polled here; without it a
    KeyboardInterrupt in the calling thread stops the run.
    """
    checkpoint("run")
    stamp = dt.datetime.now(dt.timezone.utc)
    run_dir = out_root / stamp.strftime("%Y%m%d-%H%M%S-%f")
    stopped = interrupts is not None and interrupts.pending()
    own = server is None and not wrapper and not stopped and any(p.device is not None for p in planned)
    if own:
        # From this (the main) thread, first: its torch import overlaps everything below.
        server = RankServer.start(child_env())
    # NVML on many GPUs takes a while; take the inventory while the first trial's ranks start.
    try:
        with ThreadPoolExecutor(max_workers=1) as pool:
            env = pool.submit(environment)
            lanes = gpus.gpu_lanes(gpus.gpu_count(), dict(os.environ)) if jobs > 1 else []
            result = run_all(
                planned,
                run_dir,
                Hooks(on_start, on_tick, on_done),
                wrapper,
                jobs,
                lanes,
                server,
                interrupts=interrupts,
                ledger=gpu_ledger(planned, lanes),
            )
            checkpoint("collected")
            result.report.environment = with_runtime(env.result(), result.report.trials)
    finally:
        if own:
            server.close()
    result.report.command = shlex.join(sys.argv)
    result.report.created = stamp.isoformat(timespec="seconds")
    result.run_dir = run_dir
    return result


def gpu_ledger(planned: list[Planned], lanes: list[str]) -> MemoryLedger | None:
    """Where concurrent CUDA trials share GPUs whose size NVML tells: the ledger they claim
    memory from (repro/run/ledger.py); None otherwise (one job, no CUDA trial, no NVML)."""
    if not lanes or not any(p.device == Device.CUDA for p in planned):
        return None
    totals = gpus.visible_memory()[: len(lanes)]
    return MemoryLedger(totals) if len(totals) == len(lanes) and all(totals) else None


def claim_memory(
    ledger: MemoryLedger | None, p: Planned, slot: int, lanes: list[str], stop: threading.Event
) -> tuple[Any, str, bool]:
    """(the claim or None, a note for the trial when it had to wait, whether it was stopped
    while waiting); no claim without a ledger or off CUDA."""
    if ledger is None or p.device != Device.CUDA:
        return None, "", False
    per_rank = expected_peak_bytes(p.cfg)
    claim = ledger.claim(need_on(trial_gpus(slot, len(lanes), p.cfg.run.tp, p.cfg.run.share_gpu), per_rank), stop)
    if claim is None:
        return None, "", True
    if claim.waited_s < 1.0:
        return claim, "", False
    return (
        claim,
        (
            f"waited {claim.waited_s:.0f} s for GPU memory: this trial is expected to reach "
            f"{gib(per_rank)} a rank, more than was left beside the trials running then"
        ),
        False,
    )


@dataclass
class Hooks:
    on_start: Callable[[str, Planned], None] | None = None
    on_tick: Callable[[str, int], None] | None = None
    on_done: Callable[[TrialRecord], None] | None = None


def run_one(
    i: int,
    p: Planned,
    run_dir: Path,
    hooks: Hooks,
    wrapper: list[str] | None,
    slots: queue.SimpleQueue,
    lanes: list[str],
    stop: threading.Event,
    server: RankServer | None = None,
    ledger: MemoryLedger | None = None,
) -> TrialRecord | None:
    """One trial on a pool thread. The thread lives until its trial's ranks are reaped, which
    matters: PR_SET_PDEATHSIG fires when the *thread* that spawned a worker exits."""
    if stop.is_set():
        return None  # Ctrl-C before this trial started
    tid = trial_id(i if p.index is None else p.index, p.cfg)
    if hooks.on_start:
        hooks.on_start(tid, p)
    if p.device is None:
        trial = unsupported_record(tid, p.cfg, p.reason)
    else:
        slot = slots.get()
        claim = None
        try:
            claim, waited, stopped = claim_memory(ledger, p, slot, lanes, stop)
            if stopped:
                return None  # Ctrl-C while it waited for GPU memory
            trial = run_trial(
                p.cfg,
                p.device,
                run_dir,
                tid,
                fault=p.fault,
                wrapper=wrapper,
                on_tick=hooks.on_tick,
                env=lane_env(slot, lanes),
                stop=stop,
                server=server,
            )
            if waited:
                trial.notes.append(waited)
        finally:
            if claim is not None:
                ledger.release(claim)
            slots.put(slot)
    if hooks.on_done:
        hooks.on_done(trial)
    return trial


def run_all(
    planned: list[Planned],
    run_dir: Path,
    hooks: Hooks,
    wrapper: list[str] | None,
    jobs: int,
    lanes: list[str],
    server: RankServer | None = None,
    one: Callable[..., TrialRecord | None] | None = None,
    interrupts: Interrupts | None = None,
    ledger: MemoryLedger | None = None,
) -> RunResult:
    """one: the per-trial step, run_one's signature (repro/run/ray_runner.py runs it on a cluster);
    ledger: the GPU memory concurrent CUDA trials claim (passed to `one` only when there is one)."""
    one = one or run_one
    stop = threading.Event()
    slots: queue.SimpleQueue = queue.SimpleQueue()
    for k in range(max(1, jobs)):
        slots.put(k)
    records: list[TrialRecord | None] = [None] * len(planned)
    interrupted_by = None
    if interrupts is not None and interrupts.pending():
        stop.set()  # a signal during start-up: run nothing
        interrupted_by = interrupts.name
    with ThreadPoolExecutor(max_workers=max(1, jobs), thread_name_prefix="trial") as pool:
        extra = {"ledger": ledger} if ledger is not None else {}
        futures = {
            pool.submit(one, i, p, run_dir, hooks, wrapper, slots, lanes, stop, server, **extra): i
            for i, p in enumerate(planned)
        }
        pending = set(futures)
        while pending:
            try:
                done, pending = wait(pending, timeout=POLL_S, return_when=FIRST_COMPLETED)
                if interrupts is not None and interrupts.pending() and not stop.is_set():
                    stop.set()  # the trials kill their groups, keep records
                    interrupted_by = interrupted_by or interrupts.name
            except KeyboardInterrupt as e:
                # Ctrl-C (or SIGTERM, see Terminated) reaches this thread only (the ranks run in
                # their own process groups): tell every running trial to kill its group and
                # hand back what it recorded.
                stop.set()
                interrupted_by = interrupted_by or ("SIGTERM" if isinstance(e, Terminated) else "SIGINT")
                continue
            for f in done:
                try:
                    records[futures[f]] = f.result()
                except Interrupted as e:
                    records[futures[f]] = e.trial
                    interrupted_by = interrupted_by or "SIGINT"
    trials = [t for t in records if t is not None]
    interrupted = interrupted_by is not None
    report = Report(
        environment={},
        trials=trials,
        interrupted=interrupted,
        interrupted_by=interrupted_by,
        not_run=len(planned) - len(trials),
    )
    return RunResult(report=report, interrupted=interrupted)
