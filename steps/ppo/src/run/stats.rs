//! What step 3 measures and says: the rollout's statistics reduced over the ranks, the step's
//! log line and metrics record, the answers printed, the run's summary.

use super::update::UpdateMeans;
use crate::eval::PolicyEval;
use crate::experience::Experience;
use crate::models::PpoModels;
use crate::ppo;
use anyhow::Result;
use data::Tokenizer;
use hybrid_engine::comm::{ProcessGroup, ReduceOp};
use hybrid_engine::training::metrics::Metrics;
use serde::Serialize;
use serde_json::json;

/// What step 3 did.
#[derive(Clone, Debug, Serialize)]
pub struct PpoSummary {
    pub steps: u64,
    /// The starting (SFT) actor and the PPO actor on `--eval-prompts`.
    pub sft_eval: Option<PolicyEval>,
    pub ppo_eval: Option<PolicyEval>,
    pub rollouts_reused: u64,
    pub answers_dropped_short: u64,
    /// Mean reward-model score of the rollouts in the first and last step.
    pub first_reward: Option<f64>,
    pub last_reward: Option<f64>,
    pub output_dir: std::path::PathBuf,
}

/// Sums over a rollout's rows behind [`RolloutStats`]: summed over the ranks, they give the
/// statistics of the whole rollout.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct RolloutSums {
    pub(super) rows: f64,
    pub(super) reward: f64,
    pub(super) reward_sq: f64,
    pub(super) kl_k1: f64,
    pub(super) kl_k3: f64,
    /// Per answer, the KL to the reference summed over its tokens (k1).
    pub(super) kl_sequence: f64,
    pub(super) answer_len: f64,
    pub(super) eos: f64,
    /// Per answer, the mean advantage over its tokens: their sum and sum of squares.
    pub(super) adv: f64,
    pub(super) adv_sq: f64,
    /// Over the unmasked answer actions: their count, the returns and the critic's errors.
    pub(super) actions: f64,
    pub(super) ret: f64,
    pub(super) ret_sq: f64,
    pub(super) err: f64,
    pub(super) err_sq: f64,
}

impl RolloutSums {
    pub(super) fn of(exp: &Experience) -> Self {
        let mut s = Self { rows: exp.b as f64, ..Self::default() };
        let width = exp.actions() - exp.start;
        for r in 0..exp.b {
            let score = f64::from(exp.scores[r]);
            (s.reward, s.reward_sq) = (s.reward + score, s.reward_sq + score * score);
            let mask = &exp.row(&exp.action_mask, r)[exp.start..];
            let (k1, k3) = ppo::kl_estimates(
                &exp.row(&exp.logprobs, r)[exp.start..],
                &exp.row(&exp.ref_logprobs, r)[exp.start..],
                mask,
            );
            (s.kl_k1, s.kl_k3) = (s.kl_k1 + k1, s.kl_k3 + k3);
            s.kl_sequence += k1 * mask.iter().map(|&m| f64::from(m)).sum::<f64>();
            s.answer_len += exp.answer_lens[r] as f64;
            s.eos += f64::from(u8::from(exp.ended_with_eos[r]));
            let values = &exp.row(&exp.values, r)[exp.start..];
            let returns = &exp.returns[r * width..(r + 1) * width];
            let advantages = &exp.advantages[r * width..(r + 1) * width];
            let tokens = mask.iter().map(|&m| f64::from(m)).sum::<f64>();
            let adv = mask.iter().zip(advantages).map(|(&m, &a)| f64::from(m * a)).sum::<f64>() / tokens.max(1.0);
            (s.adv, s.adv_sq) = (s.adv + adv, s.adv_sq + adv * adv);
            for ((&m, &v), &g) in mask.iter().zip(values).zip(returns) {
                if m > 0.0 {
                    let (g, e) = (f64::from(g), f64::from(g - v));
                    s.actions += 1.0;
                    (s.ret, s.ret_sq, s.err, s.err_sq) = (s.ret + g, s.ret_sq + g * g, s.err + e, s.err_sq + e * e);
                }
            }
        }
        s
    }

    pub(super) fn to_array(self) -> [f64; 15] {
        [
            self.rows,
            self.reward,
            self.reward_sq,
            self.kl_k1,
            self.kl_k3,
            self.kl_sequence,
            self.answer_len,
            self.eos,
            self.adv,
            self.adv_sq,
            self.actions,
            self.ret,
            self.ret_sq,
            self.err,
            self.err_sq,
        ]
    }

    pub(super) fn from_array(a: [f64; 15]) -> Self {
        let [rows, reward, reward_sq, kl_k1, kl_k3, kl_sequence, answer_len, eos, adv, adv_sq, actions, ret, ret_sq, err, err_sq] =
            a;
        Self {
            rows,
            reward,
            reward_sq,
            kl_k1,
            kl_k3,
            kl_sequence,
            answer_len,
            eos,
            adv,
            adv_sq,
            actions,
            ret,
            ret_sq,
            err,
            err_sq,
        }
    }

    /// The sums over every rank's rows.
    pub(super) fn over_ranks(self, group: &ProcessGroup) -> Result<Self> {
        let mut a = self.to_array();
        group.all_reduce_scalars(&mut a, ReduceOp::Sum)?;
        Ok(Self::from_array(a))
    }
}

/// The population variance of values with `n`, `sum` and `sum_sq`.
pub(super) fn variance(n: f64, sum: f64, sum_sq: f64) -> f64 {
    let mean = sum / n.max(1.0);
    (sum_sq / n.max(1.0) - mean * mean).max(0.0)
}

/// What a rollout says about the policy, over every rank's rows: reward, KL to the reference,
/// answer lengths, EOS share, how well the critic explains the returns.
/// A rollout's statistics over every rank: the log line's and metrics.jsonl's `rollout` (these
/// names; NaN is written as null).
#[derive(Clone, Copy, Debug, serde::Serialize)]
pub(super) struct RolloutStats {
    pub(super) reward_mean: f64,
    pub(super) reward_std: f64,
    pub(super) kl_ref_k1: f64,
    pub(super) kl_ref_sequence: f64,
    pub(super) kl_ref_k3: f64,
    pub(super) explained_variance: f64,
    pub(super) answer_len_mean: f64,
    pub(super) advantage_mean: f64,
    pub(super) advantage_std: f64,
    pub(super) eos_share: f64,
    pub(super) rows: f64,
    /// GRPO and RLOO: the share of the rollout's groups whose answers all scored the same.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) groups_zero_std: Option<f64>,
}

impl RolloutStats {
    pub(super) fn of(exp: &Experience, group: &ProcessGroup) -> Result<Self> {
        let s = RolloutSums::of(exp).over_ranks(group)?;
        let n = s.rows.max(1.0);
        Ok(Self {
            reward_mean: s.reward / n,
            reward_std: variance(s.rows, s.reward, s.reward_sq).sqrt(),
            kl_ref_k1: s.kl_k1 / n,
            kl_ref_sequence: s.kl_sequence / n,
            kl_ref_k3: s.kl_k3 / n,
            explained_variance: 1.0 - variance(s.actions, s.err, s.err_sq) / variance(s.actions, s.ret, s.ret_sq),
            answer_len_mean: s.answer_len / n,
            advantage_mean: s.adv / n,
            advantage_std: variance(s.rows, s.adv, s.adv_sq).sqrt(),
            eos_share: s.eos / n,
            rows: s.rows,
            groups_zero_std: None,
        })
    }
}

/// A rollout's statistics for the log, with the KL coefficient its rewards used.
pub(super) struct RolloutReport<'a> {
    pub(super) stats: &'a RolloutStats,
    pub(super) kl_ctl: f64,
    /// `--kl-target` adapts the coefficient: the log line shows it.
    pub(super) adaptive: bool,
}

/// A PPO step's seconds on this rank: the rollout (`generate`, then the experience) and training.
#[derive(Clone, Copy)]
pub(super) struct PhaseSecs {
    pub(super) generate: f64,
    pub(super) rollout: f64,
    pub(super) train: f64,
}

#[allow(clippy::too_many_arguments)]
pub(super) fn log_step(
    metrics: &mut Metrics,
    epoch: usize,
    step: u64,
    total: u64,
    rollout: &RolloutReport,
    updates: &UpdateMeans,
    times: PhaseSecs,
    models: &PpoModels,
) -> Result<()> {
    let (u, stats, critic) = (&updates.stats, rollout.stats, models.critic.as_ref());
    // The ratio and the clip fraction the log line shows: over the updates after the phase's
    // first (whose ratio is 1 by construction) when there are some.
    let shown = updates.later.unwrap_or(*u);
    let record = json!({
        "step": step,
        "epoch": epoch,
        "rollout": stats,
        "kl_ctl": rollout.kl_ctl,
        "actor_loss": u.actor_loss,
        "critic_loss": critic.map(|_| u.critic_loss),
        "ratio_mean": u.ratio_mean,
        "clip_fraction": u.clip_fraction,
        "approx_kl": u.approx_kl,
        "ratio_mean_after_first": updates.later.map(|l| l.ratio_mean),
        "clip_fraction_after_first": updates.later.map(|l| l.clip_fraction),
        "approx_kl_after_first": updates.later.map(|l| l.approx_kl),
        "updates_stopped_early": updates.stopped_early.map(|(done, planned)| json!({"done": done, "planned": planned})),
        "entropy": u.entropy,
        "ptx_loss": updates.ptx_loss,
        "actor_lr": models.actor.trainer().latest_lr(),
        "critic_lr": critic.map(|c| c.trainer().latest_lr()),
        "actor_loss_scale": models.actor.trainer().dynamic_loss_scale(),
        "critic_loss_scale": critic.map(|c| c.trainer().dynamic_loss_scale()),
        "actor_skipped_steps": models.actor.trainer().skipped_steps(),
        "critic_skipped_steps": critic.map(|c| c.trainer().skipped_steps()),
        "generation_secs": times.rollout,
        "generate_secs": times.generate,
        "experience_secs": times.rollout - times.generate,
        "training_secs": times.train,
    });
    // fp16 runs also show each model's loss scale and skipped updates.
    let actor = models.actor.trainer();
    let scaling = match (&actor.scaler, critic.map(|c| (&c.trainer().scaler, c.trainer().skipped_steps()))) {
        (Some(a), Some((Some(c), skipped))) => {
            format!(" loss scale {}/{} | skipped {}/{skipped} |", a.scale, c.scale, actor.skipped_steps())
        }
        (Some(a), None) => format!(" loss scale {} | skipped {} |", a.scale, actor.skipped_steps()),
        _ => String::new(),
    };
    let kl_ctl = if rollout.adaptive { format!(" (kl_ctl {:.4})", rollout.kl_ctl) } else { String::new() };
    let stopped = match updates.stopped_early {
        Some((done, planned)) => format!(" | stopped at target KL after {done}/{planned} updates"),
        None => String::new(),
    };
    // The critic's loss and how much of the return it explains, when there is one.
    let critic_loss =
        critic.map(|_| format!(" | critic loss {:.4} | expl var {:.3}", u.critic_loss, stats.explained_variance));
    metrics.println(&format!(
        " step {step:>5}/{total} | epoch {epoch} | reward {:.3} (std {:.3}) | kl_ref {:.4}{kl_ctl} | actor loss {:.4}{} | ratio {:.3} | clip {:.3} | approx kl {:.2e} | entropy {:.3} | answer len {:.1} | eos {:.2} | generate {:.1}s experience {:.1}s train {:.1}s{stopped} |{scaling}",
        stats.reward_mean,
        stats.reward_std,
        stats.kl_ref_k3,
        u.actor_loss,
        critic_loss.unwrap_or_default(),
        shown.ratio_mean,
        shown.clip_fraction,
        shown.approx_kl,
        u.entropy,
        stats.answer_len_mean,
        stats.eos_share,
        times.generate,
        times.rollout - times.generate,
        times.train,
    ));
    metrics.record(record)?;
    metrics.advance(format!("reward {:.3}", stats.reward_mean));
    Ok(())
}

/// A few decoded rollouts (DS-Chat `--print_answers`), printed, and as a table in TensorBoard's
/// text panel `rollout/samples` at `step`.
pub(super) fn print_answers(
    metrics: &mut Metrics,
    step: u64,
    exp: &Experience,
    tok: &Tokenizer,
    pad: u32,
    n: usize,
) -> Result<()> {
    let p = exp.start + 1;
    let mut table = String::from("| prompt | answer | reward |\n|---|---|---|\n");
    let cell = hybrid_engine::telemetry::markdown_cell;
    for r in 0..exp.b.min(n) {
        let row = &exp.seq[r * exp.l..(r + 1) * exp.l];
        let prompt: Vec<u32> =
            row[..p].iter().zip(&exp.attention_mask[r * exp.l..]).filter(|(_, m)| **m == 1).map(|(t, _)| *t).collect();
        let answer: Vec<u32> = row[p..].iter().copied().take_while(|&t| t != pad).collect();
        let (prompt, answer) = (tok.decode(&prompt)?, tok.decode(&answer)?);
        metrics.println(&format!("--- prompt: {prompt:?}\n--- answer: {answer:?} (reward {:.3})", exp.scores[r]));
        table.push_str(&format!("| {} | {} | {:.3} |\n", cell(&prompt), cell(&answer), exp.scores[r]));
    }
    metrics.text(step as i64, "rollout/samples", &table)
}
