"""Attention over a KV cache: flash_attn_with_kvcache, its validation, the split-KV plan and the
launches of cuda_src/decode.cu (the append with rotary, the split-KV decode kernel, the combine).
The spec is decode_ref.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import numpy as np

from . import build, params, sm80
from .configs import cpp_bool, mask_flags
from .problem import AttentionOptions, Problem

HEAD_DIMS = (32, 64, 128, 256)  # a 128-thread block copies whole rows of 16-byte chunks
BLOCK_M = 64    # packed query rows per block (DecodeTraits::kBlockM)
# Keys per step by head dim: 32 at 256 keeps the two stages within an Ampere/Ada block's 99 KiB
BLOCK_N = {32: 64, 64: 64, 128: 64, 256: 32}
STAGES = 2      # K, V stages (DecodeTraits::kStages)
MAX_SPLITS = 128
MIN_KEYS_PER_SPLIT = 128  # less and the partials' traffic outweighs the parallelism
NVRTC_OPTIONS = sm80.NVRTC_OPTIONS


def num_splits_for(batch: int, head_groups: int, m_blocks: int, key_capacity: int, num_sms: int) -> int:
    """The split-KV rule for num_splits=0: none when the blocks without splits (batch x head
    groups x packed q blocks) fill every SM; otherwise enough splits for two blocks per SM, each
    split at least MIN_KEYS_PER_SPLIT keys of the cache's capacity (the index arrays' values are on
    the GPU: the plan may not read them), at most MAX_SPLITS."""
    blocks = batch * head_groups * m_blocks
    if blocks == 0 or blocks >= num_sms:
        return 1
    want = -(-2 * num_sms // blocks)
    return max(1, min(want, key_capacity // MIN_KEYS_PER_SPLIT, MAX_SPLITS))


def unsupported(head_dim: int, device) -> str | None:
    """Why the kv-cache kernels cannot run at this head dim on `device` (a DeviceInfo), or None."""
    if device.capability < 80:
        major, minor = divmod(device.capability, 10)
        return f"needs compute capability 8.0 or newer; this GPU has {major}.{minor}"
    smem = DecodeVariant(head_dim, "bfloat16", "none", False).smem_bytes
    if smem > device.smem_per_block_optin:
        return f"head dim {head_dim} needs {smem} bytes of shared memory per block; this GPU grants {device.smem_per_block_optin}"
    return None


@dataclass(frozen=True)
class DecodeVariant:
    head_dim: int
    dtype: str
    mask: str  # one of configs.MASKS
    score_mod: bool

    source = "decode.cu"
    nvrtc_options = NVRTC_OPTIONS

    @property
    def block_n(self) -> int:
        return BLOCK_N[self.head_dim]

    @property
    def name_expression(self) -> str:
        return (f"flash_decode_kernel<{self.head_dim}, {self.block_n}, {mask_flags(self.mask)}, "
                f"{cpp_bool(self.dtype == 'bfloat16')}, {cpp_bool(self.score_mod)}>")

    @property
    def smem_bytes(self) -> int:
        """Q, then STAGES x (K, V), rows padded by 8 elements (DecodeTraits)."""
        return (BLOCK_M + STAGES * 2 * self.block_n) * (self.head_dim + 8) * 2

    @property
    def layout_check(self) -> str:
        return build.smem_check(f"DecodeTraits<{self.head_dim}, {self.block_n}>", self)

    def __str__(self) -> str:
        return (f"decode d={self.head_dim} {self.dtype} mask={self.mask}" + ("+score_mod" if self.score_mod else "")
                + f" tile={BLOCK_M}x{self.block_n}")


@dataclass(frozen=True)
class DecodeHelper:
    """The append, the query rotation and the combine: one instance per (head dim, dtype)."""
    kernel: str  # one of HELPER_KERNELS
    head_dim: int
    dtype: str

    source = "decode.cu"
    nvrtc_options = NVRTC_OPTIONS
    smem_bytes = 0
    layout_check = ""

    @property
    def name_expression(self) -> str:
        bf16 = cpp_bool(self.dtype == "bfloat16")
        return f"{self.kernel}<{self.head_dim}, {bf16}>" if self.kernel in HEAD_DIM_KERNELS else f"{self.kernel}<{bf16}>"

    def __str__(self) -> str:
        return f"{self.kernel} d={self.head_dim} {self.dtype}"


HEAD_DIM_KERNELS = ("flash_decode_combine_kernel",)
HELPER_KERNELS = ("kvcache_append_kernel", "rotary_q_kernel") + HEAD_DIM_KERNELS


def variants(head_dims=HEAD_DIMS, dtypes=("float16", "bfloat16"), masks=("none", "causal", "local"),
             score_mods=(False, True)) -> list:
    """Every decode kernel: the main kernel's instances, then the helpers'."""
    main = [DecodeVariant(d, dt, m, mod) for d in head_dims for dt in dtypes for m in masks for mod in score_mods]
    helpers = [DecodeHelper(k, d if k in HEAD_DIM_KERNELS else 0, dt) for k in HELPER_KERNELS for d in head_dims
               for dt in dtypes]
    return main + list(dict.fromkeys(helpers))


def ci_cases() -> list:
    """(variant, arch) pairs CI compiles: every kernel once, bfloat16 for sm_90a and float16 for
    sm_80 (as the sm80 families: each dtype and each arch with every option)."""
    return [(v, "sm_90a" if v.dtype == "bfloat16" else "sm_80") for v in variants()]


def _index_array(value, name: str, batch: int, device: int, check_values: bool):
    """(device int32 array or None, host copy or None) of an index argument given as None, an int
    (cache_seqlens only), a host or a device array. A host copy of a device array is made only when
    check_values asks for it (a device-to-host copy, which waits for the stream)."""
    import cupy

    from .validation import ArraySpec, check_index_array

    if value is None:
        return None, None
    if isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_)):
        if name != "cache_seqlens":
            raise TypeError(f"{name} must be an int32 array of shape (batch,); got an int")
        host = np.full(batch, int(value), np.int32)
        return cupy.asarray(host), host
    if isinstance(value, np.ndarray):
        check_index_array(name, ArraySpec.of(value, device), batch, device)
        return cupy.asarray(value), value
    from .api import as_device_array

    array = as_device_array(value, name)
    check_index_array(name, ArraySpec.of(array), batch, device)
    return array, (cupy.asnumpy(array) if check_values else None)


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None, cache_batch_idx=None,
                            cache_leftpad=None, block_table=None, rotary_cos=None, rotary_sin=None,
                            rotary_interleaved: bool = True, softmax_scale: Optional[float] = None,
                            causal: bool = False, window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
                            alibi_slopes=None, sinks=None, num_splits: int = 0, return_lse: bool = False,
                            check_values: bool = True):
    """Attention of q over a KV cache, the new keys k, v appended to it in place first.

    Arguments:
        q: (batch, seqlen_q, nheads, headdim), float16 or bfloat16, on the GPU; seqlen_q from 1
            (decoding) to thousands (chunked prefill, speculative decoding).
        k_cache, v_cache: (batch_cache, seqlen_cache, nheads_k, headdim), or with block_table
            (num_blocks, page_size, nheads_k, headdim), any page size; q's dtype; nheads_k divides
            nheads. Written in place at the appended rows only.
        k, v: optional (batch, seqlen_new, nheads_k, headdim): written at rows cache_seqlens[b] ..
            cache_seqlens[b] + seqlen_new - 1 of sequence b's cache, then attended with the rest.
        cache_seqlens: int, or int32 (batch,) (host or GPU): the rows of each sequence's cache in
            use before the append. Default: the whole cache (not with block_table or k, v).
        cache_batch_idx: int32 (batch,): the cache entry of each sequence (default b); distinct
            when k, v are appended. Not with block_table.
        cache_leftpad: int32 (batch,): the first row of each sequence's cache (default 0); its keys
            are rows cache_leftpad[b] .. cache_seqlens[b] + seqlen_new - 1.
        block_table: int32 (batch, max_blocks): row r of sequence b is row r % page_size of block
            block_table[b, r // page_size].
        rotary_cos, rotary_sin: (seqlen_ro, rotary_dim / 2) in q's dtype, with k, v only: the new
            keys are rotated at their cache rows before they are written; the queries at
            cache_seqlens[b] + i (causal or windowed) or all at cache_seqlens[b].
            rotary_interleaved: rotate the pairs (2 j, 2 j + 1) (GPT-J) instead of (j, j +
            rotary_dim / 2) (GPT-NeoX).
        softmax_scale, causal, window_size, softcap, alibi_slopes, sinks: as flash_attn_func, the
            masks aligned to the bottom right (the last query row is the last key's position).
        num_splits: how many parts each sequence's keys are cut into (split-KV), merged by their
            LSEs; 0 (default) chooses (num_splits_for), 1 turns splitting off.
        return_lse: also return softmax_lse, float32 (batch, nheads, seqlen_q).
        check_values: check the index arrays' values (cache_seqlens, cache_batch_idx,
            cache_leftpad, block_table) before any launch. Host arrays are always checked; GPU
            arrays cost a device-to-host copy, which waits for the stream and cannot run under
            stream capture: pass False in a decode loop once the inputs are known good.

    Returns out (batch, seqlen_q, nheads, headdim) in q's dtype (and softmax_lse). Runs on CuPy's
    current stream with no host synchronization when check_values=False or the index arrays are
    host arrays; allocations come from CuPy's pool, so a step can be captured into a CUDA graph.
    """
    import cupy

    from .api import as_device_array
    from .device import device_info
    from .validation import ArraySpec, check_band, check_kvcache_inputs, check_kvcache_values, check_softcap, dtype_name

    arrays = {name: None if a is None else as_device_array(a, name)
              for name, a in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v),
                              ("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin), ("alibi_slopes", alibi_slopes),
                              ("sinks", sinks))}
    q, k_cache, v_cache, k, v = (arrays[n] for n in ("q", "k_cache", "v_cache", "k", "v"))
    rotary_cos, rotary_sin = arrays["rotary_cos"], arrays["rotary_sin"]
    spec = {n: None if a is None else ArraySpec.of(a) for n, a in arrays.items()}
    # the block table, like the other index arrays, may be a host array (checked, then copied over)
    if block_table is None or isinstance(block_table, np.ndarray):
        table = block_table
        table_spec = None if table is None else ArraySpec.of(table, q.device.id)
    else:
        table = as_device_array(block_table, "block_table")
        table_spec = ArraySpec.of(table)
    check_kvcache_inputs(spec["q"], spec["k_cache"], spec["v_cache"], spec["k"], spec["v"], table_spec,
                         spec["rotary_cos"], spec["rotary_sin"], HEAD_DIMS)
    check_band(causal, window_size, "bottom_right")
    check_softcap(softcap)
    if isinstance(num_splits, (bool, np.bool_)) or not isinstance(num_splits, (int, np.integer)) \
            or not 0 <= num_splits <= 4096:
        raise ValueError(f"num_splits must be an int in [0, 4096] (0: chosen; 1: no splitting); got {num_splits!r}")
    if not isinstance(rotary_interleaved, (bool, np.bool_)):
        raise TypeError(f"rotary_interleaved must be a bool; got {rotary_interleaved!r}")
    batch, seqlen_q, nheads, head_dim = q.shape
    paged = block_table is not None
    if paged and (cache_batch_idx is not None or cache_leftpad is not None):
        raise ValueError("cache_batch_idx and cache_leftpad are for a contiguous cache, not with block_table")
    if cache_seqlens is None and (paged or k is not None):
        raise ValueError("cache_seqlens is needed with block_table and where k, v are appended")
    if not paged and cache_batch_idx is None and k_cache.shape[0] != batch:
        raise ValueError(f"k_cache has {k_cache.shape[0]} entries for {batch} sequences; give cache_batch_idx to "
                         "choose among them")
    seqlen_new = 0 if k is None else k.shape[1]
    capacity = k_cache.shape[1] * (block_table.shape[1] if paged else 1)
    device = q.device.id
    with q.device:
        if cache_seqlens is None:
            cache_seqlens = k_cache.shape[1]
        seqlens_d, seqlens_h = _index_array(cache_seqlens, "cache_seqlens", batch, device, check_values)
        idx_d, idx_h = _index_array(cache_batch_idx, "cache_batch_idx", batch, device, check_values)
        pad_d, pad_h = _index_array(cache_leftpad, "cache_leftpad", batch, device, check_values)
        bt_d = None if table is None else cupy.asarray(table)
        bt_h = table if isinstance(table, np.ndarray) else cupy.asnumpy(table) if table is not None and check_values \
            else None
        windowed = causal or tuple(window_size) != (-1, -1)
        if seqlens_h is not None:
            check_kvcache_values(seqlens_h, pad_h, idx_h, bt_h, seqlen_new=seqlen_new, capacity=capacity,
                                 cache_entries=k_cache.shape[0], seqlen_ro=None if rotary_cos is None else
                                 rotary_cos.shape[0], rotary_q_per_row=windowed, seqlen_q=seqlen_q)
        options = AttentionOptions(softmax_scale, causal, window_size, "bottom_right", softcap, arrays["alibi_slopes"],
                                   arrays["sinks"])
        problem = Problem._make(q, batch, seqlen_q, capacity, nheads, k_cache.shape[2], head_dim, dtype_name(q.dtype),
                                options, None, None)
        out = cupy.empty(q.shape, q.dtype)
        lse = cupy.empty((batch, nheads, seqlen_q), cupy.float32)
        info = device_info(device)
        reason = unsupported(head_dim, info)
        if reason is not None:
            raise ValueError(f"flash_attn_with_kvcache cannot run on {info.name}: {reason}")
        if out.size or seqlen_new:
            _launch(problem, q, k_cache, v_cache, k, v, seqlens_d, idx_d, pad_d, bt_d, rotary_cos, rotary_sin,
                    bool(rotary_interleaved), windowed, int(num_splits), out, lse, info)
    return (out, lse) if return_lse else out


def _launch(problem, q, k_cache, v_cache, k, v, seqlens, batch_idx, leftpad, block_table, rotary_cos, rotary_sin,
            interleaved, windowed, num_splits, out, lse, device):
    import cupy

    batch, seqlen_q, nheads, head_dim = q.shape
    nheads_k = k_cache.shape[2]
    o = problem.options
    pack = 1 if o.alibi_slopes is not None or o.sinks is not None else nheads // nheads_k  # per-head ALiBi, sink
    m_blocks = -(-seqlen_q * pack // BLOCK_M)
    splits = num_splits or num_splits_for(batch, nheads // pack, m_blocks, problem.max_seqlen_k, device.sm_count)
    q_eff = q if rotary_cos is None else cupy.empty(q.shape, q.dtype)
    partial = splits > 1
    out_partial = cupy.empty((splits, batch, nheads, seqlen_q, head_dim), cupy.float32) if partial else None
    lse_partial = cupy.empty((splits, batch, nheads, seqlen_q), cupy.float32) if partial else None
    values = params.fwd_values(problem, q_eff, k_cache, v_cache, out, lse)
    values.update({
        "k_cache": k_cache, "v_cache": v_cache, "k_new": k, "v_new": v, "q_source": q,
        "q_rotated": None if rotary_cos is None else q_eff, "rotary_cos": rotary_cos, "rotary_sin": rotary_sin,
        "cache_seqlens": seqlens, "cache_batch_idx": batch_idx, "cache_leftpad": leftpad, "block_table": block_table,
        "out_partial": out_partial, "lse_partial": lse_partial,
        **params.strides("knew", _strides_or_zero(k)), **params.strides("vnew", _strides_or_zero(v)),
        **params.strides("qsrc", _strides_or_zero(q)),
        "block_table_batch_stride": 0 if block_table is None else block_table.strides[0] // 4,
        "page_size": k_cache.shape[1] if block_table is not None else 0, "seqlen_new": 0 if k is None else k.shape[1],
        "num_splits": splits, "heads_per_block": pack,
        "rotary_dim": 0 if rotary_cos is None else 2 * rotary_cos.shape[1], "rotary_interleaved": int(interleaved),
        "rotary_q_per_row": int(windowed),
    })
    record = params.pack("DecodeParams", values)
    dtype = problem.dtype
    threads = head_dim // 8  # 16 bytes each
    if k is not None and k.size:
        build.get_kernel(DecodeHelper("kvcache_append_kernel", 0, dtype))((k.shape[1], nheads_k, batch), (threads,),
                                                                          (record,))
    if not out.size:
        return
    if rotary_cos is not None:
        build.get_kernel(DecodeHelper("rotary_q_kernel", 0, dtype))((seqlen_q, nheads, batch), (threads,), (record,))
    main = DecodeVariant(head_dim, dtype, problem.band.mask, problem.score_mod)
    build.get_kernel(main)((m_blocks * splits, nheads // pack, batch), (128,), (record,), shared_mem=main.smem_bytes)
    if partial:
        build.get_kernel(DecodeHelper("flash_decode_combine_kernel", head_dim, dtype))(
            (-(-seqlen_q // 4), nheads, batch), (128,), (record,))


def _strides_or_zero(array) -> tuple:
    return (0, 0, 0) if array is None else tuple(s // array.dtype.itemsize for s in array.strides)
