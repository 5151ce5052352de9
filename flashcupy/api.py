"""Public entry points of flashcupy."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from . import build, configs, launch
from .device import device_info
from .validation import (ArraySpec, check_backward_inputs, check_band, check_cu_seqlens, check_cu_seqlens_values,
                         check_forward_inputs, check_pointer_alignment, check_score_mods, check_varlen_layout,
                         dtype_name)

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
                    softcap=0.0, alibi_slopes=None, sinks=None, return_lse=False):
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
        softcap: float >= 0; with softcap > 0 each scaled score s becomes softcap * tanh(s / softcap)
            (Gemma 2, Grok), before ALiBi and the mask. 0 (default) turns it off.
        alibi_slopes: optional float32 (nheads,) or (batch, nheads) on the GPU: adds
            -slope * |i + offset - j| to the scaled score of row i and key j, with the band's offset
            (seqlen_k - seqlen_q for "bottom_right", 0 for "top_left").
        sinks: optional float32 (nheads,) on the GPU: a learnable sink logit per query head that joins
            every row's softmax denominator, sum_j exp(s_ij) + exp(sink), as gpt-oss does. A row with
            no visible key then has output 0 and LSE = sink.
        return_lse: also return softmax_lse.

    Returns:
        out: (batch, seqlen_q, nheads, headdim) in q's dtype, and with return_lse=True also
        softmax_lse: float32 (batch, nheads, seqlen_q), natural-log sum of exp of scaled scores.

    Head dims 32, 64, 96, 128, 192 and 256 are supported, on GPUs of compute capability >= 8.0.
    The kernel runs on CuPy's current stream; nothing synchronizes the device.
    """
    q, k, v = _device_arrays(q=q, k=k, v=v)
    check_forward_inputs(ArraySpec.of(q), ArraySpec.of(k), ArraySpec.of(v), softmax_scale)
    problem = _Problem.padded(q, k, softmax_scale, causal, window_size, alignment, softcap, alibi_slopes, sinks)
    return _forward(problem, q, k, v, return_lse)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=None,
                           causal=False, window_size=(-1, -1), alignment="bottom_right", softcap=0.0,
                           alibi_slopes=None, sinks=None, return_lse=False, check_cu_seqlens=True):
    """flash_attn_func over a batch of variable-length sequences packed without padding.

    Arguments:
        q: (total_q, nheads, headdim): the rows of every sequence, one sequence after another.
        k, v: (total_k, nheads_k, headdim), packed the same way.
        cu_seqlens_q, cu_seqlens_k: int32 (batch + 1,) on the GPU, cumulative lengths: sequence b
            is rows cu_seqlens_q[b]:cu_seqlens_q[b + 1] of q and keys cu_seqlens_k[b]:cu_seqlens_k[b + 1]
            of k, v. Sequences of length 0 are allowed.
        max_seqlen_q, max_seqlen_k: ints, at least the longest sequence's lengths (they size the grid).
        check_cu_seqlens: verify that cu_seqlens start at 0, never decrease, end at total_q / total_k
            and respect max_seqlen (a device-to-host copy of 2 x (batch + 1) ints, which waits for
            the stream); pass False in a hot loop once the inputs are known good.
        The other options as in flash_attn_func, applied to each sequence on its own (causal and
        window alignment use that sequence's seqlen_q and seqlen_k; alibi_slopes of shape
        (batch, nheads) give each sequence its row).

    Returns:
        out: (total_q, nheads, headdim), and with return_lse=True softmax_lse: float32 (nheads, total_q).
    """
    q, k, v, cu_seqlens_q, cu_seqlens_k = _device_arrays(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q,
                                                         cu_seqlens_k=cu_seqlens_k)
    check_varlen_layout(ArraySpec.of(q), ArraySpec.of(k), ArraySpec.of(v))
    check_forward_inputs(ArraySpec.of(q[None]), ArraySpec.of(k[None]), ArraySpec.of(v[None]), softmax_scale)
    problem = _Problem.varlen(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, check_cu_seqlens,
                              softmax_scale, causal, window_size, alignment, softcap, alibi_slopes, sinks)
    return _forward(problem, q, k, v, return_lse)


def flash_attn_backward(dout, q, k, v, out, softmax_lse, softmax_scale=None, causal=False,
                        deterministic=False, dq=None, dk=None, dv=None, window_size=(-1, -1),
                        alignment="bottom_right", softcap=0.0, alibi_slopes=None, sinks=None):
    """Gradients of flash_attn_func's output with respect to q, k and v (FlashAttention-2 backward).

    Arguments:
        dout: gradient of the loss with respect to `out`, shape and dtype of q.
        q, k, v, out, softmax_lse: the forward's inputs and results (`flash_attn_func(...,
            return_lse=True)`); softmax_scale, causal, window_size, alignment, softcap,
            alibi_slopes and sinks as given to the forward.
        deterministic: add the per-key-block contributions to dq in a fixed order, so two runs
            give identical bits (slower; the default adds them with float32 atomics).
        dq, dk, dv: optional output arrays (shape and dtype of q, k, v) written in place.

    Returns:
        (dq, dk, dv) in the dtypes and shapes of q, k, v; with sinks also dsinks, float32 (nheads,).
        With fewer kv heads than query heads (GQA/MQA), dk and dv are summed over the query heads
        of each group.

    Extra device memory is O(seqlen): D = rowsum(dout * out) and a float32 dq accumulator (and,
    under GQA, per-query-head dk, dv before the group sum). Runs on CuPy's current stream.
    """
    dout, q, k, v, out, softmax_lse = _device_arrays(dout=dout, q=q, k=k, v=v, out=out, softmax_lse=softmax_lse)
    grads = _output_arrays(dq=dq, dk=dk, dv=dv)
    check_backward_inputs(*(ArraySpec.of(a) for a in (dout, q, k, v, out, softmax_lse)), softmax_scale,
                          {n: ArraySpec.of(a) for n, a in grads.items()})
    problem = _Problem.padded(q, k, softmax_scale, causal, window_size, alignment, softcap, alibi_slopes, sinks)
    return _backward(problem, dout, q, k, v, out, softmax_lse, deterministic, grads)


def flash_attn_varlen_backward(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                               max_seqlen_k, softmax_scale=None, causal=False, deterministic=False, dq=None,
                               dk=None, dv=None, window_size=(-1, -1), alignment="bottom_right", softcap=0.0,
                               alibi_slopes=None, sinks=None, check_cu_seqlens=True):
    """flash_attn_backward for flash_attn_varlen_func: packed (total, nheads, headdim) arrays,
    softmax_lse (nheads, total_q), and the forward's cu_seqlens and max_seqlen. Returns (dq, dk, dv),
    with sinks also dsinks."""
    dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k = _device_arrays(
        dout=dout, q=q, k=k, v=v, out=out, softmax_lse=softmax_lse, cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k)
    grads = _output_arrays(dq=dq, dk=dk, dv=dv)
    check_varlen_layout(ArraySpec.of(q), ArraySpec.of(k), ArraySpec.of(v))
    if softmax_lse.ndim != 2:
        raise ValueError(f"softmax_lse must have shape (nheads, total_q) for varlen; got {softmax_lse.shape}")
    check_backward_inputs(*(ArraySpec.of(a[None]) for a in (dout, q, k, v, out, softmax_lse)), softmax_scale,
                          {n: ArraySpec.of(a[None]) for n, a in grads.items()})
    problem = _Problem.varlen(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, check_cu_seqlens,
                              softmax_scale, causal, window_size, alignment, softcap, alibi_slopes, sinks)
    return _backward(problem, dout, q, k, v, out, softmax_lse, deterministic, grads)


@dataclass(frozen=True)
class _Problem:
    """What every launch needs besides the tensors: sizes, where sequences live, mask, score mods."""

    batch: int
    max_seqlen_q: int
    max_seqlen_k: int
    nheads: int
    nheads_k: int
    head_dim: int
    scale: float
    band: launch.Band
    cu_seqlens_q: object  # CuPy int32 arrays (varlen) or None (padded)
    cu_seqlens_k: object
    softcap: float
    alibi_slopes: object  # CuPy float32 or None
    sinks: object

    @classmethod
    def padded(cls, q, k, softmax_scale, causal, window_size, alignment, softcap, alibi_slopes, sinks):
        batch, seqlen_q, nheads, head_dim = q.shape
        return cls._make(q, batch, seqlen_q, k.shape[1], nheads, k.shape[2], head_dim, None, None, softmax_scale,
                         causal, window_size, alignment, softcap, alibi_slopes, sinks)

    @classmethod
    def varlen(cls, q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, check_values, softmax_scale,
               causal, window_size, alignment, softcap, alibi_slopes, sinks):
        import cupy

        batch = check_cu_seqlens(ArraySpec.of(cu_seqlens_q), ArraySpec.of(cu_seqlens_k), max_seqlen_q,
                                 max_seqlen_k, q.device.id)
        if check_values:
            for name, cu, total, longest in (("cu_seqlens_q", cu_seqlens_q, q.shape[0], max_seqlen_q),
                                             ("cu_seqlens_k", cu_seqlens_k, k.shape[0], max_seqlen_k)):
                check_cu_seqlens_values(name, cupy.asnumpy(cu), total, int(longest))
        return cls._make(q, batch, int(max_seqlen_q), int(max_seqlen_k), q.shape[1], k.shape[1], q.shape[2],
                         cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, window_size, alignment, softcap,
                         alibi_slopes, sinks)

    @classmethod
    def _make(cls, q, batch, max_seqlen_q, max_seqlen_k, nheads, nheads_k, head_dim, cu_q, cu_k, softmax_scale,
              causal, window_size, alignment, softcap, alibi_slopes, sinks):
        check_band(causal, window_size, alignment)
        alibi_slopes, sinks = (None if a is None else as_device_array(a, n)
                               for a, n in ((alibi_slopes, "alibi_slopes"), (sinks, "sinks")))
        check_score_mods(softcap, None if alibi_slopes is None else ArraySpec.of(alibi_slopes),
                         None if sinks is None else ArraySpec.of(sinks), batch, nheads, q.device.id)
        band = launch.plan_band(causal, window_size, alignment, max_seqlen_q, max_seqlen_k)
        scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)
        return cls(batch, max_seqlen_q, max_seqlen_k, nheads, nheads_k, head_dim, scale, band, cu_q, cu_k,
                   float(softcap), alibi_slopes, sinks)

    @property
    def score_mod(self) -> bool:
        return self.softcap > 0 or self.alibi_slopes is not None

    @property
    def is_varlen(self) -> bool:
        return self.cu_seqlens_q is not None

    def lse_shape(self, total_q: int) -> tuple:
        return (self.nheads, total_q) if self.is_varlen else (self.batch, self.nheads, self.max_seqlen_q)

    def sequence_args(self) -> tuple:
        """cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, nheads, heads per kv head."""
        return (_pointer(self.cu_seqlens_q), _pointer(self.cu_seqlens_k), np.int32(self.max_seqlen_q),
                np.int32(self.max_seqlen_k), np.int32(self.nheads), np.int32(self.nheads // self.nheads_k))

    def lse_strides(self, lse) -> tuple:
        """(batch, head) element strides of the LSE (and D) layout."""
        return (np.int64(0), np.int64(lse.shape[1])) if self.is_varlen else (
            np.int64(self.nheads * self.max_seqlen_q), np.int64(self.max_seqlen_q))

    def mask_and_mod_args(self) -> tuple:
        """The band, then softcap, alibi_slopes and their batch stride."""
        alibi_batch_stride = self.nheads if self.alibi_slopes is not None and self.alibi_slopes.ndim == 2 else 0
        return (*self.band.kernel_args(), np.float32(self.softcap), _pointer(self.alibi_slopes),
                np.int32(alibi_batch_stride))

    def scale_args(self) -> tuple:
        return np.float32(self.scale), np.float32(self.scale * LOG2E)


def _forward(problem: _Problem, q, k, v, return_lse):
    import cupy

    with q.device:
        out = cupy.empty(q.shape, dtype=q.dtype)
        lse = cupy.empty(problem.lse_shape(q.shape[0]), dtype=cupy.float32)
        if out.size:  # else batch, seqlen_q or nheads is 0: nothing to compute, no launch
            for name, a in (("q", q), ("k", k), ("v", v)):
                check_pointer_alignment(name, a.data.ptr)
            info = device_info(q.device.id)
            variant = configs.fwd_variant(problem.head_dim, dtype_name(q.dtype), problem.band.mask, info.capability,
                                          info.smem_per_block_optin, problem.score_mod)
            plan = launch.plan_forward(variant, problem.batch, problem.nheads, problem.max_seqlen_q)
            build.get_kernel(variant)(
                plan.grid, plan.block,
                (q, k, v, out, lse, *problem.sequence_args(), *_row_strides(q, k, v, out), *problem.lse_strides(lse),
                 *problem.mask_and_mod_args(), _pointer(problem.sinks), *problem.scale_args()),
                shared_mem=plan.smem_bytes)
    return (out, lse) if return_lse else out


def _backward(problem: _Problem, dout, q, k, v, out, softmax_lse, deterministic, grads):
    import cupy

    p = problem
    with q.device:
        dq = grads["dq"] if "dq" in grads else cupy.empty(q.shape, q.dtype)
        dk = grads["dk"] if "dk" in grads else cupy.empty(k.shape, k.dtype)
        dv = grads["dv"] if "dv" in grads else cupy.empty(v.shape, v.dtype)
        if dq.size == 0 or dk.size == 0:  # no query or no key: every gradient is zero
            for g in (dq, dk, dv):
                g.fill(0)
            return (dq, dk, dv) if p.sinks is None else (dq, dk, dv, cupy.zeros(p.nheads, cupy.float32))
        for name, a in (("dout", dout), ("q", q), ("k", k), ("v", v), ("out", out), ("dq", dq), ("dk", dk),
                        ("dv", dv)):
            check_pointer_alignment(name, a.data.ptr)
        info = device_info(q.device.id)
        dtype = dtype_name(q.dtype)
        variant = configs.bwd_variant(p.head_dim, dtype, p.band.mask, deterministic, info.capability,
                                      info.smem_per_block_optin, p.score_mod)
        # The row-wise kernels (preprocess, dQ convert, GQA sum) take rows as (batch, seqlen); a packed
        # varlen batch is one sequence of all its rows.
        (rows_batch, rows_seqlen), (k_batch, k_seqlen) = (
            ((1, q.shape[0]), (1, k.shape[0])) if p.is_varlen else ((p.batch, p.max_seqlen_q), (p.batch, p.max_seqlen_k)))
        plans = launch.plan_backward(variant, p.batch, p.nheads, p.max_seqlen_q, p.max_seqlen_k, p.nheads_k,
                                     rows_q=rows_batch * rows_seqlen, rows_k=k_batch * k_seqlen)

        # 1. D = rowsum(dO * O), laid out as the LSE, and the float32 dQ accumulator zeroed
        delta = cupy.empty(softmax_lse.shape, cupy.float32)
        dq_accum = cupy.empty((*q.shape[:-1], p.head_dim), cupy.float32)
        pre = configs.BwdHelperVariant("flash_bwd_preprocess_kernel", p.head_dim, dtype)
        build.get_kernel(pre)(plans.preprocess.grid, plans.preprocess.block,
                              (dout, out, delta, dq_accum, np.int32(rows_seqlen), np.int32(p.nheads),
                               np.int32(rows_batch), *_row_strides(dout, out)))
        # 2. dK, dV per key block; dQ added into the accumulator. Under GQA each query head writes
        # its own dK, dV slice, summed over the group afterwards.
        semaphore = cupy.zeros(plans.semaphores, cupy.int32) if deterministic else None
        grouped = p.nheads != p.nheads_k
        per_head_shape = (*k.shape[:-2], p.nheads, p.head_dim)
        dk_heads = cupy.empty(per_head_shape, q.dtype) if grouped else dk
        dv_heads = cupy.empty(per_head_shape, q.dtype) if grouped else dv
        build.get_kernel(variant)(plans.main.grid, plans.main.block,
                                  (q, k, v, dout, softmax_lse, delta, dq_accum, dk_heads, dv_heads, _pointer(semaphore),
                                   *p.sequence_args(), *_row_strides(q, k, v, dout, dk_heads, dv_heads),
                                   *p.lse_strides(softmax_lse), *p.mask_and_mod_args(), *p.scale_args()),
                                  shared_mem=plans.main.smem_bytes)
        # 3. dQ = dq_accum * softmax_scale, in the input dtype
        conv = configs.BwdHelperVariant("flash_bwd_convert_dq_kernel", p.head_dim, dtype)
        build.get_kernel(conv)(plans.convert_dq.grid, plans.convert_dq.block,
                               (dq_accum, dq, np.int32(rows_seqlen), np.int32(p.nheads), np.int32(rows_batch),
                                *_row_strides(dq), np.float32(p.scale)))
        if grouped:  # 4. dK, dV of each kv head: the sum over its query heads, in one pass
            group_sum = build.get_kernel(configs.BwdHelperVariant("flash_bwd_group_sum_kernel", p.head_dim, dtype))
            for g_heads, g in ((dk_heads, dk), (dv_heads, dv)):
                group_sum(plans.group_sum.grid, plans.group_sum.block,
                          (g_heads, g, np.int64(k_batch * k_seqlen), np.int32(k_seqlen), np.int32(p.nheads_k),
                           np.int32(p.nheads // p.nheads_k), *_row_strides(g)))
        if p.sinks is None:
            return dq, dk, dv
        # d loss / d sink_h = -sum over rows of exp(sink_h - LSE) * D: the sink's share of each
        # row's denominator times the row's dO . O
        lse3, delta3 = (a if a.ndim == 3 else a[None] for a in (softmax_lse, delta))
        dsinks = -(cupy.exp(p.sinks[None, :, None] - lse3) * delta3).sum(axis=(0, 2))
    return dq, dk, dv, dsinks


class FlashAttention:
    """Forward and backward of attention for pipelines without an autograd engine.

    `forward(q, k, v)` returns the output and keeps what the backward needs (q, k, v, out and the
    LSE: O(seqlen) memory, never the attention matrix); `backward(dout)` returns (dq, dk, dv).

        attn = FlashAttention(causal=True)
        out = attn.forward(q, k, v)
        dq, dk, dv = attn.backward(dout)
    """

    def __init__(self, softmax_scale=None, causal=False, deterministic=False, window_size=(-1, -1),
                 alignment="bottom_right", softcap=0.0, alibi_slopes=None, sinks=None):
        from .validation import check_softmax_scale

        check_softmax_scale(softmax_scale)
        check_band(causal, window_size, alignment)
        self.deterministic = deterministic
        # the options both directions take; arrays (alibi_slopes, sinks) are checked at the forward
        self.options = dict(softmax_scale=softmax_scale, causal=causal, window_size=tuple(window_size),
                            alignment=alignment, softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks)
        self.saved = None  # (q, k, v, out, softmax_lse) of the last forward

    def forward(self, q, k, v):
        q, k, v = _device_arrays(q=q, k=k, v=v)
        out, lse = flash_attn_func(q, k, v, return_lse=True, **self.options)
        self.saved = (q, k, v, out, lse)
        return out

    def backward(self, dout, dq=None, dk=None, dv=None):
        """(dq, dk, dv), with sinks also dsinks."""
        if self.saved is None:
            raise RuntimeError("FlashAttention.backward needs a forward first (or the saved arrays were released)")
        q, k, v, out, lse = self.saved
        return flash_attn_backward(dout, q, k, v, out, lse, deterministic=self.deterministic, dq=dq, dk=dk, dv=dv,
                                   **self.options)

    def release(self):
        """Drop the arrays kept for the backward."""
        self.saved = None


def _row_strides(*arrays):
    """(batch, seqlen, head) element strides of each array, as the kernels take them; a packed
    varlen array (total, nheads, headdim) has batch stride 0."""
    strides = [ArraySpec.of(a).strides for a in arrays]
    return [np.int64(x) for st in strides for x in ((0, *st[:2]) if len(st) == 3 else st[:3])]


def _pointer(array):
    """An optional array as a kernel pointer argument: null when absent."""
    return np.uint64(0) if array is None else array


def _device_arrays(**arrays):
    return [as_device_array(a, name) for name, a in arrays.items()]


def _output_arrays(**arrays) -> dict:
    return {name: as_device_array(a, name) for name, a in arrays.items() if a is not None}
