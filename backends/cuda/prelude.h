// The CUDA prelude of the portable dialect: lets NVRTC (or nvcc) compile
// backends/portable/*.hip (each family's one source for both vendors) and the CUDA
// fast paths that include them (backends/cuda/*.cu) on an NVIDIA GPU. The runtime puts
// it in front of every family's source (CudaBackend.source); with kernel_source="hip"
// it compiles the portable source alone (what an AMD GPU runs, with a warp of 32).
//
// What it maps, and why that is all:
//   * <hip/hip_runtime.h> is not available to NVRTC; every .hip file includes
//     it only under #ifndef RLP_HIP_ON_CUDA, which this header defines.
//   * The .hip sources are written (see common.h) with names that HIP and CUDA
//     both define with the same meaning: threadIdx/blockIdx/blockDim/gridDim,
//     __syncthreads, __global__/__device__/__shared__/__forceinline__/
//     __restrict__, the bit casts (__int_as_float, __float_as_int,
//     __double_as_longlong, __longlong_as_double), __clz, rint, and the
//     atomics atomicMax/atomicOr(unsigned int*) and atomicAdd(unsigned long long*).
//     None of them needs a mapping.
//   * A HIP-only name that a .hip file starts to use gets its CUDA meaning
//     here (e.g. `#define hipThreadIdx_x threadIdx.x`). One used and not mapped
//     fails the offline compile in CI (tests/test_kernel_sources.py compiles
//     every .hip through this prelude with nvcc), so the list cannot fall
//     behind silently. AMD builtins (__builtin_amdgcn_*) have no CUDA meaning
//     and are not allowed in the shared sources.
//   * __shfl_xor(var, lane_mask, width) (common.h's one segment shuffle, width
//     32) is HIP's unsynchronised shuffle; CUDA spells it __shfl_xor_sync with a
//     full mask, the mapping HIP's own NVIDIA headers use. Every lane of the
//     warp calls it (common.h's rlp_block_* preconditions).
// Include guard rather than #pragma once: the runtime inlines this file into
// the compiled text, where #pragma once would draw a warning.
#ifndef RLP_CUDA_PRELUDE_H
#define RLP_CUDA_PRELUDE_H

#ifndef RLP_HIP_ON_CUDA
#define RLP_HIP_ON_CUDA 1
#endif

#define __shfl_xor(var, lane_mask, width) __shfl_xor_sync(0xffffffffu, (var), (lane_mask), (width))

// common.h's launch bounds with NVIDIA's minimum of resident blocks per multiprocessor.
#define RLP_LAUNCH_BOUNDS(threads, nvidia_min_blocks) __launch_bounds__(threads, nvidia_min_blocks)

#endif  // RLP_CUDA_PRELUDE_H
