// AdamW's update of an f32 parameter on the GPU, in place, in two passes: the moments, then the
// parameter. Every product, quotient, sum and root is an IEEE round-to-nearest intrinsic, in the
// order of training/optim.rs's adamw_update, so that no multiply-add is contracted and the result
// is the CPU's bit for bit. The moments live in one buffer: m in [0, n), v in [n, 2n). Both
// kernels take (what they update, what they read, n, four coefficients).
#include <stdint.h>

#include <type_traits>

#include "multi_tensor.cuh"

// m = b1 m + (1 - b1) g;  v = b2 v + ((1 - b2) g) g.  omb1 = 1 - b1 and omb2 = 1 - b2 come
// rounded from the host, as the CPU computes them.
extern "C" __global__ void adamw_moments_f32(float *mv, const float *g, uint64_t n, float b1, float omb1,
                                             float b2, float omb2) {
  for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < n;
       i += (uint64_t)blockDim.x * gridDim.x) {
    const float gi = g[i];
    mv[i] = __fadd_rn(__fmul_rn(b1, mv[i]), __fmul_rn(omb1, gi));
    mv[n + i] = __fadd_rn(__fmul_rn(b2, mv[n + i]), __fmul_rn(__fmul_rn(omb2, gi), gi));
  }
}

// p = p decay - (step_size m) / (sqrt(v) / bc2_sqrt + eps).
extern "C" __global__ void adamw_param_f32(float *p, const float *mv, uint64_t n, float decay, float step_size,
                                           float bc2_sqrt, float eps) {
  for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < n;
       i += (uint64_t)blockDim.x * gridDim.x) {
    const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(mv[n + i]), bc2_sqrt), eps);
    p[i] = __fsub_rn(__fmul_rn(p[i], decay), __fdiv_rn(__fmul_rn(step_size, mv[i]), denom));
  }
}

// The whole model's AdamW update in one launch (multi_tensor.cuh's table, one block a chunk),
// fused with what a mixed-precision step does around it: the gradient is read in its own dtype
// (bf16/f16 as backward made it, or f32 when accumulated) and multiplied by `grad_scale` (the
// accumulation/loss-scale correction times the clipping coefficient; 1 leaves it exact), and the
// new f32 parameter is rounded into the slot's bf16/f16 compute copy where it has one. The update
// itself is adamw_moments_f32 then adamw_param_f32, rounding for rounding: on a gradient already
// scaled, the same bits. b1, 1 - b1, b2, 1 - b2, sqrt(1 - b2^step) and eps are shared; each slot
// carries its own decay factor and step size (weight decay and LoRA's learning rate differ).
struct AdamWShared {
  float grad_scale, b1, omb1, b2, omb2, bc2_sqrt, eps;
};

// The copy type of a slot without a compute copy (fp32 training): no store is compiled.
struct NoCopy {};

template <typename G, typename C>
__device__ __forceinline__ void adamw_chunk(const TensorSlot &s, ChunkRange r, const AdamWShared &k) {
  const G *g = reinterpret_cast<const G *>(s.grad);
  float *p = reinterpret_cast<float *>(s.param), *mv = reinterpret_cast<float *>(s.moments);
  C *copy = reinterpret_cast<C *>(s.copy);
  const uint64_t n = s.n;
  for (uint64_t i = r.begin + threadIdx.x; i < r.end; i += blockDim.x) {
    const float gi = __fmul_rn(to_f32(g[i]), k.grad_scale);
    const float m = __fadd_rn(__fmul_rn(k.b1, mv[i]), __fmul_rn(k.omb1, gi));
    const float v = __fadd_rn(__fmul_rn(k.b2, mv[n + i]), __fmul_rn(__fmul_rn(k.omb2, gi), gi));
    mv[i] = m;
    mv[n + i] = v;
    const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(v), k.bc2_sqrt), k.eps);
    const float pi = __fsub_rn(__fmul_rn(p[i], s.decay), __fdiv_rn(__fmul_rn(s.step_size, m), denom));
    p[i] = pi;
    if constexpr (!std::is_same_v<C, NoCopy>) store_f32(&copy[i], pi);
  }
}

extern "C" __global__ void adamw_multi_tensor(const TensorSlot *slots, uint32_t count, uint32_t chunk,
                                              AdamWShared k) {
  const TensorSlot &s = slot_of_chunk(slots, count, blockIdx.x);
  const ChunkRange r = chunk_range(s, chunk);
  with_float_type(s.grad_dtype, [&](auto grad) {
    using G = std::remove_cv_t<std::remove_pointer_t<decltype(grad)>>;
    switch (s.copy_dtype) {
      case DTYPE_BF16: adamw_chunk<G, __nv_bfloat16>(s, r, k); break;
      case DTYPE_F16: adamw_chunk<G, __half>(s, r, k); break;
      default: adamw_chunk<G, NoCopy>(s, r, k); break;
    }
  });
}
