"""repro: reproduce and diagnose CUDA-graph memory-lifetime bugs in LLM inference engines."""

__version__ = "0.1.0"

# The reload-stability check, imported on first use: the CLI imports this package and must
# not import torch.
_LAZY = {"reload_census": "repro.diagnose.stability", "expect_stable": "repro.diagnose.stability"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'repro' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + list(_LAZY))
