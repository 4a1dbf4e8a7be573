"""torch's build facts (version, CUDA, NCCL, graph liveness support) in this interpreter.

Read in a worker (rank 0 reports them for the run's environment) and by `repro doctor`; the
trial parent never imports this module's torch. Attributes only: no torch.cuda call that
could create a CUDA context.
"""

from __future__ import annotations

import inspect
from types import ModuleType


def nccl_version(torch: ModuleType) -> str | None:
    """NCCL torch was built with, e.g. '2.27.7'; None for builds without NCCL.

    torch.cuda.nccl.version() only calls ncclGetVersion(), which returns a compile-time
    constant and creates no CUDA context. The _nccl_version check keeps CPU builds (which
    lack the binding) from raising.
    """
    if not hasattr(torch._C, "_nccl_version"):
        return None
    try:
        import torch.cuda.nccl

        version = torch.cuda.nccl.version()
    except (RuntimeError, AttributeError, OSError):
        return None
    numbers = ".".join(str(part) for part in version[:3])
    return numbers + (f"-{version[3]}" if len(version) > 3 else "")


def torch_supports_liveness() -> bool:
    """Whether this torch's torch.cuda.graph accepts check_input_liveness (torch >= 2.13).

    Here, not in the guard that uses it, so that `repro doctor` can ask without importing the guard.
    """
    import torch

    try:
        return "check_input_liveness" in inspect.signature(torch.cuda.graph).parameters
    except (AttributeError, TypeError, ValueError):
        return False


def describe_torch() -> dict:
    """torch's build facts. Reads attributes only: no torch.cuda call that could init CUDA."""
    try:
        import torch
    except Exception as error:  # a broken torch install is itself a finding
        return {
            "version": None,
            "cuda": None,
            "nccl": None,
            "cuda_built": False,
            "graph_check_input_liveness": False,
            "error": str(error) or type(error).__name__,
        }
    return {
        "version": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": nccl_version(torch),
        "cuda_built": bool(torch.backends.cuda.is_built()),
        "graph_check_input_liveness": torch_supports_liveness(),
        "error": None,
    }
