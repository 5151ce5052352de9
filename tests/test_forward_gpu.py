"""The forward kernel against the float64 reference, on the GPU."""

from __future__ import annotations

import math

import numpy as np
import pytest

from gpu_helpers import REL_TOL, check_lse, poison_pool, randn, rel_err, requires_gpu, skip_unless_served, to_host64

pytestmark = requires_gpu

SEQLENS = [1, 17, 128, 1000, 4099]


@pytest.fixture(autouse=True, params=["sm90", "sm80", "decode"])
def forward_family(request, monkeypatch):
    """Every test runs on each forward family (FLASHCUPY_BACKEND); a family that does not serve the
    test's problem on this GPU skips it, saying why."""
    monkeypatch.setenv("FLASHCUPY_BACKEND", request.param)
    return request.param


UNEQUAL = [(17, 1000), (1000, 17), (128, 4099), (4099, 129)]


def run_and_check(q, k, v, causal, dtype_name, softmax_scale=None):
    import os

    import cupy

    import flashcupy
    from flashcupy.reference import attention_ref

    skip_unless_served("fwd", os.environ["FLASHCUPY_BACKEND"], q, k, causal=causal)
    batch, seqlen_q, nheads, d = q.shape
    poison_pool(((batch, seqlen_q, nheads, d), q.dtype), ((batch, nheads, seqlen_q), cupy.float32))
    out, lse = flashcupy.flash_attn_func(q, k, v, softmax_scale=softmax_scale, causal=causal, return_lse=True)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (batch, nheads, seqlen_q) and lse.dtype == cupy.float32
    ref_out, ref_lse = attention_ref(to_host64(q), to_host64(k), to_host64(v), softmax_scale=softmax_scale,
                                     causal=causal)
    out_h = to_host64(out)
    assert not np.isnan(out_h).any(), "unwritten (poisoned) or NaN output elements"
    err = rel_err(out_h, ref_out)
    assert err < REL_TOL[dtype_name], f"out relative error {err:.2e}"
    check_lse(lse, ref_lse)
    return err


@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen", SEQLENS)
def test_equal_seqlens(dtype_name, head_dim, causal, seqlen):
    rng = np.random.default_rng(1000 * seqlen + head_dim + causal)
    for batch, nheads in ((1, 3), (8, 2)):
        if batch * seqlen * seqlen > 8 * 1000 * 1000 and batch > 1:
            batch = 2  # keep the float64 reference quick at the longest length
        shape = (batch, seqlen, nheads, head_dim)
        q, k, v = (randn(rng, shape, dtype_name) for _ in range(3))
        run_and_check(q, k, v, causal, dtype_name)


@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen_q,seqlen_k", UNEQUAL)
def test_unequal_seqlens(dtype_name, head_dim, causal, seqlen_q, seqlen_k):
    rng = np.random.default_rng(seqlen_q * 7 + seqlen_k + head_dim + causal)
    q = randn(rng, (2, seqlen_q, 2, head_dim), dtype_name)
    k, v = (randn(rng, (2, seqlen_k, 2, head_dim), dtype_name) for _ in range(2))
    run_and_check(q, k, v, causal, dtype_name)


@pytest.mark.parametrize("head_dim", [32, 96, 192, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_other_head_dims(head_dim, causal):
    rng = np.random.default_rng(head_dim + causal)
    q = randn(rng, (2, 300, 2, head_dim), "bfloat16")
    k, v = (randn(rng, (2, 333, 2, head_dim), "bfloat16") for _ in range(2))
    run_and_check(q, k, v, causal, "bfloat16")


@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16"])
def test_large_batch_heads_and_scale(dtype_name):
    rng = np.random.default_rng(7)
    shape = (8, 130, 16, 64)
    q, k, v = (randn(rng, shape, dtype_name) for _ in range(3))
    run_and_check(q, k, v, True, dtype_name, softmax_scale=0.3)


@pytest.mark.parametrize("causal", [False, True])
def test_noncontiguous_strides(causal):
    """Packed qkv (batch, seq, 3, heads, d) and a (batch, heads, seq, d) buffer seen transposed."""
    import cupy

    rng = np.random.default_rng(11)
    b, n, h, d = 2, 257, 4, 128
    qkv = randn(rng, (b, n, 3, h, d), "bfloat16")
    q, k = qkv[:, :, 0], qkv[:, :, 1]
    v = cupy.ascontiguousarray(randn(rng, (b, h, n, d), "bfloat16")).transpose(0, 2, 1, 3)
    assert not q.flags.c_contiguous and not v.flags.c_contiguous
    run_and_check(q, k, v, causal, "bfloat16")


def test_broadcast_and_reversed_views(forward_family):
    """K and V broadcast over the batch (stride 0) and Q reversed along the sequence (a negative
    stride), read in place: the sm80 kernels compute them; the sm90 family's TMA tensor maps take
    positive strides, so forcing it says so."""
    import cupy

    import flashcupy
    from flashcupy.device import device_info

    rng = np.random.default_rng(13)
    b, n, h, d = 3, 129, 4, 64
    q = randn(rng, (b, n, h, d), "bfloat16")[:, ::-1]
    k, v = (cupy.broadcast_to(randn(rng, (1, n, h, d), "bfloat16"), (b, n, h, d)) for _ in range(2))
    assert q.strides[1] < 0 and k.strides[0] == 0
    if forward_family == "sm90":
        if device_info().capability != 90:
            pytest.skip("sm90: Hopper (compute capability 9.0) only")
        with pytest.raises(ValueError, match="zero or negative stride"):
            flashcupy.flash_attn_func(q, k, v)
        return
    run_and_check(q, k, v, True, "bfloat16")


def test_gqa_heads():
    rng = np.random.default_rng(5)
    q = randn(rng, (2, 200, 8, 64), "float16")
    k, v = (randn(rng, (2, 190, 2, 64), "float16") for _ in range(2))
    run_and_check(q, k, v, True, "float16")


def test_nan_stays_in_its_row():
    import cupy

    import flashcupy

    rng = np.random.default_rng(3)
    q, k, v = (randn(rng, (1, 200, 2, 64), "float16") for _ in range(3))
    q[0, 37, 1, 5] = np.nan
    out = to_host64(flashcupy.flash_attn_func(q, k, v))
    assert np.isnan(out[0, 37, 1]).all()
    mask = np.ones(out.shape, bool)
    mask[0, 37, 1] = False
    assert np.isfinite(out[mask]).all()
    cupy.cuda.Device().synchronize()


def test_empty_inputs(forward_family):
    import cupy

    import flashcupy

    rng = np.random.default_rng(0)
    q = randn(rng, (0, 16, 2, 64), "float16")
    out, lse = flashcupy.flash_attn_func(q, q, q, return_lse=True)
    assert out.shape == (0, 16, 2, 64) and lse.shape == (0, 2, 16)
    q = randn(rng, (2, 0, 2, 64), "float16")
    assert flashcupy.flash_attn_func(q, q, q).shape == (2, 0, 2, 64)
    # no keys at all: every row sees nothing (sm90 leaves empty sequences to sm80: no tensor map of them)
    if forward_family == "sm90":
        return
    q = randn(rng, (1, 5, 2, 64), "float16")
    kv = randn(rng, (1, 0, 2, 64), "float16")
    out, lse = flashcupy.flash_attn_func(q, kv, kv, return_lse=True)
    assert (cupy.asnumpy(out.astype(cupy.float32)) == 0).all()
    assert (cupy.asnumpy(lse) == -np.inf).all()


def test_memory_is_linear_in_seqlen():
    """A forward at seqlen 65536 allocates out and LSE only: nothing of size N x N."""
    import cupy

    import flashcupy

    rng = np.random.default_rng(9)
    shape = (1, 65536, 1, 64)
    q, k, v = (randn(rng, shape, "bfloat16") for _ in range(3))
    pool = cupy.get_default_memory_pool()
    cupy.cuda.Device().synchronize()
    pool.free_all_blocks()
    before = pool.total_bytes()
    out, lse = flashcupy.flash_attn_func(q, k, v, causal=True, return_lse=True)
    cupy.cuda.Device().synchronize()
    extra = pool.total_bytes() - before
    assert extra <= out.nbytes + lse.nbytes + 4096, f"{extra} extra bytes for outputs of {out.nbytes + lse.nbytes}"
    # spot-check the last rows against the reference (a full float64 reference would be N x N)
    from flashcupy.reference import attention_ref

    tail = slice(65536 - 64, 65536)
    ref_out, _ = attention_ref(to_host64(q[:, tail]), to_host64(k), to_host64(v), causal=True)
    assert rel_err(to_host64(out[:, tail]), ref_out) < REL_TOL["bfloat16"]
    assert math.isfinite(float(lse.max()))


@pytest.mark.parametrize("causal", [False, True])
def test_a_repeated_call_replays_its_launch(causal, monkeypatch):
    """A call with the inputs and options of the last one skips the host work (no problem is
    described again) and computes from the inputs' current contents into fresh outputs; a change
    of shape or option takes the full path."""
    import os

    import cupy

    import flashcupy
    from flashcupy import replay
    from flashcupy.problem import Problem
    from flashcupy.reference import attention_ref

    rng = np.random.default_rng(31 + causal)
    shape = (2, 129, 3, 64)
    q, k, v = (randn(rng, shape, "bfloat16") for _ in range(3))
    skip_unless_served("fwd", os.environ["FLASHCUPY_BACKEND"], q, k, causal=causal)
    described, padded = [], Problem.padded
    monkeypatch.setattr(Problem, "padded", lambda *a, **kw: described.append(1) or padded(*a, **kw))
    replay.clear()
    outputs = ((shape, q.dtype), ((2, 3, 129), cupy.float32))
    first, first_lse = flashcupy.flash_attn_func(q, k, v, causal=causal, return_lse=True)
    for _ in range(2):
        poison_pool(*outputs)
        out, lse = flashcupy.flash_attn_func(q, k, v, causal=causal, return_lse=True)
        assert out.data.ptr != first.data.ptr
        assert (to_host64(out) == to_host64(first)).all() and (cupy.asnumpy(lse) == cupy.asnumpy(first_lse)).all()
    assert len(described) == 1

    def check(out, lse, q, **options):
        ref_out, ref_lse = attention_ref(to_host64(q), to_host64(k), to_host64(v), causal=causal, **options)
        assert rel_err(to_host64(out), ref_out) < REL_TOL["bfloat16"]
        check_lse(lse, ref_lse)

    for a in (q, k, v):  # new contents in the same buffers: the kept launch reads them
        a[...] = randn(rng, shape, "bfloat16")
    poison_pool(*outputs)
    check(*flashcupy.flash_attn_func(q, k, v, causal=causal, return_lse=True), q)
    assert len(described) == 1
    check(*flashcupy.flash_attn_func(q, k, v, softmax_scale=0.3, causal=causal, return_lse=True), q,
          softmax_scale=0.3)
    assert len(described) == 2
    short = q[:, :100]  # the same pointer, another shape
    check(*flashcupy.flash_attn_func(short, k, v, causal=causal, return_lse=True), short)
    assert len(described) == 3
