"""The environment a run meets: the GPU inventory through NVML (gpus, doctor) and torch's build facts
(runtime). Parent-side: nothing here imports torch at import time (runtime reads it when asked).
"""
