// NVIDIA's int8 tensor-core and staging pieces that the gemm and attention families share (sm_80+):
// the mma.sync m16n8k32 s8 product and cp.async copies into shared memory. Included by
// backends/cuda/gemm.cu and backends/cuda/attention.cu; the runtime inlines it into each.
#ifndef RLP_CUDA_PIPELINE_H
#define RLP_CUDA_PIPELINE_H

// c += A (16 x 32, row) x B (32 x 8, col), int8 operands, int32 accumulators: thread (g = lane / 4,
// t = lane % 4) gives a0 / a1 (rows g, g + 8, bytes 4t..4t+3), a2 / a3 (bytes 16 + 4t..), b0 / b1
// (column g, bytes 4t.. and 16 + 4t..) and holds c for rows g, g + 8 and columns 2t, 2t + 1.
__device__ __forceinline__ void rlp_mma_s8(int (&c)[4], int a0, int a1, int a2, int a3, int b0, int b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ int rlp_word(const int4& v, int i) {
    return i == 0 ? v.x : (i == 1 ? v.y : (i == 2 ? v.z : v.w));
}

// 16 bytes from global to shared memory without passing through registers; valid = false writes
// 16 zero bytes (the source is not read).
__device__ __forceinline__ void rlp_cp_async16(void* smem, const void* gmem, bool valid) {
    const unsigned int address = (unsigned int)__cvta_generic_to_shared(smem);
    const int bytes = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(address), "l"(gmem), "r"(bytes));
}

__device__ __forceinline__ void rlp_cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

// Wait until at most PENDING committed groups of this thread are still in flight.
template <int PENDING>
__device__ __forceinline__ void rlp_cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(PENDING)); }

// ---- wgmma (sm_90a): Hopper warpgroup MMA from 128-byte-swizzled shared memory ------------
// Defined only where the arch-specific Hopper features exist (--gpu-architecture=sm_90a, which
// runtime/flags.py gives compute capability 9.0); the kernels that use them trap elsewhere.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define RLP_HAS_WGMMA 1
#endif

#ifdef RLP_HAS_WGMMA
__device__ __forceinline__ void rlp_wgmma_n32(int (&d)[16], unsigned long long a, unsigned long long b) {
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n32k32.s32.s8.s8 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15"
        "}, %16, %17, 1;\n"
        :
          "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3]), "+r"(d[4]), "+r"(d[5]), "+r"(d[6]), "+r"(d[7]),
          "+r"(d[8]), "+r"(d[9]), "+r"(d[10]), "+r"(d[11]), "+r"(d[12]), "+r"(d[13]), "+r"(d[14]), "+r"(d[15])
        : "l"(a), "l"(b));
}

__device__ __forceinline__ void rlp_wgmma_n64(int (&d)[32], unsigned long long a, unsigned long long b) {
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n64k32.s32.s8.s8 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15,"
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
        "}, %32, %33, 1;\n"
        :
          "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3]), "+r"(d[4]), "+r"(d[5]), "+r"(d[6]), "+r"(d[7]),
          "+r"(d[8]), "+r"(d[9]), "+r"(d[10]), "+r"(d[11]), "+r"(d[12]), "+r"(d[13]), "+r"(d[14]), "+r"(d[15]),
          "+r"(d[16]), "+r"(d[17]), "+r"(d[18]), "+r"(d[19]), "+r"(d[20]), "+r"(d[21]), "+r"(d[22]), "+r"(d[23]),
          "+r"(d[24]), "+r"(d[25]), "+r"(d[26]), "+r"(d[27]), "+r"(d[28]), "+r"(d[29]), "+r"(d[30]), "+r"(d[31])
        : "l"(a), "l"(b));
}

__device__ __forceinline__ void rlp_wgmma_n128(int (&d)[64], unsigned long long a, unsigned long long b) {
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n128k32.s32.s8.s8 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15,"
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31,"
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47,"
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
        "}, %64, %65, 1;\n"
        :
          "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3]), "+r"(d[4]), "+r"(d[5]), "+r"(d[6]), "+r"(d[7]),
          "+r"(d[8]), "+r"(d[9]), "+r"(d[10]), "+r"(d[11]), "+r"(d[12]), "+r"(d[13]), "+r"(d[14]), "+r"(d[15]),
          "+r"(d[16]), "+r"(d[17]), "+r"(d[18]), "+r"(d[19]), "+r"(d[20]), "+r"(d[21]), "+r"(d[22]), "+r"(d[23]),
          "+r"(d[24]), "+r"(d[25]), "+r"(d[26]), "+r"(d[27]), "+r"(d[28]), "+r"(d[29]), "+r"(d[30]), "+r"(d[31]),
          "+r"(d[32]), "+r"(d[33]), "+r"(d[34]), "+r"(d[35]), "+r"(d[36]), "+r"(d[37]), "+r"(d[38]), "+r"(d[39]),
          "+r"(d[40]), "+r"(d[41]), "+r"(d[42]), "+r"(d[43]), "+r"(d[44]), "+r"(d[45]), "+r"(d[46]), "+r"(d[47]),
          "+r"(d[48]), "+r"(d[49]), "+r"(d[50]), "+r"(d[51]), "+r"(d[52]), "+r"(d[53]), "+r"(d[54]), "+r"(d[55]),
          "+r"(d[56]), "+r"(d[57]), "+r"(d[58]), "+r"(d[59]), "+r"(d[60]), "+r"(d[61]), "+r"(d[62]), "+r"(d[63])
        : "l"(a), "l"(b));
}

__device__ __forceinline__ void rlp_wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void rlp_wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int PENDING>
__device__ __forceinline__ void rlp_wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(PENDING) : "memory");
}
// Shared memory written through the generic proxy (stores, cp.async) before wgmma reads it through the async proxy.
__device__ __forceinline__ void rlp_fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

template <int BN>
__device__ __forceinline__ void rlp_wgmma(int (&d)[BN / 2], unsigned long long a, unsigned long long b) {
    if constexpr (BN == 32) rlp_wgmma_n32(d, a, b);
    else if constexpr (BN == 64) rlp_wgmma_n64(d, a, b);
    else rlp_wgmma_n128(d, a, b);
}

// Shared-memory matrix descriptor of a K-major tile with the 128-byte swizzle: rows 128 bytes
// apart, 8-row groups 1024 bytes apart (the stride byte offset); the leading byte offset is
// unused by this layout. The tile starts 1024-byte aligned, plus 32 bytes per k32 step.
__device__ __forceinline__ unsigned long long rlp_wgmma_descriptor(const signed char* tile) {
    const unsigned long long address = (unsigned long long)__cvta_generic_to_shared(tile);
    return ((address & 0x3FFFF) >> 4) | (1ull << 16) | ((1024ull >> 4) << 32) | (1ull << 62);
}
#endif  // RLP_HAS_WGMMA

// (Any build: it emits nothing.) Keeps the compiler from moving accumulator reads or writes across the asynchronous wgmma.
template <int R>
__device__ __forceinline__ void rlp_wgmma_pin(int (&d)[R]) {
#pragma unroll
    for (int i = 0; i < R; ++i) asm volatile("" : "+r"(d[i])::"memory");
}

// Byte `byte` (< 128) of row r of a tile with the 128-byte swizzle, the layout wgmma's descriptors read
// (rlp_wgmma_descriptor): rows 128 bytes apart, 16-byte piece p of row r at p ^ (r % 8).
__device__ __forceinline__ int rlp_swizzle128(int r, int byte) {
    return r * 128 + ((((byte >> 4) ^ r) & 7) << 4) + (byte & 15);
}

#endif  // RLP_CUDA_PIPELINE_H
