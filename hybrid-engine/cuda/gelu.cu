// GPT-2's GELU (`gelu_new`, the tanh approximation) and its gradient on the GPU, what fused.rs's
// Gelu and GeluGrad compute on the CPU (rowops::gelu_and_slope), in f32 whatever the dtype.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include "common.cuh"

// gelu_new'(u), in f32.
__device__ __forceinline__ float gelu_slope(float u) {
  const float t = tanhf(GELU_K0 * u * (1.0f + GELU_K1 * u * u));
  return 0.5f * (1.0f + t) + 0.5f * u * (1.0f - t * t) * GELU_K0 * (1.0f + 3.0f * GELU_K1 * u * u);
}

#define GELU(NAME, T, TO_F32, FROM_F32)                                                   \
  extern "C" __global__ void NAME(const T *h, T *y, uint64_t n) {                          \
    elementwise8(                                                                          \
        n, aligned16(h) && aligned16(y),                                                   \
        [&](uint64_t p) {                                                                  \
          const Pack8<T> a = reinterpret_cast<const Pack8<T> *>(h)[p];                     \
          Pack8<T> o;                                                                      \
          _Pragma("unroll") for (int k = 0; k < 8; ++k) o.v[k] = FROM_F32(gelu_new(TO_F32(a.v[k]))); \
          reinterpret_cast<Pack8<T> *>(y)[p] = o;                                          \
        },                                                                                 \
        [&](uint64_t i) { y[i] = FROM_F32(gelu_new(TO_F32(h[i]))); });                     \
  }

#define GELU_GRAD(NAME, T, TO_F32, FROM_F32)                                              \
  extern "C" __global__ void NAME(const T *h, const T *dy, T *dh, uint64_t n) {            \
    elementwise8(                                                                          \
        n, aligned16(h) && aligned16(dy) && aligned16(dh),                                 \
        [&](uint64_t p) {                                                                  \
          const Pack8<T> a = reinterpret_cast<const Pack8<T> *>(h)[p];                     \
          const Pack8<T> g = reinterpret_cast<const Pack8<T> *>(dy)[p];                    \
          Pack8<T> o;                                                                      \
          _Pragma("unroll") for (int k = 0; k < 8; ++k) o.v[k] =                           \
              FROM_F32(TO_F32(g.v[k]) * gelu_slope(TO_F32(a.v[k])));                       \
          reinterpret_cast<Pack8<T> *>(dh)[p] = o;                                         \
        },                                                                                 \
        [&](uint64_t i) { dh[i] = FROM_F32(TO_F32(dy[i]) * gelu_slope(TO_F32(h[i]))); });  \
  }

#define IDENTITY(v) (v)
GELU(gelu_f32, float, IDENTITY, IDENTITY)
GELU(gelu_bf16, __nv_bfloat16, __bfloat162float, __float2bfloat16_rn)
GELU(gelu_f16, __half, __half2float, __float2half_rn)
GELU_GRAD(gelu_grad_f32, float, IDENTITY, IDENTITY)
GELU_GRAD(gelu_grad_bf16, __nv_bfloat16, __bfloat162float, __float2bfloat16_rn)
GELU_GRAD(gelu_grad_f16, __half, __half2float, __float2half_rn)
