// Masking of score tiles: keys past seqlen_k and, for local attention, keys outside the band.
//
// The band (Is_local): query row i sees keys [i + offset - left, i + offset + right], where
// offset = seqlen_k - seqlen_q aligns row i to the bottom-right corner (flash-attn >= 2.1) or
// offset = 0 to the top-left (PyTorch SDPA, JAX). Causal is the band (left, right) = (inf, 0); a
// sliding window bounds left and/or right. "Unbounded" arrives as a bound no row can reach
// (flashcupy/launch.py, plan_band). Tiles outside the band are never visited; only tiles that straddle an edge of the
// band or seqlen_k are masked (tile_needs_mask), every other tile skips the work.
#pragma once
#include "ptx.cuh"

template <bool Is_local, int kBlockM, int kBlockN>
struct Mask {
    int seqlen_q, seqlen_k;
    int offset, left, right;

    // Keys that some row of the q block at row0 may see lie in [key_begin, key_end).
    FC_DEVICE int key_begin(int row0) const { return Is_local ? max(0, row0 + offset - left) : 0; }
    FC_DEVICE int key_end(int row0) const {
        return Is_local ? min(seqlen_k, row0 + kBlockM + offset + right) : seqlen_k;
    }

    // Does n block `n_block` hold a key that some row of q block `row0` must not see?
    FC_DEVICE bool tile_needs_mask(int row0, int n_block) const {
        const int key0 = n_block * kBlockN, key_last = key0 + kBlockN - 1;
        if (key_last >= seqlen_k) return true;
        return Is_local && (key_last > row0 + offset + right || key0 < row0 + kBlockM - 1 + offset - left);
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
                const int hi = Is_local ? min(seqlen_k, row + 1 + offset + right) : seqlen_k;
                const int lo = Is_local ? row + offset - left : 0;
#pragma unroll
                for (int nt = 0; nt < kNTiles; ++nt) {
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const int key = key_base + 8 * nt + 2 * t + e;
                        if (key >= hi || key < lo) s[mt][nt][2 * h + e] = -FC_INF;
                    }
                }
            }
        }
    }
};
