// Warp-level GEMM steps on sm80 tensor cores: mma.sync.m16n8k16 with fragments from ldmatrix.
//
// A warp computes acc[mt][nt] += A[mt] B[nt] for kMTiles m16 tiles of A and kNTiles n8 tiles of B,
// 16 along k per call. A arrives as register fragments, loaded from shared memory (load_a_frags)
// or converted from the accumulators of an earlier product (acc_to_a_frag); B is read from shared
// memory, two n8 tiles (16 columns of B) per ldmatrix.x4.
//
// An operand in shared memory is a tile with rows of kCols elements (tile.cuh), stored either
// along its outer dimension (rows are m for A, n for B: K in S = Q K^T) or along k (rows are k,
// loaded with .trans: V in O += P V). The caller gives this lane's ldmatrix address of the tile
// (ldsm_lane_offset_a for A and for B along k, ldsm_lane_offset_b for B along n) and the (row, col)
// of this k step's first 16x16 block; the next blocks lie 16 rows or 16 columns further on, so each
// block's offset is a compile-time constant that lands in the instruction.
#pragma once
#include "ptx.cuh"
#include "tile.cuh"

template <bool kTrans>
FC_DEVICE void ldsm_x4(u32 (&r)[4], u32 addr) {
    if constexpr (kTrans) ldmatrix_x4_trans(r, addr);
    else ldmatrix_x4(r, addr);
}

// A fragments of kMTiles m16 tiles for one k16 step: tile mt at (row + 16 mt, col), or with
// kTransA (rows are k) at (row, col + 16 mt).
template <bool kTransA, int kCols, int kMTiles>
FC_DEVICE void load_a_frags(u32 (&a)[kMTiles][4], u32 a_lane, int row, int col) {
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
        ldsm_x4<kTransA>(a[mt], a_lane + tile_offset<kCols>(kTransA ? row : row + 16 * mt,
                                                            kTransA ? col + 16 * mt : col));
}

// Two n8 accumulator tiles (columns k0..k0+7 and k0+8..k0+15 of a 16-row block) -> the A fragment
// of an m16n8k16 mma whose k dimension is those 16 columns. The C and A layouts line up, so the
// conversion is register-local (FA2: P stays in registers between its two matrix products).
template <bool Is_bf16>
FC_DEVICE void acc_to_a_frag(const float (&lo)[4], const float (&hi)[4], u32 (&a)[4]) {
    a[0] = pack_f32x2<Is_bf16>(lo[0], lo[1]);
    a[1] = pack_f32x2<Is_bf16>(lo[2], lo[3]);
    a[2] = pack_f32x2<Is_bf16>(hi[0], hi[1]);
    a[3] = pack_f32x2<Is_bf16>(hi[2], hi[3]);
}

// n8 tiles 2 np and 2 np + 1 of a k16 step, acc[mt][nt] += A[mt] B[nt]: one ldmatrix.x4 of the
// 16x16 block of B at (row + 16 np, col), or with kTransB (rows are k) at (row, col + 16 np).
template <bool Is_bf16, bool kTransB, int kCols, int kMTiles, int kNTiles>
FC_DEVICE void warp_mma_pair(float (&acc)[kMTiles][kNTiles][4], const u32 (&a)[kMTiles][4], u32 b_lane,
                             int row, int col, int np) {
    u32 b[4];
    ldsm_x4<kTransB>(b, b_lane + tile_offset<kCols>(kTransB ? row : row + 16 * np, kTransB ? col + 16 * np : col));
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) {
        mma_16816<Is_bf16>(acc[mt][2 * np], a[mt], b[0], b[1]);
        mma_16816<Is_bf16>(acc[mt][2 * np + 1], a[mt], b[2], b[3]);
    }
}

// One k16 step over every n8 tile of acc: acc[mt][nt] += A[mt] B[nt].
template <bool Is_bf16, bool kTransB, int kCols, int kMTiles, int kNTiles>
FC_DEVICE void warp_mma_k16(float (&acc)[kMTiles][kNTiles][4], const u32 (&a)[kMTiles][4], u32 b_lane,
                            int row, int col) {
    static_assert(kNTiles % 2 == 0, "B is loaded two n8 tiles at a time");
#pragma unroll
    for (int np = 0; np < kNTiles / 2; ++np) warp_mma_pair<Is_bf16, kTransB, kCols>(acc, a, b_lane, row, col, np);
}

// Two k16 steps of one shape whose B tiles (at shared addresses b0_tile, b1_tile) share a layout,
// so one lane offset b_lane and one (row, col) serve both; interleaved pair by pair:
// acc0 += A0 B0 and acc1 += A1 B1 (the backward's S^T and dP^T, and dV and dK).
template <bool Is_bf16, bool kTransB, int kCols, int kMTiles, int kNTiles>
FC_DEVICE void warp_mma_k16_x2(float (&acc0)[kMTiles][kNTiles][4], const u32 (&a0)[kMTiles][4], u32 b0_tile,
                               float (&acc1)[kMTiles][kNTiles][4], const u32 (&a1)[kMTiles][4], u32 b1_tile,
                               u32 b_lane, int row, int col) {
    static_assert(kNTiles % 2 == 0, "B is loaded two n8 tiles at a time");
#pragma unroll
    for (int np = 0; np < kNTiles / 2; ++np) {
        warp_mma_pair<Is_bf16, kTransB, kCols>(acc0, a0, b0_tile + b_lane, row, col, np);
        warp_mma_pair<Is_bf16, kTransB, kCols>(acc1, a1, b1_tile + b_lane, row, col, np);
    }
}

// The fragments of a single m16 tile held without their m dimension (acc[nt][4], a[4]), as the
// helpers above take them.
template <int kNTiles>
FC_DEVICE float (&one_m_tile(float (&acc)[kNTiles][4]))[1][kNTiles][4] {
    return reinterpret_cast<float (&)[1][kNTiles][4]>(acc);
}
FC_DEVICE const u32 (&one_m_tile(const u32 (&a)[4]))[1][4] { return reinterpret_cast<const u32 (&)[1][4]>(a); }

// Accumulators to zero before the first step.
template <int kMTiles, int kNTiles>
FC_DEVICE void clear_acc(float (&acc)[kMTiles][kNTiles][4]) {
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[mt][nt][e] = 0.f;
}
template <int kNTiles>
FC_DEVICE void clear_acc(float (&acc)[kNTiles][4]) { clear_acc(one_m_tile(acc)); }
