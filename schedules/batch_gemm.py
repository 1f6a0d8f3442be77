"""Batch GEMM of two activations (attention's ``Q @ K^T`` and ``P @ V``) around BRGEMM.

``Y[b] = epilogue(X[b] @ B[b])`` for ``b < batch``, where B is a tensor computed at run time,
so it cannot be packed ahead like a dense layer's weights.  The PrimFunc packs it itself,
one ``K x bn`` panel at a time into the flat BRGEMM's contiguous B operand
(``Bp[batch, N/bn, K, bn]``): O(K*N) copies per batch element against O(M*N*K) flops.

Loops (outermost first)::

    parallel for (b, jo)                 # batch element x N panel [x M block, see below]
        pack Bp[b, jo] <- B[b][:, jo*bn : (jo+1)*bn]   (vectorized along bn)
        for io:                          # M blocks of bm rows
            C tile = 0
            BRGEMM(bm x bn x K): C tile += X[b][io] @ Bp[b, jo]
            epilogue on the tile while it is hot

Each parallel task owns its B panel, so packing is never repeated; only when there are too
few (batch, panel) tasks for the threads do the M blocks join the parallel loop and each task
packs its panel itself (``BatchGemmConfig.parallel_rows``, cost ``1/bm`` of the compute).

Operand layouts.  Attention keeps heads interleaved along the channels (``[..., S, H, D]``,
what a ``[..., S, H*D]`` projection reshapes to) and permutes them to ``[..., H, S, D]`` for
the matmuls.  Instead of materializing those permutes, each operand may be read (written, for
Y) *interleaved*: with ``heads = H`` the batch index is ``b = o * H + h`` and

=====  ===========================  =================================================
        plain                        interleaved
=====  ===========================  =================================================
X      ``[batch * M, K]``           ``[batch / H * M, H * K]``: X[b][i, r] at
                                    ``[o * M + i, h * K + r]``
B      ``[batch, K, N]``            ``[batch / H, K, H * N]``
B^T    ``[batch, N, K]``            ``[batch / H, N, H * K]``  (``b_transposed``)
Y      ``[batch * M, N]``           ``[batch / H * M, H * N]``
=====  ===========================  =================================================

The epilogue sees Y in its stored two-dimensional form: operand shapes follow
``Operand.shape(*problem.y_shape)``.

Examples
--------
>>> p = BatchGemmProblem(batch=12, m=128, n=128, k=64, b_transposed=True)
>>> p.x_shape, p.b_shape, p.y_shape
((1536, 64), (12, 128, 64), (1536, 128))
>>> q = BatchGemmProblem(12, 128, 128, 64, True, heads=12, x_interleaved=True,
...                      b_interleaved=True)
>>> q.x_shape, q.b_shape
((128, 768), (1, 128, 768))
>>> from microkernels.isa import DEFAULT_CACHES, from_name
>>> machine = Machine(from_name("avx2"), DEFAULT_CACHES, threads=2)
>>> sch = schedule(p, default_config(p, machine), "avx2")   # doctest: +SKIP
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from microkernels import isa as _isa
from microkernels.brgemm import BrgemmShape, dispatch
from microkernels.epilogue import Epilogue
from microkernels.machine import Machine

from .blocking import divisors, near_divisors

if TYPE_CHECKING:
    import numpy as np
    from tvm import s_tir
    from tvm.tirx import PrimFunc

__all__ = ["BatchGemmProblem", "BatchGemmConfig", "default_config", "candidates", "workload",
           "schedule", "reference"]


def _positive(value: object, what: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{what} must be a positive int, got {value!r}")


@dataclass(frozen=True)
class BatchGemmProblem:
    """``Y[b] = epilogue(X[b] @ B[b])`` in float32 for ``batch`` pairs of activations.

    Parameters
    ----------
    batch, m, n, k
        Number of GEMMs and their sizes (``X[b]`` is ``m x k``, ``B[b]`` is ``k x n``).
    b_transposed
        B is stored as ``[N, K]`` per batch element (``X @ B^T``, as in ``Q @ K^T``).
    epilogue
        Elementwise chain applied to each finished output tile of the stored Y.
    heads
        Batch elements interleaved along the columns of the interleaved operands; divides
        ``batch``.  1 when no operand is interleaved.
    x_interleaved, b_interleaved, y_interleaved
        Which operands are stored interleaved (module docstring).
    """

    batch: int
    m: int
    n: int
    k: int
    b_transposed: bool = False
    epilogue: Epilogue = field(default_factory=Epilogue)
    heads: int = 1
    x_interleaved: bool = False
    b_interleaved: bool = False
    y_interleaved: bool = False

    def __post_init__(self) -> None:
        for name in ("batch", "m", "n", "k", "heads"):
            _positive(getattr(self, name), f"BatchGemmProblem.{name}")
        flags = ("b_transposed", "x_interleaved", "b_interleaved", "y_interleaved")
        for name in flags:
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"BatchGemmProblem.{name} must be a bool")
        if not isinstance(self.epilogue, Epilogue):
            raise TypeError(f"epilogue must be an Epilogue, got {type(self.epilogue).__name__}")
        if self.batch % self.heads:
            raise ValueError(f"heads={self.heads} does not divide batch={self.batch}")
        interleaved = self.x_interleaved or self.b_interleaved or self.y_interleaved
        if interleaved != (self.heads > 1):
            raise ValueError(f"heads={self.heads}: heads > 1 exactly when some operand is "
                             "interleaved")
        if self.epilogue.out_dtype("float32") != "float32":
            raise ValueError("the batch GEMM writes float32: the epilogue must end in float32")

    def _h(self, interleaved: bool) -> int:
        return self.heads if interleaved else 1

    @property
    def x_shape(self) -> tuple[int, int]:
        """Stored shape of X."""
        h = self._h(self.x_interleaved)
        return (self.batch // h * self.m, h * self.k)

    @property
    def b_shape(self) -> tuple[int, int, int]:
        """Stored shape of B (``[N, K]`` panels when ``b_transposed``)."""
        h = self._h(self.b_interleaved)
        rows, cols = (self.n, self.k) if self.b_transposed else (self.k, self.n)
        return (self.batch // h, rows, h * cols)

    @property
    def y_shape(self) -> tuple[int, int]:
        """Stored shape of Y (and of C, which the epilogue reads)."""
        h = self._h(self.y_interleaved)
        return (self.batch // h * self.m, h * self.n)

    @property
    def flops(self) -> int:
        return 2 * self.batch * self.m * self.n * self.k

    @property
    def layout(self) -> str:
        """Layout letters (t: B^T; x/b/y: interleaved) and the heads, "" for plain operands.

        Examples
        --------
        >>> BatchGemmProblem(12, 8, 8, 8, True, heads=12, x_interleaved=True).layout
        'tx12'
        """
        tags = "".join(t for t, on in (("t", self.b_transposed), ("x", self.x_interleaved),
                                       ("b", self.b_interleaved), ("y", self.y_interleaved))
                       if on)
        return tags + (str(self.heads) if self.heads > 1 else "")

    @property
    def name(self) -> str:
        """A short unique name: sizes, :attr:`layout`, epilogue."""
        name = f"{self.batch}x{self.m}x{self.n}x{self.k}"
        if self.layout:
            name += f"_{self.layout}"
        return name + (f"_{self.epilogue.name}" if self.epilogue.ops else "")


@dataclass(frozen=True)
class BatchGemmConfig:
    """Block sizes of a batch GEMM; one BRGEMM call reduces the whole K.

    Parameters
    ----------
    bm, bn
        Rows and columns of an output tile; each divides its dimension.
    bk
        K block of the BRGEMM (its batch-reduce count is ``K / bk``).
    parallel_rows
        Also run the M blocks in parallel (each task then packs its own B panel).
    """

    bm: int
    bn: int
    bk: int
    parallel_rows: bool = False

    def __post_init__(self) -> None:
        for name in ("bm", "bn", "bk"):
            _positive(getattr(self, name), f"BatchGemmConfig.{name}")

    def check(self, problem: BatchGemmProblem) -> None:
        """ValueError unless the blocks tile ``problem`` exactly."""
        for block, dim, name in ((self.bm, problem.m, "bm"), (self.bn, problem.n, "bn"),
                                 (self.bk, problem.k, "bk")):
            if dim % block:
                raise ValueError(f"{name}={block} does not divide {dim}")


def _block(dim: int, limit: int, multiple: int = 1) -> int:
    """The largest divisor of ``dim`` within ``limit`` (preferring multiples of ``multiple``);
    the whole ``dim`` instead of a sliver when ``dim`` has no fair divisor (a prime sequence
    length such as 197) and is not too large for one block."""
    fitting = [d for d in divisors(dim) if d <= limit]
    best = max([d for d in fitting if d % multiple == 0] or fitting)
    return dim if 4 * best < min(dim, limit) and dim <= 4 * limit else best


def default_config(problem: BatchGemmProblem, machine: Machine) -> BatchGemmConfig:
    """Blocks following :func:`schedules.blocking.default_config`'s rules (tiles of at most
    64 x 64, two vectors wide where possible, K whole in blocks of at most 512), and parallel
    M blocks when the (batch, panel) tasks number fewer than two per thread."""
    lanes = machine.isa.lanes("float32")
    n = problem.n
    bn = _block(n, max(64, 2 * lanes), 2 * lanes) if n % lanes == 0 else _block(n, 64, lanes)
    bm = _block(problem.m, 64)
    bk = _block(problem.k, 512)
    tasks = problem.batch * (n // bn)
    return BatchGemmConfig(bm, bn, bk,
                           parallel_rows=tasks < 2 * machine.threads and problem.m > bm)


def candidates(problem: BatchGemmProblem, machine: Machine) -> list[BatchGemmConfig]:
    """A short list of configurations worth measuring, :func:`default_config`'s first.

    Measurement only: no cost model ranks these; the tuner times them all, so the list stays
    short.  After the default come the default's blocks with the M blocks' parallelism
    flipped, then, each with both parallelisms, the two nearest other ``bm`` (divisors of M
    from 8 to 128 rows), the nearest other ``bn`` (a vector multiple up to 64 where N has
    one) and the nearest other ``bk`` (a divisor of K up to 512), neither of these two
    narrower than a vector.  Parallel M blocks are only tried when M has more than one
    block.  That makes ten configurations at most.

    Examples
    --------
    >>> from microkernels.isa import DEFAULT_CACHES, from_name
    >>> machine = Machine(from_name("avx2"), DEFAULT_CACHES, threads=2)
    >>> p = BatchGemmProblem(batch=12, m=128, n=128, k=64, b_transposed=True)
    >>> found = candidates(p, machine)
    >>> found[0] == default_config(p, machine)
    True
    >>> [(c.bm, c.bn, c.bk, c.parallel_rows) for c in found[:3]]
    [(64, 64, 64, False), (64, 64, 64, True), (32, 64, 64, False)]
    """
    base = default_config(problem, machine)
    lanes = machine.isa.lanes("float32")
    p = problem
    blocks = [replace(base, bm=bm) for bm in near_divisors(p.m, base.bm, 2, lo=min(8, p.m),
                                                           hi=128)]
    blocks += [replace(base, bn=bn) for bn in near_divisors(
        p.n, base.bn, 1, lo=min(lanes, p.n), hi=64, multiple=lanes if p.n % lanes == 0 else 1)]
    blocks += [replace(base, bk=bk) for bk in near_divisors(p.k, base.bk, 1,
                                                           lo=min(lanes, p.k), hi=512)]
    found = []
    for config in (base, *blocks):
        for parallel_rows in (config.parallel_rows, not config.parallel_rows):
            flipped = replace(config, parallel_rows=parallel_rows and p.m > config.bm)
            if flipped not in found:
                found.append(flipped)
    return found


def workload(problem: BatchGemmProblem, bn: int) -> PrimFunc:
    """The unscheduled PrimFunc ``(X, B, *epilogue operands, Y)`` with the packing stage ``Bp``,
    the GEMM ``C`` over the stored Y's ``[rows, cols]`` and the stage ``epilogue`` (if any)."""
    from tvm import te

    from microkernels.epilogue import apply_te

    p = problem
    if p.n % bn:
        raise ValueError(f"bn={bn} does not divide N={p.n}")
    m, n, k = p.m, p.n, p.k
    hx, hb, hy = (p._h(f) for f in (p.x_interleaved, p.b_interleaved, p.y_interleaved))
    x = te.placeholder(p.x_shape, "float32", name="X")
    b_in = te.placeholder(p.b_shape, "float32", name="B")

    def panel(b, jo, r, ji):
        o, h = b // hb, b % hb
        if p.b_transposed:
            return b_in[o, jo * bn + ji, h * k + r]
        return b_in[o, r, h * n + jo * bn + ji]

    bp = te.compute((p.batch, n // bn, k, bn), panel, name="Bp")
    r = te.reduce_axis((0, k), name="k")

    def gemm(row, col):
        # Batch element and position of the stored Y element (row, col).
        b = row // m * hy + col // n if hy > 1 else row // m
        i, j = row % m, col % n
        x_row = row if hx == hy else b // hx * m + i
        x_col = (b % hx) * k + r if hx > 1 else r
        return te.sum(x[x_row, x_col] * bp[b, j // bn, r, j % bn], axis=r)

    c = te.compute(p.y_shape, gemm, name="C")
    extra = {op.name: te.placeholder(op.shape(*p.y_shape), op.dtype, name=op.name)
             for op in p.epilogue.inputs("float32")}
    y = apply_te(p.epilogue, c, extra) if p.epilogue.ops else c
    return te.create_prim_func([x, b_in, *extra.values(), y])


def schedule(problem: BatchGemmProblem, config: BatchGemmConfig,
             isa: str | _isa.Isa = "avx2") -> s_tir.Schedule:
    """The scheduled batch GEMM (module docstring) with the ISA's BRGEMM microkernel.

    Raises
    ------
    TypeError
        ``problem`` or ``config`` is not of its class.
    ValueError
        Block sizes do not tile the problem.
    """
    from tvm import s_tir

    isa_name = isa.name if isinstance(isa, _isa.Isa) else _isa.from_name(isa).name
    if not isinstance(problem, BatchGemmProblem):
        raise TypeError(f"problem must be a BatchGemmProblem, got {type(problem).__name__}")
    if not isinstance(config, BatchGemmConfig):
        raise TypeError(f"config must be a BatchGemmConfig, got {type(config).__name__}")
    config.check(problem)
    p, bm, bn = problem, config.bm, config.bn
    hy = p._h(p.y_interleaved)
    sch = s_tir.Schedule(workload(p, bn))
    gemm = sch.get_sblock("C")
    row, col, kk = sch.get_loops(gemm)
    o, io, ii = sch.split(row, [p.batch // hy, p.m // bm, bm])
    h, jo, ji = sch.split(col, [hy, p.n // bn, bn])
    ko, ki = sch.split(kk, [1, None])  # a one-trip K loop: where C is zeroed
    sch.reorder(o, h, jo, io, ko, ii, ji, ki)
    task = sch.fuse(o, h, jo, io) if config.parallel_rows else sch.fuse(o, h, jo)
    # The panel under the task loop: TVM compacts Bp (and the C of an epilogue) to one task's
    # region, a per-thread buffer that stays in cache for all of the task's M blocks.
    pack = sch.get_sblock("Bp")
    sch.compute_at(pack, task)
    sch.vectorize(sch.get_loops(pack)[-1])
    if p.epilogue.ops:
        epilogue = sch.get_sblock("epilogue")
        sch.reverse_compute_at(epilogue, task if config.parallel_rows else io)
        sch.vectorize(sch.get_loops(epilogue)[-1])
    sch.parallel(task)
    init = sch.decompose_reduction(gemm, ko)
    sch.vectorize(sch.get_loops(init)[-1])
    shape = BrgemmShape(m=bm, n=bn, k=config.bk, batch=p.k // config.bk, layout="flat",
                        isa=isa_name)
    # A unit row loop vanishes from the matched block (see the BRGEMM desc): start below it.
    sch.tensorize(ii if bm > 1 else ji, dispatch(shape))
    return sch


def reference(problem: BatchGemmProblem, x: np.ndarray, b: np.ndarray,
              extra: dict[str, np.ndarray] | None = None) -> np.ndarray:
    """numpy result (stored Y) for operands in their stored shapes, accumulated in float64.

    Examples
    --------
    >>> import numpy as np
    >>> p = BatchGemmProblem(2, 1, 1, 2, b_transposed=True)
    >>> reference(p, np.ones((2, 2), np.float32), np.full((2, 1, 2), 3, np.float32))
    array([[6.],
           [6.]], dtype=float32)
    """
    import numpy as np

    from microkernels.epilogue import reference as epilogue_reference

    p = problem
    hx, hb, hy = (p._h(f) for f in (p.x_interleaved, p.b_interleaved, p.y_interleaved))
    for array, shape, what in ((x, p.x_shape, "X"), (b, p.b_shape, "B")):
        if np.shape(array) != shape:
            raise ValueError(f"{what} must have the stored shape {shape}, got {np.shape(array)}")
    # Stored -> logical [batch, rows, cols]: [o, rows, h, cols] -> [o, h, rows, cols].
    def logical(a, h, rows, cols):
        return a.reshape(-1, rows, h, cols).transpose(0, 2, 1, 3).reshape(p.batch, rows, cols)

    xs = logical(np.asarray(x, np.float64), hx, p.m, p.k)
    bs = logical(np.asarray(b, np.float64), hb, *((p.n, p.k) if p.b_transposed else (p.k, p.n)))
    if p.b_transposed:
        bs = bs.transpose(0, 2, 1)
    ys = (xs @ bs).astype(np.float32)
    # Logical -> stored Y.
    c = ys.reshape(-1, hy, p.m, p.n).transpose(0, 2, 1, 3).reshape(p.y_shape)
    return epilogue_reference(p.epilogue, c, extra) if p.epilogue.ops else c
