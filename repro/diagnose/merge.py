"""The finding merge: one list from the guard's and the census's findings of one check.

A storage both mechanisms saw becomes one finding (mechanism "both"); a census finding in a
storage the guard recorded carries the guard's readable name; where one mechanism saw something
the other did not, ``disagreement`` says what the other one said. Plain data in, plain data out:
no torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from repro.outcome import Finding, Mechanism, Status

if TYPE_CHECKING:
    from repro.diagnose.census import CensusBook


def merge_findings(
    guard: list[Finding], census: list[Finding], slots: list[Any], guard_on: bool, book: CensusBook | None
) -> list[Finding]:
    """One list from both mechanisms; a storage both saw becomes one finding ("both").

    slots: the guard's recorded storages (name, storage_ptr, storage_nbytes, reported), so a
    census finding in a storage the guard knows carries its readable name. Where one mechanism
    saw something the other did not, ``disagreement`` says what the other one said.
    """
    out, used = [], set()
    for c in census:
        start, end = c.census["block_start"], c.census["block_start"] + c.census["block_size"]
        g = next(
            (
                i
                for i, g in enumerate(guard)
                if i not in used and g.old_ptr < end and start < g.old_ptr + max(g.nbytes, 1)
            ),
            None,
        )
        if g is not None:
            used.add(g)
            merged = guard[g]
            merged.mechanism, merged.census = Mechanism.BOTH, c.census
            out.append(merged)
            continue
        if guard_on:
            slot = next(
                (s for s in slots if s.storage_ptr < end and start < s.storage_ptr + max(s.storage_nbytes, 1)), None
            )
            if slot is None:
                c.disagreement = "the guard did not see this storage (it never passed the dispatcher)"
            elif slot.reported:
                c.slot, c.mechanism = slot.name, Mechanism.BOTH  # the guard said it at an earlier check
                c.census["guard_reported"] = sorted(slot.reported)
            else:
                c.slot = slot.name
                c.disagreement = f"the guard recorded this storage as {slot.name} and sees it alive"
        out.append(c)
    for i, g in enumerate(guard):
        if i in used:
            continue
        if book is not None and book.censuses:
            refs = book.references_in(g.old_ptr, g.old_ptr + max(g.nbytes, 1))
            if not refs and book.held_in(g.old_ptr, g.old_ptr + max(g.nbytes, 1)):
                pass  # the census handed this storage to the guard: one mechanism, no disagreement
            elif not refs:
                g.disagreement = "the census found no captured address in this storage"
            elif g.status == Status.REBOUND:
                g.disagreement = (
                    "the census sees the captured block still allocated (a rebinding is visible only to the guard)"
                )
            elif g.status == Status.CONTENTS_CHANGED:
                g.disagreement = (
                    "the census sees the captured block still allocated (changed bytes at the same "
                    "address are visible only to the guard's fingerprint)"
                )
            else:
                said = {book.said.get(r.block.start) for _, r in refs} - {None}
                g.disagreement = (
                    f"the census reported this block earlier ({', '.join(sorted(said))})"
                    if said
                    else "the census sees the captured block still allocated"
                )
        out.append(g)
    return out
