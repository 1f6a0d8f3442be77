"""Operand packing (microkernels.pack.Packing): numpy, TE and index maps agree, padding is zero.

The MMLA packers in the same module are tested with the aarch64 kernels (test_brgemm_arm.py).
"""

import numpy as np
import pytest
import tvm
from hypothesis import given, settings
from hypothesis import strategies as st
from tvm import s_tir, te

from microkernels.pack import Packing, padded

PACKINGS = [
    Packing.blocked_b(16),
    Packing.blocked_a(4, 8),
    Packing.vnni_b(2),
    Packing.vnni_b(4),
    Packing.vnni_blocked_b(4, 16),
    Packing.vnni_blocked_b(2, 8),
    Packing.blocked_b(1),
]
IDS = [p.name for p in PACKINGS]


def _matrix(rows, cols, dtype="float32"):
    # distinct non-zero values, so a misplaced element or a non-zero pad is visible
    return (np.arange(rows * cols).reshape(rows, cols) % 97 + 1).astype(dtype)


def test_packed_shapes():
    assert Packing.blocked_b(16).packed_shape(64, 40) == (3, 64, 16)
    assert Packing.blocked_a(4, 8).packed_shape(13, 37) == (4, 5, 4, 8)
    assert Packing.vnni_b(4).packed_shape(13, 37) == (4, 37, 4)
    assert Packing.vnni_blocked_b(2, 16).packed_shape(13, 37) == (3, 7, 16, 2)
    assert Packing.vnni_b(4).padded_shape(13, 37) == (16, 37)
    assert padded(37, 16) == 48 and padded(32, 16) == 32


def test_vnni_layout_matches_brgemm_b_operand():
    """vnni_b(alpha) is the ``[K/alpha][n][alpha]`` B of the BRGEMM vnni2/vnni4 layouts."""
    b = _matrix(8, 3, "int8")
    bp = Packing.vnni_b(4).pack(b)
    for kk in range(8):
        for j in range(3):
            assert bp[kk // 4, j, kk % 4] == b[kk, j]


def test_blocked_b_panels_are_contiguous_k_by_bn():
    b = _matrix(5, 32)
    bp = Packing.blocked_b(16).pack(b)
    assert bp.flags["C_CONTIGUOUS"]
    np.testing.assert_array_equal(bp[1], b[:, 16:32])


@pytest.mark.parametrize("packing", PACKINGS, ids=IDS)
@pytest.mark.parametrize("rows,cols", [(13, 37), (16, 32), (1, 1), (3, 50)])
def test_numpy_roundtrip_and_zero_padding(packing, rows, cols):
    x = _matrix(rows, cols)
    xp = packing.pack(x)
    assert xp.shape == packing.packed_shape(rows, cols) and xp.dtype == x.dtype
    np.testing.assert_array_equal(packing.unpack(xp, rows, cols), x)
    # every real element lands once; all the rest is padding and zero
    assert np.count_nonzero(xp) == x.size and xp.sum() == x.sum()


@pytest.mark.parametrize("packing", PACKINGS, ids=IDS)
def test_index_maps_match_numpy(packing):
    rows, cols = 13, 37
    x = _matrix(rows, cols)
    xp = packing.pack(x)
    forward, inverse = packing.index_maps()
    for i in range(rows):
        for j in range(cols):
            assert xp[forward(i, j)] == x[i, j]
            assert inverse(*forward(i, j)) == (i, j)


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 40), cols=st.integers(1, 40), br=st.integers(1, 9),
       bc=st.integers(1, 9), order=st.permutations(["R", "r", "C", "c"]))
def test_any_packing_roundtrips(rows, cols, br, bc, order):
    order = tuple(p for p in order if (p != "r" or br > 1) and (p != "c" or bc > 1))
    packing = Packing(br, bc, order)
    x = _matrix(rows, cols, "int32")
    np.testing.assert_array_equal(packing.unpack(packing.pack(x), rows, cols), x)


@pytest.mark.parametrize("packing", PACKINGS[:5], ids=IDS[:5])
def test_te_pack_and_unpack_match_numpy(packing):
    rows, cols = 13, 37
    x = te.placeholder((rows, cols), "float32", name="X")
    xp = packing.te_pack(x)
    back = packing.te_unpack(xp, rows, cols)
    ex = tvm.compile(te.create_prim_func([x, xp, back]), target="llvm")
    data = _matrix(rows, cols)
    out_p = tvm.runtime.empty(packing.packed_shape(rows, cols), "float32")
    out_u = tvm.runtime.empty((rows, cols), "float32")
    ex(tvm.runtime.tensor(data), out_p, out_u)
    np.testing.assert_array_equal(out_p.numpy(), packing.pack(data))
    np.testing.assert_array_equal(out_u.numpy(), data)


def test_transform_layout_with_forward_map():
    """The forward map repacks a GEMM's B buffer inside a schedule (VNNI-4, int8)."""
    m, n, k = 4, 6, 8
    a = te.placeholder((m, k), "uint8", name="A")
    b = te.placeholder((k, n), "int8", name="B")
    r = te.reduce_axis((0, k), name="r")
    c = te.compute((m, n), lambda i, j: te.sum(a[i, r].astype("int32") * b[r, j].astype("int32"),
                                               axis=r), name="C")
    sch = s_tir.Schedule(te.create_prim_func([a, b, c]))
    block = sch.get_sblock("C")
    packing = Packing.vnni_b(4)
    sch.transform_layout(block, ("read", 1), packing.index_maps()[0])
    ex = tvm.compile(sch.mod, target="llvm")
    rng = np.random.default_rng(0)
    av = rng.integers(0, 256, (m, k)).astype("uint8")
    bv = rng.integers(-128, 128, (k, n)).astype("int8")
    out = tvm.runtime.empty((m, n), "int32")
    ex(tvm.runtime.tensor(av), tvm.runtime.tensor(packing.pack(bv)), out)  # B is [2][6][4] now
    np.testing.assert_array_equal(out.numpy(), av.astype(np.int64) @ bv.astype(np.int64))


def test_invalid_arguments():
    with pytest.raises(ValueError, match="positive"):
        Packing.blocked_b(0)
    with pytest.raises(ValueError, match="positive"):
        Packing.vnni_b(-2)
    with pytest.raises(ValueError, match="exactly once"):
        Packing(2, 4, ("R", "C", "c"))  # "r" missing although rows are split
    with pytest.raises(ValueError, match="exactly once"):
        Packing(1, 4, ("R", "C", "c", "c"))
    with pytest.raises(ValueError, match="2-D"):
        Packing.vnni_b(4).pack(np.zeros((2, 3, 4)))
    with pytest.raises(ValueError, match="2-D"):
        Packing.vnni_b(4).pack(np.zeros((0, 3)))
    with pytest.raises(ValueError, match=r"has shape \(2, 3, 4\), got"):
        Packing.vnni_b(4).unpack(np.zeros((2, 3, 2)), 8, 3)
    with pytest.raises(ValueError, match="packed indices"):
        Packing.vnni_b(4).index_maps()[1](1, 2)
    with pytest.raises(ValueError, match="2-D tensor"):
        Packing.vnni_b(4).te_pack(te.placeholder((2, 3, 4), "int8", name="X"))
    with pytest.raises(ValueError, match="has shape"):
        Packing.vnni_b(4).te_unpack(te.placeholder((2, 3, 2), "int8", name="Xp"), 8, 3)
    with pytest.raises(ValueError, match="positive"):
        padded(0, 4)


def test_templates_pack_weights_with_blocked_b():
    """The GEMM and conv templates' weight layouts are blocked_b panels (unit bn kept)."""
    from schedules import conv, gemm

    w = np.arange(5 * 7, dtype="float32").reshape(5, 7)
    for bn in (1, 7):
        expected = w.reshape(5, 7 // bn, bn).transpose(1, 0, 2)
        assert np.array_equal(gemm.pack_weight(w, bn), expected)
    oihw = np.arange(4 * 3 * 2 * 2, dtype="float32").reshape(4, 3, 2, 2)
    packed = conv.pack_weight(oihw, 2)
    assert packed.shape == (2, 2, 2, 3, 2)
    assert np.array_equal(packed[1, 0, 1], oihw[2:4, :, 0, 1].T)  # [C, bk] of tap (0, 1)
