"""repro.pytest.attribution on hand-written record files: phases from markers, owners and times."""

from __future__ import annotations

import json
from pathlib import Path

from repro.pytest.attribution import OUTSIDE, Attribution, Phase, all_findings, graph_key, run_stats


def write(path: Path, *records: dict, partial: str = "") -> None:
    with open(path, "a") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
        f.write(partial)


def process(pid: int, owner: str | None = None) -> dict:
    return {"kind": "process", "pid": pid, "env": {"REPRO_WATCH_OWNER": owner} if owner else {}}


def marker(nodeid: str, phase: str, at: float) -> dict:
    return {"kind": "test", "nodeid": nodeid, "phase": phase, "at": at, "t": at}


def finding(graph: str, t: float, slot: str = "w") -> dict:
    return {
        "kind": "finding",
        "mechanism": "guard",
        "t": t,
        "finding": {"graph": graph, "slot": slot, "status": "freed", "message": f"{slot} freed"},
    }


def test_own_file_phases_follow_the_markers(tmp_path):
    main = tmp_path / "h-1.jsonl"
    write(
        main,
        process(1),
        marker("t.py::a", "setup", 1.0),
        {"kind": "capture", "graph": "#1 x", "t": 1.1},
        marker("t.py::a", "call", 2.0),
        marker("t.py::b", "call", 3.0),
        finding("#1 x (+2 more)", 3.1),
    )
    att = Attribution(tmp_path, me="h-1")
    (f,) = att.poll()
    assert f.captured_in == Phase("t.py::a", "setup") and f.replayed_in == Phase("t.py::b", "call")
    assert f.id == "h-1.jsonl:6" and att.poll() == []  # read once


def test_started_process_by_owner_and_time_and_a_line_being_written(tmp_path):
    att = Attribution(tmp_path, me="h-1")
    write(tmp_path / "h-1.jsonl", process(1), marker("t.py::a", "call", 10.0))
    att.note_phase(10.0, Phase("t.py::a", "call"))
    att.note_phase(20.0, OUTSIDE)
    child = tmp_path / "h-2.jsonl"
    write(
        child,
        process(2, owner="h-1"),
        {"kind": "capture", "graph": "#1 y", "t": 11.0},
        partial=json.dumps(finding("#1 y", 12.0))[:20],
    )
    write(tmp_path / "h-3.jsonl", process(3, owner="h-9"), finding("#1 z", 12.0))  # another session's
    assert att.poll() == []  # the finding's line is not complete yet
    with open(child, "a") as f:
        f.write(json.dumps(finding("#1 y", 12.0))[20:] + "\n")
    (f,) = att.poll()
    assert f.pid == 2 and f.captured_in == f.replayed_in == Phase("t.py::a", "call")


def test_a_started_process_running_its_own_session_reports_itself(tmp_path):
    write(tmp_path / "h-1.jsonl", process(1))
    write(tmp_path / "h-2.jsonl", process(2, owner="h-1"), marker("inner.py::x", "call", 1.0), finding("#1 q", 1.5))
    assert Attribution(tmp_path, me="h-1").poll() == []


def test_all_findings_keeps_to_its_session(tmp_path):
    write(tmp_path / "h-1.jsonl", process(1))  # controller
    write(
        tmp_path / "h-2.jsonl",
        process(2, owner="h-1"),
        marker("t.py::a", "call", 5.0),
        {"kind": "capture", "graph": "#1 g", "t": 5.1},
    )  # worker
    write(tmp_path / "h-3.jsonl", process(3, owner="h-2"), finding("#1 k", 5.5))  # its child
    write(tmp_path / "h-4.jsonl", process(4, owner="h-2"), {"kind": "capture", "graph": "#1 k", "t": 5.2})
    write(tmp_path / "h-8.jsonl", process(8), marker("old.py::z", "call", 1.0), finding("#1 o", 1.1))
    found = all_findings(tmp_path, root="h-1")
    assert [(f.pid, f.replayed_in.nodeid) for f in found] == [(3, "t.py::a")]
    assert found[0].captured_in is None  # its graph was captured in another process
    stats = run_stats(tmp_path, root="h-1")
    assert (stats.processes, stats.captures) == (4, 2)


def test_graph_key_strips_the_more_graphs_suffix():
    assert graph_key("#3 a.py:1 in f (+6 more)") == "#3 a.py:1 in f"
    assert graph_key("#3 a.py:1 in f") == "#3 a.py:1 in f"
