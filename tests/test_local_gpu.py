"""Local attention (window_size) and the top-left alignment, forward and backward, on the GPU."""

from __future__ import annotations

import numpy as np
import pytest

from gpu_helpers import (REL_TOL, check_grads, check_lse, poison_pool, randn, rel_err, requires_gpu, serving_families,
                         to_host64)

pytestmark = requires_gpu

CASES = [  # (seqlen_q, seqlen_k, causal, window_size, alignment)
    (1000, 1000, False, (64, 64), "bottom_right"),
    (1000, 1000, True, (100, -1), "bottom_right"),
    (777, 1300, False, (-1, 33), "bottom_right"),
    (1300, 777, True, (250, 0), "bottom_right"),
    (300, 1000, True, (-1, -1), "top_left"),
    (1000, 300, True, (-1, -1), "top_left"),
    (517, 700, False, (5, 90), "top_left"),
    (700, 517, False, (0, 0), "top_left"),
    (129, 4000, False, (17, 200), "bottom_right"),
    # bands wider than several key blocks: masked steps at both edges, unmasked ones between
    (1100, 1100, False, (300, 400), "bottom_right"),
    (900, 1400, True, (700, -1), "bottom_right"),
]


@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16"])
@pytest.mark.parametrize("head_dim", [64, 96, 128, 192, 256])
@pytest.mark.parametrize("seqlen_q,seqlen_k,causal,window_size,alignment", CASES)
def test_forward_and_backward(dtype_name, head_dim, seqlen_q, seqlen_k, causal, window_size, alignment):
    import cupy

    import flashcupy
    from flashcupy.reference import attention_bwd_ref, attention_ref

    rng = np.random.default_rng(seqlen_q + 3 * seqlen_k + head_dim + causal)
    q = randn(rng, (2, seqlen_q, 4, head_dim), dtype_name)
    k, v = (randn(rng, (2, seqlen_k, 2, head_dim), dtype_name) for _ in range(2))  # GQA 4 -> 2
    dout = randn(rng, q.shape, dtype_name)
    kw = dict(causal=causal, window_size=window_size, alignment=alignment)
    poison_pool((q.shape, q.dtype), ((2, 4, seqlen_q), cupy.float32))
    out, lse = flashcupy.flash_attn_func(q, k, v, return_lse=True, **kw)
    host = [to_host64(a) for a in (q, k, v, dout)]
    ref_out, ref_lse = attention_ref(*host[:3], **kw)
    out_h = to_host64(out)
    assert not np.isnan(out_h).any()
    assert rel_err(out_h, ref_out) < REL_TOL[dtype_name]
    check_lse(lse, ref_lse)

    refs = attention_bwd_ref(host[3], *host[:3], **kw)
    for deterministic in (False, True):
        for backend in serving_families("bwd", q, k, deterministic=deterministic, **kw):  # each backward family
            poison_pool((q.shape, q.dtype), (k.shape, k.dtype), (v.shape, v.dtype), ((2, 4, seqlen_q), cupy.float32),
                        (q.shape, cupy.float32))
            grads = flashcupy.flash_attn_backward(dout, q, k, v, out, lse, deterministic=deterministic, backend=backend,
                                                  **kw)
            check_grads(grads, refs, dtype_name, f"{backend} deterministic={deterministic}")


def test_window_changes_the_result_and_validation():
    import flashcupy

    rng = np.random.default_rng(1)
    q, k, v = (randn(rng, (1, 300, 2, 64), "float16") for _ in range(3))
    full = to_host64(flashcupy.flash_attn_func(q, k, v))
    local = to_host64(flashcupy.flash_attn_func(q, k, v, window_size=(8, 8)))
    assert rel_err(local, full) > 0.1
    with pytest.raises(ValueError, match="causal=True already limits"):
        flashcupy.flash_attn_func(q, k, v, causal=True, window_size=(4, 4))
    with pytest.raises(ValueError, match="alignment must be one of"):
        flashcupy.flash_attn_func(q, k, v, alignment="center")
