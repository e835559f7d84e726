//! A PPO rollout, DS-Chat `generate_experience`: the actor answers a batch of prompts in
//! generation mode, then, with no gradients, the actor and the frozen reference give the
//! log-probs of every action, the critic its values and the reward model its score; rewards,
//! advantages and returns follow from [`crate::ppo`].
//!
//! Shapes: B rows, P = `max_prompt_seq_len` (prompts are left-padded to exactly P, so the first
//! answer token is emitted by action `start = P - 1` in every row), L = P + the longest answer,
//! L - 1 actions.
//!
//! Across data-parallel ranks each rank generates its share of the rollout's prompts; every row
//! keeps its position in the whole rollout, which keys its sampling and places it in a global
//! micro-batch, so the ranks together hold the rows one rank would. A critic sharded at rest
//! (ZeRO stage 3) gathers its blocks as its forward runs, a collective: every rank runs it once
//! per rollout, a rank that kept no rows on a filler row.

use crate::ppo::{self, PpoConfig};
use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use hybrid_engine::generation::generate::{gather_log_probs, position_ids, Generation, LeftPadded, SamplingConfig};
use hybrid_engine::model::gpt2::Gpt2;
use hybrid_engine::model::positions::Positions;
use hybrid_engine::tensor_parallel::vocab::tempered;
use hybrid_engine::training::train_step::TrainedModel;
use std::ops::Range;

/// One rollout's record. Per-action arrays are (B, L - 1) row-major; `advantages` and
/// `returns` cover actions `start..` only: (B, L - 1 - start).
#[derive(Clone, Debug)]
pub struct Experience {
    /// (B, L): left-padded prompt, then the answer right-padded with pad.
    pub seq: Vec<u32>,
    /// (B, L): 1 on prompt tokens and non-pad answer tokens (DS-Chat: `seq != pad`).
    pub attention_mask: Vec<u32>,
    pub b: usize,
    pub l: usize,
    /// Action that emits the first answer token (P - 1).
    pub start: usize,
    /// Old policy log-probs of each action's token.
    pub logprobs: Vec<f32>,
    pub ref_logprobs: Vec<f32>,
    /// Critic values, zeroed from each row's end (the action after the one that emitted EOS):
    /// GAE's terminal value. With the EOS action in the mask every value GAE reads is one the
    /// critic trains; with `--mask-eos-action` GAE reads the EOS action's value, which the critic
    /// never trains (as in DS-Chat).
    pub values: Vec<f32>,
    pub rewards: Vec<f32>,
    /// The actions the losses read ([`ppo::action_mask`]): `seq[t + 1] != pad`, and the one
    /// that emitted EOS unless `--mask-eos-action`.
    pub action_mask: Vec<f32>,
    pub advantages: Vec<f32>,
    pub returns: Vec<f32>,
    /// Each answer's score (before clipping): the reward model's, plus `--reward-fn`'s rewards.
    pub scores: Vec<f32>,
    /// The score each row's reward is formed from: `scores`, or with `--normalize-reward`
    /// normalised by the running moments.
    pub reward_scores: Vec<f32>,
    /// Answer tokens per row (EOS included when produced) and whether it ended with EOS.
    pub answer_lens: Vec<usize>,
    pub ended_with_eos: Vec<bool>,
    /// Each row's position in the whole rollout (over all ranks), ascending.
    pub positions: Vec<usize>,
    /// Prompts in the whole rollout (over all ranks), dropped rows included.
    pub rollout_size: usize,
}

impl Experience {
    /// A rank's record of a rollout in which none of its rows was kept (the other ranks' were):
    /// it holds no rows but takes part in every global micro-batch.
    pub fn empty(p: usize, rollout_size: usize) -> Self {
        Self {
            seq: vec![],
            attention_mask: vec![],
            b: 0,
            l: p,
            start: p - 1,
            logprobs: vec![],
            ref_logprobs: vec![],
            values: vec![],
            rewards: vec![],
            action_mask: vec![],
            advantages: vec![],
            returns: vec![],
            scores: vec![],
            reward_scores: vec![],
            answer_lens: vec![],
            ended_with_eos: vec![],
            positions: vec![],
            rollout_size,
        }
    }

    /// Global micro-batches of `global_micro` rollout positions each: the same number on every
    /// rank, whatever rows were dropped.
    pub fn micro_batches(&self, global_micro: usize) -> usize {
        self.rollout_size.div_ceil(global_micro)
    }

    /// The rows of global micro-batch `k` (positions `k * global_micro..`) this rank holds.
    pub fn micro_batch_rows(&self, k: usize, global_micro: usize) -> Range<usize> {
        let first = self.positions.partition_point(|&p| p < k * global_micro);
        let end = self.positions.partition_point(|&p| p < (k + 1) * global_micro);
        first..end
    }

    /// Actions per row (L - 1).
    pub fn actions(&self) -> usize {
        self.l - 1
    }

    /// Row `r` of a per-action array.
    pub fn row<'a>(&self, a: &'a [f32], r: usize) -> &'a [f32] {
        &a[r * self.actions()..(r + 1) * self.actions()]
    }
}

/// The models a rollout reads.
pub struct RolloutModels<'a> {
    /// The actor's training view (same weights, unfused), used without gradients here; under
    /// ZeRO stage 3 the actor generation gathered.
    pub actor: &'a Gpt2,
    /// The frozen reference and reward model, and PPO's critic (GRPO and RLOO have none): whole,
    /// or under ZeRO stage 3 sharded at rest, their forwards then collectives.
    pub reference: &'a TrainedModel,
    pub critic: Option<&'a TrainedModel>,
    /// None with `--no-reward-model`: the scores are the external rewards alone.
    pub reward: Option<&'a TrainedModel>,
}

impl RolloutModels<'_> {
    /// The models sharded at rest, in the order a rollout runs them: a rank without rows runs
    /// each once on a filler row, so that the other ranks' gathers find its shards.
    fn sharded(&self) -> impl Iterator<Item = &TrainedModel> {
        [Some(self.reference), self.critic, self.reward]
            .into_iter()
            .flatten()
            .filter(|m| matches!(m, TrainedModel::Sharded(_)))
    }
}

/// Rewards from outside the reward model (`--reward-fn`) of a rollout's kept rows, each given
/// as its prompt's tokens (padding removed) and its answer's (EOS removed): one reward a row.
pub type ExternalRewards<'f> = dyn FnMut(&[(&[u32], &[u32])]) -> Result<Vec<f32>> + 'f;

/// What happened to a rollout's rows.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RolloutCounts {
    pub generated: usize,
    /// Rows whose answer had at most one non-pad token (DS-Chat drops them).
    pub dropped_short: usize,
}

/// Generates answers for `prompts` with `generate` (the hybrid engine's generation mode: this
/// rank alone, or its inference tensor-parallel group) and scores them; `None` when every answer was too short to
/// learn from (the caller then reuses the previous experience, DS-Chat's `last_generated_experience`).
/// Each prompt's key ([`LeftPadded::keys`]) is its position in the rollout of `rollout_size`
/// prompts (this rank's share of which `prompts` are). `external` gives the rewards from
/// outside the reward model of the kept rows, each given as its prompt's tokens (padding
/// removed) and its answer's (EOS removed), which are added to the reward model's scores.
/// `normalize` turns the kept rows' scores into the scores their rewards use. Every rank calls
/// `external`, then `normalize`, once (either may be a collective), with no rows when it kept
/// none.
#[allow(clippy::too_many_arguments)]
pub fn generate_experience(
    models: &RolloutModels,
    generate: impl FnOnce(&LeftPadded) -> Result<Generation>,
    prompts: &LeftPadded,
    rollout_size: usize,
    sampling: &SamplingConfig,
    cfg: &PpoConfig,
    external: &mut ExternalRewards,
    normalize: &mut dyn FnMut(&[f32]) -> Result<Vec<f32>>,
    device: &Device,
) -> Result<(Option<Experience>, RolloutCounts)> {
    let generation = generate(prompts)?;
    let pad = sampling.pad_token_id;
    let p = prompts.p;
    let keep: Vec<usize> = (0..prompts.b).filter(|&r| answer_is_learnable(&generation.tokens[r], pad)).collect();
    let counts = RolloutCounts { generated: prompts.b, dropped_short: prompts.b - keep.len() };
    if keep.is_empty() {
        external(&[])?;
        normalize(&[])?;
        let filler = Tensor::zeros((1, 1), DType::U32, device)?;
        for model in models.sharded() {
            model.with_hidden(&filler, &Positions::default(), |_, _| Ok(()))?;
        }
        return Ok((None, counts));
    }
    let longest = keep.iter().map(|&r| generation.tokens[r].len()).max().unwrap_or(0);
    let (b, l) = (keep.len(), p + longest);
    let mut seq = Vec::with_capacity(b * l);
    for &r in &keep {
        seq.extend_from_slice(&prompts.ids[r * p..(r + 1) * p]);
        let answer = &generation.tokens[r];
        seq.extend(answer.iter().copied().chain(std::iter::repeat_n(pad, longest - answer.len())));
    }
    // DS-Chat's `attention_mask = seq != pad`, keeping the prompts' own mask (a prompt may
    // contain the pad id as a real token).
    let mut attention_mask = Vec::with_capacity(b * l);
    for (i, &r) in keep.iter().enumerate() {
        attention_mask.extend_from_slice(&prompts.mask[r * p..(r + 1) * p]);
        attention_mask.extend(seq[i * l + p..(i + 1) * l].iter().map(|&t| u32::from(t != pad)));
    }
    let forward = ForwardInputs::new(&seq, &attention_mask, b, l, device)?.with_temperature(cfg.temperature);
    let logprobs = forward.logprobs(models.actor)?;
    let ref_logprobs = forward.model_logprobs(models.reference)?;
    // (B, L); without a critic zeros, which leave GAE's place to the group advantages.
    let values_full = match models.critic {
        Some(critic) => forward.token_values(critic)?,
        None => vec![0.0; b * l],
    };
    let mut scores = match models.reward {
        Some(reward) => forward.end_scores(reward, &seq, p, pad)?,
        None => vec![0.0; b],
    };
    let texts: Vec<(Vec<u32>, &[u32])> = keep
        .iter()
        .map(|&r| {
            let prompt = prompts.ids[r * p..(r + 1) * p].iter().zip(&prompts.mask[r * p..]);
            let answer = &generation.tokens[r];
            let words = answer.len() - usize::from(answer.last() == sampling.eos_token_id.as_ref());
            (prompt.filter(|(_, &m)| m == 1).map(|(&t, _)| t).collect(), &answer[..words])
        })
        .collect();
    let rows: Vec<(&[u32], &[u32])> = texts.iter().map(|(prompt, answer)| (prompt.as_slice(), *answer)).collect();
    for (score, reward) in scores.iter_mut().zip(external(&rows)?) {
        *score += reward;
    }
    let reward_scores = normalize(&scores)?;

    let (start, actions) = (p - 1, l - 1);
    let (mut values, mut rewards, mut action_mask) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..b {
        let row_seq = &seq[i * l..(i + 1) * l];
        let mask = ppo::action_mask(row_seq, pad, start, cfg.eos_action);
        let end = ppo::end_of_answer(row_seq, pad, start);
        let lp = &logprobs[i * actions..(i + 1) * actions];
        let rp = &ref_logprobs[i * actions..(i + 1) * actions];
        let mut v: Vec<f32> = values_full[i * l..i * l + actions].to_vec(); // V[t] for t < L - 1
        for x in v.iter_mut().skip(end) {
            *x = 0.0;
        }
        let r = ppo::compute_rewards(lp, rp, reward_scores[i], end, cfg);
        values.extend(v);
        rewards.extend(r);
        action_mask.extend(mask);
    }
    // Set by the next stage, `advantages::compute_advantages`.
    let (advantages, returns) = (vec![0.0; b * (actions - start)], vec![0.0; b * (actions - start)]);
    let answer_lens = keep.iter().map(|&r| generation.tokens[r].len()).collect();
    let ended_with_eos = keep.iter().map(|&r| generation.tokens[r].last() == sampling.eos_token_id.as_ref()).collect();
    let positions = keep.iter().map(|&r| prompts.keys[r] as usize).collect();
    let experience = Experience {
        seq,
        attention_mask,
        b,
        l,
        start,
        logprobs,
        ref_logprobs,
        values,
        rewards,
        action_mask,
        advantages,
        returns,
        scores,
        reward_scores,
        answer_lens,
        ended_with_eos,
        positions,
        rollout_size,
    };
    Ok((Some(experience), counts))
}

/// The positions of a rollout of `n` prompts that `rank` of `world` ranks generates: in each
/// global micro-batch of `global_micro` consecutive positions, every `world`-th from `rank` on
/// (torch's DistributedSampler within the micro-batch), ascending. The ranks' shares of global
/// micro-batch `k` together are the one-rank micro-batch `k`; unlike SFT's sampler nothing is
/// padded, so a short last rollout gives some ranks fewer rows, or none.
pub fn rollout_share(n: usize, global_micro: usize, rank: usize, world: usize) -> Vec<usize> {
    assert!(rank < world && global_micro > 0, "rank {rank} of {world}, global micro-batch {global_micro}");
    (0..n)
        .step_by(global_micro)
        .flat_map(|first| (first..(first + global_micro).min(n)).skip(rank).step_by(world))
        .collect()
}

/// DS-Chat drops answers with at most one non-pad token: nothing to learn from.
pub fn answer_is_learnable(answer: &[u32], pad: u32) -> bool {
    answer.iter().filter(|&&t| t != pad).count() > 1
}

/// A (B, L) batch with its mask and transformers' position ids, as tensors for a forward pass.
pub struct ForwardInputs {
    pub ids: Tensor,
    pub mask: Tensor,
    pub positions: Tensor,
    pub b: usize,
    pub l: usize,
    /// The log-probs are of softmax(logits / temperature): the distribution rollouts sampled.
    pub temperature: f64,
}

impl ForwardInputs {
    pub fn new(seq: &[u32], mask: &[u32], b: usize, l: usize, device: &Device) -> Result<Self> {
        Ok(Self {
            ids: Tensor::from_slice(seq, (b, l), device)?,
            mask: Tensor::from_slice(mask, (b, l), &Device::Cpu)?, // read on the host (Positions)
            positions: Tensor::from_vec(position_ids(mask, b, l), (b, l), device)?,
            b,
            l,
            temperature: 1.0,
        })
    }

    /// The log-probs of the distribution sampled at `temperature` ([`crate::PpoConfig::temperature`]).
    pub fn with_temperature(mut self, temperature: f64) -> Self {
        self.temperature = temperature;
        self
    }

    /// Left padding is masked out of attention and takes no positions, exactly as in generation,
    /// so these log-probs equal the ones generation saw.
    pub fn as_positions(&self) -> Positions<'_> {
        Positions { position_ids: Some(&self.positions), attention_mask: Some(&self.mask) }
    }

    /// Log-prob of each action's token under `model`: (B, L - 1) row-major.
    pub fn logprobs(&self, model: &Gpt2) -> Result<Vec<f32>> {
        self.logprobs_after(model, &model.forward_blocks(&self.ids, &self.as_positions(), None, None)?)
    }

    /// [`Self::logprobs`] under a model whole or sharded at rest (a collective then).
    pub fn model_logprobs(&self, model: &TrainedModel) -> Result<Vec<f32>> {
        model.with_hidden(&self.ids, &self.as_positions(), |heads, hidden| self.logprobs_after(heads.trunk, hidden))
    }

    /// The log-probs of the actions from the trunk's last hidden state (B, L, C) by `model`'s
    /// final norm and LM head (the whole model's own forward from there on).
    fn logprobs_after(&self, model: &Gpt2, hidden: &Tensor) -> Result<Vec<f32>> {
        if !model.is_tensor_parallel() {
            let logits = tempered(model.loss_input(&model.lm_head(hidden)?)?, self.temperature)?; // (B, L, V)
            return Ok(gather_log_probs(&logits, &self.ids)?.flatten_all()?.to_vec1()?);
        }
        // Under tensor parallelism from the vocabulary slices: the full logits exist nowhere.
        let actions = self.l - 1;
        let next = self.ids.narrow(1, 1, actions)?;
        let (logp, _) = model.next_token_log_probs(&hidden.narrow(1, 0, actions)?, &next, false, self.temperature)?;
        Ok(logp.flatten_all()?.to_vec1()?)
    }

    /// Per-token values of a critic or reward model, whole or sharded at rest (a collective
    /// then): (B, L) row-major.
    pub fn token_values(&self, model: &TrainedModel) -> Result<Vec<f32>> {
        model.with_hidden(&self.ids, &self.as_positions(), |heads, hidden| {
            Ok(heads.token_scores(hidden)?.flatten_all()?.to_vec1()?)
        })
    }

    /// The reward model's score of each answer: at the last token before the answer's first
    /// pad (DS-Chat `forward_value(..., prompt_length)`), or at the last position.
    pub fn end_scores(&self, reward: &TrainedModel, seq: &[u32], p: usize, pad: u32) -> Result<Vec<f32>> {
        let all = self.token_values(reward)?;
        Ok((0..self.b)
            .map(|i| {
                let row = &seq[i * self.l..(i + 1) * self.l];
                let first_pad = row[p..].iter().position(|&t| t == pad).map_or(self.l, |k| p + k);
                all[i * self.l + first_pad.max(1) - 1]
            })
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hybrid_engine::comm::ProcessGroup;
    use hybrid_engine::generation::generate::generate_left_padded;
    use hybrid_engine::generation::mode::GenerationMode;
    use hybrid_engine::model::gpt2::Gpt2Config;
    use hybrid_engine::model::reward_model::{add_score_head, RewardModel};
    use hybrid_engine::training::zero3::ShardedModel;
    use hybrid_engine::ParamStore;

    fn small() -> Gpt2Config {
        Gpt2Config { n_layer: 2, n_embd: 32, n_head: 4, n_positions: 32, vocab_size: 64, ..Gpt2Config::tiny() }
    }

    #[test]
    fn generation_log_probs_equal_a_training_forward_on_left_padded_prompts() -> Result<()> {
        let dev = Device::Cpu;
        let cfg = small();
        let actor = ParamStore::init(&cfg, 3, &dev)?.model(&cfg)?;
        let prompts = LeftPadded::new(&[vec![5, 6, 7], vec![9], vec![1, 2, 3, 4, 5]], 6, 0);
        let sampling = SamplingConfig { temperature: Some(1.0), seed: 7, ..SamplingConfig::greedy(5, None, 0, 64) };
        let generation = generate_left_padded(&actor, &prompts, &sampling, &dev)?;
        let l = 6 + 5;
        let seq: Vec<u32> = (0..3)
            .flat_map(|r| {
                prompts.ids[r * 6..(r + 1) * 6].iter().chain(&generation.tokens[r]).copied().collect::<Vec<_>>()
            })
            .collect();
        let mask: Vec<u32> = (0..3)
            .flat_map(|r| prompts.mask[r * 6..(r + 1) * 6].iter().copied().chain([1; 5]).collect::<Vec<_>>())
            .collect();
        let forward = ForwardInputs::new(&seq, &mask, 3, l, &dev)?;
        let lp = forward.logprobs(&actor)?;
        let mut worst = 0f32;
        for r in 0..3 {
            for (k, &g) in generation.logprobs[r].iter().enumerate() {
                worst = worst.max((lp[r * (l - 1) + 5 + k] - g).abs());
            }
        }
        assert!(worst < 1e-5, "generation vs training log-probs differ by {worst}");
        Ok(())
    }

    #[test]
    fn generation_mode_with_fused_lora_gives_the_training_forwards_log_probs() -> Result<()> {
        let dev = Device::Cpu;
        let cfg = small();
        let mut params = ParamStore::init(&cfg, 3, &dev)?;
        let lora = lora::LoraConfig { dim: 4, ..lora::LoraConfig::default() };
        params.add_lora(&cfg, &lora, 5)?;
        // Non-zero B, so that the adapters change the outputs.
        for (name, var) in params.iter() {
            if name.ends_with("lora_B.weight") {
                var.set(&Tensor::randn(0f32, 0.5, var.shape(), &dev)?)?;
            }
        }
        let engine = GenerationMode::new(6, 5, false);
        let fused = engine.model(&params, &cfg)?; // generation mode: LoRA fused into the weights
        let training = params.model(&cfg)?; // training mode: LoRA unfused
        let prompts = LeftPadded::new(&[vec![5, 6, 7], vec![9]], 6, 0);
        let sampling = SamplingConfig { temperature: Some(1.0), seed: 3, ..SamplingConfig::greedy(5, None, 0, 64) };
        let generation = generate_left_padded(&fused, &prompts, &sampling, &dev)?;
        let l = 6 + 5;
        let seq: Vec<u32> = (0..2)
            .flat_map(|r| {
                prompts.ids[r * 6..(r + 1) * 6].iter().chain(&generation.tokens[r]).copied().collect::<Vec<_>>()
            })
            .collect();
        let mask: Vec<u32> = (0..2)
            .flat_map(|r| prompts.mask[r * 6..(r + 1) * 6].iter().copied().chain([1; 5]).collect::<Vec<_>>())
            .collect();
        let forward = ForwardInputs::new(&seq, &mask, 2, l, &dev)?;
        let lp = forward.logprobs(&training)?;
        let base = forward.logprobs(&ParamStore::init(&cfg, 3, &dev)?.model(&cfg)?)?;
        let (mut worst, mut moved) = (0f32, 0f32);
        for r in 0..2 {
            for (k, &g) in generation.logprobs[r].iter().enumerate() {
                worst = worst.max((lp[r * (l - 1) + 5 + k] - g).abs());
                moved = moved.max((base[r * (l - 1) + 5 + k] - g).abs());
            }
        }
        assert!(worst < 1e-5, "fused generation vs unfused training log-probs differ by {worst}");
        assert!(moved > 1e-3, "the adapters must matter for this test to mean anything ({moved})");
        Ok(())
    }

    #[test]
    fn rollout_shares_split_every_global_micro_batch_and_cover_the_rollout_once() {
        // 10 prompts, global micro-batches of 4 over 2 ranks: [0..4), [4..8), [8..10).
        assert_eq!(rollout_share(10, 4, 0, 2), vec![0, 2, 4, 6, 8]);
        assert_eq!(rollout_share(10, 4, 1, 2), vec![1, 3, 5, 7, 9]);
        // 4 prompts, micro-batches of 3 over 3 ranks: the last micro-batch has rank 0's row only.
        assert_eq!(rollout_share(4, 3, 0, 3), vec![0, 3]);
        assert_eq!(rollout_share(4, 3, 2, 3), vec![2]);
        assert_eq!(rollout_share(7, 7, 0, 1), (0..7).collect::<Vec<_>>());
        for (n, world, per_rank) in [(12, 2, 3), (13, 3, 2), (5, 3, 4), (2, 3, 1)] {
            let micro = per_rank * world;
            let mut seen = vec![0; n];
            for rank in 0..world {
                let share = rollout_share(n, micro, rank, world);
                assert!(share.windows(2).all(|w| w[0] < w[1]), "ascending: {share:?}");
                for k in 0..n.div_ceil(micro) {
                    let in_k = share.iter().filter(|&&p| p / micro == k).count();
                    assert!(in_k <= per_rank, "at most the per-device rows in a micro-batch");
                }
                share.iter().for_each(|&p| seen[p] += 1);
            }
            assert!(seen.iter().all(|&c| c == 1), "n {n}, world {world}: {seen:?}");
        }
    }

    #[test]
    fn micro_batches_count_rollout_positions_so_drops_leave_holes() {
        // Kept rows at positions 0, 2, 3 and 7 of a rollout of 9 (the others dropped, or another
        // rank's): micro-batches of 4 positions.
        let exp = Experience { positions: vec![0, 2, 3, 7], ..Experience::empty(4, 9) };
        assert_eq!(exp.micro_batches(4), 3, "by the rollout's size, whatever was dropped");
        assert_eq!(exp.micro_batch_rows(0, 4), 0..3);
        assert_eq!(exp.micro_batch_rows(1, 4), 3..4);
        assert_eq!(exp.micro_batch_rows(2, 4), 4..4, "none of the last micro-batch's rows is here");
        // A row at a micro-batch's first position belongs to it, not to the one before.
        let exp = Experience { positions: vec![3, 4, 8], ..Experience::empty(4, 9) };
        assert_eq!([0, 1, 2].map(|k| exp.micro_batch_rows(k, 4)), [0..1, 1..2, 2..3]);
    }

    #[test]
    fn answers_of_at_most_one_token_are_dropped() {
        let eos = 9;
        assert!(!answer_is_learnable(&[eos], eos), "EOS at once");
        assert!(!answer_is_learnable(&[4, eos], eos), "one token, then EOS");
        assert!(!answer_is_learnable(&[4], eos), "one token at the length limit");
        assert!(answer_is_learnable(&[4, 5, eos], eos));
        assert!(answer_is_learnable(&[4, 5], eos));
    }

    /// Prompts of 2 tokens in rows of 6, pad 0: row 0's answer is 3 tokens then padding, row
    /// 1's (a left-padded prompt) runs to the length limit, row 2's is empty. The scores are
    /// the reward model's values at positions 4, 5 and 1 of their rows.
    #[test]
    fn the_reward_models_score_is_read_before_the_answers_first_pad() -> Result<()> {
        let (dev, cfg) = (Device::Cpu, small());
        let mut store = ParamStore::init(&cfg, 5, &dev)?;
        add_score_head(&mut store, &cfg, 5, &dev)?;
        let reward = TrainedModel::reward(RewardModel::new(&store, &cfg)?);
        let seq = [5, 6, 7, 8, 9, 0, 0, 6, 7, 8, 9, 10, 5, 6, 0, 0, 0, 0];
        let mask: Vec<u32> = seq.iter().map(|&t| u32::from(t != 0)).collect();
        let inputs = ForwardInputs::new(&seq, &mask, 3, 6, &dev)?;
        let all = inputs.token_values(&reward)?;
        assert_eq!(inputs.end_scores(&reward, &seq, 2, 0)?, [all[4], all[6 + 5], all[12 + 1]]);
        Ok(())
    }

    #[test]
    fn experience_rows_drop_short_answers_and_end_where_the_answer_ends() -> Result<()> {
        let dev = Device::Cpu;
        let cfg = small();
        let params = ParamStore::init(&cfg, 4, &dev)?;
        let actor = params.model(&cfg)?;
        let mut critic_params = ParamStore::init(&cfg, 5, &dev)?;
        add_score_head(&mut critic_params, &cfg, 5, &dev)?;
        let critic = TrainedModel::reward(RewardModel::new(&critic_params, &cfg)?);
        let reference = TrainedModel::lm(params.model(&cfg)?);
        let reward = TrainedModel::reward(RewardModel::new(&critic_params, &cfg)?);
        let models =
            RolloutModels { actor: &actor, reference: &reference, critic: Some(&critic), reward: Some(&reward) };
        let prompts = LeftPadded::new(&[vec![5, 6], vec![7, 8, 9]], 4, 0);
        // Sampling over a random model: answers of 6 tokens (no EOS among ids 1..64 by chance
        // only if EOS is never drawn; we let EOS be id 63 and check consistency either way).
        let sampling = SamplingConfig { temperature: Some(1.0), seed: 1, ..SamplingConfig::greedy(6, Some(63), 0, 64) };
        let cfg_ppo = PpoConfig { lam: 1.0, ..PpoConfig::default() };
        let mut engine = GenerationMode::new(4, 6, false);
        let mut rollout = |models: &RolloutModels| {
            let generate = |p: &LeftPadded| engine.generate(&actor, p, &sampling, &dev);
            let mut none = |rows: &[(&[u32], &[u32])]| Ok(vec![0.0; rows.len()]);
            generate_experience(
                models,
                generate,
                &prompts,
                2,
                &sampling,
                &cfg_ppo,
                &mut none,
                &mut |s| Ok(s.to_vec()),
                &dev,
            )
        };
        let (exp, counts) = rollout(&models)?;
        let mut exp = exp.expect("random answers are longer than one token");
        // The next stage: GAE.
        let share = crate::advantages::compute_advantages(&mut exp, &ProcessGroup::single(), 1, &cfg_ppo)?;
        assert_eq!(share, None, "PPO has no groups");
        assert_eq!(counts.generated, 2);
        assert_eq!(exp.b + counts.dropped_short, 2);
        assert_eq!(exp.start, 3);
        assert_eq!(exp.advantages.len(), exp.b * (exp.actions() - exp.start));
        for r in 0..exp.b {
            // Reference = actor: the KL penalty is zero, so the rewards are the clipped score alone.
            let rewards = exp.row(&exp.rewards, r);
            let nonzero: Vec<f32> = rewards.iter().copied().filter(|x| *x != 0.0).collect();
            assert_eq!(nonzero.len(), 1, "{rewards:?}");
            assert!((nonzero[0] - exp.scores[r].clamp(-5.0, 5.0)).abs() < 1e-6);
            // With gamma = lam = 1, GAE telescopes: the first return is the sum of the rewards.
            let ret0 = exp.returns[r * (exp.actions() - exp.start)];
            assert!((ret0 - nonzero[0]).abs() < 1e-4, "return {ret0} vs reward {}", nonzero[0]);
            // Values are zero from the end on, like the rewards.
            let end = ppo::end_of_answer(&exp.seq[r * exp.l..(r + 1) * exp.l], sampling.pad_token_id, exp.start);
            assert!(exp.row(&exp.values, r).iter().skip(end).all(|v| *v == 0.0));
        }
        // The frozen models and the critic sharded at rest (ZeRO stage 3, here over one rank)
        // give the whole models' log-probs, values and scores bit for bit.
        let group = std::sync::Arc::new(ProcessGroup::single());
        let sharded = |store: &ParamStore| -> Result<TrainedModel> {
            let model = ShardedModel::new(group.clone(), &cfg, store, DType::F32)?.freeze();
            Ok(TrainedModel::Sharded(std::rc::Rc::new(model)))
        };
        let (reference, critic, reward) = (sharded(&params)?, sharded(&critic_params)?, sharded(&critic_params)?);
        let models =
            RolloutModels { actor: &actor, reference: &reference, critic: Some(&critic), reward: Some(&reward) };
        let (again, _) = rollout(&models)?;
        let again = again.expect("the same answers");
        assert_eq!(again.seq, exp.seq);
        assert_eq!((&again.ref_logprobs, &again.values, &again.scores), (&exp.ref_logprobs, &exp.values, &exp.scores));

        // --reward-fn: each kept row's prompt (padding removed) and answer (EOS removed) are
        // scored, and the rewards added to the reward model's scores.
        let mut seen = Vec::new();
        let mut external = |rows: &[(&[u32], &[u32])]| {
            seen = rows.iter().map(|(p, a)| (p.to_vec(), a.to_vec())).collect::<Vec<_>>();
            Ok((0..rows.len()).map(|i| 10.0 * (i + 1) as f32).collect())
        };
        let generate = |p: &LeftPadded| engine.generate(&actor, p, &sampling, &dev);
        let (added, _) = generate_experience(
            &models,
            generate,
            &prompts,
            2,
            &sampling,
            &cfg_ppo,
            &mut external,
            &mut |s| Ok(s.to_vec()),
            &dev,
        )?;
        let added = added.expect("the same answers");
        assert_eq!(seen.len(), exp.b);
        for (i, (prompt, answer)) in seen.iter().enumerate() {
            let row = &exp.seq[i * exp.l..(i + 1) * exp.l];
            let want_prompt: Vec<u32> = [vec![5, 6], vec![7, 8, 9]][i].clone();
            assert_eq!(prompt, &want_prompt, "row {i}: the prompt without its padding");
            let mut want_answer = row[4..4 + exp.answer_lens[i]].to_vec();
            if exp.ended_with_eos[i] {
                assert_eq!(want_answer.pop(), Some(63));
            }
            assert_eq!(answer, &want_answer, "row {i}: the answer up to EOS");
            assert!((added.scores[i] - exp.scores[i] - 10.0 * (i + 1) as f32).abs() < 1e-4, "row {i}");
        }
        Ok(())
    }
}
