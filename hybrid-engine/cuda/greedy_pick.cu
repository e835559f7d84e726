// Greedy decoding's choice on the GPU, what fused.rs's GreedyPick computes on the CPU: for each
// row of logits (B, V), the first id below `limit` with the row's largest logit, and that
// token's log-probability under the whole row, x[token] - logsumexp(x), the exponentials summed
// in f64. out: (B, 2) f32, the token (an exact integer: V < 2^24) then its log-probability. Only
// these two numbers a row go to the host, not the row's V logits (32 rows of GPT-2's vocabulary
// are 6.4 MB of f32 a token). One block a row, two passes over it: the maximum and the pick,
// then the sum (the second pass reads what the first left in L2).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <math.h>
#include <stdint.h>

#include "common.cuh"

#define THREADS 256
#define WARPS (THREADS / 32)
#define NOTHING 0xffffffffu

// (best, at) merged with (best2, at2): the larger value, on a tie the smaller id (the CPU's
// argmax takes the first position of the maximum). `at` NOTHING: no value seen.
__device__ __forceinline__ void merge_pick(float &best, uint32_t &at, float best2, uint32_t at2) {
  if (at2 == NOTHING) return;
  if (at == NOTHING || best2 > best || (best2 == best && at2 < at)) {
    best = best2;
    at = at2;
  }
}

#define GREEDY_PICK(SUFFIX, T, TO_F32)                                                                       \
  extern "C" __global__ void greedy_pick_##SUFFIX(const T *logits, float *out, uint32_t v, uint32_t limit) { \
    __shared__ float best_of_warp[WARPS], max_of_warp[WARPS];                                                \
    __shared__ uint32_t at_of_warp[WARPS];                                                                   \
    __shared__ double total_of_warp[WARPS];                                                                  \
    const T *x = logits + (uint64_t)blockIdx.x * v;                                                          \
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;                                              \
    float best = -INFINITY, m = -INFINITY;                                                                   \
    uint32_t at = NOTHING;                                                                                   \
    for (uint32_t j = threadIdx.x; j < v; j += THREADS) {                                                    \
      const float xj = TO_F32(x[j]);                                                                         \
      m = fmaxf(m, xj);                                                                                      \
      if (j < limit) merge_pick(best, at, xj, j);                                                            \
    }                                                                                                        \
    for (int o = 16; o > 0; o >>= 1) {                                                                       \
      const float best2 = __shfl_xor_sync(0xffffffff, best, o);                                              \
      const uint32_t at2 = __shfl_xor_sync(0xffffffff, at, o);                                               \
      merge_pick(best, at, best2, at2);                                                                      \
    }                                                                                                        \
    m = warp_max(m);                                                                                         \
    if (lane == 0) {                                                                                         \
      best_of_warp[warp] = best;                                                                             \
      at_of_warp[warp] = at;                                                                                 \
      max_of_warp[warp] = m;                                                                                 \
    }                                                                                                        \
    __syncthreads();                                                                                         \
    best = -INFINITY;                                                                                        \
    at = NOTHING;                                                                                            \
    m = -INFINITY;                                                                                           \
    for (int w = 0; w < WARPS; ++w) {                                                                        \
      merge_pick(best, at, best_of_warp[w], at_of_warp[w]);                                                  \
      m = fmaxf(m, max_of_warp[w]);                                                                          \
    }                                                                                                        \
    double total = 0.0;                                                                                      \
    for (uint32_t j = threadIdx.x; j < v; j += THREADS) total += (double)expf(TO_F32(x[j]) - m);             \
    total = warp_sum_f64(total);                                                                             \
    if (lane == 0) total_of_warp[warp] = total;                                                              \
    __syncthreads();                                                                                         \
    if (threadIdx.x == 0) {                                                                                  \
      total = 0.0;                                                                                           \
      for (int w = 0; w < WARPS; ++w) total += total_of_warp[w];                                             \
      /* limit >= 1 (the caller's), so some id was seen; NOTHING only guards the read. */                    \
      const uint32_t token = at == NOTHING ? 0 : at;                                                         \
      out[2ull * blockIdx.x] = (float)token;                                                                 \
      out[2ull * blockIdx.x + 1] = (float)((double)TO_F32(x[token]) - ((double)m + log(total)));             \
    }                                                                                                        \
  }

#define IDENTITY(v) (v)
GREEDY_PICK(f32, float, IDENTITY)
GREEDY_PICK(bf16, __nv_bfloat16, __bfloat162float)
GREEDY_PICK(f16, __half, __half2float)
