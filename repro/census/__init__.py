"""`repro.census`, the path users import: the module lives in repro/diagnose/census.py.

A package rather than census.py so that the old file is gone and git follows the module to its new
place (a change to census.py made elsewhere merges into repro/diagnose/census.py).
"""
from repro.diagnose.census import *  # noqa: F401,F403
