// The embedding table's gradient on the GPU, what fused.rs's EmbeddingGrad computes on the CPU:
// dw (V, C), row v the sum of dy's rows (N, C) at the positions whose id is v, added in f32 in the
// order of the positions and rounded once; rows of absent ids stay as allocated (zeros). The ids
// come grouped by row from the host (fused.rs's group_ids): `groups` holds the rows (G), the
// groups' starts (G + 1) and the positions (N), one after another. One block a group, one thread
// a column: every sum has one writer and a fixed order, so the result is deterministic and, in
// f32, the CPU's bit for bit. (candle's index_add gives each of C threads all N ids in turn.)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

// Grid (G, 1), any block width; the threads stride over the C columns.
#define EMBEDDING_GRAD(NAME, T, TO_F32, FROM_F32)                                                  \
  extern "C" __global__ void NAME(const T *dy, const uint32_t *groups, uint32_t n_groups, T *dw,   \
                                  uint32_t c) {                                                    \
    const uint32_t *rows = groups, *starts = groups + n_groups, *positions = starts + n_groups + 1; \
    const uint32_t g = blockIdx.x, k0 = starts[g], k1 = starts[g + 1];                             \
    const uint64_t row = rows[g];                                                                  \
    for (uint32_t col = threadIdx.x; col < c; col += blockDim.x) {                                 \
      float acc = 0.0f;                                                                            \
      for (uint32_t k = k0; k < k1; ++k) acc += TO_F32(dy[(uint64_t)positions[k] * c + col]);      \
      dw[row * c + col] = FROM_F32(acc);                                                           \
    }                                                                                              \
  }

#define IDENTITY(v) (v)
EMBEDDING_GRAD(embedding_grad_f32, float, IDENTITY, IDENTITY)
EMBEDDING_GRAD(embedding_grad_bf16, __nv_bfloat16, __bfloat162float, __float2bfloat16_rn)
EMBEDDING_GRAD(embedding_grad_f16, __half, __half2float, __float2half_rn)
