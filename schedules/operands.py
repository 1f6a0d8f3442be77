"""What a template's operand type means: its accumulator, packed layout and epilogue types.

Every template (GEMM, conv, batch GEMM) multiplies X in one of three types, and the type
alone decides the accumulator, the layout the BRGEMM reads the packed operand in (unless the
ISA multiplies in MMLA blocks, :func:`schedules.gemm.operand_layout`), the bytes the caches
hold per element, and the types along the epilogue (:meth:`Epilogue.start_dtype`).  A
problem class mixes in :class:`TypedProblem` for them.

Examples
--------
>>> OPERANDS["uint8"]
('int32', 'vnni4')
"""

from __future__ import annotations

from microkernels.brgemm import DTYPES
from microkernels.epilogue import Epilogue

__all__ = ["OPERANDS", "ELEMENT_BYTES", "TypedProblem"]

#: dtype of X -> (accumulator dtype, BRGEMM layout of the packed operand); W's dtype follows
#: (:data:`microkernels.brgemm.DTYPES`: float32, bfloat16, int8).
OPERANDS: dict[str, tuple[str, str]] = {
    "float32": ("float32", "flat"),
    "bfloat16": ("float32", "vnni2"),
    "uint8": ("int32", "vnni4"),
}
#: Bytes of one element of X (and of W): what the caches hold of the operands.
ELEMENT_BYTES = {"float32": 4, "bfloat16": 2, "uint8": 1}


class TypedProblem:
    """The types that follow from a problem's ``dtype`` and ``epilogue`` fields.

    Examples
    --------
    >>> from dataclasses import dataclass
    >>> from microkernels.epilogue import EpilogueOp
    >>> @dataclass(frozen=True)
    ... class P(TypedProblem):
    ...     dtype: str
    ...     epilogue: Epilogue
    >>> p = P("uint8", Epilogue((EpilogueOp("scale", value=0.5),)))
    >>> (p.acc_dtype, p.weight_dtype, p.element_bytes, p.epilogue_dtype, p.out_dtype)
    ('int32', 'int8', 1, 'float32', 'float32')
    """

    dtype: str
    epilogue: Epilogue

    @property
    def acc_dtype(self) -> str:
        """The accumulator's dtype: float32, or int32 for uint8."""
        return OPERANDS[self.dtype][0]

    @property
    def weight_dtype(self) -> str:
        """W's dtype: float32, bfloat16 or int8."""
        return DTYPES[(self.dtype, self.acc_dtype)]

    @property
    def element_bytes(self) -> int:
        """Bytes of one element of X (and of W)."""
        return ELEMENT_BYTES[self.dtype]

    @property
    def epilogue_dtype(self) -> str:
        """The dtype the epilogue starts from (:meth:`Epilogue.start_dtype`)."""
        return self.epilogue.start_dtype(self.acc_dtype)

    @property
    def out_dtype(self) -> str:
        """The dtype of Y."""
        return self.epilogue.out_dtype(self.epilogue_dtype)
