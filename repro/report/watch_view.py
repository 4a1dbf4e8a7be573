"""The watch report's view model: what a `repro watch` report says, decided once.

WatchView (the verdict, the processes table, the findings grouped into problems, the notes)
is drawn by the trial report's writers: console.py on the terminal, junit.py (the one XML-safe
JUnit writer), html.py (templates/watch.html, autoescaped); watch_document is the JSON document
(schema repro.watch/1) that jsonfile.py (the one strict JSON writer) writes. The records it
reads are repro/watch/records.py's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from repro.outcome import Status, as_member, to_jsonable
from repro.report.fmt import fmt_bytes, fmt_ptr, fmt_ranges, plain
from repro.report.groups import FindingGroup, group_findings
from repro.report.view import BAD, OK, WARN, Cell, Column, Fact, TableView, table_rows
from repro.watch.records import WatchedProcess, WatchFinding, WatchReport

MAX_GROUPS_SHOWN = 10  # groups shown in full; the rest are counted (all are in --json)
MAX_NAMES_SHOWN = 4  # member names listed under a group
MAX_ERRORS_SHOWN = 3  # internal errors shown per process


# -- the view model -----------------------------------------------------------------------------


def short_argv(argv: list[str], width: int = 60) -> str:
    text = plain(" ".join(argv[1:] if len(argv) > 1 else argv))
    return text if len(text) <= width else text[: width - 1] + "…"


def replays_text(p: WatchedProcess) -> str:
    """The replays the hooks counted; "≥ n" where they stood aside a while (every graph
    settled: torch's own replay ran, uncounted)."""
    if p.replays is None:
        return "?"
    return str(p.replays) if p.replays_all_counted else f"≥ {p.replays}"


def graphs_text(p: WatchedProcess) -> str:
    return str(p.graphs) + (f" ({p.managed_graphs} managed)" if p.managed_graphs else "")


PROCESS_COLUMNS: tuple[Column, ...] = (
    Column("host", "host", lambda p: Cell(plain(p.host))),
    Column("pid", "pid", lambda p: Cell(str(p.pid)), numeric=True),
    Column("rank", "rank", lambda p: Cell("" if p.rank is None else str(p.rank)), numeric=True),
    Column("torch", "torch", lambda p: Cell("hooked" if p.torch_hooked else "not imported")),
    Column("graphs", "graphs", lambda p: Cell(graphs_text(p)), numeric=True),
    Column("replays", "replays", lambda p: Cell(replays_text(p)), numeric=True),
    Column("findings", "findings", lambda p: Cell(str(p.findings)), numeric=True),
    Column("exited", "exited", lambda p: Cell("yes" if p.exited else "no")),
    Column("command", "command", lambda p: Cell(short_argv(p.argv)), wrap=True),
)


WHOLE_COMMAND = Column("command", "command", lambda p: Cell(plain(" ".join(p.argv))), wrap=True)


def processes_view(rep: WatchReport, whole_command: bool = False) -> TableView:
    """One row per process; the host column only when the processes ran on several hosts.
    whole_command: each command whole (a page wraps it), not cut for a terminal."""
    multi_host = len({p.host for p in rep.processes}) > 1
    columns = [
        WHOLE_COMMAND if whole_command and c.key == "command" else c
        for c in PROCESS_COLUMNS
        if c.key != "host" or multi_host
    ]
    return TableView(
        f"Processes watched ({len(rep.processes)})",
        columns,
        table_rows(columns, rep.processes, failed=lambda p: p.findings > 0),
    )


def finding_facts(w: WatchFinding) -> list[tuple[str, str]]:
    f = w.finding
    facts = [
        ("process", f"pid {w.pid} on {w.host}" + ("" if w.rank is None else f", rank {w.rank}")),
        ("graph", f.graph),
        ("mechanism", w.mechanism),
        ("seen", f.when),
        ("address", fmt_ptr(f.old_ptr) + (f" → {fmt_ptr(f.new_ptr)}" if f.new_ptr is not None else "")),
    ]
    if f.shape or f.dtype:
        facts.append(("tensor", f"{list(f.shape)} {f.dtype} · {fmt_bytes(f.nbytes)}"))
    facts += [(label, site) for label, site in (("created at", f.created_at), ("freed at", f.freed_at)) if site]
    if f.census:
        facts.append(
            (
                "kernel",
                f"{f.census.get('kernel')} · node {f.census.get('node')} · "
                f"{f.census.get('where')} +{f.census.get('offset')}",
            )
        )
    if f.disagreement:
        facts.append(("disagreement", f.disagreement))
    if f.message:
        facts.append(("message", f.message))
    return facts


def group_headline(g: FindingGroup) -> str:
    """'in 67 graphs' / 'in 3 graphs of 2 processes, ranks 0-1' for a group of findings."""
    graphs = g.graphs()
    procs = {(w.host, w.pid) for w in g.members}
    where = f"in {len(graphs)} graph{'s' if len(graphs) != 1 else ''}"
    if len(procs) > 1:
        where += f" of {len(procs)} processes"
    ranks = sorted({w.rank for w in g.members if w.rank is not None})
    if ranks:
        where += f", rank{'s' if len(ranks) > 1 else ''} {fmt_ranges(ranks)}"
    return where


def group_facts(g: FindingGroup) -> list[tuple[str, str]]:
    """The first member's facts, with the group's extent in front of them."""
    facts = [("found", f"{g.count} time{'s' if g.count != 1 else ''} {group_headline(g)}")]
    names = g.names()
    if len(names) > 1:
        shown = ", ".join(names[:MAX_NAMES_SHOWN]) + (
            f" and {len(names) - MAX_NAMES_SHOWN} more" if len(names) > MAX_NAMES_SHOWN else ""
        )
        facts.append(("tensors", shown))
    return facts + finding_facts(g.members[0])


@dataclass
class ProblemView:
    """One group of findings as every renderer shows it; record text made printable."""

    status: Status | str  # a Status; a record of another version may hold one this one lacks
    pattern: str
    headline: str  # 'in 67 graphs of 2 processes, ranks 0, 1'
    tone: str
    facts: list[Fact]


def problem_view(g: FindingGroup) -> ProblemView:
    return ProblemView(
        status=as_member(Status, plain(g.status)),
        pattern=plain(g.pattern),
        headline=plain(group_headline(g)),
        tone=BAD if g.status == Status.FREED else WARN,
        facts=[Fact(label, plain(str(value))) for label, value in group_facts(g)],
    )


@dataclass
class ProcessCase:
    """A watched process as one test (JUnit): its findings grouped among themselves."""

    name: str  # 'host:pid[rank r]'
    command: str  # the whole argv
    problems: list[ProblemView]


def process_case(p: WatchedProcess, findings: list[WatchFinding]) -> ProcessCase:
    name = f"{p.host}:{p.pid}" + ("" if p.rank is None else f"[rank {p.rank}]")
    groups = group_findings(findings, finding_of=lambda w: w.finding)
    return ProcessCase(name=plain(name), command=plain(" ".join(p.argv)), problems=[problem_view(g) for g in groups])


def process_cases(rep: WatchReport) -> list[ProcessCase]:
    by_process: dict[tuple[str, int], list[WatchFinding]] = {}
    for w in rep.findings:
        by_process.setdefault((w.host, w.pid), []).append(w)
    return [process_case(p, by_process.get((p.host, p.pid), [])) for p in rep.processes]


def pool_note(rep: WatchReport) -> str | None:
    """What the verdict relied on: the shared-pool contract engines use."""
    managed = sum(p.pool_managed for p in rep.processes)
    cross = sum(p.cross_pool for p in rep.processes)
    if not managed and not cross:
        return None
    text = (
        f"pool contract: {managed} captured storage(s) lived in their own graph's memory pool and "
        "were not checked (correct as long as the graphs of one pool replay in capture order)"
    )
    if cross:
        text += f"; {cross} lived in another graph's pool (a cross-pool dependency: checked)"
    return text


def nothing_checked(rep: WatchReport) -> bool:
    """No finding, and no watched process captured a CUDA graph: "no findings" would claim
    more than was looked at (every program on a machine without a GPU)."""
    return not rep.findings and not any(p.graphs for p in rep.processes)


def verdict_cells(rep: WatchReport, groups: int) -> list[Cell]:
    """The verdict's parts; every renderer joins them with " · " (a terminal breaks lines
    only between two parts)."""
    hooked = sum(p.torch_hooked for p in rep.processes)
    graphs = sum(p.graphs for p in rep.processes)
    cells = [Cell("INTERRUPTED", WARN)] if rep.interrupted else []
    if rep.findings:
        cells.append(Cell(f"{len(rep.findings)} finding(s) in {groups} group(s)", BAD))
    elif nothing_checked(rep):
        cells.append(Cell("nothing checked (no CUDA graph captured)", WARN))
    else:
        cells.append(Cell("no findings", OK))
    cells.append(Cell(f"{len(rep.processes)} process(es) watched, {hooked} imported torch, {graphs} graph capture(s)"))
    if rep.command_exit is not None:
        cells.append(Cell(f"command exited {rep.command_exit}"))
    return cells


def internal_errors(rep: WatchReport) -> list[str]:
    return [
        plain(f"watch internal error in pid {p.pid}: {err}")
        for p in rep.processes
        for err in p.internal_errors[:MAX_ERRORS_SHOWN]
    ]


@dataclass
class WatchView:
    """What a watch report says, decided once for the console, JUnit and HTML."""

    verdict: list[Cell]
    command: str
    created: str
    schema: str
    processes: TableView
    page_processes: TableView  # the same, each command whole (a page wraps it)
    findings_total: int
    groups_total: int
    problems: list[ProblemView]  # the first MAX_GROUPS_SHOWN groups
    hidden_findings: int  # in the groups past those
    census: str  # the census states of the processes that captured a graph
    pool_note: str
    internal_errors: list[str]
    notes: list[str]
    records: str  # the run directories read
    cases: list[ProcessCase]

    @property
    def verdict_text(self) -> str:
        return " · ".join(c.text for c in self.verdict)

    @property
    def verdict_tone(self) -> str:
        return self.verdict[1 if len(self.verdict) > 1 and self.verdict[0].text == "INTERRUPTED" else 0].tone

    @property
    def findings_title(self) -> str:
        return f"Findings ({self.findings_total} in {self.groups_total} group{'s' if self.groups_total != 1 else ''})"

    @property
    def hidden_groups(self) -> int:
        return self.groups_total - len(self.problems)


def watch_view(rep: WatchReport) -> WatchView:
    groups = rep.groups()
    return WatchView(
        verdict=verdict_cells(rep, len(groups)),
        command=plain(" ".join(rep.command)),
        created=rep.created,
        schema=rep.schema,
        processes=processes_view(rep),
        page_processes=processes_view(rep, whole_command=True),
        findings_total=len(rep.findings),
        groups_total=len(groups),
        problems=[problem_view(g) for g in groups[:MAX_GROUPS_SHOWN]],
        hidden_findings=sum(g.count for g in groups[MAX_GROUPS_SHOWN:]),
        census="; ".join(sorted({plain(p.census) for p in rep.processes if p.graphs})),
        pool_note=pool_note(rep) or "",
        internal_errors=internal_errors(rep),
        notes=[plain(n) for n in rep.notes],
        records=plain(", ".join(rep.run_dirs)),
        cases=process_cases(rep),
    )


# -- the JSON document --------------------------------------------------------------------------


def group_json(g: FindingGroup, rep: WatchReport) -> dict[str, Any]:
    index = {id(w): i for i, w in enumerate(rep.findings)}
    return {
        "pattern": g.pattern,
        "status": g.status,
        "mechanism": g.mechanism,
        "freed_at": g.freed_at,
        "count": g.count,
        "graphs": g.graphs(),
        "names": g.names(),
        "processes": sorted({f"{w.host}:{w.pid}" for w in g.members}),
        "ranks": sorted({w.rank for w in g.members if w.rank is not None}),
        "findings": [index[id(w)] for w in g.members],
    }


def watch_document(rep: WatchReport) -> dict[str, Any]:
    """Every record as read (schema repro.watch/1), the groups as indices into findings[]."""
    doc = to_jsonable(rep)
    doc["groups"] = [group_json(g, rep) for g in rep.groups()]
    note = pool_note(rep)
    if note:
        doc["notes"] = doc["notes"] + [note]
    return doc
