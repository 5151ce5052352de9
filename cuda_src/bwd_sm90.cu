// FlashAttention backward for Hopper (sm_90a): the FlashAttention-2 structure (one thread block per
// key block, dK and dV in registers, dQ added into a float32 accumulator) on TMA, mbarriers and
// wgmma, with a producer warpgroup (FlashAttention-3, section 3.3 of its paper). The preprocess
// (D = rowsum(dO O), dq_accum = 0), the dQ conversion and the GQA group sum are bwd.cu's kernels
// (flashcupy/sm90_bwd.py launches them around this one).
//
// A block holds key block j and walks the q blocks i of kBlockM queries that see it:
//   warpgroup 0, producer: warp 0 (one thread) loads K_j, V_j once, then Q_i and dO_i of each q
//       block into rings of kStages (kStagesDO for dO; full / empty mbarriers), by TMA; warps 1
//       and 2 copy LSE_i and D_i; warp 3 (one thread) adds each consumer's dQ_i tile from shared
//       memory into dq_accum with TMA reductions;
//   the two others, consumers, in one of two arrangements by head dim.
// Keys on the wgmma's M (head dims 64, 128): kBlockN = 128 keys, 64 per consumer, kBlockM 64 (128
// at head dim 64; 80 at 128 without score mods, unmasked or causal from 2048 queries:
// flashcupy/sm90_bwd.py); per q block each consumer
//       S^T = K_j Q_i^T, dP^T = V_j dO_i^T              // wgmma, all operands in shared memory
//       P^T = exp2(S^T c - LSE_i log2 e)                // under dP^T's wgmma; masked where needed
//       dS^T = P^T (dP^T - D_i) -> shared memory (two buffers, alternating)
//       dV_j += P^T dO_i                                // wgmma, P^T from registers
//       dQ_i = dS K_j                                   // wgmma, both operands transposed in smem
//       dK_j += dS^T Q_i                                // wgmma, dS^T from registers, under dQ's store
//       dQ_i -> shared memory, handed to warp 3;
//     dQ_i per warpgroup, over all the block's keys: with 64 queries half of the columns, with 128
//     half of the queries; with 80 (no wgmma has an M of 80) half of the columns as
//       dQ_i^T = K_j^T dS^T                             // dS stored untransposed (stmatrix .trans)
// Keys on N (head dims 192 and 256, where 64 keys x all columns of dK and dV per consumer would
// not fit in registers): kBlockN = 96 keys at 192, 64 at 256, kBlockM = 64; per q block each consumer
//       S = Q_i K_c^T, dP = dO_i V_c^T                  // its half c of the keys, queries on M
//       P, dS as above -> shared memory, transposed (stmatrix): P^T, dS^T [kBlockN keys][64 queries]
//       dV_j^T += dO_i^T P^T, dK_j^T += Q_i^T dS^T      // columns on M, operands in smem: at 256
//                                                       // its 128 columns, all keys; at 192 all
//                                                       // columns, its 48 keys
//       dQ_i = dS K_j                                   // its half of the columns, all keys, in
//                                                       // two slices, each with a place of its own
//     with one stage of dO; P^T, dS^T in two pairs, alternating, at 256 (48 keys with the whole dQ
//     tile at once read slower: docs/PERF_NOTES.md), one pair at 192.
// Then dK_j *= softmax_scale; dK_j, dV_j to memory.
// Has_score_mod instances take the raw scores to natural units before P and fold the softcap's
// derivative into dS; Is_deterministic ones add each q block's dQ tiles in a fixed key-block order
// (a semaphore per q block); a sink needs nothing here (it is in the LSE).
// Shared memory: K, V (kBlockN rows), kStages x Q, kStagesDO x dO (kBlockM rows), each as 64-column
// chunks with the 128-byte swizzle; kDSBuffers x kBlockN x kBlockM 16-bit (dS^T twice, or P^T and dS^T kPdSPairs times;
// 64-query chunks of [kBlockN keys][64], 128-byte rows, the same swizzle; with 80 queries dS
// twice, 64-key chunks of [80 queries][64]); per consumer its dQ_i
// tile (at 192 both slices, at 256 the first; float32, 32-column parts, the same swizzle); kStages x
// (LSE_i log2 e, D_i); the mbarriers.
#include "sm90.cuh"
#include "mask.cuh"
#include "score_mod.cuh"
#include "seqlens.cuh"
#include "warp_mma.cuh"
#include "params.cuh"
#include "grid.cuh"

constexpr float kLog2e = 1.4426950408889634f;

template <int kHeadDim_, int kBlockM_, int kBlockN_, int kStages_>
struct Sm90BwdTraits {
    static constexpr int kHeadDim = kHeadDim_, kBlockM = kBlockM_, kBlockN = kBlockN_, kStages = kStages_;
    static constexpr bool kKeysOnN = kHeadDim > 128;  // the consumers' arrangement (above)
    // Keys on N, dK^T and dV^T over all columns and each consumer's keys where half of the columns
    // is not whole 64-column m tiles (192)
    static constexpr bool kDKVSplitKeys = kKeysOnN && (kHeadDim / 2) % 64 != 0;
    static constexpr int kStagesDO = kKeysOnN ? 1 : kStages;
    static constexpr int kConsumerWGs = 2;
    static constexpr int kThreads = 128 * (1 + kConsumerWGs), kConsumers = 128 * kConsumerWGs;
    static constexpr int kProducerRegs = 24, kConsumerRegs = 240;
    // setmaxnreg moves registers within the block's allocation (65536 / kThreads at launch, in 8s):
    // what the producer gives up must cover what the consumers take, or they wait forever.
    static constexpr int kLaunchRegs = 65536 / kThreads / 8 * 8;
    static_assert((kLaunchRegs - kProducerRegs) * 128 >= (kConsumerRegs - kLaunchRegs) * kConsumers,
                  "register reallocation: the consumers would wait for registers the producer does not free");
    // Whole 64-column chunks of the 128-byte swizzle: at d = 96 the second is half used (TMA fills
    // its columns past the head dim with zeros, which no wgmma reads)
    static constexpr int kChunk = 64, kChunks = (kHeadDim + kChunk - 1) / kChunk, kTileCols = kChunks * kChunk;
    static constexpr int kKVBytes = kBlockN * kTileCols * 2;  // K or V
    static constexpr int kQBytes = kBlockM * kTileCols * 2;   // Q or dO, one stage
    static constexpr int kDSBytes = kBlockN * kBlockM * 2;   // dS^T, dS or P^T, one buffer (layouts above)
    // keys on N, P^T and dS^T: twice at 256 (alternating by q block), once at 192 (the room
    // holds the second dQ slices, kDQSlicesApart)
    static constexpr int kDSBuffers = kKeysOnN && !kDKVSplitKeys ? 4 : 2;
    static constexpr int kPdSPairs = kKeysOnN ? kDSBuffers / 2 : 0;
    // Keys on N: a consumer's keys of S and dP; its part of dK^T and dV^T: half of the columns over
    // all keys where the half is whole 64-column m tiles (256), else all columns over its keys (192)
    static constexpr int kWGKeys = kBlockN / kConsumerWGs;
    static constexpr int kDKVCols = kDKVSplitKeys ? kHeadDim : kHeadDim / kConsumerWGs;
    static constexpr int kDKVKeys = kDKVSplitKeys ? kWGKeys : kBlockN;
    // dQ_i: each consumer a kDQRows x kDQCols tile over all the block's keys, staged as float32 in
    // 32-column parts (128-byte rows): with 64 queries, all of them and half of the columns; with 128,
    // its half of the queries (kDQSplitRows) and all columns; with 80 (not a wgmma M), all of them and
    // half of the columns, computed transposed (kDQTransposed: dQ_i^T = K_j^T dS^T, queries on N).
    // Keys on N, a consumer's half of the columns goes in kDQSlices slices of at most 64, computed
    // and handed off in turn (each with a place of its own: kDQSlicesApart, kDQSecondInQ below): at
    // 256 its two chunks; at 192 a whole chunk (0 or 2), then its half of the middle one. At d = 96
    // each consumer takes a chunk's 64 columns, the second's last 32 past the head dim (K's zeros)
    // and not added (kDQColsLast). A wgmma's N-major B may start inside a chunk but not run past its
    // end.
    static constexpr bool kDQSplitRows = kBlockM == 128;
    static constexpr bool kDQTransposed = !kKeysOnN && kBlockM % 64 != 0;
    static constexpr int kDQSlices = kKeysOnN ? 2 : 1;
    static constexpr int kDQRows = kDQTransposed ? kBlockM : 64;
    static constexpr int kDQCols = kKeysOnN ? kChunk : kDQSplitRows ? kHeadDim : kTileCols / kConsumerWGs;
    static constexpr int kDQColsLast = kDQSplitRows || kKeysOnN ? kDQCols : kHeadDim - kDQCols;
    // consumer c's slice sl of dQ: its first column and its width (the columns warp 3 adds)
    static FC_DEVICE constexpr int dq_col0(int c, int sl) {
        return !kKeysOnN ? (kDQSplitRows ? 0 : c * kDQCols)
                         : kDKVSplitKeys ? (sl == 0 ? 2 * kChunk * c : kChunk + kChunk / 2 * c)
                                         : (kDQSlices * c + sl) * kDQCols;
    }
    static FC_DEVICE constexpr int dq_cols(int c, int sl) {
        return !kKeysOnN ? (c + 1 == kConsumerWGs ? kDQColsLast : kDQCols)
                         : kDKVSplitKeys && sl == 1 ? kChunk / 2 : kDQCols;
    }
    // the slices hand off each column of a dQ row once (with kDQSplitRows, each consumer's rows)
    static FC_DEVICE constexpr bool dq_columns_once() {
        u64 seen[4] = {};
        int count = 0;
        for (int c = 0; c < (kDQSplitRows ? 1 : kConsumerWGs); ++c)
            for (int sl = 0; sl < kDQSlices; ++sl)
                for (int col = dq_col0(c, sl); col < dq_col0(c, sl) + dq_cols(c, sl); ++col, ++count) {
                    if (col < 0 || col >= kHeadDim || (seen[col / 64] >> (col % 64) & 1)) return false;
                    seen[col / 64] |= u64(1) << (col % 64);
                }
        return count == kHeadDim;
    }
    static constexpr int kDQPartCols = 32, kDQParts = kDQCols / kDQPartCols;
    // The second slice has a place of its own, so that it is stored without waiting for the first's
    // reduction to have read the tile (a barrier per slice to warp 3): at 192 in the consumer's dQ
    // tile (kDQSlicesApart); at 256 in the consumer's half of the Q stage (kDQSecondInQ), its 128
    // columns, which only its own dK^T reads, free once that is done; warp 3 then releases the
    // stage, once it has read the slice.
    static constexpr bool kDQSlicesApart = kDKVSplitKeys, kDQSecondInQ = kKeysOnN && !kDKVSplitKeys;
    static constexpr int kDQPartBytes = kDQRows * kDQPartCols * 4;
    static_assert(!kDQSecondInQ || (kDQParts * kDQPartBytes == kQBytes / 2 && kDKVCols * kBlockM * 2 == kQBytes / 2),
                  "the second dQ slice fills the consumer's half of the Q stage: the columns of its dK^T");
    static constexpr int kDQBytes = (kDQSlicesApart ? kHeadDim / kConsumerWGs / kDQPartCols : kDQParts) * kDQPartBytes;
    static constexpr int kOffV = kKVBytes;
    static constexpr int kOffQ = 2 * kKVBytes;
    static constexpr int kOffDO = kOffQ + kStages * kQBytes;
    static constexpr int kOffDS = kOffDO + kStagesDO * kQBytes;
    static constexpr int kOffDQ = kOffDS + kDSBuffers * kDSBytes;
    static constexpr int kOffLse = kOffDQ + kConsumerWGs * kDQBytes;  // per stage LSE_i log2 e, then D_i
    static constexpr int kOffBar = kOffLse + kStages * 2 * kBlockM * 4;
    // mbarriers (8 bytes each from kOffBar): K and V full; per stage Q (with LSE, D; and dO with keys
    // on M) full, empty; keys on N, per dO stage full, empty
    static constexpr int kMbarQFull = 1, kMbarQEmpty = kMbarQFull + kStages;
    static constexpr int kMbarDOFull = kKeysOnN ? kMbarQEmpty + kStages : kMbarQFull;
    static constexpr int kMbarDOEmpty = kKeysOnN ? kMbarDOFull + kStagesDO : kMbarQEmpty;
    static constexpr int kBarriers = 1 + 2 * kStages + (kKeysOnN ? 2 * kStagesDO : 0);
    static constexpr int kStageLoaders = 64;  // producer threads that copy a stage's LSE and D
    static constexpr int kSmemBytes = kOffBar + kBarriers * 8 + 1024;
    // Named barriers: dS^T written (both consumers read all of it), then per consumer its dQ tile
    // written (to warp 3; keys on N, per slice) and read (from warp 3); with one P^T, dS^T pair,
    // both consumers past the last q block's wgmmas (they read it).
    static constexpr int kBarDS = 1, kBarDQFull = 2, kBarDQEmpty = 4, kBarPdSFree = 6, kBarDQFullLast = 7;
    static constexpr int kDQHandoff = 128 + 32;
    // consumer c's slice sl of the q block in Q stage `stage`: its place in shared memory, the
    // barrier that hands it to warp 3
    static FC_DEVICE constexpr int dq_place(int c, int sl, int stage) {
        return kDQSecondInQ && sl == 1 ? kOffQ + stage * kQBytes + c * (kQBytes / 2)
                                       : kOffDQ + c * kDQBytes + (kDQSlicesApart ? sl * kDQParts * kDQPartBytes : 0);
    }
    static FC_DEVICE constexpr int dq_full_bar(int c, int sl) { return (sl == 1 ? kBarDQFullLast : kBarDQFull) + c; }
    static_assert(kKeysOnN || kHeadDim == 64 || kHeadDim == 128 || (kHeadDim == 96 && kBlockM == 64),
                  "keys on M: head dims 64, 96 and 128 (dQ: 64 x 32, 64 and 32, or 64 x 64 per warpgroup)");
    static_assert(kKeysOnN || kBlockM == 64 || (kBlockM == 128 && kHeadDim == 64) || (kBlockM == 80 && kHeadDim == 128),
                  "keys on M: q blocks of 64, 128 at head dim 64 (S^T and dP^T take 64 registers each), 80 at 128");
    static_assert(kKeysOnN || kBlockN == 128, "keys on M: two consumer warpgroups of 64 keys");
    static_assert(!kKeysOnN || (((kHeadDim == 192 && kBlockN == 96) || (kHeadDim == 256 && kBlockN == 64)) &&
                                kBlockM == 64),
                  "keys on N: head dims 192 (48 keys per consumer; dQ a chunk and a half) and 256 (32 keys per "
                  "consumer), 64 queries (one wgmma M)");
};

// A thread's mask bounds for its fragment's two rows, `first` and first + 8: two keys with keys on M
// (kRowsAreKeys: the queries that see each, Mask::rows_seeing), two queries with keys on N (the keys
// each sees, Mask::keys_seen), less `base`, so that a score at offset c from base in row r is hidden
// where c < lo[r] or c >= hi[r], a constant compare (a test of the query per score had made masked
// steps 1.4x the instructions of unmasked ones).
template <bool kRowsAreKeys, class MaskT>
FC_DEVICE void fragment_bounds(const MaskT& mask, int first, int base, int (&lo)[2], int (&hi)[2]) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        if constexpr (kRowsAreKeys) mask.rows_seeing(first + 8 * r, lo[r], hi[r]);
        else mask.keys_seen(first + 8 * r, lo[r], hi[r]);
        lo[r] -= base;
        hi[r] -= base;
    }
}

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
    int key, q0, t2;
    bool needs_mask;

    template <bool kSoftcap, bool kAlibi>
    FC_DEVICE void run() {
        int lo[2], hi[2];
        fragment_bounds<true>(mask, key, q0 + t2, lo, hi);
#pragma unroll
        for (int kk = 0; kk < kBlockM / 16; ++kk) {
            float dcap[2][4];
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                const int nt = 2 * kk + j;
                const float2 lse2 = *reinterpret_cast<const float2*>(lse + 8 * nt + t2);
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int c = 8 * nt + e % 2, k_e = key + 8 * (e / 2), q_e = q0 + t2 + c;
                    const float x = mod.apply<kSoftcap, kAlibi>(s[0][nt][e], q_e, k_e, dcap[j][e]) * kLog2e;
                    float pr = fast_exp2(x - (e % 2 ? lse2.y : lse2.x));
                    if (needs_mask && (c < lo[e / 2] || c >= hi[e / 2])) pr = 0.f;
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
    int section_heads;  // (head, batch) pairs whose key blocks interleave in the block order
    TmaDesc q, k, v, dout, dq_accum;
};
// section_heads follows BwdParams directly (its size is a multiple of its 8-byte alignment).
static_assert(sizeof(BwdParams) + 4 <= 512 && sizeof(Sm90BwdArgs) == 512 + 5 * 128,
              "flashcupy/sm90_bwd.py lays section_heads after BwdParams, the tensor maps at 512, 640, 768, 896 and 1024");

// What the producer and the consumers of a thread block share: its key block and (head, batch), the
// sequence's lengths, the q blocks that see the key block, its shared memory and mbarriers.
template <class T, bool Is_causal, bool Is_local>
struct Sm90BwdBlock {
    unsigned char* smem_ptr;  // the layout's base, as a generic pointer
    u32 smem;                 // and as a shared-memory address (1024-byte aligned)
    SeqLens seq;
    Mask<Is_causal, Is_local, T::kBlockM, T::kBlockN> mask;
    int n_block, head, batch, key0, m_block_min, m_count;
    int tma_batch;  // a packed varlen tensor is one batch entry

    FC_DEVICE u32 kv_full() const { return smem + T::kOffBar; }
    FC_DEVICE u32 q_full(int s) const { return smem + T::kOffBar + 8 * (T::kMbarQFull + s); }
    FC_DEVICE u32 q_empty(int s) const { return smem + T::kOffBar + 8 * (T::kMbarQEmpty + s); }
    FC_DEVICE u32 do_full(int s) const { return smem + T::kOffBar + 8 * (T::kMbarDOFull + s); }
    FC_DEVICE u32 do_empty(int s) const { return smem + T::kOffBar + 8 * (T::kMbarDOEmpty + s); }
    FC_DEVICE float* lse_stage(int s) const {  // LSE_i log2 e, then D_i
        return reinterpret_cast<float*>(smem_ptr + T::kOffLse) + s * 2 * T::kBlockM;
    }
};

// Warpgroup 0: the TMA loads (warp 0), the LSE and D copies (warps 1, 2), the dQ reductions (warp 3).
template <class T, bool Is_causal, bool Is_local, bool Is_deterministic>
FC_DEVICE void bwd_producer(const Sm90BwdArgs& args, const Sm90BwdBlock<T, Is_causal, Is_local>& b, int tid,
                            bool last_keys_first) {
    constexpr int kBlockM = T::kBlockM, kBlockN = T::kBlockN, kStages = T::kStages;
    const BwdParams& p = args.p;
    const int lane = tid & 31;
    regs_release<T::kProducerRegs>();
    // Warps 1 and 2 copy LSE (in log2 units; +inf where P must be 0) and D, rows r + 64 j; thread
    // 0, in warp 0, issues the TMA loads (the copiers wait for stages to empty: not its warp).
    const int r = tid - 32;
    if (r >= 0 && r < T::kStageLoaders) {
        constexpr int kRows = (kBlockM + T::kStageLoaders - 1) / T::kStageLoaders;
        const float* gLse = p.lse + b.batch * p.lse_batch_stride + b.head * p.lse_head_stride + b.seq.q_start;
        const float* gDelta = p.delta + b.batch * p.lse_batch_stride + b.head * p.lse_head_stride + b.seq.q_start;
        bool row_in_block[kRows];  // with 80 queries a step, the second row only for r < 16
#pragma unroll
        for (int j = 0; j < kRows; ++j) row_in_block[j] = kBlockM % 64 == 0 || r + 64 * j < kBlockM;
        for (int it = 0; it < b.m_count; ++it) {
            const int s = it % kStages;
            float* stage = b.lse_stage(s);
            float l[kRows], d[kRows];
#pragma unroll
            for (int j = 0; j < kRows; ++j) {
                const int q = (b.m_block_min + it) * kBlockM + r + 64 * j;
                const bool in = row_in_block[j] && q < b.seq.seqlen_q;
                l[j] = in ? gLse[q] : FC_INF;  // past the queries: P = 0
                d[j] = in ? gDelta[q] : 0.f;
            }
            mbar_wait(b.q_empty(s), ((it / kStages) & 1) ^ 1);
#pragma unroll
            for (int j = 0; j < kRows; ++j) {
                if (!row_in_block[j]) break;
                stage[r + 64 * j] = l[j] == -FC_INF ? FC_INF : l[j] * kLog2e;  // a row without keys: P = 0, not NaN
                stage[kBlockM + r + 64 * j] = d[j];
            }
            mbar_arrive(b.q_full(s));
        }
    }
    if (tid == 0) {
        tma_prefetch_desc(&args.q);
        tma_prefetch_desc(&args.k);
        tma_prefetch_desc(&args.v);
        tma_prefetch_desc(&args.dout);
        const u32 sK = b.smem, sV = b.smem + T::kOffV, sQ = b.smem + T::kOffQ, sdO = b.smem + T::kOffDO;
        const int kv_head = b.head / p.heads_per_kv_head, k_row = b.seq.k_start + b.key0;
        mbar_arrive_expect_tx(b.kv_full(), 2 * T::kKVBytes);
#pragma unroll
        for (int c = 0; c < T::kChunks; ++c) {
            tma_load_4d(sK + c * kBlockN * 128, &args.k, b.kv_full(), c * T::kChunk, k_row, kv_head, b.tma_batch);
            tma_load_4d(sV + c * kBlockN * 128, &args.v, b.kv_full(), c * T::kChunk, k_row, kv_head, b.tma_batch);
        }
        for (int it = 0; it < b.m_count; ++it) {
            const int s = it % kStages, q_row = b.seq.q_start + (b.m_block_min + it) * kBlockM;
            mbar_wait(b.q_empty(s), ((it / kStages) & 1) ^ 1);
            mbar_arrive_expect_tx(b.q_full(s), (T::kKeysOnN ? 1 : 2) * T::kQBytes);
#pragma unroll
            for (int c = 0; c < T::kChunks; ++c)
                tma_load_4d(sQ + s * T::kQBytes + c * kBlockM * 128, &args.q, b.q_full(s), c * T::kChunk, q_row, b.head,
                            b.tma_batch);
            const int sd = it % T::kStagesDO;
            if constexpr (T::kKeysOnN) {
                mbar_wait(b.do_empty(sd), ((it / T::kStagesDO) & 1) ^ 1);
                mbar_arrive_expect_tx(b.do_full(sd), T::kQBytes);
            }
#pragma unroll
            for (int c = 0; c < T::kChunks; ++c)
                tma_load_4d(sdO + sd * T::kQBytes + c * kBlockM * 128, &args.dout, b.do_full(sd), c * T::kChunk, q_row,
                            b.head, b.tma_batch);
        }
    }
    if (tid / 32 == 3 && b.m_count > 0) {  // warp 3: each consumer's dQ_i tile into dq_accum
        // Deterministic: q block i's tiles are added in key-block order. The key blocks that
        // reach it are a contiguous range [key_begin, key_end) / kBlockN; its semaphore counts
        // those that have added, so block j waits for its rank. Without a mask the order is
        // ascending. Under a causal or band mask it is descending: key block j's first q
        // blocks are the last ones of the blocks below it, which ascending order would make it
        // wait for, while the blocks above it reach them first (they start there); those are
        // launched first, so a block never waits for one that is not running.
        int* sems = p.dq_semaphore + (i64(b.batch) * p.nheads + b.head) * ((p.max_seqlen_q + kBlockM - 1) / kBlockM);
        // Each consumer waits for its tile to be free before writing it; the first is.
#pragma unroll
        for (int c = 0; c < T::kConsumerWGs; ++c) named_bar_arrive(T::kBarDQEmpty + c, T::kDQHandoff);
        for (int it = 0; it < b.m_count; ++it) {
            // Rows past a sequence's end hold zeros (P = 0 there): in a packed varlen batch they
            // add nothing to the next sequence, past the tensor's end TMA drops them.
            const int m_block = b.m_block_min + it, q_row = b.seq.q_start + m_block * kBlockM;
            const int n_rank = last_keys_first ? (b.mask.key_end(m_block * kBlockM) - 1) / kBlockN - b.n_block
                                               : b.n_block - b.mask.key_begin(m_block * kBlockM) / kBlockN;
            if (Is_deterministic) {
                if (lane == 0)
                    while (ld_acquire(sems + m_block) != n_rank) asm volatile("nanosleep.u32 64;\n");
                __syncwarp();
            }
#pragma unroll
            for (int sl = 0; sl < T::kDQSlices; ++sl) {
#pragma unroll
                for (int c = 0; c < T::kConsumerWGs; ++c) {
                    named_bar_sync(T::dq_full_bar(c, sl), T::kDQHandoff);
                    if (lane == 0) {
                        const u32 tile = b.smem + T::dq_place(c, sl, it % kStages);
#pragma unroll
                        for (int h = 0; h < T::dq_cols(c, sl) / T::kDQPartCols; ++h)
                            tma_reduce_add_4d(&args.dq_accum, tile + h * T::kDQPartBytes,
                                              T::dq_col0(c, sl) + h * T::kDQPartCols,
                                              q_row + (T::kDQSplitRows ? c * T::kDQRows : 0), b.head, b.tma_batch);
                        bulk_commit();
                    }
                }
                if (Is_deterministic && sl + 1 == T::kDQSlices && lane == 0) {
                    bulk_wait<0>();  // added, not only read
                    st_release(sems + m_block, n_rank + 1);
                }
                // the dQ tiles free once read (at 192 after both slices; at 256 the second slice is
                // in the Q stage, which is freed here instead of by the consumers)
                const bool tile_read = T::kDQSlicesApart ? sl + 1 == T::kDQSlices : sl == 0;
                if (tile_read && it + 1 < b.m_count) {
                    if (lane == 0) bulk_wait_read<0>();
                    __syncwarp();
#pragma unroll
                    for (int c = 0; c < T::kConsumerWGs; ++c) named_bar_arrive(T::kBarDQEmpty + c, T::kDQHandoff);
                }
                if (T::kDQSecondInQ && sl == 1 && lane == 0) {
                    bulk_wait_read<0>();
                    mbar_arrive(b.q_empty(it % kStages));
                }
            }
        }
        if (lane == 0) bulk_wait<0>();
    }
}

// A consumer's dQ_i (rows 16 warp + g + 8 h of its 64, columns 8 nt + 2 t + e1 of its kCols) to
// its dQ tile, then handed to warp 3: column part nt / 4, its 16-byte unit 2 (nt % 4) + t / 2
// swizzled with the row's low three bits (g): the address of unit (t / 2) ^ g, XOR (nt % 4) << 5.
// Rows g and g ^ 1 would store to the same banks at once, so odd rows store tile nt ^ 2 where even
// ones store tile nt (the half-warp's 64 stores then cover the 32 banks once).
// Transposed (kDQTransposed), the thread holds dQ_i^T: columns 16 warp + g + 8 h, queries 8 nt + 2 t + e1,
// stored one float at a time (the two queries lie in different rows): column c's 16-byte unit c / 4 of
// its part swizzled with the query's low three bits, which for the warp's 8 g and 4 t cover 32 banks.
template <class T>
FC_DEVICE void hand_off_dq_transposed(u32 smem, int consumer, int warp, int g, int t,
                                      const float (&acc_dq)[T::kDQRows / 2]) {
    const u32 tile = smem + T::kOffDQ + consumer * T::kDQBytes;  // = T::dq_place(consumer, 0, 0)
    named_bar_sync(T::kBarDQEmpty + consumer, T::kDQHandoff);
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int e1 = 0; e1 < 2; ++e1) {
            // query 2 t + e1 of the first tile; the others 8 rows (1024 bytes) apart, with the same swizzle
            const int c = 16 * warp + g + 8 * h, q = 2 * t + e1;
            const u32 addr = in_place(tile + (c / T::kDQPartCols) * T::kDQPartBytes + q * 128 +
                                      ((((c % T::kDQPartCols) / 4) ^ q) << 4) + (c % 4) * 4);
#pragma unroll
            for (int nt = 0; nt < T::kDQRows / 8; ++nt) st_shared_f32(addr + nt * 1024, acc_dq[4 * nt + 2 * h + e1]);
        }
    fence_proxy_async_shared();  // visible to the TMA reduction
    named_bar_arrive(T::dq_full_bar(consumer, 0), T::kDQHandoff);
}

template <class T, int kCols = T::kDQCols, int kSlice = 0, int kRegs>
FC_DEVICE void hand_off_dq(u32 smem, int consumer, int warp, int g, int t, const float (&acc_dq)[kRegs],
                           int stage = 0) {
    static_assert(2 * kRegs >= kCols, "a dQ fragment of kCols columns");
    const bool odd = g & 1;
    const u32 dq_row = in_place(smem + T::dq_place(consumer, kSlice, stage) + (16 * warp + g) * 128 +
                                (((((t >> 1) ^ g) << 4) + 8 * (t & 1)) ^ (odd << 6)));
    // the second slice's place is free by then (dq_place)
    if (kSlice == 0) named_bar_sync(T::kBarDQEmpty + consumer, T::kDQHandoff);
#pragma unroll
    for (int nt = 0; nt < kCols / 8; ++nt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int even_i = 4 * nt + 2 * h, odd_i = 4 * (nt ^ 2) + 2 * h;
            st_shared_f32x2(((dq_row + h * 8 * 128) ^ ((nt % 4) << 5)) + (nt / 4) * T::kDQPartBytes,
                            odd ? acc_dq[odd_i] : acc_dq[even_i], odd ? acc_dq[odd_i + 1] : acc_dq[even_i + 1]);
        }
    fence_proxy_async_shared();  // visible to the TMA reduction
    named_bar_arrive(T::dq_full_bar(consumer, kSlice), T::kDQHandoff);
}

// dK and dV from their rows staged at the Q stages (kBlockN rows of dK, then as many of dV,
// kRowBytes apart; unit u of row r at unit_offset(r, u) bytes into its row) to memory: 16-byte
// units, consecutive consumer threads along a row.
template <int kRowBytes, class T, bool Is_causal, bool Is_local, class UnitOffset>
FC_DEVICE void store_staged_dk_dv(const BwdParams& p, const Sm90BwdBlock<T, Is_causal, Is_local>& b, int tid,
                                  UnitOffset unit_offset) {
    u16* gdK = p.dk + b.batch * p.dk_batch_stride + b.head * p.dk_head_stride + i64(b.seq.k_start) * p.dk_row_stride;
    u16* gdV = p.dv + b.batch * p.dv_batch_stride + b.head * p.dv_head_stride + i64(b.seq.k_start) * p.dv_row_stride;
    constexpr int kUnits = T::kHeadDim / 8;
    const unsigned char* staged = b.smem_ptr + T::kOffQ;
    for (int idx = tid - 128; idx < T::kBlockN * kUnits; idx += T::kConsumers) {
        const int r = idx / kUnits, u = idx % kUnits, key = b.key0 + r;
        if (key < b.seq.seqlen_k) {
            const int at = r * kRowBytes + unit_offset(r, u);
            *reinterpret_cast<uint4*>(gdK + key * p.dk_row_stride + 8 * u) = *reinterpret_cast<const uint4*>(staged + at);
            *reinterpret_cast<uint4*>(gdV + key * p.dv_row_stride + 8 * u) =
                *reinterpret_cast<const uint4*>(staged + T::kBlockN * kRowBytes + at);
        }
    }
}

// P^T = exp2(S^T scale_log2 - LSE) in place of S^T (keys on M, plain scores): element e of tile nt
// is key key_row + 8 (e / 2), query q0 + 2 t + 8 nt + e % 2; where kMaskable and masked, the keys
// and queries past the sequences and those the mask hides get 0, tested as 8 nt + e % 2 against
// each key's bounds less q0 + 2 t (fragment_bounds). The stage's LSE (lse_s) is read here unless
// kLseEarly has read it already.
template <bool kMaskable, bool kLseEarly, int kNTiles, class MaskT>
FC_DEVICE void bwd_probs(float (&acc_s)[1][kNTiles][4], float2 (&lse2)[kNTiles], const float* lse_s, float scale_log2,
                         const MaskT& mask, int key_row, int q0, int t, bool masked) {
    int lo[2], hi[2];
    if constexpr (kMaskable) fragment_bounds<true>(mask, key_row, q0 + 2 * t, lo, hi);
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt) {
        if constexpr (!kLseEarly) lse2[nt] = *reinterpret_cast<const float2*>(lse_s + 8 * nt + 2 * t);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int e1 = e % 2, c = 8 * nt + e1;
            float pr = fast_exp2(acc_s[0][nt][e] * scale_log2 - (e1 ? lse2[nt].y : lse2[nt].x));
            if (kMaskable && masked && (c < lo[e / 2] || c >= hi[e / 2])) pr = 0.f;
            acc_s[0][nt][e] = pr;
        }
    }
}

// Keys on M: a consumer's 64 keys of the block (see the top of the file).
template <class T, bool Is_causal, bool Is_local, bool Is_bf16, bool Has_score_mod>
FC_DEVICE void bwd_consumer_keys_on_m(const BwdParams& p, const Sm90BwdBlock<T, Is_causal, Is_local>& b,
                                      const ScoreMod& mod, int tid) {
    constexpr int kHeadDim = T::kHeadDim, kBlockM = T::kBlockM, kBlockN = T::kBlockN, kStages = T::kStages;
    const u32 smem = b.smem, sK = smem, sV = smem + T::kOffV, sQ = smem + T::kOffQ, sdO = smem + T::kOffDO;
    const u32 sdS = smem + T::kOffDS;
    const int seqlen_q = b.seq.seqlen_q, seqlen_k = b.seq.seqlen_k, key0 = b.key0;
    // without a band or score mods, and causal at d = 64: the warpgroup index warp-uniform and K_j's,
    // V_j's descriptors held in uniform registers (d = 64 1-8% faster from 4k, causal 1-3%, d = 128
    // 1-3%); elsewhere level to 3% slower (docs/PERF_NOTES.md)
    constexpr bool kUniformWG = (kHeadDim == 64 || !Is_causal) && !Is_local && !Has_score_mod;
    const int consumer = (kUniformWG ? warpgroup_index() : tid / 128) - 1;
    const int lane = tid & 31, warp = (tid / 32) % 4, g = lane >> 2, t = lane & 3;
    const int key_wg0 = 64 * consumer;                 // this warpgroup's first key in the block
    const int key_w0 = key_wg0 + 16 * warp;            // this warp's first key (wgmma rows)
    float acc_dk[kHeadDim / 2], acc_dv[kHeadDim / 2];  // 64 keys x kHeadDim per warpgroup
#pragma unroll
    for (int i = 0; i < kHeadDim / 2; ++i) acc_dk[i] = acc_dv[i] = 0.f;

    // Descriptors: K-major K, V (this warpgroup's 64 rows), Q, dO: 64-column chunks kBlockN or kBlockM
    // * 128 bytes apart, 16-column k steps 32 bytes apart; N-major dO, Q as the B of dV, dK (16
    // queries 2048 bytes apart); MN-major dS (16 keys 2048 bytes apart) and K (a 64-column chunk)
    // for dQ.
    const u32 sK_wg = sK + key_wg0 * 128, sV_wg = sV + key_wg0 * 128;

    mbar_wait(b.kv_full(), 0);
    // The walk over q blocks [it_begin, it_end), with the scores' mask code (walk_masked) or, where no
    // score needs it, without: outside varlen, a key block inside seqlen_k, rows past seqlen_q read
    // as zeros with LSE +inf and D 0, so P and dS are 0 there already. Called with a constant each
    // way, inlined twice: a branch in the step instead would split its basic block (ptxas then waits
    // for dP^T before P^T).
    constexpr bool kBanded = Is_causal || Is_local;
    auto walk = [&](const bool walk_masked, const int it_begin, const int it_end) {
        for (int it = it_begin; it < it_end; ++it) {
            const int s = it % kStages, m_block = b.m_block_min + it, q0 = m_block * kBlockM;
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
            mbar_wait(b.q_full(s), (it / kStages) & 1);
            // this stage's LSE_i log2 e, then D_i; a thread's two queries in a tile are adjacent (one
            // float2). LSE_i is read before the wgmmas are issued (read after them, its loads waited
            // behind the wgmmas' and stalled P^T) in 64-query steps and in 80-query ones without a
            // band (under a causal mask 80 measured level, with more spills). D_i after P^T.
            const float* lse_s = b.lse_stage(s);
            constexpr bool kLseEarly = !Has_score_mod && (kBlockM == 64 || (kBlockM == 80 && !kBanded));
            float2 lse2[kBlockM / 8], dsum2[kBlockM / 8];
            if constexpr (kLseEarly) {
#pragma unroll
                for (int nt = 0; nt < kBlockM / 8; ++nt) lse2[nt] = lds_f32x2(smem_u32(lse_s + 8 * nt + 2 * t));
            }
            wgmma_fence();
            // K_j and V_j do not change: with kUniformWG their descriptors stay in uniform registers,
            // else they are rebuilt each step (in_place), not held in per-thread registers
            auto kv_base = [&](u32 tile) { return kUniformWG ? tile : in_place(tile); };
            issue_ss(s_flat, gmma_desc(kv_base(sK_wg), 16, 1024), gmma_desc(sQ_s, 16, 1024));
            issue_ss(dp_flat, gmma_desc(kv_base(sV_wg), 16, 1024), gmma_desc(sdO_s, 16, 1024));
            wgmma_wait<1>();  // S^T done; dP^T still running
            fence_regs(s_flat);

            // P^T in place of S^T and a_p, P^T in the input dtype (dV's A operand); then dS^T in place of dP^T
            const bool needs_mask = q0 + kBlockM > seqlen_q || key0 + kBlockN > seqlen_k ||
                                    (kBanded && b.mask.tile_needs_mask(q0, b.n_block));
            u32 a_p[kBlockM / 16][4], a_ds[kBlockM / 16][4];
            if constexpr (Has_score_mod) {
                Sm90ScoreModProbs<kBlockM, kBlockN, Is_causal, Is_local, Is_bf16> probs{
                    acc_s, a_p, lse_s, mod, b.mask, key0 + key_w0 + g, q0, 2 * t, walk_masked && needs_mask};
                mod.dispatch(probs);
            } else {
                const int key_row = key0 + key_w0 + g;
                // Banded builds' masked walks: masked steps take their own copy (with the flag tested per
                // score they branched on it per score on every step, 12-18% slower). Unbanded: the walk's
                // copy, the flag tested per score there, predicated (a split per step read 9% slower)
                if (walk_masked && (!kBanded || needs_mask))
                    bwd_probs<true, kLseEarly>(acc_s, lse2, lse_s, p.scale_log2, b.mask, key_row, q0, t,
                                               kBanded || needs_mask);
                else
                    bwd_probs<false, kLseEarly>(acc_s, lse2, lse_s, p.scale_log2, b.mask, key_row, q0, t, false);
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
            if constexpr (T::kDQTransposed) {
                // dS untransposed ([kBlockM queries][64 keys] chunks) by stmatrix .trans: matrix i = lane / 8
                // is query tile nt + i / 2, keys key_w0 + 8 (i % 2) ..; its row r = lane % 8 is query 8 (nt
                // + i / 2) + r, whose 8 keys fill 16-byte unit (key_w0 % 64) / 8 + i % 2, swizzled with r
                const int i = lane / 8, r = lane % 8;
                const u32 ds_unit = in_place(sdS_b + (key_w0 / 64) * kBlockM * 128 + (8 * (i / 2) + r) * 128 +
                                             ((((key_w0 % 64) / 8 + i % 2) ^ r) << 4));
#pragma unroll
                for (int nt = 0; nt < kBlockM / 8; nt += 2)
                    stmatrix_x4_trans(ds_unit + nt * 8 * 128, pack_f32x2<Is_bf16>(acc_dp[0][nt][0], acc_dp[0][nt][1]),
                                      pack_f32x2<Is_bf16>(acc_dp[0][nt][2], acc_dp[0][nt][3]),
                                      pack_f32x2<Is_bf16>(acc_dp[0][nt + 1][0], acc_dp[0][nt + 1][1]),
                                      pack_f32x2<Is_bf16>(acc_dp[0][nt + 1][2], acc_dp[0][nt + 1][3]));
            } else {
                const u32 ds_row = in_place(sdS_b + (key_w0 + g) * 128 + (g << 4) + 4 * t);
#pragma unroll
                for (int nt = 0; nt < kBlockM / 8; ++nt)
#pragma unroll
                    for (int h = 0; h < 2; ++h)
                        st_shared_u32(((ds_row + h * 8 * 128) ^ ((nt % 8) << 4)) + (nt / 8) * kBlockN * 128,
                                      pack_f32x2<Is_bf16>(acc_dp[0][nt][2 * h], acc_dp[0][nt][2 * h + 1]));
            }
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
                gmma_desc(kv_base(sK + (col0 / 64) * kBlockN * 128 + (col0 % 64) * 2), kBlockN * 128, 1024);
            float acc_dq[T::kDQTransposed ? kBlockM / 2 : kDQCols / 2];
            // d = 96: the second consumer's 64 columns run past the head dim into K's zero-filled
            // ones (a wgmma of 32 in a branch of its own made ptxas serialize every wgmma); only its
            // first kDQColsLast are handed off
            const bool last_dq_cols = T::kDQColsLast != kDQCols && consumer + 1 == T::kConsumerWGs;
            if constexpr (T::kDQTransposed) {
                // dQ_i^T (its 64 columns x kBlockM queries) = K_j^T (M-major: 16 keys 2048 bytes apart) dS^T
                // (dS K-major: 16 keys 32 bytes apart in a 64-key chunk, chunks kBlockM * 128 bytes apart)
                const u64 desc_ds = gmma_desc(sdS_b, 16, 1024);
#pragma unroll
                for (int kk = 0; kk < kBlockN / 16; ++kk)
                    Wgmma<kBlockM, Is_bf16>::ss_tn(acc_dq, gmma_desc_advance(desc_k_dq, kk * 2048),
                                                   gmma_desc_advance(desc_ds, (kk / 4) * kBlockM * 128 + (kk % 4) * 32),
                                                   kk > 0);
            } else {
                const u64 desc_ds = gmma_desc(sdS_b + (row0 / 64) * kBlockN * 128, kBlockN * 128, 1024);
#pragma unroll
                for (int kk = 0; kk < kBlockN / 16; ++kk)
                    Wgmma<kDQCols, Is_bf16>::ss_tt(acc_dq, gmma_desc_advance(desc_ds, kk * 2048),
                                                   gmma_desc_advance(desc_k_dq, kk * 2048), kk > 0);
            }
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
            if constexpr (T::kDQTransposed) hand_off_dq_transposed<T>(smem, consumer, warp, g, t, acc_dq);
            else if (last_dq_cols) hand_off_dq<T, T::kDQColsLast>(smem, consumer, warp, g, t, acc_dq);
            else hand_off_dq<T>(smem, consumer, warp, g, t, acc_dq);
            wgmma_wait<0>();  // dK done: Q_i, dO_i, a_ds free
            fence_regs(acc_dk);
            mbar_arrive(b.q_empty(s));  // Q_i, dO_i consumed
        }
    };
    // Steps [unmasked_begin, unmasked_end) walk without mask code, score mods or not: without a mask
    // all, under a causal one those after the q blocks its diagonal crosses (the walk's first), under
    // a band those between its edges; the others, and every step in varlen calls and where the key
    // block crosses seqlen_k, with it. Against mask code on every step: causal 1-5% faster, causal
    // with softcap or ALiBi 8-17%, score mods without a mask 2-5%, windows 0-3% (docs/PERF_NOTES.md)
    const bool maskable_everywhere = p.cu_seqlens_q || p.cu_seqlens_k || key0 + kBlockN > seqlen_k;
    int unmasked_begin = maskable_everywhere ? b.m_count : 0, unmasked_end = b.m_count;
    if ((Is_causal || Is_local) && !maskable_everywhere)
        b.mask.unmasked_steps(key0, b.m_block_min, b.m_count, unmasked_begin, unmasked_end);
    if (unmasked_begin > 0) walk(true, 0, unmasked_begin);
    if (unmasked_begin < unmasked_end) walk(false, unmasked_begin, unmasked_end);
    if constexpr (Is_local)
        if (unmasked_end < b.m_count) walk(true, unmasked_end, b.m_count);

    // dK (times softmax_scale) and dV through shared memory, in the Q and dO stages once both
    // consumers' last wgmmas have read them: stmatrix puts each warp's fragments into rows of keys
    // (kHeadDim columns, the 16-byte units of row r at unit ^ (r % 8), so that 8 rows' units fall in
    // different banks); then 16-byte stores along the rows, where each thread had stored its
    // fragments 4 bytes at a time (5-10% faster at 512-1k tokens, docs/PERF_NOTES.md). The stages'
    // address comes from the generic pointer: sQ, kept live across the loop, spilled at d=128. Rows
    // of whole chunks (at d = 96, 12 units of 16 bytes swizzled among 16).
    constexpr int kRowBytes = T::kTileCols * 2;
    static_assert(2 * kBlockN * kRowBytes <= 2 * kStages * T::kQBytes && T::kOffDO == T::kOffQ + kStages * T::kQBytes,
                  "dK, dV staged in the Q and dO stages");
    const u32 sdK = in_place(smem_u32(b.smem_ptr)) + T::kOffQ, sdV = sdK + kBlockN * kRowBytes;
    named_bar_sync(T::kBarDS, T::kConsumers);
    {
        // matrix i of a stmatrix: the warp's rows 8 (i % 2) .., columns 16 j + 8 (i / 2) ..
        const int i = lane / 8, row = key_w0 + 8 * (i % 2) + lane % 8;
        const float sc = p.softmax_scale;
#pragma unroll
        for (int j = 0; j < kHeadDim / 16; ++j) {
            const u32 offset = row * kRowBytes + (((2 * j + i / 2) ^ (row & 7)) << 4);
            const float* k0 = acc_dk + 8 * j;  // fragment of columns 16 j ..: rows g, g + 8, then 16 j + 8 ..
            const float* v0 = acc_dv + 8 * j;
            stmatrix_x4(sdK + offset, pack_f32x2<Is_bf16>(k0[0] * sc, k0[1] * sc), pack_f32x2<Is_bf16>(k0[2] * sc, k0[3] * sc),
                        pack_f32x2<Is_bf16>(k0[4] * sc, k0[5] * sc), pack_f32x2<Is_bf16>(k0[6] * sc, k0[7] * sc));
            stmatrix_x4(sdV + offset, pack_f32x2<Is_bf16>(v0[0], v0[1]), pack_f32x2<Is_bf16>(v0[2], v0[3]),
                        pack_f32x2<Is_bf16>(v0[4], v0[5]), pack_f32x2<Is_bf16>(v0[6], v0[7]));
        }
    }
    named_bar_sync(T::kBarDS, T::kConsumers);
    store_staged_dk_dv<kRowBytes>(p, b, tid, [](int r, int u) { return (u ^ (r & 7)) << 4; });
}

// Keys on N: P and dCap for a consumer's S tile (64 queries x kNT n tiles of 8 keys): element e of
// tile j is query q_row + 8 (e / 2), key key + 8 j + e % 2. P = exp2(score * scale_log2 - LSE_i log2
// e), 0 where masked (8 j + e % 2 tested against the row's key bounds less key, fragment_bounds); with
// score mods each raw score goes to natural units first (score_mod.cuh) and dcap gets the softcap's
// derivative, which dS = P (dP - D_i) dcap needs.
template <int kNT, class MaskT, bool Has_score_mod>
struct Sm90ProbsKeysOnN {
    float (&s)[kNT * 4];
    float (&dcap)[kNT * 4];
    const float (&lse)[2];  // LSE_i log2 e of the thread's two rows
    const ScoreMod& mod;
    const MaskT& mask;
    float scale_log2;  // softmax_scale log2 e, or log2 e after a score mod
    int q_row, key;
    bool needs_mask;

    template <bool kSoftcap, bool kAlibi>
    FC_DEVICE void run() {
        int lo[2], hi[2];
        fragment_bounds<false>(mask, q_row, key, lo, hi);
#pragma unroll
        for (int j = 0; j < kNT; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int c = 8 * j + e % 2, q = q_row + 8 * (e / 2), k = key + c;
                float x = s[4 * j + e];
                if constexpr (Has_score_mod) x = mod.apply<kSoftcap, kAlibi>(x, q, k, dcap[4 * j + e]);
                float pr = fast_exp2(x * scale_log2 - lse[e / 2]);
                if (needs_mask && (c < lo[e / 2] || c >= hi[e / 2])) pr = 0.f;
                s[4 * j + e] = pr;
            }
    }
};

// Keys on N: a consumer's half of the keys of S and dP, its part of dK, dV, its half of dQ (see the top).
template <class T, bool Is_causal, bool Is_local, bool Is_bf16, bool Has_score_mod>
FC_DEVICE void bwd_consumer_keys_on_n(const BwdParams& p, const Sm90BwdBlock<T, Is_causal, Is_local>& b,
                                      const ScoreMod& mod, int tid) {
    constexpr int kHeadDim = T::kHeadDim, kBlockM = T::kBlockM, kBlockN = T::kBlockN, kStages = T::kStages;
    constexpr int kNT = T::kWGKeys / 8;   // n tiles of S and dP
    constexpr int kMT = T::kDKVCols / 64, kDKVKeys = T::kDKVKeys;  // m tiles (64 columns), keys of dK^T, dV^T
    constexpr bool kBanded = Is_causal || Is_local;
    const u32 smem = b.smem, sK = smem, sV = smem + T::kOffV, sQ = smem + T::kOffQ, sdO = smem + T::kOffDO;
    const int seqlen_q = b.seq.seqlen_q, seqlen_k = b.seq.seqlen_k, key0 = b.key0;
    const int consumer = tid / 128 - 1, lane = tid & 31, warp = (tid / 32) % 4, g = lane >> 2, t = lane & 3;
    const int key_wg = T::kWGKeys * consumer;  // this warpgroup's first key in the block
    const int col_dkv = T::kDKVSplitKeys ? 0 : T::kDKVCols * consumer;  // its first column of dK, dV
    const int key_dkv = T::kDKVSplitKeys ? key_wg : 0;                   // and first key
    const int row = 16 * warp + g;  // the thread's first query in a q block (and row + 8)
    // dK^T, dV^T: element e of tile j of m tile mt is column col_dkv + 64 mt + row + 8 (e / 2), key
    // key_dkv + 8 j + 2 t + e % 2
    float acc_dk[kMT][kDKVKeys / 2], acc_dv[kMT][kDKVKeys / 2];
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int i = 0; i < kDKVKeys / 2; ++i) acc_dk[mt][i] = acc_dv[mt][i] = 0.f;
    // P^T, dS^T ([kBlockN keys][kBlockM queries], 128-byte rows, the 128-byte swizzle) from S-shaped
    // fragments, transposed by stmatrix: matrix i = lane / 8 is tile j0 + i / 2, rows 8 (i % 2) ..
    // of the warp's 16; its row r = lane % 8 is key key_wg + 8 j + r, whose queries 16 warp + 8 (i %
    // 2) .. fill 16-byte unit 2 warp + i % 2, swizzled with r.
    auto store_transposed = [&](u32 base, const float (&x)[kNT * 4]) {
        const int i = lane / 8, r = lane % 8;
#pragma unroll
        for (int j0 = 0; j0 < kNT; j0 += 2) {
            const int j = j0 + (j0 + 1 < kNT ? i / 2 : 0);
            const u32 addr = base + (key_wg + 8 * j + r) * 128 + (((2 * warp + i % 2) ^ r) << 4);
            if (j0 + 1 < kNT)
                stmatrix_x4_trans(addr, pack_f32x2<Is_bf16>(x[4 * j0], x[4 * j0 + 1]),
                                  pack_f32x2<Is_bf16>(x[4 * j0 + 2], x[4 * j0 + 3]),
                                  pack_f32x2<Is_bf16>(x[4 * j0 + 4], x[4 * j0 + 5]),
                                  pack_f32x2<Is_bf16>(x[4 * j0 + 6], x[4 * j0 + 7]));
            else
                stmatrix_x2_trans(addr, pack_f32x2<Is_bf16>(x[4 * j0], x[4 * j0 + 1]),
                                  pack_f32x2<Is_bf16>(x[4 * j0 + 2], x[4 * j0 + 3]));
        }
    };

    mbar_wait(b.kv_full(), 0);
    // the step count recomputed here (in_place: not the one computed before the producer branch,
    // which ptxas keeps on the stack and reloads each step)
    const int m_count = max(0, (int(in_place(b.mask.row_end(key0))) + kBlockM - 1) / kBlockM - b.m_block_min);
    for (int it = 0; it < m_count; ++it) {
        const int s = it % kStages, sd = it % T::kStagesDO, q0 = (b.m_block_min + it) * kBlockM;
        const u32 sQ_s = sQ + s * T::kQBytes, sdO_s = sdO + sd * T::kQBytes;
        float acc_s[kNT * 4], acc_dp[kNT * 4];  // S, dP: 64 queries x this warpgroup's keys
        // acc = A B^T over the head dim, A the 64 rows of Q or dO, B this warpgroup's keys of K or V
        auto issue_ss = [&](float (&acc)[kNT * 4], u64 desc_a, u64 desc_b) {
#pragma unroll
            for (int ks = 0; ks < kHeadDim / 16; ++ks) {
                const u32 chunk = ks / 4, col_bytes = (ks % 4) * 32;
                Wgmma<T::kWGKeys, Is_bf16>::ss(acc, gmma_desc_advance(desc_a, chunk * kBlockM * 128 + col_bytes),
                                               gmma_desc_advance(desc_b, chunk * kBlockN * 128 + col_bytes), ks > 0);
            }
            wgmma_commit();
        };
        // S as soon as Q_i lands: dO has one stage, loaded once the last step's dV^T had read it
        mbar_wait(b.q_full(s), (it / kStages) & 1);
        // LSE_i of the thread's two queries: read before the wgmmas are issued without a band or
        // score mods (read after them, its loads wait behind theirs and stall P; 2% faster at d =
        // 256, level at 192, slightly slower under a causal mask), else after
        const float* lse_s = b.lse_stage(s);
        constexpr bool kLseEarly = !Has_score_mod && !kBanded;
        float lse[2];
        if constexpr (kLseEarly) {
            lse[0] = lds_f32(smem_u32(lse_s + row));
            lse[1] = lds_f32(smem_u32(lse_s + row + 8));
        }
        wgmma_fence();
        issue_ss(acc_s, gmma_desc(sQ_s, 16, 1024), gmma_desc(in_place(sK + key_wg * 128), 16, 1024));
        mbar_wait(b.do_full(sd), (it / T::kStagesDO) & 1);
        issue_ss(acc_dp, gmma_desc(sdO_s, 16, 1024), gmma_desc(in_place(sV + key_wg * 128), 16, 1024));
        if constexpr (!kLseEarly) {
            lse[0] = lse_s[row];
            lse[1] = lse_s[row + 8];
        }
        wgmma_wait<1>();  // S done; dP still running
        fence_regs(acc_s);
        const bool needs_mask = q0 + kBlockM > seqlen_q || key0 + kBlockN > seqlen_k ||
                                (kBanded && b.mask.tile_needs_mask(q0, b.n_block));
        float dcap[kNT * 4];
        Sm90ProbsKeysOnN<kNT, decltype(b.mask), Has_score_mod> probs{
            acc_s, dcap, lse, mod, b.mask, Has_score_mod ? kLog2e : p.scale_log2, q0 + row, key0 + key_wg + 2 * t,
            needs_mask};
        if constexpr (Has_score_mod) mod.dispatch(probs);
        else probs.template run<false, false>();
        // Two P^T, dS^T pairs alternate: the other consumer read this one two q blocks ago, and has
        // waited for its wgmmas (wgmma_wait<0>) before the last kBarDS. One pair: both consumers
        // meet first, each past the last q block's wgmmas.
        const u32 sPT = smem + T::kOffDS + (it % T::kPdSPairs) * 2 * T::kDSBytes, sdST = sPT + T::kDSBytes;
        if constexpr (T::kPdSPairs == 1) named_bar_sync(T::kBarPdSFree, T::kConsumers);
        store_transposed(sPT, acc_s);
        wgmma_wait<0>();  // dP done
        fence_regs(acc_dp);
        const float dsum[2] = {lse_s[kBlockM + row], lse_s[kBlockM + row + 8]};
#pragma unroll
        for (int i = 0; i < kNT * 4; ++i)
            acc_dp[i] = acc_s[i] * (acc_dp[i] - dsum[(i % 4) / 2]) * (Has_score_mod ? dcap[i] : 1.f);
        store_transposed(sdST, acc_dp);
        fence_proxy_async_shared();  // P^T, dS^T visible to the wgmmas (async proxy)
        named_bar_sync(T::kBarDS, T::kConsumers);

        // dV^T += dO_i^T P^T and dK^T += Q_i^T dS^T: A dO_i's or Q_i's 64-column chunks (M-major: 16
        // queries 2048 bytes apart), B P^T or dS^T (K-major: 16 queries 32 bytes apart)
        auto issue_dkv = [&](float (&acc)[kMT][kDKVKeys / 2], u64 desc_cols, u64 desc_keys) {
#pragma unroll
            for (int mt = 0; mt < kMT; ++mt) fence_regs(acc[mt]);
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < kBlockM / 16; ++kk)
#pragma unroll
                for (int mt = 0; mt < kMT; ++mt)
                    Wgmma<kDKVKeys, Is_bf16>::ss_tn(acc[mt], gmma_desc_advance(desc_cols, mt * kBlockM * 128 + kk * 2048),
                                                    gmma_desc_advance(desc_keys, kk * 32), 1);
            wgmma_commit();
        };
        const u64 desc_pt = gmma_desc(sPT + key_dkv * 128, 16, 1024), desc_dst = gmma_desc(sdST + key_dkv * 128, 16, 1024);
        const u64 desc_do_m = gmma_desc(sdO_s + (col_dkv / 64) * kBlockM * 128, kBlockM * 128, 1024);
        const u64 desc_q_m = gmma_desc(sQ_s + (col_dkv / 64) * kBlockM * 128, kBlockM * 128, 1024);
        issue_dkv(acc_dv, desc_do_m, desc_pt);
        // dQ_i = dS K_j over a slice of its columns: A dS^T (M-major: 16 keys 2048 bytes apart), B K
        // (N-major, the slice's columns of a 64-column chunk)
        const u64 desc_ds = gmma_desc(sdST, kBlockN * 128, 1024);
        // the second slice in the same registers, or a narrower one in its own (the first's part of
        // them made ptxas serialize the wgmmas, C7511)
        constexpr int kCols1 = T::dq_cols(0, 1);
        float acc_dq[T::kDQCols / 2], acc_dq_narrow[kCols1 < T::kDQCols ? kCols1 / 2 : 1];
        auto issue_dq = [&](int slice) {
            const u32 col0 = T::dq_col0(consumer, slice);  // its chunk, then the column in it
            const u64 desc_k = gmma_desc(in_place(sK + col0 / 64 * kBlockN * 128 + col0 % 64 * 2), kBlockN * 128, 1024);
#pragma unroll
            for (int kk = 0; kk < kBlockN / 16; ++kk) {
                const u64 a = gmma_desc_advance(desc_ds, kk * 2048), b = gmma_desc_advance(desc_k, kk * 2048);
                if constexpr (kCols1 < T::kDQCols) {
                    if (slice == 1) {
                        Wgmma<kCols1, Is_bf16>::ss_tt(acc_dq_narrow, a, b, kk > 0);
                        continue;
                    }
                }
                Wgmma<T::kDQCols, Is_bf16>::ss_tt(acc_dq, a, b, kk > 0);
            }
            wgmma_commit();
        };
        static_assert(T::kDQSlices == 2 && T::kDQCols == 64 && T::dq_cols(0, 0) == 64,
                      "keys on N: dQ in two slices, the first of 64 columns");
        issue_dq(0);
        issue_dkv(acc_dk, desc_q_m, desc_dst);
        wgmma_wait<2>();  // dV^T done: dO_i free
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) fence_regs(acc_dv[mt]);
        mbar_arrive(b.do_empty(sd));
        wgmma_wait<1>();  // dQ_i's first slice done
        fence_regs(acc_dq);
        hand_off_dq<T>(smem, consumer, warp, g, t, acc_dq);
        wgmma_fence();
        issue_dq(1);  // under dK^T's wgmma
        wgmma_wait<1>();  // dK^T done: Q_i free (at 256 once warp 3 has read the second slice there)
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) fence_regs(acc_dk[mt]);
        if constexpr (!T::kDQSecondInQ) mbar_arrive(b.q_empty(s));
        wgmma_wait<0>();  // the second slice done: P^T, dS^T free
        if constexpr (kCols1 < T::kDQCols) {
            fence_regs(acc_dq_narrow);
            hand_off_dq<T, kCols1, 1>(smem, consumer, warp, g, t, acc_dq_narrow);
        } else {
            fence_regs(acc_dq);
            hand_off_dq<T, T::kDQCols, 1>(smem, consumer, warp, g, t, acc_dq, s);
        }
    }

    // dK (times softmax_scale) and dV through shared memory, where stmatrix transposes the fragments
    // into rows of keys (kHeadDim columns, padded by 16 bytes: 8 rows' units fall in different
    // banks); the Q and dO stages (and at 192 the P^T, dS^T buffers after them) hold them once both
    // consumers' last wgmmas have read Q, dO, P^T and dS^T.
    constexpr int kRowBytes = kHeadDim * 2 + 16;
    static_assert(T::kOffDO == T::kOffQ + kStages * T::kQBytes && T::kOffDS == T::kOffDO + T::kStagesDO * T::kQBytes &&
                      2 * kBlockN * kRowBytes <= T::kOffDQ - T::kOffQ,
                  "dK, dV staged in the Q, dO and P^T, dS^T buffers");
    const u32 sdK = in_place(smem_u32(b.smem_ptr)) + T::kOffQ, sdV = sdK + kBlockN * kRowBytes;
    if constexpr (T::kDQSecondInQ)  // the last q blocks' second dQ slices read from the Q stages
        for (int it = max(0, m_count - kStages); it < m_count; ++it)
            mbar_wait(b.q_empty(it % kStages), (it / kStages) & 1);
    named_bar_sync(T::kBarDS, T::kConsumers);
    {
        const int i = lane / 8, r = lane % 8;
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
            for (int j0 = 0; j0 < kDKVKeys / 8; j0 += 2) {  // matrix i: key tile j0 + i / 2, columns 8 (i % 2) ..
                const int col = col_dkv + 64 * mt + 16 * warp + 8 * (i % 2);
                const u32 offset = (key_dkv + 8 * (j0 + i / 2) + r) * kRowBytes + col * 2;
                const float* k4 = acc_dk[mt] + 4 * j0;
                const float* v4 = acc_dv[mt] + 4 * j0;
                const float sc = p.softmax_scale;
                stmatrix_x4_trans(sdK + offset, pack_f32x2<Is_bf16>(k4[0] * sc, k4[1] * sc),
                                  pack_f32x2<Is_bf16>(k4[2] * sc, k4[3] * sc),
                                  pack_f32x2<Is_bf16>(k4[4] * sc, k4[5] * sc),
                                  pack_f32x2<Is_bf16>(k4[6] * sc, k4[7] * sc));
                stmatrix_x4_trans(sdV + offset, pack_f32x2<Is_bf16>(v4[0], v4[1]), pack_f32x2<Is_bf16>(v4[2], v4[3]),
                                  pack_f32x2<Is_bf16>(v4[4], v4[5]), pack_f32x2<Is_bf16>(v4[6], v4[7]));
            }
    }
    named_bar_sync(T::kBarDS, T::kConsumers);
    store_staged_dk_dv<kRowBytes>(p, b, tid, [](int, int u) { return u << 4; });
}

template <int kHeadDim, int kBlockM, int kBlockN, int kStages, bool Is_causal, bool Is_local, bool Is_bf16,
          bool Is_deterministic, bool Has_score_mod>
__global__ void __launch_bounds__(Sm90BwdTraits<kHeadDim, kBlockM, kBlockN, kStages>::kThreads, 1)
flash_bwd_sm90_kernel(const __grid_constant__ Sm90BwdArgs args) {
    using T = Sm90BwdTraits<kHeadDim, kBlockM, kBlockN, kStages>;
    static_assert(T::dq_columns_once(), "the dQ slices cover the head dim, each column once");
    const BwdParams& p = args.p;
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const u32 smem = (smem_u32(smem_raw) + 1023) & ~1023u;
    const int tid = threadIdx.x;
    if (tid == 0) {
        const u32 bar = smem + T::kOffBar;
        mbar_init(bar, 1);  // K, V full
        for (int s = 0; s < kStages; ++s) {
            mbar_init(bar + 8 * (T::kMbarQFull + s), 1 + T::kStageLoaders);
            mbar_init(bar + 8 * (T::kMbarQEmpty + s), T::kDQSecondInQ ? 1 : T::kConsumers);  // the consumers, or warp 3
        }
        for (int s = 0; s < (T::kKeysOnN ? T::kStagesDO : 0); ++s) {
            mbar_init(bar + 8 * (T::kMbarDOFull + s), 1);
            mbar_init(bar + 8 * (T::kMbarDOEmpty + s), T::kConsumers);
        }
        mbar_fence_init();
    }
    __syncthreads();

    // Block (key block, head, batch) in sections of section_heads (head, batch) pairs whose Q, dO
    // and dQ fit in L2 together (grid.cuh): under a causal mask a pair's first key blocks see the
    // most queries, and every pair of a section starts its heaviest blocks before the light ones
    // fill the tail; one pair per section (no mask) keeps a head's key blocks adjacent. The last
    // key block first where the deterministic mode adds a q block's tiles from its last key block
    // down (bwd_producer).
    constexpr bool kLastKeysFirst = Is_deterministic && (Is_causal || Is_local);
    const int num_n_blocks = (p.max_seqlen_k + T::kBlockN - 1) / T::kBlockN;
    int n_index, hb;
    section_coords(blockIdx.x, num_n_blocks, p.nheads * p.batch, args.section_heads, n_index, hb);
    const int n_block = kLastKeysFirst ? num_n_blocks - 1 - n_index : n_index;
    const int head = hb % p.nheads, batch = hb / p.nheads;
    const SeqLens seq(p.cu_seqlens_q, p.cu_seqlens_k, batch, p.max_seqlen_q, p.max_seqlen_k);
    const int key0 = n_block * kBlockN;
    if (key0 >= seq.seqlen_k) return;  // varlen: past this sequence's end
    const int band_offset = p.align_bottom_right ? seq.seqlen_k - seq.seqlen_q : 0;
    const Mask<Is_causal, Is_local, kBlockM, kBlockN> mask{seq.seqlen_q, seq.seqlen_k, band_offset, p.window_left,
                                                           p.window_right};
    const ScoreMod mod(p.softmax_scale, p.softcap, p.alibi_slopes, p.alibi_batch_stride, batch, head, band_offset);
    const int m_block_min = mask.row_begin(key0) / kBlockM;
    const Sm90BwdBlock<T, Is_causal, Is_local> b{
        smem_raw + (smem - smem_u32(smem_raw)), smem, seq, mask, n_block, head, batch, key0, m_block_min,
        max(0, (mask.row_end(key0) + kBlockM - 1) / kBlockM - m_block_min), p.cu_seqlens_q ? 0 : batch};

    if (tid < 128) {
        bwd_producer<T, Is_causal, Is_local, Is_deterministic>(args, b, tid, kLastKeysFirst);
        return;
    }
    regs_claim<T::kConsumerRegs>();
    if constexpr (T::kKeysOnN)
        bwd_consumer_keys_on_n<T, Is_causal, Is_local, Is_bf16, Has_score_mod>(p, b, mod, tid);
    else
        bwd_consumer_keys_on_m<T, Is_causal, Is_local, Is_bf16, Has_score_mod>(p, b, mod, tid);
}
