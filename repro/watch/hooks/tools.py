"""What the hooks check with, loaded once, at the program's first graph: the guard (its
recording, its slots and checks) and, where it runs, the graph census.

Both are imported on a thread of their own (load_modules says why), never at import time:
importing the hooks imports no torch.
"""

from __future__ import annotations

import os
import threading
from types import ModuleType
from typing import TYPE_CHECKING

from repro.diagnose.drops import DropCount
from repro.watch.hooks.records import Log
from repro.watch.settings import Record, WatchSettings

if TYPE_CHECKING:  # annotations only: nothing here imports torch until the program does
    from repro.diagnose.allocator import AllocationStacks
    from repro.diagnose.census import CensusBook
    from repro.diagnose.guard import CaptureGuard


def load_census() -> ModuleType | None:
    """repro.census where it exists (the graph census reads what kernels really touch)."""
    try:
        from repro.diagnose import census
    except ImportError:
        return None
    return census


def plumbing_files() -> list[str]:
    """This package's source files. Any of them can be on the stack when the guard names a
    site (the CUDAGraph wrappers, what they call, a drop callback run inside a check): they are
    plumbing, never the user's site."""
    here = os.path.dirname(__file__)
    return [os.path.join(here, name) for name in sorted(os.listdir(here)) if name.endswith(".py")]


class Census:
    """The graph census in this process, behind its small API (census_supported, CensusBook,
    clock_marker, merge_findings). Whether it is supported here is asked once, at first use."""

    def __init__(self):
        self.module: ModuleType | None = None  # repro.diagnose.census, once asked and found supported here
        self.asked = False  # whether it was asked (Tools.census_ready)
        self.state = "not checked yet (no capture)"  # what the records say of it
        self.book: CensusBook | None = None  # where it runs: made with the guard (None where that failed)
        # Graphs captured (or reset) since the census last checked: checked together, against one
        # allocator snapshot, at the first replay after them (not one snapshot per graph).
        self.due: list[str] = []

    def exit_line(self) -> str:
        """The exit record's census line."""
        if self.book is not None:
            try:
                return f"active; {self.book.census_line()}"
            except Exception:
                pass
        return self.state

    def reads(self) -> dict[str, float] | None:
        """For the exit record: how often the census read the allocator's segments (its pool
        map, again whenever they changed), the seconds those checks took, how often it took a
        whole snapshot (at its checks), the parameter words of the graphs it holds (what its
        read and sort scale with), and how many 2 MiB pages of words outside the allocator it
        asked the driver about (one query each: Driver.is_device_address) in how many seconds;
        None where it did not run."""
        try:
            pools, censuses = self.book.pools, list(self.book.censuses.values())
            reads = {
                "segment_maps": pools.refreshes,
                "segment_seconds": round(pools.seconds, 6),
                "snapshots": self.book.snapshots,
                "graphs": len(censuses),
                "words": sum(c.words for c in censuses),
            }
        except AttributeError:  # no book (it never ran), or one that keeps no such counts
            return None
        try:
            driver = self.module.load_driver()
            reads["address_pages"] = len(driver.address_cache)
            reads["address_seconds"] = round(driver.address_seconds, 6)
        except Exception:  # a stand-in census, or no driver: the counts above stand alone
            pass
        return reads


class Tools:
    """The guard and the census, each made once, at first use."""

    def __init__(self, settings: WatchSettings, log: Log):
        self.settings = settings
        self.log = log
        self.guard: CaptureGuard | None = None
        self.drops = DropCount()  # the guard counts its captured storages' deaths here
        self.expired = None  # torch.UntypedStorage._expired once torch is in use
        self.census = Census()
        self._loaded = False  # load_modules ran

    def load_modules(self) -> None:
        """Import, once, what the hooks use, on a thread of its own, before the first use.

        The hooks first run inside the program's own calls (its ``CUDAGraph()``, its capture),
        so an import made in place runs with the program's frames below it on the stack. Module
        code that leaves a frame in a reference cycle (torch.fx keeps ``inspect.currentframe()``
        in a local of its import-time ``wrap()``) then pins, on CPython 3.11/3.12, every frame
        below that one through ``f_back``, each with all its locals: the program's capturing
        function outlives its return until the cyclic GC happens to run, and the buffer it
        frees on return is not freed while watched (the very bug watch exists to show would
        not happen). A thread's stack holds its own frames only. The recording mode's first
        dispatch is made there too (torch imports torch._dynamo at it). Only a message is kept
        of an error, never the exception (its traceback would hold frames).
        """
        if self._loaded:
            return
        self._loaded = True
        failed: list[str] = []

        def load() -> None:
            try:
                census = load_census()
                import repro.diagnose.guard

                # Only the dispatch-mode recording needs the warm-up (its first dispatch imports
                # torch._dynamo: seconds on an image without bytecode); where the census makes
                # the slots, no capture records at the dispatcher.
                if self.settings.record == Record.OPS or census is None or not census.census_supported()[0]:
                    repro.diagnose.guard.warm_up()
            except Exception as e:
                failed.append(f"{type(e).__name__}: {e}")

        try:
            thread = threading.Thread(target=load, name="repro-watch-import", daemon=True)
            thread.start()
            thread.join()
        except RuntimeError as e:  # no thread can be started: the hooks import in place
            failed.append(f"no import thread ({e})")
        if failed:
            self.log.counters.internal_errors += 1
            self.log.write({"kind": "internal", "where": "importing the hooks' modules", "error": failed[0]})

    def ensure_guard(self) -> CaptureGuard:
        if self.guard is None:
            self.load_modules()
            import torch
            from repro.diagnose.guard import CaptureGuard
            from repro.outcome import GuardMode

            # StorageWeakRef.expired() goes through two Python calls; the C function is ~20x faster.
            self.expired = getattr(torch.UntypedStorage, "_expired", None)
            # raise mode: we raise ourselves, after writing the record.
            self.guard = CaptureGuard(mode=GuardMode.WARN, plumbing=plumbing_files(), drops=self.drops)
            census = self.census
            if self.census_ready():
                # Starts the allocator's alloc/free trace, so reuse at the same address is seen;
                # before the first capture, never inside one. With --stacks it records each
                # allocation's stack, as start_stacks began it at CUDA's initialisation.
                tracing = census.module.Tracing.STACKS if self.settings.stacks else census.module.Tracing.START
                try:
                    census.book = census.module.CensusBook(rank=0, trace=tracing)
                except Exception as e:
                    census.state = f"unavailable: {type(e).__name__}: {e}"
            self.log.write({"kind": "census", "state": census.state})
        return self.guard

    def census_ready(self) -> bool:
        """Whether the census is supported in this process (asked once, on first use); it runs
        where its book could be made too (ensure_guard)."""
        census = self.census
        if not census.asked:
            self.load_modules()
            module = load_census()
            if module is None:
                census.state = "unavailable: repro.diagnose.census is not in this install"
            else:
                ok, why = module.census_supported()
                census.state = "active" if ok else f"unavailable: {why}"
                census.module = module if ok else None
            census.asked = True
        return census.module is not None

    def start_stacks(self) -> None:
        """With --stacks, at CUDA's initialisation (torch.cuda._lazy_call): the allocator records
        each allocation's stack from the program's first tensor on, not from its first capture
        (where the census starts its trace), so weights and buffers made before are covered.
        It runs inside torch's lazy init, which fails the program's CUDA call if this raises."""
        try:
            # Imported here, under the program's frames, unlike load_modules' imports: allocator
            # imports no torch and keeps no frame, so nothing of the caller's stack is pinned.
            from repro.diagnose.allocator import start_trace

            start_trace(stacks=True)
            self.log.write({"kind": "stacks", "state": "recording from CUDA's initialisation"})
        except Exception as e:
            self.log.internal("starting the allocation stacks (--stacks)", e)

    def allocation_sites(self) -> AllocationSites | None:
        """With --stacks, where each new slot's storage was allocated, for one adoption (a read
        of the allocator's segments, taken at the first slot that asks); None without."""
        if not self.settings.stacks or self.guard is None:
            return None
        from repro.diagnose.allocator import AllocationStacks

        return AllocationSites(AllocationStacks(), self.guard.plumbing, self.log)


class AllocationSites:
    """address -> "file:line in func" of the program's line that allocated the live block there,
    from the stacks the allocator recorded (--stacks); None where none is known. A failed read
    is said once, as the hooks' own error, and never costs the adoption that asked."""

    def __init__(self, stacks: AllocationStacks, plumbing: frozenset[str], log: Log):
        self.stacks = stacks
        self.plumbing = plumbing
        self.log = log
        self.failed = False

    def __call__(self, addr: int) -> str | None:
        if self.failed:
            return None
        try:
            from repro.diagnose.sites import recorded_site

            return recorded_site(self.stacks.frames_at(addr), self.plumbing)
        except Exception as e:
            self.failed = True
            self.log.internal("reading the allocation stacks (--stacks)", e)
            return None
