"""`repro.stability`, the path users import: the module lives in repro/diagnose/stability.py.

A package rather than stability.py so that the old file is gone and git follows the module to its new
place (a change to stability.py made elsewhere merges into repro/diagnose/stability.py).
"""

from repro.diagnose.stability import *  # noqa: F401,F403
