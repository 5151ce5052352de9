// Masking of score tiles: keys past seqlen_k and, when causal, keys right of the diagonal.
//
// Causal is aligned to the bottom-right corner (flash-attn >= 2.1): query row i sees key j iff
// j <= i + seqlen_k - seqlen_q. Only the tiles that straddle a boundary are masked; the loop in
// the kernel asks tile_needs_mask() and skips the work for every other tile.
#pragma once
#include "ptx.cuh"

template <bool Is_causal, int kBlockM, int kBlockN>
struct Mask {
    int seqlen_q, seqlen_k;

    // Highest key any row of q block `row0` may see, plus one (keys are < this bound).
    FC_DEVICE int key_end(int row0) const {
        if (!Is_causal) return seqlen_k;
        return min(seqlen_k, row0 + kBlockM + seqlen_k - seqlen_q);
    }

    // Does n block `n_block` hold a key that some row of q block `row0` must not see?
    FC_DEVICE bool tile_needs_mask(int row0, int n_block) const {
        const int key_last = (n_block + 1) * kBlockN - 1;
        if (key_last >= seqlen_k) return true;
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
                const int limit = Is_causal ? min(seqlen_k, row + 1 + seqlen_k - seqlen_q) : seqlen_k;
#pragma unroll
                for (int nt = 0; nt < kNTiles; ++nt) {
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const int key = key_base + 8 * nt + 2 * t + e;
                        if (key >= limit) s[mt][nt][2 * h + e] = -FC_INF;
                    }
                }
            }
        }
    }
};
