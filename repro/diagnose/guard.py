"""Stale-capture guard: name the captured tensor that died or moved, before the replay.

A CUDA graph bakes in the device address of every tensor its kernels touch. Memory allocated
during capture lives in the graph's private pool; anything allocated outside it (weights, an
all-gathered lm_head, kernel workspaces, quant-config scales) is only safe while its owner keeps
it alive at the same address. This guard records those outside tensors while the capture (or a
CPU dry run of the same code) runs, and checks cheaply before each replay whether any of them
was freed or replaced.

The idea is PyTorch's own: ``torch.cuda.graph(..., check_input_liveness=True)`` (torch >= 2.13)
and inductor's cudagraph trees keep a storage weak reference plus the data pointer seen at
capture. This is an independent implementation that also runs on torch 2.11 and on CPU, and
adds readable names (``moe.moe_kernel.workspace13``), where the storage was created and where
its last Python reference was dropped.

Usage on your own CUDA graph::

    import torch
    from repro.diagnose.guard import CaptureGuard

    guard = CaptureGuard(mode="warn")          # "raise": check() raises StaleCaptureError
    head = torch.nn.Linear(256, 4096, bias=False, device="cuda").requires_grad_(False)
    guard.watch("head", head)                  # names: "head.weight", "head.weight[view]"
    static_in = torch.zeros(16, 256, device="cuda")

    def capture_routine(graph):
        weight = head.weight.clone()           # made outside the capture, held by a local only
        static_in @ weight.t()                 # warm up before capturing, as usual
        torch.cuda.synchronize()
        with guard.capture(graph, "head bs=16"):
            out = static_in @ weight.t()
        return out                             # `weight` dies here; the graph keeps its address

    graph = torch.cuda.CUDAGraph()
    with guard.tracking():                     # optional: remembers where storages were made
        static_out = capture_routine(graph)

    for finding in guard.check("before replay"):   # microseconds; nothing is replayed
        print(finding.message)
    # graph 'head bs=16' captured tensor <local weight of capture_routine, created by
    # aten.clone at ...> (float32[4096, 256], 4.0 MiB) at 0x7f..., and that storage has been
    # freed (last reference dropped at ... (returned)). Replaying will read freed memory: ...

Without a GPU, wrap the same code in ``guard.recording("head bs=16")`` instead of
``guard.capture(...)``: the recording and the verdict are the same, only no graph exists.

Limits: only tensors that reach the PyTorch dispatcher are seen (aten ops and registered custom
ops); a raw Triton launch or a C++ extension that takes pointers directly is invisible, as it is
to PyTorch's own check. Names for plain attributes are found up to four hops below a watched
owner (``owner.obj.sub.tensor``, ``owner.graphs[16].inputs[0]``).
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import os
import sys
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from types import FrameType
from typing import Any, ContextManager, NamedTuple

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from repro.diagnose import fingerprint, owners, sites
from repro.diagnose.drops import DropCount
from repro.outcome import Finding, GuardMode, Manifest, Status
from repro.diagnose.owners import Named, Owner, bind_owners, build_index, exposed_name, hold, resolve, storage_of
from repro.diagnose.sites import frame_site, holder_of, storage_key, user_frame
from repro.env.runtime import torch_supports_liveness
from repro.units import format_bytes

MECHANISM = "repro dispatch-mode guard"
MECHANISM_WITH_TORCH = "torch check_input_liveness + repro dispatch-mode guard"
FIX_FREED = (
    "Replaying will read freed memory: keep the tensor alive for the graph's lifetime "
    "(cache it on the module) or re-capture after it changes."
)
FIX_REBOUND = (
    "Replaying will keep using the old tensor, not the owner's current one: update "
    "the captured tensor in place (copy_) instead of rebinding it, or re-capture after "
    "it changes."
)
FIX_MOVED = (
    "Replaying will touch memory the storage no longer owns: do not resize or re-point "
    "captured storages, or re-capture after they change."
)
FIX_CONTENTS = (
    "Replaying will compute with the new bytes: keep the tensor out of memory that is "
    "discarded (a sleeping pool's scope), restore it before the next replay, or rebuild it "
    "and re-capture. A write the program meant but torch did not count (through .data, "
    "numpy, a raw kernel) reads the same: write through the tensor itself (copy_), or "
    "inside guard.program_writes()."
)

# The guard's own files never name a user's site; callers add theirs (capture helpers, collectives).
OWN_FILES = sites.module_files(sys.modules[__name__], owners, sites)
_PRUNE_EVERY = 4096  # births recorded between sweeps of dead entries
# Ops whose input is a tensor the op's caller just made from Python data (torch.tensor(...)
# emits lift_fresh on the fresh tensor): inside a recording it is as new as any op's output.
_FRESH_OPS = frozenset((torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default))


class StaleCaptureError(RuntimeError):
    """A captured tensor is dead or moved; ``findings`` holds every new finding of that check."""

    def __init__(self, message: str, findings: list[Finding] | None = None):
        super().__init__(message)
        self.findings = list(findings or [])


@dataclass
class Slot:
    """One storage a capture reads or writes that was not allocated inside the capture."""

    name: str
    graphs: list[str]
    shape: list[int]  # of the largest view seen
    dtype: str  # "bfloat16"
    nbytes: int  # of the largest view seen
    data_ptr: int  # of the largest view seen
    storage_ptr: int
    storage_nbytes: int
    device: str
    version: int | None  # t._version at record time; None for inference tensors
    captured_at: str  # "file:line in func (aten.mm.default)" of the first op seen
    created_at: str | None = None
    freed_at: str | None = None  # where the storage's last reference went (set as it dies)
    ref: StorageWeakRef | None = field(default=None, repr=False, compare=False)
    key: int = field(default=0, repr=False)  # storage identity; unique while `ref` lives
    named: Named | None = field(default=None, repr=False, compare=False)
    reported: set[Status] = field(default_factory=set, repr=False, compare=False)  # each said once
    drop_ref: weakref.ref | None = field(default=None, repr=False, compare=False)
    # The graph pool the storage's memory belongs to, where the caller told (assign_pools), and
    # the graphs that allocate from that very pool: for them the storage is pool-managed.
    pool: tuple[int, int] | None = None
    managed_in: set[str] = field(default_factory=set, repr=False, compare=False)
    # Contents (repro/diagnose/fingerprint.py): a captured op wrote the storage (graph-written, never
    # fingerprinted); a weak handle to the tensor first seen (its version counter); the
    # fingerprint of the bytes the graph reads, as of the last check point.
    written: bool = field(default=False, repr=False, compare=False)
    handle: weakref.ref | None = field(default=None, repr=False, compare=False)
    contents: fingerprint.Print | None = field(default=None, repr=False, compare=False)

    @property
    def graph(self) -> str:
        return self.graphs[0] if self.graphs else ""

    def checked_in(self, graph: str | None) -> bool:
        """Whether the slot's lifetime matters to `graph` (None: to any of its graphs)."""
        if graph is None:
            return not self.managed_in.issuperset(self.graphs)
        return graph not in self.managed_in


@dataclass(frozen=True)
class _Birth:
    """Where tracking saw a storage created; formatted only if it ends up in a slot."""

    ref: StorageWeakRef
    op: Any
    filename: str
    lineno: int
    func: str


@dataclass
class _Recording:
    label: str
    capturing: bool  # a real CUDA capture: host tensors are not in the graph
    # Storages made by an op inside the block: the capture's own (graph pool), never slots. Keys
    # alone suffice: a key is reused only after its storage died, and whatever is allocated
    # inside the block is the capture's own memory as well.
    produced: set[int] = field(default_factory=set)
    index: dict[int, Named] | None = None
    index_fresh: bool = False  # index built for this recording (a miss will not rebuild it)
    pool: tuple[int, int] | None = None  # the capturing graph's pool
    pool_of: Callable[[int], tuple[int, int] | None] | None = None  # address -> graph pool, cheap


class _Status(NamedTuple):
    """A tuple, not a dataclass: check() builds one per slot per replay."""

    status: Status  # freed, moved, rebound, contents-changed or unchanged
    new_ptr: int | None = None
    detail: str = ""  # for rebound: "rebound" (a new tensor) | "dropped" (none);
    # for contents-changed: since when the bytes were as captured


_UNCHANGED = _Status(Status.UNCHANGED)


class _OpObserver(TorchDispatchMode):
    """Runs every op unchanged, then hands (op, args, kwargs, out) to a callback.

    Visible to torch.compile: for processes that never compile (the scenario ranks). torch
    otherwise wraps a mode's __torch_dispatch__ in torch._disable_dynamo, whose first call
    imports torch._dynamo: 0.9 s with bytecode on a CPU box, several seconds on an image
    without it, paid inside the first capture of every trial (benchmarks/startup.py).
    """

    supports_higher_order_operators = True

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False

    def __init__(self, on_op: Callable[[Any, tuple, dict, Any], None]):
        super().__init__()
        self._on_op = on_op

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self._on_op(func, args, kwargs, out)
        return out


class _HiddenOpObserver(_OpObserver):
    """The same observer, hidden from torch.compile as torch hides every mode by default: for
    programs that may compile (repro watch). Its first dispatch imports torch._dynamo."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return True

    __torch_dispatch__ = _OpObserver.__torch_dispatch__  # wrapped by TorchDispatchMode.__init_subclass__


class CaptureGuard:
    """Records tensors a capture baked in and checks, before replay, that they are still there.

    mode: a GuardMode (or its string): off records nothing; warn returns findings and lets the
    run go on (so the real symptom still shows); raise makes check() raise StaleCaptureError on
    the first finding.
    plumbing: source files of the caller's own helpers (capture wrappers, collectives) whose
    frames must not be named as the site: a site names the line that asked for the tensor.
    compiles: whether the process may run torch.compile (the default, as for any program);
    False keeps the recording visible to it and its first use free of the torch._dynamo import.
    """

    _not_an_owner = True  # naming never walks into a guard

    def __init__(
        self,
        mode: GuardMode | str = GuardMode.WARN,
        rank: int = 0,
        plumbing: Iterable[str] = (),
        compiles: bool = True,
        scratch: Callable[[], ContextManager] | None = None,
        drops: DropCount | None = None,
    ):
        if mode not in tuple(GuardMode):
            raise ValueError(f"guard mode {mode!r} is not one of {', '.join(GuardMode)}")
        self.mode = GuardMode(mode)
        self.rank = rank
        # compiles=False: the process never runs torch.compile, so the recording need not be
        # hidden from it (and its first use need not import torch._dynamo).
        self._observer = _HiddenOpObserver if compiles else _OpObserver
        self._plumbing = sites.plumbing_set(plumbing, OWN_FILES)
        # Deaths of captured storages so far: while it has not moved, none of them died (the
        # replay hook's fast path tests this one number, not each storage). drops: a counter
        # made before the guard (the watch hooks test it from their first replay on).
        self.drops = drops if drops is not None else DropCount()
        self._owners: list[Owner] = []
        self._slots: dict[int, Slot] = {}
        # Slots of storages that moved after they were recorded (resize_() in place: the same
        # storage object, new memory): one Slot per placement, so each graph is told about the
        # address it captured. _slots holds each storage's current placement.
        self._earlier: list[Slot] = []
        self._births: dict[int, _Birth] = {}
        self._births_since_prune = 0
        self._mechanism = MECHANISM
        # graph label (or None: all) -> weak refs of its slots not yet reported freed; the
        # liveness check walks this tuple only. Cleared whenever the slots or their states change.
        self._live_refs: dict[str | None, tuple[StorageWeakRef | None, ...]] = {}
        # graph label -> its slots, so a check costs what that graph captured, not what the
        # process captured before it (an engine captures thousands of graphs).
        self._by_graph: dict[str, list[Slot]] = {}
        # Names of owners' tensors, reused across recordings until the owners change, and
        # the storages a freshly built index did not know (a local, a library workspace):
        # they do not rebuild it again in later recordings (an engine captures thousands).
        self._index: dict[int, Named] | None = None
        self._unnamed: set[tuple[int, int]] = set()  # (storage key, data_ptr)
        self._extents: tuple[dict[int, Named] | None, Extents] | None = None
        self.index_builds = 0
        # Where the fingerprints' temporaries are allocated (the harness's own pool): on a GPU
        # they must not land in freed captured blocks, whose bytes decide how a bug shows.
        self._scratch = scratch or contextlib.nullcontext

    # -- public API -------------------------------------------------------------------------

    @property
    def slots(self) -> list[Slot]:
        return self._every_slot()

    def _every_slot(self) -> list[Slot]:
        """Every placement of every captured storage, earlier placements first."""
        return [*self._earlier, *self._slots.values()] if self._earlier else list(self._slots.values())

    def _placed(self, key: int, storage_ptr: int) -> Slot | None:
        """The slot of storage `key` at its current address, or None. A storage that moved since
        its slot was made retires that slot (still checked: the graphs that captured it read
        the old address) and gets a new one from the caller: FlashInfer #4398's resize_()."""
        slot = self._slots.get(key)
        if slot is not None and slot.storage_ptr != storage_ptr:
            self._earlier.append(self._slots.pop(key))
            self._live_refs.clear()
            return None
        return slot

    @property
    def mechanism(self) -> str:
        return self._mechanism

    @property
    def torch_liveness_available(self) -> bool:
        return torch_supports_liveness()

    def watch(self, name: str, obj: Any) -> None:
        """Register an owner (module, kernel or config object, dataclass, dict, tensor)."""
        if self.mode is GuardMode.OFF:
            return
        owners = [o for o in self._owners if o.name != name]
        owners.append(Owner(name, hold(obj)))
        self._owners = bind_owners(owners)
        self._index = None
        self._unnamed.clear()

    @contextlib.contextmanager
    def tracking(self) -> Iterator[None]:
        """Remember the op and user-code site that created each storage made in the block."""
        if self.mode is GuardMode.OFF:
            yield
            return
        with self._observer(self._note_births):
            yield
        self._prune_births()

    @contextlib.contextmanager
    def recording(
        self,
        graph: str,
        pool: tuple[int, int] | None = None,
        pool_of: Callable[[int], tuple[int, int] | None] | None = None,
    ) -> Iterator[None]:
        """Record every tensor the block's ops touch that was allocated outside the block.

        pool / pool_of: the capturing graph's pool and a cheap address -> pool lookup; a
        storage already known to be in that pool is recorded as pool-managed at once, without
        naming it (it is never a finding, and naming walks the caller's frames)."""
        if self.mode is GuardMode.OFF:
            yield
            return
        rec = _Recording(label=graph, capturing=cuda_capturing(), pool=pool, pool_of=pool_of)
        self._by_graph.setdefault(graph, [])
        try:
            with self._observer(functools.partial(self._observe, rec)):
                yield
        finally:
            self._live_refs.clear()
        if not rec.capturing:
            self.fingerprint(graph)  # a dry run ends here; a real capture after capture_end

    def adopt(
        self,
        graph: str,
        words: Iterable[Any],
        frame: FrameType | None = None,
        created_at: Callable[[int], str | None] | None = None,
    ) -> list[Any]:
        """Slots for a capture the graph census read, with nothing recorded at the dispatcher.

        words: the census's captured words outside the graph's own pool (anything with .addr
        and .describe(): census Words and References); frame: a frame of the code that ended
        the capture, whose user frames' locals are searched (None: owners only); created_at:
        storage address -> "file:line in func" where it was allocated, or None, asked once per
        new slot (the watch hooks read the allocator's recorded stacks). Each word
        inside a storage that a watched owner or one of those locals holds makes (or extends)
        that storage's slot, named as a recording names it. The recording's cost is per op of
        the capture; this one's is per distinct captured address. The owner index is built
        here only when the owners changed (refresh_index() builds it again on purpose).
        Returns the words no slot took: memory no one holds (a library's workspace, a tensor
        only a C++ structure keeps, stale bytes), which is the census's alone.
        """
        self._by_graph.setdefault(graph, [])
        words = list(words)
        if self.mode is GuardMode.OFF or not words:
            return words
        frame = user_frame(frame, self._plumbing)
        site = frame_site(frame)
        # The capturing frames' locals are read only if some word is in no owner's storage
        # (reading them costs ~20 us a frame, and an engine captures thousands of graphs).
        held = LazyExtents(lambda: held_by_locals(frame, self._plumbing) if frame is not None else Extents([]))
        if self._index is None:
            self._index = self._build_index()
        owned = self._owned_extents()
        left: list[Any] = []
        hit: set[int] = set()  # addresses inside a slot's storage
        done: set[int] = set()  # storage keys this graph already has
        for w in words:
            addr = w.addr
            if addr in hit:
                continue
            if self._adopt_word(graph, w, owned, held, site, done, created_at) is None:
                left.append(w)
            else:
                hit.add(addr)
        self._live_refs.clear()
        return left

    def refresh_index(self) -> None:
        """Build the owner index again: an owner may have gained a tensor since (a reload, a
        lazily made buffer). The watch hooks call it once per check, not per capture (an
        engine captures thousands of graphs, and building it walks every owner)."""
        if self.mode is not GuardMode.OFF:
            self._index = self._build_index()

    def _owned_extents(self) -> Extents:
        """The owner index as storage extents, derived once per index build."""
        if self._extents is None or self._extents[0] is not self._index:
            self._extents = (
                self._index,
                Extents.of((n.storage_ptr, n.storage_nbytes, key, n) for key, n in (self._index or {}).items()),
            )
        return self._extents[1]

    def _adopt_word(
        self,
        graph: str,
        w: Any,
        owned: Extents,
        held: Extents | LazyExtents,
        site: str,
        done: set[int],
        created_at: Callable[[int], str | None] | None = None,
    ) -> Slot | None:
        """The slot of the storage holding w's address (made, or extended to this graph), or
        None when no owner or local holds it."""
        found = owned.find(w.addr)
        named, t = None, None
        if found is not None:
            key, named = found
            slot = self._slots.get(key) if key in done else None
            if slot is not None and slot.storage_ptr <= w.addr < slot.storage_ptr + slot.storage_nbytes:
                return slot  # this graph's slot of that storage, checked for a word before
            t = resolve(named)
            if (
                not isinstance(t, torch.Tensor)
                or storage_key(t) != key
                or t.untyped_storage().data_ptr() != named.storage_ptr
            ):
                named = t = None  # the index is stale for this storage
        if t is None:
            found = held.find(w.addr)
            if found is None:
                return None
            key, (t, holder) = found
        if key in done:
            return self._slots[key]
        done.add(key)
        storage = t.untyped_storage()
        slot = self._placed(key, storage.data_ptr())
        if slot is not None:
            if widen_slot(slot, t, graph):
                self._by_graph[graph].append(slot)
            return slot
        # Asked here, while the storage lives: its address is still its own allocation's.
        made = created_at(storage.data_ptr()) if created_at is not None else None
        slot = new_slot(t, storage, key, graph, f"{site} ({w.describe()})", created_at=made, named=named)
        slot.name = exposed_name(named, t) if named is not None else f"<local {holder[0]} of {holder[1]}>"
        self._slots[key] = slot
        self._by_graph[graph].append(slot)
        listen_for_drop(slot, storage, self._plumbing, self.drops)
        return slot

    @contextlib.contextmanager
    def capture(
        self,
        graph: torch.cuda.CUDAGraph,
        label: str,
        pool=None,
        stream=None,
        use_torch_liveness: bool = False,
        fingerprint: bool = True,
    ) -> Iterator[None]:
        """``torch.cuda.graph(graph, pool, stream)`` + ``recording(label)``.

        use_torch_liveness=True also passes ``check_input_liveness=True`` where the running torch
        accepts it (>= 2.13), so ``graph.replay()`` itself raises on dead inputs.
        fingerprint=False: the caller calls fingerprint(label) itself, later (after its own
        capture-end work).
        """
        kwargs: dict[str, Any] = {}
        if use_torch_liveness and torch_supports_liveness():
            kwargs["check_input_liveness"] = True
            self._mechanism = MECHANISM_WITH_TORCH
        with torch.cuda.graph(graph, pool=pool, stream=stream, **kwargs):
            with self.recording(label):
                yield
        if fingerprint:
            self.fingerprint(label)

    def check(self, when: str, graph: str | None = None, deep: bool = True) -> list[Finding]:
        """Findings new since the last check (each slot once per status).

        graph: only the slots that capture recorded, i.e. what the replay about to run reads.
        deep:  also detect rebinding (an owner's name now points at another tensor), which
               re-resolves every owner path. deep=False tests liveness only (what names the
               tensor before an illegal memory access): run it before every replay, and a
               deep check after anything that may rebind (a weight reload).
        """
        if self.mode is GuardMode.OFF or (not deep and self._all_alive(graph)):
            return []
        findings = []
        for slot in self._every_slot() if graph is None else self._by_graph.get(graph, ()):
            if Status.FREED in slot.reported or not slot.checked_in(graph):
                continue  # freed is final; a pool-managed storage is its pool's business
            status = self._classify(slot) if deep else self._liveness(slot)
            if status.status is Status.UNCHANGED or status.status in slot.reported:
                continue
            slot.reported.add(status.status)
            findings.append(self._finding(slot, status, when))
            self._live_refs.clear()
        if deep:
            findings += self._check_contents(when, graph)
        if findings and self.mode is GuardMode.RAISE:
            raise StaleCaptureError(findings[0].message, findings)
        return findings

    def manifest(self, when: str) -> Manifest:
        """Counts of captured storages by state (the pointer census of vLLM RFC #48312)."""
        counts = dict.fromkeys((Status.FREED, Status.MOVED, Status.REBOUND, Status.UNCHANGED), 0)
        if self.mode is not GuardMode.OFF:
            for slot in self._every_slot():
                if not slot.checked_in(None):
                    continue
                status = Status.FREED if Status.FREED in slot.reported else self._classify(slot).status
                counts[status] += 1
        return Manifest(
            when=when,
            rank=self.rank,
            freed=counts[Status.FREED],
            rebound=counts[Status.REBOUND],
            unchanged=counts[Status.UNCHANGED],
            moved=counts[Status.MOVED],
        )

    def freed_blocks(self) -> list[tuple[int, int, str]]:
        """(storage data_ptr, storage nbytes, dtype) of every captured storage now freed."""
        return [
            (s.storage_ptr, s.storage_nbytes, s.dtype)
            for s in self._every_slot()
            if s.checked_in(None) and s.ref is not None and s.ref.expired()
        ]

    def slots_of(self, graph: str) -> list[Slot]:
        """The storages one capture recorded (its slots), in the order first seen."""
        return list(self._by_graph.get(graph, ()))

    def assign_pools(
        self, graph: str, graph_pool: tuple[int, int] | None, pool_of: Callable[[int], tuple[int, int] | None]
    ) -> list[Slot]:
        """After a capture: which of its slots live in a graph pool, and which in its own.

        A storage in the pool the graph itself allocates from (its private pool, or one it
        shares with other graphs) is pool-managed for that graph: the pool keeps the memory
        reserved while a graph of it lives, and graphs of one pool replayed in capture order
        may hand each other intermediates whose Python references are gone (vLLM keeps only
        weak references to piece outputs). Its Python lifetime is then no finding. A storage
        in another graph's pool is a cross-pool dependency: returned from the list (and still
        checked like any memory from outside). pool_of(address) -> pool id or None (not in a
        graph pool).
        """
        cross = []
        for slot in self._by_graph.get(graph, ()):
            if slot.pool is None and (slot.ref is not None and not slot.ref.expired()):
                slot.pool = pool_of(slot.storage_ptr)
            if slot.pool is None:
                continue
            if graph_pool is not None and slot.pool == graph_pool:
                slot.managed_in.add(graph)
            else:
                cross.append(slot)
        self._live_refs.clear()
        return cross

    def pool_managed(self) -> int:
        """Storages pool-managed for every graph that captured them (not checked)."""
        return sum(1 for s in self._every_slot() if s.managed_in and not s.checked_in(None))

    @property
    def plumbing(self) -> frozenset[str]:
        """Every file whose frames are not user sites: torch aside, the guard's and the caller's."""
        return self._plumbing

    # -- contents (repro/diagnose/fingerprint.py) ----------------------------------------------------

    def fingerprint(self, graph: str) -> None:
        """After a capture ended (outside it): fingerprint the storages it reads and no captured
        op writes, outside every graph pool. One sync per device; recording() and capture() call
        it, graphs.capture after its census."""
        if self.mode is GuardMode.OFF:
            return
        slots = [s for s in self._by_graph.get(graph, ()) if fingerprint.checkable(s, graph)]
        with self._scratch():
            fingerprint.take(slots, f"the end of capture '{graph}'", resolve)

    def _check_contents(self, when: str, graph: str | None) -> list[Finding]:
        """Deep checks: storages whose bytes changed while no version counter moved."""
        slots = [
            s
            for s in (self._every_slot() if graph is None else self._by_graph.get(graph, ()))
            if s.contents is not None and fingerprint.checkable(s, graph)
        ]
        if not slots:
            return []
        with self._scratch():
            changed = fingerprint.compare(slots, f"the check '{when}'", resolve)
        findings = []
        for slot, old in changed:
            slot.reported.add(Status.CONTENTS_CHANGED)
            status = _Status(Status.CONTENTS_CHANGED, None, fingerprint.since_text(old))
            findings.append(self._finding(slot, status, when))
        return findings

    @contextlib.contextmanager
    def replaying(self, graph: str) -> Iterator[None]:
        """Around a graph's first replay (graphs.Captured brackets it): every fingerprinted
        storage whose bytes the replay changed is graph-written from then on (a write no
        captured op's schema declared). Every graph's storages: one graph may write what
        another reads. Two fingerprints, one sync each; the first replay only."""
        slots = [s for s in self._every_slot() if s.contents is not None and fingerprint.checkable(s, None)]
        if not slots:  # mode off records nothing
            yield
            return
        with self._scratch():
            before = fingerprint.measure(slots)
        yield
        with self._scratch():
            for slot in fingerprint.changed_since(slots, before):
                slot.written = True

    @contextlib.contextmanager
    def program_writes(self) -> Iterator[None]:
        """Writes made inside the block are the program's, also those no version counter
        counts (``param.data.copy_(...)``): the captured storages they wrote get a new
        reference fingerprint at the next deep check instead of a finding. Costs one dispatch
        per op inside the block (ops are seen, not their memory: numpy or a raw kernel is not)."""
        if self.mode is GuardMode.OFF:
            yield
            return
        keys: set[int] = set()
        with self._observer(lambda func, args, kwargs, out: keys.update(fingerprint.written_keys(func, args, kwargs))):
            yield
        for key in keys:
            slot = self._slots.get(key)
            if slot is not None:
                fingerprint.forget(slot)

    # -- recording --------------------------------------------------------------------------

    def _observe(self, rec: _Recording, func, args, kwargs, out) -> None:
        # Runs after every op of the capture (a decoder step is ~1,500 of them): a storage
        # already seen costs one storage lookup and two set/dict lookups.
        if func in _FRESH_OPS:
            note_produced(rec, op_tensors(args, kwargs), set(), self._slots)
            return
        input_keys = set()
        produced, slots, label = rec.produced, self._slots, rec.label
        for t in op_tensors(args, kwargs):
            try:
                storage = t.untyped_storage()
            except (RuntimeError, NotImplementedError, TypeError):
                continue
            key = storage._cdata
            input_keys.add(key)
            if key in produced:
                continue
            slot = slots.get(key)
            if slot is not None and slot.storage_ptr != storage.data_ptr():
                slot = self._placed(key, storage.data_ptr())  # it moved since: a new placement
            if slot is None:
                if storage.data_ptr() == 0 or not graph_visible(t, rec.capturing):
                    continue
                slot = self._new_slot(rec, func, t, storage)
                slot.handle = fingerprint.handle_of(t)
                slots[key] = slot
                self._by_graph[label].append(slot)
                listen_for_drop(slot, storage, self._plumbing, self.drops)
            elif slot.graphs[-1] != label or t.nbytes > slot.nbytes:
                if widen_slot(slot, t, label):
                    self._by_graph[label].append(slot)
        note_produced(rec, out_tensors(out), input_keys, slots)
        if fingerprint.written_args(func):
            fingerprint.mark_written(func, args, kwargs, slots)

    def _new_slot(self, rec: _Recording, func, t: torch.Tensor, storage: torch.UntypedStorage) -> Slot:
        key = storage._cdata
        if rec.pool is not None and rec.pool_of is not None and rec.pool_of(storage.data_ptr()) == rec.pool:
            return self._pool_slot(rec, func, t, storage)
        named = self._named(rec, key, storage.data_ptr())
        frame = user_frame(sys._getframe(1), self._plumbing)
        birth = self._births.get(key)
        created_at = format_birth(birth) if birth is not None else None
        slot = new_slot(t, storage, key, rec.label, f"{frame_site(frame)} ({func})", created_at=created_at, named=named)
        if named is not None:
            slot.name = exposed_name(named, t)
        else:
            slot.name = local_slot_name(key, frame, birth, func, self._plumbing)
        return slot

    def _pool_slot(self, rec: _Recording, func, t: torch.Tensor, storage: torch.UntypedStorage) -> Slot:
        """A storage in the capturing graph's own pool (an earlier piece's output, say)."""
        site = frame_site(user_frame(sys._getframe(2), self._plumbing))
        slot = new_slot(t, storage, storage._cdata, rec.label, f"{site} ({func})", pool=rec.pool)
        slot.name = f"<storage of graph pool {rec.pool}, read by {getattr(func, 'overloadpacket', func)} at {site}>"
        slot.managed_in.add(rec.label)
        return slot

    def _named(self, rec: _Recording, key: int, storage_ptr: int) -> Named | None:
        """The owner path of a storage. The index of every owner's tensors is built once and
        kept while the owners stay the same; a storage it does not know rebuilds it once per
        recording (an owner may have gained a tensor since), and so does one it knows at
        another address (the storage moved: resize_() in place)."""
        if rec.index is None:
            if self._index is None:
                self._index, rec.index_fresh = self._build_index(), True
            rec.index = self._index
        named = rec.index.get(key)
        known = named is not None and named.storage_ptr == storage_ptr
        if not known and not rec.index_fresh and (key, storage_ptr) not in self._unnamed:
            self._index = rec.index = self._build_index()
            rec.index_fresh = True
            named = rec.index.get(key)
        if named is not None and named.storage_ptr != storage_ptr:
            named = None  # a key that another storage had, or an address the storage left
        if named is None and rec.index_fresh:
            self._unnamed.add((key, storage_ptr))
        return named

    def _build_index(self) -> dict[int, Named]:
        self.index_builds += 1
        return build_index(self._owners)

    def _note_births(self, func, args, kwargs, out) -> None:
        input_keys = {s._cdata for s in map(storage_of, op_tensors(args, kwargs)) if s is not None}
        frame = None
        for t in out_tensors(out):
            storage = storage_of(t)
            if storage is None or storage._cdata in input_keys or storage._cdata in self._births:
                continue
            if frame is None:
                frame = user_frame(sys._getframe(1), self._plumbing)
            code = frame.f_code if frame is not None else None
            self._births[storage._cdata] = _Birth(
                ref=StorageWeakRef(storage),
                op=func,
                filename=code.co_filename if code else "<unknown>",
                lineno=frame.f_lineno if frame else 0,
                func=code.co_name if code else "?",
            )
            self._births_since_prune += 1
        if self._births_since_prune >= _PRUNE_EVERY:
            self._prune_births()

    def _prune_births(self) -> None:
        # Dropping the weak ref of a dead storage lets its identity be reused: drop the entry too.
        self._births = {k: b for k, b in self._births.items() if not b.ref.expired()}
        self._births_since_prune = 0

    # -- checking ---------------------------------------------------------------------------

    def _all_alive(self, graph: str | None) -> bool:
        """The per-replay fast path: one C call per storage, no allocation, no name lookups."""
        refs = self._live_refs.get(graph)
        if refs is None:
            slots = self._every_slot() if graph is None else self._by_graph.get(graph, ())
            refs = self._live_refs[graph] = tuple(
                s.ref for s in slots if Status.FREED not in s.reported and s.checked_in(graph)
            )
        for ref in refs:
            if ref is None or ref.expired():
                return False
        return True

    def _liveness(self, slot: Slot) -> _Status:
        if slot.ref is None or slot.ref.expired():
            return _Status(Status.FREED, current_ptr(slot))
        return _UNCHANGED

    def _classify(self, slot: Slot) -> _Status:
        if slot.ref is None or slot.ref.expired():
            return _Status(Status.FREED, current_ptr(slot))
        current = resolve(slot.named) if slot.named is not None else None
        held = isinstance(current, torch.Tensor) and storage_key(current) == slot.key
        # While the owner still holds it, its tensor gives the storage; otherwise revive the weak ref.
        storage = current.untyped_storage() if held else torch.UntypedStorage._new_with_weak_ptr(slot.ref.cdata)
        if storage is None:
            return _Status(Status.FREED, current_ptr(slot))
        ptr = storage.data_ptr()
        del storage
        if ptr != slot.storage_ptr:
            return _Status(Status.MOVED, ptr + (slot.data_ptr - slot.storage_ptr))
        if held or slot.named is None:
            return _UNCHANGED
        if not isinstance(current, torch.Tensor):
            return _Status(Status.REBOUND, None, "dropped")
        return _Status(Status.REBOUND, current.data_ptr() + view_offset(slot), "rebound")

    def _finding(self, slot: Slot, status: _Status, when: str) -> Finding:
        return Finding(
            slot=slot.name,
            graph=graph_label(slot),
            status=status.status,
            when=when,
            rank=self.rank,
            shape=list(slot.shape),
            dtype=slot.dtype,
            nbytes=slot.nbytes,
            old_ptr=slot.data_ptr,
            new_ptr=status.new_ptr,
            created_at=slot.created_at,
            freed_at=slot.freed_at if status.status is Status.FREED else None,
            message=finding_message(slot, status),
        )


# -- helpers: torch capability ------------------------------------------------------------------


def warm_up() -> None:
    """Make the recording mode's first dispatch now, on one op of no consequence.

    torch wraps a dispatch mode's __torch_dispatch__ so that its first call imports
    torch._dynamo (torch 2.13 and 2.14 do). That import would otherwise run at the first op of
    the first capture, inside the caller's frames: whoever wants it to run elsewhere (the watch
    hooks, on a thread of their own) calls this first. Records nothing.
    """
    probe = torch.zeros(1)
    with _HiddenOpObserver(lambda *args: None):
        probe.add_(0)


def cuda_capturing() -> bool:
    # An uninitialised CUDA context cannot be capturing; asking would initialise it. Initialised
    # implies available: is_available() would ask the driver for its device count (~26 us on an
    # H200 host, once per capture).
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


# -- helpers: tensors and storages --------------------------------------------------------------


def op_tensors(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """Tensor args of an op: plain, in lists (cat, foreach, index) and in kwargs (out=)."""
    found = []
    for group in (args, kwargs.values()):
        for a in group:
            if isinstance(a, torch.Tensor):
                found.append(a)
            elif isinstance(a, (list, tuple)):
                found.extend(b for b in a if isinstance(b, torch.Tensor))
    return found


def out_tensors(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (list, tuple)):
        return [o for o in out if isinstance(o, torch.Tensor)]
    return []


def graph_visible(t: torch.Tensor, capturing: bool) -> bool:
    """During a real capture only device memory and pinned host memory end up in the graph."""
    if not capturing or t.is_cuda:
        return True
    try:
        return t.device.type == "cpu" and t.is_pinned()
    except RuntimeError:
        return False


def version_of(t: torch.Tensor) -> int | None:
    try:
        return t._version
    except RuntimeError:  # inference tensors carry no version counter
        return None


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def new_slot(
    t: torch.Tensor, storage: torch.UntypedStorage, key: int, graph: str, captured_at: str, **more: Any
) -> Slot:
    """A slot for `storage`, first seen through the view `t` by `graph`; named by the caller."""
    return Slot(
        name="",
        graphs=[graph],
        shape=list(t.shape),
        dtype=dtype_name(t.dtype),
        nbytes=t.nbytes,
        data_ptr=t.data_ptr(),
        storage_ptr=storage.data_ptr(),
        storage_nbytes=storage.nbytes(),
        device=str(t.device),
        version=version_of(t),
        captured_at=captured_at,
        ref=StorageWeakRef(storage),
        key=key,
        **more,
    )


def widen_slot(slot: Slot, t: torch.Tensor, label: str) -> bool:
    """Same storage seen again: keep the largest view, note another graph that uses it.
    True when the graph is new to the slot (graphs are recorded one at a time, so a graph
    already noted is the last one)."""
    added = label not in slot.graphs[-1:]
    if added:
        slot.graphs.append(label)
    if t.nbytes > slot.nbytes:
        slot.shape, slot.dtype, slot.nbytes = list(t.shape), dtype_name(t.dtype), t.nbytes
        slot.data_ptr = t.data_ptr()
        if slot.named is not None:
            slot.name = exposed_name(slot.named, t)
    return added


def note_produced(rec: _Recording, tensors: list[torch.Tensor], input_keys: set[int], slots: dict[int, Slot]) -> None:
    """A fresh storage made by an op inside the block comes from the capture (graph pool): safe,
    not a slot. Views of inputs share the input's storage and are skipped here."""
    for t in tensors:
        storage = storage_of(t)
        if storage is None:
            continue
        key = storage._cdata
        if key not in input_keys and key not in slots:
            rec.produced.add(key)


def listen_for_drop(
    slot: Slot, storage: torch.UntypedStorage, plumbing: frozenset[str], drops: DropCount | None = None
) -> None:
    """Note where the storage's last reference goes: that line freed it.

    torch keeps one Python object per live storage (PyObject preservation), and it dies with
    the storage itself, whichever reference was last: a tensor, a view, or the C++ side of
    `param.data = new`. A weakref callback fires inside that deallocation, so the stack is the
    dropping site. The ref lives on the slot (not in weakref.finalize's process-wide registry):
    it dies with the guard. drops: counted up at each death.
    """
    try:
        slot.drop_ref = weakref.ref(storage, make_drop_callback(slot, plumbing, drops))
    except TypeError:
        slot.drop_ref = None


def make_drop_callback(
    slot: Slot, plumbing: frozenset[str], drops: DropCount | None = None
) -> Callable[[weakref.ref], None]:
    def on_drop(ref: weakref.ref) -> None:
        # Runs inside a deallocation, maybe at interpreter exit: never raise.
        if drops is not None:
            try:
                drops.count()
            except Exception:
                pass
        try:
            slot.freed_at = sites.drop_site(sys._getframe(1), plumbing)
        except Exception:
            pass

    return on_drop


def current_ptr(slot: Slot) -> int | None:
    """Where the owner's name points now, for a freed slot (None if it names nothing)."""
    if slot.named is None:
        return None
    current = resolve(slot.named)
    return current.data_ptr() + view_offset(slot) if isinstance(current, torch.Tensor) else None


def view_offset(slot: Slot) -> int:
    return slot.data_ptr - slot.named.data_ptr if slot.named is not None else 0


# -- helpers: storage extents (adopt) ------------------------------------------------------------


class Extents:
    """Storages by address range: which one holds an address (storages never overlap)."""

    def __init__(self, items: list[tuple[int, int, int, Any]]):
        self.items = sorted(items, key=lambda item: item[0])  # (start, end, key, value)
        self.starts = [item[0] for item in self.items]

    @classmethod
    def of(cls, extents: Iterable[tuple[int, int, int, Any]]) -> Extents:
        """From (start, nbytes, key, value); empty storages hold nothing."""
        return cls([(start, start + size, key, value) for start, size, key, value in extents if start and size])

    def find(self, addr: int) -> tuple[int, Any] | None:
        i = bisect.bisect_right(self.starts, addr) - 1
        if i >= 0 and addr < self.items[i][1]:
            return self.items[i][2], self.items[i][3]
        return None


class LazyExtents:
    """Extents made on the first find()."""

    def __init__(self, make: Callable[[], Extents]):
        self.make, self.made = make, None

    def find(self, addr: int) -> tuple[int, Any] | None:
        if self.made is None:
            self.made = self.make()
        return self.made.find(addr)


def held_by_locals(frame: FrameType | None, plumbing: frozenset[str]) -> Extents:
    """Storages of the tensors bound to locals of the user frames from `frame` outwards, each
    with (tensor, (variable, function)) of the outermost frame holding it (as holder_of)."""
    found: dict[int, tuple[int, int, int, Any]] = {}
    for _ in range(sites.LOCAL_SCAN_FRAMES):
        frame = user_frame(frame, plumbing)
        if frame is None:
            break
        for var, value in sites.frame_locals(frame):
            if isinstance(value, torch.Tensor):
                storage = storage_of(value)
                if storage is not None:
                    found[storage._cdata] = (
                        storage.data_ptr(),
                        storage.nbytes(),
                        storage._cdata,
                        (value, (var, frame.f_code.co_name)),
                    )
        frame = frame.f_back
    return Extents.of(found.values())


# -- helpers: names of locals -------------------------------------------------------------------


def format_birth(birth: _Birth) -> str:
    return f"{os.path.basename(birth.filename)}:{birth.lineno} in {birth.func} ({birth.op})"


def local_slot_name(key: int, frame: FrameType | None, birth: _Birth | None, func, plumbing: frozenset[str]) -> str:
    holder = holder_of(key, frame, plumbing)
    held = f"{holder[0]} of {holder[1]}" if holder else ""
    if birth is not None:
        made = (
            f"created by {birth.op.overloadpacket if hasattr(birth.op, 'overloadpacket') else birth.op}"
            f" at {os.path.basename(birth.filename)}:{birth.lineno} in {birth.func}"
        )
        return f"<local {held + ', ' if held else ''}{made}>"
    if holder:
        return f"<local {held}>"
    op = func.overloadpacket if hasattr(func, "overloadpacket") else func
    return f"<unwatched tensor read by {op} at {frame_site(frame)}>"


# -- helpers: messages --------------------------------------------------------------------------


def graph_label(slot: Slot) -> str:
    extra = len(slot.graphs) - 1
    return slot.graph + (f" (+{extra} more)" if extra > 0 else "")


def finding_message(slot: Slot, status: _Status) -> str:
    graphs = f"graph '{slot.graph}'"
    if len(slot.graphs) > 1:
        graphs += f" (and {len(slot.graphs) - 1} more graphs)"
    shape = ", ".join(str(d) for d in slot.shape)
    what = f"captured tensor {slot.name} ({slot.dtype}[{shape}], {format_bytes(slot.nbytes)}"
    if slot.created_at and "created by" not in slot.name:
        what += f", created at {slot.created_at}"
    if slot.pool is not None:
        what += f", in graph pool {slot.pool}: not this graph's own, a cross-pool dependency"
    head = f"{graphs} {what}) at {slot.data_ptr:#x}"
    owner = slot.named.name if slot.named is not None else ""
    if status.status is Status.FREED:
        dropped = f" (last reference dropped at {slot.freed_at})" if slot.freed_at else ""
        now = (
            f"; {owner} now names a different tensor at {status.new_ptr:#x}"
            if owner and status.new_ptr is not None
            else ""
        )
        return f"{head}, and that storage has been freed{dropped}{now}. {FIX_FREED}"
    if status.status is Status.MOVED:
        return f"{head}, but that storage now lives at {status.new_ptr:#x} (it was resized or re-pointed). {FIX_MOVED}"
    if status.status is Status.CONTENTS_CHANGED:
        return (
            f"{head}, and its bytes changed {status.detail} while no torch write reached it: the "
            f"storage is alive at the same address, so no pointer check can see this. {FIX_CONTENTS}"
        )
    if status.detail == "dropped":
        return (
            f"{head}, but {owner} no longer holds a tensor; the old storage is still alive "
            f"only through another reference. {FIX_REBOUND}"
        )
    return (
        f"{head}, but {owner} now names a different tensor at {status.new_ptr:#x}; the old "
        f"storage is still alive, so a replay silently uses the old values. {FIX_REBOUND}"
    )
