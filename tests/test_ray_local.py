"""`repro watch` over a program whose `ray.init()` starts a Ray cluster of its own: its actor's
records reach the run directory (ray-<node>/) and its finding the report. Skipped where Ray is
not importable; the cluster is the program's and ends with it."""

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO, watch_argv

pytest.importorskip("ray")
pytestmark = pytest.mark.ray


def test_watch_reaches_the_actor_of_a_cluster_the_program_starts(tmp_path):
    program = [sys.executable, str(REPO / "tests" / "watch_programs" / "ray_local.py")]
    # RAY_AUTH_MODE=disabled: a new local cluster would otherwise turn token authentication on and
    # leave a ~/.ray/auth_token behind, which later `ray start`s of this machine would pick up.
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("REPRO_WATCH", "RAY_ADDRESS"))},
        "PYTHONPATH": str(REPO),
        "RAY_AUTH_MODE": "disabled",
    }
    run_dir = tmp_path / "run"
    try:
        done = subprocess.run(
            watch_argv(run_dir, *program, report=tmp_path / "w.json"),
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
        )
    finally:
        subprocess.run(["ray", "stop", "--force"], capture_output=True, timeout=120)  # in case it was left
    assert done.returncode == 1, done.stderr  # the actor's stale capture
    assert done.stdout == "out (2, 8)\n"
    pid = int(next(l for l in done.stderr.splitlines() if l.startswith("actor pid ")).split()[2])
    assert "watched=True" in done.stderr
    doc = json.loads((tmp_path / "w.json").read_text())
    # Ray's worker starter (setup_worker.py) inherited the cluster's environment, and so the
    # sitecustomize, before it exec'd into the worker under the same pid: that phase has a
    # record in the run directory itself; the worker's own records came through its node folder.
    (actor,) = [
        p
        for p in doc["processes"]
        if p["pid"] == pid and os.path.basename(os.path.dirname(p["record_file"])).startswith("ray-")
    ]
    assert actor["torch_hooked"] and actor["origins"] == ["ray"] and actor["findings"] == 1
    assert [f["pid"] for f in doc["findings"]] == [pid]
    assert any(n.startswith("Ray node ") and f"pid {pid}" in n for n in doc["notes"])
