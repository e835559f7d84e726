// GPT-2's GELU (`gelu_new`, the tanh approximation) and its gradient on the GPU, what fused.rs's
// Gelu and GeluGrad compute on the CPU (rowops::gelu_and_slope), in f32 whatever the dtype.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include "common.cuh"

#define GELU(NAME, T, TO_F32, FROM_F32)                                                          \
  extern "C" __global__ void NAME(const T *h, T *y, uint64_t n) {                                 \
    for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < n;                     \
         i += (uint64_t)blockDim.x * gridDim.x) {                                                 \
      y[i] = FROM_F32(gelu_new(TO_F32(h[i])));                                                    \
    }                                                                                             \
  }

#define GELU_GRAD(NAME, T, TO_F32, FROM_F32)                                                     \
  extern "C" __global__ void NAME(const T *h, const T *dy, T *dh, uint64_t n) {                   \
    for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < n;                     \
         i += (uint64_t)blockDim.x * gridDim.x) {                                                 \
      const float u = TO_F32(h[i]);                                                               \
      const float t = tanhf(GELU_K0 * u * (1.0f + GELU_K1 * u * u));                              \
      const float slope =                                                                         \
          0.5f * (1.0f + t) + 0.5f * u * (1.0f - t * t) * GELU_K0 * (1.0f + 3.0f * GELU_K1 * u * u); \
      dh[i] = FROM_F32(TO_F32(dy[i]) * slope);                                                    \
    }                                                                                             \
  }

#define IDENTITY(v) (v)
GELU(gelu_f32, float, IDENTITY, IDENTITY)
GELU(gelu_bf16, __nv_bfloat16, __bfloat162float, __float2bfloat16_rn)
GELU(gelu_f16, __half, __half2float, __float2half_rn)
GELU_GRAD(gelu_grad_f32, float, IDENTITY, IDENTITY)
GELU_GRAD(gelu_grad_bf16, __nv_bfloat16, __bfloat162float, __float2bfloat16_rn)
GELU_GRAD(gelu_grad_f16, __half, __half2float, __float2half_rn)
