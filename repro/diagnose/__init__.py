"""Diagnosis where the graphs are (a rank, a watched process): the stale-capture guard and what it
rests on (owners, sites, fingerprint), the graph census and its parts (cuda_driver, graph_walk,
words, allocator, trace_index, captured, fates), allocator forensics and the reload-stability
check. guard, owners, sites, fingerprint and stability import torch; the census's modules and
forensics read it only when asked.
"""
