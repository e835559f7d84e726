// Attention of generation's new tokens over the KV cache, straight from c_attn's output: what
// ops::split_heads, KvCache::append, ops::cached_attention's two products and softmax and
// ops::merge_heads do in nine launches a layer, in two. A decoding step is a few rows a layer,
// so its time on a GPU is launches, not arithmetic.
//
// qkv: (B, T, 3C) the new tokens' queries, keys and values, C = NH * HD; qkv_bias: null, or
// c_attn's bias (3C) when qkv is the gemm's output without it, added here as linear.cu adds it
// (in f32, rounded to T: the same values, one launch fewer). kv: the layer's cache
// (2, B, NH, CAP, HD), keys then values, positions [0, start) already cached; the new tokens go
// to [start, start + T). bias: (B or 1, 1, T, S) f32 with S = start + T, 0 where a key is
// visible, gpt2.rs's MASKED (-1e9) where not. y: (B, T, C). The softmax runs in f32 with the
// running maximum and sum (FlashAttention's online softmax), and the products accumulate in f32.
//
// start_at: null, or where `start` is read on the device (a decoding step captured as a CUDA
// graph serves every position: generation/decode_graph.rs). The attention's bias is then read
// with rows of bias_stride values (a buffer over the cache's whole capacity), else of S.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include "common.cuh"

// Warps a block of the attention kernels (kernels/cuda.rs, warp_per_row's ROWS_PER_BLOCK).
#define DECODE_WARPS 4

#define FLOAT_TYPES(X) X(f32, float, IDENTITY, IDENTITY) X(bf16, __nv_bfloat16, __bfloat162float, __float2bfloat16_rn) X(f16, __half, __half2float, __float2half_rn)
#define IDENTITY(v) (v)
// c_attn's output element i, channel ch of 3C, with its bias if that is given separately.
#define QKV(i, ch, TO_F32, FROM_F32) (qkv_bias ? FROM_F32(TO_F32(qkv[i]) + TO_F32(qkv_bias[ch])) : qkv[i])

// kv[which][b][h][start + t][d] = qkv[b][t][(1 + which) C + h HD + d], for which 0 (keys) and 1.
#define KV_CACHE_APPEND(SUFFIX, T, TO_F32, FROM_F32)                                               \
  extern "C" __global__ void kv_cache_append_##SUFFIX(const T *qkv, const T *qkv_bias, T *kv,      \
                                                      uint32_t b, uint32_t t, uint32_t nh,          \
                                                      uint32_t hd, uint32_t cap, uint32_t start_arg, \
                                                      const uint32_t *start_at) {                   \
    const uint64_t c = (uint64_t)nh * hd, n = 2ull * b * t * c;                                    \
    const uint64_t start = start_at ? *start_at : start_arg;                                       \
    for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < n;                      \
         i += (uint64_t)blockDim.x * gridDim.x) {                                                  \
      const uint64_t ch = i % c, row = i / c; /* row: (which, b, t) */                             \
      const uint64_t ti = row % t, bi = (row / t) % b, which = row / ((uint64_t)t * b);            \
      const uint64_t h = ch / hd, d = ch % hd;                                                     \
      kv[(((which * b + bi) * nh + h) * cap + start + ti) * hd + d] =                              \
          QKV((bi * t + ti) * 3 * c + (1 + which) * c + ch, (1 + which) * c + ch, TO_F32, FROM_F32); \
    }                                                                                              \
  }

// One warp a query row (b, h, t), keys 32 at a time, a lane a key: each lane takes its key's
// whole dot product with the query (kept in shared memory, read by every lane at once), the warp
// updates the running max and sum once per 32 keys, then each lane adds the 32 values' HD / 32
// dimensions it holds (HD a multiple of 32 up to 128) with the probabilities passed along the
// warp. One warp sum a key (the previous kernel) left every step a chain of shuffles: 167 us a
// layer for gpt2-medium at B16 over 260 positions on an H200, the keys read at 100 GB/s; this
// kernel made that model's decoding step 7.77 -> 4.76 ms (BENCHMARKS.md, 2026-11-28).
#define DECODE_ATTENTION(SUFFIX, T, TO_F32, FROM_F32)                                              \
  extern "C" __global__ void decode_attention_##SUFFIX(                                             \
      const T *qkv, const T *qkv_bias, const T *kv, const float *bias, T *y, uint32_t b,          \
      uint32_t t, uint32_t nh, uint32_t hd, uint32_t cap, uint32_t s_arg, uint32_t bias_batches,    \
      float scale, const uint32_t *start_at, uint32_t bias_stride) {                               \
    __shared__ float query[DECODE_WARPS][128];                                                     \
    const uint32_t s = start_at ? *start_at + t : s_arg;                                           \
    const uint32_t warp = threadIdx.x / 32, lane = threadIdx.x % 32, per_lane = hd / 32;           \
    const uint64_t row = blockIdx.x * (uint64_t)(blockDim.x / 32) + warp;                          \
    if (row >= (uint64_t)b * nh * t) return;                                                       \
    const uint64_t ti = row % t, h = (row / t) % nh, bi = row / ((uint64_t)t * nh);                \
    const uint64_t c = (uint64_t)nh * hd;                                                          \
    const uint64_t q0 = (bi * t + ti) * 3 * c + h * hd;                                            \
    const T *keys = kv + (bi * nh + h) * cap * hd;                                                 \
    const T *values = kv + ((1ull * b + bi) * nh + h) * cap * hd;                                  \
    const float *mask = bias + ((bias_batches == 1 ? 0 : bi) * t + ti) * (start_at ? bias_stride : s); \
    float *q = query[warp];                                                                        \
    _Pragma("unroll") for (uint32_t e = 0; e < 4; e++)                                             \
      if (e < per_lane) q[lane + 32 * e] = TO_F32(QKV(q0 + lane + 32 * e, h * hd + lane + 32 * e, TO_F32, FROM_F32)); \
    __syncwarp();                                                                                  \
    const bool packed = aligned16(kv);                                                             \
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f}, m = -INFINITY, l = 0.0f;                              \
    for (uint32_t j0 = 0; j0 < s; j0 += 32) {                                                      \
      const uint32_t j = j0 + lane, here = s - j0 < 32 ? s - j0 : 32;                              \
      float score = -INFINITY;                                                                     \
      if (j < s) {                                                                                 \
        const T *key = keys + (uint64_t)j * hd;                                                    \
        float dot = 0.0f;                                                                          \
        if (packed) {                                                                              \
          for (uint32_t d = 0; d < hd; d += 8) {                                                   \
            const Pack8<T> k8 = *reinterpret_cast<const Pack8<T> *>(key + d);                      \
            _Pragma("unroll") for (int u = 0; u < 8; u++) dot += q[d + u] * TO_F32(k8.v[u]);       \
          }                                                                                        \
        } else {                                                                                   \
          for (uint32_t d = 0; d < hd; d++) dot += q[d] * TO_F32(key[d]);                          \
        }                                                                                          \
        score = dot * scale + mask[j];                                                             \
      }                                                                                            \
      const float m_new = fmaxf(m, warp_max(score));                                               \
      const float p = j < s ? expf(score - m_new) : 0.0f, correction = expf(m - m_new);            \
      l = l * correction + warp_sum(p);                                                            \
      _Pragma("unroll") for (uint32_t e = 0; e < 4; e++) acc[e] *= correction;                     \
      for (uint32_t k = 0; k < here; k++) {                                                        \
        const float pk = __shfl_sync(0xffffffff, p, k);                                            \
        const T *value = values + (uint64_t)(j0 + k) * hd + lane;                                  \
        _Pragma("unroll") for (uint32_t e = 0; e < 4; e++)                                         \
          if (e < per_lane) acc[e] += pk * TO_F32(value[32 * e]);                                  \
      }                                                                                            \
      m = m_new;                                                                                   \
    }                                                                                              \
    T *out = y + (bi * t + ti) * c + h * hd;                                                       \
    _Pragma("unroll") for (uint32_t e = 0; e < 4; e++)                                             \
      if (e < per_lane) out[lane + 32 * e] = FROM_F32(acc[e] / l);                                 \
  }

FLOAT_TYPES(KV_CACHE_APPEND)
FLOAT_TYPES(DECODE_ATTENTION)
