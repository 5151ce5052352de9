// FlashAttention-2 forward, sm80 instructions (mma.sync, ldmatrix, cp.async); runs on sm80+.
//
// One thread block per (q block of kBlockM rows, head, batch), on a 1-D grid (block_coords). Pseudocode (FA2 Algorithm 1):
//
//   load Q_i                                   // once, into shared memory
//   m = -inf, l = 0, O = 0                     // registers
//   for j = n_block_max - 1 down to n_block_min: // causal / local: blocks outside never visited
//       load V_j (async, overlaps S)           // K_j was prefetched during the previous PV
//       S = Q_i K_j^T                          // tensor cores, fp32 accumulators
//       mask S if block j straddles seqlen_k or the diagonal
//       m_new = max(m, rowmax(S)); P = exp2(S * c - m_new * c); l = l * exp2(m - m_new) + rowsum(P)
//       O = O * exp2(m - m_new)
//       prefetch K_{j-1} (async, overlaps PV)
//       O += P V_j                             // P converted to 16-bit in registers, never stored
//   O /= l;  LSE = m * softmax_scale + ln(l)   // c = softmax_scale * log2(e); a sink joins l here
//
// Has_score_mod instances turn S into natural units with softcap and ALiBi first (score_mod.cuh);
// varlen batches find their rows through cu_seqlens (seqlens.cuh).
// Warps split the q block (FA2 section 3.3): warp w owns rows [w * kRowsPerWarp, +kRowsPerWarp)
// and shares K_j, V_j through shared memory, so no warp waits on another's partial results.
#include "ptx.cuh"
#include "tile.cuh"
#include "warp_mma.cuh"
#include "fragment.cuh"
#include "softmax.cuh"
#include "mask.cuh"
#include "grid.cuh"
#include "seqlens.cuh"
#include "score_mod.cuh"
#include "params.cuh"

template <int kHeadDim_, int kBlockM_, int kBlockN_, int kNWarps_, bool Is_causal_, bool Is_local_, bool Is_bf16_>
struct FwdTraits {
    static constexpr int kHeadDim = kHeadDim_, kBlockM = kBlockM_, kBlockN = kBlockN_, kNWarps = kNWarps_;
    static constexpr bool Is_causal = Is_causal_, Is_local = Is_local_, Is_bf16 = Is_bf16_;
    static constexpr int kThreads = kNWarps * 32;
    static constexpr int kRowsPerWarp = kBlockM / kNWarps;
    static constexpr int kMTiles = kRowsPerWarp / 16;  // 16-row mma tiles per warp
    static constexpr int kNTiles = kBlockN / 8;        // 8-key mma tiles of S
    static constexpr int kDTiles = kHeadDim / 8;       // 8-column mma tiles of O
    static constexpr int kPitch = SmemTile<kHeadDim>::kPitch;
    // Q, K and V tiles; flashcupy/sm80.py launches with the same number (CI asserts it: layout_check).
    static constexpr int kSmemBytes = (kBlockM + 2 * kBlockN) * kPitch * 2;
    static_assert(kHeadDim % 32 == 0, "head dim must be a multiple of 32");
    static_assert(kBlockM % (16 * kNWarps) == 0, "each warp needs whole 16-row tiles");
    static_assert(kBlockN % 16 == 0, "key block must be a multiple of 16");
};

template <int kHeadDim, int kBlockM, int kBlockN, int kNWarps, bool Is_causal, bool Is_local, bool Is_bf16,
          bool Has_score_mod>
__global__ void __launch_bounds__(kNWarps * 32)
flash_fwd_kernel(const __grid_constant__ FwdParams p) {  // params.cuh
    using T = FwdTraits<kHeadDim, kBlockM, kBlockN, kNWarps, Is_causal, Is_local, Is_bf16>;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    u16* sQ = reinterpret_cast<u16*>(smem_raw);
    u16* sK = sQ + kBlockM * T::kPitch;
    u16* sV = sK + kBlockN * T::kPitch;

    int m_block, head, batch;
    block_coords<Is_causal || Is_local, Is_causal || Is_local>(blockIdx.x, (p.max_seqlen_q + kBlockM - 1) / kBlockM, p.nheads, m_block, head, batch);
    const SeqLens seq(p.cu_seqlens_q, p.cu_seqlens_k, batch, p.max_seqlen_q, p.max_seqlen_k);
    const int seqlen_q = seq.seqlen_q, seqlen_k = seq.seqlen_k;
    const int row0 = m_block * kBlockM;
    if (row0 >= seqlen_q) return;  // varlen: past this sequence's end
    const int kv_head = head / p.heads_per_kv_head;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int rows_valid = min(kBlockM, seqlen_q - row0);

    const u16* gQ = p.q + batch * p.q_batch_stride + head * p.q_head_stride + (i64(seq.q_start) + row0) * p.q_row_stride;
    const u16* gK = p.k + batch * p.k_batch_stride + kv_head * p.k_head_stride + i64(seq.k_start) * p.k_row_stride;
    const u16* gV = p.v + batch * p.v_batch_stride + kv_head * p.v_head_stride + i64(seq.k_start) * p.v_row_stride;
    u16* gO = p.out + batch * p.o_batch_stride + head * p.o_head_stride + (i64(seq.q_start) + row0) * p.o_row_stride;
    float* gLse = p.lse + batch * p.lse_batch_stride + head * p.lse_head_stride + seq.q_start + row0;

    const int band_offset = p.align_bottom_right ? seqlen_k - seqlen_q : 0;
    const Mask<Is_causal, Is_local, kBlockM, kBlockN> mask{seqlen_q, seqlen_k, band_offset, p.window_left, p.window_right};
    const ScoreMod mod(p.softmax_scale, p.softcap, p.alibi_slopes, p.alibi_batch_stride, batch, head, band_offset);
    // With score mods S is in natural units before the softmax (score_mod.cuh).
    const float score_log2 = Has_score_mod ? 1.4426950408889634f : p.scale_log2;
    const int n_block_min = Is_local ? mask.key_begin(row0) / kBlockN : 0;
    const int n_block_max = (mask.key_end(row0) + kBlockN - 1) / kBlockN;  // <= n_block_min: no key
    const int warp_row0 = warp * T::kRowsPerWarp;  // first row of this warp within the q block
    const int g = lane >> 2, t = lane & 3;

    float acc_o[T::kMTiles][T::kDTiles][4];
    clear_acc(acc_o);
    OnlineSoftmax<T::kMTiles> softmax;

    const u32 sQ_base = smem_u32(sQ), sK_base = smem_u32(sK), sV_base = smem_u32(sV);
    const TileLoader<kBlockM, kHeadDim, T::kThreads> q_loader(tid, p.q_row_stride);
    const TileLoader<kBlockN, kHeadDim, T::kThreads> k_loader(tid, p.k_row_stride);
    const TileLoader<kBlockN, kHeadDim, T::kThreads> v_loader(tid, p.v_row_stride);
    if (n_block_max > n_block_min) {
        q_loader.load(sQ_base, gQ, rows_valid);
        const int key_last = (n_block_max - 1) * kBlockN;
        k_loader.load(sK_base, gK + key_last * p.k_row_stride, seqlen_k - key_last);
        cp_async_commit();
    }
    // This lane's ldmatrix addresses; per-fragment offsets below are compile-time constants.
    const u32 sQ_frag = sQ_base + tile_offset<kHeadDim>(warp_row0, 0) + ldsm_lane_offset_a<kHeadDim>(lane);
    const u32 sK_frag = sK_base + ldsm_lane_offset_b<kHeadDim>(lane);
    const u32 sV_frag = sV_base + ldsm_lane_offset_a<kHeadDim>(lane);

    for (int n_block = n_block_max - 1; n_block >= n_block_min; --n_block) {
        const int key0 = n_block * kBlockN;
        cp_async_wait<0>();
        __syncthreads();  // K_j landed for every warp; every warp is done reading V_{j+1}
        v_loader.load(sV_base, gV + key0 * p.v_row_stride, seqlen_k - key0);
        cp_async_commit();

        // S = Q_i K_j^T over the head dim, 16 columns per step.
        float acc_s[T::kMTiles][T::kNTiles][4];
        clear_acc(acc_s);
#pragma unroll
        for (int kd = 0; kd < kHeadDim / 16; ++kd) {
            u32 a[T::kMTiles][4];
            load_a_frags<false, kHeadDim>(a, sQ_frag, 0, 16 * kd);
            warp_mma_k16<Is_bf16, false, kHeadDim>(acc_s, a, sK_frag, 0, 16 * kd);
        }
        const MmaAccCoords s_coords(row0 + warp_row0, key0, lane);  // rows: queries, columns: keys
        if (Has_score_mod) apply_score_mod(mod, acc_s, s_coords);
        if (mask.tile_needs_mask(row0, n_block)) mask.apply(acc_s, s_coords);
        softmax.update(acc_s, acc_o, score_log2);

        cp_async_wait<0>();
        __syncthreads();  // V_j landed; every warp is done reading K_j
        if (n_block > n_block_min) {
            const int key_prev = key0 - kBlockN;
            k_loader.load(sK_base, gK + key_prev * p.k_row_stride, seqlen_k - key_prev);
            cp_async_commit();
        }

        // O += P V_j, 16 keys per step; two n8 tiles of P make one k16 A fragment.
#pragma unroll
        for (int ks = 0; ks < kBlockN / 16; ++ks) {
            u32 p[T::kMTiles][4];
#pragma unroll
            for (int mt = 0; mt < T::kMTiles; ++mt) acc_to_a_frag<Is_bf16>(acc_s[mt][2 * ks], acc_s[mt][2 * ks + 1], p[mt]);
            warp_mma_k16<Is_bf16, true, kHeadDim>(acc_o, p, sV_frag, 16 * ks, 0);
        }
    }

    float row_lse[OnlineSoftmax<T::kMTiles>::kRows];
    softmax.finalize(acc_o, Has_score_mod ? 1.f : p.softmax_scale, p.sinks ? p.sinks[head] : -FC_INF, row_lse);

    // Stage O through this warp's own rows of sQ (only this warp ever read them), then store
    // 16-byte chunks. A block with no key at all never loaded Q, so it skips straight here too.
    __syncwarp();
#pragma unroll
    for (int mt = 0; mt < T::kMTiles; ++mt) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = warp_row0 + 16 * mt + g + 8 * h;
#pragma unroll
            for (int dt = 0; dt < T::kDTiles; ++dt) {
                *reinterpret_cast<u32*>(sQ + row * T::kPitch + 8 * dt + 2 * t) =
                    pack_f32x2<Is_bf16>(acc_o[mt][dt][2 * h], acc_o[mt][dt][2 * h + 1]);
            }
            if (t == 0 && row < rows_valid) gLse[row] = row_lse[2 * mt + h];
        }
    }
    __syncwarp();
    store_tile<T::kRowsPerWarp, kHeadDim, 32>(gO + i64(warp_row0) * p.o_row_stride, p.o_row_stride,
                                              sQ + warp_row0 * T::kPitch, rows_valid - warp_row0, lane);
}
