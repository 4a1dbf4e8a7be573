"""`repro.stability`, the path users import: the module lives in repro/diagnose/stability.py."""
from repro.diagnose.stability import *  # noqa: F401,F403
