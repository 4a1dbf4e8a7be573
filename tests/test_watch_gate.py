"""The replay wrapper's gate (repro/watch/hooks/graphs.py Gate): settled graphs replay past one
compare and one set lookup, never a per-graph lookup; graphs not yet replayed since their
capture keep their first-replay deep check; a dead captured storage sends replays back through
the checks until one pass has tested every settled graph, and the graph that lost it still
reports at its own next replay. CPU: a stand-in graph class (tests/watch_programs/fake_graph)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from conftest import REPO

from repro.watch.hooks.graphs import Mode

PROGRAMS = REPO / "tests" / "watch_programs"


class CountingDict(dict):
    """The wrapper's per-graph lookup, counted."""

    gets = 0

    def get(self, key, default=None):
        CountingDict.gets += 1
        return super().get(key, default)


def watched_engine(tmp_path, graphs: int):
    """A watcher over a fresh stand-in graph class, its by_id counted, and an engine whose
    graph i captured its cache_i."""
    import torch
    from repro.watch import hooks as watch_hooks

    sys.path.insert(0, str(PROGRAMS))
    try:
        from fake_graph import FakeGraph, capture
    finally:
        sys.path.remove(str(PROGRAMS))
    Graph = type("Graph", (FakeGraph,), {})
    watcher = watch_hooks.Watcher(watch_hooks.WatchSettings(str(tmp_path), "warn", "api"))
    watcher.log.recorder = watch_hooks.Recorder(str(tmp_path))
    watcher.graphs.by_id = CountingDict()
    watcher.patch(Graph)

    class Engine:
        pass

    engine = Engine()
    made = []
    for i in range(graphs):
        setattr(engine, f"cache_{i}", torch.zeros(4, 4))
        graph = Graph()
        with capture(graph):
            getattr(engine, f"cache_{i}").add_(1)
        made.append(graph)
    return watcher, engine, made


def settle(*graphs) -> None:
    """Replays that take each graph through its deep check, then its storages tested once,
    then settled."""
    for _ in range(3):
        for graph in graphs:
            graph.replay()


def test_settled_graphs_replay_without_a_per_graph_lookup_and_a_new_one_keeps_its_deep_check_plumbing(tmp_path):
    watcher, engine, (a, b, c) = watched_engine(tmp_path, 3)
    gate = watcher.graphs.gate
    settle(a, b)
    assert watcher.log.counters.checks_deep == 2
    assert gate.at == watcher.tools.drops.n and id(a) not in gate.held and id(b) not in gate.held
    assert id(c) in gate.held  # captured, never replayed: an engine replays few of its sizes
    assert gate.mode == Mode.HELD  # only held graphs are checked
    # c still waits for its first-replay check: the wrapper stays on the class
    assert type(a).replay is watcher.replay_wrappers[type(a)]
    CountingDict.gets = 0
    for _ in range(10):
        a.replay(), b.replay()
    assert CountingDict.gets == 0 and watcher.log.counters.replays == 26
    c.replay()
    assert watcher.log.counters.checks_deep == 3  # c's first replay is still checked deeply
    watcher.log.recorder.close()


def test_a_dead_storage_is_reported_at_its_graphs_next_replay_after_the_gate_reopened_plumbing(tmp_path):
    import torch

    watcher, engine, (a, b) = watched_engine(tmp_path, 2)
    gate = watcher.graphs.gate
    settle(a, b)
    engine.cache_1 = torch.zeros(4, 4)  # rebinding frees what b captured
    assert watcher.tools.drops.n == 1 and gate.at != watcher.tools.drops.n  # the gate is stale
    CountingDict.gets = 0
    for _ in range(4):
        a.replay()  # per-graph path until the stale replays outnumber the graphs it let through
    assert CountingDict.gets >= 1
    assert gate.at == watcher.tools.drops.n and id(a) not in gate.held and id(b) in gate.held
    CountingDict.gets = 0
    a.replay()
    assert CountingDict.gets == 0 and watcher.log.counters.findings == 0
    b.replay()
    assert watcher.log.counters.findings == 1
    records = [json.loads(line) for line in Path(watcher.log.recorder.path).read_text().splitlines()]
    slots = [r["finding"]["slot"] for r in records if r["kind"] == "finding"]
    assert slots == ["engine.cache_1"]  # a local of the capturing function
    watcher.log.recorder.close()


def test_a_reset_holds_every_other_graph_for_its_deep_check_plumbing(tmp_path):
    watcher, engine, (a, b) = watched_engine(tmp_path, 2)
    gate = watcher.graphs.gate
    settle(a, b)
    assert not {id(a), id(b)} & gate.held
    b.reset()
    assert {id(a), id(b)} <= gate.held
    a.replay()
    assert watcher.log.counters.checks_deep == 3
    watcher.log.recorder.close()


def test_with_every_graph_settled_the_wrappers_stand_aside_until_a_death_or_a_capture_plumbing(tmp_path):
    import torch

    watcher, engine, (a, b) = watched_engine(tmp_path, 2)
    gate, graph_class = watcher.graphs.gate, type(a)
    hook = graph_class.replay
    settle(a, b)
    assert gate.mode == Mode.ASIDE and gate.asides == 1  # nothing held, nothing died
    # Standing aside, the class's replay is torch's own: nothing of ours runs at a replay.
    assert graph_class.replay is hook.__wrapped__
    entered = []
    real = watcher.checks.before_replay
    watcher.checks.before_replay = lambda g: entered.append(g) or real(g)
    counted, CountingDict.gets = watcher.log.counters.replays, 0
    saved = b.replay  # saved while standing aside: torch's bound replay (unwatched, documented)
    for _ in range(5):
        a.replay(), saved()
    assert CountingDict.gets == 0 and entered == [] and watcher.log.counters.replays == counted
    assert saved.__func__ is hook.__wrapped__
    engine.cache_1 = torch.zeros(4, 4)  # frees what b captured: the wrapper is back at once, by the drop
    assert gate.mode == Mode.STALE and graph_class.replay is hook
    b.replay()
    assert entered == [b] and watcher.log.counters.findings == 1
    for _ in range(4):
        a.replay()  # the gate reopens; b stays held (its storage is dead)
    assert gate.mode == Mode.HELD and id(b) in gate.held and graph_class.replay is hook
    watcher.log.recorder.close()


def test_a_capture_arms_the_wrappers_and_the_new_graph_gets_its_deep_check_plumbing(tmp_path):
    watcher, engine, (a,) = watched_engine(tmp_path, 1)
    gate = watcher.graphs.gate
    settle(a)
    assert gate.mode == Mode.ASIDE
    new = type(a)()
    new.capture_begin()
    engine.cache_0.add_(1)
    new.capture_end()
    assert gate.mode == Mode.HELD and id(new) in gate.held
    new.replay()
    assert watcher.log.counters.checks_deep == 2
    settle(new)
    assert gate.mode == Mode.ASIDE and gate.asides == 2
    watcher.log.recorder.close()
