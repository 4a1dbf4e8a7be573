"""Put first on PYTHONPATH by `repro watch`: start the hooks in this process, then run the
sitecustomize this file shadows (if any), then take this directory off sys.path again so the
program sees the sys.path it would have had. The hooks import nothing of torch until the
program does. Nothing here may break the program: any failure is one line on stderr.
"""

import importlib.machinery
import importlib.util
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))


def _on_path(entry: str) -> bool:
    return os.path.abspath(entry or os.curdir) == _HERE


def _start_hooks() -> None:
    root = os.path.dirname(os.path.dirname(os.path.dirname(_HERE)))  # holds the repro package (repro/watch/_site)
    added = root not in sys.path
    if added:
        sys.path.insert(0, root)  # this copy of repro, not another one the path may hold
    try:
        from repro.watch import hooks as watch_hooks

        watch_hooks.activate_from_env(watch_hooks.Origin.SITECUSTOMIZE)
    finally:
        if added and root in sys.path:
            sys.path.remove(root)


def _run_shadowed() -> None:
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", [p for p in sys.path if not _on_path(p)])
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)


try:
    _start_hooks()
except Exception as e:  # never break the program being watched
    sys.stderr.write(f"repro watch: hooks not started in pid {os.getpid()}: {type(e).__name__}: {e}\n")
sys.path[:] = [p for p in sys.path if not _on_path(p)]
_run_shadowed()
