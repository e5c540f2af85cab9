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
//   * HIP-CPU has no __builtin_amdgcn_*. The integer MFMA builtins an exact int8 kernel would use
//     on gfx942 (and gfx90a) are emulated over the whole 64-lane wavefront, with AMD's operand and
//     result layouts (the section "Integer MFMA" below states the map and its sources).
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
#include <type_traits>

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

// ---- Integer MFMA (matrix fused multiply-add) over the whole 64-lane wavefront
//
// __builtin_amdgcn_mfma_i32_16x16x32_i8 and _32x32x16_i8 (gfx942, CDNA3), _16x16x16i8 and _32x32x8i8
// (gfx90a, CDNA2; gfx942 has them no more): D = A B + C with A of M x K and B of K x N signed int8,
// C and D of M x N int32, M = N. One call is one instruction of the whole wavefront: every lane
// gives its A and B registers and its C registers, every lane gets its D registers back. The clang
// signatures (BuiltinsAMDGPU.def), which a kernel must use as they are:
//   16x16x32_i8: (long a, long b, int4 c, 0, 0, 0) -> int4      8 int8 of A and of B a lane
//   32x32x16_i8: (long a, long b, int16 c, 0, 0, 0) -> int16    8 int8 of A and of B a lane
//   16x16x16i8:  (int a,  int b,  int4 c, 0, 0, 0) -> int4      4 int8 of A and of B a lane
//   32x32x8i8:   (int a,  int b,  int16 c, 0, 0, 0) -> int16    4 int8 of A and of B a lane
// with intN a vector of N int spelled `int __attribute__((vector_size(4 * N)))` (g++ and clang both
// take that spelling; clang's own ext_vector_type is unknown to g++). The last three arguments
// (cbsz, abid, blgp: broadcast and lane-permutation modifiers) must be constant zero here.
//
// The layout, for an instruction whose A and B hold KL int8 a lane (KL = 8: the gfx942 pair; 4: the
// gfx90a pair), G = 64 / M lane groups, K = G * KL; lane l, byte b of its operand register (b = 0 the
// least significant byte: bits 7:0 of the operand's first VGPR, b = 4..7 the second VGPR's bytes):
//   A[i][k]  lane M * (k / KL) + i, byte k % KL     (row i = l % M,    k = KL * (l / M) + b)
//   B[k][j]  lane M * (k / KL) + j, byte k % KL     (column j = l % M, same k)
//   C/D[i][j]  in lane l, register r (0..3 for M = 16, 0..15 for M = 32):
//            j = l % M,  i = 4 G (r / 4) + 4 (l / M) + r % 4
//            (16x16: i = 4 (l / 16) + r; 32x32: i = 8 (r / 4) + 4 (l / 32) + r % 4)
// So lanes 0..M-1 hold k = 0..KL-1 of every row of A (column of B), the next M lanes the next KL
// values of k, and a lane's D registers are one column j, in runs of 4 consecutive rows.
// Sources, which agree: AMD's matrix instruction calculator (github.com/ROCm/amd_matrix_instruction_
// calculator, commit 2ef9189, `--architecture cdna3 --instruction v_mfma_i32_16x16x32_i8
// --detail-instruction` and likewise 32x32x16_i8, cdna2 16x16x16i8 and 32x32x8i8: AMD's register <->
// element formulas); composable_kernel's xdlops_gemm.hpp (mfma_type
// for mfma_i32_16x16x32i8 / 32x32x16i8: lane = blk_id * num_threads_per_blk + blk_td, A and B origin
// (k block blk_id, row / column blk_td), k_per_blk = 8 consecutive k a lane, D rows from
// blk_id * group_size in groups of 4, groups num_input_blks * 4 rows apart); IREE's
// getSingleSubgroupLayout (IREEGPUAttrs.cpp) for MFMA_I32_16x16x32_I8 / 32x32x16_I8. Not checked on
// an AMD GPU: none was available (docs/rocm.md).
//
// Arithmetic: every product of two int8 and every sum is exact in int64 here; D is the sum taken to
// int32 modulo 2^32. The emulation does not model what the hardware does when a sum leaves the int32
// range (wraps or saturates: the sources do not say); an exact kernel keeps its sums inside it.
//
// The exchange: the same ring as rlp_cpu_shfl_xor, over the 64 lanes of the caller's wavefront
// (lane = thread % warpSize): each lane writes its operands, then yields to the next lane of its
// wavefront; when the first lane runs again every lane has written. Two slot sets alternate, and a
// stamp per slot aborts the run if the lanes of a wavefront do not all make the same call (an MFMA
// is executed by the whole wavefront: every lane must reach it, the block must hold whole wavefronts).
struct rlp_cpu_mfma_operands {
    std::int64_t a, b;
};

// The operands of the caller's wavefront, lane by lane (its own lane in *lane).
inline const rlp_cpu_mfma_operands* rlp_cpu_mfma_exchange(std::int64_t a, std::int64_t b, int* lane) {
    using hip::detail::Fiber;
    using hip::detail::Tile;
    constexpr int max_threads = 1024;
    thread_local static rlp_cpu_mfma_operands slots[2][max_threads];
    thread_local static unsigned long long stamps[2][max_threads];  // which call wrote the slot
    thread_local static unsigned long long calls[max_threads];
    const Fiber& self = Fiber::this_fiber();
    const int thread = (int)id(self);
    const int threads = (int)count(dimensions(Tile::this_tile()));
    if (threads % warpSize != 0 || (thread != 0 && self == Fiber::main())) {
        std::fprintf(stderr, "rlp_cpu_mfma: an MFMA in a block of %d threads (thread %d): it needs whole "
                     "wavefronts of %d lanes, running as fibers\n", threads, thread, (int)warpSize);
        std::abort();
    }
    const int first = thread - thread % warpSize;
    const unsigned long long call = ++calls[thread];
    const int set = (int)(call & 1u);
    slots[set][thread] = rlp_cpu_mfma_operands{a, b};
    stamps[set][thread] = call;
    hip::detail::this_tile::has_barrier = true;  // the fibers of this block run as fibers, not in a loop
    const int next = (thread + 1 < first + warpSize) ? thread + 1 : first;
    Fiber::yield(Tile::fibers()[next]);
    for (int other = first; other < first + warpSize; ++other) {
        if (stamps[set][other] != call) {
            std::fprintf(stderr, "rlp_cpu_mfma: lane %d's MFMA %llu met lane %d's MFMA %llu (every lane of a "
                         "wavefront must execute the same MFMA)\n", thread, call, other, stamps[set][other]);
            std::abort();
        }
    }
    *lane = thread - first;
    return &slots[set][first];
}

// Byte `byte` of a lane's operand register as a signed int8 (byte 0: bits 7:0).
inline std::int64_t rlp_cpu_mfma_i8(std::int64_t operand, int byte) {
    return (std::int64_t)(std::int8_t)(std::uint8_t)((std::uint64_t)operand >> (8 * byte));
}

// The operand types of clang's builtins: 64 bits (long) for the gfx942 pair, 32 (int) for the gfx90a
// pair. Stricter than clang, which would convert an int to long without a word (and so give a lane
// 4 bytes of A where the instruction reads 8).
template <typename T>
inline std::int64_t rlp_cpu_mfma_long(T x) {
    static_assert(std::is_integral_v<T> && sizeof(T) == 8, "rlp_cpu_mfma: this MFMA's A and B are 64-bit (long)");
    return (std::int64_t)x;
}
template <typename T>
inline std::int64_t rlp_cpu_mfma_int(T x) {
    static_assert(std::is_integral_v<T> && sizeof(T) == 4, "rlp_cpu_mfma: this MFMA's A and B are 32-bit (int)");
    return (std::int64_t)(std::uint32_t)x;
}

// One integer MFMA of M x M output, KL int8 of A and of B a lane (the layout above).
template <int M, int KL, int cbsz, int abid, int blgp, typename Accumulator>
inline Accumulator rlp_cpu_mfma_i32_i8(std::int64_t a, std::int64_t b, Accumulator c) {
    static_assert(cbsz == 0 && abid == 0 && blgp == 0, "rlp_cpu_mfma: cbsz, abid and blgp must be 0");
    constexpr int lanes = 64, groups = lanes / M, registers = M * M / lanes;
    static_assert(warpSize == lanes, "the integer MFMA emulation is for a 64-lane wavefront");
    static_assert(sizeof(Accumulator) == 4 * registers && std::is_same_v<std::remove_reference_t<decltype(c[0])>, int>,
                  "rlp_cpu_mfma: C must be `int __attribute__((vector_size(4 * registers)))`");
    int lane = 0;
    const rlp_cpu_mfma_operands* wave = rlp_cpu_mfma_exchange(a, b, &lane);
    const int j = lane % M;
    Accumulator d;
    for (int r = 0; r < registers; ++r) {
        const int i = 4 * groups * (r / 4) + 4 * (lane / M) + r % 4;
        std::int64_t sum = c[r];
        for (int k = 0; k < groups * KL; ++k) {
            const int group = M * (k / KL), byte = k % KL;
            sum += rlp_cpu_mfma_i8(wave[group + i].a, byte) * rlp_cpu_mfma_i8(wave[group + j].b, byte);
        }
        d[r] = (int)(std::uint32_t)(std::uint64_t)sum;
    }
    return d;
}

#define __builtin_amdgcn_mfma_i32_16x16x32_i8(a, b, c, cbsz, abid, blgp) \
    rlp_cpu_mfma_i32_i8<16, 8, (cbsz), (abid), (blgp)>(rlp_cpu_mfma_long(a), rlp_cpu_mfma_long(b), (c))
#define __builtin_amdgcn_mfma_i32_32x32x16_i8(a, b, c, cbsz, abid, blgp) \
    rlp_cpu_mfma_i32_i8<32, 8, (cbsz), (abid), (blgp)>(rlp_cpu_mfma_long(a), rlp_cpu_mfma_long(b), (c))
#define __builtin_amdgcn_mfma_i32_16x16x16i8(a, b, c, cbsz, abid, blgp) \
    rlp_cpu_mfma_i32_i8<16, 4, (cbsz), (abid), (blgp)>(rlp_cpu_mfma_int(a), rlp_cpu_mfma_int(b), (c))
#define __builtin_amdgcn_mfma_i32_32x32x8i8(a, b, c, cbsz, abid, blgp) \
    rlp_cpu_mfma_i32_i8<32, 4, (cbsz), (abid), (blgp)>(rlp_cpu_mfma_int(a), rlp_cpu_mfma_int(b), (c))

// ---- Integer dot product of 4 byte pairs (v_dot4_i32_i8 on gfx90a and gfx942; clang's
// __builtin_amdgcn_sdot4(int a, int b, int c, bool clamp)): c + the four products of the signed bytes
// of a and b, in int32 (wrapping: no sum of the sources leaves int32). One lane's instruction, no
// wavefront state. The clamp (saturation) is not modelled: it must be constant false here, as the MFMA
// modifiers must be 0.
template <bool CLAMP>
inline int rlp_cpu_sdot4(int a, int b, int c) {
    static_assert(!CLAMP, "rlp_cpu_sdot4: the clamp is not emulated");
    std::int64_t sum = c;
    for (int i = 0; i < 4; ++i)
        sum += (std::int64_t)(signed char)(a >> (8 * i)) * (std::int64_t)(signed char)(b >> (8 * i));
    return (int)(std::uint32_t)(std::uint64_t)sum;
}

#define __builtin_amdgcn_sdot4(a, b, c, clamp) rlp_cpu_sdot4<(clamp)>((a), (b), (c))

#endif  // RLP_HIP_CPU_PRELUDE_H
