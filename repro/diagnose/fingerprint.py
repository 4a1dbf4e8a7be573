"""Contents lost at the same address: fingerprints of the read-only inputs a capture baked in.

Every other check of the guard asks whether a captured storage is still there: freed, moved,
rebound. Some losses keep the storage alive at the same address and change only its bytes, and
no pointer check can see those (the guard, the census, torch's ``check_input_liveness``). vLLM
#53508: persistent attention metadata allocated inside the KV-cache pool's scope lost its
contents in a level-1 sleep (the pool's physical memory is discarded, its virtual addresses
kept) while every tensor kept its address; SGLang #33124 is the same shape. The graph replays
fine and computes with zeros.

What this module does, at three points the guard already has (never per replay):

  capture end   fingerprint each storage the capture read and did not write, that lies
                outside every graph pool: the bytes the graph read (its largest view), with
                the storage's version counter(s) as seen then.
  first replay  (graphs.Captured brackets it) fingerprint the same storages before and after:
                what the replay itself changed is graph-written, never checked again.
  deep check    fingerprint again and compare. Changed bytes with a version counter that moved
                is a program write (torch's in-place ops and copy_ bump it): the new bytes
                become the reference. Changed bytes with no counter moved is the finding
                ``contents-changed``; a storage whose counter cannot be read (no live tensor of
                it is known, or an inference tensor) is never reported.

Which inputs are read-only: the recording sees every op at the dispatcher, and an op's schema
says which of its arguments it writes (``Tensor(a!)``: in-place ops, ``out=``); a storage any
captured op wrote is graph-written (a KV cache, an output buffer, a workspace) for every graph,
since one graph's replay writes what another reads. The first-replay diff is the net for writes
no schema declares (a custom op without the annotation, a raw kernel inside the capture); its
limit: a write that leaves the bytes it samples unchanged at that replay and changes them at a
later one (a KV slot first written at step 5) still reads as a loss later. Pool memory (a
storage in a graph pool, as ``CaptureGuard.assign_pools`` says) is never fingerprinted: other
graphs of the pool write it at their replays.

The fingerprint, on the storage's own device, one sync per device per check point: the region
is read as int64 words (int32 or bytes where its alignment says so); up to FULL_BYTES it is
summed whole, above it a fixed, evenly spaced sample of SAMPLES words is summed (the same
positions every time). Two int64 sums: all words and the even-indexed ones. A loss that
changes fewer than region/SAMPLES contiguous bytes of a large tensor can fall between samples
and go unseen.

What the version counter does not count, and so reads as a loss when the bytes change: writes
through ``param.data`` (a new TensorImpl with a counter of its own), numpy views of CPU
tensors, raw kernels (Triton, a C++ extension) or memsets given a data_ptr, and every write to
an inference tensor (no counter: never reported). ``CaptureGuard.program_writes()`` records, at
the dispatcher, the storages ops write inside its block (``.data`` writes included); those get a
new reference instead of a finding; its cost is one dispatch per op inside the block.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from repro.outcome import Status
from repro.diagnose.sites import storage_key

if TYPE_CHECKING:  # the guard imports this module
    from collections.abc import Callable

    from repro.diagnose.guard import Slot
    from repro.diagnose.owners import Named

    Resolve = Callable[[Named], Any]  # an owner path -> what it names now (repro.diagnose.owners.resolve)

FULL_BYTES = 1 << 20  # a region up to 1 MiB is summed whole
SAMPLES = 4096  # words summed of a larger one (16 KiB), evenly spaced
_DEAD = frozenset((Status.FREED, Status.MOVED, Status.REBOUND, Status.CONTENTS_CHANGED))  # said already: not checked


@dataclass(frozen=True)
class Print:
    """The bytes a graph reads of one storage, as of `when`."""

    offset: int  # bytes from the storage's start
    nbytes: int
    digest: tuple[int, int] | None  # (sum of words, sum of even words); None: take anew
    versions: tuple[int | None, int | None]  # of the captured tensor, of the owner's tensor
    when: str  # "the end of capture 'moe forward'", a check's `when`


# -- recording: which storages a capture writes ---------------------------------------------------


def handle_of(t: torch.Tensor) -> weakref.ref | None:
    """A weak reference to the tensor whose version counter counts writes to `t`: its base for
    a view (views share their base's counter, and the view the capture saw is often a
    temporary), else `t`. Weak: a fingerprint must not extend a lifetime."""
    base = t._base if t._base is not None else t
    try:
        return weakref.ref(base)
    except TypeError:
        return None


@functools.lru_cache(maxsize=None)
def written_args(func: Any) -> tuple[tuple[int, str], ...]:
    """(position, name) of the arguments an op's schema marks as written (``Tensor(a!)``)."""
    schema = getattr(func, "_schema", None)
    if schema is None:  # a higher-order op: its body's ops are seen one by one
        return ()
    return tuple(
        (i, a.name) for i, a in enumerate(schema.arguments) if a.alias_info is not None and a.alias_info.is_write
    )


def written_keys(func: Any, args: tuple, kwargs: dict) -> list[int]:
    """Storage keys of the tensors the op writes."""
    keys = []
    for i, name in written_args(func):
        value = args[i] if i < len(args) else kwargs.get(name)
        for t in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(t, torch.Tensor):
                key = storage_key(t)
                if key is not None:
                    keys.append(key)
    return keys


def mark_written(func: Any, args: tuple, kwargs: dict, slots: dict[int, Slot]) -> None:
    """A captured op wrote these slots: graph-written, never fingerprinted."""
    for key in written_keys(func, args, kwargs):
        slot = slots.get(key)
        if slot is not None:
            slot.written = True


# -- what is checked --------------------------------------------------------------------------


def checkable(slot: Slot, graph: str | None) -> bool:
    """A live storage from outside every graph pool that no captured op writes, not said dead."""
    return (
        not slot.written
        and slot.pool is None
        and slot.checked_in(graph)
        and slot.ref is not None
        and not slot.ref.expired()
        and not (slot.reported & _DEAD)
    )


def version_if_same(t: Any, key: int) -> int | None:
    if not isinstance(t, torch.Tensor) or storage_key(t) != key:
        return None
    try:
        return t._version
    except RuntimeError:  # an inference tensor has no version counter
        return None


def versions(slot: Slot, resolve: Resolve) -> tuple[int | None, int | None]:
    """Version counters of the tensor the capture saw and of the owner's tensor, where either
    still holds the storage (resolve: the owner path -> its tensor now)."""
    held = slot.handle() if slot.handle is not None else None
    owner = resolve(slot.named) if slot.named is not None else None
    return version_if_same(held, slot.key), version_if_same(owner, slot.key)


def wrote(old: tuple, new: tuple) -> bool:
    return any(a is not None and b is not None and a != b for a, b in zip(old, new))


def countable(old: tuple, new: tuple) -> bool:
    """Some counter was readable both times: a change without a write can be told."""
    return any(a is not None and b is not None for a, b in zip(old, new))


# -- the fingerprint ---------------------------------------------------------------------------


def revive(slot: Slot) -> torch.UntypedStorage | None:
    """The slot's storage if it lives where it was captured, else None (freed or moved: the
    liveness check's business)."""
    storage = torch.UntypedStorage._new_with_weak_ptr(slot.ref.cdata)
    if storage is None or storage.data_ptr() != slot.storage_ptr:
        return None
    return storage


def region_of(slot: Slot, storage: torch.UntypedStorage) -> tuple[int, int]:
    """(offset, nbytes) of the bytes the graph reads: its largest view, clamped to the storage
    (an expanded view's nbytes exceeds its storage)."""
    offset = slot.data_ptr - slot.storage_ptr
    return offset, max(0, min(slot.nbytes, storage.nbytes() - offset))


def words_of(storage: torch.UntypedStorage, offset: int, nbytes: int) -> torch.Tensor:
    """[n] view of the region as the widest words its alignment allows (int64, int32, uint8);
    no copy."""
    raw = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (storage.nbytes(),), (1,))
    region = raw[offset : offset + nbytes]
    for dtype in (torch.int64, torch.int32):
        size = dtype.itemsize
        if offset % size == 0 and nbytes % size == 0:
            return region.view(dtype)
    return region


def digest_of(words: torch.Tensor) -> torch.Tensor:
    """[2] int64 on the words' device: the sums of all words and of the even ones. Above
    FULL_BYTES, of a fixed strided sample (a view: nothing is copied). int64 words are summed
    as they are (torch's CPU sum casting int32 to int64 runs ~10x slower than a native one);
    a sum that wraps is still the same sum for the same bytes, in any order."""
    n = words.numel()
    if n * words.element_size() > FULL_BYTES:
        words = words[:: -(-n // SAMPLES)]
    return torch.stack([words.sum(dtype=torch.int64), words[::2].sum(dtype=torch.int64)])


def measure(slots: list[Slot]) -> list[tuple[int, int, tuple[int, int]] | None]:
    """(offset, nbytes, digest) per slot (None: freed or moved). The digests of one device are
    stacked and read back at once: one sync per device."""
    found: list[tuple[int, int, Any] | None] = []
    for slot in slots:
        storage = revive(slot)
        if storage is None:
            found.append(None)
            continue
        offset, nbytes = region_of(slot, storage)
        found.append((offset, nbytes, digest_of(words_of(storage, offset, nbytes))))
    by_device: dict[Any, list[int]] = {}
    for i, f in enumerate(found):
        if f is not None:
            by_device.setdefault(f[2].device, []).append(i)
    out: list[tuple[int, int, tuple[int, int]] | None] = [None] * len(found)
    for indices in by_device.values():
        values = torch.stack([found[i][2] for i in indices]).tolist()  # [n, 2]: the sync
        for i, (total, even) in zip(indices, values):
            out[i] = (found[i][0], found[i][1], (total, even))
    return out


def take(slots: list[Slot], when: str, resolve: Resolve) -> None:
    """Reference fingerprints for slots without one (or whose graph now reads a wider view)."""
    todo = [
        s
        for s in slots
        if s.contents is None or s.contents.nbytes != s.nbytes or s.contents.offset != s.data_ptr - s.storage_ptr
    ]
    for slot, m in zip(todo, measure(todo)):
        if m is not None:
            slot.contents = Print(m[0], m[1], m[2], versions(slot, resolve), when)


def compare(slots: list[Slot], when: str, resolve: Resolve) -> list[tuple[Slot, Print]]:
    """(slot, its reference) for each slot whose bytes changed while no counter moved. Every
    compared slot's reference becomes what it holds now: the next check judges what happens
    after this one."""
    slots = [s for s in slots if s.contents is not None]
    changed = []
    for slot, m in zip(slots, measure(slots)):
        if m is None:
            continue
        old, now = slot.contents, versions(slot, resolve)
        slot.contents = Print(m[0], m[1], m[2], now, when)
        if old.digest is None or (old.offset, old.nbytes) != (m[0], m[1]) or old.digest == m[2]:
            continue  # a new reference, a wider view, or unchanged
        if countable(old.versions, now) and not wrote(old.versions, now):
            changed.append((slot, old))
    return changed


def changed_since(slots: list[Slot], before: list) -> list[Slot]:
    """The slots whose bytes differ from `before` (measure() of the same list, earlier)."""
    return [s for s, b, a in zip(slots, before, measure(slots)) if b is not None and a is not None and b != a]


def forget(slot: Slot) -> None:
    """The program wrote the slot in a way no counter saw: the next check takes a new reference."""
    if slot.contents is not None:
        slot.contents = Print(
            slot.contents.offset, slot.contents.nbytes, None, slot.contents.versions, slot.contents.when
        )


def since_text(old: Print) -> str:
    held, owner = old.versions
    counter = held if held is not None else owner
    return f"since {old.when} (its version counter still at {counter})"
