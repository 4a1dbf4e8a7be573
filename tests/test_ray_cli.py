"""`--ray` where Ray cannot be used: one line and exit 3, never a traceback; and the parent's
modules for sharding, merging and Ray stay free of torch (and of Ray until --ray is given)."""

import os
import subprocess
import sys

from conftest import REPO


def test_without_ray_installed_ray_is_exit_3_in_one_line(tmp_path):
    # A `ray` package that cannot be imported, first on the path: as where Ray is not installed.
    (tmp_path / "ray").mkdir()
    (tmp_path / "ray" / "__init__.py").write_text("raise ImportError('No module named ray')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}
    done = subprocess.run(
        [sys.executable, "-m", "repro", "matrix", "--ray", "auto", "--list"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 3
    assert done.stderr == (
        "repro: error: --ray needs Ray, which is not installed here: pip install 'repro[ray]' (or pip install ray)\n"
    )


def test_the_parent_modules_import_neither_torch_nor_ray():
    code = (
        "import sys, repro.cli, repro.run.shard, repro.run.merge, repro.run.ray_runner, repro.watch.ray; "
        "print(sorted(m for m in ('torch', 'ray') if m in sys.modules))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_a_watched_program_can_load_rays_hook_from_this_copy_without_repro_on_its_path(tmp_path):
    # Ray imports RAY_RUNTIME_ENV_HOOK by name inside the program's ray.init(), where the
    # program's own sys.path need not reach this copy of repro: the package the sitecustomize
    # imported (for the hooks) is what the import finds.
    code = (
        "import importlib, os, sys; "
        "m = importlib.import_module(os.environ['RAY_RUNTIME_ENV_HOOK'].rpartition('.')[0]); "
        "print(m.__file__, any(p and os.path.samefile(p, sys.argv[1]) for p in sys.path if os.path.isdir(p)))"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith("REPRO_WATCH")}
    done = subprocess.run(
        [
            sys.executable,
            str(REPO / "cli.py"),
            "watch",
            "--run-dir",
            str(tmp_path / "run"),
            "--",
            sys.executable,
            "-c",
            code,
            str(REPO),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    path, on_path = done.stdout.split()
    assert path == str(REPO / "repro" / "watch" / "ray.py") and on_path == "False"
