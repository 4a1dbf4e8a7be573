"""repro.audit: static detection of upstream vLLM fixes in trees, archives and installs."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import sys
import zipfile
from pathlib import Path

import pytest
from rich.console import Console

from repro.audit import scan as audit
from repro.audit.scan import (
    FIXES,
    AuditError,
    AuditResult,
    FixCheck,
    audit_archive,
    audit_directory,
    audit_installed,
    find_fix,
    missing_required,
    render,
)

try:  # tests/ without __init__.py (pytest puts this folder on sys.path)...
    import fixtures_audit as fx
except ImportError:  # ...or as a package, if one is added later
    from tests import fixtures_audit as fx


# A tree without Model Runner V2 (vllm/v1/worker/gpu/) cannot carry its two fixes.
NO_V2 = {"55341": "not-applicable", "53508": "not-applicable"}


def states(result: AuditResult) -> dict[str, str]:
    return {c.fix_id: c.state for c in result.checks}


def tree(tmp_path: Path, **kwargs) -> Path:
    version = kwargs.pop("version", "0.99.0")
    return fx.write_tree(tmp_path / "src", fx.source_files(**kwargs), version=version)


@pytest.fixture(autouse=True)
def never_imports_vllm():
    # Every synthetic package's __init__ raises; this also catches a stray import.
    assert "vllm" not in sys.modules
    yield
    assert "vllm" not in sys.modules


# --------------------------------------------------------------------------- the table


def test_fix_ids_are_unique_and_found_with_or_without_hash():
    assert len({f.fix_id for f in FIXES}) == len(FIXES)
    assert find_fix("#50074").function == "_setup_kernel"
    assert find_fix(" 43909 ").file == fx.GEMMA


def test_find_fix_unknown_id_names_known_ones():
    with pytest.raises(AuditError, match="12345.*43909, 50074, 57954"):
        find_fix("12345")


# --------------------------------------------------------------------------- upstream states


def test_pre_fix_tree_has_nothing(tmp_path):
    root = tree(tmp_path, gemma="pre", **fx.PRE_FIX)
    result = audit_directory(root)
    assert states(result) == {"43909": "absent", "50074": "absent", "57954": "absent", **NO_V2}
    text = (root / fx.NVFP4).read_text()
    kernel = result.check("50074")
    assert kernel.line == fx.line_of(text, "self.moe_kernel = make_nvfp4_moe_kernel")
    assert "every call" in kernel.evidence
    gemma = result.check("43909")
    assert gemma.line == fx.line_of((root / fx.GEMMA).read_text(), "all_gather(head")
    assert "local only" in gemma.evidence


def test_only_50074_tree(tmp_path):
    result = audit_directory(tree(tmp_path, **fx.ONLY_50074))
    assert states(result) == {"43909": "present", "50074": "present", "57954": "absent", **NO_V2}
    assert "no in-place refresh" in result.check("57954").evidence


def test_all_three_tree(tmp_path):
    root = tree(tmp_path, **fx.ALL_FIXES)
    result = audit_directory(root)
    assert states(result) == {"43909": "present", "50074": "present", "57954": "present", **NO_V2}
    nvfp4 = (root / fx.NVFP4).read_text()
    gemma = (root / fx.GEMMA).read_text()
    assert result.check("57954").line == fx.line_of(nvfp4, "g1_alphas.copy_")
    assert result.check("50074").line == fx.line_of(nvfp4, "self.moe_kernel = make")
    assert "is None" in result.check("50074").evidence
    assert result.check("43909").line == fx.line_of(gemma, "self._stable_full_lm_head_weight = head")
    assert all(c.file in (fx.GEMMA, fx.NVFP4, fx.V2_RUNNER) for c in result.checks)
    assert result.version == "0.99.0"
    assert result.kind == "directory"


def test_no_nvfp4_file_is_not_applicable(tmp_path):
    result = audit_directory(tree(tmp_path, guard=None))
    assert states(result) == {"43909": "present", "50074": "not-applicable", "57954": "not-applicable", **NO_V2}
    assert result.check("50074").line is None
    assert "does not exist" in result.check("57954").evidence


def test_no_gemma_file_is_not_applicable(tmp_path):
    result = audit_directory(tree(tmp_path, gemma=None))
    assert states(result)["43909"] == "not-applicable"


def test_file_without_the_function_is_absent_and_says_why(tmp_path):
    files = fx.source_files()
    files[fx.NVFP4] = fx.NVFP4_HEADER  # the class, but no _setup_kernel
    result = audit_directory(fx.write_tree(tmp_path / "src", files))
    check = result.check("50074")
    assert (check.state, check.line) == ("absent", None)
    assert "defines no _setup_kernel" in check.evidence


# --------------------------------------------------------------------------- formatting variants


@pytest.mark.parametrize("guard", ["is_none", "paren", "getattr", "not", "else_of_not_none", "early_return"])
def test_kernel_guard_variants_are_recognized(tmp_path, guard):
    result = audit_directory(tree(tmp_path, guard=guard, refresh="none"))
    assert result.check("50074").state == "present", result.check("50074").evidence


def test_guard_on_another_attribute_does_not_count(tmp_path):
    files = fx.source_files(guard="none", refresh="none")
    files[fx.NVFP4] = files[fx.NVFP4].replace(
        "        self.moe_quant_config = self.get_fused",
        "        if self.moe_quant_config is None:\n            self.moe_quant_config = self.get_fused",
    )
    result = audit_directory(fx.write_tree(tmp_path / "src", files))
    assert result.check("50074").state == "absent"


@pytest.mark.parametrize("refresh", ["else_branch", "unconditional", "alias", "helper", "subscript"])
def test_alpha_refresh_variants_are_recognized(tmp_path, refresh):
    result = audit_directory(tree(tmp_path, guard="is_none", refresh=refresh))
    check = result.check("57954")
    assert check.state == "present", check.evidence
    assert "process_weights_after_loading" in check.evidence


def test_alpha_refresh_inside_early_return_branch(tmp_path):
    result = audit_directory(tree(tmp_path, guard="early_return", refresh="else_branch"))
    assert states(result) == {"43909": "present", "50074": "present", "57954": "present", **NO_V2}


def test_copy_after_process_weights_after_loading_is_absent(tmp_path):
    root = tree(tmp_path, guard="is_none", refresh="after_pwal")
    result = audit_directory(root)
    check = result.check("57954")
    assert check.state == "absent"
    assert check.line == fx.line_of((root / fx.NVFP4).read_text(), "g1_alphas.copy_")
    assert "comes after" in check.evidence


def test_refreshing_only_one_alpha_is_absent(tmp_path):
    result = audit_directory(tree(tmp_path, guard="is_none", refresh="only_g1"))
    check = result.check("57954")
    assert check.state == "absent"
    assert "g2_alphas not refreshed" in check.evidence


@pytest.mark.parametrize(
    "variant,state",
    [
        ("pre", "absent"),
        ("fixed", "present"),
        ("fixed_variant", "present"),
        ("write_only", "absent"),
        ("reset_only", "absent"),
    ],
)
def test_gemma_variants(tmp_path, variant, state):
    result = audit_directory(tree(tmp_path, gemma=variant))
    assert result.check("43909").state == state, result.check("43909").evidence


def test_module_that_does_not_parse_is_judged_per_function(tmp_path):
    # Syntax this interpreter may lack elsewhere in the file must not blind the audit.
    files = fx.source_files(**fx.ONLY_50074)
    files[fx.NVFP4] = files[fx.NVFP4].replace(
        "class Nvfp4OnlineMoEMethod:", "def broken(:\n    pass\n\n\nclass Nvfp4OnlineMoEMethod:"
    )
    root = fx.write_tree(tmp_path / "src", files)
    result = audit_directory(root)
    assert states(result) == {"43909": "present", "50074": "present", "57954": "absent", **NO_V2}
    text = (root / fx.NVFP4).read_text()
    assert result.check("50074").line == fx.line_of(text, "self.moe_kernel = make")


def test_helper_is_found_when_module_does_not_parse(tmp_path):
    files = fx.source_files(guard="is_none", refresh="helper")
    files[fx.NVFP4] = "x = (\n" + files[fx.NVFP4]
    result = audit_directory(fx.write_tree(tmp_path / "src", files))
    assert result.check("57954").state == "present"


def test_function_that_does_not_parse_is_an_error_naming_it(tmp_path):
    # A leftover merge-conflict marker breaks the function body for every Python version: the
    # audit says so instead of guessing from text.
    files = fx.source_files(**fx.ALL_FIXES)
    files[fx.NVFP4] = files[fx.NVFP4].replace(
        "            replace_parameter(layer, name, value)\n",
        "            replace_parameter(layer, name, value)\n<<<<<<< HEAD\n",
        1,
    )
    root = fx.write_tree(tmp_path / "src", files)
    text = (root / fx.NVFP4).read_text()
    line, marker = fx.line_of(text, "def _setup_kernel"), fx.line_of(text, "<<<<<<< HEAD")
    with pytest.raises(
        AuditError,
        match=rf"^{fx.NVFP4}:{line}: _setup_kernel\(\) does not parse "
        rf"\(merge-conflict marker at line {marker}\), so fix #50074 "
        "cannot be judged",
    ):
        audit_directory(root)


# --------------------------------------------------------------------------- Model Runner V2


def v2_tree(tmp_path: Path, drop: tuple[str, ...] = (), **v2) -> tuple[Path, AuditResult]:
    """A tree with Model Runner V2's three files (less `drop`) in the state `v2` names."""
    files = fx.source_files(v2=v2)
    for rel in drop:
        del files[rel]
    root = fx.write_tree(tmp_path / "src", files, version="0.40.0")
    return root, audit_directory(root)


def text_of(root: Path, rel: str) -> str:
    return (root / rel).read_text()


@pytest.mark.parametrize(
    "spec,expected",
    [
        (fx.V2_PRE_FIX, ("absent", "absent")),
        (fx.V2_ONLY_LOCK, ("present", "absent")),
        (fx.V2_IN_PLACE, ("present", "present")),
        (fx.V2_ALL_FIXES, ("present", "present")),
    ],
)
def test_v2_upstream_states(tmp_path, spec, expected):
    _, result = v2_tree(tmp_path, **spec)
    got = (result.check("55341").state, result.check("53508").state)
    assert got == expected, [result.check(i).evidence for i in ("55341", "53508")]


def test_v2_pre_fix_names_the_capture_and_the_rebuilt_tensor(tmp_path):
    root, result = v2_tree(tmp_path, **fx.V2_PRE_FIX)
    lock = result.check("55341")
    assert (lock.file, lock.line) == (
        fx.V2_RUNNER,
        fx.line_of(text_of(root, fx.V2_RUNNER), "self.speculator.capture()"),
    )
    assert "no lock_workspace() after it in capture_model()" in lock.evidence
    assert "Worker.compile_or_warm_up_model()" in lock.evidence
    # The rebuild is in BlockTables, one call below the runner's wake-up hook.
    wake = result.check("53508")
    assert (wake.file, wake.line) == (
        fx.BLOCK_TABLE,
        fx.line_of(fx.BLOCK_TABLE_SOURCE, "self.block_table_ptrs = self._addresses"),
    )
    assert "rebinds self.block_table_ptrs = self._addresses(self.tables)" in wake.evidence
    assert f"{fx.WORKER}:{fx.line_of(text_of(root, fx.WORKER), 'post_kv_cache_wake_up()')}" in wake.evidence


def test_v2_files_absent_is_not_applicable(tmp_path):
    # Only the runner decides: a worker alone (every V1 version has one) is not Model Runner V2.
    _, result = v2_tree(tmp_path, drop=(fx.V2_RUNNER, fx.BLOCK_TABLE))
    assert {k: states(result)[k] for k in NO_V2} == NO_V2
    assert "does not exist" in result.check("55341").evidence


# -- #55341 -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "capture,needle",
    [
        ("locked", "lock_workspace()"),
        ("manager_lock", "current_workspace_manager().lock()"),
        ("helper_lock", "self._seal_workspace()"),
    ],
)
def test_workspace_lock_variants_are_recognized(tmp_path, capture, needle):
    root, result = v2_tree(tmp_path, capture=capture)
    check = result.check("55341")
    assert check.state == "present", check.evidence
    runner = text_of(root, fx.V2_RUNNER)
    assert check.line == fx.line_of(runner, needle)
    assert "after the capture by self.speculator.capture()" in check.evidence


def test_workspace_lock_in_the_worker_counts(tmp_path):
    # vLLM #46883's shape: the lock at the end of warmup, after capture_model().
    root, result = v2_tree(tmp_path, worker_lock="after_capture")
    check = result.check("55341")
    assert (check.state, check.file) == ("present", fx.WORKER)
    assert check.line == fx.line_of(text_of(root, fx.WORKER), "lock_workspace()")
    assert "Worker.compile_or_warm_up_model() locks the workspace" in check.evidence


@pytest.mark.parametrize(
    "capture,says",
    [
        ("helper_no_lock", "no lock_workspace() after it"),
        ("lock_before", "the lock at line"),
    ],
)
def test_workspace_not_locked_after_capture_is_absent(tmp_path, capture, says):
    _, result = v2_tree(tmp_path, capture=capture)
    check = result.check("55341")
    assert check.state == "absent"
    assert says in check.evidence


def test_workspace_lock_without_worker_says_so(tmp_path):
    _, result = v2_tree(tmp_path, drop=(fx.WORKER,))
    check = result.check("55341")
    assert check.state == "absent"
    assert f"no Worker.compile_or_warm_up_model() in {fx.WORKER} to read" in check.evidence


def test_capture_model_without_a_capture_call_is_unknown(tmp_path):
    root, result = v2_tree(tmp_path, capture="no_capture_call")
    check = result.check("55341")
    assert check.state == "unknown"
    assert check.line == fx.line_of(text_of(root, fx.V2_RUNNER), "def capture_model")
    assert "cannot see where graphs are captured" in check.evidence


def test_unreadable_call_after_capture_is_unknown_unless_the_worker_locks(tmp_path):
    root, result = v2_tree(tmp_path, capture="unread_helper")
    check = result.check("55341")
    assert check.state == "unknown"
    assert check.line == fx.line_of(text_of(root, fx.V2_RUNNER), "self._finish_capture()")
    assert "self._finish_capture()" in check.evidence and "cannot see whether it locks" in check.evidence
    # A lock the rule can read settles it.
    _, result = v2_tree(tmp_path / "locked", capture="unread_helper", worker_lock="after_capture")
    assert result.check("55341").state == "present"


# -- #53508 -----------------------------------------------------------------------------------


def test_layout_refreshed_in_place_at_wake(tmp_path):
    _, result = v2_tree(tmp_path, wake="in_place")
    check = result.check("53508")
    assert (check.state, check.file) == ("present", fx.BLOCK_TABLE)
    assert check.line == fx.line_of(fx.BLOCK_TABLE_SOURCE, "self.block_table_ptrs.copy_")
    assert "refreshes the layout in place (self.block_table_ptrs.copy_(...)" in check.evidence


@pytest.mark.parametrize("worker_wake", ["hook", "hook_helper"])
def test_layout_rebuilt_at_wake_is_absent(tmp_path, worker_wake):
    _, result = v2_tree(tmp_path, worker_wake=worker_wake)
    check = result.check("53508")
    assert (check.state, check.file) == ("absent", fx.BLOCK_TABLE)
    assert "graphs captured before sleep keep reading the old tensor" in check.evidence


def test_one_rebuilt_layout_tensor_outweighs_an_in_place_refresh(tmp_path):
    # slot_mapping_enabled has no "block" in its name: it counts because BlockTables owns it.
    _, result = v2_tree(tmp_path, wake="half_in_place")
    check = result.check("53508")
    assert (check.state, check.file) == ("absent", fx.BLOCK_TABLE)
    assert check.line == fx.line_of(fx.BLOCK_TABLE_SOURCE, "self.slot_mapping_enabled = ")
    assert "rebinds self.slot_mapping_enabled" in check.evidence


@pytest.mark.parametrize(
    "wake,needle",
    [
        ("rebuild_inline", "self.block_tables.block_sizes_tensor = torch.tensor"),
        ("rebuild_wrapper", "self.block_tables.num_blocks = make_uva_tensor"),
        ("rebuild_object", "self.block_tables = BlockTables(self.block_sizes"),
    ],
)
def test_layout_rebuilt_by_the_runner_itself_is_absent(tmp_path, wake, needle):
    root, result = v2_tree(tmp_path, wake=wake)
    check = result.check("53508")
    assert (check.state, check.file) == ("absent", fx.V2_RUNNER)
    assert check.line == fx.line_of(text_of(root, fx.V2_RUNNER), needle)
    assert f"rebinds {needle.split(' =')[0]}" in check.evidence


def test_layout_not_refreshed_inside_the_kv_pool_is_absent(tmp_path):
    # Nothing rebuilds the layout, but it was made inside the kv_cache pool: level-1 sleep
    # keeps its address and drops its values.
    for worker_kv_init in ("pool", "pool_alias"):
        root, result = v2_tree(tmp_path / worker_kv_init, worker_kv_init=worker_kv_init, worker_wake="no_hook")
        check = result.check("53508")
        assert (check.state, check.file) == ("absent", fx.WORKER), check.evidence
        assert check.line == fx.line_of(text_of(root, fx.WORKER), "with ")
        assert "does not call post_kv_cache_wake_up()" in check.evidence
        assert "loses the layout tensors' values" in check.evidence


def test_scoped_pool_without_wake_rebuild_is_present(tmp_path):
    root, result = v2_tree(tmp_path, wake="none", kv_init="scoped")
    check = result.check("53508")
    assert (check.state, check.file) == ("present", fx.V2_RUNNER)
    assert check.line == fx.line_of(text_of(root, fx.V2_RUNNER), "def initialize_kv_cache")
    assert "takes and uses kv_cache_allocation_context" in check.evidence
    assert "the runner defines no post_kv_cache_wake_up()" in check.evidence


def test_allocation_context_that_is_dropped_is_not_a_scope(tmp_path):
    _, result = v2_tree(tmp_path, wake="none", kv_init="ignored_param")
    assert result.check("53508").state == "absent"


def test_layout_hook_into_unreadable_code_is_unknown(tmp_path):
    root, result = v2_tree(tmp_path, wake="unreadable")
    check = result.check("53508")
    assert (check.state, check.file) == ("unknown", fx.V2_RUNNER)
    assert check.line == fx.line_of(text_of(root, fx.V2_RUNNER), "restore_layout_after_wake()")
    assert "self.block_tables.restore_layout_after_wake()" in check.evidence
    assert "cannot tell whether it rebuilds" in check.evidence


def test_layout_scope_that_cannot_be_seen_is_unknown(tmp_path):
    _, result = v2_tree(tmp_path, wake="none", worker_kv_init="bare")
    check = result.check("53508")
    assert check.state == "unknown"
    assert "cannot see where the pool scope ends" in check.evidence


def test_layout_hook_without_worker_is_unknown(tmp_path):
    _, result = v2_tree(tmp_path, drop=(fx.WORKER,))
    check = result.check("53508")
    assert check.state == "unknown"
    assert "no Worker.wake_up()" in check.evidence and "rebinds" not in check.evidence


def test_layout_rebuild_without_block_table_file_is_unknown(tmp_path):
    # Without block_table.py the hook's callee cannot be read: unknown, never a guess.
    _, result = v2_tree(tmp_path, drop=(fx.BLOCK_TABLE,))
    check = result.check("53508")
    assert check.state == "unknown"
    assert "init_block_table_layout_tensors()" in check.evidence


def test_v2_fixes_are_read_from_archives(tmp_path):
    # The worker and block_table.py are read from the wheel too, not only the runner.
    wheel = fx.make_wheel(
        tmp_path / "vllm-0.40.0-py3-none-any.whl", fx.source_files(v2=fx.V2_PRE_FIX), version="0.40.0"
    )
    result = audit_archive(wheel)
    assert (result.check("55341").state, result.check("53508").state) == ("absent", "absent")
    assert result.check("53508").file == fx.BLOCK_TABLE
    sdist = fx.make_sdist(tmp_path / "vllm-0.40.0.tar.gz", fx.source_files(v2=fx.V2_ALL_FIXES), version="0.40.0")
    result = audit_archive(sdist)
    assert (result.check("55341").state, result.check("53508").state) == ("present", "present")


# --------------------------------------------------------------------------- directories


def test_directory_may_be_the_vllm_package_itself(tmp_path):
    root = tree(tmp_path, **fx.ALL_FIXES, version="1.2.3")
    result = audit_directory(root / "vllm")
    assert states(result)["57954"] == "present"
    assert result.version == "1.2.3"
    assert result.source == str(root / "vllm")


def test_directory_version_prefers_dist_info_and_ignores_version_py_fallback(tmp_path):
    files = fx.source_files()
    # vllm/version.py's "dev" fallback sits in an except block: not the version.
    files["vllm/version.py"] = (
        'try:\n    from ._version import __version__\nexcept Exception:\n    __version__ = "dev"\n'
    )
    root = fx.write_tree(tmp_path / "site", files, version="0.50.1", dist_info=True)
    (root / "vllm" / "_version.py").write_text("__version__ = version = '0.0.0+other'\n")
    assert audit_directory(root).version == "0.50.1"
    (root / "vllm-0.50.1.dist-info" / "METADATA").unlink()
    assert audit_directory(root).version == "0.0.0+other"
    (root / "vllm" / "_version.py").unlink()
    assert audit_directory(root).version is None


def test_sdist_checkout_version_from_pkg_info(tmp_path):
    root = fx.write_tree(tmp_path / "vllm-0.7.7", fx.source_files())
    (root / "PKG-INFO").write_text(fx.metadata("0.7.7"))
    assert audit_directory(root).version == "0.7.7"


# --------------------------------------------------------------------------- archives


@pytest.mark.parametrize(
    "spec,expected",
    [
        (fx.PRE_FIX, {"50074": "absent", "57954": "absent"}),
        (fx.ONLY_50074, {"50074": "present", "57954": "absent"}),
        (fx.ALL_FIXES, {"50074": "present", "57954": "present"}),
    ],
)
def test_wheel(tmp_path, spec, expected):
    wheel = fx.make_wheel(
        tmp_path / "vllm-0.31.0-cp38-abi3-manylinux_2_28_x86_64.whl", fx.source_files(**spec), version="0.31.0"
    )
    result = audit_archive(wheel)
    assert result.kind == "archive"
    assert result.version == "0.31.0"
    assert result.source == str(wheel)
    assert {k: states(result)[k] for k in expected} == expected


def test_wheel_without_nvfp4_file(tmp_path):
    wheel = fx.make_wheel(tmp_path / "v.whl", fx.source_files(guard=None), version="0.24.0")
    assert states(audit_archive(wheel)) == {
        "43909": "present",
        "50074": "not-applicable",
        "57954": "not-applicable",
        **NO_V2,
    }


def test_sdist_with_top_level_versioned_folder(tmp_path):
    sdist = fx.make_sdist(tmp_path / "vllm-0.28.0.tar.gz", fx.source_files(**fx.ONLY_50074), version="0.28.0")
    result = audit_archive(sdist)
    assert result.version == "0.28.0"
    # The nested tests/data/vllm copy holds a pre-fix gemma file: it must not be chosen.
    assert states(result) == {"43909": "present", "50074": "present", "57954": "absent", **NO_V2}
    line = result.check("50074").line
    assert line == fx.line_of(fx.nvfp4_source(**fx.ONLY_50074), "self.moe_kernel = make")


def test_archive_version_falls_back_to_version_module_then_file_name(tmp_path):
    files = {**fx.source_files(), "vllm/_version.py": "__version__ = version = '0.40.2'\n"}
    zipped = fx.make_wheel(tmp_path / "vllm-0.40.1.zip", files, version=None)
    assert audit_archive(zipped).version == "0.40.2"
    bare = fx.make_wheel(tmp_path / "vllm-0.40.1-py3-none-any.whl", fx.source_files(), version=None)
    assert audit_archive(bare).version == "0.40.1"
    anonymous = fx.make_wheel(tmp_path / "snapshot.zip", fx.source_files(), version=None)
    assert audit_archive(anonymous).version is None


def test_archive_is_read_without_extracting(tmp_path, monkeypatch):
    wheel = fx.make_wheel(tmp_path / "w.whl", fx.source_files(), version="0.31.0")
    sdist = fx.make_sdist(tmp_path / "s.tar.gz", fx.source_files(), version="0.31.0")

    def refuse(*args, **kwargs):
        raise AssertionError("the audit must not extract archives to disk")

    monkeypatch.setattr(zipfile.ZipFile, "extractall", refuse)
    monkeypatch.setattr(zipfile.ZipFile, "extract", refuse)
    monkeypatch.setattr("tarfile.TarFile.extractall", refuse)
    monkeypatch.setattr("tarfile.TarFile.extract", refuse)
    before = set(tmp_path.iterdir())
    audit_archive(wheel)
    audit_archive(sdist)
    assert set(tmp_path.iterdir()) == before


# --------------------------------------------------------------------------- installed


def test_installed_is_found_without_importing(tmp_path, monkeypatch):
    site = fx.write_tree(tmp_path / "site-packages", fx.source_files(**fx.ONLY_50074), version="0.28.0", dist_info=True)
    monkeypatch.syspath_prepend(str(site))
    importlib.invalidate_caches()
    result = audit_installed()
    assert result.kind == "installed"
    assert result.version == "0.28.0"
    assert Path(result.source) == site / "vllm"
    assert states(result) == {"43909": "present", "50074": "present", "57954": "absent", **NO_V2}
    assert "vllm" not in sys.modules


def test_not_installed_raises(monkeypatch):
    monkeypatch.setattr(audit.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(AuditError, match=r"not installed.*--path DIR.*--wheel FILE"):
        audit_installed()


# --------------------------------------------------------------------------- errors


def test_missing_directory(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(AuditError, match=re.escape(str(missing)) + ".*--path"):
        audit_directory(missing)


def test_directory_that_is_a_file(tmp_path):
    (tmp_path / "f.whl").write_text("x")
    with pytest.raises(AuditError, match="not a directory.*--wheel"):
        audit_directory(tmp_path / "f.whl")


def test_directory_without_vllm(tmp_path):
    (tmp_path / "other").mkdir()
    with pytest.raises(AuditError, match=r"No vllm package found in .*other"):
        audit_directory(tmp_path / "other")


def test_missing_archive(tmp_path):
    with pytest.raises(AuditError, match=r"missing\.whl does not exist.*--wheel"):
        audit_archive(tmp_path / "missing.whl")


@pytest.mark.parametrize(
    "name,payload",
    [
        ("garbage.whl", b"this is not an archive at all" * 10),
        ("empty.tar.gz", b""),
        ("bad.tar.gz", b"\x1f\x8b\x08\x00" + b"\x00" * 40),
    ],
)
def test_corrupt_archive(tmp_path, name, payload):
    path = tmp_path / name
    path.write_bytes(payload)
    with pytest.raises(AuditError, match=re.escape(str(path)) + ".*re-download"):
        audit_archive(path)


def test_truncated_wheel(tmp_path):
    good = fx.make_wheel(tmp_path / "good.whl", fx.source_files(), version="0.1.0")
    cut = tmp_path / "cut.whl"
    cut.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    with pytest.raises(AuditError, match="Cannot read"):
        audit_archive(cut)


def test_archive_without_vllm(tmp_path):
    path = tmp_path / "other-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("other/__init__.py", "")
        archive.writestr("vllmish/__init__.py", "")
    with pytest.raises(AuditError, match=r"No vllm package .* inside .*other-1\.0"):
        audit_archive(path)


# --------------------------------------------------------------------------- verdicts & output


def result_with(**fix_states: str) -> AuditResult:
    checks = [FixCheck(f.fix_id, f.title, fix_states.get(f"f{f.fix_id}", "present"), f.file, None, "") for f in FIXES]
    return AuditResult("x", "directory", None, checks)


def test_missing_required():
    result = result_with(f50074="absent", f57954="not-applicable", f53508="unknown")
    assert missing_required(result, []) == []
    assert missing_required(result, ["43909", "55341"]) == []
    assert missing_required(result, ["#57954", "50074", "50074"]) == ["57954", "50074"]
    assert missing_required(result, ["53508"]) == ["53508"]  # unknown never passes a gate
    with pytest.raises(AuditError):
        missing_required(result, ["999"])


def test_to_dict_is_json(tmp_path):
    result = audit_directory(tree(tmp_path, **fx.ALL_FIXES))
    data = json.loads(json.dumps(result.to_dict()))
    assert data["kind"] == "directory" and data["version"] == "0.99.0"
    assert [c["fix_id"] for c in data["checks"]] == ["43909", "50074", "57954", "55341", "53508"]
    assert set(data["checks"][0]) == {"fix_id", "title", "state", "file", "line", "evidence"}


def test_render_table_keeps_code_brackets(tmp_path):
    result = audit_directory(tree(tmp_path, gemma="write_only", **fx.PRE_FIX))
    result.checks[0].evidence = "self.x = head[: self.vocab] [bold]not markup[/bold]"
    console = Console(record=True, width=250)
    render(result, console)
    out = console.export_text()
    assert "head[: self.vocab] [bold]not markup[/bold]" in out
    assert "0.99.0" in out
    for c in result.checks:
        assert f"#{c.fix_id}" in out and c.state in out


def test_render_shows_unknown_and_evidence_in_another_file(tmp_path):
    _, result = v2_tree(tmp_path, wake="unreadable", worker_lock="after_capture")
    console = Console(record=True, width=300)
    render(result, console)
    out = console.export_text()
    assert "unknown" in out and "restore_layout_after_wake" in out
    assert f"{fx.WORKER}:{result.check('55341').line}" in out


def test_library_has_no_print():
    from repro.audit import rules as audit_rules

    for module in (audit, audit_rules):
        assert not re.search(r"(?<![\w.])print\(", Path(module.__file__).read_text())


# --------------------------------------------------------------------------- real wheels

# What audit_archive found in the real PyPI wheels (manylinux x86_64, abi3). #43909 landed
# between 0.22.1 and 0.23.0; gemma4_mtp.py first appears after 0.19.x; online/nvfp4.py
# first appears in 0.25/0.26.
REAL = {
    "0.19.0": ("not-applicable", "not-applicable", "not-applicable"),
    "0.22.0": ("absent", "not-applicable", "not-applicable"),
    "0.22.1": ("absent", "not-applicable", "not-applicable"),
    "0.23.0": ("present", "not-applicable", "not-applicable"),
    "0.33.0": ("present", "present", "present"),
    "0.32.0": ("present", "present", "present"),
    "0.30.0": ("present", "present", "absent"),
    "0.28.0": ("present", "present", "absent"),
    "0.27.1": ("present", "absent", "absent"),
    "0.26.0": ("present", "absent", "absent"),
    "0.24.0": ("present", "not-applicable", "not-applicable"),
}


@pytest.mark.vllm
def test_real_wheels():
    folder = os.environ.get("REPRO_VLLM_WHEELS")
    if not folder:
        pytest.skip("REPRO_VLLM_WHEELS is not set")
    wheels = sorted(Path(folder).glob("vllm-*.whl")) + sorted(Path(folder).glob("vllm-*.tar.gz"))
    audited = 0
    for wheel in wheels:
        result = audit_archive(wheel)
        if result.version not in REAL:
            continue
        got = tuple(states(result)[k] for k in ("43909", "50074", "57954"))
        assert got == REAL[result.version], (wheel.name, result.to_dict())
        audited += 1
    if not audited:
        pytest.skip(f"no wheel of a known version in {folder}")
