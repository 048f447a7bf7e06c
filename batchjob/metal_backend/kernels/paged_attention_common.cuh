// Helpers shared by the CUDA paged attention kernels (passed to mx.fast.cuda_kernel as `header`).
// The CUDA twin of paged_attention_common.metal: same index math, line for line, mirrored in index_math.py
// and tested there. Buffers, grid and template constants are those of LAYOUT.md.

__device__ __forceinline__ int find_seq_for_token(const int* cu_seqlens_q, int num_seqs, int token) {
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

__device__ __forceinline__ int find_seq_for_query_block(const int* cu_seqlens_q, int num_seqs, int block, int bq) {
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

__device__ __forceinline__ int kv_slot(const int* table_row, int pos, int block_size) {
    return table_row[pos / block_size] * block_size + pos % block_size;
}

// Sum over the 32 lanes of a warp (the CUDA spelling of Metal's simd_sum); every lane gets the total.
__device__ __forceinline__ float warp_sum(float x) {
    for (int offset = 16; offset > 0; offset /= 2) {
        x += __shfl_xor_sync(0xffffffffu, x, offset);
    }
    return x;
}

__device__ __forceinline__ float negative_infinity() {
    return -__int_as_float(0x7f800000);
}
