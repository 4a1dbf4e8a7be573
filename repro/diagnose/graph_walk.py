"""Walking a captured CUDA graph: every node, child graphs flattened, its words handed to a sorter.

Kernel nodes give their whole parameter buffer (per-parameter offsets and sizes from
``cuFuncGetParamInfo`` / ``cuKernelGetParamInfo``, or the single ``extra`` buffer cuBLASLt's
kernels pass), memcpy and memset nodes their device pointers. A graph's kernel words are
gathered as it is read (words.Chunks) and sorted in one pass after its last node, by a
words.Matcher or words.Deferred. A node that cannot be read is listed in the census's
``unreadable`` and counted, never guessed.
"""

from __future__ import annotations

import time

from repro.diagnose.captured import GraphCensus, short_name
from repro.diagnose.cuda_driver import (
    CU_MEMORYTYPE_DEVICE,
    CU_MEMORYTYPE_UNIFIED,
    Driver,
    DriverError,
    KernelNodeParams,
    NodeKind,
    function_info,
    memcpy_address,
    param_chunks,
    read_extra,
)
from repro.diagnose.words import Chunks, Matcher


def read_kernel(
    driver: Driver, census: GraphCensus, match: Matcher, index: int, node: int, chunks: Chunks | None = None
) -> None:
    """One kernel node's parameter bytes into chunks (the graph's, sorted by pool once read_graph
    has read every node); without chunks, sorted now."""
    now = chunks is None
    chunks = Chunks() if now else chunks
    read_kernel_params(driver, census, index, driver.kernel_params(node), chunks)
    if now:
        match.add_chunks(census, chunks)


def read_kernel_params(driver: Driver, census: GraphCensus, index: int, p: KernelNodeParams, chunks: Chunks) -> None:
    """read_kernel for parameters already read from the driver."""
    name, layout = function_info(driver, p)
    census.kernels += 1
    if p.kernelParams:
        if isinstance(layout, DriverError):
            census.unreadable.append(f"node {index} kernel {short_name(name)}: {layout}")
            return
        got, missing = param_chunks(layout.slots.from_address(p.kernelParams), layout)
        if missing:
            census.unreadable.append(f"node {index} kernel {short_name(name)}: {missing}")
        for buf, base in got:
            census.words += chunks.add(index, name, buf, base, layout.where)
    elif p.extra:
        buf = read_extra(p.extra)
        if buf is None:
            census.unreadable.append(
                f"node {index} kernel {short_name(name)}: 'extra' holds no CU_LAUNCH_PARAM_BUFFER_POINTER/SIZE pair"
            )
            return
        census.words += chunks.add(index, name, buf, 0, extra_where)
    else:
        try:
            pairs = driver.param_layout(p)
        except DriverError:
            pairs = []
        if pairs:
            census.unreadable.append(
                f"node {index} kernel {short_name(name)}: {len(pairs)} parameters but neither kernelParams nor extra"
            )


def extra_where(offset: int) -> str:
    return f"extra +{offset}"


def read_memcpy(driver: Driver, census: GraphCensus, match: Matcher, index: int, node: int) -> None:
    p = driver.memcpy_params(node)
    census.words += 2
    if p.srcMemoryType in (CU_MEMORYTYPE_DEVICE, CU_MEMORYTYPE_UNIFIED):
        match.add(
            census,
            index,
            NodeKind.MEMCPY,
            "",
            "src",
            0,
            memcpy_address(p.srcDevice, p.srcXInBytes, p.srcY, p.srcZ, p.srcPitch, p.srcHeight),
        )
    if p.dstMemoryType in (CU_MEMORYTYPE_DEVICE, CU_MEMORYTYPE_UNIFIED):
        match.add(
            census,
            index,
            NodeKind.MEMCPY,
            "",
            "dst",
            0,
            memcpy_address(p.dstDevice, p.dstXInBytes, p.dstY, p.dstZ, p.dstPitch, p.dstHeight),
        )


def read_memset(driver: Driver, census: GraphCensus, match: Matcher, index: int, node: int) -> None:
    census.words += 1
    match.add(census, index, NodeKind.MEMSET, "", "dst", 0, driver.memset_params(node).dst)


READERS = {NodeKind.KERNEL: read_kernel, NodeKind.MEMCPY: read_memcpy, NodeKind.MEMSET: read_memset}


def read_graph(
    driver: Driver, census: GraphCensus, match: Matcher, graph: int, depth: int = 0, chunks: Chunks | None = None
) -> None:
    """Every node of the graph, child graphs flattened into the same node numbering; the
    kernels' words are sorted by pool once, after the last node (one pass, not one per node)."""
    top = chunks is None
    chunks = Chunks() if top else chunks
    kernel_node = getattr(driver, "kernel_node", None)  # stand-in drivers may lack it
    types = census.node_types
    for node in driver.nodes(graph):
        index = census.nodes
        census.nodes += 1
        try:
            p = kernel_node(node) if kernel_node is not None else None
            if p is not None:  # most nodes: a kernel, read with one driver call
                types[NodeKind.KERNEL] = types.get(NodeKind.KERNEL, 0) + 1
                read_kernel_params(driver, census, index, p, chunks)
                continue
            kind = driver.node_type(node)
            types[kind] = types.get(kind, 0) + 1
            if kind == NodeKind.GRAPH and depth < 8:
                read_graph(driver, census, match, driver.child_graph(node), depth + 1, chunks)
            elif kind == NodeKind.KERNEL:
                read_kernel(driver, census, match, index, node, chunks)
            elif kind in READERS:
                READERS[kind](driver, census, match, index, node)
        except DriverError as e:
            census.unreadable.append(f"node {index}: {e}")
    if top:
        sort_words(census, match, chunks)


def sort_words(census: GraphCensus, match: Matcher, chunks: Chunks) -> None:
    """The kernels' words of a graph read into chunks, sorted by pool in one pass (timed apart
    from the reading: census.sort_seconds)."""
    t0 = time.perf_counter()
    match.add_chunks(census, chunks)
    census.sort_seconds += time.perf_counter() - t0
