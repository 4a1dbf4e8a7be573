"""What each part of a watcher (capture recording, checking) is handed: the state it shares with
the other parts, made once per process by the Watcher."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from repro.watch.hooks.graphs import GraphStates
    from repro.watch.hooks.records import Log
    from repro.watch.hooks.tools import Tools
    from repro.watch.settings import WatchSettings


class Part:
    # A plain class, as Captures and tools.Census: the hooks are imported in every Python process
    # a watched command starts, and defining a dataclass costs ~0.3 ms there.
    def __init__(self, settings: WatchSettings, log: Log, graphs: GraphStates, tools: Tools):
        self.settings = settings  # what this process was told (record mode, on-finding)
        self.log = log  # its records, counters and seconds
        self.graphs = graphs  # what the hooks know of each graph
        self.tools = tools  # the guard and the census, made at first use
