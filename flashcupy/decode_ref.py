"""Float64 NumPy reference of attention over a KV cache (flash_attn_with_kvcache), and the NumPy
transcription of split-KV decoding with its merge by LSE: the executable spec of the decode path.

The cache. k_cache, v_cache are (batch_cache, seqlen_cache, nheads_k, headdim), or, paged, (num_blocks,
page_size, nheads_k, headdim) with block_table (batch, max_blocks) of block indices: row r of
sequence b is then row r % page_size of block block_table[b, r // page_size]. Sequence b reads
cache entry cache_batch_idx[b] (default b; not with a block table). Its keys are the cache rows
[leftpad_b, cache_seqlens[b]) (cache_leftpad, default 0), followed by the seqlen_new new keys k, v
(when given), which are written into the cache at rows cache_seqlens[b] + i first: every other row
of the cache stays as it was.

Rotary embedding (rotary_cos, rotary_sin of shape (seqlen_ro, rotary_dim / 2), with the new keys
only): the cache row is the position. New key i of sequence b is rotated at position
cache_seqlens[b] + i before it is written; query row i at cache_seqlens[b] + i when the attention is
causal or windowed, else every query row at cache_seqlens[b]. Interleaved (GPT-J) rotates the pairs
(x[2j], x[2j + 1]); not interleaved (GPT-NeoX) the pairs (x[j], x[j + rotary_dim / 2]); columns
from rotary_dim on are left as they are.

Attention: sequence b is plain attention (reference.attention_ref) of its seqlen_q query rows over
its seqlen_k = cache_seqlens[b] - leftpad_b + seqlen_new keys, with every option of flash_attn_func
(the masks aligned to the bottom right: the last query row is the last key's position).

Split-KV (decode_split_kv, the decode kernel's plan written out): a sequence's keys are cut into
num_splits shares of whole key blocks; each gives a partial output and LSE over its keys alone, and
merge_partials combines them, exactly, by their LSEs. The same merge joins the blocks of ring
attention.
"""

from __future__ import annotations

import numpy as np

from .reference import _f64, _is_int, attention_ref


def rotary_rotate(x, cos, sin, positions, interleaved: bool) -> np.ndarray:
    """x (seqlen, heads, headdim) rotated row by row at `positions` (seqlen,) -> float64 copy."""
    x = _f64(x).copy()
    cos, sin = _f64(cos)[np.asarray(positions)], _f64(sin)[np.asarray(positions)]  # (seqlen, rotary_dim / 2)
    half = cos.shape[1]
    c, s = cos[:, None, :], sin[:, None, :]
    if interleaved:
        x0, x1 = x[..., 0:2 * half:2].copy(), x[..., 1:2 * half:2].copy()
        x[..., 0:2 * half:2], x[..., 1:2 * half:2] = x0 * c - x1 * s, x0 * s + x1 * c
    else:
        x0, x1 = x[..., :half].copy(), x[..., half:2 * half].copy()
        x[..., :half], x[..., half:2 * half] = x0 * c - x1 * s, x0 * s + x1 * c
    return x


def _rounded(x: np.ndarray, dtype) -> np.ndarray:
    """x rounded to `dtype` and back to float64 (None: x)."""
    return x if dtype is None else x.astype(dtype).astype(np.float64)


def _per_batch(values, batch: int, name: str, default: int) -> np.ndarray:
    if values is None:
        return np.full(batch, default, np.int64)
    if _is_int(values):
        return np.full(batch, int(values), np.int64)
    values = np.asarray(values)
    if values.shape != (batch,):
        raise ValueError(f"{name} must be an int or of shape (batch,) {(batch,)}, got {values.shape}")
    return values.astype(np.int64)


def _cache_rows(b: int, rows: np.ndarray, page_size: int, block_table, cache_batch_idx):
    """(cache entry or block, row in it) of logical rows `rows` of sequence b."""
    if block_table is None:
        return np.full(rows.shape, cache_batch_idx[b]), rows
    table = np.asarray(block_table)
    return table[b, rows // page_size], rows % page_size


def kvcache_ref(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None,
                block_table=None, rotary_cos=None, rotary_sin=None, rotary_interleaved=True, softmax_scale=None,
                causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, sinks=None, rotated_dtype=None):
    """-> (out (batch, seqlen_q, nheads, headdim), lse (batch, nheads, seqlen_q), k_cache, v_cache),
    all float64, the caches as they are after the append (copies; the arguments are not changed).
    rotated_dtype: the dtype rotated keys and queries are held in (the cache's, as the kernels hold
    them), to which they are rounded after the rotation; None keeps them in float64."""
    q = _f64(q)
    batch, seqlen_q, nheads, headdim = q.shape
    k_cache, v_cache = _f64(k_cache).copy(), _f64(v_cache).copy()
    seqlen_cache = k_cache.shape[1]
    paged = block_table is not None
    page_size = seqlen_cache if paged else None
    seqlens = _per_batch(cache_seqlens, batch, "cache_seqlens", 0 if paged else seqlen_cache)
    if cache_seqlens is None and k is not None:
        raise ValueError("cache_seqlens is needed where the new keys k, v are appended")
    leftpad = _per_batch(cache_leftpad, batch, "cache_leftpad", 0)
    entries = np.arange(batch) if cache_batch_idx is None else np.asarray(cache_batch_idx).astype(np.int64)
    seqlen_new = 0 if k is None else k.shape[1]
    rotary = rotary_cos is not None
    windowed = causal or tuple(window_size) != (-1, -1)
    out = np.zeros(q.shape)
    lse = np.empty((batch, nheads, seqlen_q))
    for b in range(batch):
        if seqlen_new:
            rows = seqlens[b] + np.arange(seqlen_new)
            k_new, v_new = _f64(k[b]), _f64(v[b])
            if rotary:
                k_new = _rounded(rotary_rotate(k_new, rotary_cos, rotary_sin, rows, rotary_interleaved), rotated_dtype)
            where = _cache_rows(b, rows, page_size, block_table, entries)
            k_cache[where], v_cache[where] = k_new, v_new
        keys = np.arange(leftpad[b], seqlens[b] + seqlen_new)
        where = _cache_rows(b, keys, page_size, block_table, entries)
        q_b = q[b]
        if rotary:
            positions = seqlens[b] + (np.arange(seqlen_q) if windowed else np.zeros(seqlen_q, np.int64))
            q_b = _rounded(rotary_rotate(q_b, rotary_cos, rotary_sin, positions, rotary_interleaved), rotated_dtype)
        slopes = None if alibi_slopes is None else np.broadcast_to(_f64(alibi_slopes), (batch, nheads))[b]
        o_b, lse_b = attention_ref(q_b[None], k_cache[where][None], v_cache[where][None], softmax_scale, causal,
                                   window_size, softcap=softcap, alibi_slopes=slopes, sinks=sinks)
        out[b], lse[b] = o_b[0], lse_b[0]
    return out, lse, k_cache, v_cache


def merge_partials(outs, lses):
    """Merge partial attention results over disjoint key sets: outs (splits, ..., headdim), lses
    (splits, ...) -> (out, lse) with lse = log sum_s exp(lse_s) and out = sum_s exp(lse_s - lse) out_s.
    A part with lse -inf (no key) weighs nothing; with no key at all, out = 0 and lse = -inf."""
    outs, lses = _f64(outs), _f64(lses)
    m = lses.max(axis=0)
    finite = np.isfinite(m)
    m_safe = np.where(finite, m, 0.0)
    w = np.exp(lses - m_safe)  # exp(-inf) = 0 for empty parts
    total = w.sum(axis=0)
    lse = np.where(finite, m_safe + np.log(np.where(finite, total, 1.0)), -np.inf)
    out = np.einsum("s...,s...d->...d", w / np.where(finite, total, 1.0), outs)
    return out, lse


def split_blocks(n_first: int, n_blocks: int, num_splits: int, split: int) -> tuple:
    """Key blocks [n_min, n_max) of split `split` among n_blocks from n_first: as evenly as they go,
    the first splits one more; splits past the last block get none (flash_decode_kernel)."""
    per, extra = divmod(n_blocks, num_splits)
    n_min = n_first + split * per + min(split, extra)
    return n_min, n_min + per + (split < extra)


def decode_split_kv(q, k, v, num_splits: int, block_n: int, *, pack: int = 1, block_m: int = 64,
                    softmax_scale=None, causal=False, window_size=(-1, -1)):
    """flash_decode_kernel's plan for one sequence, in NumPy: q (seqlen_q, nheads, d) over k, v
    (seqlen_k, nheads_k, d). A block takes `pack` query heads of one kv head (its row r is query
    row r // pack of head first + r % pack) and block_m such rows; it sees the keys its first and
    last query rows bound (the bottom-right band), cut into whole blocks of block_n keys, and split
    `split` of them gives a partial output and LSE over its share (split_blocks); merge_partials
    joins the splits -> (out (seqlen_q, nheads, d), lse (nheads, seqlen_q)), equal to attention_ref."""
    q, k, v = _f64(q), _f64(k), _f64(v)
    seqlen_q, nheads, d = q.shape
    seqlen_k, nheads_k, _ = k.shape
    group = nheads // nheads_k
    scale = d ** -0.5 if softmax_scale is None else softmax_scale
    left, right = window_size
    right = 0 if causal else right
    offset = seqlen_k - seqlen_q
    outs = np.zeros((num_splits, nheads, seqlen_q, d))
    lses = np.full((num_splits, nheads, seqlen_q), -np.inf)
    rows_total = seqlen_q * pack
    for head0 in range(0, nheads, pack):
        kv_head = head0 // group
        for row0 in range(0, rows_total, block_m):
            rows = np.arange(row0, min(row0 + block_m, rows_total))
            qs, heads = rows // pack, head0 + rows % pack
            key_begin = max(0, qs[0] + offset - left) if left >= 0 else 0
            key_end = min(seqlen_k, qs[-1] + 1 + offset + right) if right >= 0 else seqlen_k
            n_first = key_begin // block_n
            n_blocks = max(0, -(-key_end // block_n) - n_first)
            for split in range(num_splits):
                n_min, n_max = split_blocks(n_first, n_blocks, num_splits, split)
                keys = np.arange(n_min * block_n, n_max * block_n)
                keys = keys[keys < seqlen_k]
                s = np.einsum("rd,kd->rk", q[qs, heads], k[keys, kv_head]) * scale
                seen = np.ones(s.shape, bool)
                if right >= 0:
                    seen &= keys[None, :] <= qs[:, None] + offset + right
                if left >= 0:
                    seen &= keys[None, :] >= qs[:, None] + offset - left
                s = np.where(seen, s, -np.inf)
                m = s.max(axis=1, initial=-np.inf)
                some = np.isfinite(m)
                e = np.exp(s - np.where(some, m, 0.0)[:, None])
                total = e.sum(axis=1)
                outs[split, heads, qs] = np.where(some[:, None], e @ v[keys, kv_head] /
                                                  np.where(some, total, 1.0)[:, None], 0.0)
                lses[split, heads, qs] = np.where(some, m + np.log(np.where(some, total, 1.0)), -np.inf)
    out, lse = merge_partials(outs, lses)
    return out.transpose(1, 0, 2), lse
