// Attention over a KV cache (flashcupy/kvcache.py): the new keys appended in place (rotary applied),
// then split-KV flash decoding, the splits merged by their LSEs. sm80 instructions, runs on sm80+;
// on sm90 the staged loads and the cluster merge (sm90.cuh's cluster wrappers) besides.
// The spec is flashcupy/decode_ref.py.
//
// kvcache_append_kernel: new key i of sequence b to cache row cache_seqlens[b] + i (paged: through
//     the block table), rotated at that position when rotary tables are given; v likewise, unrotated.
// rotary_q_kernel: q rotated into a scratch copy (row i at cache_seqlens[b] + i under a causal or
//     band mask, else at cache_seqlens[b]).
// flash_decode_kernel (few query rows: decoding, speculative tokens): one thread block per (packed
//     q block, split, kv head group, sequence). The query heads that share a kv head are packed
//     into the block's rows (row r: query row r / pack, head first_head + r % pack), so each K, V
//     byte is read once per block. The warps split the keys: per step each warp takes 16 of
//     kBlockN keys (S = Q K^T, mask, online softmax, O += P V over its keys alone, so shared memory
//     is read once per byte), and at the end the warps' (max, sum, O) merge through shared memory.
//     Memory-bound: each warp keeps its next rows in flight, by a kStages-deep cp.async ring
//     (sm80-89) or in registers a step ahead (sm90, StagedRows).
// flash_prefill_kernel (many query rows: chunked prefill): the warps split the rows, 16 each, and
//     every warp reads every key block, as the sm80 forward (fwd.cu).
// Both: K, V rows are found through CacheRows (contiguous, or pages of any size; sm90's staged
//     loads take a warp's 16 rows from one page where the page size allows). A block's
//     keys are its split's share of the key blocks its rows see. One split writes O and the LSE;
//     several write float32 partials, each normalized over its own keys (LSE -inf where it saw
//     none), and the block that finishes a q block's last split merges them (the decode kernel
//     from L2 into registers, merge_splits_in_registers; the prefill kernel's many rows through
//     shared memory, merge_splits):
//     lse = log(sum_s exp(lse_s) + exp(sink)), O = sum_s exp(lse_s - lse) O_s; on sm90, where the
//     GPU holds them all at once, a q block's splits run as one cluster and merge through
//     distributed shared memory instead (flash_decode_cluster_kernel). (A merge kernel
//     of its own measured slower on an H200: its start costs more than the count that finds the
//     last split's block.)
#include "ptx.cuh"
#include "sm90.cuh"
#include "tile.cuh"
#include "warp_mma.cuh"
#include "fragment.cuh"
#include "softmax.cuh"
#include "mask.cuh"
#include "score_mod.cuh"
#include "params.cuh"

FC_DEVICE int cache_entry(const DecodeParams& p, int batch) {
    return p.cache_batch_idx ? p.cache_batch_idx[batch] : batch;
}

// Where the cache rows of one (sequence, kv head) lie. Row `row` counts from the sequence's first
// cache row (cache_leftpad's rows included): contiguous, row `row` of the sequence's cache entry;
// paged, row row % page_size of block block_table[row / page_size], the division by the page size
// as a multiply and a shift (page_div_mul, page_div_shift: kvcache.page_divider).
struct CacheRows {
    u16* k;              // the kv head's first row: of the entry (contiguous) or of block 0 (paged)
    u16* v;
    i64 k_row, v_row;    // row strides
    i64 k_block, v_block;  // paged: block strides
    const int* table;    // the sequence's row of the block table; null: contiguous
    u32 page_size, div_mul, div_shift;

    FC_DEVICE CacheRows(const DecodeParams& p, int batch, int kv_head)
        : k_row(p.k_row_stride), v_row(p.v_row_stride), k_block(p.k_batch_stride), v_block(p.v_batch_stride),
          table(p.block_table ? p.block_table + batch * p.block_table_batch_stride : nullptr),
          page_size(p.page_size), div_mul(u32(p.page_div_mul)), div_shift(p.page_div_shift) {
        const i64 entry = table ? 0 : cache_entry(p, batch);
        k = p.k_cache + entry * p.k_batch_stride + kv_head * p.k_head_stride;
        v = p.v_cache + entry * p.v_batch_stride + kv_head * p.v_head_stride;
    }

    FC_DEVICE u32 page(int row) const { return u32((unsigned long long)(u32(row)) * div_mul >> div_shift); }
    // Paged: the block holding row `row` (a read of the block table).
    FC_DEVICE int block_of(int row) const { return table[page(row)]; }
    // Element offsets of cache row `row` in K and in V; paged, in block `block` (block_of(row)).
    FC_DEVICE void find_in(int row, int block, i64& k_at, i64& v_at) const {
        if (table) {
            const i64 in_page = u32(row) - page(row) * page_size;
            k_at = block * k_block + in_page * k_row;
            v_at = block * v_block + in_page * v_row;
        } else {
            k_at = i64(row) * k_row;
            v_at = i64(row) * v_row;
        }
    }
    FC_DEVICE void find(int row, i64& k_at, i64& v_at) const { find_in(row, table ? block_of(row) : 0, k_at, v_at); }
    // Do the 16 rows of a group (its first row a multiple of 16 past the leftpad, which paged
    // caches do not have) lie in one page, a row stride apart? Then the first row's block finds
    // them all: one table read for 16 rows.
    FC_DEVICE bool groups_of_16_in_one_page() const { return !table || page_size % 16 == 0; }
};

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
    const CacheRows cache(p, batch, kv_head);
    i64 k_at, v_at;
    cache.find(row, k_at, v_at);
    const u16* k_src = p.k_new + batch * p.knew_batch_stride + i64(i) * p.knew_row_stride + kv_head * p.knew_head_stride;
    const u16* v_src = p.v_new + batch * p.vnew_batch_stride + i64(i) * p.vnew_row_stride + kv_head * p.vnew_head_stride;
    const u16* cos = p.rotary_cos ? p.rotary_cos + i64(row) * (p.rotary_dim / 2) : nullptr;
    const u16* sin = p.rotary_sin ? p.rotary_sin + i64(row) * (p.rotary_dim / 2) : nullptr;
    copy_chunk_rotated<Is_bf16>(cache.k + k_at, k_src, cos, sin, p.rotary_dim, p.rotary_interleaved, chunk);
    copy_chunk_rotated<Is_bf16>(cache.v + v_at, v_src, nullptr, nullptr, 0, false, chunk);
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

// The work of one thread block of either attention kernel: packed rows row0 .. row0 + rows_valid - 1
// of (sequence `batch`, query heads head0 ..), and of the key blocks those rows see, the share of
// split `split`. Grid (q blocks x num_splits, kv head groups, batch); a q block's splits are
// adjacent, so they run together and the last of them merges soon after the first.
template <int kBlockM, int kBlockN, bool Is_causal, bool Is_local>
struct DecodeBlock {
    int m_block, split, head0, pack, kv_head, batch, leftpad, q_start, seqlen_q, seqlen_k;
    int rows_total, row0, rows_valid;
    int n_block_min, n_block_max;  // this split's key blocks; empty: it saw no key
    int mask_from, mask_below;     // keys >= mask_from, or (Is_local) < mask_below, are hidden from some row
    Mask<Is_causal, Is_local, kBlockM, kBlockN> mask;

    FC_DEVICE DecodeBlock(const DecodeParams& p, int m_block_, int split_) {
        m_block = m_block_;
        split = split_;
        pack = p.heads_per_block;
        head0 = blockIdx.y * pack;
        kv_head = head0 / p.heads_per_kv_head;
        batch = blockIdx.z;
        // varlen (flash_attn_varlen_func's packed q, out and LSE): the sequence's rows from q_start;
        // its keys are those of a one-entry cache from leftpad = cu_seqlens_k[batch] (kvcache.launch)
        q_start = p.cu_seqlens_q ? p.cu_seqlens_q[batch] : 0;
        seqlen_q = p.cu_seqlens_q ? p.cu_seqlens_q[batch + 1] - q_start : p.max_seqlen_q;
        leftpad = p.cache_leftpad ? p.cache_leftpad[batch] : 0;
        // keys, the new ones included; without lengths (flash_attn_func's k, v) every sequence is full
        seqlen_k = (p.cache_seqlens ? p.cache_seqlens[batch] : p.max_seqlen_k) + p.seqlen_new - leftpad;
        rows_total = min(seqlen_q, p.max_seqlen_q) * pack;  // the grid's and the partials' rows at most
        row0 = m_block * kBlockM;
        rows_valid = max(0, min(kBlockM, rows_total - row0));
        mask.seqlen_q = seqlen_q;
        mask.seqlen_k = seqlen_k;
        mask.offset = p.align_bottom_right ? seqlen_k - seqlen_q : 0;  // the band's diagonal
        mask.left = p.window_left;
        mask.right = p.window_right;
        // the keys query rows [q_first, q_last] see, cut into whole blocks, shared among the splits
        const int q_first = row0 / pack, q_last = (row0 + max(rows_valid, 1) - 1) / pack;
        const int key_begin = Is_local ? max(0, mask.row_first_key(q_first)) : 0;
        const int key_end = mask.row_key_limit(q_last);
        mask_from = mask.row_key_limit(q_first);
        mask_below = Is_local ? mask.row_first_key(q_last) : 0;
        const int n_first = key_begin / kBlockN, n_blocks = max(0, (key_end + kBlockN - 1) / kBlockN - n_first);
        const int per = n_blocks / p.num_splits, extra = n_blocks % p.num_splits;
        n_block_min = n_first + split * per + min(split, extra);
        n_block_max = n_block_min + per + (split < extra);
    }
    FC_DEVICE int query(int r) const { return (row0 + r) / pack; }  // of block row r, in its sequence
    FC_DEVICE i64 q_row(int r) const { return q_start + query(r); }  // in q, out and the LSE
    FC_DEVICE int head(int r) const { return head0 + (row0 + r) % pack; }
    // Does a 16-key group from key0 hold a key hidden from some row (or past the last key)?
    FC_DEVICE bool needs_mask(int key0, int keys) const {
        return key0 + keys > mask_from || (Is_local && key0 < mask_below);
    }
    // The (query, head) slot of block row r in the partials' (batch, nheads, max_seqlen_q).
    FC_DEVICE i64 slot(const DecodeParams& p, int r) const {
        return (i64(batch) * p.nheads + head(r)) * p.max_seqlen_q + query(r);
    }
    FC_DEVICE u16* out_row(const DecodeParams& p, int r) const {
        return p.out + batch * p.o_batch_stride + q_row(r) * p.o_row_stride + head(r) * p.o_head_stride;
    }
    FC_DEVICE float* lse_at(const DecodeParams& p, int r) const {
        return p.lse + batch * p.lse_batch_stride + head(r) * p.lse_head_stride + q_row(r);
    }
    // Where split `split` keeps block row r's partial LSE (and, times the head dim, its output).
    FC_DEVICE i64 partial_slot(const DecodeParams& p, int r) const {
        return i64(split) * p.batch * p.nheads * p.max_seqlen_q + slot(p, r);
    }
    // This q block's count of stored splits: p.split_counters is (batch, kv head groups, q blocks).
    FC_DEVICE int* split_counter(const DecodeParams& p) const {
        return p.split_counters + (i64(batch) * gridDim.y + blockIdx.y) * (gridDim.x / p.num_splits) + m_block;
    }
};

// Packed rows: the fragment's row r is query row (row0 + r) / pack; the mask and score mods see that.
struct PackedCoords {
    int row0, col_base, g, t, pack;
    FC_DEVICE int row(int mt, int h) const { return (row0 + 16 * mt + g + 8 * h) / pack; }
    FC_DEVICE int col(int nt, int e1) const { return col_base + 8 * nt + 2 * t + e1; }
};

// Q rows of a block into a (kRows x kHeadDim) shared tile, 16 bytes per cp.async; rows past
// rows_valid are zero-filled (reading nothing).
template <int kRows, int kHeadDim, int kThreads, class Block>
FC_DEVICE void load_q(u32 s_tile, const DecodeParams& p, const Block& blk, int tid) {
    constexpr int kChunks = kHeadDim / 8;
    for (int i = tid; i < kRows * kChunks; i += kThreads) {
        const int r = i / kChunks, chunk = i % kChunks;
        const bool valid = r < blk.rows_valid;
        const u16* src = valid ? p.q + blk.batch * p.q_batch_stride + blk.q_row(r) * p.q_row_stride
                                         + blk.head(r) * p.q_head_stride + chunk * 8
                               : p.q;
        cp_async_16(s_tile + (r * SmemTile<kHeadDim>::kPitch + chunk * 8) * 2, src, valid ? 16 : 0);
    }
}

// K and V of keys key0 .. key0 + kRows - 1 into two (kRows x kHeadDim) shared tiles, 16 bytes per
// cp.async, by kThreads threads (tid: this one's index among them); keys at or past seqlen_k are
// zero-filled (reading nothing). Each row is found on its own (a table read per row when paged),
// but for a warp's 16 rows (key0 a multiple of 16) on sm90, which are found from their first row
// where they lie in one page (CacheRows::groups_of_16_in_one_page, as StagedRows does): on an H200
// at d=256 that took a paged cache from 0.78-0.88 of the contiguous one's speed to level, and the
// contiguous one up to 10% faster. In sm_80 instances it made ptxas spill 4-16 bytes, which no sm80
// GPU here could weigh.
template <int kRows, int kHeadDim, int kThreads>
FC_DEVICE void load_kv(u32 sK, u32 sV, const CacheRows& cache, int leftpad, int key0, int seqlen_k, int tid) {
    constexpr int kChunks = kHeadDim / 8, kRowsPerPass = kThreads / kChunks;
    constexpr int kPasses = (kRows + kRowsPerPass - 1) / kRowsPerPass;
    static_assert(kRowsPerPass >= 1, "a whole row per pass at least");
    const int chunk = tid % kChunks, r0 = tid / kChunks;
    // head dims 96 and 192: the chunks of whole rows leave kThreads % kChunks threads out, and the
    // last pass may hold fewer rows
    if (kThreads % kChunks != 0 && r0 >= kRowsPerPass) return;
#if __CUDA_ARCH__ >= 900
    if (kRows == 16 && cache.groups_of_16_in_one_page()) {
        i64 k_at = 0, v_at = 0;
        if (key0 < seqlen_k) cache.find(leftpad + key0 + r0, k_at, v_at);  // the page of all 16 rows
#pragma unroll
        for (int i = 0; i < kPasses; ++i) {
            const bool valid = key0 + r0 + i * kRowsPerPass < seqlen_k;
            const u32 s_at = ((r0 + i * kRowsPerPass) * SmemTile<kHeadDim>::kPitch + chunk * 8) * 2;
            cp_async_16(sK + s_at, cache.k + k_at + i * kRowsPerPass * cache.k_row + chunk * 8, valid ? 16 : 0);
            cp_async_16(sV + s_at, cache.v + v_at + i * kRowsPerPass * cache.v_row + chunk * 8, valid ? 16 : 0);
        }
        return;
    }
#endif
#pragma unroll
    for (int i = 0; i < kPasses; ++i) {
        if (kRows % kRowsPerPass != 0 && r0 + i * kRowsPerPass >= kRows) break;
        const int key = key0 + r0 + i * kRowsPerPass;
        const u32 s_at = ((r0 + i * kRowsPerPass) * SmemTile<kHeadDim>::kPitch + chunk * 8) * 2;
        i64 k_at = 0, v_at = 0;
        const bool valid = key < seqlen_k;
        if (valid) cache.find(leftpad + key, k_at, v_at);
        cp_async_16(sK + s_at, cache.k + k_at + chunk * 8, valid ? 16 : 0);
        cp_async_16(sV + s_at, cache.v + v_at + chunk * 8, valid ? 16 : 0);
    }
}

// A warp's 16 K and 16 V rows of keys key0 .. key0 + 15 on their way to shared memory through
// registers (sm90): lane l loads 16-byte chunk l % kChunks of rows l / kChunks + i kRowsPerPass
// (ld.global.nc, zeros for keys at or past seqlen_k), and later stores them as (16 x kHeadDim)
// tiles. A warp's loads reach L2 as whole 128-byte requests; cp.async and one bulk copy per row
// reached it as smaller, overlapping ones (1.5x and 1.1x the sectors) and read HBM 5-10% slower.
// Paged, the rows' blocks come from the block table a step earlier (fetch_blocks), so the loads
// of a step never wait for the table. A warp's 16 rows (key0 a multiple of 16) that lie in one page
// (CacheRows::groups_of_16_in_one_page) take one table read per step and sit a stride apart, as in a
// contiguous cache (with a block and an offset per row the paged kernel ran a third more
// instructions and was 4-24% slower than the contiguous one on an H100).
template <int kHeadDim>
struct StagedRows {
    static constexpr int kChunks = kHeadDim / 8, kRowsPerPass = 32 / kChunks, kPasses = 16 / kRowsPerPass;
    static_assert(kChunks <= 32 && 16 % kRowsPerPass == 0, "whole rows per pass");
    // head dim 96: 2 rows of 12 chunks per pass, lanes 24-31 idle
    FC_DEVICE static bool idle(int lane) { return kRowsPerPass * kChunks < 32 && lane >= kRowsPerPass * kChunks; }
    uint4 k[kPasses], v[kPasses];
    int blocks[kPasses] = {};  // paged: the blocks of the rows of the next load (in one page: of its first row)

    FC_DEVICE void fetch_blocks(const CacheRows& cache, int leftpad, int key0, int seqlen_k, int lane) {
        if (!cache.table || idle(lane)) return;
        if (cache.groups_of_16_in_one_page()) {
            blocks[0] = key0 < seqlen_k ? cache.block_of(leftpad + key0) : 0;
            return;
        }
        const int r0 = lane / kChunks;
#pragma unroll
        for (int i = 0; i < kPasses; ++i) {
            const int key = key0 + r0 + i * kRowsPerPass;
            blocks[i] = key < seqlen_k ? cache.block_of(leftpad + key) : 0;
        }
    }
    FC_DEVICE void load(const CacheRows& cache, int leftpad, int key0, int seqlen_k, int lane) {
        if (idle(lane)) return;
        const int chunk = lane % kChunks, r0 = lane / kChunks;
        if (cache.groups_of_16_in_one_page()) {
            i64 k_at, v_at;
            cache.find_in(leftpad + key0 + r0, blocks[0], k_at, v_at);
#pragma unroll
            for (int i = 0; i < kPasses; ++i) {
                if (key0 + r0 + i * kRowsPerPass < seqlen_k) {
                    k[i] = ld_nc_v4(cache.k + k_at + i * kRowsPerPass * cache.k_row + chunk * 8);
                    v[i] = ld_nc_v4(cache.v + v_at + i * kRowsPerPass * cache.v_row + chunk * 8);
                } else {
                    k[i] = v[i] = make_uint4(0, 0, 0, 0);
                }
            }
            return;
        }
#pragma unroll
        for (int i = 0; i < kPasses; ++i) {
            const int key = key0 + r0 + i * kRowsPerPass;
            if (key < seqlen_k) {
                i64 k_at, v_at;
                cache.find_in(leftpad + key, blocks[i], k_at, v_at);
                k[i] = ld_nc_v4(cache.k + k_at + chunk * 8);
                v[i] = ld_nc_v4(cache.v + v_at + chunk * 8);
            } else {
                k[i] = v[i] = make_uint4(0, 0, 0, 0);
            }
        }
    }
    FC_DEVICE void store(u32 sK, u32 sV, int lane) const {
        if (idle(lane)) return;
        const int chunk = lane % kChunks, r0 = lane / kChunks;
#pragma unroll
        for (int i = 0; i < kPasses; ++i) {
            const u32 at = ((r0 + i * kRowsPerPass) * SmemTile<kHeadDim>::kPitch + chunk * 8) * 2;
            st_shared_v4(sK + at, k[i]);
            st_shared_v4(sV + at, v[i]);
        }
    }
};

// After every thread of the block stored its split's partials: true in the one block, of all the
// splits of this q block, that stored last; it may then read every split's partials. One thread
// counts for the block, after the barrier that orders the block's stores before its count (the
// count releases them and acquires the other splits'). The counter (kvcache.split_counters: zero
// before the launch) is back at zero when the kernel ends.
FC_DEVICE bool last_split_of(int* counter, int num_splits) {
    __shared__ int s_last;
    __syncthreads();
    if (threadIdx.x == 0) {
        const bool last = atomic_add_acq_rel_gpu(counter, 1) == num_splits - 1;
        if (last) *counter = 0;  // every split has counted: reset for the next launch
        s_last = last;
    }
    __syncthreads();
    return s_last;
}

// The prefill kernel's merge of a q block's splits (decode_ref.merge_partials), with the sink in
// the denominator: lse = log(sum_s exp(lse_s) + exp(sink)), out = sum_s exp(lse_s - lse) out_s.
// Up to 64 rows: more bytes than registers hold in flight (merge_splits_in_registers), so they go
// through shared memory, every load of a chunk of rows at once. The partials come from other
// blocks, through L2 (cp.async.cg, ld.cg).
// A thread owns up to kItems (row, 4 columns) items of a chunk and copies those columns of every
// split into its own part of shared memory while a warp per row (its lanes over the splits) turns
// the LSEs into weights. s_work: kWorkFloats floats of shared memory free for it; a chunk's rows
// and splits are cut to fit (kvcache.MAX_SPLITS bounds the splits).
template <int kHeadDim, int kThreads, int kWorkFloats, int kMaxRows, bool Is_bf16, class Block>
FC_DEVICE void merge_splits(const DecodeParams& p, const Block& blk, float* s_work, int tid) {
    constexpr int kQuads = kHeadDim / 4, kWarps = kThreads / 32, kLaneSplits = 4;
    constexpr int kItems = (kMaxRows * kQuads + kThreads - 1) / kThreads > 16 ? 16
                           : (kMaxRows * kQuads + kThreads - 1) / kThreads;
    // rows of a chunk: its items, and room for their weights (up to 128 splits) and one split
    constexpr int kItemRows = kItems * kThreads / kQuads, kFitRows = (kWorkFloats - 3) / (128 + 1 + kHeadDim);
    constexpr int kChunkRows = kItemRows < kFitRows ? kItemRows : kFitRows;
    static_assert(32 * kLaneSplits >= 128, "a warp's lanes hold every split's LSE (MAX_SPLITS)");
    static_assert(kChunkRows >= 1, "a row's weights and a split of it fit");
    constexpr float kLog2e = 1.4426950408889634f, kLn2 = 0.6931471805599453f;
    const int splits = p.num_splits, warp = tid / 32, lane = tid % 32;
    const i64 split_stride = i64(p.batch) * p.nheads * p.max_seqlen_q;
    for (int r0 = 0; r0 < blk.rows_valid; r0 += kChunkRows) {
        const int rows = min(kChunkRows, blk.rows_valid - r0);
        float* s_weight = s_work;                        // [row][split]: exp(lse_s - lse)
        float* s_lse = s_weight + rows * splits;         // [row]
        const int weight_floats = (rows * (splits + 1) + 3) & ~3;  // the copies' 16-byte alignment
        float* s_part = s_work + weight_floats;          // [row][split of the group][column]
        const int group = min(splits, (kWorkFloats - weight_floats) / (rows * kHeadDim));
        float4 o[kItems];
#pragma unroll
        for (int k = 0; k < kItems; ++k) o[k] = make_float4(0.f, 0.f, 0.f, 0.f);
        for (int s0 = 0; s0 < splits; s0 += group) {
            const int n = min(group, splits - s0);
#pragma unroll
            for (int k = 0; k < kItems; ++k) {
                const int item = tid + k * kThreads, r = item / kQuads, col = 4 * (item % kQuads);
                if (item < rows * kQuads) {
                    const float* src = p.out_partial + blk.slot(p, r0 + r) * kHeadDim + col;
                    for (int j = 0; j < n; ++j)
                        cp_async_16(smem_u32(s_part + (r * group + j) * kHeadDim + col),
                                    src + (s0 + j) * split_stride * kHeadDim, 16);
                }
            }
            cp_async_commit();
            if (s0 == 0) {  // the weights, while the first group's copies are in flight
                for (int r = warp; r < rows; r += kWarps) {
                    const i64 slot = blk.slot(p, r0 + r);
                    float x[kLaneSplits];
#pragma unroll
                    for (int j = 0; j < kLaneSplits; ++j) {
                        const int s = lane + 32 * j;
                        x[j] = s < splits ? ld_cg_f32(p.lse_partial + s * split_stride + slot) : -FC_INF;
                    }
                    const float sink = p.sinks ? p.sinks[blk.head(r0 + r)] : -FC_INF;
                    float top = sink;
#pragma unroll
                    for (int j = 0; j < kLaneSplits; ++j) top = fmaxf(top, x[j]);
                    top = warp_max(top);
                    float lse = -FC_INF;
                    if (top != -FC_INF) {
                        float total = lane == 0 ? fast_exp2((sink - top) * kLog2e) : 0.f;
#pragma unroll
                        for (int j = 0; j < kLaneSplits; ++j) total += fast_exp2((x[j] - top) * kLog2e);
                        lse = top + fast_log2(warp_sum(total)) * kLn2;
                    }
#pragma unroll
                    for (int j = 0; j < kLaneSplits; ++j) {
                        const int s = lane + 32 * j;
                        if (s < splits) s_weight[r * splits + s] = lse == -FC_INF ? 0.f : fast_exp2((x[j] - lse) * kLog2e);
                    }
                    if (lane == 0) s_lse[r] = lse;
                }
                __syncthreads();  // the weights, for every thread
            }
            cp_async_wait<0>();  // this thread's copies: it reads only those
#pragma unroll
            for (int k = 0; k < kItems; ++k) {
                const int item = tid + k * kThreads, r = item / kQuads, col = 4 * (item % kQuads);
                if (item < rows * kQuads) {
                    for (int j = 0; j < n; ++j) {
                        const float w = s_weight[r * splits + s0 + j];
                        const float4 x = *reinterpret_cast<const float4*>(s_part + (r * group + j) * kHeadDim + col);
                        o[k].x += w * x.x;
                        o[k].y += w * x.y;
                        o[k].z += w * x.z;
                        o[k].w += w * x.w;
                    }
                }
            }
        }
#pragma unroll
        for (int k = 0; k < kItems; ++k) {
            const int item = tid + k * kThreads, r = item / kQuads, col = 4 * (item % kQuads);
            if (item < rows * kQuads) {
                *reinterpret_cast<uint2*>(blk.out_row(p, r0 + r) + col) =
                    make_uint2(pack_f32x2<Is_bf16>(o[k].x, o[k].y), pack_f32x2<Is_bf16>(o[k].z, o[k].w));
                if (col == 0) *blk.lse_at(p, r0 + r) = s_lse[r];
            }
        }
        __syncthreads();  // before the next chunk's weights overwrite these
    }
}

// One merged item (block row r, 4 columns) over `splits` splits, load(s, lse, o) giving split s's
// LSE and its 4 columns of O. The splits' LSEs are one row's scores: kChunk splits' loads go out
// at once and fold into a running max and sum (the output rescaled when the max moves); the sink
// joins the denominator once, at the end.
template <int kChunk, bool Is_bf16, class Block, class Load>
FC_DEVICE void merge_item(const DecodeParams& p, const Block& blk, int r, int col, int splits, const Load& load) {
    constexpr float kLog2e = 1.4426950408889634f;
    float top = -FC_INF, sum = 0.f;
    float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int s0 = 0; s0 < splits; s0 += kChunk) {
        float x[kChunk];
        float4 o_split[kChunk];
#pragma unroll
        for (int j = 0; j < kChunk; ++j) {
            if (s0 + j < splits) {
                load(s0 + j, x[j], o_split[j]);
            } else {
                x[j] = -FC_INF;
                o_split[j] = make_float4(0.f, 0.f, 0.f, 0.f);
            }
        }
        float m = top;
#pragma unroll
        for (int j = 0; j < kChunk; ++j) m = fmaxf(m, x[j]);
        if (m == -FC_INF) continue;  // no split so far saw a key
        const float c = fast_exp2((top - m) * kLog2e);  // 0 while top is -inf
        sum *= c;
        o = make_float4(o.x * c, o.y * c, o.z * c, o.w * c);
#pragma unroll
        for (int j = 0; j < kChunk; ++j) {
            const float w = fast_exp2((x[j] - m) * kLog2e);  // an empty split's O is 0, its weight 0
            sum += w;
            o.x += w * o_split[j].x;
            o.y += w * o_split[j].y;
            o.z += w * o_split[j].z;
            o.w += w * o_split[j].w;
        }
        top = m;
    }
    float inv, lse;
    softmax_denominator(top, sum, p.sinks ? p.sinks[blk.head(r)] : -FC_INF, inv, lse);
    *reinterpret_cast<uint2*>(blk.out_row(p, r) + col) =
        make_uint2(pack_f32x2<Is_bf16>(o.x * inv, o.y * inv), pack_f32x2<Is_bf16>(o.z * inv, o.w * inv));
    if (col == 0) *blk.lse_at(p, r) = lse;
}

// The decode kernel's merge of a q block's splits by the block that counted last: its items spread
// over the threads, each merged from the partials in L2 (merge_item, 16 splits' loads at once).
// An item costs one round trip through L2 per 16 splits (a thread has one or two at 16 rows),
// where the merge through shared memory (merge_splits) waited for the copies' issue, the weights'
// round trip, a barrier and the sums: 2.2 -> 1.5 us of a 1 x 8k step on an H200. Its 80 registers
// of loads raise the kernel's count (sm90 d=128 234 -> 250, sm80 d=64 96 -> 217), which changes
// no tile's blocks per SM (kvcache.blocks_per_sm: shared memory, threads or the staged rows bound
// them first).
template <int kHeadDim, int kThreads, bool Is_bf16, class Block>
FC_DEVICE void merge_splits_in_registers(const DecodeParams& p, const Block& blk, int tid) {
    constexpr int kQuads = kHeadDim / 4;
    const i64 split_stride = i64(p.batch) * p.nheads * p.max_seqlen_q;
    for (int item = tid; item < blk.rows_valid * kQuads; item += kThreads) {
        const int r = item / kQuads, col = 4 * (item % kQuads);
        const i64 slot = blk.slot(p, r);
        merge_item<16, Is_bf16>(p, blk, r, col, p.num_splits, [&](int s, float& x, float4& o) {
            x = ld_cg_f32(p.lse_partial + s * split_stride + slot);
            o = ld_cg_f32x4(p.out_partial + (s * split_stride + slot) * kHeadDim + col);
        });
    }
}

// sm90: the merge of a q block's splits when they are the blocks of one cluster. Each block stored
// its split's O and LSE in its own shared memory (s_out, s_lse); after a cluster barrier, block
// `rank` merges items rank, rank + kCluster, .. ((row, 4 columns) each) from every block's shared
// memory, and a second barrier keeps every block's shared memory alive until the others have read it.
template <int kHeadDim, int kThreads, int kCluster, bool Is_bf16, class Block>
FC_DEVICE void merge_cluster(const DecodeParams& p, const Block& blk, const float* s_out, const float* s_lse, int tid) {
    constexpr int kQuads = kHeadDim / 4;
    cluster_sync();
    const int rank = cluster_rank();
    const u32 out_base = smem_u32(s_out), lse_base = smem_u32(s_lse);
    for (int item = rank + kCluster * tid; item < blk.rows_valid * kQuads; item += kCluster * kThreads) {
        const int r = item / kQuads, col = 4 * (item % kQuads);
        merge_item<kCluster, Is_bf16>(p, blk, r, col, kCluster, [&](int s, float& x, float4& o) {
            x = ld_cluster_f32(cluster_map(lse_base + 4 * r, s));
            o = ld_cluster_f32x4(cluster_map(out_base + 4 * (r * kHeadDim + col), s));
        });
    }
    cluster_sync();
}

template <int kHeadDim_, int kNWarps_, int kStages_>
struct DecodeTraits {
    static constexpr int kHeadDim = kHeadDim_, kNWarps = kNWarps_, kStages = kStages_;
    static constexpr int kThreads = kNWarps * 32;
    static constexpr int kWarpKeys = 16;  // a warp's keys per step: one k16 step of P V
    static constexpr int kBlockM = 16, kBlockN = kNWarps * kWarpKeys;
    static constexpr int kDTiles = kHeadDim / 8, kPitch = SmemTile<kHeadDim>::kPitch;
    // Q, then a ring of kStages x (K, V) of kBlockN keys (padded rows: tile.cuh)
    static constexpr int kQBytes = kBlockM * kPitch * 2, kKVBytes = kBlockN * kPitch * 2;
    static constexpr int kRingBytes = kStages * 2 * kKVBytes;
    // after the loop the ring holds each warp's O (float32 rows of kOPitch: the fragments' 8-byte
    // stores free of bank conflicts) and each warp's row max and row sum
    static constexpr int kOPitch = kHeadDim + 8;
    // and, in a cluster's blocks (flash_decode_cluster_kernel), the block's split: O [row][kHeadDim]
    // and the LSE [row], float32, for the other blocks of the cluster to read
    static constexpr int kMergeBytes = kNWarps * kBlockM * (kOPitch + 2) * 4 + kBlockM * (kHeadDim + 1) * 4;
    static constexpr int kRegionBytes = kRingBytes > kMergeBytes ? kRingBytes : kMergeBytes;
    static constexpr int kSmemBytes = kQBytes + kRegionBytes;
    static_assert(kHeadDim % 32 == 0 && kStages >= 2, "head dims of 32s, two stages at least");
};

// The body of both decode kernels: kCluster 1, the splits merged by the last split's block
// (last_split_of, merge_splits); more, the blocks of a cluster are the splits and merge through
// distributed shared memory (merge_cluster).
template <int kHeadDim, int kNWarps, int kStages, int kCluster, bool Is_causal, bool Is_local, bool Is_bf16,
          bool Has_score_mod>
FC_DEVICE void decode_attention(const DecodeParams& p) {
    using T = DecodeTraits<kHeadDim, kNWarps, kStages>;
    constexpr int kBlockM = T::kBlockM, kBlockN = T::kBlockN, kThreads = T::kThreads;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    const u32 sQ = smem_u32(smem_raw);
    griddep_wait();  // launched programmatically: the kernels ahead (append, the previous step) done
    auto sK = [&](int s) { return sQ + T::kQBytes + s * 2 * T::kKVBytes; };
    auto sV = [&](int s) { return sK(s) + T::kKVBytes; };
    const DecodeBlock<kBlockM, kBlockN, Is_causal, Is_local> blk(p, blockIdx.x / p.num_splits, blockIdx.x % p.num_splits);
    if (blk.rows_valid == 0) return;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const CacheRows cache(p, blk.batch, blk.kv_head);
    const int n_steps = blk.n_block_max - blk.n_block_min;
    // Each warp streams its own 16 keys of every step through its own rows of the ring and waits
    // for its own loads only: the warps never wait for each other inside the loop. sm80-89 (and
    // head dim 256): cp.async 16 bytes per lane, kStages - 1 steps ahead, counted by groups. sm90:
    // the next step's rows wait in registers while this step computes (StagedRows), and go to
    // shared memory after it.
#if __CUDA_ARCH__ >= 900
    constexpr bool kStaged = kHeadDim <= 128;  // 192 and 256: 128 registers of rows
#else
    constexpr bool kStaged = false;
#endif
    const u32 k_rows = tile_offset<kHeadDim>(16 * warp, 0);
    auto key0_of = [&](int i) { return (blk.n_block_min + i) * kBlockN + 16 * warp; };
    StagedRows<kHeadDim> staged;
    if (kStaged) {
        // loads run a step ahead of the math, block-table reads two. The first step's rows go out
        // before Q's copies (every thread a share, cp.async, a group of its own), whose address
        // math would otherwise hold them back; Q is read only once those rows are in shared memory.
        if (n_steps > 0) {
            staged.fetch_blocks(cache, blk.leftpad, key0_of(0), blk.seqlen_k, lane);
            staged.load(cache, blk.leftpad, key0_of(0), blk.seqlen_k, lane);
            load_q<kBlockM, kHeadDim, kThreads>(sQ, p, blk, tid);
            cp_async_commit();
            if (n_steps > 1) staged.fetch_blocks(cache, blk.leftpad, key0_of(1), blk.seqlen_k, lane);
            staged.store(sK(0) + k_rows, sV(0) + k_rows, lane);
        }
        if (n_steps > 1) {
            staged.load(cache, blk.leftpad, key0_of(1), blk.seqlen_k, lane);
            if (n_steps > 2) staged.fetch_blocks(cache, blk.leftpad, key0_of(2), blk.seqlen_k, lane);
        }
    } else {
        // Q (every thread a share, cp.async) with the first steps; the ring filled but for one
        // stage, one cp.async group per stage always
        if (n_steps > 0) load_q<kBlockM, kHeadDim, kThreads>(sQ, p, blk, tid);
#pragma unroll
        for (int i = 0; i < kStages - 1; ++i) {
            if (i < n_steps)
                load_kv<16, kHeadDim, 32>(sK(i) + k_rows, sV(i) + k_rows, cache, blk.leftpad, key0_of(i), blk.seqlen_k,
                                          lane);
            cp_async_commit();
        }
    }

    const ScoreMod mod(p.softmax_scale, p.softcap, p.alibi_slopes, p.alibi_batch_stride, blk.batch, blk.head0,
                       blk.mask.offset);
    const float score_log2 = Has_score_mod ? 1.4426950408889634f : p.scale_log2;
    float acc_o[1][T::kDTiles][4];
    clear_acc(acc_o);
    OnlineSoftmax<1> softmax;
    const u32 q_lane = sQ + ldsm_lane_offset_a<kHeadDim>(lane);
    u32 q_frag[kHeadDim / 16][1][4];  // Q's A fragments, kept in registers from the first step on
    const u32 k_lane = k_rows + ldsm_lane_offset_b<kHeadDim>(lane);
    const u32 v_lane = ldsm_lane_offset_a<kHeadDim>(lane);

    for (int i = 0; i < n_steps; ++i) {
        if (!kStaged) cp_async_wait<kStages - 2>();  // this lane's copies of step i landed (and of Q with step 0)
        else if (i == 0) cp_async_wait<0>();  // Q
        if (i == 0) {
            __syncthreads();  // Q: every thread's copies (and, staged, step 0's rows)
#pragma unroll
            for (int kd = 0; kd < kHeadDim / 16; ++kd) load_a_frags<false, kHeadDim>(q_frag[kd], q_lane, 0, 16 * kd);
        } else {
            __syncwarp();  // the warp's other lanes' rows of step i; and the warp is done with step i - 1
        }
        if (!kStaged) {
            const int ahead = i + kStages - 1;  // into step i - 1's stage
            if (ahead < n_steps)
                load_kv<16, kHeadDim, 32>(sK(ahead % kStages) + k_rows, sV(ahead % kStages) + k_rows, cache, blk.leftpad,
                                          key0_of(ahead), blk.seqlen_k, lane);
            cp_async_commit();
        }
        const int s = i % kStages, key0 = key0_of(i);
        // S = Q K^T over this warp's 16 keys
        float acc_s[1][2][4];
        clear_acc(acc_s);
#pragma unroll
        for (int kd = 0; kd < kHeadDim / 16; ++kd)
            warp_mma_k16<Is_bf16, false, kHeadDim>(acc_s, q_frag[kd], sK(s) + k_lane, 0, 16 * kd);
        const PackedCoords coords{blk.row0, key0, g, t, blk.pack};
        if (Has_score_mod) apply_score_mod(mod, acc_s, coords);
        if (blk.needs_mask(key0, 16)) blk.mask.apply(acc_s, coords);
        softmax.update(acc_s, acc_o, score_log2);
        // O += P V over the same keys: P (16 x 16) is one A fragment
        u32 pa[1][4];
        acc_to_a_frag<Is_bf16>(acc_s[0][0], acc_s[0][1], pa[0]);
        warp_mma_k16<Is_bf16, true, kHeadDim>(acc_o, pa, sV(s) + v_lane, 16 * warp, 0);
        if (kStaged && i + 1 < n_steps) {  // step i + 1's rows, loaded while step i computed; then step i + 2's
            staged.store(sK((i + 1) % kStages) + k_rows, sV((i + 1) % kStages) + k_rows, lane);
            if (i + 2 < n_steps) staged.load(cache, blk.leftpad, key0_of(i + 2), blk.seqlen_k, lane);
            if (i + 3 < n_steps) staged.fetch_blocks(cache, blk.leftpad, key0_of(i + 3), blk.seqlen_k, lane);
        }
    }

    griddep_launch_dependents();  // the next kernel's blocks may take SMs as this one's finish
    // The warps' states through shared memory (the ring is free once no copy is in flight), then
    // each block row's: M = max_w m_w, L = sum_w l_w 2^(m_w - M), O = sum_w O_w 2^(m_w - M).
    cp_async_wait<0>();
    __syncthreads();
    float* sO = reinterpret_cast<float*>(smem_raw + T::kQBytes);  // [warp][row][kOPitch]
    float* sStat = sO + kNWarps * kBlockM * T::kOPitch;            // [warp][row]: max, sum
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int r = g + 8 * h;
        const float sum = quad_sum(softmax.row_sum[h]);
        if (r >= blk.rows_valid) continue;  // only valid rows are read (one decode token of 4 heads: 4 of 16)
        float* o_row = sO + (warp * kBlockM + r) * T::kOPitch + 2 * t;
#pragma unroll
        for (int dt = 0; dt < T::kDTiles; ++dt)
            *reinterpret_cast<float2*>(o_row + 8 * dt) = make_float2(acc_o[0][dt][2 * h], acc_o[0][dt][2 * h + 1]);
        if (t == 0) {
            sStat[2 * (warp * kBlockM + r)] = softmax.row_max[h];
            sStat[2 * (warp * kBlockM + r) + 1] = sum;
        }
    }
    __syncthreads();
    const bool partial = p.num_splits > 1;
    float* s_split_out = sStat + 2 * kNWarps * kBlockM;  // the cluster's merge reads these
    float* s_split_lse = s_split_out + kBlockM * kHeadDim;
    constexpr int kQuads = kHeadDim / 4;
    for (int item = tid; item < blk.rows_valid * kQuads; item += kThreads) {
        const int r = item / kQuads, col = 4 * (item % kQuads);
        float top = -FC_INF;
#pragma unroll
        for (int w = 0; w < kNWarps; ++w) top = fmaxf(top, sStat[2 * (w * kBlockM + r)]);
        float sum = 0.f;
        float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
        if (top != -FC_INF) {
#pragma unroll
            for (int w = 0; w < kNWarps; ++w) {
                const float m = sStat[2 * (w * kBlockM + r)];
                const float scale = m == -FC_INF ? 0.f : fast_exp2((m - top) * score_log2);
                sum += scale * sStat[2 * (w * kBlockM + r) + 1];
                const float4 x = *reinterpret_cast<const float4*>(sO + (w * kBlockM + r) * T::kOPitch + col);
                o.x += scale * x.x;
                o.y += scale * x.y;
                o.z += scale * x.z;
                o.w += scale * x.w;
            }
        }
        // One split: the sink joins the denominator here; several: the merge adds it once.
        const float sink = !partial && p.sinks ? p.sinks[blk.head(r)] : -FC_INF;
        float inv, lse;
        softmax_denominator(top == -FC_INF ? -FC_INF : top * (Has_score_mod ? 1.f : p.softmax_scale), sum, sink,
                            inv, lse);
        o = make_float4(o.x * inv, o.y * inv, o.z * inv, o.w * inv);
        if constexpr (kCluster > 1) {
            *reinterpret_cast<float4*>(s_split_out + r * kHeadDim + col) = o;
            if (col == 0) s_split_lse[r] = lse;
        } else if (partial) {
            const i64 at = blk.partial_slot(p, r);
            *reinterpret_cast<float4*>(p.out_partial + at * kHeadDim + col) = o;
            if (col == 0) p.lse_partial[at] = lse;
        } else {
            *reinterpret_cast<uint2*>(blk.out_row(p, r) + col) =
                make_uint2(pack_f32x2<Is_bf16>(o.x, o.y), pack_f32x2<Is_bf16>(o.z, o.w));
            if (col == 0) *blk.lse_at(p, r) = lse;
        }
    }
    if constexpr (kCluster > 1)
        merge_cluster<kHeadDim, kThreads, kCluster, Is_bf16>(p, blk, s_split_out, s_split_lse, tid);
    else if (partial && last_split_of(blk.split_counter(p), p.num_splits))
        merge_splits_in_registers<kHeadDim, kThreads, Is_bf16>(p, blk, tid);
}

template <int kHeadDim, int kNWarps, int kStages, bool Is_causal, bool Is_local, bool Is_bf16, bool Has_score_mod>
__global__ void __launch_bounds__(kNWarps * 32)
flash_decode_kernel(const __grid_constant__ DecodeParams p) {
    decode_attention<kHeadDim, kNWarps, kStages, 1, Is_causal, Is_local, Is_bf16, Has_score_mod>(p);
}

// sm90: a q block's kCluster splits (p.num_splits == kCluster) as one cluster of blocks, merged
// without the count that finds the last split's block (two dependent round trips through L2:
// 1-1.5 us a call on an H100). kvcache.plan_launch takes it where the GPU holds every q block's
// cluster at once (a cluster's blocks share a GPC).
template <int kHeadDim, int kNWarps, int kStages, int kCluster, bool Is_causal, bool Is_local, bool Is_bf16,
          bool Has_score_mod>
#if __CUDA_ARCH__ >= 900
__global__ void __cluster_dims__(kCluster, 1, 1) __launch_bounds__(kNWarps * 32)
flash_decode_cluster_kernel(const __grid_constant__ DecodeParams p) {
    decode_attention<kHeadDim, kNWarps, kStages, kCluster, Is_causal, Is_local, Is_bf16, Has_score_mod>(p);
}
#else
__global__ void flash_decode_cluster_kernel(const __grid_constant__ DecodeParams p) {}  // clusters: sm90 on
#endif

template <int kHeadDim_, int kBlockN_>
struct PrefillTraits {
    static constexpr int kHeadDim = kHeadDim_, kBlockM = 64, kBlockN = kBlockN_, kNWarps = 4;
    static constexpr int kThreads = kNWarps * 32, kRowsPerWarp = kBlockM / kNWarps;
    static constexpr int kNTiles = kBlockN / 8, kDTiles = kHeadDim / 8;
    static constexpr int kPitch = SmemTile<kHeadDim>::kPitch;
    // Q, then kStages x (K, V) of a key block (padded rows: tile.cuh): the next block's K and V
    // load while this one's are used
    static constexpr int kStages = 2;
    static constexpr int kQBytes = kBlockM * kPitch * 2, kKVBytes = kBlockN * kPitch * 2;
    static constexpr int kSmemBytes = kQBytes + kStages * 2 * kKVBytes;
    static_assert(kHeadDim % 32 == 0 && kBlockN % 16 == 0, "head dims of 32s, key blocks of 16s");
};

template <int kHeadDim, int kBlockN, bool Is_causal, bool Is_local, bool Is_bf16, bool Has_score_mod>
__global__ void __launch_bounds__(128)
flash_prefill_kernel(const __grid_constant__ DecodeParams p) {
    using T = PrefillTraits<kHeadDim, kBlockN>;
    constexpr int kBlockM = T::kBlockM;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    const u32 sQ_base = smem_u32(smem_raw);
    auto sK_stage = [&](int s) { return sQ_base + T::kQBytes + s * 2 * T::kKVBytes; };
    auto sV_stage = [&](int s) { return sK_stage(s) + T::kKVBytes; };
    const DecodeBlock<kBlockM, kBlockN, Is_causal, Is_local> blk(p, blockIdx.x / p.num_splits, blockIdx.x % p.num_splits);
    if (blk.rows_valid == 0) return;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const int n_block_min = blk.n_block_min, n_block_max = blk.n_block_max;
    const CacheRows cache(p, blk.batch, blk.kv_head);
    const ScoreMod mod(p.softmax_scale, p.softcap, p.alibi_slopes, p.alibi_batch_stride, blk.batch, blk.head0,
                       blk.mask.offset);
    const float score_log2 = Has_score_mod ? 1.4426950408889634f : p.scale_log2;
    const int warp_row0 = warp * T::kRowsPerWarp;

    float acc_o[1][T::kDTiles][4];
    clear_acc(acc_o);
    OnlineSoftmax<1> softmax;
    // K and V of key block n into stage s, one cp.async group
    auto load_block = [&](int n, int s) {
        load_kv<kBlockN, kHeadDim, T::kThreads>(sK_stage(s), sV_stage(s), cache, blk.leftpad, n * kBlockN,
                                                blk.seqlen_k, tid);
        cp_async_commit();
    };
    if (n_block_max > n_block_min) {  // Q and the last block; the one before it too
        load_q<kBlockM, kHeadDim, T::kThreads>(sQ_base, p, blk, tid);
        load_block(n_block_max - 1, 0);
        if (n_block_max - 2 >= n_block_min) load_block(n_block_max - 2, 1);
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
        const PackedCoords coords{blk.row0 + warp_row0, key0, g, t, blk.pack};
        if (Has_score_mod) apply_score_mod(mod, acc_s, coords);
        if (blk.needs_mask(key0, kBlockN)) blk.mask.apply(acc_s, coords);
        softmax.update(acc_s, acc_o, score_log2);
#pragma unroll
        for (int ks = 0; ks < kBlockN / 16; ++ks) {
            u32 pa[1][4];
            acc_to_a_frag<Is_bf16>(acc_s[0][2 * ks], acc_s[0][2 * ks + 1], pa[0]);
            warp_mma_k16<Is_bf16, true, kHeadDim>(acc_o, pa, sV_stage(s) + v_lane, 16 * ks, 0);
        }
        __syncthreads();  // every warp is done with stage s: the block after next may fill it
        if (n_block - 2 >= n_block_min) load_block(n_block - 2, s);
    }

    // One split: O and the LSE, the sink in the denominator (one head per block with sinks). Several:
    // each split's own normalization and no sink; the last split's block merges them.
    const bool partial = p.num_splits > 1;
    float row_lse[2];
    softmax.finalize(acc_o, Has_score_mod ? 1.f : p.softmax_scale, !partial && p.sinks ? p.sinks[blk.head0] : -FC_INF,
                     row_lse);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int r = warp_row0 + g + 8 * h;
        if (r >= blk.rows_valid) continue;
        if (partial) {
            const i64 at = blk.partial_slot(p, r);
            float* o = p.out_partial + at * kHeadDim;
#pragma unroll
            for (int dt = 0; dt < T::kDTiles; ++dt)
                *reinterpret_cast<float2*>(o + 8 * dt + 2 * t) = make_float2(acc_o[0][dt][2 * h], acc_o[0][dt][2 * h + 1]);
            if (t == 0) p.lse_partial[at] = row_lse[h];
        } else {
            u16* o = blk.out_row(p, r);
#pragma unroll
            for (int dt = 0; dt < T::kDTiles; ++dt)
                *reinterpret_cast<u32*>(o + 8 * dt + 2 * t) = pack_f32x2<Is_bf16>(acc_o[0][dt][2 * h], acc_o[0][dt][2 * h + 1]);
            if (t == 0) *blk.lse_at(p, r) = row_lse[h];
        }
    }
    if (partial && last_split_of(blk.split_counter(p), p.num_splits))  // every thread is past its shared reads
        merge_splits<kHeadDim, T::kThreads, T::kSmemBytes / 4, kBlockM, Is_bf16>(p, blk, reinterpret_cast<float*>(smem_raw),
                                                                          tid);
}
