"""The reload-stability check: a pointer-identity census of every tensor slot, before and after.

A CUDA graph captured before a weight reload keeps reading the storages it captured. A reload is
safe for it only if every tensor the graph may read is still the same storage, at the same
address, with the same view. Outputs cannot show this (an identity reload, same weights again,
passes by construction), and liveness cannot either: a kernel rebuilt on reload may leave its
old workspace alive through some other reference (0 of 88 storages freed, all rebound). Only
pointer identity sees it (vLLM RFC #48312).

    import repro
    with repro.expect_stable(layer, name="moe"):
        reload_weights(layer, new_checkpoint)
    # repro.diagnose.stability.ReloadUnstable: 4 tensor slots changed across the reload:
    #   moe.quant_method.moe_kernel.workspace13  freed: a new storage ...

The census walks everything reachable from the root (owners.walk_tensors: attributes,
parameters and buffers, containers, dataclasses, partials, closure cells, bound methods,
__dict__/__slots__, wrapper subclasses' inner tensors), holding each storage by weak reference only, so it never keeps an old
storage alive and "freed" means freed. Runs on CPU whenever the reload code does.
"""

from __future__ import annotations

import contextlib
import fnmatch
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from repro.diagnose.owners import storage_of, walk_tensors
from repro.units import format_bytes

MAX_DEPTH = 12  # model.layers[3].mlp.experts.quant_method.moe_kernel.launch.<cell ws>
MAX_NODES = 500_000  # objects expanded per census
MAX_ITEMS = 100_000  # per list / dict: a census must see every layer
VIEW_FIELDS = ("data_ptr", "shape", "stride", "dtype", "storage_offset")


class Change(StrEnum):
    """What became of one tensor slot across the block, in the order changes_headline counts them.
    freed, rebound and moved mean what they mean for a finding (repro.outcome.Status)."""

    FREED = "freed"  # the old storage is dead
    REBOUND = "rebound"  # the path holds a new storage; the old one is still alive
    DROPPED = "dropped"  # the path holds no tensor now; the old storage is still alive
    MOVED = "moved"  # the same storage at a new address (resized or re-pointed)
    RESHAPED = "reshaped"  # the same storage through a different view
    ADDED = "added"  # a tensor where there was none, in a storage not seen before


class ReloadUnstable(AssertionError):
    """Tensor slots changed across a block that should have kept them; `changes` lists them."""

    def __init__(self, message: str, changes: list[SlotChange]):
        super().__init__(message)
        self.changes = changes


@dataclass(frozen=True)
class SlotState:
    """One tensor at one path, as the census saw it. The storage is held weakly."""

    path: str
    data_ptr: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: str
    storage_offset: int
    device: str
    nbytes: int
    storage_ptr: int | None  # None: no real memory (meta, sparse)
    storage_key: int | None  # StorageImpl identity; unique while the storage lives
    ref: StorageWeakRef | None = field(default=None, repr=False, compare=False)

    def alive(self) -> bool:
        return self.ref is not None and not self.ref.expired()

    def view(self) -> dict[str, Any]:
        return {f: getattr(self, f) for f in VIEW_FIELDS}


@dataclass
class ReloadCensus:
    root: str
    slots: dict[str, SlotState]
    nodes: int
    truncated: str = ""

    def by_storage(self) -> dict[int, list[str]]:
        out: dict[int, list[str]] = {}
        for s in self.slots.values():
            if s.storage_key is not None:
                out.setdefault(s.storage_key, []).append(s.path)
        return out


@dataclass
class SlotChange:
    path: str
    status: Change
    changed: list[str]  # storage, data_ptr, shape, stride, dtype, storage_offset
    before: SlotState | None
    after: SlotState | None
    also_at: list[str] = field(default_factory=list)  # where the old storage is reachable now

    @property
    def message(self) -> str:
        return change_message(self)


def reload_census(
    root: Any, name: str = "root", max_depth: int = MAX_DEPTH, max_nodes: int = MAX_NODES
) -> ReloadCensus:
    """Every tensor slot reachable from `root`, by path (``name.quant_method.moe_kernel.w``)."""
    walk = walk_tensors(root, name, max_depth, max_nodes, MAX_ITEMS)
    slots: dict[str, SlotState] = {}
    for path, tensor in walk.found:
        slots.setdefault(path, slot_state(path, tensor))
    return ReloadCensus(root=name, slots=slots, nodes=walk.nodes, truncated=walk.truncated)


def slot_state(path: str, t: torch.Tensor) -> SlotState:
    storage = storage_of(t)
    return SlotState(
        path=path,
        data_ptr=t.data_ptr() if storage is not None else 0,
        shape=tuple(t.shape),
        stride=tuple(t.stride()) if t.layout == torch.strided else (),
        dtype=str(t.dtype).removeprefix("torch."),
        storage_offset=t.storage_offset() if storage is not None else 0,
        device=str(t.device),
        nbytes=t.numel() * t.element_size(),
        storage_ptr=storage.data_ptr() if storage is not None else None,
        storage_key=storage._cdata if storage is not None else None,
        ref=StorageWeakRef(storage) if storage is not None else None,
    )


def compare(before: ReloadCensus, after: ReloadCensus) -> list[SlotChange]:
    """Every slot that is not the same storage, at the same address, with the same view."""
    changes = []
    now_at = after.by_storage()
    for path, old in before.slots.items():
        new = after.slots.get(path)
        change = classify(old, new)
        if change is not None:
            if change.status in (Change.REBOUND, Change.DROPPED) and old.storage_key is not None:
                change.also_at = [p for p in now_at.get(old.storage_key, []) if p != path]
            changes.append(change)
    known = before.by_storage()
    for path, new in after.slots.items():
        # A storage the census already saw at another path is no new memory: the walk only
        # reached it another way (its first path now holds something else).
        if path not in before.slots and new.storage_key not in known:
            changes.append(SlotChange(path, Change.ADDED, ["storage"], None, new))
    return changes


def classify(old: SlotState, new: SlotState | None) -> SlotChange | None:
    if old.storage_key is not None and not old.alive():
        return SlotChange(old.path, Change.FREED, ["storage"], old, new)
    if new is None:
        return SlotChange(old.path, Change.DROPPED, ["storage"], old, None)
    if new.storage_key != old.storage_key:
        return SlotChange(old.path, Change.REBOUND, ["storage"], old, new)
    if new.storage_ptr != old.storage_ptr:
        return SlotChange(old.path, Change.MOVED, ["storage_ptr"] + view_changes(old, new), old, new)
    changed = view_changes(old, new)
    return SlotChange(old.path, Change.RESHAPED, changed, old, new) if changed else None


def view_changes(old: SlotState, new: SlotState) -> list[str]:
    before, after = old.view(), new.view()
    return [f for f in VIEW_FIELDS if before[f] != after[f]]


def describe(s: SlotState) -> str:
    shape = ", ".join(str(d) for d in s.shape)
    return f"{s.dtype}[{shape}] {format_bytes(s.nbytes)} at {s.data_ptr:#x}"


def change_message(c: SlotChange) -> str:
    old, new = c.before, c.after
    if c.status == Change.ADDED:
        return f"{c.path}  added: {describe(new)} (no tensor here before the reload)"
    head = f"{c.path}  {c.status}: was {describe(old)}"
    if c.status == Change.FREED:
        now = f", now {describe(new)} in a new storage" if new is not None else ", and the path holds no tensor now"
        return f"{head}{now}; the old storage has been freed (a graph captured before reads freed memory)"
    where = (
        f" (still reachable at {', '.join(c.also_at[:3])})" if c.also_at else " (held outside what the census walks)"
    )
    if c.status == Change.REBOUND:
        return (
            f"{head}, now {describe(new)} in a new storage; the old storage is still alive"
            f"{where}, so a graph captured before silently keeps using the old values"
        )
    if c.status == Change.DROPPED:
        return f"{head}; the path holds no tensor now and the old storage is still alive{where}"
    if c.status == Change.MOVED:
        return (
            f"{head}, now {describe(new)}: the same storage now lives at {new.storage_ptr:#x} (resized or re-pointed)"
        )
    fields = ", ".join(f"{f} {old.view()[f]} -> {new.view()[f]}" for f in c.changed)
    return f"{head}: the same storage seen through a different view ({fields})"


def changes_headline(changes: list[SlotChange], census: ReloadCensus) -> str:
    """'3 of 120 tensor slots under model changed across the reload (2 moved, 1 freed)'"""
    counts = {s: sum(1 for c in changes if c.status == s) for s in Change}
    parts = ", ".join(f"{n} {s}" for s, n in counts.items() if n)
    return f"{len(changes)} of {len(census.slots)} tensor slots under {census.root} changed across the reload ({parts})"


def filtered(changes: list[SlotChange], ignore: Iterable[str]) -> list[SlotChange]:
    """Changes whose path matches none of the glob patterns in `ignore`."""
    patterns = list(ignore)
    return [c for c in changes if not any(fnmatch.fnmatchcase(c.path, p) for p in patterns)]


@dataclass
class Stability:
    """What `expect_stable` saw; `changes` is filled when the block ends."""

    before: ReloadCensus
    after: ReloadCensus | None = None
    changes: list[SlotChange] = field(default_factory=list)
    ignored: int = 0

    def report(self) -> str:
        census = self.after or self.before
        lines = [changes_headline(self.changes, census) + ":"] + [f"  {c.message}" for c in self.changes]
        if census.truncated:
            lines.append(f"  (census incomplete: {census.truncated})")
        return "\n".join(lines)


@contextlib.contextmanager
def expect_stable(
    root: Any, name: str = "model", ignore: Iterable[str] = (), raises: bool = True, max_depth: int = MAX_DEPTH
) -> Iterator[Stability]:
    """Census before, census after the block; raise ReloadUnstable naming every changed slot.

    ignore: glob patterns of paths allowed to change (a cache the graphs never read).
    raises=False: only fill the yielded Stability's `changes`.
    """
    stability = Stability(before=reload_census(root, name, max_depth))
    yield stability
    stability.after = reload_census(root, name, max_depth)
    every = compare(stability.before, stability.after)
    stability.changes = filtered(every, ignore)
    stability.ignored = len(every) - len(stability.changes)
    if stability.changes and raises:
        raise ReloadUnstable(stability.report(), stability.changes)
