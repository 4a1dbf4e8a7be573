"""repro: reproduce and diagnose CUDA-graph memory-lifetime bugs in LLM inference engines."""
__version__ = "0.1.0"
