// A tiny CPU stand-in for the parts of Metal our kernel bodies use, so the exact kernel text can run here.
// The threads of a threadgroup are cooperative fibers (ucontext) on one OS thread: simd_sum and
// threadgroup_barrier really wait for every thread of their group, and a round in which no waiting thread
// can advance (divergent simd_sum, a barrier some threads skip) aborts the run instead of passing.
#include <ucontext.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

// Address-space words last: every system header must be included above this line.

#define device
#define constant
#define threadgroup static

typedef unsigned int uint;
struct uint3 { uint x, y, z; };
typedef _Float16 float16_t;

struct EmuBarrier {
    int count = 0, arrived = 0;
    long generation = 0;
};

struct EmuFiber {
    ucontext_t ctx;
    std::vector<char> stack;
    uint tid = 0;
    bool done = false;
};

static ucontext_t emu_scheduler;
static EmuFiber* emu_current = nullptr;
static long emu_events = 0;  // arrivals and releases: proof that a scheduling round made progress
static std::vector<EmuBarrier> emu_simd_barriers;  // one per simdgroup
static std::vector<float> emu_simd_values;         // 32 lane values per simdgroup
static EmuBarrier emu_threadgroup_barrier;
static std::function<void(uint)> emu_thread_body;

static void emu_wait(EmuBarrier& b) {
    const long gen = b.generation;
    ++emu_events;
    if (++b.arrived == b.count) {
        b.arrived = 0;
        ++b.generation;
        return;
    }
    while (b.generation == gen) swapcontext(&emu_current->ctx, &emu_scheduler);
}

static void emu_fiber_entry() {
    emu_thread_body(emu_current->tid);
    emu_current->done = true;
}

// Run one threadgroup of n threads to completion.
static void emu_run_threadgroup(std::vector<EmuFiber>& fibers, uint n) {
    emu_threadgroup_barrier = EmuBarrier{int(n)};
    emu_simd_barriers.assign((n + 31) / 32, EmuBarrier{32});
    emu_simd_values.assign(((n + 31) / 32) * 32, 0.0f);
    for (uint t = 0; t < n; ++t) {
        EmuFiber& f = fibers[t];
        f.tid = t;
        f.done = false;
        getcontext(&f.ctx);
        f.ctx.uc_stack.ss_sp = f.stack.data();
        f.ctx.uc_stack.ss_size = f.stack.size();
        f.ctx.uc_link = &emu_scheduler;
        makecontext(&f.ctx, emu_fiber_entry, 0);
    }
    uint alive = n;
    while (alive > 0) {
        const long before = emu_events;
        uint finished = 0;
        for (uint t = 0; t < n; ++t) {
            if (fibers[t].done) continue;
            emu_current = &fibers[t];
            swapcontext(&emu_scheduler, &fibers[t].ctx);
            if (fibers[t].done) ++finished;
        }
        alive -= finished;
        if (alive > 0 && finished == 0 && emu_events == before) {
            std::fprintf(stderr, "emulator: threads wait at a barrier or simd_sum that not every thread reaches\n");
            std::exit(3);
        }
    }
}

namespace metal {
using std::exp;
using std::max;
using std::min;
enum class mem_flags { mem_none, mem_device, mem_threadgroup };
inline void threadgroup_barrier(mem_flags) { emu_wait(emu_threadgroup_barrier); }
inline float simd_sum(float x) {
    const uint sg = emu_current->tid / 32, lane = emu_current->tid % 32;
    emu_simd_values[sg * 32 + lane] = x;
    emu_wait(emu_simd_barriers[sg]);
    float total = 0.0f;
    for (int i = 0; i < 32; ++i) total += emu_simd_values[sg * 32 + i];
    emu_wait(emu_simd_barriers[sg]);  // nobody overwrites the values before every lane has read them
    return total;
}
}  // namespace metal
