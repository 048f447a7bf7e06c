// Per-token paged attention: one simdgroup (32 threads) per (query token, query head).
// Best for decode-like batches (query length 1); see LAYOUT.md for buffers, grid and template constants.
const uint lane = thread_position_in_threadgroup.x;
const int head = int(threadgroup_position_in_grid.y);
const int token = int(threadgroup_position_in_grid.z);
const int num_seqs = params[0];
const int max_blocks = params[1];

const int seq = find_seq_for_token(cu_seqlens_q, num_seqs, token);
const int q_start = cu_seqlens_q[seq];
const int q_len = cu_seqlens_q[seq + 1] - q_start;
const int context_len = context_lens[seq];
// Causal with the context offset: query row j of the sequence sees KV positions < context_len - q_len + j + 1.
const int visible = context_len - q_len + (token - q_start) + 1;
const int kv_head = head / (NUM_Q_HEADS / NUM_KV_HEADS);
const auto table_row = block_tables + seq * max_blocks;  // device or constant pointer (see header)

constexpr int DIMS_PER_LANE = (HEAD_DIM + 31) / 32;
float q_reg[DIMS_PER_LANE];
float acc[DIMS_PER_LANE];
const int q_base = (token * NUM_Q_HEADS + head) * HEAD_DIM;
for (int i = 0; i < DIMS_PER_LANE; ++i) {
    const int d = int(lane) + 32 * i;
    q_reg[i] = d < HEAD_DIM ? float(q[q_base + d]) * scale[0] : 0.0f;
    acc[i] = 0.0f;
}

// Online softmax in fp32: running max, running denominator, rescaled accumulator.
float row_max = -INFINITY;
float row_sum = 0.0f;
for (int pos = 0; pos < visible; ++pos) {
    const int kv_base = (kv_slot(table_row, pos, BLOCK_SIZE) * NUM_KV_HEADS + kv_head) * HEAD_DIM;
    float partial = 0.0f;
    for (int i = 0; i < DIMS_PER_LANE; ++i) {
        const int d = int(lane) + 32 * i;
        if (d < HEAD_DIM) {
            partial += q_reg[i] * float(k_cache[kv_base + d]);
        }
    }
    const float score = metal::simd_sum(partial);
    const float new_max = metal::max(row_max, score);
    const float correction = metal::exp(row_max - new_max);  // exp(-inf) = 0 on the first position
    const float p = metal::exp(score - new_max);
    row_sum = row_sum * correction + p;
    for (int i = 0; i < DIMS_PER_LANE; ++i) {
        const int d = int(lane) + 32 * i;
        const float v = d < HEAD_DIM ? float(v_cache[kv_base + d]) : 0.0f;
        acc[i] = acc[i] * correction + p * v;
    }
    row_max = new_max;
}

for (int i = 0; i < DIMS_PER_LANE; ++i) {
    const int d = int(lane) + 32 * i;
    if (d < HEAD_DIM) {
        out[q_base + d] = T(acc[i] / row_sum);  // visible >= 1, so row_sum > 0
    }
}
