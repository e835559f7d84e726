// The sum of squares of a tensor in f64, what a gradient norm adds up (the CPU's sum_of_squares
// also squares and sums in f64): each block sums a grid-stride slice of the tensor, then one block
// adds the blocks' sums in block order. The grid depends only on the length, so the result is the
// same on every run.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

__device__ __forceinline__ double warp_sum_f64(double v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o);
  return v;
}

// The sum of `v` over a block (blockDim.x a multiple of 32, at most 1024), valid in thread 0.
__device__ __forceinline__ double block_sum_f64(double v) {
  __shared__ double warp_sums[32];
  const uint32_t warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  v = warp_sum_f64(v);
  if (lane == 0) warp_sums[warp] = v;
  __syncthreads();
  v = 0.0;
  if (warp == 0) {
    v = lane < blockDim.x / 32 ? warp_sums[lane] : 0.0;
    v = warp_sum_f64(v);
  }
  return v;
}

#define SUM_OF_SQUARES(NAME, T, TO_F32)                                                           \
  extern "C" __global__ void NAME(const T *x, uint64_t n, double *partial) {                      \
    double acc = 0.0;                                                                             \
    for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < n;                     \
         i += (uint64_t)blockDim.x * gridDim.x) {                                                 \
      const double v = TO_F32(x[i]);                                                              \
      acc += v * v;                                                                               \
    }                                                                                             \
    acc = block_sum_f64(acc);                                                                     \
    if (threadIdx.x == 0) partial[blockIdx.x] = acc;                                              \
  }

#define IDENTITY(v) (v)
SUM_OF_SQUARES(sum_of_squares_f32, float, IDENTITY)
SUM_OF_SQUARES(sum_of_squares_bf16, __nv_bfloat16, __bfloat162float)
SUM_OF_SQUARES(sum_of_squares_f16, __half, __half2float)

// out[0] = the sum of partial[0..blocks), one block, each thread a strided share, then in order.
extern "C" __global__ void sum_partials_f64(const double *partial, uint32_t blocks, double *out) {
  double acc = 0.0;
  for (uint32_t i = threadIdx.x; i < blocks; i += blockDim.x) acc += partial[i];
  acc = block_sum_f64(acc);
  if (threadIdx.x == 0) out[0] = acc;
}
