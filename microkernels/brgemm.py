"""Batch-reduce GEMM (BRGEMM): the kernel description, its TIR semantics and the dispatcher.

``C[m, n] += sum_b sum_k A_b[m, k] * B_b[k, n]`` over ``batch`` blocks of A and B that sit at
fixed strides from each other (the stride-based BRGEMM of the TPP paper, the form blocked
layouts give).  Outside the blocked layout the batch blocks lie one after the other along
K, A's too unless the shape is ``batched_a``: then A's blocks sit at a stride of their own
(a conv's filter rows, a row of the image apart, beside its weight rows that run on along
K).  C is accumulated in registers across the whole batch-reduce
(output-stationary); zeroing is the schedule's job, done by TVM's ``decompose_reduction``
at the first K step, exactly where PARLOOPER calls its zero TPP.  Where one call is the
whole reduction of its C block, a kernel with ``beta=0`` (:func:`zeroing`) starts its
accumulators at zero instead of loading C, and the schedule drops the zeroing pass: a 1x1
convolution over 64 channels otherwise stores its C block three times (zeros, the sums, the
epilogue's result) for 64 FMAs per element.  Where the reduction takes several calls, a
kernel with ``first_call_zeroes`` does so on the call where :func:`first_call` (a flag the
schedule binds to "every reduction index at its first block") holds and adds to C on the
others: oneDNN's BRGEMM ``do_init``, with no zeroing pass either.

A :class:`BrgemmShape` names one kernel.  :func:`dispatch` turns it into a registered
``tvm.s_tir.TensorIntrin`` (created on first use and cached, like LIBXSMM's
``dispatch(shape) -> kernel``): the *desc* is the TIR semantics below, the *impl* is the code of
the richest ISA implementation registered for that shape (see :func:`register_impl`), falling
back along the ISA's lineage down to the generic loops.

Operand layouts (row-major, N is the vector dimension; ``K = batch * k``):

=========  =================================  =====================================
layout     A                                  B
=========  =================================  =====================================
flat       ``[m, K]`` rows at stride ``sa``   ``[K, n]`` rows at stride ``sb``
blocked    ``[batch, m, k]`` (stride ``sab``) ``[batch, k, n]`` (stride ``sbb``)
vnni2      ``[m, K]``                         ``[K/2, n, 2]`` (bf16 pairs along K)
vnni4      ``[m, K]``                         ``[K/4, n, 4]`` (int8 quads along K)
vnni4_w7   ``[m, K]`` (uint8)                 as vnni4, every weight in [-64, 64]
=========  =================================  =====================================

``vnni4_w7`` is a contract on B's values, not only on its arrangement: with 7-bit weights
the pair sums of ``vpmaddubsw`` (at most ``2 * 255 * 64 = 32640``) cannot saturate int16, so
CPUs without VNNI run int8 at about twice the exact kernel's rate.  The range is the one
ONNX Runtime's ``reduce_range`` quantizes weights to (``[-64, 64]``, its advice for CPUs
without VNNI; oneDNN's weight scale adjustment of 0.5 does the same);
:func:`check_operands` and ``pack`` enforce it.

Examples
--------
>>> shape = BrgemmShape(m=6, n=16, k=64, batch=4, isa="avx2")
>>> shape.flops
49152
>>> dispatch(shape)  # doctest: +SKIP
'tpp_brgemm_avx2_float32_flat_6x16x64x4'
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from . import isa as _isa

if TYPE_CHECKING:
    import numpy as np
    from tvm import tirx
    from tvm.tirx import PrimFunc

__all__ = [
    "BrgemmShape",
    "LAYOUTS",
    "DTYPES",
    "dispatch",
    "register_impl",
    "register_layout",
    "implementations",
    "desc_func",
    "reference",
    "B_RANGES",
    "check_operands",
    "first_call",
    "skipped_blocks",
    "edge_rows",
    "zeroing",
]

#: (dtype of A, dtype of the accumulator) -> dtype of B.
DTYPES: dict[tuple[str, str], str] = {
    ("float32", "float32"): "float32",
    ("bfloat16", "float32"): "bfloat16",
    ("uint8", "int32"): "int8",
    ("int8", "int32"): "int8",
}

#: layout -> (K elements interleaved per B row, dtypes of A it admits).
LAYOUTS: dict[str, tuple[int, frozenset[str]]] = {
    "flat": (1, frozenset({"float32", "bfloat16", "uint8", "int8"})),
    "blocked": (1, frozenset({"float32", "bfloat16", "uint8", "int8"})),
    "vnni2": (2, frozenset({"bfloat16"})),
    "vnni4": (4, frozenset({"uint8", "int8"})),
    "vnni4_w7": (4, frozenset({"uint8"})),
}

#: layout -> inclusive range every B value must lie in (layouts that restrict B's values).
B_RANGES: dict[str, tuple[int, int]] = {"vnni4_w7": (-64, 64)}


@dataclass(frozen=True)
class BrgemmShape:
    """One BRGEMM kernel: ``C[m, n] += sum over batch blocks of A_b[m, k] @ B_b[k, n]``.

    Parameters
    ----------
    m, n, k
        Block sizes of one multiply (``k`` per batch element).
    batch
        Number of (A_b, B_b) block pairs reduced into C (PARLOOPER's ``brcount``).
    dtype_a, dtype_acc
        Input and accumulator types; B's type follows (:data:`DTYPES`).
    layout
        Operand layout (:data:`LAYOUTS`).
    isa
        Name of the ISA the code is for (:data:`microkernels.isa.KNOWN`).
    beta
        1: add to C (``C += ...``); 0: overwrite it (``C = ...``; C's incoming values are
        never read).  The TIR semantics (:func:`desc_func`) are the same for both: a
        schedule uses a ``beta=0`` kernel only for a call whose C block it zeroed and that
        is the only call of the reduction, and drops the zeroing (``schedules.nest``).
    first_call_zeroes
        The call where :func:`first_call` holds overwrites C, the others add to it (with
        ``beta=1``): one kernel for every call of a reduction that takes several, the
        schedule binding the flag to the first (``schedules.nest.bind_first_call``) and
        dropping the zeroing.  The TIR semantics are again those of ``beta=1``.
    batched_a
        A is ``[batch, m, k]``, its batch blocks at a stride of their own, where B's stay
        consecutive along K (``[batch*k/alpha, n, alpha]``): one call reduces a conv's
        filter rows, each a row of the image apart (flat and VNNI layouts, ``batch > 1``).
    skips_blocks
        (``batched_a`` only.)  The call leaves out the first and the last blocks of its
        batch that :func:`skipped_blocks` count (free variables the schedule binds, as it
        does :func:`first_call`): blocks of A that hold zeros, a conv's filter rows over its
        zero border.  The TIR semantics are those of the whole batch, which such zeros do
        not change.
    edge_k
        (``batched_a`` only, a multiple of ``alpha``, at most ``k / 2``.)  Where :func:`edge_rows`
        holds (free flags the schedule binds), the first row of A leaves out the first
        ``edge_k`` values of each block's K, the last row the last ``edge_k``: a conv's first
        and last output columns over the zero border, whose filter taps there read zeros.
        Same TIR semantics; kernels without this skip compute the zeros.
    """

    m: int
    n: int
    k: int
    batch: int = 1
    dtype_a: str = "float32"
    dtype_acc: str = "float32"
    layout: str = "flat"
    isa: str = "avx2"
    beta: int = 1
    first_call_zeroes: bool = False
    batched_a: bool = False
    skips_blocks: bool = False
    edge_k: int = 0

    def __post_init__(self) -> None:
        for dim in ("m", "n", "k", "batch"):
            value = getattr(self, dim)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"BrgemmShape.{dim} must be a positive int, got {value!r}")
        if (self.dtype_a, self.dtype_acc) not in DTYPES:
            supported = ", ".join(f"{a}->{c}" for a, c in DTYPES)
            raise ValueError(
                f"unsupported BRGEMM dtypes {self.dtype_a}->{self.dtype_acc}; "
                f"supported: {supported}"
            )
        if self.layout not in LAYOUTS:
            _load_implementations()  # layouts registered by implementation modules (mmla)
        if self.layout not in LAYOUTS:
            raise ValueError(f"unknown layout {self.layout!r}; known: {', '.join(LAYOUTS)}")
        alpha, dtypes = LAYOUTS[self.layout]
        if self.dtype_a not in dtypes:
            raise ValueError(f"layout {self.layout!r} does not hold {self.dtype_a} operands")
        if self.k % alpha:
            raise ValueError(f"layout {self.layout!r} needs k divisible by {alpha}, got {self.k}")
        if self.beta not in (0, 1) or isinstance(self.beta, bool):
            raise ValueError(f"BrgemmShape.beta must be 0 or 1, got {self.beta!r}")
        if self.first_call_zeroes and self.beta != 1:
            raise ValueError("first_call_zeroes needs beta=1: the calls after the first add")
        for flag in ("batched_a", "skips_blocks"):
            if not isinstance(getattr(self, flag), bool):
                raise TypeError(f"BrgemmShape.{flag} must be a bool, got "
                                f"{getattr(self, flag)!r}")
        if self.skips_blocks and not self.batched_a:
            raise ValueError("skips_blocks leaves out blocks of a batched_a kernel's A")
        if not isinstance(self.edge_k, int) or isinstance(self.edge_k, bool) or not (
                self.edge_k == 0 or (self.batched_a and 0 < 2 * self.edge_k <= self.k
                                     and self.edge_k % alpha == 0)):
            raise ValueError(f"edge_k is 0, or at most half a batched_a kernel's K in whole "
                             f"{self.layout} groups, got {self.edge_k!r} of k={self.k}")
        if self.batched_a and (self.layout == "blocked" or self.layout in _LAYOUT_FNS
                               or self.batch == 1):
            raise ValueError(f"batched_a needs batch > 1 and a flat or VNNI layout, got "
                             f"batch={self.batch}, layout {self.layout!r}")
        _isa.from_name(self.isa)

    @property
    def dtype_b(self) -> str:
        return DTYPES[(self.dtype_a, self.dtype_acc)]

    @property
    def alpha(self) -> int:
        """K elements packed together per B row (1, or the VNNI factor 2/4)."""
        return LAYOUTS[self.layout][0]

    @property
    def flops(self) -> int:
        return 2 * self.m * self.n * self.k * self.batch

    @property
    def name(self) -> str:
        """Name of the registered ``TensorIntrin`` for this shape."""
        return (
            f"tpp_brgemm_{self.isa}_{self.dtype_a}_{self.layout}_"
            f"{self.m}x{self.n}x{self.k}x{self.batch}"
            + ("_beta0" if self.beta == 0 else "_beta0first" if self.first_call_zeroes else "")
            + ("_batcheda" if self.batched_a else "")
            + ("_skips" if self.skips_blocks else "")
            + (f"_edges{self.edge_k}" if self.edge_k else "")
        )

    def a_shape(self) -> tuple[int, ...]:
        """Shape of the A operand of one kernel call."""
        if self.layout in _LAYOUT_FNS:
            return _LAYOUT_FNS[self.layout][0](self)[0]
        if self.layout == "blocked" or self.batched_a:
            return (self.batch, self.m, self.k)
        return (self.m, self.batch * self.k)

    def b_shape(self) -> tuple[int, ...]:
        """Shape of the B operand of one kernel call."""
        if self.layout in _LAYOUT_FNS:
            return _LAYOUT_FNS[self.layout][0](self)[1]
        if self.layout == "blocked":
            return (self.batch, self.k, self.n)
        if self.alpha > 1:
            return (self.batch * self.k // self.alpha, self.n, self.alpha)
        return (self.batch * self.k, self.n)


ImplFactory = Callable[[BrgemmShape], "PrimFunc"]
DescFactory = Callable[[BrgemmShape, bool], "PrimFunc"]

# (isa, dtype_a, layout) -> impl factory.  Implementation modules register here when imported;
# they are imported lazily by dispatch() so importing this module parses no TVMScript.
_IMPLS: dict[tuple[str, str, str], ImplFactory] = {}
# The keys of _IMPLS whose factories also make beta=0 and first_call_zeroes kernels.
_ZEROING: set[tuple[str, str, str]] = set()
# The keys of _IMPLS whose factories also make batched_a kernels.
_BATCHED_A: set[tuple[str, str, str]] = set()
_DESCS: dict[str, DescFactory] = {}
# layout -> (operand shapes function, numpy reference) for layouts registered by modules.
_LAYOUT_FNS: dict[str, tuple[Callable, Callable]] = {}
_IMPL_MODULES = ("microkernels.x86", "microkernels.amx", "microkernels.arm")
_loaded = False


def register_impl(isas: str | tuple[str, ...], dtype_a: str, layout: str, *,
                  zeroing: bool = False, batched_a: bool = False):
    """Decorator registering ``factory(shape) -> impl PrimFunc`` for these ISAs.

    The impl must read and write the same buffers (shapes, strides, scopes) as
    :func:`desc_func` declares for the shape, and compute the same values; with
    ``zeroing``, the factory also makes ``beta=0`` and ``first_call_zeroes`` kernels,
    with ``batched_a`` kernels of ``batched_a`` shapes (:class:`BrgemmShape`).
    """
    names = (isas,) if isinstance(isas, str) else isas

    def wrap(factory: ImplFactory) -> ImplFactory:
        for name in names:
            if name != "generic":
                _isa.from_name(name)
            _IMPLS[(name, dtype_a, layout)] = factory
            if zeroing:
                _ZEROING.add((name, dtype_a, layout))
            if batched_a:
                _BATCHED_A.add((name, dtype_a, layout))
        return factory

    return wrap


def register_layout(layout: str, alpha: int, dtypes: frozenset[str], shapes: Callable,
                    reference: Callable):
    """Decorator registering a desc factory ``f(shape, as_workload) -> PrimFunc`` for a layout.

    ``shapes(shape) -> (a_shape, b_shape, c_shape)`` and ``reference(shape, a, b, c)`` give
    the layout's operand shapes and numpy semantics to :class:`BrgemmShape` and
    :func:`reference`.
    """

    def wrap(factory: DescFactory) -> DescFactory:
        LAYOUTS[layout] = (alpha, frozenset(dtypes))
        _DESCS[layout] = factory
        _LAYOUT_FNS[layout] = (shapes, reference)
        _register_generic(layout)
        return factory

    return wrap


def _load_implementations() -> None:
    global _loaded
    if not _loaded:
        for module in _IMPL_MODULES:
            importlib.import_module(module)
        _loaded = True


def implementations() -> list[tuple[str, str, str]]:
    """Registered (isa, dtype_a, layout) implementations, without building any kernel."""
    _load_implementations()
    return sorted(_IMPLS)


def find_impl(shape: BrgemmShape) -> tuple[str, PrimFunc]:
    """The implementation used for ``shape`` and its impl function.

    The richest ISA along the shape's lineage whose factory accepts the shape wins; a factory
    refuses a shape it cannot do (an AMX tile budget, a NEON register tile) with ValueError,
    and the next one is tried, down to the generic loops.  A ``beta=0`` or
    ``first_call_zeroes`` shape takes only factories registered with ``zeroing``, a
    ``batched_a`` one only those registered with ``batched_a`` (the generic loops do both).
    """
    _load_implementations()
    zeroes = shape.beta == 0 or shape.first_call_zeroes
    for name in _isa.from_name(shape.isa).lineage() + ("generic",):
        key = (name, shape.dtype_a, shape.layout)
        factory = _IMPLS.get(key)
        if factory is None or (zeroes and key not in _ZEROING) or (
                shape.batched_a and key not in _BATCHED_A):
            continue
        try:
            return name, factory(shape)
        except ValueError:
            continue
    if zeroes:
        raise ValueError(f"no BRGEMM implementation has a zeroing variant for {shape}")
    raise AssertionError(f"no generic BRGEMM registered for {shape}")


@functools.cache
def first_call() -> tirx.Var:
    """The flag a ``first_call_zeroes`` kernel reads: true on the first call of a reduction.

    A free boolean variable of the kernel's impl; the schedule replaces it with its own
    condition once the call is tensorized (``schedules.nest.bind_first_call``).
    """
    from tvm import tirx

    return tirx.Var("tpp_first_call", "bool")


@functools.cache
def skipped_blocks() -> tuple[tirx.Var, tirx.Var]:
    """How many blocks a ``skips_blocks`` kernel leaves out at the start and at the end of
    its batch: free int32 variables of its impl that the schedule replaces with its own
    expressions once the call is tensorized (``schedules.nest.bind_call_vars``)."""
    from tvm import tirx

    return tirx.Var("tpp_skip_first", "int32"), tirx.Var("tpp_skip_last", "int32")


@functools.cache
def edge_rows() -> tuple[tirx.Var, tirx.Var]:
    """Whether an ``edge_k`` kernel's first and last rows of A leave out their edge of K:
    free boolean variables of its impl that the schedule replaces with its own conditions
    once the call is tensorized (``schedules.nest.bind_call_vars``)."""
    from tvm import tirx

    return tirx.Var("tpp_left_edge", "bool"), tirx.Var("tpp_right_edge", "bool")


@functools.cache
def zeroing(shape: BrgemmShape, first_call_only: bool = False) -> BrgemmShape | None:
    """``shape`` with ``beta=0`` (with ``first_call_only``: ``first_call_zeroes``) if the
    implementation that runs ``shape`` has a zeroing variant (never a slower fallback of
    another ISA), else None.

    >>> zeroing(BrgemmShape(m=28, n=64, k=64, isa="avx2")).name
    'tpp_brgemm_avx2_float32_flat_28x64x64x1_beta0'
    >>> zeroing(BrgemmShape(m=32, n=32, k=64, dtype_a="bfloat16", layout="vnni2", isa="amx")).name
    'tpp_brgemm_amx_bfloat16_vnni2_32x32x64x1_beta0'
    >>> zeroing(BrgemmShape(m=4, n=16, k=8, isa="neon"))  # NEON kernels always read C
    >>> zeroing(BrgemmShape(m=28, n=64, k=64, isa="avx2"), first_call_only=True).name
    'tpp_brgemm_avx2_float32_flat_28x64x64x1_beta0first'
    """
    zeroed = dataclasses.replace(shape, **({"first_call_zeroes": True} if first_call_only
                                           else {"beta": 0}))
    try:
        return zeroed if find_impl(zeroed)[0] == find_impl(shape)[0] else None
    except ValueError:
        return None


def desc_func(shape: BrgemmShape, as_workload: bool = False) -> PrimFunc:
    """The TIR semantics of ``shape``.

    With ``as_workload`` the buffers are dense and the loops sit in a block named ``"brgemm"``
    under a function ``main``: a standalone kernel that tests and benchmarks tensorize.
    """
    if shape.layout in _DESCS:
        return _DESCS[shape.layout](shape, as_workload)
    return _strided_desc(shape, as_workload)


def _strided_desc(shape: BrgemmShape, as_workload: bool, zero_first: bool = False,
                  first: tirx.PrimExpr | None = None) -> PrimFunc:
    import contextlib

    from tvm import tirx
    from tvm.script.ir_builder import IRBuilder
    from tvm.script.ir_builder import tirx as T

    m, n, k, batch, alpha = shape.m, shape.n, shape.k, shape.batch, shape.alpha
    ta, tb, tc = shape.dtype_a, shape.dtype_b, shape.dtype_acc
    a_shape, b_shape = shape.a_shape(), shape.b_shape()
    blocked = shape.layout == "blocked"
    # Dense strides for a workload; symbolic ones let the intrinsic match any sub-tensor.
    dense = as_workload

    def a_at(i, kk, kb):  # element (i, kk) of the stacked [m, batch*k] A (of block kb)
        if shape.batched_a:
            return (kb, i, kk)
        return (kk // k, i, kk % k) if blocked else (i, kk)

    def b_at(j, kk, kb):  # element (kk, j) of the stacked [batch*k, n] B (of block kb)
        if blocked:
            return (kk // k, kk % k, j)
        if shape.batched_a:
            return (kb * (k // alpha) + kk // alpha, j, kk % alpha) if alpha > 1 else \
                (kb * k + kk, j)
        return (kk // alpha, j, kk % alpha) if alpha > 1 else (kk, j)

    sv = {name: tirx.Var(name, "int32") for name in ("sa0", "sa1", "sb0", "sb1", "sc")}
    a_strides = [sv["sa0"], sv["sa1"], 1] if len(a_shape) == 3 else [sv["sa0"], 1]
    b_strides = [sv["sb0"], sv["sb1"], 1] if len(b_shape) == 3 else [sv["sb0"], 1]
    # One reduction loop over batch*k (batch outer): a scheduled GEMM's K loop split once by
    # batch*k matches it; batched_a, a loop over the batch and one over k (a conv's filter
    # rows and channels, two iterators of its block).  TVM drops unit loops and their block
    # iterators from the GEMM a kernel is matched in, so the desc has none either: unit axes
    # index with 0.
    reductions = (("b", batch), ("k", k)) if shape.batched_a else (("k", batch * k),)
    axes = [(name, extent) for name, extent in (("i", m), ("j", n), *reductions)
            if extent > 1]
    with IRBuilder() as builder:
        with T.prim_func(s_tir=True):
            T.func_name("main" if dense else "desc")
            if dense:
                T.func_attr({"global_symbol": "main", "tirx.noalias": True})
            a, b, c = (T.arg(name, T.handle()) for name in ("a", "b", "c"))
            A = T.match_buffer(a, a_shape, ta, strides=None if dense else a_strides,
                               offset_factor=1)
            B = T.match_buffer(b, b_shape, tb, strides=None if dense else b_strides,
                               offset_factor=1)
            C = T.match_buffer(c, (m, n), tc, strides=None if dense else [sv["sc"], 1],
                               offset_factor=1)
            for name, buf in zip("ABC", (A, B, C), strict=True):
                IRBuilder.name(name, buf)
            with T.sblock("root" if not dense else "brgemm_root"):
                T.reads(C[0:m, 0:n], A[tuple(slice(0, s) for s in a_shape)],
                        B[tuple(slice(0, s) for s in b_shape)])
                T.writes(C[0:m, 0:n])
                if zero_first:  # a zeroing impl: the sums overwrite C (on the first call)
                    with contextlib.ExitStack() as when:
                        if first is not None:
                            when.enter_context(T.If(first))
                            when.enter_context(T.Then())
                        with T.grid(m, n) as (zi, zj):
                            T.buffer_store(C, tirx.const(0, tc), [zi, zj])
                with contextlib.ExitStack() as loops:
                    if axes:
                        loop_vars = loops.enter_context(T.grid(*(e for _, e in axes)))
                        if isinstance(loop_vars, tirx.Var):  # one loop: a bare variable
                            loop_vars = [loop_vars]
                        IRBuilder.name_many([name for name, _ in axes], list(loop_vars))
                    with T.sblock("brgemm"):
                        it = {}
                        for (name, extent), var in zip(axes, loop_vars if axes else [],
                                                       strict=True):
                            axis = T.axis.reduce if name in "bk" else T.axis.spatial
                            it[name] = IRBuilder.name("v" + name, axis(extent, var))
                        vi, vj, vk, vb = (it.get(name, 0) for name in "ijkb")
                        a_load, b_load = A[a_at(vi, vk, vb)], B[b_at(vj, vk, vb)]
                        T.reads(C[vi, vj], a_load, b_load)
                        T.writes(C[vi, vj])
                        T.buffer_store(C, C[vi, vj] + tirx.Cast(tc, a_load)
                                       * tirx.Cast(tc, b_load), [vi, vj])
    return builder.get()


def _generic_impl(shape: BrgemmShape) -> PrimFunc:
    """Portable fallback: the semantics themselves, left to LLVM's vectorizer (with
    ``beta=0``, after zeroing C, with ``first_call_zeroes`` on the first call; the layouts of
    :func:`register_layout` have no such variants)."""
    if shape.beta == 0 or shape.first_call_zeroes:
        if shape.layout in _DESCS:
            raise ValueError(f"no generic zeroing kernel for the {shape.layout} layout")
        return _strided_desc(shape, False, zero_first=True,
                             first=first_call() if shape.first_call_zeroes else None)
    return desc_func(shape)


def _register_generic(layout: str) -> None:
    for dtype in LAYOUTS[layout][1]:
        _IMPLS[("generic", dtype, layout)] = _generic_impl
        if layout not in _DESCS:
            _ZEROING.add(("generic", dtype, layout))
            _BATCHED_A.add(("generic", dtype, layout))


for _layout in LAYOUTS:
    _register_generic(_layout)


#: Tuning threads schedule candidates at once: one registers an intrinsic while the others
#: wait, instead of both registering it (TVM refuses the second).
_REGISTERING = threading.Lock()


def dispatch(shape: BrgemmShape) -> str:
    """Register (once) and return the name of the ``TensorIntrin`` for ``shape``."""
    from tvm.s_tir import TensorIntrin

    with _REGISTERING:
        if TensorIntrin.get(shape.name, allow_missing=True) is None:
            _, impl = find_impl(shape)
            TensorIntrin.register(shape.name, desc_func(shape), impl)
    return shape.name


def check_operands(shape: BrgemmShape, b: np.ndarray) -> None:
    """ValueError unless B's values are within what ``shape``'s layout admits.

    >>> import numpy as np
    >>> check_operands(BrgemmShape(6, 16, 8, 1, "uint8", "int32", "vnni4_w7"),
    ...                np.full((2, 16, 4), 100, "int8"))
    Traceback (most recent call last):
    ...
    ValueError: layout 'vnni4_w7' needs B in [-64, 64]; got values in [100, 100]
    """
    if shape.layout in B_RANGES and b.size:
        lo, hi = B_RANGES[shape.layout]
        b_min, b_max = int(b.min()), int(b.max())
        if b_min < lo or b_max > hi:
            raise ValueError(f"layout {shape.layout!r} needs B in [{lo}, {hi}]; "
                             f"got values in [{b_min}, {b_max}]")


def reference(shape: BrgemmShape, a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """numpy result of ``c + BRGEMM(a, b)`` with operands in ``shape``'s layout.

    bfloat16 operands are passed as their uint16 bit patterns.  B outside the range its layout
    admits (:data:`B_RANGES`) is a ValueError: the kernels' results are undefined there.
    """
    import numpy as np

    check_operands(shape, b)
    if shape.layout in _LAYOUT_FNS:
        return _LAYOUT_FNS[shape.layout][1](shape, a, b, c)

    def widen(x: np.ndarray, dtype: str) -> np.ndarray:
        if dtype == "bfloat16":
            return (x.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
        return x.astype(np.float64 if shape.dtype_acc == "float32" else np.int64)

    a2, b2 = widen(a, shape.dtype_a), widen(b, shape.dtype_b)
    if shape.batched_a:  # [batch, m, k] -> the [m, batch*k] it multiplies
        a2 = a2.transpose(1, 0, 2).reshape(shape.m, -1)
    if shape.layout == "blocked":
        acc = np.einsum("bmk,bkn->mn", a2, b2)
    elif shape.alpha > 1:
        acc = a2 @ b2.transpose(0, 2, 1).reshape(-1, shape.n)
    else:
        acc = a2 @ b2
    return (c.astype(acc.dtype) + acc).astype(c.dtype)
