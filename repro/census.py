"""`repro.census`, the path users import: the module lives in repro/diagnose/census.py."""
from repro.diagnose.census import *  # noqa: F401,F403
