"""GEMM schedule template: a loop_spec string decides the outer loops, BRGEMM does the rest.

The workload is ``Y = epilogue(X @ W)`` with ``X[M, K]`` row-major and the weights pre-packed
per N block as ``Wp[N/bn, K, bn]`` (each block's K x bn panel contiguous — the "flat" BRGEMM B
operand).  Three logical loops, declared as in PARLOOPER's GEMM:

* ``a`` — K blocks (``K / bk``), stepping ``k_step`` blocks: one BRGEMM call reduces
  ``k_step`` blocks (its ``batch``);
* ``b`` — M blocks (``M / bm``), step 1;
* ``c`` — N blocks (``N / bn``), step 1.

Below them the ``bm x bn x (k_step * bk)`` body is tensorized with the BRGEMM intrinsic of
the target's ISA (:func:`microkernels.brgemm.dispatch`).  C is zeroed right above the first
``a`` loop (PARLOOPER's ``if (ik == 0) zero_tpp``; TVM's ``decompose_reduction``), and the
epilogue runs on each output tile under the deepest spatial loop that encloses every ``a`` loop,
i.e. right after the tile's last K step; when an ``a`` loop is outermost it runs as a separate
parallel pass.

Parallel loops: consecutive capitals are fused into one parallel loop where they stand (TVM's
pool forks and joins around it, like ``omp for collapse(k)`` inside the serial outer loops);
``{R:n}``/``{C:n}``/``{L:n}`` grids split their loop into ``n`` chunks and hoist the chunk loops
outermost, fused into one parallel loop of ``R*C*L`` tasks — each task runs the serial loops
over its own block of iterations, as PARLOOPER's thread grid does.  TVM runs one parallel
region at a time, so other separated parallel loops are rejected.

Packing A (``GemmConfig.pack_a``): ``X`` is the network's activation, row-major with rows K
floats apart, so a call with a short K block reads short pieces of many pages, which neither
the prefetchers nor the TLB like.  ``pack_a=d`` copies the slice of ``X`` the loops below
depth ``d`` read into a dense buffer under the ``d``-th loop (TVM's ``cache_read`` +
``compute_at``), as BLAS packs A; the copy runs in parallel unless a parallel loop already
encloses it.  B needs no packing: the weights are packed once, ahead of time.

Examples
--------
>>> from schedules.gemm import GemmProblem, GemmConfig, schedule
>>> p = GemmProblem(m=128, n=256, k=512)
>>> cfg = GemmConfig.of("bCa", bm=32, bn=64, bk=128, k_step=2)
>>> sch = schedule(p, cfg, isa="avx2")    # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from microkernels import isa as _isa
from microkernels.brgemm import BrgemmShape, dispatch
from microkernels.epilogue import Epilogue
from microkernels.pack import Packing

from .loop_spec import LoopSpec, LoopSpecError, parse
from .nest import check_exact, finish_nest, nest_loops
from .space import BlockedGemm, Candidate

if TYPE_CHECKING:
    from tvm import s_tir
    from tvm.s_tir import LoopRV, SBlockRV
    from tvm.tirx import PrimFunc

__all__ = ["GemmProblem", "GemmConfig", "workload", "schedule", "pack_weight"]


@dataclass(frozen=True)
class GemmProblem:
    """``Y[m, n] = epilogue(X[m, k] @ W[k, n])`` in float32.

    Parameters
    ----------
    m, n, k
        GEMM sizes.
    epilogue
        Elementwise chain applied to each finished output tile.
    """

    m: int
    n: int
    k: int
    dtype: str = "float32"
    epilogue: Epilogue = field(default_factory=Epilogue)

    def __post_init__(self) -> None:
        for dim in ("m", "n", "k"):
            value = getattr(self, dim)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"GemmProblem.{dim} must be a positive int, got {value!r}")
        if self.dtype != "float32":
            raise ValueError(f"the GEMM template handles float32, got {self.dtype!r}")
        self.epilogue.out_dtype("float32")  # raises for chains that do not type-check

    @property
    def flops(self) -> int:
        return 2 * self.m * self.n * self.k


@dataclass(frozen=True)
class GemmConfig:
    """Block sizes plus a point of the loop_spec space for one GEMM.

    Parameters
    ----------
    bm, bn, bk
        Block sizes: each divides its dimension.
    candidate
        The loop_spec over ``a`` (K blocks), ``b`` (M blocks), ``c`` (N blocks) with its block
        steps; its step of ``a`` is ``k_step``, the K blocks one BRGEMM call reduces.
    pack_a
        None, or copy the slice of ``X`` that the loops below depth ``pack_a`` of the spec
        read into a contiguous buffer there (0 = all of ``X`` before the loops, 1 = under
        the outermost loop, ...), as BLAS packs A: the microkernel then reads short dense
        rows instead of rows ``K`` floats apart, each on its own page.

    Examples
    --------
    >>> GemmConfig.of("bcaBCb", 32, 64, 128, k_step=2, block_steps={"b": (4, 2)}).k_step
    2
    """

    bm: int
    bn: int
    bk: int
    candidate: Candidate
    pack_a: int | None = None

    def __post_init__(self) -> None:
        for name in ("bm", "bn", "bk"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"GemmConfig.{name} must be a positive int, got {value!r}")
        if self.pack_a is not None and (not isinstance(self.pack_a, int)
                                        or isinstance(self.pack_a, bool) or self.pack_a < 0):
            raise ValueError(f"GemmConfig.pack_a must be None or a loop depth >= 0, "
                             f"got {self.pack_a!r}")

    @classmethod
    def of(cls, spec: str, bm: int, bn: int, bk: int, k_step: int = 1,
           block_steps: Mapping[str, tuple[int, ...]] | None = None,
           pack_a: int | None = None) -> GemmConfig:
        """Shorthand building the :class:`~schedules.space.Candidate` too."""
        steps = {"a": k_step} if k_step != 1 else {}
        return cls(bm, bn, bk, Candidate(spec, block_steps or {}, steps), pack_a)

    def with_candidate(self, candidate: Candidate) -> GemmConfig:
        """These blocks in another loop order; if A is packed, it is packed under the new
        order's outermost K loop.

        Examples
        --------
        >>> cfg = GemmConfig.of("acb", 256, 64, 512, pack_a=1)
        >>> cfg.with_candidate(Candidate("cBCa", {"c": (2,)})).pack_a
        4
        """
        pack = None
        if self.pack_a is not None:
            letters = [o.loop for o in parse(candidate.spec, 3).occurrences]
            pack = letters.index(0) + 1  # under the first occurrence of ``a``
        return GemmConfig(self.bm, self.bn, self.bk, candidate, pack)

    def reuses_packed_a(self) -> bool:
        """Whether A is packed and an N loop runs under the packing, reusing the copy.

        Examples
        --------
        >>> GemmConfig.of("acb", 256, 64, 512, pack_a=1).reuses_packed_a()
        True
        >>> GemmConfig.of("BCa", 64, 64, 512, pack_a=3).reuses_packed_a()
        False
        """
        if self.pack_a is None:
            return False
        return any(o.loop == 2 for o in parse(self.spec, 3).occurrences[self.pack_a:])

    @property
    def spec(self) -> str:
        return self.candidate.spec

    @property
    def k_step(self) -> int:
        return self.candidate.step("a")

    def check(self, problem: GemmProblem) -> None:
        """ValueError unless the blocks tile ``problem`` exactly."""
        for block, dim, name in ((self.bm, problem.m, "bm"), (self.bn, problem.n, "bn"),
                                 (self.bk, problem.k, "bk")):
            if dim % block:
                raise ValueError(f"{name}={block} does not divide {dim}")
        if (problem.k // self.bk) % self.k_step:
            raise ValueError(f"k_step={self.k_step} does not divide K/bk={problem.k // self.bk}")

    def blocked(self, problem: GemmProblem) -> BlockedGemm:
        """The problem in block units, as the space and the cost model see it."""
        self.check(problem)
        return BlockedGemm(problem.m, problem.n, problem.k, self.bm, self.bn, self.bk)


def pack_weight(w: np.ndarray, bn: int) -> np.ndarray:
    """numpy ``W[K, N] -> Wp[N/bn, K, bn]``: each N block's panel contiguous
    (:meth:`~microkernels.pack.Packing.blocked_b`, the flat BRGEMM's B).

    Examples
    --------
    >>> w = np.arange(6, dtype="float32").reshape(2, 3)
    >>> pack_weight(w, 1)[2].ravel().tolist()     # column 2 of W, one N block per column
    [2.0, 5.0]
    """
    k, n = w.shape
    if n % bn:
        raise ValueError(f"bn={bn} does not divide N={n}")
    # A unit bn leaves its axis out of the packing; the template's operand keeps it.
    return Packing.blocked_b(bn).pack(w).reshape(n // bn, k, bn)


def workload(problem: GemmProblem, bn: int) -> PrimFunc:
    """The unscheduled PrimFunc ``(X, Wp, *epilogue operands, Y)``."""
    from tvm import te

    from microkernels.epilogue import apply_te

    m, n, k = problem.m, problem.n, problem.k
    x = te.placeholder((m, k), "float32", name="X")
    wp = te.placeholder((n // bn, k, bn), "float32", name="Wp")
    r = te.reduce_axis((0, k), name="k")
    c = te.compute((m, n), lambda i, j: te.sum(x[i, r] * wp[j // bn, r, j % bn], axis=r),
                   name="C")
    extra = {op.name: te.placeholder(op.shape(m, n), op.dtype, name=op.name)
             for op in problem.epilogue.inputs("float32")}
    y = apply_te(problem.epilogue, c, extra) if problem.epilogue.ops else c
    return te.create_prim_func([x, wp, *extra.values(), y])


def schedule(problem: GemmProblem, config: GemmConfig, isa: str | _isa.Isa = "avx2"
             ) -> s_tir.Schedule:
    """The scheduled GEMM: loop_spec outer loops around the ISA's BRGEMM microkernel.

    Raises
    ------
    LoopSpecError
        The spec is malformed, misses a loop, blocks do not nest, parallelizes the K loop, or
        needs two parallel regions at once.
    ValueError
        Block sizes do not tile the problem.
    """
    from tvm import s_tir

    isa_name = isa.name if isinstance(isa, _isa.Isa) else _isa.from_name(isa).name
    spec = config.candidate.parse(*config.blocked(problem).trips)
    check_exact(spec)
    sch = s_tir.Schedule(workload(problem, config.bn))
    gemm = sch.get_sblock("C")
    i, j, kk = sch.get_loops(gemm)
    i_blocks, i_body = sch.split(i, [None, config.bm])
    j_blocks, j_body = sch.split(j, [None, config.bn])
    k_blocks, k_body = sch.split(kk, [None, config.k_step * config.bk])

    order, grid_loops = nest_loops(sch, spec, {"a": k_blocks, "b": i_blocks, "c": j_blocks})
    sch.reorder(*grid_loops, *order, i_body, j_body, k_body)
    pack = _pack_a(sch, spec, gemm, config.pack_a, order) if config.pack_a is not None else None
    epilogue = sch.get_sblock("epilogue") if problem.epilogue.ops else None
    finish_nest(sch, spec, order, grid_loops, gemm, frozenset("a"), epilogue)
    if pack is not None:
        _parallel_pack(sch, spec, pack, config.pack_a, bool(grid_loops))
    shape = BrgemmShape(m=config.bm, n=config.bn, k=config.bk, batch=config.k_step,
                        layout="flat", isa=isa_name)
    # Unit loops vanish from the matched block (see the BRGEMM desc): start below them.
    extents = (config.bm, config.bn, config.k_step * config.bk)
    body = next((loop for loop, e in zip((i_body, j_body, k_body), extents, strict=True)
                 if e > 1), k_body)
    sch.tensorize(body, dispatch(shape))
    return sch


def _pack_a(sch: s_tir.Schedule, spec: LoopSpec, gemm: SBlockRV, depth: int,
            order: list[LoopRV]) -> SBlockRV:
    """Copy the ``X`` slice read below ``depth`` loops into a dense buffer there."""
    if depth > len(order):
        raise LoopSpecError(f"pack_a={depth} is deeper than the {len(order)} loops of the spec",
                            spec.text, len(spec.text))
    groups = spec.parallel_groups()
    if spec.mode != "grid" and groups and depth - 1 in groups[0][:-1]:
        # The copy would sit between loops that are fused into one parallel loop.
        o = spec.occurrences[depth - 1]
        raise LoopSpecError(f"pack_a={depth} splits the collapsed parallel loops", spec.text,
                            o.position)
    pack = sch.cache_read(gemm, 0, "global")
    if depth:
        sch.compute_at(pack, order[depth - 1])
    return pack


def _parallel_pack(sch: s_tir.Schedule, spec: LoopSpec, pack: SBlockRV, depth: int,
                   grid: bool) -> None:
    """Vectorize the copy along K; run its rows in parallel unless a parallel loop encloses it."""
    rows, cols = sch.get_loops(pack)[-2:]
    sch.vectorize(cols)
    groups = spec.parallel_groups()
    enclosed = depth > 0 and (grid or bool(groups) and depth - 1 >= groups[0][0])
    if not enclosed:
        sch.parallel(rows)
