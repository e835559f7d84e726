// Flash attention with every product in registers (FlashAttention-2's design), what fused.rs's
// Attention computes on the CPU, on the tensor cores' mma.sync m16n8k16 (sm_80 and later): the
// scores, probabilities and their gradients never go through shared memory. Per (batch, head),
// y = dropout(softmax(q k^T * scale + bias)) v from c_attn's output qkv (B, T, 3C) and the
// additive mask bias (B or 1, 1, T, T) f32; bf16 or f16 operands, f32 accumulation and softmax,
// head dimension 64.
//
// A block takes 64 rows (queries in forward and dq, keys in dk/dv), each of its four warps 16 of
// them, and walks the tiles of 64 of the other side that `attention_tile_liveness` marked live,
// loading the next tile into shared memory (cp.async) while it computes on this one. A warp's
// left operands (its 16 rows of q, or k and v) stay in registers; the tiles' operands are read
// with ldmatrix, transposed where the product needs it. In the m16n8k16 accumulator a thread
// holds rows g = lane / 4 and g + 8 and columns 2 (lane % 4) and 2 (lane % 4) + 1 of each 8 wide
// n-tile, and two adjacent n-tiles converted to half precision are the left operand of the next
// product: P v, dS k, P^T dy and dS^T q are taken from registers as they were computed.
//
// Forward makes one pass with a running row max and sum; it keeps the row max and 1 / sum for
// backward. dq is one kernel over query tiles (it also writes each row's D = dy . y), dk and dv
// one over key tiles: every sum has one writer and a fixed order, so the gradients are
// deterministic without atomics. Dropout draws the CPU's mask (common.cuh) at the element's index
// in the (B, NH, T, T) probabilities. A row with every key masked (bias -1e9) is uniform over its
// T keys, as the composed softmax makes it: its block walks every tile.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include "common.cuh"

#define HD 64     // head dimension
#define TILE 64   // rows of a block, and rows of a tile of the other side
#define WARPS 4   // warps of a block, 16 rows each
// Row stride of a tile in shared memory, in elements: 144 bytes, so that the 8 rows an ldmatrix
// reads at a time fall in distinct banks.
#define LDT 72
// A bias at or below this masks its entry (the model's mask is -1e9).
#define MASKED_BELOW -5e8f
// Blocks an SM must hold (__launch_bounds__' second argument caps the registers ptxas may give a
// thread; sm_90 counts): the forward 3 (168 registers, none spilled; 206 uncapped), dq and dk/dv 2
// (254 and 242; at 3 they spill 240 and 24 bytes).
#define FORWARD_BOUNDS __launch_bounds__(WARPS * 32, 3)
#define BACKWARD_BOUNDS __launch_bounds__(WARPS * 32, 2)

// The tiles of the mask worth walking: live[bias batch][query tile][key tile] is 0 where every
// entry of the tile (of a row and key within T) is masked, 2 where every one is exactly 0 (the
// kernels then skip reading it: adding 0 changes no logit), else 1. Grid (key tiles, query tiles,
// bias batches), 256 threads; row_live (bias batches, T), zeroed before, gets 1 for each row with
// a live entry, for attention_dead_rows.
extern "C" __global__ void attention_tile_liveness(const float *bias, uint8_t *live, uint32_t *row_live, uint32_t t) {
  __shared__ uint32_t row_flags[TILE];
  const uint32_t kt = blockIdx.x, qt = blockIdx.y, tiles = gridDim.x;
  const float *rows = bias + (uint64_t)blockIdx.z * t * t;
  if (threadIdx.x < TILE) row_flags[threadIdx.x] = 0;
  __syncthreads();
  bool any = false, plain = true;
  // Thread x reads column x % 64 of the tile's rows x / 64 + 4 k: a warp reads 128 bytes of a row.
#pragma unroll 4
  for (uint32_t k = 0; k < TILE / 4; ++k) {
    const uint32_t r = threadIdx.x / TILE + 4 * k, i = qt * TILE + r, j = kt * TILE + threadIdx.x % TILE;
    if (i < t && j < t) {
      const float v = rows[(uint64_t)i * t + j];
      if (v > MASKED_BELOW) any = true, row_flags[r] = 1;
      plain &= v == 0.0f;
    }
  }
  any = __syncthreads_or(any);
  plain = __syncthreads_and(plain);
  const uint32_t i = qt * TILE + threadIdx.x;
  if (threadIdx.x < TILE && i < t && row_flags[threadIdx.x]) row_live[(uint64_t)blockIdx.z * t + i] = 1;
  if (threadIdx.x == 0) live[((uint64_t)blockIdx.z * tiles + qt) * tiles + kt] = !any ? 0 : plain ? 2 : 1;
}

// A query tile with a row (within T) that has no live key at all is walked whole, so that the row
// stays uniform over its T keys: its dead tiles become 1 (none of its tiles is 2: that row is
// masked in each). Grid (query tiles, bias batches), 64 threads.
extern "C" __global__ void attention_dead_rows(uint8_t *live, const uint32_t *row_live, uint32_t t) {
  const uint32_t qt = blockIdx.x, tiles = gridDim.x, i = qt * TILE + threadIdx.x;
  const bool dead = i < t && !row_live[(uint64_t)blockIdx.y * t + i];
  if (!__syncthreads_or(dead)) return;
  uint8_t *row = live + ((uint64_t)blockIdx.y * tiles + qt) * tiles;
  for (uint32_t kt = threadIdx.x; kt < tiles; kt += blockDim.x)
    if (!row[kt]) row[kt] = 1;
}

// A half-precision type's pair packing and tensor-core product: pack(lo, hi) puts two values in
// one register (lo in the low bits, the lower column), mma does d += a b with a 16 x 16 (row), b
// 16 x 8 (col) and f32 accumulators.
template <typename T> struct Half;
#define HALF(T, T2, FROM_FLOATS, PTX_TYPE)                                                                          \
  template <> struct Half<T> {                                                                                      \
    static __device__ __forceinline__ uint32_t pack(float lo, float hi) {                                           \
      T2 v = FROM_FLOATS(lo, hi);                                                                                   \
      return *reinterpret_cast<uint32_t *>(&v);                                                                    \
    }                                                                                                               \
    static __device__ __forceinline__ void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {   \
      asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." PTX_TYPE "." PTX_TYPE ".f32 {%0,%1,%2,%3}, "           \
                   "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"                                                       \
                   : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])                                                 \
                   : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));                                 \
    }                                                                                                               \
  };
HALF(__nv_bfloat16, __nv_bfloat162, __floats2bfloat162_rn, "bf16")
HALF(__half, __half2, __floats2half2_rn, "f16")

__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }

__device__ __forceinline__ uint32_t shared_address(const void *p) {
  return (uint32_t)__cvta_generic_to_shared(p);
}

// Four 8 x 8 matrices of 16-bit values from shared memory; lane l gives the address of row l % 8
// of matrix l / 8. Without .trans, lane l receives row l / 4, columns 2 (l % 4) and + 1 of each;
// with it, the same of the transposed matrix.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void *p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(shared_address(p)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void *p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(shared_address(p)));
}

// 16 bytes from global to shared memory without the registers; zeros where !valid.
__device__ __forceinline__ void copy_async(void *dst, const void *src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(shared_address(dst)), "l"(src),
               "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void copy_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int PENDING> __device__ __forceinline__ void copy_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(PENDING) : "memory");
}

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

// Starts copying rows [r0, r0 + 64) of a head's part into dst (64 x 64, row stride LDT), zeros
// past T. Part of the caller's copy group.
template <typename T>
__device__ __forceinline__ void load_tile_async(T *dst, const T *src, const Head &hd, uint32_t width, uint32_t part,
                                                uint32_t r0) {
#pragma unroll
  for (int k = 0; k < TILE * HD / 8 / (WARPS * 32); ++k) {
    const uint32_t e = threadIdx.x + k * WARPS * 32, r = e / (HD / 8), d = e % (HD / 8) * 8;
    const bool valid = r0 + r < hd.t;
    copy_async(dst + r * LDT + d, src + hd.at(valid ? r0 + r : 0, width, part) + d, valid);
  }
}

// The warp's 16 rows of a 64 x 64 tile as the left operand of four k-steps (16 columns each).
template <typename T> __device__ __forceinline__ void load_left(uint32_t (&a)[HD / 16][4], const T *tile) {
  const uint32_t warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
  for (int ks = 0; ks < HD / 16; ++ks)
    ldmatrix_x4(a[ks], tile + (warp * 16 + lane % 16) * LDT + ks * 16 + lane / 16 * 8);
}

// The accumulators of n-tiles, zeroed.
template <int NT> __device__ __forceinline__ void zero(float (&acc)[NT][4]) {
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.0f;
}

// s (16 x 8 NT) = a (16 x 64, registers) times the transpose of rows [n0, n0 + 8 NT) of `tile`
// (their 64 columns): the tile's rows are the product's columns (q k^T, dy v^T, k q^T, v dy^T).
template <typename T, int NT>
__device__ __forceinline__ void times_rows_transposed(float (&s)[NT][4], const uint32_t (&a)[HD / 16][4], const T *tile,
                                                      uint32_t n0) {
  const uint32_t lane = threadIdx.x % 32;
  zero(s);
#pragma unroll
  for (int ks = 0; ks < HD / 16; ++ks)
#pragma unroll
    for (int np = 0; np < NT / 2; ++np) {
      // Matrices: rows n0 + 16 np + (0..7, 0..7, 8..15, 8..15), columns 16 ks + (0, 8, 0, 8).
      uint32_t b[4];
      ldmatrix_x4(b, tile + (n0 + np * 16 + lane / 16 * 8 + lane % 8) * LDT + ks * 16 + (lane / 8) % 2 * 8);
      Half<T>::mma(s[2 * np], a[ks], b[0], b[1]);
      Half<T>::mma(s[2 * np + 1], a[ks], b[2], b[3]);
    }
}

// acc (16 x 64) += p (16 x 16 KS, accumulator layout) times rows [k0, k0 + 16 KS) of `tile`: p's
// columns are the tile's rows (P v, dS k, P^T dy, dS^T q).
template <typename T, int KS>
__device__ __forceinline__ void accumulate_times_rows(float (&acc)[HD / 8][4], const float (&p)[2 * KS][4],
                                                      const T *tile, uint32_t k0) {
  const uint32_t lane = threadIdx.x % 32;
#pragma unroll
  for (int ks = 0; ks < KS; ++ks) {
    const uint32_t a[4] = {Half<T>::pack(p[2 * ks][0], p[2 * ks][1]), Half<T>::pack(p[2 * ks][2], p[2 * ks][3]),
                           Half<T>::pack(p[2 * ks + 1][0], p[2 * ks + 1][1]),
                           Half<T>::pack(p[2 * ks + 1][2], p[2 * ks + 1][3])};
#pragma unroll
    for (int dp = 0; dp < HD / 16; ++dp) {
      // Matrices (transposed): rows k0 + 16 ks + (0..7, 8..15, 0..7, 8..15), columns 16 dp + (0, 0, 8, 8).
      uint32_t b[4];
      ldmatrix_x4_trans(b, tile + (k0 + ks * 16 + (lane / 8) % 2 * 8 + lane % 8) * LDT + dp * 16 + lane / 16 * 8);
      Half<T>::mma(acc[2 * dp], a, b[0], b[1]);
      Half<T>::mma(acc[2 * dp + 1], a, b[2], b[3]);
    }
  }
}

// Writes a warp's 16 accumulated rows (times row_scale of each of the thread's two rows) to rows
// r0.. of a head's part.
template <typename T>
__device__ __forceinline__ void store_rows(T *dst, const Head &hd, uint32_t width, uint32_t part, uint32_t r0,
                                           const float (&acc)[HD / 8][4], float scale_lo, float scale_hi) {
  const uint32_t lane = threadIdx.x % 32, g = lane / 4, c = lane % 4 * 2;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const uint32_t row = r0 + g + 8 * half;
    if (row >= hd.t) continue;
    const float s = half ? scale_hi : scale_lo;
    T *out = dst + hd.at(row, width, part) + c;
#pragma unroll
    for (int nt = 0; nt < HD / 8; ++nt)
      *reinterpret_cast<uint32_t *>(out + nt * 8) = Half<T>::pack(acc[nt][2 * half] * s, acc[nt][2 * half + 1] * s);
  }
}

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

// The next live tile after `after` in a row of the liveness map, or `tiles`.
__device__ __forceinline__ uint32_t next_live(const uint8_t *live, uint32_t stride, int after, uint32_t tiles) {
  uint32_t k = after + 1;
  while (k < tiles && !live[(uint64_t)k * stride]) ++k;
  return k;
}

// Starts copying key tile `next`'s keys and values into buffer `buf` (none past the last tile) and
// closes the copy group. The caller's previous barrier ended every read of that buffer.
template <typename T>
__device__ __forceinline__ void prefetch_key_tile(T (&k_tiles)[2][TILE * LDT], T (&v_tiles)[2][TILE * LDT],
                                                  uint32_t buf, uint32_t next, uint32_t tiles, const T *qkv,
                                                  const Head &hd) {
  if (next < tiles) {
    load_tile_async(k_tiles[buf], qkv, hd, 3 * hd.c(), 1, next * TILE);
    load_tile_async(v_tiles[buf], qkv, hd, 3 * hd.c(), 2, next * TILE);
  }
  copy_commit();
}

// The mask entries of a warp's 16 query rows i0.. and key tile j0.. in the accumulator layout:
// -inf past T, 0 for rows past T and throughout a plain tile (liveness 2, not read).
__device__ __forceinline__ void read_mask(float (&s)[TILE / 8][4], const float *bias_rows, bool plain, uint32_t i0,
                                          uint32_t j0, uint32_t t) {
  const uint32_t lane = threadIdx.x % 32, g = lane / 4, c = lane % 4 * 2;
#pragma unroll
  for (int nt = 0; nt < TILE / 8; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const uint32_t i = i0 + g + 8 * (e / 2), j = j0 + nt * 8 + c + e % 2;
      s[nt][e] = j >= t ? -INFINITY : i < t && !plain ? bias_rows[(uint64_t)i * t + j] : 0.0f;
    }
}

// Where a block of the forward or dq kernel works: its (batch, head), its 64 queries from q0 and
// its warp's 16 from i0, its bias batch's mask rows and its query tile's row of the tile map.
struct QueryBlock {
  Head hd;
  uint32_t tiles, q0, i0;
  const float *bias_rows;
  const uint8_t *live_row;
  __device__ __forceinline__ QueryBlock(const float *bias, const uint8_t *live, uint32_t t, uint32_t nh,
                                        uint32_t bias_batches)
      : hd{t, nh, blockIdx.y / nh, blockIdx.y % nh}, tiles((t + TILE - 1) / TILE), q0(blockIdx.x * TILE),
        i0(q0 + threadIdx.x / 32 * 16) {
    const uint32_t bb = bias_batches == 1 ? 0 : hd.b;
    bias_rows = bias + (uint64_t)bb * t * t;
    live_row = live + ((uint64_t)bb * tiles + blockIdx.x) * tiles;
  }
};

// y (B, T, C), and per query row (B * NH * T each, in `stats`) the row max and 1 / row sum.
// Grid (ceil(T / 64), B * NH), 128 threads.
template <typename T>
__device__ __forceinline__ void attention_forward(const T *qkv, const float *bias, const uint8_t *live, T *y,
                                                  float *stats, uint32_t t, uint32_t nh, uint32_t bias_batches,
                                                  float scale, Dropout drop) {
  __shared__ __align__(128) T k_tiles[2][TILE * LDT];
  __shared__ __align__(128) T v_tiles[2][TILE * LDT];
  const uint32_t lane = threadIdx.x % 32, g = lane / 4, c = lane % 4 * 2;
  const QueryBlock qb(bias, live, t, nh, bias_batches);
  const Head hd = qb.hd;

  load_tile_async(k_tiles[1], qkv, hd, 3 * hd.c(), 0, qb.q0);  // the queries, staged in buffer 1
  uint32_t kt = next_live(qb.live_row, 1, -1, qb.tiles);
  prefetch_key_tile(k_tiles, v_tiles, 0, kt, qb.tiles, qkv, hd);
  copy_wait<0>();
  __syncthreads();
  uint32_t q[HD / 16][4];
  load_left(q, k_tiles[1]);
  __syncthreads();  // before the first iteration refills buffer 1

  float out[HD / 8][4];
  zero(out);
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};  // rows g and g + 8 (l: this thread's columns)
  for (uint32_t buf = 0; kt < qb.tiles; buf ^= 1) {
    const uint32_t next = next_live(qb.live_row, 1, kt, qb.tiles), j0 = kt * TILE;
    prefetch_key_tile(k_tiles, v_tiles, buf ^ 1, next, qb.tiles, qkv, hd);
    float s[TILE / 8][4];
    read_mask(s, qb.bias_rows, qb.live_row[kt] == 2, qb.i0, j0, t);  // while the tiles arrive
    copy_wait<1>();
    __syncthreads();
    float logits[TILE / 8][4];
    times_rows_transposed(logits, q, k_tiles[buf], 0);
    float corr[2];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float mx = m[half];
#pragma unroll
      for (int nt = 0; nt < TILE / 8; ++nt)
#pragma unroll
        for (int e = 2 * half; e < 2 * half + 2; ++e) s[nt][e] += logits[nt][e] * scale, mx = fmaxf(mx, s[nt][e]);
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 2));
      corr[half] = expf(m[half] - mx);  // 0 on the first tile (m = -inf), where out is 0
      m[half] = mx;
      float sum = 0.0f;
      const uint32_t i = qb.i0 + g + 8 * half;
#pragma unroll
      for (int nt = 0; nt < TILE / 8; ++nt)
#pragma unroll
        for (int e = 2 * half; e < 2 * half + 2; ++e) {
          const uint32_t j = j0 + nt * 8 + c + e % 2;
          float p = expf(s[nt][e] - mx);
          sum += p;
          if (drop.on && i < t && j < t) p *= drop.factor((hd.bh() * t + i) * t + j);
          s[nt][e] = p;
        }
      l[half] = l[half] * corr[half] + sum;
    }
#pragma unroll
    for (int nt = 0; nt < HD / 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) out[nt][e] *= corr[e / 2];
    accumulate_times_rows<T, TILE / 16>(out, s, v_tiles[buf], 0);
    __syncthreads();  // every warp is done with this buffer before the next iteration refills it
    kt = next;
  }
  copy_wait<0>();
  float inv[2];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    l[half] += __shfl_xor_sync(0xffffffff, l[half], 1);
    l[half] += __shfl_xor_sync(0xffffffff, l[half], 2);
    inv[half] = 1.0f / l[half];
    const uint32_t i = qb.i0 + g + 8 * half;
    if (lane % 4 == 0 && i < t) {
      const uint64_t rows = (uint64_t)gridDim.y * t, row = hd.bh() * t + i;
      stats[row] = m[half], stats[rows + row] = inv[half];
    }
  }
  store_rows(y, hd, hd.c(), 0, qb.i0, out, inv[0], inv[1]);
}

// dq of the q part of dqkv (B, T, 3C) from the forward's row statistics `stats`, and per query row
// (B * NH * T, in `dsum`) D = dy . y (the softmax backward's row term; with dropout it is still
// the sum over keys of the kept probability times dy . v). Grid (ceil(T / 64), B * NH), 128
// threads.
template <typename T>
__device__ __forceinline__ void attention_backward_dq(const T *qkv, const float *bias, const uint8_t *live, const T *y,
                                                      const T *dy, T *dqkv, const float *stats, float *dsum_out,
                                                      uint32_t t, uint32_t nh, uint32_t bias_batches, float scale,
                                                      Dropout drop) {
  __shared__ __align__(128) T k_tiles[2][TILE * LDT];
  __shared__ __align__(128) T v_tiles[2][TILE * LDT];
  const uint32_t lane = threadIdx.x % 32, g = lane / 4, c = lane % 4 * 2;
  const QueryBlock qb(bias, live, t, nh, bias_batches);
  const Head hd = qb.hd;
  const uint64_t rows = (uint64_t)gridDim.y * t;

  load_tile_async(k_tiles[1], qkv, hd, 3 * hd.c(), 0, qb.q0);  // the queries and dy, staged in buffers 1
  load_tile_async(v_tiles[1], dy, hd, hd.c(), 0, qb.q0);
  uint32_t kt = next_live(qb.live_row, 1, -1, qb.tiles);
  prefetch_key_tile(k_tiles, v_tiles, 0, kt, qb.tiles, qkv, hd);
  // D of the warp's 16 rows (the whole warp reads one row at a time), then each thread's two rows.
  float dsum = 0.0f;
#pragma unroll
  for (int r = 0; r < 16; ++r) {
    const uint32_t i = qb.i0 + r;
    float v = 0.0f;
    if (i < t) {
      const uint64_t at = hd.at(i, hd.c(), 0);
      const float dy0 = to_float(dy[at + lane]), dy1 = to_float(dy[at + lane + 32]);
      v = dy0 * to_float(y[at + lane]) + dy1 * to_float(y[at + lane + 32]);
    }
    v = warp_sum(v);
    if (lane == r) dsum = v;
  }
  if (lane < 16 && qb.i0 + lane < t) dsum_out[hd.bh() * t + qb.i0 + lane] = dsum;
  float mr[2], inv[2], dr[2];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const uint32_t i = qb.i0 + g + 8 * half;
    dr[half] = __shfl_sync(0xffffffff, dsum, g + 8 * half);
    mr[half] = i < t ? stats[hd.bh() * t + i] : 0.0f;
    inv[half] = i < t ? stats[rows + hd.bh() * t + i] : 0.0f;
  }
  copy_wait<0>();
  __syncthreads();
  uint32_t q[HD / 16][4], gr[HD / 16][4];
  load_left(q, k_tiles[1]);
  load_left(gr, v_tiles[1]);
  __syncthreads();  // before the first iteration refills buffers 1

  float dq[HD / 8][4];
  zero(dq);
  for (uint32_t buf = 0; kt < qb.tiles; buf ^= 1) {
    const uint32_t next = next_live(qb.live_row, 1, kt, qb.tiles), j0 = kt * TILE;
    prefetch_key_tile(k_tiles, v_tiles, buf ^ 1, next, qb.tiles, qkv, hd);
    float s[TILE / 8][4];
    read_mask(s, qb.bias_rows, qb.live_row[kt] == 2, qb.i0, j0, t);  // while the tiles arrive
    copy_wait<1>();
    __syncthreads();
    {
      float logits[TILE / 8][4], dp[TILE / 8][4];
      times_rows_transposed(logits, q, k_tiles[buf], 0);
      times_rows_transposed(dp, gr, v_tiles[buf], 0);
#pragma unroll
      for (int nt = 0; nt < TILE / 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const uint32_t i = qb.i0 + g + 8 * (e / 2), j = j0 + nt * 8 + c + e % 2;
          float ds = 0.0f;
          if (i < t && j < t) {
            const float p = expf(logits[nt][e] * scale + s[nt][e] - mr[e / 2]) * inv[e / 2];
            ds = scale * p * (drop.factor((hd.bh() * t + i) * t + j) * dp[nt][e] - dr[e / 2]);
          }
          s[nt][e] = ds;
        }
    }
    // dq += dS k: the key tile's rows are dS's columns.
    accumulate_times_rows<T, TILE / 16>(dq, s, k_tiles[buf], 0);
    __syncthreads();
    kt = next;
  }
  copy_wait<0>();
  store_rows(dqkv, hd, 3 * hd.c(), 0, qb.i0, dq, 1.0f, 1.0f);
}

// dk and dv of the k and v parts of dqkv, from the forward's statistics, the D the dq kernel wrote
// and the transposed mask bias_t (B or 1, 1, T, T): bias_t[j][i] = bias[i][j], read along the
// queries. Walks the query tiles live for the block's keys, in halves of 32 queries (registers).
// Grid (ceil(T / 64), B * NH), 128 threads.
template <typename T>
__device__ __forceinline__ void attention_backward_dkv(const T *qkv, const float *bias_t, const uint8_t *live,
                                                       const T *dy, const float *stats, const float *dsum, T *dqkv,
                                                       uint32_t t, uint32_t nh, uint32_t bias_batches, float scale,
                                                       Dropout drop) {
  __shared__ __align__(128) T q_tiles[2][TILE * LDT];
  __shared__ __align__(128) T g_tiles[2][TILE * LDT];
  __shared__ float row_stats[2][3][TILE];  // per query of a tile: max, 1 / sum, D
  const uint32_t warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4 * 2;
  const Head hd{t, nh, blockIdx.y / nh, blockIdx.y % nh};
  const uint32_t tiles = (t + TILE - 1) / TILE, k0 = blockIdx.x * TILE, j0 = k0 + warp * 16;
  const uint32_t bb = bias_batches == 1 ? 0 : hd.b;
  const float *bias_cols = bias_t + (uint64_t)bb * t * t;
  // Column blockIdx.x of the map: query tile qt's entry is at qt * tiles.
  const uint8_t *live_col = live + (uint64_t)bb * tiles * tiles + blockIdx.x;
  const uint64_t rows = (uint64_t)gridDim.y * t;
  // Query tile qt's statistics into row_stats[buf] (plain loads; the barrier before use orders them).
  auto load_stats = [&](uint32_t buf, uint32_t qt) {
    for (uint32_t e = threadIdx.x; e < 3 * TILE; e += WARPS * 32) {
      const uint32_t which = e / TILE, i = qt * TILE + e % TILE;
      const uint64_t row = hd.bh() * t + i;
      row_stats[buf][which][e % TILE] =
          i >= t ? 0.0f : which == 0 ? stats[row] : which == 1 ? stats[rows + row] : dsum[row];
    }
  };

  // The keys and values, staged in the query buffers 1 for their fragments.
  load_tile_async(q_tiles[1], qkv, hd, 3 * hd.c(), 1, k0);
  load_tile_async(g_tiles[1], qkv, hd, 3 * hd.c(), 2, k0);
  copy_commit();
  copy_wait<0>();
  __syncthreads();
  uint32_t k[HD / 16][4], v[HD / 16][4];
  load_left(k, q_tiles[1]);
  load_left(v, g_tiles[1]);
  __syncthreads();
  uint32_t qt = next_live(live_col, tiles, -1, tiles);
  if (qt < tiles) {
    load_tile_async(q_tiles[0], qkv, hd, 3 * hd.c(), 0, qt * TILE);
    load_tile_async(g_tiles[0], dy, hd, hd.c(), 0, qt * TILE);
    load_stats(0, qt);
  }
  copy_commit();

  float dk[HD / 8][4], dv[HD / 8][4];
  zero(dk);
  zero(dv);
  for (uint32_t buf = 0; qt < tiles; buf ^= 1) {
    const uint32_t next = next_live(live_col, tiles, qt, tiles), q0 = qt * TILE;
    if (next < tiles) {
      load_tile_async(q_tiles[buf ^ 1], qkv, hd, 3 * hd.c(), 0, next * TILE);
      load_tile_async(g_tiles[buf ^ 1], dy, hd, hd.c(), 0, next * TILE);
      load_stats(buf ^ 1, next);
    }
    copy_commit();
    copy_wait<1>();
    __syncthreads();
    const float *m_of = row_stats[buf][0], *inv_of = row_stats[buf][1], *d_of = row_stats[buf][2];
    const bool plain = live_col[(uint64_t)qt * tiles] == 2;
#pragma unroll
    for (uint32_t half = 0; half < 2; ++half) {
      const uint32_t n0 = half * (TILE / 2);
      float s[TILE / 16][4];  // keys x 32 queries: the mask entries, then the kept probabilities
#pragma unroll
      for (int nt = 0; nt < TILE / 16; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const uint32_t j = j0 + g + 8 * (e / 2), i = q0 + n0 + nt * 8 + c + e % 2;
          s[nt][e] = i < t && j < t && !plain ? bias_cols[(uint64_t)j * t + i] : 0.0f;
        }
      float st[TILE / 16][4], dpt[TILE / 16][4];
      times_rows_transposed(st, k, q_tiles[buf], n0);   // (q k^T)^T = k q^T
      times_rows_transposed(dpt, v, g_tiles[buf], n0);  // (dy v^T)^T = v dy^T
#pragma unroll
      for (int nt = 0; nt < TILE / 16; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const uint32_t jj = g + 8 * (e / 2), j = j0 + jj, ii = n0 + nt * 8 + c + e % 2, i = q0 + ii;
          float kept = 0.0f, ds = 0.0f;
          if (i < t && j < t) {
            const float p = expf(st[nt][e] * scale + s[nt][e] - m_of[ii]) * inv_of[ii];
            const float f = drop.factor((hd.bh() * t + i) * t + j);
            kept = p * f;
            ds = scale * p * (f * dpt[nt][e] - d_of[ii]);
          }
          s[nt][e] = kept, st[nt][e] = ds;
        }
      // dv += P^T dy and dk += dS^T q: the query tile's rows are the products' inner dimension.
      accumulate_times_rows<T, TILE / 32>(dv, s, g_tiles[buf], n0);
      accumulate_times_rows<T, TILE / 32>(dk, st, q_tiles[buf], n0);
    }
    __syncthreads();
    qt = next;
  }
  copy_wait<0>();
  store_rows(dqkv, hd, 3 * hd.c(), 1, j0, dk, 1.0f, 1.0f);
  store_rows(dqkv, hd, 3 * hd.c(), 2, j0, dv, 1.0f, 1.0f);
}

#define FLASH_ATTENTION(SUFFIX, T)                                                                                    \
  extern "C" __global__ void FORWARD_BOUNDS attention_forward_##SUFFIX(                                               \
      const T *qkv, const float *bias, const uint8_t *live, T *y, float *stats, uint32_t t, uint32_t nh,              \
      uint32_t bias_batches, float scale, uint64_t seed, uint32_t threshold, float keep_scale, uint32_t dropout) {    \
    attention_forward<T>(qkv, bias, live, y, stats, t, nh, bias_batches, scale,                                       \
                         Dropout{seed, threshold, keep_scale, dropout});                                              \
  }                                                                                                                   \
  extern "C" __global__ void BACKWARD_BOUNDS attention_backward_dq_##SUFFIX(                                          \
      const T *qkv, const float *bias, const uint8_t *live, const T *y, const T *dy, T *dqkv, const float *stats,     \
      float *dsum, uint32_t t, uint32_t nh, uint32_t bias_batches, float scale, uint64_t seed, uint32_t threshold,    \
      float keep_scale, uint32_t dropout) {                                                                           \
    attention_backward_dq<T>(qkv, bias, live, y, dy, dqkv, stats, dsum, t, nh, bias_batches, scale,                   \
                             Dropout{seed, threshold, keep_scale, dropout});                                          \
  }                                                                                                                   \
  extern "C" __global__ void BACKWARD_BOUNDS attention_backward_dkv_##SUFFIX(                                         \
      const T *qkv, const float *bias_t, const uint8_t *live, const T *dy, const float *stats, const float *dsum,     \
      T *dqkv, uint32_t t, uint32_t nh, uint32_t bias_batches, float scale, uint64_t seed, uint32_t threshold,        \
      float keep_scale, uint32_t dropout) {                                                                           \
    attention_backward_dkv<T>(qkv, bias_t, live, dy, stats, dsum, dqkv, t, nh, bias_batches, scale,                   \
                              Dropout{seed, threshold, keep_scale, dropout});                                         \
  }

FLASH_ATTENTION(bf16, __nv_bfloat16)
FLASH_ATTENTION(f16, __half)
