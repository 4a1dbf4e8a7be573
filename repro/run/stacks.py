"""Python stacks a rank dumped when the parent asked (faulthandler), and who they blame.

At a deadline every rank of a hung group is asked for its stacks before the kill. In a
tensor-parallel group one rank that stops (a hang, an endless loop, a deadlock) leaves its
peers blocked in the next collective; the rank to blame is the one that is NOT waiting in a
collective while the others are.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

# faulthandler's format: a header per thread, then one line per frame, most recent first.
THREAD_HEADER = re.compile(r"^(Current thread|Thread) 0x[0-9a-fA-F]+")
FRAME = re.compile(r'^\s+File "(?P<path>.*)", line (?P<line>\d+) in (?P<func>.*)$')

# Frames that mean "blocked in a collective": torch.distributed's Python API (gloo blocks
# inside it) and the harness's own collective helpers.
COLLECTIVE_PATHS = ("/torch/distributed/", "/repro/rank/dist.py")
# The rank's own entry module: its thread is the one that runs the scenario.
WORKER_PATH = "/repro/rank/worker.py"
TOP_FRAMES = 6


@dataclass
class Frame:
    path: str
    line: int
    func: str

    def text(self) -> str:
        return f"{self.path}:{self.line} in {self.func}"


@dataclass
class Thread:
    current: bool
    frames: list[Frame] = field(default_factory=list)  # most recent first


def parse_dump(text: str) -> list[Thread]:
    threads: list[Thread] = []
    for line in text.splitlines():
        if THREAD_HEADER.match(line):
            threads.append(Thread(current=line.startswith("Current")))
        elif (m := FRAME.match(line)) and threads:
            threads[-1].frames.append(Frame(m["path"], int(m["line"]), m["func"]))
    return threads


def main_thread(threads: list[Thread]) -> Thread | None:
    """The thread running the worker's entry point (the one a scenario runs in)."""
    for t in threads:
        if any(f.path.endswith(WORKER_PATH) for f in t.frames):
            return t
    return threads[0] if threads else None


def in_collective(frames: list[Frame]) -> bool:
    return any(any(p in f.path for p in COLLECTIVE_PATHS) for f in frames)


def top_frames(text: str, n: int = TOP_FRAMES) -> list[str]:
    """The main thread's n most recent frames, 'path:line in func'; [] when nothing was dumped."""
    thread = main_thread(parse_dump(text))
    return [f.text() for f in thread.frames[:n]] if thread else []


def blame(stacks: dict[int, list[Frame]]) -> tuple[int | None, str]:
    """(rank, why) from each rank's main-thread frames; rank None when the stacks do not tell.

    Exactly the ranks outside a collective are suspects when at least one peer waits in one;
    the lowest suspect is named (several suspects are listed in `why`).
    """
    dumped = {r: f for r, f in stacks.items() if f}
    waiting = sorted(r for r, f in dumped.items() if in_collective(f))
    outside = sorted(r for r in dumped if r not in waiting)
    if not waiting or not outside:
        state = "waiting in a collective" if waiting else "outside any collective"
        return None, (f"every rank that answered was {state}" if dumped else "no rank dumped its stack")
    rank = outside[0]
    where = dumped[rank][0]
    others = ", ".join(str(r) for r in waiting)
    also = f" (also outside: {', '.join(str(r) for r in outside[1:])})" if len(outside) > 1 else ""
    return rank, (
        f"rank {rank} was not in a collective (at {short(where)}) while rank{'s' if len(waiting) > 1 else ''} "
        f"{others} waited in one{also}"
    )


def short(frame: Frame) -> str:
    """'worker.py:93 in inject_fault'."""
    return f"{frame.path.rsplit('/', 1)[-1]}:{frame.line} in {frame.func}"


def main_frames(text: str) -> list[Frame]:
    thread = main_thread(parse_dump(text))
    return thread.frames if thread else []
