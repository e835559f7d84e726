// Flash-style attention on the GPU, what fused.rs's Attention computes on the CPU: per (batch,
// head), y = dropout(softmax(q k^T * scale + bias)) v from c_attn's output qkv (B, T, 3C) and the
// additive mask bias (B or 1, 1, T, T) f32, heads side by side in y (B, T, C), without the
// (B, NH, T, T) probabilities in memory. bf16 or f16 operands on the tensor cores (WMMA 16x16x16,
// f32 accumulation), the softmax in f32, head dimension 64 (every GPT-2 size).
//
// A block takes 64 rows (queries in forward and dq, keys in dk/dv), each of its four warps 16 of
// them, and walks the other side in tiles of 64, staged in shared memory with zeros past T.
// Forward makes two passes over the keys: the row max and sum first, then the normalised
// probabilities times v, so the output needs no rescaling as the max moves; it keeps the row
// statistics (max and 1 / sum per query) for backward. Backward recomputes the probabilities from
// them; dq is one kernel over query tiles (it also writes each row's D = dy . y), dk and dv one
// over key tiles, so every sum has one writer and a fixed order: the gradients are deterministic,
// without atomics.
//
// Dropout draws the CPU's mask (dropout.cu's counter hash) at the element's index in the
// (B, NH, T, T) probabilities. Masked entries (bias -1e9) contribute exp(-1e9 - max) = 0, and a
// row with every key masked is uniform over its T keys, as the composed softmax makes it: the row
// max and sum are kept apart for that reason (max + log(sum) would lose the sum at -1e9).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <mma.h>
#include <stdint.h>

#include "common.cuh"

using namespace nvcuda;

#define HD 64     // head dimension
#define TILE 64   // rows of a block, and rows of a tile of the other side
#define WARPS 4   // warps of a block, 16 rows each
#define WROWS 16  // rows of a warp
// Row strides in shared memory, padded so that the tensor cores' loads of 8 rows at a time hit
// distinct banks: half-precision tiles (144 bytes a row) and f32 scores (272 bytes).
#define LDT 72
#define LDS 68
// A bias at or below this masks its entry (the model's mask is -1e9). A tile whose entries are
// all masked adds exp(-1e9 - max) = 0 to every row that has a live entry elsewhere, so it is
// skipped (the causal mask's upper half); a block with a row that has no live entry at all skips
// nothing, so that row stays uniform over its T keys.
#define MASKED_BELOW -5e8f
// Blocks of a kernel an SM must hold at least (__launch_bounds__' second argument, which caps the
// registers ptxas may give a thread). Unset, ptxas is free (forward 168 registers, 3 blocks; dq
// 210, 2; dk/dv 254, 2): flash_attention_more_blocks.cu and _most_blocks.cu include this file
// with values set; the host chooses among the three (HYBRID_ENGINE_ATTENTION_BLOCKS).
#ifdef FORWARD_MIN_BLOCKS
#define FORWARD_BOUNDS __launch_bounds__(WARPS * 32, FORWARD_MIN_BLOCKS)
#else
#define FORWARD_BOUNDS __launch_bounds__(WARPS * 32)
#endif
#ifdef DQ_MIN_BLOCKS
#define DQ_BOUNDS __launch_bounds__(WARPS * 32, DQ_MIN_BLOCKS)
#else
#define DQ_BOUNDS __launch_bounds__(WARPS * 32)
#endif
#ifdef DKV_MIN_BLOCKS
#define DKV_BOUNDS __launch_bounds__(WARPS * 32, DKV_MIN_BLOCKS)
#else
#define DKV_BOUNDS __launch_bounds__(WARPS * 32)
#endif

template <typename T> struct Conv;
template <> struct Conv<__nv_bfloat16> {
  static __device__ __forceinline__ float to(__nv_bfloat16 v) { return __bfloat162float(v); }
  static __device__ __forceinline__ __nv_bfloat16 from(float v) { return __float2bfloat16_rn(v); }
};
template <> struct Conv<__half> {
  static __device__ __forceinline__ float to(__half v) { return __half2float(v); }
  static __device__ __forceinline__ __half from(float v) { return __float2half_rn(v); }
};

// The dropout site of one call: element i's factor is 0 or `scale` (common.cuh's draw).
struct Dropout {
  uint64_t seed;
  uint32_t threshold;
  float scale;
  uint32_t on;
  __device__ __forceinline__ float factor(uint64_t i) const {
    return on ? dropout_factor(seed, threshold, scale, i) : 1.0f;
  }
};

// Where one (batch, head) pair's rows live.
struct Head {
  uint32_t t, nh, b, h;
  __device__ __forceinline__ uint64_t bh() const { return (uint64_t)b * nh + h; }
  __device__ __forceinline__ uint32_t c() const { return nh * HD; }
  // Offset of row `row`'s head columns in a (B, T, width) tensor, `part` heads-widths in (qkv:
  // 0 q, 1 k, 2 v; y and dy: 0).
  __device__ __forceinline__ uint64_t at(uint32_t row, uint32_t width, uint32_t part) const {
    return ((uint64_t)b * t + row) * width + part * c() + h * HD;
  }
};

// Rows [r0, r0 + 64) of a head's part into dst (64 x 64, row stride LDT), zeros past T: 16-byte
// loads (8 values), all four of a thread's issued before any is stored.
template <typename T>
__device__ __forceinline__ void load_tile(T *dst, const T *src, const Head &hd, uint32_t width, uint32_t part,
                                          uint32_t r0) {
  uint4 v[TILE * HD / 8 / (WARPS * 32)];
#pragma unroll
  for (int k = 0; k < TILE * HD / 8 / (WARPS * 32); ++k) {
    const uint32_t e = threadIdx.x + k * WARPS * 32, r = e / (HD / 8), d = e % (HD / 8) * 8;
    v[k] = r0 + r < hd.t ? *reinterpret_cast<const uint4 *>(src + hd.at(r0 + r, width, part) + d)
                         : make_uint4(0, 0, 0, 0);
  }
#pragma unroll
  for (int k = 0; k < TILE * HD / 8 / (WARPS * 32); ++k) {
    const uint32_t e = threadIdx.x + k * WARPS * 32, r = e / (HD / 8), d = e % (HD / 8) * 8;
    *reinterpret_cast<uint4 *>(dst + r * LDT + d) = v[k];
  }
}

typedef wmma::fragment<wmma::accumulator, 16, 16, 16, float> Acc;
template <typename T> using RowA = wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major>;
template <typename T> using RowB = wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major>;
template <typename T> using ColB = wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major>;

// A warp's 16 rows of a (64 x 64) row-major tile as the left operand, split along its columns.
template <typename T> __device__ __forceinline__ void load_rows(RowA<T> (&a)[HD / 16], const T *tile) {
  const uint32_t warp = threadIdx.x / 32;
#pragma unroll
  for (int k = 0; k < HD / 16; ++k) wmma::load_matrix_sync(a[k], tile + warp * WROWS * LDT + k * 16, LDT);
}

// out (16 x 64 f32, row stride LDS) = a (16 x 64) times the transpose of `tile` (64 x 64, row
// stride LDT).
template <typename T>
__device__ __forceinline__ void times_transposed(float *out, const RowA<T> (&a)[HD / 16], const T *tile) {
#pragma unroll
  for (int n = 0; n < TILE / 16; ++n) {
    Acc acc;
    wmma::fill_fragment(acc, 0.0f);
#pragma unroll
    for (int k = 0; k < HD / 16; ++k) {
      ColB<T> bt;
      wmma::load_matrix_sync(bt, tile + n * 16 * LDT + k * 16, LDT);
      wmma::mma_sync(acc, a[k], bt, acc);
    }
    wmma::store_matrix_sync(out + n * 16, acc, LDS, wmma::mem_row_major);
  }
}

// acc (16 x 64) += a (16 x 64 in shared memory, row stride LDT) times tile (64 x 64, row stride
// LDT).
template <typename T>
__device__ __forceinline__ void accumulate(Acc (&acc)[HD / 16], const T *a_rows, const T *tile) {
#pragma unroll
  for (int k = 0; k < TILE / 16; ++k) {
    RowA<T> a;
    wmma::load_matrix_sync(a, a_rows + k * 16, LDT);
#pragma unroll
    for (int n = 0; n < HD / 16; ++n) {
      RowB<T> b;
      wmma::load_matrix_sync(b, tile + k * 16 * LDT + n * 16, LDT);
      wmma::mma_sync(acc[n], a, b, acc[n]);
    }
  }
}

// Writes a warp's 16 accumulated rows (through `stage`, 16 x 64 f32) to rows r0.. of a head's part.
template <typename T>
__device__ __forceinline__ void store_rows(T *dst, const Head &hd, uint32_t width, uint32_t part, uint32_t r0,
                                           Acc (&acc)[HD / 16], float *stage) {
  const uint32_t lane = threadIdx.x % 32;
#pragma unroll
  for (int n = 0; n < HD / 16; ++n) wmma::store_matrix_sync(stage + n * 16, acc[n], HD, wmma::mem_row_major);
  __syncwarp();
  for (uint32_t e = lane; e < WROWS * HD; e += 32) {
    const uint32_t r = e / HD, d = e % HD;
    if (r0 + r < hd.t) dst[hd.at(r0 + r, width, part) + d] = Conv<T>::from(stage[e]);
  }
  __syncwarp();
}

// A warp's mask entries for its 16 query rows i0.. and the keys j0 + lane, j0 + lane + 32, in
// the layout of its scores: -inf past T (no weight at all), 0 for rows past T (never stored).
// Returns whether one of them (of a row and key within T) is live.
__device__ __forceinline__ bool read_bias(float (&b)[WROWS][2], const float *bias_rows, const Head &hd, uint32_t i0,
                                          uint32_t j0) {
  const uint32_t lane = threadIdx.x % 32;
  bool live = false;
#pragma unroll
  for (int r = 0; r < WROWS; ++r) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const uint32_t i = i0 + r, j = j0 + lane + 32 * half;
      const float v = j >= hd.t ? -INFINITY : i < hd.t ? bias_rows[(uint64_t)i * hd.t + j] : 0.0f;
      b[r][half] = v;
      live |= i < hd.t && j < hd.t && v > MASKED_BELOW;
    }
  }
  return live;
}

// Row max m and sum l of exp(logit - m) of a warp's 16 query rows over the keys, from its q
// fragments (lane r holds row r's; the lanes past 16 are unused), skipping the key tiles that are
// masked for every row of the block when `skip`. k_tile and scores are scratch; the first barrier
// also guards whatever the block staged in k_tile before.
template <typename T>
__device__ __forceinline__ void row_statistics(float &m_out, float &l_out, const RowA<T> (&q)[HD / 16],
                                               const T *qkv, const float *bias_rows, const Head &hd, uint32_t i0,
                                               float scale, T *k_tile, float *scores, bool skip) {
  const uint32_t lane = threadIdx.x % 32;
  float m[WROWS], l[WROWS];
#pragma unroll
  for (int r = 0; r < WROWS; ++r) m[r] = -INFINITY, l[r] = 0.0f;
  for (uint32_t j0 = 0; j0 < hd.t; j0 += TILE) {
    float b[WROWS][2];
    const bool live = __syncthreads_or(read_bias(b, bias_rows, hd, i0, j0));
    if (skip && !live) continue;
    load_tile(k_tile, qkv, hd, 3 * hd.c(), 1, j0);
    __syncthreads();
    times_transposed(scores, q, k_tile);
    __syncwarp();
#pragma unroll
    for (int r = 0; r < WROWS; ++r) {
      const float x0 = scores[r * LDS + lane] * scale + b[r][0];
      const float x1 = scores[r * LDS + lane + 32] * scale + b[r][1];
      const float mr = fmaxf(m[r], warp_max(fmaxf(x0, x1)));
      l[r] = l[r] * expf(m[r] - mr) + warp_sum(expf(x0 - mr) + expf(x1 - mr));
      m[r] = mr;
    }
    __syncwarp();
  }
  m_out = 0.0f, l_out = 1.0f;
#pragma unroll
  for (int r = 0; r < WROWS; ++r)
    if (lane == r) m_out = m[r], l_out = l[r];
}

// The row statistics of a block's queries with masked tiles skipped, unless one of its rows (within
// T) has no live key: then again without skipping. Returns whether the block may skip.
template <typename T>
__device__ __forceinline__ bool block_statistics(float &m, float &l, const RowA<T> (&q)[HD / 16], const T *qkv,
                                                 const float *bias_rows, const Head &hd, uint32_t i0, float scale,
                                                 T *k_tile, float *scores) {
  const uint32_t lane = threadIdx.x % 32;
  row_statistics(m, l, q, qkv, bias_rows, hd, i0, scale, k_tile, scores, true);
  const bool unmasked_row = __syncthreads_or(lane < WROWS && i0 + lane < hd.t && m <= MASKED_BELOW);
  if (unmasked_row) row_statistics(m, l, q, qkv, bias_rows, hd, i0, scale, k_tile, scores, false);
  return !unmasked_row;
}

// Reads the warp's mask entries of key tile j0 into b, then, unless `skip` and no entry of the
// tile is live for the block, stages the tile's keys and values: returns whether it did. Its
// first barrier also guards the tiles the block read in the previous iteration.
template <typename T>
__device__ __forceinline__ bool stage_key_tile(float (&b)[WROWS][2], T *k_tile, T *v_tile, const T *qkv,
                                               const float *bias_rows, const Head &hd, uint32_t i0, uint32_t j0,
                                               bool skip) {
  const bool live = __syncthreads_or(read_bias(b, bias_rows, hd, i0, j0));
  if (skip && !live) return false;
  load_tile(k_tile, qkv, hd, 3 * hd.c(), 1, j0);
  load_tile(v_tile, qkv, hd, 3 * hd.c(), 2, j0);
  __syncthreads();
  return true;
}

// y (B, T, C), and per query row (B * NH * T each, in `stats`) the row max and 1 / row sum.
// Grid (ceil(T / 64), B * NH), 128 threads.
template <typename T>
__device__ __forceinline__ void attention_forward(const T *qkv, const float *bias, T *y, float *stats, uint32_t t,
                                                  uint32_t nh, uint32_t bias_batches, float scale, Dropout drop) {
  __shared__ __align__(128) T k_tile[TILE * LDT];
  __shared__ __align__(128) T v_tile[TILE * LDT];
  __shared__ __align__(128) float scores_all[WARPS][WROWS * LDS];
  __shared__ __align__(128) T probs_all[WARPS][WROWS * LDT];
  const uint32_t warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const Head hd{t, nh, blockIdx.y / nh, blockIdx.y % nh};
  const uint32_t q0 = blockIdx.x * TILE, i0 = q0 + warp * WROWS;
  const float *bias_rows = bias + (bias_batches == 1 ? 0 : (uint64_t)hd.b * t * t);
  float *scores = scores_all[warp];
  T *probs = probs_all[warp];

  load_tile(k_tile, qkv, hd, 3 * hd.c(), 0, q0);  // the queries, staged in k_tile
  __syncthreads();
  RowA<T> q[HD / 16];
  load_rows(q, k_tile);
  float m, l;
  const bool skip = block_statistics(m, l, q, qkv, bias_rows, hd, i0, scale, k_tile, scores);
  const float inv_l = 1.0f / l;
  if (lane < WROWS && i0 + lane < t) {
    const uint64_t rows = (uint64_t)gridDim.y * t, row = hd.bh() * t + i0 + lane;
    stats[row] = m, stats[rows + row] = inv_l;
  }

  Acc out[HD / 16];
#pragma unroll
  for (int n = 0; n < HD / 16; ++n) wmma::fill_fragment(out[n], 0.0f);
  for (uint32_t j0 = 0; j0 < t; j0 += TILE) {
    float b[WROWS][2];
    if (!stage_key_tile(b, k_tile, v_tile, qkv, bias_rows, hd, i0, j0, skip)) continue;
    times_transposed(scores, q, k_tile);
    __syncwarp();
#pragma unroll
    for (int r = 0; r < WROWS; ++r) {
      const uint32_t i = i0 + r;
      const float mr = __shfl_sync(0xffffffff, m, r), inv = __shfl_sync(0xffffffff, inv_l, r);
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const uint32_t jj = lane + 32 * half, j = j0 + jj;
        float p = expf(scores[r * LDS + jj] * scale + b[r][half] - mr) * inv;
        if (i < t && j < t) p *= drop.factor((hd.bh() * t + i) * t + j);
        probs[r * LDT + jj] = Conv<T>::from(p);
      }
    }
    __syncwarp();
    accumulate(out, probs, v_tile);
  }
  store_rows(y, hd, hd.c(), 0, i0, out, scores);
}

// The online forward needs to know which row of its 16 x 16 tile each element of a thread's f32
// accumulator fragment holds, to rescale the rows: on sm_80 and later element e of lane `lane` is
// row lane / 4 + 8 * ((e / 2) % 2), column (lane % 4) * 2 + e % 2 + 8 * (e / 4) (the layout of
// mma.m16n8k16, twice). wmma leaves the layout unspecified, so accumulator_layout_probe checks it
// on the device, and the two-pass forward runs where it does not hold.
__device__ __forceinline__ uint32_t acc_row(uint32_t lane, int e) { return lane / 4 + 8 * ((e / 2) % 2); }
__device__ __forceinline__ uint32_t acc_col(uint32_t lane, int e) { return (lane % 4) * 2 + e % 2 + 8 * (e / 4); }

// *ok = whether the layout above holds (one warp).
extern "C" __global__ void accumulator_layout_probe(uint32_t *ok) {
  __shared__ __align__(128) float tile[16 * 16];
  const uint32_t lane = threadIdx.x % 32;
  for (uint32_t k = lane; k < 16 * 16; k += 32) tile[k] = (float)k;
  __syncwarp();
  Acc a;
  wmma::load_matrix_sync(a, tile, 16, wmma::mem_row_major);
  bool good = a.num_elements == 8;
  for (int e = 0; e < a.num_elements && e < 8; ++e) good &= a.x[e] == (float)(acc_row(lane, e) * 16 + acc_col(lane, e));
  good = __all_sync(0xffffffff, good);
  if (lane == 0) *ok = good;
}

// One pass over the key tiles with a running row max m and sum l (FlashAttention-2's loop): the
// unnormalised exp(logit - m) times v accumulate in `out`, rescaled by exp(m_old - m_new) as a
// row's max moves; the caller divides by l. Skips the tiles masked for every row of the block when
// `skip`. Leaves row r's m and l in lane r (lanes past 16: 0 and 1), as row_statistics does.
template <typename T>
__device__ __forceinline__ void online_pass(Acc (&out)[HD / 16], float &m_out, float &l_out, const RowA<T> (&q)[HD / 16],
                                            const T *qkv, const float *bias_rows, const Head &hd, uint32_t i0,
                                            float scale, Dropout drop, T *k_tile, T *v_tile, float *scores, T *probs,
                                            bool skip) {
  const uint32_t lane = threadIdx.x % 32;
  // Row r's running max and sum live in lane r (registers are what limits this kernel).
  float m_lane = -INFINITY, l_lane = 0.0f;
#pragma unroll
  for (int n = 0; n < HD / 16; ++n) wmma::fill_fragment(out[n], 0.0f);
  for (uint32_t j0 = 0; j0 < hd.t; j0 += TILE) {
    float b[WROWS][2];
    if (!stage_key_tile(b, k_tile, v_tile, qkv, bias_rows, hd, i0, j0, skip)) continue;
    times_transposed(scores, q, k_tile);
    __syncwarp();
    float corr_lo = 1.0f, corr_hi = 1.0f;  // the rescale factors of this lane's accumulator rows
#pragma unroll
    for (int r = 0; r < WROWS; ++r) {
      const uint32_t i = i0 + r;
      const float x0 = scores[r * LDS + lane] * scale + b[r][0];
      const float x1 = scores[r * LDS + lane + 32] * scale + b[r][1];
      const float m_old = __shfl_sync(0xffffffff, m_lane, r);
      const float mr = fmaxf(m_old, warp_max(fmaxf(x0, x1)));
      const float corr = expf(m_old - mr);  // 0 on the first tile (m = -inf), where out is 0
      float p[2] = {expf(x0 - mr), expf(x1 - mr)};
      const float sum = warp_sum(p[0] + p[1]);
      if (lane == r) l_lane = l_lane * corr + sum, m_lane = mr;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const uint32_t jj = lane + 32 * half, j = j0 + jj;
        if (i < hd.t && j < hd.t) p[half] *= drop.factor((hd.bh() * hd.t + i) * hd.t + j);
        probs[r * LDT + jj] = Conv<T>::from(p[half]);
      }
      if (r == lane / 4) corr_lo = corr;
      if (r == lane / 4 + 8) corr_hi = corr;
    }
    __syncwarp();
#pragma unroll
    for (int n = 0; n < HD / 16; ++n)
#pragma unroll
      for (int e = 0; e < 8; ++e) out[n].x[e] *= (e / 2) % 2 ? corr_hi : corr_lo;
    accumulate(out, probs, v_tile);
  }
  m_out = lane < WROWS ? m_lane : 0.0f, l_out = lane < WROWS ? l_lane : 1.0f;
}

// attention_forward in one pass over the keys (online_pass), where accumulator_layout_probe holds:
// the same y up to rounding (the probabilities times v are rounded before, not after, the division
// by the row sum) and the statistics of the same definition. A block with a row that has no live
// key makes a second pass without skipping, as block_statistics does.
template <typename T>
__device__ __forceinline__ void attention_forward_online(const T *qkv, const float *bias, T *y, float *stats,
                                                         uint32_t t, uint32_t nh, uint32_t bias_batches, float scale,
                                                         Dropout drop) {
  __shared__ __align__(128) T k_tile[TILE * LDT];
  __shared__ __align__(128) T v_tile[TILE * LDT];
  __shared__ __align__(128) float scores_all[WARPS][WROWS * LDS];
  __shared__ __align__(128) T probs_all[WARPS][WROWS * LDT];
  const uint32_t warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const Head hd{t, nh, blockIdx.y / nh, blockIdx.y % nh};
  const uint32_t q0 = blockIdx.x * TILE, i0 = q0 + warp * WROWS;
  const float *bias_rows = bias + (bias_batches == 1 ? 0 : (uint64_t)hd.b * t * t);
  float *scores = scores_all[warp];
  T *probs = probs_all[warp];

  load_tile(k_tile, qkv, hd, 3 * hd.c(), 0, q0);  // the queries, staged in k_tile
  __syncthreads();
  RowA<T> q[HD / 16];
  load_rows(q, k_tile);
  Acc out[HD / 16];
  float m, l;
  for (int pass = 0; pass < 2; ++pass) {  // one inlined copy of the loop: registers
    online_pass(out, m, l, q, qkv, bias_rows, hd, i0, scale, drop, k_tile, v_tile, scores, probs, pass == 0);
    if (!__syncthreads_or(lane < WROWS && i0 + lane < t && m <= MASKED_BELOW)) break;
  }
  const float inv_l = 1.0f / l;
  if (lane < WROWS && i0 + lane < t) {
    const uint64_t rows = (uint64_t)gridDim.y * t, row = hd.bh() * t + i0 + lane;
    stats[row] = m, stats[rows + row] = inv_l;
  }
  const float inv_lo = __shfl_sync(0xffffffff, inv_l, lane / 4), inv_hi = __shfl_sync(0xffffffff, inv_l, lane / 4 + 8);
#pragma unroll
  for (int n = 0; n < HD / 16; ++n)
#pragma unroll
    for (int e = 0; e < 8; ++e) out[n].x[e] *= (e / 2) % 2 ? inv_hi : inv_lo;
  store_rows(y, hd, hd.c(), 0, i0, out, scores);
}

// dq of the q part of dqkv (B, T, 3C) from the forward's row statistics `stats`, and per query row
// (B * NH * T, in `dsum`) D = dy . y (the softmax backward's row term; with dropout it is still
// the sum over keys of the kept probability times dy . v). Masked tiles are skipped as forward
// skipped them: unless a row of the block has no live key (its max at the mask).
// Grid (ceil(T / 64), B * NH), 128 threads.
template <typename T>
__device__ __forceinline__ void attention_backward_dq(const T *qkv, const float *bias, const T *y, const T *dy,
                                                      T *dqkv, const float *stats, float *dsum_out, uint32_t t,
                                                      uint32_t nh, uint32_t bias_batches, float scale,
                                                      Dropout drop) {
  __shared__ __align__(128) T k_tile[TILE * LDT];
  __shared__ __align__(128) T v_tile[TILE * LDT];
  __shared__ __align__(128) float scores_all[WARPS][WROWS * LDS];
  __shared__ __align__(128) T dscores_all[WARPS][WROWS * LDT];
  const uint32_t warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const Head hd{t, nh, blockIdx.y / nh, blockIdx.y % nh};
  const uint32_t q0 = blockIdx.x * TILE, i0 = q0 + warp * WROWS;
  const float *bias_rows = bias + (bias_batches == 1 ? 0 : (uint64_t)hd.b * t * t);
  float *scores = scores_all[warp];
  T *dscores = dscores_all[warp];
  const uint64_t rows = (uint64_t)gridDim.y * t;

  load_tile(k_tile, qkv, hd, 3 * hd.c(), 0, q0);
  load_tile(v_tile, dy, hd, hd.c(), 0, q0);
  __syncthreads();
  RowA<T> q[HD / 16], g[HD / 16];
  load_rows(q, k_tile);
  load_rows(g, v_tile);
  // Lane r holds row r's statistics, as block_statistics leaves them.
  float m = 0.0f, inv_l = 0.0f;
  if (lane < WROWS && i0 + lane < t) {
    const uint64_t row = hd.bh() * t + i0 + lane;
    m = stats[row], inv_l = stats[rows + row];
  }
  const bool skip = !__syncthreads_or(lane < WROWS && i0 + lane < t && m <= MASKED_BELOW);
  float dsum = 0.0f;
#pragma unroll
  for (int r = 0; r < WROWS; ++r) {
    const uint32_t i = i0 + r;
    float v = 0.0f;
    if (i < t) {
      const uint64_t at = hd.at(i, hd.c(), 0);
      v = Conv<T>::to(dy[at + lane]) * Conv<T>::to(y[at + lane]) +
          Conv<T>::to(dy[at + lane + 32]) * Conv<T>::to(y[at + lane + 32]);
    }
    v = warp_sum(v);
    if (lane == r) dsum = v;
  }
  if (lane < WROWS && i0 + lane < t) dsum_out[hd.bh() * t + i0 + lane] = dsum;

  Acc dq[HD / 16];
#pragma unroll
  for (int n = 0; n < HD / 16; ++n) wmma::fill_fragment(dq[n], 0.0f);
  for (uint32_t j0 = 0; j0 < t; j0 += TILE) {
    float b[WROWS][2];
    if (!stage_key_tile(b, k_tile, v_tile, qkv, bias_rows, hd, i0, j0, skip)) continue;
    // dy v^T, read into registers, then q k^T in the same scratch.
    times_transposed(scores, g, v_tile);
    __syncwarp();
    float dp[WROWS][2];
#pragma unroll
    for (int r = 0; r < WROWS; ++r) dp[r][0] = scores[r * LDS + lane], dp[r][1] = scores[r * LDS + lane + 32];
    __syncwarp();
    times_transposed(scores, q, k_tile);
    __syncwarp();
#pragma unroll
    for (int r = 0; r < WROWS; ++r) {
      const uint32_t i = i0 + r;
      const float mr = __shfl_sync(0xffffffff, m, r), inv = __shfl_sync(0xffffffff, inv_l, r);
      const float dr = __shfl_sync(0xffffffff, dsum, r);
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const uint32_t jj = lane + 32 * half, j = j0 + jj;
        float ds = 0.0f;
        if (i < t && j < t) {
          const float p = expf(scores[r * LDS + jj] * scale + b[r][half] - mr) * inv;
          ds = scale * p * (drop.factor((hd.bh() * t + i) * t + j) * dp[r][half] - dr);
        }
        dscores[r * LDT + jj] = Conv<T>::from(ds);
      }
    }
    __syncwarp();
    accumulate(dq, dscores, k_tile);
  }
  store_rows(dqkv, hd, 3 * hd.c(), 0, i0, dq, scores);
}

// dk and dv of the k and v parts of dqkv, from the forward's statistics, the D the dq kernel wrote
// and the transposed mask bias_t (B or 1, 1, T, T): bias_t[j][i] = bias[i][j], read along the queries.
// A query tile is skipped when every entry of it for the block's keys is masked and each of its
// rows has a live key (a row max above the mask). Grid (ceil(T / 64), B * NH), 128 threads.
template <typename T>
__device__ __forceinline__ void attention_backward_dkv(const T *qkv, const float *bias_t, const T *dy,
                                                       const float *stats, const float *dsum, T *dqkv, uint32_t t,
                                                       uint32_t nh, uint32_t bias_batches, float scale,
                                                       Dropout drop) {
  __shared__ __align__(128) T q_tile[TILE * LDT];
  __shared__ __align__(128) T g_tile[TILE * LDT];
  __shared__ __align__(128) float scores_all[WARPS][WROWS * LDS];
  __shared__ __align__(128) T probs_all[WARPS][WROWS * LDT];
  const uint32_t warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const Head hd{t, nh, blockIdx.y / nh, blockIdx.y % nh};
  const uint32_t k0 = blockIdx.x * TILE, j0 = k0 + warp * WROWS;
  const float *bias_cols = bias_t + (bias_batches == 1 ? 0 : (uint64_t)hd.b * t * t);
  float *scores = scores_all[warp];
  T *probs = probs_all[warp];
  // The warp's dscores go over its own scores once those are in registers.
  T *dscores = reinterpret_cast<T *>(scores);
  const uint64_t rows = (uint64_t)gridDim.y * t;
  const float *row_max = stats, *row_inv_sum = stats + rows, *row_dsum = dsum;

  load_tile(q_tile, qkv, hd, 3 * hd.c(), 1, k0);  // the keys and values, staged
  load_tile(g_tile, qkv, hd, 3 * hd.c(), 2, k0);
  __syncthreads();
  RowA<T> k[HD / 16], v[HD / 16];
  load_rows(k, q_tile);
  load_rows(v, g_tile);

  Acc dk[HD / 16], dv[HD / 16];
#pragma unroll
  for (int n = 0; n < HD / 16; ++n) wmma::fill_fragment(dk[n], 0.0f), wmma::fill_fragment(dv[n], 0.0f);
  for (uint32_t i0 = 0; i0 < t; i0 += TILE) {
    float mr[2], inv[2], dr[2], b[WROWS][2];
    bool live = false;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const uint32_t i = i0 + lane + 32 * half;
      const uint64_t row = hd.bh() * t + i;
      mr[half] = i < t ? row_max[row] : 0.0f, inv[half] = i < t ? row_inv_sum[row] : 0.0f;
      dr[half] = i < t ? row_dsum[row] : 0.0f;
      live |= i < t && mr[half] <= MASKED_BELOW;  // a row with no live key weighs every key
#pragma unroll
      for (int r = 0; r < WROWS; ++r) {
        const uint32_t j = j0 + r;
        b[r][half] = i < t && j < t ? bias_cols[(uint64_t)j * t + i] : -INFINITY;
        live |= b[r][half] > MASKED_BELOW;
      }
    }
    if (!__syncthreads_or(live)) continue;
    load_tile(q_tile, qkv, hd, 3 * hd.c(), 0, i0);
    load_tile(g_tile, dy, hd, hd.c(), 0, i0);
    __syncthreads();
    // (dy v^T)^T = v dy^T and (q k^T)^T = k q^T for the warp's 16 keys and the tile's 64 queries.
    times_transposed(scores, v, g_tile);
    __syncwarp();
    float dp[WROWS][2], s[WROWS][2];
#pragma unroll
    for (int r = 0; r < WROWS; ++r) dp[r][0] = scores[r * LDS + lane], dp[r][1] = scores[r * LDS + lane + 32];
    __syncwarp();
    times_transposed(scores, k, q_tile);
    __syncwarp();
#pragma unroll
    for (int r = 0; r < WROWS; ++r) s[r][0] = scores[r * LDS + lane], s[r][1] = scores[r * LDS + lane + 32];
    __syncwarp();
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const uint32_t ii = lane + 32 * half, i = i0 + ii;
#pragma unroll
      for (int r = 0; r < WROWS; ++r) {
        const uint32_t j = j0 + r;
        float kept = 0.0f, ds = 0.0f;
        if (i < t && j < t) {
          const float p = expf(s[r][half] * scale + b[r][half] - mr[half]) * inv[half];
          const float f = drop.factor((hd.bh() * t + i) * t + j);
          kept = p * f;
          ds = scale * p * (f * dp[r][half] - dr[half]);
        }
        probs[r * LDT + ii] = Conv<T>::from(kept);
        dscores[r * LDT + ii] = Conv<T>::from(ds);
      }
    }
    __syncwarp();
    accumulate(dv, probs, g_tile);
    accumulate(dk, dscores, q_tile);
  }
  store_rows(dqkv, hd, 3 * hd.c(), 1, j0, dk, scores);
  store_rows(dqkv, hd, 3 * hd.c(), 2, j0, dv, scores);
}

#define FLASH_ATTENTION(SUFFIX, T)                                                                                \
  extern "C" __global__ void FORWARD_BOUNDS attention_forward_##SUFFIX(                                           \
      const T *qkv, const float *bias, T *y, float *stats, uint32_t t, uint32_t nh, uint32_t bias_batches,        \
      float scale, uint64_t seed, uint32_t threshold, float keep_scale, uint32_t dropout) {                       \
    attention_forward<T>(qkv, bias, y, stats, t, nh, bias_batches, scale,                                         \
                         Dropout{seed, threshold, keep_scale, dropout});                                          \
  }                                                                                                               \
  extern "C" __global__ void FORWARD_BOUNDS attention_forward_online_##SUFFIX(                                    \
      const T *qkv, const float *bias, T *y, float *stats, uint32_t t, uint32_t nh, uint32_t bias_batches,        \
      float scale, uint64_t seed, uint32_t threshold, float keep_scale, uint32_t dropout) {                       \
    attention_forward_online<T>(qkv, bias, y, stats, t, nh, bias_batches, scale,                                  \
                                Dropout{seed, threshold, keep_scale, dropout});                                   \
  }                                                                                                               \
  extern "C" __global__ void DQ_BOUNDS attention_backward_dq_##SUFFIX(                                            \
      const T *qkv, const float *bias, const T *y, const T *dy, T *dqkv, const float *stats, float *dsum,         \
      uint32_t t, uint32_t nh, uint32_t bias_batches, float scale, uint64_t seed, uint32_t threshold,             \
      float keep_scale, uint32_t dropout) {                                                                       \
    attention_backward_dq<T>(qkv, bias, y, dy, dqkv, stats, dsum, t, nh, bias_batches, scale,                     \
                             Dropout{seed, threshold, keep_scale, dropout});                                      \
  }                                                                                                               \
  extern "C" __global__ void DKV_BOUNDS attention_backward_dkv_##SUFFIX(                                          \
      const T *qkv, const float *bias_t, const T *dy, const float *stats, const float *dsum, T *dqkv,             \
      uint32_t t, uint32_t nh, uint32_t bias_batches, float scale, uint64_t seed, uint32_t threshold,             \
      float keep_scale, uint32_t dropout) {                                                                       \
    attention_backward_dkv<T>(qkv, bias_t, dy, stats, dsum, dqkv, t, nh, bias_batches, scale,                     \
                              Dropout{seed, threshold, keep_scale, dropout});                                     \
  }

FLASH_ATTENTION(bf16, __nv_bfloat16)
FLASH_ATTENTION(f16, __half)
