"""`repro.guard`, the path users import: the module lives in repro/diagnose/guard.py."""
from repro.diagnose.guard import *  # noqa: F401,F403
