//! How good a policy is on held-out prompts: its greedy answers, their mean reward-model score,
//! and, on the demo task, the rule-based task score (`data::demo::score_answer`). This is how the
//! pipeline shows that PPO improved on the SFT actor.

use crate::experience::ForwardInputs;
use anyhow::Result;
use candle_core::Device;
use data::Tokenizer;
use hybrid_engine::generation::generate::{generate_left_padded, LeftPadded, SamplingConfig};
use hybrid_engine::model::gpt2::Gpt2;
use hybrid_engine::model::reward_model::RewardModel;
use serde::Serialize;

/// A policy's greedy answers to held-out prompts, scored.
#[derive(Clone, Debug, Serialize)]
pub struct PolicyEval {
    pub prompts: usize,
    /// Mean reward-model score of the answers.
    pub reward_mean: f64,
    /// Share of answers the demo scorer accepts (None when no prompt is a demo prompt).
    pub task_success: Option<f64>,
    pub answers: Vec<String>,
}

/// Greedy answers (up to `max_answer` tokens) to `prompts`, left-padded to `max_prompt`, scored
/// by `reward` and, where the prompt is a demo prompt, by the demo scorer.
#[allow(clippy::too_many_arguments)]
pub fn evaluate_policy(
    actor: &Gpt2,
    reward: &RewardModel,
    tok: &Tokenizer,
    prompts: &[String],
    max_prompt: usize,
    max_answer: usize,
    batch_size: usize,
    device: &Device,
) -> Result<PolicyEval> {
    let eos = tok.eos_id();
    let sampling = SamplingConfig::greedy(max_answer, Some(eos), eos, tok.vocab_size().min(actor.cfg.vocab_size));
    let (mut scores, mut answers) = (Vec::new(), Vec::new());
    for chunk in prompts.chunks(batch_size) {
        let ids: Vec<Vec<u32>> = chunk.iter().map(|p| tok.encode(p)).collect::<Result<_>>()?;
        let ids: Vec<Vec<u32>> = ids
            .into_iter()
            .map(|mut v| {
                // Keep the end of an over-long prompt: the question is there.
                if v.len() > max_prompt {
                    v.drain(..v.len() - max_prompt);
                }
                v
            })
            .collect();
        let padded = LeftPadded::new(&ids, max_prompt, eos);
        let generation = generate_left_padded(actor, &padded, &sampling, device)?;
        let longest = generation.tokens.iter().map(Vec::len).max().unwrap_or(0).max(1);
        let l = max_prompt + longest;
        let (mut seq, mut mask) = (Vec::new(), Vec::new());
        for (r, answer) in generation.tokens.iter().enumerate() {
            seq.extend_from_slice(&padded.ids[r * max_prompt..(r + 1) * max_prompt]);
            seq.extend(answer.iter().copied().chain(std::iter::repeat_n(eos, longest - answer.len())));
            mask.extend_from_slice(&padded.mask[r * max_prompt..(r + 1) * max_prompt]);
            mask.extend(
                answer.iter().map(|&t| u32::from(t != eos)).chain(std::iter::repeat_n(0, longest - answer.len())),
            );
        }
        let inputs = ForwardInputs::new(&seq, &mask, chunk.len(), l, device)?;
        scores.extend(inputs.end_scores(reward, &seq, max_prompt, eos)?);
        for answer in &generation.tokens {
            answers.push(tok.decode(answer.strip_suffix(&[eos]).unwrap_or(answer))?);
        }
    }
    let pairs: Vec<(String, String)> = prompts.iter().cloned().zip(answers.iter().cloned()).collect();
    let known = pairs.iter().filter(|(p, a)| data::demo::score_answer(p, a).is_some()).count();
    Ok(PolicyEval {
        prompts: prompts.len(),
        reward_mean: scores.iter().map(|&s| f64::from(s)).sum::<f64>() / scores.len().max(1) as f64,
        task_success: (known > 0).then(|| data::demo::task_success_rate(&pairs)),
        answers,
    })
}
