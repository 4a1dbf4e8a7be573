"""Units for humans: one byte formatter for every message, table and report."""

from __future__ import annotations


def format_bytes(n: int | None) -> str:
    """Binary units, as allocators count: 134217728 -> '128 MiB', 1536 -> '1.5 KiB'; None -> '-'."""
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            break
        value /= 1024
    if unit == "B":
        return f"{int(n)} B"
    return f"{value:.1f}".rstrip("0").rstrip(".") + f" {unit}"
