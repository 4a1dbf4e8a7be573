"""Memory forensics: from a stale device address to where it was allocated and freed.

The CUDA caching allocator can record every alloc/free with its Python stack
(``torch.cuda.memory._record_memory_history``). Given the address a guard finding names, the
trace says which allocation covered it, where that allocation was made, where it was freed and
whether the segment went back to the driver (then a replay faults with error 700 instead of
reading stale data). ``dump()`` writes the same history as a pickle for pytorch.org/memory_viz.

The pieces that read a snapshot take plain dicts shaped like torch's (``device_traces``: one
list of trace entries per device, each ``{"action", "addr", "size", "stream", "frames": [
{"filename", "line", "name"}]}``, oldest first; frames innermost first), so they are testable
without a GPU and do not import torch. Nothing here raises on a broken CUDA context: a failed
snapshot returns None and leaves the reason in ``MemoryHistory.reason``.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from repro.diagnose.trace_index import RELEASE_ACTIONS, overlaps

if TYPE_CHECKING:
    from repro.outcome import Finding

TOP_FRAMES = 8
# torch's own Python files (site-packages/torch/...) and native frames are noise in a stack
# meant to point at the user's code.
_TORCH_PATH = re.compile(r"[/\\](?:site|dist)-packages[/\\]torch[/\\]")
_NATIVE_SUFFIXES = (".cpp", ".cc", ".cxx", ".c", ".h", ".hpp", ".cu", ".cuh", ".so")


@dataclass
class AllocEvents:
    """The trace events of the last allocation that covered an address."""

    device: int
    alloc: dict[str, Any]
    free_requested: dict[str, Any] | None = None
    free_completed: dict[str, Any] | None = None
    # The memory went back to the driver: segment_free, or segment_unmap under expandable segments.
    released: dict[str, Any] | None = None

    @property
    def freed(self) -> bool:
        return self.free_requested is not None or self.free_completed is not None


def find_events(traces: list, ptr: int) -> AllocEvents | None:
    """The LAST alloc whose [addr, addr+size) covers ptr, and the frees of it that followed.

    traces: a snapshot's ``device_traces`` (a list per device) or one device's list.
    The last alloc wins: when the memory was reused, the newest owner is the one at that
    address now. Frees match the alloc's address; a release (segment_free, segment_unmap) counts
    only after a free.
    """
    per_device = [traces] if traces and isinstance(traces[0], dict) else traces
    for device, trace in enumerate(per_device):
        last = None
        for i, entry in enumerate(trace):
            if entry.get("action") == "alloc" and overlaps(entry, ptr, ptr + 1):
                last = i
        if last is not None:
            return events_after(device, trace, last, ptr)
    return None


def events_after(device: int, trace: list, index: int, ptr: int) -> AllocEvents:
    alloc = trace[index]
    found = AllocEvents(device=device, alloc=alloc)
    for entry in trace[index + 1 :]:
        action = entry.get("action")
        if action == "free_requested" and entry.get("addr") == alloc["addr"]:
            found.free_requested = found.free_requested or entry
        elif action == "free_completed" and entry.get("addr") == alloc["addr"]:
            found.free_completed = found.free_completed or entry
        elif action in RELEASE_ACTIONS and found.freed and overlaps(entry, ptr, ptr + 1):
            found.released = found.released or entry
    return found


def is_user_frame(frame: dict[str, Any], torch_dir: str | None = None, plumbing: frozenset[str] = frozenset()) -> bool:
    filename = frame.get("filename") or ""
    if not filename or filename == "??" or filename.startswith("<frozen"):
        return False
    if filename.endswith(_NATIVE_SUFFIXES) or _TORCH_PATH.search(filename):
        return False
    if filename in plumbing:
        return False  # e.g. the guard's dispatch mode, in every stack recorded during capture
    return not (torch_dir and filename.startswith(torch_dir))


def format_frame(frame: dict[str, Any]) -> str:
    return f"{os.path.basename(frame.get('filename', '?'))}:{frame.get('line', 0)} in {frame.get('name', '?')}"


def user_frames(
    frames: list[dict[str, Any]] | None, limit: int = TOP_FRAMES, plumbing: frozenset[str] = frozenset()
) -> list[str]:
    """Top user frames ("file:line in func"), innermost first; torch, native frames and the
    caller's plumbing files (e.g. ``CaptureGuard.plumbing``) dropped."""
    torch_dir = installed_torch_dir()
    kept = [format_frame(f) for f in frames or [] if is_user_frame(f, torch_dir, plumbing)]
    return kept[:limit]


def installed_torch_dir() -> str | None:
    # Only when torch is already loaded: a parent process reading a dumped snapshot stays torch-free.
    torch = sys.modules.get("torch")
    path = getattr(torch, "__file__", None)
    return os.path.dirname(path) + os.sep if path else None


def describe(events: AllocEvents, plumbing: frozenset[str] = frozenset()) -> dict[str, Any]:
    """The record locate() returns for one address."""
    free = events.free_requested or events.free_completed
    return {
        "addr": events.alloc["addr"],
        "size": events.alloc.get("size", 0),
        "device": events.device,
        "freed": events.freed,
        "alloc_stack": user_frames(events.alloc.get("frames"), plumbing=plumbing),
        "free_stack": user_frames(free.get("frames"), plumbing=plumbing) if free else [],
        "released_to_driver": events.released is not None,
    }


def snapshot_name(scenario: str, rank: int, pid: int) -> str:
    """'memory-gemma4-mtp-rank0-pid1234.pickle': one file per rank and process."""
    return f"memory-{scenario}-rank{rank}-pid{pid}.pickle"


class MemoryHistory:
    """The CUDA allocator's alloc/free history with Python stacks, bounded by max_entries.

    A no-op without CUDA (``available`` is False, ``reason`` says why). Failures after start
    (e.g. a sticky CUDA error) are recorded in ``reason`` and reported as None, never raised.
    plumbing: source files left out of the stacks (pass ``CaptureGuard.plumbing``: the guard's
    dispatch mode and the caller's helpers sit in every stack recorded during a capture).
    """

    def __init__(self, enabled: bool, max_entries: int = 100_000, plumbing: Iterable[str] = ()):
        self.enabled = enabled
        self.max_entries = max_entries
        self.plumbing = frozenset(plumbing)
        self.active = False
        self.reason = ""
        self.available = False
        if not enabled:
            self.reason = "memory history disabled"
            return
        try:
            import torch

            if not torch.cuda.is_available():
                self.reason = f"CUDA is not available (torch {torch.__version__}): no allocator history"
                return
        except Exception as exc:  # a broken torch install still must not stop the run
            self.reason = f"torch unavailable: {exc}"
            return
        self.available = True

    def __enter__(self) -> MemoryHistory:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> bool:
        """Begin recording (process-wide, like the allocator itself). True when recording."""
        if not self.available or self.active:
            return self.active
        try:
            import torch

            # Same keyword names in torch 2.11 and 2.13; "python" stacks keep ~2 us per event.
            torch.cuda.memory._record_memory_history(
                enabled="all", context="all", stacks="python", max_entries=self.max_entries
            )
        except Exception as exc:
            self.reason = f"_record_memory_history failed: {exc}"
            return False
        self.active = True
        self.reason = ""
        return True

    def stop(self) -> None:
        if not self.active:
            return
        try:
            import torch

            torch.cuda.memory._record_memory_history(enabled=None)
        except Exception as exc:
            self.reason = f"stopping memory history failed: {exc}"
        self.active = False

    def snapshot(self) -> dict[str, Any] | None:
        if not self.active:
            self.reason = self.reason or "memory history was not started"
            return None
        try:
            import torch

            return torch.cuda.memory._snapshot()
        except Exception as exc:
            self.reason = f"memory snapshot failed: {exc}"
            return None

    def locate(self, ptr: int, snapshot: dict[str, Any] | None = None) -> dict[str, Any] | None:
        """{"addr", "size", "alloc_stack", "free_stack", "released_to_driver", ...} or None."""
        snap = snapshot if snapshot is not None else self.snapshot()
        if snap is None:
            return None
        try:
            events = find_events(snap.get("device_traces", []), ptr)
        except Exception as exc:  # an unexpected snapshot shape from another torch version
            self.reason = f"reading the memory snapshot failed: {exc}"
            return None
        if events is None:
            self.reason = f"no recorded allocation covers {ptr:#x} (history too short or started late?)"
            return None
        return describe(events, self.plumbing)

    def annotate(self, findings: list[Finding]) -> int:
        """Fill alloc_stack / free_stack of guard findings in place; returns how many were found."""
        if not findings:
            return 0
        snap = self.snapshot()
        if snap is None:
            return 0
        located = 0
        for finding in findings:
            where = self.locate(finding.old_ptr, snap)
            if where is None:
                continue
            finding.alloc_stack = where["alloc_stack"]
            finding.free_stack = where["free_stack"]
            located += 1
        return located

    def dump(self, path: str | os.PathLike) -> str | None:
        """Write the snapshot pickle atomically (tmp file, then rename); the path or None."""
        if not self.active:
            self.reason = self.reason or "memory history was not started"
            return None
        path = os.fspath(path)
        tmp = f"{path}.tmp-{os.getpid()}"
        try:
            import torch

            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            torch.cuda.memory._dump_snapshot(tmp)
            os.replace(tmp, path)
        except Exception as exc:
            self.reason = f"dumping the memory snapshot failed: {exc}"
            remove_quietly(tmp)
            return None
        return path

    snapshot_name = staticmethod(snapshot_name)


def remove_quietly(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass
