"""Known-harmless warnings, silenced at the process entry points (the CLI and each worker).

Without numpy, `import torch` warns "Failed to initialize NumPy: No module named 'numpy'"
(torch/csrc/utils/tensor_numpy.cpp). Nothing here converts tensors to numpy, so it changes
nothing; but every rank and the doctor print it, and it filled the stderr tails that HANG and
CRASH reports and JUnit system-err show. Only that message is filtered.
"""

from __future__ import annotations

import warnings

NUMPY_MISSING = r"Failed to initialize NumPy"


def silence_known_warnings() -> None:
    warnings.filterwarnings("ignore", message=NUMPY_MISSING, category=UserWarning)
