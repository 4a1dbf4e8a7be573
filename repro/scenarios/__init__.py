"""Scenario registry: name -> module with `run(ctx: repro.worker.WorkerContext) -> None`.

Imported lazily inside workers only: scenario modules import torch and touch CUDA.
"""
from __future__ import annotations

import importlib
from types import ModuleType

MODULES = {
    "gemma4-mtp": "repro.scenarios.gemma4_mtp",
    "nvfp4-reload": "repro.scenarios.nvfp4_moe",
    "selftest": "repro.scenarios.selftest",
}


def load_scenario(name: str) -> ModuleType:
    return importlib.import_module(MODULES[name])
