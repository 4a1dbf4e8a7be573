"""One output object (repro/output.py) for every command: one table of exit codes, one error
line, `--json -` resolved once; every scenario command, selftest included, generated."""

import ast
import importlib.util
import inspect
import json
import os
import re
import subprocess
import sys

import pytest
from typer.testing import CliRunner

import repro.audit.scan
import repro.output
from conftest import REPO
from repro.cli import app, scenario_command
from repro.config import RunConfig
from repro.output import Exit, Output
from repro.scenarios import SCENARIOS

runner = CliRunner()

# One trial, two ranks on CPU, one step: the cheapest run that writes a report.
ONE_TRIAL = """\
[matrix]
device = "cpu"
[[trial]]
scenario = "selftest"
tp = 2
steps = 1
"""


def invoke(*args):
    return runner.invoke(app, list(args))


def commands() -> dict:
    return {c.name: c for c in app.registered_commands}


# -- one table of exit codes ----------------------------------------------------------------


def readme_exit_codes() -> list[int]:
    readme = (REPO / "README.md").read_text()
    table = readme[readme.index("| exit | meaning |") :].split("\n\n")[0]
    return [int(line.split("|")[1]) for line in table.splitlines()[2:]]


def test_readme_exit_table_is_the_exit_table():
    assert readme_exit_codes() == sorted({int(e) for e in Exit})


def test_no_module_declares_exit_codes_of_its_own():
    """An `EXIT_... = 2` anywhere but repro/output.py is a second table that can drift."""
    declared = []
    for path in (REPO / "repro").rglob("*.py"):
        if path.name == "output.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Assign):
                continue
            names = [n.id for t in node.targets for n in ast.walk(t) if isinstance(n, ast.Name)]
            numbers = [n for n in ast.walk(node.value) if isinstance(n, ast.Constant) and type(n.value) is int]
            if numbers and any(name.startswith("EXIT_") for name in names):
                declared.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert declared == []


def test_every_help_lists_codes_of_the_table():
    for name, command in commands().items():
        text = invoke(name, "--help").stdout
        if "Exit codes:" not in text:
            continue
        rows = text[text.index("Exit codes:") :].splitlines()[1:]
        codes = [row.split()[0] for row in rows if row.strip()]
        assert codes and all(c == "0.." or int(c) in set(Exit) for c in codes), (name, codes)


@pytest.mark.parametrize(
    "args,code",
    [
        (["presets"], Exit.OK),
        (["presets", "nope"], Exit.USAGE),  # click's own check
        (["gemma4-mtp", "--mode", "halfway"], Exit.USAGE),
        (["selftest", "--print-config"], Exit.OK),
        (["selftest", "--inject-fault", "melt@0:0"], Exit.USAGE),
        (["matrix", "--list"], Exit.OK),
        (["matrix", "--jobs", "0"], Exit.USAGE),
        (["matrix", "--config", "gpu-2", "--artifacts", "{tmp}"], Exit.ENV),  # every trial UNSUPPORTED here
        (["merge", "/nonexistent.json"], Exit.USAGE),
        (["doctor", "--json", "/nonexistent/d.json"], Exit.USAGE),
        (["vllm-audit", "--path", "/a", "--wheel", "/b"], Exit.USAGE),
        (["watch"], Exit.USAGE),
        (["watch-report", "/nonexistent"], Exit.USAGE),
        ([], Exit.USAGE),  # bare `repro`: its help
        (["--version"], Exit.OK),
    ],
)
def test_exit_codes_are_members_of_the_table(args, code, tmp_path, no_gpu):
    """Not only the same number: the member itself, so no command returns a bare literal."""
    result = invoke(*[a.format(tmp=tmp_path) for a in args])
    assert isinstance(result.exit_code, Exit), (args, repr(result.exit_code), result.stderr)
    assert result.exit_code is code, (args, result.exit_code, result.stderr)


def test_a_trial_that_misses_its_expectation_exits_failed(tmp_path, no_gpu):
    result = invoke("selftest", "--tp", "1", "--steps", "1", "--expect", "reproduced", "--artifacts", str(tmp_path))
    assert result.exit_code is Exit.FAILED, result.stderr


def test_vllm_missing_is_an_environment_exit(monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        repro.audit.scan.importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else find_spec(name, *a)
    )
    assert invoke("vllm-audit").exit_code is Exit.ENV


def test_watch_exit_codes_come_from_the_table():
    from repro.watch.command import CommandResult, finish
    from repro.watch.records import WatchReport

    assert finish(WatchReport([], []), ["true"], CommandResult(0, True), "warn").exit is Exit.INTERRUPTED
    assert finish(WatchReport([], []), ["true"], CommandResult(7, False), "warn").exit == 7  # CMD's own


# -- one error line ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args",
    [
        ["gemma4-mtp", "--mode", "halfway"],  # a usage error click found
        ["presets", "nope"],
        ["gemma4-mtp", "--tp", "0", "--device", "cpu"],  # a config error
        ["selftest", "--inject-fault", "melt@0:0"],
        ["matrix", "--jobs", "0"],
        ["merge", "/nonexistent.json"],
        ["doctor", "--json", "/nonexistent/d.json"],
        ["vllm-audit", "--path", "/a", "--wheel", "/b"],
        ["watch"],
        ["watch-report", "/nonexistent"],
    ],
)
def test_every_error_line_comes_from_the_one_function(args, monkeypatch, no_gpu):
    monkeypatch.setattr(repro.output, "error_line", lambda message: f"ONE<{message}>")
    result = invoke(*args)
    assert result.exit_code == Exit.USAGE
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("ONE<") and lines[0].endswith(">"), result.stderr


def test_the_error_line():
    assert repro.output.error_line("--jobs 0: must be >= 1") == "repro: error: --jobs 0: must be >= 1"


# -- `--json -` resolved once -------------------------------------------------------------------


@pytest.mark.parametrize("json_path,mode,file", [("-", True, None), ("r.json", False, "r.json"), (None, False, None)])
def test_json_path_resolves_to_stdout_or_a_file(json_path, mode, file):
    out = Output(json_path)
    assert (out.json_mode, out.json_file) == (mode, file)


def only_json(result, schema: str) -> dict:
    """stdout is the JSON document and nothing else; the human report went to stderr."""
    assert result.exit_code == Exit.OK, result.stderr
    doc = json.loads(result.stdout)
    assert doc["schema"] == schema and result.stderr.strip()
    return doc


@pytest.fixture(scope="module")
def shard_report(tmp_path_factory):
    """One shard (1/1) of a one-trial matrix, as `repro matrix --json -` wrote it on stdout."""
    tmp = tmp_path_factory.mktemp("shard")
    (tmp / "one.toml").write_text(ONE_TRIAL)
    result = invoke(
        "matrix", "--config", str(tmp / "one.toml"), "--shard", "1/1", "--artifacts", str(tmp / "arts"), "--json", "-"
    )
    path = tmp / "shard.json"
    path.write_text(result.stdout)
    return result, path


@pytest.fixture(scope="module")
def watch_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("watch") / "run"
    subprocess.run(
        [sys.executable, "-m", "repro", "watch", "--run-dir", str(run_dir), "--", sys.executable, "-c", "pass"],
        check=True,
        capture_output=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=120,
    )
    return run_dir


def test_json_dash_for_a_scenario_command(tmp_path, no_gpu):
    result = invoke("selftest", "--tp", "1", "--steps", "1", "--artifacts", str(tmp_path), "--json", "-")
    only_json(result, "repro.report/1")
    assert "1/1 trials met their expectation" in result.stderr


def test_json_dash_for_matrix(shard_report):
    result, _ = shard_report
    doc = only_json(result, "repro.report/1")
    assert doc["shard"]["count"] == 1 and "1/1 trials met their expectation" in result.stderr


def strip_created(text: str) -> str:
    """The document without its top-level creation time (a watch report's is when it was read)."""
    return re.sub(r'^  "created": .*\n', "", text, flags=re.M)


@pytest.mark.parametrize("command", ["merge", "watch-report"])
def test_json_dash_writes_what_a_json_file_holds(command, shard_report, watch_run, tmp_path):
    source, schema = (shard_report[1], "repro.report/1") if command == "merge" else (watch_run, "repro.watch/1")
    to_stdout = invoke(command, str(source), "--json", "-")
    only_json(to_stdout, schema)
    to_file = invoke(command, str(source), "--json", str(tmp_path / "r.json"))
    assert to_file.exit_code == Exit.OK, to_file.stderr
    in_file = (tmp_path / "r.json").read_text()
    assert strip_created(to_stdout.stdout) == strip_created(in_file)
    # The same human report, on stderr with `--json -` (merge's on stdout without; watch's
    # always on stderr, stdout being CMD's).
    assert to_stdout.stderr == to_file.stdout + to_file.stderr


@pytest.mark.parametrize("args,table_word", [(["doctor"], "torch"), (["vllm-audit", "--path", "{tree}"], "43909")])
def test_json_dash_moves_tables_to_stderr_too(args, table_word, tmp_path):
    from fixtures_audit import source_files, write_tree

    tree = write_tree(tmp_path / "src", source_files(refresh="none"), version="0.28.0")
    result = invoke(*[a.format(tree=tree) for a in args], "--json", "-")
    assert result.exit_code == Exit.OK, result.stderr
    json.loads(result.stdout)
    assert table_word in result.stderr


# -- selftest generated like the other scenario commands -----------------------------------------


def test_every_scenario_command_is_generated_from_its_spec():
    registered = commands()
    for spec in SCENARIOS.values():
        if spec.name in registered:
            callback = registered[spec.name].callback
            assert callback.__qualname__ == scenario_command.__name__ + ".<locals>.command", spec.name
            generated = inspect.signature(scenario_command(spec)).parameters
            assert list(inspect.signature(callback).parameters) == list(generated), spec.name


def test_unused_run_keys_are_common_run_keys_left_off_the_command():
    fields = {f for f in RunConfig.__dataclass_fields__}
    for spec in SCENARIOS.values():
        assert set(spec.unused_run_keys) <= fields - set(spec.run_key_names), spec.name
    params = inspect.signature(commands()["selftest"].callback).parameters
    assert not set(SCENARIOS["selftest"].unused_run_keys) & set(params)
    assert {"tp", "steps", "deadline", "stall", "json_path", "print_config", "inject_fault"} <= set(params)
