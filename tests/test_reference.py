"""CPU tests of flashcupy.reference: the plain reference against independent math, and the tiled
FA2 transcriptions against the plain reference."""

import itertools
import math

import numpy as np
import pytest

from flashcupy.reference import (
    attention_bwd_ref,
    attention_flops,
    attention_ref,
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


def _loop_attention(q, k, v, scale, causal):
    """Per-element attention with math.exp, independent of the module's vectorised code."""
    batch, sq, nheads, d = q.shape
    sk, nheads_k = k.shape[1], k.shape[2]
    out = np.zeros(q.shape)
    lse = np.full((batch, nheads, sq), -np.inf)
    for b, h, i in itertools.product(range(batch), range(nheads), range(sq)):
        kh = h // (nheads // nheads_k)
        keys = [j for j in range(sk) if not causal or j - i <= sk - sq]
        if not keys:
            continue
        scores = {j: scale * sum(q[b, i, h, e] * k[b, j, kh, e] for e in range(d)) for j in keys}
        top = max(scores.values())
        weights = {j: math.exp(s - top) for j, s in scores.items()}
        total = sum(weights.values())
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

    def f(q, k, v):
        return np.sum(attention_ref(q, k, v, softmax_scale=scale, causal=causal)[0] * dout)

    grads = attention_bwd_ref(dout, q, k, v, softmax_scale=scale, causal=causal)
    eps = 1e-5
    for which, grad in enumerate(grads):
        args = [q.copy(), k.copy(), v.copy()]
        x = args[which]
        numeric = np.zeros(x.shape)
        for idx in np.ndindex(x.shape):
            orig = x[idx]
            x[idx] = orig + eps
            up = f(*args)
            x[idx] = orig - eps
            down = f(*args)
            x[idx] = orig
            numeric[idx] = (up - down) / (2 * eps)
        err = np.max(np.abs(grad - numeric)) / np.max(np.abs(numeric))
        assert err < 1e-6, ("dq", "dk", "dv")[which]


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


@pytest.mark.parametrize("block_m,block_n", [(16, 16), (64, 32)])
def test_causal_rows_without_keys(block_m, block_n):
    # seqlen_q > seqlen_k: rows i < seqlen_q - seqlen_k see nothing; with 70 such rows and block_m
    # 16 whole q blocks are never run in the forward (n_block_max <= 0).
    seqlen_q, seqlen_k = 90, 20
    rng = np.random.default_rng(8)
    q, k, v = _qkv(rng, 2, seqlen_q, seqlen_k, 4, 2, 16)
    dout = rng.standard_normal(q.shape)
    empty = np.arange(seqlen_q) < seqlen_q - seqlen_k
    results = [attention_ref(q, k, v, causal=True),
               fa2_forward_tiled(q, k, v, causal=True, block_m=block_m, block_n=block_n)]
    for out, lse in results:
        assert not np.isnan(out).any() and not np.isnan(lse).any()
        np.testing.assert_array_equal(out[:, empty], 0.0)
        assert np.all(lse[:, :, empty] == -np.inf)
        assert np.all(np.isfinite(lse[:, :, ~empty]))
    out, lse = results[0]
    tiled = fa2_backward_tiled(dout, q, k, v, out, lse, causal=True, block_m=block_m, block_n=block_n)
    for dq, dk, dv in (attention_bwd_ref(dout, q, k, v, causal=True), tiled):
        assert not any(np.isnan(g).any() for g in (dq, dk, dv))
        np.testing.assert_array_equal(dq[:, empty], 0.0)
        # dout in the empty rows must not reach dk, dv.
        dout2 = dout.copy()
        dout2[:, empty] = rng.standard_normal(dout2[:, empty].shape)
        for g, g2 in zip((dk, dv), attention_bwd_ref(dout2, q, k, v, causal=True)[1:]):
            np.testing.assert_allclose(g, g2, rtol=1e-9, atol=1e-11)


def _expected_tiles(seqlen_q, seqlen_k, causal, block_m, block_n):
    """Tiles holding an allowed (row, key) pair, and those among them holding a forbidden one.

    Brute force over the element mask; keys past seqlen_k count as forbidden, rows past seqlen_q
    do not exist.
    """
    n_q, n_k = -(-seqlen_q // block_m), -(-seqlen_k // block_n)
    keys = np.arange(n_k * block_n)
    allowed = np.broadcast_to(keys[None, :] < seqlen_k, (seqlen_q, keys.size))
    if causal:
        allowed = allowed & (keys[None, :] <= np.arange(seqlen_q)[:, None] + seqlen_k - seqlen_q)
    visited, masked = set(), set()
    for i, j in itertools.product(range(n_q), range(n_k)):
        tile = allowed[i * block_m:(i + 1) * block_m, j * block_n:(j + 1) * block_n]
        if tile.any():
            visited.add((i, j))
            if not tile.all():
                masked.add((i, j))
    return visited, masked


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
    assert set(masked) == want_masked
    # Strictly below the diagonal most tiles run unmasked once the sequence spans a few blocks.
    if seqlen == 256 and block_m == block_n:
        assert len(want_visited - want_masked) > 0


@pytest.mark.parametrize("block_m,block_n", BLOCKS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen_q,seqlen_k", SEQLENS + [(300, 40), (40, 300)])
def test_tile_schedule_brute_force(block_m, block_n, causal, seqlen_q, seqlen_k):
    want_visited, want_masked = _expected_tiles(seqlen_q, seqlen_k, causal, block_m, block_n)
    rng = np.random.default_rng(10)
    q, k, v = _qkv(rng, 1, seqlen_q, seqlen_k, 1, 1, 4)
    out, lse, visited, masked = fa2_forward_tiled(q, k, v, causal=causal, block_m=block_m, block_n=block_n,
                                                  return_visited=True)
    assert set(visited) == want_visited and set(masked) == want_masked
    # The forward walks each q block's key blocks from the last down to 0.
    for i in {i for i, _ in visited}:
        js = [j for ii, j in visited if ii == i]
        assert js == sorted(js, reverse=True) and js[-1] == 0
    *_, visited, masked = fa2_backward_tiled(rng.standard_normal(q.shape), q, k, v, out, lse, causal=causal,
                                             block_m=block_m, block_n=block_n, return_visited=True)
    assert set(visited) == want_visited and set(masked) == want_masked


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
