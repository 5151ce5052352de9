"""Argument checks for the public API: clear errors that name the argument, raised before any launch.

The checks work on `ArraySpec`, a small description of an array (shape, dtype, element strides,
device), so the same code runs on the CPU in tests and on GPU arrays in the API.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .configs import SUPPORTED_HEAD_DIMS
from .launch import MAX_GRID_YZ

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
    address: int | None = None  # of element 0, for a GPU array (to tell arrays that share memory)

    @classmethod
    def of(cls, array, device: int | None = None) -> "ArraySpec":
        itemsize = array.dtype.itemsize
        # A byte stride that is not a whole number of elements stays fractional here, so the
        # layout check refuses it instead of a floor division silently changing it.
        strides = tuple(s // itemsize if s % itemsize == 0 else s / itemsize for s in array.strides)
        if device is None:
            dev = getattr(array, "device", None)
            device = getattr(dev, "id", None)
        address = getattr(getattr(array, "data", None), "ptr", None)  # CuPy's MemoryPointer; None on the host
        return cls(tuple(array.shape), np.dtype(array.dtype), strides, device, address)


# The kernels' row arithmetic is 32-bit, with room for a block's rows past a sequence's end.
MAX_ROWS = 2**30
MAX_ROWS_TEXT = f"2**{MAX_ROWS.bit_length() - 1}"  # as the error messages write it


class _AtAddress:
    """An array interface at a GPU address: NumPy builds a view of it and never reads it."""

    def __init__(self, x: ArraySpec):
        self.__array_interface__ = {"data": (x.address, True), "shape": x.shape, "typestr": x.dtype.str,
                                    "strides": tuple(int(s * x.dtype.itemsize) for s in x.strides), "version": 3}


def _byte_range(x: ArraySpec) -> tuple | None:
    """[first, past last) byte of a GPU array's elements; None for a host or an empty one."""
    if x.address is None or 0 in x.shape:
        return None
    low = high = 0
    for stride, n in zip(x.strides, x.shape):
        if stride < 0:
            low += stride * (n - 1)
        else:
            high += stride * (n - 1)
    return x.address + low * x.dtype.itemsize, x.address + (high + 1) * x.dtype.itemsize


def shares_memory(a: ArraySpec, b: ArraySpec, ranges: tuple | None = None) -> bool:
    """Whether two GPU arrays have an element in common: exactly, not by their address ranges
    (interleaved views such as the q, k, v slices of one packed tensor share none), by NumPy's
    solver where the ranges meet. `ranges`: their _byte_range, where known."""
    ra, rb = ranges or (_byte_range(a), _byte_range(b))
    if ra is None or rb is None or ra[1] <= rb[0] or rb[1] <= ra[0]:
        return False
    try:
        return bool(np.shares_memory(np.asarray(_AtAddress(a)), np.asarray(_AtAddress(b)), max_work=1 << 20))
    except np.exceptions.TooHardError:  # not seen with 4-D attention layouts; leave the call be
        return False


def check_outputs_apart(outputs: dict, inputs: dict) -> None:
    """The caller's output arrays (name -> ArraySpec) share no memory with each other nor with the
    call's inputs: a kernel writing one while it reads or writes the other gives wrong results."""
    if not outputs:
        return
    arrays = {**{n: a for n, a in inputs.items() if a is not None}, **outputs}
    ranges = {n: _byte_range(a) for n, a in arrays.items()}
    names = list(outputs)
    for i, name in enumerate(names):
        for other in names[i + 1:] + [n for n in arrays if n not in outputs]:
            if shares_memory(outputs[name], arrays[other], (ranges[name], ranges[other])):
                raise ValueError(f"{name} shares memory with {other}; pass an output array of its own")


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
    if isinstance(softmax_scale, (bool, np.bool_)):
        raise TypeError(f"softmax_scale must be a positive number or None; got {softmax_scale!r}")
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
    check_outputs_apart({n: a for n, a in grads.items() if a is not None},
                        {"dout": dout, "q": q, "k": k, "v": v, "out": out, "softmax_lse": softmax_lse})


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
    """softcap 0 (off), or positive, finite and a normal float32 (the kernels take it as one)."""
    if isinstance(softcap, (bool, np.bool_)):
        raise TypeError(f"softcap must be a number >= 0 (0: off); got {softcap!r}")
    try:
        value = float(softcap)
    except (TypeError, ValueError):
        raise TypeError(f"softcap must be a number >= 0 (0: off); got {softcap!r}") from None
    if not (value >= 0 and math.isfinite(value)) or value > float(np.finfo(np.float32).max):
        raise ValueError(f"softcap must be a finite number >= 0 (0: off); got {softcap!r}")
    if 0 < value < float(np.finfo(np.float32).tiny):
        raise ValueError(f"softcap must be 0 (off) or at least float32's smallest normal number (about 1.2e-38); "
                         f"got {softcap!r}")


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
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) \
                or not 0 <= value < MAX_ROWS:
            raise ValueError(f"{name} must be an int in [0, {MAX_ROWS_TEXT}); got {value!r}")
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


# ----------------------------------------------------------------------------------------------
# flash_attn_with_kvcache
# ----------------------------------------------------------------------------------------------

def check_kvcache_inputs(q: ArraySpec, k_cache: ArraySpec, v_cache: ArraySpec, k: ArraySpec | None,
                         v: ArraySpec | None, block_table: ArraySpec | None, rotary_cos: ArraySpec | None,
                         rotary_sin: ArraySpec | None, head_dims) -> None:
    """Shapes, dtypes, layouts and devices of flash_attn_with_kvcache's arrays (the index arrays'
    values are check_kvcache_values's)."""
    if len(q.shape) != 4:
        raise ValueError(f"q must have 4 dimensions (batch, seqlen_q, nheads, headdim); got shape {q.shape}")
    if q.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"q has dtype {q.dtype}; flashcupy supports float16 and bfloat16")
    batch, _, nheads, head_dim = q.shape
    if head_dim not in head_dims:
        raise ValueError(f"q's head dim {head_dim} is not one the kv-cache kernels support: {head_dims}")
    layout = ("(num_blocks, page_size, nheads_k, headdim)" if block_table is not None
              else "(batch_cache, seqlen_cache, nheads_k, headdim)")
    for name, a in (("k_cache", k_cache), ("v_cache", v_cache)):
        if len(a.shape) != 4:
            raise ValueError(f"{name} must have 4 dimensions {layout}; got shape {a.shape}")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache must have the same shape; got {k_cache.shape} and {v_cache.shape}")
    nheads_k = k_cache.shape[2]
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"k_cache's head dim {k_cache.shape[3]} differs from q's {head_dim}")
    if nheads_k == 0 or nheads % nheads_k:
        raise ValueError(f"q's nheads ({nheads}) must be a multiple of the caches' nheads_k ({nheads_k})")
    if (k is None) != (v is None):
        raise ValueError("k and v (the new keys and values) must be given together")
    arrays = [("k_cache", k_cache), ("v_cache", v_cache)]
    if k is not None:
        for name, a in (("k", k), ("v", v)):
            if len(a.shape) != 4 or a.shape[0] != batch or a.shape[2:] != (nheads_k, head_dim) or a.shape[1] < 1:
                raise ValueError(f"{name} must be (batch, seqlen_new >= 1, nheads_k, headdim) = ({batch}, seqlen_new, "
                                 f"{nheads_k}, {head_dim}); got {a.shape}")
        if k.shape != v.shape:
            raise ValueError(f"k and v must have the same shape; got {k.shape} and {v.shape}")
        arrays += [("k", k), ("v", v)]
        check_outputs_apart({"k_cache": k_cache, "v_cache": v_cache}, {})  # the append writes both
    for name, a in arrays:
        if a.dtype != q.dtype:
            raise TypeError(f"{name} has dtype {a.dtype}; it must be q's ({q.dtype})")
        if a.device != q.device:
            raise ValueError(f"{name} must be on q's device ({q.device}); got {a.device}")
        _check_row_layout(name, a)
    _check_row_layout("q", q)
    if block_table is not None:
        if block_table.dtype != np.int32 or len(block_table.shape) != 2 or block_table.shape[0] != batch:
            raise ValueError(f"block_table must be int32 of shape (batch, max_blocks) with batch = {batch}; got "
                             f"{block_table.dtype} {block_table.shape}")
        if block_table.shape[1] > 1 and block_table.strides[1] != 1:
            raise ValueError("block_table's rows must be contiguous; copy it with cupy.ascontiguousarray(block_table)")
        if block_table.device != q.device:
            raise ValueError(f"block_table must be on q's device ({q.device}); got {block_table.device}")
        if block_table.shape[1] == 0 or k_cache.shape[1] == 0:
            raise ValueError(f"a paged cache needs at least one block per sequence and one row per block; got "
                             f"block_table {block_table.shape} and k_cache {k_cache.shape}")
    capacity = k_cache.shape[1] * (1 if block_table is None else block_table.shape[1])
    if capacity >= MAX_ROWS:
        raise ValueError(f"the cache holds {capacity} rows per sequence; the kernels take fewer than {MAX_ROWS_TEXT}")
    # the kv-cache kernels' grids have sequences on z and heads on y
    if batch > MAX_GRID_YZ or nheads > MAX_GRID_YZ:
        raise ValueError(f"q's batch ({batch}) and nheads ({nheads}) must be at most {MAX_GRID_YZ} each; split the "
                         "batch")
    if (rotary_cos is None) != (rotary_sin is None):
        raise ValueError("rotary_cos and rotary_sin must be given together")
    if rotary_cos is not None:
        if k is None:
            raise ValueError("rotary_cos and rotary_sin apply to the new keys: give k and v with them")
        for name, a in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
            if len(a.shape) != 2 or a.shape != rotary_cos.shape:
                raise ValueError(f"{name} must be (seqlen_ro, rotary_dim / 2), both alike; got {a.shape}")
            if a.dtype != q.dtype:
                raise TypeError(f"{name} has dtype {a.dtype}; it must be q's ({q.dtype})")
            if any(s != e for s, e, n in zip(a.strides, _c_strides(a.shape), a.shape) if n > 1):
                raise ValueError(f"{name} must be C-contiguous; copy it with cupy.ascontiguousarray({name})")
            if a.device != q.device:
                raise ValueError(f"{name} must be on q's device ({q.device}); got {a.device}")
        rotary_dim = 2 * rotary_cos.shape[1]
        if rotary_dim % 16 or not 0 < rotary_dim <= head_dim:
            raise ValueError(f"rotary_dim = 2 x rotary_cos.shape[1] = {rotary_dim} must be a multiple of 16 and at "
                             f"most the head dim {head_dim}")


def check_index_array(name: str, a: ArraySpec, batch: int, device) -> None:
    """cache_seqlens, cache_batch_idx, cache_leftpad: int32 (batch,), contiguous, on q's device."""
    if a.dtype != np.int32 or a.shape != (batch,):
        raise ValueError(f"{name} must be int32 of shape (batch,) = ({batch},); got {a.dtype} {a.shape}")
    if batch > 1 and a.strides[0] != 1:
        raise ValueError(f"{name} must be contiguous; copy it with cupy.ascontiguousarray({name})")
    if a.device is not None and a.device != device:
        raise ValueError(f"{name} must be on q's device ({device}); got {a.device}")


def check_cache_batch_idx(batch_idx: np.ndarray, seqlen_new: int, cache_entries: int) -> None:
    """cache_batch_idx's values (host copy): in range and, when keys are appended, distinct."""
    bad = np.flatnonzero((batch_idx < 0) | (batch_idx >= cache_entries))
    if bad.size:
        raise ValueError(f"cache_batch_idx[{bad[0]}] = {batch_idx[bad[0]]} is outside the cache's "
                         f"{cache_entries} entries")
    if seqlen_new and np.unique(batch_idx).size != batch_idx.size:
        raise ValueError("cache_batch_idx must be distinct when new keys are appended (two sequences would write "
                         "the same cache entry)")


def check_kvcache_values(seqlens: np.ndarray, leftpad: np.ndarray | None, batch_idx: np.ndarray | None,
                         block_table: np.ndarray | None, *, seqlen_new: int, capacity: int, cache_entries: int,
                         seqlen_ro: int | None, rotary_q_per_row: bool, seqlen_q: int) -> None:
    """The index arrays' values (host copies): every sequence's rows, the new ones included, inside its
    cache; leftpad within them; cache_batch_idx entries in range and, when keys are appended,
    distinct; the block table's blocks in range; the rotary tables long enough."""
    end = seqlens.astype(np.int64) + seqlen_new
    for b in range(seqlens.shape[0]):
        if seqlens[b] < 0 or end[b] > capacity:
            raise ValueError(f"cache_seqlens[{b}] = {seqlens[b]} plus the {seqlen_new} new keys does not fit the "
                             f"cache's {capacity} rows per sequence")
        if leftpad is not None and not 0 <= leftpad[b] <= seqlens[b]:
            raise ValueError(f"cache_leftpad[{b}] = {leftpad[b]} must lie in [0, cache_seqlens[{b}] = {seqlens[b]}]")
    if batch_idx is not None:
        check_cache_batch_idx(batch_idx, seqlen_new, cache_entries)
    if block_table is not None:
        page_size = capacity // block_table.shape[1]
        for b in range(seqlens.shape[0]):
            used = block_table[b, :-(-int(end[b]) // page_size)]
            bad = np.flatnonzero((used < 0) | (used >= cache_entries))
            if bad.size:
                raise ValueError(f"block_table[{b}, {bad[0]}] = {used[bad[0]]} is outside the cache's "
                                 f"{cache_entries} blocks")
    if seqlen_ro is not None:
        last = int(end.max(initial=0)) - 1 if seqlen_new else 0
        if rotary_q_per_row:
            last = max(last, int(seqlens.max(initial=0)) + seqlen_q - 1)
        if last >= seqlen_ro:
            raise ValueError(f"rotary_cos and rotary_sin have {seqlen_ro} rows; positions up to {last} are rotated")
