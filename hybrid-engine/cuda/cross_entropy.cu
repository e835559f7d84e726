// Per-row cross-entropy on the GPU, what fused.rs's CrossEntropyRows and CrossEntropyRowsGrad
// compute on the CPU, reading the logits in their own dtype (no f32 copy of the (N, V) logits):
// loss[r] = logsumexp(x[r]) - x[r, target[r]] in f32, and the gradient
// dx[r, j] = (softmax(x[r])[j] - [j == target[r]]) * grad[r], the row's log-sum-exp recovered
// from its loss as loss + x[target]. One block per row (V is long): each thread keeps an online
// (max, sum of exp) over its strided elements, merged across the block. A target outside the
// vocabulary gives a NaN loss (the CPU kernel refuses it with an error). Where V is a multiple of
// 8 and the rows are 16-byte aligned (`packed` from the launcher: GPT-2's padded 50304), a thread
// moves eight values in a 16-byte access (Pack8) and folds them into its (max, sum) with one
// rescale for the eight; else one value at a time.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <math.h>
#include <stdint.h>

#include "common.cuh"

#define THREADS 256

// (m, s) = the max and sum of exp(x - m) of a set; merged with another set.
__device__ __forceinline__ void merge(float &m, float &s, float m2, float s2) {
  if (m2 == -INFINITY) return;
  if (m == -INFINITY) { m = m2; s = s2; return; }
  const float mm = fmaxf(m, m2);
  s = s * expf(m - mm) + s2 * expf(m2 - mm);
  m = mm;
}

// The log-sum-exp of the row across the block (every thread gets it).
__device__ __forceinline__ float block_log_sum_exp(float m, float s) {
  __shared__ float ms[THREADS / 32], ss[THREADS / 32];
  for (int o = 16; o > 0; o >>= 1) {
    const float m2 = __shfl_xor_sync(0xffffffff, m, o), s2 = __shfl_xor_sync(0xffffffff, s, o);
    merge(m, s, m2, s2);
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) { ms[warp] = m; ss[warp] = s; }
  __syncthreads();
  m = -INFINITY; s = 0.0f;
  for (int w = 0; w < THREADS / 32; ++w) merge(m, s, ms[w], ss[w]);  // the same order everywhere
  return m + logf(s);
}

// Folds eight values into the thread's (m, s): the new max once, then each exp against it.
__device__ __forceinline__ void fold8(float &m, float &s, const float (&f)[8]) {
  float mx = f[0];
#pragma unroll
  for (int i = 1; i < 8; ++i) mx = fmaxf(mx, f[i]);
  if (mx == -INFINITY) return;
  if (mx > m) {
    s *= expf(m - mx);  // 0 while m is -inf (s is 0 then too)
    m = mx;
  }
#pragma unroll
  for (int i = 0; i < 8; ++i) s += expf(f[i] - m);
}

#define CROSS_ENTROPY(NAME, T, TO_F32)                                                              \
  extern "C" __global__ void NAME(const T *logits, const uint32_t *targets, float *loss, uint32_t v, \
                                  uint32_t packed) {                                                \
    const T *x = logits + (uint64_t)blockIdx.x * v;                                                  \
    float m = -INFINITY, s = 0.0f;                                                                   \
    uint32_t done = 0;                                                                               \
    if (packed && aligned16(x)) {                                                                    \
      for (uint32_t p = threadIdx.x; p < v / 8; p += THREADS) {                                      \
        const Pack8<T> q = reinterpret_cast<const Pack8<T> *>(x)[p];                                 \
        float f[8];                                                                                  \
        _Pragma("unroll") for (int i = 0; i < 8; ++i) f[i] = TO_F32(q.v[i]);                         \
        fold8(m, s, f);                                                                              \
      }                                                                                              \
      done = v / 8 * 8;                                                                              \
    }                                                                                                \
    for (uint32_t j = done + threadIdx.x; j < v; j += THREADS) merge(m, s, TO_F32(x[j]), 1.0f);     \
    const float lse = block_log_sum_exp(m, s);                                                       \
    if (threadIdx.x == 0) {                                                                          \
      const uint32_t t = targets[blockIdx.x];                                                        \
      loss[blockIdx.x] = t < v ? lse - TO_F32(x[t]) : NAN;                                           \
    }                                                                                                \
  }

#define CROSS_ENTROPY_GRAD(NAME, T, TO_F32, FROM_F32)                                               \
  extern "C" __global__ void NAME(const T *logits, const uint32_t *targets, const float *loss_grad,  \
                                  T *dx, uint32_t v, uint32_t packed) {                              \
    const uint64_t r = blockIdx.x;                                                                   \
    const T *x = logits + r * v;                                                                     \
    const uint32_t t = targets[r];                                                                   \
    const float g = loss_grad[2 * r + 1];                                                            \
    const float lse = loss_grad[2 * r] + (t < v ? TO_F32(x[t]) : NAN);                               \
    T *d = dx + r * v;                                                                               \
    uint32_t done = 0;                                                                               \
    if (packed && aligned16(x) && aligned16(d)) {                                                    \
      for (uint32_t p = threadIdx.x; p < v / 8; p += THREADS) {                                      \
        const Pack8<T> q = reinterpret_cast<const Pack8<T> *>(x)[p];                                 \
        Pack8<T> o;                                                                                  \
        _Pragma("unroll") for (int i = 0; i < 8; ++i) o.v[i] =                                       \
            FROM_F32((expf(TO_F32(q.v[i]) - lse) - (8 * p + i == t ? 1.0f : 0.0f)) * g);             \
        reinterpret_cast<Pack8<T> *>(d)[p] = o;                                                      \
      }                                                                                              \
      done = v / 8 * 8;                                                                              \
    }                                                                                                \
    for (uint32_t j = done + threadIdx.x; j < v; j += THREADS)                                       \
      d[j] = FROM_F32((expf(TO_F32(x[j]) - lse) - (j == t ? 1.0f : 0.0f)) * g);                      \
  }

#define IDENTITY(v) (v)
CROSS_ENTROPY(cross_entropy_f32, float, IDENTITY)
CROSS_ENTROPY(cross_entropy_bf16, __nv_bfloat16, __bfloat162float)
CROSS_ENTROPY(cross_entropy_f16, __half, __half2float)
CROSS_ENTROPY_GRAD(cross_entropy_grad_f32, float, IDENTITY, IDENTITY)
CROSS_ENTROPY_GRAD(cross_entropy_grad_bf16, __nv_bfloat16, __bfloat162float, __float2bfloat16_rn)
CROSS_ENTROPY_GRAD(cross_entropy_grad_f16, __half, __half2float, __float2half_rn)
