// A decoding step's epilogues on the GPU, each the work of two or three launches in one, with
// the same roundings (the unfused path's intermediates are rounded to T where it stores them):
//
// bias_residual_layer_norm: after c_proj's gemm y (N, C) without its bias b, the residual
//   stream x (N, C) and the next LayerNorm (w, beta): out[0] = x + (y + b), the new residual,
//   and out[1] = LayerNorm(out[0]), the next layer's input; out (2, N, C). What linear.cu's bias
//   add, candle's add and layer_norm.cu do (row_stats is layer_norm.cu's, one warp a row).
// bias_gelu: gelu_new(y + b) after c_fc's gemm y (N, W) without its bias b (W): linear.cu's bias
//   add and gelu.cu.
// embed_layer_norm: the embeddings wte[id] + wpe[position] of N tokens and the first block's
//   ln_1 of them, out (2, N, C): embedding.cu's two lookups, candle's add and layer_norm.cu. An
//   id or position outside its table gives a row of NaN.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include "common.cuh"

#define ROWS_PER_BLOCK 4

// normed = LayerNorm(residual) with (w, beta), one warp a row, as layer_norm.cu. Lane l of the
// warp reads columns l, l + 32, ...: row_stats's own stride, the columns the callers' lane l has
// just written, so each lane reads back only what it wrote.
template <typename T, typename ToF32, typename FromF32>
__device__ __forceinline__ void layer_norm_row(const T *residual, T *normed, const T *w, const T *beta,
                                               uint32_t c, float eps, ToF32 to_f32, FromF32 from_f32) {
  float mean, rstd;
  row_stats(residual, c, eps, to_f32, &mean, &rstd);
  for (uint32_t j = threadIdx.x % 32; j < c; j += 32)
    normed[j] = from_f32((to_f32(residual[j]) - mean) * rstd * to_f32(w[j]) + to_f32(beta[j]));
}

#define BIAS_RESIDUAL_LAYER_NORM(SUFFIX, T, TO_F32, FROM_F32)                                          \
  extern "C" __global__ void bias_residual_layer_norm_##SUFFIX(const T *y, const T *b, const T *x,     \
                                                               const T *w, const T *beta, T *out,      \
                                                               uint64_t rows, uint32_t c, float eps) { \
    const uint64_t r = blockIdx.x * (uint64_t)ROWS_PER_BLOCK + threadIdx.x / 32;                       \
    if (r >= rows) return;                                                                             \
    const T *yr = y + r * c, *xr = x + r * c;                                                          \
    T *residual = out + r * c, *normed = out + (rows + r) * c;                                         \
    for (uint32_t j = threadIdx.x % 32; j < c; j += 32) {                                              \
      const T with_bias = FROM_F32(TO_F32(yr[j]) + TO_F32(b[j]));                                      \
      residual[j] = FROM_F32(TO_F32(xr[j]) + TO_F32(with_bias));                                       \
    }                                                                                                  \
    layer_norm_row(residual, normed, w, beta, c, eps, [](T v) { return TO_F32(v); },                   \
                   [](float v) -> T { return FROM_F32(v); });                                          \
  }

#define EMBED_LAYER_NORM(SUFFIX, T, TO_F32, FROM_F32)                                                  \
  extern "C" __global__ void embed_layer_norm_##SUFFIX(                                                \
      const uint32_t *ids, const uint32_t *positions, const T *wte, const T *wpe, const T *w,          \
      const T *beta, T *out, uint64_t rows, uint32_t c, uint32_t vocab, uint32_t n_positions,          \
      float eps) {                                                                                     \
    const uint64_t r = blockIdx.x * (uint64_t)ROWS_PER_BLOCK + threadIdx.x / 32;                       \
    if (r >= rows) return;                                                                             \
    const uint32_t id = ids[r], position = positions[r];                                               \
    const bool inside = id < vocab && position < n_positions;                                          \
    const T *token = wte + (uint64_t)(inside ? id : 0) * c;                                            \
    const T *place = wpe + (uint64_t)(inside ? position : 0) * c;                                      \
    T *residual = out + r * c, *normed = out + (rows + r) * c;                                         \
    for (uint32_t j = threadIdx.x % 32; j < c; j += 32)                                                \
      residual[j] = inside ? FROM_F32(TO_F32(token[j]) + TO_F32(place[j])) : FROM_F32(NAN);            \
    layer_norm_row(residual, normed, w, beta, c, eps, [](T v) { return TO_F32(v); },                   \
                   [](float v) -> T { return FROM_F32(v); });                                          \
  }

#define BIAS_GELU(SUFFIX, T, TO_F32, FROM_F32)                                                         \
  extern "C" __global__ void bias_gelu_##SUFFIX(const T *y, const T *b, T *out, uint64_t n,            \
                                                uint32_t width) {                                      \
    for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < n;                          \
         i += (uint64_t)blockDim.x * gridDim.x) {                                                      \
      const T with_bias = FROM_F32(TO_F32(y[i]) + TO_F32(b[i % width]));                               \
      out[i] = FROM_F32(gelu_new(TO_F32(with_bias)));                                                  \
    }                                                                                                  \
  }

#define IDENTITY(v) (v)
#define DECODE_LAYER_KERNELS(SUFFIX, T, TO_F32, FROM_F32)   \
  BIAS_RESIDUAL_LAYER_NORM(SUFFIX, T, TO_F32, FROM_F32)     \
  BIAS_GELU(SUFFIX, T, TO_F32, FROM_F32)                    \
  EMBED_LAYER_NORM(SUFFIX, T, TO_F32, FROM_F32)
DECODE_LAYER_KERNELS(f32, float, IDENTITY, IDENTITY)
DECODE_LAYER_KERNELS(bf16, __nv_bfloat16, __bfloat162float, __float2bfloat16_rn)
DECODE_LAYER_KERNELS(f16, __half, __half2float, __float2half_rn)
