// Sampling's choice on the GPU, what kernels/sample_pick.rs's `sample_with_draw` computes on the
// CPU: for each row of logits (B, V) and its uniform draw u in [0, 1) (drawn on the host from the
// row's stream, so a row samples the CPU's token), the token that temperature, top-k and top-p
// sampling take, and its log-probability under the whole row (as greedy_pick.cu). out: (B, 2)
// f32, the token (an exact integer: V < 2^24) then its log-probability; only these two numbers a
// row go to the host, not the row's V logits.
//
// The candidates are a prefix of the order "logit descending, id ascending" (f32::total_cmp's
// order on the logits, ties by id): top-k keeps the first k, top-p then the shortest prefix whose
// weight reaches top_p of theirs (at least one), weights exp((x - max) / t) in f64. Such a prefix
// is named by its last element, found without sorting by a radix select over the logits' 32-bit
// order keys, 8 bits a pass (by count for top-k, by weight for top-p), the last pass's ties
// resolved by id. The draw then walks the candidates in id order, as the CPU does: each thread
// sums the weights of its contiguous stretch of ids, and the thread whose stretch holds u times
// the candidates' weight walks it. Sums in another order than the CPU's differ by rounding only,
// so a token differs only where the draw falls within rounding of a boundary.
//
// One block a row; every pass reads the row again (from L2: a row of GPT-2's vocabulary is 100 kB
// in bf16).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <math.h>
#include <stdint.h>

#include "common.cuh"

#define THREADS 256
#define WARPS (THREADS / 32)
#define NONE 0xffffffffu

// The logit's key: unsigned order of keys = f32::total_cmp's order of the logits.
__device__ __forceinline__ uint32_t order_key(float x) {
  const uint32_t b = __float_as_uint(x);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// Whether the element (key, id) comes at or before the element (cut_key, cut_id) in the order
// "logit descending, id ascending".
__device__ __forceinline__ bool at_or_before(uint32_t key, uint32_t id, uint32_t cut_key, uint32_t cut_id) {
  return key > cut_key || (key == cut_key && id <= cut_id);
}

struct Scratch {
  uint32_t count[256];
  double mass[256];
  uint32_t thread_count[THREADS];
  double thread_mass[THREADS];
  float max_of_warp[WARPS];
  double total_of_warp[WARPS];
  uint32_t bin, rank, cut_key, cut_id, pick, last;
  double above, target;
};

// For each lane whose `bin` is below 256: one more in count[bin] and `w` more in mass[bin] (with
// `mass`). One shared-memory atomic per distinct bin of the warp: most of a row's logits share the
// high bits of their keys, and atomics on one address from every lane would run one at a time.
// Every lane of the warp calls it.
__device__ __forceinline__ void add_to_bins(uint32_t bin, double w, uint32_t *count, double *mass) {
  const unsigned peers = __match_any_sync(0xffffffff, bin);
  double sum = 0.0;
  if (mass != nullptr) {
    for (int src = 0; src < 32; ++src) {
      const double other = __shfl_sync(0xffffffff, w, src);
      if ((peers >> src) & 1) sum += other;
    }
  }
  if ((int)(threadIdx.x % 32) == __ffs(peers) - 1 && bin < 256) {
    atomicAdd(&count[bin], (uint32_t)__popc(peers));
    if (mass != nullptr) atomicAdd(&mass[bin], sum);
  }
}

// The ids [lo, hi) of this thread's contiguous stretch of [0, limit).
__device__ __forceinline__ void stretch(uint32_t limit, uint32_t *lo, uint32_t *hi) {
  const uint32_t chunk = (limit + THREADS - 1) / THREADS;
  *lo = min(threadIdx.x * chunk, limit);
  *hi = min(*lo + chunk, limit);
}

// Thread 0 turns thread_count / thread_mass into exclusive prefix sums (mass from `start`).
__device__ __forceinline__ void exclusive_scans(Scratch &s, double start) {
  if (threadIdx.x == 0) {
    uint32_t c = 0;
    double m = start;
    for (int t = 0; t < THREADS; ++t) {
      const uint32_t nc = c + s.thread_count[t];
      const double nm = m + s.thread_mass[t];
      s.thread_count[t] = c;
      s.thread_mass[t] = m;
      c = nc;
      m = nm;
    }
  }
}

// The element at rank `rank` (0-based) of ids [0, limit) in the candidate order, into
// s.cut_key / s.cut_id.
template <typename T, typename F>
__device__ void select_by_count(const T *x, uint32_t limit, uint32_t rank, Scratch &s, F to_f32) {
  uint32_t prefix = 0, high = 0;
  if (threadIdx.x == 0) s.rank = rank;
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int i = threadIdx.x; i < 256; i += THREADS) s.count[i] = 0;
    __syncthreads();
    // Whole warps a round (add_to_bins needs every lane): ids past the limit add nothing.
    for (uint32_t base = threadIdx.x - threadIdx.x % 32; base < limit; base += THREADS) {
      const uint32_t j = base + threadIdx.x % 32;
      const uint32_t k = j < limit ? order_key(to_f32(x[j])) : 0;
      add_to_bins(j < limit && (k & high) == prefix ? (k >> shift) & 255 : 256, 0.0, s.count, nullptr);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      // From the largest keys down: the bin that holds the wanted rank.
      uint32_t before = 0;
      int bin = 255;
      for (; bin > 0; --bin) {
        if (before + s.count[bin] > s.rank) break;
        before += s.count[bin];
      }
      s.rank -= before;
      s.bin = bin;
    }
    __syncthreads();
    prefix |= s.bin << shift;
    high |= 255u << shift;
  }
  // Among the ids with this key, the s.rank-th smallest.
  uint32_t lo, hi, n = 0;
  stretch(limit, &lo, &hi);
  for (uint32_t j = lo; j < hi; ++j) n += order_key(to_f32(x[j])) == prefix;
  s.thread_count[threadIdx.x] = n;
  s.thread_mass[threadIdx.x] = 0.0;
  __syncthreads();
  exclusive_scans(s, 0.0);
  __syncthreads();
  const uint32_t first = s.thread_count[threadIdx.x];
  if (s.rank >= first && s.rank < first + n) {
    uint32_t seen = first;
    for (uint32_t j = lo; j < hi; ++j) {
      if (order_key(to_f32(x[j])) != prefix) continue;
      if (seen++ == s.rank) {
        s.cut_id = j;
        break;
      }
    }
  }
  if (threadIdx.x == 0) s.cut_key = prefix;
  __syncthreads();
}

// Among the ids [0, limit) at or before the cut (s.cut_key, s.cut_id), the first element in the
// candidate order whose weight, with the weight of all before it, reaches `target`; the last of
// them where none does. Into s.cut_key / s.cut_id.
template <typename T, typename F>
__device__ void select_by_weight(const T *x, uint32_t limit, double target, double m, double t, Scratch &s,
                                 F to_f32) {
  const uint32_t set_key = s.cut_key, set_id = s.cut_id;
  uint32_t prefix = 0, high = 0;
  if (threadIdx.x == 0) s.above = 0.0;
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int i = threadIdx.x; i < 256; i += THREADS) {
      s.count[i] = 0;
      s.mass[i] = 0.0;
    }
    __syncthreads();
    for (uint32_t base = threadIdx.x - threadIdx.x % 32; base < limit; base += THREADS) {
      const uint32_t j = base + threadIdx.x % 32;
      const float xj = j < limit ? to_f32(x[j]) : 0.0f;
      const uint32_t k = order_key(xj);
      const bool in = j < limit && (k & high) == prefix && at_or_before(k, j, set_key, set_id);
      add_to_bins(in ? (k >> shift) & 255 : 256, in ? exp(((double)xj - m) / t) : 0.0, s.count, s.mass);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      // From the largest keys down: the first bin where the weight reaches the target, else the
      // last bin that holds an element (the target lies beyond rounding of the set's weight).
      double above = s.above;
      int bin = -1, lowest = 0;
      for (int b = 255; b >= 0; --b) {
        if (s.count[b] == 0) continue;
        lowest = b;
        if (above + s.mass[b] >= target) {
          bin = b;
          break;
        }
        above += s.mass[b];
      }
      if (bin < 0) {
        bin = lowest;
        above -= s.mass[lowest];
      }
      s.above = above;
      s.bin = bin;
    }
    __syncthreads();
    prefix |= s.bin << shift;
    high |= 255u << shift;
  }
  // Among the ids with this key (in the set), by id: the first that reaches the target.
  uint32_t lo, hi;
  stretch(limit, &lo, &hi);
  double mine = 0.0;
  uint32_t last = NONE;
  for (uint32_t j = lo; j < hi; ++j) {
    const float xj = to_f32(x[j]);
    const uint32_t k = order_key(xj);
    if (k == prefix && at_or_before(k, j, set_key, set_id)) {
      mine += exp(((double)xj - m) / t);
      last = j;
    }
  }
  s.thread_count[threadIdx.x] = 0;
  s.thread_mass[threadIdx.x] = mine;
  if (threadIdx.x == 0) {
    s.pick = NONE;
    s.last = 0;
  }
  __syncthreads();
  exclusive_scans(s, s.above);
  __syncthreads();
  if (last != NONE) {
    atomicMax(&s.last, last);
    double cum = s.thread_mass[threadIdx.x];
    for (uint32_t j = lo; j < hi; ++j) {
      const float xj = to_f32(x[j]);
      const uint32_t k = order_key(xj);
      if (k != prefix || !at_or_before(k, j, set_key, set_id)) continue;
      cum += exp(((double)xj - m) / t);
      if (cum >= target) {
        atomicMin(&s.pick, j);
        break;
      }
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    s.cut_key = prefix;
    s.cut_id = s.pick != NONE ? s.pick : s.last;
  }
  __syncthreads();
}

template <typename T, typename F>
__device__ void sample_pick(const T *logits, const double *draws, float *out, uint32_t v, uint32_t limit,
                            double t, uint32_t top_k, double top_p, F to_f32) {
  __shared__ Scratch s;
  const T *x = logits + (uint64_t)blockIdx.x * v;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  // The largest logit below the limit (the weights' scale) and over the row (the log-probability's).
  float m_limit = -INFINITY, m_row = -INFINITY;
  for (uint32_t j = threadIdx.x; j < v; j += THREADS) {
    const float xj = to_f32(x[j]);
    m_row = fmaxf(m_row, xj);
    if (j < limit) m_limit = fmaxf(m_limit, xj);
  }
  m_limit = warp_max(m_limit);
  m_row = warp_max(m_row);
  if (lane == 0) s.max_of_warp[warp] = m_limit;
  __syncthreads();
  float m = -INFINITY;
  for (int w = 0; w < WARPS; ++w) m = fmaxf(m, s.max_of_warp[w]);
  __syncthreads();
  if (lane == 0) s.max_of_warp[warp] = m_row;
  __syncthreads();
  float mr = -INFINITY;
  for (int w = 0; w < WARPS; ++w) mr = fmaxf(mr, s.max_of_warp[w]);
  const double md = (double)m;

  // The candidates: every id below the limit, then top-k's prefix, then top-p's.
  if (threadIdx.x == 0) {
    s.cut_key = 0;
    s.cut_id = NONE;
  }
  __syncthreads();
  if (top_k > 0 && top_k < limit) select_by_count(x, limit, top_k - 1, s, to_f32);
  if (top_p < 1.0) {
    double total = 0.0;
    const uint32_t set_key = s.cut_key, set_id = s.cut_id;
    for (uint32_t j = threadIdx.x; j < limit; j += THREADS) {
      const float xj = to_f32(x[j]);
      if (at_or_before(order_key(xj), j, set_key, set_id)) total += exp(((double)xj - md) / t);
    }
    total = warp_sum_f64(total);
    if (lane == 0) s.total_of_warp[warp] = total;
    __syncthreads();
    total = 0.0;
    for (int w = 0; w < WARPS; ++w) total += s.total_of_warp[w];
    __syncthreads();
    select_by_weight(x, limit, top_p * total, md, t, s, to_f32);
  }

  // The draw, in id order over the candidates.
  const uint32_t cut_key = s.cut_key, cut_id = s.cut_id;
  uint32_t lo, hi, last = NONE;
  stretch(limit, &lo, &hi);
  double mine = 0.0;
  for (uint32_t j = lo; j < hi; ++j) {
    const float xj = to_f32(x[j]);
    if (at_or_before(order_key(xj), j, cut_key, cut_id)) {
      mine += exp(((double)xj - md) / t);
      last = j;
    }
  }
  s.thread_count[threadIdx.x] = 0;
  s.thread_mass[threadIdx.x] = mine;
  __syncthreads();
  exclusive_scans(s, 0.0);
  __syncthreads();
  // u times the candidates' weight (the last thread's exclusive sum plus its own).
  if (threadIdx.x == THREADS - 1) {
    s.target = draws[blockIdx.x] * (s.thread_mass[THREADS - 1] + mine);
    s.pick = NONE;
    s.last = 0;
  }
  __syncthreads();
  if (last != NONE) {
    atomicMax(&s.last, last);
    double rem = s.target - s.thread_mass[threadIdx.x];
    if (rem >= 0.0 && rem < mine) {
      uint32_t pick = last;  // rounding past the stretch's end: its last candidate
      for (uint32_t j = lo; j < hi; ++j) {
        const float xj = to_f32(x[j]);
        if (!at_or_before(order_key(xj), j, cut_key, cut_id)) continue;
        const double w = exp(((double)xj - md) / t);
        if (rem < w) {
          pick = j;
          break;
        }
        rem -= w;
      }
      atomicMin(&s.pick, pick);
    }
  }
  // The log-probability's normaliser over the whole row, as greedy_pick.cu sums it.
  double z = 0.0;
  for (uint32_t j = threadIdx.x; j < v; j += THREADS) z += (double)expf(to_f32(x[j]) - mr);
  z = warp_sum_f64(z);
  if (lane == 0) s.total_of_warp[warp] = z;
  __syncthreads();
  if (threadIdx.x == 0) {
    z = 0.0;
    for (int w = 0; w < WARPS; ++w) z += s.total_of_warp[w];
    const uint32_t token = s.pick != NONE ? s.pick : s.last;
    out[2ull * blockIdx.x] = (float)token;
    out[2ull * blockIdx.x + 1] = (float)((double)to_f32(x[token]) - ((double)mr + log(z)));
  }
}

#define SAMPLE_PICK(SUFFIX, T, TO_F32)                                                                     \
  extern "C" __global__ void sample_pick_##SUFFIX(const T *logits, const double *draws, float *out,        \
                                                  uint32_t v, uint32_t limit, double t, uint32_t top_k,   \
                                                  double top_p) {                                          \
    sample_pick(logits, draws, out, v, limit, t, top_k, top_p, [](T a) { return TO_F32(a); });            \
  }

#define IDENTITY(v) (v)
SAMPLE_PICK(f32, float, IDENTITY)
SAMPLE_PICK(bf16, __nv_bfloat16, __bfloat162float)
SAMPLE_PICK(f16, __half, __half2float)
