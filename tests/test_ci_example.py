"""docs/ci/github-gpu-runner.yml is a valid workflow whose repro commands exist as written."""

import os
import shlex
import subprocess
import sys

import pytest

from conftest import REPO

WORKFLOW = REPO / "docs" / "ci" / "github-gpu-runner.yml"


def load() -> dict:
    yaml = pytest.importorskip("yaml")
    return yaml.safe_load(WORKFLOW.read_text())


def repro_lines(job: dict) -> list[list[str]]:
    """Every `repro ...` command of the job's run steps, continuation lines joined."""
    out = []
    for step in job["steps"]:
        script = step.get("run", "").replace("\\\n", " ")
        out += [shlex.split(line) for line in script.splitlines() if line.strip().startswith("repro ")]
    return out


def test_workflow_is_plain_yaml_without_tabs():
    text = WORKFLOW.read_text()
    assert "\t" not in text and text.startswith("#")


def test_workflow_structure():
    doc = load()
    job = doc["jobs"]["gpu-matrix"]
    assert "self-hosted" in job["runs-on"] and "gpu" in job["runs-on"]
    commands = repro_lines(job)
    assert ["repro", "doctor"] == commands[0][:2]
    matrix = commands[1]
    assert matrix[:4] == ["repro", "matrix", "--config", "gpu-2"] and "--junit" in matrix
    keep = [s for s in job["steps"] if s.get("uses", "").startswith("actions/upload-artifact")]
    assert keep and "failure()" in keep[0]["if"] and keep[0]["with"]["path"] == "reports/"
    assert matrix[matrix.index("--artifacts") + 1].startswith("reports/")  # the records are uploaded too
    install = next(s["run"] for s in job["steps"] if "pip install" in s.get("run", ""))
    assert "--system-site-packages" in install  # the runner's CUDA torch stays


def test_workflow_repro_commands_parse(tmp_path):
    """Each command as written is accepted by this repro, outputs and all. Without a GPU the
    matrix's trials are UNSUPPORTED (exit 3, nothing runs) and its reports are still written."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": "", "XDG_CACHE_HOME": str(tmp_path / "cache")}
    (tmp_path / "reports").mkdir()  # the workflow's `mkdir -p reports`
    for argv in repro_lines(load()["jobs"]["gpu-matrix"]):
        out = subprocess.run(
            [sys.executable, "-m", "repro", *argv[1:]],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == (3 if argv[1] == "matrix" else 0), (argv, out.stderr)
    for name in ("doctor.json", "repro-gpu.xml", "repro-gpu.json", "repro-gpu.html"):
        assert (tmp_path / "reports" / name).is_file(), name
