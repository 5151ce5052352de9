"""Public entry points of flashcupy."""

from __future__ import annotations

import math

import numpy as np

from . import build, configs, launch
from .device import device_info
from .validation import ArraySpec, check_forward_inputs, check_pointer_alignment, dtype_name

_DLPACK_CPU = 1


def as_device_array(x, name: str):
    """A CuPy view of `x` without copying: CuPy arrays as they are, other CUDA arrays through
    DLPack or ``__cuda_array_interface__``. Host arrays are refused with a TypeError."""
    import cupy

    if isinstance(x, cupy.ndarray):
        return x
    if isinstance(x, np.ndarray):
        raise TypeError(f"{name} is a NumPy (host) array; flashcupy runs on the GPU: move it there "
                        f"with cupy.asarray({name})")
    if hasattr(x, "__dlpack__") and hasattr(x, "__dlpack_device__"):
        if x.__dlpack_device__()[0] == _DLPACK_CPU:
            raise TypeError(f"{name} lives in host memory ({type(x).__name__}); flashcupy runs on the GPU: "
                            f"move it there with cupy.asarray({name})")
        return cupy.from_dlpack(x)
    if hasattr(x, "__cuda_array_interface__"):
        return cupy.asarray(x)
    raise TypeError(f"{name} must be a CuPy array or a CUDA array that supports DLPack or "
                    f"__cuda_array_interface__; got {type(x).__name__}")


def flash_attn_func(q, k, v, softmax_scale=None, causal=False, return_lse=False):
    """Exact attention softmax(q k^T * softmax_scale) v with the FlashAttention-2 forward kernel.

    Arguments:
        q: (batch, seqlen_q, nheads, headdim), float16 or bfloat16, on the GPU.
        k, v: (batch, seqlen_k, nheads_k, headdim), same dtype and device; nheads_k divides
            nheads (query head h reads kv head h // (nheads // nheads_k)).
            Any strides, provided the last dimension is contiguous; nothing is copied.
        softmax_scale: float > 0; default 1 / sqrt(headdim).
        causal: mask keys right of the diagonal, aligned to the bottom-right corner as in
            flash-attn >= 2.1. With seqlen_q = 2, seqlen_k = 5 (1 = attended):
                1 1 1 1 0
                1 1 1 1 1
            and with seqlen_q = 5, seqlen_k = 2 the first three rows see no key at all:
                0 0
                0 0
                0 0
                1 0
                1 1
            Such rows give output 0 and LSE -inf.
        return_lse: also return softmax_lse.

    Returns:
        out: (batch, seqlen_q, nheads, headdim) in q's dtype, and with return_lse=True also
        softmax_lse: float32 (batch, nheads, seqlen_q), natural-log sum of exp of scaled scores.

    Head dims 32, 64, 96, 128, 192 and 256 are supported, on GPUs of compute capability >= 8.0.
    The kernel runs on CuPy's current stream; nothing synchronizes the device.
    """
    import cupy

    q, k, v = (as_device_array(a, n) for a, n in ((q, "q"), (k, "k"), (v, "v")))
    check_forward_inputs(ArraySpec.of(q), ArraySpec.of(k), ArraySpec.of(v), softmax_scale)
    batch, seqlen_q, nheads, head_dim = q.shape
    seqlen_k, nheads_k = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)

    with q.device:
        out = cupy.empty((batch, seqlen_q, nheads, head_dim), dtype=q.dtype)
        lse = cupy.empty((batch, nheads, seqlen_q), dtype=cupy.float32)
        if out.size == 0:
            pass  # batch, seqlen_q or nheads is 0: nothing to compute, no launch
        elif seqlen_k == 0:
            out.fill(0)  # no key to attend: the convention for rows that see no key
            lse.fill(-np.inf)
        else:
            for name, a in (("q", q), ("k", k), ("v", v)):
                check_pointer_alignment(name, a.data.ptr)
            info = device_info(q.device.id)
            variant = configs.fwd_variant(head_dim, dtype_name(q.dtype), causal, info.capability,
                                          info.smem_per_block_optin)
            kernel = build.get_kernel(variant)
            plan = launch.plan_forward(variant, batch, nheads, seqlen_q)
            qs, ks, vs, os_ = (ArraySpec.of(a).strides for a in (q, k, v, out))
            kernel(plan.grid, plan.block,
                   (q, k, v, out, lse,
                    np.int32(seqlen_q), np.int32(seqlen_k), np.int32(nheads), np.int32(nheads // nheads_k),
                    *(np.int64(s) for s in qs[:3]), *(np.int64(s) for s in ks[:3]),
                    *(np.int64(s) for s in vs[:3]), *(np.int64(s) for s in os_[:3]),
                    np.float32(scale), np.float32(scale * math.log2(math.e))),
                   shared_mem=plan.smem_bytes)
    return (out, lse) if return_lse else out
