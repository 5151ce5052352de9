// Masking of score tiles: keys past seqlen_k, and keys outside a causal diagonal or a band.
//
// Is_causal: query row i sees keys j <= i + seqlen_k - seqlen_q (the diagonal aligned to the
// bottom-right corner, as flash-attn >= 2.1).
// Is_local: the general band, row i sees keys [i + offset - left, i + offset + right], where
// offset = seqlen_k - seqlen_q (bottom-right) or 0 (top-left, as PyTorch SDPA and JAX), and a side
// the caller leaves unbounded arrives as a bound no row reaches (flashcupy/problem.py, plan_band).
// It serves sliding windows, causal with a window, and top-left causal; plain bottom-right causal
// keeps its own cheaper instance. Tiles outside the keys a q block can see are never visited; only
// tiles that straddle an edge are masked (tile_needs_mask), every other tile skips the work.
#pragma once
#include "ptx.cuh"

template <bool Is_causal, bool Is_local, int kBlockM, int kBlockN>
struct Mask {
    int seqlen_q, seqlen_k;
    int offset, left, right;  // Is_local only

    // Keys that some row of the q block at row0 may see lie in [key_begin, key_end) (forward).
    FC_DEVICE int key_begin(int row0) const { return Is_local ? max(0, row0 + offset - left) : 0; }
    FC_DEVICE int key_end(int row0) const {
        if (Is_local) return min(seqlen_k, row0 + kBlockM + offset + right);
        if (Is_causal) return min(seqlen_k, row0 + kBlockM + seqlen_k - seqlen_q);
        return seqlen_k;
    }

    // Rows that may see some key of the key block at key0 lie in [row_begin, row_end) (backward).
    FC_DEVICE int row_begin(int key0) const {
        if (Is_local) return max(0, key0 - offset - right);
        if (Is_causal) return max(0, key0 + seqlen_q - seqlen_k);
        return 0;
    }
    FC_DEVICE int row_end(int key0) const {
        if (Is_local) return max(0, min(seqlen_q, key0 + kBlockN - offset + left));
        return seqlen_q;
    }

    // Backward: of the steps over q blocks [m_block_min, m_block_min + m_count) that see the key
    // block at key0 (inside seqlen_k), those in [first, end) have no key that some row must not see:
    // under a causal mask every one after the diagonal's, under a band those between its two edges.
    FC_DEVICE void unmasked_steps(int key0, int m_block_min, int m_count, int& first, int& end) const {
        const int off = Is_local ? offset : seqlen_k - seqlen_q, reach = Is_local ? right : 0;
        const int rows_from = max(0, key0 + kBlockN - 1 - off - reach);  // rows from here see the last key
        first = min(m_count, max(0, (rows_from + kBlockM - 1) / kBlockM - m_block_min));
        end = m_count;
        if (Is_local) {
            const int rows_to = key0 - off + left;  // rows up to here see the first key
            const int m_last = rows_to >= kBlockM - 1 ? (rows_to - kBlockM + 1) / kBlockM : -1;
            end = max(first, min(m_count, m_last + 1 - m_block_min));
        }
    }

    // Row `row` sees keys [row_first_key(row), row_key_limit(row)); the first bound is Is_local's only.
    FC_DEVICE int row_key_limit(int row) const {
        if (Is_local) return min(seqlen_k, row + 1 + offset + right);
        if (Is_causal) return min(seqlen_k, row + 1 + seqlen_k - seqlen_q);
        return seqlen_k;
    }
    FC_DEVICE int row_first_key(int row) const { return row + offset - left; }
    FC_DEVICE bool hidden(int row, int key) const {
        return key >= row_key_limit(row) || (Is_local && key < row_first_key(row));
    }

    // The backward's per-thread masks, in one bound pair per fragment row, so that each score's test
    // compares a constant: with rows on keys, the rows below seqlen_q that see `key` lie in [lo, hi)
    // (hidden's inverse: key <= row + offset + right, and Is_local's key >= row + offset - left);
    // with rows on queries, the keys `row` sees lie in [lo, hi). Both empty past the sequences.
    FC_DEVICE void rows_seeing(int key, int& lo, int& hi) const {
        lo = Is_local ? key - offset - right : Is_causal ? key - (seqlen_k - seqlen_q) : 0;
        hi = key >= seqlen_k ? lo : Is_local ? min(seqlen_q, key - offset + left + 1) : seqlen_q;
    }
    FC_DEVICE void keys_seen(int row, int& lo, int& hi) const {
        lo = Is_local ? row_first_key(row) : 0;
        hi = row >= seqlen_q ? lo : row_key_limit(row);
    }

    // Does n block `n_block` hold a key that some row of q block `row0` must not see?
    FC_DEVICE bool tile_needs_mask(int row0, int n_block) const {
        const int key0 = n_block * kBlockN, key_last = key0 + kBlockN - 1;
        if (key_last >= seqlen_k) return true;
        if (Is_local) return key_last > row0 + offset + right || key0 < row0 + kBlockM - 1 + offset - left;
        return Is_causal && key_last > row0 + seqlen_k - seqlen_q;
    }

    // Sets to -inf the scores of fragment s (fragment.cuh) that their row must not see; coords
    // places them, its rows being queries and its columns keys.
    template <class Coords, int kMTiles, int kNTiles>
    FC_DEVICE void apply(float (&s)[kMTiles][kNTiles][4], const Coords& coords) const {
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int row = coords.row(mt, h);
                const int limit = row_key_limit(row), first = row_first_key(row);
#pragma unroll
                for (int nt = 0; nt < kNTiles; ++nt) {
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const int key = coords.col(nt, e);
                        if (key >= limit || (Is_local && key < first)) s[mt][nt][2 * h + e] = -FC_INF;
                    }
                }
            }
        }
    }
};
