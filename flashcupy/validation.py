"""Argument checks for the public API: clear errors that name the argument, raised before any launch.

The checks work on `ArraySpec`, a small description of an array (shape, dtype, element strides,
device), so the same code runs on the CPU in tests and on GPU arrays in the API.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .configs import SUPPORTED_HEAD_DIMS

try:  # bfloat16 as a NumPy dtype (CuPy 14 accepts it); a plain dependency of the package
    import ml_dtypes

    BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - ml_dtypes is in install_requires
    BFLOAT16 = None

SUPPORTED_DTYPES = {np.dtype(np.float16): "float16"}
if BFLOAT16 is not None:
    SUPPORTED_DTYPES[BFLOAT16] = "bfloat16"


@dataclass(frozen=True)
class ArraySpec:
    shape: tuple
    dtype: np.dtype
    strides: tuple  # in elements
    device: int | None  # CUDA device id

    @classmethod
    def of(cls, array, device: int | None = None) -> "ArraySpec":
        itemsize = array.dtype.itemsize
        # A byte stride that is not a whole number of elements stays fractional here, so the
        # layout check refuses it instead of a floor division silently changing it.
        strides = tuple(s // itemsize if s % itemsize == 0 else s / itemsize for s in array.strides)
        if device is None:
            dev = getattr(array, "device", None)
            device = getattr(dev, "id", None)
        return cls(tuple(array.shape), np.dtype(array.dtype), strides, device)


def dtype_name(dtype) -> str:
    dtype = np.dtype(dtype)
    if dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"unsupported dtype {dtype}; flashcupy supports float16 and bfloat16")
    return SUPPORTED_DTYPES[dtype]


def check_forward_inputs(q: ArraySpec, k: ArraySpec, v: ArraySpec) -> None:
    """Validate q, k, v of shape (batch, seqlen, nheads, headdim)."""
    for name, a in (("q", q), ("k", k), ("v", v)):
        if len(a.shape) != 4:
            raise ValueError(f"{name} must have 4 dimensions (batch, seqlen, nheads, headdim); "
                             f"got shape {a.shape}")
        if a.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{name} has dtype {a.dtype}; flashcupy supports float16 and bfloat16")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must share one dtype; got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k and v must be on one device; got q on {q.device}, k on {k.device}, "
                         f"v on {v.device}")
    batch, _, nheads, head_dim = q.shape
    for name, a in (("k", k), ("v", v)):
        if a.shape[0] != batch:
            raise ValueError(f"{name} has batch size {a.shape[0]} but q has {batch}")
        if a.shape[3] != head_dim:
            raise ValueError(f"{name} has head dim {a.shape[3]} but q has {head_dim}")
    if k.shape[1] != v.shape[1]:
        raise ValueError(f"k and v must have the same seqlen; got k {k.shape[1]}, v {v.shape[1]}")
    if k.shape[2] != v.shape[2]:
        raise ValueError(f"k and v must have the same number of heads; got k {k.shape[2]}, v {v.shape[2]}")
    nheads_k = k.shape[2]
    if nheads_k == 0 or nheads % nheads_k != 0:
        raise ValueError(f"the number of heads in k/v ({nheads_k}) must divide the number of heads "
                         f"in q ({nheads})")
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head dim {head_dim} is not supported; supported head dims: "
                         f"{', '.join(map(str, SUPPORTED_HEAD_DIMS))}")
    for name, a in (("q", q), ("k", k), ("v", v)):
        _check_row_layout(name, a)


def check_softmax_scale(softmax_scale) -> None:
    if softmax_scale is None:
        return
    try:
        value = float(softmax_scale)
    except (TypeError, ValueError):
        raise TypeError(f"softmax_scale must be a positive number or None; got {softmax_scale!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"softmax_scale must be a positive finite number or None; got {softmax_scale!r}")
    # The kernels take softmax_scale and softmax_scale * log2(e) as float32.
    f32 = np.finfo(np.float32)
    if not (float(f32.tiny) <= value and value * math.log2(math.e) <= float(f32.max)):
        raise ValueError(f"softmax_scale must be representable in float32 (about 1e-38 to 1e38); "
                         f"got {softmax_scale!r}")


def check_pointer_alignment(name: str, ptr: int) -> None:
    if ptr % 16:
        raise ValueError(f"{name} data must be 16-byte aligned for vector loads; got address {ptr:#x}. "
                         f"Copy it with cupy.ascontiguousarray({name}).")


def check_backward_inputs(dout: ArraySpec, q: ArraySpec, k: ArraySpec, v: ArraySpec, out: ArraySpec,
                          softmax_lse: ArraySpec, grads: dict) -> None:
    """Validate the backward's arguments against q, k, v; `grads` maps "dq"/"dk"/"dv" to the
    ArraySpec of a caller-provided output (or None)."""
    check_forward_inputs(q, k, v)
    for name, a in (("dout", dout), ("out", out)):
        if a.shape != q.shape:
            raise ValueError(f"{name} must have the shape of q {q.shape}; got {a.shape}")
        if a.dtype != q.dtype:
            raise TypeError(f"{name} must have the dtype of q ({q.dtype}); got {a.dtype}")
        if a.device != q.device:
            raise ValueError(f"{name} must be on q's device ({q.device}); got {a.device}")
        _check_row_layout(name, a)
    batch, seqlen_q, nheads, _ = q.shape
    if softmax_lse.shape != (batch, nheads, seqlen_q):
        raise ValueError(f"softmax_lse must have shape (batch, nheads, seqlen_q) = {(batch, nheads, seqlen_q)}; "
                         f"got {softmax_lse.shape}")
    if softmax_lse.dtype != np.float32:
        raise TypeError(f"softmax_lse must be float32 (as the forward returns it); got {softmax_lse.dtype}")
    expected_strides = (nheads * seqlen_q, seqlen_q, 1)
    if any(s != e for s, e, n in zip(softmax_lse.strides, expected_strides, softmax_lse.shape) if n > 1):
        raise ValueError("softmax_lse must be C-contiguous (as the forward returns it); "
                         "copy it with cupy.ascontiguousarray(softmax_lse)")
    if softmax_lse.device != q.device:
        raise ValueError(f"softmax_lse must be on q's device ({q.device}); got {softmax_lse.device}")
    for name, ref in (("dq", q), ("dk", k), ("dv", v)):
        a = grads.get(name)
        if a is None:
            continue
        if a.shape != ref.shape or a.dtype != ref.dtype:
            raise ValueError(f"{name} must have the shape and dtype of {name[1:]} ({ref.shape}, {ref.dtype}); "
                             f"got {a.shape}, {a.dtype}")
        if a.device != q.device:
            raise ValueError(f"{name} must be on q's device ({q.device}); got {a.device}")
        _check_row_layout(name, a)
        _check_no_overlap(name, a)


def _check_no_overlap(name: str, a: ArraySpec) -> None:
    """An output whose elements share memory (zero or overlapping strides, e.g. from broadcast_to)
    would have several threads write one address."""
    dims = sorted((abs(s), n) for s, n in zip(a.strides, a.shape) if n > 1)
    span = 1  # elements covered by the dims taken so far
    for stride, extent in dims:
        if stride < span:
            raise ValueError(f"{name} has overlapping elements (strides {a.strides} for shape {a.shape}); "
                             "pass an array that owns distinct memory for every element")
        span = stride * extent


def _check_row_layout(name: str, a: ArraySpec) -> None:
    if 0 in a.shape:
        return  # an empty array has no layout to speak of (CuPy reports zero strides)
    if any(s != int(s) for s in a.strides):
        raise ValueError(f"{name} has byte strides that are not whole multiples of its item size "
                         f"(element strides {a.strides}); copy it with cupy.ascontiguousarray({name})")
    if a.strides[3] != 1 and a.shape[3] > 1:
        raise ValueError(f"{name} must be contiguous in its last dimension (headdim); got element strides "
                         f"{a.strides}. Make it so with cupy.ascontiguousarray({name}).")
    # 16-byte vector accesses need every row start aligned to 8 elements
    if any(s % 8 for s, n in zip(a.strides[:3], a.shape[:3]) if n > 1):
        raise ValueError(f"{name} strides {a.strides} (in elements) must be multiples of 8 for the batch, "
                         f"seqlen and head dimensions; copy it with cupy.ascontiguousarray({name})")


ALIGNMENTS = ("bottom_right", "top_left")


def check_band(causal, window_size, alignment) -> None:
    """Validate the masking options: window_size = (left, right), -1 meaning unbounded; alignment
    of the causal diagonal and the window when seqlen_q != seqlen_k."""
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be True or False; got {causal!r}")
    try:
        left, right = window_size
    except (TypeError, ValueError):
        raise TypeError(f"window_size must be a pair (left, right) of ints, -1 for unbounded; got {window_size!r}") from None
    for side, value in (("left", left), ("right", right)):
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < -1:
            raise ValueError(f"window_size {side} must be an int >= -1 (-1: unbounded); got {value!r}")
    if causal and right > 0:
        raise ValueError(f"causal=True already limits the window to 0 keys on the right; got window_size {window_size!r} "
                         "(use window_size=(left, 0) or (left, -1))")
    if alignment not in ALIGNMENTS:
        raise ValueError(f"alignment must be one of {ALIGNMENTS}; got {alignment!r}")


def check_softcap(softcap) -> None:
    """softcap >= 0, finite and representable in float32 (0: off)."""
    try:
        value = float(softcap)
    except (TypeError, ValueError):
        raise TypeError(f"softcap must be a number >= 0 (0: off); got {softcap!r}") from None
    if not (value >= 0 and math.isfinite(value)) or value > float(np.finfo(np.float32).max):
        raise ValueError(f"softcap must be a finite number >= 0 (0: off); got {softcap!r}")


def check_score_mods(alibi_slopes: ArraySpec | None, sinks: ArraySpec | None, batch: int, nheads: int,
                     device) -> None:
    """alibi_slopes float32 (nheads,) or (batch, nheads); sinks float32 (nheads,)."""
    for name, a, shapes in (("alibi_slopes", alibi_slopes, ((nheads,), (batch, nheads))),
                            ("sinks", sinks, ((nheads,),))):
        if a is None:
            continue
        if a.shape not in shapes:
            wanted = " or ".join(str(s) for s in shapes)
            raise ValueError(f"{name} must have shape {wanted} (nheads = {nheads}, batch = {batch}); got {a.shape}")
        if a.dtype != np.float32:
            raise TypeError(f"{name} must be float32; got {a.dtype}")
        if any(s != e for s, e, n in zip(a.strides, _c_strides(a.shape), a.shape) if n > 1):
            raise ValueError(f"{name} must be C-contiguous; copy it with cupy.ascontiguousarray({name})")
        if a.device != device:
            raise ValueError(f"{name} must be on q's device ({device}); got {a.device}")


def check_varlen_layout(q: ArraySpec, k: ArraySpec, v: ArraySpec) -> None:
    """Packed q (total_q, nheads, headdim), k and v (total_k, nheads_k, headdim)."""
    for name, a in (("q", q), ("k", k), ("v", v)):
        if len(a.shape) != 3:
            raise ValueError(f"{name} must have 3 dimensions (total_tokens, nheads, headdim) for varlen; "
                             f"got shape {a.shape}")


def check_cu_seqlens(cu_seqlens_q: ArraySpec, cu_seqlens_k: ArraySpec, max_seqlen_q, max_seqlen_k,
                     device) -> int:
    """The cumulative-length arrays' own properties; returns batch. Their values are checked by
    check_cu_seqlens_values."""
    for name, a in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if a.dtype != np.int32:
            raise TypeError(f"{name} must be int32; got {a.dtype}")
        if len(a.shape) != 1 or a.shape[0] < 2:
            raise ValueError(f"{name} must be 1-D with batch + 1 >= 2 entries; got shape {a.shape}")
        if a.strides[0] != 1:
            raise ValueError(f"{name} must be contiguous; copy it with cupy.ascontiguousarray({name})")
        if a.device != device:
            raise ValueError(f"{name} must be on q's device ({device}); got {a.device}")
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must have the same length (batch + 1); got "
                         f"{cu_seqlens_q.shape[0]} and {cu_seqlens_k.shape[0]}")
    for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < 0:
            raise ValueError(f"{name} must be an int >= 0; got {value!r}")
    return cu_seqlens_q.shape[0] - 1


def check_cu_seqlens_values(name: str, cu: np.ndarray, total: int, max_seqlen: int) -> None:
    """cu (host copy): starts at 0, non-decreasing, ends at the packed tensor's length, and no
    sequence longer than max_seqlen."""
    if cu[0] != 0:
        raise ValueError(f"{name}[0] must be 0; got {cu[0]}")
    lengths = np.diff(cu.astype(np.int64))
    if (lengths < 0).any():
        b = int(np.argmax(lengths < 0))
        raise ValueError(f"{name} must be non-decreasing; {name}[{b + 1}] = {cu[b + 1]} < {name}[{b}] = {cu[b]}")
    if cu[-1] != total:
        raise ValueError(f"{name}[-1] = {cu[-1]} must equal the number of packed tokens ({total})")
    longest = int(lengths.max(initial=0))
    if longest > max_seqlen:
        which = "max_seqlen_q" if name.endswith("_q") else "max_seqlen_k"
        raise ValueError(f"{which} = {max_seqlen} is shorter than the longest sequence in {name} ({longest})")


def _c_strides(shape) -> tuple:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))
