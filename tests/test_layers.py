"""The layer rule the parent side rests on: importing a parent-side module never imports torch.

The parent (CLI, matrix, launcher, reports, watch's own side, the pytest plugin's session side)
starts in well under a second and runs on machines without torch; ranks and watched processes
import torch. The modules that may import torch at import time are listed here, and nowhere
else can a module start to: a new module is parent-side until it is added to TORCH_SIDE.
"""
from __future__ import annotations

import pkgutil
import subprocess
import sys

import repro
from conftest import REPO

# Rank-side and diagnosis modules: they run where the graphs are (a rank, a watched process).
TORCH_SIDE = {
    "repro.compare", "repro.dist", "repro.fingerprint", "repro.graphs", "repro.guard", "repro.nvfp4", "repro.owners",
    "repro.sites", "repro.specdec", "repro.stability",
    "repro.scenarios.gemma4_mtp", "repro.scenarios.gemma4_target", "repro.scenarios.nvfp4_moe",
    "repro.scenarios.piecewise_split", "repro.scenarios.selftest", "repro.scenarios.sleep_wake",
    "repro.scenarios.workspace_grow",
}


def all_modules() -> list[str]:
    names = ["repro"]
    for info in pkgutil.walk_packages(repro.__path__, "repro."):
        if not info.name.startswith("repro._site"):      # the sitecustomize runs on import
            names.append(info.name)
    return sorted(names)


PROBE = "import importlib, sys\nfor name in sys.argv[1:]: importlib.import_module(name)\nprint('torch' in sys.modules)"


def imports_torch(modules: list[str]) -> bool:
    """Whether importing these modules, in a fresh interpreter, imports torch."""
    proc = subprocess.run([sys.executable, "-c", PROBE, *modules], cwd=REPO, capture_output=True,
                          text=True, timeout=120, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.split()[-1] == "True"


def test_every_parent_side_module_imports_without_torch():
    parent = [m for m in all_modules() if m not in TORCH_SIDE]
    assert "repro.cli" in parent and "repro.watch_hooks" in parent and len(parent) > 40
    if imports_torch(parent):            # one interpreter for all; on a failure, name them
        culprits = [m for m in parent if imports_torch([m])]
        raise AssertionError(f"these parent-side modules import torch: {culprits}; import it inside "
                             "the function that needs it, or list the module in TORCH_SIDE if it "
                             "runs on the rank side")


def test_the_torch_side_list_names_modules_that_exist():
    assert TORCH_SIDE <= set(all_modules())
