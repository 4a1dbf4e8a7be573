"""repro/diagnose/sites.py: reading a frame's locals without side effects (what the watch hooks use to
name what the capturing code holds)."""

from __future__ import annotations

import gc
import sys
import weakref

from repro.diagnose import sites


def locals_of_caller(depth: int = 1) -> dict:
    frame = sys._getframe(depth + 1)
    try:
        return dict(sites.frame_locals(frame))
    finally:
        del frame


def test_frame_locals_reads_arguments_locals_and_cells_and_skips_unbound_ones():
    def f(a, b, *args, **kw):
        x = [1]  # noqa: F841 (read through the frame)
        cell = "held by a closure"

        def inner():
            return cell

        got = locals_of_caller(0)
        late = 5  # noqa: F841 (unbound when read)
        return got, inner

    got, inner = f(1, "two", 3, k=4)
    assert got["a"] == 1 and got["b"] == "two" and got["args"] == (3,) and got["kw"] == {"k": 4}
    assert got["x"] == [1] and got["inner"] is inner
    assert got["cell"] == "held by a closure"  # a cell variable: its contents, not the cell
    assert "late" not in got and "got" not in got  # not yet bound when read


def test_frame_locals_skips_an_empty_cell_and_reads_free_variables():
    def outer():
        captured = object()

        def f():
            seen = captured
            got = locals_of_caller(0)
            return got, seen

        never = None  # noqa: F841

        def g():
            return never  # noqa: F821 (an empty cell: deleted below)

        del never  # an empty cell
        return f(), locals_of_caller(0)

    (inner_got, seen), outer_got = outer()
    assert inner_got["captured"] is seen and inner_got["seen"] is seen
    assert "never" not in outer_got and "g" in outer_got and "captured" in outer_got


def test_reading_locals_changes_no_reference_count_and_keeps_nothing_alive():
    class Thing:
        pass

    thing = Thing()
    ref = weakref.ref(thing)
    before = sys.getrefcount(thing)
    for _ in range(200):
        assert locals_of_caller(0)["thing"] is thing
    gc.collect()
    assert sys.getrefcount(thing) == before
    del thing
    gc.collect()
    assert ref() is None


def test_a_frame_read_many_times_still_sees_its_later_assignments():
    def f():
        value = 1
        first = locals_of_caller(0)["value"]
        value = 2
        return first, locals_of_caller(0)["value"], value

    assert f() == (1, 2, 2)


def test_module_frames_give_their_namespace():
    namespace: dict = {"sites": sites, "sys": sys}
    exec("frame = sys._getframe()\nfound = dict(sites.frame_locals(frame))\ndel frame", namespace)
    assert namespace["found"]["sites"] is sites


def test_recorded_site_is_the_innermost_frame_of_the_program_itself():
    import os

    import repro
    import torch

    torch_file = os.path.join(os.path.dirname(torch.__file__), "nn", "modules", "linear.py")
    hooks_file = os.path.join(os.path.dirname(repro.__file__), "watch", "hooks", "capture.py")
    helper = "/srv/app/helpers.py"  # the caller's plumbing (a capture wrapper)
    stack = [  # innermost first, as torch's memory snapshot records an allocation
        {"filename": "??", "line": 0, "name": "native"},
        {"filename": torch_file, "line": 106, "name": "__init__"},
        {"filename": hooks_file, "line": 40, "name": "end"},
        {"filename": helper, "line": 3, "name": "make"},
        {"filename": "/srv/app/model.py", "line": 27, "name": "build"},
        {"filename": "/srv/app/main.py", "line": 9, "name": "<module>"},
    ]
    assert sites.recorded_site(stack, frozenset({helper})) == "model.py:27 in build"
    assert sites.recorded_site(stack, frozenset()) == "helpers.py:3 in make"
    assert sites.recorded_site(stack[:3], frozenset()) is None  # torch's and repro's only
    assert sites.recorded_site([], frozenset()) is None and sites.recorded_site(None, frozenset()) is None
    frozen = {"filename": "<frozen runpy>", "line": 88, "name": "_run_code"}
    assert sites.recorded_site([frozen, stack[4]], frozenset()) == "model.py:27 in build"
