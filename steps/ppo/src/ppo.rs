//! PPO's math, DS-Chat `ppo_trainer.py` semantics (`compute_rewards`,
//! `get_advantages_and_returns`, `actor_loss_fn`, `critic_loss_fn`), as pure functions with the
//! hyperparameters passed in a [`PpoConfig`] (DS-Chat hard-codes them in `__init__`).
//!
//! Shapes: B rows, L = P + A tokens per sequence (P the padded prompt, A the answer limit);
//! per-action arrays have L - 1 entries: action t emits token t + 1, so the first answer token
//! is emitted by action `start = P - 1`.

use candle_core::{Result, Tensor};

/// PPO constants (DS-Chat's defaults).
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct PpoConfig {
    /// Weight of the per-token KL penalty against the reference model.
    pub kl_ctl: f64,
    /// The reward model's score is clipped to +-this.
    pub clip_reward_value: f64,
    /// Policy ratio clip: the ratio is kept within [1 - cliprange, 1 + cliprange].
    pub cliprange: f64,
    /// DAPO's clip-higher: the upper bound becomes 1 + this (absent: 1 + cliprange), so that an
    /// unlikely token with a positive advantage can grow further in one update. Not written when
    /// absent, so that the checkpoints of earlier versions resume with the same flags.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cliprange_high: Option<f64>,
    /// Value clip around the old values.
    pub cliprange_value: f64,
    pub gamma: f64,
    pub lam: f64,
    /// How answers become advantages (`--algorithm`); PPO when absent (older checkpoints).
    #[serde(default)]
    pub algorithm: Algorithm,
    /// How GRPO scales its centred scores (`--scale-rewards`); by the group's std when absent.
    #[serde(default)]
    pub scale_rewards: RewardScaling,
    /// How the policy loss averages its tokens (`--loss-type`); token-level when absent. Not
    /// written at the default, so that earlier checkpoints resume with the same flags.
    #[serde(default, skip_serializing_if = "LossType::is_default")]
    pub loss_type: LossType,
    /// `--whiten-advantages`: each rollout's advantages centred and scaled over its answer
    /// tokens (TRL's and OpenRLHF's default for PPO). Not written when off.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub whiten_advantages: bool,
    /// The action that emits EOS is an action like the others: the actor, the critic and the
    /// KL terms read it (TRL, OpenRLHF), so the policy learns when to stop. Off
    /// (`--mask-eos-action`): DS-Chat's mask, `seq[t + 1] != pad`, which with GPT-2 (pad = EOS)
    /// leaves it out. Written only when on, so that the checkpoints of earlier versions (which
    /// masked it) resume only with `--mask-eos-action`.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub eos_action: bool,
    /// `--max-answer-seq-len`: Dr. GRPO's constant divisor (per answer).
    #[serde(skip)]
    pub max_answer_len: usize,
    /// The temperature rollouts sample at (`--temperature` with `--do-sample`; 1 for greedy
    /// rollouts): the policy the ratio and the KL read is the one sampled, softmax(logits / T),
    /// as TRL and OpenRLHF temper the old, new and reference log-probs.
    #[serde(skip)]
    pub temperature: f64,
}

impl PpoConfig {
    /// The policy ratio's clip range, [1 - cliprange, 1 + (cliprange_high or cliprange)].
    pub fn ratio_bounds(&self) -> (f64, f64) {
        (1.0 - self.cliprange, 1.0 + self.cliprange_high.unwrap_or(self.cliprange))
    }
}

impl Default for PpoConfig {
    fn default() -> Self {
        Self {
            kl_ctl: 0.1,
            clip_reward_value: 5.0,
            cliprange: 0.2,
            cliprange_high: None,
            cliprange_value: 0.2,
            gamma: 1.0,
            lam: 0.95,
            algorithm: Algorithm::Ppo,
            scale_rewards: RewardScaling::Group,
            loss_type: LossType::Bnpo,
            whiten_advantages: false,
            eos_action: true,
            max_answer_len: 0,
            temperature: 1.0,
        }
    }
}

/// How the policy loss (and GRPO's KL term) averages its per-token values over a global
/// micro-batch (`--loss-type`, TRL's `loss_type`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LossType {
    /// Token-level: the sum over every answer token divided by their number (BNPO; over all
    /// ranks, as DAPO's global token count), so a long answer weighs by its length.
    #[default]
    Bnpo,
    /// DeepSeekMath's GRPO: each answer's mean over its tokens, then the mean over the answers,
    /// so every answer weighs the same whatever its length.
    Grpo,
    /// Liu et al.'s Dr. GRPO: the sum over every answer token divided by answers x
    /// `--max-answer-seq-len`, a constant, so no length bias either way.
    #[value(name = "dr_grpo", alias = "dr-grpo")]
    DrGrpo,
}

impl LossType {
    fn is_default(&self) -> bool {
        *self == Self::default()
    }

    /// Whether the loss is a mean over answers (each rank's share of a global micro-batch is
    /// then its share of the answers) rather than over tokens.
    pub fn per_answer(self) -> bool {
        self != Self::Bnpo
    }
}

/// The mean of `per_token` (B, N) over the masked tokens as `how` averages them (see
/// [`LossType`]); `max_len` is Dr. GRPO's constant (the width N when 0).
pub fn aggregate_loss(per_token: &Tensor, mask: &Tensor, how: LossType, max_len: usize) -> Result<Tensor> {
    let masked = (per_token * mask)?;
    match how {
        LossType::Bnpo => masked.sum_all()? / mask.sum_all()?.to_scalar::<f32>()?.max(1.0) as f64,
        LossType::Grpo => {
            let per_answer = masked.sum(1)?.div(&mask.sum(1)?.maximum(1.0)?)?;
            per_answer.mean_all()
        }
        LossType::DrGrpo => {
            let (b, n) = per_token.dims2()?;
            let len = if max_len == 0 { n } else { max_len };
            masked.sum_all()? / (b * len) as f64
        }
    }
}

/// TRL's `masked_whiten`: `values` centred on their mean over the unmasked entries and scaled by
/// their standard deviation (unbiased), `(v - mean) / sqrt(var + 1e-8)`; `sums` = (count, sum,
/// sum of squares) over every rank's entries. Masked entries are left as they are.
pub fn whiten(values: &mut [f32], mask: &[f32], [count, sum, sum_sq]: [f64; 3]) {
    if count < 2.0 {
        return;
    }
    let mean = sum / count;
    let var = (sum_sq / count - mean * mean).max(0.0) * count / (count - 1.0);
    let scale = 1.0 / (var + 1e-8).sqrt();
    for (v, &m) in values.iter_mut().zip(mask) {
        if m > 0.0 {
            *v = ((f64::from(*v) - mean) * scale) as f32;
        }
    }
}

/// Which of a row's L - 1 actions the losses and the KL terms read, 1 or 0. DS-Chat's
/// `seq[t + 1] != pad`; with `eos_action` also the action that emitted EOS (the first pad after
/// the answer, action `end - 1` of [`end_of_answer`], when the answer did not hit the length
/// limit), as TRL and OpenRLHF keep it. With GPT-2, pad = EOS: DS-Chat's mask drops the one
/// action that decides where the answer stops, the one its score lands on.
pub fn action_mask(seq: &[u32], pad: u32, start: usize, eos_action: bool) -> Vec<f32> {
    let mut mask: Vec<f32> = seq.windows(2).map(|w| f32::from(u8::from(w[1] != pad))).collect();
    let eos = end_of_answer(seq, pad, start) - 1;
    if eos_action && eos < mask.len() {
        mask[eos] = 1.0;
    }
    mask
}

/// DS-Chat's `end` of a row of L tokens whose first answer token action `start` emits:
/// `start + n + 1` with n the answer's non-pad tokens. The reward lands on action `end - 1`;
/// rewards and values are zeroed from `end` on. With GPT-2 (pad = EOS) action `end - 1` is the
/// one that emitted EOS, or, when the answer hit the length limit, one past the last action,
/// which DS-Chat's slicing clamps to the last action ([`reward_index`]).
pub fn end_of_answer(seq: &[u32], pad: u32, start: usize) -> usize {
    start + seq[start + 1..].iter().filter(|&&t| t != pad).count() + 1
}

/// Where the score is added: `end - 1`, clamped to the last action (Python's slice
/// `rewards[start:end][-1]` on a row of `actions` entries).
pub fn reward_index(end: usize, actions: usize) -> usize {
    end.min(actions) - 1
}

/// One row's rewards: `-kl_ctl * (logp - ref_logp)` per action, plus the clipped score on the
/// action that ends the answer, and zero from `end` on. `logp`, `ref_logp`: the L - 1 actions
/// (the prompt's actions get a penalty too, as in DS-Chat; GAE never reads them).
pub fn compute_rewards(logp: &[f32], ref_logp: &[f32], score: f32, end: usize, cfg: &PpoConfig) -> Vec<f32> {
    assert_eq!(logp.len(), ref_logp.len(), "compute_rewards: logp and ref_logp differ in length");
    let kl_ctl = cfg.kl_ctl as f32;
    let mut r: Vec<f32> = logp.iter().zip(ref_logp).map(|(a, b)| -kl_ctl * (a - b)).collect();
    let clip = cfg.clip_reward_value as f32;
    r[reward_index(end, logp.len())] += score.clamp(-clip, clip);
    for x in r.iter_mut().skip(end) {
        *x = 0.0;
    }
    r
}

/// The clipped policy loss: `ratio = exp((logp - old) * mask)`,
/// `sum(max(-A ratio, -A clip(ratio, lo, hi)) * mask) / sum(mask)` with
/// `(lo, hi)` = [`PpoConfig::ratio_bounds`]. All (B, N).
pub fn actor_loss(
    logp: &Tensor,
    old_logp: &Tensor,
    advantages: &Tensor,
    mask: &Tensor,
    cfg: &PpoConfig,
) -> Result<Tensor> {
    aggregate_loss(&actor_token_losses(logp, old_logp, advantages, mask, cfg)?, mask, LossType::Bnpo, 0)
}

/// [`actor_loss`] per token, before any mean: `max(-A ratio, -A clip(ratio, lo, hi))`, (B, N).
pub fn actor_token_losses(
    logp: &Tensor,
    old_logp: &Tensor,
    advantages: &Tensor,
    mask: &Tensor,
    cfg: &PpoConfig,
) -> Result<Tensor> {
    let ratio = ((logp - old_logp)? * mask)?.exp()?;
    let (lo, hi) = cfg.ratio_bounds();
    let clipped = ratio.clamp(lo, hi)?;
    let neg_adv = advantages.neg()?;
    (&neg_adv * &ratio)?.maximum(&(&neg_adv * &clipped)?)
}

/// The clipped value loss: `Vc = clip(V, V_old - c, V_old + c)`,
/// `0.5 * sum(max((V - G)^2, (Vc - G)^2) * mask) / sum(mask)`. All (B, N).
pub fn critic_loss(
    values: &Tensor,
    old_values: &Tensor,
    returns: &Tensor,
    mask: &Tensor,
    cfg: &PpoConfig,
) -> Result<Tensor> {
    let c = cfg.cliprange_value;
    let clipped = values.maximum(&(old_values - c)?)?.minimum(&(old_values + c)?)?;
    let l1 = (values - returns)?.sqr()?;
    let l2 = (clipped - returns)?.sqr()?;
    let loss = (l1.maximum(&l2)? * mask)?.sum_all()?;
    (loss * 0.5)? / mask.sum_all()?.to_scalar::<f32>()? as f64
}

/// One EMA update in place: `ema = beta * ema + (1 - beta) * current` (DS-Chat `moving_average`,
/// beta 0.992).
pub fn ema_update(ema: &mut [f32], current: &[f32], beta: f32) {
    for (e, c) in ema.iter_mut().zip(current) {
        *e = beta * *e + (1.0 - beta) * c;
    }
}

/// The two KL estimators of the policy against the reference over masked actions:
/// k1 = mean(d), k3 = mean(exp(-d) - 1 + d), d = logp - ref_logp (Schulman's "Approximating KL").
pub fn kl_estimates(logp: &[f32], ref_logp: &[f32], mask: &[f32]) -> (f64, f64) {
    let (mut k1, mut k3, mut n) = (0f64, 0f64, 0f64);
    for ((a, b), m) in logp.iter().zip(ref_logp).zip(mask) {
        if *m > 0.0 {
            let d = f64::from(a - b);
            k1 += d;
            k3 += (-d).exp() - 1.0 + d;
            n += 1.0;
        }
    }
    (k1 / n.max(1.0), k3 / n.max(1.0))
}

/// The approximate KL from the rollout policy to the current one at one sampled action, from
/// `d = logp_new - logp_old`: `(rho - 1) - log rho` with `rho = exp(d)` (Schulman's k3 for
/// KL(old || new), the actions sampled from the old policy): never negative, 0 only at rho = 1,
/// and unbiased, which `d^2 / 2` is not.
pub fn approx_kl(d: f64) -> f64 {
    d.exp_m1() - d
}

/// Ziegler et al.'s adaptive KL controller (TRL's `AdaptiveKLController`): the coefficient
/// `beta` after a rollout of `n` answers whose KL to the reference (summed over each answer's
/// tokens, mean over the answers) was `kl`: `beta * (1 + e * n / horizon)` with
/// `e = clip(kl / target - 1, -0.2, 0.2)`, so it grows while the policy drifts past `target` and
/// shrinks while it stays closer.
pub fn adaptive_kl_coefficient(beta: f64, kl: f64, target: f64, n: f64, horizon: f64) -> f64 {
    let e = (kl / target - 1.0).clamp(-0.2, 0.2);
    beta * (1.0 + e * n / horizon)
}

/// Step 3's algorithm (`--algorithm`): how a rollout's answers become advantages.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Algorithm {
    /// DS-Chat's PPO: per-token KL penalty in the reward, a critic, GAE.
    #[default]
    Ppo,
    /// DeepSeekMath's GRPO: no critic; each answer's score normalised within its prompt's group
    /// ([`crate::advantages::group_normalized_advantages`]) on every token; the KL to the reference a loss term
    /// (k3, [`k3_kl_tokens`]) instead of a reward penalty. The loss averages its tokens as
    /// `--loss-type` says: token-level (BNPO) by default, DeepSeekMath's per-answer mean with
    /// `grpo`, Dr. GRPO's constant with `dr_grpo` ([`LossType`]).
    Grpo,
    /// Ahmadian et al.'s RLOO: no critic; each answer's sequence reward (score minus the KL
    /// penalty summed over its tokens) less the mean of the other answers to its prompt
    /// ([`crate::advantages::leave_one_out_advantages`]) on every token.
    Rloo,
    /// OpenRLHF's REINFORCE++: no critic; PPO's token-level rewards (the KL penalty on every
    /// token, the clipped score on the last), each token's advantage its discounted return
    /// (`--gamma`), normalised over the whole rollout's answer tokens
    /// ([`crate::advantages::reinforce_pp_advantages`]). Needs no groups: one answer per prompt
    /// is enough.
    #[value(name = "reinforce_pp", alias = "reinforce++")]
    #[serde(rename = "reinforce_pp")]
    ReinforcePp,
}

impl Algorithm {
    /// PPO trains a critic; GRPO, RLOO and REINFORCE++ have none.
    pub fn has_critic(self) -> bool {
        self == Algorithm::Ppo
    }

    /// GRPO and RLOO compare the answers to one prompt: they need several, sampled.
    pub fn compares_answers(self) -> bool {
        matches!(self, Algorithm::Grpo | Algorithm::Rloo)
    }

    pub fn name(self) -> &'static str {
        match self {
            Algorithm::Ppo => "ppo",
            Algorithm::Grpo => "grpo",
            Algorithm::Rloo => "rloo",
            Algorithm::ReinforcePp => "reinforce_pp",
        }
    }

    /// How logs and summaries name it.
    pub fn label(self) -> &'static str {
        match self {
            Algorithm::Ppo => "PPO",
            Algorithm::Grpo => "GRPO",
            Algorithm::Rloo => "RLOO",
            Algorithm::ReinforcePp => "REINFORCE++",
        }
    }
}

/// What GRPO divides a group's centred scores by (`--scale-rewards`, TRL's `scale_rewards`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RewardScaling {
    /// DeepSeekMath's GRPO: the group's standard deviation. Every group weighs the same, also
    /// one whose answers differ only by a hair of score.
    #[default]
    Group,
    /// The standard deviation of all the rollout's scores (TRL's `batch`): one scale for every
    /// group, so a group whose answers score alike moves the policy little.
    Batch,
    /// None (Liu et al.'s Dr. GRPO): advantages in the reward model's units.
    None,
}

/// RLOO's reward of a whole answer: its clipped score minus `kl_ctl` times the KL to the
/// reference summed over its tokens (k1, `logp - ref_logp` at the sampled tokens, as TRL's
/// RLOOTrainer).
pub fn sequence_reward(score: f32, logp: &[f32], ref_logp: &[f32], mask: &[f32], cfg: &PpoConfig) -> f64 {
    let kl: f64 =
        logp.iter().zip(ref_logp).zip(mask).filter(|(_, &m)| m > 0.0).map(|((a, b), _)| f64::from(a - b)).sum();
    f64::from(score).clamp(-cfg.clip_reward_value, cfg.clip_reward_value) - cfg.kl_ctl * kl
}

/// The most one token adds to [`k3_kl_loss`] (verl's `low_var_kl`): k3 grows as `exp(ref -
/// logp)`, so a single token the policy has made far less likely than the reference does would
/// otherwise own the whole update (measured on the demo: one token at `ref - logp` = 10.6 nats
/// turned a GRPO update's loss from about 0.05 into 137, its gradient about 40000 where a
/// token's policy-gradient weight is of order 1; docs/RLHF-INVESTIGATION.md, section 12).
pub const K3_MAX: f64 = 10.0;

/// GRPO's KL term: the k3 estimator of KL(policy || reference) at the sampled tokens,
/// `exp(ref - logp) - (ref - logp) - 1`, unbiased and never negative (Schulman), each token's
/// capped at [`K3_MAX`] (where it adds no gradient), as a masked mean over the answer tokens:
/// `sum(k3 * mask) / sum(mask)`. All (B, N); differentiable in `logp`.
pub fn k3_kl_loss(logp: &Tensor, ref_logp: &Tensor, mask: &Tensor) -> Result<Tensor> {
    aggregate_loss(&k3_kl_tokens(logp, ref_logp, mask)?, mask, LossType::Bnpo, 0)
}

/// [`k3_kl_loss`] per token, before any mean, (B, N).
pub fn k3_kl_tokens(logp: &Tensor, ref_logp: &Tensor, mask: &Tensor) -> Result<Tensor> {
    // exp of at most 20 cannot overflow f32; past about 2.6 nats the cap applies anyway.
    let d = ((ref_logp - logp)? * mask)?.minimum(20.0)?;
    ((d.exp()? - &d)? - 1.0)?.minimum(K3_MAX)
}

/// Running mean and variance of the reward model's scores over every rollout so far
/// (OpenRLHF's `--normalize_reward` with its running moments): `--normalize-reward` turns each
/// score into `(score - mean) / std` before rewards are formed, so that the reward's scale, and
/// what `--clip-reward-value` cuts, do not depend on how the reward model happened to be
/// scaled.
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct RunningMoments {
    pub count: f64,
    pub mean: f64,
    /// Population variance.
    pub var: f64,
}

impl RunningMoments {
    /// Merges a batch of `n` values with sum `sum` and sum of squares `sum_sq` (Chan et al.'s
    /// parallel update: the result is the moments of everything seen, in any batching).
    pub fn update(&mut self, n: f64, sum: f64, sum_sq: f64) {
        if n == 0.0 {
            return;
        }
        let batch_mean = sum / n;
        let batch_var = (sum_sq / n - batch_mean * batch_mean).max(0.0);
        let total = self.count + n;
        let delta = batch_mean - self.mean;
        let m2 = self.var * self.count + batch_var * n + delta * delta * self.count * n / total;
        (self.count, self.mean, self.var) = (total, self.mean + delta * n / total, m2 / total);
    }

    pub fn normalize(&self, x: f64) -> f64 {
        (x - self.mean) / (self.var.sqrt() + 1e-8)
    }
}

/// `1 - Var(returns - values) / Var(returns)` over masked actions: how much of the return the
/// critic explains (1 perfect, 0 a constant guess, negative worse).
pub fn explained_variance(values: &[f32], returns: &[f32], mask: &[f32]) -> f64 {
    let pick = |f: &dyn Fn(usize) -> f64| -> Vec<f64> { (0..mask.len()).filter(|&i| mask[i] > 0.0).map(f).collect() };
    let ret = pick(&|i| f64::from(returns[i]));
    let err = pick(&|i| f64::from(returns[i] - values[i]));
    // The two variances' 1/n cancels: their sums of squared deviations from the mean.
    let squared_deviations = |x: &[f64]| {
        let m = x.iter().sum::<f64>() / x.len().max(1) as f64;
        x.iter().map(|v| (v - m).powi(2)).sum::<f64>()
    };
    1.0 - squared_deviations(&err) / squared_deviations(&ret)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device, Var};

    const PAD: u32 = 0;

    fn close(a: &[f32], b: &[f32]) {
        assert_eq!(a.len(), b.len(), "{a:?} vs {b:?}");
        for (x, y) in a.iter().zip(b) {
            assert!((x - y).abs() < 1e-5, "{a:?} vs {b:?}");
        }
    }

    /// The three means of `--loss-type` by hand: two answers of 3 and 1 tokens.
    #[test]
    fn loss_types_average_as_their_papers_say() -> Result<()> {
        let dev = &candle_core::Device::Cpu;
        let per_token = Tensor::new(&[[1f32, 2., 3.], [4., 9., 9.]], dev)?;
        let mask = Tensor::new(&[[1f32, 1., 1.], [1., 0., 0.]], dev)?;
        let loss = |how, len| -> Result<f32> { aggregate_loss(&per_token, &mask, how, len)?.to_scalar() };
        assert_eq!(loss(LossType::Bnpo, 0)?, 2.5, "(1 + 2 + 3 + 4) / 4 tokens");
        assert_eq!(loss(LossType::Grpo, 0)?, 3.0, "(6 / 3 + 4 / 1) / 2 answers");
        assert_eq!(loss(LossType::DrGrpo, 4)?, 1.25, "10 / (2 answers x 4)");
        assert!((loss(LossType::DrGrpo, 0)? - 10.0 / 6.0).abs() < 1e-6, "the width when no length is given");
        // The two that divide by answers: a rank's share of them weighs its part on many ranks.
        assert!(LossType::Grpo.per_answer() && LossType::DrGrpo.per_answer() && !LossType::Bnpo.per_answer());
        Ok(())
    }

    /// TRL's `masked_whiten` by hand: [1, 2, 3] have mean 2 and unbiased variance 1; the masked
    /// entry is left alone.
    #[test]
    fn whitening_centres_and_scales_the_unmasked_advantages() {
        let mut v = [1f32, 2., 3., 100.];
        whiten(&mut v, &[1., 1., 1., 0.], [3.0, 6.0, 14.0]);
        let want = [-1f32, 0., 1., 100.];
        assert!(v.iter().zip(want).all(|(a, b)| (a - b).abs() < 1e-6), "{v:?}");
        let mut one = [5f32];
        whiten(&mut one, &[1.], [1.0, 5.0, 25.0]);
        assert_eq!(one, [5.0], "fewer than two values have no spread to scale by");
        // Two values 1 and 5: mean 3, unbiased variance 8, each 2 / sqrt(8 + 1e-8) from 0.
        let mut two = [1f32, 5.];
        whiten(&mut two, &[1., 1.], [2.0, 6.0, 26.0]);
        let d = (2.0 / (8.0f64 + 1e-8).sqrt()) as f32;
        assert_eq!(two, [-d, d]);
        // Equal values have no spread: they centre to 0 (the 1e-8 keeps the scale finite).
        let mut flat = [2f32, 2.];
        whiten(&mut flat, &[1., 1.], [2.0, 4.0, 8.0]);
        assert_eq!(flat, [0.0, 0.0]);
    }

    #[test]
    fn rewards_land_on_the_eos_action_and_zero_after_it() {
        // P = 2 (prompt 5, 6), answer 7, 8, EOS (= pad 0), then padding: L = 7, 6 actions.
        let seq = [5, 6, 7, 8, PAD, PAD, PAD];
        let start = 1; // action 1 emits the first answer token (7)
        let end = end_of_answer(&seq, PAD, start);
        assert_eq!(end, 4, "n = 2 answer tokens: end = 1 + 2 + 1");
        // Action 3 emits EOS: an action (TRL, OpenRLHF), or masked as DS-Chat masks it.
        assert_eq!(action_mask(&seq, PAD, start, true), [1.0, 1.0, 1.0, 1.0, 0.0, 0.0]);
        assert_eq!(action_mask(&seq, PAD, start, false), [1.0, 1.0, 1.0, 0.0, 0.0, 0.0]);
        let cfg = PpoConfig::default();
        let logp = [-1.0, -0.5, -0.4, -0.3, -9.0, -9.0];
        let refp = [-1.0, -0.7, -0.2, -0.1, -1.0, -1.0];
        let r = compute_rewards(&logp, &refp, 7.0, end, &cfg);
        // -0.1 * (logp - ref) = [0, -0.02, 0.02, 0.02, ...]; score 7 clipped to 5 on action 3 (emits EOS).
        close(&r, &[0.0, -0.02, 0.02, 5.02, 0.0, 0.0]);
    }

    #[test]
    fn an_answer_at_the_length_limit_gets_its_reward_on_the_last_action() {
        let seq = [5, 6, 7, 8, 9]; // no pad: the answer used every position
        let end = end_of_answer(&seq, PAD, 1);
        assert_eq!(end, 5, "one past the 4 actions");
        // No EOS was emitted: both masks are every action.
        assert_eq!(action_mask(&seq, PAD, 1, true), [1.0; 4]);
        assert_eq!(action_mask(&seq, PAD, 1, false), [1.0; 4]);
        assert_eq!(reward_index(end, 4), 3);
        let r = compute_rewards(&[0.0; 4], &[0.0; 4], -6.0, end, &PpoConfig::default());
        close(&r, &[0.0, 0.0, 0.0, -5.0]);
    }

    #[test]
    fn an_empty_answer_puts_the_reward_on_the_first_action() {
        // The answer is EOS at once: n = 0, end = start + 1, reward on action start. (Rows with
        // at most one answer token are dropped before this in generate_experience.)
        let seq = [5, 6, PAD, PAD];
        let end = end_of_answer(&seq, PAD, 1);
        assert_eq!(end, 2);
        assert_eq!(action_mask(&seq, PAD, 1, true), [1.0, 1.0, 0.0], "EOS is the answer's one action");
        let r = compute_rewards(&[0.0; 3], &[0.0; 3], 1.0, end, &PpoConfig::default());
        close(&r, &[0.0, 1.0, 0.0]);
    }

    #[test]
    fn actor_loss_clips_the_ratio_in_the_pessimistic_direction() -> candle_core::Result<()> {
        let dev = Device::Cpu;
        let cfg = PpoConfig::default();
        // Two actions: ratio e^0.5 = 1.6487 with A = +1 (clipped to 1.2) and ratio e^-0.5 =
        // 0.6065 with A = -2 (clipped to 0.8). A masked third action must not count.
        let logp = Var::new(&[[0.5f32, -0.5, 3.0]], &dev)?;
        let old = Tensor::new(&[[0.0f32, 0.0, 0.0]], &dev)?;
        let adv = Tensor::new(&[[1.0f32, -2.0, 100.0]], &dev)?;
        let mask = Tensor::new(&[[1.0f32, 1.0, 0.0]], &dev)?;
        let loss = actor_loss(logp.as_tensor(), &old, &adv, &mask, &cfg)?;
        // Action 0: max(-1.6487, -1.2) = -1.2. Action 1: max(1.2131, 1.6) = 1.6. Mean = 0.2.
        let got: f32 = loss.to_scalar()?;
        assert!((got - 0.2).abs() < 1e-5, "{got}");
        // Both are on their clipped branch: no gradient flows through either.
        let g = loss.backward()?.get(logp.as_tensor()).map(|g| g.to_vec2::<f32>()).transpose()?;
        assert_eq!(g.unwrap_or_default().concat().iter().map(|x| x.abs()).sum::<f32>(), 0.0);

        // Inside the clip range the gradient is -A * ratio / sum(mask); the ratio is the new
        // policy's over the old one's: log-ratios 0.1 and -0.1.
        let logp = Var::new(&[[0.3f32, 0.1]], &dev)?;
        let loss = actor_loss(
            logp.as_tensor(),
            &Tensor::new(&[[0.2f32, 0.2]], &dev)?,
            &Tensor::new(&[[2.0f32, 1.0]], &dev)?,
            &Tensor::new(&[[1.0f32, 1.0]], &dev)?,
            &cfg,
        )?;
        let g = loss.backward()?.get(logp.as_tensor()).expect("gradient").to_vec2::<f32>()?;
        close(&g[0], &[-2.0 * 0.1f32.exp() / 2.0, -(-0.1f32).exp() / 2.0]);
        Ok(())
    }

    #[test]
    fn clip_higher_raises_only_the_upper_bound() -> candle_core::Result<()> {
        let dev = Device::Cpu;
        let cfg = PpoConfig { cliprange_high: Some(0.28), ..PpoConfig::default() };
        assert_eq!(cfg.ratio_bounds(), (0.8, 1.28));
        // Ratios e^0.2 = 1.2214 (A = +1: inside [0.8, 1.28], unclipped, gradient -A ratio / 3),
        // e^0.4 = 1.4918 (A = +1: clipped to 1.28, no gradient) and e^-0.4 = 0.6703 (A = -1:
        // clipped to 0.8 as without clip-higher, no gradient).
        let logp = Var::new(&[[0.2f32, 0.4, -0.4]], &dev)?;
        let old = Tensor::zeros((1, 3), DType::F32, &dev)?;
        let adv = Tensor::new(&[[1.0f32, 1.0, -1.0]], &dev)?;
        let mask = Tensor::ones((1, 3), DType::F32, &dev)?;
        let loss = actor_loss(logp.as_tensor(), &old, &adv, &mask, &cfg)?;
        // max(-1.2214, -1.2214) + max(-1.4918, -1.28) + max(0.6703, 0.8) = -1.2214 - 1.28 + 0.8.
        let want = (-0.2f32.exp() - 1.28 + 0.8) / 3.0;
        let got: f32 = loss.to_scalar()?;
        assert!((got - want).abs() < 1e-6, "{got} vs {want}");
        let g = loss.backward()?.get(logp.as_tensor()).expect("gradient").to_vec2::<f32>()?;
        close(&g[0], &[-0.2f32.exp() / 3.0, 0.0, 0.0]);
        // The symmetric clip (the default) clips the first ratio at 1.2 too.
        let sym: f32 = actor_loss(logp.as_tensor(), &old, &adv, &mask, &PpoConfig::default())?.to_scalar()?;
        assert!((sym - (-1.2 - 1.2 + 0.8) / 3.0).abs() < 1e-6, "{sym}");
        Ok(())
    }

    #[test]
    fn critic_loss_takes_the_larger_of_clipped_and_unclipped_errors() -> candle_core::Result<()> {
        let dev = Device::Cpu;
        let cfg = PpoConfig::default();
        let values = Tensor::new(&[[1.0f32, 0.0, 5.0]], &dev)?;
        let old = Tensor::new(&[[0.5f32, 0.1, 0.0]], &dev)?;
        let returns = Tensor::new(&[[0.0f32, 0.0, 0.0]], &dev)?;
        let mask = Tensor::new(&[[1.0f32, 1.0, 0.0]], &dev)?;
        // Action 0: V 1.0 clipped to 0.7: max(1.0, 0.49) = 1.0. Action 1: V 0 inside [-0.1, 0.3]: 0.
        let got: f32 = critic_loss(&values, &old, &returns, &mask, &cfg)?.to_scalar()?;
        assert!((got - 0.5 * 1.0 / 2.0).abs() < 1e-6, "{got}");
        // Clipping that increases the error wins: V 0.0, old 1.0 -> clipped 0.8, return 0.0.
        let got: f32 = critic_loss(
            &Tensor::new(&[[0.0f32]], &dev)?,
            &Tensor::new(&[[1.0f32]], &dev)?,
            &Tensor::new(&[[0.0f32]], &dev)?,
            &Tensor::new(&[[1.0f32]], &dev)?,
            &cfg,
        )?
        .to_scalar()?;
        assert!((got - 0.5 * 0.64).abs() < 1e-6, "{got}");
        Ok(())
    }

    #[test]
    fn ema_kl_and_explained_variance_hand_computed() {
        let mut ema = [1.0f32, 0.0];
        ema_update(&mut ema, &[0.0, 1.0], 0.992);
        close(&ema, &[0.992, 0.008]);
        let (k1, k3) = kl_estimates(&[-1.0, -2.0, 5.0], &[-1.5, -2.0, 0.0], &[1.0, 1.0, 0.0]);
        assert!((k1 - 0.25).abs() < 1e-12);
        assert!((k3 - ((-0.5f64).exp() - 1.0 + 0.5) / 2.0).abs() < 1e-12);
        assert!((explained_variance(&[1.0, 2.0, 3.0], &[1.0, 2.0, 3.0], &[1.0; 3]) - 1.0).abs() < 1e-12);
        assert!(explained_variance(&[2.0, 2.0, 2.0], &[1.0, 2.0, 3.0], &[1.0; 3]).abs() < 1e-12);
        // Masked actions do not count; errors 1, -1 against returns 1, 3 (variance 1): 1 - 1 / 1.
        let masked = [1.0, 1.0, 0.0];
        assert!((explained_variance(&[1.0, 2.0, 100.0], &[1.0, 2.0, 0.0], &masked) - 1.0).abs() < 1e-12);
        assert!(explained_variance(&[0.0, 4.0, 100.0], &[1.0, 3.0, 0.0], &masked).abs() < 1e-12);
    }

    /// rho = 2: (2 - 1) - ln 2; rho = 1/2: (1/2 - 1) + ln 2. `d^2 / 2` would give both 0.240.
    /// Hand-computed: KL 12 against a target of 6 is clipped to +20%, KL 5.4 gives -10%; a
    /// rollout of 64 answers over a horizon of 10000 applies 0.0064 of it.
    #[test]
    fn the_adaptive_kl_coefficient_moves_toward_the_target() {
        let close = |a: f64, b: f64| (a - b).abs() < 1e-12;
        assert!(close(adaptive_kl_coefficient(0.1, 12.0, 6.0, 64.0, 10000.0), 0.100128));
        assert!(close(adaptive_kl_coefficient(0.1, 5.4, 6.0, 64.0, 10000.0), 0.099936));
        assert!(close(adaptive_kl_coefficient(0.1, 6.0, 6.0, 64.0, 10000.0), 0.1));
        assert!(close(adaptive_kl_coefficient(0.1, 0.0, 6.0, 64.0, 10000.0), 0.099872));
    }

    #[test]
    fn approx_kl_is_rho_minus_1_minus_log_rho() {
        let ln2 = std::f64::consts::LN_2;
        assert!((approx_kl(ln2) - (1.0 - ln2)).abs() < 1e-15);
        assert!((approx_kl(-ln2) - (ln2 - 0.5)).abs() < 1e-15);
        assert_eq!(approx_kl(0.0), 0.0);
        // Small steps keep their precision (exp_m1; `exp(d) - 1 - d` loses 4 digits at 1e-6):
        // d^2 / 2 + d^3 / 6.
        assert!((approx_kl(1e-6) / (5e-13 + 1e-18 / 6.0) - 1.0).abs() < 1e-8);
    }

    /// Score 7 clipped to 5; KL over the two unmasked tokens (0.5 - 0.2) + (-1 + 1.5) = 0.8.
    /// A checkpoint's run fingerprint holds the config: the options added since the first
    /// checkpoints are left out at their defaults, so those checkpoints resume with the flags
    /// they were started with; set, they are written (a resume must give them again).
    #[test]
    fn later_options_are_written_into_the_fingerprint_only_when_set() {
        let written = |cfg: &PpoConfig| serde_json::to_value(cfg).unwrap();
        let default = written(&PpoConfig::default());
        assert!(default.get("loss_type").is_none() && default.get("whiten_advantages").is_none(), "{default}");
        let set = written(&PpoConfig { loss_type: LossType::Grpo, whiten_advantages: true, ..PpoConfig::default() });
        assert_eq!(
            (&set["loss_type"], &set["whiten_advantages"]),
            (&serde_json::json!("grpo"), &serde_json::json!(true))
        );
    }

    #[test]
    fn sequence_reward_is_the_clipped_score_minus_the_summed_kl() {
        let cfg = PpoConfig::default();
        let r = sequence_reward(7.0, &[0.5, -1.0, 9.0], &[0.2, -1.5, 0.0], &[1.0, 1.0, 0.0], &cfg);
        assert!((r - (5.0 - 0.1 * 0.8)).abs() < 1e-6, "{r}");
        // Clipped from below as well; inside the range the score is kept.
        let r = sequence_reward(-7.0, &[0.5], &[0.2], &[1.0], &cfg);
        assert!((r - (-5.0 - 0.1 * 0.3)).abs() < 1e-6, "{r}");
        let r = sequence_reward(2.0, &[0.5], &[0.2], &[1.0], &cfg);
        assert!((r - (2.0 - 0.1 * 0.3)).abs() < 1e-6, "{r}");
    }

    /// d = ref - logp = -0.5, 1 and 3: k3 = e^-0.5 + 0.5 - 1, e - 2 and e^3 - 4 = 16.09, the
    /// last capped at 10; the masked one ignored. The gradient in logp is 1 - exp(ref - logp)
    /// per token over the token count, 0 for the capped token.
    #[test]
    fn k3_kl_loss_hand_computed_with_its_gradient_and_cap() -> candle_core::Result<()> {
        let dev = Device::Cpu;
        let logp = Var::new(&[[-1.0f32, -2.0, -5.0, 0.0]], &dev)?;
        let refp = Tensor::new(&[[-1.5f32, -1.0, -2.0, 70.0]], &dev)?;
        let mask = Tensor::new(&[[1.0f32, 1.0, 1.0, 0.0]], &dev)?;
        let loss = k3_kl_loss(logp.as_tensor(), &refp, &mask)?;
        let want = (((-0.5f64).exp() - 0.5) + (1f64.exp() - 2.0) + K3_MAX) / 3.0;
        assert!((f64::from(loss.to_scalar::<f32>()?) - want).abs() < 1e-6);
        let g = loss.backward()?.get(logp.as_tensor()).expect("gradient").to_vec2::<f32>()?;
        close(&g[0], &[(1.0 - (-0.5f32).exp()) / 3.0, (1.0 - 1f32.exp()) / 3.0, 0.0, 0.0]);
        Ok(())
    }

    /// [1, 2, 3] then [4, 5]: the moments of 1..=5, mean 3 and population variance 2.
    #[test]
    fn running_moments_merge_batches_exactly() {
        let mut m = RunningMoments::default();
        m.update(3.0, 6.0, 14.0);
        assert!((m.mean - 2.0).abs() < 1e-12 && (m.var - 2.0 / 3.0).abs() < 1e-12, "{m:?}");
        m.update(2.0, 9.0, 41.0);
        m.update(0.0, 0.0, 0.0);
        assert_eq!(m.count, 5.0);
        assert!((m.mean - 3.0).abs() < 1e-12 && (m.var - 2.0).abs() < 1e-12, "{m:?}");
        assert!((m.normalize(3.0 + 2f64.sqrt()) - 1.0).abs() < 1e-7);
        assert_eq!(m.normalize(3.0), 0.0);
        // Equal scores have no spread: the 1e-8 keeps the scale finite and the sign.
        let mut flat = RunningMoments::default();
        flat.update(2.0, 4.0, 8.0);
        assert_eq!(flat.normalize(2.5), 0.5 / 1e-8);
    }
}
