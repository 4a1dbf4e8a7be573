"""Checking at replay: is what a graph captured still there?

Every replay of a settled graph is let through by the replay wrapper itself (patch.py, the
Gate in graphs.py); the others come here. A graph's first replay after its capture, or after
any graph's reset (a reset frees that graph's pool, which another graph may read: vllm-omni
#6457), takes the deep check (rebinding, and the census check of every graph due); any other,
the liveness check (one C call per captured storage, none while no captured storage died).
torch's own check_input_liveness error, where the program turned it on, is recorded as a
finding.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from repro.watch.hooks.graphs import GraphState
from repro.watch.hooks.part import Part
from repro.watch.hooks.records import torch_finding
from repro.watch.settings import OnFinding, Record

if TYPE_CHECKING:  # annotations only: nothing here imports torch until the program does
    import torch


class Checks(Part):
    """The replay and reset hooks of one process."""

    def before_replay(self, graph: torch.cuda.CUDAGraph) -> None:
        state = self.graphs.get(graph)
        if state is None or state.managed or not state.captured:
            return
        self.log.counters.replays += 1
        # The per-replay path: nothing while no captured storage died, else one C call per
        # captured storage of the graph.
        if state.deep_reason is None and state.live is not None and self.all_alive(state):
            return
        self.graphs.hold(state)
        t0 = time.perf_counter()
        try:
            if state.deep_reason is None:
                findings = self.tools.guard.check("before replay", graph=state.label, deep=False)
            else:
                findings = self.deep_check(state)
            state.live = self.live_handles(state.label)
        except Exception as e:
            self.log.internal("replay check", e)
            return
        finally:
            self.log.seconds.checks += time.perf_counter() - t0
        if findings:
            self.log.report(findings)
            if self.settings.on_finding == OnFinding.RAISE:
                from repro.diagnose.guard import StaleCaptureError

                raise StaleCaptureError(findings[0].message, findings)

    def deep_check(self, state: GraphState) -> list:
        when, state.deep_reason = state.deep_reason, None
        self.log.counters.checks_deep += 1
        guard, census = self.tools.guard, self.tools.census
        findings = guard.check(when, graph=state.label, deep=True)
        if census.book is not None and census.due:
            # Every graph captured (or reset) since the last census check, in one snapshot.
            live = {s.label for s in self.graphs.captured() if s.census is not None}
            due, census.due = [label for label in census.due if label in live], []
            census_findings = census.book.check_graphs(when, due)
            self.adopt_late(due)
            findings = census.module.merge_findings(findings, census_findings, guard.slots, True, census.book)
            self.pause_trace()
        return findings

    def adopt_late(self, labels: list[str]) -> None:
        """After a census check matched the words no owner or local held at capture: those in
        memory still allocated then may be in tensors an owner gained since its index was
        built. Build it again, once for the whole check (not per capture), and hand over
        what it names."""
        book = self.tools.census.book
        censuses = [
            book.censuses[label] for label in labels if label in book.censuses and book.censuses[label].references
        ]
        if not censuses or self.settings.record != Record.GRAPH:
            return
        self.tools.guard.refresh_index()
        sites = self.tools.allocation_sites()
        for census in censuses:
            book.hand_over(census, self.tools.guard.adopt(census.label, census.references, None, sites))

    def pause_trace(self) -> None:
        """Every graph matched: the trace can rest until the next capture (its own errors
        never cost the findings of the check that led here)."""
        try:
            if self.tools.census.book.pause_trace():
                self.log.write({"kind": "trace", "state": "paused until the next capture"})
        except Exception as e:
            self.log.internal("pausing the allocator trace", e)

    def all_alive(self, state: GraphState) -> bool:
        """Whether every storage in state.live lives; where each of them tells its death, the
        graph is settled as of the guard's drop count (the replay wrapper's fast path)."""
        drops = self.tools.drops.n
        if state.fast_at == drops:
            return True
        if any(map(self.tools.expired, state.live)):
            return False
        if self.listened(state.label):
            self.graphs.settle(state)
        return True

    def on_stale_gate(self) -> None:
        """A replay took the per-graph path because a captured storage died since the gate
        last opened. Once as many have as there are graphs the gate lets through, test those
        graphs' storages in one pass and open it again: a death costs at most twice the
        per-graph path, however rarely the other graphs replay (an engine replays few of its
        sizes)."""
        gate = self.graphs.gate
        gate.stale_replays += 1
        if gate.stale_replays > len(self.graphs.by_id) - len(gate.held):
            self.reopen()

    def reopen(self) -> None:
        """Test the storages of every graph the gate lets through: graphs with one dead are
        held (their next replay reports it), the others settle as of the drop count now."""
        drops, gate = self.tools.drops.n, self.graphs.gate
        for state in self.graphs.unheld():
            # all_alive settles it where every storage tells its death; else it stays checked
            if state.live is None or not self.all_alive(state) or state.fast_at != drops:
                self.graphs.hold(state)
        gate.at, gate.stale_replays = drops, 0
        gate.update()

    def listened(self, label: str) -> bool:
        """Whether every storage of the graph's slots tells its death (a drop callback)."""
        return all(slot.drop_ref is not None for slot in self.tools.guard.slots_of(label))

    def live_handles(self, label: str) -> tuple[int, ...] | None:
        """Handles of the graph's storages not yet reported freed; None: use the guard's path."""
        if self.tools.expired is None:
            return None
        from repro.outcome import Status  # loaded with the guard already

        handles = []
        for slot in self.tools.guard.slots_of(label):
            if Status.FREED not in slot.reported and slot.checked_in(label):
                if slot.ref is None:
                    return None
                handles.append(slot.ref.cdata)
        return tuple(handles)

    def on_replay_error(self, graph: torch.cuda.CUDAGraph, error: RuntimeError) -> None:
        """torch's own check_input_liveness (where the program turned it on) raises here."""
        text = str(error)
        if not text.startswith("CUDA graph replay detected"):
            return
        state = self.graphs.get(graph)
        try:
            self.log.report([torch_finding(state.label if state else "?", text, self.log.current_rank())])
        except Exception as e:
            self.log.internal("recording torch's liveness error", e)

    def on_reset(self, graph: torch.cuda.CUDAGraph) -> None:
        """A reset frees the graph's pool: every other graph's next replay is checked deeply."""
        try:
            self.log.counters.resets += 1
            census = self.tools.census
            state = self.graphs.get(graph)
            if state is not None:
                state.captured = False  # nothing to check until it is captured again
                self.graphs.hold(state)
                if state.census is not None and census.book is not None:
                    census.book.censuses.pop(state.label, None)
                    state.census = None
            for other in self.graphs.captured():
                if other is not state and not other.managed:
                    self.graphs.hold(other, f"first replay after a reset of {state.label if state else 'a graph'}")
                    if other.census is not None and other.label not in census.due:
                        census.due.append(other.label)
            self.log.write({"kind": "reset", "graph": state.label if state else None})
        except Exception as e:
            self.log.internal("reset", e)
