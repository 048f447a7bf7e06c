// Tiled prefill paged attention, CUDA twin of paged_attention_tiled.metal: one block per (virtual query block,
// head) holds BQ query rows; NUM_SIMDGROUPS warps own BQ / NUM_SIMDGROUPS rows each; K/V tiles of BK positions
// are staged once in shared memory (fp32) and reused by all BQ rows. See LAYOUT.md.
constexpr int ROWS_PER_SIMDGROUP = BQ / NUM_SIMDGROUPS;
constexpr int DIMS_PER_LANE = (HEAD_DIM + 31) / 32;
constexpr int THREADS = NUM_SIMDGROUPS * 32;
__shared__ float k_tile[BK * HEAD_DIM];
__shared__ float v_tile[BK * HEAD_DIM];

const int tid = int(threadIdx.x);
const int lane = tid % 32;
const int warp = tid / 32;
const int head = int(blockIdx.y);
const int block = int(blockIdx.z);
const int num_seqs = params[0];
const int max_blocks = params[1];

const int seq = find_seq_for_query_block(cu_seqlens_q, num_seqs, block, BQ);
const int q_start = cu_seqlens_q[seq];
const int q_len = cu_seqlens_q[seq + 1] - q_start;
const int local_block = block - (q_start / BQ + seq);
if (local_block * BQ >= q_len) {
    return;  // surplus block: every thread exits before any barrier
}
const int first_row = local_block * BQ;
const int rows_here = min(BQ, q_len - first_row);
const int context_len = context_lens[seq];
const int offset = context_len - q_len;
const int kv_end = offset + first_row + rows_here;
const int kv_head = head / (NUM_Q_HEADS / NUM_KV_HEADS);
const int* table_row = block_tables + seq * max_blocks;

float q_reg[ROWS_PER_SIMDGROUP][DIMS_PER_LANE];
float acc[ROWS_PER_SIMDGROUP][DIMS_PER_LANE];
float row_max[ROWS_PER_SIMDGROUP];
float row_sum[ROWS_PER_SIMDGROUP];
#pragma unroll
for (int r = 0; r < ROWS_PER_SIMDGROUP; ++r) {
    const int row = first_row + warp * ROWS_PER_SIMDGROUP + r;
    const int q_base = ((q_start + row) * NUM_Q_HEADS + head) * HEAD_DIM;
#pragma unroll
    for (int i = 0; i < DIMS_PER_LANE; ++i) {
        const int d = lane + 32 * i;
        q_reg[r][i] = (row < q_len && d < HEAD_DIM) ? static_cast<float>(q[q_base + d]) * scale[0] : 0.0f;
        acc[r][i] = 0.0f;
    }
    row_max[r] = negative_infinity();
    row_sum[r] = 0.0f;
}

for (int tile_start = 0; tile_start < kv_end; tile_start += BK) {
    for (int e = tid; e < BK * HEAD_DIM; e += THREADS) {
        const int pos = tile_start + e / HEAD_DIM;
        const int d = e % HEAD_DIM;
        float k_val = 0.0f;
        float v_val = 0.0f;
        if (pos < kv_end) {
            const int kv_base = (kv_slot(table_row, pos, BLOCK_SIZE) * NUM_KV_HEADS + kv_head) * HEAD_DIM;
            k_val = static_cast<float>(k_cache[kv_base + d]);
            v_val = static_cast<float>(v_cache[kv_base + d]);
        }
        k_tile[e] = k_val;
        v_tile[e] = v_val;
    }
    __syncthreads();

    const int tile_len = min(BK, kv_end - tile_start);
    for (int kk = 0; kk < tile_len; ++kk) {
        const int pos = tile_start + kk;
#pragma unroll
        for (int r = 0; r < ROWS_PER_SIMDGROUP; ++r) {
            const int row = first_row + warp * ROWS_PER_SIMDGROUP + r;
            if (row >= q_len || pos >= offset + row + 1) {
                continue;  // uniform across the warp, so warp_sum stays convergent
            }
            float partial = 0.0f;
#pragma unroll
            for (int i = 0; i < DIMS_PER_LANE; ++i) {
                const int d = lane + 32 * i;
                if (d < HEAD_DIM) {
                    partial += q_reg[r][i] * k_tile[kk * HEAD_DIM + d];
                }
            }
            const float score = warp_sum(partial);
            const float new_max = fmaxf(row_max[r], score);
            const float correction = expf(row_max[r] - new_max);
            const float p = expf(score - new_max);
            row_sum[r] = row_sum[r] * correction + p;
#pragma unroll
            for (int i = 0; i < DIMS_PER_LANE; ++i) {
                const int d = lane + 32 * i;
                const float v = d < HEAD_DIM ? v_tile[kk * HEAD_DIM + d] : 0.0f;
                acc[r][i] = acc[r][i] * correction + p * v;
            }
            row_max[r] = new_max;
        }
    }
    __syncthreads();
}

#pragma unroll
for (int r = 0; r < ROWS_PER_SIMDGROUP; ++r) {
    const int row = first_row + warp * ROWS_PER_SIMDGROUP + r;
    if (row >= q_len) {
        continue;
    }
    const int q_base = ((q_start + row) * NUM_Q_HEADS + head) * HEAD_DIM;
#pragma unroll
    for (int i = 0; i < DIMS_PER_LANE; ++i) {
        const int d = lane + 32 * i;
        if (d < HEAD_DIM) {
            out[q_base + d] = static_cast<T>(acc[r][i] / row_sum[r]);
        }
    }
}
