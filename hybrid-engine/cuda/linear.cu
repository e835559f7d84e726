// The linear layer's pieces around cuBLAS's gemm on the GPU, what fused.rs's Linear and
// ColumnSums compute on the CPU: the bias added to each row of the gemm's output, and
// the bias gradient, the column sums of dy (N, W), in f32 whatever the dtype. The column sums are
// deterministic: each block sums its columns over a fixed chunk of rows into an f32 scratch
// (chunks, W), then a second kernel (common.cuh) adds the chunks in order.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include "common.cuh"

// out[r][c] = y[r][c] + b[c] over n rows of width w: one thread a column (its bias read once),
// grid (ceil(w / blockDim.x), rows), striding over the rows past gridDim.y.
#define ADD_BIAS_ROWS(NAME, T, TO_F32, FROM_F32)                                                  \
  extern "C" __global__ void NAME(const T *y, const T *b, T *out, uint64_t n, uint32_t w) {       \
    const uint32_t c = blockIdx.x * blockDim.x + threadIdx.x;                                     \
    if (c >= w) return;                                                                           \
    const float bc = TO_F32(b[c]);                                                                \
    for (uint64_t r = blockIdx.y; r < n; r += gridDim.y) {                                        \
      out[r * w + c] = FROM_F32(TO_F32(y[r * w + c]) + bc);                                       \
    }                                                                                             \
  }

// partial[chunk][c] = sum of g[r][c] over the rows of chunk blockIdx.y (rows_per_chunk each), one
// thread a column. Grid (ceil(W / blockDim.x), chunks).
#define COLUMN_SUMS_PARTIAL(NAME, T, TO_F32)                                                      \
  extern "C" __global__ void NAME(const T *g, float *partial, uint64_t n, uint32_t w,              \
                                  uint64_t rows_per_chunk) {                                       \
    const uint32_t c = blockIdx.x * blockDim.x + threadIdx.x;                                     \
    if (c >= w) return;                                                                           \
    const uint64_t r0 = blockIdx.y * rows_per_chunk;                                              \
    const uint64_t r1 = r0 + rows_per_chunk < n ? r0 + rows_per_chunk : n;                       \
    float acc = 0.0f;                                                                             \
    for (uint64_t r = r0; r < r1; ++r) acc += TO_F32(g[r * w + c]);                               \
    partial[(uint64_t)blockIdx.y * w + c] = acc;                                                  \
  }

#define IDENTITY(v) (v)
#define LINEAR_KERNELS(SUFFIX, T, TO_F32, FROM_F32)                  \
  ADD_BIAS_ROWS(add_bias_rows_##SUFFIX, T, TO_F32, FROM_F32)         \
  COLUMN_SUMS_PARTIAL(column_sums_partial_##SUFFIX, T, TO_F32)       \
  COLUMN_SUMS(column_sums_finish_##SUFFIX, T, FROM_F32)

LINEAR_KERNELS(f32, float, IDENTITY, IDENTITY)
LINEAR_KERNELS(bf16, __nv_bfloat16, __bfloat162float, __float2bfloat16_rn)
LINEAR_KERNELS(f16, __half, __half2float, __float2half_rn)
