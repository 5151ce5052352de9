// Online softmax over score tiles held in mma accumulator fragments (FA2 Algorithm 1, lines 8-10).
//
// Each thread holds 2 rows per 16-row m tile (rows g and g + 8 of the mma layout); the 4 lanes of
// a quad share a row, so row reductions are two xor-shuffles. Scores stay unscaled in the
// accumulators; p = exp2(s * scale_log2 - m * scale_log2) costs one FFMA and one MUFU.EX2.
// The row sum is kept per thread and reduced across the quad only once, in finalize().
#pragma once
#include "ptx.cuh"

FC_DEVICE float quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
    return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
FC_DEVICE float quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    return x + __shfl_xor_sync(0xffffffffu, x, 2);
}
// The same over a whole warp.
FC_DEVICE float warp_max(float x) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
    return x;
}
FC_DEVICE float warp_sum(float x) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}

// The end of one row's softmax: m its largest score in natural units (-inf: it saw no key), sum its
// sum of exp(s - m), sink a logit that joins the denominator (-inf: none), so that
// lse = log(sum_j exp(s_j) + exp(sink)), evaluated against the larger of m and the sink so that
// neither overflows; inv turns the row's output accumulated against m into the softmax's. A row
// with no key and no sink gets inv = 0 and LSE -inf; with a sink, inv = 0 and LSE = sink.
FC_DEVICE void softmax_denominator(float m, float sum, float sink, float& inv, float& lse) {
    constexpr float kLn2 = 0.6931471805599453f, kLog2e = 1.4426950408889634f;
    const float top = fmaxf(m, sink);
    inv = 0.f;
    lse = -FC_INF;
    if (top != -FC_INF) {
        const float rows_part = fast_exp2((m - top) * kLog2e);  // 1 without a sink
        const float denom = sum * rows_part + fast_exp2((sink - top) * kLog2e);
        inv = rows_part / denom;
        lse = top + fast_log2(denom) * kLn2;
    }
}

template <int kMTiles>
struct OnlineSoftmax {
    static constexpr int kRows = 2 * kMTiles;
    float row_max[kRows];  // running max of unscaled scores; -inf until a key is seen
    float row_sum[kRows];  // this thread's share of the running sum of exp2 terms

    FC_DEVICE OnlineSoftmax() {
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
            row_max[r] = -FC_INF;
            row_sum[r] = 0.f;
        }
    }

    // Fold a new score tile s[mt][nt][4] into the state: update maxima, turn s into
    // probabilities in place, and rescale the output accumulator o[mt][dt][4] by exp2(m_old - m_new).
    template <int kNTiles, int kDTiles>
    FC_DEVICE void update(float (&s)[kMTiles][kNTiles][4], float (&o)[kMTiles][kDTiles][4], float scale_log2) {
        float alpha[kRows];
        probs(s, scale_log2, alpha);
        rescale(o, alpha);
    }

    // The first half of update: maxima, probabilities and sums; alpha[r] = exp2(m_old - m_new) of
    // each row, for rescale. Apart, so that O can still be accumulating while they run (sm90).
    template <int kNTiles>
    FC_DEVICE void probs(float (&s)[kMTiles][kNTiles][4], float scale_log2, float (&alpha)[kRows]) {
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int r = 2 * mt + h;
                float m = row_max[r];
#pragma unroll
                for (int nt = 0; nt < kNTiles; ++nt) m = fmaxf(m, fmaxf(s[mt][nt][2 * h], s[mt][nt][2 * h + 1]));
                m = quad_max(m);
                // A row that has seen only masked keys keeps max -inf; subtracting 0 instead of
                // -inf keeps exp2 at 0 rather than NaN.
                const float m_scaled = (m == -FC_INF) ? 0.f : m * scale_log2;
                alpha[r] = fast_exp2(row_max[r] * scale_log2 - m_scaled);
                row_max[r] = m;
                float sum = 0.f;
#pragma unroll
                for (int nt = 0; nt < kNTiles; ++nt) {
#pragma unroll
                    for (int e = 2 * h; e < 2 * h + 2; ++e) {
                        s[mt][nt][e] = fast_exp2(s[mt][nt][e] * scale_log2 - m_scaled);
                        sum += s[mt][nt][e];
                    }
                }
                row_sum[r] = row_sum[r] * alpha[r] + sum;
            }
        }
    }

    template <int kDTiles>
    FC_DEVICE void rescale(float (&o)[kMTiles][kDTiles][4], const float (&alpha)[kRows]) const {
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
            for (int dt = 0; dt < kDTiles; ++dt)
#pragma unroll
                for (int e = 0; e < 4; ++e) o[mt][dt][e] *= alpha[2 * mt + e / 2];
    }

    // Reduce the row sums across the quad, scale o by 1 / denominator and return each row's
    // natural-log LSE in lse[r] (softmax_denominator). score_unit turns the running max into natural
    // units (softmax_scale for raw scores, 1 for scores already scaled).
    template <int kDTiles>
    FC_DEVICE void finalize(float (&o)[kMTiles][kDTiles][4], float score_unit, float sink, float (&lse)[kRows]) {
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int r = 2 * mt + h;
                const float sum = quad_sum(row_sum[r]);
                const float m = row_max[r] == -FC_INF ? -FC_INF : row_max[r] * score_unit;
                float inv;
                softmax_denominator(m, sum, sink, inv, lse[r]);
#pragma unroll
                for (int dt = 0; dt < kDTiles; ++dt) {
                    o[mt][dt][2 * h] *= inv;
                    o[mt][dt][2 * h + 1] *= inv;
                }
            }
        }
    }
};
