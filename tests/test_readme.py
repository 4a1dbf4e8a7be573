"""README.md stays true: every `repro ...` command it shows runs on CPU and exits 0, or 3 where it
needs GPUs (or vLLM) this machine does not have; its install lines show the CPU-only wheel."""

import importlib.util
import json
import os
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from typer.testing import CliRunner

from conftest import REPO
from repro.cli import app
from repro.config import TrialConfig, default_expectation
from repro.run.matrix import load_matrix
from repro.outcome import parse_expectation
from repro.scenarios import SCENARIOS

runner = CliRunner()

README = (REPO / "README.md").read_text()


def readme_commands() -> list[str]:
    """`repro ...` lines of the fenced code blocks, and the commands of the overview table.

    `repro watch -- CMD` lines are left out: their CMD is the reader's own program
    (my_decode_loop.py, train.py); tests/test_watch.py runs watch over real programs."""
    commands, fenced = [], False
    for line in README.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif fenced and line.startswith("repro "):
            commands.append(shlex.join(shlex.split(line, comments=True)))
        elif not fenced and line.startswith("| `repro "):
            commands.append(line.split("`")[1])
    return [c for c in dict.fromkeys(commands) if not c.startswith("repro watch ")]


def option(argv: list[str], name: str, default: str | None = None) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else default


def as_run(command: str) -> tuple[list[str], int]:
    """The argv to run and the exit code it must give on a CPU-only machine."""
    argv = shlex.split(command)[1:]
    if argv[0] == "matrix" and option(argv, "--config", "ci-smoke") == "ci-smoke":
        # The CPU smoke matrix (or a subset) is what .ci/run runs after this suite: its plan only here.
        argv = [*argv, "--list"]
    needs_gpus = (option(argv, "--config") or "").startswith("gpu-") and "--list" not in argv
    no_vllm = argv[0] == "vllm-audit" and importlib.util.find_spec("vllm") is None
    return argv, 3 if needs_gpus or no_vllm else 0


def test_readme_lists_the_commands_it_should():
    commands = readme_commands()
    assert "repro gemma4-mtp --tp 2" in commands and "repro matrix --config gpu-2 --jobs 8" in commands
    assert len(commands) >= 15
    assert "repro matrix --config ci-smoke" in (REPO / ".ci" / "run").read_text()


RUN_KEYS_COMPARED_OUT = ("expect", "deadline_s", "device")  # a matrix sets these for CI's budget


def trial_key(cfg: dict) -> str:
    run = {k: v for k, v in cfg["run"].items() if k not in RUN_KEYS_COMPARED_OUT}
    return json.dumps([cfg["scenario"], cfg["preset"], cfg["model"], run], sort_keys=True)


def ci_smoke_trials() -> dict[str, set]:
    """The CPU smoke matrix's trials (which .ci/run runs after this suite): key -> the outcomes
    each is expected to give."""
    _, planned = load_matrix("ci-smoke", 0)
    return {trial_key(p.cfg.to_dict()): set(parse_expectation(default_expectation(p.cfg))) for p in planned}


def covered_by_ci_smoke(argv: list[str], smoke: dict[str, set]) -> bool:
    """A scenario command whose trial is one of the smoke matrix's (same preset, dims, mode, tp,
    steps, seed, after-free, lifecycle) and whose expectation admits that trial's expected outcome:
    running it here again would duplicate CI's run. Its command line is still checked here."""
    if argv[0] not in SCENARIOS or not SCENARIOS[argv[0]].command or "--print-config" in argv:
        return False
    resolved = runner.invoke(app, [*argv, "--print-config"])
    assert resolved.exit_code == 0, (argv, resolved.stderr)
    cfg = json.loads(resolved.stdout)
    if cfg["device"] != "cpu" or trial_key(cfg) not in smoke:
        return False
    expected = set(parse_expectation(default_expectation(TrialConfig.from_dict(cfg))))
    return smoke[trial_key(cfg)] <= expected


@pytest.mark.slow
def test_every_readme_command_runs_on_cpu(tmp_path, no_gpu):
    env = {**os.environ, "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": "", "XDG_CACHE_HOME": str(tmp_path / "cache")}
    smoke = ci_smoke_trials()
    planned = [as_run(c) for c in readme_commands()]
    to_run = [(argv, code) for argv, code in planned if not covered_by_ci_smoke(argv, smoke)]
    assert 0 < len(to_run) < len(planned)

    def run(argv_code: tuple[list[str], int]) -> tuple[str, int, int, str]:
        argv, expected = argv_code
        out = subprocess.run(
            [sys.executable, "-m", "repro", *argv], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
        )
        return shlex.join(argv), expected, out.returncode, out.stderr[-2000:]

    with ThreadPoolExecutor(max_workers=3) as pool:
        results = list(pool.map(run, to_run))
    wrong = [r for r in results if r[1] != r[2]]
    assert not wrong, "\n\n".join(f"repro {c}: exit {got}, expected {want}\n{err}" for c, want, got, err in wrong)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache"]  # nothing in the cwd


def test_readme_shows_the_cpu_wheel_beside_the_plain_install():
    lines = README.splitlines()
    cpu = [
        l for l in lines if l.startswith("pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu")
    ]
    plain = [l for l in lines if l.startswith("pip install torch==2.13.0 ") and "--index-url" not in l]
    assert cpu and plain
    assert lines.index(plain[0]) - lines.index(cpu[0]) == 1  # side by side
    assert "pip install -q torch==2.13.0" in (REPO / ".ci" / "run").read_text()  # what works in CI stays


def test_set_up_starts_from_a_clone_and_a_venv():
    setup = README[README.index("## Set up and run") : README.index("## The mission commands")]
    lines = [l for l in setup.splitlines() if l and not l.startswith(("#", "`"))]
    assert lines[0].startswith("git clone ") and "cd repro" in lines[0]
    assert lines[1].startswith("python3 -m venv .venv && . .venv/bin/activate")
    tests = README[README.index("## Tests") :]
    assert "minutes on 2 cores" in tests and '-m "not slow and ' in tests


def test_the_fast_subsets_are_what_they_say():
    """A -m of one's own replaces addopts' (GPU tests would be collected); the in-process
    subset names test files that exist and start no trial and no repro process."""
    import re
    import tomllib

    addopts = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["addopts"]
    excluded = re.findall(r"not (\w+)", addopts)
    tests = README[README.index("## Tests") :]
    commands = [l for l in tests.splitlines() if l.startswith("python3 -m pytest")]
    for line in commands:
        if ' -m "' in line:
            assert all(f"not {m}" in line for m in excluded), line
    [in_process] = [l for l in commands if "in-process only" in l]
    files = [REPO / f for f in in_process.split("#")[0].split() if f.startswith("tests/")]
    assert len(files) >= 4
    for f in files:
        assert not re.search(r'run_trial|CliRunner|RankServer|"-m", "repro"', f.read_text()), f.name


def test_test_extra_holds_every_module_the_suite_imports_or_skips():
    """A module a test skips without is in [test]: on a CPU machine only GPU tests skip."""
    import re
    import tomllib

    extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["test"]
    names = {re.split(r"[<>=\[ ]", req)[0].lower() for req in extra}
    distribution = {
        "yaml": "pyyaml",
        "xdist": "pytest-xdist",
        "pytest_forked": "pytest-forked",
        "pytest_timeout": "pytest-timeout",
        "pytest_shard": "pytest-shard",
    }
    gpu_only = {"torch", "cuda.bindings.nvrtc"}  # torch is a dependency; nvrtc: GPU tests only
    for path in (REPO / "tests").glob("test_*.py"):
        for module in re.findall(r'importorskip\("([^"]+)"\)', path.read_text()):
            if module not in gpu_only:
                assert distribution.get(module, module) in names, (path.name, module)


def test_the_layout_names_every_module():
    """README's Layout tree names each module of the package (a new one goes in the tree too); a
    scenario's NAME.py and NAME_spec.py are the tree's NAME."""
    import re

    layout = README[README.index("## Layout") :]
    layout = layout[: layout.index("```", layout.index("```") + 3)]
    scenarios = REPO / "repro" / "scenarios"
    modules = {
        p.stem
        for p in (REPO / "repro").rglob("*.py")
        if p.stem != "__init__" and "_site" not in p.parts and "__pycache__" not in p.parts
        if not (scenarios / f"{p.stem.removesuffix('_spec')}_spec.py").exists()
    }
    missing = sorted(m for m in modules if not re.search(rf"(?<![\w.]){re.escape(m)}(?!\w)", layout))
    assert not missing, f"README's Layout does not name {missing}"
