"""The environment a run meets: the GPU inventory through NVML (gpus, inventory; doctor draws it as
tables) and torch's build facts (runtime). Parent-side: nothing here imports torch at import time
(runtime reads it when asked).
"""
