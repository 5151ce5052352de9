// FlashAttention forward for Hopper (sm_90a): TMA loads into a multi-stage shared-memory pipeline,
// wgmma on the tensor cores, and warp specialization (FlashAttention-3, sections 3.1-3.2).
//
// A persistent grid (a block per SM) walks the work tiles, q blocks of kBlockM = 128 or 192 rows of
// one (head, batch); a block has 1 + kBlockM / 64 warpgroups:
//   warpgroup 0, producer (24 or 32 registers per thread): one thread issues the TMA loads: for each
//       tile Q_i once (into the older of two Q buffers where shared memory has room for them, when
//       the consumers have released it), then K_j and V_j of every key
//       block the q block sees into the next stage of a ring of kStages, each waiting
//       until the consumers have released that stage's K or V (empty barriers), each completing on
//       its full barrier with its byte count;
//   the others, consumers (240 or 160 registers): 64 rows of the q block each. Over the key blocks
//       (the last, masked one first, as in the sm80 kernel), the next S issued before this P V
//       (FlashAttention-3's intra-warpgroup overlap; ptxas holds the softmax, which writes over S,
//       until P V is done too: docs/PERF_NOTES.md):
//           S = Q_i K_first^T; softmax -> P                    // prologue
//           for each next key block j, previous block j':
//               issue S = Q_i K_j^T                         // wgmma, Q and K in shared memory
//               issue O += P V_j'                           // wgmma, P from registers
//               wait S; release K_j; mask S where j straddles seqlen_k or the band
//               m_new = max(m, rowmax(S)); P = exp2(S c - m_new c); l = l exp2(m - m_new) + rowsum(P)
//               wait P V; release V_j'; O = O exp2(m - m_new)  // d > 128: before the next P V instead
//           release Q (the producer loads the next tile's); O += P V_last
//           O /= l, LSE = m softmax_scale + ln(l) (a sink joins l); O (through shared memory and
//           TMA stores where it can be staged) and LSE to memory.
//       With kPingPong the consumers issue each loop iteration's two GEMMs in turn (named
//       barriers), so one warpgroup's softmax runs under the others' GEMMs (FlashAttention-3, 3.1).
// The wgmma accumulators of a warp hold its 16 rows in the mma.sync m16n8 layout (sm90.cuh), so
// the online softmax, the mask and the score mods are softmax.cuh's, mask.cuh's and score_mod.cuh's,
// with fragment.cuh's MmaAccCoords placing the scores, shared with the sm80 kernels.
//
// Shared memory holds each tile as head-dim chunks of 64 columns (128 bytes a row; at d = 96 half
// of the second chunk is used), the 128-byte swizzle TMA writes and the wgmma descriptors read: the
// Q buffers, then kStages K tiles, then kStages V tiles, then O's tile where it fits, then the
// mbarriers.
#include "sm90.cuh"
#include "softmax.cuh"
#include "mask.cuh"
#include "fragment.cuh"
#include "warp_mma.cuh"
#include "seqlens.cuh"
#include "score_mod.cuh"
#include "params.cuh"
#include "grid.cuh"

template <int kHeadDim_, int kBlockM_, int kBlockN_, int kStages_>
struct Sm90FwdTraits {
    static constexpr int kHeadDim = kHeadDim_, kBlockM = kBlockM_, kBlockN = kBlockN_, kStages = kStages_;
    static constexpr int kConsumerWGs = kBlockM / 64;  // consumer warpgroups, 64 rows each
    static constexpr int kThreads = 128 * (1 + kConsumerWGs);
    static constexpr int kConsumers = 128 * kConsumerWGs;
    // Registers per thread after setmaxnreg: the producer gives up what the consumers take
    // (64K registers per SM among kThreads threads).
    static constexpr int kProducerRegs = kConsumerWGs == 2 ? 24 : 32;
    static constexpr int kConsumerRegs = kConsumerWGs == 2 ? 240 : 160;
    // setmaxnreg moves registers within the block's allocation (65536 / kThreads at launch, in 8s):
    // what the producer gives up must cover what the consumers take, or they wait forever.
    static constexpr int kLaunchRegs = 65536 / kThreads / 8 * 8;
    static_assert((kLaunchRegs - kProducerRegs) * 128 >= (kConsumerRegs - kLaunchRegs) * kConsumers,
                  "register reallocation: the consumers would wait for registers the producer does not free");

    static constexpr int kChunk = 64;              // head-dim columns per 128-byte swizzle atom
    // Whole chunks: at d = 96 the second is half used (TMA fills its columns past the head dim with
    // zeros, which no wgmma reads, and its stores drop them)
    static constexpr int kChunks = (kHeadDim + kChunk - 1) / kChunk;
    static constexpr int kTileCols = kChunks * kChunk;
    static constexpr int kQBytes = kBlockM * kTileCols * 2;
    static constexpr int kKVBytes = kBlockN * kTileCols * 2;  // one K or V tile
    // Two Q buffers where shared memory allows: the next tile's Q loads while this one computes
    // (one buffer would leave that load, from DRAM, between the two tiles).
    static constexpr int kMaxSmem = 227 * 1024;
    static constexpr int kQSlots = 2 * kQBytes + 2 * kStages * kKVBytes + 2048 <= kMaxSmem ? 2 : 1;
    static constexpr int kOffK = kQSlots * kQBytes;
    static constexpr int kOffV = kOffK + kStages * kKVBytes;
    // O's tile through shared memory and out by TMA stores (the consumers hand it over in a few
    // stmatrix and go on): in a buffer of its own where it fits beside the rest (d = 64, 128), else
    // in the one Q buffer (d = 192, 256), free once the tile's last S = Q K^T is done; the next Q
    // loads when the stores have read it. Else each thread stores its fragments.
    static constexpr int kOBytes = kBlockM * kTileCols * 2;
    static constexpr bool kOOwnBuffer = kOffV + kStages * kKVBytes + kOBytes + 2048 <= kMaxSmem;
    static constexpr bool kOInQ = !kOOwnBuffer && kQSlots == 1;  // where the kernel asks for it (below)
    static constexpr int kOffO = kOffV + kStages * kKVBytes;
    static constexpr int kOffBar = kOffO + (kOOwnBuffer ? kOBytes : 0);
    // per stage K full, V full, K empty, V empty; per Q slot full, empty; per tile slot full, empty
    static constexpr int kTileSlots = 2;  // the producer announces the consumers' next tiles through these
    static constexpr int kBarriers = 4 * kStages + 2 * kQSlots + 2 * kTileSlots;
    static constexpr int kOffTileSlots = kOffBar + kBarriers * 8;
    // + 1024: the dynamic shared memory base is aligned up to the swizzle atom's 1024 bytes.
    static constexpr int kSmemBytes = kOffTileSlots + kTileSlots * 4 + 1024;
    static_assert(kHeadDim % 32 == 0 && kHeadDim <= 256, "head dim: whole 64-column chunks, or half of the last");
    static_assert(kBlockM == 128 || kBlockM == 192, "two or three consumer warpgroups");
    static_assert(kBlockN % 16 == 0 && kBlockN <= 256, "key block: a wgmma N");
    static_assert(kQBytes % 1024 == 0 && kKVBytes % 1024 == 0, "tiles on swizzle-atom boundaries");
};

// The kernel's one parameter: the parameter struct, the tile order's section width, and the tensor
// maps of q, k, v and out, each a 4-D (headdim, seqlen, heads, batch) view with the caller's
// strides (flashcupy/sm90_fwd.py).
struct Sm90FwdArgs {
    FwdParams p;
    int section_heads;  // (head, batch) pairs whose q blocks interleave in the tile order
    int pad_;
    // null: block b takes tiles b, b + gridDim.x, ...; else {next, finished}, two zeros at launch,
    // from which blocks take their next tile as they free up (and which the last block zeroes)
    int* tile_counter;
    TmaDesc q, k, v, o;
};
// section_heads follows FwdParams directly (its size is a multiple of its 8-byte alignment).
static_assert(sizeof(FwdParams) + 16 <= 256 && sizeof(Sm90FwdArgs) == 256 + 4 * 128,
              "flashcupy/sm90_fwd.py lays section_heads, tile_counter after FwdParams, the tensor maps at 256, 384, 512, 640");

// How a main-loop step masks its scores: not at all, always, or where its key block needs it.
enum StepMask { kUnmasked, kMasked, kMaskedAtEdges };

template <int kHeadDim, int kBlockM, int kBlockN, int kStages, bool kPingPong, bool kAdvanceDescs, bool Is_causal,
          bool Is_local, bool Is_bf16, bool Has_score_mod, bool kStageOInQ>
__global__ void __launch_bounds__(128 * (1 + kBlockM / 64), 1)
flash_fwd_sm90_kernel(const __grid_constant__ Sm90FwdArgs args) {
    using T = Sm90FwdTraits<kHeadDim, kBlockM, kBlockN, kStages>;
    // Large head dims rescale O under the next S = Q K^T rather than after P V (its 128 multiplies
    // per thread at d = 256 otherwise sit between P V's end and the next GEMMs); so does d = 64
    // without a band (2-4% faster there; level at d = 64 causal, 2-4% slower at d = 128 causal,
    // level at d = 128 without a mask: docs/PERF_NOTES.md).
    constexpr bool kRescaleUnderS = kHeadDim > 128 || (kHeadDim == 64 && !Is_causal && !Is_local);
    // Causal d = 128 runs the main loop's masked and unmasked steps as two copies of the step
    // (3% faster at 8k-16k on an H200; level at d = 256, 1-3% slower at d = 64 and under a
    // window at d = 128: docs/PERF_NOTES.md).
    constexpr bool kMaskedStepsApart = kHeadDim == 128 && Is_causal;
    // O in the Q buffer where the tile has no room for its own and the caller asks for it
    // (flashcupy/sm90_fwd.py: always without a band; for short rows under a band)
    static_assert(!kStageOInQ || T::kOInQ, "O staged in the Q buffer: only where the traits have no room for its own");
    constexpr bool kOInQ = kStageOInQ, kStoreO = T::kOOwnBuffer || kOInQ;
    const FwdParams& p = args.p;
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const u32 smem = (smem_u32(smem_raw) + 1023) & ~1023u;
    const u32 sQ = smem, sK = smem + T::kOffK, sV = smem + T::kOffV, sO = smem + T::kOffO, sBar = smem + T::kOffBar;
    auto k_full = [&](int s) { return sBar + 8 * s; };
    auto v_full = [&](int s) { return sBar + 8 * (kStages + s); };
    auto k_empty = [&](int s) { return sBar + 8 * (2 * kStages + s); };
    auto v_empty = [&](int s) { return sBar + 8 * (3 * kStages + s); };
    auto q_full = [&](int s) { return sBar + 8 * (4 * kStages + s); };
    auto q_empty = [&](int s) { return sBar + 8 * (4 * kStages + T::kQSlots + s); };
    auto tile_full = [&](int s) { return sBar + 8 * (4 * kStages + 2 * T::kQSlots + s); };
    auto tile_empty = [&](int s) { return sBar + 8 * (4 * kStages + 2 * T::kQSlots + T::kTileSlots + s); };

    const int tid = threadIdx.x, warpgroup = tid / 128, lane = tid & 31;
    volatile int* tile_slot = reinterpret_cast<int*>(smem_raw + (smem - smem_u32(smem_raw)) + T::kOffTileSlots);
    if (tid == 0) {
        for (int s = 0; s < T::kQSlots; ++s) {
            mbar_init(q_full(s), 1);
            mbar_init(q_empty(s), T::kConsumers);
        }
        for (int s = 0; s < kStages; ++s) {
            mbar_init(k_full(s), 1);
            mbar_init(v_full(s), 1);
            mbar_init(k_empty(s), T::kConsumers);
            mbar_init(v_empty(s), T::kConsumers);
        }
        for (int s = 0; s < T::kTileSlots; ++s) {
            mbar_init(tile_full(s), 1);
            mbar_init(tile_empty(s), T::kConsumers);
        }
        mbar_fence_init();
    }
    __syncthreads();

    // Persistent grid: a block walks work tiles (indices into tile_at's order, num_m_blocks x heads
    // x batch): its first is blockIdx.x, the next blockIdx.x + gridDim.x, ... or, with a tile
    // counter, the next one not yet taken. The producer picks each tile and announces it to the
    // consumers through a ring of tile slots (an index >= num_tiles: no more); the K/V stages and
    // the Q buffers carry their phases from one tile to the next, so the next tile's loads start
    // while this one computes.
    const int num_m_blocks = (p.max_seqlen_q + kBlockM - 1) / kBlockM;
    const int num_tiles = num_m_blocks * p.nheads * p.batch;
    struct Tile {
        int m_block, head, batch, row0, n_block_min, n_block_max;
        SeqLens seq;
        Mask<Is_causal, Is_local, kBlockM, kBlockN> mask;
        int band_offset;
    };
    auto tile_at = [&](int index) {
        // Sections of section_heads (head, batch) pairs, whose K and V fit in L2 together, one
        // after the other; inside a section the q blocks go row by row across its pairs, the
        // bottom row first for causal and local (their heaviest blocks: longest work first). One
        // pair per section (unmasked problems) walks a head's q blocks in order.
        int m_in, hb;
        section_coords(index, num_m_blocks, p.nheads * p.batch, args.section_heads, m_in, hb);
        const int m_block = (Is_causal || Is_local) ? num_m_blocks - 1 - m_in : m_in;
        const int head = hb % p.nheads, batch = hb / p.nheads;
        const SeqLens seq(p.cu_seqlens_q, p.cu_seqlens_k, batch, p.max_seqlen_q, p.max_seqlen_k);
        const int band_offset = p.align_bottom_right ? seq.seqlen_k - seq.seqlen_q : 0;
        const Mask<Is_causal, Is_local, kBlockM, kBlockN> mask{seq.seqlen_q, seq.seqlen_k, band_offset, p.window_left,
                                                              p.window_right};
        const int row0 = m_block * kBlockM;
        const int n_block_min = Is_local ? mask.key_begin(row0) / kBlockN : 0;
        const int n_block_max = (mask.key_end(row0) + kBlockN - 1) / kBlockN;  // <= n_block_min: no key
        return Tile{m_block, head, batch, row0, n_block_min, n_block_max, seq, mask, band_offset};
    };
    // Tensor-map coordinates: a packed varlen tensor is one batch entry of all sequences' rows; the
    // rows a box takes past a sequence belong to the next one (or read as zeros at the end) and are
    // masked (keys) or never stored (queries).
    auto tma_batch = [&](int batch) { return p.cu_seqlens_q ? 0 : batch; };

    if (warpgroup == 0) {  // ---- producer ----
        regs_release<T::kProducerRegs>();
        // The first ping-pong turn to consumer 0 (an arrival from the consumers' own code, which
        // ptxas sees as divergent, would make it serialize their wgmma).
        if (kPingPong) named_bar_arrive(1, 256);
        if (tid == 0) {
            tma_prefetch_desc(&args.q);
            tma_prefetch_desc(&args.k);
            tma_prefetch_desc(&args.v);
            int q_iter = 0, kv_iter = 0;
            for (int index = blockIdx.x, slot_iter = 0;; ++slot_iter) {
                if (slot_iter > 0)
                    index = args.tile_counter ? atomicAdd(args.tile_counter, 1) + int(gridDim.x) : index + int(gridDim.x);
                const int slot = slot_iter % T::kTileSlots;
                mbar_wait(tile_empty(slot), ((slot_iter / T::kTileSlots) & 1) ^ 1);
                tile_slot[slot] = index;
                mbar_arrive(tile_full(slot));
                if (index >= num_tiles) break;
                const Tile w = tile_at(index);
                if (w.row0 >= w.seq.seqlen_q || w.n_block_max <= w.n_block_min) continue;
                const int kv_head = w.head / p.heads_per_kv_head, k_row0 = w.seq.k_start;
                // a new barrier's "previous phase" has completed: the first waits pass
                const int qs = q_iter % T::kQSlots;
                mbar_wait(q_empty(qs), ((q_iter / T::kQSlots) & 1) ^ 1);
                mbar_arrive_expect_tx(q_full(qs), T::kQBytes);
#pragma unroll
                for (int c = 0; c < T::kChunks; ++c)
                    tma_load_4d(sQ + qs * T::kQBytes + c * kBlockM * 128, &args.q, q_full(qs), c * T::kChunk,
                                w.seq.q_start + w.row0, w.head, tma_batch(w.batch));
                ++q_iter;
                for (int n_block = w.n_block_max - 1; n_block >= w.n_block_min; --n_block, ++kv_iter) {
                    const int s = kv_iter % kStages;
                    const u32 parity = ((kv_iter / kStages) & 1) ^ 1;
                    mbar_wait(k_empty(s), parity);
                    mbar_arrive_expect_tx(k_full(s), T::kKVBytes);
#pragma unroll
                    for (int c = 0; c < T::kChunks; ++c)
                        tma_load_4d(sK + s * T::kKVBytes + c * kBlockN * 128, &args.k, k_full(s), c * T::kChunk,
                                    k_row0 + n_block * kBlockN, kv_head, tma_batch(w.batch));
                    mbar_wait(v_empty(s), parity);
                    mbar_arrive_expect_tx(v_full(s), T::kKVBytes);
#pragma unroll
                    for (int c = 0; c < T::kChunks; ++c)
                        tma_load_4d(sV + s * T::kKVBytes + c * kBlockN * 128, &args.v, v_full(s), c * T::kChunk,
                                    k_row0 + n_block * kBlockN, kv_head, tma_batch(w.batch));
                }
            }
            // The last block to finish zeroes the counter for the next launch.
            if (args.tile_counter && atomicAdd(args.tile_counter + 1, 1) == int(gridDim.x) - 1) {
                atomicExch(args.tile_counter, 0);
                atomicExch(args.tile_counter + 1, 0);
            }
        }
        return;
    }

    // ---- consumers ----
    regs_claim<T::kConsumerRegs>();
    // rows 64 consumer .. of the q block, taken warp-uniform so that the wgmma descriptors live in
    // uniform registers: no R2UR in the main loop (docs/PERF_NOTES.md)
    const int consumer = warpgroup_index() - 1;
    // Ping-pong: the consumers issue their main-loop GEMMs in turn (consumer 0, 1, .., 0, ..), each
    // waiting on its own named barrier (1 + consumer) for the previous one's arrival, so that one
    // warpgroup's softmax runs while the tensor cores work through the others' GEMMs. Consumer 0
    // holds the first turn (the producer warpgroup's arrival). Every consumer takes the same number
    // of turns per tile.
    const int turn_bar = 1 + consumer, next_turn_bar = 1 + (consumer + 1) % T::kConsumerWGs;
    const int warp_row0 = 64 * consumer + 16 * ((tid / 32) % 4);  // this warp's first row in the block
    const int g = lane >> 2, t = lane & 3;
    // Descriptors: K-major Q (this warpgroup's 64 rows) and K, 8-row groups 1024 bytes apart, k
    // steps of 16 columns 32 bytes apart inside a chunk; V N-major, chunks kBlockN * 128 bytes apart
    // along the head dim, 16 keys 2048 bytes apart.
    int q_iter = 0, kv_iter = 0;
    for (int slot_iter = 0;; ++slot_iter) {
        const int slot = slot_iter % T::kTileSlots;
        mbar_wait(tile_full(slot), (slot_iter / T::kTileSlots) & 1);
        const int index = tile_slot[slot];
        mbar_arrive(tile_empty(slot));
        if (index >= num_tiles) break;
        const Tile w = tile_at(index);
        if (w.row0 >= w.seq.seqlen_q) continue;  // varlen: past this sequence's end
        const int row0 = w.row0, n_block_max = w.n_block_max;
        float acc_o[1][kHeadDim / 8][4];
#pragma unroll
        for (int dt = 0; dt < kHeadDim / 8; ++dt)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc_o[0][dt][e] = 0.f;
        float(&o_flat)[kHeadDim / 2] = reinterpret_cast<float(&)[kHeadDim / 2]>(acc_o);
        OnlineSoftmax<1> softmax;
        const ScoreMod mod(p.softmax_scale, p.softcap, p.alibi_slopes, p.alibi_batch_stride, w.batch, w.head,
                           w.band_offset);
        // With score mods S is in natural units before the softmax (score_mod.cuh).
        const float score_log2 = Has_score_mod ? 1.4426950408889634f : p.scale_log2;

        const int n_count = w.n_block_max - w.n_block_min;
        // O through shared memory (below); a packed varlen tensor's rows past this sequence are the
        // next one's, which a box would overwrite, so varlen stores fragments; so does a tile without
        // keys where O's buffer is Q's (the producer loaded no Q for it: the buffer may be filling)
        const bool o_staged = kStoreO && !p.cu_seqlens_q && (T::kOOwnBuffer || n_count > 0);
        if (n_count > 0) {
            const int qs = q_iter % T::kQSlots;
            const u32 sQ_wg = sQ + qs * T::kQBytes + consumer * 64 * 128;
            // With kAdvanceDescs each wgmma's descriptor is its tile's advanced by the constant
            // offset (fewer instructions; measured faster at d = 128 only), else built from its address.
            auto desc = [&](u32 tile, u32 offset, u32 leading) {
                return kAdvanceDescs ? gmma_desc_advance(gmma_desc(tile, leading, 1024), offset)
                                     : gmma_desc(tile + offset, leading, 1024);
            };
            auto issue_s = [&](float (&s_flat)[kBlockN / 2], int stage) {  // S = Q_i K_j^T
                const u32 sK_s = sK + stage * T::kKVBytes;
#pragma unroll
                for (int ks = 0; ks < kHeadDim / 16; ++ks) {
                    const u32 chunk = ks / 4, col_bytes = (ks % 4) * 32;
                    Wgmma<kBlockN, Is_bf16>::ss(s_flat, desc(sQ_wg, chunk * kBlockM * 128 + col_bytes, 16),
                                                desc(sK_s, chunk * kBlockN * 128 + col_bytes, 16), ks > 0);
                }
                wgmma_commit();
            };
            auto issue_pv = [&](const u32 (&a_p)[kBlockN / 16][4], int stage) {  // O += P V_j
                const u32 sV_s = sV + stage * T::kKVBytes;
#pragma unroll
                for (int kk = 0; kk < kBlockN / 16; ++kk)
                    Wgmma<kHeadDim, Is_bf16>::rs(o_flat, a_p[kk], desc(sV_s, kk * 2048, kBlockN * 128));
                wgmma_commit();
            };
            auto stage_of = [&](int it) { return (kv_iter + it) % kStages; };
            auto parity_of = [&](int it) { return u32((kv_iter + it) / kStages) & 1; };

            float acc_s[1][kBlockN / 8][4];
            float(&s_flat)[kBlockN / 2] = reinterpret_cast<float(&)[kBlockN / 2]>(acc_s);
            u32 a_p[kBlockN / 16][4];
            float alpha[2];
            mbar_wait(q_full(qs), (q_iter / T::kQSlots) & 1);
            mbar_wait(k_full(stage_of(0)), parity_of(0));
            wgmma_fence();
            issue_s(s_flat, stage_of(0));
            wgmma_wait<0>();
            fence_regs(s_flat);
            mbar_arrive(k_empty(stage_of(0)));
            {
                const MmaAccCoords coords(row0 + warp_row0, (n_block_max - 1) * kBlockN, lane);
                if (Has_score_mod) apply_score_mod(mod, acc_s, coords);
                if (w.mask.tile_needs_mask(row0, n_block_max - 1)) w.mask.apply(acc_s, coords);
            }
            softmax.probs(acc_s, score_log2, alpha);  // O is still 0: nothing to rescale
#pragma unroll
            for (int kk = 0; kk < kBlockN / 16; ++kk)
                acc_to_a_frag<Is_bf16>(acc_s[0][2 * kk], acc_s[0][2 * kk + 1], a_p[kk]);

            // One main-loop step. Its mask: none, always, or where a band's edge or seqlen_k crosses
            // its key block; without a band only the prologue's block can. A test in the step splits
            // the softmax's basic block (ptxas then waits for P V at its top): without a band there is
            // none, and causal d = 128 runs its masked steps in a copy of their own.
            auto step = [&](int it, StepMask step_mask) {
                const int n_block = n_block_max - 1 - it;
                fence_regs(s_flat);
                fence_regs(o_flat);
                mbar_wait(k_full(stage_of(it)), parity_of(it));
                if (kPingPong) named_bar_sync(turn_bar, 256);
                wgmma_fence();
                issue_s(s_flat, stage_of(it));
                if (kRescaleUnderS) {  // O's rescale by the last softmax while S is computed
                    fence_regs(o_flat);
                    softmax.rescale(acc_o, alpha);
                    fence_regs(o_flat);
                    wgmma_fence();
                }
                mbar_wait(v_full(stage_of(it - 1)), parity_of(it - 1));
                issue_pv(a_p, stage_of(it - 1));
                if (kPingPong) named_bar_arrive(next_turn_bar, 256);
                wgmma_wait<1>();  // S done; P V may still run
                fence_regs(s_flat);
                mbar_arrive(k_empty(stage_of(it)));
                const MmaAccCoords coords(row0 + warp_row0, n_block * kBlockN, lane);  // a warp's 16 rows, as mma.sync
                if (Has_score_mod) apply_score_mod(mod, acc_s, coords);
                if (step_mask == kMasked ||
                    (step_mask == kMaskedAtEdges && (Is_causal || Is_local) && w.mask.tile_needs_mask(row0, n_block)))
                    w.mask.apply(acc_s, coords);
                softmax.probs(acc_s, score_log2, alpha);
                wgmma_wait<0>();
                fence_regs(o_flat);
                mbar_arrive(v_empty(stage_of(it - 1)));
                if (!kRescaleUnderS) softmax.rescale(acc_o, alpha);
#pragma unroll
                for (int kk = 0; kk < kBlockN / 16; ++kk)
                    acc_to_a_frag<Is_bf16>(acc_s[0][2 * kk], acc_s[0][2 * kk + 1], a_p[kk]);
            };
            if (kMaskedStepsApart) {
                // the key blocks the diagonal or seqlen_k crosses are the first steps' (from the last block down)
                int it = 1;
                for (; it < n_count && w.mask.tile_needs_mask(row0, n_block_max - 1 - it); ++it) step(it, kMasked);
                for (; it < n_count; ++it) step(it, kUnmasked);
            } else {
                for (int it = 1; it < n_count; ++it) step(it, kMaskedAtEdges);
            }
            // every S of this tile is done: the producer may load the next Q (where O's stores do not read the buffer)
            if (!kOInQ || !o_staged) mbar_arrive(q_empty(qs));
            mbar_wait(v_full(stage_of(n_count - 1)), parity_of(n_count - 1));
            fence_regs(o_flat);
            if (kRescaleUnderS && n_count > 1) softmax.rescale(acc_o, alpha);
            fence_regs(o_flat);
            wgmma_fence();
            issue_pv(a_p, stage_of(n_count - 1));
            wgmma_wait<0>();
            fence_regs(o_flat);
            mbar_arrive(v_empty(stage_of(n_count - 1)));
            kv_iter += n_count;
            ++q_iter;
        }

        float row_lse[2];
        softmax.finalize(acc_o, Has_score_mod ? 1.f : p.softmax_scale, p.sinks ? p.sinks[w.head] : -FC_INF, row_lse);
        float* gLse = p.lse + w.batch * p.lse_batch_stride + w.head * p.lse_head_stride + w.seq.q_start;
        if (o_staged) {
            // This warpgroup's 64 rows into its part of sO (each chunk's rows of the block, 128
            // swizzled bytes a row, as TMA reads them) by stmatrix: per 16 columns four 8 x 8
            // matrices, rows 0-7 and 8-15 of the warp, columns +0 and +8. Thread 0 of the warpgroup
            // then stores the chunks; its next tile's first waits until they have been read (in Q's
            // buffer, it waits at once and then releases the buffer).
            const u32 sO_wg = (T::kOOwnBuffer ? sO : sQ) + consumer * 64 * 128;
            const int store_bar = 1 + T::kConsumerWGs + consumer;  // after the ping-pong ids
            const bool issuer = tid % 128 == 0;
            if (issuer) bulk_wait_read<0>();
            named_bar_sync(store_bar, 128);
            const int matrix = lane >> 3, row = 16 * ((tid / 32) % 4) + (lane & 7) + 8 * (matrix & 1);
#pragma unroll
            for (int j = 0; j < kHeadDim / 16; ++j) {
                const int unit = (2 * j + (matrix >> 1)) % 8;  // 16-byte column unit in the chunk
                stmatrix_x4(sO_wg + (j / 4) * kBlockM * 128 + row * 128 + ((unit ^ (row & 7)) << 4),
                            pack_f32x2<Is_bf16>(acc_o[0][2 * j][0], acc_o[0][2 * j][1]),
                            pack_f32x2<Is_bf16>(acc_o[0][2 * j][2], acc_o[0][2 * j][3]),
                            pack_f32x2<Is_bf16>(acc_o[0][2 * j + 1][0], acc_o[0][2 * j + 1][1]),
                            pack_f32x2<Is_bf16>(acc_o[0][2 * j + 1][2], acc_o[0][2 * j + 1][3]));
            }
            fence_proxy_async_shared();
            named_bar_sync(store_bar, 128);
            if (issuer) {
#pragma unroll
                for (int c = 0; c < T::kChunks; ++c)
                    tma_store_4d(&args.o, sO_wg + c * kBlockM * 128, c * T::kChunk, row0 + 64 * consumer, w.head, w.batch);
                bulk_commit();
                if (kOInQ) bulk_wait_read<0>();
            }
            if (kOInQ) mbar_arrive(q_empty((q_iter - 1) % T::kQSlots));  // this tile's, loaded (n_count > 0)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int r = row0 + warp_row0 + g + 8 * h;
                if (t == 0 && r < w.seq.seqlen_q) gLse[r] = row_lse[h];
            }
            continue;
        }
        u16* gO = p.out + w.batch * p.o_batch_stride + w.head * p.o_head_stride + i64(w.seq.q_start) * p.o_row_stride;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = row0 + warp_row0 + g + 8 * h;
            if (row < w.seq.seqlen_q) {
                u16* gO_row = gO + i64(row) * p.o_row_stride + 2 * t;
#pragma unroll
                for (int dt = 0; dt < kHeadDim / 8; ++dt)
                    *reinterpret_cast<u32*>(gO_row + 8 * dt) =
                        pack_f32x2<Is_bf16>(acc_o[0][dt][2 * h], acc_o[0][dt][2 * h + 1]);
                if (t == 0) gLse[row] = row_lse[h];
            }
        }
    }
    if (kStoreO && tid % 128 == 0) bulk_wait<0>();  // O's last stores done before the block ends
}
