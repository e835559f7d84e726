// LayerNorm over the last dimension on the GPU, what fused.rs's LayerNorm and LayerNormGrad
// compute on the CPU (rowops::layer_norm, rowops::layer_norm_grad), in f32 whatever the tensors'
// dtype: y = (x - mean) * rstd * w + b (biased variance, as torch), and backward
// dx = rstd * (dy*w - mean(dy*w) - xhat * mean(dy*w * xhat)), dw = sum_rows dy * xhat,
// db = sum_rows dy. x, dy: (N, C) contiguous; w, b: (C,), all of one dtype.
//
// One warp per row. The backward's column sums are deterministic (a resumed GPU run must add in
// the same order): each warp owns its columns' partial sums in shared memory (lane j the columns
// j, j + 32, ...: no two threads write one) over a fixed set of rows, a block adds its warps' sums
// in warp order into its row of a (blocks, 2C) f32 scratch, and a second kernel adds the blocks in
// order for each column.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include "common.cuh"

#define ROWS_PER_BLOCK 4

#define LAYER_NORM(NAME, T, TO_F32, FROM_F32)                                                        \
  extern "C" __global__ void NAME(const T *x, const T *w, const T *b, T *y, uint64_t rows, uint32_t c, \
                                  float eps) {                                                       \
    const uint64_t r = blockIdx.x * (uint64_t)ROWS_PER_BLOCK + threadIdx.x / 32;                      \
    if (r >= rows) return;                                                                            \
    const T *xr = x + r * c;                                                                          \
    float mean, rstd;                                                                                 \
    row_stats(xr, c, eps, [](T v) { return TO_F32(v); }, &mean, &rstd);                               \
    T *yr = y + r * c;                                                                                \
    for (uint32_t j = threadIdx.x % 32; j < c; j += 32)                                               \
      yr[j] = FROM_F32((TO_F32(xr[j]) - mean) * rstd * TO_F32(w[j]) + TO_F32(b[j]));                  \
  }

// dx rows into dx; this block's dw (first C) and db (last C) partial sums into partial[block].
// Warp k of block b takes rows b * W + k, then W * gridDim.x further, W = blockDim.x / 32; shared
// memory holds 2C floats a warp.
#define LAYER_NORM_GRAD(NAME, T, TO_F32, FROM_F32)                                                    \
  extern "C" __global__ void NAME(const T *x, const T *w, const T *dy, T *dx, float *partial,         \
                                  uint64_t rows, uint32_t c, float eps) {                             \
    extern __shared__ float shared_sums[];                                                            \
    const uint32_t lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;         \
    float *sums = shared_sums + warp * 2 * c;                                                         \
    for (uint32_t j = lane; j < 2 * c; j += 32) sums[j] = 0.0f;                                       \
    const uint64_t stride = (uint64_t)gridDim.x * warps;                                              \
    for (uint64_t r = (uint64_t)blockIdx.x * warps + warp; r < rows; r += stride) {                   \
      const T *xr = x + r * c, *dyr = dy + r * c;                                                     \
      float mean, rstd;                                                                               \
      row_stats(xr, c, eps, [](T v) { return TO_F32(v); }, &mean, &rstd);                             \
      float s_gw = 0.0f, s_gw_xhat = 0.0f;                                                            \
      for (uint32_t j = lane; j < c; j += 32) {                                                       \
        const float xhat = (TO_F32(xr[j]) - mean) * rstd, g = TO_F32(dyr[j]);                         \
        const float gw = g * TO_F32(w[j]);                                                            \
        s_gw += gw;                                                                                   \
        s_gw_xhat += gw * xhat;                                                                       \
        sums[j] += g * xhat;                                                                          \
        sums[c + j] += g;                                                                             \
      }                                                                                               \
      const float mean_gw = warp_sum(s_gw) / c, mean_gw_xhat = warp_sum(s_gw_xhat) / c;               \
      T *dxr = dx + r * c;                                                                            \
      for (uint32_t j = lane; j < c; j += 32) {                                                       \
        const float xhat = (TO_F32(xr[j]) - mean) * rstd;                                             \
        dxr[j] = FROM_F32(rstd * (TO_F32(dyr[j]) * TO_F32(w[j]) - mean_gw - xhat * mean_gw_xhat));    \
      }                                                                                               \
    }                                                                                                 \
    __syncthreads();                                                                                  \
    for (uint32_t j = threadIdx.x; j < 2 * c; j += blockDim.x) {                                      \
      float s = 0.0f;                                                                                 \
      for (uint32_t k = 0; k < warps; ++k) s += shared_sums[k * 2 * c + j];                           \
      partial[blockIdx.x * 2ull * c + j] = s;                                                         \
    }                                                                                                 \
  }

#define IDENTITY(v) (v)
LAYER_NORM(layer_norm_f32, float, IDENTITY, IDENTITY)
LAYER_NORM(layer_norm_bf16, __nv_bfloat16, __bfloat162float, __float2bfloat16_rn)
LAYER_NORM(layer_norm_f16, __half, __half2float, __float2half_rn)
LAYER_NORM_GRAD(layer_norm_grad_f32, float, IDENTITY, IDENTITY)
LAYER_NORM_GRAD(layer_norm_grad_bf16, __nv_bfloat16, __bfloat162float, __float2bfloat16_rn)
LAYER_NORM_GRAD(layer_norm_grad_f16, __half, __half2float, __float2half_rn)
COLUMN_SUMS(column_sums_f32, float, IDENTITY)
COLUMN_SUMS(column_sums_bf16, __nv_bfloat16, __float2bfloat16_rn)
COLUMN_SUMS(column_sums_f16, __half, __float2half_rn)
