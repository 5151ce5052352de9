// Kernel parameters: one struct per direction, passed by value (__grid_constant__) to every kernel
// of that direction. flashcupy/params.py holds the same field table, fills it from the validated
// problem, and CI compiles both layouts against each other (tests/test_params.py): a field added on
// one side only fails CI. Keep one field per line, in the table's order.
//
// Tensors are (batch, seqlen, heads, headdim) with element strides and a contiguous head dim; a
// packed varlen tensor is (total, heads, headdim) with batch stride 0 (seqlens.cuh).
#pragma once
#include "ptx.cuh"

struct FwdParams {
    const u16* q;                // (batch, seqlen_q, nheads,   headdim)
    const u16* k;                // (batch, seqlen_k, nheads_k, headdim)
    const u16* v;                // (batch, seqlen_k, nheads_k, headdim)
    u16* out;                    // (batch, seqlen_q, nheads,   headdim)
    float* lse;                  // (batch, nheads, seqlen_q), or varlen (nheads, total_q)
    const int* cu_seqlens_q;     // varlen: (batch + 1) cumulative lengths; padded: null
    const int* cu_seqlens_k;
    const float* alibi_slopes;   // (nheads) or (batch, nheads); null: no ALiBi (score_mod.cuh)
    const float* sinks;          // (nheads) sink logits; null: none
    i64 q_batch_stride;
    i64 q_row_stride;
    i64 q_head_stride;
    i64 k_batch_stride;
    i64 k_row_stride;
    i64 k_head_stride;
    i64 v_batch_stride;
    i64 v_row_stride;
    i64 v_head_stride;
    i64 o_batch_stride;
    i64 o_row_stride;
    i64 o_head_stride;
    i64 lse_batch_stride;        // also D's (the backward's delta)
    i64 lse_head_stride;
    int max_seqlen_q;            // padded: every sequence's length; varlen: the longest (sizes the grid)
    int max_seqlen_k;
    int nheads;
    int heads_per_kv_head;       // nheads / nheads_k (GQA)
    int align_bottom_right;      // 1: band offset seqlen_k - seqlen_q of each sequence; 0: offset 0
    int window_left;             // Is_local band bounds (mask.cuh)
    int window_right;
    int alibi_batch_stride;      // nheads for (batch, nheads) slopes, else 0
    int batch;                   // sequences (the persistent sm90 grid walks batch x heads x q blocks)
    float softcap;               // 0: off
    float softmax_scale;
    float scale_log2;            // softmax_scale * log2(e)
};

struct BwdParams : FwdParams {   // out and lse are the forward's results here
    const u16* dout;             // shape of q
    float* delta;                // D = rowsum(dO * O), laid out as lse
    float* dq_accum;             // (rows_batch, nheads, rows_seqlen_q, headdim) float32, contiguous: a head's
                                 //   rows adjacent (the reductions' lines spread over L2); zeroed by the preprocess
    u16* dq;                     // shape of q
    u16* dk;                     // (batch, seqlen_k, nheads, headdim): the main kernel's dK, one slice per
    u16* dv;                     //   query head; with nheads_k == nheads the result itself
    u16* dk_kv;                  // GQA: (batch, seqlen_k, nheads_k, headdim), dk summed per kv head
    u16* dv_kv;
    int* dq_semaphore;           // (batch, nheads, q blocks), zeroed; deterministic instances only, else null
    i64 do_batch_stride;
    i64 do_row_stride;
    i64 do_head_stride;
    i64 dq_batch_stride;
    i64 dq_row_stride;
    i64 dq_head_stride;
    i64 dk_batch_stride;
    i64 dk_row_stride;
    i64 dk_head_stride;
    i64 dv_batch_stride;
    i64 dv_row_stride;
    i64 dv_head_stride;
    i64 dk_kv_batch_stride;
    i64 dk_kv_row_stride;
    i64 dk_kv_head_stride;
    i64 dv_kv_batch_stride;
    i64 dv_kv_row_stride;
    i64 dv_kv_head_stride;
    int rows_batch;              // the row-wise kernels' view: (rows_batch, rows_seqlen_q) rows of q and
    int rows_seqlen_q;           //   (rows_batch, rows_seqlen_k) of k; a varlen batch is 1 x its packed rows
    int rows_seqlen_k;
    int nheads_k;
};

struct DecodeParams : FwdParams {  // q, k, v: the queries (rotated, with rotary tables) and the caches
    u16* k_cache;                // k and v again, written by the append
    u16* v_cache;
    const u16* k_new;            // (batch, seqlen_new, nheads_k, headdim), appended at cache_seqlens; null: none
    const u16* v_new;
    const u16* q_source;         // rotary: the caller's q, rotated into q_rotated (which is q)
    u16* q_rotated;
    const u16* rotary_cos;       // (seqlen_ro, rotary_dim / 2) in the input dtype; null: no rotary
    const u16* rotary_sin;
    const int* cache_seqlens;    // (batch) cache rows before the new keys, counted from row 0; null: max_seqlen_k
    const int* cache_batch_idx;  // (batch) cache entry of each sequence; null: its own
    const int* cache_leftpad;    // (batch) first key row; null: 0
    const int* block_table;      // (batch, max_blocks) block indices of a paged cache; null: contiguous
    float* out_partial;          // (splits, batch, nheads, max_seqlen_q, headdim) float32 when num_splits > 1
    float* lse_partial;          // (splits, batch, nheads, max_seqlen_q)
    int* split_counters;         // (batch, kv head groups, q blocks) splits stored so far; zero between launches
    i64 knew_batch_stride;
    i64 knew_row_stride;
    i64 knew_head_stride;
    i64 vnew_batch_stride;
    i64 vnew_row_stride;
    i64 vnew_head_stride;
    i64 qsrc_batch_stride;
    i64 qsrc_row_stride;
    i64 qsrc_head_stride;
    i64 block_table_batch_stride;
    i64 page_div_mul;            // row / page_size = (row * page_div_mul) >> page_div_shift (kvcache.page_divider)
    int page_size;               // paged: rows per block (k's batch stride is then the block stride)
    int page_div_shift;
    int seqlen_new;
    int num_splits;
    int heads_per_block;         // query heads packed into a block's rows: heads_per_kv_head, or 1
    int rotary_dim;
    int rotary_interleaved;      // 1: pairs (2 j, 2 j + 1); 0: pairs (j, j + rotary_dim / 2)
    int rotary_q_per_row;        // 1: query row i at position cache_seqlens + i; 0: all at cache_seqlens
};
