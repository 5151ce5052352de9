// Attention over a KV cache (flashcupy/kvcache.py): the new keys appended in place (rotary applied),
// then split-KV flash decoding, then the splits merged by their LSEs. sm80 instructions; runs on
// sm80+. The spec is flashcupy/decode_ref.py.
//
// kvcache_append_kernel: new key i of sequence b to cache row cache_seqlens[b] + i (paged: through
//     the block table), rotated at that position when rotary tables are given; v likewise, unrotated.
// rotary_q_kernel: q rotated into a scratch copy (row i at cache_seqlens[b] + i under a causal or
//     band mask, else at cache_seqlens[b]).
// flash_decode_kernel: one thread block per (packed q block, split, kv head group, sequence). The
//     query heads that share a kv head are packed into the block's rows (row r: query row r /
//     pack, head first_head + r % pack), so each K, V byte is read once per block; the block's
//     keys are its split's share of the key blocks the rows see. Per key block as the sm80 forward
//     (fwd.cu): S = Q K^T, mask, online softmax, O += P V; K, V rows found row by row (pages of any
//     size). One split writes O and the LSE; several write float32 partials, each normalized over
//     its own keys (LSE -inf where it saw none).
// flash_decode_combine_kernel: one warp per (sequence, head, query row) merges the partials:
//     lse = log(sum_s exp(lse_s) + exp(sink)), O = sum_s exp(lse_s - lse) O_s.
#include "ptx.cuh"
#include "tile.cuh"
#include "warp_mma.cuh"
#include "fragment.cuh"
#include "softmax.cuh"
#include "mask.cuh"
#include "score_mod.cuh"
#include "params.cuh"

// Cache row `row` (from the sequence's first row) of kv head `kv_head`: contiguous, the batch entry's
// row; paged, row row % page_size of block block_table[row / page_size].
FC_DEVICE i64 cache_row_offset(const DecodeParams& p, int batch, int entry, int kv_head, int row, i64 row_stride,
                               i64 batch_stride, i64 head_stride) {
    if (p.block_table) {
        const int block = p.block_table[batch * p.block_table_batch_stride + row / p.page_size];
        return block * batch_stride + (row % p.page_size) * row_stride + kv_head * head_stride;
    }
    return entry * batch_stride + i64(row) * row_stride + kv_head * head_stride;
}

FC_DEVICE int cache_entry(const DecodeParams& p, int batch) {
    return p.cache_batch_idx ? p.cache_batch_idx[batch] : batch;
}

// One 16-bit element as a float.
template <bool Is_bf16>
FC_DEVICE float element(const u16* x, int i) {
    float lo, unused;
    unpack_f32x2<Is_bf16>(u32(x[i]), lo, unused);
    return lo;
}

// Elements [8 chunk, 8 chunk + 8) of a row, rotated where they lie below rotary_dim (cos, sin: the
// position's rows of the tables, rotary_dim / 2 each; null: a plain copy). A pair's other element
// may lie in another chunk (not interleaved: j and j + rotary_dim / 2), so it is read from src.
template <bool Is_bf16>
FC_DEVICE void copy_chunk_rotated(u16* dst, const u16* src, const u16* cos, const u16* sin, int rotary_dim,
                                  bool interleaved, int chunk) {
    float x[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) x[e] = element<Is_bf16>(src, 8 * chunk + e);
    if (cos && 8 * chunk < rotary_dim) {  // rotary_dim is a multiple of 16: a chunk is in or out
        const int half = rotary_dim / 2;
        float y[8];
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            const int col = 8 * chunk + e;
            // pair (2 j, 2 j + 1) or (j, j + half); the first of a pair gets x c - y s, the second x c + y s
            const int j = interleaved ? col / 2 : (col < half ? col : col - half);
            const bool second = interleaved ? (col & 1) : col >= half;
            const float partner = interleaved ? x[e ^ 1] : element<Is_bf16>(src, second ? col - half : col + half);
            const float c = element<Is_bf16>(cos, j), s = element<Is_bf16>(sin, j);
            y[e] = second ? x[e] * c + partner * s : x[e] * c - partner * s;
        }
#pragma unroll
        for (int e = 0; e < 8; ++e) x[e] = y[e];
    }
    uint4 out;
    out.x = pack_f32x2<Is_bf16>(x[0], x[1]);
    out.y = pack_f32x2<Is_bf16>(x[2], x[3]);
    out.z = pack_f32x2<Is_bf16>(x[4], x[5]);
    out.w = pack_f32x2<Is_bf16>(x[6], x[7]);
    *reinterpret_cast<uint4*>(dst + 8 * chunk) = out;
}

// grid (seqlen_new, nheads_k, batch), kHeadDim / 8 threads: the new k and v rows into the cache.
template <bool Is_bf16>
__global__ void kvcache_append_kernel(const __grid_constant__ DecodeParams p) {
    const int i = blockIdx.x, kv_head = blockIdx.y, batch = blockIdx.z, chunk = threadIdx.x;
    const int row = p.cache_seqlens[batch] + i;  // its cache row, and its rotary position
    const int entry = cache_entry(p, batch);
    const i64 k_dst = cache_row_offset(p, batch, entry, kv_head, row, p.k_row_stride, p.k_batch_stride, p.k_head_stride);
    const i64 v_dst = cache_row_offset(p, batch, entry, kv_head, row, p.v_row_stride, p.v_batch_stride, p.v_head_stride);
    const u16* k_src = p.k_new + batch * p.knew_batch_stride + i64(i) * p.knew_row_stride + kv_head * p.knew_head_stride;
    const u16* v_src = p.v_new + batch * p.vnew_batch_stride + i64(i) * p.vnew_row_stride + kv_head * p.vnew_head_stride;
    const u16* cos = p.rotary_cos ? p.rotary_cos + i64(row) * (p.rotary_dim / 2) : nullptr;
    const u16* sin = p.rotary_sin ? p.rotary_sin + i64(row) * (p.rotary_dim / 2) : nullptr;
    copy_chunk_rotated<Is_bf16>(p.k_cache + k_dst, k_src, cos, sin, p.rotary_dim, p.rotary_interleaved, chunk);
    copy_chunk_rotated<Is_bf16>(p.v_cache + v_dst, v_src, nullptr, nullptr, 0, false, chunk);
}

// grid (seqlen_q, nheads, batch), kHeadDim / 8 threads: q_rotated = q rotated at its position.
template <bool Is_bf16>
__global__ void rotary_q_kernel(const __grid_constant__ DecodeParams p) {
    const int i = blockIdx.x, head = blockIdx.y, batch = blockIdx.z, chunk = threadIdx.x;
    const int position = p.cache_seqlens[batch] + (p.rotary_q_per_row ? i : 0);
    const u16* src = p.q_source + batch * p.qsrc_batch_stride + i64(i) * p.qsrc_row_stride + head * p.qsrc_head_stride;
    u16* dst = p.q_rotated + batch * p.q_batch_stride + i64(i) * p.q_row_stride + head * p.q_head_stride;
    copy_chunk_rotated<Is_bf16>(dst, src, p.rotary_cos + i64(position) * (p.rotary_dim / 2),
                                p.rotary_sin + i64(position) * (p.rotary_dim / 2), p.rotary_dim, p.rotary_interleaved,
                                chunk);
}

template <int kHeadDim_, int kBlockN_>
struct DecodeTraits {
    static constexpr int kHeadDim = kHeadDim_, kBlockM = 64, kBlockN = kBlockN_, kNWarps = 4;
    static constexpr int kThreads = kNWarps * 32, kRowsPerWarp = kBlockM / kNWarps, kMTiles = 1;
    static constexpr int kNTiles = kBlockN / 8, kDTiles = kHeadDim / 8;
    static constexpr int kPitch = SmemTile<kHeadDim>::kPitch, kChunksPerRow = kHeadDim / 8;
    // Q, then kStages x (K, V) of a key block (padded rows: tile.cuh): the next block's K and V
    // load while this one's are used (decoding has little work per byte to hide a load under)
    static constexpr int kStages = 2;
    static constexpr int kQBytes = kBlockM * kPitch * 2, kKVBytes = kBlockN * kPitch * 2;
    static constexpr int kSmemBytes = kQBytes + kStages * 2 * kKVBytes;
    static_assert(kHeadDim % 32 == 0 && kBlockN % 16 == 0, "head dims of 32s, key blocks of 16s");
};

// Rows of a (kRows x kHeadDim) shared-memory tile from global rows found one by one (row_ptr(r):
// the row's first element, or null past the valid rows: zero-filled, reading nothing at `any`),
// 16 bytes per cp.async.
template <int kRows, int kHeadDim, int kThreads, class RowPtr>
FC_DEVICE void gather_tile(u32 s_tile, int tid, const u16* any, const RowPtr& row_ptr) {
    constexpr int kChunks = kHeadDim / 8, kRowsPerPass = kThreads / kChunks;
    static_assert(kThreads % kChunks == 0, "whole rows per pass");
    const int chunk = tid % kChunks;
    for (int r = tid / kChunks; r < kRows; r += kRowsPerPass) {
        const u16* src = row_ptr(r);
        cp_async_16(s_tile + (r * SmemTile<kHeadDim>::kPitch + chunk * 8) * 2, src ? src + chunk * 8 : any,
                    src ? 16 : 0);
    }
}

// Packed rows: the fragment's row r is query row (row0 + r) / pack; the mask and score mods see that.
struct PackedCoords {
    int row0, col_base, g, t, pack;
    FC_DEVICE int row(int mt, int h) const { return (row0 + 16 * mt + g + 8 * h) / pack; }
    FC_DEVICE int col(int nt, int e1) const { return col_base + 8 * nt + 2 * t + e1; }
};

template <int kHeadDim, int kBlockN, bool Is_causal, bool Is_local, bool Is_bf16, bool Has_score_mod>
__global__ void __launch_bounds__(128)
flash_decode_kernel(const __grid_constant__ DecodeParams p) {
    using T = DecodeTraits<kHeadDim, kBlockN>;
    constexpr int kBlockM = T::kBlockM;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    const u32 sQ_base = smem_u32(smem_raw);
    auto sK_stage = [&](int s) { return sQ_base + T::kQBytes + s * 2 * T::kKVBytes; };
    auto sV_stage = [&](int s) { return sK_stage(s) + T::kKVBytes; };
    const int m_block = blockIdx.x / p.num_splits, split = blockIdx.x % p.num_splits;
    const int head0 = blockIdx.y * p.heads_per_block, batch = blockIdx.z, pack = p.heads_per_block;
    const int kv_head = head0 / p.heads_per_kv_head;
    const int seqlen_q = p.max_seqlen_q;
    const int leftpad = p.cache_leftpad ? p.cache_leftpad[batch] : 0;
    const int seqlen_k = p.cache_seqlens[batch] + p.seqlen_new - leftpad;  // keys, the new ones included
    const int rows_total = seqlen_q * pack, row0 = m_block * kBlockM;
    if (row0 >= rows_total) return;
    const int rows_valid = min(kBlockM, rows_total - row0);
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const int entry = cache_entry(p, batch);

    // The keys this block's query rows [q_first, q_last] see, cut into the splits' shares of blocks
    const int band_offset = p.align_bottom_right ? seqlen_k - seqlen_q : 0;
    const Mask<Is_causal, Is_local, kBlockM, kBlockN> mask{seqlen_q, seqlen_k, band_offset, p.window_left, p.window_right};
    const int q_first = row0 / pack, q_last = (row0 + rows_valid - 1) / pack;
    const int key_begin = Is_local ? max(0, mask.row_first_key(q_first)) : 0;
    const int key_end = mask.row_key_limit(q_last);
    const int n_first = key_begin / kBlockN, n_blocks = max(0, (key_end + kBlockN - 1) / kBlockN - n_first);
    const int per = n_blocks / p.num_splits, extra = n_blocks % p.num_splits;
    const int n_block_min = n_first + split * per + min(split, extra);
    const int n_block_max = n_block_min + per + (split < extra);  // empty: this split saw no key

    const ScoreMod mod(p.softmax_scale, p.softcap, p.alibi_slopes, p.alibi_batch_stride, batch, head0, band_offset);
    const float score_log2 = Has_score_mod ? 1.4426950408889634f : p.scale_log2;
    const int warp_row0 = warp * T::kRowsPerWarp;

    float acc_o[1][T::kDTiles][4];
    clear_acc(acc_o);
    OnlineSoftmax<1> softmax;
    auto q_row = [&](int r) -> const u16* {
        if (r >= rows_valid) return nullptr;
        const int q = (row0 + r) / pack, head = head0 + (row0 + r) % pack;
        return p.q + batch * p.q_batch_stride + i64(q) * p.q_row_stride + head * p.q_head_stride;
    };
    // rows key0.. of the K or V cache (cache_row_offset), null past the keys
    auto cache_rows = [&](const u16* cache, i64 row_stride, i64 batch_stride, i64 head_stride, int key0) {
        return [&, cache, row_stride, batch_stride, head_stride, key0](int r) -> const u16* {
            const int key = key0 + r;
            return key < seqlen_k ? cache + cache_row_offset(p, batch, entry, kv_head, leftpad + key, row_stride,
                                                             batch_stride, head_stride)
                                  : nullptr;
        };
    };
    // K and V of key block n into stage s, one cp.async group
    auto load_kv = [&](int n, int s) {
        gather_tile<kBlockN, kHeadDim, T::kThreads>(
            sK_stage(s), tid, p.k, cache_rows(p.k, p.k_row_stride, p.k_batch_stride, p.k_head_stride, n * kBlockN));
        gather_tile<kBlockN, kHeadDim, T::kThreads>(
            sV_stage(s), tid, p.v, cache_rows(p.v, p.v_row_stride, p.v_batch_stride, p.v_head_stride, n * kBlockN));
        cp_async_commit();
    };
    if (n_block_max > n_block_min) {  // Q and the last block; the one before it too
        gather_tile<kBlockM, kHeadDim, T::kThreads>(sQ_base, tid, p.q, q_row);
        load_kv(n_block_max - 1, 0);
        if (n_block_max - 2 >= n_block_min) load_kv(n_block_max - 2, 1);
    }
    const u32 sQ_frag = sQ_base + tile_offset<kHeadDim>(warp_row0, 0) + ldsm_lane_offset_a<kHeadDim>(lane);
    const u32 k_lane = ldsm_lane_offset_b<kHeadDim>(lane), v_lane = ldsm_lane_offset_a<kHeadDim>(lane);

    for (int n_block = n_block_max - 1, s = 0; n_block >= n_block_min; --n_block, s ^= 1) {
        const int key0 = n_block * kBlockN;
        if (n_block - 1 >= n_block_min) cp_async_wait<1>();  // this block's group landed, the next may not
        else cp_async_wait<0>();
        __syncthreads();  // ... for every thread's copies

        float acc_s[1][T::kNTiles][4];
        clear_acc(acc_s);
#pragma unroll
        for (int kd = 0; kd < kHeadDim / 16; ++kd) {
            u32 a[1][4];
            load_a_frags<false, kHeadDim>(a, sQ_frag, 0, 16 * kd);
            warp_mma_k16<Is_bf16, false, kHeadDim>(acc_s, a, sK_stage(s) + k_lane, 0, 16 * kd);
        }
        const PackedCoords coords{row0 + warp_row0, key0, g, t, pack};
        if (Has_score_mod) apply_score_mod(mod, acc_s, coords);
        if (Is_causal || Is_local || key0 + kBlockN > seqlen_k) mask.apply(acc_s, coords);
        softmax.update(acc_s, acc_o, score_log2);
#pragma unroll
        for (int ks = 0; ks < kBlockN / 16; ++ks) {
            u32 pa[1][4];
            acc_to_a_frag<Is_bf16>(acc_s[0][2 * ks], acc_s[0][2 * ks + 1], pa[0]);
            warp_mma_k16<Is_bf16, true, kHeadDim>(acc_o, pa, sV_stage(s) + v_lane, 16 * ks, 0);
        }
        __syncthreads();  // every warp is done with stage s: the block after next may fill it
        if (n_block - 2 >= n_block_min) load_kv(n_block - 2, s);
    }

    // One split: O and the LSE, the sink in the denominator (one head per block with sinks). Several:
    // each split's own normalization and no sink; the combine adds it once.
    const bool partial = p.num_splits > 1;
    float row_lse[2];
    softmax.finalize(acc_o, Has_score_mod ? 1.f : p.softmax_scale, !partial && p.sinks ? p.sinks[head0] : -FC_INF,
                     row_lse);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int r = warp_row0 + g + 8 * h;
        if (r >= rows_valid) continue;
        const int q = (row0 + r) / pack, head = head0 + (row0 + r) % pack;
        if (partial) {
            const i64 at = ((i64(split) * p.batch + batch) * p.nheads + head) * seqlen_q + q;
            float* o = p.out_partial + at * kHeadDim;
#pragma unroll
            for (int dt = 0; dt < T::kDTiles; ++dt)
                *reinterpret_cast<float2*>(o + 8 * dt + 2 * t) = make_float2(acc_o[0][dt][2 * h], acc_o[0][dt][2 * h + 1]);
            if (t == 0) p.lse_partial[at] = row_lse[h];
        } else {
            u16* o = p.out + batch * p.o_batch_stride + i64(q) * p.o_row_stride + head * p.o_head_stride;
#pragma unroll
            for (int dt = 0; dt < T::kDTiles; ++dt)
                *reinterpret_cast<u32*>(o + 8 * dt + 2 * t) = pack_f32x2<Is_bf16>(acc_o[0][dt][2 * h], acc_o[0][dt][2 * h + 1]);
            if (t == 0) p.lse[batch * p.lse_batch_stride + head * p.lse_head_stride + q] = row_lse[h];
        }
    }
}

// grid (ceil(seqlen_q / 4), nheads, batch), 4 warps: warp w merges query row 4 blockIdx.x + w.
template <int kHeadDim, bool Is_bf16>
__global__ void __launch_bounds__(128)
flash_decode_combine_kernel(const __grid_constant__ DecodeParams p) {
    constexpr int kPerLane = kHeadDim / 32;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int q = blockIdx.x * 4 + warp, head = blockIdx.y, batch = blockIdx.z;
    if (q >= p.max_seqlen_q) return;
    const i64 split_stride = i64(p.batch) * p.nheads * p.max_seqlen_q;
    const i64 at = (i64(batch) * p.nheads + head) * p.max_seqlen_q + q;
    const float sink = p.sinks ? p.sinks[head] : -FC_INF;
    float top = sink;
    for (int s = 0; s < p.num_splits; ++s) top = fmaxf(top, p.lse_partial[s * split_stride + at]);
    float o[kPerLane] = {};
    float lse = -FC_INF;
    if (top != -FC_INF) {
        float total = fast_exp2((sink - top) * 1.4426950408889634f);
        for (int s = 0; s < p.num_splits; ++s) total += fast_exp2((p.lse_partial[s * split_stride + at] - top) * 1.4426950408889634f);
        lse = top + fast_log2(total) * 0.6931471805599453f;
        for (int s = 0; s < p.num_splits; ++s) {
            const float w = fast_exp2((p.lse_partial[s * split_stride + at] - lse) * 1.4426950408889634f);
            const float* src = p.out_partial + (s * split_stride + at) * kHeadDim;
#pragma unroll
            for (int e = 0; e < kPerLane; ++e) o[e] += w * src[lane + 32 * e];
        }
    }
    u16* dst = p.out + batch * p.o_batch_stride + i64(q) * p.o_row_stride + head * p.o_head_stride;
#pragma unroll
    for (int e = 0; e < kPerLane; ++e) {
        float lo = o[e], unused = 0.f;
        dst[lane + 32 * e] = u16(pack_f32x2<Is_bf16>(lo, unused) & 0xffffu);
    }
    if (lane == 0) p.lse[batch * p.lse_batch_stride + head * p.lse_head_stride + q] = lse;
}
