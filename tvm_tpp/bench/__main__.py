"""A benchmark worker: ``python -m tvm_tpp.bench JOB`` (see :mod:`tvm_tpp.bench.protocol`)."""

import sys

from .protocol import main

sys.exit(main())
