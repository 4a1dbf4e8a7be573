"""Diagnosis where the graphs are (a rank, a watched process): the stale-capture guard and what it
rests on (owners, sites, fingerprint), the graph census and its trace index, allocator forensics and
the reload-stability check. guard, owners, sites, fingerprint and stability import torch; census,
trace_index and forensics read it only when asked.
"""
