"""The CUDA source of the Hopper paged attention kernel (`engine/cuda_attention.py` says how it is used).

FlashAttention's scheme on `wgmma`: a warpgroup takes 64 query rows of one sequence and one q head; q and the
probabilities are the A operand from registers; K and V tiles of 64 keys come into shared memory by `cp.async`,
stored in the 128-byte swizzled layout `wgmma` reads through matrix descriptors, in a ring of `STAGES` tiles in
dynamic shared memory (the next tile's K and V load while this one's are used). The source is header-free: NVRTC
compiles it in a fraction of a second (engine/nvrtc.py), for sm_90a, whose `wgmma` it needs.

The main loop's speed is instruction issue, not the tensor cores: its warps also issue the loads and the softmax.
So what runs per tile is kept short (docs/cuda_kernels.md has the measurements):
- the loads (`LEAN_LOADS`, where the block size allows): a thread loads the same 16-byte column of every eighth
  row of a tile, so its offsets into a cache block and into shared memory are fixed at the start, a tile costs one
  block-table read per cache block it spans, and K and V share the addresses. The general form, a table read and
  an address per row, remains for block sizes it does not fit;
- the softmax takes the raw scores' maximum and folds the scale into exp2's argument (one FMA a score).
"""

from __future__ import annotations

import mlx.core as mx

BLOCK_M = 64        # query rows of a thread block (one warpgroup)
BLOCK_N = 64        # keys of a tile
THREADS = 128
STAGES = 2          # K/V tiles in flight or in use per block: loads are issued STAGES - 1 tiles ahead
HEAD_DIMS = (128,)   # the Qwen decoders' head size; 64 failed the start-up check on an H100 (not pursued)
TYPES = {mx.bfloat16: ("bf16", "bf16x2"), mx.float16: ("f16", "f16x2")}

_BODY = r"""
#define DT (D / 8)
#define NT (BLOCK_N / 8)

__device__ __forceinline__ unsigned int smem_u32(const void* p) {
    unsigned long long a; asm("cvta.to.shared.u64 %0, %1;" : "=l"(a) : "l"(p)); return (unsigned int)a;
}
__device__ __forceinline__ void cp_async16(unsigned int dst, const void* src, int bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" :: "r"(dst), "l"(src), "r"(bytes));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;\n" :: "n"(N)); }
__device__ __forceinline__ void fence_async_smem() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_wait0() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void reg_fence(float* r) {
    #pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i]) :: "memory");
}
__device__ __forceinline__ unsigned int pack2(float lo, float hi) {
    unsigned int r; asm("cvt.rn." PACK_T ".f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo)); return r;
}
__device__ __forceinline__ float fast_exp2(float x) {
    float y; asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x)); return y;
}
/* element offset of (key row, 8-column group) in a K or V tile: 64-column atoms (BLOCK_N rows of 128 bytes), a
   row's 16-byte chunks permuted by its low three bits (the 128-byte swizzle wgmma reads without bank conflicts) */
__device__ __forceinline__ int tiled(int row, int d8) {
    return (d8 >> 3) * (BLOCK_N * 64) + row * 64 + (((d8 & 7) ^ (row & 7)) * 8);
}
__device__ __forceinline__ unsigned long long make_desc(const void* smem, unsigned int lbo, unsigned int sbo) {
    return (unsigned long long)((smem_u32(smem) & 0x3FFFF) >> 4) | ((unsigned long long)((lbo >> 4) & 0x3FFF) << 16)
         | ((unsigned long long)((sbo >> 4) & 0x3FFF) << 32) | (1ull << 62);   /* 128-byte swizzle */
}
WGMMA_HELPERS

extern "C" __global__ void __launch_bounds__(128) KERNEL_NAME(
        const unsigned short* q, const unsigned short* k_cache, const unsigned short* v_cache,
        const int* block_tables, const int* cu_seqlens_q, const int* context_lens, const int* tile_seq,
        const int* tile_start, const float* scale_log2_in, unsigned short* out, int q_row_heads, int max_blocks) {
    /* STAGES rings of K and V tiles in dynamic shared memory, each tile at a 1,024-byte boundary (the swizzle's) */
    extern __shared__ unsigned char smem_raw[];
    unsigned short* const k_ring =
        (unsigned short*)(smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u));
    unsigned short* const v_ring = k_ring + STAGES * BLOCK_N * D;
    const float scale_log2 = scale_log2_in[0];
    const int tile = blockIdx.x, h = blockIdx.y, kvh = h / (HQ / HKV);
    const int seq = tile_seq[tile], q0 = tile_start[tile];
    const int tok0 = cu_seqlens_q[seq];
    const int q_len = cu_seqlens_q[seq + 1] - tok0;
    const int ctx = context_lens[seq];
    const int prefix = ctx - q_len;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t4 = lane % 4;
    const int* table = block_tables + (long long)seq * max_blocks;
    const int last_row = min(q0 + BLOCK_M, q_len) - 1;
    const int key_end = min(ctx, prefix + last_row + 1);
    const int tiles = (key_end + BLOCK_N - 1) / BLOCK_N;
    const int masked_from = prefix + q0 + 1;
    const int r0 = q0 + warp * 16 + g, r1 = r0 + 8;

    unsigned int qf[D / 16][4];
    {
        const unsigned int* row0 =
            (const unsigned int*)(q + ((long long)(tok0 + min(r0, q_len - 1)) * q_row_heads + h) * D);
        const unsigned int* row1 =
            (const unsigned int*)(q + ((long long)(tok0 + min(r1, q_len - 1)) * q_row_heads + h) * D);
        #pragma unroll
        for (int ks = 0; ks < D / 16; ++ks) {
            qf[ks][0] = row0[ks * 8 + t4];
            qf[ks][1] = row1[ks * 8 + t4];
            qf[ks][2] = row0[ks * 8 + 4 + t4];
            qf[ks][3] = row1[ks * 8 + 4 + t4];
        }
    }

#if LEAN_LOADS
    /* A thread loads the same 16-byte chunk (column group d8) of rows row0, row0 + RPP, ... of every K and V tile:
       its offsets into a cache block and into a tile are fixed, a tile needs one block-table entry per cache block
       it spans, and K and V share them. (Rows RPP apart keep their swizzle, so a pass is 128 bytes a row further.) */
    const int d8 = threadIdx.x % DT, row0 = threadIdx.x / DT;
    const long long chunk = ((long long)row0 * HKV + kvh) * D + d8 * 8;
    const unsigned int k_dst0 = smem_u32(k_ring + tiled(row0, d8)), v_dst0 = smem_u32(v_ring + tiled(row0, d8));
    auto load_kv = [&](int slot, int kstart) {
        const unsigned int tile_bytes = slot * BLOCK_N * D * 2;
        #pragma unroll
        for (int j = 0; j < BLOCK_N / SPAN; ++j) {   /* the cache blocks a tile spans, SPAN keys of each */
            const int first = kstart + j * SPAN;
            const long long base = first < ctx ? (long long)table[first / BS] * (BS * HKV * D)
                                                     + (long long)(first % BS) * (HKV * D) : 0;
            #pragma unroll
            for (int r = 0; r < SPAN / RPP; ++r) {
                const bool live = first + r * RPP + row0 < ctx;
                const long long off = live ? base + chunk + (long long)(r * RPP) * (HKV * D) : 0;
                const unsigned int dst = tile_bytes + (j * SPAN + r * RPP) * 128;
                cp_async16(k_dst0 + dst, k_cache + off, live ? 16 : 0);
                cp_async16(v_dst0 + dst, v_cache + off, live ? 16 : 0);
            }
        }
    };
#else
    auto load_tile = [&](const unsigned short* cache, unsigned short* dst, int kstart) {
        #pragma unroll
        for (int i = 0; i < BLOCK_N * DT / 128; ++i) {
            const int c = threadIdx.x + i * 128;
            const int d8 = c % DT, row = c / DT;
            const int key = kstart + row;
            const bool live = key < ctx;
            const int block = live ? table[key / BS] : 0;
            const unsigned short* src =
                cache + (((long long)block * BS + (live ? key % BS : 0)) * HKV + kvh) * D + d8 * 8;
            cp_async16(smem_u32(dst + tiled(row, d8)), src, live ? 16 : 0);
        }
    };
    auto load_kv = [&](int slot, int kstart) {
        load_tile(k_cache, k_ring + slot * BLOCK_N * D, kstart);
        load_tile(v_cache, v_ring + slot * BLOCK_N * D, kstart);
    };
#endif

    float o[DT * 4];
    #pragma unroll
    for (int i = 0; i < DT * 4; ++i) o[i] = 0.0f;
    float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.0f, l1 = 0.0f;
    /* K is K-major for the scores (8-row groups 1,024 bytes apart); V is MN-major for its product (its 64-column
       atoms BLOCK_N * 128 bytes apart, 8-row groups 1,024) */
    const unsigned long long k_desc0 = make_desc(k_ring, 16, 1024);
    const unsigned long long v_desc0 = make_desc(v_ring, BLOCK_N * 128, 1024);

    /* tiles n .. n + STAGES - 2 are in flight when tile n's turn comes: each load has STAGES - 1 tiles' work to land */
    #pragma unroll
    for (int i = 0; i < STAGES - 1; ++i) {
        if (i < tiles) load_kv(i, i * BLOCK_N);
        cp_commit();
    }
    for (int n = 0; n < tiles; ++n) {
        const int kstart = n * BLOCK_N;
        const int stage = n % STAGES;
        cp_wait<STAGES - 2>();   /* tile n's group is done; later ones may still fly */
        fence_async_smem();
        __syncthreads();         /* every thread is past tile n - 1: its buffers are free */
        {
            const int ahead = n + STAGES - 1, slot = ahead % STAGES;
            if (ahead < tiles) load_kv(slot, ahead * BLOCK_N);
            cp_commit();         /* empty past the last tile, so the group count stays one a tile */
        }
        const unsigned long long k_desc = k_desc0 + (unsigned long long)((stage * BLOCK_N * D * 2) >> 4);
        const unsigned long long v_desc = v_desc0 + (unsigned long long)((stage * BLOCK_N * D * 2) >> 4);

        float s[NT * 4];
        #pragma unroll
        for (int i = 0; i < NT * 4; ++i) s[i] = 0.0f;
        reg_fence<NT * 4>(s);
        wg_fence();
        #pragma unroll
        for (int ks = 0; ks < D / 16; ++ks)   /* k-step ks: 32 bytes into a row, 64-column atoms BLOCK_N rows apart */
            wgmma_s(s, qf[ks], k_desc + (unsigned long long)((((ks >> 2) * BLOCK_N * 128) + (ks & 3) * 32) >> 4));
        wg_commit();
        wg_wait0();
        reg_fence<NT * 4>(s);

        float tm0 = -INFINITY, tm1 = -INFINITY;
        const bool edge = kstart + BLOCK_N > masked_from || kstart + BLOCK_N > ctx;
        #pragma unroll
        for (int j = 0; j < NT; ++j) {
            #pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int key = kstart + j * 8 + 2 * t4 + e;
                float a = s[4 * j + e], b = s[4 * j + 2 + e];   /* raw scores: the scale goes into exp2's FMA */
                if (edge) {
                    if (key >= ctx || key > prefix + r0) a = -INFINITY;
                    if (key >= ctx || key > prefix + r1) b = -INFINITY;
                }
                s[4 * j + e] = a; s[4 * j + 2 + e] = b;
                tm0 = fmaxf(tm0, a); tm1 = fmaxf(tm1, b);
            }
        }
        tm0 = fmaxf(tm0, __shfl_xor_sync(0xffffffffu, tm0, 1));
        tm0 = fmaxf(tm0, __shfl_xor_sync(0xffffffffu, tm0, 2));
        tm1 = fmaxf(tm1, __shfl_xor_sync(0xffffffffu, tm1, 1));
        tm1 = fmaxf(tm1, __shfl_xor_sync(0xffffffffu, tm1, 2));
        /* m0, m1: the rows' largest raw scores so far; b0, b1 the same scaled (base 2), 0 while a row has none */
        const float nm0 = fmaxf(m0, tm0), nm1 = fmaxf(m1, tm1);
        const float b0 = nm0 == -INFINITY ? 0.0f : nm0 * scale_log2, b1 = nm1 == -INFINITY ? 0.0f : nm1 * scale_log2;
        const float alpha0 = fast_exp2(fmaf(m0, scale_log2, -b0)), alpha1 = fast_exp2(fmaf(m1, scale_log2, -b1));
        m0 = nm0; m1 = nm1;
        float ps0 = 0.0f, ps1 = 0.0f;
        #pragma unroll
        for (int j = 0; j < NT; ++j) {
            s[4 * j] = fast_exp2(fmaf(s[4 * j], scale_log2, -b0));
            s[4 * j + 1] = fast_exp2(fmaf(s[4 * j + 1], scale_log2, -b0));
            s[4 * j + 2] = fast_exp2(fmaf(s[4 * j + 2], scale_log2, -b1));
            s[4 * j + 3] = fast_exp2(fmaf(s[4 * j + 3], scale_log2, -b1));
            ps0 += s[4 * j] + s[4 * j + 1];
            ps1 += s[4 * j + 2] + s[4 * j + 3];
        }
        l0 = l0 * alpha0 + ps0;
        l1 = l1 * alpha1 + ps1;
        #pragma unroll
        for (int i = 0; i < DT; ++i) {
            o[4 * i] *= alpha0; o[4 * i + 1] *= alpha0; o[4 * i + 2] *= alpha1; o[4 * i + 3] *= alpha1;
        }

        unsigned int pa[BLOCK_N / 16][4];
        #pragma unroll
        for (int kk = 0; kk < BLOCK_N / 16; ++kk) {
            pa[kk][0] = pack2(s[8 * kk], s[8 * kk + 1]);
            pa[kk][1] = pack2(s[8 * kk + 2], s[8 * kk + 3]);
            pa[kk][2] = pack2(s[8 * kk + 4], s[8 * kk + 5]);
            pa[kk][3] = pack2(s[8 * kk + 6], s[8 * kk + 7]);
        }
        reg_fence<DT * 4>(o);
        wg_fence();
        #pragma unroll
        for (int kk = 0; kk < BLOCK_N / 16; ++kk)   /* k-step kk: sixteen key rows of 128 bytes */
            wgmma_o(o, pa[kk], v_desc + (unsigned long long)((kk * 16 * 128) >> 4));
        wg_commit();
        wg_wait0();
        reg_fence<DT * 4>(o);
    }
    cp_wait<0>();

    l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
    l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
    const float inv0 = l0 > 0.0f ? 1.0f / l0 : 0.0f, inv1 = l1 > 0.0f ? 1.0f / l1 : 0.0f;
    unsigned int* out0 = (unsigned int*)(out + ((long long)(tok0 + r0) * HQ + h) * D);
    unsigned int* out1 = (unsigned int*)(out + ((long long)(tok0 + r1) * HQ + h) * D);
    #pragma unroll
    for (int j = 0; j < DT; ++j) {
        if (r0 < q_len) out0[j * 4 + t4] = pack2(o[4 * j] * inv0, o[4 * j + 1] * inv0);
        if (r1 < q_len) out1[j * 4 + t4] = pack2(o[4 * j + 2] * inv1, o[4 * j + 3] * inv1);
    }
}
"""


def _wgmma_helper(name: str, n: int, mma_t: str, trans_b: int) -> str:
    """`name(float* d, const unsigned* a, unsigned long long desc)`: d += a (registers) x B (descriptor), m64nNk16."""
    regs = n // 2   # accumulators a thread holds: 64 x n over 128 threads
    d = ", ".join(f"%{i}" for i in range(regs))
    outs = ", ".join(f'"+f"(d[{i}])' for i in range(regs))
    return (f"__device__ __forceinline__ void {name}(float* d, const unsigned int* a, unsigned long long desc) {{\n"
            f'    asm volatile("wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{mma_t}.{mma_t} "\n'
            f'                 "{{{d}}}, {{%{regs}, %{regs + 1}, %{regs + 2}, %{regs + 3}}}, %{regs + 4}, "\n'
            f'                 "1, 1, 1, {trans_b};\\n"\n'
            f'                 : {outs}\n'
            f'                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));\n}}\n')


ARCH = "sm_90a"   # the compile target: `wgmma` needs the architecture-specific sm_90a


def shared_memory(d: int) -> int:
    """Bytes of dynamic shared memory a block asks for: the K and V rings (half precision), plus slack to start
    them at a 1,024-byte boundary, which the 128-byte swizzle's descriptors assume."""
    return STAGES * 2 * BLOCK_N * d * 2 + 1024


def _load_pass(d: int, block_size: int) -> tuple[int, int]:
    """(rows of a tile one pass of the block's 16-byte loads covers, keys of a tile in one cache block): the
    lean loads' `RPP` and `SPAN`."""
    return THREADS // (d // 8), min(block_size, BLOCK_N)


def lean_loads(d: int, block_size: int) -> bool:
    """Whether the kernel's loads take the lean form (module docstring): a pass of the block's 16-byte loads covers
    whole rows, a whole number of passes fits in a tile's share of a cache block, and tiles and cache blocks nest."""
    rows_a_pass, span = _load_pass(d, block_size)
    return THREADS % (d // 8) == 0 and span % rows_a_pass == 0 and max(block_size, BLOCK_N) % span == 0


def kernel_source(dtype: mx.Dtype, hq: int, hkv: int, d: int, block_size: int) -> tuple[str, str]:
    """(source, kernel name): one header-free translation unit for `mx.fast.precompiled_cuda_kernel` (the
    inputs, the output, then the scalars `q_row_heads` and `max_blocks`). The scale comes as an input array:
    MLX 0.32's binding refuses float scalars."""
    mma_t, pack_t = TYPES[dtype]
    name = f"batchjob_hopper_paged_{mma_t}_{hq}_{hkv}_{d}_{block_size}"
    rows_a_pass, span = _load_pass(d, block_size)
    defines = {"KERNEL_NAME": name, "HQ": hq, "HKV": hkv, "D": d, "BS": block_size, "BLOCK_M": BLOCK_M,
               "STAGES": STAGES, "LEAN_LOADS": int(lean_loads(d, block_size)), "RPP": rows_a_pass, "SPAN": span,
               "BLOCK_N": BLOCK_N, "PACK_T": f'"{pack_t}"', "INFINITY": "__int_as_float(0x7f800000)"}
    helpers = _wgmma_helper("wgmma_s", BLOCK_N, mma_t, 0) + _wgmma_helper("wgmma_o", d, mma_t, 1)
    return "".join(f"#define {k} {v}\n" for k, v in defines.items()) + _BODY.replace("WGMMA_HELPERS", helpers), name
