// Per-token paged attention, CUDA twin of paged_attention_per_token.metal: one warp per (query token, head).
const int lane = int(threadIdx.x);
const int head = int(blockIdx.y);
const int token = int(blockIdx.z);
const int num_seqs = params[0];
const int max_blocks = params[1];

const int seq = find_seq_for_token(cu_seqlens_q, num_seqs, token);
const int q_start = cu_seqlens_q[seq];
const int q_len = cu_seqlens_q[seq + 1] - q_start;
const int context_len = context_lens[seq];
const int visible = context_len - q_len + (token - q_start) + 1;
const int kv_head = head / (NUM_Q_HEADS / NUM_KV_HEADS);
const int* table_row = block_tables + seq * max_blocks;

constexpr int DIMS_PER_LANE = (HEAD_DIM + 31) / 32;
float q_reg[DIMS_PER_LANE];
float acc[DIMS_PER_LANE];
const int q_base = (token * NUM_Q_HEADS + head) * HEAD_DIM;
#pragma unroll
for (int i = 0; i < DIMS_PER_LANE; ++i) {
    const int d = lane + 32 * i;
    q_reg[i] = d < HEAD_DIM ? static_cast<float>(q[q_base + d]) * scale[0] : 0.0f;
    acc[i] = 0.0f;
}

float row_max = negative_infinity();
float row_sum = 0.0f;
for (int pos = 0; pos < visible; ++pos) {
    const int kv_base = (kv_slot(table_row, pos, BLOCK_SIZE) * NUM_KV_HEADS + kv_head) * HEAD_DIM;
    float partial = 0.0f;
#pragma unroll
    for (int i = 0; i < DIMS_PER_LANE; ++i) {
        const int d = lane + 32 * i;
        if (d < HEAD_DIM) {
            partial += q_reg[i] * static_cast<float>(k_cache[kv_base + d]);
        }
    }
    const float score = warp_sum(partial);
    const float new_max = fmaxf(row_max, score);
    const float correction = expf(row_max - new_max);
    const float p = expf(score - new_max);
    row_sum = row_sum * correction + p;
#pragma unroll
    for (int i = 0; i < DIMS_PER_LANE; ++i) {
        const int d = lane + 32 * i;
        const float v = d < HEAD_DIM ? static_cast<float>(v_cache[kv_base + d]) : 0.0f;
        acc[i] = acc[i] * correction + p * v;
    }
    row_max = new_max;
}

#pragma unroll
for (int i = 0; i < DIMS_PER_LANE; ++i) {
    const int d = lane + 32 * i;
    if (d < HEAD_DIM) {
        out[q_base + d] = static_cast<T>(acc[i] / row_sum);
    }
}
