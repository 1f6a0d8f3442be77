"""AMX tiles configured once per thread's share of a kernel, not once per BRGEMM call.

Each AMX BRGEMM call (:mod:`microkernels.amx`) starts with ``ldtilecfg`` and ends with
``tilerelease``, so it can run anywhere.  ``ldtilecfg`` costs about 250-400 cycles, as much as
four to six K steps of a 2x2-tile call: a ResNet 1x1 conv over 64 channels makes one or two
steps a call.  Where every call of a scheduled PrimFunc loads the same configuration and all
of them run inside its one parallel loop, :func:`configure_tiles_once` splits that loop into
one chunk per thread (the contiguous chunks TVM's pool hands out anyway), configures the tiles
at the start of each chunk, releases them at its end, and drops the calls' own
``ldtilecfg``/``tilerelease``.  The element-wise code between calls (epilogues) leaves the
tile state alone, and the kernel's tile shapes do not change within the function, so each call
finds the configuration it would have loaded.  Functions with several configurations (tile
tails) or AMX calls outside a parallel loop are returned unchanged.

Examples
--------
>>> from schedules.gemm import GemmConfig, GemmProblem, schedule
>>> p = GemmProblem(64, 64, 64, dtype="bfloat16")
>>> func = schedule(p, GemmConfig.of("CBa", 32, 32, 64), "amx").mod["main"]
>>> once = configure_tiles_once(func, threads=2)
>>> [tile_configurations(f) for f in (func, once)]  # one ldtilecfg in the code, each moved
[1, 1]
>>> [f.script().index("ldtilecfg") < f.script().index("C_update_o") for f in (func, once)]
[False, True]
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import tvm
    from tvm import tirx

__all__ = ["configure_tiles_once", "configure_tiles_once_pass", "tile_configurations"]


@functools.cache
def _llvm_intrin_op():  # looked up once
    import tvm

    return tvm.ir.Op.get("tirx.call_llvm_intrin")


@functools.cache
def _intrinsic(name: str) -> int:
    from tvm.target import codegen

    return int(codegen.llvm_lookup_intrinsic_id(f"llvm.x86.{name}"))


def _is_call(stmt: object, name: str) -> bool:
    """Whether ``stmt`` is ``Evaluate(call_llvm_intrin(llvm.x86.<name>, ...))``."""
    import tvm
    from tvm import tirx

    call = stmt.value if isinstance(stmt, tirx.Evaluate) else None
    return (isinstance(call, tvm.ir.expr.Call) and call.op.same_as(_llvm_intrin_op())
            and int(call.args[0]) == _intrinsic(name))


def _calls(node: object, name: str) -> list[tirx.Evaluate]:
    """The ``Evaluate`` statements under ``node`` that call ``llvm.x86.<name>``."""
    import tvm_ffi
    from tvm import tirx

    found: list[tirx.Evaluate] = []
    tvm_ffi.structural_walk(node, (tirx.Evaluate, lambda s: found.append(s)
                                   if _is_call(s, name) else None))
    return found


def tile_configurations(func: tirx.PrimFunc) -> int:
    """How many ``ldtilecfg`` calls ``func``'s code holds."""
    return len(_calls(func.body, "ldtilecfg"))


def _configurations(body: tirx.Stmt) -> set[tuple[int, ...]]:
    """The configuration words each ``ldtilecfg`` under ``body`` loads: the eight constants
    its kernel stores right before it (``()`` where they are not that)."""
    import tvm_ffi
    from tvm import tirx

    found: set[tuple[int, ...]] = set()

    def visit(seq: tirx.SeqStmt) -> None:
        stmts = list(seq.seq)
        for k, stmt in enumerate(stmts):
            if _is_call(stmt, "ldtilecfg"):
                words = tuple(int(s.value) for s in stmts[max(0, k - 8):k]
                              if isinstance(s, tirx.BufferStore)
                              and isinstance(s.value, tirx.IntImm))
                found.add(words if len(words) == 8 else ())

    tvm_ffi.structural_walk(body, (tirx.SeqStmt, visit))
    return found


def configure_tiles_once(func: tirx.PrimFunc, threads: int) -> tirx.PrimFunc:
    """``func`` with its AMX tiles configured once per chunk of its parallel loop (module
    doc), split into ``threads`` chunks; ``func`` itself where that does not apply."""
    import tvm
    import tvm_ffi
    from tvm import tirx

    total = tile_configurations(func)
    if not total:
        return func
    words = _configurations(func.body)
    if len(words) != 1 or () in words:
        return func
    parallel: list[tirx.For] = []
    tvm_ffi.structural_walk(func.body, (tirx.For, lambda f: parallel.append(f)
                                        if f.kind == tirx.ForKind.PARALLEL else None))
    if len(parallel) != 1 or len(_calls(parallel[0].body, "ldtilecfg")) != total:
        return func
    loop = parallel[0]
    if not isinstance(loop.extent, tirx.IntImm) or loop.min.value != 0:
        return func
    extent, dtype = int(loop.extent), loop.loop_var.ty
    tasks = max(1, min(threads, extent))
    chunk = -(-extent // tasks)
    task, step = tirx.Var("tile_task", dtype), tirx.Var("tile_step", dtype)
    index = task * tirx.const(chunk, dtype) + step
    noop = tirx.Evaluate(tirx.const(0, "int32"))
    body = tvm_ffi.structural_map(loop.body, [
        (tirx.Evaluate, lambda s: noop if _is_call(s, "ldtilecfg") or _is_call(s, "tilerelease")
         else s),
        (tvm.ir.expr.Var, lambda v: index if v.same_as(loop.loop_var) else v)])
    if extent % tasks:
        body = tirx.IfThenElse(index < tirx.const(extent, dtype), body, None)
    config = tirx.decl_buffer((8,), "int64", name="tile_config", scope="local")
    setup = [tirx.AllocBuffer(config)] + [
        tirx.BufferStore(config, tirx.const(w, "int64"), [k]) for k, w in enumerate(*words)]
    setup.append(tirx.Evaluate(tirx.call_llvm_intrin(
        "void", "llvm.x86.ldtilecfg", config.access_ptr("r"))))
    release = tirx.Evaluate(tirx.call_llvm_intrin("void", "llvm.x86.tilerelease"))
    chunked = tirx.For(task, 0, tasks, tirx.ForKind.PARALLEL, tirx.SeqStmt(
        [*setup, tirx.For(step, 0, chunk, tirx.ForKind.SERIAL, body), release]))
    return func.with_body(tvm_ffi.structural_map(
        func.body, (tirx.For, lambda f: chunked if f.same_as(loop) else f)))


def configure_tiles_once_pass(threads: int) -> tvm.transform.Pass:
    """The module pass of :func:`configure_tiles_once` over every PrimFunc."""
    from tvm import tirx

    return tirx.transform.prim_func_pass(
        lambda func, _mod, _ctx: configure_tiles_once(func, threads), opt_level=0,
        name="TppConfigureTilesOnce")
