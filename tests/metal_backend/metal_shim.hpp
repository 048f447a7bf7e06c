// A tiny CPU stand-in for the parts of Metal our kernel bodies use, so the exact kernel text can run here.
// Threads of one threadgroup are real std::threads; simd_sum and threadgroup_barrier are real barriers with a
// timeout, so a divergent simd_sum or a barrier some threads skip fails loudly instead of passing.
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <algorithm>

#define device
#define constant
#define threadgroup static

typedef unsigned int uint;
struct uint3 { uint x, y, z; };
typedef _Float16 float16_t;

struct TimedBarrier {
    std::mutex m;
    std::condition_variable cv;
    int count = 0, waiting = 0;
    long generation = 0;
    void wait(const char* what) {
        std::unique_lock<std::mutex> lock(m);
        long gen = generation;
        if (++waiting == count) {
            waiting = 0;
            ++generation;
            cv.notify_all();
            return;
        }
        if (!cv.wait_for(lock, std::chrono::seconds(5), [&] { return generation != gen; })) {
            std::fprintf(stderr, "emulator: %s: not every thread arrived (divergent control flow)\n", what);
            std::_Exit(3);
        }
    }
};

struct SimdContext { uint lane, simdgroup; };
static thread_local SimdContext simd_ctx;
static TimedBarrier* simd_barriers;   // one per simdgroup
static float (*simd_values)[32];      // one row of lane values per simdgroup
static TimedBarrier threadgroup_bar;

namespace metal {
using std::exp;
using std::max;
using std::min;
enum class mem_flags { mem_none, mem_device, mem_threadgroup };
inline void threadgroup_barrier(mem_flags) { threadgroup_bar.wait("threadgroup_barrier"); }
inline float simd_sum(float x) {
    const uint sg = simd_ctx.simdgroup;
    simd_values[sg][simd_ctx.lane] = x;
    simd_barriers[sg].wait("simd_sum");
    float total = 0.0f;
    for (int i = 0; i < 32; ++i) total += simd_values[sg][i];
    simd_barriers[sg].wait("simd_sum");
    return total;
}
}  // namespace metal
