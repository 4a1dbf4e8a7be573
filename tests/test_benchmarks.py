"""benchmarks/ is not run by CI (it needs GPUs and minutes), so at least every script must import:
a renamed or moved harness name breaks it here, not on the next GPU session."""
import importlib.util
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
SCRIPTS = sorted(p for p in BENCHMARKS.glob("*.py") if p.name != "common.py")


@pytest.fixture
def benchmarks_on_path(monkeypatch):
    # The scripts import their siblings (common, replay) as top-level modules, as `python
    # benchmarks/x.py` would; keep those out of sys.modules afterwards.
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    before = set(sys.modules)
    yield
    for name in set(sys.modules) - before:
        if getattr(sys.modules[name], "__file__", "") and str(BENCHMARKS) in sys.modules[name].__file__:
            del sys.modules[name]


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_benchmark_script_imports_and_has_main(script, benchmarks_on_path):
    spec = importlib.util.spec_from_file_location(f"benchmark_{script.stem}", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)            # runs the imports, not main(): __name__ is not __main__
    assert callable(getattr(module, "main", None)), f"{script.name} has no main()"
