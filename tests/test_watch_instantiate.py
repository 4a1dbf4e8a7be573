"""A kept graph's instantiation at capture end (repro/watch/hooks/instantiate.py): a large graph's
goes to a thread while the census sorts what it read, a small one's runs inline, and either way
the capturing thread gets the graph instantiated, or the instantiation's own exception, when
finish() returns. CPU: the graphs are stand-ins (the GPU runs instantiate real ones)."""

from __future__ import annotations

import threading
import types

import pytest

from repro.watch.hooks.instantiate import THREAD_WORDS, Instantiation


class Graph:
    def __init__(self, error: BaseException | None = None, gate: threading.Event | None = None):
        self.error, self.gate = error, gate
        self.threads: list[str] = []

    def instantiate(self):
        if self.gate is not None:
            assert self.gate.wait(5)  # holds the thread until the caller has moved on
        self.threads.append(threading.current_thread().name)
        if self.error is not None:
            raise self.error


def census(words: int):
    return types.SimpleNamespace(words=words)


def test_a_large_graph_instantiates_on_a_thread_while_the_caller_goes_on():
    gate = threading.Event()
    graph = Graph(gate=gate)
    inst = Instantiation(graph)
    inst.start(census(THREAD_WORDS))
    assert graph.threads == []  # still instantiating: start() did not wait
    gate.set()  # what the caller does meanwhile (the census's sort) is done
    inst.finish()
    assert graph.threads == ["repro-watch-instantiate"]
    assert not inst.thread.is_alive()  # nothing left running once capture_end returns


def test_a_small_graph_or_no_census_instantiates_inline_at_finish():
    for words in (None, THREAD_WORDS - 1):
        graph = Graph()
        inst = Instantiation(graph)
        inst.start(None if words is None else census(words))
        assert inst.thread is None and graph.threads == []
        inst.finish()
        assert graph.threads == [threading.current_thread().name]


def test_the_instantiations_exception_reaches_the_capturing_thread():
    for words in (THREAD_WORDS, 1):
        error = RuntimeError("CUDA error: out of memory")
        inst = Instantiation(Graph(error=error))
        inst.start(census(words))
        with pytest.raises(RuntimeError) as got:
            inst.finish()
        assert got.value is error  # the same exception the program would have had from torch


def test_start_is_taken_once():
    graph = Graph()
    inst = Instantiation(graph)
    inst.start(census(THREAD_WORDS))
    first = inst.thread
    inst.start(census(THREAD_WORDS))
    inst.finish()
    assert inst.thread is first and len(graph.threads) == 1
