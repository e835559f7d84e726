//! What a generation takes and gives: the sampling settings and each row's random stream, the
//! prompts left-padded to one length with transformers' mask and position ids, and the tokens
//! made with their log-probabilities. Both decoding loops read them: the host's
//! (`generate.rs`) and, on a GPU, the CUDA graph's (`decode_graph.rs`).

use crate::kernels::ops;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

#[derive(Clone, Debug)]
pub struct SamplingConfig {
    pub max_new_tokens: usize,
    /// `None` or 0 means greedy.
    pub temperature: Option<f64>,
    pub top_k: Option<usize>,
    pub top_p: Option<f64>,
    /// Stop a row when it emits this token.
    pub eos_token_id: Option<u32>,
    /// Filler for finished rows and left padding.
    pub pad_token_id: u32,
    /// Logits at ids >= this (Megatron vocabulary padding) are never chosen.
    pub vocab_limit: usize,
    /// With a row's key, the stream its sampling draws from ([`row_rng`]).
    pub seed: u64,
}

impl SamplingConfig {
    pub fn greedy(max_new_tokens: usize, eos: Option<u32>, pad: u32, vocab_limit: usize) -> Self {
        Self {
            max_new_tokens,
            temperature: None,
            top_k: None,
            top_p: None,
            eos_token_id: eos,
            pad_token_id: pad,
            vocab_limit,
            seed: 0,
        }
    }
    fn is_greedy(&self) -> bool {
        self.temperature.is_none_or(|t| t <= 0.0)
    }

    /// What the sampler takes, or `None` for greedy decoding.
    pub(crate) fn sampling_params(&self) -> Option<ops::SamplingParams> {
        (!self.is_greedy()).then(|| ops::SamplingParams {
            vocab_limit: self.vocab_limit,
            temperature: self.temperature.unwrap_or(1.0),
            top_k: self.top_k,
            top_p: self.top_p,
        })
    }
}

/// The random stream of the row keyed `key`: ChaCha8 seeded by `seed`, stream `key`. Key 0 is
/// the seed's default stream, so a lone row samples as before per-row streams existed.
pub fn row_rng(seed: u64, key: u64) -> ChaCha8Rng {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    rng.set_stream(key);
    rng
}

/// What a generation produced ([`crate::generation::generate::generate_left_padded`]).
#[derive(Clone, Debug, PartialEq)]
pub struct Generation {
    /// New tokens per row, ending at (and including) EOS when one was produced.
    pub tokens: Vec<Vec<u32>>,
    /// `log p(token)` of each new token under the model's logits (before temperature, top-k
    /// or top-p), computed as the tokens are generated.
    pub logprobs: Vec<Vec<f32>>,
}

/// Prompts left-padded to one length P, with the attention mask and the position ids that
/// transformers' `generate` builds for them (`cumsum(mask) - 1`: pads take no positions), so a
/// padded row produces the same tokens as the same prompt alone.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LeftPadded {
    /// (B, P) token ids.
    pub ids: Vec<u32>,
    /// (B, P): 1 on prompt tokens, 0 on padding.
    pub mask: Vec<u32>,
    pub b: usize,
    pub p: usize,
    /// Each row's sampling stream ([`row_rng`]); its index in the batch unless set.
    pub keys: Vec<u64>,
}

impl LeftPadded {
    /// Left-pads `prompts` (each at most `p` tokens) to `p`.
    pub fn new(prompts: &[Vec<u32>], p: usize, pad: u32) -> Self {
        let b = prompts.len();
        let (mut ids, mut mask) = (Vec::with_capacity(b * p), Vec::with_capacity(b * p));
        for prompt in prompts {
            assert!(prompt.len() <= p, "LeftPadded: a prompt of {} tokens exceeds {p}", prompt.len());
            let pad_len = p - prompt.len();
            ids.extend(std::iter::repeat_n(pad, pad_len).chain(prompt.iter().copied()));
            mask.extend((0..p).map(|i| u32::from(i >= pad_len)));
        }
        Self { ids, mask, b, p, keys: (0..b as u64).collect() }
    }

    /// Samples row `r` from the stream `keys[r]`: a row keyed by its place in a larger batch
    /// (PPO's rollout cut across ranks) samples what it would sample there.
    pub fn with_keys(mut self, keys: Vec<u64>) -> Self {
        assert_eq!(keys.len(), self.b, "LeftPadded::with_keys: one key per row");
        self.keys = keys;
        self
    }

    /// Position ids `cumsum(mask) - 1`, pads at 0. (B, P) row-major.
    pub fn position_ids(&self) -> Vec<u32> {
        position_ids(&self.mask, self.b, self.p)
    }
}

/// `cumsum(mask) - 1` per row, clamped at 0 (transformers' position ids under left padding).
pub fn position_ids(mask: &[u32], b: usize, t: usize) -> Vec<u32> {
    let mut out = Vec::with_capacity(b * t);
    for row in mask.chunks(t) {
        let mut seen = 0u32;
        for &m in row {
            seen += m;
            out.push(seen.saturating_sub(1));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::Rng;

    /// Left padding by hand: pads first, the mask 0 on them, positions counting the real tokens
    /// before each (pads at 0), each row keyed by its index.
    #[test]
    fn left_padding_and_position_ids_by_hand() {
        let batch = LeftPadded::new(&[vec![5, 6, 7], vec![8], vec![1, 2, 3, 4]], 4, 0);
        assert_eq!(batch.ids, [0, 5, 6, 7, 0, 0, 0, 8, 1, 2, 3, 4]);
        assert_eq!(batch.mask, [0, 1, 1, 1, 0, 0, 0, 1, 1, 1, 1, 1]);
        assert_eq!(batch.position_ids(), [0, 0, 1, 2, 0, 0, 0, 0, 0, 1, 2, 3]);
        assert_eq!((batch.b, batch.p, batch.keys), (3, 4, vec![0, 1, 2]));
        // A 0 inside a row (not left padding's layout, but the rule is the same) takes no position.
        assert_eq!(position_ids(&[0, 1, 0, 1, 1], 1, 5), [0, 0, 0, 1, 2]);
    }

    /// Greedy unless a temperature above 0 is given; then the sampler gets the settings as they
    /// are.
    #[test]
    fn sampling_settings_greedy_unless_a_temperature_above_zero() {
        let greedy = SamplingConfig::greedy(4, Some(2), 0, 50);
        assert_eq!(greedy.sampling_params(), None);
        for temperature in [Some(0.0), Some(-1.0)] {
            assert_eq!(SamplingConfig { temperature, ..greedy.clone() }.sampling_params(), None, "{temperature:?}");
        }
        let sampled = SamplingConfig { temperature: Some(0.7), top_k: Some(5), top_p: Some(0.9), ..greedy };
        let want = ops::SamplingParams { vocab_limit: 50, temperature: 0.7, top_k: Some(5), top_p: Some(0.9) };
        assert_eq!(sampled.sampling_params(), Some(want));
    }

    /// Key 0 is the seed's own stream; other keys and seeds are other streams.
    #[test]
    fn a_rows_stream_is_its_seeds_stream_of_its_key() {
        let draws = |mut rng: ChaCha8Rng| (0..4).map(|_| rng.random::<u64>()).collect::<Vec<_>>();
        assert_eq!(draws(row_rng(7, 0)), draws(ChaCha8Rng::seed_from_u64(7)));
        assert_ne!(draws(row_rng(7, 1)), draws(row_rng(7, 0)));
        assert_ne!(draws(row_rng(8, 1)), draws(row_rng(7, 1)));
    }
}
