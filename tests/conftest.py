import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SLOW = Path(__file__).with_name("slow.txt")  # written by tests/slow_from_durations.py


def slow_tests() -> set[str]:
    if not SLOW.exists():
        return set()
    return {line.strip() for line in SLOW.read_text().splitlines() if line.strip() and not line.startswith("#")}


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(config, items):
    """Mark `slow` what took long in the last --durations run (tests/slow.txt), beside the tests
    marked in their files: `-m "not slow"` is then the quick check."""
    listed = slow_tests()
    for item in items:
        if item.nodeid in listed:
            item.add_marker(pytest.mark.slow)
    skip_without_gpus(items)


def skip_without_gpus(items) -> None:
    """`gpu` and `multi_gpu` tests skip where CUDA has too few GPUs, so a -m of one's own that
    does not exclude them (`-m "not slow"`) still passes on a CPU machine."""
    wanted = {m for item in items for m in ("gpu", "multi_gpu") if item.get_closest_marker(m)}
    if not wanted:
        return
    import torch  # only when a GPU test was collected

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item in items:
        if item.get_closest_marker("multi_gpu") and gpus < 2:
            item.add_marker(pytest.mark.skip(reason=f"needs two or more CUDA GPUs ({gpus} here)"))
        elif item.get_closest_marker("gpu") and gpus < 1:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))


@pytest.fixture
def no_gpu(monkeypatch):
    """Pretend NVML sees no GPU, so auto device means CPU on any machine."""
    import repro.env.gpus

    monkeypatch.setattr(repro.env.gpus, "gpu_count", lambda *a, **k: 0)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it is gone for our purposes only once reaped, so read its state.
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        return state != "Z"
    except OSError:
        return False


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


@pytest.fixture
def cuda_only():
    """GPU tests: skip without CUDA; run without autograd; wait for the GPU at the end."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    with torch.no_grad():
        yield
    torch.cuda.synchronize()


# A three-trial CPU matrix (two pass, one cannot meet its expectation): what the shard, merge
# and Ray tests split, place and join.
TINY_MATRIX = """\
[matrix]
description = "tiny sharding check"
device = "cpu"
deadline_s = 60
[[trial]]
scenario = "selftest"
tp = 2
steps = 2
[[trial]]
scenario = "selftest"
tp = 1
steps = 2
[[trial]]
scenario = "selftest"
tp = 2
steps = 3
expect = "CRASH"          # a clean self-test cannot meet this: the run must fail
"""


def watch_argv(run_dir, *program, report=None, options=()) -> list[str]:
    """`python -m repro watch --run-dir RUN_DIR [--json REPORT] [OPTIONS] -- PROGRAM...`"""
    as_json = ["--json", str(report)] if report is not None else []
    return [sys.executable, "-m", "repro", "watch", "--run-dir", str(run_dir), *as_json, *options, "--", *program]
