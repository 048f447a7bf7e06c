// Helpers shared by the paged attention kernels (passed to mx.fast.metal_kernel as `header`).
// Python twins of these functions live in index_math.py and are tested exhaustively there; keep the
// two in step line by line.
//
// Pointer parameters are templates on purpose: MLX binds an input with fewer than 8 elements in the
// `constant` address space and larger ones in `device`, so a small batch (cu_seqlens_q of 5 entries) and a
// large one produce different pointer types. Never spell an address space in these sources.

// Sequence that owns flat query token `token`: the largest s in [0, num_seqs) with
// cu_seqlens_q[s] <= token. Sequences are never empty in our metadata, but the rule also skips empty ones.
template <typename IntPtr>
inline int find_seq_for_token(IntPtr cu_seqlens_q, int num_seqs, int token) {
    int lo = 0;
    int hi = num_seqs - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (cu_seqlens_q[mid] <= token) {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    return lo;
}

// Sequence that owns virtual query block `block` in the tiled kernel's grid. Sequence s owns the virtual
// blocks starting at cu_seqlens_q[s] / BQ + s; it is given cu[s+1]/BQ - cu[s]/BQ + 1 of them, at least the
// ceil(q_len / BQ) it needs, so the grid (num_tokens / BQ + num_seqs blocks) can be sized on the host without
// a prefix sum over ceil(q_len / BQ). Blocks past a sequence's last row are surplus and exit.
template <typename IntPtr>
inline int find_seq_for_query_block(IntPtr cu_seqlens_q, int num_seqs, int block, int bq) {
    int lo = 0;
    int hi = num_seqs - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (cu_seqlens_q[mid] / bq + mid <= block) {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    return lo;
}

// Flat cache slot of KV position `pos` of a sequence, through its block-table row.
template <typename IntPtr>
inline int kv_slot(IntPtr table_row, int pos, int block_size) {
    return table_row[pos / block_size] * block_size + pos % block_size;
}
