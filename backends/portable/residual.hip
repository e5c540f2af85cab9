#ifndef RLP_HIP_ON_CUDA
#include <hip/hip_runtime.h>
#endif
// Kernel family "residual": IEEE float32 additions, and a bit-copy transpose (contracts/residual.toml).
// Reference: rlportable/ops/residual.py. One source for both vendors.
#include "common.h"

extern "C" __global__ void residual_add_f32(const float* __restrict__ a, const float* __restrict__ b,
                                            float* __restrict__ y, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        y[i] = rlp_add(a[i], b[i]);
}

extern "C" __global__ void residual_add_bias_f32(const float* __restrict__ x, const float* __restrict__ b,
                                                 float* __restrict__ y, long long rows, long long n) {
    const long long total = rows * n;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total; i += (long long)gridDim.x * blockDim.x)
        y[i] = rlp_add(x[i], b[i % n]);
}

// y [cols, rows] = x [rows, cols] transposed, as a copy of 32-bit patterns (unsigned int, never a
// float register operation), so every bit is kept, NaN payloads included.
// A 32 x 32 tile goes through shared memory: coalesced reads of x rows, coalesced writes of y rows.
// The row pitch of 33 words puts tile[k][c] in bank (k + c) mod 32 (32 banks of 4 bytes on both
// vendors), so the 32 threads of one threadIdx.y hit 32 different banks both when they write a tile
// row and when they read a tile column: no bank conflicts, at any warp width.
// blockDim.x must be 32 (the tile width), blockDim.y any size (the op uses 8); tiles grid-stride
// over both grid axes, so any grid moves every element exactly once.
#define RLP_TRANSPOSE_TILE 32

extern "C" __global__ void residual_transpose_f32(const unsigned int* __restrict__ x, unsigned int* __restrict__ y,
                                                  long long rows, long long cols) {
    __shared__ unsigned int tile[RLP_TRANSPOSE_TILE][RLP_TRANSPOSE_TILE + 1];
    for (long long tile_row = (long long)blockIdx.y * RLP_TRANSPOSE_TILE; tile_row < rows;
         tile_row += (long long)gridDim.y * RLP_TRANSPOSE_TILE) {
        for (long long tile_col = (long long)blockIdx.x * RLP_TRANSPOSE_TILE; tile_col < cols;
             tile_col += (long long)gridDim.x * RLP_TRANSPOSE_TILE) {
            const long long col = tile_col + threadIdx.x;
            for (int k = threadIdx.y; k < RLP_TRANSPOSE_TILE; k += blockDim.y) {
                const long long row = tile_row + k;
                if (row < rows && col < cols) tile[k][threadIdx.x] = x[row * cols + col];
            }
            __syncthreads();
            const long long out_col = tile_row + threadIdx.x;  // a row of x is a column of y
            for (int k = threadIdx.y; k < RLP_TRANSPOSE_TILE; k += blockDim.y) {
                const long long out_row = tile_col + k;
                if (out_row < cols && out_col < rows) y[out_row * rows + out_col] = tile[threadIdx.x][k];
            }
            __syncthreads();
        }
    }
}

// Rows of a 2-D array of 32-bit words copied from row src[i] to row dst[i], i < n (the KV cache's
// copy-on-write; contracts/residual.toml "copy_rows"). No arithmetic: bit patterns move as unsigned
// int. The destinations are distinct and no destination is a source (checked by the caller), so
// the copies are independent and any order of threads gives the same result.
extern "C" __global__ void residual_copy_rows_u32(const int* __restrict__ src, const int* __restrict__ dst,
                                                  long long n, long long words, unsigned int* a) {
    const long long total = n * words;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        const long long pair = i / words;
        const long long word = i - pair * words;
        a[(long long)dst[pair] * words + word] = a[(long long)src[pair] * words + word];
    }
}
