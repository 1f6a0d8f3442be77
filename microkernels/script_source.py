"""TVMScript builders that parse the source their module was imported with.

TVM's parser reads a decorated function's source from its file whenever the decorator runs:
in a builder (a function defining a ``@T.prim_func`` from its arguments), at every call.  A
process whose installed package changes under it (an upgrade during a long tuning run, an
edit during a test run) would then parse the new file's text with the old code's closure
values: an error ("Function must be decorated"), or a different kernel.  :func:`pin_source`
keeps the text a module was imported from in :mod:`linecache` as an entry without a
modification time, which ``linecache.checkcache`` leaves alone, so every later parse reads
the source the running code was compiled from.

Examples
--------
>>> import linecache, sys
>>> pin_source(__name__)
>>> linecache.cache[sys.modules[__name__].__file__][1] is None
True
"""

from __future__ import annotations

import linecache
import sys
import tokenize

__all__ = ["pin_source"]


def pin_source(module_name: str) -> None:
    """Keep the source module ``module_name`` (imported) was loaded from for TVM's parser.

    Call it at the top of a module that builds TVMScript functions at run time, right
    after its imports: ``pin_source(__name__)``.
    """
    path = sys.modules[module_name].__file__
    if path is None:
        return
    with tokenize.open(path) as source:  # the encoding Python compiled it with
        text = source.read()
    lines = text.splitlines(keepends=True)
    linecache.cache[path] = (len(text), None, lines, path)
