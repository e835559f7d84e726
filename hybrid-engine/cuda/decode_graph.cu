// The end of a decoding step captured as a CUDA graph (generation/decode_graph.rs): what the
// host's decoding loop in generate.rs does between two steps, on the device, so that the graph
// serves every step without the host reading the tokens.
//
// picks: (B, 2) f32, the step's token (an exact integer) and its log-probability per row, from
// greedy_pick.cu or sample_pick.cu. done: (B) 1 for a row that has emitted EOS. state: [0] the
// positions cached before the next step (the KV cache's length, which decode_attention.cu reads:
// the prompt's p and one a step after the first), [1] the step being made (0: the prompt's), [2]
// the rows still running after it. A finished row's token becomes
// `pad`; each row's token and log-probability go to row `step` of tokens and logprobs (steps, B);
// the next step's inputs are the tokens, at positions one further; with all_draws (steps, B), the
// next step's uniform draws are copied to draws (row r's stream consumed one draw a step while it
// ran, so its draw for a step is the step's entry whatever the other rows did). eos: 0xffffffff
// for none. One block; its threads stride over the rows.
#include <stdint.h>

#define NO_EOS 0xffffffffu

extern "C" __global__ void decode_graph_advance(const float *picks, uint32_t *ids, uint32_t *positions,
                                                uint32_t *done, uint32_t *state, uint32_t *tokens,
                                                float *logprobs, double *draws, const double *all_draws,
                                                uint32_t b, uint32_t steps, uint32_t p, uint32_t pad,
                                                uint32_t eos) {
  __shared__ uint32_t running;
  if (threadIdx.x == 0) running = 0;
  __syncthreads();
  const uint32_t step = state[1];
  uint32_t mine = 0;
  for (uint32_t r = threadIdx.x; r < b; r += blockDim.x) {
    const bool was_done = done[r] != 0;
    const uint32_t token = was_done ? pad : (uint32_t)picks[2 * r];
    if (step < steps) {
      tokens[(uint64_t)step * b + r] = token;
      logprobs[(uint64_t)step * b + r] = picks[2 * r + 1];
    }
    const bool now_done = was_done || (eos != NO_EOS && token == eos);
    done[r] = now_done ? 1u : 0u;
    mine += now_done ? 0u : 1u;
    ids[r] = token;
    positions[r] += 1;  // wraps: a row without prompt tokens starts at 0xffffffff
    if (all_draws != nullptr && step + 1 < steps) draws[r] = all_draws[(uint64_t)(step + 1) * b + r];
  }
  atomicAdd(&running, mine);
  __syncthreads();
  if (threadIdx.x == 0) {
    state[0] = p + step;
    state[1] = step + 1;
    state[2] = running;
  }
}
