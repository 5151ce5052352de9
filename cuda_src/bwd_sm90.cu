// FlashAttention backward for Hopper (sm_90a): the FlashAttention-2 structure (one thread block per
// key block, dK and dV in registers, dQ added into a float32 accumulator) on TMA, mbarriers and
// wgmma, with a producer warpgroup (FlashAttention-3, section 3.3 of its paper). The preprocess
// (D = rowsum(dO O), dq_accum = 0), the dQ conversion and the GQA group sum are bwd.cu's kernels
// (flashcupy/sm90_bwd.py launches them around this one).
//
// A block holds key block j (kBlockN = 128 keys, 64 per consumer warpgroup, keys on the wgmma's M)
// and walks the q blocks i of kBlockM queries that see it (64, or 128 at head dim 64):
//   warpgroup 0, producer: warp 0 (one thread) loads K_j, V_j once, then Q_i and dO_i of each q
//       block into a ring of kStages (full / empty mbarriers), by TMA; warps 1 and 2 copy LSE_i and
//       D_i; warp 3 (one thread) adds each consumer's dQ_i tile from shared memory into dq_accum
//       with TMA reductions;
//   the others, consumers, 64 keys each, per q block:
//       S^T = K_j Q_i^T, dP^T = V_j dO_i^T              // wgmma, all operands in shared memory
//       P^T = exp2(S^T c - LSE_i log2 e)                // under dP^T's wgmma; masked where needed
//       dS^T = P^T (dP^T - D_i) -> shared memory (two buffers, alternating)
//       dV_j += P^T dO_i                                // wgmma, P^T from registers
//       dQ_i = dS K_j                                   // wgmma, both operands transposed in smem
//       dK_j += dS^T Q_i                                // wgmma, dS^T from registers, under dQ's store
//       dQ_i -> shared memory, handed to warp 3;
//     dQ_i per warpgroup, over all the block's keys: with 64 queries half of the columns, with 128
//     half of the queries;
//   then dK_j *= softmax_scale; dK_j, dV_j to memory.
// Has_score_mod instances take the raw scores to natural units before P^T (score_mod.cuh) and fold
// the softcap's derivative into dS^T; Is_deterministic ones add each q block's dQ tiles in a fixed
// key-block order (a semaphore per q block); a sink needs nothing here (it is in the LSE).
// Shared memory: K, V (kBlockN rows), kStages x (Q, dO) (kBlockM rows), each as 64-column chunks
// with the 128-byte swizzle; 2 x dS^T (64-query chunks of [kBlockN keys][64], 128-byte rows, the
// same swizzle); per consumer its dQ_i tile (float32, 32-column parts, the same swizzle); kStages x
// (LSE_i log2 e, D_i); the mbarriers.
#include "sm90.cuh"
#include "mask.cuh"
#include "score_mod.cuh"
#include "seqlens.cuh"
#include "warp_mma.cuh"
#include "params.cuh"

constexpr float kLog2e = 1.4426950408889634f;

template <int kHeadDim_, int kBlockM_, int kBlockN_, int kStages_>
struct Sm90BwdTraits {
    static constexpr int kHeadDim = kHeadDim_, kBlockM = kBlockM_, kBlockN = kBlockN_, kStages = kStages_;
    static constexpr int kConsumerWGs = kBlockN / 64;
    static constexpr int kThreads = 128 * (1 + kConsumerWGs), kConsumers = 128 * kConsumerWGs;
    static constexpr int kProducerRegs = 24, kConsumerRegs = 240;
    // setmaxnreg moves registers within the block's allocation (65536 / kThreads at launch, in 8s):
    // what the producer gives up must cover what the consumers take, or they wait forever.
    static constexpr int kLaunchRegs = 65536 / kThreads / 8 * 8;
    static_assert((kLaunchRegs - kProducerRegs) * 128 >= (kConsumerRegs - kLaunchRegs) * kConsumers,
                  "register reallocation: the consumers would wait for registers the producer does not free");
    static constexpr int kChunk = 64, kChunks = kHeadDim / kChunk;
    static constexpr int kKVBytes = kBlockN * kHeadDim * 2;  // K or V
    static constexpr int kQBytes = kBlockM * kHeadDim * 2;   // Q or dO, one stage
    static constexpr int kDSBytes = kBlockN * kBlockM * 2;   // dS^T, one buffer (kBlockM / 64 chunks)
    // dQ_i: each consumer a 64 x kDQCols tile over all the block's keys, staged as float32 in 32-column
    // parts (128-byte rows): with 64 queries, all of them and half of the columns; with 128, its half
    // of the queries (kDQSplitRows) and all columns
    static constexpr bool kDQSplitRows = kBlockM == 128;
    static constexpr int kDQRows = 64, kDQCols = kDQSplitRows ? kHeadDim : kHeadDim / kConsumerWGs;
    static constexpr int kDQPartCols = 32, kDQParts = kDQCols / kDQPartCols;
    static constexpr int kDQPartBytes = kDQRows * kDQPartCols * 4, kDQBytes = kDQParts * kDQPartBytes;
    static constexpr int kOffV = kKVBytes;
    static constexpr int kOffQ = 2 * kKVBytes;
    static constexpr int kOffDO = kOffQ + kStages * kQBytes;
    static constexpr int kOffDS = kOffDO + kStages * kQBytes;
    static constexpr int kOffDQ = kOffDS + 2 * kDSBytes;
    static constexpr int kOffLse = kOffDQ + kConsumerWGs * kDQBytes;  // per stage LSE_i log2 e, then D_i
    static constexpr int kOffBar = kOffLse + kStages * 2 * kBlockM * 4;
    static constexpr int kBarriers = 1 + 2 * kStages;  // K and V full; per stage Q, dO, LSE, D full, empty
    static constexpr int kStageLoaders = 64;           // producer threads that copy a stage's LSE and D
    static constexpr int kSmemBytes = kOffBar + kBarriers * 8 + 1024;
    // Named barriers: dS^T written (both consumers read all of it), then per consumer its dQ tile
    // written (to warp 3) and read (from warp 3).
    static constexpr int kBarDS = 1, kBarDQFull = 2, kBarDQEmpty = 4, kDQHandoff = 128 + 32;
    static_assert(kHeadDim == 64 || kHeadDim == 128, "head dims 64 and 128 (dQ: 64 x 32 or 64 x 64 per warpgroup)");
    static_assert(kBlockM == 64 || (kBlockM == 128 && kHeadDim == 64),
                  "q blocks of 64 (128 at head dim 64: S^T and dP^T take 64 registers each)");
    static_assert(kBlockN == 128, "two consumer warpgroups of 64 keys");
};

// The score-mod instances' P^T and a_p (the plain ones compute them in the kernel, where ptxas
// keeps one branch per tile around the masking; inside this struct it branched per score, 3-14%
// slower under a causal mask). Element e of the thread's tile nt is key key + 8 (e / 2), query
// q0 + 8 nt + t2 + e % 2. Each raw score goes to natural units first (score_mod.cuh), then
// P^T = exp2(score log2 e - LSE_i log2 e), 0 where masked; once a_p holds P^T in the input dtype,
// s holds P^T times the softcap's derivative, which is what dS^T = P^T (dP^T - D_i) needs. 16
// queries at a time, so that few derivatives wait for a_p (register pressure).
template <int kBlockM, int kBlockN, bool Is_causal, bool Is_local, bool Is_bf16>
struct Sm90ScoreModProbs {
    float (&s)[1][kBlockM / 8][4];
    u32 (&a_p)[kBlockM / 16][4];
    const float* lse;  // this stage's LSE_i log2 e
    const ScoreMod& mod;
    const Mask<Is_causal, Is_local, kBlockM, kBlockN>& mask;
    int key, q0, t2, seqlen_q, seqlen_k;
    bool needs_mask;

    template <bool kSoftcap, bool kAlibi>
    FC_DEVICE void run() {
#pragma unroll
        for (int kk = 0; kk < kBlockM / 16; ++kk) {
            float dcap[2][4];
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                const int nt = 2 * kk + j;
                const float2 lse2 = *reinterpret_cast<const float2*>(lse + 8 * nt + t2);
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int k_e = key + 8 * (e / 2), q_e = q0 + 8 * nt + t2 + e % 2;
                    const float x = mod.apply<kSoftcap, kAlibi>(s[0][nt][e], q_e, k_e, dcap[j][e]) * kLog2e;
                    float pr = fast_exp2(x - (e % 2 ? lse2.y : lse2.x));
                    if (needs_mask && (k_e >= seqlen_k || q_e >= seqlen_q || mask.hidden(q_e, k_e))) pr = 0.f;
                    s[0][nt][e] = pr;
                }
            }
            acc_to_a_frag<Is_bf16>(s[0][2 * kk], s[0][2 * kk + 1], a_p[kk]);
#pragma unroll
            for (int j = 0; j < 2; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) s[0][2 * kk + j][e] *= dcap[j][e];
        }
    }
};

// The kernel's one parameter: BwdParams and the tensor maps of q, k, v, dout and dq_accum.
struct Sm90BwdArgs {
    BwdParams p;
    TmaDesc q, k, v, dout, dq_accum;
};
static_assert(sizeof(BwdParams) <= 512 && sizeof(Sm90BwdArgs) == 512 + 5 * 128,
              "flashcupy/sm90_bwd.py lays the tensor maps at bytes 512, 640, 768, 896 and 1024");

template <int kHeadDim, int kBlockM, int kBlockN, int kStages, bool Is_causal, bool Is_local, bool Is_bf16,
          bool Is_deterministic, bool Has_score_mod>
__global__ void __launch_bounds__(128 * (1 + kBlockN / 64), 1)
flash_bwd_sm90_kernel(const __grid_constant__ Sm90BwdArgs args) {
    using T = Sm90BwdTraits<kHeadDim, kBlockM, kBlockN, kStages>;
    const BwdParams& p = args.p;
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const u32 smem = (smem_u32(smem_raw) + 1023) & ~1023u;
    const u32 sK = smem, sV = smem + T::kOffV, sQ = smem + T::kOffQ, sdO = smem + T::kOffDO, sdS = smem + T::kOffDS;
    const u32 kv_full = smem + T::kOffBar;
    auto q_full = [&](int s) { return kv_full + 8 * (1 + s); };
    auto q_empty = [&](int s) { return kv_full + 8 * (1 + kStages + s); };
    const int tid = threadIdx.x, warpgroup = tid / 128, lane = tid & 31;
    if (tid == 0) {
        mbar_init(kv_full, 1);
        for (int s = 0; s < kStages; ++s) {
            mbar_init(q_full(s), 1 + T::kStageLoaders);
            mbar_init(q_empty(s), T::kConsumers);
        }
        mbar_fence_init();
    }
    __syncthreads();

    // Block (key block, head, batch), key blocks of a head adjacent; the last key block first where
    // the deterministic mode adds a q block's tiles from its last key block down (below).
    constexpr bool kLastKeysFirst = Is_deterministic && (Is_causal || Is_local);
    const int num_n_blocks = (p.max_seqlen_k + kBlockN - 1) / kBlockN;
    const int n_index = blockIdx.x % num_n_blocks, hb = blockIdx.x / num_n_blocks;
    const int n_block = kLastKeysFirst ? num_n_blocks - 1 - n_index : n_index;
    const int head = hb % p.nheads, batch = hb / p.nheads;
    const SeqLens seq(p.cu_seqlens_q, p.cu_seqlens_k, batch, p.max_seqlen_q, p.max_seqlen_k);
    const int seqlen_q = seq.seqlen_q, seqlen_k = seq.seqlen_k;
    const int key0 = n_block * kBlockN;
    if (key0 >= seqlen_k) return;  // varlen: past this sequence's end
    const int band_offset = p.align_bottom_right ? seqlen_k - seqlen_q : 0;
    const Mask<Is_causal, Is_local, kBlockM, kBlockN> mask{seqlen_q, seqlen_k, band_offset, p.window_left, p.window_right};
    const ScoreMod mod(p.softmax_scale, p.softcap, p.alibi_slopes, p.alibi_batch_stride, batch, head, band_offset);
    const int m_block_min = mask.row_begin(key0) / kBlockM;
    const int m_count = max(0, (mask.row_end(key0) + kBlockM - 1) / kBlockM - m_block_min);
    const int tma_batch = p.cu_seqlens_q ? 0 : batch;  // a packed varlen tensor is one batch entry

    if (warpgroup == 0) {  // ---- producer ----
        regs_release<T::kProducerRegs>();
        // Warps 1 and 2 copy LSE (in log2 units; +inf where P must be 0) and D, rows r + 64 j; thread
        // 0, in warp 0, issues the TMA loads (the copiers wait for stages to empty: not its warp).
        const int r = tid - 32;
        if (r >= 0 && r < T::kStageLoaders) {
            constexpr int kRows = kBlockM / T::kStageLoaders;
            const float* gLse = p.lse + batch * p.lse_batch_stride + head * p.lse_head_stride + seq.q_start;
            const float* gDelta = p.delta + batch * p.lse_batch_stride + head * p.lse_head_stride + seq.q_start;
            for (int it = 0; it < m_count; ++it) {
                const int s = it % kStages;
                float* stage = reinterpret_cast<float*>(smem_raw + (smem - smem_u32(smem_raw)) + T::kOffLse) + s * 2 * kBlockM;
                float l[kRows], d[kRows];
#pragma unroll
                for (int j = 0; j < kRows; ++j) {
                    const int q = (m_block_min + it) * kBlockM + r + 64 * j;
                    l[j] = q < seqlen_q ? gLse[q] : FC_INF;  // past the queries: P = 0
                    d[j] = q < seqlen_q ? gDelta[q] : 0.f;
                }
                mbar_wait(q_empty(s), ((it / kStages) & 1) ^ 1);
#pragma unroll
                for (int j = 0; j < kRows; ++j) {
                    stage[r + 64 * j] = l[j] == -FC_INF ? FC_INF : l[j] * kLog2e;  // a row without keys: P = 0, not NaN
                    stage[kBlockM + r + 64 * j] = d[j];
                }
                mbar_arrive(q_full(s));
            }
        }
        if (tid == 0) {
            tma_prefetch_desc(&args.q);
            tma_prefetch_desc(&args.k);
            tma_prefetch_desc(&args.v);
            tma_prefetch_desc(&args.dout);
            const int kv_head = head / p.heads_per_kv_head, k_row = seq.k_start + key0;
            mbar_arrive_expect_tx(kv_full, 2 * T::kKVBytes);
#pragma unroll
            for (int c = 0; c < T::kChunks; ++c) {
                tma_load_4d(sK + c * kBlockN * 128, &args.k, kv_full, c * T::kChunk, k_row, kv_head, tma_batch);
                tma_load_4d(sV + c * kBlockN * 128, &args.v, kv_full, c * T::kChunk, k_row, kv_head, tma_batch);
            }
            for (int it = 0; it < m_count; ++it) {
                const int s = it % kStages, q_row = seq.q_start + (m_block_min + it) * kBlockM;
                mbar_wait(q_empty(s), ((it / kStages) & 1) ^ 1);
                mbar_arrive_expect_tx(q_full(s), 2 * T::kQBytes);
#pragma unroll
                for (int c = 0; c < T::kChunks; ++c) {
                    tma_load_4d(sQ + s * T::kQBytes + c * kBlockM * 128, &args.q, q_full(s), c * T::kChunk, q_row, head,
                                tma_batch);
                    tma_load_4d(sdO + s * T::kQBytes + c * kBlockM * 128, &args.dout, q_full(s), c * T::kChunk, q_row,
                                head, tma_batch);
                }
            }
        }
        if (tid / 32 == 3 && m_count > 0) {  // warp 3: each consumer's dQ_i tile into dq_accum
            // Deterministic: q block i's tiles are added in key-block order. The key blocks that
            // reach it are a contiguous range [key_begin, key_end) / kBlockN; its semaphore counts
            // those that have added, so block j waits for its rank. Without a mask the order is
            // ascending. Under a causal or band mask it is descending: key block j's first q
            // blocks are the last ones of the blocks below it, which ascending order would make it
            // wait for, while the blocks above it reach them first (they start there); those are
            // launched first, so a block never waits for one that is not running.
            int* sems = p.dq_semaphore + (i64(batch) * p.nheads + head) * ((p.max_seqlen_q + kBlockM - 1) / kBlockM);
            // Each consumer waits for its tile to be free before writing it; the first is.
#pragma unroll
            for (int c = 0; c < T::kConsumerWGs; ++c) named_bar_arrive(T::kBarDQEmpty + c, T::kDQHandoff);
            for (int it = 0; it < m_count; ++it) {
                // Rows past a sequence's end hold zeros (P = 0 there): in a packed varlen batch they
                // add nothing to the next sequence, past the tensor's end TMA drops them.
                const int m_block = m_block_min + it, q_row = seq.q_start + m_block * kBlockM;
                const int n_rank = kLastKeysFirst ? (mask.key_end(m_block * kBlockM) - 1) / kBlockN - n_block
                                                  : n_block - mask.key_begin(m_block * kBlockM) / kBlockN;
                if (Is_deterministic) {
                    if (lane == 0)
                        while (ld_acquire(sems + m_block) != n_rank) asm volatile("nanosleep.u32 64;\n");
                    __syncwarp();
                }
#pragma unroll
                for (int c = 0; c < T::kConsumerWGs; ++c) {
                    named_bar_sync(T::kBarDQFull + c, T::kDQHandoff);
                    if (lane == 0) {
                        const u32 tile = smem + T::kOffDQ + c * T::kDQBytes;
#pragma unroll
                        for (int h = 0; h < T::kDQParts; ++h)
                            tma_reduce_add_4d(&args.dq_accum, tile + h * T::kDQPartBytes,
                                              (T::kDQSplitRows ? 0 : c * T::kDQCols) + h * T::kDQPartCols,
                                              q_row + (T::kDQSplitRows ? c * T::kDQRows : 0), head, tma_batch);
                        bulk_commit();
                    }
                }
                if (Is_deterministic && lane == 0) {
                    bulk_wait<0>();  // added, not only read
                    st_release(sems + m_block, n_rank + 1);
                }
                if (it + 1 < m_count) {
                    if (lane == 0) bulk_wait_read<0>();
                    __syncwarp();
#pragma unroll
                    for (int c = 0; c < T::kConsumerWGs; ++c) named_bar_arrive(T::kBarDQEmpty + c, T::kDQHandoff);
                }
            }
            if (lane == 0) bulk_wait<0>();
        }
        return;
    }

    // ---- consumers ----
    regs_claim<T::kConsumerRegs>();
    const int consumer = warpgroup - 1, warp = (tid / 32) % 4, g = lane >> 2, t = lane & 3;
    const int key_wg0 = 64 * consumer;                 // this warpgroup's first key in the block
    const int key_w0 = key_wg0 + 16 * warp;            // this warp's first key (wgmma rows)
    float acc_dk[kHeadDim / 2], acc_dv[kHeadDim / 2];  // 64 keys x kHeadDim per warpgroup
#pragma unroll
    for (int i = 0; i < kHeadDim / 2; ++i) acc_dk[i] = acc_dv[i] = 0.f;

    const float* sLse = reinterpret_cast<const float*>(smem_raw + (smem - smem_u32(smem_raw)) + T::kOffLse);
    // Descriptors: K-major K, V (this warpgroup's 64 rows), Q, dO: 64-column chunks kBlockN or kBlockM
    // * 128 bytes apart, 16-column k steps 32 bytes apart; N-major dO, Q as the B of dV, dK (16
    // queries 2048 bytes apart); MN-major dS (16 keys 2048 bytes apart) and K (a 64-column chunk)
    // for dQ.
    const u32 sK_wg = sK + key_wg0 * 128, sV_wg = sV + key_wg0 * 128;

    mbar_wait(kv_full, 0);
    for (int it = 0; it < m_count; ++it) {
        const int s = it % kStages, m_block = m_block_min + it, q0 = m_block * kBlockM;
        const u32 sQ_s = sQ + s * T::kQBytes, sdO_s = sdO + s * T::kQBytes, sdS_b = sdS + (it & 1) * T::kDSBytes;
        float acc_s[1][kBlockM / 8][4], acc_dp[1][kBlockM / 8][4];  // S^T, dP^T: 64 keys x kBlockM queries
        float(&s_flat)[kBlockM / 2] = reinterpret_cast<float(&)[kBlockM / 2]>(acc_s);
        float(&dp_flat)[kBlockM / 2] = reinterpret_cast<float(&)[kBlockM / 2]>(acc_dp);
        // acc = A B^T over the head dim, A this warpgroup's 64 rows of K or V, B kBlockM rows of Q or dO;
        // each k step's descriptors are the tiles' advanced by constants
        auto issue_ss = [&](float (&acc)[kBlockM / 2], u64 desc_a, u64 desc_b) {
#pragma unroll
            for (int ks = 0; ks < kHeadDim / 16; ++ks) {
                const u32 chunk = ks / 4, col_bytes = (ks % 4) * 32;
                Wgmma<kBlockM, Is_bf16>::ss(acc, gmma_desc_advance(desc_a, chunk * kBlockN * 128 + col_bytes),
                                            gmma_desc_advance(desc_b, chunk * kBlockM * 128 + col_bytes), ks > 0);
            }
            wgmma_commit();
        };
        mbar_wait(q_full(s), (it / kStages) & 1);
        wgmma_fence();
        // K_j and V_j do not change; their descriptors are rebuilt each step (in_place), not held
        issue_ss(s_flat, gmma_desc(in_place(sK_wg), 16, 1024), gmma_desc(sQ_s, 16, 1024));
        issue_ss(dp_flat, gmma_desc(in_place(sV_wg), 16, 1024), gmma_desc(sdO_s, 16, 1024));
        // this stage's LSE_i log2 e, then D_i; a thread's two queries in a tile are adjacent (one
        // float2). With 64 queries LSE_i is read while the wgmmas run (with 128 there are no
        // registers for it), D_i after P^T.
        const float* lse_s = sLse + s * 2 * kBlockM;
        constexpr bool kLseEarly = !Has_score_mod && kBlockM == 64;
        float2 lse2[kBlockM / 8], dsum2[kBlockM / 8];
        if constexpr (kLseEarly) {
#pragma unroll
            for (int nt = 0; nt < kBlockM / 8; ++nt)
                lse2[nt] = *reinterpret_cast<const float2*>(lse_s + 8 * nt + 2 * t);
        }
        wgmma_wait<1>();  // S^T done; dP^T still running
        fence_regs(s_flat);

        // P^T in place of S^T and a_p, P^T in the input dtype (dV's A operand); then dS^T in place of dP^T
        const bool needs_mask = q0 + kBlockM > seqlen_q || key0 + kBlockN > seqlen_k ||
                                ((Is_causal || Is_local) && mask.tile_needs_mask(q0, n_block));
        u32 a_p[kBlockM / 16][4], a_ds[kBlockM / 16][4];
        if constexpr (Has_score_mod) {
            Sm90ScoreModProbs<kBlockM, kBlockN, Is_causal, Is_local, Is_bf16> probs{
                acc_s, a_p, lse_s, mod, mask, key0 + key_w0 + g, q0, 2 * t, seqlen_q, seqlen_k, needs_mask};
            mod.dispatch(probs);
        } else {  // element e of tile nt is key key_w0 + g + 8 (e / 2), query q0 + 8 nt + 2 t + e % 2
#pragma unroll
            for (int nt = 0; nt < kBlockM / 8; ++nt) {
                if constexpr (!kLseEarly) lse2[nt] = *reinterpret_cast<const float2*>(lse_s + 8 * nt + 2 * t);
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int e1 = e % 2;
                    float pr = fast_exp2(acc_s[0][nt][e] * p.scale_log2 - (e1 ? lse2[nt].y : lse2[nt].x));
                    if (needs_mask) {
                        const int key = key0 + key_w0 + g + 8 * (e / 2), q = q0 + 8 * nt + 2 * t + e1;
                        if (key >= seqlen_k || q >= seqlen_q || mask.hidden(q, key)) pr = 0.f;
                    }
                    acc_s[0][nt][e] = pr;
                }
            }
#pragma unroll
            for (int kk = 0; kk < kBlockM / 16; ++kk)
                acc_to_a_frag<Is_bf16>(acc_s[0][2 * kk], acc_s[0][2 * kk + 1], a_p[kk]);
        }
        wgmma_wait<0>();  // dP^T done
        fence_regs(dp_flat);
#pragma unroll
        for (int nt = 0; nt < kBlockM / 8; ++nt)
            dsum2[nt] = *reinterpret_cast<const float2*>(lse_s + kBlockM + 8 * nt + 2 * t);
#pragma unroll
        for (int nt = 0; nt < kBlockM / 8; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e)
                acc_dp[0][nt][e] = acc_s[0][nt][e] * (acc_dp[0][nt][e] - (e % 2 ? dsum2[nt].y : dsum2[nt].x));
#pragma unroll
        for (int kk = 0; kk < kBlockM / 16; ++kk)
            acc_to_a_frag<Is_bf16>(acc_dp[0][2 * kk], acc_dp[0][2 * kk + 1], a_ds[kk]);
        // dS^T to shared memory in chunks of 64 queries ([kBlockN keys][64], 128-byte rows): chunk
        // nt / 8, row key, 16-byte unit nt % 8 swizzled with the row's low three bits (g): the
        // address of unit g, XOR (nt % 8) << 4. Two buffers: the other warpgroup may still read the
        // last q block's (its dQ wgmma), not the one before, which it finished before the last dS^T
        // barrier.
        const u32 ds_row = in_place(sdS_b + (key_w0 + g) * 128 + (g << 4) + 4 * t);
#pragma unroll
        for (int nt = 0; nt < kBlockM / 8; ++nt)
#pragma unroll
            for (int h = 0; h < 2; ++h)
                st_shared_u32(((ds_row + h * 8 * 128) ^ ((nt % 8) << 4)) + (nt / 8) * kBlockN * 128,
                              pack_f32x2<Is_bf16>(acc_dp[0][nt][2 * h], acc_dp[0][nt][2 * h + 1]));
        // dV += P^T dO_i, under the dS^T barrier and ahead of dQ (issued before dS^T, under dP^T, it
        // kept P^T's registers through dS^T: with 128 queries they do not fit, with 64 it measured
        // 1-3% slower)
        fence_regs(acc_dv);
        wgmma_fence();
        const u64 desc_do_n = gmma_desc(sdO_s, kBlockM * 128, 1024);
#pragma unroll
        for (int kk = 0; kk < kBlockM / 16; ++kk)
            Wgmma<kHeadDim, Is_bf16>::rs(acc_dv, a_p[kk], gmma_desc_advance(desc_do_n, kk * 2048));
        wgmma_commit();
        fence_proxy_async_shared();  // dS^T visible to the wgmma (async proxy)
        named_bar_sync(T::kBarDS, T::kConsumers);

        // dQ_i (64 queries from row0 x kDQCols columns from col0) = dS (queries x keys) K (keys x
        // columns); K's columns col0.. start (col0 % 64) * 2 bytes into a row of its 64-column
        // chunk, the queries row0.. are dS^T's chunk row0 / 64
        constexpr int kDQCols = T::kDQCols;
        const int col0 = T::kDQSplitRows ? 0 : consumer * kDQCols, row0 = T::kDQSplitRows ? consumer * 64 : 0;
        const u64 desc_k_dq =
            gmma_desc(in_place(sK + (col0 / 64) * kBlockN * 128 + (col0 % 64) * 2), kBlockN * 128, 1024);
        const u64 desc_ds = gmma_desc(sdS_b + (row0 / 64) * kBlockN * 128, kBlockN * 128, 1024);
        float acc_dq[kDQCols / 2];
#pragma unroll
        for (int kk = 0; kk < kBlockN / 16; ++kk)
            Wgmma<kDQCols, Is_bf16>::ss_tt(acc_dq, gmma_desc_advance(desc_ds, kk * 2048),
                                           gmma_desc_advance(desc_k_dq, kk * 2048), kk > 0);
        wgmma_commit();
        // dK += dS^T Q_i
        const u64 desc_q_n = gmma_desc(sQ_s, kBlockM * 128, 1024);
        fence_regs(acc_dk);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < kBlockM / 16; ++kk)
            Wgmma<kHeadDim, Is_bf16>::rs(acc_dk, a_ds[kk], gmma_desc_advance(desc_q_n, kk * 2048));
        wgmma_commit();
        wgmma_wait<1>();  // dV, dQ_i done
        fence_regs(acc_dv);
        fence_regs(acc_dq);
        // dQ_i to this warpgroup's tile, rows 16 warp + g + 8 h, columns 8 nt + 2 t + e1: column
        // part nt / 4, its 16-byte unit 2 (nt % 4) + t / 2 swizzled with the row's low three bits
        // (g): the address of unit (t / 2) ^ g, XOR (nt % 4) << 5. Rows g and g ^ 1 would store to
        // the same banks at once, so odd rows store tile nt ^ 2 where even ones store tile nt (the
        // half-warp's 64 stores then cover the 32 banks once).
        const bool odd = g & 1;
        const u32 dq_row = in_place(smem + T::kOffDQ + consumer * T::kDQBytes + (16 * warp + g) * 128 +
                                    (((((t >> 1) ^ g) << 4) + 8 * (t & 1)) ^ (odd << 6)));
        named_bar_sync(T::kBarDQEmpty + consumer, T::kDQHandoff);
#pragma unroll
        for (int nt = 0; nt < kDQCols / 8; ++nt)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int even_i = 4 * nt + 2 * h, odd_i = 4 * (nt ^ 2) + 2 * h;
                st_shared_f32x2(((dq_row + h * 8 * 128) ^ ((nt % 4) << 5)) + (nt / 4) * T::kDQPartBytes,
                                odd ? acc_dq[odd_i] : acc_dq[even_i], odd ? acc_dq[odd_i + 1] : acc_dq[even_i + 1]);
            }
        fence_proxy_async_shared();  // visible to the TMA reduction
        named_bar_arrive(T::kBarDQFull + consumer, T::kDQHandoff);
        wgmma_wait<0>();  // dK done: Q_i, dO_i, a_ds free
        fence_regs(acc_dk);
        mbar_arrive(q_empty(s));  // Q_i, dO_i consumed
    }

    // dK *= softmax_scale; rows key_w0 + g + 8 h, columns 8 dt + 2 t + e1
    u16* gdK = p.dk + batch * p.dk_batch_stride + head * p.dk_head_stride + i64(seq.k_start) * p.dk_row_stride;
    u16* gdV = p.dv + batch * p.dv_batch_stride + head * p.dv_head_stride + i64(seq.k_start) * p.dv_row_stride;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int key = key0 + key_w0 + g + 8 * h;
        if (key < seqlen_k) {
#pragma unroll
            for (int dt = 0; dt < kHeadDim / 8; ++dt) {
                *reinterpret_cast<u32*>(gdK + key * p.dk_row_stride + 8 * dt + 2 * t) =
                    pack_f32x2<Is_bf16>(acc_dk[4 * dt + 2 * h] * p.softmax_scale, acc_dk[4 * dt + 2 * h + 1] * p.softmax_scale);
                *reinterpret_cast<u32*>(gdV + key * p.dv_row_stride + 8 * dt + 2 * t) =
                    pack_f32x2<Is_bf16>(acc_dv[4 * dt + 2 * h], acc_dv[4 * dt + 2 * h + 1]);
            }
        }
    }
}
