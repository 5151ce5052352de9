// Thin wrappers over the PTX instructions the sm80 kernels use.
// No CUDA toolkit header is included anywhere in cuda_src: NVRTC alone builds every kernel,
// on any machine, so CI can compile every variant without a GPU.
#pragma once

typedef unsigned int u32;
typedef unsigned short u16;
typedef long long i64;

#define FC_DEVICE __device__ __forceinline__

// Generic pointer -> 32-bit shared-memory address (what ldmatrix / cp.async take).
FC_DEVICE u32 smem_u32(const void* ptr) {
    u32 addr;
    asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(addr) : "l"(ptr));
    return addr;
}

// ---- cp.async (sm80): 16-byte global -> shared copies that bypass registers --------------------
// src_bytes = 0 writes 16 zero bytes: how ragged tails are loaded without reading past the end.
FC_DEVICE void cp_async_16(u32 dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}
FC_DEVICE void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
FC_DEVICE void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// ---- ldmatrix: four 8x8 b16 matrices from shared memory into mma fragments ---------------------
// Lane l gives the address of row (l % 8) of matrix (l / 8); register i receives matrix i.
FC_DEVICE void ldmatrix_x4(u32 (&r)[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
FC_DEVICE void ldmatrix_x4_trans(u32 (&r)[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

// ---- mma.sync m16n8k16, float32 accumulators: c += a * b ----------------------------------------
// a: 16x16 row-major fragment (4 regs), b: 16x8 column fragment (2 regs), c: 16x8 (4 floats).
// Fragment layout (lane = 4 * g + t): c[0..1] = row g, cols 2t..2t+1; c[2..3] = row g + 8.
template <bool Is_bf16>
FC_DEVICE void mma_16816(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    if constexpr (Is_bf16) {
        asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%0,%1,%2,%3};\n"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    } else {
        asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%0,%1,%2,%3};\n"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
}

// ---- conversions and special functions ----------------------------------------------------------
// Two floats -> packed 16-bit pair, lo in the low half (the element with the lower column index).
template <bool Is_bf16>
FC_DEVICE u32 pack_f32x2(float lo, float hi) {
    u32 r;
    if constexpr (Is_bf16) {
        asm("cvt.rn.bf16x2.f32 %0, %2, %1;\n" : "=r"(r) : "f"(lo), "f"(hi));
    } else {
        asm("cvt.rn.f16x2.f32 %0, %2, %1;\n" : "=r"(r) : "f"(lo), "f"(hi));
    }
    return r;
}

// Packed 16-bit pair -> two floats.
template <bool Is_bf16>
FC_DEVICE void unpack_f32x2(u32 v, float& lo, float& hi) {
    if constexpr (Is_bf16) {
        lo = __uint_as_float(v << 16);
        hi = __uint_as_float(v & 0xffff0000u);
    } else {
        asm("{ .reg .f16 l, h; mov.b32 {l, h}, %2; cvt.f32.f16 %0, l; cvt.f32.f16 %1, h; }\n"
            : "=f"(lo), "=f"(hi) : "r"(v));
    }
}

FC_DEVICE float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

FC_DEVICE float fast_log2(float x) {
    float y;
    asm("lg2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

#define FC_INF __int_as_float(0x7f800000)

// ---- global atomics and ordering (backward's dQ accumulation) ------------------------------------
FC_DEVICE void red_add_f32(float* addr, float v) {
    asm volatile("red.global.add.f32 [%0], %1;\n" ::"l"(addr), "f"(v) : "memory");
}
// Four adjacent floats (16-byte aligned); one vector reduction on sm90 (PTX ISA 8.1), four scalar
// ones before.
FC_DEVICE void red_add_f32x4(float* addr, float4 v) {
#if __CUDA_ARCH__ >= 900
    asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"l"(addr), "f"(v.x), "f"(v.y), "f"(v.z),
                 "f"(v.w) : "memory");
#else
    red_add_f32(addr, v.x);
    red_add_f32(addr + 1, v.y);
    red_add_f32(addr + 2, v.z);
    red_add_f32(addr + 3, v.w);
#endif
}
FC_DEVICE int ld_acquire(const int* addr) {
    int v;
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(addr) : "memory");
    return v;
}
FC_DEVICE void st_release(int* addr, int v) {
    asm volatile("st.release.gpu.global.b32 [%0], %1;\n" ::"l"(addr), "r"(v) : "memory");
}
// Loads through L2 only (not this SM's L1): data another block stored during this kernel.
FC_DEVICE float ld_cg_f32(const float* addr) {
    float v;
    asm volatile("ld.global.cg.f32 %0, [%1];\n" : "=f"(v) : "l"(addr));
    return v;
}
FC_DEVICE float4 ld_cg_f32x4(const float* addr) {
    float4 v;
    asm volatile("ld.global.cg.v4.f32 {%0, %1, %2, %3}, [%4];\n" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "l"(addr));
    return v;
}
// Adds to a GPU-wide counter, ordered after this thread's earlier memory operations (and those a
// barrier ordered before them) and before its later ones: a release and an acquire in one.
FC_DEVICE int atomic_add_acq_rel_gpu(int* addr, int value) {
    int old;
    asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], %2;\n" : "=r"(old) : "l"(addr), "r"(value) : "memory");
    return old;
}
// 16 bytes through the read-only path (data no thread of the kernel writes), and 16 bytes into
// shared memory.
FC_DEVICE uint4 ld_nc_v4(const void* addr) {
    uint4 v;
    asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(addr));
    return v;
}
// Programmatic dependent launch (sm90): a kernel launched with programmatic stream serialization
// may start before the kernel ahead of it in its stream has finished; griddep_wait holds it until
// that kernel has completed and its writes are visible (at once when not launched so), and
// griddep_launch_dependents lets the kernel behind this one start its blocks early.
FC_DEVICE void griddep_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
FC_DEVICE void griddep_launch_dependents() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
FC_DEVICE void st_shared_v4(u32 addr, uint4 v) {
    asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
}
FC_DEVICE void cp_async_4(u32 dst, const void* src, int src_bytes) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}
