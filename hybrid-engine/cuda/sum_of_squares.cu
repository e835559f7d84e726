// The sum of squares of tensors in f64, what a gradient norm adds up (the CPU's sum_of_squares
// also squares and sums in f64), in one launch for all of them: each block sums a chunk, then one
// block adds the chunks' sums in chunk order. The result is the same on every run.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include "multi_tensor.cuh"

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

// partial[c] = the sum of squares of chunk c of the table's tensors (multi_tensor.cuh), one block
// a chunk: the grid, and so the order of every sum, depends only on the tensors' lengths.
extern "C" __global__ void sum_of_squares_multi_tensor(const TensorSlot *slots, uint32_t count, uint32_t chunk,
                                                       double *partial) {
  const TensorSlot &s = slot_of_chunk(slots, count, blockIdx.x);
  const ChunkRange r = chunk_range(s, chunk);
  double acc = 0.0;
  with_float_type(s.grad_dtype, [&](auto typed) {
    const auto *x = reinterpret_cast<decltype(typed)>(s.grad);
    for (uint64_t i = r.begin + threadIdx.x; i < r.end; i += blockDim.x) {
      const double v = to_f32(x[i]);
      acc += v * v;
    }
  });
  acc = block_sum_f64(acc);
  if (threadIdx.x == 0) partial[blockIdx.x] = acc;
}

// out[0] = the sum of partial[0..blocks), one block, each thread a strided share, then in order.
extern "C" __global__ void sum_partials_f64(const double *partial, uint32_t blocks, double *out) {
  double acc = 0.0;
  for (uint32_t i = threadIdx.x; i < blocks; i += blockDim.x) acc += partial[i];
  acc = block_sum_f64(acc);
  if (threadIdx.x == 0) out[0] = acc;
}
