"""Names for captured tensors: the attribute path from a watched owner to each tensor.

The guard names a captured storage by where a watched object exposes it
(``moe.quant_method.moe_kernel.workspace13``, ``proposer.graphs[16].inputs[0]``): a breadth-
first walk of the owners' object graph, bounded in hops, items and nodes so a huge object graph
cannot stall a capture. Owners are held weakly where the type allows (naming must not extend a
lifetime), and a dotted owner ("moe.quant_method") is reached through its parent at every use,
so rebinding the parent's attribute is seen.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

# nn.Module bookkeeping attributes (hook dicts, _parameters, ...): walked another way or not at all.
_MODULE_INTERNALS = frozenset(vars(torch.nn.Module()))
_MAX_HOPS = 4  # owner.a.b.tensor, owner.graphs[16].inputs[0]
_MAX_ITEMS = 256  # per list / dict while naming
_MAX_NODES = 20_000  # per index build


@dataclass(frozen=True)
class Owner:
    """A watched object. When its watch name extends another owner's ("moe.quant_method" under
    "moe") and that path reaches it, it is found through the parent at every use, so rebinding
    `layer.quant_method` is seen; otherwise it is held (weakly where the type allows)."""

    name: str
    held: Callable[[], Any]  # weakref.ref where possible: the guard must not extend lifetimes
    parent: Owner | None = None
    steps: tuple[tuple[str, Any], ...] = ()

    def get(self) -> Any:
        if self.parent is None:
            return self.held()
        return follow(self.parent.get(), self.steps)


@dataclass(frozen=True)
class Named:
    """Where a watched owner exposes a tensor: owner + attribute/item steps."""

    name: str
    owner: Owner
    steps: tuple[tuple[str, Any], ...]
    data_ptr: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_ptr: int
    storage_nbytes: int = 0


def hold(obj: Any) -> Callable[[], Any]:
    """A weak reference where the type allows one; dicts and lists can only be held strongly."""
    try:
        return weakref.ref(obj)
    except TypeError:
        return lambda: obj


def step_text(kind: str, key: Any) -> str:
    if kind == "cell":
        return f".<cell {key}>"  # a closure variable: not reachable by getattr
    return f".{key}" if kind == "attr" else f"[{key!r}]"


def resolve(named: Named) -> Any:
    """The tensor the owner's name points at now (None if the chain breaks)."""
    return follow(named.owner.get(), named.steps)


def follow(obj: Any, steps: tuple[tuple[str, Any], ...]) -> Any:
    """Walk attribute / item steps; None where the chain breaks (owner gone, attribute unset)."""
    try:
        for kind, key in steps:
            if obj is None:
                return None
            obj = getattr(obj, key) if kind == "attr" else obj[key]
    except (AttributeError, KeyError, IndexError, TypeError):
        return None
    return obj


def bind_owners(owners: list[Owner]) -> list[Owner]:
    """Re-derive parent links: "a.b.c" hangs off "a.b" (or "a") when that path reaches it.

    A link made once stays (the held object may be gone since: that is a rebinding, and the
    link is how it is seen); a new link needs the path to reach the held object now.
    """
    by_name = {o.name: o for o in owners}
    bound: dict[str, Owner] = {}

    def bind(owner: Owner) -> Owner:
        if owner.name in bound:
            return bound[owner.name]
        bound[owner.name] = Owner(owner.name, owner.held)  # cycle guard while parents bind
        parts = owner.name.split(".")
        for cut in range(len(parts) - 1, 0, -1):
            parent_name = ".".join(parts[:cut])
            if parent_name not in by_name:
                continue
            steps = tuple(("attr", p) for p in parts[cut:])
            parent = bind(by_name[parent_name])
            kept = owner.parent is not None and owner.steps == steps
            obj = owner.held()
            if kept or (obj is not None and follow(parent.get(), steps) is obj):
                bound[owner.name] = Owner(owner.name, owner.held, parent, steps)
                break
        return bound[owner.name]

    return [bind(o) for o in owners]


def build_index(owners: list[Owner]) -> dict[int, Named]:
    """storage identity -> shortest name under a watched owner (breadth first)."""
    index: dict[int, Named] = {}
    queue: deque[tuple[Owner, Any, tuple, int]] = deque()
    seen: set[int] = set()
    for owner in owners:
        root = owner.get()
        if isinstance(root, torch.nn.Module):
            add_module_tensors(index, owner, root)
            for mname, module in root.named_modules():
                prefix = tuple(("attr", part) for part in mname.split(".")) if mname else ()
                for attr, value in list(vars(module).items()):
                    if attr not in _MODULE_INTERNALS:
                        queue.append((owner, value, prefix + (("attr", attr),), 1))
        elif root is not None:
            queue.append((owner, root, (), 0))
    visited = 0
    while queue and visited < _MAX_NODES:
        owner, value, steps, hops = queue.popleft()
        visited += 1
        if isinstance(value, torch.Tensor):
            add_named(index, owner, steps, value)
            continue
        if hops >= _MAX_HOPS or id(value) in seen or isinstance(value, torch.nn.Module):
            continue
        seen.add(id(value))
        for kind, key, child in children(value):
            queue.append((owner, child, steps + ((kind, key),), hops + 1))
    return index


def add_module_tensors(index: dict[int, Named], owner: Owner, module: torch.nn.Module) -> None:
    for pname, tensor in list(module.named_parameters()) + list(module.named_buffers()):
        add_named(index, owner, tuple(("attr", part) for part in pname.split(".")), tensor)


def add_named(index: dict[int, Named], owner: Owner, steps: tuple, t: torch.Tensor) -> None:
    storage = storage_of(t)
    if storage is None or storage._cdata in index:
        return
    name = owner.name + "".join(step_text(kind, key) for kind, key in steps)
    index[storage._cdata] = Named(
        name=name,
        owner=owner,
        steps=steps,
        data_ptr=t.data_ptr(),
        shape=tuple(t.shape),
        stride=tuple(t.stride()),
        storage_ptr=storage.data_ptr(),
        storage_nbytes=storage.nbytes(),
    )


def children(value: Any, max_items: int = _MAX_ITEMS, code: bool = False) -> list[tuple[str, Any, Any]]:
    """(kind, key, child) of containers and plain objects worth naming tensors through.

    code: also look inside what holds tensors without being data: functools.partial (func,
    args, keywords), a function's closure cells (kind "cell") and a bound method's __self__
    and __func__. The reload census needs them (a kernel launcher kept as a partial over its
    workspace is exactly what a reload rebuilds); naming at capture time does not.
    """
    if isinstance(value, (list, tuple)):
        return [("item", i, v) for i, v in enumerate(value[:max_items])]
    if isinstance(value, dict):
        items = [(k, v) for k, v in value.items() if isinstance(k, (str, int))]
        return [("item", k, v) for k, v in items[:max_items]]
    if code:
        held = code_children(value)
        if held is not None:
            return held
    if not is_plain_object(value):
        return []
    attrs = dict(vars(value)) if hasattr(value, "__dict__") else {}
    for cls in type(value).__mro__:
        for slot_name in getattr(cls, "__slots__", ()):
            if slot_name not in ("__dict__", "__weakref__") and hasattr(value, slot_name):
                attrs.setdefault(slot_name, getattr(value, slot_name))
    return [("attr", k, v) for k, v in list(attrs.items())[:max_items]]


def code_children(value: Any) -> list[tuple[str, Any, Any]] | None:
    """What a partial, a function or a bound method holds; None for anything else."""
    if isinstance(value, functools.partial):
        return [("attr", "func", value.func), ("attr", "args", value.args), ("attr", "keywords", value.keywords)]
    if isinstance(value, types.MethodType):
        return [("attr", "__self__", value.__self__), ("attr", "__func__", value.__func__)]
    if isinstance(value, types.FunctionType):
        cells = zip(value.__code__.co_freevars, value.__closure__ or ())
        out = []
        for name, cell in cells:
            try:
                out.append(("cell", name, cell.cell_contents))
            except ValueError:  # a cell not filled yet
                continue
        return out
    return None


def is_plain_object(value: Any) -> bool:
    """User objects (kernels, configs, dataclasses); not torch's own, not code or types."""
    if isinstance(
        value,
        (
            type,
            types.ModuleType,
            types.FunctionType,
            types.MethodType,
            types.BuiltinFunctionType,
            str,
            bytes,
            int,
            float,
            bool,
        ),
    ):
        return False
    module = type(value).__module__ or ""
    if module in ("builtins", "torch") or module.startswith("torch.") or getattr(value, "_not_an_owner", False):
        return False  # torch's objects hold no user tensors worth naming; nor does a guard
    return hasattr(value, "__dict__") or hasattr(type(value), "__slots__") or dataclasses.is_dataclass(value)


def exposed_name(named: Named, t: torch.Tensor) -> str:
    """The owner's name, with "[view]" when the graph saw only part of (or a reshaped) tensor."""
    exact = t.data_ptr() == named.data_ptr and tuple(t.shape) == named.shape and tuple(t.stride()) == named.stride
    return named.name if exact else named.name + "[view]"


def storage_of(t: torch.Tensor):
    """The untyped storage, or None for tensors without real memory (meta, sparse, empty)."""
    try:
        storage = t.untyped_storage()
        if storage.data_ptr() == 0:
            return None
    except (RuntimeError, NotImplementedError, TypeError):
        return None
    return storage


@dataclass
class Walk:
    """Every (path, tensor) reachable from a root, for the reload census."""

    found: list[tuple[str, torch.Tensor]]
    nodes: int  # objects expanded
    truncated: str = ""  # why the walk stopped early ("" when it saw everything)


def walk_tensors(root: Any, name: str, max_depth: int, max_nodes: int, max_items: int) -> Walk:
    """Breadth first from `root`: each tensor at every path that reaches it, each other object
    expanded once (at its shortest path, so cycles end). Modules anywhere in the graph give
    their own parameters, buffers, submodules and plain attributes; code objects that hold
    tensors (partials, closures, bound methods) are looked into (`children(code=True)`).
    A tensor is a leaf: attributes hung on parameters (weight loaders) are not walked.
    """
    found: list[tuple[str, torch.Tensor]] = []
    queue: deque[tuple[str, Any, int]] = deque([(name, root, 0)])
    seen: set[int] = set()
    nodes, truncated = 0, ""
    while queue:
        path, value, depth = queue.popleft()
        if isinstance(value, torch.Tensor):
            found.append((path, value))
            # A wrapper subclass (a quantized weight) holds its real storages as inner tensors.
            for attr in inner_tensors(value) if depth < max_depth else ():
                queue.append((f"{path}.{attr}", getattr(value, attr), depth + 1))
            continue
        if id(value) in seen or value is None or isinstance(value, (str, bytes, int, float, bool)):
            continue
        if depth >= max_depth:
            truncated = truncated or f"depth bound {max_depth} reached at {path}"
            continue
        if nodes >= max_nodes:
            truncated = truncated or f"node bound {max_nodes} reached"
            break
        seen.add(id(value))
        nodes += 1
        for kind, key, child in (
            module_children(value) if isinstance(value, torch.nn.Module) else children(value, max_items, code=True)
        ):
            queue.append((path + step_text(kind, key), child, depth + 1))
    return Walk(found=found, nodes=nodes, truncated=truncated)


def inner_tensors(t: torch.Tensor) -> list[str]:
    """Attribute names of a traceable wrapper subclass's inner tensors (torchao-style)."""
    flatten = getattr(type(t), "__tensor_flatten__", None)
    if flatten is None:
        return []
    try:
        names, _ = t.__tensor_flatten__()
    except Exception:  # a subclass whose flatten needs more than its own state
        return []
    return [n for n in names if isinstance(getattr(t, n, None), torch.Tensor)]


def module_children(module: torch.nn.Module) -> list[tuple[str, Any, Any]]:
    """A module's parameters, buffers and submodules by attribute name, then its plain attributes."""
    out: list[tuple[str, Any, Any]] = []
    for table in (module._parameters, module._buffers, module._modules):
        out.extend(("attr", key, value) for key, value in table.items() if value is not None)
    out.extend(("attr", key, value) for key, value in vars(module).items() if key not in _MODULE_INTERNALS)
    return out
