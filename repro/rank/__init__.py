"""The rank side: what runs in a rank process (worker: one rank of one trial; dist: the
tensor-parallel process group and its collectives; graphs: capture and replay; server: the rank
server that imports torch once and forks the ranks). Torch lives here; the parent only starts
these as processes (`python -m repro.rank.server`, `python -m repro.rank.worker`) and never
imports them.
"""
