// Where sequence `batch` lives: padded batches or packed variable-length ones (varlen).
//
// Padded: every sequence has max_seqlen_q rows and max_seqlen_k keys, and the batch strides move
// between them. Varlen: q holds all sequences' rows one after another (the batch strides are 0),
// cu_seqlens_q[b] is the first row of sequence b and cu_seqlens_q[b + 1] - cu_seqlens_q[b] its
// length (likewise keys with cu_seqlens_k). The grids are sized by the longest sequence; thread
// blocks past a shorter sequence's end return at once.
#pragma once
#include "ptx.cuh"

struct SeqLens {
    int q_start, k_start;   // first row / key of the sequence in the packed tensors (0 when padded)
    int seqlen_q, seqlen_k;  // this sequence's lengths

    FC_DEVICE SeqLens(const int* cu_seqlens_q, const int* cu_seqlens_k, int batch, int max_seqlen_q,
                      int max_seqlen_k) {
        q_start = cu_seqlens_q ? cu_seqlens_q[batch] : 0;
        k_start = cu_seqlens_k ? cu_seqlens_k[batch] : 0;
        seqlen_q = cu_seqlens_q ? cu_seqlens_q[batch + 1] - q_start : max_seqlen_q;
        seqlen_k = cu_seqlens_k ? cu_seqlens_k[batch + 1] - k_start : max_seqlen_k;
    }
};
