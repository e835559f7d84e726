// An f32 tensor cast into the existing storage of a bf16 or f16 one of the same length, rounding
// to nearest even (as candle's cast and the CPU's `half` conversions): mixed precision's compute
// copy refreshed from the fp32 masters in one kernel, with no temporary (fused.rs's CastInto).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#define CAST_INTO(NAME, T, FROM_F32)                                                          \
  extern "C" __global__ void NAME(T *dst, const float *src, uint64_t n) {                     \
    for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < n;                 \
         i += (uint64_t)blockDim.x * gridDim.x)                                               \
      dst[i] = FROM_F32(src[i]);                                                              \
  }

CAST_INTO(cast_into_bf16, __nv_bfloat16, __float2bfloat16_rn)
CAST_INTO(cast_into_f16, __half, __float2half_rn)
