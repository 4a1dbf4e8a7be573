"""What the watch hooks do at each capture, kept cheap for engines that capture thousands of
graphs: the owners walk's per-type memo names as asking each value does (and is not used where
isinstance is not decided by the type alone); the exit record counts the census's reads."""

from __future__ import annotations

import types

import torch

from repro.watch.hooks.owners import _MAX_KINDS, _NO_MEMO, Kind, by_type_alone, owner_name


class Cache:
    def __init__(self):
        self.k = torch.zeros(2)


class Empty:
    def __init__(self):
        self.n = 3


class Slotted:
    __slots__ = ("x",)


def locals_of_a_capture() -> list[tuple[str, object]]:
    layer = torch.nn.Linear(2, 2)
    return [
        ("x", torch.zeros(2)),
        ("w", torch.nn.Parameter(torch.zeros(2))),
        ("layer", layer),
        ("self", layer),
        ("cache", Cache()),
        ("other", Empty()),
        ("self", Cache()),
        ("slots", Slotted()),
        ("n", 3),
        ("names", ["a"]),
        ("__builtins__", {}),
        ("torch", torch),
        ("fn", len),
    ]


def test_the_memo_names_as_asking_each_value_does():
    kinds: dict = {}
    for _ in range(2):  # the second pass answers from the memo
        for var, value in locals_of_a_capture():
            assert owner_name(var, value, torch, kinds) == owner_name(var, value, torch), var
    assert kinds[torch.Tensor] is Kind.SKIP and kinds[torch.nn.Linear] is Kind.MODULE
    assert kinds[Cache] is Kind.OBJECT and kinds[Slotted] is Kind.SKIP
    names = [owner_name(var, value, torch, kinds) for var, value in locals_of_a_capture()]
    assert names == [None, None, "layer", "Linear", "cache", None, "Cache", None, None, None, None, None, None]


def test_a_plain_object_is_asked_again_each_time():
    """The memo keeps a type's kind, never an object's answer: the same type with and without
    tensors is named accordingly."""
    kinds: dict = {}
    holder = Empty()
    assert owner_name("holder", holder, torch, kinds) is None
    holder.t = torch.ones(1)
    assert owner_name("holder", holder, torch, kinds) == "holder"


def test_no_memo_where_a_metaclass_decides_isinstance():
    class Meta(type):
        def __instancecheck__(cls, obj):
            return getattr(obj, "looks_like_a_tensor", False)

    class FakeTensor(metaclass=Meta):
        pass

    fake = types.SimpleNamespace(Tensor=FakeTensor, nn=types.SimpleNamespace(Module=torch.nn.Module))
    assert by_type_alone(torch)
    assert not by_type_alone(fake)
    memo = _NO_MEMO
    memo[int] = Kind.OBJECT
    assert memo.get(int) is None  # remembers nothing


def test_the_memo_stops_growing_at_its_bound():
    """A program that makes classes as it goes: the memo keeps at most _MAX_KINDS types and
    still names every local by asking it."""
    kinds: dict = {}
    made = [type(f"Made{i}", (), {}) for i in range(_MAX_KINDS + 5)]
    for cls in made:
        obj = cls()
        obj.t = torch.zeros(1)
        assert owner_name("obj", obj, torch, kinds) == "obj"
    assert len(kinds) == _MAX_KINDS


def test_the_exit_records_census_reads_where_the_census_ran():
    """The exit record says how often the census read the segment map and took a snapshot
    (what a piecewise engine's capture cost rests on), and how many words its graphs hold (what
    a full graph's census cost grows with); None where no census ran or the book
    keeps no such counts, never an error at exit."""
    from repro.watch.hooks.tools import Census

    census = Census()
    assert census.reads() is None
    census.book = types.SimpleNamespace(
        pools=types.SimpleNamespace(refreshes=12, seconds=0.0123456789),
        snapshots=3,
        censuses={"a": types.SimpleNamespace(words=70_000), "b": types.SimpleNamespace(words=1_500)},
    )
    book_reads = {"segment_maps": 12, "segment_seconds": 0.012346, "snapshots": 3, "graphs": 2, "words": 71_500}
    assert census.reads() == book_reads
    # Where the census's driver answers: how many pages it asked about, in how long.
    driver = types.SimpleNamespace(address_cache={1: True, 2: False, 9: False}, address_seconds=0.0000125)
    census.module = types.SimpleNamespace(load_driver=lambda: driver)
    assert census.reads() == {**book_reads, "address_pages": 3, "address_seconds": 0.000013}
    census.book = object()
    assert census.reads() is None
