"""`repro.census`, the path users import: the census API lives in repro/diagnose/census.py, the
records a user reads of it (blocks, words, references, fates) in its neighbours there.

A package rather than census.py so that the old file is gone and git follows the module to its new
place (a change to census.py made elsewhere merges into repro/diagnose/census.py).
"""

from repro.diagnose.census import *  # noqa: F401,F403

# What a census's records are made of, from where each lives (census.py itself uses only some).
from repro.diagnose.allocator import Block, BlockState, PoolMap  # noqa: F401
from repro.diagnose.captured import GraphCensus, Reference, Word  # noqa: F401
from repro.diagnose.cuda_driver import DriverError, NodeKind  # noqa: F401
from repro.diagnose.fates import Fate, census_finding  # noqa: F401
