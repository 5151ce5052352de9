// Score modifications of the Has_score_mod kernel instances: softcap and ALiBi.
//
// With them the kernels turn each raw score q.k into natural (softmax) units first:
//   s = softmax_scale * q.k;  s = softcap * tanh(s / softcap) if softcap > 0;
//   s -= slope * |row + offset - key|   (ALiBi; offset as the band's: seqlen_k - seqlen_q for the
//                                        bottom-right alignment, 0 for top-left)
// and then run the softmax with scale log2(e) instead of softmax_scale * log2(e). Both options are
// run-time values (softcap 0 and slope 0 turn them off); the instances without score mods keep
// the raw scores and fold softmax_scale into the exponent, one FFMA per score.
#pragma once
#include "ptx.cuh"

FC_DEVICE float tanh_approx(float x) {  // sm75+ MUFU.TANH, max relative error about 2^-11
    float y;
    asm("tanh.approx.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

struct ScoreMod {
    float scale;        // softmax_scale
    float softcap;      // 0: off
    float inv_softcap;  // softmax_scale / softcap
    float slope;        // ALiBi slope of this (batch, head); 0: off
    int offset;         // row + offset is the key on the row's diagonal

    FC_DEVICE ScoreMod(float softmax_scale, float softcap_, const float* alibi_slopes, int alibi_batch_stride,
                       int batch, int head, int offset_)
        : scale(softmax_scale), softcap(softcap_), inv_softcap(softcap_ > 0.f ? softmax_scale / softcap_ : 0.f),
          slope(alibi_slopes ? alibi_slopes[batch * alibi_batch_stride + head] : 0.f), offset(offset_) {}

    // Softcapped score (natural units, before ALiBi) of raw score x.
    FC_DEVICE float capped(float x) const { return softcap > 0.f ? softcap * tanh_approx(x * inv_softcap) : x * scale; }
    FC_DEVICE float bias(int row, int key) const { return -slope * fabsf(float(row + offset - key)); }
    FC_DEVICE float operator()(float x, int row, int key) const { return capped(x) + bias(row, key); }
    // d(capped) / d(scale * x) at a score whose capped value is c: 1 - tanh^2. Clamped, so that a
    // masked score (-inf) gives 0, not NaN.
    FC_DEVICE float dcapped(float c) const {
        if (softcap <= 0.f) return 1.f;
        const float t = fminf(fmaxf(c / softcap, -1.f), 1.f);
        return 1.f - t * t;
    }
};

// The forward's S tile: s[mt][nt][e] is row row_base + 16 mt + g + 8 (e / 2), key key_base + 8 nt +
// 2 t + (e % 2), lane = 4 g + t (mask.cuh's layout).
template <int kMTiles, int kNTiles>
FC_DEVICE void apply_score_mod(const ScoreMod& mod, float (&s)[kMTiles][kNTiles][4], int row_base, int key_base,
                               int lane) {
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e)
                s[mt][nt][e] = mod(s[mt][nt][e], row_base + 16 * mt + g + 8 * (e >> 1), key_base + 8 * nt + 2 * t + (e & 1));
}
