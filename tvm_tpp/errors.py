"""The errors tvm-tpp raises for its users' mistakes, all under :class:`TppError`.

The command line prints these as one line and exits with status 2; any other exception is a
bug and keeps its traceback.  Errors about a value the user gave also subclass
``ValueError``, so ``except ValueError`` keeps working for library callers.

Examples
--------
>>> from tvm_tpp import errors
>>> issubclass(errors.TargetError, errors.TppError), issubclass(errors.TargetError, ValueError)
(True, True)
>>> try:
...     raise errors.ModelError("no such ONNX file: a.onnx")
... except errors.TppError as err:
...     print(f"tvm-tpp: error: {err}")
tvm-tpp: error: no such ONNX file: a.onnx
"""

from __future__ import annotations

__all__ = ["TppError", "ModelError", "TargetError", "DatabaseError", "NotRunnableError",
           "UsageError", "RemoteError"]


class TppError(Exception):
    """Base of the errors caused by what a user asked for, not by a bug."""


class ModelError(TppError, ValueError):
    """The model cannot be used: missing file, malformed ONNX, unknown or symbolic shapes."""


class TargetError(TppError, ValueError):
    """A malformed target spec: unknown ISA or option, or a bad option value."""


class DatabaseError(TppError, ValueError):
    """The tuning database in the work directory is missing or cannot be read."""


class NotRunnableError(TppError, RuntimeError):
    """The code was built for an ISA this CPU does not execute (or cannot be linked here)."""


class UsageError(TppError):
    """A bad command-line argument, or an output file that cannot be written."""


class RemoteError(TppError, RuntimeError):
    """The RPC tracker or its servers cannot measure: unreachable, no server under the key,
    every server gone, or servers whose CPU lacks the ISA asked for."""
