// Tiled prefill paged attention (FlashAttention-2 style): one threadgroup per (virtual query block, query
// head) holds BQ query rows; NUM_SIMDGROUPS simdgroups own BQ / NUM_SIMDGROUPS rows each; K/V tiles of BK
// positions are staged once in threadgroup memory and reused by all BQ rows. See LAYOUT.md.
constexpr int ROWS_PER_SIMDGROUP = BQ / NUM_SIMDGROUPS;
constexpr int DIMS_PER_LANE = (HEAD_DIM + 31) / 32;
constexpr int THREADS = NUM_SIMDGROUPS * 32;
threadgroup float k_tile[BK * HEAD_DIM];
threadgroup float v_tile[BK * HEAD_DIM];

const uint tid = thread_position_in_threadgroup.x;
const uint lane = thread_index_in_simdgroup;
const uint simdgroup = simdgroup_index_in_threadgroup;
const int head = int(threadgroup_position_in_grid.y);
const int block = int(threadgroup_position_in_grid.z);
const int num_seqs = params[0];
const int max_blocks = params[1];

const int seq = find_seq_for_query_block(cu_seqlens_q, num_seqs, block, BQ);
const int q_start = cu_seqlens_q[seq];
const int q_len = cu_seqlens_q[seq + 1] - q_start;
const int local_block = block - (q_start / BQ + seq);
if (local_block * BQ >= q_len) {
    return;  // surplus threadgroup: the whole threadgroup exits before any barrier
}
const int first_row = local_block * BQ;
const int rows_here = metal::min(BQ, q_len - first_row);
const int context_len = context_lens[seq];
const int offset = context_len - q_len;  // row j sees KV positions < offset + j + 1
const int kv_end = offset + first_row + rows_here;  // what the last row of this block can see
const int kv_head = head / (NUM_Q_HEADS / NUM_KV_HEADS);
const auto table_row = block_tables + seq * max_blocks;  // device or constant pointer (see header)

float q_reg[ROWS_PER_SIMDGROUP][DIMS_PER_LANE];
float acc[ROWS_PER_SIMDGROUP][DIMS_PER_LANE];
float row_max[ROWS_PER_SIMDGROUP];
float row_sum[ROWS_PER_SIMDGROUP];
for (int r = 0; r < ROWS_PER_SIMDGROUP; ++r) {
    const int row = first_row + int(simdgroup) * ROWS_PER_SIMDGROUP + r;  // row within the sequence
    const int q_base = ((q_start + row) * NUM_Q_HEADS + head) * HEAD_DIM;
    for (int i = 0; i < DIMS_PER_LANE; ++i) {
        const int d = int(lane) + 32 * i;
        q_reg[r][i] = (row < q_len && d < HEAD_DIM) ? float(q[q_base + d]) * scale[0] : 0.0f;
        acc[r][i] = 0.0f;
    }
    row_max[r] = -INFINITY;
    row_sum[r] = 0.0f;
}

for (int tile_start = 0; tile_start < kv_end; tile_start += BK) {
    // Every thread helps stage the tile; positions past kv_end are zero-filled and never scored.
    for (int e = int(tid); e < BK * HEAD_DIM; e += THREADS) {
        const int pos = tile_start + e / HEAD_DIM;
        const int d = e % HEAD_DIM;
        float k_val = 0.0f;
        float v_val = 0.0f;
        if (pos < kv_end) {
            const int kv_base = (kv_slot(table_row, pos, BLOCK_SIZE) * NUM_KV_HEADS + kv_head) * HEAD_DIM;
            k_val = float(k_cache[kv_base + d]);
            v_val = float(v_cache[kv_base + d]);
        }
        k_tile[e] = k_val;
        v_tile[e] = v_val;
    }
    metal::threadgroup_barrier(metal::mem_flags::mem_threadgroup);

    const int tile_len = metal::min(BK, kv_end - tile_start);
    for (int kk = 0; kk < tile_len; ++kk) {
        const int pos = tile_start + kk;
        for (int r = 0; r < ROWS_PER_SIMDGROUP; ++r) {
            const int row = first_row + int(simdgroup) * ROWS_PER_SIMDGROUP + r;
            // Uniform across the simdgroup (all lanes share the row), so simd_sum below stays convergent.
            if (row >= q_len || pos >= offset + row + 1) {
                continue;
            }
            float partial = 0.0f;
            for (int i = 0; i < DIMS_PER_LANE; ++i) {
                const int d = int(lane) + 32 * i;
                if (d < HEAD_DIM) {
                    partial += q_reg[r][i] * k_tile[kk * HEAD_DIM + d];
                }
            }
            const float score = metal::simd_sum(partial);
            const float new_max = metal::max(row_max[r], score);
            const float correction = metal::exp(row_max[r] - new_max);
            const float p = metal::exp(score - new_max);
            row_sum[r] = row_sum[r] * correction + p;
            for (int i = 0; i < DIMS_PER_LANE; ++i) {
                const int d = int(lane) + 32 * i;
                const float v = d < HEAD_DIM ? v_tile[kk * HEAD_DIM + d] : 0.0f;
                acc[r][i] = acc[r][i] * correction + p * v;
            }
            row_max[r] = new_max;
        }
    }
    metal::threadgroup_barrier(metal::mem_flags::mem_threadgroup);  // tile fully read before it is rewritten
}

for (int r = 0; r < ROWS_PER_SIMDGROUP; ++r) {
    const int row = first_row + int(simdgroup) * ROWS_PER_SIMDGROUP + r;
    if (row >= q_len) {
        continue;
    }
    const int q_base = ((q_start + row) * NUM_Q_HEADS + head) * HEAD_DIM;
    for (int i = 0; i < DIMS_PER_LANE; ++i) {
        const int d = int(lane) + 32 * i;
        if (d < HEAD_DIM) {
            out[q_base + d] = T(acc[r][i] / row_sum[r]);  // every row sees at least position 0
        }
    }
}
