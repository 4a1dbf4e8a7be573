"""The watch report at engine scale: repeated findings grouped, lines capped, pool contract said."""

from __future__ import annotations

import io
import json
import xml.etree.ElementTree as ET

from rich.console import Console

from repro.report import watch_view as V
from repro.watch import records as R
from repro.watch import report as W
from repro.outcome import Finding, to_jsonable


def finding(slot, graph, status="freed", freed_at="decoder.py:88 in capture (reassigned)"):
    return Finding(
        slot=slot,
        graph=graph,
        status=status,
        when="first replay after capture",
        rank=0,
        shape=[8, 1024],
        dtype="bfloat16",
        nbytes=16384,
        old_ptr=0x7F0000000000,
        freed_at=freed_at,
        message=f"graph '{graph}' captured tensor {slot} ...",
    )


def write_process(run_dir, pid, findings, argv=("python", "engine.py"), pool_managed=0, stood_aside=0):
    lines = [{"kind": "process", "pid": pid, "host": "h", "argv": list(argv), "started": pid}]
    lines += [{"kind": "finding", "mechanism": "guard", "rank": 0, "finding": to_jsonable(f)} for f in findings]
    lines.append(
        {
            "kind": "exit",
            "counters": {"replays": 10},
            "census": "active",
            "pool_managed": pool_managed,
            "cross_pool": 0,
            "stood_aside": stood_aside,
        }
    )
    (run_dir / f"h-{pid}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))


def engine_report(tmp_path):
    repeated = [
        finding("<local a of capture_pieces>", f"#{i} piece {i % 33} bs={8 * (i // 33 + 1)}") for i in range(2046)
    ]
    real = [
        finding("model.layers.7.rotary", f"#{i} bs={i}", status="freed", freed_at="run.py:9 in reload") for i in (1, 2)
    ]
    write_process(tmp_path, 11, repeated[:1000] + real[:1])
    write_process(tmp_path, 12, repeated[1000:] + real[1:], pool_managed=2211)
    return R.load_report([tmp_path])


def rendered(rep, width=100):
    out = io.StringIO()
    W.render(rep, Console(file=out, width=width, color_system=None))
    return out.getvalue()


def test_thousands_of_repeated_findings_read_as_one_line_each_group(tmp_path):
    rep = engine_report(tmp_path)
    groups = rep.groups()
    assert [(g.pattern, g.count) for g in groups] == [
        ("<local a of capture_pieces>", 2046),
        ("model.layers.*.rotary", 2),
    ]
    text = rendered(rep)
    assert "Findings (2048 in 2 groups)" in text
    assert "in 2046 graphs of 2 processes" in text
    assert text.count("FREED") == 2  # one headline per group, not per finding
    assert len(text.splitlines()) < 60


def test_groups_past_the_cap_are_counted_not_printed(tmp_path):
    findings = [finding(f"w{i}", f"g{i}", freed_at=f"f.py:{i} in f") for i in range(V.MAX_GROUPS_SHOWN + 5)]
    write_process(tmp_path, 11, findings)
    text = rendered(R.load_report([tmp_path]))
    assert text.count("FREED") == V.MAX_GROUPS_SHOWN
    assert "5 more groups (5 findings; all are in --json)" in text


def test_json_keeps_every_finding_and_groups_point_at_them(tmp_path):
    rep = engine_report(tmp_path)
    doc = json.loads(W.report_json(rep))
    assert len(doc["findings"]) == 2048 and doc["schema"] == "repro.watch/1"
    first, second = doc["groups"]
    assert first["count"] == 2046 and len(first["findings"]) == 2046
    assert {doc["findings"][i]["finding"]["slot"] for i in second["findings"]} == {"model.layers.7.rotary"}
    assert second["processes"] == ["h:11", "h:12"]
    assert any(n.startswith("pool contract: 2211 captured storage(s)") for n in doc["notes"])


def test_junit_has_one_failure_per_group_and_survives_control_characters(tmp_path):
    write_process(tmp_path, 11, [finding("cache.k", f"g{i}") for i in range(50)], argv=("python", "x\x01y.py"))
    root = ET.fromstring(W.junit_xml(R.load_report([tmp_path])))
    [case] = root.findall("testsuite/testcase")
    assert len(case.findall("failure")) == 1
    assert "in 50 graphs" in case.find("failure").get("message")


def test_pool_contract_is_said_in_the_console(tmp_path):
    write_process(tmp_path, 11, [], pool_managed=64)
    assert "pool contract: 64 captured storage(s) lived in their own graph's memory pool" in rendered(
        R.load_report([tmp_path]), 200
    )


# ---- the files go through the trial report's writers ------------------------------------------

HOSTILE = "\x01<script>alert(1)</script>"


def hostile_run(tmp_path):
    """Records as a program can make them: markup and a control character in a tensor name and a
    message, an argv with bytes that were not UTF-8 (surrogate escapes once read back)."""
    f = finding(f"cache.k{HOSTILE}", "g0")
    f.message = f"captured tensor freed {HOSTILE}"
    write_process(tmp_path, 11, [f], argv=("python", f"x{HOSTILE}.py", "--name=caf\udce9"))
    return R.load_report([tmp_path])


def test_junit_of_hostile_records_parses_and_keeps_their_text(tmp_path):
    path = tmp_path / "out" / "w.xml"
    W.write_artifacts(hostile_run(tmp_path), str(path), None)
    root = ET.parse(path).getroot()
    [case] = root.iter("testcase")
    failure = case.find("failure")
    assert "cache.k<script>alert(1)</script>" in failure.get("message")
    assert "captured tensor freed <script>alert(1)</script>" in failure.text
    assert case.find("system-out").text == "python x<script>alert(1)</script>.py --name=caf\ufffd"
    assert root.find("testsuite/properties/property[@name='schema']").get("value") == R.SCHEMA


def test_html_of_hostile_records_is_escaped_by_the_shared_template(tmp_path):
    path = tmp_path / "out" / "w.html"
    W.write_artifacts(hostile_run(tmp_path), None, str(path))
    page = path.read_text(encoding="utf-8")
    assert "<script" not in page and "\x01" not in page
    assert "cache.k&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "captured tensor freed &lt;script&gt;" in page and "x&lt;script&gt;" in page
    # The trial page's layout and pieces: its stylesheet, the finding block, the folded facts.
    assert page.startswith("<!DOCTYPE html>") and "table.facts th{" in page
    assert '<div class="finding">' in page and "<details open>" in page


def test_html_says_what_the_console_says(tmp_path):
    write_process(tmp_path, 11, [finding("cache.k", f"g{i}") for i in range(3)], pool_managed=64)
    rep = R.load_report([tmp_path])
    rep.notes = ["Nothing checked: a note"]
    page = W.report_html(rep)
    text = rendered(rep, 300)
    for line in (
        "Processes watched (1)",
        "Findings (3 in 1 group)",
        "in 3 graphs, rank 0",
        "pool contract: 64 captured storage(s)",
        "Nothing checked: a note",
        "records: ",
    ):
        assert line in text
        assert line.replace("'", "&#39;") in page, line


def test_json_goes_through_the_strict_writer(tmp_path):
    write_process(tmp_path, 11, [finding("cache.k", "g0")])
    path = next(tmp_path.glob("*.jsonl"))
    head, *rest = path.read_text().splitlines()
    process = json.loads(head)
    process["started"] = float("nan")  # a bare NaN token, which Python's json reads back
    path.write_text("\n".join([json.dumps(process), *rest]) + "\n")

    def reject(token):
        raise AssertionError(f"non-standard JSON token {token}")

    doc = json.loads(W.report_json(R.load_report([tmp_path])), parse_constant=reject)
    assert doc["processes"][0]["started"] == "NaN" and doc["schema"] == R.SCHEMA


def test_json_keeps_its_schema(tmp_path):
    """The watch JSON's keys, as tools read them, are unchanged by the shared writer."""
    write_process(tmp_path, 11, [finding("cache.k", "g0")], pool_managed=1)
    doc = json.loads(W.report_json(R.load_report([tmp_path])))
    assert list(doc) == [
        "processes",
        "findings",
        "command",
        "run_dirs",
        "command_exit",
        "exit",
        "interrupted",
        "on_finding",
        "created",
        "notes",
        "schema",
        "groups",
    ]
    assert list(doc["findings"][0]) == ["pid", "host", "rank", "mechanism", "finding"]
    assert list(doc["groups"][0]) == [
        "pattern",
        "status",
        "mechanism",
        "freed_at",
        "count",
        "graphs",
        "names",
        "processes",
        "ranks",
        "findings",
    ]
    assert "record_file" in doc["processes"][0] and "pool_managed" in doc["processes"][0]


# -- everyday edges: what a CPU run of watch says, at 80 columns and in the page ---------------


def cpu_process(run_dir, pid=21, argv=("python3", "examples/watch_kv_cache.py")):
    """A watched process as on a machine without a GPU: torch hooked, no graph captured."""
    lines = [
        {"kind": "process", "pid": pid, "host": "h", "argv": list(argv), "started": pid},
        {"kind": "hooked", "torch": "2.13.0+cpu"},
        {"kind": "exit", "counters": {"replays": 0}, "census": "not checked (no capture)"},
    ]
    (run_dir / f"h-{pid}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))


def test_nothing_captured_reads_as_nothing_checked_not_as_no_findings(tmp_path):
    from repro.watch.command import merge

    cpu_process(tmp_path)
    rep = merge([tmp_path])
    assert rep.exit == 0 and not rep.findings
    text = rendered(rep, 80)
    first = text.splitlines()[0]
    assert first.startswith("nothing checked (no CUDA graph captured)") and "no findings" not in first
    assert "Nothing checked: no CUDA graph was captured in the 1 watched process(es)" in " ".join(text.split())
    assert "this machine has no GPU" not in text  # merged records: not this machine's to say


def test_a_graph_checked_without_findings_is_no_findings(tmp_path):
    write_process(tmp_path, 11, [])
    rep = R.load_report([tmp_path])
    rep.processes[0].graphs = 3
    assert rendered(rep, 80).startswith("no findings · 1 process(es) watched")


def test_80_columns_break_between_parts_and_never_inside_a_command(tmp_path):
    cpu_process(tmp_path, argv=("python3", "examples/watch_kv_cache.py", "--steps", "4"))
    rep = R.load_report([tmp_path])
    rep.command_exit = 0
    narrow = rendered(rep, 80)
    lines = narrow.splitlines()
    assert not any(line.rstrip().endswith(("·", "|", "│")) for line in lines), narrow
    assert all(len(line) <= 80 for line in lines)
    assert any(line.strip() == "pid 21: examples/watch_kv_cache.py --steps 4" for line in lines), narrow
    wide = rendered(rep, 160)
    row = next(line for line in wide.splitlines() if line.lstrip().startswith("21 "))
    assert row.rstrip().endswith("examples/watch_kv_cache.py --steps 4")  # in the table where it fits
    assert "pid 21:" not in wide


def test_watch_page_leads_with_the_verdict_and_what_watch_could_see(tmp_path):
    from repro.watch.command import merge

    cpu_process(tmp_path, argv=("python3", "<b>x</b>.py"))
    page = W.report_html(merge([tmp_path]))
    order = [
        page.index(s)
        for s in (
            '<p class="lead warn"><span class="warn">nothing checked',
            "Nothing checked: no CUDA graph",
            "<h2>Processes watched (1)</h2>",
        )
    ]
    assert order == sorted(order)
    assert ".scroll{overflow-x:auto" in page and '<div class="scroll"><table>' in page  # styled; tables scroll
    assert "<b>x</b>" not in page and "&lt;b&gt;x&lt;/b&gt;.py" in page  # escaped by the engine
    assert "<script" not in page


def test_watch_page_shows_each_problem_once_with_its_facts(tmp_path):
    rep = engine_report(tmp_path)
    page = W.report_html(rep)
    assert '<p class="lead bad"><span class="bad">2048 finding(s) in 2 group(s)</span>' in page
    assert "<h2>Findings (2048 in 2 groups)</h2>" in page and page.count('<div class="finding">') == 2
    assert page.count("<details open>") == 1  # the first problem open
    assert '<th>found</th><td class=""><span class="mono">2046 times in 2046 graphs of 2 processes' in page
    assert page.index("<h2>Findings") < page.index("<h2>Processes watched")
    assert page.count('<tr class="row-bad">') == 2


def test_replays_read_at_least_the_count_where_the_wrappers_stood_aside(tmp_path):
    """Standing aside, torch's own replay runs and nothing counts it: the report must not print
    the count as the number of replays."""
    write_process(tmp_path, 21, [], argv=("python", "all_counted.py"))
    write_process(tmp_path, 22, [], argv=("python", "stood_aside.py"), stood_aside=3)
    rep = R.load_report([tmp_path])
    by_pid = {p.pid: p for p in rep.processes}
    assert by_pid[21].replays_all_counted and not by_pid[22].replays_all_counted
    rows = {line.split()[-1]: line for line in rendered(rep, width=160).splitlines() if ".py" in line}
    assert " 10 " in rows["all_counted.py"] and "≥ 10" not in rows["all_counted.py"]
    assert "≥ 10" in rows["stood_aside.py"]
