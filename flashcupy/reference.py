"""Float64 NumPy reference of the attention the kernels compute: the executable spec.

Layout: q is (batch, seqlen_q, nheads, headdim); k and v are (batch, seqlen_k, nheads_k, headdim)
with nheads % nheads_k == 0 (GQA: query head h reads kv head h // (nheads // nheads_k)).
softmax_lse is (batch, nheads, seqlen_q), natural log.

Masking (the kernels' band, cuda_src/mask.cuh): offset = seqlen_k - seqlen_q for
alignment="bottom_right" (flash-attn >= 2.1, the default) or 0 for "top_left" (PyTorch SDPA, JAX);
(left, right) = window_size with -1 unbounded; causal=True means right = 0. Query row i sees key j
iff j < seqlen_k and (left unbounded or j >= i + offset - left) and (right unbounded or
j <= i + offset + right). Without causal and window nothing is masked.

Scores, for batch b, query head h, row i and key j, built in this order ("scaled units", the units
the softmax exponentiates):
  1. s = softmax_scale * q_i . k_j, softmax_scale defaulting to 1 / sqrt(headdim);
  2. softcap > 0 (0 = off): s = softcap * tanh(s / softcap);
  3. alibi_slopes, shape (nheads,) or (batch, nheads): s = s - slope[b, h] * |i + offset - j|, with
     the mask's offset, on every (i, j) whether masked or not (it is a bias, not a mask);
  4. s = -inf where row i does not see key j.
Softmax, with sinks (shape (nheads,), one logit per query head in scaled units) joining only the
denominator: l_i = sum_j exp(s_ij) + exp(sinks[h]) (no sink term without sinks),
out_i = sum_j exp(s_ij) / l_i * v_j, lse_i = log(l_i). A row that sees no key has output 0 and
LSE sinks[h] (-inf without sinks), and contributes no gradient to q, k, v.

Gradients are those of sum(out * dout) (the LSE is not differentiated). With P the probabilities,
D_i = rowsum(dout_i * out_i) and dS = P * (dout V^T - D) in scaled units: softcap multiplies dS by
1 - tanh^2(s / softcap) (s as after step 1); then dq = softmax_scale * dS K, dk = softmax_scale *
dS^T Q and dv = P^T dout, dk and dv summed over each GQA group; alibi_slopes gets no gradient.
With sinks the backward returns a fourth result, dsinks[h] = -sum_{b,i} exp(sinks[h] - lse_bhi) * D_bhi
(the sink's probability times -D); without sinks exactly (dq, dk, dv).

Variable length (attention_varlen_ref, attention_varlen_bwd_ref): q is (total_q, nheads, headdim), k
and v (total_k, nheads_k, headdim), packing `batch` sequences; cu_seqlens_q and cu_seqlens_k are
integer (int32 in the kernels), of length batch + 1, cu[0] = 0, non-decreasing, cu[-1] = total.
Sequence b is rows cu_seqlens_q[b]:cu_seqlens_q[b + 1] of q and cu_seqlens_k[b]:cu_seqlens_k[b + 1]
of k, v (either may be empty) and is attended alone, as a batch of one with its own seqlen_q and
seqlen_k (so its own offset) and alibi_slopes row b. softmax_lse is (nheads, total_q); dsinks sums
over all sequences.

Two kinds of functions live here:
  * attention_ref / attention_bwd_ref: the plain math, per (batch, head) with the full score matrix.
  * fa2_forward_tiled / fa2_backward_tiled: FlashAttention-2 Algorithms 1 and 2 written the way
    the CUDA kernels run them (same loop order, tile skipping, masking rule, base-2 online softmax,
    sink folded in at the forward's end), so a kernel can be read against them line by line.
All inputs are cast to float64; every result is float64.
"""

from __future__ import annotations

import math

import numpy as np

from .validation import ALIGNMENTS

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


def _check_softcap(softcap) -> float:
    if (isinstance(softcap, (bool, np.bool_)) or not isinstance(softcap, (int, float, np.integer, np.floating))
            or not 0 <= softcap < math.inf):
        raise ValueError(f"softcap must be a finite number >= 0 (0 = off), got {softcap!r}")
    return float(softcap)


def _alibi_rows(alibi_slopes, batch: int, nheads: int):
    """alibi_slopes as float64 (batch, nheads), or None when off."""
    if alibi_slopes is None:
        return None
    slopes = _f64(alibi_slopes)
    if slopes.shape not in ((nheads,), (batch, nheads)):
        raise ValueError(f"alibi_slopes must be (nheads,) {(nheads,)} or (batch, nheads) {(batch, nheads)}, "
                         f"got {slopes.shape}")
    return np.broadcast_to(slopes, (batch, nheads))


def _check_sinks(sinks, nheads: int):
    """sinks as float64 (nheads,), or None when off."""
    if sinks is None:
        return None
    sinks = _f64(sinks)
    if sinks.shape != (nheads,) or not np.isfinite(sinks).all():
        raise ValueError(f"sinks must be finite, of shape (nheads,) {(nheads,)}, got {sinks.shape}")
    return sinks


def _alibi_distance(rows, keys, offset: int) -> np.ndarray:
    """|i + offset - j| for rows i and keys j (1-D): ALiBi measures from the band's diagonal."""
    return np.abs(rows[:, None] + offset - keys[None, :])


def _dsinks(sinks, lse, delta) -> np.ndarray:
    """dsinks[h] = -sum_{b,i} exp(sinks[h] - lse[b,h,i]) * D[b,h,i]: the sink's probability times -D.

    lse >= sinks[h] in every row, so the exponential stays <= 1.
    """
    return -np.sum(np.exp(sinks[None, :, None] - lse) * delta, axis=(0, 2))


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


def _softmax_rows(s: np.ndarray, sink: float = -np.inf):
    """Row softmax of scaled scores s (masked entries -inf) with exp(sink) added to every
    denominator -> (p, lse); a row with no key gives p = 0 and lse = sink (-inf: no sink)."""
    m = np.max(s, axis=-1, keepdims=True, initial=sink)  # initial covers seqlen_k == 0
    # Subtracting 0 for an all-masked row without sink keeps exp at 0 instead of exp(-inf - -inf) = NaN.
    m = np.where(m == -np.inf, 0.0, m)
    e = np.exp(s - m)
    l = e.sum(axis=-1, keepdims=True) + np.exp(sink - m)
    empty = l == 0
    p = e / np.where(empty, 1.0, l)
    lse = np.where(empty, -np.inf, m + np.log(np.where(empty, 1.0, l)))
    return p, lse[..., 0]


# ----------------------------------------------------------------------------------------------
# Plain reference
# ----------------------------------------------------------------------------------------------


class _Heads:
    """The plain reference's validated options for one call, giving one (batch, head) at a time."""

    def __init__(self, q, k, group, softmax_scale, causal, window_size, alignment, softcap, alibi_slopes, sinks):
        batch, seqlen_q, nheads, headdim = q.shape
        seqlen_k = k.shape[1]
        self.q, self.k, self.group = q, k, group
        self.scale = _scale(softmax_scale, headdim)
        band = _band(causal, window_size, alignment, seqlen_q, seqlen_k)
        rows, keys = np.arange(seqlen_q), np.arange(seqlen_k)
        self.mask = _allowed(rows[:, None], keys[None, :], seqlen_k, band) if band.active else None
        self.softcap = _check_softcap(softcap)
        self.alibi = _alibi_rows(alibi_slopes, batch, nheads)
        self.distance = None if self.alibi is None else _alibi_distance(rows, keys, band.offset)
        self.sinks = _check_sinks(sinks, nheads)

    def probs(self, b, h):
        """-> (p, lse, dcap) of head h in batch b; dcap = d(capped score) / d(scaled score), 1 without softcap."""
        s = self.q[b, :, h] @ self.k[b, :, h // self.group].T * self.scale
        dcap = 1.0
        if self.softcap:
            t = np.tanh(s / self.softcap)
            s, dcap = self.softcap * t, 1.0 - t * t
        if self.alibi is not None:
            s = s - self.alibi[b, h] * self.distance
        if self.mask is not None:
            s = np.where(self.mask, s, -np.inf)
        p, lse = _softmax_rows(s, -np.inf if self.sinks is None else self.sinks[h])
        return p, lse, dcap


def attention_ref(q, k, v, softmax_scale=None, causal=False, window_size=(-1, -1), alignment="bottom_right", *,
                  softcap=0.0, alibi_slopes=None, sinks=None):
    """softmax(Q K^T * scale) V -> (out (b, sq, h, d), lse (b, h, sq)), both float64.

    causal, window_size and alignment select the keys each row sees (attention_mask); softcap,
    alibi_slopes and sinks as in the module docstring.
    """
    q, k, v, group = _check_qkv(q, k, v)
    batch, seqlen_q, nheads, _ = q.shape
    heads = _Heads(q, k, group, softmax_scale, causal, window_size, alignment, softcap, alibi_slopes, sinks)
    out = np.zeros(q.shape)
    lse = np.empty((batch, nheads, seqlen_q))
    # One (batch, head) at a time keeps memory at one score matrix.
    for b in range(batch):
        for h in range(nheads):
            p, lse[b, h], _ = heads.probs(b, h)
            out[b, :, h] = p @ v[b, :, h // group]
    return out, lse


def attention_bwd_ref(dout, q, k, v, softmax_scale=None, causal=False, window_size=(-1, -1),
                      alignment="bottom_right", *, softcap=0.0, alibi_slopes=None, sinks=None, out=None):
    """Gradients (dq, dk, dv) of sum(attention_ref(q, k, v, ...)[0] * dout); dk, dv summed per GQA group.

    With sinks, (dq, dk, dv, dsinks), dsinks of shape (nheads,). `out`, when given, is the forward
    output the backward is handed (e.g. rounded to the input dtype): D = rowsum(dout * out) is taken
    from it, as the FlashAttention backwards take it, instead of from the exact output.
    """
    q, k, v, group = _check_qkv(q, k, v)
    dout = _f64(dout)
    if dout.shape != q.shape:
        raise ValueError(f"dout must have the shape of q, got {dout.shape} and {q.shape}")
    batch, seqlen_q, nheads, _ = q.shape
    heads = _Heads(q, k, group, softmax_scale, causal, window_size, alignment, softcap, alibi_slopes, sinks)
    out = None if out is None else _f64(out)
    if out is not None and out.shape != q.shape:
        raise ValueError(f"out must have the shape of q, got {out.shape} and {q.shape}")
    dq, dk, dv = np.zeros(q.shape), np.zeros(k.shape), np.zeros(v.shape)
    lse, delta = np.empty((batch, nheads, seqlen_q)), np.empty((batch, nheads, seqlen_q))
    for b in range(batch):
        for h in range(nheads):
            kh = h // group
            p, lse[b, h], dcap = heads.probs(b, h)  # empty rows: p = 0, so no gradient
            do = dout[b, :, h]
            o = p @ v[b, :, kh] if out is None else out[b, :, h]
            dv[b, :, kh] += p.T @ do
            dp = do @ v[b, :, kh].T
            delta[b, h] = np.sum(do * o, axis=-1)
            # The chain rule through the softcap's tanh turns the capped score's gradient into the scaled one's.
            ds = p * (dp - delta[b, h, :, None]) * dcap
            dq[b, :, h] = heads.scale * (ds @ k[b, :, kh])
            dk[b, :, kh] += heads.scale * (ds.T @ q[b, :, h])
    if heads.sinks is None:
        return dq, dk, dv
    return dq, dk, dv, _dsinks(heads.sinks, lse, delta)


# ----------------------------------------------------------------------------------------------
# Variable-length (packed) batches
# ----------------------------------------------------------------------------------------------


def _cu_seqlens(cu_seqlens, total: int, name: str) -> list:
    cu = np.asarray(cu_seqlens)
    if cu.ndim != 1 or cu.size < 2 or not np.issubdtype(cu.dtype, np.integer):
        raise ValueError(f"{name} must be a 1-D integer array of length batch + 1 >= 2, "
                         f"got dtype {cu.dtype} shape {cu.shape}")
    if cu[0] != 0 or cu[-1] != total or np.any(np.diff(cu) < 0):
        raise ValueError(f"{name} must start at 0, never decrease and end at the packed length {total}, "
                         f"got {cu.tolist()}")
    return [int(x) for x in cu]


def _varlen_sequences(q, k, v, cu_seqlens_q, cu_seqlens_k, kw):
    """Validate a packed batch -> [(q rows, kv rows, options)]: one entry per sequence, as slices
    and the keyword arguments of attention_ref for that sequence (its alibi_slopes row)."""
    if q.ndim != 3 or k.ndim != 3:
        raise ValueError(f"packed q and k must be 3-D (total, heads, headdim), got {q.shape} and {k.shape}")
    if v.shape != k.shape:
        raise ValueError(f"v must have the shape of k, got {v.shape} and {k.shape}")
    cu_q = _cu_seqlens(cu_seqlens_q, q.shape[0], "cu_seqlens_q")
    cu_k = _cu_seqlens(cu_seqlens_k, k.shape[0], "cu_seqlens_k")
    if len(cu_q) != len(cu_k):
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must both have length batch + 1, "
                         f"got {len(cu_q)} and {len(cu_k)}")
    batch = len(cu_q) - 1
    kw = dict(kw)
    alibi = _alibi_rows(kw.pop("alibi_slopes", None), batch, q.shape[1])
    return [(slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1]),
             dict(kw, alibi_slopes=None if alibi is None else alibi[b:b + 1])) for b in range(batch)]


def attention_varlen_ref(q, k, v, cu_seqlens_q, cu_seqlens_k, **kw):
    """attention_ref over a packed batch -> (out (total_q, h, d), lse (h, total_q)), both float64.

    Each sequence is attended alone (module docstring); kw are attention_ref's options, alibi_slopes
    (nheads,) or (batch, nheads).
    """
    q, k, v = _f64(q), _f64(k), _f64(v)
    sequences = _varlen_sequences(q, k, v, cu_seqlens_q, cu_seqlens_k, kw)
    out = np.zeros(q.shape)
    lse = np.empty((q.shape[1], q.shape[0]))
    for rows, kv_rows, options in sequences:
        out_b, lse_b = attention_ref(q[None, rows], k[None, kv_rows], v[None, kv_rows], **options)
        out[rows], lse[:, rows] = out_b[0], lse_b[0]
    return out, lse


def attention_varlen_bwd_ref(dout, q, k, v, cu_seqlens_q, cu_seqlens_k, out=None, **kw):
    """attention_bwd_ref over a packed batch -> (dq, dk, dv) in the packed layouts, or
    (dq, dk, dv, dsinks) with sinks, dsinks summed over the sequences; `out` packed as q."""
    dout, q, k, v = _f64(dout), _f64(q), _f64(k), _f64(v)
    out = None if out is None else _f64(out)
    if dout.shape != q.shape:
        raise ValueError(f"dout must have the shape of q, got {dout.shape} and {q.shape}")
    sequences = _varlen_sequences(q, k, v, cu_seqlens_q, cu_seqlens_k, kw)
    dq, dk, dv = np.zeros(q.shape), np.zeros(k.shape), np.zeros(v.shape)
    dsinks = np.zeros(q.shape[1])
    for rows, kv_rows, options in sequences:
        grads = attention_bwd_ref(dout[None, rows], q[None, rows], k[None, kv_rows], v[None, kv_rows], **options,
                                  out=None if out is None else out[None, rows])
        dq[rows], dk[kv_rows], dv[kv_rows] = grads[0][0], grads[1][0], grads[2][0]
        dsinks += grads[3] if len(grads) == 4 else 0.0
    return (dq, dk, dv) if kw.get("sinks") is None else (dq, dk, dv, dsinks)


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


class _TileScores:
    """Score tiles as the kernels hold them, in tile units: one multiply by c = unit * log2(e)
    turns a tile score into a base-2 exponent in scaled units.

    Without softcap a tile score is the raw q . k and unit = softmax_scale; with softcap it is
    tanh(q . k * softmax_scale / softcap) and unit = softcap (scaled score = softcap * tanh). ALiBi
    enters divided by unit, as flash-attn divides the slope by its softmax multiplier. unit > 0, so
    a running max of tile scores is a running max of scaled ones.
    """

    def __init__(self, scale, softcap, alibi, offset, nheads_k):
        self.scale, self.softcap, self.offset = scale, softcap, offset
        self.unit = softcap if softcap else scale
        self.c = self.unit * LOG2E
        # (batch, nheads) -> (batch, nheads_k, group, 1, 1), the grouped layout of the tiles.
        self.alibi = None if alibi is None else alibi.reshape(alibi.shape[0], nheads_k, -1, 1, 1) / self.unit

    def __call__(self, q_i, k_j, rows, keys):
        """-> (t, g): the tile's scores and g = d(scaled score) / d(softmax_scale * q . k), the
        backward's softcap factor 1 - tanh^2 (1 without softcap)."""
        t = q_i @ k_j.swapaxes(-1, -2)
        g = 1.0
        if self.softcap:
            t = np.tanh(t * (self.scale / self.softcap))
            g = 1.0 - t * t
        if self.alibi is not None:
            t = t - self.alibi * _alibi_distance(rows, keys, self.offset)
        return t, g


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
                      return_visited=False, window_size=(-1, -1), alignment="bottom_right", *,
                      softcap=0.0, alibi_slopes=None, sinks=None):
    """FlashAttention-2 forward (Algorithm 1) as the kernel runs it -> (out, lse).

    causal, window_size, alignment, softcap, alibi_slopes and sinks as in attention_ref. With
    return_visited=True also returns (visited, masked): lists of (q_block, k_block) pairs in the
    order the kernel visits them (the schedule is the same for every batch and head).
    """
    q, k, v, _ = _check_qkv(q, k, v)
    _check_blocks(block_m, block_n)
    batch, seqlen_q, nheads, headdim = q.shape
    seqlen_k, nheads_k = k.shape[1], k.shape[2]
    band = _band(causal, window_size, alignment, seqlen_q, seqlen_k)
    scores = _TileScores(_scale(softmax_scale, headdim), _check_softcap(softcap),
                         _alibi_rows(alibi_slopes, batch, nheads), band.offset, nheads_k)
    sinks = _check_sinks(sinks, nheads)
    c = scores.c

    qg, kg, vg = _grouped(q, nheads_k), _grouped(k, nheads_k), _grouped(v, nheads_k)
    out = np.zeros(qg.shape)
    lse = np.empty(qg.shape[:-1])
    sinks_g = None if sinks is None else sinks.reshape(1, nheads_k, -1, 1)
    visited, masked = [], []

    for m_block in range(_ceil_div(seqlen_q, block_m)):
        row0 = m_block * block_m
        rows = np.arange(row0, min(row0 + block_m, seqlen_q))
        q_i = qg[..., rows, :]
        m = np.full(q_i.shape[:-1], -np.inf)  # running row max of tile scores
        l = np.zeros(q_i.shape[:-1])  # running sum of exp2 terms
        o = np.zeros(q_i.shape)  # unnormalised output

        # The kernel walks key blocks backwards, from the last one the block needs down to the
        # first (0 unless the window bounds the left); none at all when n_block_max <= n_block_min.
        n_block_min, n_block_max = _n_block_range(row0, block_m, block_n, seqlen_k, band)
        for n_block in range(n_block_max - 1, n_block_min - 1, -1):
            keys = np.arange(n_block * block_n, min((n_block + 1) * block_n, seqlen_k))
            s, _ = scores(q_i, kg[..., keys, :], rows, keys)
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

        row_max = m * scores.unit  # scaled units; -inf where no key was seen
        if sinks_g is not None:
            # Epilogue: the sink is one last key of the online softmax, with score sink and value 0,
            # so the denominator becomes l + exp(sink - row_max). Rescaling to max(row_max, sink)
            # first keeps exp2 finite where the sink exceeds every score (ALiBi far from the
            # diagonal), and gives a row that saw no key l = 1: out 0, lse = sink.
            new_max = np.maximum(row_max, sinks_g)
            alpha = np.exp2((row_max - new_max) * LOG2E)
            l = l * alpha + np.exp2((sinks_g - new_max) * LOG2E)
            o = o * alpha[..., None]
            row_max = new_max
        empty = l == 0  # no key seen (or no block visited at all) and no sink
        safe_l = np.where(empty, 1.0, l)
        out[..., rows, :] = np.where(empty[..., None], 0.0, o / safe_l[..., None])
        lse[..., rows] = np.where(empty, -np.inf, row_max + np.log(safe_l))

    out = _ungrouped(out)
    lse = lse.reshape(batch, nheads, seqlen_q)
    if return_visited:
        return out, lse, visited, masked
    return out, lse


def fa2_backward_tiled(dout, q, k, v, out, lse, softmax_scale=None, causal=False, block_m=64, block_n=64,
                       return_visited=False, window_size=(-1, -1), alignment="bottom_right", *,
                       softcap=0.0, alibi_slopes=None, sinks=None):
    """FlashAttention-2 backward (Algorithm 2) as the kernel runs it -> (dq, dk, dv), or
    (dq, dk, dv, dsinks) with sinks.

    out and lse are the forward's results (lse natural log, the sink included; -inf for rows with
    no key and no sink); causal, window_size, alignment, softcap, alibi_slopes and sinks as in
    attention_ref. With return_visited=True also returns (visited, masked): lists of
    (q_block, k_block) pairs in visit order.
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
    scores = _TileScores(scale, _check_softcap(softcap), _alibi_rows(alibi_slopes, batch, nheads), band.offset,
                         nheads_k)
    sinks = _check_sinks(sinks, nheads)

    qg, kg, vg = _grouped(q, nheads_k), _grouped(k, nheads_k), _grouped(v, nheads_k)
    dog = _grouped(dout, nheads_k)
    lse_g = lse.reshape(qg.shape[:-1])
    # Preprocessing pass: D_i = rowsum(dO_i * O_i).
    delta = np.sum(dog * _grouped(out, nheads_k), axis=-1)
    # P is recomputed from the LSE in base 2; the sink is in the LSE, so it needs nothing else in the
    # loop. A row with LSE -inf saw no key: an LSE of +inf there makes every exp2 argument -inf, so
    # P = 0 without any -inf - -inf = NaN.
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

            s, g = scores(q_i, k_j, rows, keys)
            visited.append((m_block, n_block))
            # Rows past seqlen_q do not exist here; the kernel masks them, which is why a q block
            # running past seqlen_q counts as masked.
            if _bwd_needs_mask(row0, n_block, block_m, block_n, seqlen_q, seqlen_k, band):
                masked.append((m_block, n_block))
                s = np.where(_allowed(rows[:, None], keys[None, :], seqlen_k, band), s, -np.inf)
            p = np.exp2(s * scores.c - lse2[..., rows, None])

            # Sums over the group axis give dk, dv of the shared kv head (GQA).
            dv_j += (p.swapaxes(-1, -2) @ do_i).sum(axis=2, keepdims=True)
            dp = do_i @ v_j.swapaxes(-1, -2)
            # g carries the gradient through the softcap's tanh to the raw score.
            ds = p * (dp - delta[..., rows, None]) * g
            dk_j += (ds.swapaxes(-1, -2) @ q_i).sum(axis=2, keepdims=True)
            dq_acc[..., rows, :] += ds @ k_j

        dk[..., keys, :] = dk_j * scale
        dv[..., keys, :] = dv_j

    grads = (_ungrouped(dq_acc * scale), _ungrouped(dk), _ungrouped(dv))
    if sinks is not None:
        # The kernel computes dsinks outside the tiled loop, from the LSE and D alone.
        grads += (_dsinks(sinks, lse, delta.reshape(batch, nheads, seqlen_q)),)
    if return_visited:
        return grads + (visited, masked)
    return grads


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
