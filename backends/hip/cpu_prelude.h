// The HIP-CPU prelude of the portable dialect: lets g++ compile backends/portable/*.hip and
// backends/hip/*.hip against AMD's HIP-CPU runtime (third_party HIP-CPU: HIP on the CPU, a
// wavefront of warpSize = 64 lanes, each thread a fiber), so the HIP sources run with a 64-lane
// wavefront where no AMD GPU is at hand (runtime/hip_cpu.py builds and launches them).
//
// What it adds, and why:
//   * HIP-CPU lacks some device intrinsics the sources use. They are defined here with their
//     exact meaning: bit casts through memcpy, __fma_rn as std::fma (correctly rounded, IEEE
//     754 fusedMultiplyAdd), conversions as the C++ conversions under round-to-nearest-even.
//     The build passes -ffp-contract=off and no fast-math, so no other expression is fused.
//   * HIP-CPU's shuffles store to a per-warp scratchpad and then wait at a block-wide barrier
//     (every fiber of the block yields in turn). That is only right when every thread of the
//     block shuffles equally often; common.h's segments of 32 lanes may part (a segment per row,
//     rows in a per-segment loop), and there the block-wide barrier pairs calls that do not
//     belong together. The one shuffle of the dialect (__shfl_xor, width 32) is therefore
//     rlp_cpu_shfl_xor below: the index arithmetic of HIP's own __shfl_xor for a 64-lane
//     wavefront, with a wait that involves only the 32 lanes of the caller's segment.
//   * Dynamic shared memory: HIP-CPU turns __shared__ into thread_local and spells dynamic
//     shared memory HIP_DYNAMIC_SHARED; common.h's RLP_DYNAMIC_SHARED is mapped to it.
// Include guard rather than #pragma once: the runtime inlines this file into the compiled text.
#ifndef RLP_HIP_CPU_PRELUDE_H
#define RLP_HIP_CPU_PRELUDE_H

#define RLP_HIP_CPU 1

#include <hip/hip_runtime.h>

// Kernels as plain functions (HIP-CPU adds GCC's `simd`, clones nobody calls); `flatten` inlines
// each kernel's helpers into it, and marks the kernels for runtime/hip_cpu.py to find them.
#undef __global__
#define __global__ __attribute__((flatten))
#undef __device__
#define __device__

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

template <typename To, typename From>
inline To rlp_cpu_bit_cast(From from) {
    static_assert(sizeof(To) == sizeof(From), "bit casts keep the width");
    To to;
    std::memcpy(&to, &from, sizeof(To));
    return to;
}

inline float __int_as_float(int x) { return rlp_cpu_bit_cast<float>(x); }
inline float __uint_as_float(unsigned int x) { return rlp_cpu_bit_cast<float>(x); }
inline int __float_as_int(float x) { return rlp_cpu_bit_cast<int>(x); }
inline unsigned int __float_as_uint(float x) { return rlp_cpu_bit_cast<unsigned int>(x); }
inline long long __double_as_longlong(double x) { return rlp_cpu_bit_cast<long long>(x); }
inline double __hiloint2double(int high, int low) {
    return rlp_cpu_bit_cast<double>(((unsigned long long)(unsigned int)high << 32) | (unsigned int)low);
}
inline int __double2hiint(double x) { return (int)(rlp_cpu_bit_cast<unsigned long long>(x) >> 32); }
inline int __double2loint(double x) { return (int)rlp_cpu_bit_cast<unsigned long long>(x); }
inline double __fma_rn(double a, double b, double c) { return std::fma(a, b, c); }
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
inline float __double2float_rn(double x) { return (float)x; }
// HIP-CPU declares __clzll for int64_t (long here) and uint64_t only; the sources pass long long.
inline unsigned int __clzll(long long x) { return __clzll((std::int64_t)x); }
inline unsigned int __umulhi(unsigned int a, unsigned int b) {
    return (unsigned int)(((unsigned long long)a * b) >> 32);
}
inline unsigned long long __umul64hi(unsigned long long a, unsigned long long b) {
    return (unsigned long long)(((unsigned __int128)a * b) >> 64);
}
// HIP's __byte_perm: byte i of the result is byte s_i of the eight bytes y:x (selector nibbles).
inline unsigned int __byte_perm(unsigned int x, unsigned int y, unsigned int s) {
    const unsigned long long bytes = ((unsigned long long)y << 32) | x;
    unsigned int result = 0u;
    for (int i = 0; i < 4; ++i) result |= (unsigned int)((bytes >> (8 * ((s >> (4 * i)) & 7u))) & 0xffu) << (8 * i);
    return result;
}

// __shfl_xor(value, lane_mask, width) for the fibers of one block. HIP's index rule: lane =
// thread % warpSize, source = lane ^ lane_mask, kept only inside the caller's aligned group of
// `width` lanes (else the caller's own value). The wait: each lane writes its value, then yields
// to the next lane of its group (the last to the first); when the first lane runs again every
// lane of the group has written. Two slot sets, alternating per call, keep a value until all
// lanes have read it (a lane reads right after it is resumed, before it can write again). The
// group's lanes must call it equally often (common.h's preconditions); a count checks that.
inline unsigned int rlp_cpu_shfl_xor(unsigned int value, int lane_mask, int width) {
    using hip::detail::Fiber;
    using hip::detail::Tile;
    constexpr int max_threads = 1024;
    thread_local static unsigned int slots[2][max_threads];
    thread_local static unsigned long long stamps[2][max_threads];  // which call wrote the slot
    thread_local static unsigned long long calls[max_threads];
    const Fiber& self = Fiber::this_fiber();
    const int thread = (int)id(self);
    const int threads = (int)count(dimensions(Tile::this_tile()));
    if (width != 32 || threads % width != 0 || (thread != 0 && self == Fiber::main())) {
        std::fprintf(stderr, "rlp_cpu_shfl_xor: a shuffle outside common.h's preconditions (width %d, "
                     "%d threads, thread %d)\n", width, threads, thread);
        std::abort();
    }
    const int lane = thread % warpSize;
    const int first = thread - thread % width;
    const unsigned long long call = ++calls[thread];
    const int set = (int)(call & 1u);
    slots[set][thread] = value;
    stamps[set][thread] = call;
    hip::detail::this_tile::has_barrier = true;  // the fibers of this block run as fibers, not in a loop
    const int next = (thread + 1 < first + width) ? thread + 1 : first;
    Fiber::yield(Tile::fibers()[next]);
    int source = lane ^ lane_mask;
    if (source >= ((lane + width) & ~(width - 1))) source = lane;
    const int partner = thread - lane + source;
    if (stamps[set][partner] != call) {
        std::fprintf(stderr, "rlp_cpu_shfl_xor: lane %d's shuffle %llu met lane %d's shuffle %llu (the lanes of "
                     "a segment must shuffle equally often)\n", thread, call, partner, stamps[set][partner]);
        std::abort();
    }
    return slots[set][partner];
}

#undef __shfl_xor
#define __shfl_xor(value, lane_mask, width) rlp_cpu_shfl_xor((value), (lane_mask), (width))

#define RLP_DYNAMIC_SHARED(type, name) HIP_DYNAMIC_SHARED(type, name)

#endif  // RLP_HIP_CPU_PRELUDE_H
