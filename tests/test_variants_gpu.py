"""softcap, ALiBi, attention sinks and variable-length (packed) batches, forward and backward, on
the GPU, against the float64 reference; alone and combined with GQA, causal and windows."""

from __future__ import annotations

import numpy as np
import pytest

from gpu_helpers import (REL_TOL, check_grads, check_grads_per_sequence, check_lse, poison_pool, randn, rel_err,
                         requires_gpu, serving_families, to_host64)

pytestmark = requires_gpu


def _f32(rng, shape, low, high):
    import cupy

    return cupy.asarray(rng.uniform(low, high, shape).astype(np.float32))


def _host(x):
    return None if x is None else to_host64(x)


# (seqlen_q, seqlen_k, causal, window_size, alignment, softcap, alibi: None / "heads" / "batch", sinks, GQA)
MOD_CASES = [
    (300, 517, False, (-1, -1), "bottom_right", 5.0, None, False, False),
    (1000, 1000, True, (-1, -1), "bottom_right", 0.0, "heads", False, False),
    (777, 1300, False, (200, 64), "top_left", 0.0, "batch", False, True),
    (1000, 1000, True, (-1, -1), "bottom_right", 0.0, None, True, False),
    (1300, 777, True, (-1, -1), "bottom_right", 0.0, None, True, True),  # 523 rows with only the sink
    (777, 1300, True, (300, -1), "bottom_right", 2.0, "heads", True, True),
    (129, 4000, False, (-1, -1), "top_left", 2.0, "batch", True, False),
]


@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16"])
@pytest.mark.parametrize("head_dim", [64, 96, 128, 192, 256])
@pytest.mark.parametrize("case", MOD_CASES, ids=lambda c: "-".join(map(str, c)).replace(" ", ""))
def test_softcap_alibi_sinks(dtype_name, head_dim, case):
    import cupy

    import flashcupy
    from flashcupy.reference import attention_bwd_ref, attention_ref

    seqlen_q, seqlen_k, causal, window_size, alignment, softcap, alibi, sinks, gqa = case
    batch, nheads = 2, 4
    rng = np.random.default_rng(seqlen_q + 7 * seqlen_k + head_dim)
    q = randn(rng, (batch, seqlen_q, nheads, head_dim), dtype_name)
    k, v = (randn(rng, (batch, seqlen_k, 2 if gqa else nheads, head_dim), dtype_name) for _ in range(2))
    dout = randn(rng, q.shape, dtype_name)
    kw = dict(causal=causal, window_size=window_size, alignment=alignment, softcap=softcap,
              alibi_slopes=None if alibi is None else _f32(rng, (nheads,) if alibi == "heads" else (batch, nheads),
                                                           0.01, 0.3),
              sinks=_f32(rng, (nheads,), -1.0, 3.0) if sinks else None)
    host_kw = {**kw, "alibi_slopes": _host(kw["alibi_slopes"]), "sinks": _host(kw["sinks"])}
    host = [to_host64(a) for a in (q, k, v, dout)]

    poison_pool((q.shape, q.dtype), ((batch, nheads, seqlen_q), cupy.float32))
    out, lse = flashcupy.flash_attn_func(q, k, v, return_lse=True, **kw)
    ref_out, ref_lse = attention_ref(*host[:3], **host_kw)
    out_h = to_host64(out)
    assert not np.isnan(out_h).any()
    assert rel_err(out_h, ref_out) < REL_TOL[dtype_name]
    check_lse(lse, ref_lse)
    # each option changes the result on its own: a kernel that ignored either one fails
    for option, off, used in (("softcap", 0.0, softcap > 0), ("alibi_slopes", None, alibi is not None)):
        if used:
            without, _ = attention_ref(*host[:3], **{**host_kw, option: off})
            assert rel_err(without, ref_out) > 10 * REL_TOL[dtype_name], option

    refs = attention_bwd_ref(host[3], *host[:3], **host_kw)
    for deterministic in (False, True):
        for backend in serving_families("bwd", q, k, deterministic=deterministic, **kw):  # each backward family
            poison_pool((q.shape, q.dtype), (k.shape, k.dtype), (v.shape, v.dtype), (q.shape, cupy.float32))
            grads = flashcupy.flash_attn_backward(dout, q, k, v, out, lse, deterministic=deterministic,
                                                  backend=backend, **kw)
            check_grads(grads, refs, dtype_name, f"{backend} deterministic={deterministic}")


def test_sink_rows_without_keys_and_handle():
    """Rows that see no key give 0 and LSE = sink; the handle returns dsinks."""
    import cupy

    import flashcupy
    from flashcupy.reference import attention_bwd_ref

    rng = np.random.default_rng(5)
    q = randn(rng, (1, 300, 2, 64), "float16")
    k, v = (randn(rng, (1, 100, 2, 64), "float16") for _ in range(2))
    sinks = _f32(rng, (2,), 0.5, 1.5)
    attn = flashcupy.FlashAttention(causal=True, sinks=sinks, softcap=3.0)
    out = attn.forward(q, k, v)
    lse = attn.saved[4]
    assert (to_host64(out)[0, :200] == 0).all()
    assert np.allclose(cupy.asnumpy(lse)[0, :, :200], cupy.asnumpy(sinks)[:, None], rtol=0, atol=1e-6)
    dout = randn(rng, q.shape, "float16")
    grads = attn.backward(dout)
    refs = attention_bwd_ref(*(to_host64(a) for a in (dout, q, k, v)), causal=True, softcap=3.0, sinks=_host(sinks))
    check_grads(grads, refs, "float16", "handle")


def _packed(rng, lengths, nheads, head_dim, dtype_name):
    total = int(sum(lengths))
    return randn(rng, (total, nheads, head_dim), dtype_name)


def _cu(lengths):
    import cupy

    return cupy.asarray(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))


# (lengths_q, lengths_k, options): ragged, zero-length sequences on either side, batch 1
VARLEN_CASES = [
    ([1000], [1000], dict(causal=True)),
    ([0, 1, 130, 777, 64, 0, 513], [5, 1, 300, 777, 0, 9, 513], dict()),
    ([0, 1, 130, 777, 64, 0, 513], [5, 1, 300, 777, 0, 9, 513], dict(causal=True)),
    ([17, 400, 1000, 3], [900, 400, 129, 3], dict(causal=True, window_size=(100, -1))),
    ([17, 400, 1000, 3], [900, 400, 129, 3], dict(window_size=(32, 64), alignment="top_left", softcap=4.0)),
    ([250, 0, 700], [300, 128, 650], dict(causal=True, alibi="batch", sinks=True)),
    ([1, 2100, 129], [17, 2100, 300], dict(causal=True)),  # past the sm90 backward's causal step switch
]


@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16"])
@pytest.mark.parametrize("head_dim", [64, 96, 128, 192, 256])
@pytest.mark.parametrize("gqa", [False, True])
@pytest.mark.parametrize("lengths_q, lengths_k, options", VARLEN_CASES)
def test_varlen(dtype_name, head_dim, gqa, lengths_q, lengths_k, options):
    import cupy

    import flashcupy
    from flashcupy.reference import attention_varlen_bwd_ref, attention_varlen_ref

    nheads, nheads_k = 4, 2 if gqa else 4
    batch = len(lengths_q)
    rng = np.random.default_rng(sum(lengths_q) + head_dim + gqa)
    q = _packed(rng, lengths_q, nheads, head_dim, dtype_name)
    k, v = (_packed(rng, lengths_k, nheads_k, head_dim, dtype_name) for _ in range(2))
    dout = randn(rng, q.shape, dtype_name)
    cu_q, cu_k = _cu(lengths_q), _cu(lengths_k)
    kw = dict(options)
    if kw.pop("alibi", None):
        kw["alibi_slopes"] = _f32(rng, (batch, nheads), 0.01, 0.2)
    if kw.pop("sinks", None):
        kw["sinks"] = _f32(rng, (nheads,), -1.0, 2.0)
    host_kw = {n: (_host(a) if n in ("alibi_slopes", "sinks") else a) for n, a in kw.items()}
    sizes = (cu_q, cu_k, max(lengths_q), max(lengths_k))
    host = [to_host64(a) for a in (q, k, v, dout)] + [cupy.asnumpy(cu_q), cupy.asnumpy(cu_k)]

    poison_pool((q.shape, q.dtype), ((nheads, q.shape[0]), cupy.float32))
    out, lse = flashcupy.flash_attn_varlen_func(q, k, v, *sizes, return_lse=True, **kw)
    assert out.shape == q.shape and lse.shape == (nheads, q.shape[0])
    ref_out, ref_lse = attention_varlen_ref(*host[:3], *host[4:], **host_kw)
    out_h = to_host64(out)
    assert not np.isnan(out_h).any()
    assert rel_err(out_h, ref_out) < REL_TOL[dtype_name]
    check_lse(lse, ref_lse)

    refs = attention_varlen_bwd_ref(host[3], *host[:3], *host[4:], **host_kw)
    for deterministic in (False, True):
        for backend in serving_families("bwd", q[None], k[None], varlen=True, deterministic=deterministic, **kw):
            poison_pool((q.shape, q.dtype), (k.shape, k.dtype), (v.shape, v.dtype), (q.shape, cupy.float32))
            grads = flashcupy.flash_attn_varlen_backward(dout, q, k, v, out, lse, *sizes, deterministic=deterministic,
                                                         backend=backend, **kw)
            check_grads(grads, refs, dtype_name, f"{backend} deterministic={deterministic}")


SHORT_LENGTHS = (1, 2, 15, 16, 17, 300)


@pytest.mark.parametrize("shift", range(len(SHORT_LENGTHS)))
@pytest.mark.parametrize("options", [{}, {"causal": True}, {"window_size": (64, 64)}], ids=["none", "causal", "window"])
@pytest.mark.parametrize("nheads_k", [1, 4])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_varlen_short_sequences_in_every_position(shift, options, nheads_k, head_dim):
    """Sequences of 1, 2, 15, 16 and 17 tokens (and one of 300) in every position of the batch,
    checked one sequence at a time: a 1-token sequence has dq = dk = 0 exactly, and must come back
    as zero up to rounding, wherever it sits."""
    import cupy

    import flashcupy
    from flashcupy.reference import attention_varlen_bwd_ref, attention_varlen_ref

    lengths = list(np.roll(SHORT_LENGTHS, shift))
    nheads, dtype_name = 4, "float16"
    rng = np.random.default_rng(100 * shift + nheads_k)
    q = _packed(rng, lengths, nheads, head_dim, dtype_name)
    k, v = (_packed(rng, lengths, nheads_k, head_dim, dtype_name) for _ in range(2))
    dout = randn(rng, q.shape, dtype_name)
    cu = _cu(lengths)
    sizes = (cu, cu, max(lengths), max(lengths))
    host = [to_host64(a) for a in (q, k, v, dout)]
    cu_h = cupy.asnumpy(cu)

    poison_pool((q.shape, q.dtype), ((nheads, q.shape[0]), cupy.float32))
    out, lse = flashcupy.flash_attn_varlen_func(q, k, v, *sizes, return_lse=True, **options)
    ref_out, ref_lse = attention_varlen_ref(*host[:3], cu_h, cu_h, **options)
    out_h = to_host64(out)
    for b in range(len(lengths)):
        rows = slice(cu_h[b], cu_h[b + 1])
        assert rel_err(out_h[rows], ref_out[rows]) < REL_TOL[dtype_name], (lengths, b)
    check_lse(lse, ref_lse)
    refs = attention_varlen_bwd_ref(host[3], *host[:3], cu_h, cu_h, **options)
    for deterministic in (False, True):
        for backend in serving_families("bwd", q[None], k[None], varlen=True, deterministic=deterministic, **options):
            poison_pool((q.shape, q.dtype), (k.shape, k.dtype), (v.shape, v.dtype), (q.shape, cupy.float32))
            grads = flashcupy.flash_attn_varlen_backward(dout, q, k, v, out, lse, *sizes, deterministic=deterministic,
                                                         backend=backend, **options)
            check_grads_per_sequence(grads, refs, cu_h, cu_h, dtype_name,
                                     f"{backend} {lengths} deterministic={deterministic}")


def test_varlen_many_sequences_and_heads():
    """Large batch x heads: 96 ragged sequences (some empty), 16 heads, fp16."""
    import flashcupy
    from flashcupy.reference import attention_varlen_ref

    rng = np.random.default_rng(11)
    lengths = rng.integers(0, 300, 96)
    lengths[::17] = 0
    q, k, v = (_packed(rng, lengths, 16, 64, "float16") for _ in range(3))
    cu = _cu(lengths)
    out = flashcupy.flash_attn_varlen_func(q, k, v, cu, cu, int(lengths.max()), int(lengths.max()), causal=True)
    ref, _ = attention_varlen_ref(*(to_host64(a) for a in (q, k, v)), cu.get(), cu.get(), causal=True)
    assert rel_err(to_host64(out), ref) < REL_TOL["float16"]


def test_varlen_validation():
    import cupy

    import flashcupy

    rng = np.random.default_rng(3)
    q = _packed(rng, [10, 20], 2, 64, "float16")
    good = _cu([10, 20])
    cases = [
        (dict(cu_seqlens_q=good.astype(cupy.int64)), TypeError, "cu_seqlens_q must be int32"),
        (dict(cu_seqlens_k=cupy.asarray([0, 20, 10], cupy.int32)), ValueError, "non-decreasing"),
        (dict(cu_seqlens_q=cupy.asarray([0, 10, 29], cupy.int32)), ValueError, "number of packed tokens"),
        (dict(cu_seqlens_q=cupy.asarray([1, 10, 30], cupy.int32)), ValueError, r"cu_seqlens_q\[0\] must be 0"),
        (dict(max_seqlen_k=19), ValueError, "max_seqlen_k = 19 is shorter"),
        (dict(cu_seqlens_k=_cu([30])), ValueError, "same length"),
        (dict(q=q[None]), ValueError, "q must have 3 dimensions"),
    ]
    for change, error, match in cases:
        args = dict(q=q, k=q, v=q, cu_seqlens_q=good, cu_seqlens_k=good, max_seqlen_q=20, max_seqlen_k=20)
        args.update(change)
        with pytest.raises(error, match=match):
            flashcupy.flash_attn_varlen_func(**args)
    with pytest.raises(ValueError, match="alibi_slopes must have shape"):
        flashcupy.flash_attn_varlen_func(q, q, q, good, good, 20, 20, alibi_slopes=cupy.zeros((3, 2), cupy.float32))
    with pytest.raises(ValueError, match="softcap must be"):
        flashcupy.flash_attn_varlen_func(q, q, q, good, good, 20, 20, softcap=-1.0)


def test_backend_forcing(monkeypatch):
    """backend= and FLASHCUPY_BACKEND pick the named family; a wrong name is refused before any launch."""
    import flashcupy
    from flashcupy import registry
    from flashcupy.reference import attention_ref

    rng = np.random.default_rng(5)
    q, k, v = (randn(rng, (1, 200, 2, 64), "bfloat16") for _ in range(3))
    ref, _ = attention_ref(*(to_host64(a) for a in (q, k, v)), causal=True)
    for name in registry.family_names("fwd"):
        out = flashcupy.flash_attn_func(q, k, v, causal=True, backend=name)
        assert rel_err(to_host64(out), ref) < REL_TOL["bfloat16"], name
        monkeypatch.setenv("FLASHCUPY_BACKEND", name)
        out = flashcupy.flash_attn_func(q, k, v, causal=True)
        assert rel_err(to_host64(out), ref) < REL_TOL["bfloat16"], name
    monkeypatch.setenv("FLASHCUPY_BACKEND", "nonesuch")
    with pytest.raises(ValueError, match="FLASHCUPY_BACKEND='nonesuch' names no kernel family"):
        flashcupy.flash_attn_func(q, k, v)
    monkeypatch.delenv("FLASHCUPY_BACKEND")
    with pytest.raises(ValueError, match="backend='nonesuch' names no kernel family; choose from"):
        flashcupy.flash_attn_func(q, k, v, backend="nonesuch")


@pytest.mark.parametrize("causal", [False, True])
def test_repeated_varlen_calls_replay_their_launches(causal, monkeypatch):
    """Varlen calls with check_cu_seqlens=False and the same arrays skip the host work after the
    first, forward and backward, and read the arrays' current contents, the lengths in cu_seqlens
    included (other lengths, same totals, same buffers)."""
    import cupy

    import flashcupy
    from flashcupy import replay
    from flashcupy.problem import Problem
    from flashcupy.reference import attention_varlen_bwd_ref, attention_varlen_ref

    described, varlen = [], Problem.varlen
    monkeypatch.setattr(Problem, "varlen", lambda *a, **kw: described.append(1) or varlen(*a, **kw))
    replay.clear()
    rng = np.random.default_rng(5 + causal)
    configs = (([17, 1, 129], [40, 1, 129]), ([100, 40, 7], [10, 150, 10]))
    q = _packed(rng, configs[0][0], 4, 64, "bfloat16")
    k, v = (_packed(rng, configs[0][1], 2, 64, "bfloat16") for _ in range(2))
    dout = randn(rng, q.shape, "bfloat16")
    cu_q, cu_k = _cu(configs[0][0]), _cu(configs[0][1])
    sizes = (cu_q, cu_k, 200, 200)  # bounds of every length below
    for lengths_q, lengths_k in configs:
        cu_q[...], cu_k[...] = _cu(lengths_q), _cu(lengths_k)
        for a in (q, k, v, dout):
            a[...] = randn(rng, a.shape, "bfloat16")
        host = [to_host64(a) for a in (q, k, v, dout)] + [cupy.asnumpy(cu_q), cupy.asnumpy(cu_k)]
        poison_pool((q.shape, q.dtype), ((4, q.shape[0]), cupy.float32))
        out, lse = flashcupy.flash_attn_varlen_func(q, k, v, *sizes, causal=causal, return_lse=True,
                                                    check_cu_seqlens=False)
        ref_out, ref_lse = attention_varlen_ref(*host[:3], *host[4:], causal=causal)
        assert rel_err(to_host64(out), ref_out) < REL_TOL["bfloat16"], lengths_q
        check_lse(lse, ref_lse)
        refs = attention_varlen_bwd_ref(host[3], *host[:3], *host[4:], causal=causal)
        for _ in range(2):  # the second call with these out and lse is kept
            poison_pool((q.shape, q.dtype), (k.shape, k.dtype), (v.shape, v.dtype), (q.shape, cupy.float32))
            grads = flashcupy.flash_attn_varlen_backward(dout, q, k, v, out, lse, *sizes, causal=causal,
                                                         check_cu_seqlens=False)
            check_grads(grads, refs, "bfloat16", f"lengths {lengths_q}")
    # described: the first forward, and the first backward over each forward's out and LSE
    assert len(described) == 3
