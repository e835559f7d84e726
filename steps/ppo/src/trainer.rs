//! The four models of step 3 and one PPO update, DS-Chat `DeepSpeedPPOTrainer.train_rlhf`: on a
//! micro-batch of an [`Experience`], the clipped actor loss and step, then the clipped critic
//! loss and step; the optional pretraining (PTX) loss (`train_unsupervised`) added to the actor's
//! loss of the same update, and the EMA of the actor after each update.
//!
//! Across data-parallel ranks an update is one global micro-batch: each rank backpropagates its
//! rows' masked means weighted by its share of the global micro-batch's answer tokens, so the
//! gradient the trainers average over ranks is the one-rank gradient of the whole micro-batch.
//!
//! Under ZeRO stage 3 the actor and the critic are [`hybrid_engine::training::zero3::ShardedModel`]s: every forward and backward
//! gathers their blocks from the ranks (collectives), so a rank with no rows in a global
//! micro-batch still runs one, on a filler row whose loss is zero, and the EMA follows each
//! rank's shard of the actor's weights.

use crate::experience::{Experience, ForwardInputs};
use crate::models::PpoModels;
use crate::ppo::{self, Algorithm, PpoConfig};
use anyhow::Result;
use candle_core::{Device, Tensor};
use hybrid_engine::engine::Engine;
use hybrid_engine::kernels::ops::DropoutKey;
use hybrid_engine::model::gpt2::Dropout;
use hybrid_engine::training::trainer::StepReport;
use std::cell::RefCell;
use std::ops::Range;

/// What one PPO update measured: this rank's part of the global micro-batch's means (its sums
/// over answer tokens divided by the global micro-batch's token count), so that the sum over
/// ranks is the global mean; with one rank, the means themselves.
#[derive(Clone, Copy, Debug, Default, serde::Serialize)]
pub struct UpdateStats {
    pub actor_loss: f64,
    pub critic_loss: f64,
    /// Mean `exp(logp_new - logp_old)` over masked actions.
    pub ratio_mean: f64,
    /// Share of masked actions whose ratio left [1 - c, 1 + c].
    pub clip_fraction: f64,
    /// Mean [`ppo::approx_kl`] from the rollout policy to the current one.
    pub approx_kl: f64,
    /// Mean entropy of the policy at the masked actions.
    pub entropy: f64,
}

impl UpdateStats {
    pub fn to_array(self) -> [f64; 6] {
        [self.actor_loss, self.critic_loss, self.ratio_mean, self.clip_fraction, self.approx_kl, self.entropy]
    }

    pub fn from_array(a: [f64; 6]) -> Self {
        let [actor_loss, critic_loss, ratio_mean, clip_fraction, approx_kl, entropy] = a;
        Self { actor_loss, critic_loss, ratio_mean, clip_fraction, approx_kl, entropy }
    }
}

/// This rank's part of one global PPO micro-batch.
pub struct MicroBatch<'a> {
    pub exp: &'a Experience,
    /// This rank's rows of `exp` in the global micro-batch; empty when it holds none of them
    /// (it still takes part in the update, with zero gradients).
    pub rows: Range<usize>,
    /// Answer tokens of the global micro-batch over all ranks (what the one-rank loss divides by).
    pub global_tokens: f64,
    /// Its answers over all ranks (what a per-answer loss, `--loss-type grpo|dr_grpo`, divides by).
    pub global_rows: f64,
    pub rank: usize,
    pub world: usize,
    /// The update's number (dropout keys).
    pub micro: u64,
}

impl MicroBatch<'_> {
    /// Answer tokens (unmasked actions) of this rank's rows.
    pub fn local_tokens(&self) -> f64 {
        answer_tokens(self.exp, &self.rows)
    }
}

/// Unmasked answer actions of rows `rows` of `exp`: the denominator of PPO's masked means.
pub fn answer_tokens(exp: &Experience, rows: &Range<usize>) -> f64 {
    rows.clone().map(|r| exp.row(&exp.action_mask, r)[exp.start..].iter().map(|&m| f64::from(m)).sum::<f64>()).sum()
}

/// Per-action tensors of rows `rows` for actions `start..`: (b, A).
fn answer_slice(exp: &Experience, data: &[f32], rows: &Range<usize>, device: &Device) -> Result<Tensor> {
    let (actions, start) = (exp.actions(), exp.start);
    let width = actions - start;
    let mut out = Vec::with_capacity(rows.len() * width);
    for r in rows.clone() {
        out.extend_from_slice(&data[r * actions + start..(r + 1) * actions]);
    }
    Ok(Tensor::from_vec(out, (rows.len(), width), device)?)
}

/// The advantages or returns of rows `rows`, already (B, A): (b, A).
fn answer_rows(exp: &Experience, data: &[f32], rows: &Range<usize>, device: &Device) -> Result<Tensor> {
    let width = exp.actions() - exp.start;
    Ok(Tensor::from_slice(&data[rows.start * width..rows.end * width], (rows.len(), width), device)?)
}

/// Pretraining blocks for the actor's update (DS-Chat `train_unsupervised`, PTX): their LM loss
/// times `coef` (`--unsup-coef`) joins the PPO actor loss of the same update.
pub struct PtxBatch {
    /// (B, T) tokens of this rank's blocks and their next-token targets.
    pub ids: Tensor,
    pub targets: Tensor,
    pub coef: f64,
    pub key: DropoutKey,
}

/// What one update did on this rank.
pub struct UpdateOutcome {
    /// This rank's part of the measurements.
    pub stats: UpdateStats,
    /// The unscaled LM loss of this rank's PTX blocks.
    pub ptx_loss: Option<f32>,
    /// The optimizer steps the update completed (at an accumulation boundary).
    pub actor_step: Option<StepReport>,
    pub critic_step: Option<StepReport>,
}

impl PpoModels {
    /// One PPO update: this rank's part of a global micro-batch `mb`, with `ptx` blocks when
    /// PTX is on. The actor's loss is `L_PPO + unsup_coef * L_LM` (the spec's
    /// `loss_actor += unsup_coef * LM loss`): both backward passes add to the same accumulation,
    /// so they make one optimizer step and one EMA update, as DS-Chat does by doubling the
    /// actor's gradient accumulation (`gradient_accumulation_steps_actor`).
    pub fn train_rlhf(
        &mut self,
        mb: &MicroBatch,
        cfg: &PpoConfig,
        seed: u64,
        ptx: Option<&PtxBatch>,
        device: &Device,
    ) -> Result<UpdateOutcome> {
        let local_tokens = mb.local_tokens();
        let stats = if mb.rows.is_empty() {
            // The other ranks' gradients are averaged with this rank's: it adds zeros.
            self.actor.add_zero_gradients(device)?;
            if let Some(critic) = &mut self.critic {
                critic.add_zero_gradients(device)?;
            }
            UpdateStats::default()
        } else {
            // The loss is a mean over the answer tokens (or, per answer, over the answers) of the
            // whole global micro-batch, as one rank holding all of it would compute: this rank's
            // mean weighs by its share of them (times the world, which the ranks' average
            // divides out).
            let world = mb.world as f64;
            let token_share = local_tokens * world / mb.global_tokens;
            let actor_share = match cfg.loss_type.per_answer() {
                true => mb.rows.len() as f64 * world / mb.global_rows,
                false => token_share,
            };
            self.rlhf_backward(mb, cfg, seed, (actor_share, token_share), device)?
        };
        let ptx_loss = ptx.map(|batch| self.unsupervised_backward(batch)).transpose()?;

        // Both steps after all backward passes, so that --align-overflow can look at both.
        let (actor_step, critic_step) = match &mut self.critic {
            Some(critic) => Engine::step_both(&mut self.actor, critic, self.align_overflow)?,
            None => (self.actor.step()?, None),
        };
        if let (Some(ema), Some(StepReport { skipped: false, .. })) = (&mut self.ema, actor_step) {
            ema.update(&self.actor)?;
        }
        Ok(UpdateOutcome { stats, ptx_loss, actor_step, critic_step })
    }

    /// The actor's and the critic's forward and backward on this rank's (non-empty) rows of
    /// `mb`, their losses scaled by `(actor_share, critic_share)`; returns this rank's part of
    /// the measurements.
    fn rlhf_backward(
        &mut self,
        mb: &MicroBatch,
        cfg: &PpoConfig,
        seed: u64,
        (actor_share, critic_share): (f64, f64),
        device: &Device,
    ) -> Result<UpdateStats> {
        let (exp, rows) = (mb.exp, &mb.rows);
        let (b, l, start) = (rows.len(), exp.l, exp.start);
        let seq = &exp.seq[rows.start * l..rows.end * l];
        let mask_tokens = &exp.attention_mask[rows.start * l..rows.end * l];
        let inputs = ForwardInputs::new(seq, mask_tokens, b, l, device)?;
        let old_logp = answer_slice(exp, &exp.logprobs, rows, device)?;
        let mask = answer_slice(exp, &exp.action_mask, rows, device)?;
        let advantages = answer_rows(exp, &exp.advantages, rows, device)?;
        // GRPO's KL to the reference is a loss term: its log-probs at the sampled tokens.
        let grpo_ref_logp = (cfg.algorithm == Algorithm::Grpo)
            .then(|| answer_slice(exp, &exp.ref_logprobs, rows, device))
            .transpose()?;
        let next_tokens = inputs.ids.narrow(1, start + 1, l - 1 - start)?; // (b, A)

        // Each rank draws its own masks (its rows differ); one rank draws one rank's masks.
        let key = |salt: u64| DropoutKey { seed: seed ^ salt, step: mb.micro, micro_batch: mb.rank as u64 };

        // Actor: the LM head only on the answer's positions.
        let actor = &mut self.actor;
        let dropout = Dropout::from_config(&actor.config, key(0));
        let seen: RefCell<Option<(Tensor, Tensor)>> = RefCell::new(None);
        let actor_loss = actor.forward_backward(
            &inputs.ids,
            &inputs.as_positions(),
            Some(&dropout),
            actor_share,
            |heads, hidden| {
                let lm = heads.trunk;
                let h = hidden.narrow(1, start, l - 1 - start)?; // (b, A, C)
                let (logp, entropy) = lm.next_token_log_probs(&h, &next_tokens, true, cfg.temperature)?; // (b, A) each
                let entropy = entropy.expect("asked for");
                *seen.borrow_mut() = Some((logp.detach(), entropy));
                let per_token = ppo::actor_token_losses(&logp, &old_logp, &advantages, &mask, cfg)?;
                let per_token = match &grpo_ref_logp {
                    Some(ref_logp) => (per_token + (ppo::k3_kl_tokens(&logp, ref_logp, &mask)? * cfg.kl_ctl)?)?,
                    None => per_token,
                };
                ppo::aggregate_loss(&per_token, &mask, cfg.loss_type, cfg.max_answer_len)
            },
        )?;
        let (new_logp, entropy) = seen.into_inner().expect("the actor head ran");
        let critic_loss = match &mut self.critic {
            Some(critic) => Self::critic_backward(critic, mb, &inputs, cfg, seed, critic_share, device)?,
            None => 0.0,
        };
        // Each loss weighs by this rank's part of its mean (the shares without the world factor).
        let world = mb.world as f64;
        let losses = [(actor_loss, actor_share / world), (critic_loss, critic_share / world)];
        policy_stats(&new_logp, &old_logp, &entropy, &mask, cfg, losses, mb.global_tokens)
    }

    /// The critic's forward and backward on this rank's rows of `mb` (their tokens `inputs`),
    /// its loss scaled by `share`; returns the loss.
    fn critic_backward(
        critic: &mut Engine,
        mb: &MicroBatch,
        inputs: &ForwardInputs,
        cfg: &PpoConfig,
        seed: u64,
        share: f64,
        device: &Device,
    ) -> Result<f32> {
        let (exp, rows) = (mb.exp, &mb.rows);
        let (l, start) = (exp.l, exp.start);
        let old_values = answer_slice(exp, &exp.values, rows, device)?;
        let mask = answer_slice(exp, &exp.action_mask, rows, device)?;
        let returns = answer_rows(exp, &exp.returns, rows, device)?;
        let key = |salt: u64| DropoutKey { seed: seed ^ salt, step: mb.micro, micro_batch: mb.rank as u64 };
        let dropout = Dropout::from_config(&critic.config, key(0xc417));
        critic.forward_backward(&inputs.ids, &inputs.as_positions(), Some(&dropout), share, |heads, hidden| {
            let values = heads.token_scores(hidden)?.narrow(1, start, l - 1 - start)?; // (b, A)
            ppo::critic_loss(&values, &old_values, &returns, &mask, cfg)
        })
    }

    /// The PTX loss's backward, scaled by its coefficient, into the actor's accumulated
    /// gradients. Across ranks every rank holds as many full blocks, so the ranks' average of
    /// their mean losses is the global mean. Returns the unscaled LM loss of this rank's blocks.
    fn unsupervised_backward(&mut self, ptx: &PtxBatch) -> Result<f32> {
        let actor = &mut self.actor;
        let dropout = Dropout::from_config(&actor.config, DropoutKey { seed: ptx.key.seed ^ 0x9715, ..ptx.key });
        actor.lm_forward_backward(&ptx.ids, &ptx.targets, Some(&dropout), ptx.coef)
    }

    /// Applies what is left in the accumulators at the end of the run.
    pub fn flush(&mut self) -> Result<()> {
        if let Some(StepReport { skipped: false, .. }) = self.actor.flush()? {
            if let Some(ema) = &mut self.ema {
                ema.update(&self.actor)?;
            }
        }
        if let Some(critic) = &mut self.critic {
            critic.flush()?;
        }
        Ok(())
    }
}

/// This rank's part of the global micro-batch's means: sums over its masked actions divided by
/// `global_tokens`; its mean losses (actor, critic) each weighted by its part of that mean.
fn policy_stats(
    new: &Tensor,
    old: &Tensor,
    entropy: &Tensor,
    mask: &Tensor,
    cfg: &PpoConfig,
    [(actor_loss, actor_part), (critic_loss, critic_part)]: [(f32, f64); 2],
    global_tokens: f64,
) -> Result<UpdateStats> {
    let new: Vec<f32> = new.flatten_all()?.to_vec1()?;
    let old: Vec<f32> = old.flatten_all()?.to_vec1()?;
    let ent: Vec<f32> = entropy.flatten_all()?.to_vec1()?;
    let mask: Vec<f32> = mask.flatten_all()?.to_vec1()?;
    let (lo, hi) = cfg.ratio_bounds();
    let (mut ratio, mut clipped, mut kl, mut h) = (0f64, 0f64, 0f64, 0f64);
    for i in 0..mask.len() {
        if mask[i] > 0.0 {
            let d = f64::from(new[i] - old[i]);
            let r = d.exp();
            ratio += r;
            clipped += f64::from(u8::from(r < lo || r > hi));
            kl += ppo::approx_kl(d);
            h += f64::from(ent[i]);
        }
    }
    let total = global_tokens.max(1.0);
    Ok(UpdateStats {
        actor_loss: f64::from(actor_loss) * actor_part,
        critic_loss: f64::from(critic_loss) * critic_part,
        ratio_mean: ratio / total,
        clip_fraction: clipped / total,
        approx_kl: kl / total,
        entropy: h / total,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::args::PpoArgs;
    use crate::models::{lm_on, reward_model_on, Ema};
    use clap::Parser;
    use hybrid_engine::comm::ProcessGroup;
    use hybrid_engine::engine::{EngineConfig, Head, Ranks};
    use hybrid_engine::model::gpt2::Gpt2Config;
    use hybrid_engine::model::reward_model::add_score_head;
    use hybrid_engine::training::optim::{AdamW, AdamWConfig};
    use hybrid_engine::training::train_step::TrainedModel;
    use hybrid_engine::ParamStore;

    /// Four answer actions of this rank (a fifth masked) in a global micro-batch of 8 tokens:
    /// log-ratios 0.1 and 0.05 inside the ratio's range [0.8, 1.2], -0.3 below it (ratio
    /// 0.741) and 0.4 above it (1.492): two clipped; each sum over 8.
    #[test]
    fn policy_stats_sum_this_ranks_answer_actions_over_the_global_tokens() -> Result<()> {
        let dev = Device::Cpu;
        let d = [0.1f32, -0.3, 0.05, 0.4];
        let new = Tensor::new(&[[d[0], d[1], d[2], d[3], 5.0]], &dev)?;
        let old = Tensor::zeros((1, 5), candle_core::DType::F32, &dev)?;
        let entropy = Tensor::new(&[[1.0f32, 2.0, 3.0, 4.0, 9.0]], &dev)?;
        let mask = Tensor::new(&[[1.0f32, 1.0, 1.0, 1.0, 0.0]], &dev)?;
        let losses = [(2.0, 0.5), (4.0, 0.25)];
        let s = policy_stats(&new, &old, &entropy, &mask, &PpoConfig::default(), losses, 8.0)?;
        let d = d.map(f64::from);
        let close = |a: f64, b: f64| (a - b).abs() < 1e-12;
        assert!(close(s.actor_loss, 1.0) && close(s.critic_loss, 1.0), "{s:?}");
        assert!(close(s.ratio_mean, d.iter().map(|d| d.exp()).sum::<f64>() / 8.0), "{s:?}");
        assert!(close(s.clip_fraction, 2.0 / 8.0), "{s:?}");
        assert!(close(s.approx_kl, d.iter().map(|&d| ppo::approx_kl(d)).sum::<f64>() / 8.0), "{s:?}");
        assert!(close(s.entropy, 10.0 / 8.0), "{s:?}");
        // What the ranks' reduction moves, in a fixed order.
        assert_eq!(UpdateStats::from_array([1.0, 2.0, 3.0, 4.0, 5.0, 6.0]).to_array(), [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
        assert_eq!(s.to_array(), [s.actor_loss, s.critic_loss, s.ratio_mean, s.clip_fraction, s.approx_kl, s.entropy]);
        Ok(())
    }

    fn tiny_config() -> Gpt2Config {
        Gpt2Config {
            n_layer: 1,
            n_embd: 16,
            n_head: 2,
            n_positions: 16,
            vocab_size: 40,
            resid_pdrop: 0.0,
            embd_pdrop: 0.0,
            attn_pdrop: 0.0,
            ..Gpt2Config::tiny()
        }
    }

    /// Step 3's models on one rank, as `run` builds them from `flags`, over tiny random GPT-2s;
    /// the actor trains at `actor_lr` (the CLI refuses 0), the critic at 1e-3. Also returns a
    /// copy of the actor's starting weights.
    fn tiny_models(flags: &str, actor_lr: f64) -> (PpoArgs, PpoModels, ParamStore) {
        let args = PpoArgs::try_parse_from(std::iter::once("ppo").chain(flags.split_whitespace())).unwrap();
        let (cfg, cpu) = (tiny_config(), Device::Cpu);
        let group = std::sync::Arc::new(ProcessGroup::single());
        let actor = ParamStore::init(&cfg, 1, &cpu).unwrap();
        let start = actor.copy().unwrap();
        let mut critic = ParamStore::init(&cfg, 2, &cpu).unwrap();
        add_score_head(&mut critic, &cfg, 3, &cpu).unwrap();
        let (reference, reward) =
            (lm_on(&start, &cfg, false, None).unwrap(), reward_model_on(&critic, &cfg, false, None).unwrap());
        // As `run` configures them, over 10 optimizer steps at the given learning rates.
        let engine = |critic: bool, lr: f64| EngineConfig {
            schedule: args.lr_scheduler_type.schedule(lr, args.num_warmup_steps, 10),
            lora_learning_rate: Some(lr),
            ..args.engine_config(critic, 10, &group).unwrap()
        };
        let ranks = Ranks { data: group.clone(), tensor: None };
        let models = PpoModels {
            actor: Engine::new(&engine(false, actor_lr), &cfg, Head::Lm, actor, ranks.clone()).unwrap(),
            critic: Some(Engine::new(&engine(true, 1e-3), &cfg, Head::Score, critic.copy().unwrap(), ranks).unwrap()),
            reference: crate::models::Reference::Loaded(TrainedModel::lm(reference)),
            reward: Some(TrainedModel::reward(reward)),
            ema: args.enable_ema.then(|| Ema::Whole(start.copy().unwrap())),
            align_overflow: false,
        };
        (args, models, start)
    }

    /// Two rows of a 3-token prompt and a 3-token answer (the second ends early: pad 0), with
    /// the actor's own log-probs as the rollout's and advantages of both signs.
    fn tiny_experience(actor: &hybrid_engine::Gpt2) -> Experience {
        tiny_experience_at(actor, 1.0)
    }

    /// [`tiny_experience`] sampled at `temperature`.
    fn tiny_experience_at(actor: &hybrid_engine::Gpt2, temperature: f64) -> Experience {
        let (b, l, p, pad) = (2, 6, 3, 0u32);
        let seq = vec![5u32, 9, 13, 21, 7, 30, 2, 4, 6, 8, 11, pad];
        let attention_mask: Vec<u32> = seq.iter().map(|&t| u32::from(t != pad)).collect();
        let inputs = crate::experience::ForwardInputs::new(&seq, &attention_mask, b, l, &Device::Cpu)
            .unwrap()
            .with_temperature(temperature);
        let logprobs = inputs.logprobs(actor).unwrap();
        let mut exp = Experience::empty(p, b);
        let actions = (l - 1) * b;
        exp.action_mask = seq.chunks(l).flat_map(|row| ppo::action_mask(row, pad, p - 1, true)).collect();
        exp.advantages = vec![1.5, -0.7, 0.4, -1.2, 0.9, 0.3];
        exp.returns = vec![0.5, 0.2, -0.3, 0.1, 0.6, -0.4];
        exp.values = vec![0.0; actions];
        exp.ref_logprobs = logprobs.clone();
        exp.rewards = vec![0.0; actions];
        exp.scores = vec![1.0, -1.0];
        exp.reward_scores = exp.scores.clone();
        exp.answer_lens = vec![3, 2];
        exp.ended_with_eos = vec![false, true];
        exp.positions = vec![0, 1];
        Experience { seq, attention_mask, b, l, logprobs, ..exp }
    }

    fn micro_batch(exp: &Experience, micro: u64) -> MicroBatch<'_> {
        let rows = 0..exp.b;
        MicroBatch {
            exp,
            global_tokens: answer_tokens(exp, &rows),
            global_rows: rows.len() as f64,
            rows,
            rank: 0,
            world: 1,
            micro,
        }
    }

    fn actor_trunk(models: &PpoModels) -> &hybrid_engine::Gpt2 {
        match models.actor.model() {
            TrainedModel::Whole { trunk, .. } => trunk,
            TrainedModel::Sharded(_) => unreachable!("one rank"),
        }
    }

    fn values(store: &ParamStore) -> Vec<f32> {
        store.vars.iter().flat_map(|v| v.flatten_all().unwrap().to_vec1::<f32>().unwrap()).collect()
    }

    fn max_diff(a: &[f32], b: &[f32]) -> f32 {
        a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
    }

    /// The training forward reproduces the rollout's log-probs: at learning rate 0 every
    /// update sees ratio 1 and approx KL 0; after a real step the ratio departs from 1.
    #[test]
    fn the_ratio_is_1_until_the_policy_moves() {
        for (lr, moves) in [(0.0, false), (1e-2, true)] {
            // No warmup: DS-Chat's default of 100 steps makes the first update's rate 0.
            let (args, mut models, _) = tiny_models("--gradient-accumulation-steps 1 --num-warmup-steps 0", lr);
            let exp = tiny_experience(actor_trunk(&models));
            let first = models.train_rlhf(&micro_batch(&exp, 1), &args.ppo_config(), 7, None, &Device::Cpu).unwrap();
            assert!(first.actor_step.is_some(), "one micro-batch per step");
            let second = models.train_rlhf(&micro_batch(&exp, 2), &args.ppo_config(), 7, None, &Device::Cpu).unwrap();
            for (n, stats) in [(1, first.stats), (2, second.stats)] {
                let departed = (stats.ratio_mean - 1.0).abs() > 1e-4 && stats.approx_kl > 1e-8;
                if n == 1 || !moves {
                    assert!((stats.ratio_mean - 1.0).abs() < 1e-6, "lr {lr}, update {n}: {stats:?}");
                    assert!(stats.approx_kl.abs() < 1e-12, "lr {lr}, update {n}: {stats:?}");
                } else {
                    assert!(departed, "lr {lr}, update {n}: {stats:?}");
                }
            }
        }
    }

    /// Rollouts sampled at a temperature: the old log-probs and the training forward's are both
    /// of softmax(logits / T), so the ratio is 1 before the policy moves; read at another
    /// temperature than they were sampled at, it is not. The tempered log-probs are
    /// log_softmax(logits / T) at each action's token.
    #[test]
    fn the_ratio_reads_the_policy_at_the_temperature_it_sampled() {
        let (args, mut models, _) = tiny_models("--gradient-accumulation-steps 1 --do-sample --temperature 0.7", 0.0);
        let cfg = args.ppo_config();
        assert_eq!(cfg.temperature, 0.7);
        let exp = tiny_experience_at(actor_trunk(&models), 0.7);
        let logits = actor_trunk(&models)
            .forward(
                &Tensor::from_slice(&exp.seq, (exp.b, exp.l), &Device::Cpu).unwrap(),
                &Default::default(),
                None,
                None,
            )
            .unwrap();
        let logits: Vec<f32> = logits.flatten_all().unwrap().to_vec1().unwrap();
        let v = logits.len() / (exp.b * exp.l);
        for (r, t) in [(0, 2), (1, 3)] {
            let row = &logits[(r * exp.l + t) * v..(r * exp.l + t + 1) * v];
            let z: f64 = row.iter().map(|&x| (f64::from(x) / 0.7).exp()).sum();
            let token = exp.seq[r * exp.l + t + 1] as usize;
            let want = f64::from(row[token]) / 0.7 - z.ln();
            let got = f64::from(exp.logprobs[r * exp.actions() + t]);
            assert!((got - want).abs() < 1e-4, "row {r} action {t}: {got} vs {want}");
        }
        let stats = models.train_rlhf(&micro_batch(&exp, 1), &cfg, 7, None, &Device::Cpu).unwrap().stats;
        assert!((stats.ratio_mean - 1.0).abs() < 1e-6 && stats.approx_kl.abs() < 1e-12, "{stats:?}");
        let untempered = tiny_experience(actor_trunk(&models));
        let stats = models.train_rlhf(&micro_batch(&untempered, 2), &cfg, 7, None, &Device::Cpu).unwrap().stats;
        assert!((stats.ratio_mean - 1.0).abs() > 1e-3, "read at T = 0.7, sampled at 1: {stats:?}");
    }

    /// The action that emits EOS trains the actor and the critic (TRL, OpenRLHF): with every
    /// advantage and return zero but that action's, one update moves both models;
    /// `--mask-eos-action` (DS-Chat's mask) leaves them where they were.
    #[test]
    fn the_eos_action_trains_the_actor_and_the_critic_unless_masked() {
        for (flags, trains) in [("", true), ("--mask-eos-action", false)] {
            let flags = format!("--gradient-accumulation-steps 1 --num-warmup-steps 0 {flags}");
            let (args, mut models, start) = tiny_models(&flags, 1e-2);
            let cfg = args.ppo_config();
            assert_eq!(cfg.eos_action, trains);
            let mut exp = tiny_experience(actor_trunk(&models));
            // Row 1 is [2, 4, 6, 8, 11, pad]: its answer 8, 11, then EOS (= pad), emitted by
            // action 4, the third of its answer's actions.
            exp.action_mask =
                exp.seq.chunks(exp.l).flat_map(|row| ppo::action_mask(row, 0, exp.start, trains)).collect();
            let eos = exp.actions() - exp.start + 2;
            exp.advantages = vec![0.0; exp.advantages.len()];
            (exp.advantages[eos], exp.returns[eos]) = (1.0, 1.0);
            // The critic's own values as the old values and the returns: no error to learn
            // from but the EOS action's, whose return is its value plus 1.
            let critic = models.critic.as_ref().expect("PPO has a critic");
            let inputs =
                crate::experience::ForwardInputs::new(&exp.seq, &exp.attention_mask, exp.b, exp.l, &Device::Cpu)
                    .unwrap();
            let token_values = inputs.token_values(critic.model()).unwrap();
            exp.values = token_values.chunks(exp.l).flat_map(|row| row[..exp.l - 1].to_vec()).collect();
            exp.returns = exp.values.chunks(exp.actions()).flat_map(|row| row[exp.start..].to_vec()).collect();
            exp.returns[eos] += 1.0;
            let critic_start = values(critic.masters());
            models.train_rlhf(&micro_batch(&exp, 1), &cfg, 7, None, &Device::Cpu).unwrap();
            let actor_moved = max_diff(&values(models.actor.masters()), &values(&start));
            let critic_moved = max_diff(&values(models.critic.as_ref().unwrap().masters()), &critic_start);
            assert_eq!(actor_moved > 1e-6, trains, "{flags:?}: actor moved by {actor_moved}");
            assert_eq!(critic_moved > 1e-6, trains, "{flags:?}: critic moved by {critic_moved}");
        }
    }

    /// PTX adds `unsup_coef * L_LM` to the actor's PPO loss: one AdamW step on the sum's
    /// gradient (computed here by plain autodiff on a whole model), one EMA update.
    #[test]
    fn ptx_makes_one_update_from_the_summed_loss() {
        let cfg = tiny_config();
        let ptx_ids = Tensor::new(&[[3u32, 8, 12, 19, 25], [1, 2, 3, 4, 5]], &Device::Cpu).unwrap();
        let ptx_targets = Tensor::new(&[[8u32, 12, 19, 25, 31], [2, 3, 4, 5, 6]], &Device::Cpu).unwrap();
        let trained_with = |coef: f64| {
            let flags = "--gradient-accumulation-steps 1 --gradient-clipping 0 --enable-ema --adam-eps 1e-6 --num-warmup-steps 0";
            let (args, mut models, start) = tiny_models(flags, 1e-2);
            let exp = tiny_experience(actor_trunk(&models));
            let key = DropoutKey { seed: 7, step: 1, micro_batch: 0 };
            let ptx = PtxBatch { ids: ptx_ids.clone(), targets: ptx_targets.clone(), coef, key };
            let out =
                models.train_rlhf(&micro_batch(&exp, 1), &args.ppo_config(), 7, Some(&ptx), &Device::Cpu).unwrap();
            assert!(out.actor_step.is_some_and(|s| !s.skipped) && out.ptx_loss.is_some());
            assert_eq!(models.actor.trainer().optimizer.step, 1, "one optimizer step per update");
            let ema = match &models.ema {
                Some(Ema::Whole(ema)) => values(ema),
                _ => unreachable!(),
            };
            (args, models, start, exp, ema)
        };

        let coef = 0.5;
        let (args, models, start, exp, ema) = trained_with(coef);
        // The reference: the summed loss on a fresh model over the starting weights.
        let model = start.model(&cfg).unwrap();
        let inputs =
            crate::experience::ForwardInputs::new(&exp.seq, &exp.attention_mask, exp.b, exp.l, &Device::Cpu).unwrap();
        let logits = model.forward(&inputs.ids, &inputs.as_positions(), None, None).unwrap();
        let logp_all = candle_nn::ops::log_softmax(&logits, candle_core::D::Minus1).unwrap();
        let answer = exp.start..exp.l - 1;
        let next = inputs.ids.narrow(1, answer.start + 1, answer.len()).unwrap();
        let logp = logp_all
            .narrow(1, answer.start, answer.len())
            .unwrap()
            .contiguous()
            .unwrap()
            .gather(&next.unsqueeze(2).unwrap().contiguous().unwrap(), 2)
            .unwrap()
            .squeeze(2)
            .unwrap();
        let per_action = |a: &[f32]| {
            let rows: Vec<f32> = (0..exp.b).flat_map(|r| exp.row(a, r)[answer.clone()].to_vec()).collect();
            Tensor::from_vec(rows, (exp.b, answer.len()), &Device::Cpu).unwrap()
        };
        let old = per_action(&exp.logprobs);
        let mask = per_action(&exp.action_mask);
        let adv = Tensor::from_slice(&exp.advantages, (exp.b, answer.len()), &Device::Cpu).unwrap();
        let ppo_loss = ppo::actor_loss(&logp, &old, &adv, &mask, &args.ppo_config()).unwrap();
        let lm_loss = model.lm_loss(&ptx_ids, &ptx_targets, None).unwrap();
        let loss = (ppo_loss + (lm_loss * coef).unwrap()).unwrap();
        let grads = loss.backward().unwrap();
        let grads: Vec<Tensor> = start.vars.iter().map(|v| grads.get(v.as_tensor()).unwrap().clone()).collect();
        let adam = AdamWConfig::ds_chat(1e-6, 0.0);
        let mut optimizer = AdamW::new(adam, &start).unwrap();
        let lr = models.actor.trainer().schedule.lr(0);
        let before = values(&start);
        optimizer.step(&start, &grads, lr).unwrap();
        let (want, got) = (values(&start), values(models.actor.masters()));
        let moved = max_diff(&want, &before);
        assert!(moved > 1e-3, "the step moved the weights by {moved}");
        assert!(max_diff(&got, &want) < 1e-5, "off by {} (moved {moved})", max_diff(&got, &want));
        // One EMA update after the one step: 0.992 start + 0.008 updated.
        let want_ema: Vec<f32> = before.iter().zip(&got).map(|(s, a)| 0.992 * s + 0.008 * a).collect();
        assert!(max_diff(&ema, &want_ema) < 1e-6);

        // The coefficient matters: without PTX the update is another.
        let (_, without, ..) = trained_with(0.0);
        let differs = max_diff(&values(without.actor.masters()), &got);
        assert!(differs > 1e-4, "--unsup-coef 0 and {coef} gave updates {differs} apart");
    }
}
