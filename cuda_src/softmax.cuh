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
                const float alpha = fast_exp2(row_max[r] * scale_log2 - m_scaled);
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
                row_sum[r] = row_sum[r] * alpha + sum;
#pragma unroll
                for (int dt = 0; dt < kDTiles; ++dt) {
                    o[mt][dt][2 * h] *= alpha;
                    o[mt][dt][2 * h + 1] *= alpha;
                }
            }
        }
    }

    // Reduce the row sums across the quad, scale o by 1 / sum and return each row's
    // natural-log LSE in lse[r]. A row with no attended key (sum 0) gets o = 0 and LSE = -inf.
    template <int kDTiles>
    FC_DEVICE void finalize(float (&o)[kMTiles][kDTiles][4], float softmax_scale, float (&lse)[kRows]) {
        constexpr float kLn2 = 0.6931471805599453f;
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int r = 2 * mt + h;
                const float sum = quad_sum(row_sum[r]);
                const bool empty = (sum == 0.f);
                const float inv = empty ? 0.f : 1.f / sum;
                lse[r] = empty ? -FC_INF : row_max[r] * softmax_scale + fast_log2(sum) * kLn2;
#pragma unroll
                for (int dt = 0; dt < kDTiles; ++dt) {
                    o[mt][dt][2 * h] *= inv;
                    o[mt][dt][2 * h + 1] *= inv;
                }
            }
        }
    }
};
