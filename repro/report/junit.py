"""JUnit XML: one <testcase> per trial, named stably so CI can track a case across runs."""
from __future__ import annotations

import os
import re
import xml.etree.ElementTree as ET
from typing import Any

from repro.files import write_text_atomic
from repro.outcome import Outcome, Report
from repro.report.view import RunView, TrialView, config_params, run_config, run_view

# Characters XML 1.0 forbids even escaped; one in a stderr tail would make the whole file unreadable.
XML_INVALID = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ufffe\uffff]")


def xml_text(text: Any) -> str:
    return XML_INVALID.sub("", str(text))


def junit_name(tv: TrialView) -> str:
    """'unfixed[tp=2,after_free=release]': stable across runs, so CI can track a case's history."""
    params = config_params(tv.record)
    if run_config(tv.record).get("device") == "cpu":
        params["device"] = "cpu"   # a forced-CPU run is a different test from the GPU one
    return f"{tv.mode}[{','.join(k if v is None else f'{k}={v}' for k, v in params.items())}]"


def junit_names(trials: list[TrialView]) -> list[str]:
    """Case names, made unique with the trial id: JUnit consumers silently merge equal names."""
    names = [junit_name(t) for t in trials]
    return [f"{n[:-1]},id={t.id}]" if names.count(n) > 1 else n for n, t in zip(names, trials)]


def failure_details(tv: TrialView) -> str:
    """Plain-text story of a trial for a JUnit failure body: what, where, why, last words."""
    lines = [f"{tv.title} (trial {tv.id})", f"outcome {tv.outcome}, expected {tv.expected}", tv.meaning]
    if tv.first_failure:
        lines.append("first failure: " + tv.first_failure)
    lines += tv.basis
    lines += [f"{f.label}: {f.value}" for f in tv.facts]
    for fv in tv.findings:
        lines.append(f"finding: {fv.where} {fv.slot} {fv.status}")
        lines += [f"    {f.label:<12} {f.value}" for f in fv.facts]
    for row in tv.ranks.rows:
        error = row.cells["error"].text
        lines.append(f"rank {row.cells['rank'].text}: {row.cells['exit'].text}" + (f": {error}" if error != "-" else ""))
    lines += [f"--- rank {rank} stderr tail ---\n{stderr}" for rank, stderr in tv.stderr_tails]
    return xml_text("\n".join(lines))


def add_properties(parent: ET.Element, props: dict[str, Any]) -> None:
    node = ET.SubElement(parent, "properties")
    for name, value in props.items():
        ET.SubElement(node, "property", name=name, value=xml_text(value))


def junit_case(suite: ET.Element, tv: TrialView, name: str) -> str:
    """Append one <testcase>; returns 'failure', 'skipped' or 'passed' for the suite's counts."""
    case = ET.SubElement(suite, "testcase", classname=f"repro.{tv.scenario}", name=name,
                         time=f"{tv.seconds or 0.0:.3f}")
    add_properties(case, {"outcome": tv.outcome, "expected": tv.expected, "trial_id": tv.id,
                          "device": tv.device or "-", **({"node": tv.record.node} if tv.record.node else {}),
                          "graph_replayed": str(tv.record.graph_replayed).lower()})
    message = f"outcome {tv.outcome}, expected {tv.expected}"
    if not tv.met:
        node = ET.SubElement(case, "failure", message=xml_text(message), type=tv.outcome)
        node.text = failure_details(tv)
        result = "failure"
    elif tv.outcome == Outcome.UNSUPPORTED.value:
        # Skipped, not passed: the environment could not run it, so nothing was tested.
        failure = tv.record.first_failure
        detail = failure.detail if failure else tv.meaning
        ET.SubElement(case, "skipped", message=xml_text(f"UNSUPPORTED: {detail}"))
        result = "skipped"
    else:
        result = "passed"
    stderr = "\n".join(f"--- rank {rank} ---\n{text}" for rank, text in tv.stderr_tails)
    if stderr:
        ET.SubElement(case, "system-err").text = xml_text(stderr)
    return result


def problem_case(suite: ET.Element, text: str) -> str:
    """A merge's missing or duplicated shard: a failed case of its own, so CI shows it."""
    case = ET.SubElement(suite, "testcase", classname="repro.merge", name=text.split(":")[0], time="0.000")
    ET.SubElement(case, "failure", message=xml_text(text), type="SHARD").text = xml_text(text)
    return "failure"


def junit_xml(report: Report) -> str:
    rv: RunView = run_view(report)
    suites = ET.Element("testsuites", name="repro")
    suite = ET.SubElement(suites, "testsuite", name="repro")
    add_properties(suite, {"command": rv.command, "environment": rv.environment,
                           "interrupted": str(rv.interrupted).lower(), "schema": rv.schema})
    results = [junit_case(suite, tv, n) for tv, n in zip(rv.trials, junit_names(rv.trials))]
    results += [problem_case(suite, text) for text in rv.problems]
    total = sum(tv.seconds or 0.0 for tv in rv.trials)
    counts = {"tests": str(len(results)), "failures": str(results.count("failure")), "errors": "0",
              "skipped": str(results.count("skipped")), "time": f"{total:.3f}"}
    suite.attrib.update(counts)
    if rv.created:
        suite.set("timestamp", rv.created)
    suites.attrib.update(counts)
    ET.indent(suites)
    return ET.tostring(suites, encoding="unicode", xml_declaration=True) + "\n"


def write_junit(report: Report, path: str | os.PathLike) -> None:
    write_text_atomic(path, junit_xml(report))
