"""How many captured storages have died: the one number the replay hooks test per replay.

Plain data, no torch: `repro watch`'s hooks hold the counter before the program imports torch,
and the guard (repro.diagnose.guard) counts up in its drop callbacks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class DropCount:
    """How many captured storages have died (drop callbacks that fired)."""

    n: int = 0
    # Told of each death, after the count moved (the watch hooks' replay wrappers stop standing
    # aside). Runs inside a deallocation: it must not raise.
    on_drop: Callable[[], None] | None = None

    def count(self) -> None:
        self.n += 1
        if self.on_drop is not None:
            self.on_drop()
