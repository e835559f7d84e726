//! How good a policy is on held-out prompts: its greedy answers, their mean reward-model score
//! and length, on an embedded task (the demo's capitals, arithmetic) the rule-based task score (`data::tasks`), and how
//! far it moved from the SFT model: its KL to the reference, estimated on sampled answers. This
//! is how the pipeline shows that RLHF improved on the SFT actor, and at what distance.

use crate::experience::ForwardInputs;
use anyhow::Result;
use candle_core::Device;
use data::Tokenizer;
use hybrid_engine::generation::generate::{generate_left_padded, LeftPadded, SamplingConfig};
use hybrid_engine::model::gpt2::Gpt2;
use hybrid_engine::training::train_step::TrainedModel;
use serde::Serialize;

/// A policy's greedy answers to held-out prompts, scored.
#[derive(Clone, Debug, Serialize)]
pub struct PolicyEval {
    /// The prompts `reward_mean` and `task_success` are over: all but the demo's held-out
    /// countries' (on the demo, its held-out phrasings of the countries steps 2 and 3 train on).
    pub prompts: usize,
    /// Mean reward-model score of the answers (none without a reward model: DPO).
    pub reward_mean: Option<f64>,
    /// Share of answers their task's scorer accepts (None when no prompt belongs to a task).
    pub task_success: Option<f64>,
    /// The prompts about the demo's held-out countries (`data::demo::heldout_countries`: no row
    /// of steps 2 and 3 asks about them), scored apart.
    pub heldout_country_prompts: usize,
    /// Share of those answers the demo's scorer accepts (None without such prompts).
    pub heldout_country_task_success: Option<f64>,
    /// Mean tokens of the greedy answers to every prompt (EOS included).
    pub answer_len_mean: f64,
    /// KL(policy || reference) per answer, in nats: the mean over [`KL_SAMPLES`] answers
    /// sampled per prompt (temperature 1) of their summed `log pi - log pi_ref`, an unbiased
    /// estimate of the sequence-level KL.
    pub kl_to_reference: f64,
    /// The prompts, in order; `answers` are the greedy answers to them.
    pub prompt_texts: Vec<String>,
    pub answers: Vec<String>,
}

/// Answers sampled per prompt for the KL estimate.
pub const KL_SAMPLES: usize = 4;

/// The `actor`'s (called `name` in its progress line) greedy answers (up to `max_answer` tokens)
/// to `prompts`, left-padded to `max_prompt`, scored by `reward` (when given) and, where the
/// prompt is a demo prompt, by the demo scorer; and the KL of the actor to `reference` on sampled
/// answers.
#[allow(clippy::too_many_arguments)]
pub fn evaluate_policy(
    (name, actor): (&str, &Gpt2),
    reference: &Gpt2,
    reward: Option<&TrainedModel>,
    tok: &Tokenizer,
    prompts: &[String],
    max_prompt: usize,
    max_answer: usize,
    batch_size: usize,
    device: &Device,
) -> Result<PolicyEval> {
    let eos = tok.eos_id();
    let sampling = SamplingConfig::greedy(max_answer, Some(eos), eos, tok.vocab_size().min(actor.cfg.vocab_size));
    let (mut scores, mut answers, mut lengths) = (Vec::new(), Vec::new(), Vec::new());
    let (mut kl_sum, mut kl_answers) = (0f64, 0usize);
    let label = format!("answering the held-out prompts ({name})");
    let mut progress = hybrid_engine::telemetry::progress::Phase::start(&label, "prompts", prompts.len() as u64);
    for (c, chunk) in prompts.chunks(batch_size).enumerate() {
        let _done = progress.done_after(chunk.len() as u64);
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
        lengths.extend(generation.tokens.iter().map(Vec::len));
        // The KL: each prompt's sampled answers, keyed by their position among all prompts.
        let repeated: Vec<Vec<u32>> = ids.iter().flat_map(|v| std::iter::repeat_n(v.clone(), KL_SAMPLES)).collect();
        let first = (c * batch_size * KL_SAMPLES) as u64;
        let keys = (first..first + repeated.len() as u64).collect();
        let sampled = LeftPadded::new(&repeated, max_prompt, eos).with_keys(keys);
        let temperature = SamplingConfig { temperature: Some(1.0), seed: 0x6b1, ..sampling.clone() };
        let samples = generate_left_padded(actor, &sampled, &temperature, device)?;
        for (r, answer) in samples.tokens.iter().enumerate() {
            let prompt = &sampled.ids[r * max_prompt..(r + 1) * max_prompt];
            let mask = &sampled.mask[r * max_prompt..(r + 1) * max_prompt];
            kl_sum += sequence_log_ratio(actor, reference, prompt, mask, answer, device)?;
            kl_answers += 1;
        }
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
        if let Some(reward) = reward {
            let inputs = ForwardInputs::new(&seq, &mask, chunk.len(), l, device)?;
            scores.extend(inputs.end_scores(reward, &seq, max_prompt, eos)?);
        }
        for answer in &generation.tokens {
            answers.push(tok.decode(answer.strip_suffix(&[eos]).unwrap_or(answer))?);
        }
    }
    let (trained, new) = scores_by_prompt_set(prompts, &answers, &scores);
    Ok(PolicyEval {
        prompts: trained.prompts,
        reward_mean: reward.and(trained.reward_mean),
        task_success: trained.task_success,
        heldout_country_prompts: new.prompts,
        heldout_country_task_success: new.task_success,
        answer_len_mean: lengths.iter().sum::<usize>() as f64 / lengths.len().max(1) as f64,
        kl_to_reference: kl_sum / kl_answers.max(1) as f64,
        prompt_texts: prompts.to_vec(),
        answers,
    })
}

/// One prompt set's count, mean reward-model score and task score.
#[derive(Clone, Debug, PartialEq)]
struct SetScores {
    prompts: usize,
    reward_mean: Option<f64>,
    task_success: Option<f64>,
}

/// The scores of the prompts about the countries steps 2 and 3 train on (and of any prompt of
/// no held-out country), then those of the demo's held-out countries; `rewards` as many as
/// `prompts`, or none.
fn scores_by_prompt_set(prompts: &[String], answers: &[String], rewards: &[f32]) -> (SetScores, SetScores) {
    let set = |heldout_country: bool| {
        let chosen: Vec<usize> = (0..prompts.len())
            .filter(|&i| data::demo::asks_about_heldout_country(&prompts[i]) == heldout_country)
            .collect();
        let pairs: Vec<(String, String)> = chosen.iter().map(|&i| (prompts[i].clone(), answers[i].clone())).collect();
        let reward_sum: f64 = chosen.iter().filter_map(|&i| rewards.get(i)).map(|&r| f64::from(r)).sum();
        SetScores {
            prompts: chosen.len(),
            reward_mean: (!rewards.is_empty() && !chosen.is_empty()).then(|| reward_sum / chosen.len() as f64),
            task_success: data::tasks::task_score(&pairs),
        }
    };
    (set(false), set(true))
}

/// A score as the held-out lines print it: three decimals, or `n/a` where there is none.
pub fn score_text(score: Option<f64>) -> String {
    score.map_or("n/a".to_string(), |s| format!("{s:.3}"))
}

/// How the task score on the demo's held-out countries moved, as the held-out lines end:
/// `; held-out countries (64): task score SFT 0.812 -> PPO 0.844`; empty without such prompts.
pub fn heldout_countries_clause(prompts: usize, before: Option<f64>, after: Option<f64>, name: &str) -> String {
    if prompts == 0 {
        return String::new();
    }
    format!("; held-out countries ({prompts}): task score SFT {} -> {name} {}", score_text(before), score_text(after))
}

/// `log pi(answer) - log pi_ref(answer)` after one left-padded `prompt` (with its `mask`).
fn sequence_log_ratio(
    actor: &Gpt2,
    reference: &Gpt2,
    prompt: &[u32],
    mask: &[u32],
    answer: &[u32],
    device: &Device,
) -> Result<f64> {
    if answer.is_empty() {
        return Ok(0.0);
    }
    let seq: Vec<u32> = prompt.iter().chain(answer).copied().collect();
    let full_mask: Vec<u32> = mask.iter().copied().chain(std::iter::repeat_n(1, answer.len())).collect();
    let inputs = ForwardInputs::new(&seq, &full_mask, 1, seq.len(), device)?;
    let (policy, reference) = (inputs.logprobs(actor)?, inputs.logprobs(reference)?);
    // Action t emits token t + 1: the answer's tokens are emitted by actions P - 1 onwards.
    let start = prompt.len() - 1;
    Ok(policy[start..].iter().zip(&reference[start..]).map(|(a, b)| f64::from(a - b)).sum())
}

/// How exploitable a reward model is on the demo task: for each held-out prompt and each answer
/// template, every city of the table put in the template and scored. A reward model that knows
/// the task scores the capital first; PPO finds every wrong city it scores higher.
#[derive(Clone, Debug, Serialize)]
pub struct RewardProbe {
    /// (held-out prompt, answer template) combinations probed.
    pub probes: usize,
    /// Share of them whose capital answer scores above every wrong city's.
    pub capital_first: f64,
    /// Mean number of wrong cities scored above the capital (of the table's others).
    pub wrong_above_capital: f64,
    /// Share of the held-out prompts whose best-scored answer names the capital, of every city
    /// in every template and every true answer about another country ("The capital of Kenya is
    /// Nairobi."): the answer a policy that maximises this reward model ends up giving. A reward
    /// model may rank the cities right within each template and still prefer a template in
    /// which it judges the city worse, or an off-topic answer.
    pub best_answer_correct: f64,
    pub cities: usize,
}

/// [`RewardProbe`] of `reward` on the demo's held-out phrasings of the countries it trained on.
pub fn probe_demo_reward_model(
    reward: &TrainedModel,
    tok: &Tokenizer,
    max_prompt: usize,
    device: &Device,
) -> Result<RewardProbe> {
    use data::demo::{
        asks_about_heldout_country, heldout_prompts, off_topic_answers, render_answer, score_answer, ANSWER_TEMPLATES,
        COUNTRIES,
    };
    let eos = tok.eos_id();
    let cities: Vec<&str> = COUNTRIES.iter().flat_map(|c| std::iter::once(c.capital).chain(c.mistake)).collect();
    let (mut probes, mut first, mut above) = (0usize, 0usize, 0usize);
    let (mut prompts, mut best_correct) = (0usize, 0usize);
    // The countries the reward model trained on: it never saw a pair about a held-out country.
    for held in heldout_prompts()?.into_iter().filter(|p| !asks_about_heldout_country(&p.prompt)) {
        let country = COUNTRIES.iter().find(|c| c.name == held.country).expect("held-out countries are in the table");
        let mut prompt = tok.encode(&held.prompt)?;
        if prompt.len() > max_prompt {
            prompt.drain(..prompt.len() - max_prompt);
        }
        let padded = LeftPadded::new(std::slice::from_ref(&prompt), max_prompt, eos);
        let score_answers = |texts: &[String]| -> Result<Vec<f32>> {
            let answers: Vec<Vec<u32>> = texts.iter().map(|t| tok.encode(t)).collect::<Result<_>>()?;
            let longest = answers.iter().map(Vec::len).max().unwrap_or(0) + 1;
            let (mut seq, mut mask) = (Vec::new(), Vec::new());
            for answer in &answers {
                seq.extend_from_slice(&padded.ids);
                seq.extend(answer.iter().copied().chain(std::iter::repeat_n(eos, longest - answer.len())));
                mask.extend_from_slice(&padded.mask);
                mask.extend(std::iter::repeat_n(1, answer.len()).chain(std::iter::repeat_n(0, longest - answer.len())));
            }
            let inputs = ForwardInputs::new(&seq, &mask, answers.len(), max_prompt + longest, device)?;
            inputs.end_scores(reward, &seq, max_prompt, eos)
        };
        // (score, names the capital) of the best answer so far.
        let mut best = (f32::NEG_INFINITY, false);
        let mut keep_best = |texts: &[String], scores: &[f32]| {
            for (text, &score) in texts.iter().zip(scores) {
                if score > best.0 {
                    best = (score, score_answer(&held.prompt, text).is_some_and(|s| s.correct));
                }
            }
        };
        let capital = cities.iter().position(|&c| c == country.capital).expect("the capital is a city");
        for template in 0..ANSWER_TEMPLATES.len() {
            let texts: Vec<String> = cities.iter().map(|city| render_answer(country, template, city)).collect();
            let scores = score_answers(&texts)?;
            let higher = scores.iter().enumerate().filter(|&(i, &s)| i != capital && s >= scores[capital]).count();
            probes += 1;
            first += usize::from(higher == 0);
            above += higher;
            keep_best(&texts, &scores);
        }
        let off_topic: Vec<String> = off_topic_answers(country.name).collect();
        keep_best(&off_topic, &score_answers(&off_topic)?);
        prompts += 1;
        best_correct += usize::from(best.1);
    }
    Ok(RewardProbe {
        probes,
        capital_first: first as f64 / probes.max(1) as f64,
        wrong_above_capital: above as f64 / probes.max(1) as f64,
        best_answer_correct: best_correct as f64 / prompts.max(1) as f64,
        cities: cities.len(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_held_out_countries_are_scored_apart_from_the_other_prompts() {
        let ask = |country: &str| format!("\n\nHuman: What is the capital of {country}?\n\nAssistant:");
        // France and Canada are trained on; Turkey and Ghana are held-out countries.
        let prompts = [ask("France"), ask("Turkey"), ask("Canada"), ask("Ghana"), ask("Turkey")];
        let answers = [" Paris.", " Istanbul.", " Toronto.", " It is Accra.", " Ankara."].map(String::from);
        let rewards = [1.0, 10.0, 3.0, 20.0, 30.0];
        let (trained, new) = scores_by_prompt_set(&prompts, &answers, &rewards);
        assert_eq!(trained, SetScores { prompts: 2, reward_mean: Some(2.0), task_success: Some(0.5) });
        assert_eq!(new, SetScores { prompts: 3, reward_mean: Some(20.0), task_success: Some(2.0 / 3.0) });
        // No reward model: no reward mean; no held-out country: nothing to score apart.
        let (trained, new) = scores_by_prompt_set(&prompts[..1], &answers[..1], &[]);
        assert_eq!(trained, SetScores { prompts: 1, reward_mean: None, task_success: Some(1.0) });
        assert_eq!(new, SetScores { prompts: 0, reward_mean: None, task_success: None });
        assert_eq!(heldout_countries_clause(new.prompts, None, None, "PPO"), "");
        assert_eq!(
            heldout_countries_clause(64, Some(0.5), Some(0.75), "GRPO"),
            "; held-out countries (64): task score SFT 0.500 -> GRPO 0.750"
        );
    }
}
