"""Findings grouped so that one problem reads as one line, however many graphs, ranks or
processes show it.

An engine captures one graph per batch size (and, piecewise, one per layer piece per size), so
one dead tensor, or one mistake repeated in every layer, is found in hundreds of graphs. A
group is what those findings share: the slot name with its varying parts folded
(``model.7.rotary`` and ``model.8.rotary`` -> ``model.*.rotary``), the status, and the line
that dropped the last reference. Each group keeps its members, so JSON and HTML can still list
every graph, rank and process.

No torch import (the parent renders reports).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from repro.outcome import Finding, Mechanism, Status

# Parts of a slot name that differ between members of one repeated problem.
_HEX = re.compile(r"0x[0-9a-fA-F]+")
_INDEX = re.compile(r"(?<=[.\[])\d+(?=[.\]]|$)")  # model.7.rotary, graphs[16]
_NODE = re.compile(r"\bnode \d+\b")  # census: "node 12 kernel ..."


def slot_pattern(name: str) -> str:
    """The slot name with addresses, layer indices and node numbers folded to '*'."""
    name = _HEX.sub("0x*", name)
    name = _NODE.sub("node *", name)
    return _INDEX.sub("*", name)


@dataclass
class FindingGroup:
    """Findings that are one problem: same name pattern, status, mechanism and drop site."""

    pattern: str
    status: Status
    mechanism: Mechanism
    freed_at: str | None
    members: list[Any] = field(default_factory=list)  # Finding, or what finding_of unwraps
    findings: list[Finding] = field(default_factory=list)

    @property
    def count(self) -> int:
        return len(self.members)

    @property
    def first(self) -> Finding:
        return self.findings[0]

    def graphs(self) -> list[str]:
        return unique(f.graph for f in self.findings)

    def ranks(self) -> list[int]:
        return sorted({f.rank for f in self.findings if f.rank is not None})

    def names(self) -> list[str]:
        return unique(f.slot for f in self.findings)


def group_key(f: Finding) -> tuple:
    return (slot_pattern(f.slot), f.status, f.mechanism, f.freed_at)


def group_findings(items: Iterable[Any], finding_of: Callable[[Any], Finding] = lambda x: x) -> list[FindingGroup]:
    """Groups in the order their first member appears (what happened first reads first)."""
    groups: dict[tuple, FindingGroup] = {}
    for item in items:
        f = finding_of(item)
        key = group_key(f)
        group = groups.get(key)
        if group is None:
            group = groups[key] = FindingGroup(
                pattern=key[0], status=f.status, mechanism=f.mechanism, freed_at=f.freed_at
            )
        group.members.append(item)
        group.findings.append(f)
    return list(groups.values())


def unique(values: Iterable[str]) -> list[str]:
    """Distinct values in first-seen order."""
    return list(dict.fromkeys(values))
