"""Parallel loops whose iterations the threads take in chunks as they come free.

TVM's CPU code generator splits a parallel loop statically: of ``E`` iterations each of ``T``
threads runs one contiguous ``E / T``, and the loop ends when the slowest thread does.  On a
shared core (a VM whose vCPU is preempted, a busy neighbour, a core the OS gives another
process) that thread holds the others at the join: measured on a 2-vCPU Zen 1 guest in its
slow phases, GPT-2's int8 build ran 1.16x and its float32 one 1.07x slower than with the
chunks below, and ONNX Runtime, whose pool balances dynamically, kept its speed.

:func:`dynamic_parallel` rewrites every parallel loop of a lowered function into tasks that
take chunks of up to ``E // (4 T)`` iterations (:func:`chunk_size`) from a shared counter
(one atomic add a chunk) until none are left::

    next[0] = 0
    for task in parallel(min(E, 4 T)):
        start[0] = fetch_add(next, chunk)
        while start[0] < E:
            for j in range(min(chunk, E - start[0])):
                i = start[0] + j          # the old loop variable, bound per iteration
                ...                       # the old body
            start[0] = fetch_add(next, chunk)

Iterations of a parallel loop are independent in any order (TVM's own split is one such
order), so results are unchanged.  There are as many tasks as chunks, which TVM shares out
statically over its pool: with ``T`` threads the first task of each takes chunks until none
are left and its later tasks find the counter at the end; a larger pool at run time (a model
exported for fewer cores) still puts every thread to work.  Loops with a step other than one
are left to TVM's split.  The per-thread tasks of :mod:`schedules.tile_config` (AMX tiles
configured once a task) become chunks of one task each, every one still configuring its tiles.

Examples
--------
>>> tir_pipeline(2)
'tpp_dynamic_parallel_2'
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from microkernels.machine import is_tpp, machine_of

if TYPE_CHECKING:
    import tvm
    from tvm.target import Target

__all__ = ["CHUNKS_PER_THREAD", "chunk_size", "dynamic_parallel", "pipeline_for",
           "tir_pipeline"]

#: Chunks a thread takes when all run at the same speed: enough that one slow thread's last
#: chunk is a quarter of its share, few enough that each keeps contiguous runs of tiles.
CHUNKS_PER_THREAD = 4

#: ``fetch_add(ptr, n)``: the counter's old value, then ``+ n`` (TIR has no atomics on CPU).
_FETCH_ADD_LL = "\n".join([
    "define linkonce_odr i32 @tpp_fetch_add(ptr %p, i32 %v) alwaysinline {",
    "  %r = atomicrmw add ptr %p, i32 %v seq_cst",
    "  ret i32 %r",
    "}",
])


def chunk_size(extent: int, threads: int) -> int:
    """Iterations a chunk of a parallel loop of ``extent`` iterations takes: the largest up
    to ``extent // (CHUNKS_PER_THREAD * threads)`` whose chunks, taken in turn by equally
    fast threads, leave none of them more than its share, ``ceil(extent / threads)``
    iterations (1 % more on long loops).  A batch-1 conv over 28 rows in chunks of 3 gave
    one thread 15 rows and the other 13: VGG-19's int8 3x3 convs on 28x28 maps ran 7 %
    slower than in chunks of 2 (Zen 4, 2 threads).

    >>> chunk_size(28, 2), chunk_size(224, 2), chunk_size(7, 2), chunk_size(37, 2)
    (2, 28, 1, 3)
    """
    share = -(-extent // threads)
    allowed = share + share // 100

    def longest(chunk: int) -> int:  # iterations of the busiest thread
        full, rest = divmod(extent, chunk)
        rounds, uneven = divmod(full, threads)
        return chunk * (rounds + 1) if uneven else chunk * rounds + rest

    largest = max(1, extent // (CHUNKS_PER_THREAD * threads))
    return next(c for c in range(largest, 0, -1) if longest(c) <= allowed)


def _as(dtype: str, value: Any) -> Any:
    from tvm import tirx

    return value if str(value.ty.dtype) == dtype else tirx.Cast(dtype, value)


def _chunked(loop: Any, threads: int) -> list:
    """The statements replacing parallel ``loop``: the counter, then the tasks."""
    from tvm import tirx

    extent = loop.extent
    dtype = str(extent.ty.dtype)
    counter = tirx.decl_buffer((1,), "int32", "tpp_next")
    start = tirx.decl_buffer((1,), "int32", "tpp_start")
    if isinstance(extent, tirx.IntImm):
        chunk = tirx.const(chunk_size(extent.value, threads), dtype)
    else:  # a symbolic extent (a dynamic batch): the upper bound, balanced or not
        chunk = tirx.max(tirx.const(1, dtype),
                         tirx.floordiv(extent, tirx.const(CHUNKS_PER_THREAD * threads, dtype)))

    def take() -> Any:
        return tirx.BufferStore(start, tirx.call_extern(
            "int32", "tpp_fetch_add", counter.data, _as("int32", chunk)), [0])

    first = _as(dtype, tirx.BufferLoad(start, [0]))
    j = tirx.Var("tpp_j", dtype)
    body = list(loop.body.seq) if isinstance(loop.body, tirx.SeqStmt) else [loop.body]
    run = tirx.For(j, 0, tirx.min(chunk, extent - first), tirx.ForKind.SERIAL,
                   tirx.SeqStmt([tirx.Bind(loop.loop_var, loop.min + first + j), *body]))
    chunks = tirx.While(tirx.BufferLoad(start, [0]) < _as("int32", extent),
                        tirx.SeqStmt([run, take()]))
    # One task per chunk, not per thread: TVM shares the tasks out over its pool however
    # large it is at run time; a thread whose first task found the counter at the end skips
    # the rest of its tasks with one atomic add each.
    count = tirx.min(extent, tirx.const(CHUNKS_PER_THREAD * threads, dtype))
    tasks = tirx.For(tirx.Var("tpp_task", dtype), 0, count, tirx.ForKind.PARALLEL,
                     tirx.SeqStmt([tirx.AllocBuffer(start), take(), chunks]))
    return [tirx.AllocBuffer(counter), tirx.BufferStore(counter, tirx.const(0, "int32"), [0]),
            tasks]


def _chunkable(loop: Any) -> bool:
    """Whether ``loop`` is a parallel loop of unit step (the only kind TVM's schedules make)."""
    from tvm import tirx

    return loop.kind == tirx.ForKind.PARALLEL and (
        loop.step is None or (isinstance(loop.step, tirx.IntImm) and loop.step.value == 1))


def dynamic_parallel(threads: int) -> tvm.transform.Pass:
    """The TIR pass that chunks the parallel loops of every function for ``threads`` threads.

    Parameters
    ----------
    threads
        The threads the code is built for: chunks are sized for them.

    Examples
    --------
    >>> import tvm
    >>> from tvm.script import tirx as T
    >>> @T.prim_func(private=True)
    ... def double(a: T.Buffer((10,), "float32")):
    ...     for i in T.parallel(10):
    ...         a[i] = a[i] * T.float32(2)
    >>> text = dynamic_parallel(2)(tvm.IRModule({"double": double}))["double"].script()
    >>> "T.parallel(8)" in text and "tpp_fetch_add" in text
    True
    """
    import tvm
    import tvm_ffi
    from tvm import tirx

    if threads < 1:
        raise ValueError(f"dynamic_parallel needs at least one thread, got {threads}")

    @tvm.tirx.transform.prim_func_pass(opt_level=0, name="DynamicParallel")
    def _pass(func: Any, _mod: Any, _ctx: Any) -> Any:
        loops: list[Any] = []
        tvm_ffi.structural_walk(func.body, (tirx.For, lambda f: loops.append(f)
                                            if _chunkable(f) else None))
        if not loops:
            return func
        # Post-order: a parallel loop's body is mapped before it (TVM nests none in another).
        body = tvm_ffi.structural_map(func.body, (tirx.For, lambda f: tirx.SeqStmt(
            _chunked(f, threads)) if _chunkable(f) else f))
        return func.with_body(tirx.AttrStmt(tirx.const(0, "int32"), "pragma_import_llvm",
                                            tvm.ir.StringImm(_FETCH_ADD_LL), body))

    return _pass


def tir_pipeline(threads: int) -> str:
    """The name of TVM's default TIR pipeline followed by :func:`dynamic_parallel` for
    ``threads`` threads, registered on first use: ``tvm.compile(..., tir_pipeline=name)``."""
    import tvm

    name = f"tpp_dynamic_parallel_{threads}"
    registry = tvm.tirx.compilation_pipeline

    if name not in registry.PIPELINE_MAP:
        def factory() -> tuple:
            lower, host, device = registry.get_tir_pipeline("default")
            return tvm.ir.transform.Sequential([lower, dynamic_parallel(threads)]), host, device

        registry.register_tir_pipeline(name, factory)
    return name


def pipeline_for(target: Target) -> str:
    """The TIR pipeline to build for ``target`` with: :func:`tir_pipeline` of its threads on
    a ``tpp`` target, TVM's ``"default"`` on any other."""
    return tir_pipeline(machine_of(target).threads) if is_tpp(target) else "default"
