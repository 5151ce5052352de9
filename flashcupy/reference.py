"""Float64 NumPy reference of the attention the kernels compute: the executable spec.

Layout: q is (batch, seqlen_q, nheads, headdim); k and v are (batch, seqlen_k, nheads_k, headdim)
with nheads % nheads_k == 0 (GQA: query head h reads kv head h // (nheads // nheads_k)).
softmax_lse is (batch, nheads, seqlen_q), natural log.

Masking (the kernels' band, cuda_src/mask.cuh): offset = seqlen_k - seqlen_q for
alignment="bottom_right" (flash-attn >= 2.1, the default) or 0 for "top_left" (PyTorch SDPA, JAX);
(left, right) = window_size with -1 unbounded; causal=True means right = 0. Query row i sees key j
iff j < seqlen_k and (left unbounded or j >= i + offset - left) and (right unbounded or
j <= i + offset + right). Without causal and window nothing is masked. A row that sees no key has
output 0, LSE -inf and contributes no gradient.

Two kinds of functions live here:
  * attention_ref / attention_bwd_ref: the plain math, per (batch, head) with the full score matrix.
  * fa2_forward_tiled / fa2_backward_tiled: FlashAttention-2 Algorithms 1 and 2 written the way
    the CUDA kernels run them (same loop order, tile skipping, masking rule, base-2 online softmax),
    so a kernel can be read against them line by line.
All inputs are cast to float64; every result is float64.
"""

from __future__ import annotations

import math

import numpy as np

LOG2E = math.log2(math.e)


# ----------------------------------------------------------------------------------------------
# Shared helpers
# ----------------------------------------------------------------------------------------------


def _f64(x) -> np.ndarray:
    # astype handles float16, float32 and ml_dtypes.bfloat16 alike.
    return np.asarray(x).astype(np.float64)


def _check_qkv(q, k, v):
    """Cast to float64, validate the layout, return (q, k, v, heads_per_kv_head)."""
    q, k, v = _f64(q), _f64(k), _f64(v)
    if q.ndim != 4 or k.ndim != 4:
        raise ValueError(f"q and k must be 4-D (batch, seqlen, heads, headdim), got {q.shape} and {k.shape}")
    if v.shape != k.shape:
        raise ValueError(f"v must have the shape of k, got {v.shape} and {k.shape}")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"batch and headdim of q {q.shape} and k {k.shape} differ")
    nheads, nheads_k = q.shape[2], k.shape[2]
    if nheads_k == 0 or nheads % nheads_k != 0:
        raise ValueError(f"nheads ({nheads}) must be a multiple of nheads_k ({nheads_k})")
    return q, k, v, nheads // nheads_k


def _scale(softmax_scale, headdim: int) -> float:
    return 1.0 / math.sqrt(headdim) if softmax_scale is None else float(softmax_scale)


ALIGNMENTS = ("bottom_right", "top_left")


class _Band:
    """Which keys a query row may see: row i sees keys [i + offset - left, i + offset + right],
    cut to [0, seqlen_k). left / right are None where unbounded; causal is right = 0."""

    __slots__ = ("offset", "left", "right")

    def __init__(self, offset: int, left, right):
        self.offset, self.left, self.right = offset, left, right

    @property
    def active(self) -> bool:
        """False when only seqlen_k bounds the keys (no causal mask, no window)."""
        return self.left is not None or self.right is not None


def _check_alignment(alignment) -> None:
    if not isinstance(alignment, str) or alignment not in ALIGNMENTS:
        raise ValueError(f"alignment must be one of {ALIGNMENTS}, got {alignment!r}")


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _band(causal, window_size, alignment, seqlen_q: int, seqlen_k: int) -> _Band:
    """Validate the masking options and resolve them into a _Band for these sequence lengths."""
    _check_alignment(alignment)
    try:
        left, right = window_size
    except (TypeError, ValueError):
        raise ValueError(f"window_size must be a pair (left, right) of ints >= -1, got {window_size!r}") from None
    if not (_is_int(left) and _is_int(right)) or left < -1 or right < -1:
        raise ValueError(f"window_size must be a pair (left, right) of ints >= -1, got {window_size!r}")
    left, right = int(left), int(right)
    if causal:
        if right not in (-1, 0):
            raise ValueError(f"window_size right must be -1 or 0 when causal=True (causal means right = 0), "
                             f"got window_size {window_size!r}")
        right = 0
    offset = seqlen_k - seqlen_q if alignment == "bottom_right" else 0
    return _Band(offset, None if left < 0 else left, None if right < 0 else right)


def _allowed(rows, keys, seqlen_k: int, band: _Band) -> np.ndarray:
    """The one masking rule: key in range and inside the row's band."""
    ok = keys < seqlen_k
    if band.left is not None:
        ok = ok & (keys >= rows + band.offset - band.left)
    if band.right is not None:
        ok = ok & (keys <= rows + band.offset + band.right)
    return ok


def attention_mask(seqlen_q: int, seqlen_k: int, causal=False, window_size=(-1, -1),
                   alignment="bottom_right") -> np.ndarray:
    """Bool (seqlen_q, seqlen_k): True where query row i may attend key j.

    offset = seqlen_k - seqlen_q ("bottom_right") or 0 ("top_left"); (left, right) = window_size,
    -1 unbounded, causal forces right = 0. Row i sees key j iff j >= i + offset - left (left
    bounded) and j <= i + offset + right (right bounded).
    """
    band = _band(causal, window_size, alignment, seqlen_q, seqlen_k)
    return _allowed(np.arange(seqlen_q)[:, None], np.arange(seqlen_k)[None, :], seqlen_k, band)


def causal_mask(seqlen_q: int, seqlen_k: int, alignment="bottom_right") -> np.ndarray:
    """Bool (seqlen_q, seqlen_k): True where query row i may attend key j, i.e. j <= i + offset."""
    return attention_mask(seqlen_q, seqlen_k, causal=True, alignment=alignment)


def _ceil_div(a: int, b: int) -> int:
    # Python's floor division makes this a true ceiling for negative a too.
    return -(-a // b)


def _grouped(x: np.ndarray, nheads_k: int) -> np.ndarray:
    """(batch, seqlen, nheads, d) -> (batch, nheads_k, group, seqlen, d); head h = kv * group + g."""
    b, s, h, d = x.shape
    return x.transpose(0, 2, 1, 3).reshape(b, nheads_k, h // nheads_k, s, d)


def _ungrouped(x: np.ndarray) -> np.ndarray:
    """Inverse of _grouped."""
    b, hk, g, s, d = x.shape
    return x.reshape(b, hk * g, s, d).transpose(0, 2, 1, 3)


def _softmax_rows(s: np.ndarray):
    """Row softmax of scaled scores s (masked entries -inf) -> (p, lse); empty rows give 0, -inf."""
    m = np.max(s, axis=-1, keepdims=True, initial=-np.inf)  # initial covers seqlen_k == 0
    # Subtracting 0 for an all-masked row keeps exp at 0 instead of exp(-inf - -inf) = NaN.
    m = np.where(m == -np.inf, 0.0, m)
    e = np.exp(s - m)
    l = e.sum(axis=-1, keepdims=True)
    empty = l == 0
    p = e / np.where(empty, 1.0, l)
    lse = np.where(empty, -np.inf, m + np.log(np.where(empty, 1.0, l)))
    return p, lse[..., 0]


# ----------------------------------------------------------------------------------------------
# Plain reference
# ----------------------------------------------------------------------------------------------


def _head_probs(q, k, b, h, kh, scale, mask):
    s = q[b, :, h] @ k[b, :, kh].T * scale
    if mask is not None:
        s = np.where(mask, s, -np.inf)
    return _softmax_rows(s)


def _mask_or_none(causal, window_size, alignment, seqlen_q: int, seqlen_k: int):
    """The (seqlen_q, seqlen_k) mask, or None when nothing is masked (validates the options)."""
    band = _band(causal, window_size, alignment, seqlen_q, seqlen_k)
    if not band.active:
        return None
    return _allowed(np.arange(seqlen_q)[:, None], np.arange(seqlen_k)[None, :], seqlen_k, band)


def attention_ref(q, k, v, softmax_scale=None, causal=False, window_size=(-1, -1), alignment="bottom_right"):
    """softmax(Q K^T * scale) V -> (out (b, sq, h, d), lse (b, h, sq)), both float64.

    causal, window_size and alignment select the keys each row sees (attention_mask).
    """
    q, k, v, group = _check_qkv(q, k, v)
    batch, seqlen_q, nheads, _ = q.shape
    seqlen_k = k.shape[1]
    scale = _scale(softmax_scale, q.shape[3])
    mask = _mask_or_none(causal, window_size, alignment, seqlen_q, seqlen_k)
    out = np.zeros(q.shape)
    lse = np.empty((batch, nheads, seqlen_q))
    # One (batch, head) at a time keeps memory at one score matrix.
    for b in range(batch):
        for h in range(nheads):
            p, lse[b, h] = _head_probs(q, k, b, h, h // group, scale, mask)
            out[b, :, h] = p @ v[b, :, h // group]
    return out, lse


def attention_bwd_ref(dout, q, k, v, softmax_scale=None, causal=False, window_size=(-1, -1),
                      alignment="bottom_right"):
    """Gradients (dq, dk, dv) of sum(attention_ref(q, k, v, ...)[0] * dout); dk, dv summed per GQA group."""
    q, k, v, group = _check_qkv(q, k, v)
    dout = _f64(dout)
    if dout.shape != q.shape:
        raise ValueError(f"dout must have the shape of q, got {dout.shape} and {q.shape}")
    batch, seqlen_q, nheads, _ = q.shape
    scale = _scale(softmax_scale, q.shape[3])
    mask = _mask_or_none(causal, window_size, alignment, seqlen_q, k.shape[1])
    dq, dk, dv = np.zeros(q.shape), np.zeros(k.shape), np.zeros(v.shape)
    for b in range(batch):
        for h in range(nheads):
            kh = h // group
            p, _ = _head_probs(q, k, b, h, kh, scale, mask)  # empty rows: p = 0, so no gradient
            do = dout[b, :, h]
            o = p @ v[b, :, kh]
            dv[b, :, kh] += p.T @ do
            dp = do @ v[b, :, kh].T
            delta = np.sum(do * o, axis=-1, keepdims=True)
            ds = p * (dp - delta)
            dq[b, :, h] = scale * (ds @ k[b, :, kh])
            dk[b, :, kh] += scale * (ds.T @ q[b, :, h])
    return dq, dk, dv


# ----------------------------------------------------------------------------------------------
# FlashAttention-2, tiled as the kernels run it
# ----------------------------------------------------------------------------------------------
#
# Every (batch, head) pair is an independent thread block in the kernels, so the NumPy code
# runs one tile for all of them at once: arrays are grouped to (batch, nheads_k, group, seq, d)
# and K_j / V_j broadcast over the group axis (no GQA copies).


def _check_blocks(block_m: int, block_n: int):
    if int(block_m) != block_m or int(block_n) != block_n or block_m < 1 or block_n < 1:
        raise ValueError(f"block sizes must be positive integers, got {block_m}, {block_n}")


def _band_cuts_tile(row0, key0, block_m, block_n, band: _Band) -> bool:
    """Does the band cut the tile of q block row0 x key block key0 (all block_m x block_n slots)?

    The first row reaches least far right, so it decides the right edge; the last row of the block
    reaches least far left, so it decides the left edge (cuda_src/mask.cuh, tile_needs_mask).
    """
    key_last = key0 + block_n - 1
    if band.right is not None and key_last > row0 + band.offset + band.right:
        return True
    return band.left is not None and key0 < row0 + block_m - 1 + band.offset - band.left


def _fwd_needs_mask(row0, n_block, block_m, block_n, seqlen_k, band: _Band) -> bool:
    """Forward: the key block straddles seqlen_k or an edge of the band."""
    key0 = n_block * block_n
    return key0 + block_n - 1 >= seqlen_k or _band_cuts_tile(row0, key0, block_m, block_n, band)


def _bwd_needs_mask(row0, n_block, block_m, block_n, seqlen_q, seqlen_k, band: _Band) -> bool:
    """Backward: as the forward, and also when the q block runs past seqlen_q (cuda_src/bwd.cu)."""
    return (row0 + block_m > seqlen_q or _fwd_needs_mask(row0, n_block, block_m, block_n, seqlen_k, band))


def _n_block_range(row0, block_m, block_n, seqlen_k, band: _Band):
    """(n_block_min, n_block_max): the key blocks the q block at row0 visits; none when max <= min.

    Keys some row of the block may see lie in [key_begin, key_end): the first row bounds the left
    edge, the block's last row (row0 + block_m - 1, even past seqlen_q) the right one.
    """
    key_begin = 0 if band.left is None else max(0, row0 + band.offset - band.left)
    key_end = seqlen_k if band.right is None else min(seqlen_k, row0 + block_m - 1 + band.offset + band.right + 1)
    return key_begin // block_n, _ceil_div(key_end, block_n)


def _m_block_range(key0, block_m, block_n, num_m_blocks, band: _Band):
    """(m_block_min, m_block_max): the q blocks the backward visits for the key block at key0.

    Row key0 - offset - right is the first that sees key0 (the block's first key); row
    key_last - offset + left (key_last = key0 + block_n - 1, even past seqlen_k) the last that sees
    key_last. Floor division: a negative row gives block 0 at the start, no block at the end.
    """
    m_block_min = 0 if band.right is None else max(0, (key0 - band.offset - band.right) // block_m)
    if band.left is None:
        m_block_max = num_m_blocks
    else:
        row_last = key0 + block_n - 1 - band.offset + band.left
        m_block_max = 0 if row_last < 0 else min(num_m_blocks, row_last // block_m + 1)
    return m_block_min, m_block_max


def fa2_forward_tiled(q, k, v, softmax_scale=None, causal=False, block_m=64, block_n=64,
                      return_visited=False, window_size=(-1, -1), alignment="bottom_right"):
    """FlashAttention-2 forward (Algorithm 1) as the kernel runs it -> (out, lse).

    causal, window_size and alignment as in attention_ref. With return_visited=True also returns
    (visited, masked): lists of (q_block, k_block) pairs in the order the kernel visits them (the
    schedule is the same for every batch and head).
    """
    q, k, v, _ = _check_qkv(q, k, v)
    _check_blocks(block_m, block_n)
    batch, seqlen_q, nheads, headdim = q.shape
    seqlen_k, nheads_k = k.shape[1], k.shape[2]
    band = _band(causal, window_size, alignment, seqlen_q, seqlen_k)
    scale = _scale(softmax_scale, headdim)
    # Scores stay unscaled; one multiply by c turns them into base-2 exponents. The running max
    # of unscaled scores is the max of scaled ones because scale > 0.
    c = scale * LOG2E

    qg, kg, vg = _grouped(q, nheads_k), _grouped(k, nheads_k), _grouped(v, nheads_k)
    out = np.zeros(qg.shape)
    lse = np.empty(qg.shape[:-1])
    visited, masked = [], []

    for m_block in range(_ceil_div(seqlen_q, block_m)):
        row0 = m_block * block_m
        rows = np.arange(row0, min(row0 + block_m, seqlen_q))
        q_i = qg[..., rows, :]
        m = np.full(q_i.shape[:-1], -np.inf)  # running row max of unscaled scores
        l = np.zeros(q_i.shape[:-1])  # running sum of exp2 terms
        o = np.zeros(q_i.shape)  # unnormalised output

        # The kernel walks key blocks backwards, from the last one the block needs down to the
        # first (0 unless the window bounds the left); none at all when n_block_max <= n_block_min.
        n_block_min, n_block_max = _n_block_range(row0, block_m, block_n, seqlen_k, band)
        for n_block in range(n_block_max - 1, n_block_min - 1, -1):
            keys = np.arange(n_block * block_n, min((n_block + 1) * block_n, seqlen_k))
            s = q_i @ kg[..., keys, :].swapaxes(-1, -2)
            visited.append((m_block, n_block))
            if _fwd_needs_mask(row0, n_block, block_m, block_n, seqlen_k, band):
                masked.append((m_block, n_block))
                s = np.where(_allowed(rows[:, None], keys[None, :], seqlen_k, band), s, -np.inf)

            m_new = np.maximum(m, s.max(axis=-1))
            # A row that has seen only masked keys keeps max -inf: subtract 0 so exp2 gives 0, not NaN.
            m_scaled = np.where(m_new == -np.inf, 0.0, m_new * c)
            alpha = np.exp2(m * c - m_scaled)
            p = np.exp2(s * c - m_scaled[..., None])
            l = l * alpha + p.sum(axis=-1)
            o = o * alpha[..., None] + p @ vg[..., keys, :]
            m = m_new

        empty = l == 0  # no key seen (or no block visited at all)
        safe_l = np.where(empty, 1.0, l)
        out[..., rows, :] = np.where(empty[..., None], 0.0, o / safe_l[..., None])
        lse[..., rows] = np.where(empty, -np.inf, m * scale + np.log(safe_l))

    out = _ungrouped(out)
    lse = lse.reshape(batch, nheads, seqlen_q)
    if return_visited:
        return out, lse, visited, masked
    return out, lse


def fa2_backward_tiled(dout, q, k, v, out, lse, softmax_scale=None, causal=False, block_m=64, block_n=64,
                       return_visited=False, window_size=(-1, -1), alignment="bottom_right"):
    """FlashAttention-2 backward (Algorithm 2) as the kernel runs it -> (dq, dk, dv).

    out and lse are the forward's results (lse natural log, -inf for rows with no key); causal,
    window_size and alignment as in attention_ref. With return_visited=True also returns
    (visited, masked): lists of (q_block, k_block) pairs in visit order.
    """
    q, k, v, _ = _check_qkv(q, k, v)
    _check_blocks(block_m, block_n)
    dout, out, lse = _f64(dout), _f64(out), _f64(lse)
    batch, seqlen_q, nheads, headdim = q.shape
    seqlen_k, nheads_k = k.shape[1], k.shape[2]
    if dout.shape != q.shape or out.shape != q.shape:
        raise ValueError(f"dout {dout.shape} and out {out.shape} must have the shape of q {q.shape}")
    if lse.shape != (batch, nheads, seqlen_q):
        raise ValueError(f"lse must be (batch, nheads, seqlen_q) {(batch, nheads, seqlen_q)}, "
                         f"got {lse.shape}")
    band = _band(causal, window_size, alignment, seqlen_q, seqlen_k)
    scale = _scale(softmax_scale, headdim)
    c = scale * LOG2E

    qg, kg, vg = _grouped(q, nheads_k), _grouped(k, nheads_k), _grouped(v, nheads_k)
    dog = _grouped(dout, nheads_k)
    lse_g = lse.reshape(qg.shape[:-1])
    # Preprocessing pass: D_i = rowsum(dO_i * O_i).
    delta = np.sum(dog * _grouped(out, nheads_k), axis=-1)
    # P is recomputed from the LSE in base 2. A row with LSE -inf saw no key: an LSE of +inf
    # there makes every exp2 argument -inf, so P = 0 without any -inf - -inf = NaN.
    lse2 = np.where(lse_g == -np.inf, np.inf, lse_g * LOG2E)

    dq_acc = np.zeros(qg.shape)  # the kernel's float32 dQ accumulator, updated by atomic adds
    dk = np.zeros(kg.shape)
    dv = np.zeros(vg.shape)
    visited, masked = [], []

    for n_block in range(_ceil_div(seqlen_k, block_n)):
        key0 = n_block * block_n
        keys = np.arange(key0, min(key0 + block_n, seqlen_k))
        k_j, v_j = kg[..., keys, :], vg[..., keys, :]
        dk_j = np.zeros(k_j.shape)  # "registers": written once after the inner loop
        dv_j = np.zeros(v_j.shape)

        # Only the q blocks with a row that sees a key of this block, in ascending order.
        m_block_min, m_block_max = _m_block_range(key0, block_m, block_n, _ceil_div(seqlen_q, block_m), band)
        for m_block in range(m_block_min, m_block_max):
            row0 = m_block * block_m
            rows = np.arange(row0, min(row0 + block_m, seqlen_q))
            q_i, do_i = qg[..., rows, :], dog[..., rows, :]

            s = q_i @ k_j.swapaxes(-1, -2)
            visited.append((m_block, n_block))
            # Rows past seqlen_q do not exist here; the kernel masks them, which is why a q block
            # running past seqlen_q counts as masked.
            if _bwd_needs_mask(row0, n_block, block_m, block_n, seqlen_q, seqlen_k, band):
                masked.append((m_block, n_block))
                s = np.where(_allowed(rows[:, None], keys[None, :], seqlen_k, band), s, -np.inf)
            p = np.exp2(s * c - lse2[..., rows, None])

            # Sums over the group axis give dk, dv of the shared kv head (GQA).
            dv_j += (p.swapaxes(-1, -2) @ do_i).sum(axis=2, keepdims=True)
            dp = do_i @ v_j.swapaxes(-1, -2)
            ds = p * (dp - delta[..., rows, None])
            dk_j += (ds.swapaxes(-1, -2) @ q_i).sum(axis=2, keepdims=True)
            dq_acc[..., rows, :] += ds @ k_j

        dk[..., keys, :] = dk_j * scale
        dv[..., keys, :] = dv_j

    dq = _ungrouped(dq_acc * scale)
    dk, dv = _ungrouped(dk), _ungrouped(dv)
    if return_visited:
        return dq, dk, dv, visited, masked
    return dq, dk, dv


# ----------------------------------------------------------------------------------------------
# Cost model
# ----------------------------------------------------------------------------------------------


def attention_flops(batch, seqlen_q, seqlen_k, nheads, headdim, causal, mode="fwd") -> float:
    """FLOPs as the FA2 paper counts them.

    fwd = 4 * seqlen_q * seqlen_k * headdim * nheads * batch, halved when causal;
    bwd = 2.5 * fwd; fwdbwd = 3.5 * fwd.
    """
    factor = {"fwd": 1.0, "bwd": 2.5, "fwdbwd": 3.5}
    if mode not in factor:
        raise ValueError(f"mode must be one of {sorted(factor)}, got {mode!r}")
    fwd = 4.0 * seqlen_q * seqlen_k * headdim * nheads * batch
    if causal:
        fwd /= 2
    return fwd * factor[mode]
