"""Public entry points of flashcupy: validate, describe the problem, hand it to a kernel family."""

from __future__ import annotations

from typing import Optional, Tuple

import numpy as np

from . import registry, replay
from .device import device_info
from .problem import BACKEND_ENV, AttentionOptions, Problem, requested_backend
from .validation import (ArraySpec, check_backward_inputs, check_forward_inputs, check_pointer_alignment,
                         check_varlen_layout, dtype_name)

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


def flash_attn_func(q, k, v, softmax_scale: Optional[float] = None, causal: bool = False,
                    window_size: Tuple[int, int] = (-1, -1), alignment: str = "bottom_right", softcap: float = 0.0,
                    alibi_slopes=None, sinks=None, return_lse: bool = False, backend: Optional[str] = None):
    """Exact attention softmax(q k^T * softmax_scale) v: FlashAttention-2 and -3 forward kernels, and
    for few queries per sequence the split-KV decode kernel (`flashcupy info` shows which runs).

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
        backend: a kernel family's name (`flashcupy info` lists them) to force instead of the first
            that serves the problem; the FLASHCUPY_BACKEND environment variable does the same for
            every call. An error if that family cannot compute this call.

    Returns:
        out: (batch, seqlen_q, nheads, headdim) in q's dtype, and with return_lse=True also
        softmax_lse: float32 (batch, nheads, seqlen_q), natural-log sum of exp of scaled scores.

    Head dims 32, 64, 96, 128, 192 and 256 are supported, on GPUs of compute capability >= 8.0.
    The kernel runs on CuPy's current stream; nothing synchronizes the device.
    """
    key = replay.call_key("flash_attn_func", (q, k, v, alibi_slopes, sinks),
                          (softmax_scale, causal, window_size, alignment, softcap, backend))
    kept = replay.rerun_forward(key, return_lse)  # the same inputs and options as a recent call
    if kept is not None:
        return kept
    options = AttentionOptions(softmax_scale, causal, window_size, alignment, softcap, alibi_slopes, sinks,
                               backend=backend)
    q, k, v = _device_arrays(q=q, k=k, v=v)
    check_forward_inputs(ArraySpec.of(q), ArraySpec.of(k), ArraySpec.of(v))
    problem = Problem.padded(q, k, dtype_name(q.dtype), _with_device_arrays(options), read=(q, k, v))
    return _forward(problem, q, k, v, return_lse, key)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int,
                           softmax_scale: Optional[float] = None, causal: bool = False,
                           window_size: Tuple[int, int] = (-1, -1), alignment: str = "bottom_right",
                           softcap: float = 0.0, alibi_slopes=None, sinks=None, return_lse: bool = False,
                           check_cu_seqlens: bool = True, backend: Optional[str] = None):
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
    # kept only without the value check, which reads cu_seqlens
    key = None if check_cu_seqlens is not False else replay.call_key(
        "flash_attn_varlen_func", (q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, sinks),
        (max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_size, alignment, softcap, backend))
    kept = replay.rerun_forward(key, return_lse)
    if kept is not None:
        return kept
    options = AttentionOptions(softmax_scale, causal, window_size, alignment, softcap, alibi_slopes, sinks,
                               backend=backend)
    q, k, v, cu_seqlens_q, cu_seqlens_k = _device_arrays(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q,
                                                         cu_seqlens_k=cu_seqlens_k)
    check_varlen_layout(ArraySpec.of(q), ArraySpec.of(k), ArraySpec.of(v))
    check_forward_inputs(ArraySpec.of(q[None]), ArraySpec.of(k[None]), ArraySpec.of(v[None]))
    problem = Problem.varlen(q, k, dtype_name(q.dtype), _with_device_arrays(options), cu_seqlens_q, cu_seqlens_k,
                             max_seqlen_q, max_seqlen_k, check_cu_seqlens, read=(q, k, v))
    return _forward(problem, q, k, v, return_lse, key)


def flash_attn_backward(dout, q, k, v, out, softmax_lse, softmax_scale: Optional[float] = None,
                        causal: bool = False, deterministic: bool = False, dq=None, dk=None, dv=None,
                        window_size: Tuple[int, int] = (-1, -1), alignment: str = "bottom_right",
                        softcap: float = 0.0, alibi_slopes=None, sinks=None, backend: Optional[str] = None):
    """Gradients of flash_attn_func's output with respect to q, k and v (FlashAttention-2 backward).

    Arguments:
        dout: gradient of the loss with respect to `out`, shape and dtype of q.
        q, k, v, out, softmax_lse: the forward's inputs and results (`flash_attn_func(...,
            return_lse=True)`); softmax_scale, causal, window_size, alignment, softcap,
            alibi_slopes and sinks as given to the forward.
        deterministic: add the per-key-block contributions to dq in a fixed order, so two runs
            give identical bits (slower; the default adds them with float32 atomics).
        dq, dk, dv: optional output arrays (shape and dtype of q, k, v) written in place.
        backend: as in flash_attn_func, a backward kernel family's name.

    Returns:
        (dq, dk, dv) in the dtypes and shapes of q, k, v; with sinks also dsinks, float32 (nheads,).
        With fewer kv heads than query heads (GQA/MQA), dk and dv are summed over the query heads
        of each group.

    Extra device memory is O(seqlen): D = rowsum(dout * out) and a float32 dq accumulator (and,
    under GQA, per-query-head dk, dv before the group sum). Runs on CuPy's current stream.
    """
    key = replay.call_key("flash_attn_backward", (dout, q, k, v, out, softmax_lse, dq, dk, dv, alibi_slopes, sinks),
                          (softmax_scale, causal, deterministic, window_size, alignment, softcap, backend))
    b = replay.rerun(key, {"dq": dq, "dk": dk, "dv": dv})  # the same arrays and options as a recent call
    if b is not None:
        return _gradients(b["dq"], b["dk"], b["dv"], b["delta"], softmax_lse, sinks)
    options = AttentionOptions(softmax_scale, causal, window_size, alignment, softcap, alibi_slopes, sinks,
                               deterministic, backend)
    dout, q, k, v, out, softmax_lse = _device_arrays(dout=dout, q=q, k=k, v=v, out=out, softmax_lse=softmax_lse)
    grads = _output_arrays(dq=dq, dk=dk, dv=dv)
    check_backward_inputs(*(ArraySpec.of(a) for a in (dout, q, k, v, out, softmax_lse)),
                          {n: ArraySpec.of(a) for n, a in grads.items()})
    problem = Problem.padded(q, k, dtype_name(q.dtype), _with_device_arrays(options), read=(q, k, v, dout))
    return _backward(problem, dout, q, k, v, out, softmax_lse, grads, key)


def flash_attn_varlen_backward(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int,
                               max_seqlen_k: int, softmax_scale: Optional[float] = None, causal: bool = False,
                               deterministic: bool = False, dq=None, dk=None, dv=None,
                               window_size: Tuple[int, int] = (-1, -1), alignment: str = "bottom_right",
                               softcap: float = 0.0, alibi_slopes=None, sinks=None, check_cu_seqlens: bool = True,
                               backend: Optional[str] = None):
    """flash_attn_backward for flash_attn_varlen_func: packed (total, nheads, headdim) arrays,
    softmax_lse (nheads, total_q), and the forward's cu_seqlens and max_seqlen. Returns (dq, dk, dv),
    with sinks also dsinks."""
    key = None if check_cu_seqlens is not False else replay.call_key(
        "flash_attn_varlen_backward",
        (dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, dq, dk, dv, alibi_slopes, sinks),
        (max_seqlen_q, max_seqlen_k, softmax_scale, causal, deterministic, window_size, alignment, softcap, backend))
    b = replay.rerun(key, {"dq": dq, "dk": dk, "dv": dv})
    if b is not None:
        return _gradients(b["dq"], b["dk"], b["dv"], b["delta"], softmax_lse, sinks)
    options = AttentionOptions(softmax_scale, causal, window_size, alignment, softcap, alibi_slopes, sinks,
                               deterministic, backend)
    dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k = _device_arrays(
        dout=dout, q=q, k=k, v=v, out=out, softmax_lse=softmax_lse, cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k)
    grads = _output_arrays(dq=dq, dk=dk, dv=dv)
    check_varlen_layout(ArraySpec.of(q), ArraySpec.of(k), ArraySpec.of(v))
    if softmax_lse.ndim != 2:
        raise ValueError(f"softmax_lse must have shape (nheads, total_q) for varlen; got {softmax_lse.shape}")
    check_backward_inputs(*(ArraySpec.of(a[None]) for a in (dout, q, k, v, out, softmax_lse)),
                          {n: ArraySpec.of(a[None]) for n, a in grads.items()})
    problem = Problem.varlen(q, k, dtype_name(q.dtype), _with_device_arrays(options), cu_seqlens_q, cu_seqlens_k,
                             max_seqlen_q, max_seqlen_k, check_cu_seqlens, read=(q, k, v, dout))
    return _backward(problem, dout, q, k, v, out, softmax_lse, grads, key)


def _with_device_arrays(options: AttentionOptions) -> AttentionOptions:
    """The options with alibi_slopes and sinks as CuPy arrays (no copy)."""
    slopes, sinks = (None if a is None else as_device_array(a, name)
                     for a, name in ((options.alibi_slopes, "alibi_slopes"), (options.sinks, "sinks")))
    return options.with_arrays(slopes, sinks)


def family_for(direction: str, problem: Problem, device) -> registry.Family:
    """The family a call runs on. FLASHCUPY_BACKEND applies to the directions that have a family of
    that name; backend= must name a family of this direction."""
    backend, source = requested_backend(problem.options)
    if source == BACKEND_ENV and backend is not None and backend not in registry.family_names(direction):
        if backend not in registry.family_names():
            raise ValueError(f"{BACKEND_ENV}={backend!r} names no kernel family; choose from "
                             f"{', '.join(registry.family_names())}")
        backend = None
    return registry.select(direction, problem, device, backend, source)


def _forward(problem: Problem, q, k, v, return_lse, key=None):
    """Allocates out and the LSE and launches; with a call key, keeps the launch for the next call
    of that key (replay.py)."""
    import cupy

    with q.device:
        out = cupy.empty(q.shape, dtype=q.dtype)
        lse = cupy.empty(problem.lse_shape(q.shape[0]), dtype=cupy.float32)
        if out.size:  # else batch, seqlen_q or nheads is 0: nothing to compute, no launch
            for name, a in (("q", q), ("k", k), ("v", v)):
                check_pointer_alignment(name, a.data.ptr)
            device = device_info(q.device.id)
            launch = family_for("fwd", problem, device).run(problem, device, q, k, v, out, lse)
            outputs = replay.Buffers({"out": (out.shape, out.dtype, False), "lse": (lse.shape, lse.dtype, False)})
            replay.keep(key, replay.CallReplay(outputs, [launch]))
    return (out, lse) if return_lse else out


def _backward(problem: Problem, dout, q, k, v, out, softmax_lse, grads, key=None):
    """Allocates the gradients the caller did not give and launches; with a call key, keeps the
    launches for the next call of that key (replay.py)."""
    import cupy

    p = problem
    with q.device:
        dq = grads["dq"] if "dq" in grads else cupy.empty(q.shape, q.dtype)
        dk = grads["dk"] if "dk" in grads else cupy.empty(k.shape, k.dtype)
        dv = grads["dv"] if "dv" in grads else cupy.empty(v.shape, v.dtype)
        if dq.size == 0 or dk.size == 0:  # no query or no key: every gradient is zero
            for g in (dq, dk, dv):
                g.fill(0)
            return (dq, dk, dv) if p.options.sinks is None else (dq, dk, dv, cupy.zeros(p.nheads, cupy.float32))
        for name, a in (("dout", dout), ("q", q), ("k", k), ("v", v), ("out", out), ("dq", dq), ("dk", dk),
                        ("dv", dv)):
            check_pointer_alignment(name, a.data.ptr)
        device = device_info(q.device.id)
        delta, launches = family_for("bwd", p, device).run(p, device, dout, q, k, v, out, softmax_lse, dq, dk, dv)
        replay.keep(key, launches)
        return _gradients(dq, dk, dv, delta, softmax_lse, p.options.sinks)


def _gradients(dq, dk, dv, delta, softmax_lse, sinks):
    """(dq, dk, dv), with sinks also dsinks: d loss / d sink_h = -sum over rows of exp(sink_h - LSE)
    * D, the sink's share of each row's denominator times the row's dO . O."""
    import cupy

    if sinks is None:
        return dq, dk, dv
    with dq.device:
        lse3, delta3 = (a if a.ndim == 3 else a[None] for a in (softmax_lse, delta))
        dsinks = -(cupy.exp(sinks[None, :, None] - lse3) * delta3).sum(axis=(0, 2))
    return dq, dk, dv, dsinks


class FlashAttention:
    """Forward and backward of attention for pipelines without an autograd engine.

    `forward(q, k, v)` returns the output and keeps what the backward needs (q, k, v, out and the
    LSE: O(seqlen) memory, never the attention matrix); `backward(dout)` returns (dq, dk, dv).
    The options are flash_attn_func's and flash_attn_backward's, checked here, once.

        attn = FlashAttention(causal=True)
        out = attn.forward(q, k, v)
        dq, dk, dv = attn.backward(dout)
    """

    def __init__(self, softmax_scale: Optional[float] = None, causal: bool = False, deterministic: bool = False,
                 window_size: Tuple[int, int] = (-1, -1), alignment: str = "bottom_right", softcap: float = 0.0,
                 alibi_slopes=None, sinks=None, backend: Optional[str] = None):
        self.options = AttentionOptions(softmax_scale, causal, window_size, alignment, softcap,
                                        alibi_slopes, sinks, deterministic, backend)
        self.saved = None  # (q, k, v, out, softmax_lse) of the last forward

    def _kwargs(self, direction: str) -> dict:
        o = self.options
        kwargs = dict(softmax_scale=o.softmax_scale, causal=o.causal, window_size=o.window_size,
                      alignment=o.alignment, softcap=o.softcap, alibi_slopes=o.alibi_slopes, sinks=o.sinks,
                      backend=o.backend)
        return {**kwargs, "deterministic": o.deterministic} if direction == "bwd" else kwargs

    def forward(self, q, k, v):
        q, k, v = _device_arrays(q=q, k=k, v=v)
        out, lse = flash_attn_func(q, k, v, return_lse=True, **self._kwargs("fwd"))
        self.saved = (q, k, v, out, lse)
        return out

    def backward(self, dout, dq=None, dk=None, dv=None):
        """(dq, dk, dv), with sinks also dsinks."""
        if self.saved is None:
            raise RuntimeError("FlashAttention.backward needs a forward first (or the saved arrays were released)")
        q, k, v, out, lse = self.saved
        return flash_attn_backward(dout, q, k, v, out, lse, dq=dq, dk=dk, dv=dv, **self._kwargs("bwd"))

    def release(self) -> None:
        """Drop the arrays kept for the backward."""
        self.saved = None


def _device_arrays(**arrays):
    return [as_device_array(a, name) for name, a in arrays.items()]


def _output_arrays(**arrays) -> dict:
    return {name: as_device_array(a, name) for name, a in arrays.items() if a is not None}
