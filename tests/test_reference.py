"""CPU tests of flashcupy.reference: the plain reference against independent math, and the tiled
FA2 transcriptions against the plain reference."""

import itertools
import math

import numpy as np
import pytest

from flashcupy.reference import (
    attention_bwd_ref,
    attention_flops,
    attention_mask,
    attention_ref,
    attention_varlen_bwd_ref,
    attention_varlen_ref,
    causal_mask,
    fa2_backward_tiled,
    fa2_forward_tiled,
)

RTOL = 1e-10
ATOL = 1e-12


def _qkv(rng, batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim):
    q = rng.standard_normal((batch, seqlen_q, nheads, headdim))
    k = rng.standard_normal((batch, seqlen_k, nheads_k, headdim))
    v = rng.standard_normal((batch, seqlen_k, nheads_k, headdim))
    return q, k, v


def _random_case(seed):
    """Batch, head layout (incl. GQA) and head dim drawn from a seeded generator."""
    rng = np.random.default_rng(seed)
    batch = int(rng.choice([1, 3]))
    nheads, nheads_k = [(1, 1), (2, 2), (2, 1), (4, 2), (4, 1)][rng.integers(5)]
    headdim = int(rng.choice([8, 16, 32]))
    return rng, batch, nheads, nheads_k, headdim


def _sees(i, j, seqlen_q, seqlen_k, causal=False, window_size=(-1, -1), alignment="bottom_right"):
    """The band rule for one (row, key) pair, written out independently of the module. No cut at
    seqlen_k, so the tile tests can extend it to the padded slots of a tile."""
    offset = seqlen_k - seqlen_q if alignment == "bottom_right" else 0
    left, right = window_size
    if causal:
        right = 0
    return (left == -1 or j >= i + offset - left) and (right == -1 or j <= i + offset + right)


def _loop_attention(q, k, v, scale, causal, window_size=(-1, -1), alignment="bottom_right", softcap=0.0,
                    alibi=None, sinks=None):
    """Per-element attention with math.exp, independent of the module's vectorised code.

    softcap as the module's; alibi (batch, nheads) slopes, sinks (nheads,) logits, written out from
    the module docstring's formulas.
    """
    batch, sq, nheads, d = q.shape
    sk, nheads_k = k.shape[1], k.shape[2]
    offset = sk - sq if alignment == "bottom_right" else 0
    out = np.zeros(q.shape)
    lse = np.full((batch, nheads, sq), -np.inf)
    for b, h, i in itertools.product(range(batch), range(nheads), range(sq)):
        kh = h // (nheads // nheads_k)
        keys = [j for j in range(sk) if _sees(i, j, sq, sk, causal, window_size, alignment)]
        scores = {}
        for j in keys:
            s = scale * sum(q[b, i, h, e] * k[b, j, kh, e] for e in range(d))
            if softcap:
                s = softcap * math.tanh(s / softcap)
            if alibi is not None:
                s -= alibi[b][h] * abs(i + offset - j)
            scores[j] = s
        sink = [] if sinks is None else [sinks[h]]
        if not keys and not sink:
            continue
        top = max(list(scores.values()) + sink)
        weights = {j: math.exp(s - top) for j, s in scores.items()}
        total = sum(weights.values()) + sum(math.exp(x - top) for x in sink)
        lse[b, h, i] = top + math.log(total)
        for e in range(d):
            out[b, i, h, e] = sum(w * v[b, j, kh, e] for j, w in weights.items()) / total
    return out, lse


# ----------------------------------------------------------------------------------------------
# attention_ref
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(4, 4), (3, 5), (5, 3)])
def test_ref_matches_loop(causal, seqlen_q, seqlen_k):
    rng = np.random.default_rng(1)
    q, k, v = _qkv(rng, 2, seqlen_q, seqlen_k, 4, 2, 3)
    out, lse = attention_ref(q, k, v, softmax_scale=0.7, causal=causal)
    want_out, want_lse = _loop_attention(q, k, v, 0.7, causal)
    np.testing.assert_allclose(out, want_out, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(lse, want_lse, rtol=RTOL, atol=ATOL)


def test_causal_mask_bottom_right():
    # Square: lower triangle. Wide: shifted right by seqlen_k - seqlen_q. Tall: first rows empty.
    np.testing.assert_array_equal(causal_mask(3, 3), np.tril(np.ones((3, 3), bool)))
    np.testing.assert_array_equal(causal_mask(2, 4), [[1, 1, 1, 0], [1, 1, 1, 1]])
    np.testing.assert_array_equal(causal_mask(4, 2), [[0, 0], [0, 0], [1, 0], [1, 1]])


@pytest.mark.parametrize("causal", [False, True])
def test_ref_rows_sum_to_one(causal):
    rng = np.random.default_rng(2)
    q, k, _ = _qkv(rng, 2, 9, 6, 2, 1, 8)
    out, _ = attention_ref(q, k, np.ones(k.shape), causal=causal)
    seen = causal_mask(9, 6).any(axis=1) if causal else np.ones(9, bool)
    np.testing.assert_allclose(out[:, seen], 1.0, rtol=RTOL)
    np.testing.assert_array_equal(out[:, ~seen], 0.0)


@pytest.mark.parametrize("causal", [False, True])
def test_ref_lse_is_logsumexp(causal):
    rng = np.random.default_rng(3)
    q, k, v = _qkv(rng, 2, 7, 10, 4, 2, 8)
    _, lse = attention_ref(q, k, v, softmax_scale=0.3, causal=causal)
    allowed = causal_mask(7, 10) if causal else np.ones((7, 10), bool)
    for b, h in itertools.product(range(2), range(4)):
        s = 0.3 * q[b, :, h] @ k[b, :, h // 2].T
        want = [np.logaddexp.reduce(s[i][allowed[i]]) for i in range(7)]
        np.testing.assert_allclose(lse[b, h], want, rtol=RTOL)


def test_default_scale_is_rsqrt_headdim():
    rng = np.random.default_rng(4)
    q, k, v = _qkv(rng, 1, 5, 5, 2, 2, 16)
    for fn in (attention_ref, fa2_forward_tiled):
        out, lse = fn(q, k, v)
        want_out, want_lse = fn(q, k, v, softmax_scale=0.25)
        np.testing.assert_array_equal(out, want_out)
        np.testing.assert_array_equal(lse, want_lse)
    # And a different scale really changes the result.
    assert not np.allclose(attention_ref(q, k, v, softmax_scale=0.5)[0], out)


@pytest.mark.parametrize("dtype", ["float16", "float32", "bfloat16"])
def test_low_precision_inputs_computed_in_float64(dtype):
    if dtype == "bfloat16":
        dtype = pytest.importorskip("ml_dtypes").bfloat16
    rng = np.random.default_rng(5)
    q, k, v = (x.astype(dtype) for x in _qkv(rng, 2, 20, 30, 2, 1, 16))
    dout = rng.standard_normal(q.shape).astype(dtype)
    q64, k64, v64, do64 = (x.astype(np.float64) for x in (q, k, v, dout))
    for fn in (attention_ref, fa2_forward_tiled):
        out, lse = fn(q, k, v, causal=True)
        assert out.dtype == lse.dtype == np.float64
        want_out, want_lse = attention_ref(q64, k64, v64, causal=True)
        np.testing.assert_allclose(out, want_out, rtol=RTOL, atol=ATOL)
        np.testing.assert_allclose(lse, want_lse, rtol=RTOL, atol=ATOL)
    grads = attention_bwd_ref(dout, q, k, v, causal=True)
    for g, want in zip(grads, attention_bwd_ref(do64, q64, k64, v64, causal=True)):
        assert g.dtype == np.float64
        np.testing.assert_allclose(g, want, rtol=RTOL, atol=ATOL)


def test_backward_takes_d_from_the_output_it_is_handed():
    """out=: D = rowsum(dout * out) from the given output. The exact output gives the same gradients;
    a perturbed one moves dq, dk and dsinks (through D) but not dv; packed batches slice it per sequence."""
    rng = np.random.default_rng(31)
    q, k, v = _qkv(rng, 2, 5, 7, 4, 2, 8)
    dout = rng.standard_normal(q.shape)
    kw = dict(causal=True, sinks=rng.uniform(-1, 2, 4))
    out, _ = attention_ref(q, k, v, **kw)
    exact = attention_bwd_ref(dout, q, k, v, **kw)
    for g, want in zip(attention_bwd_ref(dout, q, k, v, out=out, **kw), exact):
        np.testing.assert_allclose(g, want, rtol=1e-12, atol=1e-12)
    moved = attention_bwd_ref(dout, q, k, v, out=out + 1e-3 * rng.standard_normal(out.shape), **kw)
    np.testing.assert_array_equal(moved[2], exact[2])
    for g, want in zip(moved[:2] + moved[3:], exact[:2] + exact[3:]):
        assert np.abs(g - want).max() > 1e-6
    with pytest.raises(ValueError):
        attention_bwd_ref(dout, q, k, v, out=out[:, :3], **kw)
    cu = np.array([0, 5, 10])
    flat = [x.reshape(-1, *x.shape[2:]) for x in (dout, q, k, v, out + 1e-3)]
    packed = attention_varlen_bwd_ref(*flat[:4], cu, np.array([0, 7, 14]), out=flat[4], **kw)
    padded = attention_bwd_ref(dout, q, k, v, out=out + 1e-3, **kw)
    for g, want in zip(packed[:3], padded[:3]):
        np.testing.assert_allclose(g, want.reshape(g.shape), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(packed[3], padded[3], rtol=1e-12, atol=1e-12)


def test_bad_shapes_rejected():
    rng = np.random.default_rng(6)
    q, k, v = _qkv(rng, 1, 4, 4, 3, 2, 8)
    for fn in (attention_ref, fa2_forward_tiled):
        with pytest.raises(ValueError):
            fn(q, k, v)  # 3 heads over 2 kv heads
        with pytest.raises(ValueError):
            fn(q[..., :2, :], k, v[..., :4])  # v head dim differs from k
    with pytest.raises(ValueError):
        fa2_forward_tiled(q[..., :2, :], k, v, block_m=0)


# ----------------------------------------------------------------------------------------------
# attention_bwd_ref against finite differences
# ----------------------------------------------------------------------------------------------


def _check_against_finite_differences(dout, q, k, v, kw):
    """attention_bwd_ref's gradients of sum(out * dout) against central differences of attention_ref:
    dq, dk, dv, and dsinks when kw has sinks."""
    kw = dict(kw)
    sinks = kw.pop("sinks", None)
    args = [q.copy(), k.copy(), v.copy()] + ([] if sinks is None else [np.array(sinks, dtype=float)])

    def f():
        q, k, v, *sinks = args
        return np.sum(attention_ref(q, k, v, sinks=sinks[0] if sinks else None, **kw)[0] * dout)

    grads = attention_bwd_ref(dout, q, k, v, sinks=sinks, **kw)
    assert len(grads) == len(args)
    eps = 1e-5
    for name, x, grad in zip(("dq", "dk", "dv", "dsinks"), args, grads):
        numeric = np.zeros(x.shape)
        for idx in np.ndindex(x.shape):
            orig = x[idx]
            x[idx] = orig + eps
            up = f()
            x[idx] = orig - eps
            down = f()
            x[idx] = orig
            numeric[idx] = (up - down) / (2 * eps)
        # Relative to the gradient's size, absolute where it is 0 (a row seeing one key only
        # gives no dq, dk).
        err = np.max(np.abs(grad - numeric)) / max(np.max(np.abs(numeric)), 1e-2)
        assert err < 1e-6, name


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(
    "batch,seqlen_q,seqlen_k,nheads,nheads_k",
    [(1, 4, 4, 2, 2), (2, 3, 5, 2, 1), (1, 5, 3, 2, 1), (2, 5, 4, 2, 2)],
)
def test_bwd_ref_finite_differences(causal, batch, seqlen_q, seqlen_k, nheads, nheads_k):
    rng = np.random.default_rng([7, seqlen_q, seqlen_k, nheads_k])
    q, k, v = _qkv(rng, batch, seqlen_q, seqlen_k, nheads, nheads_k, 4)
    dout = rng.standard_normal(q.shape)
    scale = 0.8

    _check_against_finite_differences(dout, q, k, v, dict(softmax_scale=scale, causal=causal))


# ----------------------------------------------------------------------------------------------
# fa2_forward_tiled / fa2_backward_tiled against the reference
# ----------------------------------------------------------------------------------------------

BLOCKS = [(16, 16), (32, 64), (64, 32), (128, 64), (64, 128)]
SEQLENS = [(1, 1), (17, 17), (63, 65), (65, 63), (100, 130), (130, 100), (1, 130), (130, 1), (17, 100)]


@pytest.mark.parametrize("block_m,block_n", BLOCKS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen_q,seqlen_k", SEQLENS)
def test_fa2_forward_matches_ref(block_m, block_n, causal, seqlen_q, seqlen_k):
    seed = [block_m, block_n, causal, seqlen_q, seqlen_k]
    rng, batch, nheads, nheads_k, headdim = _random_case(seed)
    q, k, v = _qkv(rng, batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim)
    out, lse = fa2_forward_tiled(q, k, v, causal=causal, block_m=block_m, block_n=block_n)
    want_out, want_lse = attention_ref(q, k, v, causal=causal)
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    np.testing.assert_allclose(out, want_out, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(lse, want_lse, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("block_m,block_n", BLOCKS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen_q,seqlen_k", SEQLENS[::2] + [(65, 63)])
def test_fa2_backward_matches_ref(block_m, block_n, causal, seqlen_q, seqlen_k):
    seed = [block_m, block_n, causal, seqlen_q, seqlen_k, 1]
    rng, batch, nheads, nheads_k, headdim = _random_case(seed)
    q, k, v = _qkv(rng, batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim)
    dout = rng.standard_normal(q.shape)
    out, lse = attention_ref(q, k, v, softmax_scale=0.3, causal=causal)
    got = fa2_backward_tiled(dout, q, k, v, out, lse, softmax_scale=0.3, causal=causal,
                             block_m=block_m, block_n=block_n)
    want = attention_bwd_ref(dout, q, k, v, softmax_scale=0.3, causal=causal)
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        assert g.shape == w.shape, name
        np.testing.assert_allclose(g, w, rtol=1e-9, atol=1e-11, err_msg=name)


@pytest.mark.parametrize("block_m,block_n", BLOCKS)
@pytest.mark.parametrize("seqlen", [64, 130, 256])
def test_causal_square_tile_skipping(block_m, block_n, seqlen):
    rng = np.random.default_rng(9)
    q, k, v = _qkv(rng, 1, seqlen, seqlen, 1, 1, 8)
    dout = rng.standard_normal(q.shape)
    n_k = -(-seqlen // block_n)
    # On or below the diagonal: key block j starts at or before the last row of q block i.
    want_visited = {(i, j) for i in range(-(-seqlen // block_m)) for j in range(n_k)
                    if j * block_n <= min((i + 1) * block_m, seqlen) - 1}
    # Masked: the tile crosses the diagonal (a key past the block's first row) or seqlen.
    want_masked = {(i, j) for i, j in want_visited
                   if (j + 1) * block_n - 1 > i * block_m or (j + 1) * block_n > seqlen}
    _, _, visited, masked = fa2_forward_tiled(q, k, v, causal=True, block_m=block_m, block_n=block_n,
                                              return_visited=True)
    assert len(visited) == len(set(visited)) and set(visited) == want_visited
    assert set(masked) == want_masked
    out, lse = attention_ref(q, k, v, causal=True)
    *_, visited, masked = fa2_backward_tiled(dout, q, k, v, out, lse, causal=True, block_m=block_m,
                                             block_n=block_n, return_visited=True)
    assert len(visited) == len(set(visited)) and set(visited) == want_visited
    # The backward also masks a q block that runs past seqlen_q (cuda_src/bwd.cu does).
    assert set(masked) == want_masked | {(i, j) for i, j in want_visited if (i + 1) * block_m > seqlen}
    # Strictly below the diagonal most tiles run unmasked once the sequence spans a few blocks.
    if seqlen == 256 and block_m == block_n:
        assert len(want_visited - want_masked) > 0


# ----------------------------------------------------------------------------------------------
# NaN propagation and the mask having an effect
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("fn", [attention_ref, fa2_forward_tiled])
def test_nan_in_one_q_row(fn, causal):
    rng = np.random.default_rng(11)
    q, k, v = _qkv(rng, 2, 40, 40, 2, 1, 8)
    q[1, 25, 0, 3] = np.nan
    kwargs = {"block_m": 16, "block_n": 16} if fn is fa2_forward_tiled else {}
    out, lse = fn(q, k, v, causal=causal, **kwargs)
    assert np.isnan(out[1, 25, 0]).all() and np.isnan(lse[1, 0, 25])
    nan_out = np.zeros(out.shape, bool)
    nan_out[1, 25, 0] = True
    nan_lse = np.zeros(lse.shape, bool)
    nan_lse[1, 0, 25] = True
    assert np.isfinite(out[~nan_out]).all() and np.isfinite(lse[~nan_lse]).all()


@pytest.mark.parametrize("block_m,block_n", BLOCKS)
def test_causal_mask_is_applied(block_m, block_n):
    rng = np.random.default_rng(12)
    q, k, v = _qkv(rng, 2, 100, 100, 2, 2, 16)
    causal_out, _ = fa2_forward_tiled(q, k, v, causal=True, block_m=block_m, block_n=block_n)
    full_out, _ = fa2_forward_tiled(q, k, v, causal=False, block_m=block_m, block_n=block_n)
    # Row 0 sees only key 0, so its output is exactly v[0]; the last row sees every key.
    np.testing.assert_allclose(causal_out[:, 0], v[:, 0], rtol=RTOL)
    assert np.abs(causal_out[:, 0] - full_out[:, 0]).max() > 1e-3
    np.testing.assert_allclose(causal_out[:, -1], full_out[:, -1], rtol=RTOL)
    # Every row but the last differs somewhere.
    assert (np.abs(causal_out - full_out)[:, :-1].max(axis=(0, 2, 3)) > 1e-6).all()


def test_seqlen_k_tail_is_masked():
    # 65 keys with block_n 64: the second key block holds 1 real key. If the tail were not
    # masked (or padded keys leaked in), the result would not match the 65-key reference.
    rng = np.random.default_rng(13)
    q, k, v = _qkv(rng, 1, 8, 65, 1, 1, 8)
    out, lse = fa2_forward_tiled(q, k, v, block_m=16, block_n=64)
    want_out, want_lse = attention_ref(q, k, v)
    np.testing.assert_allclose(out, want_out, rtol=RTOL)
    np.testing.assert_allclose(lse, want_lse, rtol=RTOL)
    assert not np.allclose(out, attention_ref(q, k[:, :64], v[:, :64])[0])


# ----------------------------------------------------------------------------------------------
# Local (sliding-window) attention and the causal alignment
# ----------------------------------------------------------------------------------------------

ALIGNS = ["bottom_right", "top_left"]
WINDOWS = [(0, 0), (3, -1), (-1, 5), (17, 4), (64, 0), (2, 0), (5, 5)]
# (causal, window_size): every window without causal, and with causal where right is -1 or 0.
BANDS = ([(False, w) for w in WINDOWS] + [(True, w) for w in WINDOWS if w[1] in (-1, 0)]
         + [(True, (-1, -1)), (False, (-1, -1))])
BAND_SEQLENS = [(1, 1), (17, 17), (63, 65), (65, 63), (100, 130), (130, 100), (17, 100), (100, 17),
                (1, 130), (130, 1)]


def _band_case(*index):
    """A seeded batch / head layout (GQA included) / head dim and a block size for one case."""
    rng, batch, nheads, nheads_k, headdim = _random_case(list(index))
    block_m, block_n = BLOCKS[rng.integers(len(BLOCKS))]
    return rng, batch, nheads, nheads_k, headdim, block_m, block_n


def _band_ids(band):
    causal, (left, right) = band
    return f"{'causal' if causal else 'nocausal'}-w{left}_{right}"


@pytest.mark.parametrize("band", BANDS, ids=_band_ids)
@pytest.mark.parametrize("alignment", ALIGNS)
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(4, 4), (3, 6), (6, 3)])
def test_ref_band_matches_loop(band, alignment, seqlen_q, seqlen_k):
    causal, window = band
    rng = np.random.default_rng([14, seqlen_q, seqlen_k])
    q, k, v = _qkv(rng, 2, seqlen_q, seqlen_k, 4, 2, 3)
    out, lse = attention_ref(q, k, v, softmax_scale=0.7, causal=causal, window_size=window, alignment=alignment)
    want_out, want_lse = _loop_attention(q, k, v, 0.7, causal, window, alignment)
    np.testing.assert_allclose(out, want_out, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(lse, want_lse, rtol=RTOL, atol=ATOL)


def test_band_mask_examples():
    # Top-left: the diagonal starts at the top-left corner whatever the lengths.
    np.testing.assert_array_equal(causal_mask(2, 5, alignment="top_left"), [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0]])
    np.testing.assert_array_equal(causal_mask(4, 2, alignment="top_left"), [[1, 0], [1, 1], [1, 1], [1, 1]])
    np.testing.assert_array_equal(causal_mask(3, 4), causal_mask(3, 4, alignment="bottom_right"))
    # Square: the alignments agree.
    np.testing.assert_array_equal(causal_mask(5, 5, alignment="top_left"), causal_mask(5, 5))
    # window (1, 1) on a square: tridiagonal.
    tri = np.eye(5, dtype=bool) | np.eye(5, k=1, dtype=bool) | np.eye(5, k=-1, dtype=bool)
    np.testing.assert_array_equal(attention_mask(5, 5, window_size=(1, 1)), tri)
    # Bottom-right, offset 3: row 0 sees keys [2, 3], row 1 keys [3, 4].
    np.testing.assert_array_equal(attention_mask(2, 5, window_size=(1, 0)), [[0, 0, 1, 1, 0], [0, 0, 0, 1, 1]])
    np.testing.assert_array_equal(attention_mask(2, 5, window_size=(1, 0), alignment="top_left"),
                                  [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0]])
    # Causal plus a left bound; right=-1 with causal is right=0.
    np.testing.assert_array_equal(attention_mask(4, 4, causal=True, window_size=(1, -1)),
                                  np.eye(4, dtype=bool) | np.eye(4, k=-1, dtype=bool))
    np.testing.assert_array_equal(attention_mask(4, 4, causal=True, window_size=(1, 0)),
                                  attention_mask(4, 4, causal=True, window_size=(1, -1)))
    # No band: nothing masked.
    assert attention_mask(3, 7).all() and attention_mask(3, 7, alignment="top_left").all()
    # Against the per-element rule.
    for sq, sk, causal, window, align in itertools.product([1, 4, 9], [1, 5, 9], [False, True],
                                                           [(0, 0), (2, -1), (-1, 3), (3, 1)], ALIGNS):
        if causal and window[1] > 0:
            continue
        want = [[_sees(i, j, sq, sk, causal, window, align) for j in range(sk)] for i in range(sq)]
        np.testing.assert_array_equal(attention_mask(sq, sk, causal, window, align), want)


@pytest.mark.parametrize("band", BANDS, ids=_band_ids)
@pytest.mark.parametrize("alignment", ALIGNS)
@pytest.mark.parametrize("seqlen_q,seqlen_k", BAND_SEQLENS)
def test_fa2_band_forward_matches_ref(band, alignment, seqlen_q, seqlen_k):
    causal, window = band
    index = (BANDS.index(band), ALIGNS.index(alignment), seqlen_q, seqlen_k)
    rng, batch, nheads, nheads_k, headdim, block_m, block_n = _band_case(*index)
    q, k, v = _qkv(rng, batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim)
    kw = dict(causal=causal, window_size=window, alignment=alignment)
    out, lse = fa2_forward_tiled(q, k, v, block_m=block_m, block_n=block_n, **kw)
    want_out, want_lse = attention_ref(q, k, v, **kw)
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    np.testing.assert_allclose(out, want_out, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(lse, want_lse, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("band", BANDS, ids=_band_ids)
@pytest.mark.parametrize("alignment", ALIGNS)
@pytest.mark.parametrize("seqlen_q,seqlen_k", BAND_SEQLENS)
def test_fa2_band_backward_matches_ref(band, alignment, seqlen_q, seqlen_k):
    causal, window = band
    index = (BANDS.index(band), ALIGNS.index(alignment), seqlen_q, seqlen_k, 1)
    rng, batch, nheads, nheads_k, headdim, block_m, block_n = _band_case(*index)
    q, k, v = _qkv(rng, batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim)
    dout = rng.standard_normal(q.shape)
    kw = dict(softmax_scale=0.3, causal=causal, window_size=window, alignment=alignment)
    out, lse = attention_ref(q, k, v, **kw)
    got = fa2_backward_tiled(dout, q, k, v, out, lse, block_m=block_m, block_n=block_n, **kw)
    want = attention_bwd_ref(dout, q, k, v, **kw)
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        assert g.shape == w.shape and not np.isnan(g).any(), name
        np.testing.assert_allclose(g, w, rtol=1e-9, atol=1e-11, err_msg=name)


def _empty_rows(seqlen_q, seqlen_k, causal, window, alignment):
    return np.array([not any(_sees(i, j, seqlen_q, seqlen_k, causal, window, alignment) for j in range(seqlen_k))
                     for i in range(seqlen_q)])


@pytest.mark.parametrize("block_m,block_n", [(16, 16), (64, 32)])
@pytest.mark.parametrize("causal,window,alignment,n_empty", [
    (False, (2, 0), "top_left", 68),  # row i sees [i - 2, i]: rows 22.. see past key 19
    (True, (2, -1), "top_left", 68),  # the same band through causal
    (False, (0, 0), "top_left", 70),  # row i sees key i only
    (False, (3, 2), "bottom_right", 68),  # offset -70: rows ..67 end left of key 0
    (True, (5, 0), "bottom_right", 70),
    (True, (-1, -1), "bottom_right", 70),  # plain causal, seqlen_q > seqlen_k: whole q blocks see nothing
])
def test_band_rows_without_keys(block_m, block_n, causal, window, alignment, n_empty):
    seqlen_q, seqlen_k = 90, 20
    rng = np.random.default_rng(15)
    q, k, v = _qkv(rng, 2, seqlen_q, seqlen_k, 4, 2, 16)
    dout = rng.standard_normal(q.shape)
    kw = dict(causal=causal, window_size=window, alignment=alignment)
    empty = _empty_rows(seqlen_q, seqlen_k, causal, window, alignment)
    assert empty.sum() == n_empty
    ref = attention_ref(q, k, v, **kw)
    for out, lse in (ref, fa2_forward_tiled(q, k, v, block_m=block_m, block_n=block_n, **kw)):
        assert not np.isnan(out).any() and not np.isnan(lse).any()
        np.testing.assert_array_equal(out[:, empty], 0.0)
        assert np.all(lse[:, :, empty] == -np.inf)
        assert np.all(np.isfinite(lse[:, :, ~empty]))
        np.testing.assert_allclose(out, ref[0], rtol=RTOL, atol=ATOL)
    # dout in the empty rows must reach no gradient.
    dout2 = dout.copy()
    dout2[:, empty] = rng.standard_normal(dout2[:, empty].shape)
    want = attention_bwd_ref(dout2, q, k, v, **kw)
    for grads in (attention_bwd_ref(dout, q, k, v, **kw),
                  fa2_backward_tiled(dout, q, k, v, *ref, block_m=block_m, block_n=block_n, **kw)):
        assert not any(np.isnan(g).any() for g in grads)
        np.testing.assert_array_equal(grads[0][:, empty], 0.0)
        for g, w in zip(grads, want):
            np.testing.assert_allclose(g, w, rtol=1e-9, atol=1e-11)


def test_band_schedule_skips_and_visits_empty_tiles():
    # top_left, window (2, 0), 90 x 20, blocks 16 x 16: q block 2 (rows 32..47, keys from 30 on)
    # still visits key block 1 (keys 16..19, key_begin // block_n), whose every slot is masked;
    # q blocks 3.. (key_begin >= 32) visit nothing at all and keep output 0, LSE -inf.
    rng = np.random.default_rng(16)
    q, k, v = _qkv(rng, 1, 90, 20, 1, 1, 8)
    kw = dict(window_size=(2, 0), alignment="top_left", block_m=16, block_n=16)
    out, lse, visited, masked = fa2_forward_tiled(q, k, v, return_visited=True, **kw)
    # q block 0 reaches key 15 at most; q block 1 keys 14..19 (block 1 first, walking down).
    assert visited == [(0, 0), (1, 1), (1, 0), (2, 1)]
    assert masked == visited  # every tile straddles the band or seqlen_k
    assert not np.isnan(out).any() and np.all(lse[:, :, 22:] == -np.inf)
    *_, visited, masked = fa2_backward_tiled(rng.standard_normal(q.shape), q, k, v, out, lse,
                                             return_visited=True, **kw)
    # Key block 1's last row of interest is key_last - offset + left = 31 + 2: q blocks 1 and 2.
    assert visited == [(0, 0), (1, 0), (1, 1), (2, 1)]


def _grid_mask(seqlen_q, seqlen_k, causal, window, alignment, block_m, block_n):
    """The band on every slot of the tile grid (rows and keys past the lengths included),
    vectorised from _sees's rule; returns (band, row_ok, key_ok) of shape (n_q*block_m, n_k*block_n)."""
    n_q, n_k = -(-seqlen_q // block_m), -(-seqlen_k // block_n)
    i = np.arange(n_q * block_m)[:, None]
    j = np.arange(n_k * block_n)[None, :]
    offset = seqlen_k - seqlen_q if alignment == "bottom_right" else 0
    left, right = window
    right = 0 if causal else right
    band = np.ones((i.size, j.size), bool)
    if left != -1:
        band &= j >= i + offset - left
    if right != -1:
        band &= j <= i + offset + right
    return band, np.broadcast_to(i < seqlen_q, band.shape), np.broadcast_to(j < seqlen_k, band.shape)


def _tiles(mask, block_m, block_n):
    """(n_q, block_m, n_k, block_n) view of a grid mask -> per-tile any, all."""
    t = mask.reshape(mask.shape[0] // block_m, block_m, mask.shape[1] // block_n, block_n)
    return t.any(axis=(1, 3)), t.all(axis=(1, 3))


def _pairs(tile_mask):
    return {(int(a), int(b)) for a, b in zip(*np.nonzero(tile_mask))}


@pytest.mark.parametrize("band", BANDS, ids=_band_ids)
@pytest.mark.parametrize("alignment", ALIGNS)
@pytest.mark.parametrize("seqlen_q,seqlen_k", BAND_SEQLENS + [(300, 40), (40, 300), (64, 64), (128, 200)])
def test_band_tile_schedule_brute_force(band, alignment, seqlen_q, seqlen_k):
    causal, window = band
    rng = np.random.default_rng(17)
    q, k, v = _qkv(rng, 1, seqlen_q, seqlen_k, 1, 1, 4)
    dout = rng.standard_normal(q.shape)
    kw = dict(causal=causal, window_size=window, alignment=alignment)
    out, lse = attention_ref(q, k, v, **kw)
    for block_m, block_n in BLOCKS:
        grid, row_ok, key_ok = _grid_mask(seqlen_q, seqlen_k, causal, window, alignment, block_m, block_n)
        real = grid & row_ok & key_ok  # the (row, key) pairs the attention uses
        real_any, _ = _tiles(real, block_m, block_n)
        _, real_all = _tiles(real | ~row_ok, block_m, block_n)  # rows past seqlen_q constrain nothing
        needed = _pairs(real_any)  # tiles with a pair the attention uses
        cut = _pairs(~real_all)  # tiles with a real row that must not see a key slot of the tile
        # The kernels' rule, exactly: a tile is visited iff the band (extended to every slot of the
        # tile, rows past seqlen_q and keys past seqlen_k included) meets it; the forward masks a
        # visited tile iff one of its slots is outside the band or past seqlen_k, the backward also
        # iff it has rows past seqlen_q.
        grid_any, _ = _tiles(grid, block_m, block_n)
        _, fwd_all = _tiles(grid & key_ok, block_m, block_n)
        _, bwd_all = _tiles(grid & key_ok & row_ok, block_m, block_n)
        want_visited = _pairs(grid_any)
        want_fwd_masked = want_visited & _pairs(~fwd_all)
        want_bwd_masked = want_visited & _pairs(~bwd_all)

        _, _, visited, masked = fa2_forward_tiled(q, k, v, block_m=block_m, block_n=block_n,
                                                  return_visited=True, **kw)
        assert len(visited) == len(set(visited)) and set(visited) == want_visited
        assert set(masked) == want_fwd_masked and len(masked) == len(set(masked))
        # Each q block walks a contiguous range of key blocks downwards.
        for i in {i for i, _ in visited}:
            js = [j for ii, j in visited if ii == i]
            assert js == list(range(js[0], js[-1] - 1, -1))
        # Safety: every tile the attention needs is visited, and every visited tile holding a
        # pair it must not use is masked.
        assert needed <= set(visited) and (set(visited) & cut) <= set(masked)

        *_, visited, masked = fa2_backward_tiled(dout, q, k, v, out, lse, block_m=block_m, block_n=block_n,
                                                 return_visited=True, **kw)
        assert len(visited) == len(set(visited)) and set(visited) == want_visited
        assert set(masked) == want_bwd_masked
        # Key blocks in ascending order, each over a contiguous ascending range of q blocks.
        js = [j for _, j in visited]
        assert js == sorted(js)
        for j in set(js):
            ms = [m for m, jj in visited if jj == j]
            assert ms == list(range(ms[0], ms[-1] + 1))
        assert needed <= set(visited) and (set(visited) & cut) <= set(masked)

        if alignment == "bottom_right":
            # With the bottom-right alignment the last real row already reaches seqlen_k - 1 and the
            # last real key row seqlen_q - 1, so the padded slots add nothing: visited tiles are
            # exactly those the attention needs.
            assert want_visited == needed
            if seqlen_q % block_m == 0:
                assert want_fwd_masked == needed & cut


@pytest.mark.parametrize("seqlen_q,seqlen_k,causal,window,alignment", [
    (5, 6, False, (1, 1), "bottom_right"),
    (5, 6, False, (1, 1), "top_left"),
    (6, 4, True, (1, -1), "top_left"),
    (6, 3, False, (0, 0), "top_left"),  # rows 3.. see no key; the rest see one: dq = dk = 0
    (6, 3, False, (1, 0), "top_left"),  # rows 4.. see no key
    (4, 6, True, (2, 0), "bottom_right"),
    (6, 4, False, (2, 1), "bottom_right"),  # row 0 sees no key
    (5, 5, False, (-1, 1), "bottom_right"),
])
def test_bwd_ref_band_finite_differences(seqlen_q, seqlen_k, causal, window, alignment):
    rng = np.random.default_rng([18, seqlen_q, seqlen_k])
    q, k, v = _qkv(rng, 1, seqlen_q, seqlen_k, 2, 1, 4)
    dout = rng.standard_normal(q.shape)
    kw = dict(softmax_scale=0.8, causal=causal, window_size=window, alignment=alignment)

    _check_against_finite_differences(dout, q, k, v, kw)


def test_window_changes_the_result():
    rng = np.random.default_rng(19)
    q, k, v = _qkv(rng, 2, 100, 100, 2, 1, 16)
    full_out, full_lse = attention_ref(q, k, v)
    for fn, extra in ((attention_ref, {}), (fa2_forward_tiled, {"block_m": 32, "block_n": 16})):
        local_out, local_lse = fn(q, k, v, window_size=(3, 3), **extra)
        # Every row sees at most 7 of the 100 keys: every row's output and LSE differ.
        assert (np.abs(local_out - full_out).max(axis=(0, 2, 3)) > 1e-3).all()
        assert (np.abs(local_lse - full_lse).min() > 1e-6)
        # window (0, 0) on a square: row i sees key i only, so its output is v[i].
        diag_out, _ = fn(q, k, v, window_size=(0, 0), **extra)
        np.testing.assert_allclose(diag_out, np.repeat(v, 2, axis=2), rtol=RTOL, atol=ATOL)
    # The alignment matters once seqlen_q != seqlen_k, for causal and for a window.
    q2 = q[:, :40]
    for kw in (dict(causal=True), dict(window_size=(4, 4))):
        br = attention_ref(q2, k, v, alignment="bottom_right", **kw)[0]
        tl = attention_ref(q2, k, v, alignment="top_left", **kw)[0]
        assert np.abs(br - tl).max() > 1e-3
        np.testing.assert_allclose(fa2_forward_tiled(q2, k, v, alignment="top_left", block_m=16, block_n=32,
                                                     **kw)[0], tl, rtol=RTOL, atol=ATOL)


def test_unbounded_windows_change_nothing():
    rng = np.random.default_rng(20)
    q, k, v = _qkv(rng, 1, 40, 70, 2, 2, 8)
    dout = rng.standard_normal(q.shape)
    full, causal = attention_ref(q, k, v), attention_ref(q, k, v, causal=True)
    for align in ALIGNS:
        for got, want in ((attention_ref(q, k, v, window_size=(-1, -1), alignment=align), full),
                          (attention_ref(q, k, v, window_size=(200, 200), alignment=align), full),
                          (fa2_forward_tiled(q, k, v, window_size=(110, 110), alignment=align), full)):
            np.testing.assert_allclose(got[0], want[0], rtol=RTOL, atol=ATOL)
            np.testing.assert_allclose(got[1], want[1], rtol=RTOL, atol=ATOL)
    for window in ((-1, 0), (-1, -1), (500, 0)):
        got = attention_ref(q, k, v, causal=True, window_size=window)
        np.testing.assert_array_equal(got[0], causal[0])
        np.testing.assert_array_equal(got[1], causal[1])
    # Square: the alignment makes no difference.
    qs, ks, vs = q, k[:, :40], v[:, :40]
    for kw in (dict(causal=True), dict(window_size=(3, 5)), dict(causal=True, window_size=(7, 0))):
        np.testing.assert_array_equal(attention_ref(qs, ks, vs, alignment="top_left", **kw)[0],
                                      attention_ref(qs, ks, vs, **kw)[0])
        np.testing.assert_array_equal(attention_bwd_ref(dout, qs, ks, vs, alignment="top_left", **kw)[1],
                                      attention_bwd_ref(dout, qs, ks, vs, **kw)[1])


BAD_WINDOWS = [(1,), (1, 2, 3), 5, None, "ab", (-2, 0), (0, -3), (1.5, 0), (1.0, 2), ("1", 2), (True, 0)]
BAD_ALIGNMENTS = ["bottom-right", "center", "", None, 0, "TOP_LEFT"]


def _band_calls():
    """Each public function that takes the band options, as f(**band_kwargs)."""
    rng = np.random.default_rng(21)
    q, k, v = _qkv(rng, 1, 6, 5, 2, 1, 4)
    dout = rng.standard_normal(q.shape)
    out, lse = attention_ref(q, k, v)
    return {
        "attention_ref": lambda **kw: attention_ref(q, k, v, **kw),
        "attention_bwd_ref": lambda **kw: attention_bwd_ref(dout, q, k, v, **kw),
        "fa2_forward_tiled": lambda **kw: fa2_forward_tiled(q, k, v, block_m=16, block_n=16, **kw),
        "fa2_backward_tiled": lambda **kw: fa2_backward_tiled(dout, q, k, v, out, lse, block_m=16, block_n=16,
                                                              **kw),
        "attention_mask": lambda **kw: attention_mask(6, 5, **kw),
    }


@pytest.mark.parametrize("name", list(_band_calls()))
def test_band_validation(name):
    call = _band_calls()[name]
    for window in BAD_WINDOWS:
        with pytest.raises(ValueError, match="window_size"):
            call(window_size=window)
    for alignment in BAD_ALIGNMENTS:
        with pytest.raises(ValueError, match="alignment"):
            call(alignment=alignment)
    # causal means right = 0: a window reaching further right is a contradiction.
    for window in ((3, 1), (-1, 2)):
        with pytest.raises(ValueError, match="window_size"):
            call(causal=True, window_size=window)
    # Accepted: -1 or 0 on the right with causal, lists, NumPy ints, both alignments.
    for kw in (dict(causal=True, window_size=(3, 0)), dict(causal=True, window_size=[3, -1]),
               dict(window_size=(np.int64(2), np.int32(1))), dict(alignment="top_left"),
               dict(window_size=(0, 0), alignment="bottom_right")):
        call(**kw)


def test_causal_mask_alignment_validation():
    with pytest.raises(ValueError, match="alignment"):
        causal_mask(3, 4, alignment="topleft")
    with pytest.raises(ValueError, match="alignment"):
        causal_mask(3, 4, "bottom")


# ----------------------------------------------------------------------------------------------
# Softcap, ALiBi and attention sinks
# ----------------------------------------------------------------------------------------------

MODS = ["softcap", "alibi", "alibi_batch", "sinks", "all"]
# (causal, window_size) for the option tests: none, causal, a window, causal with a window.
MOD_BANDS = [(False, (-1, -1)), (True, (-1, -1)), (False, (17, 4)), (True, (5, 0))]


def _mod_kwargs(rng, name, batch, nheads):
    """attention_ref's softcap / alibi_slopes / sinks for one MODS entry; "all" has every one,
    ALiBi per batch."""
    kw = {}
    if name in ("softcap", "all"):
        kw["softcap"] = 1.5  # below the typical scaled score: the cap bends most of them
    if name == "alibi":
        kw["alibi_slopes"] = rng.uniform(0.05, 0.5, nheads)
    if name in ("alibi_batch", "all"):
        kw["alibi_slopes"] = rng.uniform(0.05, 0.5, (batch, nheads))
    if name in ("sinks", "all"):
        kw["sinks"] = rng.standard_normal(nheads) + 1.0
    return kw


def _loop_kwargs(kw, batch, nheads):
    """_loop_attention's arguments for attention_ref keyword arguments."""
    alibi = kw.get("alibi_slopes")
    return dict(softcap=kw.get("softcap", 0.0), sinks=kw.get("sinks"),
                alibi=None if alibi is None else np.broadcast_to(alibi, (batch, nheads)))


def _band_kw(band, alignment):
    causal, window = band
    return dict(causal=causal, window_size=window, alignment=alignment)


@pytest.mark.parametrize("mods", MODS)
@pytest.mark.parametrize("band", MOD_BANDS[:2] + [(False, (1, 2)), (True, (2, 0))], ids=_band_ids)
@pytest.mark.parametrize("alignment", ALIGNS)
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(4, 4), (3, 6), (6, 3)])
def test_ref_mods_match_loop(mods, band, alignment, seqlen_q, seqlen_k):
    rng = np.random.default_rng([22, MODS.index(mods), seqlen_q, seqlen_k])
    q, k, v = _qkv(rng, 2, seqlen_q, seqlen_k, 4, 2, 3)
    kw = dict(_band_kw(band, alignment), **_mod_kwargs(rng, mods, 2, 4))
    out, lse = attention_ref(q, k, v, softmax_scale=0.7, **kw)
    want_out, want_lse = _loop_attention(q, k, v, 0.7, band[0], band[1], alignment, **_loop_kwargs(kw, 2, 4))
    np.testing.assert_allclose(out, want_out, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(lse, want_lse, rtol=RTOL, atol=ATOL)
    # Each option moves the result off plain attention.
    assert np.abs(out - attention_ref(q, k, v, softmax_scale=0.7, **_band_kw(band, alignment))[0]).max() > 1e-3


@pytest.mark.parametrize("mods", MODS)
@pytest.mark.parametrize("band", MOD_BANDS, ids=_band_ids)
@pytest.mark.parametrize("alignment", ALIGNS)
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(63, 65), (65, 63), (17, 100), (100, 17), (1, 130)])
def test_fa2_mods_match_ref(mods, band, alignment, seqlen_q, seqlen_k):
    index = (23, MODS.index(mods), MOD_BANDS.index(band), ALIGNS.index(alignment), seqlen_q, seqlen_k)
    rng, batch, nheads, nheads_k, headdim, block_m, block_n = _band_case(*index)
    q, k, v = _qkv(rng, batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim)
    dout = rng.standard_normal(q.shape)
    kw = dict(_band_kw(band, alignment), softmax_scale=0.5, **_mod_kwargs(rng, mods, batch, nheads))
    out, lse = attention_ref(q, k, v, **kw)
    got_out, got_lse = fa2_forward_tiled(q, k, v, block_m=block_m, block_n=block_n, **kw)
    assert not np.isnan(got_out).any() and not np.isnan(got_lse).any()
    np.testing.assert_allclose(got_out, out, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(got_lse, lse, rtol=RTOL, atol=ATOL)
    want = attention_bwd_ref(dout, q, k, v, **kw)
    got = fa2_backward_tiled(dout, q, k, v, out, lse, block_m=block_m, block_n=block_n, **kw)
    assert len(got) == len(want) == (4 if "sinks" in kw else 3)
    for name, g, w in zip(("dq", "dk", "dv", "dsinks"), got, want):
        assert g.shape == w.shape and not np.isnan(g).any(), name
        np.testing.assert_allclose(g, w, rtol=1e-9, atol=1e-11, err_msg=name)


@pytest.mark.parametrize("mods", MODS)
@pytest.mark.parametrize("seqlen_q,seqlen_k,causal,window,alignment", [
    (4, 4, False, (-1, -1), "bottom_right"),
    (3, 5, True, (-1, -1), "bottom_right"),
    (5, 3, True, (-1, -1), "bottom_right"),  # rows 0, 1 see no key
    (6, 4, False, (2, 1), "bottom_right"),  # row 0 sees no key
    (5, 6, False, (1, 1), "top_left"),
    (6, 3, True, (1, -1), "top_left"),
])
def test_bwd_ref_mods_finite_differences(mods, seqlen_q, seqlen_k, causal, window, alignment):
    rng = np.random.default_rng([24, MODS.index(mods), seqlen_q, seqlen_k])
    q, k, v = _qkv(rng, 2, seqlen_q, seqlen_k, 2, 1, 4)
    dout = rng.standard_normal(q.shape)
    kw = dict(softmax_scale=0.8, causal=causal, window_size=window, alignment=alignment,
              **_mod_kwargs(rng, mods, 2, 2))

    _check_against_finite_differences(dout, q, k, v, kw)


def test_softcap_bounds_scores_and_vanishes_when_large():
    rng = np.random.default_rng(25)
    q, k, v = _qkv(rng, 2, 30, 40, 4, 2, 16)
    q *= 10  # scaled scores of tens: far past the caps below
    dout = rng.standard_normal(q.shape)
    plain_out, plain_lse = attention_ref(q, k, v)
    plain_grads = attention_bwd_ref(dout, q, k, v)
    for fn, extra in ((attention_ref, {}), (fa2_forward_tiled, {"block_m": 16, "block_n": 16})):
        out, lse = fn(q, k, v, softcap=2.0, **extra)
        # Every capped score is below softcap, so lse < softcap + log(seqlen_k); the plain one is not.
        assert lse.max() < 2.0 + math.log(40) < plain_lse.max()
        assert np.abs(out - plain_out).max() > 1e-2
        # softcap * tanh(s / softcap) = s - s^3 / (3 softcap^2) + ...: the gap shrinks as 1 / softcap^2.
        errors = [np.abs(fn(q, k, v, softcap=cap, **extra)[0] - plain_out).max() for cap in (1e2, 1e3, 1e4)]
        assert errors[0] > 1e-5 and errors[1] < errors[0] / 50 and errors[2] < errors[1] / 50
    grads = attention_bwd_ref(dout, q, k, v, softcap=1e6)
    for g, want in zip(grads, plain_grads):
        np.testing.assert_allclose(g, want, rtol=1e-6, atol=1e-6)
    assert np.abs(attention_bwd_ref(dout, q, k, v, softcap=2.0)[0] - plain_grads[0]).max() > 1e-2


@pytest.mark.parametrize("alignment", ALIGNS)
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(6, 9), (9, 6)])
def test_alibi_zero_is_plain_and_steep_picks_the_diagonal(alignment, seqlen_q, seqlen_k):
    rng = np.random.default_rng(26)
    q, k, v = _qkv(rng, 2, seqlen_q, seqlen_k, 4, 2, 8)
    plain = attention_ref(q, k, v, alignment=alignment)
    # Batch 0 has zero slopes; batch 1 a steep slope on query heads 1 and 3 (kv heads 0 and 1),
    # zero on heads 0 and 2.
    slopes = np.array([[0.0, 0.0, 0.0, 0.0], [0.0, 60.0, 0.0, 60.0]])
    offset = seqlen_k - seqlen_q if alignment == "bottom_right" else 0
    # With slope 60 row i all but only sees the key nearest to i + offset.
    nearest = np.clip(np.arange(seqlen_q) + offset, 0, seqlen_k - 1)
    for fn, extra in ((attention_ref, {}), (fa2_forward_tiled, {"block_m": 16, "block_n": 16})):
        out, lse = fn(q, k, v, alignment=alignment, alibi_slopes=slopes, **extra)
        np.testing.assert_allclose(out[0], plain[0][0], rtol=RTOL, atol=ATOL)
        np.testing.assert_allclose(out[1, :, ::2], plain[0][1, :, ::2], rtol=RTOL, atol=ATOL)
        np.testing.assert_allclose(out[1, :, 1::2], v[1, nearest], rtol=0, atol=1e-10)
        zero_out, zero_lse = fn(q, k, v, alignment=alignment, alibi_slopes=np.zeros(4), **extra)
        np.testing.assert_allclose(zero_out, plain[0], rtol=RTOL, atol=ATOL)
        np.testing.assert_allclose(zero_lse, plain[1], rtol=RTOL, atol=ATOL)


def test_sinks_scale_plain_attention():
    # 90 x 20 causal: rows 0..69 see no key, and with 16 x 16 blocks whole q blocks visit no tile.
    rng = np.random.default_rng(27)
    q, k, v = _qkv(rng, 2, 90, 20, 4, 2, 16)
    dout = rng.standard_normal(q.shape)
    empty = np.arange(90) < 70
    sinks = np.array([-1.0, 0.0, 0.5, 2.0])
    plain_out, plain_lse = attention_ref(q, k, v, causal=True)
    plain_grads = attention_bwd_ref(dout, q, k, v, causal=True)
    for fn, extra in ((attention_ref, {}), (fa2_forward_tiled, {"block_m": 16, "block_n": 16})):
        out, lse = fn(q, k, v, causal=True, sinks=sinks, **extra)
        # The sink only adds exp(sink) to the denominator: lse = logaddexp(lse_plain, sink) and
        # out = out_plain * exp(lse_plain - lse); rows with no key give out 0, lse = sink.
        want_lse = np.logaddexp(plain_lse, sinks[None, :, None])
        np.testing.assert_allclose(lse, want_lse, rtol=RTOL, atol=ATOL)
        assert np.all(lse[:, :, empty] == sinks[None, :, None])
        np.testing.assert_allclose(out, plain_out * np.exp(plain_lse - lse).transpose(0, 2, 1)[..., None],
                                   rtol=RTOL, atol=ATOL)
        np.testing.assert_array_equal(out[:, empty], 0.0)
        # A very negative sink is no sink, save for the LSE of rows with no key.
        out, lse = fn(q, k, v, causal=True, sinks=np.full(4, -1e30), **extra)
        np.testing.assert_allclose(out, plain_out, rtol=RTOL, atol=ATOL)
        np.testing.assert_allclose(lse[:, :, ~empty], plain_lse[:, :, ~empty], rtol=RTOL, atol=ATOL)
        assert np.all(lse[:, :, empty] == -1e30)
    out, lse = attention_ref(q, k, v, causal=True, sinks=sinks)
    for grads in (attention_bwd_ref(dout, q, k, v, causal=True, sinks=sinks),
                  fa2_backward_tiled(dout, q, k, v, out, lse, causal=True, sinks=sinks, block_m=16, block_n=16)):
        np.testing.assert_array_equal(grads[0][:, empty], 0.0)
        assert np.abs(grads[1] - plain_grads[1]).max() > 1e-3  # the sink takes probability mass
        # dsinks[h] = -sum exp(sink - lse) D, with D = rowsum(dout * out).
        delta = np.sum(dout * out, axis=-1).transpose(0, 2, 1)
        np.testing.assert_allclose(grads[3], -np.sum(np.exp(sinks[None, :, None] - lse) * delta, axis=(0, 2)),
                                   rtol=RTOL, atol=ATOL)
    grads = attention_bwd_ref(dout, q, k, v, causal=True, sinks=np.full(4, -1e30))
    for g, want in zip(grads, plain_grads):
        np.testing.assert_allclose(g, want, rtol=RTOL, atol=ATOL)
    np.testing.assert_array_equal(grads[3], 0.0)


def test_sink_above_every_score():
    # top_left, 300 x 20, steep ALiBi: row i's best score is about -5 (i - 19), so from row ~160 on
    # exp(sink - row max) overflows float64; the tiled epilogue must rescale to the sink instead.
    rng = np.random.default_rng(31)
    q, k, v = _qkv(rng, 1, 300, 20, 2, 1, 8)
    dout = rng.standard_normal(q.shape)
    kw = dict(alignment="top_left", alibi_slopes=np.array([5.0, 0.05]), sinks=np.array([0.5, -0.3]))
    out, lse = attention_ref(q, k, v, **kw)
    got_out, got_lse = fa2_forward_tiled(q, k, v, block_m=64, block_n=16, **kw)
    assert np.isfinite(got_out).all() and np.isfinite(got_lse).all()
    np.testing.assert_allclose(got_out, out, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(got_lse, lse, rtol=RTOL, atol=ATOL)
    # There the sink takes all the mass: lse is the sink, out all but 0.
    assert np.all(lse[0, 0, 200:] == 0.5) and np.abs(out[0, 200:, 0]).max() < 1e-300
    got = fa2_backward_tiled(dout, q, k, v, out, lse, block_m=64, block_n=16, **kw)
    for name, g, w in zip(("dq", "dk", "dv", "dsinks"), got, attention_bwd_ref(dout, q, k, v, **kw)):
        np.testing.assert_allclose(g, w, rtol=1e-9, atol=1e-11, err_msg=name)


@pytest.mark.parametrize("name", [n for n in _band_calls() if n != "attention_mask"])
def test_mods_validation(name):
    call = _band_calls()[name]  # batch 1, 2 heads
    for softcap in (-1.0, -1e-9, math.inf, math.nan, None, "1", True):
        with pytest.raises(ValueError, match="softcap"):
            call(softcap=softcap)
    for slopes in (np.zeros(3), np.zeros((2, 2)), np.zeros((1, 3)), np.zeros((2, 1)), np.zeros(())):
        with pytest.raises(ValueError, match="alibi_slopes"):
            call(alibi_slopes=slopes)
    for sinks in (np.zeros(3), np.zeros((1, 2)), np.zeros(()), np.array([0.0, -np.inf]), np.array([np.nan, 0.0])):
        with pytest.raises(ValueError, match="sinks"):
            call(sinks=sinks)
    # Accepted: softcap 0 (off), ints and NumPy scalars, slopes (nheads,) or (batch, nheads), lists.
    for kw in (dict(softcap=0), dict(softcap=np.float32(2.5)), dict(softcap=3), dict(alibi_slopes=[0.1, 0.2]),
               dict(alibi_slopes=np.ones((1, 2))), dict(sinks=[0.0, -1.0])):
        call(**kw)


# ----------------------------------------------------------------------------------------------
# Variable-length (packed) batches
# ----------------------------------------------------------------------------------------------

# Sequence 1 has no query, sequence 2 no key; lengths cross no tile size.
VARLEN_Q = [5, 0, 17, 3, 40]
VARLEN_K = [7, 4, 0, 20, 33]


def _cu(lengths):
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


@pytest.mark.parametrize("mods", ["none", "all"])
@pytest.mark.parametrize("band", MOD_BANDS, ids=_band_ids)
@pytest.mark.parametrize("alignment", ALIGNS)
def test_varlen_matches_each_sequence(mods, band, alignment):
    rng = np.random.default_rng([28, MOD_BANDS.index(band)])
    nheads, nheads_k, headdim, batch = 4, 2, 4, len(VARLEN_Q)
    cu_q, cu_k = _cu(VARLEN_Q), _cu(VARLEN_K)
    q = rng.standard_normal((cu_q[-1], nheads, headdim))
    k, v = (rng.standard_normal((cu_k[-1], nheads_k, headdim)) for _ in range(2))
    dout = rng.standard_normal(q.shape)
    kw = dict(_band_kw(band, alignment), softmax_scale=0.6)
    if mods == "all":
        kw.update(_mod_kwargs(rng, mods, batch, nheads))
    out, lse = attention_varlen_ref(q, k, v, cu_q, cu_k, **kw)
    grads = attention_varlen_bwd_ref(dout, q, k, v, cu_q, cu_k, **kw)
    assert out.shape == q.shape and lse.shape == (nheads, cu_q[-1])
    assert len(grads) == (4 if mods == "all" else 3)
    dsinks = np.zeros(nheads)
    for b in range(batch):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        # Each sequence alone, as a batch of one with its own lengths (its own offset) and slopes row.
        seq_kw = dict(kw, alibi_slopes=None if "alibi_slopes" not in kw else kw["alibi_slopes"][b])
        want_out, want_lse = _loop_attention(q[None, rows], k[None, keys], v[None, keys], 0.6, band[0], band[1],
                                             alignment, **_loop_kwargs(seq_kw, 1, nheads))
        np.testing.assert_allclose(out[rows], want_out[0], rtol=RTOL, atol=ATOL)
        np.testing.assert_allclose(lse[:, rows], want_lse[0], rtol=RTOL, atol=ATOL)
        want = attention_bwd_ref(dout[None, rows], q[None, rows], k[None, keys], v[None, keys], **seq_kw)
        for name, g, w in zip(("dq", "dk", "dv"), grads, want):
            np.testing.assert_allclose(g[rows if name == "dq" else keys], w[0], rtol=RTOL, atol=ATOL, err_msg=name)
        if mods == "all":
            dsinks += want[3]
    if mods == "all":
        np.testing.assert_allclose(grads[3], dsinks, rtol=RTOL, atol=ATOL)
    # The keys of the sequence without queries get no gradient; the queries without keys output 0,
    # LSE sink (-inf without sinks).
    assert not np.any(grads[1][cu_k[1]:cu_k[2]]) and not np.any(grads[2][cu_k[1]:cu_k[2]])
    assert not np.any(out[cu_q[2]:cu_q[3]])
    empty_lse = kw["sinks"][:, None] if mods == "all" else -np.inf
    assert np.all(lse[:, cu_q[2]:cu_q[3]] == empty_lse)


def test_varlen_equal_lengths_is_the_padded_batch():
    rng = np.random.default_rng(29)
    batch, seqlen_q, seqlen_k, nheads = 3, 19, 11, 4
    q, k, v = _qkv(rng, batch, seqlen_q, seqlen_k, nheads, 2, 8)
    dout = rng.standard_normal(q.shape)
    kw = dict(causal=True, window_size=(6, 0), softcap=2.0, alibi_slopes=rng.uniform(0.1, 1, (batch, nheads)),
              sinks=rng.standard_normal(nheads))
    out, lse = attention_ref(q, k, v, **kw)
    grads = attention_bwd_ref(dout, q, k, v, **kw)
    cu_q, cu_k = _cu([seqlen_q] * batch), _cu([seqlen_k] * batch)
    packed = [x.reshape(-1, *x.shape[2:]) for x in (dout, q, k, v)]
    got_out, got_lse = attention_varlen_ref(*packed[1:], cu_q, cu_k, **kw)
    np.testing.assert_allclose(got_out, out.reshape(-1, nheads, 8), rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(got_lse, lse.transpose(1, 0, 2).reshape(nheads, -1), rtol=RTOL, atol=ATOL)
    got = attention_varlen_bwd_ref(*packed, cu_q, cu_k, **kw)
    for name, g, w in zip(("dq", "dk", "dv"), got, grads):
        np.testing.assert_allclose(g, w.reshape(g.shape), rtol=RTOL, atol=ATOL, err_msg=name)
    np.testing.assert_allclose(got[3], grads[3], rtol=RTOL, atol=ATOL)


def test_varlen_validation():
    rng = np.random.default_rng(30)
    q, k, v = (rng.standard_normal((n, 2, 4)) for n in (8, 6, 6))
    dout = rng.standard_normal(q.shape)
    good_q, good_k = np.array([0, 3, 8], np.int32), np.array([0, 6, 6], np.int32)
    bad = [np.array([1, 3, 8]), np.array([0, 5, 3, 8]), np.array([0, 3, 7]), np.array([0, 3, 9]),
           np.array([0.0, 3.0, 8.0]), np.array([[0, 3, 8]]), np.array([0]), np.array([0, 8], bool)]
    for fn in (lambda cq, ck, **kw: attention_varlen_ref(q, k, v, cq, ck, **kw),
               lambda cq, ck, **kw: attention_varlen_bwd_ref(dout, q, k, v, cq, ck, **kw)):
        fn(good_q, good_k)
        for cu in bad:
            with pytest.raises(ValueError, match="cu_seqlens_q"):
                fn(cu, good_k)
        with pytest.raises(ValueError, match="cu_seqlens_k"):
            fn(good_q, np.array([0, 6, 5], np.int32))
        with pytest.raises(ValueError, match="cu_seqlens"):
            fn(good_q, np.array([0, 6], np.int32))  # 2 sequences of q, 1 of k
        with pytest.raises(ValueError, match="alibi_slopes"):
            fn(good_q, good_k, alibi_slopes=np.zeros((3, 2)))  # batch is 2
        with pytest.raises(ValueError, match="sinks"):
            fn(good_q, good_k, sinks=np.zeros(3))
    with pytest.raises(ValueError, match="3-D"):
        attention_varlen_ref(q[None], k, v, good_q, good_k)


# ----------------------------------------------------------------------------------------------
# attention_flops
# ----------------------------------------------------------------------------------------------


def test_attention_flops():
    # 4 * 1024 * 1024 * 64 * 8 * 2 = 4_294_967_296
    assert attention_flops(2, 1024, 1024, 8, 64, causal=False) == 4_294_967_296.0
    assert attention_flops(2, 1024, 1024, 8, 64, causal=True) == 2_147_483_648.0
    # 4 * 100 * 300 * 128 * 3 * 1 = 46_080_000
    assert attention_flops(1, 100, 300, 3, 128, causal=False, mode="bwd") == 2.5 * 46_080_000
    assert attention_flops(1, 100, 300, 3, 128, causal=True, mode="fwdbwd") == 3.5 * 23_040_000
    assert isinstance(attention_flops(1, 1, 1, 1, 32, causal=False), float)
    with pytest.raises(ValueError):
        attention_flops(1, 1, 1, 1, 32, causal=False, mode="both")
