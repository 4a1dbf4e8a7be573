"""A built wheel, installed outside the checkout, carries its presets: `--print-config` and a
CPU scenario run from another directory, with the checkout nowhere on the path."""

import json
import os
import shutil
import subprocess
import sys
import zipfile

import pytest

from conftest import REPO

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """Build the wheel from a copy of the sources (no build/ or egg-info in the checkout) and
    install it with --target into a fresh folder; torch and the rest come from this Python."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    shutil.copytree(REPO / "repro", src / "repro", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(tmp / "dist"), str(src)],
        check=True,
        capture_output=True,
    )
    wheel = next((tmp / "dist").glob("repro-*.whl"))
    site = tmp / "site"
    subprocess.run(
        [*pip, "install", "--no-deps", "--no-index", "--target", str(site), str(wheel)], check=True, capture_output=True
    )
    elsewhere = tmp / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("REPRO_CONFIGS", "PYTHONPATH")}
    env.update(PYTHONPATH=str(site), XDG_CACHE_HOME=str(tmp / "cache"), CUDA_VISIBLE_DEVICES="")
    return wheel, site, elsewhere, env


def repro(installed, *args):
    _, site, elsewhere, env = installed
    return subprocess.run(
        [str(site / "bin" / "repro"), *args], cwd=elsewhere, env=env, capture_output=True, text=True, timeout=300
    )


def test_wheel_carries_every_preset(installed):
    wheel = installed[0]
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = {f"repro/configs/{p.name}" for p in (REPO / "repro" / "configs").glob("*.toml")}
    assert shipped and shipped <= names


def test_installed_copy_is_the_one_imported(installed):
    _, site, elsewhere, env = installed
    out = subprocess.run(
        [sys.executable, "-c", "import repro.config as c; print(c.__file__); print(c.CONFIG_DIR)"],
        cwd=elsewhere,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    module, config_dir = out.stdout.split()
    assert module.startswith(str(site)) and config_dir == str(site / "repro" / "configs")


def test_installed_print_config_and_presets(installed):
    result = repro(installed, "gemma4-mtp", "--print-config")
    assert result.returncode == 0, result.stderr
    cfg = json.loads(result.stdout)
    assert cfg["preset"] == "gemma4-tiny" and cfg["model"]["num_centroids"] == 50
    listed = repro(installed, "presets")
    assert listed.returncode == 0 and "qwen3-30b-a3b-moe" in listed.stdout
    assert repro(installed, "--version").stdout.startswith("repro ")


def test_installed_scenario_runs_on_cpu(installed):
    result = repro(installed, "nvfp4-reload", "--steps", "1", "--json", "-")
    assert result.returncode == 0, result.stderr
    trial = json.loads(result.stdout)["trials"][0]
    assert trial["outcome"] == "STALE_CAPTURE" and trial["met"]  # CPU: the guard's verdict
    assert not any(installed[2].iterdir())  # nothing written where it ran


def test_installed_wheel_registers_the_pytest_plugin_off_by_default(installed):
    """The wheel's pytest11 entry point: auto-loaded, inert, and on with --repro-watch."""
    _, site, elsewhere, env = installed
    suite = elsewhere.parent / "suite"
    suite.mkdir(exist_ok=True)
    (suite / "test_one.py").write_text(
        "import sys\n"
        "def test_one(request):\n"
        "    plugin = request.config.pluginmanager.get_plugin('repro')\n"
        "    assert plugin is not None and plugin.__file__.startswith(%r)\n"
        "    print('TORCH', 'torch' in sys.modules)\n" % str(site)
    )
    run = [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", "test_one.py"]
    off = subprocess.run(run, cwd=suite, env=env, capture_output=True, text=True, timeout=300)
    assert off.returncode == 0 and "TORCH False" in off.stdout, off.stdout + off.stderr
    on = subprocess.run(
        [*run, "--repro-watch", "--repro-watch-dir", str(suite / "records")],
        cwd=suite,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert on.returncode == 0 and "repro watch: no findings" in on.stdout, on.stdout + on.stderr
