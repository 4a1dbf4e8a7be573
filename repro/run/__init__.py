"""The parent: plans a run, starts and watches the rank processes, classifies, merges and shards. No
torch at import, no CUDA ever: GPU facts come from NVML (repro/env), ranks run in their own processes
(repro/rank), and protocol.py is all the two sides share.
"""
