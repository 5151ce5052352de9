// Shared-memory tiles of (rows x kCols) 16-bit elements, and their movement. kCols is the head dim
// for Q, K, V, dO tiles and the q block for the backward's dS^T tile.
//
// Rows are padded by 8 elements (16 bytes): ldmatrix reads 8 rows at the same column, and with a
// row pitch of (kHeadDim + 8) * 2 bytes those 8 rows fall in 8 different 16-byte bank groups,
// so tensor-core loads and the 4-byte output stores are free of bank conflicts.
#pragma once
#include "ptx.cuh"

template <int kCols>
struct SmemTile {
    static constexpr int kPitch = kCols + 8;        // elements per shared-memory row
    static constexpr int kChunksPerRow = kCols / 8;  // 16-byte chunks per row
};

// Asynchronously copies a (kRows x kHeadDim) global tile into shared memory, 16 bytes per
// cp.async. Each thread's offsets are computed once (the constructor), so a load in the main loop
// costs one 64-bit multiply-add per chunk. Rows at or past `rows_valid` are zero-filled (no global
// read), which keeps masked tails finite.
template <int kRows, int kHeadDim, int kThreads>
struct TileLoader {
    static constexpr int kChunksPerRow = SmemTile<kHeadDim>::kChunksPerRow;
    static constexpr int kPitch = SmemTile<kHeadDim>::kPitch;
    // Threads cover whole rows per pass when kThreads is a multiple of the chunks per row
    // (every head dim but 96 and 192); otherwise fall back to per-chunk index arithmetic.
    static constexpr bool kWholeRows = kThreads % kChunksPerRow == 0;
    static constexpr int kRowsPerPass = kWholeRows ? kThreads / kChunksPerRow : 1;
    static constexpr int kPasses = kWholeRows ? (kRows + kRowsPerPass - 1) / kRowsPerPass
                                              : (kRows * kChunksPerRow + kThreads - 1) / kThreads;
    int tid, row;        // this thread's first row (kWholeRows)
    u32 s_offset;        // its first chunk in shared memory, bytes
    i64 g_offset, g_pass_stride;  // its first chunk in global memory, and the step per pass, elements
    i64 g_row_stride;

    FC_DEVICE TileLoader(int tid_, i64 row_stride) : tid(tid_), g_row_stride(row_stride) {
        row = tid / kChunksPerRow;
        const int chunk = tid % kChunksPerRow;
        s_offset = (row * kPitch + chunk * 8) * 2;
        g_offset = row * row_stride + chunk * 8;
        g_pass_stride = kRowsPerPass * row_stride;
    }

    FC_DEVICE void load(u32 s_tile, const u16* g_tile, int rows_valid) const {
#pragma unroll
        for (int p = 0; p < kPasses; ++p) {
            if constexpr (kWholeRows) {
                const int r = row + p * kRowsPerPass;
                if (kRows % kRowsPerPass == 0 || r < kRows) {
                    const bool valid = r < rows_valid;
                    cp_async_16(s_tile + s_offset + p * kRowsPerPass * kPitch * 2,
                                valid ? g_tile + g_offset + p * g_pass_stride : g_tile, valid ? 16 : 0);
                }
            } else {
                const int idx = tid + p * kThreads;
                const int r = idx / kChunksPerRow, chunk = idx % kChunksPerRow;
                if (r < kRows) {
                    const bool valid = r < rows_valid;
                    cp_async_16(s_tile + (r * kPitch + chunk * 8) * 2,
                                valid ? g_tile + r * g_row_stride + chunk * 8 : g_tile, valid ? 16 : 0);
                }
            }
        }
    }
};

// Copy rows [0, rows_valid) of a shared-memory tile to global memory in 16-byte stores
// (coalesced: consecutive lanes write consecutive chunks of a row).
template <int kRows, int kHeadDim, int kThreads>
FC_DEVICE void store_tile(u16* g_tile, i64 g_row_stride, const u16* s_tile, int rows_valid, int tid) {
    constexpr int kChunksPerRow = SmemTile<kHeadDim>::kChunksPerRow;
    constexpr int kChunks = kRows * kChunksPerRow;
    constexpr int kIters = (kChunks + kThreads - 1) / kThreads;
#pragma unroll
    for (int it = 0; it < kIters; ++it) {
        const int idx = tid + it * kThreads;
        if (kChunks % kThreads == 0 || idx < kChunks) {
            const int row = idx / kChunksPerRow;
            const int chunk = idx % kChunksPerRow;
            if (row < rows_valid) {
                const uint4 val = *reinterpret_cast<const uint4*>(s_tile + row * SmemTile<kHeadDim>::kPitch + chunk * 8);
                *reinterpret_cast<uint4*>(g_tile + row * g_row_stride + chunk * 8) = val;
            }
        }
    }
}

// ldmatrix.x4 lane addresses. Lane l feeds row (l % 8) of matrix (l / 8). Both helpers return
// this lane's byte offset inside a 16x16 block; the block's own offset is a compile-time constant
// added on top (tile_offset), so the compiler folds it into the instruction's immediate.
//
// Order A: matrices (rows 0-7, cols 0-7), (rows 8-15, cols 0-7), (rows 0-7, cols 8-15),
// (rows 8-15, cols 8-15) -- the A fragment of mma.m16n8k16, and with .trans the B fragments of two
// n8 tiles when rows are the k dimension (V in O += P V).
template <int kCols>
FC_DEVICE u32 ldsm_lane_offset_a(int lane) {
    return ((lane & 15) * SmemTile<kCols>::kPitch + (lane >> 4) * 8) * 2;
}
// Order B: (rows 0-7, cols 0-7), (rows 0-7, cols 8-15), (rows 8-15, cols 0-7), (rows 8-15, cols 8-15)
// -- with rows = keys and cols = head dim, the B fragments of two n8 tiles of S = Q K^T:
// registers {0, 1} for keys 0-7 and {2, 3} for keys 8-15.
template <int kCols>
FC_DEVICE u32 ldsm_lane_offset_b(int lane) {
    return (((lane & 7) + (lane >> 4) * 8) * SmemTile<kCols>::kPitch + ((lane >> 3) & 1) * 8) * 2;
}

// Byte offset of element (row, col) in a tile.
template <int kCols>
__host__ __device__ constexpr u32 tile_offset(int row, int col) {
    return (row * SmemTile<kCols>::kPitch + col) * 2;
}
