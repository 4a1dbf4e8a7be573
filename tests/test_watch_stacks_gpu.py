"""`repro watch --stacks` over a real CUDA graph: a census-mode finding says where its tensor
was created.

    python3 -m pytest -m gpu tests/test_watch_stacks_gpu.py

The program (tests/watch_programs/freed_after_capture.py) captures a matmul whose weight only
the capturing function's local holds, and replays after it returned. Under the default record
mode the census reads the graph and hands the weight's storage to the guard (adopt); with
--stacks its slot's created_at comes from the allocator's recorded stack, and without, there is
none (as before).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO, watch_argv

pytestmark = pytest.mark.gpu

PROGRAM = REPO / "tests" / "watch_programs" / "freed_after_capture.py"
SLOT = "<local weight of capture>"


def allocating_line() -> int:
    """The code line marked `# ALLOCATED:` (the docstring names the marker too)."""
    lines = PROGRAM.read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if "# ALLOCATED:" in line and "torch." in line)


def watched(tmp_path, *options: str) -> dict:
    tmp_path.mkdir(parents=True, exist_ok=True)
    out = tmp_path / "report.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("REPRO_WATCH")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    proc = subprocess.run(
        watch_argv(tmp_path / "run", sys.executable, str(PROGRAM), report=out, options=options),
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 1, proc.stderr  # a finding: exit 1
    return json.loads(out.read_text())


def test_stacks_give_a_census_finding_the_line_that_allocated_its_tensor(cuda_only, tmp_path):
    rep = watched(tmp_path / "stacks", "--stacks")
    (proc,) = rep["processes"]
    assert proc["census"].startswith("active"), proc  # census mode: the storage came from the graph
    assert proc["internal_errors"] == [], proc
    (f,) = weight_findings(rep)
    assert f["status"] == "freed", f
    assert f["created_at"] == f"freed_after_capture.py:{allocating_line()} in capture", f
    assert f["freed_at"].startswith("freed_after_capture.py:"), f
    # Without --stacks: the same finding, and no created_at (nothing new ran).
    (plain,) = weight_findings(watched(tmp_path / "plain"))
    assert plain["status"] == "freed" and plain["created_at"] is None, plain


def weight_findings(rep: dict) -> list[dict]:
    """The findings of the capturing function's freed local (the census may say more)."""
    return [f["finding"] for f in rep["findings"] if f["finding"]["slot"] == SLOT]
