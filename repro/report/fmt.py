"""Text formatting shared by every renderer: numbers, bytes, addresses, captured process output."""

from __future__ import annotations

import re
from typing import Any, Iterable

from repro.outcome import REPRODUCED, Outcome
from repro.units import format_bytes as fmt_bytes  # noqa: F401  (the project's one byte formatter)

ANSI_ESCAPE = re.compile(r"\x1b(?:\[[0-?]*[ -/]*[@-~]|\][^\x07\x1b]*(?:\x07|\x1b\\)|[@-Z\\-_])")
TAIL_LINES = 12
# Bytes that were not UTF-8 (a program's argv or output) reach the records as surrogate escapes;
# no UTF-8 file or terminal takes one, so each becomes the replacement character decoders use.
LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def fmt_ptr(p: int | None) -> str:
    return "-" if p is None else f"0x{int(p):x}"


def fmt_seconds(s: float | None) -> str:
    if s is None:
        return "-"
    return f"{s * 1000:.0f} ms" if s < 1 else f"{s:.2f} s"


def fmt_ranges(numbers: Iterable[int]) -> str:
    """'0, 1' / '0-63' / '0-2, 5': a run of three or more as its ends, so 64 ranks are one word."""
    runs: list[list[int]] = []
    for n in sorted(set(numbers)):
        if runs and n == runs[-1][-1] + 1:
            runs[-1].append(n)
        else:
            runs.append([n])
    return ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 2 else ", ".join(map(str, r)) for r in runs)


def fmt_rate(x: float) -> str:
    """A per-second rate: whole numbers where they are large, two digits where a whole number
    would read 0 (a slow CPU trial's 0.21 tokens/s)."""
    return f"{x:.0f}" if x >= 10 else f"{x:.2g}"


def fmt_float(x: Any) -> str:
    """Errors and tolerances; strings stand for NaN/Inf read back from strict JSON."""
    if x is None:
        return "-"
    if isinstance(x, str):
        return x
    return f"{x:.3g}"


def fmt_expected(expected: Iterable[Outcome]) -> str:
    allowed = {Outcome(e) for e in expected}
    if not allowed:
        return "-"
    if allowed == set(REPRODUCED):
        return "reproduced"
    if allowed == {Outcome.CLEAN}:
        return "CLEAN"
    if set(REPRODUCED) < allowed:
        rest = sorted((o.value for o in allowed - set(REPRODUCED)))
        return "|".join(["reproduced", *rest])
    return "|".join(o.value for o in sorted(allowed, key=lambda o: list(Outcome).index(o)))


def fmt_value(value: Any) -> str:
    """Any JSON value as a reader wants it: no 'null', '[]' or braces."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return fmt_float(value)
    if isinstance(value, (list, tuple)):
        return ", ".join(fmt_value(v) for v in value) if value else "none"
    if isinstance(value, dict):
        parts = [f"{k} {fmt_value(v)}" for k, v in value.items() if v not in (None, [], {}, "")]
        return " · ".join(parts) if parts else "none"
    return plain(str(value))


def encodable(text: str) -> str:
    return LONE_SURROGATE.sub("\ufffd", text)


def plain(text: str) -> str:
    """Strip ANSI colour codes and control characters from captured process output."""
    text = ANSI_ESCAPE.sub("", text or "").replace("\r\n", "\n").replace("\r", "\n")
    return encodable("".join(c for c in text if c in "\n\t" or ord(c) >= 32))


def last_lines(text: str, lines: int = TAIL_LINES) -> str:
    """The last `lines` lines of captured output, made printable."""
    kept = plain(text).rstrip("\n").splitlines()
    return "\n".join(kept[-lines:])
