//! DPO (Rafailov et al., "Direct Preference Optimization"), step 2's alternative to a reward
//! model and PPO: the step-1 actor trains directly on the chosen/rejected pairs against its
//! frozen copy (the reference), and the result is an actor (`GPT2LMHeadModel`), not a reward
//! model. TRL's `DPOTrainer` semantics: per pair, with `s = log pi(answer | prompt)` summed over
//! the answer's tokens (EOS included) for the policy and the reference,
//! `h = (s_c - s_c_ref) - (s_r - s_r_ref)`; the sigmoid loss is `-log sigmoid(beta h)`, IPO's
//! (Azar et al.) `(h - 1 / (2 beta))^2` on per-token mean log-probs; the implicit rewards
//! `beta (s - s_ref)` of the chosen and rejected answers give the logged accuracy and margin.
//! With `--rpo-alpha a` (TRL's `rpo_alpha`, RPO) the loss adds `a` times the chosen answers'
//! negative log-likelihood per token of the micro-batch.
//!
//! Data-parallel and ZeRO-sharded as step 2's reward model (the same `StepArgs`), the reference
//! whole on every rank (or its tensor-parallel slices).

use crate::args::{DpoLoss, RewardArgs, DEFAULT_BETA};
use crate::loss::neg_log_sigmoid;
use anyhow::Result;
use candle_core::{Device, Tensor};
use data::batch::{pair_batch, rank_micro_batches};
use data::phases::PairSample;
use hybrid_engine::comm::{ProcessGroup, ReduceOp};
use hybrid_engine::engine::epochs::{train_epochs, EpochTask, EvalAt};
use hybrid_engine::engine::{Engine, Head, Ranks};
use hybrid_engine::model::gpt2::{Dropout, Gpt2};
use hybrid_engine::model::positions::Positions;
use hybrid_engine::model::reward_model::causal_lm_config;
use hybrid_engine::model::reward_model::Heads;
use hybrid_engine::training::metrics::{peak_rss_mib, Metrics};
use hybrid_engine::training::tensor_parallel::data_group;
use hybrid_engine::training::trainer::total_steps;
use hybrid_engine::ParamStore;
use serde::Serialize;
use serde_json::json;
use std::cell::RefCell;

/// TRL's default learning rate for DPO.
pub const DEFAULT_DPO_LR: f64 = 5e-7;

/// The answer tokens of each row of a pair batch, as a (2B, T - 1) mask over next-token
/// positions (chosen rows first): position `p - 1` predicts token `p`, which belongs to the
/// answer when `prompt_len <= p < len` (the unpadded row's length, EOS included).
pub fn answer_mask(pairs: &[&PairSample], t: usize) -> Vec<f32> {
    let rows = pairs
        .iter()
        .map(|s| (s.prompt_len, s.chosen.len()))
        .chain(pairs.iter().map(|s| (s.prompt_len, s.rejected.len())));
    let mut mask = vec![0f32; 2 * pairs.len() * (t - 1)];
    for (row, (prompt_len, len)) in rows.enumerate() {
        // (A prompt longer than a truncated answer row leaves the row without answer tokens.)
        let (first, end) = (prompt_len.max(1), len.max(prompt_len.max(1)));
        mask[row * (t - 1) + first - 1..row * (t - 1) + end - 1].fill(1.0);
    }
    mask
}

/// Each row's log-probability of its answer: `logp` (2B, T - 1) summed under `mask`, or for IPO
/// averaged over the answer's tokens. (2B,)
pub fn sequence_log_probs(logp: &Tensor, mask: &Tensor, loss: DpoLoss) -> candle_core::Result<Tensor> {
    let sum = (logp * mask)?.sum(1)?;
    match loss {
        DpoLoss::Sigmoid => Ok(sum),
        DpoLoss::Ipo => sum / mask.sum(1)?.clamp(1.0, f64::MAX)?,
    }
}

/// The DPO loss, mean over B pairs, of the policy's and the reference's sequence log-probs
/// (2B,), chosen first: `h = (pi_c - ref_c) - (pi_r - ref_r)`; sigmoid `-log sigmoid(beta h)`,
/// IPO `(h - 1 / (2 beta))^2`.
pub fn dpo_loss(policy: &Tensor, reference: &Tensor, beta: f64, loss: DpoLoss) -> candle_core::Result<Tensor> {
    let b = policy.dim(0)? / 2;
    let ratios = (policy - reference)?;
    let h = (ratios.narrow(0, 0, b)? - ratios.narrow(0, b, b)?)?;
    match loss {
        DpoLoss::Sigmoid => neg_log_sigmoid(&(h * beta)?)?.mean_all(),
        DpoLoss::Ipo => (h - 1.0 / (2.0 * beta))?.sqr()?.mean_all(),
    }
}

/// RPO's term: the chosen answers' (the first B rows') negative log-likelihood per answer token,
/// from the token log-probs `logp` (2B, T - 1) and the answer `mask`.
pub fn chosen_nll(logp: &Tensor, mask: &Tensor) -> candle_core::Result<Tensor> {
    let b = logp.dim(0)? / 2;
    let mask = mask.narrow(0, 0, b)?;
    let tokens = mask.sum_all()?.to_scalar::<f32>()?.max(1.0);
    (logp.narrow(0, 0, b)? * &mask)?.sum_all()? / f64::from(-tokens)
}

/// Sums over pairs of what TRL logs: the implicit rewards `beta (pi - ref)` of the chosen and
/// rejected answers, whether the chosen one's is higher, and the loss.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct DpoSums {
    pub pairs: f64,
    pub loss: f64,
    pub reward_chosen: f64,
    pub reward_rejected: f64,
    pub correct: f64,
}

impl DpoSums {
    /// The sums of B pairs from their sequence log-probs (2B each, chosen first) and their mean
    /// loss.
    pub fn of(policy: &[f32], reference: &[f32], beta: f64, mean_loss: f64) -> Self {
        let b = policy.len() / 2;
        let reward = |i: usize| beta * f64::from(policy[i] - reference[i]);
        let mut s = Self { pairs: b as f64, loss: mean_loss * b as f64, ..Self::default() };
        for i in 0..b {
            let (c, r) = (reward(i), reward(b + i));
            (s.reward_chosen, s.reward_rejected) = (s.reward_chosen + c, s.reward_rejected + r);
            s.correct += f64::from(u8::from(c > r));
        }
        s
    }

    fn add(&mut self, o: &Self) {
        self.pairs += o.pairs;
        self.loss += o.loss;
        self.reward_chosen += o.reward_chosen;
        self.reward_rejected += o.reward_rejected;
        self.correct += o.correct;
    }

    fn over_ranks(self, group: &ProcessGroup) -> Result<Self> {
        let mut a = [self.pairs, self.loss, self.reward_chosen, self.reward_rejected, self.correct];
        group.all_reduce_scalars(&mut a, ReduceOp::Sum)?;
        let [pairs, loss, reward_chosen, reward_rejected, correct] = a;
        Ok(Self { pairs, loss, reward_chosen, reward_rejected, correct })
    }

    /// Means over the pairs, with TRL's names.
    pub fn means(&self) -> DpoEval {
        let n = self.pairs.max(1.0);
        DpoEval {
            pairs: self.pairs as usize,
            loss: self.loss / n,
            reward_accuracy: self.correct / n,
            reward_chosen: self.reward_chosen / n,
            reward_rejected: self.reward_rejected / n,
            reward_margin: (self.reward_chosen - self.reward_rejected) / n,
        }
    }
}

/// DPO's evaluation over pairs (TRL's `rewards/accuracies`, `rewards/chosen`, ...).
#[derive(Clone, Debug, Serialize)]
pub struct DpoEval {
    pub pairs: usize,
    pub loss: f64,
    pub reward_accuracy: f64,
    pub reward_chosen: f64,
    pub reward_rejected: f64,
    pub reward_margin: f64,
}

/// What a DPO run did.
#[derive(Clone, Debug, Serialize)]
pub struct DpoSummary {
    pub steps: u64,
    /// Before training, then after each epoch.
    pub evals: Vec<DpoEval>,
    pub output_dir: std::path::PathBuf,
}

/// A batch of pairs ready for the forward passes: (2B, T) ids, the (2B, T - 1) next tokens and
/// answer mask.
struct PairInputs {
    ids: Tensor,
    next: Tensor,
    mask: Tensor,
    t: usize,
}

impl PairInputs {
    fn new(pairs: &[&PairSample], pad: u32, device: &Device) -> Result<Self> {
        let batch = pair_batch(pairs, pad);
        // A pair batch is at least 2 tokens long (a prompt and an answer token).
        let t = batch.t.max(2);
        let mut ids = batch.ids;
        if batch.t < t {
            ids = ids
                .chunks(batch.t)
                .flat_map(|row| row.iter().copied().chain(std::iter::repeat_n(pad, t - batch.t)))
                .collect();
        }
        let ids = Tensor::from_vec(ids, (2 * batch.pairs, t), device)?;
        let next = ids.narrow(1, 1, t - 1)?;
        let mask = Tensor::from_vec(answer_mask(pairs, t), (2 * batch.pairs, t - 1), device)?;
        Ok(Self { ids, next, mask, t })
    }

    /// Each row's answer log-probability under `lm` from its hidden states (2B, T, C).
    fn sequence_log_probs(&self, lm: &Gpt2, hidden: &Tensor, loss: DpoLoss) -> candle_core::Result<Tensor> {
        Ok(self.log_probs_and_nll(lm, hidden, loss, false)?.0)
    }

    /// [`Self::sequence_log_probs`], and with `nll` RPO's [`chosen_nll`] from the same log-probs.
    fn log_probs_and_nll(
        &self,
        lm: &Gpt2,
        hidden: &Tensor,
        loss: DpoLoss,
        nll: bool,
    ) -> candle_core::Result<(Tensor, Option<Tensor>)> {
        let (logp, _) = lm.next_token_log_probs(&hidden.narrow(1, 0, self.t - 1)?, &self.next, false, 1.0)?;
        let nll = if nll { Some(chosen_nll(&logp, &self.mask)?) } else { None };
        Ok((sequence_log_probs(&logp, &self.mask, loss)?, nll))
    }

    /// The frozen reference's sequence log-probs, no gradient.
    fn reference(&self, reference: &Gpt2, loss: DpoLoss) -> Result<Tensor> {
        let hidden = reference.forward_blocks(&self.ids, &Positions::default(), None, None)?;
        Ok(self.sequence_log_probs(reference, &hidden, loss)?.detach())
    }
}

/// Runs step 2 as DPO: `--model-name-or-path` is the step-1 actor.
pub fn run(args: &RewardArgs) -> Result<DpoSummary> {
    let t = &args.train;
    let lr = t.learning_rate.unwrap_or(DEFAULT_DPO_LR);
    t.validate(lr)?;
    args.data.refuse_sft_only_data("DPO's step 2")?;
    let (beta, loss_kind) = (args.beta.unwrap_or(DEFAULT_BETA), args.dpo_loss.unwrap_or(DpoLoss::Sigmoid));
    let rpo_alpha = args.rpo_alpha.unwrap_or(0.0);
    let device = t.device()?;
    let group = t.dist.join(&device)?;
    let tp = t.dist.tensor_parallel(&group)?;
    let data_group = data_group(&group, tp.as_ref());
    let world = data_group.world();
    println!("device: {}", hybrid_engine::device::describe(&device));
    // Under tensor parallelism each rank reads only its slices.
    // (Said in a line: the policy's and its frozen reference's weights.)
    let (mut start, _) = t.starting_model(false, tp.as_ref(), &device)?;
    let tokenizer = crate::train::step2_tokenizer(args, &start)?;
    let eos = tokenizer.eos_id();
    let config = start.config.clone();
    // The reference: the starting weights, frozen, dropout off, in the compute dtype.
    let precision = t.precision.precision();
    let reference_params = start.params.copy()?;
    if let Some(line) = t.apply_lora(&mut start.params, &config, tp.as_ref())? {
        println!("{line}");
    }
    let params = std::mem::take(&mut start.params);
    if let Some(tp) = &tp {
        println!("{}", tp.describe());
    }
    let lm_on = |p: &ParamStore| -> Result<Gpt2> {
        let mut model = match &tp {
            Some(tp) => tp.model(p, &config)?,
            None => p.model(&config)?,
        };
        model.fp32_loss = precision.fp32_loss;
        Ok(model)
    };
    let reference = lm_on(&reference_params.compute_copy(precision.dtype.dtype())?)?;
    drop(reference_params);

    let data_cfg = args.data.config(t.seed, t.max_seq_len, t.max_seq_len, false)?;
    let data = data::phases::reward_data(&data_cfg, &tokenizer)?;
    println!("{}", data.summary);
    match rpo_alpha > 0.0 {
        true => println!("DPO: {:?} loss, beta {beta}, learning rate {lr:e}, RPO alpha {rpo_alpha}", loss_kind),
        false => println!("DPO: {:?} loss, beta {beta}, learning rate {lr:e}", loss_kind),
    }
    let micro_per_epoch = data.train.len().div_ceil(world).div_ceil(t.per_device_train_batch_size);
    let steps = total_steps(micro_per_epoch, t.num_train_epochs, t.gradient_accumulation_steps);
    let engine_cfg = t.engine_config(lr, steps, &data_group)?;
    let ranks = Ranks { data: data_group.clone(), tensor: tp.clone() };
    let mut engine = Engine::new(&engine_cfg, &config, Head::Lm, params, ranks)?;
    engine.release_masters();
    let mut metrics = Metrics::for_rank(group.rank(), &args.output_dir, steps, 0)?.with_sinks(
        args.train.log.sinks(&args.output_dir)?,
        &[],
        0,
    )?;
    let mut task = DpoTask {
        args,
        data: &data,
        data_group: &data_group,
        eos,
        device: &device,
        reference: &reference,
        loss: (beta, loss_kind, rpo_alpha),
        train_sums: DpoSums::default(),
        evals: Vec::new(),
    };
    let plan = t.epoch_plan((micro_per_epoch, steps), "pairs", args.eval_interval, &data_group);
    let (rank, rows) = (data_group.rank(), data.train.len());
    let done = train_epochs(&mut engine, &mut task, &plan, &mut metrics, |epoch| {
        let order = data::pretrain::epoch_order(&(0..rows), t.seed, epoch as u64 - 1);
        rank_micro_batches(&order, t.per_device_train_batch_size, rank, world)
    })?;
    let summary = DpoSummary { steps: done.steps, evals: task.evals, output_dir: args.output_dir.clone() };
    metrics.finish();

    let gathered = engine.gather_weights()?;
    if !group.is_first() {
        group.barrier()?;
        return Ok(summary);
    }
    let params = gathered.params(&engine);
    t.save_step_model("DPO actor", &args.output_dir, &causal_lm_config(&config), params, "CAUSAL_LM", &|d| {
        tokenizer.save(&d.join("tokenizer.json"))
    })?;
    println!("chat with it: chat --path {}", args.output_dir.display());
    let peak = peak_rss_mib();
    metrics.end(json!({"event": "end", "summary": summary, "peak_rss_mib": peak}))?;
    group.barrier()?;
    Ok(summary)
}

/// DPO's micro-batches of pairs, their loss against the frozen reference, and the evaluation.
struct DpoTask<'a> {
    args: &'a RewardArgs,
    data: &'a data::phases::PhaseData<PairSample>,
    /// The ranks the pairs are split over.
    data_group: &'a ProcessGroup,
    eos: u32,
    device: &'a Device,
    reference: &'a Gpt2,
    /// beta, the loss, RPO's alpha (0: none).
    loss: (f64, DpoLoss, f64),
    /// The epoch's training pairs so far (this rank's).
    train_sums: DpoSums,
    /// Before training, then after each epoch.
    evals: Vec<DpoEval>,
}

impl EpochTask for DpoTask<'_> {
    type Batch = PairInputs;

    /// The loss is a mean over the pairs.
    fn batch(&self, rows: &[usize]) -> Result<(PairInputs, f64, usize)> {
        let pairs: Vec<&PairSample> = rows.iter().map(|&i| &self.data.train[i]).collect();
        Ok((PairInputs::new(&pairs, self.eos, self.device)?, pairs.len() as f64, pairs.len()))
    }

    fn forward_backward(
        &mut self,
        engine: &mut Engine,
        inputs: &PairInputs,
        dropout: &Dropout,
        share: f64,
    ) -> Result<f32> {
        let (beta, loss_kind, rpo_alpha) = self.loss;
        let ref_logp = inputs.reference(self.reference, loss_kind)?;
        let seen: RefCell<Option<Tensor>> = RefCell::new(None);
        let value =
            engine.forward_backward(&inputs.ids, &Positions::default(), Some(dropout), share, |heads, hidden| {
                let (policy, nll) = inputs.log_probs_and_nll(heads.trunk, hidden, loss_kind, rpo_alpha > 0.0)?;
                *seen.borrow_mut() = Some(policy.detach());
                let loss = dpo_loss(&policy, &ref_logp, beta, loss_kind)?;
                match nll {
                    Some(nll) => loss + (nll * rpo_alpha)?,
                    None => Ok(loss),
                }
            })?;
        let policy = seen.into_inner().expect("the policy head ran");
        self.train_sums.add(&DpoSums::of(&policy.to_vec1()?, &ref_logp.to_vec1()?, beta, f64::from(value)));
        Ok(value)
    }

    /// The training pairs' implicit rewards over the epoch, over every rank.
    fn epoch_done(&mut self, metrics: &mut Metrics, epoch: usize) -> Result<()> {
        let e = std::mem::take(&mut self.train_sums).over_ranks(self.data_group)?.means();
        metrics.println(&format!(
            "epoch {epoch} training pairs: rewards/accuracies {:.4} | rewards/margins {:.4}",
            e.reward_accuracy, e.reward_margin
        ));
        metrics.record(json!({"epoch": epoch, "train": e}))?;
        Ok(())
    }

    /// The eval pairs: each rank its share, every rank as many forwards (a ZeRO-3 forward is a
    /// collective), the sums over the ranks.
    fn evaluate(&mut self, engine: &Engine, metrics: &mut Metrics, at: EvalAt) -> Result<()> {
        let t = &self.args.train;
        let (rank, world) = (self.data_group.rank(), self.data_group.world());
        let (beta, loss_kind, _) = self.loss;
        let pairs = self.args.eval_pairs(&self.data.eval, world);
        let Some(filler) = pairs.first() else { return Ok(()) };
        let share: Vec<&PairSample> = pairs.iter().skip(rank).step_by(world).collect();
        let forwards = pairs.len().div_ceil(world).div_ceil(t.per_device_eval_batch_size);
        let chunks: Vec<&[&PairSample]> = share.chunks(t.per_device_eval_batch_size).collect();
        let mut sums = DpoSums::default();
        let label = format!("evaluating DPO on the held-out pairs ({})", at.label());
        let mut progress = hybrid_engine::telemetry::progress::Phase::start(&label, "batches", forwards as u64);
        for k in 0..forwards {
            let _done = progress.done_after(1);
            let (chunk, real) = match chunks.get(k) {
                Some(c) => (*c, true),
                None => (std::slice::from_ref(&filler), false),
            };
            let inputs = PairInputs::new(chunk, self.eos, self.device)?;
            let ref_logp = inputs.reference(self.reference, loss_kind)?;
            let policy = engine.with_hidden(&inputs.ids, &Positions::default(), |heads: &Heads, hidden| {
                Ok(inputs.sequence_log_probs(heads.trunk, hidden, loss_kind)?)
            })?;
            if real {
                let loss = f64::from(dpo_loss(&policy, &ref_logp, beta, loss_kind)?.to_scalar::<f32>()?);
                sums.add(&DpoSums::of(&policy.to_vec1()?, &ref_logp.to_vec1()?, beta, loss));
            }
        }
        let e = sums.over_ranks(self.data_group)?.means();
        metrics.println(&format!(
            "***** Evaluating DPO, {} *****\nloss {:.4} | rewards/accuracies {:.4} | rewards/chosen {:.4} | rewards/rejected {:.4} | rewards/margins {:.4}",
            at.label(), e.loss, e.reward_accuracy, e.reward_chosen, e.reward_rejected, e.reward_margin
        ));
        metrics.record(at.record(json!({"eval": e})))?;
        if let EvalAt::Epoch { .. } = at {
            self.evals.push(e);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Var;

    fn pair(prompt: &[u32], chosen: &[u32], rejected: &[u32]) -> PairSample {
        PairSample {
            chosen: [prompt, chosen].concat(),
            rejected: [prompt, rejected].concat(),
            prompt_len: prompt.len(),
        }
    }

    /// Prompt [1, 2], answers [3, 0] and [4, 5, 0] (0 = EOS): padded to T = 5, the chosen
    /// answer's tokens 3 and EOS are predicted at positions 1 and 2, the rejected's at 1, 2, 3.
    #[test]
    fn the_answer_mask_covers_the_answer_and_its_eos() {
        let p = pair(&[1, 2], &[3, 0], &[4, 5, 0]);
        let mask = answer_mask(&[&p], 5);
        assert_eq!(mask, [0.0, 1.0, 1.0, 0.0, /* rejected */ 0.0, 1.0, 1.0, 1.0]);
    }

    /// One pair, beta 0.1: policy (-1, -3), reference (-2, -2.5): h = (1) - (-0.5) = 1.5.
    /// Sigmoid: -log sigmoid(0.15) = ln(1 + e^-0.15); IPO: (1.5 - 5)^2 = 12.25.
    /// The sigmoid loss's gradient in the policy's chosen log-prob is -beta sigmoid(-beta h).
    #[test]
    fn dpo_and_ipo_losses_hand_computed() -> candle_core::Result<()> {
        let dev = Device::Cpu;
        let policy = Var::new(&[-1.0f32, -3.0], &dev)?;
        let reference = Tensor::new(&[-2.0f32, -2.5], &dev)?;
        let loss = dpo_loss(policy.as_tensor(), &reference, 0.1, DpoLoss::Sigmoid)?;
        let want = (1.0 + (-0.15f64).exp()).ln();
        assert!((f64::from(loss.to_scalar::<f32>()?) - want).abs() < 1e-6);
        let g = loss.backward()?.get(policy.as_tensor()).expect("gradient").to_vec1::<f32>()?;
        let sig = 1.0 / (1.0 + 0.15f32.exp());
        assert!((g[0] + 0.1 * sig).abs() < 1e-6 && (g[1] - 0.1 * sig).abs() < 1e-6, "{g:?}");
        let ipo: f32 = dpo_loss(policy.as_tensor(), &reference, 0.1, DpoLoss::Ipo)?.to_scalar()?;
        assert!((ipo - 12.25).abs() < 1e-5, "{ipo}");
        Ok(())
    }

    /// RPO's term: two pairs, chosen rows 0 and 1 with 2 and 1 answer tokens; the rejected rows
    /// do not count. -(-1 - 2 - 4) / 3 tokens = 7/3.
    #[test]
    fn rpo_nll_is_the_chosen_answers_mean_token_nll() -> candle_core::Result<()> {
        let dev = Device::Cpu;
        let logp =
            Tensor::new(&[[-9.0f32, -1.0, -2.0], [-9.0, -4.0, -9.0], [-5.0, -5.0, -5.0], [-6.0, -6.0, -6.0]], &dev)?;
        let mask = Tensor::new(&[[0.0f32, 1.0, 1.0], [0.0, 1.0, 0.0], [1.0, 1.0, 1.0], [0.0, 1.0, 1.0]], &dev)?;
        let nll = chosen_nll(&logp, &mask)?.to_scalar::<f32>()?;
        assert!((nll - 7.0 / 3.0).abs() < 1e-6, "{nll}");
        Ok(())
    }

    /// IPO averages over the answer's tokens, the sigmoid loss sums.
    #[test]
    fn sequence_log_probs_sum_or_average_the_answer_tokens() -> candle_core::Result<()> {
        let dev = Device::Cpu;
        let logp = Tensor::new(&[[-9.0f32, -1.0, -2.0], [-9.0, -4.0, -9.0]], &dev)?;
        let mask = Tensor::new(&[[0.0f32, 1.0, 1.0], [0.0, 1.0, 0.0]], &dev)?;
        assert_eq!(sequence_log_probs(&logp, &mask, DpoLoss::Sigmoid)?.to_vec1::<f32>()?, [-3.0, -4.0]);
        assert_eq!(sequence_log_probs(&logp, &mask, DpoLoss::Ipo)?.to_vec1::<f32>()?, [-1.5, -4.0]);
        Ok(())
    }

    /// Two pairs: implicit rewards 0.1 * (policy - reference).
    #[test]
    fn the_logged_rewards_are_beta_times_the_log_ratio() {
        let s = DpoSums::of(&[-1.0, -2.0, -3.0, -1.0], &[-2.0, -2.0, -2.0, -2.0], 0.1, 0.5);
        let e = s.means();
        assert_eq!(e.pairs, 2);
        assert!((e.reward_chosen - 0.05).abs() < 1e-9 && (e.reward_rejected - 0.0).abs() < 1e-9, "{e:?}");
        assert!((e.reward_accuracy - 0.5).abs() < 1e-12 && (e.reward_margin - 0.05).abs() < 1e-9);
        assert!((e.loss - 0.5).abs() < 1e-12);
    }

    /// Three pairs, beta 0.1, reference -2 throughout: chosen rewards 0.1, 0, -0.2 against
    /// rejected -0.1, 0.05, -0.2 (a tie: not a win); then a batch of one more pair (0.3
    /// against 0.1) added: 4 pairs, 2 wins, the losses' sums.
    #[test]
    fn the_logged_sums_add_over_batches() {
        let mut s = DpoSums::of(&[-1.0, -2.0, -4.0, -3.0, -1.5, -4.0], &[-2.0; 6], 0.1, 0.5);
        let e = s.means();
        assert_eq!((e.pairs, e.reward_accuracy), (3, 1.0 / 3.0));
        let close = |a: f64, b: f64| (a - b).abs() < 1e-7;
        assert!(close(e.reward_chosen, -0.1 / 3.0) && close(e.reward_rejected, -0.25 / 3.0), "{e:?}");
        assert!(close(e.reward_margin, 0.05), "{e:?}");
        s.add(&DpoSums::of(&[1.0, -1.0], &[-2.0; 2], 0.1, 2.0));
        let e = s.means();
        assert_eq!((e.pairs, e.reward_accuracy), (4, 0.5));
        assert!(close(e.loss, (1.5 + 2.0) / 4.0) && close(e.reward_chosen, 0.2 / 4.0), "{e:?}");
        assert!(close(e.reward_rejected, -0.15 / 4.0) && close(e.reward_margin, 0.35 / 4.0), "{e:?}");
    }
}
