// Device helpers the kernels of this directory share: warp reductions, LayerNorm's row
// statistics, GPT-2's GELU and the dropout draw.
#pragma once
#include <stdint.h>

__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffff, v, o));
  return v;
}

__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o);
  return v;
}

__device__ __forceinline__ double warp_sum_f64(double v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o);
  return v;
}

// The mean and 1/sqrt(var + eps) of row x (C elements) across the warp, in two passes.
template <typename T, typename F>
__device__ __forceinline__ void row_stats(const T *x, uint32_t c, float eps, F to_f32, float *mean, float *rstd) {
  const uint32_t lane = threadIdx.x % 32;
  float s = 0.0f;
  for (uint32_t j = lane; j < c; j += 32) s += to_f32(x[j]);
  const float m = warp_sum(s) / c;
  float v = 0.0f;
  for (uint32_t j = lane; j < c; j += 32) {
    const float d = to_f32(x[j]) - m;
    v += d * d;
  }
  *mean = m;
  *rstd = rsqrtf(warp_sum(v) / c + eps);
}

// Eight values moved as 16-byte accesses (one for 2-byte types, two for f32): elementwise
// kernels run at a fraction of the memory's bandwidth with one 2-byte access a thread.
template <typename T>
struct alignas(16) Pack8 {
  T v[8];
};

__device__ __forceinline__ bool aligned16(const void *p) { return ((uintptr_t)p & 15) == 0; }

// The grid-stride loop of an elementwise kernel over n values, eight at a time (Pack8) where
// every pointer is 16-byte aligned, then one at a time for the rest (all of them otherwise):
// `pack(p)` handles values 8p..8p+7, `one(i)` value i. Launched with a thread per eight values.
template <typename Pack, typename One>
__device__ __forceinline__ void elementwise8(uint64_t n, bool aligned, Pack pack, One one) {
  const uint64_t stride = (uint64_t)blockDim.x * gridDim.x;
  const uint64_t tid = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x;
  uint64_t done = 0;
  if (aligned) {
    for (uint64_t p = tid; p < n / 8; p += stride) pack(p);
    done = n / 8 * 8;
  }
  for (uint64_t i = done + tid; i < n; i += stride) one(i);
}

#define GELU_K0 0.7978846f  // sqrt(2 / pi)
#define GELU_K1 0.044715f

// GPT-2's GELU (`gelu_new`, the tanh approximation), in f32.
__device__ __forceinline__ float gelu_new(float u) {
  const float t = tanhf(GELU_K0 * u * (1.0f + GELU_K1 * u * u));
  return 0.5f * u * (1.0f + t);
}

__device__ __forceinline__ uint64_t splitmix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// Dropout's factor of element i of a site (src/kernels/dropout.rs, rowops::dropout_factor): kept,
// times `scale`, when the high half of SplitMix64's i-th output from `seed` is at least
// `threshold`; else 0.
__device__ __forceinline__ float dropout_factor(uint64_t seed, uint32_t threshold, float scale, uint64_t i) {
  const uint64_t golden_gamma = 0x9E3779B97F4A7C15ull;
  uint32_t draw = (uint32_t)(splitmix64(seed + (i + 1) * golden_gamma) >> 32);
  return draw >= threshold ? scale : 0.0f;
}

// out[j] = the sum over blocks of partial[block][j] (f32, (blocks, width)), in block order: the
// second pass of a deterministic column sum.
#define COLUMN_SUMS(NAME, T, FROM_F32)                                                                \
  extern "C" __global__ void NAME(const float *partial, T *out, uint32_t blocks, uint32_t width) {    \
    const uint32_t j = blockIdx.x * blockDim.x + threadIdx.x;                                         \
    if (j >= width) return;                                                                           \
    float s = 0.0f;                                                                                   \
    for (uint32_t k = 0; k < blocks; ++k) s += partial[(uint64_t)k * width + j];                      \
    out[j] = FROM_F32(s);                                                                             \
  }

// out[j] = the sum over blocks of partial[block][j] (f32, (blocks, width)) in a fixed order: the
// second pass of a deterministic column sum. A block takes 32 columns (a warp reads 128 bytes of a
// partial row), its warp w the blocks w, w + W, ... (W = COLUMN_SUM_WARPS), then warp 0 adds the
// warps' sums in warp order. Grid (ceil(width / 32)), block (32 * COLUMN_SUM_WARPS); the launchers'
// `column_sums_split` (cuda.rs), where COLUMN_SUMS' one thread a column walks every block alone.
#define COLUMN_SUM_WARPS 16
#define COLUMN_SUMS_SPLIT(NAME, T, FROM_F32)                                                          \
  extern "C" __global__ void NAME(const float *partial, T *out, uint32_t blocks, uint32_t width) {    \
    __shared__ float warp_sums[COLUMN_SUM_WARPS][32];                                                 \
    const uint32_t lane = threadIdx.x % 32, w = threadIdx.x / 32, j = blockIdx.x * 32 + lane;         \
    float s = 0.0f;                                                                                   \
    if (j < width)                                                                                    \
      for (uint32_t k = w; k < blocks; k += COLUMN_SUM_WARPS) s += partial[(uint64_t)k * width + j];  \
    warp_sums[w][lane] = s;                                                                           \
    __syncthreads();                                                                                  \
    if (w != 0 || j >= width) return;                                                                 \
    s = 0.0f;                                                                                         \
    for (uint32_t k = 0; k < COLUMN_SUM_WARPS; ++k) s += warp_sums[k][lane];                          \
    out[j] = FROM_F32(s);                                                                             \
  }
