// Dropout on the GPU, drawing the very mask the CPU draws (src/kernels/dropout.rs and
// rowops::dropout_factor): element i of a site seeded `seed` is kept, times `scale`, when the high
// half of SplitMix64's i-th output is at least `threshold`. Counter-based: a thread computes its
// elements' draws from their indices, so nothing crosses the bus and a GPU run, its resumption
// and a CPU run drop the same elements.
//
// The scale is rounded to the tensor's dtype first, as a factor tensor of that dtype holds it;
// the product of two bf16 or f16 values is exact in f32, so rounding it once gives the dtype's
// own multiplication by that factor tensor, bit for bit.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include "common.cuh"

// y[j] = x[j] * factor(j) over n contiguous elements, eight at a time where aligned.
#define DROPOUT(NAME, T, TO_F32, FROM_F32)                                                         \
  extern "C" __global__ void NAME(const T *x, T *y, uint64_t n, uint64_t seed, uint32_t threshold, \
                                  float scale) {                                                   \
    const float s = TO_F32(FROM_F32(scale));                                                       \
    elementwise8(                                                                                  \
        n, aligned16(x) && aligned16(y),                                                           \
        [&](uint64_t p) {                                                                          \
          const Pack8<T> a = reinterpret_cast<const Pack8<T> *>(x)[p];                             \
          Pack8<T> o;                                                                              \
          _Pragma("unroll") for (int k = 0; k < 8; ++k) o.v[k] =                                   \
              FROM_F32(TO_F32(a.v[k]) * dropout_factor(seed, threshold, s, 8 * p + k));            \
          reinterpret_cast<Pack8<T> *>(y)[p] = o;                                                  \
        },                                                                                         \
        [&](uint64_t i) { y[i] = FROM_F32(TO_F32(x[i]) * dropout_factor(seed, threshold, s, i)); }); \
  }

#define IDENTITY(v) (v)
DROPOUT(dropout_f32, float, IDENTITY, IDENTITY)
DROPOUT(dropout_bf16, __nv_bfloat16, __bfloat162float, __float2bfloat16_rn)
DROPOUT(dropout_f16, __half, __half2float, __float2half_rn)
