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
    "pre": '''
    def _get_full_lm_head_weight(self) -> torch.Tensor:
        head = self.lm_head.weight
        if get_tensor_model_parallel_world_size() > 1:
            head = tensor_model_parallel_all_gather(head, dim=0)
        return head[: self.vocab]
''',
    "fixed": '''
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
''',
    # another attribute name, annotated assignment, getattr read-back, extra temporaries
    "fixed_variant": '''
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
''',
    # stores it but never reads it back: not a cache
    "write_only": '''
    def _get_full_lm_head_weight(self) -> torch.Tensor:
        head = tensor_model_parallel_all_gather(self.lm_head.weight, dim=0)
        self._last_gathered = head[: self.vocab]
        return head[: self.vocab]
''',
    # a reset and an unrelated attribute are not a cache of the gathered weight
    "reset_only": '''
    def _get_full_lm_head_weight(self) -> torch.Tensor:
        self._gathered = None
        self.calls = self.calls + 1
        head = tensor_model_parallel_all_gather(self.lm_head.weight, dim=0)
        return head[: self.vocab]
''',
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

CONVERT = '''
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
'''

BUILD = '''
self.moe_quant_config = self.get_fused_moe_quant_config(layer)
self.moe_kernel = make_nvfp4_moe_kernel(
    moe_quant_config=self.moe_quant_config,
    backend=self.backend,
)
'''

REFRESH = '''
self.moe_quant_config.g1_alphas.copy_(w13_scale_2)
self.moe_quant_config.g2_alphas.copy_(w2_scale_2)
'''

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
        "subscript": "cfg = self.moe_quant_config\ncfg.g1_alphas[...] = w13_scale_2\n"
                     "cfg.g2_alphas[:] = w2_scale_2\n",
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
        body = ("if (\n    self.moe_kernel is None  # first load only\n    and self.moe is not None\n"
                "):\n" + block(BUILD, 4))
    elif guard == "getattr":
        body = 'if getattr(self, "moe_kernel", None) is None:\n' + block(BUILD, 4)
    elif guard == "not":
        body = "if not self.moe_kernel:\n" + block(BUILD, 4)
    elif guard == "else_of_not_none":
        body = "if self.moe_kernel is not None:\n    pass\nelse:\n" + block(BUILD, 4)
    elif guard == "early_return":
        body = ("if self.moe_kernel is not None:\n"
                + block(reuse, 4) + "    " + PWAL_CALL + "    return\n" + BUILD)
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
        tail = dedent('''
            def _refresh_alphas(self, new_g1, new_g2) -> None:
                self.moe_quant_config.g1_alphas.copy_(new_g1)
                self.moe_quant_config.g2_alphas.copy_(new_g2)
            ''')
    return text + ("\n" + tail if tail else "")


def nvfp4_source(guard: str = "none", refresh: str = "none", prefix: str = "") -> str:
    return NVFP4_HEADER + prefix + textwrap.indent(setup_kernel(guard, refresh), "    ")


# The three upstream states the audit must tell apart.
PRE_FIX = {"guard": "none", "refresh": "none"}
ONLY_50074 = {"guard": "is_none", "refresh": "none"}
ALL_FIXES = {"guard": "is_none", "refresh": "else_branch"}


# --------------------------------------------------------------------------- trees

def write_tree(root: Path, files: dict[str, str], version: str | None = None,
               dist_info: bool = False) -> Path:
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
    return (f"Metadata-Version: 2.4\nName: vllm\nVersion: {version}\nSummary: synthetic\n\n"
            "Version: 9.9.9 is only mentioned in the body\n")


def source_files(gemma: str | None = "fixed", guard: str | None = "is_none",
                 refresh: str = "else_branch") -> dict[str, str]:
    files = {}
    if gemma is not None:
        files[GEMMA] = gemma_source(gemma)
    if guard is not None:
        files[NVFP4] = nvfp4_source(guard, refresh)
    return files


# --------------------------------------------------------------------------- archives

def make_wheel(path: Path, files: dict[str, str], version: str | None,
               dist_info: bool = True) -> Path:
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
