"""Without numpy, torch warns "Failed to initialize NumPy" at import; that warning must not
reach the doctor's output nor a worker's stderr (the tail HANG/CRASH reports and JUnit show)."""

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO

NOISE = "Failed to initialize NumPy"


@pytest.fixture
def without_numpy(tmp_path):
    """An environment where `import numpy` fails as on an install without numpy."""
    shadow = tmp_path / "shadow" / "numpy"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'numpy'\", name='numpy')\n")
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(shadow.parent), str(REPO)]),
        "XDG_CACHE_HOME": str(tmp_path / "cache"),
        "CUDA_VISIBLE_DEVICES": "",
    }


def run(env, *args, cwd):
    return subprocess.run([sys.executable, *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=240)


def test_torch_itself_warns_without_numpy(without_numpy, tmp_path):
    """The control: the environment does reproduce the noise."""
    assert NOISE in run(without_numpy, "-c", "import torch", cwd=tmp_path).stderr


def test_doctor_is_quiet_without_numpy(without_numpy, tmp_path):
    result = run(without_numpy, "-m", "repro", "doctor", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "torch" in result.stdout and NOISE not in result.stderr + result.stdout


def test_worker_stderr_tail_is_quiet_without_numpy(without_numpy, tmp_path):
    junit = tmp_path / "trial.xml"
    result = run(
        without_numpy,
        "-m",
        "repro",
        "selftest",
        "--device",
        "cpu",
        "--steps",
        "1",
        "--inject-fault",
        "raise@0:0",
        "--artifacts",
        str(tmp_path / "runs"),
        "--junit",
        str(junit),
        "--json",
        "-",
        cwd=tmp_path,
    )
    assert result.returncode == 1, result.stderr
    trial = json.loads(result.stdout)["trials"][0]
    tail = trial["ranks"][0]["stderr_tail"]
    assert "Traceback" in tail and NOISE not in tail  # what matters is there, the noise is not
    assert NOISE not in junit.read_text()


def test_cli_stderr_is_quiet_without_numpy(without_numpy, tmp_path):
    """The rank server imports torch with the user's terminal as its stderr."""
    result = run(
        without_numpy,
        "-m",
        "repro",
        "selftest",
        "--device",
        "cpu",
        "--steps",
        "1",
        "--artifacts",
        str(tmp_path / "runs"),
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert NOISE not in result.stderr + result.stdout
