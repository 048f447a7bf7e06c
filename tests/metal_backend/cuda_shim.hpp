// A CPU stand-in for the CUDA features our paged attention kernels use, built on the Metal shim's fibers:
// each block's threads are cooperative fibers, __syncthreads and __shfl_xor_sync really wait for every thread
// of their block / warp, and a round in which no waiting thread can advance (a shuffle or barrier that not
// every thread reaches) aborts the run instead of passing.
#include <math.h>

#include <cstring>

#include "metal_shim.hpp"

#define __device__
#define __forceinline__ inline
#define __shared__ static

static uint3 emu_block_idx = {0, 0, 0};
static uint3 emu_block_dim = {1, 1, 1};

static inline uint3 emu_thread_idx() {
    const uint t = emu_current->tid;
    return {t % emu_block_dim.x, (t / emu_block_dim.x) % emu_block_dim.y, t / (emu_block_dim.x * emu_block_dim.y)};
}

#define threadIdx (emu_thread_idx())
#define blockIdx (emu_block_idx)
#define blockDim (emu_block_dim)

static inline void __syncthreads() { emu_wait(emu_threadgroup_barrier); }

static inline float __shfl_xor_sync(unsigned, float x, int lane_mask) {
    const uint warp = emu_current->tid / 32, lane = emu_current->tid % 32;
    emu_simd_values[warp * 32 + lane] = x;
    emu_wait(emu_simd_barriers[warp]);
    const float other = emu_simd_values[warp * 32 + (lane ^ uint(lane_mask))];
    emu_wait(emu_simd_barriers[warp]);  // nobody overwrites a value before its partner has read it
    return other;
}

static inline float __int_as_float(int bits) {
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
}

using std::min;  // expf and fmaxf are the C library's, as on the GPU
