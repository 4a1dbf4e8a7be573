"""`repro.guard`, the path users import: the module lives in repro/diagnose/guard.py.

A package rather than guard.py so that the old file is gone and git follows the module to its new
place (a change to guard.py made elsewhere merges into repro/diagnose/guard.py).
"""

from repro.diagnose.guard import *  # noqa: F401,F403
