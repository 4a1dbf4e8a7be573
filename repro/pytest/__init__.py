"""pytest plugin: every CUDA graph a test session captures, checked before every replay.

Registered through the ``pytest11`` entry point (``-p repro.pytest`` loads it from a checkout;
``-p no:repro`` disables it) and inert unless asked for:

    pytest --repro-watch            # = --repro-watch=fail: a finding fails the test that replayed
    pytest --repro-watch=warn       # findings listed at the end, tests unaffected
    REPRO_WATCH=1 pytest            # the same switch as `repro watch` (REPRO_WATCH=warn: warn)
    pytest --repro-watch --repro-watch-stacks  # and where each tensor was made (repro watch --stacks)

When off, this module is all that is imported (no torch, no repro.diagnose.guard) and its hooks return
at once. When on, repro.pytest.watch starts the watch hooks in the test process and, through
the environment, in every process a test starts; each finding is attributed to the test phase
that captured the graph and the one that replayed it.

Also here, on or off: the marker ``repro_watch(off=True | expect=...)`` and the fixture
``repro_stable`` (the reload-stability check, repro.diagnose.stability.expect_stable).
"""

from __future__ import annotations

import contextlib
import os
from enum import StrEnum

import pytest

ENTRY_POINT = "repro"  # the name `-p no:repro` blocks
SESSION_PLUGIN = "repro-watch-session"


class WatchMode(StrEnum):
    """What a finding does to the test that replayed the graph."""

    FAIL = "fail"  # fails it (the finding is the failure text)
    WARN = "warn"  # nothing: findings are listed at the end


ENV_ON = "REPRO_WATCH"  # repro.watch.settings.ENV_ON (not imported: this module stays bare)
MARKER_HELP = (
    "repro_watch(off=False, expect=None): off=True: findings in this test do not fail "
    "it; expect='glob' or a list of globs (matched against the tensor name or the "
    "finding's text): findings this test must produce (a missing one fails it)"
)


def pytest_addoption(parser: pytest.Parser, pluginmanager: pytest.PytestPluginManager) -> None:
    # Loaded by `-p repro.pytest` while the entry point is installed too: register once (the
    # entry point would register this same module again, under its own name).
    if pluginmanager.get_plugin(ENTRY_POINT) is None and not pluginmanager.is_blocked(ENTRY_POINT):
        pluginmanager.set_blocked(ENTRY_POINT)
    group = parser.getgroup("repro", "repro: CUDA-graph capture checks")
    group.addoption(
        "--repro-watch",
        action="store_const",
        const=WatchMode.FAIL,
        dest="repro_watch",
        default=None,
        help="check every CUDA graph the tests capture, in the test process and the "
        "processes tests start; a finding fails the test that replayed the graph "
        "(--repro-watch=fail, the default) or is listed at the end "
        "(--repro-watch=warn)",
    )
    for mode in WatchMode:  # exact option strings: `--repro-watch PATH` must leave PATH alone
        group.addoption(
            f"--repro-watch={mode}",
            action="store_const",
            const=mode,
            dest="repro_watch",
            help=f"--repro-watch in {mode} mode",
        )
    group.addoption(
        "--repro-watch-dir",
        dest="repro_watch_dir",
        default=None,
        metavar="DIR",
        help="where the per-process records go (default: REPRO_WATCH_DIR, else a new "
        "temporary directory, printed in the header)",
    )
    group.addoption(
        "--repro-watch-stacks",
        action="store_true",
        dest="repro_watch_stacks",
        default=False,
        help="with --repro-watch: the allocator records every allocation's Python stack, so "
        "graph-census findings say where the tensor was created (a cost per allocation; "
        "REPRO_WATCH_STACKS=1 does the same)",
    )


def watch_mode(config: pytest.Config) -> WatchMode | None:
    """The mode, None when off: from the option, else from REPRO_WATCH."""
    mode = config.getoption("repro_watch", None)
    if mode is not None:
        return mode
    env = os.environ.get(ENV_ON, "").strip().lower()
    if env in ("", "0"):
        return None
    return WatchMode.WARN if env == WatchMode.WARN else WatchMode.FAIL


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", MARKER_HELP)
    mode = watch_mode(config)
    if mode is None:
        return
    from repro.pytest.watch import WatchSession

    config.pluginmanager.register(WatchSession.start(config, mode), SESSION_PLUGIN)


@pytest.fixture
def repro_stable(request: pytest.FixtureRequest):
    """``with repro_stable(model, name="model"): reload(model)``: the test fails naming every
    tensor slot the block freed, rebound, moved or reshaped (repro.diagnose.stability.expect_stable)."""
    from repro.diagnose.stability import expect_stable

    @contextlib.contextmanager
    def check(root, name: str = "model", ignore=()):
        stability = None
        try:
            with expect_stable(root, name=name, ignore=ignore) as stability:
                yield stability
        finally:
            if stability is not None and stability.after is not None:
                request.node.user_properties.append(
                    (
                        "repro_reload",
                        f"{name}: {len(stability.after.slots)} tensor slots, {len(stability.changes)} changed",
                    )
                )

    return check
