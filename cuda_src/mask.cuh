// Masking of score tiles: keys past seqlen_k, and keys outside a causal diagonal or a band.
//
// Is_causal: query row i sees keys j <= i + seqlen_k - seqlen_q (the diagonal aligned to the
// bottom-right corner, as flash-attn >= 2.1).
// Is_local: the general band, row i sees keys [i + offset - left, i + offset + right], where
// offset = seqlen_k - seqlen_q (bottom-right) or 0 (top-left, as PyTorch SDPA and JAX), and a side
// the caller leaves unbounded arrives as a bound no row reaches (flashcupy/launch.py, plan_band).
// It serves sliding windows, causal with a window, and top-left causal; plain bottom-right causal
// keeps its own cheaper instance. Tiles outside the keys a q block can see are never visited; only
// tiles that straddle an edge are masked (tile_needs_mask), every other tile skips the work.
#pragma once
#include "ptx.cuh"

template <bool Is_causal, bool Is_local, int kBlockM, int kBlockN>
struct Mask {
    int seqlen_q, seqlen_k;
    int offset, left, right;  // Is_local only

    // Keys that some row of the q block at row0 may see lie in [key_begin, key_end).
    FC_DEVICE int key_begin(int row0) const { return Is_local ? max(0, row0 + offset - left) : 0; }
    FC_DEVICE int key_end(int row0) const {
        if (Is_local) return min(seqlen_k, row0 + kBlockM + offset + right);
        if (Is_causal) return min(seqlen_k, row0 + kBlockM + seqlen_k - seqlen_q);
        return seqlen_k;
    }

    // Does n block `n_block` hold a key that some row of q block `row0` must not see?
    FC_DEVICE bool tile_needs_mask(int row0, int n_block) const {
        const int key0 = n_block * kBlockN, key_last = key0 + kBlockN - 1;
        if (key_last >= seqlen_k) return true;
        if (Is_local) return key_last > row0 + offset + right || key0 < row0 + kBlockM - 1 + offset - left;
        return Is_causal && key_last > row0 + seqlen_k - seqlen_q;
    }

    // s[mt][nt][e] holds the score of row  row_base + 16 mt + g + 8 (e / 2)
    //                              and key key_base + 8 nt + 2 t + (e % 2), lane = 4 g + t.
    template <int kMTiles, int kNTiles>
    FC_DEVICE void apply(float (&s)[kMTiles][kNTiles][4], int row_base, int key_base, int lane) const {
        const int g = lane >> 2, t = lane & 3;
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int row = row_base + 16 * mt + g + 8 * h;
                const int limit = Is_local    ? min(seqlen_k, row + 1 + offset + right)
                                  : Is_causal ? min(seqlen_k, row + 1 + seqlen_k - seqlen_q)
                                              : seqlen_k;
                const int first = row + offset - left;  // Is_local only
#pragma unroll
                for (int nt = 0; nt < kNTiles; ++nt) {
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const int key = key_base + 8 * nt + 2 * t + e;
                        if (key >= limit || (Is_local && key < first)) s[mt][nt][2 * h + e] = -FC_INF;
                    }
                }
            }
        }
    }
};
