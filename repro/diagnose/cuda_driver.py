"""The CUDA driver through ctypes: the entry points and structs a captured graph is read with.

Why ctypes on libcuda, not cuda-bindings: the parameter buffers are raw host memory
(``void** kernelParams``, the ``extra`` key/value array and the buffer it points to) that must be
read by address anyway; ctypes does that directly, needs no package (CPU CI and images without
cuda-bindings import this module fine), and the four structs read here are small and stable in
the driver ABI (CUDA_KERNEL_NODE_PARAMS_v2, CUDA_MEMCPY3D, CUDA_MEMSET_NODE_PARAMS).

Besides the entry points (Driver): what a kernel node's parameters are: its function's name and
parameter layout (function_info, read once per function) and the bytes behind ``kernelParams``
(param_chunks) or ``extra`` (read_extra). Importing this module opens nothing: load_driver()
loads libcuda on first use.
"""

from __future__ import annotations

import bisect
import ctypes
import functools
import time
from enum import StrEnum
from typing import Any, NamedTuple

MAX_PARAMS = 4096  # a launch's parameter buffer is at most 32 KiB
MAX_EXTRA_PAIRS = 16


class NodeKind(StrEnum):
    """A CUDA graph node's type: CUgraphNodeType (cuda.h), its members in the driver's order (0-13)."""

    KERNEL = "kernel"
    MEMCPY = "memcpy"
    MEMSET = "memset"
    HOST = "host"
    GRAPH = "graph"  # a child graph: walked as part of its parent
    EMPTY = "empty"
    WAIT_EVENT = "wait_event"
    EVENT_RECORD = "event_record"
    EXT_SEMAS_SIGNAL = "ext_semas_signal"
    EXT_SEMAS_WAIT = "ext_semas_wait"
    MEM_ALLOC = "mem_alloc"
    MEM_FREE = "mem_free"
    BATCH_MEM_OP = "batch_mem_op"
    CONDITIONAL = "conditional"


CU_GRAPH_NODE_TYPES = dict(enumerate(NodeKind))  # CUgraphNodeType: NodeKind lists them in the driver's order
CUDA_SUCCESS, CUDA_ERROR_INVALID_VALUE = 0, 1
CU_MEMORYTYPE_DEVICE, CU_MEMORYTYPE_UNIFIED = 2, 4
CU_POINTER_ATTRIBUTE_MEMORY_TYPE = 2
CU_LAUNCH_PARAM_END, CU_LAUNCH_PARAM_BUFFER_POINTER, CU_LAUNCH_PARAM_BUFFER_SIZE = 0, 1, 2


class KernelNodeParams(ctypes.Structure):
    """CUDA_KERNEL_NODE_PARAMS_v2 (cuda.h, CUDA >= 12.0)."""

    _fields_ = [
        ("func", ctypes.c_void_p),
        ("gridDimX", ctypes.c_uint),
        ("gridDimY", ctypes.c_uint),
        ("gridDimZ", ctypes.c_uint),
        ("blockDimX", ctypes.c_uint),
        ("blockDimY", ctypes.c_uint),
        ("blockDimZ", ctypes.c_uint),
        ("sharedMemBytes", ctypes.c_uint),
        ("kernelParams", ctypes.c_void_p),
        ("extra", ctypes.c_void_p),
        ("kern", ctypes.c_void_p),
        ("ctx", ctypes.c_void_p),
    ]


class Memcpy3D(ctypes.Structure):
    """CUDA_MEMCPY3D (cuda.h)."""

    _fields_ = [
        ("srcXInBytes", ctypes.c_size_t),
        ("srcY", ctypes.c_size_t),
        ("srcZ", ctypes.c_size_t),
        ("srcLOD", ctypes.c_size_t),
        ("srcMemoryType", ctypes.c_int),
        ("srcHost", ctypes.c_void_p),
        ("srcDevice", ctypes.c_uint64),
        ("srcArray", ctypes.c_void_p),
        ("reserved0", ctypes.c_void_p),
        ("srcPitch", ctypes.c_size_t),
        ("srcHeight", ctypes.c_size_t),
        ("dstXInBytes", ctypes.c_size_t),
        ("dstY", ctypes.c_size_t),
        ("dstZ", ctypes.c_size_t),
        ("dstLOD", ctypes.c_size_t),
        ("dstMemoryType", ctypes.c_int),
        ("dstHost", ctypes.c_void_p),
        ("dstDevice", ctypes.c_uint64),
        ("dstArray", ctypes.c_void_p),
        ("reserved1", ctypes.c_void_p),
        ("dstPitch", ctypes.c_size_t),
        ("dstHeight", ctypes.c_size_t),
        ("WidthInBytes", ctypes.c_size_t),
        ("Height", ctypes.c_size_t),
        ("Depth", ctypes.c_size_t),
    ]


class MemsetParams(ctypes.Structure):
    """CUDA_MEMSET_NODE_PARAMS (cuda.h)."""

    _fields_ = [
        ("dst", ctypes.c_uint64),
        ("pitch", ctypes.c_size_t),
        ("value", ctypes.c_uint),
        ("elementSize", ctypes.c_uint),
        ("width", ctypes.c_size_t),
        ("height", ctypes.c_size_t),
    ]


class DriverError(RuntimeError):
    pass


class Driver:
    """The few libcuda entry points the census reads a graph with."""

    def __init__(self, lib: ctypes.CDLL):
        self.lib = lib
        self.get_params = self.optional("cuGraphKernelNodeGetParams_v2", "cuGraphKernelNodeGetParams")
        self.func_param_info = self.optional("cuFuncGetParamInfo")
        self.kernel_param_info = self.optional("cuKernelGetParamInfo")
        self.func_name = self.optional("cuFuncGetName")
        self.kernel_name = self.optional("cuKernelGetName")
        self.address_cache: dict[int, bool] = {}  # 2 MiB page -> a device address: one query each
        self.address_seconds = 0.0  # spent in those queries (the exit record's census_reads)
        self.function_cache: dict[int, tuple[str, Any]] = {}
        # One parameter struct for every node (kernel_node fills it; its caller reads it before
        # the next call): a struct and a byref per node cost ~1 us of the ~10 us a node took.
        self.scratch = KernelNodeParams()
        self.scratch_ref = ctypes.byref(self.scratch)
        # Declared argument types let the per-node calls take plain ints (half their cost: an
        # engine's graphs hold ~70,000 kernel nodes).
        node = ctypes.c_void_p
        for fn, out in (
            (getattr(lib, "cuGraphNodeGetType", None), ctypes.POINTER(ctypes.c_int)),
            (self.get_params, ctypes.POINTER(KernelNodeParams)),
            (getattr(lib, "cuGraphMemcpyNodeGetParams", None), ctypes.POINTER(Memcpy3D)),
            (getattr(lib, "cuGraphMemsetNodeGetParams", None), ctypes.POINTER(MemsetParams)),
            (getattr(lib, "cuGraphChildGraphNodeGetGraph", None), ctypes.POINTER(ctypes.c_void_p)),
        ):
            if fn is not None:
                fn.argtypes, fn.restype = [node, out], ctypes.c_int

    def optional(self, *names: str) -> Any:
        for name in names:
            fn = getattr(self.lib, name, None)
            if fn is not None:
                fn.restype = ctypes.c_int
                return fn
        return None

    def error_name(self, code: int) -> str:
        name = ctypes.c_char_p()
        if self.lib.cuGetErrorName(code, ctypes.byref(name)) == CUDA_SUCCESS and name.value:
            return name.value.decode()
        return f"CUresult {code}"

    def call(self, what: str, fn: Any, *args: Any) -> None:
        code = fn(*args)
        if code:
            raise DriverError(f"{what}: {self.error_name(code)}")

    def nodes(self, graph: int) -> list[int]:
        count = ctypes.c_size_t(0)
        self.call("cuGraphGetNodes", self.lib.cuGraphGetNodes, ctypes.c_void_p(graph), None, ctypes.byref(count))
        arr = (ctypes.c_void_p * max(count.value, 1))()
        self.call("cuGraphGetNodes", self.lib.cuGraphGetNodes, ctypes.c_void_p(graph), arr, ctypes.byref(count))
        return arr[: count.value]  # a list of ints, sliced in C

    def node_type(self, node: int) -> NodeKind | str:
        """The node's NodeKind; "type N" for a type this module does not know."""
        t = ctypes.c_int(-1)
        self.call("cuGraphNodeGetType", self.lib.cuGraphNodeGetType, node, ctypes.byref(t))
        return CU_GRAPH_NODE_TYPES.get(t.value, f"type {t.value}")

    def child_graph(self, node: int) -> int:
        g = ctypes.c_void_p()
        self.call("cuGraphChildGraphNodeGetGraph", self.lib.cuGraphChildGraphNodeGetGraph, node, ctypes.byref(g))
        return g.value or 0

    def kernel_params(self, node: int) -> KernelNodeParams:
        if self.get_params is None:
            raise DriverError("cuGraphKernelNodeGetParams_v2 is not in this libcuda")
        p = KernelNodeParams()
        self.call("cuGraphKernelNodeGetParams_v2", self.get_params, node, ctypes.byref(p))
        return p

    def kernel_node(self, node: int) -> KernelNodeParams | None:
        """The node's kernel parameters, or None when the node is no kernel node (or the driver
        will not say: node_type tells which). One driver call for a kernel node, the usual
        kind, where node_type then kernel_params took two. The struct is the driver's scratch:
        read it before the next call."""
        if self.get_params is None or self.get_params(node, self.scratch_ref):
            return None
        return self.scratch

    def memcpy_params(self, node: int) -> Memcpy3D:
        p = Memcpy3D()
        self.call("cuGraphMemcpyNodeGetParams", self.lib.cuGraphMemcpyNodeGetParams, node, ctypes.byref(p))
        return p

    def memset_params(self, node: int) -> MemsetParams:
        p = MemsetParams()
        self.call("cuGraphMemsetNodeGetParams", self.lib.cuGraphMemsetNodeGetParams, node, ctypes.byref(p))
        return p

    def name(self, p: KernelNodeParams) -> str:
        out = ctypes.c_char_p()
        for fn, handle in ((self.func_name, p.func), (self.kernel_name, p.kern)):
            if fn is not None and handle and fn(ctypes.byref(out), ctypes.c_void_p(handle)) == CUDA_SUCCESS:
                return (out.value or b"").decode(errors="replace")
        return "<unnamed kernel>"

    def param_layout(self, p: KernelNodeParams) -> list[tuple[int, int]]:
        """[(offset, size)] of each parameter, from the function or the library kernel handle."""
        for fn, handle, what in (
            (self.func_param_info, p.func, "cuFuncGetParamInfo"),
            (self.kernel_param_info, p.kern, "cuKernelGetParamInfo"),
        ):
            if fn is None or not handle:
                continue
            layout, code = [], CUDA_SUCCESS
            for i in range(MAX_PARAMS):
                off, size = ctypes.c_size_t(), ctypes.c_size_t()
                code = fn(ctypes.c_void_p(handle), ctypes.c_size_t(i), ctypes.byref(off), ctypes.byref(size))
                if code != CUDA_SUCCESS:
                    break
                layout.append((off.value, size.value))
            if code in (CUDA_SUCCESS, CUDA_ERROR_INVALID_VALUE):
                return layout  # INVALID_VALUE past the last parameter ends the list
            raise DriverError(f"{what}: {self.error_name(code)}")
        raise DriverError(
            "no parameter layout: neither cuFuncGetParamInfo nor cuKernelGetParamInfo "
            "applies (driver older than CUDA 12.4, or no function handle)"
        )

    def is_device_address(self, value: int) -> bool:
        """Whether the driver knows value as a device (or managed) address; cached per 2 MiB page."""
        page = value >> 21
        known = self.address_cache.get(page)
        if known is None:
            t0 = time.perf_counter()
            mem = ctypes.c_uint(0)
            ok = (
                self.lib.cuPointerGetAttribute(
                    ctypes.byref(mem), CU_POINTER_ATTRIBUTE_MEMORY_TYPE, ctypes.c_uint64(value)
                )
                == CUDA_SUCCESS
            )
            known = self.address_cache[page] = ok and mem.value in (CU_MEMORYTYPE_DEVICE, CU_MEMORYTYPE_UNIFIED)
            self.address_seconds += time.perf_counter() - t0
        return known


@functools.lru_cache(maxsize=1)
def load_driver() -> Driver:
    """libcuda through ctypes (see the module docstring for why not cuda-bindings)."""
    for name in ("libcuda.so.1", "libcuda.so"):
        try:
            return Driver(ctypes.CDLL(name))
        except OSError:
            continue
    raise DriverError("libcuda.so.1 cannot be loaded (no NVIDIA driver on this machine)")


def function_info(driver: Driver, p: KernelNodeParams) -> tuple[str, ParamLayout | DriverError]:
    """(name, parameter layout or the error reading it) of a node's function, read once per
    function: an engine's graphs launch the same few dozen kernels tens of thousands of times."""
    key = p.func or p.kern
    cache = getattr(driver, "function_cache", None)
    if key and cache is not None and key in cache:
        return cache[key]
    name = driver.name(p)
    try:
        layout: ParamLayout | DriverError = param_layout(driver.param_layout(p) if p.kernelParams else ())
    except DriverError as e:
        layout = e
    if key and cache is not None:
        cache[key] = (name, layout)
    return name, layout


class ParamLayout(NamedTuple):
    """A function's parameters as the driver lays them out, with what reading them needs,
    derived once per function."""

    pairs: tuple[tuple[int, int], ...]  # (offset, size) of each parameter
    starts: tuple[int, ...]  # offset of each parameter
    rel: tuple[int, ...]  # offset of each parameter from the first
    first: int  # offset of the first parameter
    end: int  # end of the last parameter
    slots: Any  # ctypes array type of the kernelParams pointers
    chars: Any  # ctypes char array type of the whole buffer, first parameter to end (read as .raw)
    # offset -> where(offset), filled as asked: the same function's words sit at the same
    # offsets in every node that launches it, so each name is made once per function.
    names: dict[int, str]

    def where(self, offset: int) -> str:
        """'param 3 +8': the parameter holding the word at offset, and the offset in it."""
        name = self.names.get(offset)
        if name is None:
            i = bisect.bisect_right(self.starts, offset) - 1
            name = self.names[offset] = f"param {i} +{offset - self.starts[i]}"
        return name


def param_layout(pairs: list[tuple[int, int]] | tuple[tuple[int, int], ...]) -> ParamLayout:
    pairs = tuple((int(off), int(size)) for off, size in pairs)
    starts = tuple(off for off, _ in pairs)
    first = starts[0] if starts else 0
    return ParamLayout(
        pairs,
        starts,
        tuple(off - first for off in starts),
        first,
        max((off + size for off, size in pairs), default=0),
        ctypes.c_void_p * max(len(pairs), 1),
        ctypes.c_char * max(max((off + size for off, size in pairs), default=0) - first, 0),
        {},
    )


def param_chunks(slots: Any, layout: ParamLayout) -> tuple[list[tuple[bytes, int]], str | None]:
    """(the parameters' bytes as (buffer, its offset in the parameter buffer) chunks, the first
    parameter that cannot be read or None).

    The driver hands a graph node's parameters back as pointers into one buffer laid out as
    the layout says; where they are (the usual case), one read gets them all."""
    n = len(layout.pairs)
    if not n:
        return [], None
    got = slots[:n]
    base = got[0]
    # Contiguous when every pointer sits at its offset from the first (map runs in C: this
    # check is made for every kernel node of every graph).
    if base and tuple(map(base.__rsub__, got)) == layout.rel:
        # (an array type's .raw: a third of string_at's cost, which goes through a foreign call)
        return [(layout.chars.from_address(base).raw, layout.first)], None
    chunks = []
    for i, (off, size) in enumerate(layout.pairs):
        if not got[i]:
            return chunks, f"parameter {i} has no value"
        chunks.append((ctypes.string_at(got[i], size), off))
    return chunks, None


def read_extra(extra: int) -> bytes | None:
    """The parameter buffer of a launch that passed CU_LAUNCH_PARAM_BUFFER_POINTER/SIZE."""
    pairs = (ctypes.c_void_p * (2 * MAX_EXTRA_PAIRS)).from_address(extra)
    ptr = size_ptr = None
    for i in range(0, 2 * MAX_EXTRA_PAIRS, 2):
        key = pairs[i] or CU_LAUNCH_PARAM_END
        if key == CU_LAUNCH_PARAM_END:
            break
        if key == CU_LAUNCH_PARAM_BUFFER_POINTER:
            ptr = pairs[i + 1]
        elif key == CU_LAUNCH_PARAM_BUFFER_SIZE:
            size_ptr = pairs[i + 1]
    if not ptr or not size_ptr:
        return None
    size = ctypes.c_size_t.from_address(size_ptr).value
    return ctypes.string_at(ptr, size)


def memcpy_address(base: int, x: int, y: int, z: int, pitch: int, height: int) -> int:
    return base + x + y * pitch + z * pitch * height
