"""Ctrl-C and SIGTERM: a flag the run polls, never an exception raised at an arbitrary line.

Raised as an exception, a signal lands wherever the main thread happens to be: in an import,
half-way through starting the rank server, while a finished trial is collected, while the
report is written. Each of those places lost the report (exit 143 and no JSON). So the
`repro` program installs its handlers first thing (repro/__main__.py), and while a command
that runs trials is under way a signal only sets the flag: the runner polls it, stops the
trials (their records are kept), and the report and its files are written as always, marked
interrupted. Commands that run no trial (doctor, watch, ...) get the usual behaviour back as
soon as the command line is known: there the signal raises (KeyboardInterrupt; Terminated
for SIGTERM), at once if it came earlier.

A signal that comes after the report's files are written changes neither them nor the exit
code: the run had ended. Signals already ignored when the program started (a background job
of a script ignores SIGINT) stay ignored, as a fresh interpreter keeps them.

Test hook: REPRO_SIGNAL_AT=SIGNAL@POINT (e.g. SIGTERM@server) makes the process signal
itself when it passes the named point, so a test reaches every window without timing.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

HANDLED = (signal.SIGINT, signal.SIGTERM)
SIGNAL_AT_ENV = "REPRO_SIGNAL_AT"


class Terminated(KeyboardInterrupt):
    """SIGTERM (a CI cancel): handled exactly like Ctrl-C, but named as itself."""


class Interrupts:
    """The first SIGINT/SIGTERM of this process, and whether it raises or only sets the flag."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.event = threading.Event()  # set at the first signal; the runner waits on it
        self.deferred = True  # True: record only; False: raise as Python would
        self.settled = False  # the report is out: later signals change nothing
        self.installed = False
        self._previous: dict[int, Any] = {}

    @property
    def name(self) -> str | None:
        return None if self.signum is None else signal.Signals(self.signum).name

    def install(self) -> None:
        """From the main thread only (Python's rule for signal handlers)."""
        for sig in HANDLED:
            previous = signal.getsignal(sig)
            if previous == signal.SIG_IGN:
                continue
            self._previous[sig] = previous
            signal.signal(sig, self.handle)
        self.installed = True

    def restore(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, signal.SIG_DFL if previous is None else previous)
        self._previous.clear()
        self.installed = False

    def handle(self, signum: int, frame: Any) -> None:
        if self.signum is None:
            self.signum = signum  # the first signal names the interruption
        self.event.set()
        if not self.deferred and not self.settled:
            raise self.exception()

    def exception(self) -> KeyboardInterrupt:
        return Terminated() if self.signum == signal.SIGTERM else KeyboardInterrupt()

    def pending(self) -> bool:
        return self.signum is not None and not self.settled

    def immediate(self) -> None:
        """From now on a signal raises; one that already came raises here."""
        self.deferred = False
        if self.pending():
            raise self.exception()


def checkpoint(point: str) -> None:
    """The test hook: signal this process at `point` when REPRO_SIGNAL_AT names it."""
    at = os.environ.get(SIGNAL_AT_ENV, "")
    name, _, where = at.partition("@")
    if where == point and name in signal.Signals.__members__:
        os.kill(os.getpid(), signal.Signals[name])
