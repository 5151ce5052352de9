"""Public entry points of flashcupy."""

from __future__ import annotations

import math

import numpy as np

from . import build, configs, launch
from .device import device_info
from .validation import (ArraySpec, check_backward_inputs, check_band, check_forward_inputs,
                         check_pointer_alignment, dtype_name)

_DLPACK_CPU = 1
LOG2E = math.log2(math.e)


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


def flash_attn_func(q, k, v, softmax_scale=None, causal=False, window_size=(-1, -1), alignment="bottom_right",
                    return_lse=False):
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
        window_size: (left, right) local attention: row i sees keys i + offset - left to
            i + offset + right (offset = seqlen_k - seqlen_q, or 0 with alignment="top_left"); -1
            leaves a side unbounded. Blocks outside the band are skipped, not masked. With causal,
            right is 0. E.g. seqlen_q = seqlen_k = 5, window_size=(1, 1):
                1 1 0 0 0
                1 1 1 0 0
                0 1 1 1 0
                0 0 1 1 1
                0 0 0 1 1
        alignment: "bottom_right" (default, as flash-attn) or "top_left" (as PyTorch SDPA and
            JAX): where the causal diagonal and the window sit when seqlen_q != seqlen_k. With
            seqlen_q = 2, seqlen_k = 5, causal=True, "top_left" gives
                1 0 0 0 0
                1 1 0 0 0
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
    check_band(causal, window_size, alignment)
    batch, seqlen_q, nheads, head_dim = q.shape
    seqlen_k, nheads_k = k.shape[1], k.shape[2]
    band = launch.plan_band(causal, window_size, alignment, seqlen_q, seqlen_k)
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
            variant = configs.fwd_variant(head_dim, dtype_name(q.dtype), band.mask, info.capability,
                                          info.smem_per_block_optin)
            kernel = build.get_kernel(variant)
            plan = launch.plan_forward(variant, batch, nheads, seqlen_q)
            kernel(plan.grid, plan.block,
                   (q, k, v, out, lse,
                    np.int32(seqlen_q), np.int32(seqlen_k), np.int32(nheads), np.int32(nheads // nheads_k),
                    *_row_strides(q, k, v, out), *band.kernel_args(), np.float32(scale), np.float32(scale * LOG2E)),
                   shared_mem=plan.smem_bytes)
    return (out, lse) if return_lse else out


def flash_attn_backward(dout, q, k, v, out, softmax_lse, softmax_scale=None, causal=False,
                        deterministic=False, dq=None, dk=None, dv=None, window_size=(-1, -1),
                        alignment="bottom_right"):
    """Gradients of flash_attn_func's output with respect to q, k and v (FlashAttention-2 backward).

    Arguments:
        dout: gradient of the loss with respect to `out`, shape and dtype of q.
        q, k, v, out, softmax_lse: the forward's inputs and results (`flash_attn_func(...,
            return_lse=True)`); softmax_scale, causal, window_size and alignment as given to the
            forward.
        deterministic: add the per-key-block contributions to dq in a fixed order, so two runs
            give identical bits (slower; the default adds them with float32 atomics).
        dq, dk, dv: optional output arrays (shape and dtype of q, k, v) written in place.

    Returns:
        (dq, dk, dv) in the dtypes and shapes of q, k, v. With fewer kv heads than query heads
        (GQA/MQA), dk and dv are summed over the query heads of each group.

    Extra device memory is O(seqlen): D = rowsum(dout * out) and a float32 dq accumulator (and,
    under GQA, per-query-head dk, dv before the group sum). Runs on CuPy's current stream.
    """
    import cupy

    dout, q, k, v, out, softmax_lse = (as_device_array(a, n) for a, n in (
        (dout, "dout"), (q, "q"), (k, "k"), (v, "v"), (out, "out"), (softmax_lse, "softmax_lse")))
    grads = {n: as_device_array(a, n) for n, a in (("dq", dq), ("dk", dk), ("dv", dv)) if a is not None}
    check_backward_inputs(*(ArraySpec.of(a) for a in (dout, q, k, v, out, softmax_lse)), softmax_scale,
                          {n: ArraySpec.of(a) for n, a in grads.items()})
    check_band(causal, window_size, alignment)
    batch, seqlen_q, nheads, head_dim = q.shape
    seqlen_k, nheads_k = k.shape[1], k.shape[2]
    band = launch.plan_band(causal, window_size, alignment, seqlen_q, seqlen_k)
    scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)

    with q.device:
        dq = grads.get("dq", None)
        dk = grads.get("dk", None)
        dv = grads.get("dv", None)
        dq = cupy.empty(q.shape, q.dtype) if dq is None else dq
        dk = cupy.empty(k.shape, k.dtype) if dk is None else dk
        dv = cupy.empty(v.shape, v.dtype) if dv is None else dv
        if dq.size == 0 or dk.size == 0:  # no query or no key: every gradient is zero
            for g in (dq, dk, dv):
                g.fill(0)
            return dq, dk, dv
        for name, a in (("dout", dout), ("q", q), ("k", k), ("v", v), ("out", out), ("dq", dq), ("dk", dk),
                        ("dv", dv)):
            check_pointer_alignment(name, a.data.ptr)
        info = device_info(q.device.id)
        dtype = dtype_name(q.dtype)
        variant = configs.bwd_variant(head_dim, dtype, band.mask, deterministic, info.capability,
                                      info.smem_per_block_optin)
        plans = launch.plan_backward(variant, batch, nheads, seqlen_q, seqlen_k)

        # 1. D = rowsum(dO * O), and the float32 dQ accumulator zeroed
        delta = cupy.empty((batch, nheads, seqlen_q), cupy.float32)
        dq_accum = cupy.empty((batch, seqlen_q, nheads, head_dim), cupy.float32)
        pre = configs.BwdHelperVariant("flash_bwd_preprocess_kernel", head_dim, dtype)
        build.get_kernel(pre)(plans.preprocess.grid, plans.preprocess.block,
                              (dout, out, delta, dq_accum, np.int32(seqlen_q), np.int32(nheads), np.int32(batch),
                               *_row_strides(dout, out)))
        # 2. dK, dV per key block; dQ added into the accumulator. Under GQA each query head writes
        # its own dK, dV slice, summed over the group afterwards.
        semaphore = cupy.zeros(plans.semaphores if deterministic else 1, cupy.int32)
        grouped = nheads != nheads_k
        dk_heads = cupy.empty((batch, seqlen_k, nheads, head_dim), q.dtype) if grouped else dk
        dv_heads = cupy.empty((batch, seqlen_k, nheads, head_dim), q.dtype) if grouped else dv
        build.get_kernel(variant)(plans.main.grid, plans.main.block,
                                  (q, k, v, dout, softmax_lse, delta, dq_accum, dk_heads, dv_heads, semaphore,
                                   np.int32(seqlen_q), np.int32(seqlen_k), np.int32(nheads),
                                   np.int32(nheads // nheads_k),
                                   *_row_strides(q, k, v, dout, dk_heads, dv_heads), *band.kernel_args(),
                                   np.float32(scale), np.float32(scale * LOG2E)),
                                  shared_mem=plans.main.smem_bytes)
        # 3. dQ = dq_accum * softmax_scale, in the input dtype
        conv = configs.BwdHelperVariant("flash_bwd_convert_dq_kernel", head_dim, dtype)
        build.get_kernel(conv)(plans.convert_dq.grid, plans.convert_dq.block,
                               (dq_accum, dq, np.int32(seqlen_q), np.int32(nheads), np.int32(batch),
                                *_row_strides(dq), np.float32(scale)))
        if grouped:
            group = nheads // nheads_k
            for g_heads, g in ((dk_heads, dk), (dv_heads, dv)):
                # float32 sum over the group, one query head at a time (no float32 copy of g_heads)
                per_head = g_heads.reshape(batch, seqlen_k, nheads_k, group, head_dim)
                summed = per_head[:, :, :, 0].astype(cupy.float32)
                for member in range(1, group):
                    summed += per_head[:, :, :, member]
                g[...] = summed.astype(q.dtype)
    return dq, dk, dv


class FlashAttention:
    """Forward and backward of attention for pipelines without an autograd engine.

    `forward(q, k, v)` returns the output and keeps what the backward needs (q, k, v, out and the
    LSE: O(seqlen) memory, never the attention matrix); `backward(dout)` returns (dq, dk, dv).

        attn = FlashAttention(causal=True)
        out = attn.forward(q, k, v)
        dq, dk, dv = attn.backward(dout)
    """

    def __init__(self, softmax_scale=None, causal=False, deterministic=False, window_size=(-1, -1),
                 alignment="bottom_right"):
        from .validation import check_softmax_scale

        check_softmax_scale(softmax_scale)
        check_band(causal, window_size, alignment)
        self.softmax_scale = softmax_scale
        self.causal = causal
        self.deterministic = deterministic
        self.window_size = tuple(window_size)
        self.alignment = alignment
        self.saved = None  # (q, k, v, out, softmax_lse) of the last forward

    def forward(self, q, k, v):
        q, k, v = (as_device_array(a, n) for a, n in ((q, "q"), (k, "k"), (v, "v")))
        out, lse = flash_attn_func(q, k, v, softmax_scale=self.softmax_scale, causal=self.causal,
                                   window_size=self.window_size, alignment=self.alignment, return_lse=True)
        self.saved = (q, k, v, out, lse)
        return out

    def backward(self, dout, dq=None, dk=None, dv=None):
        if self.saved is None:
            raise RuntimeError("FlashAttention.backward needs a forward first (or the saved arrays were released)")
        q, k, v, out, lse = self.saved
        return flash_attn_backward(dout, q, k, v, out, lse, softmax_scale=self.softmax_scale, causal=self.causal,
                                   deterministic=self.deterministic, dq=dq, dk=dk, dv=dv,
                                   window_size=self.window_size, alignment=self.alignment)

    def release(self):
        """Drop the arrays kept for the backward."""
        self.saved = None


def _row_strides(*arrays):
    """(batch, seqlen, head) element strides of each array, as the kernels take them."""
    return [np.int64(s) for a in arrays for s in ArraySpec.of(a).strides[:3]]
