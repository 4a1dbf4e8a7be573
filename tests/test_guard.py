"""CaptureGuard on CPU: the same dispatch-mode recording a CUDA capture gets, minus the graph."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from repro.diagnose.guard import CaptureGuard, StaleCaptureError
from repro.outcome import Finding, Manifest

THIS_FILE = Path(__file__).name
STATIC_IN = torch.ones(16, 64)  # a static input buffer that outlives every graph here


def line_of(marker: str) -> int:
    """Line number of the source line carrying `# <marker>` in this file."""
    for number, text in enumerate(Path(__file__).read_text().splitlines(), start=1):
        if text.rstrip().endswith(f"# {marker}"):
            return number
    raise AssertionError(f"marker {marker!r} not found")


@pytest.fixture(autouse=True)
def no_grad():
    # Autograd would keep captured inputs alive through saved tensors; capture code runs without.
    with torch.no_grad():
        yield


def make_scratch() -> torch.Tensor:
    return torch.full((64, 8), 2.0)  # created-scratch


def setup_graph(guard: CaptureGuard, static_in: torch.Tensor) -> torch.Tensor:
    """Like the unfixed Gemma4 capture: a buffer held only by a local of the setup routine."""
    scratch = make_scratch()
    with guard.recording("centroids bs=16"):
        out = static_in @ scratch
    return out


class Kernel:
    """A kernel object like vLLM's modular MoE kernel: device tensors outside any parameter."""

    def __init__(self, n: int = 32):
        self.workspace13 = torch.zeros(n)
        self.strides = [torch.arange(4)]


@dataclasses.dataclass
class QuantConfig:
    g1_alphas: torch.Tensor
    g2_alphas: torch.Tensor


class MoE(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w13 = torch.nn.Parameter(torch.ones(4, 32), requires_grad=False)
        self.register_buffer("expert_map", torch.arange(4))
        self.moe_kernel = Kernel()
        self.moe_quant_config = QuantConfig(torch.ones(4), torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x @ self.w13 + self.moe_kernel.workspace13
        return h * self.moe_quant_config.g1_alphas[self.expert_map].sum()


def capture_moe(guard: CaptureGuard, moe: MoE) -> torch.Tensor:
    guard.watch("moe", moe)
    with guard.recording("moe bs=2"):
        return moe(torch.ones(2, 4))  # the input is made inside: not a slot


# -- freed / rebound / unchanged ------------------------------------------------------------------


def test_local_freed_after_setup_returns_names_creation_and_drop_sites():
    guard = CaptureGuard("warn", rank=1)
    static_in = torch.ones(16, 64)
    with guard.tracking():
        setup_graph(guard, static_in)  # dropped-scratch

    findings = guard.check("before replay, step 0")

    assert len(findings) == 1
    f = findings[0]
    assert isinstance(f, Finding)
    assert (f.status, f.graph, f.when, f.rank) == ("freed", "centroids bs=16", "before replay, step 0", 1)
    assert (f.shape, f.dtype, f.nbytes) == ([64, 8], "float32", 64 * 8 * 4)
    assert f.created_at == f"{THIS_FILE}:{line_of('created-scratch')} in make_scratch (aten.full.default)"
    assert (
        f.freed_at == f"{THIS_FILE}:{line_of('dropped-scratch')} in "
        "test_local_freed_after_setup_returns_names_creation_and_drop_sites (returned)"
    )
    assert f.slot == (
        f"<local scratch of setup_graph, created by aten.full at "
        f"{THIS_FILE}:{line_of('created-scratch')} in make_scratch>"
    )


def test_static_input_that_stays_alive_is_unchanged():
    guard = CaptureGuard("warn")
    static_in = torch.ones(16, 64)
    setup_graph(guard, static_in)

    assert sorted(s.name.split(" ")[1] for s in guard.slots) == ["scratch", "static_in"]
    findings = guard.check("before replay")
    assert [f.slot.split(" ")[1] for f in findings] == ["scratch"]  # static_in is not reported
    manifest = guard.manifest("m")
    assert (manifest.freed, manifest.unchanged) == (1, 1)


def test_owner_rebinding_is_rebound_with_old_and_new_pointer_then_freed_once():
    guard = CaptureGuard("warn")
    moe = MoE()
    capture_moe(guard, moe)
    old_kernel = moe.moe_kernel
    old_ptr = old_kernel.workspace13.data_ptr()

    moe.moe_kernel = Kernel()  # the unfixed _setup_kernel: a new kernel on every reload
    findings = {f.slot: f for f in guard.check("after reload 1")}

    ws = findings["moe.moe_kernel.workspace13"]
    assert ws.status == "rebound"
    assert ws.old_ptr == old_ptr
    assert ws.new_ptr == moe.moe_kernel.workspace13.data_ptr() != old_ptr
    assert "moe.moe_quant_config.g1_alphas" not in findings  # config untouched
    assert guard.check("after reload 1, again") == []  # each slot once per status

    del old_kernel  # the last reference: now the captured workspace is gone
    freed = {f.slot: f.status for f in guard.check("after reload 2")}
    assert freed == {"moe.moe_kernel.workspace13": "freed"}
    assert guard.check("after reload 2, again") == []


def test_parameter_data_swap_is_rebound():
    guard = CaptureGuard("warn")
    moe = MoE()
    capture_moe(guard, moe)
    old = moe.w13.data
    moe.w13.data = torch.zeros(4, 32)  # a reload that rebinds instead of copy_ into the storage

    (finding,) = guard.check("after reload")
    assert (finding.slot, finding.status) == ("moe.w13", "rebound")
    assert finding.old_ptr == old.data_ptr()
    assert finding.new_ptr == moe.w13.data_ptr()


def test_in_place_reload_is_unchanged():
    guard = CaptureGuard("warn")
    moe = MoE()
    capture_moe(guard, moe)
    moe.w13.copy_(torch.full((4, 32), 3.0))  # the safe reload: same storage, new values
    moe.moe_kernel.workspace13.zero_()

    assert guard.check("after reload") == []
    manifest = guard.manifest("after reload")
    assert manifest == Manifest(when="after reload", rank=0, freed=0, rebound=0, unchanged=len(guard.slots))
    assert manifest.unchanged == 4  # w13, expert_map, workspace13, g1_alphas


def test_storage_resized_in_place_is_moved():
    guard = CaptureGuard("warn")
    moe = MoE()
    capture_moe(guard, moe)
    storage = moe.moe_kernel.workspace13.untyped_storage()
    old = storage.data_ptr()
    storage.resize_(4096)  # same storage object, new memory (FSDP-style free/realloc)

    (finding,) = guard.check("after resize")
    assert finding.slot == "moe.moe_kernel.workspace13"
    assert finding.status == "moved"  # a status of its own, not a kind of rebound
    assert finding.old_ptr == old and finding.new_ptr == storage.data_ptr() != old
    assert "resized" in finding.message
    manifest = guard.manifest("after resize")
    assert (manifest.moved, manifest.rebound, manifest.freed) == (1, 0, 0)


class Arena(torch.nn.Module):
    """A workspace grown in place between captures (FlashInfer #4398's resize_())."""

    def __init__(self):
        super().__init__()
        self.register_buffer("ws", torch.zeros(64, dtype=torch.uint8))

    def grow(self, nbytes: int) -> None:
        self.ws.untyped_storage().resize_(nbytes)
        self.ws.set_(self.ws.untyped_storage(), 0, (nbytes,))


def record_arena(guard: CaptureGuard, arena: Arena, label: str, nbytes: int) -> int:
    with guard.recording(label):
        arena.ws[:nbytes].add_(1)
    return arena.ws.data_ptr()


def test_a_storage_moved_between_captures_tells_each_graph_its_own_address():
    """Graphs captured before a resize_() read the old memory, the one after it the new: the
    finding names only the graphs that read an address the storage left, with their view."""
    guard = CaptureGuard("warn")
    arena = Arena()
    guard.watch("arena", arena)
    at = [record_arena(guard, arena, "bs=1", 16)]
    arena.grow(4096)
    at.append(record_arena(guard, arena, "bs=2", 32))
    arena.grow(8192)
    at.append(record_arena(guard, arena, "bs=4", 8192))
    assert len(set(at)) == 3
    findings = guard.check("after capture")
    # (the slice op reads the whole arena: each slot is the arena as that capture saw it)
    assert [(f.graph, f.slot, f.status, f.old_ptr, f.nbytes) for f in findings] == [
        ("bs=1", "arena.ws", "moved", at[0], 64),
        ("bs=2", "arena.ws", "moved", at[1], 4096),
    ]
    assert all(f.new_ptr == arena.ws.data_ptr() for f in findings)
    assert "'bs=1' captured" in findings[0].message and "more graphs" not in findings[0].message
    assert guard.check("before replay", graph="bs=4") == []
    manifest = guard.manifest("after capture")
    assert (manifest.moved, manifest.unchanged) == (2, 1)


def test_a_storage_moved_inside_one_capture_is_moved_for_that_graph_at_the_first_address():
    guard = CaptureGuard("warn")
    arena = Arena()
    guard.watch("arena", arena)
    with guard.recording("piece"):
        arena.ws[:8].add_(1)
        first = arena.ws.data_ptr()
        arena.grow(4096)  # mid-capture: later ops read the new memory
        arena.ws[:8].add_(1)
    (finding,) = guard.check("before replay", graph="piece")
    assert (finding.status, finding.old_ptr, finding.new_ptr) == ("moved", first, arena.ws.data_ptr())
    assert [s.storage_ptr for s in guard.slots_of("piece")] == [first, arena.ws.data_ptr()]


def test_adopt_gives_a_storage_that_moved_a_slot_per_placement():
    guard = CaptureGuard("warn")
    arena = Arena()
    guard.watch("arena", arena)
    first = arena.ws.data_ptr()
    assert guard.adopt("g0", [word(arena.ws)], None) == []
    arena.grow(4096)
    guard.refresh_index()  # the watch hooks refresh it once per check
    assert guard.adopt("g1", [word(arena.ws)], None) == []
    (finding,) = guard.check("after capture")
    assert (finding.graph, finding.status, finding.old_ptr) == ("g0", "moved", first)
    assert [s.graphs for s in guard.slots] == [["g0"], ["g1"]]


def test_parameter_data_swap_names_the_swap_line_as_freed_at():
    guard = CaptureGuard("warn")
    moe = MoE()
    guard.watch("moe", moe)
    with guard.recording("moe bs=2"):
        project = lambda x: x @ moe.w13.t()  # noqa: E731 -- a view of w13 dies in here
        project(torch.ones(2, 32))
    # This line drops the captured storage's last reference (no Python tensor object dies):
    moe.w13.data = torch.zeros(4, 32)  # swap-w13

    (finding,) = guard.check("after reload")
    assert (finding.slot, finding.status) == ("moe.w13", "freed")
    assert finding.new_ptr == moe.w13.data_ptr()
    assert finding.freed_at == (
        f"{THIS_FILE}:{line_of('swap-w13')} in test_parameter_data_swap_names_the_swap_line_as_freed_at (reassigned)"
    )


def test_recording_leaves_a_saved_locals_dict_alone():
    # Before Python 3.13, locals() hands out the one dict cached on the frame; reading the
    # frame's f_locals would refill it, and clearing it would empty the user's dict.
    guard = CaptureGuard("warn")
    scratch = torch.full((64, 8), 2.0)
    saved = locals()
    before = dict(saved)
    with guard.recording("g"):
        STATIC_IN @ scratch
    assert saved == before and saved["scratch"] is scratch
    assert guard.slots[1].name == "<local scratch of test_recording_leaves_a_saved_locals_dict_alone>"


def test_owner_dropping_the_tensor_while_something_else_holds_it():
    guard = CaptureGuard("warn")
    moe = MoE()
    capture_moe(guard, moe)
    kept = moe.moe_quant_config.g2_alphas, moe.moe_quant_config.g1_alphas
    moe.moe_quant_config = None

    findings = {f.slot: f for f in guard.check("after reset")}
    assert findings["moe.moe_quant_config.g1_alphas"].status == "rebound"
    assert findings["moe.moe_quant_config.g1_alphas"].new_ptr is None
    assert "no longer holds a tensor" in findings["moe.moe_quant_config.g1_alphas"].message
    assert kept  # held on purpose until here


# -- what is (not) a slot -----------------------------------------------------------------------


def test_slice_view_of_live_parameter_is_named_view_and_not_flagged():
    guard = CaptureGuard("warn")
    head = torch.nn.Linear(8, 100, bias=False)
    guard.watch("drafter.lm_head", head)

    def full_lm_head_weight():  # TP=1: a slice view of the long-lived parameter
        return head.weight[:64]

    def setup():
        weight = full_lm_head_weight()
        with guard.recording("centroids bs=4"):
            torch.ones(4, 8) @ weight.t()

    setup()  # the view object dies here; the parameter's storage does not
    (slot,) = guard.slots
    assert slot.name == "drafter.lm_head.weight[view]"
    assert slot.shape == [64, 8]
    assert guard.check("before replay") == []
    assert guard.manifest("m").unchanged == 1


def test_tensors_created_inside_the_recording_are_not_slots():
    guard = CaptureGuard("warn")
    weight = torch.ones(8, 8)
    with guard.recording("g"):
        tmp = torch.zeros(8, 8)  # made inside: graph pool memory on CUDA
        tmp.add_(1)
        out = torch.empty(8, 8)
        torch.mm(tmp, weight, out=out)  # written through out=, still made inside
        del tmp
    assert [s.shape for s in guard.slots] == [[8, 8]]
    assert guard.slots[0].data_ptr == weight.data_ptr()
    assert guard.check("before replay") == []


def test_tensor_literal_made_inside_the_recording_is_not_a_slot():
    # torch.tensor(...) builds the tensor from Python data, then hands it to aten.lift_fresh:
    # the op's INPUT is new, made inside the block like any op's output.
    guard = CaptureGuard("warn")
    weight = torch.ones(3)
    with guard.recording("g"):
        scale = torch.tensor([1.0, 2.0, 3.0])
        weight * scale
        del scale
    assert [s.data_ptr for s in guard.slots] == [weight.data_ptr()]
    assert guard.check("before replay") == []


def test_out_tensor_made_outside_is_a_slot():
    guard = CaptureGuard("warn")
    a = torch.ones(4, 4)
    out = torch.empty(4, 4)
    with guard.recording("g"):
        torch.mm(a, a, out=out)
    assert sorted(s.data_ptr for s in guard.slots) == sorted([a.data_ptr(), out.data_ptr()])
    del out
    (finding,) = guard.check("before replay")
    assert finding.status == "freed"


def test_one_slot_per_storage_keeps_largest_view_and_all_graphs():
    guard = CaptureGuard("warn")
    base = torch.arange(100.0)
    for bs in (1, 2):
        with guard.recording(f"g bs={bs}"):
            base[:10].sum()
            base.sum()
            base[:50].sum()
    (slot,) = guard.slots
    assert slot.shape == [100]
    assert slot.data_ptr == base.data_ptr()
    assert slot.graphs == ["g bs=1", "g bs=2"]


def test_internal_output_of_one_graph_read_by_another_is_a_slot():
    guard = CaptureGuard("warn")
    x = torch.ones(4)
    with guard.recording("first"):
        y = x * 2
    with guard.recording("second"):
        y + 1
    assert {s.data_ptr for s in guard.slots} == {x.data_ptr(), y.data_ptr()}


# -- naming -------------------------------------------------------------------------------------


def test_watch_names_module_kernel_dataclass_and_dict():
    guard = CaptureGuard("warn")
    moe = MoE()
    scales = {"w13": torch.ones(3), "w2": torch.ones(3)}
    plain = torch.ones(2)
    guard.watch("scales", scales)
    guard.watch("plain", plain)
    capture_moe(guard, moe)
    with guard.recording("extra"):
        scales["w13"] * 2
        moe.moe_kernel.strides[0] + 1
        plain + 1

    names = {s.name for s in guard.slots}
    assert {
        "moe.w13",
        "moe.expert_map",
        "moe.moe_kernel.workspace13",
        "moe.moe_quant_config.g1_alphas",
        "moe.moe_kernel.strides[0]",
        "scales['w13']",
        "plain",
    } <= names


def test_plain_tensor_attribute_on_submodule_is_named():
    guard = CaptureGuard("warn")
    outer = torch.nn.Module()
    outer.drafter = torch.nn.Module()
    outer.drafter._stable_full_lm_head_weight = torch.ones(16, 4)  # the upstream fix's cache
    guard.watch("model", outer)
    with guard.recording("g"):
        outer.drafter._stable_full_lm_head_weight.sum()
    assert [s.name for s in guard.slots] == ["model.drafter._stable_full_lm_head_weight"]


class QuantMethod:
    """Like vLLM's online NVFP4 method: owns the kernel and config, rebuilds them on reload."""

    def __init__(self):
        self.moe_kernel = Kernel()
        self.moe_quant_config = QuantConfig(torch.ones(4), torch.ones(4))


def watch_like_nvfp4_scenario(guard: CaptureGuard, layer: torch.nn.Module, reverse: bool) -> None:
    watches = [
        ("moe", layer),
        ("moe.quant_method", layer.quant_method),
        ("moe.quant_method.moe_kernel", layer.quant_method.moe_kernel),
    ]
    for name, obj in reversed(watches) if reverse else watches:
        guard.watch(name, obj)


@pytest.mark.parametrize("order", ["outer first", "inner first"])
def test_dotted_watch_names_resolve_through_the_parent(order):
    guard = CaptureGuard("warn")
    layer = torch.nn.Module()
    layer.quant_method = QuantMethod()
    method = layer.quant_method
    watch_like_nvfp4_scenario(guard, layer, reverse=order == "inner first")
    with guard.recording("moe forward"):
        method.moe_kernel.workspace13 + method.moe_quant_config.g1_alphas.sum()
    assert sorted(s.name for s in guard.slots) == [
        "moe.quant_method.moe_kernel.workspace13",
        "moe.quant_method.moe_quant_config.g1_alphas",
    ]

    old = method.moe_kernel
    method.moe_kernel = Kernel()  # watching the old kernel object must not hide this
    (finding,) = guard.check("after reload")
    assert (finding.slot, finding.status) == ("moe.quant_method.moe_kernel.workspace13", "rebound")
    assert finding.new_ptr == method.moe_kernel.workspace13.data_ptr()

    del old
    guard.watch("extra", torch.ones(1))  # re-binding owners later keeps the parent link
    (finding,) = guard.check("after reload, old kernel gone")
    assert finding.status == "freed"
    assert finding.new_ptr == method.moe_kernel.workspace13.data_ptr()


def test_closure_local_is_named_by_the_routine_that_owns_it():
    guard = CaptureGuard("warn")

    def get_top_tokens(h, lm_head_weight):
        return (h @ lm_head_weight.t()).argmax(-1)

    def setup_centroid_graphs():
        lm_head_weight = torch.ones(32, 8) * 2  # the gathered weight: held by this local only
        body = lambda x: get_top_tokens(x, lm_head_weight)  # noqa: E731 (like the upstream code)
        with guard.recording("centroids bs=4"):
            body(STATIC_IN[:4, :8])

    with guard.tracking():
        setup_centroid_graphs()
    names = sorted(s.name for s in guard.slots)
    assert names[0].startswith("<local lm_head_weight of setup_centroid_graphs, created by aten.mul")
    assert [f.slot for f in guard.check("before replay")] == [names[0]]


def test_names_resolve_lazily_at_record_time():
    guard = CaptureGuard("warn")
    moe = MoE()
    guard.watch("moe", moe)
    moe.moe_kernel = Kernel(8)  # rebound after watch(), before capture: the new one is named
    with guard.recording("g"):
        moe.moe_kernel.workspace13 + 1
    assert [s.name for s in guard.slots] == ["moe.moe_kernel.workspace13"]
    assert guard.slots[0].data_ptr == moe.moe_kernel.workspace13.data_ptr()


def test_unwatched_tensor_without_tracking_is_still_named_by_its_holder():
    guard = CaptureGuard("warn")
    lonely = torch.ones(3)
    with guard.recording("g"):
        lonely + 1
    assert (
        guard.slots[0].name == "<local lonely of test_unwatched_tensor_without_tracking_is_still_named_by_its_holder>"
    )
    assert guard.slots[0].created_at is None


def test_a_storage_no_owner_holds_rebuilds_the_owner_index_once_not_per_capture():
    """An engine captures thousands of graphs that read the same local (a static input held by
    the runner's frame): the first miss rebuilds the owners' index, later ones do not; a tensor
    an owner gains later is still named (its miss is new). Before, every capture that read the
    local rebuilt the index (99 rebuilds, 2.8 s, in the piecewise engine profile)."""
    guard = CaptureGuard("warn")
    moe = MoE()
    guard.watch("moe", moe)
    static_in = torch.ones(4)
    for i in range(50):
        with guard.recording(f"g{i}"):
            static_in + moe.moe_kernel.workspace13[:4]
    assert guard.index_builds == 1  # built fresh in the first recording, which missed it already
    moe.moe_kernel.scale = torch.ones(4)  # gained after those captures
    with guard.recording("late"):
        static_in * moe.moe_kernel.scale
    assert "moe.moe_kernel.scale" in [s.name for s in guard.slots_of("late")]
    assert guard.index_builds == 2


def test_watch_holds_owners_weakly():
    guard = CaptureGuard("warn")
    kernel = Kernel()
    guard.watch("kernel", kernel)
    with guard.recording("g"):
        kernel.workspace13 + 1
    del kernel  # had watch() kept it alive, this bug would be invisible
    (finding,) = [f for f in guard.check("before replay") if f.slot == "kernel.workspace13"]
    assert finding.status == "freed"


# -- messages, modes, manifest, freed blocks ----------------------------------------------------


def test_freed_message_names_slot_address_and_fix():
    guard = CaptureGuard("warn")
    with guard.tracking():
        setup_graph(guard, STATIC_IN)
    (f,) = guard.check("before replay")
    assert f.message.startswith("graph 'centroids bs=16' captured tensor <local scratch of setup_graph")
    assert f"(float32[64, 8], 2 KiB) at {f.old_ptr:#x}" in f.message
    assert "has been freed (last reference dropped at" in f.message
    assert "keep the tensor alive for the graph's lifetime (cache it on the module)" in f.message
    assert "\n" not in f.message


def test_rebound_message_names_both_addresses_and_fix():
    guard = CaptureGuard("warn")
    moe = MoE()
    capture_moe(guard, moe)
    old = moe.moe_kernel
    moe.moe_kernel = Kernel()
    (f,) = [f for f in guard.check("after reload") if f.slot == "moe.moe_kernel.workspace13"]
    assert f"at {f.old_ptr:#x}" in f.message and f"at {f.new_ptr:#x}" in f.message
    assert "copy_" in f.message and "re-capture" in f.message
    assert old is not None


def test_raise_mode_raises_on_first_dead_slot():
    guard = CaptureGuard("raise")
    with guard.tracking():
        setup_graph(guard, STATIC_IN)
    with pytest.raises(StaleCaptureError, match="has been freed") as info:
        guard.check("before replay")
    assert [f.status for f in info.value.findings] == ["freed"]
    assert isinstance(info.value, RuntimeError)


def test_warn_mode_returns_findings_and_keeps_going():
    guard = CaptureGuard("warn")
    setup_graph(guard, STATIC_IN)
    assert [f.status for f in guard.check("step 0")] == ["freed"]
    assert guard.check("step 1") == []  # no exception, no repeat


def test_raise_mode_is_quiet_when_everything_is_alive():
    guard = CaptureGuard("raise")
    moe = MoE()
    capture_moe(guard, moe)
    assert guard.check("before replay") == []


def test_off_mode_records_nothing():
    guard = CaptureGuard("off")
    moe = MoE()
    with guard.tracking():
        capture_moe(guard, moe)
        setup_graph(guard, STATIC_IN)
    moe.moe_kernel = Kernel()
    assert guard.slots == []
    assert guard.check("before replay") == []
    assert guard.freed_blocks() == []
    assert guard.manifest("m") == Manifest(when="m", rank=0, freed=0, rebound=0, unchanged=0, moved=0)


def test_unknown_mode_is_rejected():
    with pytest.raises(ValueError, match="off, warn, raise"):
        CaptureGuard("loud")


def test_manifest_counts_each_state():
    guard = CaptureGuard("warn", rank=3)
    moe = MoE()
    capture_moe(guard, moe)
    total = len(guard.slots)
    keep_old = moe.moe_kernel
    moe.moe_kernel = Kernel()  # workspace13 rebound (old kernel kept)
    moe.moe_quant_config = QuantConfig(torch.ones(4), torch.ones(4))  # g1_alphas freed
    manifest = guard.manifest("after reload")
    assert (manifest.rank, manifest.freed, manifest.rebound) == (3, 1, 1)
    assert manifest.unchanged == total - 2 == 2
    assert keep_old is not None


def test_freed_blocks_lists_storage_address_size_dtype():
    guard = CaptureGuard("warn")
    big = torch.zeros(1000, dtype=torch.bfloat16)
    ptr = big.untyped_storage().data_ptr()
    with guard.recording("g"):
        big[10:20].sum()
    assert guard.freed_blocks() == []
    del big
    assert guard.freed_blocks() == [(ptr, 2000, "bfloat16")]


def test_slots_is_a_copy():
    guard = CaptureGuard("warn")
    x = torch.ones(2)
    with guard.recording("g"):
        x + 1
    guard.slots.clear()
    assert len(guard.slots) == 1


def test_mechanism_and_capture_signature():
    guard = CaptureGuard("warn")
    assert guard.mechanism == "repro dispatch-mode guard"
    import inspect

    params = inspect.signature(guard.capture).parameters
    assert list(params) == ["graph", "label", "pool", "stream", "use_torch_liveness", "fingerprint"]
    assert guard.torch_liveness_available == ("check_input_liveness" in inspect.signature(torch.cuda.graph).parameters)


def test_liveness_only_check_sees_freed_not_rebound():
    """deep=False is the per-replay fast path: it names dead storages, leaves rebinding to deep."""
    import torch
    from repro.diagnose.guard import CaptureGuard

    class Kernel:
        def __init__(self):
            self.workspace = torch.zeros(8)

    guard = CaptureGuard(mode="warn")
    kernel = Kernel()
    guard.watch("k", kernel)
    doomed = torch.ones(4)
    with guard.recording("g"):
        kernel.workspace.add_(1)
        doomed * 2
    old = kernel.workspace
    kernel.workspace = torch.zeros(8)  # rebound; the old storage stays alive via `old`
    del doomed  # freed
    fast = guard.check("fast", deep=False)
    assert [f.status for f in fast] == ["freed"]
    deep = guard.check("deep")
    assert [(f.slot, f.status) for f in deep] == [("k.workspace", "rebound")]
    assert old.numel() == 8


def test_check_limited_to_one_graph():
    import torch
    from repro.diagnose.guard import CaptureGuard

    guard = CaptureGuard(mode="warn")
    a, b = torch.ones(4), torch.ones(4)
    with guard.recording("A"):
        a * 2
    with guard.recording("B"):
        b * 2
    del a, b
    assert [f.graph for f in guard.check("x", graph="B")] == ["B"]
    assert [f.graph for f in guard.check("x")] == ["A"]  # B's slot was already reported


def test_liveness_fast_path_sees_deaths_after_a_clean_check_and_new_recordings():
    """The per-replay path caches each graph's weak refs: a clean check must not hide a later
    death, a later recording must extend what it watches, and a freed slot is reported once."""
    guard = CaptureGuard(mode="warn")
    a, b = torch.ones(4), torch.ones(4)
    with guard.recording("G"):
        a * 2
    assert guard.check("r0", graph="G", deep=False) == []  # fills the cache for G
    with guard.recording("G"):  # a second capture into G
        b * 2
    del b
    assert [f.status for f in guard.check("r1", graph="G", deep=False)] == ["freed"]
    assert guard.check("r2", graph="G", deep=False) == []  # reported once, cache rebuilt
    del a
    assert [f.status for f in guard.check("r3", graph="G", deep=False)] == ["freed"]
    assert guard.check("r4", graph="G", deep=False) == []


def test_a_rank_guard_records_without_importing_dynamo_and_the_default_stays_hidden_from_compile():
    """torch wraps a dispatch mode in torch._disable_dynamo, whose first call imports torch._dynamo
    (about 1 s warm, 4 s cold on the GPU image): the scenario ranks never compile and skip it;
    a guard for an arbitrary program (repro watch) keeps torch's wrapper."""
    import subprocess
    import sys

    code = (
        "import sys, torch\n"
        "from repro.diagnose.guard import CaptureGuard\n"
        "guard = CaptureGuard('warn', compiles=False)\n"
        "weight = torch.ones(4)\n"
        "with guard.recording('g'):\n"
        "    out = weight * 2\n"
        "print('torch._dynamo' in sys.modules, [s.name for s in guard.slots])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={**__import__("os").environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)},
    )
    dynamo_imported, slots = out.stdout.split(" ", 1)
    assert dynamo_imported == "False" and "weight" in slots
    from repro.diagnose.guard import _HiddenOpObserver, _OpObserver

    hidden = _HiddenOpObserver.__torch_dispatch__
    assert hidden is not _OpObserver.__torch_dispatch__ and hidden.__wrapped__ is _OpObserver.__torch_dispatch__
    assert CaptureGuard("warn")._observer is _HiddenOpObserver


# ------------------------------------------------------------------ the shared-pool contract

POOL, OTHER = (1, 7), (1, 9)


def piece_chain(guard: CaptureGuard, pieces: int) -> list[torch.Tensor]:
    """Piecewise capture on CPU: piece i+1 reads piece i's output, made inside piece i."""
    outs, x = [], STATIC_IN
    for i in range(pieces):
        with guard.recording(f"piece {i}"):
            x = x * 2.0 + 1.0
        outs.append(x)
    return outs


def in_pool(tensors: list[torch.Tensor], pool):
    """pool_of over the storages of `tensors` (stand-in for the allocator's segment map)."""
    addrs = {t.untyped_storage().data_ptr(): pool for t in tensors}
    return lambda ptr: addrs.get(ptr)


def test_a_freed_intermediate_in_the_graphs_own_pool_is_no_finding():
    guard = CaptureGuard(mode="warn")
    outs = piece_chain(guard, 4)
    pool_of = in_pool(outs, POOL)
    for i in range(4):
        guard.assign_pools(f"piece {i}", POOL, pool_of)
    del outs  # weak references only, as engines keep them
    assert guard.check("before replay") == []
    assert all(guard.check("before replay", graph=f"piece {i}", deep=False) == [] for i in range(4))
    assert guard.pool_managed() == 3  # pieces 1..3 each read the piece before
    assert guard.manifest("x").freed == 0


def test_without_pools_the_same_chain_reports_every_freed_intermediate():
    guard = CaptureGuard(mode="warn")
    outs = piece_chain(guard, 4)
    del outs
    assert len(guard.check("before replay")) == 3


def test_memory_of_another_graphs_pool_is_a_cross_pool_dependency_and_checked():
    guard = CaptureGuard(mode="warn")
    outs = piece_chain(guard, 2)
    pool_of = in_pool(outs, OTHER)  # piece 0's output lives in another graph's pool
    guard.assign_pools("piece 0", POOL, pool_of)
    cross = guard.assign_pools("piece 1", POOL, pool_of)
    assert [s.pool for s in cross] == [OTHER]
    del outs
    [finding] = guard.check("before replay", graph="piece 1", deep=False)
    assert finding.status == "freed" and "in graph pool (1, 9)" in finding.message


def test_a_storage_pool_managed_for_one_graph_is_still_checked_for_another():
    guard = CaptureGuard(mode="warn")
    outs = piece_chain(guard, 2)
    with guard.recording("other pool graph"):
        outs[0] + 1.0  # a graph of another pool reads piece 0's output
    pool_of = in_pool(outs, POOL)
    for label, pool in (("piece 1", POOL), ("other pool graph", OTHER)):
        guard.assign_pools(label, pool, pool_of)
    del outs
    assert guard.check("r", graph="piece 1") == []
    assert [f.graph for f in guard.check("r", graph="other pool graph")] == ["piece 1 (+1 more)"]


def test_a_check_of_one_graph_costs_what_that_graph_captured():
    guard = CaptureGuard(mode="warn")
    weights = [torch.full((8,), float(i)) for i in range(50)]
    for i, w in enumerate(weights):
        with guard.recording(f"g{i}"):
            STATIC_IN[:, :8] * w
    assert [len(guard.slots_of(f"g{i}")) for i in (0, 49)] == [2, 2]  # STATIC_IN and its weight
    assert len(guard.slots) == 51
    del weights[7]
    assert [f.graph for f in guard.check("r", graph="g7", deep=False)] == ["g7"]
    assert guard.check("r", graph="g8", deep=False) == []


def test_a_storage_known_to_be_in_the_capturing_pool_is_recorded_managed_without_naming(monkeypatch):
    guard = CaptureGuard(mode="warn")
    outs = piece_chain(guard, 1)
    calls = []
    monkeypatch.setattr("repro.diagnose.guard.holder_of", lambda *a: calls.append(a))  # naming would scan frames
    with guard.recording("piece 1", pool=POOL, pool_of=in_pool(outs, POOL)):
        outs[0] * 2.0
    [slot] = guard.slots_of("piece 1")
    assert slot.managed_in == {"piece 1"} and slot.pool == POOL and calls == []
    assert slot.name.startswith("<storage of graph pool (1, 7), read by aten.mul")
    del outs
    assert guard.check("r", graph="piece 1") == []


# -- adopt: slots from a graph census's words, nothing recorded at the dispatcher ----------------


def word(t: torch.Tensor, node: int = 0, offset: int = 0):
    """A captured word as the census gives it: an address (here into t's memory) and its site."""
    import types

    return types.SimpleNamespace(addr=t.data_ptr() + offset, describe=lambda: f"node {node} kernel k param 0 +0")


def adopt_locals(guard: CaptureGuard, moe: MoE, label: str) -> list:
    scratch = torch.ones(8)  # held by this frame's local only: freed on return
    import sys

    return guard.adopt(
        label,
        [word(moe.w13, 0, 16), word(moe.moe_kernel.workspace13, 1), word(scratch, 2), word(moe.w13, 3)],
        sys._getframe(),
    )


def test_adopt_names_owner_and_local_storages_like_the_recording():
    guard = CaptureGuard("warn")
    moe = MoE()
    guard.watch("moe", moe)
    assert adopt_locals(guard, moe, "g0") == []  # adopted
    names = [s.name for s in guard.slots_of("g0")]  # w13 twice (two words, one storage): one slot
    assert names == ["moe.w13", "moe.moe_kernel.workspace13", "<local scratch of adopt_locals>"]
    w13 = guard.slots_of("g0")[0]
    assert (w13.shape, w13.dtype, w13.storage_ptr) == ([4, 32], "float32", moe.w13.data_ptr())
    assert w13.captured_at.endswith("(node 0 kernel k param 0 +0)") and "adopt_locals" in w13.captured_at
    # The local died when adopt_locals returned: freed, with the line that dropped it.
    findings = guard.check("before replay", graph="g0")
    assert [(f.slot, f.status) for f in findings] == [("<local scratch of adopt_locals>", "freed")]
    assert (
        findings[0].freed_at == f"{THIS_FILE}:{line_of('adopted')} in "
        "test_adopt_names_owner_and_local_storages_like_the_recording (returned)"
    )
    # A rebinding is seen as with a recorded slot (the owner's name is kept on the slot).
    old = moe.moe_kernel.workspace13  # still alive elsewhere: rebound, not freed
    moe.moe_kernel.workspace13 = torch.zeros(32)
    findings = guard.check("after reload", graph="g0")
    assert [(f.slot, f.status) for f in findings] == [("moe.moe_kernel.workspace13", "rebound")]
    assert findings[0].old_ptr == old.data_ptr()


def test_adopt_leaves_memory_no_one_holds_to_the_census_and_shares_slots_across_graphs():
    guard = CaptureGuard("warn")
    moe = MoE()
    guard.watch("moe", moe)
    hidden = [torch.ones(16)]  # reachable from no owner and no local the guard reads
    words = [word(moe.w13), word(hidden[0])]
    kept, hidden = hidden, None
    for label in ("g0", "g1", "g2"):
        assert guard.adopt(label, words, None) == [words[1]]  # left to the census
    assert [s.name for s in guard.slots] == ["moe.w13"]
    assert guard.slots[0].graphs == ["g0", "g1", "g2"]
    assert [s.name for s in guard.slots_of("g2")] == ["moe.w13"]
    # The index is built once (the owners did not change), however many captures read the
    # unheld address; a tensor an owner gains later is named once the index is refreshed (the
    # watch hooks do that once per check, not per capture).
    assert guard.index_builds == 1
    moe.scale = torch.ones(4)
    late = [word(moe.scale)]
    assert guard.adopt("g3", late, None) == late and guard.index_builds == 1
    guard.refresh_index()
    assert guard.adopt("g3", late, None) == [] and guard.index_builds == 2
    assert [s.name for s in guard.slots_of("g3")] == ["moe.scale"]
    assert kept[0].numel() == 16


def test_adopt_on_an_off_guard_or_without_words_records_nothing():
    off = CaptureGuard("off")
    moe = MoE()
    off.watch("moe", moe)
    words = [word(moe.w13)]
    assert off.adopt("g", words, None) == words and off.slots == []
    on = CaptureGuard("warn")
    assert on.adopt("g", [], None) == [] and on.index_builds == 0


def test_adopt_asks_where_each_new_slot_was_made_once_while_it_lives():
    guard = CaptureGuard("warn")
    moe = MoE()
    guard.watch("moe", moe)
    asked = []

    def made_at(addr: int) -> str | None:
        asked.append(addr)
        return "prog.py:7 in build" if addr == moe.w13.data_ptr() else None

    assert (
        guard.adopt("g0", [word(moe.w13), word(moe.w13, 1, 16), word(moe.moe_kernel.workspace13)], None, made_at) == []
    )
    assert asked == [moe.w13.data_ptr(), moe.moe_kernel.workspace13.data_ptr()]  # once per storage
    assert guard.adopt("g1", [word(moe.w13)], None, made_at) == [] and len(asked) == 2  # known slot: not asked
    assert [s.created_at for s in guard.slots] == ["prog.py:7 in build", None]
    moe.w13 = torch.nn.Parameter(torch.zeros(4, 32), requires_grad=False)  # the only reference goes
    (finding,) = guard.check("before replay", graph="g0")
    assert finding.created_at == "prog.py:7 in build" and ", created at prog.py:7 in build)" in finding.message
