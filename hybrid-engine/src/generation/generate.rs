//! Batched generation with the KV cache: greedy, temperature, top-k and top-p sampling (applied
//! in transformers' order), left-padded prompts, stop at EOS.
//!
//! Left padding follows transformers' `generate`: pad tokens are masked out of attention and
//! position ids count real tokens only (`cumsum(mask) - 1`), so a padded row produces the same
//! tokens as the same prompt alone. Sampling draws each row's random numbers from its own stream,
//! named by the row's key ([`LeftPadded::with_keys`]), so a row's answer does not depend on which
//! rows share its batch: a rollout cut across data-parallel ranks samples what one rank would.

use crate::kernels::ops;
use crate::model::gpt2::{Gpt2, Gpt2Cache};
use crate::model::positions::Positions;
use anyhow::{bail, Result};
use candle_core::{DType, Device, Tensor, D};
use rand::Rng;
use rand_chacha::ChaCha8Rng;

pub use crate::generation::batch::{position_ids, row_rng, Generation, LeftPadded, SamplingConfig};

/// Picks the next token from one row of logits: greedy, or [`ops::sample_with_draw`] with the
/// stream's next uniform draw.
pub fn sample_token(logits: &[f32], cfg: &SamplingConfig, rng: &mut ChaCha8Rng) -> u32 {
    match cfg.sampling_params() {
        None => crate::kernels::rowops::argmax(&logits[..cfg.vocab_limit.min(logits.len())]) as u32,
        Some(params) => ops::sample_with_draw(logits, &params, rng.random::<f64>()),
    }
}

/// Generates up to `cfg.max_new_tokens` tokens after each prompt. Returns the new tokens of
/// each row, ending at (and including) EOS when one was produced.
pub fn generate(model: &Gpt2, prompts: &[Vec<u32>], cfg: &SamplingConfig, device: &Device) -> Result<Vec<Vec<u32>>> {
    if prompts.is_empty() {
        return Ok(vec![]);
    }
    if prompts.iter().any(|p| p.is_empty()) {
        bail!("cannot generate from an empty prompt");
    }
    let p = prompts.iter().map(Vec::len).max().unwrap_or(0);
    let batch = LeftPadded::new(prompts, p, cfg.pad_token_id);
    Ok(generate_left_padded(model, &batch, cfg, device)?.tokens)
}

/// [`generate`] on prompts already left-padded to one length (PPO pads to exactly
/// `max_prompt_seq_len`, so every answer starts at the same position). The KV cache is
/// allocated once for the prompt and the longest answer.
pub fn generate_left_padded(
    model: &Gpt2,
    batch: &LeftPadded,
    cfg: &SamplingConfig,
    device: &Device,
) -> Result<Generation> {
    let capacity = batch.p.saturating_add(cfg.max_new_tokens).min(model.cfg.max_positions());
    generate_with_cache(model, batch, cfg, &mut Gpt2Cache::new(&model.cfg, capacity), device)
}

/// [`generate_left_padded`] into a KV cache the caller keeps (the hybrid engine reuses one
/// across rollouts); it is reset first and must hold the prompt and the answers.
pub fn generate_with_cache(
    model: &Gpt2,
    batch: &LeftPadded,
    cfg: &SamplingConfig,
    cache: &mut Gpt2Cache,
    device: &Device,
) -> Result<Generation> {
    generate_observed(model, batch, cfg, cache, device, &mut || {})
}

/// [`generate_with_cache`], calling `on_token` after each decoding step (a progress bar's count).
pub fn generate_observed(
    model: &Gpt2,
    batch: &LeftPadded,
    cfg: &SamplingConfig,
    cache: &mut Gpt2Cache,
    device: &Device,
    on_token: &mut dyn FnMut(),
) -> Result<Generation> {
    let (b, p) = (batch.b, batch.p);
    if b == 0 {
        return Ok(Generation { tokens: vec![], logprobs: vec![] });
    }
    let n_pos = model.cfg.max_positions();
    if p >= n_pos {
        bail!("prompt of {p} tokens leaves no room to generate: the model's context is {n_pos} tokens");
    }
    let max_new = cfg.max_new_tokens.min(n_pos - p);
    if cache.capacity() < p + max_new {
        bail!("the KV cache holds {} positions but this rollout needs {}", cache.capacity(), p + max_new);
    }
    if crate::generation::decode_graph::enabled() {
        if let Some(generation) = crate::generation::decode_graph::generate(model, batch, cfg, cache, device, on_token)?
        {
            return Ok(generation);
        }
        static SAID: std::sync::Once = std::sync::Once::new();
        SAID.call_once(|| {
            println!(
                "note: HYBRID_ENGINE_DECODE_GRAPH=1 has no effect on this generation (the graph needs a GPU, the fused decoding blocks: no tensor parallelism or unfused LoRA, and room for the answers in the context)"
            )
        });
    }
    let mut rngs: Vec<ChaCha8Rng> = batch.keys.iter().map(|&k| row_rng(cfg.seed, k)).collect();

    let mut mask: Vec<Vec<u32>> = batch.mask.chunks(p).map(<[u32]>::to_vec).collect();
    let mut next_pos: Vec<u32> = mask.iter().map(|m| m.iter().sum()).collect();
    cache.reset();
    let mut input = Tensor::from_slice(&batch.ids, (b, p), device)?;
    let mut pos_t = Tensor::from_vec(batch.position_ids(), (b, p), device)?;
    let mut out: Vec<Vec<u32>> = vec![Vec::new(); b];
    let mut logprobs: Vec<Vec<f32>> = vec![Vec::new(); b];
    let mut done = vec![false; b];
    for _ in 0..max_new {
        let mask_t = Tensor::new(mask.clone(), &Device::Cpu)?; // (B, S), read on the host
        let positions = Positions { position_ids: Some(&pos_t), attention_mask: Some(&mask_t) };
        let hidden = model.forward_blocks(&input, &positions, Some(&mut *cache), None)?; // (B, T, C)

        // The LM head on the last position only (the prompt's other positions need no logits).
        let last = hidden.narrow(1, hidden.dim(1)? - 1, 1)?.squeeze(1)?; // (B, C)
        let picks = next_tokens(&model.lm_head(&last)?, cfg, &done, &mut rngs)?;
        let mut step = Vec::with_capacity(b);
        for (r, (tok, logprob)) in picks.into_iter().enumerate() {
            let tok = if done[r] { cfg.pad_token_id } else { tok };
            if !done[r] {
                out[r].push(tok);
                logprobs[r].push(logprob);
                done[r] = cfg.eos_token_id == Some(tok);
            }
            step.push(tok);
        }
        on_token();
        if done.iter().all(|d| *d) {
            break;
        }
        for m in mask.iter_mut() {
            m.push(1);
        }
        input = Tensor::from_vec(step, (b, 1), device)?;
        pos_t = Tensor::from_vec(next_pos.clone(), (b, 1), device)?;
        next_pos.iter_mut().for_each(|x| *x += 1);
    }
    Ok(Generation { tokens: out, logprobs })
}

/// Each row's next token and its log-probability `log softmax(logits)[token]` (the exponentials
/// summed in f64) from the last position's logits (B, V), picked on the logits' device: greedy
/// ([`ops::greedy_pick()`]) or sampled ([`ops::sample_pick()`]) with one uniform draw from the stream
/// of each row not `done` (a finished row's entry is unused and its stream not advanced), so the
/// GPU samples the CPU's tokens and only two numbers a row come to the host.
fn next_tokens(
    logits: &Tensor,
    cfg: &SamplingConfig,
    done: &[bool],
    rngs: &mut [ChaCha8Rng],
) -> Result<Vec<(u32, f32)>> {
    let (tokens, logprobs) = match cfg.sampling_params() {
        None => ops::greedy_pick(logits, cfg.vocab_limit)?,
        Some(params) => {
            let draws: Vec<f64> =
                done.iter().zip(rngs).map(|(&done, rng)| if done { 0.0 } else { rng.random::<f64>() }).collect();
            ops::sample_pick(logits, &draws, &params)?
        }
    };
    Ok(tokens.into_iter().zip(logprobs).collect())
}

/// Log-probabilities of `ids[t+1]` under `logits[t]`: (B, T, V), (B, T) -> (B, T-1) f32,
/// computed in the logits' dtype. DS-Chat `gather_log_probs`.
pub fn gather_log_probs(logits: &Tensor, ids: &Tensor) -> Result<Tensor> {
    let t = ids.dim(1)?;
    let logp = crate::kernels::ops::log_softmax_last_dim(&logits.narrow(1, 0, t - 1)?)?;
    let next = ids.narrow(1, 1, t - 1)?.unsqueeze(D::Minus1)?;
    Ok(logp.gather(&next.contiguous()?, D::Minus1)?.squeeze(D::Minus1)?.to_dtype(DType::F32)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    fn cfg(temp: f64, k: Option<usize>, p: Option<f64>) -> SamplingConfig {
        SamplingConfig {
            max_new_tokens: 1,
            temperature: Some(temp),
            top_k: k,
            top_p: p,
            eos_token_id: None,
            pad_token_id: 0,
            vocab_limit: 4,
            seed: 0,
        }
    }

    /// A random GPT-2 of `n_layer` blocks of C 16 in 2 heads, 64 ids and `n_positions`.
    fn small_random_model(n_layer: usize, n_positions: usize) -> Result<Gpt2> {
        let base = crate::Gpt2Config::tiny();
        let cfg = crate::Gpt2Config { n_layer, n_embd: 16, n_head: 2, n_positions, vocab_size: 64, ..base };
        crate::ParamStore::init(&cfg, 5, &Device::Cpu)?.model(&cfg)
    }

    /// The decoding kernels (`decode.rs`: linears of up to 8 rows, the LM head's tiles and its
    /// transposed gemm, attention over the cache in place) against the composed candle ops on a
    /// random tiny GPT-2, for left-padded batches of 1, 3 and 12 rows: the same greedy tokens and
    /// log-probs. (Sampling at temperature 1 from a random model's nearly flat distribution is
    /// not compared: a 1e-7 change of a probability can move the sampled token.)
    #[test]
    fn generation_with_the_decode_kernels_matches_the_reference_ops() -> Result<()> {
        let dev = Device::Cpu;
        let cfg = crate::Gpt2Config::tiny();
        let params = crate::ParamStore::init(&cfg, 7, &dev)?;
        let model = params.model(&cfg)?;
        let mut rng = ChaCha8Rng::seed_from_u64(3);
        for rows in [1usize, 3, 12] {
            let prompts: Vec<Vec<u32>> =
                (0..rows).map(|r| (0..3 + r % 5).map(|_| rng.random_range(0..50257)).collect()).collect();
            let p = prompts.iter().map(Vec::len).max().unwrap_or(0);
            let batch = LeftPadded::new(&prompts, p, 0);
            let sampling = SamplingConfig::greedy(10, None, 0, 50257);
            let fast = generate_left_padded(&model, &batch, &sampling, &dev)?;
            let reference =
                crate::kernels::ops::with_reference_ops(|| generate_left_padded(&model, &batch, &sampling, &dev))?;
            assert_eq!(fast.tokens, reference.tokens, "{rows} rows");
            for (a, b) in fast.logprobs.iter().flatten().zip(reference.logprobs.iter().flatten()) {
                assert!((a - b).abs() < 1e-4, "{rows} rows: log-prob {a} vs {b}");
            }
        }
        Ok(())
    }

    /// `generate` left-pads prompts of any lengths itself: each row's greedy answer is, token by
    /// token, the argmax of a full forward without cache over its prompt and answer so far, and it
    /// ends at (and with) EOS. An empty batch gives nothing; an empty prompt, a prompt that fills
    /// the context, and a cache too small for the rollout are refused; answers stop at the
    /// context's end.
    #[test]
    fn generate_pads_and_decodes_what_full_forwards_pick() -> Result<()> {
        use candle_core::IndexOp;
        let dev = Device::Cpu;
        let model = small_random_model(2, 12)?;
        let cfg = model.cfg.clone();
        let sampling = SamplingConfig::greedy(5, None, 0, 64);
        let prompts = [vec![3, 4, 5], vec![9], vec![7, 8, 1, 2]];
        let answers = generate(&model, &prompts, &sampling, &dev)?;
        for (prompt, answer) in prompts.iter().zip(&answers) {
            assert_eq!(answer.len(), 5);
            let mut ids = prompt.clone();
            for &token in answer {
                let x = Tensor::new(ids.as_slice(), &dev)?.unsqueeze(0)?;
                let logits = model.forward(&x, &Positions::default(), None, None)?.i((0, ids.len() - 1))?;
                assert_eq!(token as usize, crate::kernels::rowops::argmax(&logits.to_vec1::<f32>()?), "{ids:?}");
                ids.push(token);
            }
        }
        let eos = answers[0][1];
        let stopped =
            generate(&model, &prompts, &SamplingConfig { eos_token_id: Some(eos), ..sampling.clone() }, &dev)?;
        for (answer, stopped) in answers.iter().zip(&stopped) {
            let end = answer.iter().position(|&t| t == eos).map_or(answer.len(), |i| i + 1);
            assert_eq!(stopped, &answer[..end]);
        }
        assert!(stopped[0].len() <= 2, "EOS, its second token, ends row 0");
        assert!(generate(&model, &[], &sampling, &dev)?.is_empty());
        let refused = generate(&model, &[vec![1], vec![]], &sampling, &dev).unwrap_err().to_string();
        assert_eq!(refused, "cannot generate from an empty prompt");
        let full = generate(&model, &[vec![1; 12]], &sampling, &dev).unwrap_err().to_string();
        assert!(full.contains("prompt of 12 tokens leaves no room"), "{full}");
        assert_eq!(generate(&model, &[vec![3; 9]], &sampling, &dev)?[0].len(), 3, "the context ends at 12");
        let batch = LeftPadded::new(&prompts, 4, 0);
        let small = generate_with_cache(&model, &batch, &sampling, &mut Gpt2Cache::new(&cfg, 8), &dev);
        assert_eq!(small.unwrap_err().to_string(), "the KV cache holds 8 positions but this rollout needs 9");
        let fits = generate_with_cache(&model, &batch, &sampling, &mut Gpt2Cache::new(&cfg, 9), &dev)?;
        assert_eq!(fits.tokens, answers);
        Ok(())
    }

    /// A sampled row depends on its prompt and its key only: generated among other rows, alone or
    /// in another order, it is the same answer; the same prompt under another key is another.
    #[test]
    fn a_sampled_row_depends_on_its_key_not_on_its_batch_mates() -> Result<()> {
        let dev = Device::Cpu;
        let model = small_random_model(1, 32)?;
        let sampling = SamplingConfig { temperature: Some(1.0), seed: 11, ..SamplingConfig::greedy(8, None, 0, 64) };
        let prompts = [vec![3, 4, 5], vec![9], vec![7, 8], vec![1, 2, 3, 4]];
        let all = generate_left_padded(&model, &LeftPadded::new(&prompts, 6, 0), &sampling, &dev)?;
        let some = LeftPadded::new(&[prompts[2].clone(), prompts[0].clone()], 6, 0).with_keys(vec![2, 0]);
        let some = generate_left_padded(&model, &some, &sampling, &dev)?;
        assert_eq!(some.tokens, vec![all.tokens[2].clone(), all.tokens[0].clone()]);
        let rekeyed = LeftPadded::new(&[prompts[2].clone()], 6, 0).with_keys(vec![3]);
        let rekeyed = generate_left_padded(&model, &rekeyed, &sampling, &dev)?;
        assert_ne!(rekeyed.tokens[0], all.tokens[2], "another key samples another answer");
        Ok(())
    }

    /// A rounding-size change of nearly flat logits (what another batch shape or summation order
    /// gives) leaves the sampled tokens alone, with and without top-k: the draw walks the
    /// candidates in vocabulary order, where such a change moves no boundary beyond rounding.
    #[test]
    fn sampling_is_stable_under_rounding_changes_of_flat_logits() {
        let mut noise = ChaCha8Rng::seed_from_u64(9);
        let logits: Vec<f32> = (0..50257).map(|_| noise.random_range(-0.1f32..0.1)).collect();
        let nudged: Vec<f32> = logits.iter().map(|&x| x * (1.0 + noise.random_range(-1e-6f32..1e-6))).collect();
        for top_k in [None, Some(1000)] {
            let cfg = SamplingConfig { top_k, ..cfg(1.0, None, None) };
            let cfg = SamplingConfig { vocab_limit: 50257, ..cfg };
            let (mut a, mut b) = (row_rng(4, 0), row_rng(4, 0));
            let same = (0..300).filter(|_| sample_token(&logits, &cfg, &mut a) == sample_token(&nudged, &cfg, &mut b));
            assert_eq!(same.count(), 300, "top-k {top_k:?}");
        }
    }

    /// Each position's logits score the next id, by hand: log-softmax of (0, ln 3, 0) is
    /// (ln 1/5, ln 3/5, ln 1/5), of (ln 2, 0, ln 2) is (ln 2/5, ln 1/5, ln 2/5); the last
    /// position scores nothing.
    #[test]
    fn gather_log_probs_by_hand() -> Result<()> {
        let (l2, l3) = (2f32.ln(), 3f32.ln());
        let row = [[0.0, l3, 0.0], [l2, 0.0, l2], [9.0, 9.0, 9.0]];
        let logits = Tensor::new(&[row, row], &Device::Cpu)?;
        let ids = Tensor::new(&[[0u32, 1, 2], [2, 0, 1]], &Device::Cpu)?;
        let got = gather_log_probs(&logits, &ids)?.to_vec2::<f32>()?;
        let want = [[0.6f32.ln(), 0.4f32.ln()], [0.2f32.ln(), 0.2f32.ln()]];
        for (got, want) in got.iter().flatten().zip(want.iter().flatten()) {
            assert!((got - want).abs() < 1e-6, "{got} vs {want}");
        }
        assert_eq!(got[0].len(), 2);
        Ok(())
    }

    #[test]
    fn greedy_ignores_padded_vocabulary_rows() {
        let mut rng = ChaCha8Rng::seed_from_u64(0);
        let c = SamplingConfig::greedy(1, None, 0, 3);
        assert_eq!(sample_token(&[0.0, 2.0, 1.0, 9.0], &c, &mut rng), 1, "id 3 is padding");
    }

    #[test]
    fn top_k_one_and_tiny_top_p_are_greedy() {
        let mut rng = ChaCha8Rng::seed_from_u64(0);
        let logits = [0.5, 2.0, 1.9, -1.0];
        for _ in 0..50 {
            assert_eq!(sample_token(&logits, &cfg(1.0, Some(1), None), &mut rng), 1);
            assert_eq!(sample_token(&logits, &cfg(1.0, None, Some(0.01)), &mut rng), 1);
        }
    }

    #[test]
    fn top_k_two_samples_only_the_two_best_in_proportion() {
        let mut rng = ChaCha8Rng::seed_from_u64(0);
        let logits = [-5.0, (2f32).ln(), -5.0, 0.0]; // best two: id 1 (p 2/3), id 3 (1/3)
        let mut counts = [0usize; 4];
        for _ in 0..6000 {
            counts[sample_token(&logits, &cfg(1.0, Some(2), None), &mut rng) as usize] += 1;
        }
        assert_eq!(counts[0] + counts[2], 0);
        let share = counts[1] as f64 / 6000.0;
        assert!((share - 2.0 / 3.0).abs() < 0.03, "share {share}");
    }

    #[test]
    fn top_p_keeps_the_smallest_prefix_reaching_p() {
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        // probabilities 0.5, 0.3, 0.2, ~0: top_p 0.7 keeps {0, 1}, renormalised to 5/8, 3/8.
        let logits = [0.5f32.ln(), 0.3f32.ln(), 0.2f32.ln(), -30.0];
        let mut counts = [0usize; 4];
        for _ in 0..8000 {
            counts[sample_token(&logits, &cfg(1.0, None, Some(0.7)), &mut rng) as usize] += 1;
        }
        assert_eq!(counts[2] + counts[3], 0, "{counts:?}");
        assert!((counts[0] as f64 / 8000.0 - 0.625).abs() < 0.03, "{counts:?}");
    }

    /// The top-k / top-p candidates as a stable sort of the whole vocabulary finds them (what
    /// `sample_token` did before it selected): descending logits, ties in vocabulary order.
    fn candidates_by_sorting(logits: &[f32], top_k: Option<usize>, top_p: Option<f64>) -> Vec<usize> {
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
        let weight = |i: usize| (logits[i] as f64 - max).exp();
        let mut c: Vec<usize> = (0..logits.len()).collect();
        c.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
        if let Some(k) = top_k {
            c.truncate(k);
        }
        if let Some(p) = top_p {
            let total: f64 = c.iter().map(|&i| weight(i)).sum();
            let mut cum = 0.0;
            let n = c
                .iter()
                .take_while(|&&i| {
                    let before = cum;
                    cum += weight(i) / total;
                    before < p
                })
                .count()
                .max(1);
            c.truncate(n);
        }
        c.sort_unstable();
        c
    }

    #[test]
    fn selecting_the_top_k_draws_what_sorting_the_vocabulary_drew() {
        // Logits on a coarse grid: many ties, which the order must break by vocabulary index.
        let mut rng = ChaCha8Rng::seed_from_u64(3);
        let logits: Vec<f32> = (0..2000).map(|_| (rng.random::<f32>() * 40.0).round() / 8.0).collect();
        for (top_k, top_p) in [
            (Some(1), None),
            (Some(2), None),
            (Some(7), None),
            (Some(300), None),
            (Some(50), Some(0.8)),
            (None, Some(0.5)),
        ] {
            let c = SamplingConfig { top_k, top_p, vocab_limit: logits.len(), ..cfg(1.0, None, None) };
            let want = candidates_by_sorting(&logits, top_k, top_p);
            let weights: Vec<f64> = want.iter().map(|&i| (logits[i] as f64 - 5.0).exp()).collect();
            let (mut a, mut b) = (row_rng(9, 0), row_rng(9, 0));
            for _ in 0..200 {
                let got = sample_token(&logits, &c, &mut a);
                // The reference draw: the same uniform over the same candidates' weights.
                let mut u: f64 = b.random::<f64>() * weights.iter().sum::<f64>();
                let mut pick = *want.last().unwrap();
                for (&i, w) in want.iter().zip(&weights) {
                    if u < *w {
                        pick = i;
                        break;
                    }
                    u -= w;
                }
                assert_eq!(got as usize, pick, "top-k {top_k:?} top-p {top_p:?}");
            }
        }
    }
}
