// FlashAttention-2 backward, sm80 instructions (mma.sync, ldmatrix, cp.async); runs on sm80+.
//
// Kernels (FA2 section 3.2), launched in order by flashcupy/sm80.py (Sm80Backward.run), each taking
// the one BwdParams struct (params.cuh):
//   flash_bwd_preprocess_kernel   D = rowsum(dO * O) (float32, like the LSE); dq_accum = 0
//   flash_bwd_kernel              dK, dV per key block; dQ by float32 atomic adds
//   flash_bwd_convert_dq_kernel   dQ = dq_accum * softmax_scale, in the input dtype
//   flash_bwd_group_sum_kernel    GQA: dK, dV of each kv head = the sum over its query heads
//
// Main kernel: one thread block per (key block j of kBlockN keys, head, batch). Pseudocode
// (FA2 Algorithm 2), with c = softmax_scale * log2(e):
//
//   load K_j, V_j once; dK_j = dV_j = 0 (registers)
//   for i = first .. last q block that sees block j:       // causal / local: others skipped
//       load Q_i, dO_i, LSE_i, D_i (prefetched one block ahead when kStages == 2)
//       S^T  = K_j Q_i^T                                   // keys x queries
//       P^T  = exp2(S^T * c - LSE_i * log2(e))             // masked where j straddles an edge
//       dP^T = V_j dO_i^T
//       dS^T = P^T * (dP^T - D_i)
//       dV_j += P^T dO_i                                   // P^T, dS^T stay in registers ...
//       dK_j += dS^T Q_i
//       dS^T -> shared memory                              // ... and dS^T also goes to shared memory
//       dQ_i += dS K_j                                     // float32 atomic adds into dq_accum, staged
//                                                          // through shared memory so each warp adds
//                                                          // whole row segments (4 sectors a request)
//   dK_j *= softmax_scale; store dK_j, dV_j
//
// Working on the transposes puts keys on the mma's M dimension: warp w owns 16 keys of the block,
// so P^T and dS^T come out of their mma in exactly the A-fragment layout that dV += P^T dO and
// dK += dS^T Q consume, and dK_j, dV_j never need a reduction across warps. Only dQ, whose sum
// runs over keys, reads dS from shared memory. When the head dim is too large for one warp to hold
// 16 rows of both dK and dV (192, 256), kDSplit warps share a key group and split the head dim of
// dK, dV between them (they compute the same S^T and dP^T).
//
// Has_score_mod instances (softcap, ALiBi; score_mod.cuh) take S^T to natural units before P^T and
// multiply dS^T by the softcap's 1 - tanh^2. A sink needs nothing here: it is in the LSE, and its
// own gradient, -sum_i exp(sink - LSE_i) D_i, is a reduction flashcupy/api.py does. Varlen batches
// run the preprocess and dQ-convert kernels as one sequence of all packed rows.
#include "ptx.cuh"
#include "tile.cuh"
#include "warp_mma.cuh"
#include "fragment.cuh"
#include "grid.cuh"
#include "mask.cuh"
#include "seqlens.cuh"
#include "score_mod.cuh"
#include "params.cuh"

// ---- preprocess: D = rowsum(dO * O) and a zeroed dQ accumulator, 8 threads per row -------------
// Rows (rows_batch, rows_seqlen_q, nheads): a varlen batch is one sequence of its packed rows.
template <int kHeadDim, bool Is_bf16>
__global__ void __launch_bounds__(128)
flash_bwd_preprocess_kernel(const __grid_constant__ BwdParams p) {
    // restrict: the inputs take the read-only (non-coherent) load path, as kernel arguments did
    const u16* __restrict__ dout = p.dout;
    const u16* __restrict__ out = p.out;
    float* __restrict__ dq_accum = p.dq_accum;
    float* __restrict__ delta = p.delta;
    constexpr int kThreadsPerRow = 8, kRowsPerBlock = 128 / kThreadsPerRow;
    constexpr int kChunks = kHeadDim / 8;
    const int seqlen_q = p.rows_seqlen_q, nheads = p.nheads;
    // Rows in (batch, head, row) order, so the writes of D are contiguous.
    const i64 r = i64(blockIdx.x) * kRowsPerBlock + threadIdx.x / kThreadsPerRow;
    const int sub = threadIdx.x % kThreadsPerRow;
    float acc = 0.f;
    const bool valid = r < i64(p.rows_batch) * nheads * seqlen_q;
    if (valid) {
        const int row = int(r % seqlen_q);
        const i64 bh = r / seqlen_q;
        const int head = int(bh % nheads), b = int(bh / nheads);
        float* pacc = dq_accum + r * kHeadDim;  // its layout's row order
#pragma unroll
        for (int c = sub; c < kHeadDim / 4; c += kThreadsPerRow)
            *reinterpret_cast<float4*>(pacc + 4 * c) = make_float4(0.f, 0.f, 0.f, 0.f);
        const u16* pdo = dout + b * p.do_batch_stride + row * p.do_row_stride + head * p.do_head_stride;
        const u16* po = out + b * p.o_batch_stride + row * p.o_row_stride + head * p.o_head_stride;
#pragma unroll
        for (int c = sub; c < kChunks; c += kThreadsPerRow) {
            const uint4 x = *reinterpret_cast<const uint4*>(pdo + c * 8);
            const uint4 y = *reinterpret_cast<const uint4*>(po + c * 8);
            const u32 xs[4] = {x.x, x.y, x.z, x.w}, ys[4] = {y.x, y.y, y.z, y.w};
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                float x0, x1, y0, y1;
                unpack_f32x2<Is_bf16>(xs[i], x0, x1);
                unpack_f32x2<Is_bf16>(ys[i], y0, y1);
                acc += x0 * y0 + x1 * y1;
            }
        }
    }
#pragma unroll
    for (int off = 1; off < kThreadsPerRow; off *= 2) acc += __shfl_xor_sync(0xffffffffu, acc, off);
    if (valid && sub == 0) delta[r] = acc;
}

// ---- postprocess: dQ = dq_accum * softmax_scale, 8 elements per thread -------------------------
template <int kHeadDim, bool Is_bf16>
__global__ void __launch_bounds__(256)
flash_bwd_convert_dq_kernel(const __grid_constant__ BwdParams p) {
    const float* __restrict__ dq_accum = p.dq_accum;
    u16* __restrict__ dq = p.dq;
    constexpr int kChunks = kHeadDim / 8;
    const int seqlen_q = p.rows_seqlen_q, nheads = p.nheads;
    const float softmax_scale = p.softmax_scale;
    const i64 idx = i64(blockIdx.x) * blockDim.x + threadIdx.x;
    if (idx >= i64(p.rows_batch) * seqlen_q * nheads * kChunks) return;
    // dq_accum in order: (batch, head, row, chunk)
    const int chunk = int(idx % kChunks);
    const i64 rest = idx / kChunks;
    const int row = int(rest % seqlen_q);
    const i64 rest2 = rest / seqlen_q;
    const int head = int(rest2 % nheads), b = int(rest2 / nheads);
    const float4 lo = *reinterpret_cast<const float4*>(dq_accum + idx * 8);
    const float4 hi = *reinterpret_cast<const float4*>(dq_accum + idx * 8 + 4);
    uint4 o;
    o.x = pack_f32x2<Is_bf16>(lo.x * softmax_scale, lo.y * softmax_scale);
    o.y = pack_f32x2<Is_bf16>(lo.z * softmax_scale, lo.w * softmax_scale);
    o.z = pack_f32x2<Is_bf16>(hi.x * softmax_scale, hi.y * softmax_scale);
    o.w = pack_f32x2<Is_bf16>(hi.z * softmax_scale, hi.w * softmax_scale);
    *reinterpret_cast<uint4*>(dq + b * p.dq_batch_stride + row * p.dq_row_stride + head * p.dq_head_stride + chunk * 8) = o;
}

// ---- GQA: dK (blockIdx.y = 0) or dV (1) of a kv head = sum of its query heads' slices ----------
// One pass over the per-query-head gradients (dk, dv: contiguous, (rows of k, nheads, headdim)),
// float32 sums, one rounding; 8 elements per thread. The group's heads are adjacent: query head h
// belongs to kv head h / heads_per_kv_head.
template <int kHeadDim, bool Is_bf16>
__global__ void __launch_bounds__(256)
flash_bwd_group_sum_kernel(const __grid_constant__ BwdParams p) {
    constexpr int kChunks = kHeadDim / 8;
    const bool is_v = blockIdx.y == 1;
    const u16* __restrict__ per_head = is_v ? p.dv : p.dk;
    u16* __restrict__ grad = is_v ? p.dv_kv : p.dk_kv;
    const i64 batch_stride = is_v ? p.dv_kv_batch_stride : p.dk_kv_batch_stride;
    const i64 row_stride = is_v ? p.dv_kv_row_stride : p.dk_kv_row_stride;
    const i64 head_stride = is_v ? p.dv_kv_head_stride : p.dk_kv_head_stride;
    const int seqlen = p.rows_seqlen_k, nheads_k = p.nheads_k, group = p.heads_per_kv_head;
    const i64 idx = i64(blockIdx.x) * blockDim.x + threadIdx.x;
    if (idx >= i64(p.rows_batch) * seqlen * nheads_k * kChunks) return;
    const int chunk = int(idx % kChunks);
    const int head_k = int((idx / kChunks) % nheads_k);
    const i64 row = idx / (i64(kChunks) * nheads_k);
    const u16* src = per_head + (row * nheads_k * group + i64(head_k) * group) * kHeadDim + chunk * 8;
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    for (int m = 0; m < group; ++m) {
        const uint4 x = *reinterpret_cast<const uint4*>(src + m * kHeadDim);
        const u32 xs[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            float lo, hi;
            unpack_f32x2<Is_bf16>(xs[i], lo, hi);
            acc[2 * i] += lo;
            acc[2 * i + 1] += hi;
        }
    }
    uint4 o;
    o.x = pack_f32x2<Is_bf16>(acc[0], acc[1]);
    o.y = pack_f32x2<Is_bf16>(acc[2], acc[3]);
    o.z = pack_f32x2<Is_bf16>(acc[4], acc[5]);
    o.w = pack_f32x2<Is_bf16>(acc[6], acc[7]);
    *reinterpret_cast<uint4*>(grad + (row / seqlen) * batch_stride + (row % seqlen) * row_stride +
                              head_k * head_stride + chunk * 8) = o;
}

// ---- main kernel ------------------------------------------------------------------------------
// P^T = exp2(S^T c - LSE log2 e) and dS^T = P^T (dP^T - D), in place of S^T and dP^T; coords
// (fragment.cuh) places the scores, its rows being keys and its columns queries. A row that saw no
// key has LSE -inf: using +inf there makes P 0 instead of NaN. With score mods each raw score first
// goes to natural units (c = log2 e; masked ones stay -inf) and dS^T takes the softcap's derivative.
template <int kQTiles, bool Has_score_mod>
struct ProbsAndGrads {
    float (&s)[kQTiles][4];
    float (&dp)[kQTiles][4];
    const float* lse;    // LSE_i and D_i of this stage in shared memory, at this thread's first query
    const float* delta;
    const ScoreMod& mod;
    float score_log2;
    MmaAccCoordsFolded coords;

    template <bool kSoftcap, bool kAlibi>
    FC_DEVICE void run() {
        constexpr float kLog2e = 1.4426950408889634f;
#pragma unroll
        for (int nt = 0; nt < kQTiles; ++nt) {
            // The two queries of a thread in a tile are adjacent: one float2 of LSE and one of D.
            const int i = coords.col(nt, 0) - coords.col(0, 0);
            const float2 lse_pair = *reinterpret_cast<const float2*>(lse + i);
            const float2 d_pair = *reinterpret_cast<const float2*>(delta + i);
#pragma unroll
            for (int e1 = 0; e1 < 2; ++e1) {
                const float lse_row = e1 ? lse_pair.y : lse_pair.x;
                const float lse2 = lse_row == -FC_INF ? FC_INF : lse_row * kLog2e;
                const float d_row = e1 ? d_pair.y : d_pair.x;
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int e = 2 * h + e1;
                    float x = s[nt][e], dcap = 1.f;
                    if (Has_score_mod && x != -FC_INF)
                        x = mod.apply<kSoftcap, kAlibi>(x, coords.col(nt, e1), coords.row(0, h), dcap);
                    const float p = fast_exp2(x * score_log2 - lse2);
                    s[nt][e] = p;
                    dp[nt][e] = Has_score_mod ? p * (dp[nt][e] - d_row) * dcap : p * (dp[nt][e] - d_row);
                }
            }
        }
    }
};

template <int kHeadDim_, int kBlockM_, int kBlockN_, int kNWarps_, int kStages_>
struct BwdTraits {
    static constexpr int kHeadDim = kHeadDim_, kBlockM = kBlockM_, kBlockN = kBlockN_, kNWarps = kNWarps_;
    static constexpr int kStages = kStages_;  // buffers for Q_i, dO_i, LSE_i, D_i
    static constexpr int kThreads = 32 * kNWarps;
    static constexpr int kKeyGroups = kBlockN / 16;         // warps along keys, 16 keys each
    static constexpr int kDSplit = kNWarps / kKeyGroups;    // warps splitting dK, dV's head dim
    static constexpr int kDPerWarp = kHeadDim / kDSplit;
    static constexpr int kQTiles = kBlockM / 8;             // n8 tiles of S^T along queries
    // dQ = dS K: warps tile the (kBlockM x kHeadDim) block as strips of kDqMTiles 16-row tiles x
    // head-dim parts; 32-row strips where the warps allow it (fewer shared-memory loads per mma).
    static constexpr bool kDqWide = kNWarps % (kBlockM / 32) == 0 && kBlockM % 32 == 0 &&
                                    (kHeadDim / (kNWarps / (kBlockM / 32))) % 16 == 0 &&
                                    kNWarps / (kBlockM / 32) <= kHeadDim / 16;
    static constexpr int kDqMTiles = kDqWide ? 2 : 1;
    static constexpr int kDqStrips = kBlockM / (16 * kDqMTiles);
    static constexpr int kDqParts = kNWarps / kDqStrips;
    static constexpr int kDqPerWarp = kHeadDim / kDqParts;
    static constexpr int kPitch = SmemTile<kHeadDim>::kPitch, kPitchS = SmemTile<kBlockM>::kPitch;
    static constexpr int kPitchDq = kHeadDim + 8;  // floats per row of the staged dQ block
    // Shared memory, in bytes; flashcupy/sm80.py launches with the same number (CI asserts it: layout_check).
    static constexpr int kSmemK = kBlockN * kPitch * 2;                    // K_j, and V_j after it
    static constexpr int kSmemQ = kBlockM * kPitch * 2;                    // Q_i or dO_i; a stage holds both
    static constexpr int kSmemS = kBlockN * kPitchS * 2;                   // dS^T
    static constexpr int kSmemStats = kBlockM * 4;                         // one stage of LSE_i, of D_i
    static constexpr int kSmemBytes = 2 * kSmemK + 2 * kStages * kSmemQ + kSmemS + 2 * kStages * kSmemStats;
    static_assert(kHeadDim % 32 == 0 && kBlockM % 16 == 0 && kBlockN % 16 == 0, "tile shapes");
    static_assert(kNWarps % kKeyGroups == 0 && kHeadDim % kDSplit == 0 && kDPerWarp % 16 == 0,
                  "warps must split keys into 16-row groups and the head dim into 16-column parts");
    static_assert(kNWarps % kDqStrips == 0 && kHeadDim % kDqParts == 0 && kDqPerWarp % 16 == 0,
                  "warps must tile the dQ block");
    static_assert(kStages == 1 || kStages == 2, "one or two stages");
};

template <int kHeadDim, int kBlockM, int kBlockN, int kNWarps, int kStages, bool Is_causal, bool Is_local,
          bool Is_bf16, bool Is_deterministic, bool Has_score_mod>
__global__ void __launch_bounds__(kNWarps * 32, 1)
flash_bwd_kernel(const __grid_constant__ BwdParams p) {  // params.cuh
    // The tensors as restrict pointers: no two alias, and saying so keeps ptxas from spilling in the
    // main loop (measured: 0 spills at d = 64, against 8 bytes with the struct's own pointers).
    const u16* __restrict__ q = p.q;
    const u16* __restrict__ k = p.k;
    const u16* __restrict__ v = p.v;
    const u16* __restrict__ dout = p.dout;
    const float* __restrict__ lse = p.lse;
    const float* __restrict__ delta = p.delta;
    float* __restrict__ dq_accum = p.dq_accum;
    u16* __restrict__ dk = p.dk;
    u16* __restrict__ dv = p.dv;
    int* __restrict__ dq_semaphore = p.dq_semaphore;
    const int* __restrict__ cu_seqlens_q = p.cu_seqlens_q;
    const int* __restrict__ cu_seqlens_k = p.cu_seqlens_k;
    const float* __restrict__ alibi_slopes = p.alibi_slopes;
    using T = BwdTraits<kHeadDim, kBlockM, kBlockN, kNWarps, kStages>;
    constexpr float kLog2e = 1.4426950408889634f;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    u16* sK = reinterpret_cast<u16*>(smem_raw);
    u16* sV = sK + kBlockN * T::kPitch;
    // Stage s holds Q_i then dO_i ([kBlockM][kPitch] each); once both are consumed, the same bytes
    // take the float32 dQ_i block ([kBlockM][kHeadDim + 8]) on its way to the atomics.
    u16* sQ = sV + kBlockN * T::kPitch;
    u16* sdO = sQ + kBlockM * T::kPitch;
    u16* sdS = sQ + kStages * 2 * kBlockM * T::kPitch;    // [kBlockN][kPitchS], dS^T
    float* sLse = reinterpret_cast<float*>(sdS + kBlockN * T::kPitchS);  // [kStages][kBlockM]
    float* sDelta = sLse + kStages * kBlockM;                              // [kStages][kBlockM]

    int n_block, head, batch;
    // Causal: key block 0 sees every q block, so ascending key blocks are heaviest first.
    block_coords<Is_causal || Is_local, false>(blockIdx.x, (p.max_seqlen_k + kBlockN - 1) / kBlockN, p.nheads, n_block,
                                               head, batch);
    const SeqLens seq(cu_seqlens_q, cu_seqlens_k, batch, p.max_seqlen_q, p.max_seqlen_k);
    const int seqlen_q = seq.seqlen_q, seqlen_k = seq.seqlen_k;
    if (n_block * kBlockN >= seqlen_k) return;  // varlen: past this sequence's end
    const int band_offset = p.align_bottom_right ? seqlen_k - seqlen_q : 0;
    const Mask<Is_causal, Is_local, kBlockM, kBlockN> mask{seqlen_q, seqlen_k, band_offset, p.window_left, p.window_right};
    const ScoreMod mod(p.softmax_scale, p.softcap, alibi_slopes, p.alibi_batch_stride, batch, head, band_offset);
    const int kv_head = head / p.heads_per_kv_head;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int g = lane >> 2, t = lane & 3;
    const int key0 = n_block * kBlockN;
    const int keys_valid = min(kBlockN, seqlen_k - key0);
    // The q blocks holding a row that sees a key of this block (causal / local: the others are skipped).
    const int m_block_min = mask.row_begin(key0) / kBlockM;
    const int m_block_max = (mask.row_end(key0) + kBlockM - 1) / kBlockM;

    const i64 q_start = seq.q_start, k_row = i64(seq.k_start) + key0;
    const u16* gQ = q + batch * p.q_batch_stride + head * p.q_head_stride + q_start * p.q_row_stride;
    const u16* gdO = dout + batch * p.do_batch_stride + head * p.do_head_stride + q_start * p.do_row_stride;
    const u16* gK = k + batch * p.k_batch_stride + kv_head * p.k_head_stride + k_row * p.k_row_stride;
    const u16* gV = v + batch * p.v_batch_stride + kv_head * p.v_head_stride + k_row * p.v_row_stride;
    const float* gLse = lse + batch * p.lse_batch_stride + head * p.lse_head_stride + q_start;
    const float* gDelta = delta + batch * p.lse_batch_stride + head * p.lse_head_stride + q_start;
    // dq_accum (rows_batch, nheads, rows_seqlen_q, headdim): a varlen batch is one entry of its packed rows
    const i64 dq_rows = (cu_seqlens_q ? i64(head) : i64(batch) * p.nheads + head) * p.rows_seqlen_q + (cu_seqlens_q ? q_start : 0);
    float* gdQ = dq_accum + dq_rows * kHeadDim;
    const i64 dq_row_stride = kHeadDim;

    const u32 sK_base = smem_u32(sK), sV_base = smem_u32(sV), sQ_base = smem_u32(sQ), sdO_base = smem_u32(sdO);
    const u32 sdS_base = smem_u32(sdS), sLse_base = smem_u32(sLse), sDelta_base = smem_u32(sDelta);
    const TileLoader<kBlockN, kHeadDim, T::kThreads> k_loader(tid, p.k_row_stride);
    const TileLoader<kBlockN, kHeadDim, T::kThreads> v_loader(tid, p.v_row_stride);
    const TileLoader<kBlockM, kHeadDim, T::kThreads> q_loader(tid, p.q_row_stride);
    const TileLoader<kBlockM, kHeadDim, T::kThreads> do_loader(tid, p.do_row_stride);

    // Q_i, dO_i, LSE_i and D_i of q block m into stage `stage`. Rows past seqlen_q are zero-filled.
    // (The lambda captures locals only: a reference to the params struct would take its address.)
    const i64 q_row_stride = p.q_row_stride, do_row_stride = p.do_row_stride;
    auto load_q_block = [&](int m, int stage) {
        const int row0 = m * kBlockM, rows = seqlen_q - row0;
        q_loader.load(sQ_base + stage * 2 * T::kSmemQ, gQ + row0 * q_row_stride, rows);
        do_loader.load(sdO_base + stage * 2 * T::kSmemQ, gdO + row0 * do_row_stride, rows);
        for (int r = tid; r < kBlockM; r += T::kThreads) {
            const bool valid = r < rows;
            cp_async_4(sLse_base + (stage * kBlockM + r) * 4, gLse + (valid ? row0 + r : 0), valid ? 4 : 0);
            cp_async_4(sDelta_base + (stage * kBlockM + r) * 4, gDelta + (valid ? row0 + r : 0), valid ? 4 : 0);
        }
    };

    const int m_count = max(0, m_block_max - m_block_min);
    k_loader.load(sK_base, gK, keys_valid);
    v_loader.load(sV_base, gV, keys_valid);
    if (m_count > 0) load_q_block(m_block_min, 0);
    cp_async_commit();

    // Warp roles. Phase 1 (S^T, dP^T, dV, dK): key group `kg` (16 keys), head-dim part `dpart` of
    // dK, dV. Phase 2 (dQ): row strip `dq_strip` of the q block, head-dim part `dq_part`.
    const int kg = warp % T::kKeyGroups, dpart = warp / T::kKeyGroups;
    const int dq_strip = warp % T::kDqStrips, dq_part = warp / T::kDqStrips;
    const int d0 = dpart * T::kDPerWarp, dq_d0 = dq_part * T::kDqPerWarp;
    // This lane's ldmatrix addresses; per-fragment offsets below are compile-time constants.
    const u32 sK_a = sK_base + tile_offset<kHeadDim>(16 * kg, 0) + ldsm_lane_offset_a<kHeadDim>(lane);
    const u32 sV_a = sV_base + tile_offset<kHeadDim>(16 * kg, 0) + ldsm_lane_offset_a<kHeadDim>(lane);
    const u32 q_frag_b = ldsm_lane_offset_b<kHeadDim>(lane);                       // Q, dO as B of S^T, dP^T
    const u32 q_frag_t = tile_offset<kHeadDim>(0, d0) + ldsm_lane_offset_a<kHeadDim>(lane);  // ... of dK, dV (.trans)
    const u32 sdS_t = sdS_base + tile_offset<kBlockM>(0, 16 * T::kDqMTiles * dq_strip) + ldsm_lane_offset_b<kBlockM>(lane);
    const u32 sK_t = sK_base + tile_offset<kHeadDim>(0, dq_d0) + ldsm_lane_offset_a<kHeadDim>(lane);

    float acc_dk[T::kDPerWarp / 8][4], acc_dv[T::kDPerWarp / 8][4];
    clear_acc(acc_dk);
    clear_acc(acc_dv);

    for (int it = 0; it < m_count; ++it) {
        const int m_block = m_block_min + it;
        const bool has_next = it + 1 < m_count;
        const int stage = kStages == 2 ? it & 1 : 0;
        const int row0 = m_block * kBlockM;
        const u32 sQ_s = sQ_base + stage * 2 * T::kSmemQ, sdO_s = sdO_base + stage * 2 * T::kSmemQ;
        float* sdQ = reinterpret_cast<float*>(sQ + stage * 2 * kBlockM * T::kPitch);
        const float* sLse_s = sLse + stage * kBlockM;
        const float* sDelta_s = sDelta + stage * kBlockM;
        cp_async_wait<0>();
        __syncthreads();  // Q_i, dO_i (and K_j, V_j) landed; the previous block's dQ reads of dS^T are done
        if (kStages == 2 && has_next) {
            load_q_block(m_block + 1, stage ^ 1);
            cp_async_commit();
        }

        // S^T = K_j Q_i^T and dP^T = V_j dO_i^T: 16 keys of this warp x kBlockM queries.
        float acc_s[T::kQTiles][4], acc_dp[T::kQTiles][4];
        clear_acc(acc_s);
        clear_acc(acc_dp);
#pragma unroll
        for (int kd = 0; kd < kHeadDim / 16; ++kd) {
            u32 a_k[4], a_v[4];
            ldmatrix_x4(a_k, sK_a + tile_offset<kHeadDim>(0, 16 * kd));
            ldmatrix_x4(a_v, sV_a + tile_offset<kHeadDim>(0, 16 * kd));
            warp_mma_k16_x2<Is_bf16, false, kHeadDim>(one_m_tile(acc_s), one_m_tile(a_k), sQ_s,
                                                      one_m_tile(acc_dp), one_m_tile(a_v), sdO_s, q_frag_b, 0, 16 * kd);
        }

        // Mask only blocks that straddle seqlen_k, seqlen_q or the diagonal.
        if (row0 + kBlockM > seqlen_q || mask.tile_needs_mask(row0, n_block)) {
            const MmaAccCoords st_coords(key0 + 16 * kg, row0, lane);  // rows: keys, columns: queries
#pragma unroll
            for (int nt = 0; nt < T::kQTiles; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int key = st_coords.row(0, e >> 1), row = st_coords.col(nt, e & 1);
                    if (row >= seqlen_q || mask.hidden(row, key)) acc_s[nt][e] = -FC_INF;
                }
        }
        // P^T and dS^T in place of S^T and dP^T (ProbsAndGrads above).
        const MmaAccCoordsFolded st_folded = MmaAccCoords(key0 + 16 * kg, row0, lane).folded();
        const int q0 = st_folded.col(0, 0) - row0;  // this thread's first query in the q block
        ProbsAndGrads<T::kQTiles, Has_score_mod> probs{acc_s, acc_dp, sLse_s + q0, sDelta_s + q0, mod,
                                                       Has_score_mod ? kLog2e : p.scale_log2, st_folded};
        if (Has_score_mod) mod.dispatch(probs);
        else probs.template run<false, false>();

        // dV_j += P^T dO_i and dK_j += dS^T Q_i over this warp's head-dim part; k runs over queries.
#pragma unroll
        for (int kq = 0; kq < kBlockM / 16; ++kq) {
            u32 a_p[4], a_ds[4];
            acc_to_a_frag<Is_bf16>(acc_s[2 * kq], acc_s[2 * kq + 1], a_p);
            acc_to_a_frag<Is_bf16>(acc_dp[2 * kq], acc_dp[2 * kq + 1], a_ds);
            if (dpart == 0) {  // dS^T to shared memory for dQ; a_ds[r] holds row g + 8 (r % 2), cols 8 (r / 2) + 2t
                u16* row_g = sdS + (16 * kg + g) * T::kPitchS + 16 * kq + 2 * t;
                *reinterpret_cast<u32*>(row_g) = a_ds[0];
                *reinterpret_cast<u32*>(row_g + 8 * T::kPitchS) = a_ds[1];
                *reinterpret_cast<u32*>(row_g + 8) = a_ds[2];
                *reinterpret_cast<u32*>(row_g + 8 * T::kPitchS + 8) = a_ds[3];
            }
            warp_mma_k16_x2<Is_bf16, true, kHeadDim>(one_m_tile(acc_dv), one_m_tile(a_p), sdO_s,
                                                     one_m_tile(acc_dk), one_m_tile(a_ds), sQ_s, q_frag_t, 16 * kq, 0);
        }
        __syncthreads();  // dS^T complete; every warp is done reading Q_i, dO_i

        // dQ_i += dS K_j: this warp's rows x kDqPerWarp columns, k over the block's keys.
        float acc_dq[T::kDqMTiles][T::kDqPerWarp / 8][4];
        clear_acc(acc_dq);
#pragma unroll
        for (int kk = 0; kk < kBlockN / 16; ++kk) {
            u32 a[T::kDqMTiles][4];
            load_a_frags<true, kBlockM>(a, sdS_t, 16 * kk, 0);
            warp_mma_k16<Is_bf16, true, kHeadDim>(acc_dq, a, sK_t, 16 * kk, 0);
        }
        int* sem = dq_semaphore + (i64(batch) * p.nheads + head) * ((p.max_seqlen_q + kBlockM - 1) / kBlockM) + m_block;
        // Deterministic: add in key-block order. The key blocks that reach q block i are a
        // contiguous range, from 0 or (Is_local) from the one holding key row0 + offset - left;
        // the semaphore counts the ones that have added, so block j waits for j - n_first.
        const int n_rank = n_block - mask.key_begin(row0) / kBlockN;
        if (Is_deterministic) {
            if (tid == 0)
                while (ld_acquire(sem) != n_rank) asm volatile("nanosleep.u32 64;\n");
            __syncthreads();
        }
        // Through shared memory, so that the lanes of a warp add one contiguous row segment: four
        // 32-byte sectors per L2 request instead of one (the reductions' request rate, not their
        // bytes, was the limit).
#pragma unroll
        for (int mt = 0; mt < T::kDqMTiles; ++mt)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int r = 16 * (T::kDqMTiles * dq_strip + mt) + g + 8 * h;
#pragma unroll
                for (int dt = 0; dt < T::kDqPerWarp / 8; ++dt)
                    *reinterpret_cast<float2*>(sdQ + r * T::kPitchDq + dq_d0 + 8 * dt + 2 * t) =
                        make_float2(acc_dq[mt][dt][2 * h], acc_dq[mt][dt][2 * h + 1]);
            }
        __syncthreads();
        constexpr int kChunksPerRow = kHeadDim / 4;
#pragma unroll
        for (int c = tid; c < kBlockM * kChunksPerRow; c += T::kThreads) {
            const int r = c / kChunksPerRow, col = (c % kChunksPerRow) * 4;
            if (row0 + r < seqlen_q)
                red_add_f32x4(gdQ + (row0 + r) * dq_row_stride + col,
                              *reinterpret_cast<const float4*>(sdQ + r * T::kPitchDq + col));
        }
        if (Is_deterministic) {
            __threadfence();
            __syncthreads();
            if (tid == 0) st_release(sem, n_rank + 1);
        }
        if (kStages == 1 && has_next) {  // single buffer: refill once its dQ staging has been read
            __syncthreads();
            load_q_block(m_block + 1, 0);
            cp_async_commit();
        }
    }

    // Epilogue: dK_j (times softmax_scale) and dV_j through the K, V tiles to 16-byte stores.
    cp_async_wait<0>();
    __syncthreads();
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int row = 16 * kg + g + 8 * h;
#pragma unroll
        for (int dt = 0; dt < T::kDPerWarp / 8; ++dt) {
            const int col = d0 + 8 * dt + 2 * t;
            *reinterpret_cast<u32*>(sK + row * T::kPitch + col) =
                pack_f32x2<Is_bf16>(acc_dk[dt][2 * h] * p.softmax_scale, acc_dk[dt][2 * h + 1] * p.softmax_scale);
            *reinterpret_cast<u32*>(sV + row * T::kPitch + col) =
                pack_f32x2<Is_bf16>(acc_dv[dt][2 * h], acc_dv[dt][2 * h + 1]);
        }
    }
    __syncthreads();
    store_tile<kBlockN, kHeadDim, T::kThreads>(dk + batch * p.dk_batch_stride + head * p.dk_head_stride + k_row * p.dk_row_stride,
                                               p.dk_row_stride, sK, keys_valid, tid);
    store_tile<kBlockN, kHeadDim, T::kThreads>(dv + batch * p.dv_batch_stride + head * p.dv_head_stride + k_row * p.dv_row_stride,
                                               p.dv_row_stride, sV, keys_valid, tid);
}
