"""Report rendering and artifacts, on hand-built records (CPU only, no torch)."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from rich.console import Console

from repro import files
from repro import report as rp
from repro.report import view
from repro.report.fmt import fmt_bytes, fmt_ptr
from repro.outcome import (
    Finding,
    FirstFailure,
    Manifest,
    Outcome,
    RankExit,
    Report,
    StepRecord,
    TrialRecord,
    parse_expectation,
    report_from_dict,
    to_jsonable,
)

LM_HEAD_PTR = 0x7F2A40000000
SLOT = "drafter.<local lm_head_weight>"


def config(scenario: str, mode: str, tp: int = 1, after_free: str = "release", **run) -> dict:
    return {
        "scenario": scenario,
        "preset": "tiny",
        "model": {"vocab_size": 1024},
        "run": {"mode": mode, "tp": tp, "after_free": after_free, "steps": 8, **run},
    }


def clean_trial() -> TrialRecord:
    steps = [
        StepRecord(
            step=i,
            rank=r,
            batch=16,
            replayed=True,
            numel=4096,
            compared=16,
            max_abs_err=0.0,
            tolerance=1e-2,
            seconds=0.002,
            label="graph bs=16",
        )
        for i in range(2)
        for r in range(2)
    ]
    return TrialRecord(
        id="gemma4-mtp-fixed-tp2",
        scenario="gemma4-mtp",
        mode="fixed",
        config=config("gemma4-mtp", "fixed", tp=2),
        outcome=Outcome.CLEAN,
        expected=[Outcome.CLEAN],
        met=True,
        graph_replayed=True,
        steps=steps,
        timings={"start": 1.5, "replays": 0.2, "total": 4.0},
    )


def illegal_address_trial() -> TrialRecord:
    finding = Finding(
        slot=SLOT,
        graph="centroids bs=16",
        status="freed",
        when="before replay, step 0",
        rank=0,
        shape=[262144, 256],
        dtype="bfloat16",
        nbytes=134217728,
        old_ptr=LM_HEAD_PTR,
        created_at="repro/scenarios/gemma4_mtp.py:88 in get_full_lm_head_weight",
        freed_at="repro/scenarios/gemma4_mtp.py:131 in setup_centroids_cuda_graphs",
        alloc_stack=[
            "gemma4_mtp.py:88 get_full_lm_head_weight",
            "gemma4_mtp.py:120 setup_centroids_cuda_graphs",
            "worker.py:40 run",
            "worker.py:12 main",
        ],
        free_stack=["gemma4_mtp.py:131 setup_centroids_cuda_graphs"],
    )
    return TrialRecord(
        id="gemma4-mtp-unfixed-tp2",
        scenario="gemma4-mtp",
        mode="unfixed",
        config=config("gemma4-mtp", "unfixed", tp=2),
        outcome=Outcome.ILLEGAL_ADDRESS,
        expected=parse_expectation("reproduced"),
        met=True,
        graph_replayed=True,
        first_failure=FirstFailure(
            Outcome.ILLEGAL_ADDRESS, 0, 0, "CUDA error: an illegal memory access was encountered"
        ),
        steps=[
            StepRecord(
                step=0,
                rank=1,
                batch=16,
                replayed=True,
                numel=4096,
                compared=16,
                max_abs_err=0.0,
                tolerance=1e-2,
                seconds=0.003,
                label="graph bs=16",
            )
        ],
        guard_findings=[finding],
        timings={"total": 7.4, "start": 1.9, "init": 0.6, "build": 1.1, "capture": 0.8, "replays": 0.1},
        ranks=[
            RankExit(
                rank=0,
                pid=4242,
                exitcode=1,
                signal=None,
                killed_by_harness=False,
                stderr_tail="Traceback (most recent call last):\n  [rank0]: replay()\n"
                "torch.AcceleratorError: CUDA error: an illegal memory access\n"
                "<script>alert(1)</script>\n",
                error="AcceleratorError: CUDA error 700",
            ),
            RankExit(
                rank=1,
                pid=4243,
                exitcode=None,
                signal="SIGKILL",
                killed_by_harness=True,
                stderr_tail="\x1b[31mwaiting in all_gather\x1b[0m\n",
            ),
        ],
        notes=["after-free=release: gc.collect(); torch.cuda.empty_cache() after capture"],
        artifacts={"rank0 records": "runs/gemma4-mtp-unfixed-tp2/rank0.jsonl"},
    )


def cpu_trial() -> TrialRecord:
    finding = Finding(
        slot="drafter.<local lm_head_weight>",
        graph="centroids bs=4",
        status="freed",
        when="before replay, step 0",
        rank=1,
        shape=[1024, 16],
        dtype="float32",
        nbytes=65536,
        old_ptr=0x55D0C0DE0000,
    )
    return TrialRecord(
        id="gemma4-mtp-unfixed-cpu",
        scenario="gemma4-mtp",
        mode="unfixed",
        config=config("gemma4-mtp", "unfixed", 2, device="cpu"),
        outcome=Outcome.STALE_CAPTURE,
        expected=parse_expectation("reproduced"),
        met=True,
        graph_replayed=False,
        first_failure=FirstFailure(Outcome.STALE_CAPTURE, 1, 0, "captured lm_head storage freed"),
        steps=[StepRecord(step=0, rank=1, batch=4, replayed=False, numel=64, compared=4, seconds=0.01)],
        guard_findings=[finding],
        timings={"total": 2.0},
    )


def unsupported_trial(met: bool = False) -> TrialRecord:
    return TrialRecord(
        id="gemma4-mtp-unfixed-tp8",
        scenario="gemma4-mtp",
        mode="unfixed",
        config=config("gemma4-mtp", "unfixed", 8),
        outcome=Outcome.UNSUPPORTED,
        expected=[Outcome.UNSUPPORTED] if met else parse_expectation("reproduced"),
        met=met,
        graph_replayed=False,
        first_failure=FirstFailure(Outcome.UNSUPPORTED, None, None, "tp=8 needs 8 GPUs, found 1"),
    )


def mismatch_trial() -> TrialRecord:
    # 50 reload steps; the first 5 are clean, then every one mismatches.
    steps = [
        StepRecord(
            step=i,
            rank=0,
            batch=64,
            replayed=True,
            numel=131072,
            compared=131072,
            mismatches=0 if i < 5 else 9000 + i,
            max_abs_err=0.001 if i < 5 else 3.5,
            rel_err=0.0005 if i < 5 else 0.9,
            tolerance=0.05,
            seconds=0.004,
            label=f"reload {i} (changed)",
        )
        for i in range(50)
    ]
    return TrialRecord(
        id="nvfp4-reload-kernel-reuse",
        scenario="nvfp4-reload",
        mode="kernel-reuse",
        config=config("nvfp4-reload", "kernel-reuse", after_free="poison"),
        outcome=Outcome.MISMATCH,
        expected=[Outcome.CLEAN],
        met=False,
        graph_replayed=True,
        first_failure=FirstFailure(Outcome.MISMATCH, 0, 5, "9005/131072 elements above tolerance"),
        steps=steps,
        manifests=[Manifest(when=f"after reload {i}", rank=0, freed=3, rebound=1, unchanged=12) for i in range(2)],
        timings={"custom": 0.5, "reload": 1.0, "start": 1.0, "total": 9.0},
    )


def full_report(**kw) -> Report:
    return Report(
        environment={"summary": "2x NVIDIA H200 · torch 2.11 · CUDA 13.0", "gpus": 2},
        trials=[clean_trial(), illegal_address_trial(), cpu_trial(), unsupported_trial(), mismatch_trial()],
        command="repro matrix",
        created="2025-01-01T00:00:00Z",
        **kw,
    )


def trial_text(trial: TrialRecord, width: int = 160) -> str:
    console = Console(record=True, width=width, file=io.StringIO(), color_system=None)
    rp.render_trial(trial, console)
    return console.export_text()


# ---- helpers --------------------------------------------------------------------------------


def test_outcome_styles_group_failures_red_and_keep_unsupported_apart():
    assert "green" in rp.outcome_style(Outcome.CLEAN)
    assert "yellow" in rp.outcome_style(Outcome.STALE_CAPTURE)
    assert "magenta" in rp.outcome_style(Outcome.UNSUPPORTED)
    for o in (
        Outcome.ILLEGAL_ADDRESS,
        Outcome.DEVICE_ASSERT,
        Outcome.NONFINITE,
        Outcome.MISMATCH,
        Outcome.HANG,
        Outcome.CRASH,
    ):
        assert "red" in rp.outcome_style(o)


def test_describe_has_one_distinct_sentence_per_outcome_and_places_the_failure():
    sentences = {rp.describe(o) for o in Outcome}
    assert len(sentences) == len(Outcome)
    text = rp.describe(Outcome.ILLEGAL_ADDRESS, FirstFailure(Outcome.ILLEGAL_ADDRESS, 0, 0, ""))
    assert text.startswith("CUDA error 700 on rank 0 at step 0: the replay touched memory returned to the driver")
    assert "not a pass" in rp.describe(Outcome.UNSUPPORTED)


@pytest.mark.parametrize(
    "n, text", [(None, "-"), (512, "512 B"), (1536, "1.5 KiB"), (134217728, "128 MiB"), (3 * 1024**3, "3 GiB")]
)
def test_fmt_bytes(n, text):
    assert fmt_bytes(n) == text


def test_fmt_ptr():
    assert fmt_ptr(LM_HEAD_PTR) == "0x7f2a40000000"
    assert fmt_ptr(None) == "-"


def test_report_module_does_not_import_torch():
    # The parent renders reports and must stay free of CUDA state; a fresh interpreter shows it.
    code = "import sys, repro.report; assert 'torch' not in sys.modules, 'torch imported'"
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )
    assert result.returncode == 0, result.stderr


# ---- console rendering ----------------------------------------------------------------------


def test_report_text_names_every_outcome_and_the_tally():
    text = rp.report_to_text(full_report())
    assert text.splitlines()[0].startswith("environment: 2x NVIDIA H200")
    for name in ("CLEAN", "ILLEGAL_ADDRESS", "STALE_CAPTURE", "UNSUPPORTED", "MISMATCH"):
        assert name in text
    assert "gemma4-mtp · unfixed · tp=2 · after-free=release" in text
    assert "Summary" in text
    assert "3/5 trials met their expectation" in text
    assert "interrupted" not in text


def test_interrupted_report_says_so():
    assert "interrupted" in rp.report_to_text(full_report(interrupted=True)).splitlines()[-1]


def test_single_trial_report_has_no_summary_table():
    text = rp.report_to_text(Report(environment={}, trials=[clean_trial()]))
    assert "Summary" not in text
    assert "1/1 trials met their expectation" in text


def test_cpu_line_only_for_the_cpu_trial():
    assert rp.CPU_NOTE in trial_text(cpu_trial())
    for trial in (clean_trial(), illegal_address_trial(), mismatch_trial()):
        assert "No CUDA graph was replayed" not in trial_text(trial)


def test_illegal_address_trial_shows_finding_meaning_and_rank_exits():
    text = trial_text(illegal_address_trial())
    assert SLOT in text
    assert "0x7f2a40000000" in text
    assert "128 MiB" in text
    assert "CUDA error 700 on rank 0 at step 0" in text
    assert "gemma4_mtp.py:88 get_full_lm_head_weight" in text  # top alloc frame
    assert "(+1 more frames)" in text  # 4 frames, 3 shown
    assert "killed by harness (SIGKILL)" in text
    assert "[rank0]: replay()" in text  # brackets survive (no markup)
    assert "\x1b" not in text and "waiting in all_gather" in text


def test_rank_exits_only_for_process_level_failures():
    trial = mismatch_trial()
    trial.ranks = [RankExit(rank=0, pid=1, exitcode=0, signal=None, killed_by_harness=False, stderr_tail="bye")]
    assert "Rank exits" not in trial_text(trial)
    assert "Rank exits" in trial_text(illegal_address_trial())


def test_long_step_list_is_capped_with_a_hidden_rows_note():
    text = trial_text(mismatch_trial())
    rows = [line for line in text.splitlines() if "reload " in line and "(changed)" in line]
    assert len(rows) == view.MAX_STEP_ROWS
    assert f"{50 - view.MAX_STEP_ROWS} rows hidden" in text
    assert "first failing step 5 on rank 0" in text
    assert "reload 2 (changed)" in text  # context before the first failure is kept


def test_findings_of_one_storage_in_many_graphs_are_grouped():
    trial = illegal_address_trial()
    base = trial.guard_findings[0]
    trial.guard_findings = [
        Finding(**{**base.__dict__, "graph": f"centroids bs={bs}"}) for bs in (1, 2, 4, 8, 16, 32, 64)
    ]
    text = trial_text(trial)
    assert "Findings (7)" in text
    assert text.count(f"FREED {SLOT}") == 1
    assert "in 7 graphs: centroids bs=1, centroids bs=2" in text


def test_narrow_console_keeps_outcomes_whole_and_lines_short():
    text = rp.report_to_text(full_report(), width=80)
    assert max(len(line.rstrip()) for line in text.splitlines()) <= 80
    summary = text[text.rindex("Summary") :]
    for name in ("CLEAN", "ILLEGAL_ADDRESS", "STALE_CAPTURE", "UNSUPPORTED", "MISMATCH"):
        assert name in summary
    assert "…" not in summary  # nothing truncated; long entries wrap instead


def test_step_selection_fills_the_cap_after_a_lone_failure():
    steps = [
        StepRecord(step=i, rank=0, batch=1, replayed=True, nonfinite=1 if i == 40 else 0, numel=8) for i in range(100)
    ]
    shown = view.select_steps(steps)
    assert len(shown) == view.MAX_STEP_ROWS
    assert shown[0] == 40 - view.CONTEXT_STEP_ROWS and 40 in shown


def test_manifests_and_timings_order():
    text = trial_text(mismatch_trial())
    assert "after reload 1" in text
    line = next(line for line in text.splitlines() if line.startswith("timings:"))
    assert line.index("start") < line.index("reload") < line.index("total") < line.index("custom")


def test_unsupported_is_never_rendered_as_a_pass():
    for met in (True, False):
        trial = unsupported_trial(met=met)
        text = trial_text(trial)
        assert "UNSUPPORTED" in text
        assert "✓" not in text
        assert "not a pass" in text
    for width in (160, 80):  # the table, and the narrow one-line-per-trial form
        text = rp.report_to_text(
            Report(environment={}, trials=[unsupported_trial(met=True), clean_trial()]), width=width
        )
        summary = text[text.index("Summary") :]
        row = next(line for line in summary.splitlines() if "UNSUPPORTED" in line)
        assert "✓" not in row, row
        clean_row = next(line for line in summary.splitlines() if "CLEAN" in line)
        assert "✓" in clean_row


def test_render_summary_prints_only_the_table():
    console = Console(record=True, width=160, file=io.StringIO(), color_system=None)
    rp.render_summary(full_report(), console)
    text = console.export_text()
    assert "first failure" in text and "MISMATCH" in text
    assert "environment" not in text and "Findings (" not in text


# ---- artifacts ------------------------------------------------------------------------------


def test_json_round_trip(tmp_path):
    report = full_report()
    path = tmp_path / "deep" / "dir" / "report.json"
    rp.write_json(report, path)
    back = report_from_dict(json.loads(path.read_text()))
    assert to_jsonable(back) == to_jsonable(report)


def test_json_is_strict_even_with_nonfinite_numbers(tmp_path):
    report = full_report()
    report.trials[4].steps[10].max_abs_err = float("inf")
    report.trials[4].steps[11].rel_err = float("nan")
    path = tmp_path / "r.json"
    rp.write_json(report, path)

    def reject(token):
        raise AssertionError(f"non-standard JSON token {token}")

    data = json.loads(path.read_text(), parse_constant=reject)
    assert data["trials"][4]["steps"][10]["max_abs_err"] == "Infinity"
    assert data["trials"][4]["steps"][11]["rel_err"] == "NaN"
    assert "Infinity" in rp.report_to_text(report_from_dict(data))


def test_json_holds_text_that_was_not_utf8(tmp_path):
    """Bytes that are not UTF-8 reach a record as surrogate escapes; the file is still written."""
    report = full_report()
    report.trials[0].notes = ["argv x\udcffy.py"]
    path = tmp_path / "r.json"
    rp.write_json(report, path)
    assert json.loads(path.read_text(encoding="utf-8"))["trials"][0]["notes"] == ["argv x\ufffdy.py"]


def junit_root(tmp_path, report: Report) -> ET.Element:
    path = tmp_path / "junit.xml"
    rp.write_junit(report, path)
    return ET.parse(path).getroot()


def test_junit_counts_and_cases(tmp_path):
    suite = junit_root(tmp_path, full_report()).find("testsuite")
    assert suite.get("name") == "repro"
    # mismatch (unmet) and unsupported (unmet) fail; nothing is skipped.
    assert (suite.get("tests"), suite.get("failures"), suite.get("skipped")) == ("5", "2", "0")
    assert float(suite.get("time")) == pytest.approx(4.0 + 7.4 + 2.0 + 9.0)
    cases = suite.findall("testcase")
    assert [c.get("classname") for c in cases][:2] == ["repro.gemma4-mtp", "repro.gemma4-mtp"]
    assert cases[1].get("name") == "unfixed[tp=2,after_free=release]"
    assert cases[2].get("name") == "unfixed[tp=2,after_free=release,device=cpu]"
    failure = cases[4].find("failure")
    assert failure.get("message") == "outcome MISMATCH, expected CLEAN"
    assert "9005/131072 elements above tolerance" in failure.text
    props = {p.get("name"): p.get("value") for p in cases[1].iter("property")}
    assert props["outcome"] == "ILLEGAL_ADDRESS" and props["expected"] == "reproduced"


def test_junit_names_stay_unique(tmp_path):
    twin = illegal_address_trial()
    twin.id = "second-run"
    cases = junit_root(tmp_path, Report(environment={}, trials=[illegal_address_trial(), twin])).iter("testcase")
    names = [c.get("name") for c in cases]
    assert len(set(names)) == 2 and names[1] == "unfixed[tp=2,after_free=release,id=second-run]"


def test_lifecycle_flags_appear_in_title_and_case_name(tmp_path):
    trial = clean_trial()
    trial.config["run"]["reload_drafter"] = True
    trial.config["run"]["after_free"] = ""  # unresolved: the scenario default is named
    assert rp.trial_title(trial) == "gemma4-mtp · fixed · tp=2 · after-free=release · reload-drafter"
    case = junit_root(tmp_path, Report(environment={}, trials=[trial])).find("testsuite/testcase")
    assert case.get("name") == "fixed[tp=2,after_free=release,reload_drafter]"


def test_junit_unsupported_is_skipped_only_when_expected(tmp_path):
    suite = junit_root(tmp_path, Report(environment={}, trials=[unsupported_trial(met=True), clean_trial()])).find(
        "testsuite"
    )
    assert (suite.get("tests"), suite.get("failures"), suite.get("skipped")) == ("2", "0", "1")
    skipped = suite.findall("testcase")[0]
    assert skipped.find("skipped") is not None and skipped.find("failure") is None
    suite = junit_root(tmp_path, Report(environment={}, trials=[unsupported_trial(met=False)])).find("testsuite")
    assert (suite.get("failures"), suite.get("skipped")) == ("1", "0")


def test_junit_survives_control_characters_in_stderr(tmp_path):
    report = Report(environment={}, trials=[illegal_address_trial()])
    report.trials[0].met = False
    report.trials[0].ranks[0].stderr_tail = "bell\x07 nul\x00 esc\x1b[1mbold\x1b[0m"
    case = junit_root(tmp_path, report).find("testsuite/testcase")
    assert "bell nul escbold" in case.find("failure").text
    assert SLOT in case.find("failure").text


def test_junit_writer_makes_every_attribute_and_text_xml_safe(tmp_path):
    """The one writer both report kinds use: a character XML forbids anywhere is dropped and a
    surrogate escape (bytes that were not UTF-8) written as U+FFFD, never as itself."""
    from repro.report.junit import JunitCase, JunitFailure, JunitSuite, junit_document

    bad = "a\x01b\udcffc<d>"
    suite = JunitSuite(
        name=bad,
        properties={bad: bad},
        timestamp=bad,
        cases=[
            JunitCase(
                classname=bad,
                name=bad,
                properties={"p": bad},
                failures=[JunitFailure(bad, bad, bad)],
                system_out=bad,
                system_err=bad,
            ),
            JunitCase(classname="c", name="skipped", skipped=bad),
        ],
    )
    path = tmp_path / "junit.xml"
    files.write_text_atomic(path, junit_document(suite))
    root = ET.parse(path).getroot()
    values = [v for node in root.iter() for v in [*node.attrib.values(), node.text or ""]]
    assert values.count("ab\ufffdc<d>") == 14
    assert not any("\x01" in v or "\udcff" in v for v in values)
    assert (root.get("tests"), root.get("failures"), root.get("skipped")) == ("2", "1", "1")


def test_html_is_self_contained_and_escaped(tmp_path):
    path = tmp_path / "report.html"
    rp.write_html(full_report(), path)
    page = path.read_text()
    assert page.startswith("<!DOCTYPE html>")
    assert "<script" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "drafter.&lt;local lm_head_weight&gt;" in page
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", page)
    assert "<style>" in page
    assert page.count("<section") == 5
    assert "<details>" in page  # the long trial keeps all its rows, folded


def test_atomic_write_replaces_and_leaves_no_temp_files(tmp_path):
    path = tmp_path / "out" / "report.json"
    path.parent.mkdir()
    path.write_text("old")
    rp.write_json(full_report(), path)
    assert json.loads(path.read_text())["command"] == "repro matrix"
    rp.write_html(full_report(), tmp_path / "out" / "report.html")
    assert sorted(os.listdir(path.parent)) == ["report.html", "report.json"]


def test_write_text_atomic_creates_parents_and_honours_umask(tmp_path):
    target = files.write_text_atomic(tmp_path / "a" / "b" / "env.json", "{}\n")
    assert target.read_text() == "{}\n"
    old = os.umask(0o022)
    try:
        mode = files.write_text_atomic(tmp_path / "perm.txt", "x").stat().st_mode & 0o777
    finally:
        os.umask(old)
    assert mode == 0o644  # not mkstemp's 0o600: CI must be able to read the artifact


def test_failed_atomic_write_keeps_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "report.xml"
    path.write_text("old")

    def broken_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(files.os, "replace", broken_replace)
    with pytest.raises(OSError):
        rp.write_junit(full_report(), path)
    assert path.read_text() == "old"
    assert os.listdir(tmp_path) == ["report.xml"]


# ---- progress -------------------------------------------------------------------------------


def test_progress_without_a_terminal_prints_plain_lines():
    stream = io.StringIO()
    console = Console(file=stream, width=40, force_terminal=False)
    with rp.Progress(console) as progress:
        progress.add("t1", "gemma4-mtp unfixed tp=2 with a long label that must not wrap", 8)
        progress.update("t1", 1, "replay [bs=16]")
        progress.update("t1", 1, "replay [bs=16]")  # repeat: no new line
        progress.update("t1", 2, "replay [bs=16]")
        progress.finish("t1", Outcome.ILLEGAL_ADDRESS)
    out = stream.getvalue()
    assert "\x1b" not in out and "\r" not in out
    lines = out.splitlines()
    assert len(lines) == 4
    assert lines[0] == "[t1] started gemma4-mtp unfixed tp=2 with a long label that must not wrap (8 steps)"
    assert lines[1] == "[t1] 1/8 steps done · replay [bs=16]"
    assert lines[3].startswith("[t1] finished ILLEGAL_ADDRESS in ")


def test_progress_past_the_last_step_says_finishing_not_running():
    stream = io.StringIO()
    with rp.Progress(Console(file=stream, width=80, force_terminal=False)) as progress:
        progress.add("t1", "selftest", 6)
        progress.update("t1", 0)
        progress.update("t1", 3)
        progress.update("t1", 6)
    lines = stream.getvalue().splitlines()
    assert lines[1:] == [
        "[t1] 0/6 steps done · running",
        "[t1] 3/6 steps done · running",
        "[t1] 6/6 steps done · finishing",
    ]


def test_progress_in_a_log_is_a_line_per_tenth_of_a_long_trial_not_per_step():
    """`repro gemma4-mtp --steps 5000` in a CI log: a handful of lines, the last step's among them."""
    stream = io.StringIO()
    with rp.Progress(Console(file=stream, width=80, force_terminal=False)) as progress:
        progress.add("t1", "gemma4-mtp", 5000)
        for n in range(5001):
            progress.update("t1", n)
        progress.finish("t1", Outcome.DEADLINE)
    lines = stream.getvalue().splitlines()
    assert len(lines) <= 14, lines
    assert "[t1] 500/5000 steps done · running" in lines and "[t1] 5000/5000 steps done · finishing" in lines


def test_progress_on_a_terminal_uses_the_live_display():
    stream = io.StringIO()
    console = Console(file=stream, width=100, force_terminal=True, color_system="standard")
    with rp.Progress(console) as progress:
        progress.add("t1", "nvfp4-reload [unfixed]", 5)
        progress.update("t1", 3, "reload [3]")
        progress.finish("t1", Outcome.NONFINITE)
    out = stream.getvalue()
    assert "NONFINITE" in out
    assert "nvfp4-reload [unfixed]" in out
    assert "\x1b[" in out  # a live display, not plain lines


# ---- truthful lines (each true of the trial it describes) -----------------------------------


def cpu_run(outcome: Outcome, **run) -> TrialRecord:
    """A trial that ran on CPU: the eager path stood in, the dry-run capture was timed."""
    steps = [
        StepRecord(
            step=0,
            rank=0,
            batch=8,
            replayed=False,
            numel=64,
            compared=64,
            mismatches=9 if outcome is Outcome.MISMATCH else 0,
            seconds=0.01,
            label="reload 0",
        )
    ]
    failure = None if outcome is Outcome.CLEAN else FirstFailure(outcome, 0, 0, "what went wrong")
    return TrialRecord(
        id=f"cpu-{outcome.value}",
        scenario="nvfp4-reload",
        mode="kernel-reuse",
        config=config("nvfp4-reload", "kernel-reuse", after_free="poison", **run),
        outcome=outcome,
        expected=[outcome],
        met=True,
        graph_replayed=False,
        first_failure=failure,
        steps=steps,
        timings={"capture": 0.5, "total": 2.0},
        device="cpu",
    )


def verdict_box(trial: TrialRecord) -> str:
    text = trial_text(trial)
    return text[: text.index("╰")]


@pytest.mark.parametrize("outcome", [Outcome.MISMATCH, Outcome.NONFINITE, Outcome.HANG, Outcome.CRASH])
def test_cpu_note_only_when_the_guard_decided(outcome):
    box = verdict_box(cpu_run(outcome))
    assert "comes from the stale-capture guard" not in box
    assert "the replay" not in box  # nothing was replayed
    if outcome in (Outcome.MISMATCH, Outcome.NONFINITE):
        assert "comparing the eager output with the reference" in box


def test_cpu_note_stays_for_a_guard_verdict_and_not_for_an_interrupted_run():
    assert "comes from the stale-capture guard" in verdict_box(cpu_run(Outcome.STALE_CAPTURE))
    interrupted = cpu_run(Outcome.CRASH)
    interrupted.first_failure = FirstFailure(Outcome.CRASH, None, None, "interrupted by the user (Ctrl-C)")
    assert "No CUDA graph was replayed" not in verdict_box(interrupted)


def test_clean_on_cpu_claims_no_replay():
    box = verdict_box(cpu_run(Outcome.CLEAN))
    assert "Every replay ran" not in box
    assert "Every step ran" in box
    assert "guard found no captured tensor freed or moved" in box


def test_clean_on_cpu_with_the_guard_off_says_nothing_could_be_detected():
    box = verdict_box(cpu_run(Outcome.CLEAN, guard="off"))
    assert "guard was off: a stale capture could not have been detected" in box
    assert "guard found no" not in box


def test_forensics_on_cpu_is_reported_as_ignored():
    assert "--forensics was ignored" in verdict_box(cpu_run(Outcome.STALE_CAPTURE, forensics=True))
    gpu = illegal_address_trial()
    gpu.config["run"]["forensics"] = True
    gpu.device = "cuda"
    assert "--forensics was ignored" not in trial_text(gpu)


def test_a_trial_without_graphs_never_claims_a_replay_on_any_device():
    trial = cpu_run(Outcome.CLEAN)
    trial.device, trial.timings = "cuda", {"total": 1.0}  # selftest on a GPU: no capture at all
    text = trial_text(trial)
    assert "Every replay ran" not in text and "No CUDA graph was replayed" not in text


def test_summary_line_says_when_trials_ran_on_cpu():
    cpu = Report(environment={}, trials=[cpu_run(Outcome.CLEAN), cpu_run(Outcome.STALE_CAPTURE)])
    assert rp.summary_line(cpu) == "2/2 trials met their expectation; CPU run: no CUDA graph was replayed"
    gpu = clean_trial()
    gpu.device = "cuda"
    mixed = Report(environment={}, trials=[gpu, cpu_run(Outcome.CLEAN)])
    assert "1 on CPU (no CUDA graph replayed there)" in rp.summary_line(mixed)
    assert "CPU" not in rp.summary_line(Report(environment={}, trials=[gpu]))


# ---- 80 columns -----------------------------------------------------------------------------


def numbers_in(text: str) -> list[str]:
    return re.findall(r"\d+(?:\.\d+)?(?:/\d+)?", text)


def test_steps_table_at_80_columns_keeps_every_header_and_number_whole():
    trial = mismatch_trial()
    for s in trial.steps:  # every foldable column varies: nothing folds
        s.batch, s.tolerance, s.replayed = 64 + s.step, 0.05 + s.step / 1000, s.step % 2 == 0
        s.label = f"reload {s.step} (changed weights, scale {s.step})"
        s.seconds = 123.456
    text = trial_text(trial, width=80)
    table = text[text.index("Steps (50)") : text.index("timings:")]
    assert max(len(line.rstrip()) for line in table.splitlines()) <= 80
    assert "…" not in table.replace("… ", "")  # only the hidden-rows marker
    header = " ".join(table.splitlines()[1:3])
    left_out = text[text.index("columns left out at 80 characters:") :].splitlines()[0]
    for name, words in (
        ("step", ["step"]),
        ("rank", ["rank"]),
        ("label", ["label"]),
        ("tokens", ["tokens"]),
        ("replayed", ["replayed"]),
        ("nonfinite/numel", ["nonfinite", "/numel"]),
        ("mismatches/compared", ["mismatches", "/compared"]),
        ("max abs err", ["max abs", "err"]),
        ("rel err", ["rel err"]),
        ("tolerance", ["tolerance"]),
        ("ms", [" ms"]),
    ):
        # Each column is shown with its whole header, or named as left out: never half shown.
        assert all(w in header for w in words) or f" {name}" in left_out.replace(",", " "), name
    assert "mismatches" in header and "step" in header  # the facts that make the verdict stay
    rows = [line.split() for line in table.splitlines() if re.match(r"\s+\d+\s+0\s", line)]
    assert [r[0] for r in rows][:2] == ["2", "3"] and any("9010/131072" in r for r in rows)


def test_artifact_paths_are_never_broken_mid_name():
    trial = clean_trial()
    run_dir = "/var/tmp/repro-artifacts/20260101-120000-123456/03-gemma4-mtp-reload-safe-tp2-release-reload"
    trial.artifacts = {"rank 0 records": f"{run_dir}/rank0.jsonl", "rank 1 records": f"{run_dir}/rank1.jsonl"}
    text = trial_text(trial, width=80)
    assert f"{run_dir}/" in text.splitlines()[next(i for i, l in enumerate(text.splitlines()) if "artifacts in" in l)]
    assert "rank 0 records: rank0.jsonl" in text and "rank 1 records: rank1.jsonl" in text


def test_timings_wrap_between_items_not_inside_one():
    trial = illegal_address_trial()
    trial.timings = {
        k: 12.345
        for k in (
            "start",
            "import",
            "init",
            "build",
            "capture",
            "reload",
            "replays",
            "oracle",
            "total",
            "custom_phase_one",
            "custom_phase_two",
        )
    }
    text = trial_text(trial, width=80)
    lines = text[text.index("timings:") :].splitlines()[:3]
    for line in lines:
        assert len(line) <= 80
        assert not line.rstrip().endswith("12.35") and not line.lstrip().startswith("s ")


# ---- HTML -----------------------------------------------------------------------------------


def gemma_reuse_trial() -> TrialRecord:
    """Garbage draft tokens after the lm_head's memory was reused: mismatches differ per graph."""
    sizes = {1: 0, 2: 1, 4: 3, 8: 6}
    steps = [
        StepRecord(
            step=i,
            rank=r,
            batch=bs,
            replayed=True,
            numel=bs,
            compared=bs,
            mismatches=bad,
            seconds=0.001,
            label=f"graph bs={bs}",
        )
        for i, (bs, bad) in enumerate(sizes.items())
        for r in range(2)
    ]
    trial = illegal_address_trial()
    trial.outcome, trial.steps, trial.ranks = Outcome.MISMATCH, steps, []
    trial.first_failure = FirstFailure(Outcome.MISMATCH, 0, 1, "graph bs=2: 1/2 differ from the reference")
    return trial


def reload_error_trial() -> TrialRecord:
    trial = mismatch_trial()
    for s in trial.steps:
        s.extra = {"max_scaled_err": 0.01 if s.step < 5 else 1.8}
    trial.steps[7].extra["max_scaled_err"] = "NaN"  # read back from strict JSON
    return trial


def html_page(tmp_path, report: Report) -> str:
    path = tmp_path / "out" / "report.html"
    rp.write_html(report, path)
    return path.read_text()


def test_html_environment_is_a_readable_table(tmp_path):
    env = {
        "summary": "no GPU",
        "host": {"hostname": "vm", "cpu_count": 2},
        "driver": None,
        "gpus": [],
        "torch": {"version": "2.13.0+cpu", "cuda": None, "cuda_built": False},
        "env": {},
    }
    page = html_page(tmp_path, Report(environment=env, trials=[clean_trial()]))
    section = page[page.index('<details class="environment">') :]
    assert page.index('<section id="trial-0">') < page.index('<details class="environment">')  # verdict first
    for raw in ("{", "null", "[]", "&#34;"):
        assert raw not in section, raw
    assert "<th>host hostname</th><td>vm</td>" in section
    assert "<th>torch cuda_built</th><td>no</td>" in section
    assert "<th>gpus</th><td>none</td>" in section


def test_html_findings_show_their_fields_under_their_labels(tmp_path):
    page = html_page(tmp_path, Report(environment={}, trials=[illegal_address_trial()]))
    finding = page[page.index('<div class="finding">') :]
    finding = finding[: finding.index("</div>")]
    rows = dict(re.findall(r"<tr><th>([^<]*)</th><td[^>]*>(.*?)</td></tr>", finding))
    assert "0x7f2a40000000" in rows["address"]
    assert "128 MiB" in rows["tensor"]
    assert "get_full_lm_head_weight" in rows["created at"]
    assert "setup_centroids_cuda_graphs" in rows["freed at"]
    assert "gemma4_mtp.py:88 get_full_lm_head_weight" in rows["alloc stack"]


def test_html_artifacts_are_links_relative_to_the_page(tmp_path):
    trial = clean_trial()
    trial.artifacts = {"rank 0 records": str(tmp_path / "runs" / "t 1" / "rank0.jsonl")}
    page = html_page(tmp_path, Report(environment={}, trials=[trial]))
    assert '<a class="mono" href="../runs/t%201/rank0.jsonl">' in page


def test_html_charts_per_reload_error_and_per_graph_mismatches(tmp_path):
    page = html_page(tmp_path, Report(environment={}, trials=[reload_error_trial(), gemma_reuse_trial()]))
    nvfp4, gemma = page.split('<section id="trial-1">')
    assert nvfp4.count("<svg") == 1 and "Error per reload" in nvfp4
    assert "<polyline" in nvfp4 and "tolerance 0.05" in nvfp4
    assert nvfp4.count('<circle class="dot') == 50
    assert ">NaN</text>" in nvfp4 and "reload 7: not finite" in nvfp4  # drawn and labelled, not dropped
    assert gemma.count("<svg") == 1 and "per batch size (one captured graph each)" in gemma
    bars = re.findall(r'<rect class="s0"[^>]*height="([\d.]+)"><title>graph graph bs=(\d+): ([\d.]+)</title>', gemma)
    assert [(bs, share) for _, bs, share in bars] == [("1", "0"), ("2", "0.5"), ("4", "0.75"), ("8", "0.75")]
    heights = [float(h) for h, _, _ in bars]
    assert heights[0] == 0 < heights[1] < heights[2] == heights[3]
    assert "<script" not in page and "javascript:" not in page


def test_html_has_no_chart_where_a_table_says_it_all(tmp_path):
    page = html_page(tmp_path, Report(environment={}, trials=[clean_trial(), cpu_trial()]))
    assert "<svg" not in page


def test_html_is_rendered_by_an_autoescaping_template(tmp_path):
    trial = illegal_address_trial()
    trial.notes = ['<img src=x onerror="alert(1)">']
    trial.artifacts = {"<b>x</b>": 'a"b/<c>.jsonl'}
    page = html_page(tmp_path, Report(environment={"summary": "<i>env</i>"}, trials=[trial]))
    assert "<img" not in page and "<b>x</b>" not in page and "<i>env</i>" not in page
    assert "&lt;img src=x onerror=&#34;alert(1)&#34;&gt;" in page


def test_template_is_package_data():
    import importlib.resources
    import tomllib
    from fnmatch import fnmatch

    template = importlib.resources.files("repro.report") / "templates" / "report.html"
    assert template.is_file()
    data = tomllib.loads((Path(__file__).parent.parent / "pyproject.toml").read_text())
    patterns = data["tool"]["setuptools"]["package-data"]["repro"]
    assert any(fnmatch("report/templates/report.html", p) for p in patterns)
    assert any(d.startswith("jinja2") for d in data["project"]["dependencies"])


def test_census_finding_says_which_mechanism_saw_it_and_where_the_guard_disagrees():
    trial = illegal_address_trial()
    trial.guard_findings = [
        Finding(
            slot="<block 0x7f2a40000000 read by node 3 kernel gatherTopK param 8 +0>",
            graph="centroids bs=16",
            status="released",
            when="after set-up",
            rank=0,
            shape=[],
            dtype="",
            nbytes=134217728,
            old_ptr=LM_HEAD_PTR,
            mechanism="census",
            census={
                "block_start": LM_HEAD_PTR,
                "block_size": 134217728,
                "block_pool": [0, 0],
                "status": "released",
                "how": "allocator state",
                "references": 2,
                "sites": ["node 3 kernel gatherTopK param 8 +0"],
            },
            disagreement="the guard did not see this storage (it never passed the dispatcher)",
        )
    ]
    text = trial_text(trial)
    assert "seen by" in text and "census" in text
    assert "allocator block · 128 MiB" in text
    assert "node 3 kernel gatherTopK param 8 +0" in text
    assert "the guard did not see this storage" in text
    trial.details = {
        "census": [{"graph": "centroids bs=16", "references": 4}],
        "after_free": {
            "note": "1/1 free regions re-allocated and filled (poison)",
            "writes": "0xFF bytes over each freed captured block",
        },
    }
    trial.config["run"]["guard"] = "off"
    text = trial_text(trial)
    assert "1 graphs read, 4 captured addresses outside their pools checked" in text
    assert "the graph census still checked" in text and "0xFF bytes over each" in text
    from repro.report.html import report_html

    html = report_html(Report(environment={}, trials=[trial]))
    assert "disagreement" in html and "the guard did not see this storage" in html


@pytest.mark.parametrize("width", [80, 100, 130, 200])
def test_summary_is_a_table_only_where_every_column_fits_whole(width):
    report = full_report()
    report.trials[0].config["run"]["reload_drafter"] = True  # the longest config
    report.trials[3].met, report.trials[3].expected = True, [Outcome.UNSUPPORTED]  # "skipped (not a pass)"
    text = rp.report_to_text(report, width=width)
    summary = text[text.rindex("Summary") :]
    assert "…" not in summary
    assert max(len(line.rstrip()) for line in summary.splitlines()) <= width
    assert "reload-drafter" in summary
    if "first failure" in summary:  # the table: every header whole
        for header in ("scenario", "mode", "config", "outcome", "expected", "met", "seconds"):
            assert header in summary.splitlines()[1], header
    assert "9005/131072 elements above tolerance" in re.sub(r"\s+", " ", summary)


def test_one_finding_per_rank_is_one_group_with_its_ranks():
    """gemma4-mtp at TP 2: each rank finds the same dead local; one headline names both ranks."""
    trial = illegal_address_trial()
    base = trial.guard_findings[0]
    trial.guard_findings = [
        Finding(
            **{
                **base.__dict__,
                "rank": r,
                "old_ptr": base.old_ptr + r * 4096,
                "message": f"rank {r}: the storage has been freed",
            }
        )
        for r in (0, 1)
    ]
    text = trial_text(trial)
    assert text.count(f"FREED {SLOT}") == 1 and "ranks 0, 1 · 2 findings" in text
    assert "(rank 0; 2 addresses in all)" in text
    assert "rank 0: the storage has been freed" in text


def test_repeated_mistake_shows_its_message_once():
    """nvfp4-reload: every tensor of the rebuilt kernel, dropped at one line; one message."""
    trial = illegal_address_trial()
    base = trial.guard_findings[0]
    trial.guard_findings = [
        Finding(
            **{
                **base.__dict__,
                "slot": f"moe.kernel.{name}",
                "old_ptr": base.old_ptr + i,
                "message": "Replaying will read freed memory: keep the tensor alive",
            }
        )
        for i, name in enumerate(("expert_map", "workspace13", "w13_alpha"))
    ]
    text = trial_text(trial)
    assert "Findings (3 in 3 groups)" in text
    assert text.count("Replaying will read freed memory") == 1
    assert "each finding's message is in --json and --html" in text
    for name in ("expert_map", "workspace13", "w13_alpha"):
        assert f"FREED moe.kernel.{name}" in text


def test_freed_storage_renamed_is_explained_beside_the_manifest():
    from repro.outcome import Manifest

    trial = illegal_address_trial()
    base = trial.guard_findings[0]
    trial.guard_findings = [Finding(**{**base.__dict__, "new_ptr": base.old_ptr + 4096})]
    trial.manifests = [Manifest(when="after reload 0", rank=0, freed=1, moved=0, rebound=0, unchanged=3)]
    text = trial_text(trial)
    assert "counted as freed" in text and "rebound" in text
    trial.guard_findings = [base]  # no new tensor behind the name: no note
    assert "counted as freed" not in trial_text(trial)


# ---- the HTML page's shape (docs/screenshots show it) ---------------------------------------


def test_html_leads_with_the_verdict_and_folds_the_rest(tmp_path):
    env = {"summary": "no GPU", "host": {"hostname": "vm", "cpu_count": 2}, "gpus": [], "env": {}}
    page = html_page(tmp_path, Report(environment=env, trials=[illegal_address_trial(), clean_trial()]))
    order = [
        page.index(s)
        for s in ('class="lead', "<h2>Summary</h2>", '<section id="trial-0">', '<details class="environment">')
    ]
    assert order == sorted(order)  # tally, summary, trials, environment
    trial0 = page[page.index('<section id="trial-0">') : page.index('<section id="trial-1">')]
    verdict, rest = trial0.split('<details class="trial-details">')
    assert "ILLEGAL_ADDRESS" in verdict and "Findings (1)" in verdict  # on the first screen
    assert "<summary>details: steps, timings, notes, artifacts</summary>" in trial0
    assert "Steps (1)" in rest and "timings:" in rest  # folded
    assert 'table class="summary"' in page and "table.summary td{white-space:nowrap}" in page
    assert page.count('<div class="scroll"><table') >= 3  # wide tables scroll, the page does not


def test_html_says_why_a_chart_is_missing_and_draws_no_flat_line(tmp_path):
    flat = reload_error_trial()
    for s in flat.steps:
        s.extra = {"max_scaled_err": 0.0}
    page = html_page(tmp_path, Report(environment={}, trials=[flat, cpu_trial()]))
    assert "<svg" not in page
    assert "no chart: the error was 0 at every reload" in page
    assert "no chart: " in page.split('<section id="trial-1">')[1]  # gemma4-mtp on CPU says why


def test_html_chart_axis_is_a_column_of_the_steps_table(tmp_path):
    page = html_page(tmp_path, Report(environment={}, trials=[reload_error_trial()]))
    assert ">scaled err</text>" in page  # the chart's y axis
    assert '<th class="num">scaled err</th>' in page  # the same measure in the table


def test_screenshots_of_the_pages_are_in_docs_at_both_widths():
    import struct

    shots = Path(__file__).resolve().parent.parent / "docs" / "screenshots"
    for page in ("trial", "matrix", "watch"):
        for width in (1280, 800):
            data = (shots / f"{page}-{width}.png").read_bytes()
            assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) < 300_000
            assert struct.unpack(">II", data[16:24])[0] == width  # IHDR: the window's width


# ---- a slow trial at TP 64 (`repro gemma4-mtp --steps 5000 --tp 64` on CPU) -------------------


def tp64_deadline_trial() -> TrialRecord:
    """Three steps done on each of 64 ranks when the deadline came, one dead local per rank."""
    trial = illegal_address_trial()
    base = trial.guard_findings[0]
    trial.outcome, trial.met, trial.graph_replayed = Outcome.DEADLINE, False, False
    trial.config = config("gemma4-mtp", "unfixed", tp=64, device="cpu", steps=5000)
    trial.first_failure = FirstFailure(
        Outcome.DEADLINE,
        None,
        3,
        "deadline 120 s reached in step 3 (3 of 5000 steps done) while progressing (last record 19.2 s before)",
    )
    trial.steps = [
        StepRecord(step=i, rank=r, batch=1, replayed=False, numel=3, compared=3, seconds=7.4)
        for i in range(3)
        for r in range(64)
    ]
    trial.guard_findings = [
        Finding(**{**base.__dict__, "rank": r, "old_ptr": base.old_ptr + r * 4096}) for r in range(64)
    ]
    trial.ranks = []
    trial.measures.update(tokens_per_s=0.21, acceptance_rate=0.61, mean_accepted_length=2.83, lossless=True)
    trial.artifacts = {f"rank {r} records": f"/runs/20261201/00-gemma4-mtp/rank{r}.jsonl" for r in range(64)}
    return trial


def test_a_64_rank_trial_reads_in_a_screen_its_counts_in_steps_and_ranks():
    text = trial_text(tp64_deadline_trial())
    assert "ranks 0-63 · 64 findings" in text  # not 64 numbers over five lines
    assert "Steps (3 on 64 ranks)" in text and "Steps (192)" not in text
    assert "ranks 0-63 records: rank0.jsonl … rank63.jsonl (64 files)" in text
    assert "rank 5 records" not in text
    assert "first failure: DEADLINE · step 3 · deadline 120 s" in text and "rank -" not in text
    assert "0.21 tokens/s" in text
    assert len(text.splitlines()) < 80


def test_rank_ranges_and_rates():
    from repro.report.fmt import fmt_ranges, fmt_rate

    assert fmt_ranges([0, 1]) == "0, 1" and fmt_ranges(range(64)) == "0-63"
    assert fmt_ranges([5, 0, 1, 2]) == "0-2, 5"
    assert fmt_rate(382.4) == "382" and fmt_rate(0.2149) == "0.21" and fmt_rate(3.14) == "3.1"
