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

#endif  // RLP_CUDA_PIPELINE_H
