"""The pytest plugin when on: the watch hooks for the whole session, findings per test phase.

In the test process (each xdist worker, each pytest-forked child) the hooks run as under
`repro watch` (repro.watch.hooks, origin "pytest", warn mode: a test must see torch's own
behaviour, never an exception of ours inside its replay). The session's environment carries
the same variables `repro watch` sets, so every process a test starts is watched too; they
are restored when the session ends.

At the start of each phase a marker record goes into this process's record file; at the end
of each phase the records written since (this process's and its descendants') are read back
(repro.pytest.attribution) and each finding is attached to that phase's report: it fails the test in
fail mode (the finding is the failure text), and rides on the report (`repro_watch`, plain
JSON, so xdist and pytest-forked carry it to the process that prints) into the terminal
summary and, as user properties, into pytest's own --junitxml. Findings no report carried (the
process died: a crash, a pytest-timeout, a kill) are read from the run directory at the end.
"""

from __future__ import annotations

import fnmatch
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from repro.pytest import WatchMode
from repro.pytest.attribution import OUTSIDE, Attribution, Phase, PhaseFinding, RunStats, Stage, all_findings, run_stats
from repro.watch.command import watch_env
from repro.watch.hooks import activate
from repro.watch.settings import (
    ENV_DIR,
    ENV_ON_FINDING,
    ENV_OWNER,
    ENV_RECORD,
    ENV_SITE,
    ENV_STACKS,
    ENV_VARS,
    OnFinding,
    Origin,
    Record,
    WatchSettings,
    choice_from_env,
    flag_from_env,
)

REPORT_ATTR = "repro_watch"  # on TestReport: list of PhaseFinding dicts
PROPERTY = "repro_watch_finding"  # junit user property, one per finding


@dataclass
class Expectation:
    off: bool = False
    expect: list[str] = field(default_factory=list)

    @classmethod
    def of(cls, item: pytest.Item) -> Expectation:
        marker = item.get_closest_marker("repro_watch")
        if marker is None:
            return cls()
        expect = marker.kwargs.get("expect") or []
        return cls(
            off=bool(marker.kwargs.get("off", False)), expect=[expect] if isinstance(expect, str) else list(expect)
        )

    def matches(self, pattern: str, tf: PhaseFinding) -> bool:
        f = tf.finding
        return any(fnmatch.fnmatchcase(text, pattern) for text in (f.get("slot", ""), f.get("message", "")))

    def allowed(self, tf: PhaseFinding) -> bool:
        return self.off or any(self.matches(p, tf) for p in self.expect)


def finding_text(tf: PhaseFinding) -> str:
    """What a failed test shows: the tensor, where it was made and dropped, both phases."""
    f = tf.finding
    lines = [
        f"repro watch: graph {f.get('graph')!r}: {f.get('slot')} {f.get('status')} ({tf.mechanism}, pid {tf.pid})",
        f"  captured in: {tf.captured_in.text() if tf.captured_in else 'not found in these records'}",
        f"  replayed in: {tf.replayed_in.text()}",
    ]
    if f.get("created_at"):
        lines.append(f"  created at:  {f['created_at']}")
    if f.get("freed_at"):
        lines.append(f"  dropped at:  {f['freed_at']}")
    read_by = census_reader(f.get("census") or {})
    if read_by:
        lines.append(f"  read by:     {read_by}")
    lines.append(f"  {f.get('message', '')}")
    return "\n".join(lines)


def census_reader(census: dict[str, Any]) -> str:
    """The graph node that holds the address, for census findings: kernel and parameter
    ("param 3 +8": the parameter and the byte offset in it), or a memcpy's src / dst."""
    where = census.get("where") or ""
    if census.get("kernel"):
        return f"kernel {census['kernel']}, {where}"
    if where:
        return f"node {census.get('node')} {where}"
    return ""


def restore_env(saved: dict[str, str | None]) -> None:
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@dataclass(eq=False)  # a plugin object: hashed by identity
class WatchSession:
    config: pytest.Config
    mode: WatchMode
    run_dir: Path
    watcher: Any
    saved_env: dict[str, str | None]
    attribution: Attribution
    root: str  # this session's main record file (stem): what is ours
    pid: int = field(default_factory=os.getpid)
    by_test: dict[str, list[tuple[PhaseFinding, bool]]] = field(default_factory=dict)  # (finding, allowed)
    claimed: set[str] = field(default_factory=set)
    per_item: dict[str, list[PhaseFinding]] = field(default_factory=dict)  # this test, all phases
    unclaimed: list[PhaseFinding] = field(default_factory=list)
    stats: RunStats | None = None

    @classmethod
    def start(cls, config: pytest.Config, mode: WatchMode) -> WatchSession:
        run_dir = Path(
            config.getoption("repro_watch_dir", None)
            or os.environ.get(ENV_DIR)
            or tempfile.mkdtemp(prefix="repro-watch-pytest-")
        ).resolve()
        saved = {k: os.environ.get(k) for k in (*ENV_VARS, ENV_OWNER, "PYTHONPATH")}
        record = choice_from_env(os.environ, ENV_RECORD, Record.GRAPH)
        stacks = bool(config.getoption("repro_watch_stacks", False)) or flag_from_env(os.environ, ENV_STACKS)
        env = watch_env(dict(os.environ), run_dir, os.environ.get(ENV_ON_FINDING) or OnFinding.WARN, record, stacks)
        if saved[ENV_SITE] == env[ENV_SITE]:
            env["PYTHONPATH"] = saved["PYTHONPATH"] or ""  # started under `repro watch`: on the path already
        for key in (*ENV_VARS, "PYTHONPATH"):
            os.environ[key] = env[key]
        watcher = activate(
            WatchSettings(
                run_dir=str(run_dir), on_finding=OnFinding.WARN, origin=Origin.PYTEST, record=record, stacks=stacks
            )
        )
        run_dir = Path(watcher.settings.run_dir)  # an earlier start (repro watch) decides
        me = Path(watcher.log.recorder.path).stem
        os.environ[ENV_OWNER] = me  # processes tests start say whose they are
        return cls(
            config=config,
            mode=mode,
            run_dir=run_dir,
            watcher=watcher,
            saved_env=saved,
            attribution=Attribution(run_dir, me=me),
            root=me,
        )

    # -- where this process is ------------------------------------------------------------------

    def is_worker(self) -> bool:
        return hasattr(self.config, "workerinput")

    def mark(self, phase: Phase) -> None:
        if os.getpid() != self.pid:  # a forked child (pytest-forked): its own file
            self.pid = os.getpid()
            self.attribution.me = Path(self.watcher.log.recorder.path).stem
            os.environ[ENV_OWNER] = self.attribution.me
        at = time.time()
        self.attribution.note_phase(at, phase)
        self.watcher.log.write({"kind": "test", "nodeid": phase.nodeid, "phase": phase.phase, "at": at})

    # -- hooks ------------------------------------------------------------------------------------

    def pytest_report_header(self, config: pytest.Config) -> str:
        return f"repro watch: on ({self.mode}); records in {self.run_dir}"

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_setup(self, item: pytest.Item):
        self.per_item[item.nodeid] = []
        self.mark(Phase(item.nodeid, Stage.SETUP))
        return (yield)

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_call(self, item: pytest.Item):
        self.mark(Phase(item.nodeid, Stage.CALL))
        return (yield)

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_teardown(self, item: pytest.Item, nextitem):
        self.mark(Phase(item.nodeid, Stage.TEARDOWN))
        try:
            return (yield)
        finally:
            self.mark(OUTSIDE)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo):
        report = yield
        try:
            self.attach(item, call.when, report)
        except Exception as e:  # never turn our own trouble into a test's failure
            report.sections.append(("repro watch", f"records could not be read: {type(e).__name__}: {e}"))
        return report

    def attach(self, item: pytest.Item, when: str, report: pytest.TestReport) -> None:
        found = self.attribution.poll()
        seen = self.per_item.setdefault(item.nodeid, [])
        seen.extend(found)
        expectation = Expectation.of(item)
        failing = [tf for tf in found if not expectation.allowed(tf)]
        problems = [finding_text(tf) for tf in failing]
        if when == Stage.CALL and expectation.expect and not expectation.off:
            for pattern in expectation.expect:
                if not any(expectation.matches(pattern, tf) for tf in seen):
                    problems.append(
                        f"repro watch: expected a finding matching {pattern!r} in this "
                        f"test (marker repro_watch(expect=...)); none appeared "
                        f"({len(seen)} finding(s) seen)"
                    )
        if found:
            setattr(report, REPORT_ATTR, [dict(tf.as_dict(), allowed=expectation.allowed(tf)) for tf in found])
            for tf in found:
                prop = (PROPERTY, finding_line(tf) + ("" if tf in failing else " [allowed]"))
                item.user_properties.append(prop)
                if when == Stage.TEARDOWN:  # the teardown report is made from a copy already taken
                    report.user_properties.append(prop)
        if when == Stage.TEARDOWN:
            self.per_item.pop(item.nodeid, None)
        if not problems:
            return
        text = "\n\n".join(problems)
        # A skip does not hide a replay of dead memory; an xfail keeps its own verdict.
        if self.mode == WatchMode.FAIL and not report.failed and not hasattr(report, "wasxfail"):
            report.outcome = "failed"
            report.longrepr = text
        else:
            report.sections.append(("repro watch", text))

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        for d in getattr(report, REPORT_ATTR, None) or []:
            if d["id"] in self.claimed:
                continue
            self.claimed.add(d["id"])
            self.by_test.setdefault(report.nodeid, []).append((PhaseFinding.from_dict(d), d.get("allowed", False)))

    def pytest_sessionfinish(self, session: pytest.Session, exitstatus) -> None:
        if self.is_worker() or os.getpid() != self.pid:
            return
        try:
            self.unclaimed = [tf for tf in all_findings(self.run_dir, self.root) if tf.id not in self.claimed]
            self.stats = run_stats(self.run_dir, self.root)
        except OSError:
            self.unclaimed = []
        if self.unclaimed and self.mode == WatchMode.FAIL and session.exitstatus == 0:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter, exitstatus, config) -> None:
        if self.is_worker():
            return
        tr = terminalreporter
        count = sum(len(v) for v in self.by_test.values()) + len(self.unclaimed)
        tr.write_sep("=", f"repro watch: {count} finding(s)" if count else "repro watch: no findings")
        stats = self.stats
        if stats is not None:
            checked = (
                f"{stats.captures} CUDA graph(s) captured and checked"
                if stats.captures
                else "no CUDA graph was captured: nothing was checked"
            )
            managed = f", {stats.managed} by torch.compile's cudagraph trees (not checked)" if stats.managed else ""
            tr.write_line(f"{checked}{managed}; {stats.processes} watched process(es)")
            for error in stats.internal_errors[:5]:
                tr.write_line(f"hooks' own error (the check may be incomplete): {error}")
        for nodeid, found in self.by_test.items():
            tr.write_line(nodeid or "outside any test")
            for tf, allowed in found:
                tr.write_line("  " + finding_line(tf) + (" [allowed by the repro_watch marker]" if allowed else ""))
        if self.unclaimed:
            tr.write_line(
                "recorded, but in no test report (the process ended before reporting: a crash, a timeout, a kill):"
            )
            for tf in self.unclaimed:
                tr.write_line("  " + finding_line(tf))
        tr.write_line(f"records: {self.run_dir}")

    def pytest_unconfigure(self, config: pytest.Config) -> None:
        restore_env(self.saved_env)


def finding_line(tf: PhaseFinding) -> str:
    f = tf.finding
    cap = tf.captured_in.text() if tf.captured_in else "capture not in these records"
    return (
        f"{f.get('slot')} {f.get('status')} (graph {f.get('graph')!r}; captured in {cap}; "
        f"replayed in {tf.replayed_in.text()}; pid {tf.pid})"
    )
