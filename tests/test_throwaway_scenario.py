"""A scenario is one file plus a registration: tests/data/throwaway_scenario.py, registered through
the `repro.scenarios` entry-point group of a package made here, runs through its generated
command, `repro matrix`, and the JSON, JUnit and HTML reports, with no other file of repro
touched. Real processes (parent, rank server, ranks): each finds the plugin the way an
installed package's would be found."""

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

from conftest import REPO

pytestmark = pytest.mark.slow

MATRIX = """\
[matrix]
description = "throwaway plugin"
device = "cpu"
deadline_s = 60
steps = 3
[[trial]]
scenario = "throwaway"
mode = "unfixed"
[[trial]]
scenario = "throwaway"
mode = "unfixed"
hide_bug = true
[[trial]]
scenario = "throwaway"
mode = "fixed"
[[trial]]
scenario = "throwaway"
mode = "fixed"
set = ["model.size=100000000000000"]
expect = "UNSUPPORTED"
"""


@pytest.fixture
def plugin_env(tmp_path):
    """An installed package's metadata naming the scenario's SPEC, on the path of every process."""
    dist = tmp_path / "site" / "throwaway_plugin-0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: throwaway-plugin\nVersion: 0\n")
    (dist / "entry_points.txt").write_text("[repro.scenarios]\nthrowaway = throwaway_scenario:SPEC\n")
    path = os.pathsep.join([str(REPO), str(REPO / "tests" / "data"), str(tmp_path / "site")])
    return {**os.environ, "PYTHONPATH": path}


def repro(env, *args):
    return subprocess.run(
        [sys.executable, "-m", "repro", *map(str, args)], capture_output=True, text=True, env=env, timeout=300
    )


def test_throwaway_command_runs_and_reports(tmp_path, plugin_env):
    help_ = repro(plugin_env, "--help")
    assert "throwaway" in help_.stdout
    bad = repro(plugin_env, "throwaway", "--set", "model.size=0")
    assert bad.returncode == 2 and "model.size = 0 must be >= 1" in bad.stderr  # its own rule

    out = tmp_path / "one"
    out.mkdir()
    done = repro(
        plugin_env,
        "throwaway",
        "--steps",
        "3",
        "--device",
        "cpu",
        "--json",
        out / "r.json",
        "--junit",
        out / "r.xml",
        "--html",
        out / "r.html",
        "--artifacts",
        out / "art",
    )
    assert done.returncode == 0, done.stderr
    trial = json.loads((out / "r.json").read_text())["trials"][0]
    assert trial["scenario"] == "throwaway" and trial["outcome"] == "MISMATCH"
    assert trial["expected"] == ["MISMATCH"] and trial["met"] is True  # its expectation
    assert trial["wrong_total"] == 16  # its record field
    assert trial["config"]["run"]["hide_bug"] is False and trial["config"]["preset"] == ""
    assert "acceptance_rate" in trial  # other scenarios' fields stay on every trial
    assert "Throwaway: 16 elements differed from the reference." in done.stdout  # its report line
    case = ET.parse(out / "r.xml").getroot().find(".//testcase")
    assert case.get("classname") == "repro.throwaway" and case.find("failure") is None
    page = (out / "r.html").read_text()
    assert "Wrong elements per step" in page and ">offset<" in page and ">wrong<" in page  # chart, columns


def test_throwaway_matrix(tmp_path, plugin_env):
    matrix = tmp_path / "throwaway.toml"
    matrix.write_text(MATRIX)
    listed = repro(plugin_env, "matrix", "--config", matrix, "--list")
    assert listed.returncode == 0, listed.stderr
    assert "01-throwaway-unfixed-tp1-keep-hidden expect clean" in listed.stdout  # its run key's tag
    done = repro(
        plugin_env,
        "matrix",
        "--config",
        matrix,
        "--allow-unsupported",
        "--json",
        tmp_path / "m.json",
        "--junit",
        tmp_path / "m.xml",
        "--html",
        tmp_path / "m.html",
        "--artifacts",
        tmp_path / "art",
    )
    assert done.returncode == 0, done.stdout + done.stderr
    trials = json.loads((tmp_path / "m.json").read_text())["trials"]
    assert [t["outcome"] for t in trials] == ["MISMATCH", "CLEAN", "CLEAN", "UNSUPPORTED"]
    assert "needs at least" in trials[3]["first_failure"]["detail"]  # its footprint
    assert [t["wrong_total"] for t in trials] == [16, 0, 0, None]
    suite = ET.parse(tmp_path / "m.xml").getroot().find("testsuite")
    assert suite.get("tests") == "4" and suite.get("failures") == "0"
    assert (tmp_path / "m.html").read_text().count('class="chart"') >= 1
