"""Findings grouped by name pattern, status, mechanism and drop site (repro/report/groups.py)."""

from repro.outcome import Finding
from repro.report.groups import group_findings, slot_pattern


def finding(slot, graph="g", status="freed", rank=0, freed_at="m.py:9 in f (returned)", mechanism="guard"):
    return Finding(
        slot=slot,
        graph=graph,
        status=status,
        when="before replay",
        rank=rank,
        shape=[4],
        dtype="float32",
        nbytes=16,
        old_ptr=0x7F0000001000,
        freed_at=freed_at,
        mechanism=mechanism,
    )


def test_slot_pattern_folds_layer_indices_addresses_and_nodes():
    assert slot_pattern("model.7.rotary") == "model.*.rotary"
    assert slot_pattern("proposer.graphs[16].inputs[0]") == "proposer.graphs[*].inputs[*]"
    assert (
        slot_pattern("<block 0x7f12ab read by node 12 kernel gemm param 3 +8>")
        == "<block 0x* read by node * kernel gemm param 3 +8>"
    )
    # names without varying parts are kept as they are
    assert slot_pattern("cache.k") == "cache.k"
    assert slot_pattern("<local w of capture_fn>") == "<local w of capture_fn>"


def test_one_problem_in_many_graphs_and_ranks_is_one_group():
    found = [
        finding(f"model.{i}.rotary", graph=f"#{i} bs={b}", rank=r) for i in range(32) for b in (1, 2) for r in (0, 1)
    ]
    found.append(finding("cache.k", graph="#99", status="moved", freed_at=None))
    groups = group_findings(found)
    assert [(g.pattern, g.count) for g in groups] == [("model.*.rotary", 128), ("cache.k", 1)]
    assert groups[0].ranks() == [0, 1]
    assert len(groups[0].graphs()) == 64
    assert groups[0].names()[:2] == ["model.0.rotary", "model.1.rotary"]


def test_status_drop_site_and_mechanism_split_groups():
    found = [
        finding("w"),
        finding("w", status="rebound"),
        finding("w", freed_at="other.py:3 in g"),
        finding("w", mechanism="census"),
        finding("w"),
    ]
    groups = group_findings(found)
    assert [g.count for g in groups] == [2, 1, 1, 1]


def test_members_may_be_wrappers():
    wrapped = [{"pid": p, "f": finding("cache.k", graph=f"#{p}")} for p in (11, 12)]
    (group,) = group_findings(wrapped, finding_of=lambda w: w["f"])
    assert [m["pid"] for m in group.members] == [11, 12]
    assert group.first.graph == "#11"
