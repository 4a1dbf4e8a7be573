"""Source sites for the stale-capture guard: which line of the user's code did something.

Three questions, all answered from live Python frames while the program runs:
  * which frame is the user's (not torch's, not the guard's, not the caller's plumbing),
  * how a reference went away there (the function returned, a name was reassigned, deleted),
  * which local variable of which function holds a tensor.
The first is also answered for a stack the allocator recorded (recorded_site): frames as
torch's memory snapshot gives them, dicts rather than frame objects.

The last one reads a frame's local variables without changing anything the program can see.
Before Python 3.13 (PEP 667), ``frame.f_locals`` of a function frame refreshes and returns the
one snapshot dict cached on the frame, the very dict an earlier ``locals()`` call in that
function handed to the user: reading it would add entries to the user's dict and keep every
tensor in it alive until the function returns (hiding exactly the frees the guard exists to
see). So on 3.11 and 3.12 the local slots are read straight from the interpreter frame
(CPython internals, located at import by measuring a known frame, checked on every use);
where that layout is not found, locals are not read at all and a slot goes unnamed instead.
3.13+ returns a live proxy that caches nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import dis
import functools
import inspect
import os
import sys
import types
import weakref
from collections.abc import Iterable
from typing import Any, NamedTuple

import torch

import repro
from repro.diagnose.forensics import format_frame, is_user_frame

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
# repro's own frames (the hooks, the census, the guard) are never the program's line.
_REPRO_DIR = os.path.dirname(os.path.abspath(repro.__file__)) + os.sep
_CACHE = dis.opmap.get("CACHE", -1)
LOCAL_SCAN_FRAMES = 12  # user frames searched for a local variable holding a tensor
_LOCALS_ARE_SNAPSHOTS = sys.version_info < (3, 13)
_WORD = ctypes.sizeof(ctypes.c_void_p)

# Always plumbing, whoever uses the guard: context managers and weakref callbacks sit between
# every user line and the guard's hooks.
BASE_PLUMBING = frozenset({contextlib.__file__, weakref.__file__})


def module_files(*modules: types.ModuleType) -> frozenset[str]:
    """The source files of modules, as frames name them, for a plumbing set."""
    return frozenset(f for m in modules for f in (m.__file__, os.path.abspath(m.__file__)))


def plumbing_set(extra: Iterable[str], own: frozenset[str]) -> frozenset[str]:
    """The base plumbing, a library's own files and its caller's (absolute and as given)."""
    return BASE_PLUMBING | own | frozenset(f for path in extra for f in (path, os.path.abspath(path)))


# -- user frames ---------------------------------------------------------------------------------


def is_plumbing(filename: str, plumbing: frozenset[str]) -> bool:
    return filename.startswith(_TORCH_DIR) or filename in plumbing


def user_frame(frame: types.FrameType | None, plumbing: frozenset[str]) -> types.FrameType | None:
    """First frame, walking outwards, that is neither torch nor in the plumbing files."""
    while frame is not None and is_plumbing(frame.f_code.co_filename, plumbing):
        frame = frame.f_back
    return frame


def frame_site(frame: types.FrameType | None) -> str:
    if frame is None:
        return "<unknown>"
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno} in {frame.f_code.co_name}"


def recorded_site(frames: Iterable[dict[str, Any]] | None, plumbing: frozenset[str]) -> str | None:
    """'file:line in func' of the innermost recorded frame that is the program's own: not
    torch's, not repro's, not in the plumbing, not native. frames: an allocation's stack as
    torch's memory snapshot records it ({"filename", "line", "name"}, innermost first); None
    when no frame is the program's (or nothing was recorded)."""
    for frame in frames or ():
        filename = frame.get("filename") or ""
        if is_user_frame(frame, _TORCH_DIR, plumbing) and not os.path.abspath(filename).startswith(_REPRO_DIR):
            return format_frame(frame)
    return None


def drop_site(frame: types.FrameType | None, plumbing: frozenset[str]) -> str:
    """'file:line in func (returned)': the instruction tells how the reference went away."""
    frame = user_frame(frame, plumbing)
    how = drop_kind(frame)
    return frame_site(frame) + (f" ({how})" if how else "")


def drop_kind(frame: types.FrameType | None) -> str:
    # When a function returns, its locals die while the caller sits on the CALL instruction
    # (followed by inline CACHE entries on 3.11+); `x = ...` is a STORE, `del x` a DELETE.
    if frame is None or frame.f_lasti < 0:
        return ""
    code = frame.f_code.co_code
    i = frame.f_lasti
    while 0 < i < len(code) and code[i] == _CACHE:
        i -= 2
    name = dis.opname[code[i]] if i < len(code) else ""
    if name.startswith(("CALL", "PRECALL", "RETURN")):
        return "returned"
    if name.startswith("STORE"):
        return "reassigned"
    if name.startswith("DELETE"):
        return "deleted"
    return ""


# -- local variables -----------------------------------------------------------------------------


def holder_of(key: int, frame: types.FrameType | None, plumbing: frozenset[str]) -> tuple[str, str] | None:
    """(variable, function) of the outermost user frame whose local holds this storage."""
    found = None
    for _ in range(LOCAL_SCAN_FRAMES):
        frame = user_frame(frame, plumbing)
        if frame is None:
            break
        for var, value in frame_locals(frame):
            if isinstance(value, torch.Tensor) and storage_key(value) == key:
                found = (var, frame.f_code.co_name)
                break
        frame = frame.f_back
    return found


def storage_key(t: torch.Tensor) -> int | None:
    """Identity of the tensor's storage (its StorageImpl address)."""
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError, TypeError):
        return None


def frame_locals(frame: types.FrameType) -> list[tuple[str, Any]]:
    """A frame's bound local variables (cells unwrapped), read without side effects.

    Module and class frames: their namespace (a real dict, never a snapshot). Function frames
    on 3.13+: the PEP 667 proxy. Before: the interpreter frame's slots, or [] if they cannot
    be located (never the f_locals snapshot: see the module docstring).
    """
    if not (frame.f_code.co_flags & inspect.CO_OPTIMIZED) or not _LOCALS_ARE_SNAPSHOTS:
        return list(frame.f_locals.items())
    if _LAYOUT is None:
        return []
    return read_fast_locals(frame, _LAYOUT)


class FrameLayout(NamedTuple):
    """Byte offsets into CPython 3.11/3.12 frame structs, measured on a known frame."""

    frame_data: int  # PyFrameObject.f_frame -> _PyInterpreterFrame
    code: int  # _PyInterpreterFrame's code object pointer
    frame_obj: int  # _PyInterpreterFrame.frame_obj: back to the PyFrameObject
    localsplus: int  # _PyInterpreterFrame.localsplus[0]


def word(address: int) -> int:
    return ctypes.c_void_p.from_address(address).value or 0


def slot_names(code: types.CodeType) -> tuple[str, ...]:
    """Names of the local slots in order: locals (arguments first), cell-only names, free names."""
    cells = tuple(c for c in code.co_cellvars if c not in code.co_varnames)
    return code.co_varnames + cells + code.co_freevars


def measure_layout() -> FrameLayout | None:
    """Find the offsets on a frame whose first two locals are known objects.

    PyFrameObject: a two-word object header (checked: the second word is the frame type),
    f_back, then f_frame. In the interpreter frame the two locals are searched for in its first
    words, then the code object and the frame object before them; each must be found exactly
    once. Anything
    unexpected (a debug build, another layout): None, and locals go unread.
    """
    return _measure(object(), object())


def _measure(first: object, second: object) -> FrameLayout | None:
    # No comprehension may mention `first`/`second`/`frame`: before 3.12 that turns them into
    # cells, and their slots would hold the cells.
    # `frame` is this function's own frame object, held by one of its own locals: a cycle. Were
    # it still there at the return, CPython (3.11, 3.12) would give the frame object its own copy
    # of the locals and link it to its caller's frame object (f_back), which then outlives its
    # own return the same way, and so on down the whole stack: every frame below, with every
    # local it holds, would stay alive until the cyclic GC happened to run. This module is
    # imported lazily, by the watch hooks inside the program's CUDAGraph calls, so those frames
    # include the program's capturing function: its tensors would outlive its return (the
    # freed-buffer bugs `repro watch` exists to show would not happen while it watched). So the
    # reference is dropped before returning, whichever way this returns.
    frame = sys._getframe()
    try:
        ids = (id(first), id(second), id(frame.f_code), id(frame))
        if hasattr(sys, "getobjects") or word(id(frame) + _WORD) != id(types.FrameType):
            return None  # a Py_TRACE_REFS build has a longer object header
        frame_data = 3 * _WORD
        data = word(id(frame) + frame_data)
        if not data:
            return None
        words = [word(data + i * _WORD) for i in range(12)]
        pairs = [i for i in range(11) if (words[i], words[i + 1]) == ids[:2]]
        if len(pairs) != 1:
            return None
        header = words[: pairs[0]]  # before the locals (which hold `frame` too)
        code = [i for i, w in enumerate(header) if w == ids[2]]
        owner = [i for i, w in enumerate(header) if w == ids[3]]
        if len(code) != 1 or len(owner) != 1:
            return None
        return FrameLayout(frame_data, code[0] * _WORD, owner[0] * _WORD, pairs[0] * _WORD)
    finally:
        del frame


@functools.lru_cache(maxsize=4096)
def code_slots(code: types.CodeType) -> tuple[tuple[str, ...], frozenset[str], Any, Any]:
    """(slot names, cell names, ctypes array types of the slots as addresses and as objects),
    once per code object: the watch hooks read the same few frames at every capture."""
    names = slot_names(code)
    return (
        names,
        frozenset(code.co_cellvars) | frozenset(code.co_freevars),
        ctypes.c_size_t * max(len(names), 1),
        ctypes.py_object * max(len(names), 1),
    )


def read_fast_locals(frame: types.FrameType, layout: FrameLayout) -> list[tuple[str, Any]]:
    data = word(id(frame) + layout.frame_data)
    if not data or word(data + layout.code) != id(frame.f_code) or word(data + layout.frame_obj) != id(frame):
        return []  # not the layout measured at import: read nothing
    names, cells, as_addresses, as_objects = code_slots(frame.f_code)
    at = data + layout.localsplus
    # All slots in one read; an object is taken (a new reference) only from a bound slot: a
    # py_object array raises on a NULL slot, so the addresses say which are bound first.
    bound = as_addresses.from_address(at)
    objects = as_objects.from_address(at)
    found = []
    for i, name in enumerate(names):
        if not bound[i]:
            continue  # unbound
        value = objects[i]
        if name in cells and isinstance(value, types.CellType):
            try:
                value = value.cell_contents
            except ValueError:  # an empty cell: unbound
                continue
        found.append((name, value))
    return found


_LAYOUT = measure_layout() if _LOCALS_ARE_SNAPSHOTS else None
