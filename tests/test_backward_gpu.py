"""The backward kernels against the float64 reference gradients, on the GPU."""

from __future__ import annotations

import numpy as np
import pytest

from gpu_helpers import (GRAD_TOL, REL_TOL, grad_rel_err, poison_pool, randn, rel_err, requires_gpu,
                         skip_unless_served, to_host64)

pytestmark = requires_gpu


@pytest.fixture(autouse=True, params=["sm90", "sm80"])
def backward_family(request, monkeypatch):
    """Every test runs on each backward family (FLASHCUPY_BACKEND, which also picks the forward
    family of that name); a family that does not serve the test's problem on this GPU skips it."""
    monkeypatch.setenv("FLASHCUPY_BACKEND", request.param)
    return request.param

SEQLENS = [1, 17, 128, 1000, 2049]
UNEQUAL = [(17, 1000), (1000, 17), (128, 2049), (2049, 129)]


def run_backward(q, k, v, causal, dtype_name, deterministic=False, softmax_scale=None, grads_out=None):
    import os

    import cupy

    import flashcupy
    from flashcupy.reference import attention_bwd_ref

    skip_unless_served("bwd", os.environ["FLASHCUPY_BACKEND"], q, k, causal=causal, deterministic=deterministic)
    out, lse = flashcupy.flash_attn_func(q, k, v, softmax_scale=softmax_scale, causal=causal, return_lse=True)
    rng = np.random.default_rng(q.shape[1] * 31 + k.shape[1])
    dout = randn(rng, q.shape, dtype_name)
    # NaN where the gradients and the float32 dQ accumulator (which the preprocess must zero) land
    poison_pool((q.shape, q.dtype), (k.shape, k.dtype), (v.shape, v.dtype), (lse.shape, cupy.float32),
                (q.shape, cupy.float32))
    grads = flashcupy.flash_attn_backward(dout, q, k, v, out, lse, softmax_scale=softmax_scale, causal=causal,
                                          deterministic=deterministic, **(grads_out or {}))
    refs = attention_bwd_ref(to_host64(dout), to_host64(q), to_host64(k), to_host64(v),
                             softmax_scale=softmax_scale, causal=causal)
    errs = {}
    for name, g, ref, like in zip(("dq", "dk", "dv"), grads, refs, (q, k, v)):
        assert g.shape == like.shape and g.dtype == like.dtype
        host = to_host64(g)
        assert not np.isnan(host).any(), f"{name}: unwritten (poisoned) or NaN elements"
        errs[name] = grad_rel_err(host, ref, refs[2])
        assert errs[name] < GRAD_TOL[dtype_name], f"{name} relative error {errs[name]:.2e}"
    cupy.cuda.Device().synchronize()
    return grads, errs


@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16"])
@pytest.mark.parametrize("head_dim", [64, 96, 128, 192, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen", SEQLENS)
def test_equal_seqlens(dtype_name, head_dim, causal, seqlen):
    rng = np.random.default_rng(1000 * seqlen + head_dim + causal)
    for batch, nheads in ((1, 3), (8, 2)):
        if seqlen > 1000:
            batch = min(batch, 2)
        shape = (batch, seqlen, nheads, head_dim)
        q, k, v = (randn(rng, shape, dtype_name) for _ in range(3))
        run_backward(q, k, v, causal, dtype_name)


@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16"])
@pytest.mark.parametrize("head_dim", [64, 96, 128, 192, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen_q,seqlen_k", UNEQUAL)
def test_unequal_seqlens(dtype_name, head_dim, causal, seqlen_q, seqlen_k):
    rng = np.random.default_rng(seqlen_q * 7 + seqlen_k + head_dim + causal)
    q = randn(rng, (2, seqlen_q, 2, head_dim), dtype_name)
    k, v = (randn(rng, (2, seqlen_k, 2, head_dim), dtype_name) for _ in range(2))
    run_backward(q, k, v, causal, dtype_name)


@pytest.mark.parametrize("head_dim", [32])
@pytest.mark.parametrize("causal", [False, True])
def test_other_head_dims(head_dim, causal):
    rng = np.random.default_rng(head_dim + causal)
    q = randn(rng, (2, 300, 2, head_dim), "bfloat16")
    k, v = (randn(rng, (2, 333, 2, head_dim), "bfloat16") for _ in range(2))
    run_backward(q, k, v, causal, "bfloat16")


def test_large_batch_heads_and_scale():
    """batch x heads (320) beyond twice the SM count, ragged length, a given scale."""
    rng = np.random.default_rng(8)
    shape = (8, 130, 40, 64)
    q, k, v = (randn(rng, shape, "float16") for _ in range(3))
    run_backward(q, k, v, True, "float16", softmax_scale=0.3)


@pytest.mark.parametrize("head_dim", [64, 96, 128, 192, 256])
def test_sections_of_the_block_order(head_dim, backward_family, monkeypatch):
    """The sm90 backward's block order in sections narrower than the problem (the last one narrower
    still): every key block of every pair runs once, against the reference."""
    from flashcupy import replay, sm90_bwd

    if backward_family != "sm90":
        pytest.skip("the section order is the sm90 backward's")
    replay.clear()  # a kept call of an earlier test's arrays would not ask for the sections
    asked = []
    monkeypatch.setattr(sm90_bwd, "section_heads", lambda problem, mask, deterministic: asked.append(mask) or 3)
    rng = np.random.default_rng(head_dim + 5)
    q, k, v = (randn(rng, (7, 261, 2, head_dim), "bfloat16") for _ in range(3))
    run_backward(q, k, v, True, "bfloat16")
    assert asked == ["causal"]  # the launch took the narrow sections


@pytest.mark.parametrize("causal", [False, True])
def test_noncontiguous_strides_and_given_outputs(causal):
    """Packed qkv inputs; gradients written in place into a packed dqkv buffer."""
    import cupy

    rng = np.random.default_rng(12)
    b, n, h, d = 2, 257, 4, 128
    qkv = randn(rng, (b, n, 3, h, d), "bfloat16")
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    dqkv = cupy.full(qkv.shape, np.nan, dtype=qkv.dtype)
    grads, _ = run_backward(q, k, v, causal, "bfloat16",
                            grads_out={"dq": dqkv[:, :, 0], "dk": dqkv[:, :, 1], "dv": dqkv[:, :, 2]})
    for i, g in enumerate(grads):
        assert g.data.ptr == dqkv[:, :, i].data.ptr  # written in place, no copy
    assert not cupy.isnan(dqkv.astype(cupy.float32)).any()


def test_outputs_that_share_memory_refused_before_any_write():
    """dk and dv in one buffer, or dq over q: refused by name, and nothing written."""
    import cupy

    import flashcupy

    rng = np.random.default_rng(14)
    q, k, v, dout = (randn(rng, (2, 130, 4, 64), "bfloat16") for _ in range(4))
    out, lse = flashcupy.flash_attn_func(q, k, v, return_lse=True)
    shared = cupy.full(k.shape, 7, dtype=k.dtype)
    q_before = q.copy()
    for given, match in ((dict(dk=shared, dv=shared), "dk shares memory with dv"),
                         (dict(dq=q), "dq shares memory with q"),
                         (dict(dv=dout[:, :, ::-1]), "dv shares memory with dout")):
        with pytest.raises(ValueError, match=match):
            flashcupy.flash_attn_backward(dout, q, k, v, out, lse, **given)
    assert bool((shared.astype(cupy.float32) == 7).all())
    assert bool((q.astype(cupy.float32) == q_before.astype(cupy.float32)).all())


@pytest.mark.parametrize("head_dim", [64, 96, 128, 192, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_gqa_sums_over_groups(causal, head_dim):
    rng = np.random.default_rng(6)
    q = randn(rng, (2, 200, 8, head_dim), "float16")
    k, v = (randn(rng, (2, 190, 2, head_dim), "float16") for _ in range(2))
    run_backward(q, k, v, causal, "float16")


@pytest.mark.parametrize("seqlen_q, seqlen_k", [(2047, 2047), (2048, 2048), (2100, 1000), (1000, 2100)])
@pytest.mark.parametrize("deterministic", [False, True])
def test_causal_steps_on_both_sides_of_the_length_switch(seqlen_q, seqlen_k, deterministic):
    """At head dim 128 the sm90 backward's causal step takes 64 queries below 2048 and 80 from
    there (sm90_bwd.block_m): gradients on both sides, bottom-right aligned both ways."""
    rng = np.random.default_rng(seqlen_q + seqlen_k)
    q = randn(rng, (1, seqlen_q, 2, 128), "bfloat16")
    k, v = (randn(rng, (1, seqlen_k, 2, 128), "bfloat16") for _ in range(2))
    run_backward(q, k, v, True, "bfloat16", deterministic=deterministic)


@pytest.mark.parametrize("head_dim, seqlen", [(64, 1500), (96, 1500), (128, 1500), (128, 2100), (192, 1500), (256, 1500)])
@pytest.mark.parametrize("causal", [False, True])
def test_deterministic_gives_identical_bits(causal, head_dim, seqlen):
    import cupy

    rng = np.random.default_rng(4)
    shape = (2, seqlen, 4, head_dim)
    q, k, v = (randn(rng, shape, "bfloat16") for _ in range(3))
    first, _ = run_backward(q, k, v, causal, "bfloat16", deterministic=True)
    for _ in range(3):
        again, _ = run_backward(q, k, v, causal, "bfloat16", deterministic=True)
        for a, b in zip(first, again):
            assert cupy.array_equal(a.view(cupy.uint16), b.view(cupy.uint16))


def test_handle_round_trip():
    import cupy

    import flashcupy
    from flashcupy.reference import attention_bwd_ref, attention_ref

    rng = np.random.default_rng(21)
    q, k, v = (randn(rng, (2, 333, 4, 64), "float16") for _ in range(3))
    attn = flashcupy.FlashAttention(causal=True)
    out = attn.forward(q, k, v)
    ref_out, _ = attention_ref(to_host64(q), to_host64(k), to_host64(v), causal=True)
    assert rel_err(to_host64(out), ref_out) < REL_TOL["float16"]
    dout = randn(rng, q.shape, "float16")
    grads = attn.backward(dout)
    refs = attention_bwd_ref(to_host64(dout), to_host64(q), to_host64(k), to_host64(v), causal=True)
    for g, r in zip(grads, refs):
        assert rel_err(to_host64(g), r) < GRAD_TOL["float16"]
    attn.release()
    with pytest.raises(RuntimeError, match="forward first"):
        attn.backward(dout)
    cupy.cuda.Device().synchronize()


def test_backward_validation_names_arguments():
    import cupy

    import flashcupy

    rng = np.random.default_rng(2)
    q, k, v = (randn(rng, (1, 64, 2, 64), "float16") for _ in range(3))
    out, lse = flashcupy.flash_attn_func(q, k, v, return_lse=True)
    with pytest.raises(ValueError, match="dout must have the shape of q"):
        flashcupy.flash_attn_backward(out[:, :32], q, k, v, out, lse)
    with pytest.raises(ValueError, match="softmax_lse must have shape"):
        flashcupy.flash_attn_backward(out, q, k, v, out, lse[:, :1])
    with pytest.raises(TypeError, match="softmax_lse must be float32"):
        flashcupy.flash_attn_backward(out, q, k, v, out, lse.astype(cupy.float64))
    with pytest.raises(ValueError, match="dk must have the shape and dtype of k"):
        flashcupy.flash_attn_backward(out, q, k, v, out, lse, dk=cupy.empty((1, 64, 2, 32), cupy.float16))
    with pytest.raises(TypeError, match="dout is a NumPy"):
        flashcupy.flash_attn_backward(np.zeros(q.shape, np.float16), q, k, v, out, lse)


def test_memory_is_linear_in_seqlen():
    """A backward at seqlen 65536 allocates O(seqlen): D, the dq accumulator and the gradients."""
    import cupy

    import flashcupy

    rng = np.random.default_rng(19)
    shape = (1, 65536, 1, 64)
    q, k, v, dout = (randn(rng, shape, "bfloat16") for _ in range(4))
    out, lse = flashcupy.flash_attn_func(q, k, v, causal=True, return_lse=True)
    pool = cupy.get_default_memory_pool()
    cupy.cuda.Device().synchronize()
    pool.free_all_blocks()
    before = pool.total_bytes()
    grads = flashcupy.flash_attn_backward(dout, q, k, v, out, lse, causal=True)
    cupy.cuda.Device().synchronize()
    extra = pool.total_bytes() - before
    grad_bytes = sum(g.nbytes for g in grads)
    accum_bytes = q.size * 4 + lse.nbytes  # float32 dq accumulator and D
    assert extra <= grad_bytes + accum_bytes + (1 << 20), f"{extra} extra bytes"
    assert extra < 65536 * 65536 // 64  # far below any N x N buffer
    for g in grads:
        assert bool(cupy.isfinite(g.astype(cupy.float32)).all())


@pytest.mark.parametrize("options", [dict(causal=False), dict(causal=True, deterministic=True)], ids=["plain", "det"])
@pytest.mark.parametrize("gqa", [False, True], ids=["mha", "gqa"])
def test_a_repeated_backward_replays_its_launches(options, gqa, monkeypatch):
    """A backward with the arrays and options of the last one skips the host work (no problem is
    described again), allocates fresh gradients and scratch (the dQ accumulator poisoned, the
    deterministic mode's semaphores zeroed again), and computes from the arrays' current contents;
    given outputs are written in place; other options take the full path."""
    import os

    import cupy

    import flashcupy
    from flashcupy import replay
    from flashcupy.problem import Problem
    from flashcupy.reference import attention_bwd_ref

    rng = np.random.default_rng(77 + gqa)
    q = randn(rng, (2, 129, 4, 64), "bfloat16")
    k, v = (randn(rng, (2, 129, 2 if gqa else 4, 64), "bfloat16") for _ in range(2))
    skip_unless_served("bwd", os.environ["FLASHCUPY_BACKEND"], q, k, **options)
    described, padded = [], Problem.padded
    monkeypatch.setattr(Problem, "padded", lambda *a, **kw: described.append(1) or padded(*a, **kw))
    replay.clear()
    causal = options["causal"]
    out, lse = flashcupy.flash_attn_func(q, k, v, causal=causal, return_lse=True)
    dout = randn(rng, q.shape, "bfloat16")
    scratch = ((q.shape, q.dtype), (k.shape, k.dtype), (v.shape, v.dtype), (lse.shape, cupy.float32),
               (q.shape, cupy.float32), ((2, 129, 4, 64), q.dtype))
    first = flashcupy.flash_attn_backward(dout, q, k, v, out, lse, **options)
    calls = len(described)
    for _ in range(2):
        poison_pool(*scratch)
        again = flashcupy.flash_attn_backward(dout, q, k, v, out, lse, **options)
        assert all(a.data.ptr != f.data.ptr for a, f in zip(again, first))
        for a, f in zip(again, first):  # the same up to the order of float32 atomics (bits: deterministic)
            diff = np.abs(to_host64(a) - to_host64(f)).max() / np.abs(to_host64(f)).max()
            assert diff == 0 if options.get("deterministic") else diff < 1e-2, diff
    assert len(described) == calls

    def check(grads, dout):
        refs = attention_bwd_ref(to_host64(dout), to_host64(q), to_host64(k), to_host64(v), causal=causal)
        for name, g, ref in zip(("dq", "dk", "dv"), grads, refs):
            host = to_host64(g)
            assert not np.isnan(host).any(), f"{name}: unwritten (poisoned) or NaN elements"
            assert grad_rel_err(host, ref, refs[2]) < GRAD_TOL["bfloat16"], name

    dout[...] = randn(rng, q.shape, "bfloat16")  # new contents in the same buffer: read afresh
    poison_pool(*scratch)
    check(flashcupy.flash_attn_backward(dout, q, k, v, out, lse, **options), dout)
    given = [cupy.full(a.shape, np.nan, a.dtype) for a in (q, k, v)]
    for _ in range(2):  # the caller's outputs, written in place by the full path, then the kept one
        grads = flashcupy.flash_attn_backward(dout, q, k, v, out, lse, dq=given[0], dk=given[1], dv=given[2],
                                              **options)
        assert all(g is a for g, a in zip(grads, given))
        check(grads, dout)
        for a in given:
            a.fill(np.nan)
    assert len(described) == calls + 1
    flashcupy.flash_attn_backward(dout, q, k, v, out, lse, softmax_scale=0.125, **options)
    assert len(described) == calls + 2
