//! The stage between experience and training (DS-Chat's `get_advantages_and_returns`, TRL's
//! and OpenRLHF's advantage estimators): each kept row's advantage on its answer's actions, and
//! its returns for the critic.
//!
//! - PPO: GAE over each row's KL-penalised rewards and the critic's values ([`gae_advantages`]);
//! - GRPO: each answer's score against its prompt's group, centred and scaled
//!   ([`group_advantages`]);
//! - RLOO: each answer's sequence reward less the mean of the other answers to its prompt
//!   ([`leave_one_out_advantages`]);
//! - REINFORCE++: each token's discounted return of the token-level rewards, normalised over
//!   the rollout ([`reinforce_pp_returns`], then [`ppo::whiten`]).
//!
//! The group estimators see every rank's answers: the rewards are summed over the data-parallel
//! group by rollout position first ([`compute_advantages`]).

use crate::experience::Experience;
use crate::ppo::{self, Algorithm, PpoConfig, RewardScaling};
use anyhow::Result;
use hybrid_engine::comm::{ProcessGroup, ReduceOp};

/// Sets the advantages and returns of `exp`'s rows (a rollout whose prompts came `samples`
/// times each, the answers to one prompt at consecutive positions). Every rank of `group` calls
/// it with its share of the rollout (the critic-free algorithms reduce over the group). Returns,
/// for GRPO and RLOO, the share of the rollout's groups (of two kept answers or more) whose
/// answers all scored the same: they teach nothing (TRL's `frac_reward_zero_std`).
pub fn compute_advantages(
    exp: &mut Experience,
    group: &ProcessGroup,
    samples: usize,
    cfg: &PpoConfig,
) -> Result<Option<f64>> {
    let (start, width) = (exp.start, exp.actions() - exp.start);
    let without_spread = match cfg.algorithm {
        Algorithm::Ppo => {
            for r in 0..exp.b {
                let (a, g) = gae_advantages(exp.row(&exp.rewards, r), exp.row(&exp.values, r), start, cfg);
                exp.advantages[r * width..(r + 1) * width].copy_from_slice(&a);
                exp.returns[r * width..(r + 1) * width].copy_from_slice(&g);
            }
            None
        }
        Algorithm::ReinforcePp => {
            for r in 0..exp.b {
                let a = reinforce_pp_returns(exp.row(&exp.rewards, r), start, cfg.gamma);
                exp.advantages[r * width..(r + 1) * width].copy_from_slice(&a);
            }
            None
        }
        Algorithm::Grpo | Algorithm::Rloo => Some(critic_free_advantages(exp, group, samples, cfg)?),
    };
    // REINFORCE++'s returns are normalised over the rollout as its definition says.
    if cfg.whiten_advantages || cfg.algorithm == Algorithm::ReinforcePp {
        whiten_advantages(exp, group)?;
    }
    Ok(without_spread)
}

/// REINFORCE++'s advantage before normalisation (OpenRLHF's `get_cumulative_returns`): each
/// action's discounted return `G[t] = r[t] + gamma G[t+1]` over actions `start..` of a row's
/// token-level rewards (zero from the row's end on). No critic: GAE with V = 0 and lambda = 1.
pub fn reinforce_pp_returns(rewards: &[f32], start: usize, gamma: f64) -> Vec<f32> {
    let gamma = gamma as f32;
    let mut out = vec![0f32; rewards.len() - start];
    let mut next = 0f32;
    for t in (start..rewards.len()).rev() {
        next = rewards[t] + gamma * next;
        out[t - start] = next;
    }
    out
}

/// `--whiten-advantages`: the rollout's advantages centred and scaled over every rank's answer
/// tokens ([`ppo::whiten`]; the returns, the critic's targets, are left as they are).
fn whiten_advantages(exp: &mut Experience, group: &ProcessGroup) -> Result<()> {
    let mask: Vec<f32> = (0..exp.b).flat_map(|r| exp.row(&exp.action_mask, r)[exp.start..].to_vec()).collect();
    assert_eq!(mask.len(), exp.advantages.len(), "an advantage per answer action");
    let mut sums = [0f64; 3];
    for (&a, &m) in exp.advantages.iter().zip(&mask) {
        if m > 0.0 {
            let a = f64::from(a);
            sums = [sums[0] + 1.0, sums[1] + a, sums[2] + a * a];
        }
    }
    group.all_reduce_scalars(&mut sums, ReduceOp::Sum)?;
    ppo::whiten(&mut exp.advantages, &mask, sums);
    Ok(())
}

/// GRPO's and RLOO's advantages of this rank's rows of a rollout whose prompts came
/// `samples` times each: every rank's [`group_rewards`] put at their rollout positions and
/// summed over the data-parallel group (a rank that kept no rows adds zeros), so that each
/// rank sees the whole group of each of its rows. Returns the share of the rollout's groups (of
/// two kept answers or more) whose answers all scored the same: they teach nothing (TRL's
/// `frac_reward_zero_std`).
fn critic_free_advantages(exp: &mut Experience, group: &ProcessGroup, samples: usize, cfg: &PpoConfig) -> Result<f64> {
    // Per position: the reward, and 1 where a rank kept the row.
    let mut by_position = vec![0f64; 2 * exp.rollout_size];
    for (&position, reward) in exp.positions.iter().zip(group_rewards(exp, cfg)) {
        (by_position[2 * position], by_position[2 * position + 1]) = (reward, 1.0);
    }
    group.all_reduce_scalars(&mut by_position, ReduceOp::Sum)?;
    let rewards: Vec<Option<f64>> = by_position.chunks(2).map(|p| (p[1] > 0.0).then_some(p[0])).collect();
    set_group_advantages(exp, &rewards, samples, cfg);
    Ok(share_of_groups_without_spread(&rewards, samples))
}

/// The reward each row of `exp` brings to its group: GRPO's clipped score, RLOO's score less
/// its summed KL penalty ([`ppo::sequence_reward`]).
pub fn group_rewards(exp: &Experience, cfg: &PpoConfig) -> Vec<f64> {
    let rloo = cfg.algorithm == Algorithm::Rloo;
    (0..exp.b)
        .map(|r| {
            let [logp, ref_logp, mask] =
                [&exp.logprobs, &exp.ref_logprobs, &exp.action_mask].map(|a| &exp.row(a, r)[exp.start..]);
            let cfg = PpoConfig { kl_ctl: if rloo { cfg.kl_ctl } else { 0.0 }, ..cfg.clone() };
            ppo::sequence_reward(exp.reward_scores[r], logp, ref_logp, mask, &cfg)
        })
        .collect()
}

/// GRPO's or RLOO's advantages of `exp`'s rows from every row of the rollout:
/// `by_position[p]` is the [`group_rewards`] value of the row at rollout position `p` (on any
/// rank), `None` when it was dropped; the rows of a prompt's group are the `k` consecutive
/// positions of its answers. Each row's advantage goes on every answer action (the loss masks
/// the padding); the returns stay zero (no critic).
pub fn set_group_advantages(exp: &mut Experience, by_position: &[Option<f64>], k: usize, cfg: &PpoConfig) {
    let width = exp.actions() - exp.start;
    let batch_std = batch_std(by_position);
    for r in 0..exp.b {
        let position = exp.positions[r];
        let first = position / k * k;
        let group = &by_position[first..(first + k).min(by_position.len())];
        let advantages = match cfg.algorithm {
            Algorithm::Grpo => group_advantages(group, cfg.scale_rewards, batch_std),
            Algorithm::Rloo => leave_one_out_advantages(group),
            Algorithm::Ppo | Algorithm::ReinforcePp => unreachable!("their advantages are per token"),
        };
        let a = advantages[position - first].expect("a kept row has a reward") as f32;
        exp.advantages[r * width..(r + 1) * width].fill(a);
    }
}

/// GAE over actions `start..` (DS-Chat `get_advantages_and_returns`, no whitening):
/// `delta = r[t] + gamma V[t+1] - V[t]` (V beyond the last action is 0),
/// `A[t] = delta + gamma lam A[t+1]`, returns `G = A + V`. Both are `len - start` long.
/// `values` must already be zeroed from the row's end on, as `rewards` is.
pub fn gae_advantages(rewards: &[f32], values: &[f32], start: usize, cfg: &PpoConfig) -> (Vec<f32>, Vec<f32>) {
    assert_eq!(rewards.len(), values.len(), "gae_advantages: rewards and values differ in length");
    let (gamma, lam) = (cfg.gamma as f32, cfg.lam as f32);
    let n = rewards.len();
    let mut adv = vec![0f32; n - start];
    let mut last = 0f32;
    for t in (start..n).rev() {
        let next = if t + 1 < n { values[t + 1] } else { 0.0 };
        let delta = rewards[t] + gamma * next - values[t];
        last = delta + gamma * lam * last;
        adv[t - start] = last;
    }
    let returns = adv.iter().zip(&values[start..]).map(|(a, v)| a + v).collect();
    (adv, returns)
}

/// The sample standard deviation (torch's default, unbiased) of at least two values.
fn sample_std(values: &[f64]) -> f64 {
    let n = values.len() as f64;
    let mean = values.iter().sum::<f64>() / n;
    (values.iter().map(|r| (r - mean).powi(2)).sum::<f64>() / (n - 1.0)).sqrt()
}

/// The standard deviation of every kept score of a rollout: [`RewardScaling::Batch`]'s scale
/// (0 for fewer than two).
pub fn batch_std(rewards: &[Option<f64>]) -> f64 {
    let kept: Vec<f64> = rewards.iter().flatten().copied().collect();
    if kept.len() < 2 {
        0.0
    } else {
        sample_std(&kept)
    }
}

/// GRPO's advantage of each answer of one prompt's group: `(r - mean) / (scale + 1e-4)` over
/// the answers kept (`None`: dropped), the scale the group's sample standard deviation
/// ([`RewardScaling::Group`], TRL's GRPOTrainer), `batch_std` ([`RewardScaling::Batch`]), or
/// none (`r - mean`, [`RewardScaling::None`]). A group of one kept answer, or of equal scores,
/// gives 0: nothing to compare it with.
pub fn group_advantages(rewards: &[Option<f64>], scaling: RewardScaling, batch_std: f64) -> Vec<Option<f64>> {
    let kept: Vec<f64> = rewards.iter().flatten().copied().collect();
    if kept.len() < 2 {
        return rewards.iter().map(|r| r.map(|_| 0.0)).collect();
    }
    let mean = kept.iter().sum::<f64>() / kept.len() as f64;
    let scale = match scaling {
        RewardScaling::Group => sample_std(&kept) + 1e-4,
        RewardScaling::Batch => batch_std + 1e-4,
        RewardScaling::None => 1.0,
    };
    rewards.iter().map(|r| r.map(|r| (r - mean) / scale)).collect()
}

/// Of the groups of `k` consecutive answers with at least two kept, the share whose kept answers
/// all scored the same (0 when there is no such group): a group baseline gives them all a zero
/// advantage.
pub fn share_of_groups_without_spread(rewards: &[Option<f64>], k: usize) -> f64 {
    let (mut groups, mut flat) = (0usize, 0usize);
    for group in rewards.chunks(k.max(1)) {
        let kept: Vec<f64> = group.iter().flatten().copied().collect();
        if kept.len() >= 2 {
            groups += 1;
            flat += usize::from(kept.iter().all(|&r| r == kept[0]));
        }
    }
    if groups == 0 {
        0.0
    } else {
        flat as f64 / groups as f64
    }
}

/// [`group_advantages`] scaled by the group's standard deviation (DeepSeekMath's GRPO).
pub fn group_normalized_advantages(rewards: &[Option<f64>]) -> Vec<Option<f64>> {
    group_advantages(rewards, RewardScaling::Group, 0.0)
}

/// RLOO's advantage of each answer of one prompt's group: `r_i - mean_{j != i} r_j` over the
/// answers kept (`None`: dropped), which is `k / (k - 1) * (r_i - mean)`. A lone kept answer
/// has no baseline and gets 0.
pub fn leave_one_out_advantages(rewards: &[Option<f64>]) -> Vec<Option<f64>> {
    let kept: Vec<f64> = rewards.iter().flatten().copied().collect();
    let (k, sum) = (kept.len() as f64, kept.iter().sum::<f64>());
    rewards.iter().map(|r| r.map(|r| if kept.len() < 2 { 0.0 } else { r - (sum - r) / (k - 1.0) })).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: &[f32], b: &[f32]) {
        assert_eq!(a.len(), b.len(), "{a:?} vs {b:?}");
        for (x, y) in a.iter().zip(b) {
            assert!((x - y).abs() < 1e-5, "{a:?} vs {b:?}");
        }
    }

    /// REINFORCE++'s returns by hand: rewards [x, -0.1, -0.2, 1.0, 0] from action 1 on, gamma
    /// 0.5: G = [-0.1 + 0.5 (-0.2 + 0.5 (1.0 + 0)), -0.2 + 0.5, 1.0, 0] = [0.05, 0.3, 1.0, 0].
    #[test]
    fn reinforce_pp_returns_discount_the_token_rewards() {
        let got = reinforce_pp_returns(&[9.0, -0.1, -0.2, 1.0, 0.0], 1, 0.5);
        let want = [0.05f32, 0.3, 1.0, 0.0];
        assert!(got.iter().zip(want).all(|(a, b)| (a - b).abs() < 1e-6), "{got:?}");
        assert_eq!(reinforce_pp_returns(&[1.0, 2.0, 3.0], 0, 1.0), [6.0, 5.0, 3.0], "gamma 1: rewards to go");
    }

    #[test]
    fn gae_matches_hand_computed_two_steps() {
        let cfg = PpoConfig { gamma: 0.9, lam: 0.5, ..PpoConfig::default() };
        // start = 1; actions 1 and 2.
        let rewards = [9.0, 1.0, 2.0];
        let values = [9.0, 0.5, 1.5];
        let (adv, ret) = gae_advantages(&rewards, &values, 1, &cfg);
        // t = 2: delta = 2 + 0.9 * 0 - 1.5 = 0.5; A2 = 0.5.
        // t = 1: delta = 1 + 0.9 * 1.5 - 0.5 = 1.85; A1 = 1.85 + 0.9 * 0.5 * 0.5 = 2.075.
        close(&adv, &[2.075, 0.5]);
        close(&ret, &[2.575, 2.0]);
        // DS-Chat's defaults (gamma 1, lam 0.95) on the same row.
        let (adv, _) = gae_advantages(&rewards, &values, 1, &PpoConfig::default());
        close(&adv, &[(1.0 + 1.5 - 0.5) + 0.95 * 0.5, 0.5]);
    }

    /// A group of 4 answers, one dropped: mean 2, sample std sqrt(((1-2)^2 + 0 + 1) / 2) = 1.
    #[test]
    fn group_normalized_advantages_hand_computed() {
        let adv = group_normalized_advantages(&[Some(1.0), None, Some(2.0), Some(3.0)]);
        let want = [Some(-1.0 / 1.0001), None, Some(0.0), Some(1.0 / 1.0001)];
        for (a, w) in adv.iter().zip(want) {
            assert_eq!(a.is_some(), w.is_some());
            assert!((a.unwrap_or(0.0) - w.unwrap_or(0.0)).abs() < 1e-12, "{adv:?}");
        }
        // Equal scores and lone answers teach nothing.
        assert_eq!(group_normalized_advantages(&[Some(4.0), Some(4.0)]), [Some(0.0), Some(0.0)]);
        assert_eq!(group_normalized_advantages(&[Some(4.0), None]), [Some(0.0), None]);
    }

    /// Scores 1, 2, 6 (mean 3): Dr. GRPO leaves -2, -1, 3; batch scaling divides by the given
    /// rollout's std; the rollout [1, 2, 6, 4, 4] has mean 3.4 and sample variance
    /// (5.76 + 1.96 + 6.76 + 0.36 + 0.36) / 4 = 3.8.
    #[test]
    fn group_advantages_unscaled_and_batch_scaled_hand_computed() {
        let group = [Some(1.0), Some(2.0), None, Some(6.0)];
        assert_eq!(group_advantages(&group, RewardScaling::None, 0.0), [Some(-2.0), Some(-1.0), None, Some(3.0)]);
        let std = batch_std(&[Some(1.0), Some(2.0), Some(6.0), None, Some(4.0), Some(4.0)]);
        assert!((std - 3.8f64.sqrt()).abs() < 1e-12, "{std}");
        let adv = group_advantages(&group, RewardScaling::Batch, std);
        for (a, w) in adv.iter().zip([Some(-2.0), Some(-1.0), None, Some(3.0)]) {
            assert_eq!(a.is_some(), w.is_some());
            assert!((a.unwrap_or(0.0) - w.unwrap_or(0.0) / (3.8f64.sqrt() + 1e-4)).abs() < 1e-12, "{adv:?}");
        }
        // Lone answers still teach nothing, whatever the scale.
        assert_eq!(group_advantages(&[Some(4.0), None], RewardScaling::None, 1.0), [Some(0.0), None]);
        assert_eq!(batch_std(&[Some(4.0), None]), 0.0);
    }

    /// Groups of 2: [1, 1] flat, [1, 2] not, [3, None] too small to count, [5, 5] flat.
    #[test]
    fn share_of_groups_without_spread_counts_groups_of_two_kept_or_more() {
        let rewards = [Some(1.0), Some(1.0), Some(1.0), Some(2.0), Some(3.0), None, Some(5.0), Some(5.0)];
        assert!((share_of_groups_without_spread(&rewards, 2) - 2.0 / 3.0).abs() < 1e-12);
        assert_eq!(share_of_groups_without_spread(&[Some(1.0), None], 2), 0.0);
    }

    /// The smallest group that teaches, two answers scored 1 and 3: GRPO's -1 and 1 over the
    /// sample std sqrt(2) (or unscaled), RLOO's 1 - 3 and 3 - 1.
    #[test]
    fn groups_of_two_answers_are_compared() {
        let two = [Some(1.0), Some(3.0)];
        assert_eq!(group_advantages(&two, RewardScaling::None, 0.0), [Some(-1.0), Some(1.0)]);
        let scale = 2f64.sqrt() + 1e-4;
        assert_eq!(group_normalized_advantages(&two), [Some(-1.0 / scale), Some(1.0 / scale)]);
        assert_eq!(leave_one_out_advantages(&two), [Some(-2.0), Some(2.0)]);
    }

    /// Two kept rows of 3 actions from action 1 (width 2): row 0 answers on both actions, row 1
    /// on its first only (its second is padding). Scores 1 and 3; the policy's log-probs are
    /// 0.25 above the reference's on every action (0.5 and 0.25 summed over the answers).
    fn two_rows(algorithm: Algorithm) -> (Experience, PpoConfig) {
        let exp = Experience {
            seq: vec![0; 8],
            b: 2,
            rewards: vec![9.0, 1.0, 2.0, 9.0, 4.0, 0.0],
            values: vec![0.0; 6],
            action_mask: vec![0.0, 1.0, 1.0, 0.0, 1.0, 0.0],
            logprobs: vec![-1.0; 6],
            ref_logprobs: vec![-1.25; 6],
            advantages: vec![0.0; 4],
            returns: vec![0.0; 4],
            reward_scores: vec![1.0, 3.0],
            positions: vec![0, 1],
            l: 4,
            ..Experience::empty(2, 2) // prompts of 2 tokens: the answer from action 1
        };
        (exp, PpoConfig { algorithm, gamma: 1.0, kl_ctl: 0.1, ..PpoConfig::default() })
    }

    /// REINFORCE++ whitens its returns over the answer actions alone: the returns-to-go 3 and
    /// 2 (row 0) and 4 (row 1) have mean 3 and sample std 1; row 1's padding keeps its 0.
    #[test]
    fn whitening_reads_only_the_answer_actions() -> Result<()> {
        let (mut exp, cfg) = two_rows(Algorithm::ReinforcePp);
        assert_eq!(compute_advantages(&mut exp, &ProcessGroup::single(), 1, &cfg)?, None);
        let scale = 1.0 / (1.0f64 + 1e-8).sqrt();
        close(&exp.advantages, &[0.0, (-scale) as f32, scale as f32, 0.0]);
        Ok(())
    }

    /// GRPO compares the clipped scores alone; RLOO's sequence rewards take the KL penalty,
    /// 0.1 x the summed log-ratio: 1 - 0.05 and 3 - 0.025. Each row's advantage fills its
    /// actions; no returns without a critic.
    #[test]
    fn grpo_ignores_the_kl_penalty_and_rloo_takes_it() -> Result<()> {
        let (mut exp, cfg) = two_rows(Algorithm::Grpo);
        assert_eq!(group_rewards(&exp, &cfg), [1.0, 3.0]);
        assert_eq!(compute_advantages(&mut exp, &ProcessGroup::single(), 2, &cfg)?, Some(0.0));
        let a = (1.0 / (2f64.sqrt() + 1e-4)) as f32;
        close(&exp.advantages, &[-a, -a, a, a]);
        assert_eq!(exp.returns, [0.0; 4]);

        let (mut exp, cfg) = two_rows(Algorithm::Rloo);
        let want = [1.0 - 0.05, 3.0 - 0.025];
        assert!(group_rewards(&exp, &cfg).iter().zip(want).all(|(r, w)| (r - w).abs() < 1e-12));
        compute_advantages(&mut exp, &ProcessGroup::single(), 2, &cfg)?;
        let a = (want[0] - want[1]) as f32;
        close(&exp.advantages, &[a, a, -a, -a]);
        Ok(())
    }

    /// Rewards 1, 2, 6: baselines (2 + 6) / 2 = 4, (1 + 6) / 2 = 3.5, (1 + 2) / 2 = 1.5.
    #[test]
    fn leave_one_out_advantages_hand_computed() {
        let adv = leave_one_out_advantages(&[Some(1.0), Some(2.0), None, Some(6.0)]);
        assert_eq!(adv, [Some(-3.0), Some(-1.5), None, Some(4.5)]);
        assert_eq!(leave_one_out_advantages(&[None, Some(3.0)]), [None, Some(0.0)]);
    }
}
