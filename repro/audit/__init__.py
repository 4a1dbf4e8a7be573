"""`repro vllm-audit`: which upstream CUDA-graph lifetime fixes a vLLM source carries, read as text
(scan: installed package, directory, archive; rules: the fixes and how each is judged). Parent-side:
no torch, and vLLM is never imported.
"""
