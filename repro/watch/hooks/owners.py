"""Owners: what the capturing code holds, named for the guard at each capture.

Modules, the capturing object (`self`) and plain objects that hold tensors or modules, found
in the locals of the user frames above a capture, are watched under their names: they give
the paths (`policy.0.weight`, `cache.k`) by which a captured tensor is named. Tensors held by
locals are left to the guard, which names them itself.
"""

from __future__ import annotations

from enum import Enum
from types import FrameType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # annotations only: nothing here imports torch until the program does
    from repro.diagnose.guard import CaptureGuard

_OWNER_FRAMES = 8  # user frames above a capture searched for owners
_MAX_OWNERS = 32  # owners watched per capture
# Types the kinds memo keeps (it holds the type objects, never an instance): a program that
# makes classes as it goes must not grow it without end.
_MAX_KINDS = 4096


class Kind(Enum):
    """What owner_name makes of a local, by its type alone."""

    SKIP = 0  # a tensor (the guard names it), a builtin, torch's or repro's own, no __dict__
    MODULE = 1  # a torch.nn.Module
    OBJECT = 2  # a plain object: an owner when it holds tensors or modules itself


class Owners:
    """The owners watched so far in this process, by name."""

    def __init__(self):
        self._watched: dict[str, Any] = {}  # owner name -> its object, held as the guard holds it
        # type -> its Kind. A capture loop meets the same ~100 locals at every capture (a
        # piecewise engine: 2,211 captures), nearly all tensors and builtins; asking their
        # type once saves the isinstance calls. None until asked whether torch's Tensor and
        # Module decide isinstance by the type alone (no metaclass __instancecheck__ of their
        # own): only then is a type's answer every instance's.
        self._kinds: dict[type, Kind] | None = None

    def watch(self, guard: CaptureGuard, frame: FrameType | None) -> None:
        """Name what the capturing code holds: modules, tensors and `self` in its frames."""
        from repro.diagnose.sites import frame_locals, user_frame
        import torch

        plumbing = guard.plumbing
        if self._kinds is None:
            self._kinds = {} if by_type_alone(torch) else _NO_MEMO
        kinds = self._kinds
        frame = user_frame(frame, plumbing)
        added = 0
        for _ in range(_OWNER_FRAMES):
            if frame is None or added >= _MAX_OWNERS:
                break
            for var, value in frame_locals(frame):
                name = owner_name(var, value, torch, kinds)
                if name is None or not self.watch_once(guard, name, value):
                    continue
                added += 1
                if var == "self" and not isinstance(value, torch.nn.Module):
                    added += self.watch_module_attrs(guard, name, value, torch)
            frame = user_frame(frame.f_back, plumbing)

    def watch_module_attrs(self, guard: CaptureGuard, name: str, obj: Any, torch) -> int:
        return sum(
            self.watch_once(guard, f"{name}.{attr}", value)
            for attr, value in list(getattr(obj, "__dict__", {}).items())[:_MAX_OWNERS]
            if isinstance(value, torch.nn.Module)
        )

    def watch_once(self, guard: CaptureGuard, name: str, value: Any) -> bool:
        """Watch value as name unless that very owner is watched already. Keyed by name: one
        object reached under two names (a runner's `self.model` and the caller's `model`)
        keeps both, instead of each capture re-watching the one the last capture replaced,
        which threw the owner index away at every capture (2,211 rebuilds, piecewise)."""
        from repro.diagnose.owners import hold

        held = self._watched.get(name)
        if held is not None and held() is value:
            return False
        guard.watch(name, value)
        self._watched[name] = hold(value)
        return True


class _NoMemo(dict):
    """A kinds memo that remembers nothing (where isinstance is not decided by type alone)."""

    def __setitem__(self, key, value) -> None:
        pass


_NO_MEMO: dict = _NoMemo()


def by_type_alone(torch) -> bool:
    """Whether isinstance(x, torch.Tensor) and isinstance(x, torch.nn.Module) depend on type(x)
    alone: neither class's metaclass has an __instancecheck__ of its own."""
    return all(type(cls).__instancecheck__ is type.__instancecheck__ for cls in (torch.Tensor, torch.nn.Module))


def kind_of(value: Any, torch) -> Kind:
    # Tensors held by locals are left to the guard, which names them "<local w of f, created
    # by ...>"; owners are what gives paths to tensors: modules and the capturing object.
    if isinstance(value, torch.Tensor):
        return Kind.SKIP
    if isinstance(value, torch.nn.Module):
        return Kind.MODULE
    module = type(value).__module__ or ""
    if module == "builtins" or module.startswith(("torch", "repro")) or not hasattr(value, "__dict__"):
        return Kind.SKIP
    return Kind.OBJECT


def owner_name(var: str, value: Any, torch, kinds: dict[type, Kind] = _NO_MEMO) -> str | None:
    """The watch name of a local worth watching, or None. kinds: a memo of kind_of by type,
    where that is sound (by_type_alone)."""
    if var.startswith("__"):
        return None
    kind = kinds.get(type(value))
    if kind is None:
        kind = kind_of(value, torch)
        if len(kinds) < _MAX_KINDS:
            kinds[type(value)] = kind
    if kind is Kind.SKIP:
        return None
    if kind is Kind.MODULE:
        return type(value).__name__ if var == "self" else var
    if var == "self":
        return type(value).__name__
    # A plain object (a KV cache, a runner) is worth watching when it holds tensors or modules itself.
    attrs = list(vars(value).values())[:_MAX_OWNERS]
    return var if any(isinstance(a, (torch.Tensor, torch.nn.Module)) for a in attrs) else None
