"""The README's guard example runs as shipped and finds the dead local."""

import runpy

from conftest import REPO


def test_guard_example_names_the_dead_local(capsys):
    slots = runpy.run_path(str(REPO / "examples" / "guard_own_graph.py"))["main"]()
    assert len(slots) == 1 and "local weight of capture_routine" in slots[0]
    out = capsys.readouterr().out
    assert "has been freed" in out and "guard_own_graph.py" in out
