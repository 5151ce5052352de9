// Kernels of the decode benchmark's clock (flashcupy/bench_decode.py), not of attention.
//
// spin_kernel: one thread busy for `ns` nanoseconds of the GPU's global timer, so the host can
//     queue a timed call and its events behind it: the events then see the GPU's time alone.
// read_kernel: every 16 bytes of `words` read once (an L2 flush before a cold call, and the
//     same-run read bandwidth); nothing is written unless the data holds the impossible pattern.
#include "ptx.cuh"

FC_DEVICE unsigned long long global_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

extern "C" __global__ void spin_kernel(unsigned long long ns) {
    const unsigned long long start = global_ns();
    while (global_ns() - start < ns) {
    }
}

// Each thread has kLoads 16-byte loads in flight per pass (enough bytes in flight to cover the
// memory's latency at full bandwidth), then the tail one at a time.
extern "C" __global__ void read_kernel(const uint4* words, long long count, uint4* sink) {
    constexpr int kLoads = 8;
    uint4 acc = make_uint4(0, 0, 0, 0);
    const long long threads = (long long)gridDim.x * blockDim.x, first = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    long long i = first;
    for (; i + (kLoads - 1) * threads < count; i += kLoads * threads) {
        uint4 w[kLoads];
#pragma unroll
        for (int j = 0; j < kLoads; ++j) w[j] = words[i + j * threads];
#pragma unroll
        for (int j = 0; j < kLoads; ++j) {
            acc.x ^= w[j].x;
            acc.y ^= w[j].y;
            acc.z ^= w[j].z;
            acc.w ^= w[j].w;
        }
    }
    for (; i < count; i += threads) {
        const uint4 w = words[i];
        acc.x ^= w.x;
        acc.y ^= w.y;
        acc.z ^= w.z;
        acc.w ^= w.w;
    }
    if (acc.x == 0x9e3779b9u && acc.y == 0x7f4a7c15u && acc.z == 0x3c6ef372u && acc.w == 0xa54ff53au) *sink = acc;
}
