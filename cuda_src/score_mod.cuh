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

    // Runs op.run<softcap on, ALiBi on>(): the per-score code is compiled once per combination, so
    // the run-time choice costs one uniform branch per tile, not work per score.
    template <class Op>
    FC_DEVICE void dispatch(Op& op) const {
        if (softcap > 0.f) {
            if (slope != 0.f) op.template run<true, true>();
            else op.template run<true, false>();
        } else if (slope != 0.f) {
            op.template run<false, true>();
        } else {
            op.template run<false, false>();
        }
    }

    // Natural-unit score of raw score x at (row, key); dcap gets d(score) / d(scale * x), the
    // softcap's 1 - tanh^2 (1 without it), which the backward multiplies into dS. The template
    // flags say which options may be on (dispatch), the values still decide.
    template <bool kSoftcap, bool kAlibi>
    FC_DEVICE float apply(float x, int row, int key, float& dcap) const {
        float s = x * scale;
        dcap = 1.f;
        if (kSoftcap && softcap > 0.f) {
            const float t = tanh_approx(x * inv_softcap);
            s = softcap * t;
            dcap = 1.f - t * t;
        }
        if (kAlibi && slope != 0.f) s -= slope * fabsf(float(row + offset - key));
        return s;
    }
};

// The forward's S tile to natural units; coords (fragment.cuh) places the scores of fragment s,
// its rows being queries and its columns keys.
template <class Coords, int kMTiles, int kNTiles>
struct FwdScoreModOp {
    const ScoreMod& mod;
    float (&s)[kMTiles][kNTiles][4];
    const Coords& coords;

    template <bool kSoftcap, bool kAlibi>
    FC_DEVICE void run() {
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
            for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    float unused;
                    s[mt][nt][e] = mod.apply<kSoftcap, kAlibi>(s[mt][nt][e], coords.row(mt, e >> 1),
                                                               coords.col(nt, e & 1), unused);
                }
    }
};

template <class Coords, int kMTiles, int kNTiles>
FC_DEVICE void apply_score_mod(const ScoreMod& mod, float (&s)[kMTiles][kNTiles][4], const Coords& coords) {
    FwdScoreModOp<Coords, kMTiles, kNTiles> op{mod, s, coords};
    mod.dispatch(op);
}
