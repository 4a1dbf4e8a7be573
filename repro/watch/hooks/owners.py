"""Owners: what the capturing code holds, named for the guard at each capture.

Modules, the capturing object (`self`) and plain objects that hold tensors or modules, found
in the locals of the user frames above a capture, are watched under their names: they give
the paths (`policy.0.weight`, `cache.k`) by which a captured tensor is named. Tensors held by
locals are left to the guard, which names them itself.
"""

from __future__ import annotations

from types import FrameType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # annotations only: nothing here imports torch until the program does
    from repro.diagnose.guard import CaptureGuard

_OWNER_FRAMES = 8  # user frames above a capture searched for owners
_MAX_OWNERS = 32  # owners watched per capture


class Owners:
    """The owners watched so far in this process, by name."""

    def __init__(self):
        self._watched: dict[str, Any] = {}  # owner name -> its object, held as the guard holds it

    def watch(self, guard: CaptureGuard, frame: FrameType | None) -> None:
        """Name what the capturing code holds: modules, tensors and `self` in its frames."""
        from repro.diagnose.sites import frame_locals, user_frame
        import torch

        plumbing = guard.plumbing
        frame = user_frame(frame, plumbing)
        added = 0
        for _ in range(_OWNER_FRAMES):
            if frame is None or added >= _MAX_OWNERS:
                break
            for var, value in frame_locals(frame):
                name = owner_name(var, value, torch)
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


def owner_name(var: str, value: Any, torch) -> str | None:
    """The watch name of a local worth watching, or None."""
    # Tensors held by locals are left to the guard, which names them "<local w of f, created
    # by ...>"; owners are what gives paths to tensors: modules and the capturing object.
    if var.startswith("__") or isinstance(value, torch.Tensor):
        return None
    if isinstance(value, torch.nn.Module):
        return type(value).__name__ if var == "self" else var
    module = type(value).__module__ or ""
    if module == "builtins" or module.startswith(("torch", "repro")) or not hasattr(value, "__dict__"):
        return None
    if var == "self":
        return type(value).__name__
    # A plain object (a KV cache, a runner) is worth watching when it holds tensors or modules itself.
    attrs = list(vars(value).values())[:_MAX_OWNERS]
    return var if any(isinstance(a, (torch.Tensor, torch.nn.Module)) for a in attrs) else None
