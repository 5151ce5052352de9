"""Float64 NumPy reference of the attention the kernels compute: the executable spec.

Layout: q is (batch, seqlen_q, nheads, headdim); k and v are (batch, seqlen_k, nheads_k, headdim)
with nheads % nheads_k == 0 (GQA: query head h reads kv head h // (nheads // nheads_k)).
softmax_lse is (batch, nheads, seqlen_q), natural log. Causal masking is aligned to the
bottom-right corner (flash-attn >= 2.1): query row i sees key j iff j <= i + seqlen_k - seqlen_q.
A row that sees no key has output 0, LSE -inf and contributes no gradient.

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


def _allowed(rows, keys, seqlen_q: int, seqlen_k: int, causal: bool) -> np.ndarray:
    """The one masking rule: key in range and, when causal, not right of the bottom-right diagonal."""
    ok = keys < seqlen_k
    if causal:
        ok = ok & (keys <= rows + (seqlen_k - seqlen_q))
    return ok


def causal_mask(seqlen_q: int, seqlen_k: int) -> np.ndarray:
    """Bool (seqlen_q, seqlen_k): True where query row i may attend key j (bottom-right aligned)."""
    return _allowed(np.arange(seqlen_q)[:, None], np.arange(seqlen_k)[None, :], seqlen_q, seqlen_k, True)


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


def attention_ref(q, k, v, softmax_scale=None, causal=False):
    """softmax(Q K^T * scale) V -> (out (b, sq, h, d), lse (b, h, sq)), both float64."""
    q, k, v, group = _check_qkv(q, k, v)
    batch, seqlen_q, nheads, _ = q.shape
    seqlen_k = k.shape[1]
    scale = _scale(softmax_scale, q.shape[3])
    mask = causal_mask(seqlen_q, seqlen_k) if causal else None
    out = np.zeros(q.shape)
    lse = np.empty((batch, nheads, seqlen_q))
    # One (batch, head) at a time keeps memory at one score matrix.
    for b in range(batch):
        for h in range(nheads):
            p, lse[b, h] = _head_probs(q, k, b, h, h // group, scale, mask)
            out[b, :, h] = p @ v[b, :, h // group]
    return out, lse


def attention_bwd_ref(dout, q, k, v, softmax_scale=None, causal=False):
    """Gradients (dq, dk, dv) of sum(attention_ref(q, k, v)[0] * dout); dk, dv summed per GQA group."""
    q, k, v, group = _check_qkv(q, k, v)
    dout = _f64(dout)
    if dout.shape != q.shape:
        raise ValueError(f"dout must have the shape of q, got {dout.shape} and {q.shape}")
    batch, seqlen_q, nheads, _ = q.shape
    scale = _scale(softmax_scale, q.shape[3])
    mask = causal_mask(seqlen_q, k.shape[1]) if causal else None
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


def _tile_needs_mask(row0, n_block, block_n, seqlen_q, seqlen_k, causal) -> bool:
    """Does key block n_block hold a key that some row of the q block at row0 must not see?

    The first row of a q block sees the fewest keys, so it decides (cuda_src/mask.cuh).
    """
    key_last = (n_block + 1) * block_n - 1
    if key_last >= seqlen_k:
        return True
    return causal and key_last > row0 + seqlen_k - seqlen_q


def _n_block_max(row0, block_m, block_n, seqlen_q, seqlen_k, causal) -> int:
    """Key blocks the q block at row0 visits (none right of the diagonal); may be <= 0."""
    key_end = min(seqlen_k, row0 + block_m + seqlen_k - seqlen_q) if causal else seqlen_k
    return _ceil_div(key_end, block_n)


def _m_block_min(key0, block_m, seqlen_q, seqlen_k, causal) -> int:
    """First q block with a row that sees the key block at key0 (backward skips those above)."""
    if not causal:
        return 0
    # Row key0 + seqlen_q - seqlen_k is the first to see key0, the smallest key of the block.
    return max(0, (key0 + seqlen_q - seqlen_k) // block_m)


def fa2_forward_tiled(q, k, v, softmax_scale=None, causal=False, block_m=64, block_n=64,
                      return_visited=False):
    """FlashAttention-2 forward (Algorithm 1) as the kernel runs it -> (out, lse).

    With return_visited=True also returns (visited, masked): lists of (q_block, k_block) pairs in
    the order the kernel visits them (the schedule is the same for every batch and head).
    """
    q, k, v, _ = _check_qkv(q, k, v)
    _check_blocks(block_m, block_n)
    batch, seqlen_q, nheads, headdim = q.shape
    seqlen_k, nheads_k = k.shape[1], k.shape[2]
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

        # The kernel walks key blocks backwards, from the last one the block needs down to 0.
        for n_block in range(_n_block_max(row0, block_m, block_n, seqlen_q, seqlen_k, causal) - 1, -1, -1):
            keys = np.arange(n_block * block_n, min((n_block + 1) * block_n, seqlen_k))
            s = q_i @ kg[..., keys, :].swapaxes(-1, -2)
            visited.append((m_block, n_block))
            if _tile_needs_mask(row0, n_block, block_n, seqlen_q, seqlen_k, causal):
                masked.append((m_block, n_block))
                s = np.where(_allowed(rows[:, None], keys[None, :], seqlen_q, seqlen_k, causal), s, -np.inf)

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
                       return_visited=False):
    """FlashAttention-2 backward (Algorithm 2) as the kernel runs it -> (dq, dk, dv).

    out and lse are the forward's results (lse natural log, -inf for rows with no key). With
    return_visited=True also returns (visited, masked): lists of (q_block, k_block) pairs in visit order.
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

        m_block_min = _m_block_min(key0, block_m, seqlen_q, seqlen_k, causal)
        for m_block in range(m_block_min, _ceil_div(seqlen_q, block_m)):
            row0 = m_block * block_m
            rows = np.arange(row0, min(row0 + block_m, seqlen_q))
            q_i, do_i = qg[..., rows, :], dog[..., rows, :]

            s = q_i @ k_j.swapaxes(-1, -2)
            visited.append((m_block, n_block))
            if _tile_needs_mask(row0, n_block, block_n, seqlen_q, seqlen_k, causal):
                masked.append((m_block, n_block))
                s = np.where(_allowed(rows[:, None], keys[None, :], seqlen_q, seqlen_k, causal), s, -np.inf)
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
