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

Examples
--------
>>> from schedules.gemm import GemmProblem, GemmConfig, build
>>> p = GemmProblem(m=128, n=256, k=512)
>>> cfg = GemmConfig.of("bCa", bm=32, bn=64, bk=128, k_step=2)
>>> func = build(p, cfg, isa="avx2")      # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from microkernels import isa as _isa
from microkernels.brgemm import BrgemmShape, dispatch
from microkernels.epilogue import Epilogue

from .nest import check_exact, finish_nest, nest_loops
from .space import Candidate
from .space import GemmProblem as BlockedGemm

if TYPE_CHECKING:
    from tvm import s_tir
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

    Examples
    --------
    >>> GemmConfig.of("bcaBCb", 32, 64, 128, k_step=2, block_steps={"b": (4, 2)}).k_step
    2
    """

    bm: int
    bn: int
    bk: int
    candidate: Candidate

    def __post_init__(self) -> None:
        for name in ("bm", "bn", "bk"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"GemmConfig.{name} must be a positive int, got {value!r}")

    @classmethod
    def of(cls, spec: str, bm: int, bn: int, bk: int, k_step: int = 1,
           block_steps: Mapping[str, tuple[int, ...]] | None = None) -> GemmConfig:
        """Shorthand building the :class:`~schedules.space.Candidate` too."""
        steps = {"a": k_step} if k_step != 1 else {}
        return cls(bm, bn, bk, Candidate(spec, block_steps or {}, steps))

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


def pack_weight(w, bn: int):
    """numpy ``W[K, N] -> Wp[N/bn, K, bn]``: each N block's panel contiguous."""
    k, n = w.shape
    if n % bn:
        raise ValueError(f"bn={bn} does not divide N={n}")
    return w.reshape(k, n // bn, bn).transpose(1, 0, 2).copy()


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
    epilogue = sch.get_sblock("epilogue") if problem.epilogue.ops else None
    finish_nest(sch, spec, order, grid_loops, gemm, frozenset("a"), epilogue)
    shape = BrgemmShape(m=config.bm, n=config.bn, k=config.bk, batch=config.k_step,
                        layout="flat", isa=isa_name)
    # Unit loops vanish from the matched block (see the BRGEMM desc): start below them.
    extents = (config.bm, config.bn, config.k_step * config.bk)
    body = next((loop for loop, e in zip((i_body, j_body, k_body), extents, strict=True)
                 if e > 1), k_body)
    sch.tensorize(body, dispatch(shape))
    return sch
