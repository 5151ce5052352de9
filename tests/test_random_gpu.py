"""Random combinations of every option, drawn from a seed per case, on the GPU against the float64
reference: the forward and the backward on every family that serves the problem (dense and packed
varlen batches), and flash_attn_with_kvcache. The enumerated tests pin each option; these reach the
combinations between them (head dims 96 and 192, strided inputs, GQA with windows and score mods,
paged caches with rotary and sinks, ...)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from gpu_helpers import (REL_TOL, check_grads, check_grads_per_sequence, check_lse, poison_pool, randn, rel_err,
                         requires_gpu, serving_families, to_host64)

pytestmark = requires_gpu

LENGTHS = (1, 17, 63, 127, 129, 200, 333, 517, 700)
# FLASHCUPY_RANDOM_ROUNDS=n draws n times as many cases (the first round's are always the same);
# each test draws from its own seed sequences, ([test, seed]), so no two tests share a draw.
ROUNDS = int(os.environ.get("FLASHCUPY_RANDOM_ROUNDS", "1"))
HEAD_DIMS = (32, 64, 96, 128, 192, 256)


def _band_options(rng) -> dict:
    """causal, a window (one side may be open), or neither; either alignment."""
    kind = rng.integers(3)
    options = {"alignment": str(rng.choice(["bottom_right", "top_left"]))}
    if kind == 1:
        options["causal"] = True
    elif kind == 2:
        sides = [-1, 0, 5, 100, 300]
        options["window_size"] = (int(rng.choice(sides)), int(rng.choice(sides)))
    return options


def _score_options(rng, batch: int, nheads: int) -> dict:
    import cupy

    options = {}
    if rng.random() < 0.3:
        options["softcap"] = float(rng.uniform(1.0, 10.0))
    if rng.random() < 0.3:
        shape = (nheads,) if rng.random() < 0.5 else (batch, nheads)
        options["alibi_slopes"] = cupy.asarray(rng.uniform(0.01, 0.3, shape).astype(np.float32))
    if rng.random() < 0.3:
        options["sinks"] = cupy.asarray(rng.uniform(-1.0, 3.0, (nheads,)).astype(np.float32))
    return options


def _host_options(options: dict) -> dict:
    import cupy

    return {n: cupy.asnumpy(a).astype(np.float64) if isinstance(a, cupy.ndarray) else a for n, a in options.items()}


def _heads(rng) -> tuple:
    nheads_k = int(rng.choice([1, 2, 3]))
    return nheads_k * int(rng.choice([1, 2, 4])), nheads_k


def _maybe_strided(rng, x):
    """x, or a copy of it seen through a wider buffer (more heads, or a padded head dim): strides of
    its own, the last dimension contiguous."""
    import cupy

    if rng.random() < 0.5:
        return x
    b, s, h, d = x.shape
    wide = cupy.full((b, s, h + 1, d + 8), np.nan, dtype=x.dtype)
    view = wide[:, :, 1:, 8:] if rng.random() < 0.5 else wide[:, :, :h, :d]  # bases 16-byte aligned
    view[...] = x
    return view


@pytest.mark.parametrize("seed", range(96 * ROUNDS))
def test_random_dense(seed):
    import cupy

    import flashcupy
    from flashcupy.reference import attention_bwd_ref, attention_ref

    rng = np.random.default_rng([1, seed])
    dtype_name = str(rng.choice(["float16", "bfloat16"]))
    head_dim = int(rng.choice(HEAD_DIMS))
    batch = int(rng.integers(1, 4))
    seqlen_q, seqlen_k = (int(rng.choice(LENGTHS)) for _ in range(2))
    nheads, nheads_k = _heads(rng)
    q = _maybe_strided(rng, randn(rng, (batch, seqlen_q, nheads, head_dim), dtype_name))
    k, v = (_maybe_strided(rng, randn(rng, (batch, seqlen_k, nheads_k, head_dim), dtype_name)) for _ in range(2))
    dout = randn(rng, (batch, seqlen_q, nheads, head_dim), dtype_name)
    options = {**_band_options(rng), **_score_options(rng, batch, nheads)}
    label = f"d={head_dim} {dtype_name} b={batch} {seqlen_q}x{seqlen_k} h={nheads}/{nheads_k} {sorted(options)}"
    host = [to_host64(a) for a in (q, k, v, dout)]
    host_options = _host_options(options)
    ref_out, ref_lse = attention_ref(*host[:3], **host_options)

    for backend in serving_families("fwd", q, k, **options):
        poison_pool((q.shape, q.dtype), ((batch, nheads, seqlen_q), cupy.float32))
        out, lse = flashcupy.flash_attn_func(q, k, v, return_lse=True, backend=backend, **options)
        out_h = to_host64(out)
        assert not np.isnan(out_h).any(), (label, backend, "unwritten or NaN output")
        assert rel_err(out_h, ref_out) < REL_TOL[dtype_name], (label, backend, rel_err(out_h, ref_out))
        check_lse(lse, ref_lse)

    refs = attention_bwd_ref(host[3], *host[:3], **host_options)
    # with sinks, the gradients' bounds from those of D taken from the rounded output (check_grads)
    plain = attention_bwd_ref(host[3], *host[:3], out=to_host64(out), **host_options) if "sinks" in options else None
    deterministic = bool(rng.random() < 0.3)
    for backend in serving_families("bwd", q, k, deterministic=deterministic, **options):
        poison_pool((q.shape, q.dtype), (k.shape, k.dtype), (v.shape, v.dtype), (q.shape, cupy.float32))
        grads = flashcupy.flash_attn_backward(dout, q, k, v, out, lse, deterministic=deterministic, backend=backend,
                                              **options)
        check_grads(grads, refs, dtype_name, f"{label} {backend} deterministic={deterministic}", plain)


@pytest.mark.parametrize("seed", range(48 * ROUNDS))
def test_random_varlen(seed):
    import cupy

    import flashcupy
    from flashcupy.reference import attention_varlen_bwd_ref, attention_varlen_ref

    rng = np.random.default_rng([2, seed])
    dtype_name = str(rng.choice(["float16", "bfloat16"]))
    head_dim = int(rng.choice(HEAD_DIMS))
    batch = int(rng.integers(1, 6))
    lengths_q = [int(rng.choice((0,) + LENGTHS)) for _ in range(batch)]
    lengths_k = lengths_q if rng.random() < 0.5 else [int(rng.choice((0,) + LENGTHS)) for _ in range(batch)]
    lengths_q[-1], lengths_k[-1] = max(lengths_q[-1], 1), max(lengths_k[-1], 1)  # not all empty
    nheads, nheads_k = _heads(rng)
    q = randn(rng, (sum(lengths_q), nheads, head_dim), dtype_name)
    k, v = (randn(rng, (sum(lengths_k), nheads_k, head_dim), dtype_name) for _ in range(2))
    dout = randn(rng, q.shape, dtype_name)
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(n)]).astype(np.int32) for n in (lengths_q, lengths_k))
    options = {**_band_options(rng), **_score_options(rng, batch, nheads)}
    label = f"d={head_dim} {dtype_name} {lengths_q}x{lengths_k} h={nheads}/{nheads_k} {sorted(options)}"
    sizes = (cupy.asarray(cu_q), cupy.asarray(cu_k), max(lengths_q), max(lengths_k))
    host = [to_host64(a) for a in (q, k, v, dout)]
    host_options = _host_options(options)
    ref_out, ref_lse = attention_varlen_ref(*host[:3], cu_q, cu_k, **host_options)

    for backend in serving_families("fwd", q[None], k[None], varlen=True, **options):
        poison_pool((q.shape, q.dtype), ((nheads, q.shape[0]), cupy.float32))
        out, lse = flashcupy.flash_attn_varlen_func(q, k, v, *sizes, return_lse=True, backend=backend, **options)
        out_h = to_host64(out)
        for b in range(batch):
            rows = slice(cu_q[b], cu_q[b + 1])
            assert not np.isnan(out_h[rows]).any(), (label, backend, b, "unwritten or NaN output")
            assert rel_err(out_h[rows], ref_out[rows]) < REL_TOL[dtype_name], (label, backend, b)
        check_lse(lse, ref_lse)

    refs = attention_varlen_bwd_ref(host[3], *host[:3], cu_q, cu_k, **host_options)
    plain = None
    if "sinks" in options:  # as in test_random_dense
        plain = attention_varlen_bwd_ref(host[3], *host[:3], cu_q, cu_k, out=to_host64(out), **host_options)
    deterministic = bool(rng.random() < 0.3)
    for backend in serving_families("bwd", q[None], k[None], varlen=True, deterministic=deterministic, **options):
        poison_pool((q.shape, q.dtype), (k.shape, k.dtype), (v.shape, v.dtype), (q.shape, cupy.float32))
        grads = flashcupy.flash_attn_varlen_backward(dout, q, k, v, out, lse, *sizes, deterministic=deterministic,
                                                     backend=backend, **options)
        check_grads_per_sequence(grads, refs, cu_q, cu_k, dtype_name, f"{label} {backend}", plain)
        if "sinks" in options:
            check_grads(grads, refs, dtype_name, f"{label} {backend}", plain)


@pytest.mark.parametrize("seed", range(80 * ROUNDS))
def test_random_kvcache(seed):
    from test_kvcache_gpu import run_case

    rng = np.random.default_rng([3, seed])
    batch = int(rng.integers(1, 5))
    nheads, nheads_k = _heads(rng)
    head_dim = int(rng.choice(HEAD_DIMS))
    capacity = int(rng.choice([33, 128, 300, 700]))
    seqlen_new = int(rng.choice([0, 0, 1, 3]))
    seqlen_q = int(rng.choice([1, 1, 2, 5, 40]))
    seqlens = rng.integers(0, capacity - seqlen_new + 1, batch)
    seqlens[rng.integers(batch)] = capacity - seqlen_new  # one cache full
    page_size = None if rng.random() < 0.4 else int(rng.choice([1, 7, 16, 17, 64, 256]))
    # rotary tables go with appended keys only
    rotary_dim = int(rng.choice([16, head_dim])) if seqlen_new and rng.random() < 0.5 else None
    band = _band_options(rng)
    band.pop("alignment")  # the cache's masks are aligned to the bottom right
    options = {**band, **_score_options(rng, batch, nheads)}
    run_case(rng, batch=batch, seqlen_q=seqlen_q, nheads=nheads, nheads_k=nheads_k, head_dim=head_dim,
             dtype_name=str(rng.choice(["float16", "bfloat16"])), capacity=capacity, seqlens=seqlens,
             seqlen_new=seqlen_new, page_size=page_size, rotary_dim=rotary_dim,
             interleaved=bool(rng.random() < 0.5), num_splits=int(rng.choice([0, 0, 1, 2, 3, 8, 64])), **options)
