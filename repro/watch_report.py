"""`repro watch` records -> one report over every process: rich text, JSON, JUnit XML, HTML.

Reads the ``<host>-<pid>.jsonl`` files the hooks wrote in one or more run directories (one
per node after a multi-node run), tolerating a last line cut short by a crash. No torch import.
"""
from __future__ import annotations

import json
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.measure import Measurement
from rich.padding import Padding
from rich.table import Table
from rich.text import Text

from repro.outcome import Finding, finding_from_dict, to_jsonable
from repro.files import write_text_atomic
from repro.report.fmt import fmt_bytes, fmt_ptr, fmt_ranges
from repro.report.groups import FindingGroup, group_findings
from repro.report.junit import xml_text

SCHEMA = "repro.watch/1"
MAX_GROUPS_SHOWN = 10         # groups printed in full; the rest are counted (all are in --json)
MAX_NAMES_SHOWN = 4           # member names listed under a group


@dataclass
class WatchedProcess:
    """A process in which the hooks were active."""
    pid: int
    host: str
    ppid: int | None = None
    started: float = 0.0           # unix time the hooks started in it
    argv: list[str] = field(default_factory=list)
    rank: int | None = None        # torch.distributed rank once initialised, else from RANK
    env: dict[str, str] = field(default_factory=dict)   # RANK, LOCAL_RANK, WORLD_SIZE, ...
    origins: list[str] = field(default_factory=list)    # sitecustomize | vllm-plugin | api
    on_finding: str = "warn"
    torch_hooked: bool = False     # torch.cuda.graphs was imported and CUDAGraph wrapped
    torch: str | None = None
    census: str = "not checked (no capture)"
    graphs: int = 0                # captures seen (managed ones included)
    managed_graphs: int = 0        # captured by torch.compile's cudagraph trees: not checked
    replays: int | None = None     # from the exit record; None when the process left none
    findings: int = 0
    exited: bool = False           # False: killed, crashed hard, or still running
    forked: bool = False
    internal_errors: list[str] = field(default_factory=list)
    record_file: str = ""
    pool_managed: int = 0          # captured storages in their own graph's pool: not checked
    cross_pool: int = 0            # captured storages in another graph's pool: checked


@dataclass
class WatchFinding:
    pid: int
    host: str
    rank: int | None
    mechanism: str                 # guard | census | both | torch
    finding: Finding


@dataclass
class WatchReport:
    processes: list[WatchedProcess]
    findings: list[WatchFinding]
    command: list[str] = field(default_factory=list)
    run_dirs: list[str] = field(default_factory=list)
    command_exit: int | None = None   # CMD's own exit status (None: merged report, or not run)
    exit: int | None = None           # what `repro watch` exits with
    interrupted: bool = False
    on_finding: str = "warn"
    created: str = ""
    notes: list[str] = field(default_factory=list)
    schema: str = SCHEMA

    def groups(self) -> list[FindingGroup]:
        """One group per problem (name pattern, status, mechanism, drop site), in the order of
        its first finding; members are the WatchFindings."""
        return group_findings(self.findings, finding_of=lambda w: w.finding)


# -- reading ------------------------------------------------------------------------------------

def read_records(path: Path) -> list[dict[str, Any]]:
    records = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue   # a line cut short by a crash mid-write
    return records


def process_from_records(path: Path, records: list[dict[str, Any]]) -> WatchedProcess | None:
    head = next((r for r in records if r.get("kind") == "process"), None)
    if head is None:
        return None
    proc = WatchedProcess(pid=head["pid"], host=head.get("host", ""), ppid=head.get("ppid"),
                          started=head.get("started", 0.0),
                          argv=head.get("argv", []), env=head.get("env", {}),
                          origins=[head.get("origin", "")], on_finding=head.get("on_finding", "warn"),
                          forked=bool(head.get("forked")), record_file=str(path))
    rank_env = proc.env.get("RANK")
    proc.rank = int(rank_env) if rank_env is not None and rank_env.isdigit() else None
    for r in records:
        apply_record(proc, r)
    return proc


def apply_record(proc: WatchedProcess, r: dict[str, Any]) -> None:
    kind = r.get("kind")
    if kind == "hooked":
        proc.torch_hooked = True
        proc.torch = r.get("torch") or proc.torch
    elif kind == "origin":
        proc.origins.append(r.get("origin", ""))
    elif kind == "census":
        proc.census = r.get("state", proc.census)
    elif kind == "rank" and r.get("rank") is not None:
        proc.rank = r["rank"]
    elif kind == "capture":
        proc.graphs += 1
        proc.managed_graphs += bool(r.get("managed"))
    elif kind == "finding":
        proc.findings += 1
    elif kind == "internal":
        proc.internal_errors.append(f"{r.get('where')}: {r.get('error')}")
    elif kind == "exit":
        proc.exited = True
        proc.replays = r.get("counters", {}).get("replays", 0)
        proc.pool_managed = r.get("pool_managed", 0)
        proc.cross_pool = r.get("cross_pool", 0)
        proc.census = r.get("census", proc.census)
        if r.get("rank") is not None:
            proc.rank = r["rank"]


def findings_from_records(proc: WatchedProcess, records: list[dict[str, Any]]) -> list[WatchFinding]:
    out = []
    for r in records:
        if r.get("kind") != "finding":
            continue
        finding = finding_from_dict(r.get("finding", {}))
        rank = r.get("rank", proc.rank)
        out.append(WatchFinding(pid=proc.pid, host=proc.host, rank=rank,
                                mechanism=r.get("mechanism", "guard"), finding=finding))
    return out


def record_files(run_dirs: list[Path]) -> list[Path]:
    return sorted(p for d in run_dirs for p in Path(d).glob("*.jsonl"))


def load_report(run_dirs: list[Path]) -> WatchReport:
    processes, findings = [], []
    for path in record_files(run_dirs):
        records = read_records(path)
        proc = process_from_records(path, records)
        if proc is None:
            continue
        processes.append(proc)
        findings.extend(findings_from_records(proc, records))
    processes.sort(key=lambda p: (p.host, p.started, p.pid))
    return WatchReport(processes=processes, findings=findings,
                       run_dirs=[str(d) for d in run_dirs],
                       created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))


# -- console ------------------------------------------------------------------------------------

def short_argv(argv: list[str], width: int = 60) -> str:
    text = " ".join(argv[1:] if len(argv) > 1 else argv)
    return text if len(text) <= width else text[: width - 1] + "…"


PROCESS_COLUMNS = ("pid", "rank", "torch", "graphs", "replays", "findings", "exited", "command")
NUMERIC_COLUMNS = ("pid", "rank", "graphs", "replays", "findings")


def process_row(p: WatchedProcess, multi_host: bool) -> list[str]:
    graphs = str(p.graphs) + (f" ({p.managed_graphs} managed)" if p.managed_graphs else "")
    return ([p.host] if multi_host else []) + [
        str(p.pid), "" if p.rank is None else str(p.rank),
        "hooked" if p.torch_hooked else "not imported", graphs,
        "?" if p.replays is None else str(p.replays), str(p.findings), "yes" if p.exited else "no",
        short_argv(p.argv)]


def processes_table(rep: WatchReport, with_command: bool = True) -> Table:
    table = Table(title=f"Processes watched ({len(rep.processes)})", title_justify="left",
                  show_edge=False, pad_edge=False)
    multi_host = len({p.host for p in rep.processes}) > 1
    columns = (["host"] if multi_host else []) + list(PROCESS_COLUMNS if with_command else PROCESS_COLUMNS[:-1])
    for col in columns:
        table.add_column(col, justify="right" if col in NUMERIC_COLUMNS else "left",
                         overflow="fold" if col == "command" else "ellipsis")
    for p in rep.processes:
        row = process_row(p, multi_host)[:len(columns)]
        table.add_row(*[Text(c) for c in row], style="red" if p.findings else "")
    return table


def processes_block(rep: WatchReport, console: Console) -> list[Any]:
    """The table, with each command in its column where it fits whole; else the commands go
    under the table, one line each, so a path is never broken mid-word."""
    table = processes_table(rep)
    # Measured unbounded: a measurement within the console's width is clamped to it.
    if Measurement.get(console, console.options.update_width(10 ** 6), table).maximum <= console.width:
        return [table]
    out: list[Any] = [processes_table(rep, with_command=False)]
    out += [Text.assemble((f"  pid {p.pid}: ", "dim"), short_argv(p.argv)) for p in rep.processes]
    return out


def finding_facts(w: WatchFinding) -> list[tuple[str, str]]:
    f = w.finding
    facts = [("process", f"pid {w.pid} on {w.host}" + ("" if w.rank is None else f", rank {w.rank}")),
             ("graph", f.graph), ("mechanism", w.mechanism), ("seen", f.when),
             ("address", fmt_ptr(f.old_ptr) + (f" → {fmt_ptr(f.new_ptr)}" if f.new_ptr is not None else ""))]
    if f.shape or f.dtype:
        facts.append(("tensor", f"{list(f.shape)} {f.dtype} · {fmt_bytes(f.nbytes)}"))
    facts += [(label, site) for label, site in (("created at", f.created_at), ("freed at", f.freed_at)) if site]
    if f.census:
        facts.append(("kernel", f"{f.census.get('kernel')} · node {f.census.get('node')} · "
                                f"{f.census.get('where')} +{f.census.get('offset')}"))
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
        shown = ", ".join(names[:MAX_NAMES_SHOWN]) + (f" and {len(names) - MAX_NAMES_SHOWN} more"
                                                        if len(names) > MAX_NAMES_SHOWN else "")
        facts.append(("tensors", shown))
    return facts + finding_facts(g.members[0])


def findings_block(rep: WatchReport) -> list[Any]:
    groups = rep.groups()
    out: list[Any] = [Text(f"Findings ({len(rep.findings)} in {len(groups)} group{'s' if len(groups) != 1 else ''})",
                           style="bold")]
    for g in groups[:MAX_GROUPS_SHOWN]:
        out.append(Text.assemble("  ", (g.status.upper(), "bold red" if g.status == "freed" else "bold yellow"),
                                 " ", (g.pattern, "bold"), f" · {group_headline(g)}"))
        grid = Table.grid(padding=(0, 2))
        grid.add_column(style="dim", no_wrap=True)
        grid.add_column(overflow="fold")
        for label, value in group_facts(g):
            grid.add_row(label, Text(value))
        out.append(Padding(grid, (0, 0, 0, 4)))
    hidden = groups[MAX_GROUPS_SHOWN:]
    if hidden:
        out.append(Text(f"  {len(hidden)} more groups ({sum(g.count for g in hidden)} findings; all are in --json)",
                        style="dim"))
    return out


def pool_note(rep: WatchReport) -> str | None:
    """What the verdict relied on: the shared-pool contract engines use."""
    managed = sum(p.pool_managed for p in rep.processes)
    cross = sum(p.cross_pool for p in rep.processes)
    if not managed and not cross:
        return None
    text = (f"pool contract: {managed} captured storage(s) lived in their own graph's memory pool and "
            "were not checked (correct as long as the graphs of one pool replay in capture order)")
    if cross:
        text += f"; {cross} lived in another graph's pool (a cross-pool dependency: checked)"
    return text


def nothing_checked(rep: WatchReport) -> bool:
    """No finding, and no watched process captured a CUDA graph: "no findings" would claim
    more than was looked at (every program on a machine without a GPU)."""
    return not rep.findings and not any(p.graphs for p in rep.processes)


def verdict_parts(rep: WatchReport) -> list[Text]:
    hooked = sum(p.torch_hooked for p in rep.processes)
    graphs = sum(p.graphs for p in rep.processes)
    parts = [Text("INTERRUPTED", style="bold yellow")] if rep.interrupted else []
    if rep.findings:
        parts.append(Text(f"{len(rep.findings)} finding(s) in {len(rep.groups())} group(s)", style="bold red"))
    elif nothing_checked(rep):
        parts.append(Text("nothing checked (no CUDA graph captured)", style="bold yellow"))
    else:
        parts.append(Text("no findings", style="bold green"))
    parts.append(Text(f"{len(rep.processes)} process(es) watched, {hooked} imported torch, "
                      f"{graphs} graph capture(s)"))
    if rep.command_exit is not None:
        parts.append(Text(f"command exited {rep.command_exit}"))
    return parts


def verdict_line(rep: WatchReport) -> Text:
    return Text(" · ").join(verdict_parts(rep))


def wrapped_parts(parts: list[Text], width: int, sep: str = " · ") -> Text:
    """Parts joined by sep, a line break only between two parts (never after a dangling sep)."""
    lines: list[Text] = []
    for part in parts:
        if lines and lines[-1].cell_len + len(sep) + part.cell_len <= width:
            lines[-1].append(sep)
            lines[-1].append_text(part)
        else:
            lines.append(part.copy())
    return Text("\n").join(lines)


def report_notes(rep: WatchReport) -> list[tuple[str, str]]:
    """(text, tone) of every line under the findings, the same in the console and the page:
    what the census did, the pool contract, the hooks' own errors, what watch could see."""
    notes = []
    censuses = sorted({p.census for p in rep.processes if p.graphs})
    if censuses:
        notes.append(("census: " + "; ".join(censuses), "dim"))
    note = pool_note(rep)
    if note:
        notes.append((note, "dim"))
    notes += [(f"watch internal error in pid {p.pid}: {err}", "warn")
              for p in rep.processes for err in p.internal_errors[:3]]
    notes += [(n, "warn" if n.startswith("Nothing checked") else "dim") for n in rep.notes]
    return notes


NOTE_STYLES = {"dim": "dim", "warn": "yellow"}


def render(rep: WatchReport, console: Console) -> None:
    console.print(wrapped_parts(verdict_parts(rep), console.width))
    if rep.processes:
        for item in processes_block(rep, console):
            console.print(item)
    if rep.findings:
        for item in findings_block(rep):
            console.print(item)
    for text, tone in report_notes(rep):
        console.print(Text(text, style=NOTE_STYLES[tone]))
    if rep.run_dirs:
        console.print(Text("records: " + ", ".join(rep.run_dirs), style="dim"))


# -- files --------------------------------------------------------------------------------------

def group_json(g: FindingGroup, rep: WatchReport) -> dict[str, Any]:
    index = {id(w): i for i, w in enumerate(rep.findings)}
    return {"pattern": g.pattern, "status": g.status, "mechanism": g.mechanism, "freed_at": g.freed_at,
            "count": g.count, "graphs": g.graphs(), "names": g.names(),
            "processes": sorted({f"{w.host}:{w.pid}" for w in g.members}),
            "ranks": sorted({w.rank for w in g.members if w.rank is not None}),
            "findings": [index[id(w)] for w in g.members]}


def report_json(rep: WatchReport) -> str:
    doc = to_jsonable(rep)
    doc["groups"] = [group_json(g, rep) for g in rep.groups()]     # indices into findings[]
    note = pool_note(rep)
    if note:
        doc["notes"] = doc["notes"] + [note]
    return json.dumps(doc, indent=2, ensure_ascii=False) + "\n"


def write_json(rep: WatchReport, path: str) -> None:
    """'-' writes to stdout, after everything the command itself printed there."""
    import sys
    text = report_json(rep)
    if path == "-":
        sys.stdout.write(text)
        sys.stdout.flush()
    else:
        write_text_atomic(path, text)


def junit_xml(rep: WatchReport) -> str:
    """One testcase per watched process; one failure per group of its findings (text XML-safe:
    a program's argv or a tensor name may hold characters XML forbids)."""
    suite = ET.Element("testsuite", name="repro watch", tests=str(len(rep.processes)),
                       failures=str(sum(1 for p in rep.processes if p.findings)))
    by_process: dict[tuple[str, int], list[WatchFinding]] = {}
    for w in rep.findings:
        by_process.setdefault((w.host, w.pid), []).append(w)
    for p in rep.processes:
        name = f"{p.host}:{p.pid}" + ("" if p.rank is None else f"[rank {p.rank}]")
        case = ET.SubElement(suite, "testcase", classname="repro.watch", name=xml_text(name))
        for g in group_findings(by_process.get((p.host, p.pid), []), finding_of=lambda w: w.finding):
            failure = ET.SubElement(case, "failure", type=g.status,
                                    message=xml_text(f"{g.pattern} {group_headline(g)}"))
            failure.text = xml_text("\n".join(f"{k}: {v}" for k, v in group_facts(g)))
        ET.SubElement(case, "system-out").text = xml_text(" ".join(p.argv))
    return ET.tostring(suite, encoding="unicode") + "\n"


def verdict_tone(rep: WatchReport) -> str:
    if rep.findings:
        return "bad"
    return "warn" if nothing_checked(rep) or rep.interrupted else "ok"


def group_view(g: FindingGroup) -> dict[str, Any]:
    return {"status": g.status.upper(), "tone": "bad" if g.status == "freed" else "warn", "pattern": g.pattern,
            "where": group_headline(g), "facts": group_facts(g)}


def page_view(rep: WatchReport) -> dict[str, Any]:
    """What the page shows, in the order it shows it: verdict, what watch could see, the
    findings by problem, then the processes (each command whole: a page can wrap it)."""
    multi_host = len({p.host for p in rep.processes}) > 1
    columns = (["host"] if multi_host else []) + list(PROCESS_COLUMNS)
    rows = [{"cells": process_row(p, multi_host)[:-1] + [" ".join(p.argv)], "bad": bool(p.findings)}
            for p in rep.processes]
    return {"verdict": verdict_line(rep).plain, "tone": verdict_tone(rep), "command": " ".join(rep.command),
            "created": rep.created, "schema": rep.schema, "notes": report_notes(rep),
            "findings": len(rep.findings), "groups": [group_view(g) for g in rep.groups()],
            "columns": columns, "numeric": NUMERIC_COLUMNS, "processes": rows, "run_dirs": rep.run_dirs}


def report_html(rep: WatchReport) -> str:
    """One self-contained page, rendered by the trial report's autoescaping template engine
    with its style sheet."""
    from repro.report.html import environment
    return environment().get_template("watch.html").render(page=page_view(rep))


def write_artifacts(rep: WatchReport, json_path: str | None, junit: str | None, html_path: str | None) -> None:
    if json_path:
        write_json(rep, json_path)
    if junit:
        write_text_atomic(junit, junit_xml(rep))
    if html_path:
        write_text_atomic(html_path, report_html(rep))
