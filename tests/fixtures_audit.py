"""Synthetic vLLM source trees and archives for tests/test_audit.py.

The sources imitate the shape of the upstream files (a method per fix, same attribute
names where the rule keys on them) but are written for these tests; they are never run,
only parsed. The package's __init__ raises, so a test notices if anything imports it.
"""

from __future__ import annotations

import io
import tarfile
import textwrap
import zipfile
from pathlib import Path

GEMMA = "vllm/model_executor/models/gemma4_mtp.py"
NVFP4 = "vllm/model_executor/layers/quantization/online/nvfp4.py"
V2_RUNNER = "vllm/v1/worker/gpu/model_runner.py"
BLOCK_TABLE = "vllm/v1/worker/gpu/block_table.py"
WORKER = "vllm/v1/worker/gpu_worker.py"

TRAP_INIT = 'raise RuntimeError("the audit must never import vllm")\n'


def dedent(text: str) -> str:
    return textwrap.dedent(text).lstrip("\n")


# --------------------------------------------------------------------------- gemma4_mtp.py

GEMMA_HEADER = dedent('''
    """Gemma 4 assistant drafter (synthetic test source)."""
    import torch
    from torch import nn

    from vllm.distributed import (
        get_tensor_model_parallel_world_size,
        tensor_model_parallel_all_gather,
    )


    class Gemma4MTP(nn.Module):
        def __init__(self, vocab: int) -> None:
            super().__init__()
            self.vocab = vocab
''')

# Each body is the method only, indented for the class.
GEMMA_BODIES = {
    # gathers into a local, returns it: the graph holds a tensor nobody keeps alive
    "pre": """
    def _get_full_lm_head_weight(self) -> torch.Tensor:
        head = self.lm_head.weight
        if get_tensor_model_parallel_world_size() > 1:
            head = tensor_model_parallel_all_gather(head, dim=0)
        return head[: self.vocab]
""",
    "fixed": """
    def _get_full_lm_head_weight(self) -> torch.Tensor:
        if self._stable_full_lm_head_weight is not None:
            return self._stable_full_lm_head_weight
        head = self.lm_head.weight
        world = get_tensor_model_parallel_world_size()
        if world > 1:
            head = tensor_model_parallel_all_gather(head, dim=0)
        head = head[: self.vocab]
        if world > 1:
            head = head.contiguous()
            self._stable_full_lm_head_weight = head
        return head
""",
    # another attribute name, annotated assignment, getattr read-back, extra temporaries
    "fixed_variant": """
    def _get_full_lm_head_weight(self):
        cached = getattr(self, "_full_vocab_head", None)
        if cached is not None:  # reuse: captured graphs point at this storage
            return cached
        shard = self.lm_head.weight
        full = (
            tensor_model_parallel_all_gather(shard, dim=0)
            if get_tensor_model_parallel_world_size() > 1
            else shard
        )
        sliced = full[: self.vocab].contiguous()
        self._full_vocab_head: torch.Tensor = sliced
        return sliced
""",
    # stores it but never reads it back: not a cache
    "write_only": """
    def _get_full_lm_head_weight(self) -> torch.Tensor:
        head = tensor_model_parallel_all_gather(self.lm_head.weight, dim=0)
        self._last_gathered = head[: self.vocab]
        return head[: self.vocab]
""",
    # a reset and an unrelated attribute are not a cache of the gathered weight
    "reset_only": """
    def _get_full_lm_head_weight(self) -> torch.Tensor:
        self._gathered = None
        self.calls = self.calls + 1
        head = tensor_model_parallel_all_gather(self.lm_head.weight, dim=0)
        return head[: self.vocab]
""",
}


def gemma_source(variant: str) -> str:
    return GEMMA_HEADER + textwrap.indent(dedent(GEMMA_BODIES[variant]), "    ")


# --------------------------------------------------------------------------- online/nvfp4.py

NVFP4_HEADER = dedent('''
    """Online NVFP4 MoE method (synthetic test source)."""
    from torch.nn import Module

    from vllm.model_executor.layers.fused_moe.oracle.nvfp4 import (
        convert_to_nvfp4_moe_kernel_format,
        make_nvfp4_moe_kernel,
    )
    from vllm.model_executor.utils import replace_parameter


    class Nvfp4OnlineMoEMethod:
        def __init__(self, moe) -> None:
            self.moe = moe
            self.moe_kernel = None
            self.moe_quant_config = None

        def process_weights_after_loading(self, layer: Module) -> None:
            self._setup_kernel(layer)

''')

CONVERT = """
w13, w13_scale_2, w2, w2_scale_2 = convert_to_nvfp4_moe_kernel_format(
    backend=self.backend,
    layer=layer,
)
for name, value in (
    ("w13_weight", w13),
    ("w13_weight_scale_2", w13_scale_2),
    ("w2_weight", w2),
    ("w2_weight_scale_2", w2_scale_2),
):
    replace_parameter(layer, name, value)
"""

BUILD = """
self.moe_quant_config = self.get_fused_moe_quant_config(layer)
self.moe_kernel = make_nvfp4_moe_kernel(
    moe_quant_config=self.moe_quant_config,
    backend=self.backend,
)
"""

REFRESH = """
self.moe_quant_config.g1_alphas.copy_(w13_scale_2)
self.moe_quant_config.g2_alphas.copy_(w2_scale_2)
"""

PWAL_CALL = "self.moe_kernel.fused_experts.process_weights_after_loading(layer)\n"


def block(code: str, spaces: int) -> str:
    return textwrap.indent(dedent(code), " " * spaces)


def setup_kernel(guard: str = "none", refresh: str = "none") -> str:
    """The body of _setup_kernel (indented for a method) for a guard/refresh combination.

    guard:   none | is_none | paren | getattr | not | else_of_not_none | early_return
    refresh: none | else_branch | unconditional | after_pwal | only_g1 | alias | helper |
             subscript
    """
    head = "def _setup_kernel(self, layer) -> None:\n" + block(CONVERT, 4)
    refresh_code = {
        "none": "",
        "else_branch": REFRESH,
        "unconditional": REFRESH,
        "after_pwal": REFRESH,
        "only_g1": "self.moe_quant_config.g1_alphas.copy_(w13_scale_2)\n",
        "alias": "cfg = self.moe_quant_config\ng1 = cfg.g1_alphas\ng1.copy_(w13_scale_2)\n"
        "cfg.g2_alphas.copy_(w2_scale_2, non_blocking=True)\n",
        "helper": "self._refresh_alphas(w13_scale_2, w2_scale_2)\n",
        "subscript": "cfg = self.moe_quant_config\ncfg.g1_alphas[...] = w13_scale_2\ncfg.g2_alphas[:] = w2_scale_2\n",
    }[refresh]
    in_else = refresh in ("else_branch", "only_g1", "alias", "helper", "subscript")
    reuse = refresh_code if in_else else ""
    if guard == "none":
        body = BUILD
    elif guard == "is_none":
        body = "if self.moe_kernel is None:\n" + block(BUILD, 4)
        if reuse:
            body += "else:\n    # reused kernel: refresh its scales\n" + block(reuse, 4)
            reuse = ""
    elif guard == "paren":
        body = "if (\n    self.moe_kernel is None  # first load only\n    and self.moe is not None\n):\n" + block(
            BUILD, 4
        )
    elif guard == "getattr":
        body = 'if getattr(self, "moe_kernel", None) is None:\n' + block(BUILD, 4)
    elif guard == "not":
        body = "if not self.moe_kernel:\n" + block(BUILD, 4)
    elif guard == "else_of_not_none":
        body = "if self.moe_kernel is not None:\n    pass\nelse:\n" + block(BUILD, 4)
    elif guard == "early_return":
        body = "if self.moe_kernel is not None:\n" + block(reuse, 4) + "    " + PWAL_CALL + "    return\n" + BUILD
        reuse = ""
    else:
        raise ValueError(guard)
    tail = ""
    if reuse:
        body += reuse
    if refresh == "unconditional":
        body += REFRESH
    body += PWAL_CALL
    if refresh == "after_pwal":
        body += REFRESH
    text = head + block(body, 4)
    if refresh == "helper":
        tail = dedent("""
            def _refresh_alphas(self, new_g1, new_g2) -> None:
                self.moe_quant_config.g1_alphas.copy_(new_g1)
                self.moe_quant_config.g2_alphas.copy_(new_g2)
            """)
    return text + ("\n" + tail if tail else "")


def nvfp4_source(guard: str = "none", refresh: str = "none", prefix: str = "") -> str:
    return NVFP4_HEADER + prefix + textwrap.indent(setup_kernel(guard, refresh), "    ")


# The three upstream states the audit must tell apart.
PRE_FIX = {"guard": "none", "refresh": "none"}
ONLY_50074 = {"guard": "is_none", "refresh": "none"}
ALL_FIXES = {"guard": "is_none", "refresh": "else_branch"}


# --------------------------------------------------------------------------- Model Runner V2
#
# Three files, in the shape of vLLM's (gpu/model_runner.py, gpu/block_table.py, gpu_worker.py),
# each assembled from named pieces so a test picks the upstream state it needs.

RUNNER_HEADER = dedent('''
    """Model Runner V2 (synthetic test source)."""
    import torch

    from vllm.v1.worker.gpu.attn_utils import init_kv_cache
    from vllm.v1.worker.gpu.block_table import BlockTables
    from vllm.v1.worker.workspace import current_workspace_manager, lock_workspace


    class GPUModelRunner:
        def __init__(self, vllm_config, device) -> None:
            self.vllm_config = vllm_config
            self.device = device
            self.speculator = None
            self.cudagraph_manager = None

        def _dummy_run(self, num_tokens: int) -> None:
            self.execute_model(num_tokens, dummy_run=True)

''')

# initialize_kv_cache: where the block tables (and their layout tensors) are made.
KV_INIT = {
    # the worker decides the pool scope: everything made here is inside it
    "unscoped": """
    def initialize_kv_cache(self, kv_cache_config) -> None:
        self.kv_cache_config = kv_cache_config
        self.block_tables = BlockTables(
            block_sizes=[group.block_size for group in kv_cache_config.groups],
            max_num_reqs=self.max_num_reqs,
            device=self.device,
        )
        self.kv_caches = init_kv_cache(kv_cache_config, self.device)
""",
    # the pool context comes in and is entered only around the backing allocation
    "scoped": """
    def initialize_kv_cache(
        self,
        kv_cache_config,
        is_profiling: bool = False,
        kv_cache_allocation_context=None,
    ) -> None:
        self.kv_cache_config = kv_cache_config
        self.block_tables = BlockTables(
            block_sizes=[group.block_size for group in kv_cache_config.groups],
            max_num_reqs=self.max_num_reqs,
            device=self.device,
        )
        self.kv_caches = init_kv_cache(
            kv_cache_config,
            self.device,
            kv_cache_allocation_context=kv_cache_allocation_context,
        )
""",
    # takes the parameter but drops it: not a scope
    "ignored_param": """
    def initialize_kv_cache(self, kv_cache_config, kv_cache_allocation_context=None) -> None:
        self.block_tables = BlockTables(
            block_sizes=[group.block_size for group in kv_cache_config.groups],
            max_num_reqs=self.max_num_reqs,
            device=self.device,
        )
        self.kv_caches = init_kv_cache(kv_cache_config, self.device)
""",
}

# post_kv_cache_wake_up: what the runner does to the layout at a KV-cache wake.
WAKE_HOOK = {
    "none": "",
    "rebuild": """
    def post_kv_cache_wake_up(self) -> None:
        self.block_tables.init_block_table_layout_tensors()
""",
    "in_place": """
    def post_kv_cache_wake_up(self) -> None:
        # the draft graph holds these addresses: new values, same storage
        self.block_tables.refresh_block_table_layout_tensors()
""",
    # the hook writes the tensor itself, on the runner's side
    "rebuild_inline": """
    def post_kv_cache_wake_up(self) -> None:
        tables = self.block_tables
        self.block_tables.block_sizes_tensor = torch.tensor(tables.block_sizes, device=self.device)
""",
    # a tensor made by a function of another file
    "rebuild_wrapper": """
    def post_kv_cache_wake_up(self) -> None:
        self.block_tables.num_blocks = make_uva_tensor((2, self.max_num_reqs), dtype=torch.int32)
""",
    # the whole BlockTables made anew
    "rebuild_object": """
    def post_kv_cache_wake_up(self) -> None:
        self.block_tables = BlockTables(self.block_sizes, self.max_num_reqs, self.device)
""",
    # one tensor of the layout still rebuilt next to an in-place refresh
    "half_in_place": """
    def post_kv_cache_wake_up(self) -> None:
        self.block_tables.refresh_pointers_only()
""",
    # delegates to code in none of the three files
    "unreadable": """
    def post_kv_cache_wake_up(self) -> None:
        self.block_tables.restore_layout_after_wake()
""",
}

CAPTURE = """
@torch.inference_mode()
def capture_model(self, *, profile_only: bool = False) -> int:
    if not self.cudagraph_manager.needs_capture():
        return 0
    start_free = torch.cuda.mem_get_info()[0]
    self.cudagraph_manager.capture(
        self.model,
        self.input_buffers,
        self.block_tables,
    )
    if self.speculator is not None:
        self.speculator.capture()
    end_free = torch.cuda.mem_get_info()[0]
{tail}    return start_free - end_free
"""

# What capture_model does after its last capture call (the {tail} above), plus methods it needs.
CAPTURE_TAIL = {
    "unlocked": ("", ""),
    "locked": (
        "    if not profile_only:\n"
        "        # a later growth must raise, not replace the arena the graphs read\n"
        "        lock_workspace()\n",
        "",
    ),
    "manager_lock": ("    current_workspace_manager().lock()\n", ""),
    "helper_lock": ("    self._seal_workspace()\n", "\ndef _seal_workspace(self) -> None:\n    lock_workspace()\n"),
    "helper_no_lock": (
        "    self._log_capture(start_free - end_free)\n",
        "\ndef _log_capture(self, size: int) -> None:\n    self.graph_bytes = size\n",
    ),
    # a mixin method from another file: the rule cannot read it
    "unread_helper": ("    self._finish_capture()\n", ""),
}


def capture_source(tail: str) -> str:
    code, extra = CAPTURE_TAIL[tail]
    return dedent(CAPTURE).replace("{tail}", code) + extra


# Upstream never wrote these; they are the shapes the rule must not guess about.
CAPTURE_ODD = {
    # the lock comes first, the capture after it
    "lock_before": """
    def capture_model(self) -> int:
        lock_workspace()
        self.cudagraph_manager.capture(self.model, self.input_buffers)
        return 0
""",
    # graphs are recorded by something the rule does not recognise as a capture
    "no_capture_call": """
    def capture_model(self) -> int:
        return self.graph_runner.record_all(self.model, self.input_buffers)
""",
}


def runner_source(capture: str = "unlocked", wake: str = "rebuild", kv_init: str = "unscoped") -> str:
    capture_code = dedent(CAPTURE_ODD[capture]) if capture in CAPTURE_ODD else capture_source(capture)
    parts = [dedent(KV_INIT[kv_init]), dedent(WAKE_HOOK[wake]), capture_code]
    return RUNNER_HEADER + "\n".join(textwrap.indent(p, "    ") for p in parts if p)


BLOCK_TABLE_SOURCE = dedent('''
    """Block tables of Model Runner V2 (synthetic test source)."""
    import torch


    class BlockTables:
        def __init__(self, block_sizes, max_num_reqs, device) -> None:
            self.block_sizes = block_sizes
            self.device = device
            # one [max_num_reqs, max_blocks] table per KV-cache group, and its gathered copy
            self.tables = [
                torch.zeros(max_num_reqs, 64, dtype=torch.int32, device=device)
                for _ in block_sizes
            ]
            self.inputs = [torch.zeros_like(t) for t in self.tables]
            self.init_block_table_layout_tensors()

        def _addresses(self, tensors):
            return torch.tensor(
                [t.data_ptr() for t in tensors], dtype=torch.uint64, device=self.device
            )

        def init_block_table_layout_tensors(self) -> None:
            # the layout the Triton kernels and the fused draft graph read by address
            self.block_table_ptrs = self._addresses(self.tables)
            self.block_table_strides = torch.tensor(
                [t.stride(0) for t in self.tables], dtype=torch.int64, device=self.device
            )
            self.block_sizes_tensor = torch.tensor(
                self.block_sizes, dtype=torch.int32, device=self.device
            )
            self.input_block_table_ptrs = self._addresses(self.inputs)

        def refresh_block_table_layout_tensors(self) -> None:
            self.block_table_ptrs.copy_(self._addresses(self.tables))
            self.block_table_strides[:] = torch.tensor([t.stride(0) for t in self.tables])
            self.block_sizes_tensor.copy_(torch.tensor(self.block_sizes, dtype=torch.int32))
            self.input_block_table_ptrs.copy_(self._addresses(self.inputs))

        def refresh_pointers_only(self) -> None:
            # in place for the pointers, but a new tensor for the slot-mapping flags
            self.block_table_ptrs.copy_(self._addresses(self.tables))
            self.slot_mapping_enabled = torch.tensor(self.enabled, dtype=torch.bool)
''')

WORKER_HEADER = dedent('''
    """GPU worker (synthetic test source)."""
    from contextlib import nullcontext

    from vllm.v1.worker.workspace import is_workspace_manager_initialized, lock_workspace


    class Worker:
        def _maybe_get_memory_pool_context(self, tag: str):
            if not self.vllm_config.model_config.enable_sleep_mode:
                return nullcontext()
            return self.allocator.use_memory_pool(tag=tag)

''')

WORKER_KV_INIT = {
    "pool": """
    def initialize_from_config(self, kv_cache_config) -> None:
        with self._maybe_get_memory_pool_context(tag="kv_cache"):
            self.model_runner.initialize_kv_cache(kv_cache_config)
""",
    # the older spelling: the pool bound to a local first
    "pool_alias": """
    def initialize_from_config(self, kv_cache_config) -> None:
        if self.vllm_config.model_config.enable_sleep_mode:
            context = self.allocator.use_memory_pool(tag="kv_cache")
        else:
            context = nullcontext()
        with context:
            self.model_runner.initialize_kv_cache(kv_cache_config)
""",
    "passed": """
    def initialize_from_config(self, kv_cache_config) -> None:
        self.model_runner.initialize_kv_cache(
            kv_cache_config,
            kv_cache_allocation_context=self._maybe_get_memory_pool_context(tag="kv_cache"),
        )
""",
    # no pool in sight
    "bare": """
    def initialize_from_config(self, kv_cache_config) -> None:
        self.model_runner.initialize_kv_cache(kv_cache_config)
""",
}

WORKER_WARMUP = """
def compile_or_warm_up_model(self) -> int:
    kernel_warmup(self)
    cuda_graph_memory_bytes = 0
    if not self.model_config.enforce_eager:
        cuda_graph_memory_bytes = self.model_runner.capture_model()
    self.model_runner.warmup_kernels()
{lock}    return cuda_graph_memory_bytes
"""

WORKER_LOCK = {
    "none": "",
    "after_capture": (
        "    # every path ends warmup here, captured or not\n"
        "    if is_workspace_manager_initialized():\n"
        "        lock_workspace()\n"
    ),
}

WORKER_WAKE = {
    "hook": """
    def wake_up(self, tags=None) -> None:
        self.allocator.wake_up(tags)
        if tags is None or "kv_cache" in tags:
            self.model_runner.post_kv_cache_wake_up()
""",
    # the hook reached through a worker helper
    "hook_helper": """
    def wake_up(self, tags=None) -> None:
        self.allocator.wake_up(tags)
        self._after_wake(tags)

    def _after_wake(self, tags) -> None:
        if tags is None or "kv_cache" in tags:
            self.model_runner.post_kv_cache_wake_up()
""",
    "no_hook": """
    def wake_up(self, tags=None) -> None:
        # the layout lives outside the kv_cache pool: nothing to rebuild
        self.allocator.wake_up(tags)
""",
}


def worker_source(kv_init: str = "pool", lock: str = "none", wake: str = "hook") -> str:
    parts = [
        dedent(WORKER_KV_INIT[kv_init]),
        dedent(WORKER_WARMUP).replace("{lock}", WORKER_LOCK[lock]),
        dedent(WORKER_WAKE[wake]),
    ]
    return WORKER_HEADER + "\n".join(textwrap.indent(p, "    ") for p in parts)


def v2_files(
    capture: str = "unlocked",
    wake: str = "rebuild",
    kv_init: str = "unscoped",
    worker_kv_init: str = "pool",
    worker_lock: str = "none",
    worker_wake: str = "hook",
) -> dict[str, str]:
    return {
        V2_RUNNER: runner_source(capture, wake, kv_init),
        BLOCK_TABLE: BLOCK_TABLE_SOURCE,
        WORKER: worker_source(worker_kv_init, worker_lock, worker_wake),
    }


# The upstream states the V2 rules must tell apart.
V2_PRE_FIX = {}  # unlocked; layout rebuilt at wake
V2_ONLY_LOCK = {"capture": "locked"}  # #55341 alone
V2_IN_PLACE = {"capture": "locked", "wake": "in_place"}  # #53197's in-place refresh
V2_ALL_FIXES = {
    "capture": "locked",
    "kv_init": "scoped",
    "worker_kv_init": "passed",
    "worker_wake": "no_hook",
}  # #55341 + #53508 as merged


# --------------------------------------------------------------------------- trees


def write_tree(root: Path, files: dict[str, str], version: str | None = None, dist_info: bool = False) -> Path:
    """Write `files` ("vllm/...": text) under root, plus a trap __init__ and version."""
    root.mkdir(parents=True, exist_ok=True)
    files = {"vllm/__init__.py": TRAP_INIT, **files}
    if version is not None:
        files.setdefault("vllm/_version.py", f"__version__ = version = '{version}'\n")
        if dist_info:
            files[f"vllm-{version}.dist-info/METADATA"] = metadata(version)
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def metadata(version: str) -> str:
    return (
        f"Metadata-Version: 2.4\nName: vllm\nVersion: {version}\nSummary: synthetic\n\n"
        "Version: 9.9.9 is only mentioned in the body\n"
    )


def source_files(
    gemma: str | None = "fixed", guard: str | None = "is_none", refresh: str = "else_branch", v2: dict | None = None
) -> dict[str, str]:
    """The tree's audited files; `v2` (keyword arguments of v2_files) adds Model Runner V2."""
    files = {}
    if gemma is not None:
        files[GEMMA] = gemma_source(gemma)
    if guard is not None:
        files[NVFP4] = nvfp4_source(guard, refresh)
    if v2 is not None:
        files.update(v2_files(**v2))
    return files


# --------------------------------------------------------------------------- archives


def make_wheel(path: Path, files: dict[str, str], version: str | None, dist_info: bool = True) -> Path:
    members = {"vllm/__init__.py": TRAP_INIT, **files}
    if version is not None and dist_info:
        members[f"vllm-{version}.dist-info/METADATA"] = metadata(version)
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        for rel, text in members.items():
            archive.writestr(rel, text)
    return path


def make_sdist(path: Path, files: dict[str, str], version: str) -> Path:
    top = f"vllm-{version}"
    members = {"vllm/__init__.py": TRAP_INIT, **files, "PKG-INFO": metadata(version)}
    # A nested copy deeper in the tree (as test data would be) must not be picked.
    members["tests/data/vllm/__init__.py"] = TRAP_INIT
    members[f"tests/data/{GEMMA}"] = gemma_source("pre")
    with tarfile.open(path, "w:gz") as archive:
        for rel, text in members.items():
            data = text.encode()
            info = tarfile.TarInfo(f"{top}/{rel}")
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return path


def line_of(text: str, needle: str, occurrence: int = 1) -> int:
    """1-based line of the n-th line containing `needle` (for asserting evidence lines)."""
    seen = 0
    for number, line in enumerate(text.splitlines(), start=1):
        if needle in line:
            seen += 1
            if seen == occurrence:
                return number
    raise AssertionError(f"{needle!r} not found")
