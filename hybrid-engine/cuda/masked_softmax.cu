// The attention softmax on the GPU, what fused.rs's MaskedSoftmax computes on the CPU:
// y = softmax(att * scale + bias) over each row of S scores, in f32 whatever the scores' dtype
// (Megatron's attention_softmax_in_fp32), and its gradient dx = scale * y * (dy - sum(y * dy)).
// One warp per row: rows are short (S <= n_positions), and a warp reduces without shared memory.
// att, y, dy: (B, NH, T, S) contiguous; bias: (B or 1, 1, T, S) f32.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include "common.cuh"

#define ROWS_PER_BLOCK 4

#define MASKED_SOFTMAX(NAME, T, TO_F32, FROM_F32)                                                   \
  extern "C" __global__ void NAME(const T *att, const float *bias, T *y, uint64_t rows, uint32_t s,  \
                                  uint32_t nh, uint32_t t, uint32_t bias_batches, float scale) {     \
    const uint64_t r = blockIdx.x * (uint64_t)ROWS_PER_BLOCK + threadIdx.x / 32;                     \
    const uint32_t lane = threadIdx.x % 32;                                                          \
    if (r >= rows) return;                                                                           \
    const uint64_t batch = r / ((uint64_t)nh * t), i = r % t;                                        \
    const float *b = bias + (bias_batches == 1 ? i : batch * t + i) * s;                             \
    const T *a = att + r * s;                                                                        \
    float m = -INFINITY;                                                                             \
    for (uint32_t j = lane; j < s; j += 32) m = fmaxf(m, TO_F32(a[j]) * scale + b[j]);               \
    m = warp_max(m);                                                                                 \
    float sum = 0.0f;                                                                                \
    for (uint32_t j = lane; j < s; j += 32) sum += expf(TO_F32(a[j]) * scale + b[j] - m);            \
    sum = warp_sum(sum);                                                                             \
    T *out = y + r * s;                                                                              \
    for (uint32_t j = lane; j < s; j += 32) out[j] = FROM_F32(expf(TO_F32(a[j]) * scale + b[j] - m) / sum); \
  }

#define MASKED_SOFTMAX_GRAD(NAME, T, TO_F32, FROM_F32)                                              \
  extern "C" __global__ void NAME(const T *y, const T *dy, T *dx, uint64_t rows, uint32_t s,         \
                                  float scale) {                                                    \
    const uint64_t r = blockIdx.x * (uint64_t)ROWS_PER_BLOCK + threadIdx.x / 32;                     \
    const uint32_t lane = threadIdx.x % 32;                                                          \
    if (r >= rows) return;                                                                           \
    const T *yr = y + r * s, *dyr = dy + r * s;                                                      \
    float dot = 0.0f;                                                                                \
    for (uint32_t j = lane; j < s; j += 32) dot += TO_F32(yr[j]) * TO_F32(dyr[j]);                   \
    dot = warp_sum(dot);                                                                             \
    T *out = dx + r * s;                                                                             \
    for (uint32_t j = lane; j < s; j += 32)                                                          \
      out[j] = FROM_F32(scale * TO_F32(yr[j]) * (TO_F32(dyr[j]) - dot));                             \
  }

#define IDENTITY(v) (v)
MASKED_SOFTMAX(masked_softmax_f32, float, IDENTITY, IDENTITY)
MASKED_SOFTMAX(masked_softmax_bf16, __nv_bfloat16, __bfloat162float, __float2bfloat16_rn)
MASKED_SOFTMAX(masked_softmax_f16, __half, __half2float, __float2half_rn)
MASKED_SOFTMAX_GRAD(masked_softmax_grad_f32, float, IDENTITY, IDENTITY)
MASKED_SOFTMAX_GRAD(masked_softmax_grad_bf16, __nv_bfloat16, __bfloat162float, __float2bfloat16_rn)
MASKED_SOFTMAX_GRAD(masked_softmax_grad_f16, __half, __half2float, __float2half_rn)
