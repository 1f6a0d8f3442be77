"""Re-export of :mod:`microkernels.isa`: ISA detection, register files and cache sizes."""

from microkernels.isa import *  # noqa: F403
from microkernels.isa import __all__  # noqa: F401
