"""Everyday use of the CLI: --version, completion, help that lists choices, presets, where
artifacts go, matrix --list/--only, vllm-audit without vLLM."""

import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest
from typer.testing import CliRunner

import repro
import repro.audit.scan
from conftest import REPO
from repro.cli import app

runner = CliRunner()
COMMANDS = [
    "gemma4-mtp",
    "nvfp4-reload",
    "selftest",
    "sleep-wake",
    "matrix",
    "presets",
    "doctor",
    "vllm-audit",
    "watch",
]


def invoke(*args, env=None):
    return runner.invoke(app, list(args), env=env)


def flat(text: str) -> str:
    return " ".join(text.split())


def test_version():
    result = invoke("--version")
    assert result.exit_code == 0 and result.stdout == f"repro {repro.__version__}\n"


def test_shell_completion_script_and_answers(tmp_path):
    script = tmp_path / "repro"  # completion keys on the program's name
    script.write_text(f"#!{sys.executable}\nfrom repro.cli import main\nmain()\n")
    script.chmod(0o755)
    shown = subprocess.run(
        [str(script), "--show-completion", "bash"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=60,
    )
    assert shown.returncode == 0 and "_REPRO_COMPLETE=complete_bash" in shown.stdout

    def complete(words: str) -> list[str]:
        env = {
            **os.environ,
            "PYTHONPATH": str(REPO),
            "_REPRO_COMPLETE": "complete_bash",
            "COMP_WORDS": words,
            "COMP_CWORD": str(len(words.split(" ")) - 1),
        }
        out = subprocess.run([str(script)], env=env, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        return out.stdout.split()

    assert "--after-free" in complete("repro gemma4-mtp --af")
    assert complete("repro nvfp4-reload --mode ") == ["unfixed", "kernel-reuse", "fixed"]
    assert "gemma4-mtp" in complete("repro ge")
    assert "gemma4-tiny" in complete("repro presets gem")


@pytest.mark.parametrize("command", COMMANDS)
def test_help_has_no_type_placeholders(command):
    result = invoke(command, "--help")
    assert result.exit_code == 0
    assert not re.search(r"<(str|int|float|path|bool|list\[\w+\]|text|integer)>", result.stdout), result.stdout


def lists_choices(text: str, option: str, choices: str) -> bool:
    """--help shows an option's choices as <a|b> (typer >= 0.28) or [a|b] (older typer)."""
    return f"{option} <{choices}>" in text or f"{option} [{choices}]" in text


@pytest.mark.parametrize(
    "scenario,modes,after_free",
    [
        ("gemma4-mtp", "unfixed|fixed|reload-safe", "release"),
        ("nvfp4-reload", "unfixed|kernel-reuse|fixed", "poison"),
    ],
)
def test_scenario_help_lists_choices_and_defaults(scenario, modes, after_free):
    text = flat(invoke(scenario, "--help").stdout)
    assert lists_choices(text, "--mode", modes) and "[default: unfixed]" in text
    assert lists_choices(text, "--after-free", "keep|release|reuse|poison") and f"[default: {after_free}]" in text
    assert lists_choices(text, "--guard", "off|warn|raise") and "[default: warn]" in text
    assert lists_choices(text, "--device", "auto|cuda|cpu") and "[default: auto]" in text
    assert "--seed N Seed of the weights and inputs" in text


def test_steps_help_is_per_scenario():
    gemma = flat(invoke("gemma4-mtp", "--help").stdout)
    moe = flat(invoke("nvfp4-reload", "--help").stdout)
    assert "Decode steps" in gemma and "Reload steps" not in gemma
    assert "Reload steps" in moe and "Decode steps" not in moe


def test_presets_list_and_show():
    listed = invoke("presets")
    assert listed.exit_code == 0
    names = {line.split()[0] for line in listed.stdout.splitlines()[1:]}
    assert {"gemma4-tiny", "gemma4-e2b", "moe-tiny", "qwen3-30b-a3b-moe", "ci-smoke", "gpu-2"} <= names
    shown = invoke("presets", "gemma4-tiny")
    assert shown.exit_code == 0 and 'scenario = "gemma4-mtp"' in shown.stdout
    assert "'nope' is not one of 'ci-smoke'" in invoke("presets", "nope").stderr


def test_artifacts_default_to_the_cache_with_a_latest_link(tmp_path, no_gpu, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cache = tmp_path / "cache"
    result = invoke("selftest", "--steps", "1", "--json", "-", env={"XDG_CACHE_HOME": str(cache)})
    assert result.exit_code == 0, result.stderr
    latest = cache / "repro" / "runs" / "latest"
    assert latest.is_symlink() and (latest / "00-selftest-clean-tp2-keep" / "rank1.jsonl").is_file()
    assert f"trial files in {latest.resolve()}" in flat(result.stderr)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache"]  # nothing in the cwd
    again = invoke("selftest", "--steps", "1", "--artifacts", str(tmp_path / "mine"))
    assert again.exit_code == 0 and (tmp_path / "mine" / "latest").resolve().parent == tmp_path / "mine"
    assert latest.resolve() != (tmp_path / "mine" / "latest").resolve()


def test_watch_records_default_to_the_cache(monkeypatch, tmp_path):
    from repro.watch import command as watch

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert watch.default_run_dir().parent == tmp_path / "repro" / "runs"
    assert lists_choices(flat(invoke("watch", "--help").stdout), "--on-finding", "warn|raise")


def test_matrix_list_names_every_trial_without_running(tmp_path, no_gpu):
    result = invoke("matrix", "--list", env={"XDG_CACHE_HOME": str(tmp_path)})
    assert result.exit_code == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 22 and lines[0].startswith("00-gemma4-mtp-unfixed-tp2-release")
    assert all(" expect " in line and line.rstrip().endswith("cpu") for line in lines)
    assert not any(tmp_path.iterdir())


def test_matrix_list_shows_unsupported_gpu_trials(no_gpu):
    lines = invoke("matrix", "--config", "gpu-2", "--list").stdout.splitlines()
    assert all(line.endswith(" not here") for line in lines[:23])
    reason = " ".join(lines[23:])
    assert reason.startswith("not here (23 trials, UNSUPPORTED): device = cuda but no CUDA GPU is visible")
    assert all(len(line) <= 80 and line == line.rstrip() for line in lines)  # a pipe: 80 columns


def test_matrix_only_keeps_ids_of_the_full_matrix(tmp_path, no_gpu):
    listed = invoke("matrix", "--list", "--only", "nvfp4-reload-*-identity", "--only", "reload-safe").stdout
    ids = [line.split()[0] for line in listed.splitlines()]
    assert ids == [
        "02-gemma4-mtp-reload-safe-tp2-release",
        "05-gemma4-mtp-reload-safe-tp2-release-reload",
        "08-nvfp4-reload-kernel-reuse-tp1-poison-identity",
    ]
    result = invoke("matrix", "--only", "08-*", "--json", "-", "--artifacts", str(tmp_path))
    assert result.exit_code == 0, result.stderr
    trials = json.loads(result.stdout)["trials"]
    assert [t["id"] for t in trials] == [ids[2]] and trials[0]["met"]


def test_matrix_only_matching_nothing_is_usage_error():
    result = invoke("matrix", "--only", "no-such-trial")
    assert result.exit_code == 2 and "matches none of the 22 trials" in result.stderr
    assert "--list" in result.stderr


def test_vllm_audit_without_vllm_is_environment_exit_3(monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        repro.audit.scan.importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else find_spec(name, *a)
    )
    result = invoke("vllm-audit")
    assert result.exit_code == 3 and "vllm is not installed" in result.stderr


def test_gpu_matrix_on_cpu_says_why_once_and_points_at_ci_smoke(no_gpu):
    result = invoke("matrix", "--config", "gpu-2")
    assert result.exit_code == 3
    reason = "no CUDA GPU is visible"
    assert result.stdout.count(reason) == 1, result.stdout
    assert "23 trials (00-22): UNSUPPORTED (not run, not a pass)" in result.stdout
    assert len(result.stdout.splitlines()) <= 5
    assert "`repro matrix` runs the CPU matrix (ci-smoke)" in flat(result.stderr)
    assert "started" not in result.stderr  # nothing was started


def run_cli(*args, columns=None):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("COLUMNS", None)
    if columns:
        env["COLUMNS"] = str(columns)
    return subprocess.run([sys.executable, "-m", "repro", *args], capture_output=True, text=True, env=env, timeout=120)


def test_wide_and_narrow_pipes_get_lines_without_padding_or_cuts(tmp_path):
    for columns in (None, 160):
        presets = run_cli("presets", columns=columns).stdout.splitlines()
        assert all(line == line.rstrip() for line in presets)
        assert all(len(line) <= (columns or 80) for line in presets)
    wide = run_cli("presets", columns=160).stdout
    assert "CPU smoke: every scenario x mode x lifecycle, tiny dims, guard verdicts\n" in wide  # whole
    report = run_cli("selftest", "--steps", "1", "--device", "cpu", "--artifacts", str(tmp_path), columns=160)
    assert report.returncode == 0, report.stderr
    lines = report.stdout.splitlines() + report.stderr.splitlines()
    assert lines and all(line == line.rstrip() for line in lines)
    narrow = run_cli("selftest", "--steps", "1", "--device", "cpu", "--artifacts", str(tmp_path)).stdout
    assert not any(line.rstrip().endswith(("|", "·")) for line in narrow.splitlines())
    doctor = run_cli("doctor").stdout
    assert "…" not in doctor and all(len(line) <= 80 for line in doctor.splitlines())


def test_progress_timer_stays_whole_on_a_narrow_terminal():
    import io
    from rich.console import Console
    from repro import report as rp

    stream = io.StringIO()
    with rp.Progress(Console(file=stream, width=60, force_terminal=True, color_system=None)) as progress:
        progress.add("t1", "00-gemma4-mtp-fixed-tp2-release-reload-drafter", 14)
        progress.update("t1", 3)
    assert "3/14 running 0:00:0" in stream.getvalue() and "0:00:…" not in stream.getvalue()
