//! The four models of step 3 and one PPO update, DS-Chat `DeepSpeedPPOTrainer.train_rlhf`: on a
//! micro-batch of an [`Experience`], the clipped actor loss and step, then the clipped critic
//! loss and step; the optional pretraining (PTX) loss as its own actor step
//! (`train_unsupervised`), and the EMA of the actor after each update.

use crate::experience::{Experience, ForwardInputs};
use crate::ppo::{self, PpoConfig};
use anyhow::Result;
use candle_core::{DType, Device, Tensor, D};
use hybrid_engine::kernels::ops::{self, DropoutKey};
use hybrid_engine::model::gpt2::{Dropout, Gpt2, Gpt2Config};
use hybrid_engine::model::reward_model::RewardModel;
use hybrid_engine::training::train_step::{forward_backward, lm_forward_backward, Backward};
use hybrid_engine::training::trainer::{micro_batch_done_pair, StepReport, Trainer};
use hybrid_engine::ParamStore;
use std::cell::RefCell;
use std::ops::Range;

/// A trained model: its config, parameters, the model over them and its optimizer.
pub struct Trained<M> {
    pub config: Gpt2Config,
    /// Every parameter (trunk, head, LoRA adapters).
    pub params: ParamStore,
    /// What the optimizer updates: `params`, or with `--only-optimize-lora` the adapters (and a
    /// critic's score head); shares storage with `params`.
    pub trainable: ParamStore,
    pub model: M,
    pub trainer: Trainer,
    pub checkpoint_activations: bool,
}

/// Actor, critic, the frozen reference and reward models, and the optional EMA.
pub struct PpoModels {
    pub actor: Trained<Gpt2>,
    pub critic: Trained<RewardModel>,
    pub reference: Gpt2,
    pub reward: RewardModel,
    pub ema: Option<ParamStore>,
    /// Skip both updates when either model's gradients overflowed (`--align-overflow`).
    pub align_overflow: bool,
}

/// What one PPO update measured.
#[derive(Clone, Copy, Debug, Default, serde::Serialize)]
pub struct UpdateStats {
    pub actor_loss: f64,
    pub critic_loss: f64,
    /// Mean `exp(logp_new - logp_old)` over masked actions.
    pub ratio_mean: f64,
    /// Share of masked actions whose ratio left [1 - c, 1 + c].
    pub clip_fraction: f64,
    /// `mean((logp_new - logp_old)^2) / 2` between the rollout policy and the current one.
    pub approx_kl: f64,
    /// Mean entropy of the policy at the masked actions.
    pub entropy: f64,
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

impl PpoModels {
    /// One PPO update on rows `rows` of `exp`. `micro` numbers the update (dropout keys).
    /// Returns the measurements and the optimizer steps it completed (actor, critic).
    pub fn train_rlhf(
        &mut self,
        exp: &Experience,
        rows: Range<usize>,
        cfg: &PpoConfig,
        seed: u64,
        micro: u64,
        device: &Device,
    ) -> Result<(UpdateStats, Option<StepReport>, Option<StepReport>)> {
        let (b, l, start) = (rows.len(), exp.l, exp.start);
        let seq = &exp.seq[rows.start * l..rows.end * l];
        let mask_tokens = &exp.attention_mask[rows.start * l..rows.end * l];
        let inputs = ForwardInputs::new(seq, mask_tokens, b, l, device)?;
        let old_logp = answer_slice(exp, &exp.logprobs, &rows, device)?;
        let old_values = answer_slice(exp, &exp.values, &rows, device)?;
        let mask = answer_slice(exp, &exp.action_mask, &rows, device)?;
        let advantages = answer_rows(exp, &exp.advantages, &rows, device)?;
        let returns = answer_rows(exp, &exp.returns, &rows, device)?;
        let next_tokens = inputs.ids.narrow(1, start + 1, l - 1 - start)?; // (b, A)

        // Actor: the LM head only on the answer's positions.
        let actor = &mut self.actor;
        let dropout = Dropout::from_config(&actor.config, DropoutKey { seed, step: micro, micro_batch: 0 });
        let how =
            Backward { checkpoint_activations: actor.checkpoint_activations, loss_scale: actor.trainer.loss_scale() };
        let seen: RefCell<Option<(Tensor, Tensor)>> = RefCell::new(None);
        let model = &actor.model;
        let actor_loss = forward_backward(
            model,
            &inputs.ids,
            &inputs.as_positions(),
            Some(&dropout),
            how,
            actor.trainer.grads(),
            |hidden| {
                let h = hidden.narrow(1, start, l - 1 - start)?; // (b, A, C)
                let logp_all = ops::log_softmax_last_dim(&model.loss_input(&model.lm_head(&h)?)?)?; // (b, A, V)
                let logp = logp_all
                    .gather(&next_tokens.unsqueeze(D::Minus1)?.contiguous()?, D::Minus1)?
                    .squeeze(D::Minus1)?
                    .to_dtype(DType::F32)?;
                let detached = logp_all.detach().to_dtype(DType::F32)?;
                let entropy = (detached.exp()? * &detached)?.sum(D::Minus1)?.neg()?; // (b, A)
                *seen.borrow_mut() = Some((logp.detach(), entropy));
                ppo::actor_loss(&logp, &old_logp, &advantages, &mask, cfg)
            },
        )?;
        let (new_logp, entropy) = seen.into_inner().expect("the actor head ran");

        // Critic.
        let critic = &mut self.critic;
        let dropout =
            Dropout::from_config(&critic.config, DropoutKey { seed: seed ^ 0xc417, step: micro, micro_batch: 0 });
        let how =
            Backward { checkpoint_activations: critic.checkpoint_activations, loss_scale: critic.trainer.loss_scale() };
        let rm = &critic.model;
        let critic_loss = forward_backward(
            &rm.trunk,
            &inputs.ids,
            &inputs.as_positions(),
            Some(&dropout),
            how,
            critic.trainer.grads(),
            |hidden| {
                let values = rm.token_scores(hidden)?.narrow(1, start, l - 1 - start)?; // (b, A)
                ppo::critic_loss(&values, &old_values, &returns, &mask, cfg)
            },
        )?;

        // Both steps after both backward passes, so that --align-overflow can look at both.
        let (actor_step, critic_step) = micro_batch_done_pair(
            (&mut self.actor.trainer, &self.actor.trainable),
            (&mut self.critic.trainer, &self.critic.trainable),
            self.align_overflow,
        )?;
        if let (Some(ema), Some(StepReport { skipped: false, .. })) = (&mut self.ema, actor_step) {
            update_ema(ema, &self.actor.params)?;
        }
        let stats = policy_stats(&new_logp, &old_logp, &entropy, &mask, cfg, actor_loss, critic_loss)?;
        Ok((stats, actor_step, critic_step))
    }

    /// The PTX loss on a batch of pretraining blocks, scaled by `unsup_coef`, as its own actor
    /// micro-batch (DS-Chat `train_unsupervised`). Returns the unscaled LM loss.
    pub fn train_unsupervised(
        &mut self,
        ids: &Tensor,
        targets: &Tensor,
        unsup_coef: f64,
        seed: u64,
        micro: u64,
    ) -> Result<(f32, Option<StepReport>)> {
        let actor = &mut self.actor;
        let dropout =
            Dropout::from_config(&actor.config, DropoutKey { seed: seed ^ 0x9715, step: micro, micro_batch: 0 });
        let how = Backward {
            checkpoint_activations: actor.checkpoint_activations,
            loss_scale: unsup_coef * actor.trainer.loss_scale(),
        };
        let loss = lm_forward_backward(&actor.model, ids, targets, Some(&dropout), how, actor.trainer.grads())?;
        let step = actor.trainer.micro_batch_done(&actor.trainable)?;
        if let (Some(ema), Some(StepReport { skipped: false, .. })) = (&mut self.ema, step) {
            update_ema(ema, &self.actor.params)?;
        }
        Ok((loss, step))
    }

    /// Applies what is left in the accumulators at the end of the run.
    pub fn flush(&mut self) -> Result<()> {
        if let Some(StepReport { skipped: false, .. }) = self.actor.trainer.flush(&self.actor.trainable)? {
            if let Some(ema) = &mut self.ema {
                update_ema(ema, &self.actor.params)?;
            }
        }
        self.critic.trainer.flush(&self.critic.trainable)?;
        Ok(())
    }
}

/// DS-Chat's `moving_average` with beta 0.992.
fn update_ema(ema: &ParamStore, actor: &ParamStore) -> Result<()> {
    for ((_, e), (_, a)) in ema.iter().zip(actor.iter()) {
        let mut ev: Vec<f32> = e.flatten_all()?.to_vec1()?;
        let av: Vec<f32> = a.flatten_all()?.to_vec1()?;
        ppo::ema_update(&mut ev, &av, 0.992);
        e.set(&Tensor::from_vec(ev, e.shape(), e.device())?)?;
    }
    Ok(())
}

fn policy_stats(
    new: &Tensor,
    old: &Tensor,
    entropy: &Tensor,
    mask: &Tensor,
    cfg: &PpoConfig,
    actor_loss: f32,
    critic_loss: f32,
) -> Result<UpdateStats> {
    let new: Vec<f32> = new.flatten_all()?.to_vec1()?;
    let old: Vec<f32> = old.flatten_all()?.to_vec1()?;
    let ent: Vec<f32> = entropy.flatten_all()?.to_vec1()?;
    let mask: Vec<f32> = mask.flatten_all()?.to_vec1()?;
    let (mut n, mut ratio, mut clipped, mut kl, mut h) = (0f64, 0f64, 0f64, 0f64, 0f64);
    for i in 0..mask.len() {
        if mask[i] > 0.0 {
            let d = f64::from(new[i] - old[i]);
            let r = d.exp();
            n += 1.0;
            ratio += r;
            clipped += f64::from(u8::from((r - 1.0).abs() > cfg.cliprange));
            kl += 0.5 * d * d;
            h += f64::from(ent[i]);
        }
    }
    let n = n.max(1.0);
    Ok(UpdateStats {
        actor_loss: f64::from(actor_loss),
        critic_loss: f64::from(critic_loss),
        ratio_mean: ratio / n,
        clip_fraction: clipped / n,
        approx_kl: kl / n,
        entropy: h / n,
    })
}
