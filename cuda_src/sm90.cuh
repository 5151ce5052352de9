// Hopper (sm_90a) instructions of the sm90 kernel families, as thin PTX wrappers: mbarriers, TMA
// bulk tensor loads, warpgroup matrix multiply-accumulate (wgmma), register reallocation and thread
// block clusters. Like ptx.cuh, no CUDA header: NVRTC alone builds them (with -arch=sm_90a; the
// decode kernels include them in sm_80 builds too, where only sm90 instances call them).
#pragma once
#include "ptx.cuh"

typedef unsigned long long u64;

// ---- mbarrier: a 64-bit shared-memory barrier with a phase bit and a transaction count ---------
FC_DEVICE void mbar_init(u32 bar, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count));
}
// Make the initialised barriers visible to the async proxy (TMA) and the other threads.
FC_DEVICE void mbar_fence_init() { asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }
FC_DEVICE void mbar_arrive(u32 bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// Arrive and add `bytes` to the transactions the current phase waits for (TMA completes them).
FC_DEVICE void mbar_arrive_expect_tx(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
// Wait until the phase of parity `parity` has completed. A new barrier counts its phase "before
// phase 0" (parity 1) as complete, so a producer's first wait on an empty slot, parity 1, passes.
FC_DEVICE void mbar_wait(u32 bar, u32 parity) {
    asm volatile("{\n .reg .pred done;\n"
                 "WAIT_%=:\n mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
                 " @!done bra WAIT_%=;\n}\n" ::"r"(bar), "r"(parity) : "memory");
}
// ---- TMA: bulk tensor copies described by a tensor map (encoded on the host) -------------------
// The tensor map is an opaque 128-byte, 64-byte aligned object; kernels take it inside a
// __grid_constant__ parameter so that its address is a parameter-space address.
struct alignas(64) TmaDesc {
    u64 bits[16];
};

FC_DEVICE void tma_prefetch_desc(const TmaDesc* desc) {
    asm volatile("prefetch.tensormap [%0];\n" ::"l"(desc) : "memory");
}
// A 4-D box (innermost coordinate first) into shared memory at `dst`; completion is counted on
// `bar` in bytes. Coordinates past the tensor's end read as zeros (and still count).
FC_DEVICE void tma_load_4d(u32 dst, const TmaDesc* desc, u32 bar, int c0, int c1, int c2, int c3) {
    asm volatile("cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {%3, %4, %5, %6}], [%2];\n"
                 ::"r"(dst), "l"(desc), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
                 : "memory");
}

// A 4-D box of float32 in shared memory at `src` added element-wise into global memory (the
// tensor map's layout) by TMA; coordinates past the tensor's end are dropped. Completion is tracked
// by bulk groups: bulk_commit closes one, bulk_wait_read<N> waits until at most N groups still read
// shared memory, bulk_wait<N> until at most N are unfinished.
FC_DEVICE void tma_reduce_add_4d(const TmaDesc* desc, u32 src, int c0, int c1, int c2, int c3) {
    asm volatile("cp.reduce.async.bulk.tensor.4d.global.shared::cta.add.tile.bulk_group"
                 " [%0, {%2, %3, %4, %5}], [%1];\n"
                 ::"l"(desc), "r"(src), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
                 : "memory");
}
// A 4-D box of shared memory at `src` stored into global memory (the tensor map's layout) by TMA;
// coordinates past the tensor's end are dropped. A bulk group, as the reduction.
FC_DEVICE void tma_store_4d(const TmaDesc* desc, u32 src, int c0, int c1, int c2, int c3) {
    asm volatile("cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%2, %3, %4, %5}], [%1];\n"
                 ::"l"(desc), "r"(src), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
                 : "memory");
}
// Shared-memory loads kept in program order with the wgmmas (asm volatile, as they are).
FC_DEVICE float lds_f32(u32 addr) {
    float v;
    asm volatile("ld.shared.f32 %0, [%1];\n" : "=f"(v) : "r"(addr));
    return v;
}
FC_DEVICE float2 lds_f32x2(u32 addr) {
    float2 v;
    asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];\n" : "=f"(v.x), "=f"(v.y) : "r"(addr));
    return v;
}
FC_DEVICE void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
template <int N>
FC_DEVICE void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory"); }
template <int N>
FC_DEVICE void bulk_wait() { asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(N) : "memory"); }

// This thread's warpgroup, as lane 0 of its warp has it: ptxas then knows it is the same across the
// warp and can keep what derives from it (tile addresses, wgmma descriptors) in uniform registers;
// from threadIdx.x / 128 it builds each descriptor in per-thread registers and moves it to uniform
// ones (two R2UR) before every wgmma. Which kernels gain from it is measured, not assumed: the
// uniform registers it takes are missed elsewhere (docs/PERF_NOTES.md).
FC_DEVICE int warpgroup_index() { return __shfl_sync(0xffffffffu, int(threadIdx.x) / 128, 0); }

// ---- shared memory written by threads, then read by the async proxy (wgmma, TMA) ----------------
FC_DEVICE void st_shared_u32(u32 addr, u32 v) { asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(v) : "memory"); }
// `x`, recomputed where it stands: ptxas cannot hoist it (or what is derived from it) out of a loop,
// where it would hold it in a register across the loop or spill it.
FC_DEVICE u32 in_place(u32 x) {
    u32 y;
    asm volatile("mov.b32 %0, %1;\n" : "=r"(y) : "r"(x));
    return y;
}
FC_DEVICE void st_shared_f32(u32 addr, float a) {
    asm volatile("st.shared.f32 [%0], %1;\n" ::"r"(addr), "f"(a) : "memory");
}
FC_DEVICE void st_shared_f32x2(u32 addr, float a, float b) {
    asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(addr), "f"(a), "f"(b) : "memory");
}
// stmatrix: 8 x 8 b16 matrices, each held as an mma fragment (lane 4 g + t: row g, columns 2 t,
// 2 t + 1, packed); lane 8 i + r gives the address of row r of matrix i (16 bytes).
FC_DEVICE void stmatrix_x4(u32 addr, u32 r0, u32 r1, u32 r2, u32 r3) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n"
                 ::"r"(addr), "r"(r0), "r"(r1), "r"(r2), "r"(r3) : "memory");
}
// stmatrix .trans: 8 x 8 b16 matrices, each held as an mma fragment (lane 4 g + t: row g, columns
// 2 t, 2 t + 1, packed), stored transposed: lane 8 i + r gives the address of row r of matrix i
// (16 bytes), which receives column r of the fragment. x2 reads addresses from lanes 0-15 only.
FC_DEVICE void stmatrix_x4_trans(u32 addr, u32 r0, u32 r1, u32 r2, u32 r3) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n"
                 ::"r"(addr), "r"(r0), "r"(r1), "r"(r2), "r"(r3) : "memory");
}
FC_DEVICE void stmatrix_x2_trans(u32 addr, u32 r0, u32 r1) {
    asm volatile("stmatrix.sync.aligned.m8n8.x2.trans.shared.b16 [%0], {%1, %2};\n" ::"r"(addr), "r"(r0), "r"(r1)
                 : "memory");
}
// Orders this thread's shared-memory writes before later async-proxy reads of them (with a barrier
// between the writers and the thread that issues the wgmma).
FC_DEVICE void fence_proxy_async_shared() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// ---- named barriers (ids 1..15; 0 is __syncthreads): warps of several warpgroups take turns ------
// bar.sync waits until `count` threads have arrived (itself included); bar.arrive only counts.
FC_DEVICE void named_bar_sync(int id, int count) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}
FC_DEVICE void named_bar_arrive(int id, int count) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}

// ---- register reallocation between warpgroups (setmaxnreg) -------------------------------------
template <int kRegs>
FC_DEVICE void regs_release() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs)); }
template <int kRegs>
FC_DEVICE void regs_claim() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs)); }

// ---- wgmma: D (64 x N, float32, registers) += A (64 x 16) * B (16 x N) for a warpgroup --------
// Shared-memory operands are named by 64-bit descriptors (gmma_desc). The accumulator of warp w of
// the warpgroup holds rows 16 w .. 16 w + 15 in the mma.sync m16n8 layout: d[4 j + e] is row
// 16 w + g + 8 (e / 2), column 8 j + 2 t + (e % 2) (lane = 4 g + t), so the sm80 helpers that work
// on [1][N / 8][4] fragments (softmax.cuh, mask.cuh, score_mod.cuh) apply unchanged.
FC_DEVICE void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
FC_DEVICE void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
FC_DEVICE void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }

// Pin registers in program order around the asynchronous wgmma: the compiler may not read the
// accumulators before wgmma_wait, nor move writes to them past the next issue.
template <int kN>
FC_DEVICE void fence_regs(float (&d)[kN]) {
#pragma unroll
    for (int i = 0; i < kN; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
template <int kN>
FC_DEVICE void fence_regs(u32 (&d)[kN]) {
#pragma unroll
    for (int i = 0; i < kN; ++i) asm volatile("" : "+r"(d[i])::"memory");
}

// Shared-memory matrix descriptor for the 128-byte swizzle (what TMA writes with
// CU_TENSOR_MAP_SWIZZLE_128B): start address >> 4 in bits 0-13, leading-dimension byte offset >> 4
// in bits 16-29, stride-dimension byte offset >> 4 in bits 32-45, layout 1 (128B swizzle) in bits
// 62-63. Tiles start on 1024-byte boundaries, so the base offset (bits 49-51) stays 0.
FC_DEVICE u64 gmma_desc(u32 smem_addr, u32 leading_bytes, u32 stride_bytes) {
    return u64((smem_addr & 0x3FFFF) >> 4) | (u64(leading_bytes >> 4) << 16) | (u64(stride_bytes >> 4) << 32) |
           (u64(1) << 62);
}

// The descriptor of the same layout `bytes` further on: only the start-address field changes, and
// it cannot carry out of its 14 bits (shared memory ends below 256 KiB), so one 32-bit add on the
// low word does it (cheaper than building each descriptor from its address).
FC_DEVICE u64 gmma_desc_advance(u64 desc, u32 bytes) {
    return (desc & 0xFFFFFFFF00000000ull) | u32(u32(desc) + (bytes >> 4));
}

#define FC_REGS_12 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11}"
#define FC_REGS_16 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}"
#define FC_REGS_24 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23}"
#define FC_REGS_32 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define FC_REGS_40 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39}"
#define FC_REGS_48 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47}"
#define FC_REGS_56 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55}"
#define FC_REGS_64 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"
#define FC_REGS_88 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87}"
#define FC_REGS_96 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95}"
#define FC_REGS_128 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}"
#define FC_AREGS_32 "{%32, %33, %34, %35}"
#define FC_AREGS_40 "{%40, %41, %42, %43}"
#define FC_AREGS_48 "{%48, %49, %50, %51}"
#define FC_AREGS_64 "{%64, %65, %66, %67}"
#define FC_AREGS_88 "{%88, %89, %90, %91}"
#define FC_AREGS_96 "{%96, %97, %98, %99}"
#define FC_AREGS_128 "{%128, %129, %130, %131}"
#define FC_ACC8(d, i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), \
                      "+f"(d[i + 6]), "+f"(d[i + 7])
#define FC_ACC12(d) FC_ACC8(d, 0), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11])
#define FC_ACC16(d) FC_ACC8(d, 0), FC_ACC8(d, 8)
#define FC_ACC24(d) FC_ACC8(d, 0), FC_ACC8(d, 8), FC_ACC8(d, 16)
#define FC_ACC32(d) FC_ACC8(d, 0), FC_ACC8(d, 8), FC_ACC8(d, 16), FC_ACC8(d, 24)
#define FC_ACC40(d) FC_ACC8(d, 0), FC_ACC8(d, 8), FC_ACC8(d, 16), FC_ACC8(d, 24), FC_ACC8(d, 32)
#define FC_ACC48(d) FC_ACC8(d, 0), FC_ACC8(d, 8), FC_ACC8(d, 16), FC_ACC8(d, 24), FC_ACC8(d, 32), FC_ACC8(d, 40)
#define FC_ACC56(d) FC_ACC8(d, 0), FC_ACC8(d, 8), FC_ACC8(d, 16), FC_ACC8(d, 24), FC_ACC8(d, 32), FC_ACC8(d, 40), FC_ACC8(d, 48)
#define FC_ACC64(d) FC_ACC8(d, 0), FC_ACC8(d, 8), FC_ACC8(d, 16), FC_ACC8(d, 24), FC_ACC8(d, 32), FC_ACC8(d, 40), FC_ACC8(d, 48), FC_ACC8(d, 56)
#define FC_ACC88(d) FC_ACC8(d, 0), FC_ACC8(d, 8), FC_ACC8(d, 16), FC_ACC8(d, 24), FC_ACC8(d, 32), FC_ACC8(d, 40), FC_ACC8(d, 48), FC_ACC8(d, 56), FC_ACC8(d, 64), FC_ACC8(d, 72), FC_ACC8(d, 80)
#define FC_ACC96(d) FC_ACC8(d, 0), FC_ACC8(d, 8), FC_ACC8(d, 16), FC_ACC8(d, 24), FC_ACC8(d, 32), FC_ACC8(d, 40), FC_ACC8(d, 48), FC_ACC8(d, 56), FC_ACC8(d, 64), FC_ACC8(d, 72), FC_ACC8(d, 80), FC_ACC8(d, 88)
#define FC_ACC128(d) FC_ACC8(d, 0), FC_ACC8(d, 8), FC_ACC8(d, 16), FC_ACC8(d, 24), FC_ACC8(d, 32), FC_ACC8(d, 40), FC_ACC8(d, 48), FC_ACC8(d, 56), FC_ACC8(d, 64), FC_ACC8(d, 72), FC_ACC8(d, 80), FC_ACC8(d, 88), FC_ACC8(d, 96), FC_ACC8(d, 104), FC_ACC8(d, 112), FC_ACC8(d, 120)

// A and B in shared memory; TR: "0, 0" both K-major, "1, 1" both MN-major (tnspA, tnspB);
// scale_d = 0 overwrites D. R: accumulator registers; DA, DB, SD: the operand numbers after them.
#define FC_WGMMA_SS(N, R, T, DA, DB, SD, TR)                                                              \
    asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %" #SD ", 0;\n"                                    \
                 " wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." T "." T " " FC_REGS_##R ", %" #DA       \
                 ", %" #DB ", p, 1, 1, " TR ";\n}\n"                                                        \
                 : FC_ACC##R(d)                                                                              \
                 : "l"(desc_a), "l"(desc_b), "r"(scale_d))
// A from registers; B in shared memory, N-major (tnspB = 1); D accumulates (scale-d 1).
#define FC_WGMMA_RS(N, R, T, DB, SD)                                                                      \
    asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %" #SD ", 0;\n"                                    \
                 " wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." T "." T " " FC_REGS_##R ", " FC_AREGS_##R \
                 ", %" #DB ", p, 1, 1, 1;\n}\n"                                                              \
                 : FC_ACC##R(d)                                                                              \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1))

template <int N, bool Is_bf16>
struct Wgmma {
    static_assert(N == 24 || N == 32 || N == 48 || N == 64 || N == 80 || N == 96 || N == 112 || N == 128 ||
                      N == 176 || N == 192 || N == 256,
                  "wgmma N of the sm90 kernels (add its register lists above for another)");
    static constexpr int kRegs = N / 2;  // float32 accumulators per thread

// Each form lists its N's, then FC_WGMMA_NONE: an N it lacks fails to compile (it would emit nothing).
#define FC_WGMMA_CASE(NN, R, MACRO, ...)                                                                \
    if constexpr (N == NN) {                                                                             \
        if constexpr (Is_bf16) MACRO(NN, R, "bf16", __VA_ARGS__); else MACRO(NN, R, "f16", __VA_ARGS__); \
    } else
#define FC_WGMMA_NONE static_assert(N < 0, "this wgmma form lacks this N: add its case");
    static FC_DEVICE void ss(float (&d)[kRegs], u64 desc_a, u64 desc_b, int scale_d) {
        FC_WGMMA_CASE(24, 12, FC_WGMMA_SS, 12, 13, 14, "0, 0")
        FC_WGMMA_CASE(32, 16, FC_WGMMA_SS, 16, 17, 18, "0, 0")
        FC_WGMMA_CASE(48, 24, FC_WGMMA_SS, 24, 25, 26, "0, 0")
        FC_WGMMA_CASE(64, 32, FC_WGMMA_SS, 32, 33, 34, "0, 0")
        FC_WGMMA_CASE(80, 40, FC_WGMMA_SS, 40, 41, 42, "0, 0")
        FC_WGMMA_CASE(96, 48, FC_WGMMA_SS, 48, 49, 50, "0, 0")
        FC_WGMMA_CASE(112, 56, FC_WGMMA_SS, 56, 57, 58, "0, 0")
        FC_WGMMA_CASE(128, 64, FC_WGMMA_SS, 64, 65, 66, "0, 0")
        FC_WGMMA_CASE(176, 88, FC_WGMMA_SS, 88, 89, 90, "0, 0")
        FC_WGMMA_CASE(192, 96, FC_WGMMA_SS, 96, 97, 98, "0, 0")
        FC_WGMMA_CASE(256, 128, FC_WGMMA_SS, 128, 129, 130, "0, 0")
        FC_WGMMA_NONE
    }
    // A MN-major (its M dimension contiguous), B N-major, both in shared memory
    static FC_DEVICE void ss_tt(float (&d)[kRegs], u64 desc_a, u64 desc_b, int scale_d) {
        FC_WGMMA_CASE(32, 16, FC_WGMMA_SS, 16, 17, 18, "1, 1")
        FC_WGMMA_CASE(64, 32, FC_WGMMA_SS, 32, 33, 34, "1, 1")
        FC_WGMMA_CASE(128, 64, FC_WGMMA_SS, 64, 65, 66, "1, 1")
        FC_WGMMA_NONE
    }
    // A MN-major, B K-major, both in shared memory
    static FC_DEVICE void ss_tn(float (&d)[kRegs], u64 desc_a, u64 desc_b, int scale_d) {
        FC_WGMMA_CASE(32, 16, FC_WGMMA_SS, 16, 17, 18, "1, 0")
        FC_WGMMA_CASE(48, 24, FC_WGMMA_SS, 24, 25, 26, "1, 0")
        FC_WGMMA_CASE(64, 32, FC_WGMMA_SS, 32, 33, 34, "1, 0")
        FC_WGMMA_CASE(80, 40, FC_WGMMA_SS, 40, 41, 42, "1, 0")
        FC_WGMMA_NONE
    }
    static FC_DEVICE void rs(float (&d)[kRegs], const u32 (&a)[4], u64 desc_b) {
        FC_WGMMA_CASE(64, 32, FC_WGMMA_RS, 36, 37)
        FC_WGMMA_CASE(80, 40, FC_WGMMA_RS, 44, 45)
        FC_WGMMA_CASE(96, 48, FC_WGMMA_RS, 52, 53)
        FC_WGMMA_CASE(128, 64, FC_WGMMA_RS, 68, 69)
        FC_WGMMA_CASE(176, 88, FC_WGMMA_RS, 92, 93)
        FC_WGMMA_CASE(192, 96, FC_WGMMA_RS, 100, 101)
        FC_WGMMA_CASE(256, 128, FC_WGMMA_RS, 132, 133)
        FC_WGMMA_NONE
    }
#undef FC_WGMMA_CASE
#undef FC_WGMMA_NONE
};

// ---- thread block clusters: a barrier over every thread of the cluster, and loads from another
// block's shared memory (distributed shared memory) ------------------------------------------------
// Every thread of every block of the cluster arrives (its earlier writes released) and waits (the
// others' acquired).
FC_DEVICE void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;\n" ::: "memory");
}
FC_DEVICE int cluster_rank() {
    u32 r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
    return int(r);
}
// The address of this block's shared-memory address `addr` in block `rank` of the cluster.
FC_DEVICE u32 cluster_map(u32 addr, int rank) {
    u32 r;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(r) : "r"(addr), "r"(rank));
    return r;
}
FC_DEVICE float ld_cluster_f32(u32 addr) {
    float v;
    asm volatile("ld.shared::cluster.f32 %0, [%1];\n" : "=f"(v) : "r"(addr) : "memory");
    return v;
}
FC_DEVICE float4 ld_cluster_f32x4(u32 addr) {
    float4 v;
    asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];\n"
                 : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(addr) : "memory");
    return v;
}
