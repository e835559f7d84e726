// AdamW's update of an f32 parameter on the GPU, in place, in two passes: the moments, then the
// parameter. Every product, quotient, sum and root is an IEEE round-to-nearest intrinsic, in the
// order of training/optim.rs's adamw_update, so that no multiply-add is contracted and the result
// is the CPU's bit for bit. The moments live in one buffer: m in [0, n), v in [n, 2n). Both
// kernels take (what they update, what they read, n, four coefficients).
#include <stdint.h>

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
