// Device helpers the kernels of this directory share: warp reductions and the dropout draw.
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
