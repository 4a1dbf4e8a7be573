"""How much memory a trial needs at least, checked against the machine before it starts.

A size that cannot fit (100000 experts, a vocab of billions) would otherwise run for the
whole deadline (swapping, or allocating until the OOM killer comes) and end as HANG or
CRASH. Each scenario's bound (ScenarioSpec.footprint) counts only tensors it holds at the same
moment, so it is a lower bound: a trial refused here could not have run; one admitted may
still need more. Plain arithmetic on the config: no torch (the parent must stay torch-free).
"""

from __future__ import annotations

import os
from pathlib import Path

from repro.env import gpus
from repro.config import SCENARIOS, TrialConfig
from repro.outcome import Device


def needed_bytes(cfg: TrialConfig) -> int:
    """Lower bound of one rank's memory for this trial (the scenario's formula); 0 when negligible."""
    return SCENARIOS[cfg.scenario].footprint(cfg.model, cfg.run.tp)


def expected_peak_bytes(cfg: TrialConfig) -> int:
    """What one rank is expected to reach (the scenario's peak estimate, else its footprint):
    what the matrix promises a concurrent CUDA trial on each GPU it uses (repro/run/ledger.py)."""
    spec = SCENARIOS[cfg.scenario]
    return spec.peak(cfg.model, cfg.run) if spec.peak is not None else needed_bytes(cfg)


def host_available() -> int | None:
    """MemAvailable (Linux), else physical memory; None when neither can be read."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def gib(n: float) -> str:
    return f"{n / 2**30:,.1f} GiB"


def gpu_need(cfg: TrialConfig, per_rank: int) -> tuple[list[int], int]:
    """(total bytes of each GPU the trial's ranks use, what each of them must hold): the first
    tp visible GPUs, or only the first with every rank on it (--share-gpu)."""
    totals = gpus.visible_memory()[: cfg.run.tp]
    if cfg.run.share_gpu:
        return totals[:1], per_rank * cfg.run.tp
    return totals, per_rank


def fit_reason(cfg: TrialConfig, device: str) -> str:
    """'' when the trial may fit; else why not, with the numbers (the trial is UNSUPPORTED here)."""
    per_rank = needed_bytes(cfg)
    if per_rank == 0:
        return ""
    tp = cfg.run.tp
    if device == Device.CUDA:
        totals, per_gpu = gpu_need(cfg, per_rank)
        if not totals or min(totals) >= per_gpu:
            return ""
        return (
            f"{cfg.scenario} at these model sizes needs at least {gib(per_gpu)} of GPU memory per rank "
            f"(lower bound), the smallest of the {tp} GPU(s) it would use has {gib(min(totals))}; "
            "use smaller [model] sizes"
        )
    need = per_rank * tp
    available = host_available()
    if available is None or available >= need:
        return ""
    ranks = f" ({tp} ranks x {gib(per_rank)})" if tp > 1 else ""
    return (
        f"{cfg.scenario} at these model sizes needs at least {gib(need)} of host memory{ranks} "
        f"(lower bound), this host has {gib(available)} available; use smaller [model] sizes"
    )


def peak_shortfall(cfg: TrialConfig) -> str:
    """'' when the scenario's expected peak (an estimate above the footprint) fits the GPUs the
    trial would use, else the numbers: '{scenario} at these model sizes is expected to reach
    about X a GPU (an estimate), the GPU it runs on has Y'."""
    totals, per_gpu = gpu_need(cfg, expected_peak_bytes(cfg))
    if not totals or min(totals) >= per_gpu:
        return ""
    return (
        f"{cfg.scenario} at these model sizes is expected to reach about {gib(per_gpu)} a GPU (an estimate), "
        f"the GPU it runs on has {gib(min(totals))}"
    )


def out_of_memory_note(cfg: TrialConfig) -> str:
    """For a CUDA trial whose rank ran out of GPU memory: '' when its scenario's expected peak
    fits the GPUs it used, else that it could not have run there as configured, with the
    numbers. The footprint (a lower bound) admitted it; the peak is an estimate above it, so it
    explains an out-of-memory error but does not refuse a trial beforehand: some trials reach
    their verdict before their peak (workspace-grow unfixed faults at its first replay)."""
    shortfall = peak_shortfall(cfg)
    return f"out of GPU memory: {shortfall}; run it on a larger GPU or with smaller [model] sizes" if shortfall else ""
