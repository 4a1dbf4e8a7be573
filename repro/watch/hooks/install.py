"""Waiting for the program's own torch import: a meta-path hook on one of torch's modules.

Importing the hooks imports no torch. A finder stands first on sys.meta_path until the program
imports its module (torch's own ``import torch`` imports both): ``torch.cuda.graphs``, whose
CUDAGraph gets patched, and, with --stacks, ``torch.cuda``, whose lazy initialisation starts
the allocation stacks. Then it takes itself off, lets torch's own loader run the module, and
hands the module over.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys

TARGET = "torch.cuda.graphs"
CUDA_MODULE = "torch.cuda"


class _PatchAfterExec(importlib.abc.Loader):
    """Runs the real loader, then hands the module over; leaves the module's loader as it was."""

    def __init__(self, loader, on_loaded):
        self._loader = loader
        self._on_loaded = on_loaded

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        module.__loader__ = self._loader
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        self._on_loaded(module)


class ImportHook(importlib.abc.MetaPathFinder):
    """Waits for the module `name` to be imported, then removes itself from sys.meta_path."""

    def __init__(self, on_loaded, name: str = TARGET):
        self._on_loaded = on_loaded
        self._name = name

    def find_spec(self, name, path, target=None):
        if name != self._name:
            return None
        self.uninstall()
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _PatchAfterExec(spec.loader, self._on_loaded)
        return spec

    def install(self) -> None:
        if self not in sys.meta_path:
            sys.meta_path.insert(0, self)

    def uninstall(self) -> None:
        if self in sys.meta_path:
            sys.meta_path.remove(self)
