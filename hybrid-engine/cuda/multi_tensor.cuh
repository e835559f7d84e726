// The table a multi-tensor kernel reads (apex's multi_tensor_apply): one launch over every
// parameter of a model instead of one or two a parameter, which on a GPU costs more in host time
// than the work itself for the model's many small tensors. Each tensor is cut into chunks of
// `chunk` values, one block a chunk; a tensor's row says where its chunks start, and a block
// finds its tensor by a binary search over those starts. The layout is kernels/cuda.rs's
// `TensorSlot`, field for field (addresses as 64-bit integers, so both sides agree on it).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

// Element types of a slot's operands.
#define DTYPE_F32 0u
#define DTYPE_BF16 1u
#define DTYPE_F16 2u
// A slot without a compute copy to write.
#define DTYPE_NONE 3u

struct TensorSlot {
  uint64_t param;    // float *: the f32 master, updated in place (AdamW only)
  uint64_t grad;     // const f32/bf16/f16 *: the gradient, or the tensor a norm reads
  uint64_t moments;  // float *: m then v, 2n values (AdamW only)
  uint64_t copy;     // bf16/f16 *: the compute copy AdamW writes, or 0
  uint64_t n;        // values in the tensor (at least 1)
  uint32_t first_chunk;
  uint32_t grad_dtype;  // DTYPE_F32, DTYPE_BF16 or DTYPE_F16
  uint32_t copy_dtype;  // DTYPE_BF16, DTYPE_F16 or DTYPE_NONE
  float decay;          // AdamW's 1 - lr wd for this tensor
  float step_size;      // AdamW's lr / (1 - b1^step) for this tensor
  uint32_t unused;
};

// The slot whose chunks hold chunk `c`: the last one starting at or before it (slots are in
// chunk order, every slot has at least one chunk, slots[0] starts at 0).
__device__ __forceinline__ const TensorSlot &slot_of_chunk(const TensorSlot *slots, uint32_t count, uint32_t c) {
  uint32_t lo = 0, hi = count;
  while (hi - lo > 1) {
    const uint32_t mid = (lo + hi) / 2;
    if (slots[mid].first_chunk <= c) lo = mid;
    else hi = mid;
  }
  return slots[lo];
}

// Operand values as f32 (exact for every dtype) and f32 values rounded to nearest even into them.
__device__ __forceinline__ float to_f32(float v) { return v; }
__device__ __forceinline__ float to_f32(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_f32(__half v) { return __half2float(v); }
__device__ __forceinline__ void store_f32(__nv_bfloat16 *dst, float v) { *dst = __float2bfloat16_rn(v); }
__device__ __forceinline__ void store_f32(__half *dst, float v) { *dst = __float2half_rn(v); }

// The values [begin, end) of chunk blockIdx.x within its slot.
struct ChunkRange {
  uint64_t begin, end;
};
__device__ __forceinline__ ChunkRange chunk_range(const TensorSlot &s, uint32_t chunk) {
  const uint64_t begin = (uint64_t)(blockIdx.x - s.first_chunk) * chunk;
  return {begin, min(begin + chunk, s.n)};
}

// Calls `f` with a null pointer of the element type `dtype` names (DTYPE_F32, _BF16 or _F16): a
// kernel's body is compiled once for each and chosen once a block, not once a value.
template <typename F>
__device__ __forceinline__ void with_float_type(uint32_t dtype, F f) {
  switch (dtype) {
    case DTYPE_BF16: f((const __nv_bfloat16 *)nullptr); break;
    case DTYPE_F16: f((const __half *)nullptr); break;
    default: f((const float *)nullptr); break;
  }
}
