"""``tvm-tpp bench-kernel``: single-core throughput of the host's BRGEMM micro-kernel.

The kernel of one :class:`~microkernels.brgemm.BrgemmShape` is tensorized into its own
semantics (``desc_func(shape, as_workload=True)``) wrapped in a loop that calls it ``reps``
times on the same L1-resident operands, so the time is the kernel's, not call overhead or
DRAM.  The result is compared with the core's fp32 FMA peak (:mod:`microkernels.peak`).

Low-precision kernels are reported in GOPS (2 ops per multiply-add) next to the fp32 kernel on
the same shape (``ratio_to_fp32``); their ``fraction_of_peak`` is relative to the *fp32*
peak, so e.g. 2.0 means twice the fp32 FMA peak, and ``fraction_of_dtype_peak`` to their own
instruction's (:func:`~tvm_tpp.bench.gemm.dtype_peak`: ``vpdpbusd`` 4x, ``vdpbf16ps`` 2x the
fp32 peak, AMX tiles their ops per cycle), where the ISA has one.

The kernel timed is the one :func:`~microkernels.brgemm.find_impl` picks, and it must be the
requested ISA's own (or, for a dtype that ISA adds no kernel for, the one it inherits): a
block the ISA's kernel refuses is an error, never silently another kernel.  ``isa="amx"``
times the AMX tile kernel (int8 or bfloat16) on a tile-shaped block, only where this process
may run AMX.

Examples
--------
>>> r = bench_kernel("float32", isa="avx2")  # doctest: +SKIP
>>> r["gflops"], r["peak_gflops"], r["fraction_of_peak"]  # doctest: +SKIP
(80.7, 86.3, 0.935)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from microkernels import amx, x86
from microkernels import isa as _isa
from microkernels.brgemm import B_RANGES, BrgemmShape, desc_func, dispatch, implementations
from microkernels.machine import amx_refused, host, runs_here
from microkernels.peak import llvm_target

from ..errors import UsageError
from .gemm import dtype_peak
from .timing import tvm_timer

if TYPE_CHECKING:
    import numpy as np
    from tvm.tirx import PrimFunc

__all__ = ["bench_kernel", "build_kernel", "kernel_timer", "repeated_workload", "DTYPES"]

#: CLI dtype -> (dtype of A, accumulator, layout).
DTYPES: dict[str, tuple[str, str, str]] = {
    "float32": ("float32", "float32", "flat"),
    "int8": ("uint8", "int32", "vnni4"),
    "int8_w7": ("uint8", "int32", "vnni4_w7"),
    "bfloat16": ("bfloat16", "float32", "vnni2"),
}

#: Flops per timed run (sets ``reps``): ~0.5 ms, well under a scheduler time slice, so the
#: best of many runs is one that ran undisturbed on a shared machine.
_FLOPS_PER_CALL = 4e7


def repeated_workload(shape: BrgemmShape, reps: int) -> PrimFunc:
    """``desc_func(shape, as_workload=True)`` with its body run ``reps`` times (``C += ...``)."""
    from tvm import tirx
    from tvm.s_tir.stmt import SBlock, SBlockRealize

    if reps < 1:
        raise ValueError(f"reps must be positive, got {reps}")
    func = desc_func(shape, as_workload=True)
    realize = func.body
    root = realize.block
    loop = tirx.For(tirx.Var("rep", "int32"), 0, reps, tirx.ForKind.SERIAL, root.body)
    new_root = SBlock(root.iter_vars, root.reads, root.writes, root.name_hint, loop, root.init,
                      root.alloc_buffers, root.match_buffers, root.annotations)
    return func.with_body(SBlockRealize(realize.iter_values, realize.predicate, new_root))


#: Batch blocks of the AMX default block: A and B of 32 KiB, C of 4 KiB fit the 48 KiB L1d
#: of every AMX CPU (Sapphire, Emerald and Granite Rapids).
_AMX_BATCH = 8


def _default_shape(isa: _isa.Isa, dtype_a: str = "float32") -> tuple[int, int, int, int]:
    """The block ``bench-kernel`` times by default: m, n, k, batch.

    AMX (int8 or bf16 A): the full tile-register block, 2 x 2 C tiles of 16 x 16 (m = n = 32)
    with one full 64-byte tile row of K per multiply (64 int8 or 32 bf16 elements), 8 batch
    blocks.  Otherwise the fp32 register-tile block below.

    >>> _default_shape(_isa.from_name("amx"), "uint8"), _default_shape(_isa.from_name("amx"),
    ...                                                                 "bfloat16")
    ((32, 32, 64, 8), (32, 32, 32, 8))
    """
    if isa.has("amx_tile") and dtype_a in amx.OPS_PER_CYCLE:
        side = 2 * amx.TILE_ROWS  # 2 x 2 C tiles + 2 A + 2 B tiles: all 8 tile registers
        return side, side, amx.TILE_BYTES // (2 if dtype_a == "bfloat16" else 1), _AMX_BATCH
    return _fp32_default_shape(isa)


def _fp32_default_shape(isa: _isa.Isa) -> tuple[int, int, int, int]:
    """Four fp32 register tiles down, up to two across, K = 128 as 4 batch blocks: L1-resident.

    The kernel keeps a B micro-panel in L1 while its row tiles stream A; in a block whose
    panel and A do not fit, every row tile re-streams the panel from L2, and the benchmark
    times L2 streaming (which degrades under load) rather than the kernel.  The block
    therefore narrows to one column tile, then halves K, until A, B and C fit the L1d:
    24 x 32 x 128 (31 KiB) on AVX2, 24 x 64 x 64 (28 KiB) on AVX-512, where 24 x 128 x 128
    would take 88 KiB.  Columns go first: C is loaded and stored once per call, so a
    shorter K costs more C traffic per flop.
    """
    tile = x86.register_tile(BrgemmShape(m=64, n=64, k=64, isa=isa.name), x86.FP32)
    m, width = 4 * tile.rows, tile.vectors * tile.lanes
    l1d = host().caches.l1d
    for n, k in ((2 * width, 128), (width, 128), (width, 64), (width, 32)):
        if 4 * (m * k + k * n + m * n) <= l1d:
            break
    return m, n, k // 4, 4


def _operands(shape: BrgemmShape) -> list[np.ndarray]:
    import numpy as np

    rng = np.random.default_rng(0)
    if shape.dtype_a == "float32":
        return [rng.standard_normal(s).astype("float32") for s in (shape.a_shape(),
                shape.b_shape(), (shape.m, shape.n))]
    if shape.dtype_a == "bfloat16":
        import ml_dtypes

        return [rng.standard_normal(shape.a_shape()).astype(ml_dtypes.bfloat16),
                rng.standard_normal(shape.b_shape()).astype(ml_dtypes.bfloat16),
                np.zeros((shape.m, shape.n), "float32")]
    lo, hi = B_RANGES.get(shape.layout, (-128, 127))
    return [rng.integers(0, 256, shape.a_shape()).astype(shape.dtype_a),
            rng.integers(lo, hi + 1, shape.b_shape()).astype("int8"),
            np.zeros((shape.m, shape.n), "int32")]


def build_kernel(shape: BrgemmShape, impl: Callable[[BrgemmShape], PrimFunc] | None = None
                 ) -> tuple[Any, int]:
    """Compile ``shape``'s kernel (or ``impl``) into a repeated workload for ``shape.isa``
    (on any host: nothing runs); return the executable and its repetitions per run."""
    import tvm
    from tvm import s_tir

    if impl is None:
        name = dispatch(shape)
    else:
        name = f"{shape.name}_{impl.__name__}"
        if s_tir.TensorIntrin.get(name, allow_missing=True) is None:
            s_tir.TensorIntrin.register(name, desc_func(shape), impl(shape))
    reps = max(1, int(_FLOPS_PER_CALL // shape.flops))
    sch = s_tir.Schedule(repeated_workload(shape, reps))
    sch.tensorize(sch.get_loops(sch.get_sblock("brgemm"))[1], name)
    return tvm.compile(sch.mod, target=llvm_target(_isa.from_name(shape.isa))), reps


def kernel_timer(shape: BrgemmShape, impl: Callable[[BrgemmShape], PrimFunc] | None = None
                 ) -> Callable[[], float]:
    """Compile ``shape``'s kernel (or ``impl``) into a repeated workload; return a function that
    runs it once and gives its GFLOPS (GOPS)."""
    import tvm

    if not runs_here(_isa.from_name(shape.isa)):  # for AMX: asks Linux for the tile state
        raise ValueError(f"this process cannot run {shape.isa} code")
    ex, reps = build_kernel(shape, impl)
    args = [tvm.runtime.tensor(x) for x in _operands(shape)]
    timer = tvm_timer(ex.mod, "main", args)
    return lambda: shape.flops * reps / min(timer(1, 1, True)) / 1e9


def _own_kernel(shape: BrgemmShape) -> str:
    """The ISA whose kernel ``shape``'s ISA runs for its dtype and layout: its own, or the
    one it inherits (AVX-512 BF16's fp32 kernel is AVX-512's)."""
    registered = set(implementations())
    return next(name for name in _isa.from_name(shape.isa).lineage() + ("generic",)
                if (name, shape.dtype_a, shape.layout) in registered)


def _refusal(shape: BrgemmShape, kernel: str) -> str:
    """Why ``kernel``'s implementation refuses ``shape`` (AMX: the tile plan's message)."""
    if kernel == "amx":
        try:
            amx.plan(shape)
        except ValueError as err:
            return str(err)
    return "the block does not fit its register tile"


def bench_kernel(dtype: str = "float32", isa: str | None = None, m: int | None = None,
                 n: int | None = None, k: int | None = None, batch: int | None = None,
                 rounds: int = 20, runs: int = 10) -> dict[str, Any]:
    """Time the BRGEMM kernel of ``dtype`` for ``isa`` (default: the host's) on one core.

    The kernel, the FMA-peak microbenchmark and (for low precision) the fp32 kernel on the
    same shape run interleaved, ``rounds`` times ``runs`` short runs each; every figure is the
    best run, so they share the machine's quietest moments.

    Parameters
    ----------
    dtype
        ``"float32"``, ``"int8"`` (u8 x s8 -> s32, VNNI-4 B) or ``"bfloat16"`` (VNNI-2 B).
    isa
        ISA name (:data:`microkernels.isa.KNOWN`); must run on this host.
    m, n, k, batch
        Kernel shape; defaults: the L1-resident block of :func:`_default_shape`
        (24 x 32 x 32 x 4 on AVX2, 24 x 64 x 16 x 4 on AVX-512; on AMX the tile-shaped
        32 x 32 x 64 x 8 for int8, 32 x 32 x 32 x 8 for bfloat16).

    Returns
    -------
    dict
        ``isa``, ``dtype``, ``shape`` (``[m, n, k, batch]``), ``layout``, ``impl`` (the ISA
        whose implementation ran), ``gflops``, ``peak_gflops`` (fp32 FMA peak),
        ``fraction_of_peak``, ``clock_ghz``; for low precision also ``fp32_gflops`` and
        ``ratio_to_fp32``; for full-range int8 without VNNI also ``w7_gflops`` and
        ``w7_ratio_to_fp32`` (the ``vpmaddubsw`` kernel of the ``vnni4_w7`` layout, exact for
        7-bit weights); where the kernel's ISA has an instruction for the dtype (VNNI,
        AVX512-BF16, AMX tiles) also ``dtype_peak_gops`` (one core's, at the measured clock),
        ``dtype_peak_basis`` (how it follows from the fp32 peak) and
        ``fraction_of_dtype_peak``.

    Raises
    ------
    ValueError
        Unknown dtype, a non-x86 ISA, non-positive rounds/runs.
    UsageError
        ``isa="amx"`` with a dtype AMX has no tiles for, or where this process may not run
        AMX (no tiles, or the permission refused); a block the requested ISA's kernel refuses
        (another kernel would be timed); an ISA this CPU does not run.
    """
    from microkernels.brgemm import find_impl
    from microkernels.peak import FmaChains

    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    if rounds < 1 or runs < 1:
        raise ValueError(f"rounds and runs must be positive, got {rounds}, {runs}")
    target_isa = host().isa if isa is None else _isa.from_name(isa)
    if target_isa.arch != "x86_64":
        raise ValueError(f"bench_kernel times x86 kernels; {target_isa.name} is not x86")
    dtype_a, dtype_acc, layout = DTYPES[dtype]
    dm, dn, dk, db = _default_shape(target_isa, dtype_a)
    shape = BrgemmShape(m=m or dm, n=n or dn, k=k or dk, batch=batch or db, dtype_a=dtype_a,
                        dtype_acc=dtype_acc, layout=layout, isa=target_isa.name)
    impl_isa, expected = find_impl(shape)[0], _own_kernel(shape)
    if isa is not None and target_isa.has("amx_tile") and expected != "amx":
        raise UsageError(f"AMX tiles multiply int8 and bfloat16; --isa {isa} --dtype {dtype} "
                         f"would time the {expected} kernel (ask for --isa {expected})")
    if impl_isa != expected:
        block = f"{shape.m}x{shape.n}x{shape.k}x{shape.batch}"
        raise UsageError(f"the {expected} {dtype} kernel refuses block {block} "
                         f"({_refusal(shape, expected)}); find_impl would time the {impl_isa} "
                         "kernel instead")
    if not runs_here(target_isa):
        why = ("Linux refused this process the AMX tile permission" if amx_refused()
               else f"this CPU lacks {' '.join(sorted(target_isa.requires - _isa.host_flags()))}")
        raise UsageError(f"cannot run {target_isa.name} kernels here: {why}; inspect them with "
                         f"`tvm-tpp compile --target \"tpp -isa={target_isa.name}\" --emit asm`")
    chains = FmaChains(target_isa.name)
    timers = {"kernel": kernel_timer(shape)}
    if dtype != "float32":
        timers["fp32"] = kernel_timer(BrgemmShape(m=shape.m, n=shape.n, k=shape.k,
                                                  batch=shape.batch, isa=target_isa.name))
    if dtype == "int8" and impl_isa in ("avx2", "avx512"):
        timers["w7"] = kernel_timer(replace(shape, layout="vnni4_w7"))
    best = dict.fromkeys(timers, 0.0)
    fastest_chain = float("inf")
    for _ in range(rounds):
        fastest_chain = min(fastest_chain, chains.best_seconds(runs))
        for key, timer in timers.items():
            best[key] = max(best[key], max(timer() for _ in range(runs)))
    peak = chains.peak(fastest_chain)
    result: dict[str, Any] = {
        "isa": target_isa.name,
        "dtype": dtype,
        "shape": [shape.m, shape.n, shape.k, shape.batch],
        "layout": layout,
        "impl": impl_isa,
        "gflops": round(best["kernel"], 2),
        "peak_gflops": round(peak.peak_gflops, 2),
        "fraction_of_peak": round(best["kernel"] / peak.peak_gflops, 4),
        "clock_ghz": round(peak.clock_ghz, 3),
    }
    own = (dtype_peak(dtype, _isa.from_name(impl_isa),
                      {"gflops_per_core": peak.peak_gflops, "clock_ghz": peak.clock_ghz})
           if dtype in ("int8", "bfloat16") else None)
    if own is not None:
        result["dtype_peak_gops"] = round(own[0], 1)
        result["dtype_peak_basis"] = own[1]
        result["fraction_of_dtype_peak"] = round(best["kernel"] / own[0], 4)
    if "fp32" in best:
        result["fp32_gflops"] = round(best["fp32"], 2)
        result["ratio_to_fp32"] = round(best["kernel"] / best["fp32"], 3)
    if "w7" in best:
        result["w7_gflops"] = round(best["w7"], 2)
        result["w7_ratio_to_fp32"] = round(best["w7"] / best["fp32"], 3)
    return result
