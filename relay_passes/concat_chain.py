"""DenseNet's growing channel concatenations written in place into one buffer per chain.

A dense block concatenates each layer's new channels to everything before them:
``c1 = concat(c0, n1)``, ``c2 = concat(c1, n2)``, ... Each concat copies the whole tensor
again, so a block of ``L`` layers moves ``O(L^2)`` channels through memory (on a Zen 1, 59
such copies were 11 % of DenseNet-121's time).  OpenVINO writes each layer's channels into
the final tensor instead; so does :func:`write_concat_chains` (DenseNet-121 3.9 % faster at
batch 1 on the Zen 1, the two builds exported and timed in alternating processes):

* ``buf = copy(c0)`` into the first channels of a tensor as wide as the chain's last concat;
* ``buf_i = write(buf_{i-1}, n_i)`` (``call_tir_inplace``): ``n_i`` into its channels
  (the kernels are named as data movement, ``concat_copy`` and ``concat_slice_copy``, so
  that ``tvm-tpp profile`` counts them as layout conversions);
* where ``n_i`` is a kernel's output only the concat reads (a growth conv's, element by
  element: :func:`relay_passes.concat_slices.kernel_writing`), that kernel writes its
  channels of the buffer itself, in place, and no copy of ``n_i`` is left (DenseNet-121's
  58 growth convs, Winograd ones included: bf16 1.03x at batch 8 on a Zen 5);
* each ``c_i`` becomes ``strided_slice(buf_i, channels [0, C_i))``, which FuseOps fuses into
  its readers (DenseNet's BatchNorm and ReLU), and the last one is the buffer itself.

A later write never touches the channels an earlier ``c_i`` reads, so its readers see the
same values wherever they run.  A chain is two or more channels-last (NHWC, axis 3) concats
of two static-shape tensors of one dtype, each taking the previous one as its first input;
a concat that feeds two concats' first inputs ends the chain (the two would write the same
channels).  Functions with symbolic shapes are left as they are.

Examples
--------
>>> x = relax.Var("x", relax.TensorType((1, 4, 4, 8), "float32"))
>>> bb = relax.BlockBuilder()
>>> with bb.function("main", [x]):
...     with bb.dataflow():
...         c1 = bb.emit(relax.op.concat([x, relax.op.nn.relu(x)], axis=3))
...         c2 = bb.emit_output(relax.op.concat([c1, relax.op.nn.relu(c1)], axis=3))
...     _ = bb.emit_func_output(c2)
>>> sorted(gv.name_hint for gv in write_concat_chains(bb.get()).functions)
['concat_copy', 'concat_slice_copy', 'concat_slice_copy1', 'main']
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import tvm
from tvm import relax
from tvm.script import tirx as T

from microkernels.script_source import pin_source

from .scaffold import add_kernel, is_call_to, readers, rewrite_static_functions, static_shape

if TYPE_CHECKING:
    from .concat_slices import SlicedProducer

# The TVMScript builders below parse the text this module was imported from.
pin_source(__name__)

__all__ = ["CHANNEL_AXIS", "chains", "concats", "copy_kernel", "write_concat_chains"]

#: NHWC's channel axis, the one the concats rewritten here join along.
CHANNEL_AXIS = 3


def write_concat_chains(mod: tvm.IRModule) -> tvm.IRModule:
    """``mod`` with every concat chain (module doc) written in place into one buffer."""
    rewriter = _Chains(mod)
    return relax.transform.DeadCodeElimination()(
        rewrite_static_functions(mod, rewriter, rewriter.plan))


def copy_kernel(src_shape: tuple[int, ...], channels: int, offset: int, dtype: str,
                in_place: bool) -> tvm.tirx.PrimFunc:
    """Copy an NHWC ``src`` into channels ``[offset, offset + C)`` of an NHWC buffer of
    ``channels`` channels: ``(src, buf)`` writing the output ``buf`` (its other channels left
    as they are allocated), or in place, ``(buf, src)``.  Rows run in parallel, channels in
    vectors of 8 where they divide.

    Examples
    --------
    >>> f = copy_kernel((1, 2, 3, 8), 24, 16, "float32", in_place=True)
    >>> [p.name for p in f.params]
    ['B', 'S']
    """
    n, h, w, c = src_shape
    rows, lanes = n * h * w, 8 if c % 8 == 0 else 1

    @T.prim_func(s_tir=True)
    def copy(src: T.handle, buf: T.handle):
        S = T.match_buffer(src, (n, h, w, c), dtype)
        B = T.match_buffer(buf, (n, h, w, channels), dtype)
        with T.sblock("root"):
            S2 = T.decl_buffer((rows, c), dtype, data=S.data)
            B2 = T.decl_buffer((rows, channels), dtype, data=B.data)
            for p in T.parallel(rows):
                for v in T.serial(c // lanes):
                    for j in T.vectorized(lanes):
                        B2[p, offset + v * lanes + j] = S2[p, v * lanes + j]

    if not in_place:
        return copy
    # In place, the buffer comes first (call_tir_inplace's operand 0 is the one written).
    return tvm.tirx.PrimFunc(list(reversed(copy.params)), copy.body, copy.ret_type, copy.attrs)


def _concat_parts(value: relax.Expr, axis: int = CHANNEL_AXIS
                  ) -> tuple[relax.Expr, relax.Expr] | None:
    """The two inputs of a static-shape 4-D concat of one dtype along ``axis``, or None."""
    if not is_call_to(value, "relax.concat"):
        return None
    parts = value.args[0]
    if not isinstance(parts, relax.Tuple) or len(parts.fields) != 2:
        return None
    types = [p.ty for p in parts.fields] + [value.ty]
    if not all(isinstance(t, relax.TensorType) and t.ndim == 4 and t.dtype == types[0].dtype
               and static_shape(t.shape.values) is not None for t in types):
        return None
    if int(value.attrs.axis) % 4 != axis:
        return None
    return parts.fields[0], parts.fields[1]


def concats(bindings: list[relax.Binding], axis: int = CHANNEL_AXIS
            ) -> dict[relax.Var, tuple[relax.Expr, relax.Expr]]:
    """Each concat among ``bindings`` a chain may take (two static-shape 4-D tensors of one
    dtype along ``axis``) -> its two inputs."""
    return {b.var: parts for b in bindings if isinstance(b, relax.VarBinding)
            and (parts := _concat_parts(b.value, axis)) is not None}


def chains(joined: dict[relax.Var, tuple[relax.Expr, relax.Expr]]) -> list[list[relax.Var]]:
    """The chains (module doc) among ``joined`` (:func:`concats`): lists of bound vars,
    first first."""
    heads: dict[relax.Var, list[relax.Var]] = {}  # concat -> the concats it is first input of
    for var, (first, _) in joined.items():
        if isinstance(first, relax.Var) and first in joined:
            heads.setdefault(first, []).append(var)
    nxt = {prev: users[0] for prev, users in heads.items() if len(users) == 1}
    starts = [v for v in joined if not any(nxt.get(p) == v for p in nxt)]
    found = []
    for start in starts:
        chain = [start]
        while chain[-1] in nxt:
            chain.append(nxt[chain[-1]])
        if len(chain) >= 2:
            found.append(chain)
    return found


@relax.expr_functor.mutator
class _Chains(relax.PyExprMutator):
    def __init__(self, mod: tvm.IRModule) -> None:
        super().__init__(mod)
        self.mod = mod
        # concat var -> (its chain, its position in it)
        self.plan: dict[relax.Var, tuple[list[relax.Var], int]] = {}
        self.buffers: dict[int, relax.Var] = {}  # id of a chain's first var -> latest buffer
        self.parts: dict[relax.Var, tuple[relax.Expr, relax.Expr]] = {}
        self.producing: dict[relax.Var, tuple[relax.Var, SlicedProducer]] = {}  # call -> part
        self.written: set[relax.Var] = set()  # concats whose new channels a kernel writes
        self.bound: dict = {}
        self.read_by = None

    def _start(self, chain: list[relax.Var], first: relax.Expr) -> None:
        """The chain's buffer: its first concat's first input copied into its channels."""
        full = chain[-1].ty
        kernel = add_kernel(self.builder_, copy_kernel(
            static_shape(first.ty.shape.values), int(full.shape.values[CHANNEL_AXIS]), 0,
            str(full.dtype), False), "concat_copy")
        self.buffers[id(chain)] = self.builder_.emit(relax.call_tir(kernel, [first], full))

    def _write(self, var: relax.Var, producer: SlicedProducer) -> None:
        """The producer of ``var``'s new channels, writing them into the chain's buffer."""
        chain, position = self.plan[var]
        key = id(chain)
        if position == 0 and key not in self.buffers:
            self._start(chain, self.visit_expr(self.parts[var][0]))
        buffer = self.buffers[key]
        wrote = producer.emit(self.builder_, [self.visit_expr(a) for a in producer.args],
                              buffer, str(buffer.ty.dtype))
        self.buffers[key] = self.builder_.emit(relax.op.reshape(wrote, chain[-1].ty.shape))

    def visit_function_(self, func: relax.Function) -> relax.Expr:
        self.bound, self.read_by = relax.analysis.get_var2val(func), readers(func)
        return super().visit_function_(func)

    def visit_dataflow_block_(self, block: relax.DataflowBlock) -> relax.DataflowBlock:
        # Imported here: concat_slices builds on this module's copy kernel.
        from .concat_slices import kernel_writing

        joined = concats(list(block.bindings))
        order = {b.var: i for i, b in enumerate(block.bindings)}
        for chain in chains(joined):
            channels = int(chain[-1].ty.shape.values[CHANNEL_AXIS])
            for position, var in enumerate(chain):
                self.plan[var] = (chain, position)
                self.parts[var] = first, new = joined[var]
                # A kernel computing the new channels writes them into the buffer itself,
                # where the buffer it writes (the previous concat's, or the first input to
                # start it from) is bound before it.
                producer = kernel_writing(new, self.bound[var], channels,
                                          int(first.ty.shape.values[CHANNEL_AXIS]),
                                          self.bound, self.read_by, self.mod)
                before = first if position == 0 else chain[position - 1]
                if producer is not None and order.get(before, -1) < order[producer.var]:
                    self.producing[producer.var] = (var, producer)
                    self.written.add(var)
        return super().visit_dataflow_block_(block)

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        if binding.var in self.producing:
            self._write(*self.producing[binding.var])
            return
        value = binding.value
        if is_call_to(value, "relax.reshape") and value.args[0] in self.producing:
            return  # the producer's view, which only the concat read
        if binding.var not in self.plan:
            super().visit_var_binding_(binding)
            return
        chain, position = self.plan[binding.var]
        first, new = (self.visit_expr(e) for e in self.parts[binding.var])
        full = chain[-1].ty
        key = id(chain)
        if position == 0 and key not in self.buffers:
            self._start(chain, first)
        if binding.var not in self.written:
            offset = int(first.ty.shape.values[CHANNEL_AXIS])
            src = static_shape(new.ty.shape.values)
            kernel = add_kernel(self.builder_, copy_kernel(
                src, int(full.shape.values[CHANNEL_AXIS]), offset, str(full.dtype), True),
                "concat_slice_copy")
            self.buffers[key] = self.builder_.emit(relax.call_tir_inplace(
                kernel, [self.buffers[key], new], [0], full))
        buffer = self.buffers[key]
        width = int(binding.var.ty.shape.values[CHANNEL_AXIS])
        value = buffer if position == len(chain) - 1 else relax.op.strided_slice(
            buffer, axes=[CHANNEL_AXIS], begin=[0], end=[width])
        self.builder_.emit_normalized(relax.VarBinding(binding.var,
                                                       self.builder_.normalize(value)))
