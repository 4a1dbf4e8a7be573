"""JUnit XML: the one writer every report kind uses, and the trial report's cases.

A report kind maps its view model to a JunitSuite (trial_suite, watch_suite); junit_document
writes it. Every attribute and text goes through xml_text in that one place, so no kind can let
a character XML forbids into the file.
"""

from __future__ import annotations

import os
import re
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from typing import Any

from repro.files import write_text_atomic
from repro.outcome import Outcome, Report
from repro.report.fmt import encodable
from repro.report.view import RunView, TrialView, config_params, run_config, run_view

from repro.report.watch_view import WatchView

# Characters XML 1.0 forbids even escaped; one in a stderr tail would make the whole file unreadable.
XML_INVALID = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ufffe\uffff]")


def xml_text(text: Any) -> str:
    """Forbidden characters dropped; a surrogate escape (bytes that were not UTF-8) is U+FFFD."""
    return XML_INVALID.sub("", encodable(str(text)))


# ---- the writer -------------------------------------------------------------------------------


@dataclass
class JunitFailure:
    message: str
    type: str
    text: str = ""


@dataclass
class JunitCase:
    classname: str
    name: str
    time: float | None = None  # None: the kind does not time its cases
    properties: dict[str, Any] = field(default_factory=dict)
    failures: list[JunitFailure] = field(default_factory=list)
    skipped: str | None = None  # the reason, when nothing was tested
    system_out: str = ""
    system_err: str = ""

    @property
    def result(self) -> str:
        if self.failures:
            return "failure"
        return "skipped" if self.skipped is not None else "passed"


@dataclass
class JunitSuite:
    name: str
    cases: list[JunitCase]
    properties: dict[str, Any] = field(default_factory=dict)
    timestamp: str = ""


def element(parent: ET.Element, tag: str, text: str | None = None, **attrs: Any) -> ET.Element:
    """A child element with every attribute and the text made XML-safe."""
    node = ET.SubElement(parent, tag, {k: xml_text(v) for k, v in attrs.items()})
    if text is not None:
        node.text = xml_text(text)
    return node


def add_properties(parent: ET.Element, props: dict[str, Any]) -> None:
    if not props:
        return
    node = element(parent, "properties")
    for name, value in props.items():
        element(node, "property", name=name, value=value)


def add_case(suite: ET.Element, case: JunitCase) -> None:
    attrs = {"classname": case.classname, "name": case.name}
    if case.time is not None:
        attrs["time"] = f"{case.time:.3f}"
    node = element(suite, "testcase", **attrs)
    add_properties(node, case.properties)
    for failure in case.failures:
        element(node, "failure", failure.text or None, message=failure.message, type=failure.type)
    if case.skipped is not None:
        element(node, "skipped", message=case.skipped)
    if case.system_out:
        element(node, "system-out", case.system_out)
    if case.system_err:
        element(node, "system-err", case.system_err)


def suite_counts(cases: list[JunitCase]) -> dict[str, str]:
    results = [c.result for c in cases]
    total = sum(c.time or 0.0 for c in cases)
    return {
        "tests": str(len(cases)),
        "failures": str(results.count("failure")),
        "errors": "0",
        "skipped": str(results.count("skipped")),
        "time": f"{total:.3f}",
    }


def junit_document(suite: JunitSuite) -> str:
    """<testsuites> holding the one suite, both with the counts CI dashboards read."""
    root = ET.Element("testsuites", name=xml_text(suite.name))
    node = element(root, "testsuite", name=suite.name)
    add_properties(node, suite.properties)
    for case in suite.cases:
        add_case(node, case)
    counts = suite_counts(suite.cases)
    node.attrib.update(counts)
    if suite.timestamp:
        node.set("timestamp", xml_text(suite.timestamp))
    root.attrib.update(counts)
    ET.indent(root)
    return ET.tostring(root, encoding="unicode", xml_declaration=True) + "\n"


# ---- trials -----------------------------------------------------------------------------------


def junit_name(tv: TrialView) -> str:
    """'unfixed[tp=2,after_free=release]': stable across runs, so CI can track a case's history."""
    params = config_params(tv.record)
    if run_config(tv.record).get("device") == "cpu":
        params["device"] = "cpu"  # a forced-CPU run is a different test from the GPU one
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
        lines.append(
            f"rank {row.cells['rank'].text}: {row.cells['exit'].text}" + (f": {error}" if error != "-" else "")
        )
    lines += [f"--- rank {rank} stderr tail ---\n{stderr}" for rank, stderr in tv.stderr_tails]
    return "\n".join(lines)


def trial_case(tv: TrialView, name: str) -> JunitCase:
    case = JunitCase(
        classname=f"repro.{tv.scenario}",
        name=name,
        time=tv.seconds or 0.0,
        properties={
            "outcome": tv.outcome,
            "expected": tv.expected,
            "trial_id": tv.id,
            "device": tv.device or "-",
            **({"node": tv.record.node} if tv.record.node else {}),
            "graph_replayed": str(tv.record.graph_replayed).lower(),
        },
    )
    if not tv.met:
        case.failures.append(
            JunitFailure(f"outcome {tv.outcome}, expected {tv.expected}", tv.outcome, failure_details(tv))
        )
    elif tv.outcome == Outcome.UNSUPPORTED.value:
        # Skipped, not passed: the environment could not run it, so nothing was tested.
        failure = tv.record.first_failure
        case.skipped = f"UNSUPPORTED: {failure.detail if failure else tv.meaning}"
    case.system_err = "\n".join(f"--- rank {rank} ---\n{text}" for rank, text in tv.stderr_tails)
    return case


def problem_case(text: str) -> JunitCase:
    """A merge's missing or duplicated shard: a failed case of its own, so CI shows it."""
    return JunitCase(
        classname="repro.merge", name=text.split(":")[0], time=0.0, failures=[JunitFailure(text, "SHARD", text)]
    )


def trial_suite(rv: RunView) -> JunitSuite:
    cases = [trial_case(tv, n) for tv, n in zip(rv.trials, junit_names(rv.trials))]
    return JunitSuite(
        name="repro",
        cases=cases + [problem_case(text) for text in rv.problems],
        properties={
            "command": rv.command,
            "environment": rv.environment,
            "interrupted": str(rv.interrupted).lower(),
            "schema": rv.schema,
        },
        timestamp=rv.created,
    )


def junit_xml(report: Report) -> str:
    return junit_document(trial_suite(run_view(report)))


def write_junit(report: Report, path: str | os.PathLike) -> None:
    write_text_atomic(path, junit_xml(report))


# ---- `repro watch` ----------------------------------------------------------------------------


def watch_suite(wv: WatchView) -> JunitSuite:
    """One testcase per watched process; one failure per group of its findings."""
    cases = [
        JunitCase(
            classname="repro.watch",
            name=c.name,
            system_out=c.command,
            failures=[
                JunitFailure(f"{p.pattern} {p.headline}", p.status, "\n".join(f"{f.label}: {f.value}" for f in p.facts))
                for p in c.problems
            ],
        )
        for c in wv.cases
    ]
    return JunitSuite(
        name="repro watch", cases=cases, timestamp=wv.created, properties={"command": wv.command, "schema": wv.schema}
    )
