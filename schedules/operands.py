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

from typing import TYPE_CHECKING

from microkernels import isa as _isa
from microkernels.brgemm import B_RANGES, DTYPES
from microkernels.epilogue import Epilogue

if TYPE_CHECKING:
    import numpy as np

__all__ = ["OPERANDS", "ELEMENT_BYTES", "NARROW_LAYOUT", "TypedProblem", "narrow"]

#: dtype of X -> (accumulator dtype, BRGEMM layout of the packed operand); W's dtype follows
#: (:data:`microkernels.brgemm.DTYPES`: float32, bfloat16, int8).
OPERANDS: dict[str, tuple[str, str]] = {
    "float32": ("float32", "flat"),
    "bfloat16": ("float32", "vnni2"),
    "uint8": ("int32", "vnni4"),
}
#: Bytes of one element of X (and of W): what the caches hold of the operands.
ELEMENT_BYTES = {"float32": 4, "bfloat16": 2, "uint8": 1}
#: The VNNI-4 layout whose int8 weights lie in 7 bits (:data:`microkernels.brgemm.B_RANGES`).
NARROW_LAYOUT = "vnni4_w7"


def narrow(weights: np.ndarray) -> bool:
    """Whether int8 weights fit :data:`NARROW_LAYOUT`'s range, [-64, 64]: what ONNX Runtime's
    ``reduce_range`` quantizes to, and what lets CPUs without VNNI multiply them exactly with
    ``vpmaddubsw`` at about twice the rate of full-range int8.

    >>> import numpy as np
    >>> narrow(np.array([-64, 64], "int8")), narrow(np.array([-65, 3], "int8"))
    (True, False)
    """
    lo, hi = B_RANGES[NARROW_LAYOUT]
    return bool(weights.size == 0 or (int(weights.min()) >= lo and int(weights.max()) <= hi))


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
    #: W's int8 values lie in [-64, 64] (:func:`narrow`); a field of the problems whose W is
    #: a constant the graph pass can inspect (GEMM, conv), False elsewhere.
    narrow_weights: bool = False
    layout: str  # the packed W's layout (a property of each problem class)

    def _check_narrow_weights(self) -> None:
        if not isinstance(self.narrow_weights, bool):
            raise TypeError(f"narrow_weights must be a bool, got {self.narrow_weights!r}")
        if self.narrow_weights and self.dtype != "uint8":
            raise ValueError(f"narrow_weights describes int8 weights; X is {self.dtype}")

    def brgemm_layout(self, isa: str) -> str:
        """The layout the BRGEMM kernel reads the packed W in on ``isa``: the problem's
        ``layout``, or :data:`NARROW_LAYOUT` (the same arrangement, values within 7 bits)
        for narrow weights on an x86 ISA without an int8 dot product, whose ``vpmaddubsw``
        kernel is exact on them and about twice as fast as its full-range one.

        >>> from dataclasses import dataclass
        >>> @dataclass(frozen=True)
        ... class P(TypedProblem):
        ...     dtype: str = "uint8"
        ...     epilogue: Epilogue = Epilogue()
        ...     narrow_weights: bool = True
        ...     layout: str = "vnni4"
        >>> [P().brgemm_layout(isa) for isa in ("avx2", "avx512", "avx512_vnni", "amx")]
        ['vnni4_w7', 'vnni4_w7', 'vnni4', 'vnni4']
        """
        target = _isa.from_name(isa)
        if (self.narrow_weights and self.layout == "vnni4"
                and target.arch == "x86_64" and not target.int8_dot):
            return NARROW_LAYOUT
        return self.layout

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
