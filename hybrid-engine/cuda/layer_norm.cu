// LayerNorm over the last dimension on the GPU, what fused.rs's LayerNorm and LayerNormGrad
// compute on the CPU (rowops::layer_norm, rowops::layer_norm_grad), in f32 whatever the tensors'
// dtype: y = (x - mean) * rstd * w + b (biased variance, as torch), and backward
// dx = rstd * (dy*w - mean(dy*w) - xhat * mean(dy*w * xhat)), dw = sum_rows dy * xhat,
// db = sum_rows dy. x, dy: (N, C) contiguous; w, b: (C,), all of one dtype.
//
// One warp per row. Where C is a multiple of 8 up to 1024 and the rows are 16-byte aligned (every
// GPT-2 up to gpt2-medium; `packed` from the launcher), a lane holds its part of the row in
// registers as Pack8s (lane l the columns 8 (l + 32 k) ... + 7) and moves it in 16-byte accesses;
// otherwise one value at a time, re-reading the row. The backward's column sums are deterministic
// (a resumed GPU run must add in the same order): each lane owns its columns' partial sums in the
// warp's shared memory over a fixed set of rows, a block adds
// its warps' sums in warp order into its row of a (blocks, 2C) f32 scratch, and common.cuh's
// COLUMN_SUMS (or COLUMN_SUMS_SPLIT with the packed kernels) adds the blocks in a fixed order for
// each column.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include "common.cuh"

#define ROWS_PER_BLOCK 4
// Pack8s a lane holds in the packed kernels: C up to 32 * 8 * 4 = 1024.
#define PACKS_PER_LANE 4
// The backward's blocks (at most 4 warps, the launcher's LAYER_NORM_GRAD_WARPS) an SM must hold:
// ptxas gives the bf16 kernel 145 registers uncapped (3 blocks), 128 at 4 (16 bytes spilled).
#define GRAD_BOUNDS __launch_bounds__(128, 4)

// The lane's packs of a row into registers (those within the row's `packs`).
template <typename T>
__device__ __forceinline__ void load_packs(Pack8<T> (&dst)[PACKS_PER_LANE], const T *row, uint32_t packs) {
  const uint32_t lane = threadIdx.x % 32;
#pragma unroll
  for (int k = 0; k < PACKS_PER_LANE; ++k)
    if (lane + 32 * k < packs) dst[k] = reinterpret_cast<const Pack8<T> *>(row)[lane + 32 * k];
}

// The mean and 1/sqrt(var + eps) of a row held as the warp's packs, in two passes (row_stats').
template <typename T, typename ToF32>
__device__ __forceinline__ void packed_row_stats(const Pack8<T> (&x)[PACKS_PER_LANE], uint32_t c, float eps,
                                                 ToF32 to_f32, float *mean, float *rstd) {
  const uint32_t lane = threadIdx.x % 32, packs = c / 8;
  float s = 0.0f;
#pragma unroll
  for (int k = 0; k < PACKS_PER_LANE; ++k)
    if (lane + 32 * k < packs)
#pragma unroll
      for (int i = 0; i < 8; ++i) s += to_f32(x[k].v[i]);
  const float m = warp_sum(s) / c;
  float v = 0.0f;
#pragma unroll
  for (int k = 0; k < PACKS_PER_LANE; ++k)
    if (lane + 32 * k < packs)
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const float d = to_f32(x[k].v[i]) - m;
        v += d * d;
      }
  *mean = m;
  *rstd = rsqrtf(warp_sum(v) / c + eps);
}

template <typename T, typename ToF32, typename FromF32>
__device__ __forceinline__ void layer_norm_row(const T *x, const T *w, const T *b, T *y, uint64_t rows, uint32_t c,
                                               float eps, uint32_t packed, ToF32 to_f32, FromF32 from_f32) {
  const uint64_t r = blockIdx.x * (uint64_t)ROWS_PER_BLOCK + threadIdx.x / 32;
  if (r >= rows) return;
  const T *xr = x + r * c;
  T *yr = y + r * c;
  float mean, rstd;
  if (packed) {
    const uint32_t lane = threadIdx.x % 32, packs = c / 8;
    Pack8<T> xs[PACKS_PER_LANE];
    load_packs(xs, xr, packs);
    packed_row_stats(xs, c, eps, to_f32, &mean, &rstd);
#pragma unroll
    for (int k = 0; k < PACKS_PER_LANE; ++k) {
      const uint32_t p = lane + 32 * k;
      if (p >= packs) continue;
      const Pack8<T> wk = reinterpret_cast<const Pack8<T> *>(w)[p], bk = reinterpret_cast<const Pack8<T> *>(b)[p];
      Pack8<T> o;
#pragma unroll
      for (int i = 0; i < 8; ++i)
        o.v[i] = from_f32((to_f32(xs[k].v[i]) - mean) * rstd * to_f32(wk.v[i]) + to_f32(bk.v[i]));
      reinterpret_cast<Pack8<T> *>(yr)[p] = o;
    }
    return;
  }
  row_stats(xr, c, eps, to_f32, &mean, &rstd);
  for (uint32_t j = threadIdx.x % 32; j < c; j += 32)
    yr[j] = from_f32((to_f32(xr[j]) - mean) * rstd * to_f32(w[j]) + to_f32(b[j]));
}

// dx rows into dx; this block's dw (first C) and db (last C) partial sums into partial[block].
// Warp k of block b takes rows b * W + k, then W * gridDim.x further, W = blockDim.x / 32; shared
// memory holds 2C floats a warp.
template <typename T, typename ToF32, typename FromF32>
__device__ __forceinline__ void layer_norm_grad_rows(const T *x, const T *w, const T *dy, T *dx, float *partial,
                                                     uint64_t rows, uint32_t c, float eps, uint32_t packed,
                                                     ToF32 to_f32, FromF32 from_f32) {
  extern __shared__ float shared_sums[];
  const uint32_t lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  float *sums = shared_sums + warp * 2 * c;
  const uint64_t stride = (uint64_t)gridDim.x * warps;
  if (packed) {
    const uint32_t packs = c / 8;
    Pack8<T> ws[PACKS_PER_LANE];
    load_packs(ws, w, packs);
    // The lane's columns 8p .. 8p + 7 of dw (first C) and db (last C) in the warp's shared row, as
    // float4s (the row's 2C floats are 16-byte aligned: C is a multiple of 8); in registers they
    // would hold the kernel to two blocks an SM.
    float4 *sums4 = reinterpret_cast<float4 *>(sums);
    const uint32_t db4 = c / 4;
#pragma unroll
    for (int k = 0; k < PACKS_PER_LANE; ++k) {
      const uint32_t p = lane + 32 * k;
      if (p < packs) sums4[2 * p] = sums4[2 * p + 1] = sums4[db4 + 2 * p] = sums4[db4 + 2 * p + 1] = float4{};
    }
    for (uint64_t r = (uint64_t)blockIdx.x * warps + warp; r < rows; r += stride) {
      Pack8<T> xs[PACKS_PER_LANE], gs[PACKS_PER_LANE];
      load_packs(xs, x + r * c, packs);
      load_packs(gs, dy + r * c, packs);
      float mean, rstd;
      packed_row_stats(xs, c, eps, to_f32, &mean, &rstd);
      float s_gw = 0.0f, s_gw_xhat = 0.0f;
#pragma unroll
      for (int k = 0; k < PACKS_PER_LANE; ++k) {
        const uint32_t p = lane + 32 * k;
        if (p >= packs) continue;
        float dw[8], db[8];
        *reinterpret_cast<float4 *>(dw) = sums4[2 * p];
        *reinterpret_cast<float4 *>(dw + 4) = sums4[2 * p + 1];
        *reinterpret_cast<float4 *>(db) = sums4[db4 + 2 * p];
        *reinterpret_cast<float4 *>(db + 4) = sums4[db4 + 2 * p + 1];
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const float xhat = (to_f32(xs[k].v[i]) - mean) * rstd, g = to_f32(gs[k].v[i]);
          const float gw = g * to_f32(ws[k].v[i]);
          s_gw += gw;
          s_gw_xhat += gw * xhat;
          dw[i] += g * xhat;
          db[i] += g;
        }
        sums4[2 * p] = *reinterpret_cast<float4 *>(dw);
        sums4[2 * p + 1] = *reinterpret_cast<float4 *>(dw + 4);
        sums4[db4 + 2 * p] = *reinterpret_cast<float4 *>(db);
        sums4[db4 + 2 * p + 1] = *reinterpret_cast<float4 *>(db + 4);
      }
      const float mean_gw = warp_sum(s_gw) / c, mean_gw_xhat = warp_sum(s_gw_xhat) / c;
#pragma unroll
      for (int k = 0; k < PACKS_PER_LANE; ++k) {
        const uint32_t p = lane + 32 * k;
        if (p >= packs) continue;
        Pack8<T> o;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const float xhat = (to_f32(xs[k].v[i]) - mean) * rstd;
          o.v[i] = from_f32(rstd * (to_f32(gs[k].v[i]) * to_f32(ws[k].v[i]) - mean_gw - xhat * mean_gw_xhat));
        }
        reinterpret_cast<Pack8<T> *>(dx + r * c)[p] = o;
      }
    }
  } else {
    for (uint32_t j = lane; j < 2 * c; j += 32) sums[j] = 0.0f;
    for (uint64_t r = (uint64_t)blockIdx.x * warps + warp; r < rows; r += stride) {
      const T *xr = x + r * c, *dyr = dy + r * c;
      float mean, rstd;
      row_stats(xr, c, eps, to_f32, &mean, &rstd);
      float s_gw = 0.0f, s_gw_xhat = 0.0f;
      for (uint32_t j = lane; j < c; j += 32) {
        const float xhat = (to_f32(xr[j]) - mean) * rstd, g = to_f32(dyr[j]);
        const float gw = g * to_f32(w[j]);
        s_gw += gw;
        s_gw_xhat += gw * xhat;
        sums[j] += g * xhat;
        sums[c + j] += g;
      }
      const float mean_gw = warp_sum(s_gw) / c, mean_gw_xhat = warp_sum(s_gw_xhat) / c;
      T *dxr = dx + r * c;
      for (uint32_t j = lane; j < c; j += 32) {
        const float xhat = (to_f32(xr[j]) - mean) * rstd;
        dxr[j] = from_f32(rstd * (to_f32(dyr[j]) * to_f32(w[j]) - mean_gw - xhat * mean_gw_xhat));
      }
    }
  }
  __syncthreads();
  for (uint32_t j = threadIdx.x; j < 2 * c; j += blockDim.x) {
    float s = 0.0f;
    for (uint32_t k = 0; k < warps; ++k) s += shared_sums[k * 2 * c + j];
    partial[blockIdx.x * 2ull * c + j] = s;
  }
}

// `packed` is the launcher's (C a multiple of 8 up to 1024); the kernels also check alignment.
#define LAYER_NORM(SUFFIX, T, TO_F32, FROM_F32)                                                                \
  extern "C" __global__ void layer_norm_##SUFFIX(const T *x, const T *w, const T *b, T *y, uint64_t rows,      \
                                                 uint32_t c, float eps, uint32_t packed) {                     \
    packed = packed && aligned16(x) && aligned16(w) && aligned16(b) && aligned16(y);                           \
    layer_norm_row(x, w, b, y, rows, c, eps, packed, [](T v) { return TO_F32(v); },                            \
                   [](float v) { return FROM_F32(v); });                                                       \
  }                                                                                                            \
  extern "C" __global__ void GRAD_BOUNDS layer_norm_grad_##SUFFIX(const T *x, const T *w, const T *dy, T *dx,  \
                                                      float *partial, uint64_t rows, uint32_t c, float eps,    \
                                                      uint32_t packed) {                                       \
    packed = packed && aligned16(x) && aligned16(w) && aligned16(dy) && aligned16(dx);                         \
    layer_norm_grad_rows(x, w, dy, dx, partial, rows, c, eps, packed, [](T v) { return TO_F32(v); },           \
                         [](float v) { return FROM_F32(v); });                                                 \
  }                                                                                                            \
  COLUMN_SUMS(column_sums_##SUFFIX, T, FROM_F32)                                                               \
  COLUMN_SUMS_SPLIT(column_sums_split_##SUFFIX, T, FROM_F32)

#define IDENTITY(v) (v)
LAYER_NORM(f32, float, IDENTITY, IDENTITY)
LAYER_NORM(bf16, __nv_bfloat16, __bfloat162float, __float2bfloat16_rn)
LAYER_NORM(f16, __half, __half2float, __float2half_rn)
