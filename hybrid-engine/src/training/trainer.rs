//! The optimizer side of a fine-tuning step (DS-Chat steps 1 and 2, and the PPO models later):
//! gradients of micro-batches accumulate until the accumulation boundary (DeepSpeed's
//! `is_gradient_accumulation_boundary`, counted over the whole run, not per epoch), then are
//! clipped by their global norm and applied by AdamW at the scheduled learning rate.

use crate::comm::ProcessGroup;
use crate::model::params::ParamStore;
use crate::tensor_parallel::shard::{grad_norm_squared, Split};
use crate::training::metrics::Metrics;
use crate::training::optim::{
    clip_coefficient, clip_to_norm, global_grad_norm, AdamW, AdamWConfig, GradAccumulator, SavedOptimizer,
};
use crate::training::precision::{has_overflow, Dtype, LossScaler, LossScaling, Precision, ScaleUpdate};
use crate::training::schedule::LrSchedule;
use crate::training::zero::{self, DataParallel, Partition, ZeroStage};
use crate::training::zero3::ShardedModel;
use anyhow::{bail, Context, Result};
use candle_core::{DType, Tensor};
use serde::{Deserialize, Serialize};
use serde_json::json;
use std::rc::Rc;
use std::sync::Arc;

/// What one optimizer step did.
#[derive(Clone, Copy, Debug)]
pub struct StepReport {
    /// 1-based optimizer step (accumulation boundaries, skipped ones included, as DeepSpeed's
    /// `global_steps`).
    pub step: u64,
    pub lr: f64,
    /// Global gradient norm before clipping (unscaled; inf or NaN on an fp16 overflow).
    pub grad_norm: f64,
    /// The update was skipped: an fp16 overflow, or the other PPO model's (`--align-overflow`).
    pub skipped: bool,
    /// The fp16 loss scale after this step (1 without scaling).
    pub loss_scale: f64,
    /// Updates skipped so far in the run.
    pub skipped_steps: u64,
}

/// Ends a micro-batch of two models trained on the same data (PPO's actor and critic). With
/// `align` (DS-Chat `--align_overflow`), when both reach an accumulation boundary and either's
/// gradients overflowed, both skip their update, so neither moves on experience the other did not
/// learn from.
pub fn micro_batch_done_pair(
    a: (&mut Trainer, &ParamStore),
    b: (&mut Trainer, &ParamStore),
    align: bool,
) -> Result<(Option<StepReport>, Option<StepReport>)> {
    let (ta, pa) = a;
    let (tb, pb) = b;
    let skip =
        align && ta.boundary_next() && tb.boundary_next() && (ta.pending_overflow()? || tb.pending_overflow()?);
    Ok((ta.micro_batch_done_or_skip(pa, skip)?, tb.micro_batch_done_or_skip(pb, skip)?))
}

/// The trainer's counters beyond the optimizer's step, for a checkpoint: accumulation
/// boundaries, forced skips and the fp16 loss scaler.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TrainerProgress {
    pub boundaries: u64,
    pub forced_skips: u64,
    pub scaler: Option<LossScaler>,
}

pub struct Trainer {
    pub optimizer: AdamW,
    pub schedule: LrSchedule,
    /// Micro-batches per optimizer step.
    pub accumulation: usize,
    /// Global-norm clip (0: none).
    pub clip: f64,
    pub precision: Precision,
    /// fp16's dynamic loss scale; `None` for fp32 and bf16.
    pub scaler: Option<LossScaler>,
    /// The trainable parameters forward and backward run on: the masters themselves in fp32,
    /// else their compute-dtype copy, refreshed after each update.
    compute: ParamStore,
    acc: GradAccumulator,
    pending: usize,
    /// Accumulation boundaries passed, skipped steps included.
    pub boundaries: u64,
    /// Updates skipped without an overflow of their own (`--align-overflow`); the scaler counts
    /// the overflows.
    forced_skips: u64,
    /// Data parallelism across ranks (`None`: one rank).
    dp: Option<(DataParallel, Partition)>,
    /// ZeRO stage 2: this rank's shard of the gradients summed over ranks and micro-batches.
    grad_shard: Option<Tensor>,
    /// ZeRO stages 1 and 2 under mixed precision ([`Self::shard_masters`]): this rank's shard of
    /// the fp32 masters in the partition's flat layout; the whole model is then only the
    /// compute copy.
    master_shard: Option<zero::MasterShard>,
    /// ZeRO stage 3: the sharded model, which holds the master shard and the gradient shard.
    zero3: Option<Rc<ShardedModel>>,
    /// Tensor parallelism: the TP group and how each parameter is cut, for the global gradient
    /// norm over the ranks' slices.
    tp: Option<(Arc<ProcessGroup>, Vec<Split>)>,
}

impl Trainer {
    /// A full-precision trainer over `params`, the trainable fp32 masters; see
    /// [`Self::with_precision`] for fp16 and bf16.
    pub fn new(
        params: &ParamStore,
        adam: AdamWConfig,
        schedule: LrSchedule,
        accumulation: usize,
        clip: f64,
    ) -> Result<Self> {
        Ok(Self {
            optimizer: AdamW::new(adam, params)?,
            schedule,
            accumulation,
            clip,
            precision: Precision::default(),
            scaler: None,
            compute: params.compute_copy(params.dtype())?,
            acc: GradAccumulator::new(params),
            pending: 0,
            boundaries: 0,
            forced_skips: 0,
            dp: None,
            grad_shard: None,
            master_shard: None,
            zero3: None,
            tp: None,
        })
    }

    /// A trainer of a model sharded at rest (ZeRO stage 3): the optimizer holds the moments of
    /// this rank's shard only, the gradients reach the model's shard during backward, and a
    /// step updates the shard in place. Precision as [`Self::with_precision`] (the model
    /// gathers its weights in the compute dtype).
    pub fn sharded(
        model: Rc<ShardedModel>,
        adam: AdamWConfig,
        schedule: LrSchedule,
        accumulation: usize,
        clip: f64,
        precision: Precision,
        scaling: LossScaling,
    ) -> Self {
        let empty = ParamStore::default();
        Self {
            optimizer: model.optimizer(adam),
            schedule,
            accumulation,
            clip,
            scaler: (precision.dtype == Dtype::Fp16).then(|| LossScaler::new(scaling)),
            precision,
            acc: GradAccumulator::new(&empty),
            compute: empty,
            pending: 0,
            boundaries: 0,
            forced_skips: 0,
            dp: None,
            grad_shard: None,
            master_shard: None,
            zero3: Some(model),
            tp: None,
        }
    }

    /// Trains as one of the ranks of `dp`'s group with its ZeRO stage: call after
    /// [`Self::with_precision`] and before loading optimizer state. One rank changes nothing.
    pub fn with_data_parallel(mut self, dp: DataParallel) -> Self {
        if dp.world() > 1 {
            let partition = Partition::of(&self.compute, dp.world());
            if dp.shards_optimizer() {
                self.optimizer.keep_only(&partition.ranges(dp.group.rank()));
            }
            // Stage 2 reduces gradients in buckets as backward completes them where a bucket is
            // smaller than the model (else a micro-batch's whole gradient at its end, as one
            // bucket does).
            let device = self.compute.vars.first().map_or(candle_core::Device::Cpu, |v| v.device().clone());
            if dp.stage == ZeroStage::Gradients && dp.bucket < partition.total() {
                let buckets = zero::GradientBuckets::new(dp.clone(), partition.clone(), &self.compute.names, &device);
                self.acc = GradAccumulator::new(&self.compute).with_sink(Box::new(buckets));
            }
            self.dp = Some((dp, partition));
        }
        self
    }

    /// DeepSpeed's stages 1 and 2 under mixed precision: keeps only this rank's shard of the
    /// trained fp32 masters `params` (the caller then drops them); each step updates the shard
    /// and all-gathers it, in the compute dtype, straight into the compute copy. Call after
    /// [`Self::with_data_parallel`] at stage 1 or 2 and [`Self::with_precision`] in fp16/bf16.
    pub fn shard_masters(&mut self, params: &ParamStore) -> Result<()> {
        let Some((dp, partition)) = self.dp.as_ref().filter(|(dp, _)| dp.shards_optimizer() && self.zero3.is_none())
        else {
            bail!("internal error: fp32 masters are sharded at ZeRO stages 1 and 2 across ranks only")
        };
        if self.compute.dtype() == DType::F32 || self.compute.names != params.names {
            bail!("internal error: fp32 masters are sharded beside a whole fp16/bf16 compute copy of them only");
        }
        let device = self.compute.vars.first().map_or(candle_core::Device::Cpu, |v| v.device().clone());
        let values = zero::shard_values(partition, dp.group.rank(), params)?;
        self.master_shard = Some(zero::MasterShard::new(values, dp, &device)?);
        Ok(())
    }

    /// Whether this rank keeps only its shard of the fp32 masters ([`Self::shard_masters`]).
    pub fn shards_masters(&self) -> bool {
        self.master_shard.is_some()
    }

    /// This rank's shard of the fp32 masters ([`Self::shard_masters`]) and its partition.
    pub fn master_shard(&self) -> Option<(&zero::MasterShard, &Partition)> {
        let (_, partition) = self.dp.as_ref()?;
        Some((self.master_shard.as_ref()?, partition))
    }

    /// This rank's shard, in [`Self::master_shard`]'s layout, of `store` (the same parameters as
    /// the masters: an EMA of them).
    pub fn master_shard_of(&self, store: &ParamStore) -> Result<Option<Vec<f32>>> {
        match (&self.dp, &self.master_shard) {
            (Some((dp, partition)), Some(_)) => zero::shard_values(partition, dp.group.rank(), store).map(Some),
            _ => Ok(None),
        }
    }

    /// The whole fp32 values of `values`, every rank's shard in [`Self::master_shard`]'s layout,
    /// put together on the group's first rank (every rank calls it; `None` on the others and
    /// where the masters are whole): a save of the masters, or of an EMA kept so.
    pub fn gather_master_shards(&self, values: &[f32]) -> Result<Option<ParamStore>> {
        match (&self.dp, &self.master_shard) {
            (Some((dp, partition)), Some(_)) => zero::gather_shards_to_first(dp, partition, &self.compute, values),
            _ => Ok(None),
        }
    }

    /// Where this rank keeps only its shard of the fp32 masters and they carry LoRA adapters: the
    /// whole weights generation runs on, the adapters fused in fp32 on the shards and the result
    /// all-gathered in the compute dtype ([`zero::gather_fused_weights`]). Every rank calls it.
    pub fn gather_fused_masters(&self) -> Result<Option<ParamStore>> {
        match (&self.dp, &self.master_shard) {
            (Some((dp, partition)), Some(shard)) if self.compute.lora_scaling().is_some() => {
                shard.with_values(|values| zero::gather_fused_weights(dp, partition, &self.compute, values)).map(Some)
            }
            _ => Ok(None),
        }
    }

    /// The trained parameters in the compute dtype: the masters themselves in fp32.
    pub fn compute_params(&self) -> &ParamStore {
        &self.compute
    }

    /// Trains this rank's slices of a model split over `tp` (tensor parallelism; `params` are the
    /// trained slices): the gradient norm that clipping and the fp16 overflow check read is the
    /// whole model's. With any ZeRO stage across the data-parallel group (at stage 3 the
    /// [`ShardedModel`] is built with [`ShardedModel::with_tensor_parallel`] and computes it).
    pub fn with_tensor_parallel(mut self, tp: Arc<ProcessGroup>, splits: Vec<Split>) -> Self {
        if tp.world() > 1 {
            self.tp = Some((tp, splits));
        }
        self
    }

    /// Whether the ranks hold different pieces of the optimizer state (ZeRO stages 1-3 across
    /// ranks): each saves its own in a checkpoint.
    pub fn shards_optimizer(&self) -> bool {
        self.zero3.is_some() || self.dp.as_ref().is_some_and(|(dp, _)| dp.shards_optimizer())
    }

    /// The optimizer with its full state, gathered from the ranks' shards under ZeRO onto the
    /// data-parallel group's first rank (every rank must call it, together; `None` on the
    /// others): what a checkpoint saves.
    pub fn consolidated_optimizer(&self) -> Result<Option<SavedOptimizer<'_>>> {
        let gathered = match (&self.dp, &self.zero3) {
            (_, Some(model)) => model.consolidate(&self.optimizer)?,
            // The compute copy has the masters' shapes (and is there when they are sharded).
            (Some((dp, partition)), None) if dp.shards_optimizer() => {
                zero::consolidate(dp, partition, &self.optimizer, &self.compute)?
            }
            // Whole on every rank: the save reads it where it is.
            _ => return Ok(Some(SavedOptimizer::Held(&self.optimizer))),
        };
        Ok(gathered.map(SavedOptimizer::Gathered))
    }

    /// Computes in `precision` on `compute`, the compute-dtype copy of the whole store the
    /// masters belong to ([`ParamStore::compute_copy`]; the model must be built from it):
    /// gradients are taken from its trainable part. fp16 gets a dynamic loss scale.
    pub fn with_precision(mut self, precision: Precision, compute: &ParamStore, scaling: LossScaling) -> Self {
        self.compute = compute.trainable();
        self.acc = GradAccumulator::new(&self.compute);
        self.scaler = (precision.dtype == Dtype::Fp16).then(|| LossScaler::new(scaling));
        self.precision = precision;
        self
    }

    /// Runs the LoRA adapters among `params` at `lora_lr` (DS-Chat `--lora-learning-rate`),
    /// scheduled alike with the other parameters.
    pub fn set_lora_learning_rate(&mut self, params: &ParamStore, lora_lr: f64) {
        self.optimizer.set_lora_lr(&params.names, lora_lr, self.schedule.max_lr);
    }

    /// [`Self::set_lora_learning_rate`] of the optimizer's parameters `names` (a sharded model's).
    pub fn set_lora_learning_rate_of(&mut self, names: &[String], lora_lr: f64) {
        self.optimizer.set_lora_lr(names, lora_lr, self.schedule.max_lr);
    }

    /// The factor of each micro-batch's loss before backward: 1 / accumulation steps, so that
    /// accumulated gradients are a mean, times the fp16 loss scale.
    pub fn loss_scale(&self) -> f64 {
        self.dynamic_loss_scale() / self.accumulation as f64
    }

    /// The fp16 loss scale (1 without scaling).
    pub fn dynamic_loss_scale(&self) -> f64 {
        self.scaler.as_ref().map_or(1.0, |s| s.scale)
    }

    /// No gradient is waiting for an optimizer step (a safe point for a checkpoint).
    pub fn at_boundary(&self) -> bool {
        self.pending == 0
    }

    /// The next [`Self::micro_batch_done`] will reach an accumulation boundary.
    pub fn boundary_next(&self) -> bool {
        self.pending + 1 >= self.accumulation
    }

    /// What a checkpoint keeps beyond the optimizer state.
    pub fn progress(&self) -> TrainerProgress {
        TrainerProgress { boundaries: self.boundaries, forced_skips: self.forced_skips, scaler: self.scaler.clone() }
    }

    /// Restores [`Self::progress`]; the precision must be the one the checkpoint was made with.
    pub fn restore_progress(&mut self, p: &TrainerProgress) -> Result<()> {
        if p.scaler.is_some() != self.scaler.is_some() {
            bail!("the checkpoint was trained with another --dtype (loss scaling differs): resume with the flags it was saved with");
        }
        self.boundaries = p.boundaries;
        self.forced_skips = p.forced_skips;
        self.scaler.clone_from(&p.scaler);
        Ok(())
    }

    /// The learning rate of the latest update (of the first, before any).
    pub fn latest_lr(&self) -> f64 {
        self.schedule.lr(self.optimizer.step.saturating_sub(1))
    }

    /// Updates skipped so far.
    pub fn skipped_steps(&self) -> u64 {
        self.scaler.as_ref().map_or(0, |s| s.skipped_steps) + self.forced_skips
    }

    /// Whether the gradients accumulated so far hold an inf or a NaN (what the next step would
    /// find; `--align-overflow` asks both PPO models before either steps).
    pub fn pending_overflow(&self) -> Result<bool> {
        let mut grads = self.acc.partial()?;
        grads.extend(self.grad_shard.clone());
        if let Some(model) = &self.zero3 {
            grads.extend(model.partial_gradients()?);
        }
        let local = has_overflow(&grads)?;
        match self.group() {
            // Every rank must agree, or one would step while another skips.
            Some(group) => {
                let mut flag = [f64::from(u8::from(local))];
                group.all_reduce_scalars(&mut flag, crate::comm::ReduceOp::Max)?;
                Ok(flag[0] > 0.0)
            }
            None => Ok(local),
        }
    }

    /// The group the model is trained across, if more than one rank.
    fn group(&self) -> Option<&crate::comm::ProcessGroup> {
        match (&self.dp, &self.zero3) {
            (_, Some(model)) => Some(model.group()),
            (Some((dp, _)), None) => Some(&dp.group),
            (None, None) => None,
        }
    }

    /// Where a micro-batch's backward adds its gradients.
    pub fn grads(&mut self) -> &mut GradAccumulator {
        &mut self.acc
    }

    /// Call after each micro-batch's backward: steps the optimizer at the boundary.
    pub fn micro_batch_done(&mut self, params: &ParamStore) -> Result<Option<StepReport>> {
        self.micro_batch_done_or_skip(params, false)
    }

    /// As [`Self::micro_batch_done`]; `skip` skips the update at the boundary whatever the
    /// gradients (`--align-overflow`: the other model overflowed).
    pub fn micro_batch_done_or_skip(&mut self, params: &ParamStore, skip: bool) -> Result<Option<StepReport>> {
        self.pending += 1;
        if self.acc.streams() {
            // Stage 2's buckets: what backward left is reduce-scattered now.
            self.acc.end_micro_batch()?;
        } else if let Some((dp, partition)) = self.dp.as_ref().filter(|(dp, _)| dp.stage == ZeroStage::Gradients) {
            // Stage 2 reduce-scatters each micro-batch's gradient at once: the full gradient
            // does not outlive the micro-batch.
            let fresh = self.acc.emptied();
            let grads = std::mem::replace(&mut self.acc, fresh).finish()?;
            let shard = zero::reduce_scatter_gradients(dp, partition, grads)?;
            self.grad_shard = Some(match self.grad_shard.take() {
                Some(acc) => (acc + shard)?,
                None => shard,
            });
        }
        if self.pending < self.accumulation {
            return Ok(None);
        }
        self.step(params, skip).map(Some)
    }

    /// Applies whatever has accumulated (the run's last, partial accumulation), if anything.
    pub fn flush(&mut self, params: &ParamStore) -> Result<Option<StepReport>> {
        if self.pending == 0 {
            return Ok(None);
        }
        self.step(params, false).map(Some)
    }

    fn step(&mut self, params: &ParamStore, force_skip: bool) -> Result<StepReport> {
        // Back to a mean of the micro-batches' gradients: a partial accumulation was scaled by
        // 1/accumulation per micro-batch, and fp16 gradients carry the loss scale.
        let mut fix = self.accumulation as f64 / self.pending as f64;
        if let Some(s) = &self.scaler {
            fix /= s.scale;
        }
        let mut gradients = self.take_gradients()?;
        if let Gradients::Shard(_) = gradients {
            // Shards hold sums over ranks: the mean is over ranks too.
            fix /= self.group().map_or(1, |g| g.world()) as f64;
        }
        // On a GPU the optimizer step is one launch that reads each gradient as backward made
        // it and applies `fix` and the clipping as it goes; the rest works on f32 gradients with
        // `fix` applied here.
        let fused = match &gradients {
            Gradients::Full(grads) => self.tp.is_none() && self.optimizer.fuses(params, grads, &self.compute),
            Gradients::Shard(_) => false,
        };
        if !fused {
            for g in gradients.tensors_mut() {
                *g = g.to_dtype(DType::F32)?;
                if fix != 1.0 {
                    *g = (&*g * fix)?;
                }
            }
        }
        self.pending = 0;
        self.boundaries += 1;
        let grad_norm = match (&gradients, self.group(), &self.tp) {
            (Gradients::Shard(shard), _, _) if self.zero3.is_some() => {
                self.zero3.as_ref().expect("checked").grad_norm(shard)?
            }
            (Gradients::Shard(shard), Some(group), Some((tp, splits))) => {
                let (_, partition) =
                    self.dp.as_ref().context("internal error: gradient shards without data parallelism")?;
                zero::sharded_grad_norm_tensor_parallel(group, tp, (splits, partition), shard)?
            }
            (Gradients::Shard(shard), Some(group), _) => zero::sharded_grad_norm(group, shard)?,
            (Gradients::Full(grads), _, Some((tp, splits))) => grad_norm_squared(splits, grads, tp)?.sqrt(),
            // `fix` is positive: the norm of the corrected gradients.
            _ if fused => fix * global_grad_norm(gradients.tensors_mut())?,
            _ => global_grad_norm(gradients.tensors_mut())?,
        };
        let overflow = !grad_norm.is_finite();
        let skipped = match &mut self.scaler {
            Some(scaler) => scaler.update(overflow)? == ScaleUpdate::Skip || force_skip,
            None if overflow => bail!(
                "gradients became {grad_norm} at step {} in {}: lower --learning-rate or add --num-warmup-steps",
                self.boundaries,
                self.precision.dtype.name()
            ),
            None => force_skip,
        };
        if skipped && !overflow {
            self.forced_skips += 1;
        }
        let loss_scale = self.dynamic_loss_scale();
        // A skipped step leaves the weights, the moments and the schedule where they were, as
        // DeepSpeed does on overflow.
        let lr = self.schedule.lr(self.optimizer.step);
        if !skipped && fused {
            let scale = fix * clip_coefficient(grad_norm, self.clip);
            self.optimizer.step_fused(params, gradients.tensors_mut(), lr, scale, &self.compute)?;
        } else if !skipped {
            clip_to_norm(gradients.tensors_mut(), grad_norm, self.clip)?;
            match (&gradients, &self.dp, &self.zero3) {
                (Gradients::Shard(shard), _, Some(model)) => model.adamw_step(&mut self.optimizer, shard, lr)?,
                (Gradients::Shard(shard), Some((dp, partition)), None) => match &mut self.master_shard {
                    Some(masters) => {
                        masters.step(dp.group.rank(), partition, &mut self.optimizer, shard, lr)?;
                        zero::all_gather_parameters(dp, partition, &self.compute, zero::Held::of(masters))?
                    }
                    None => zero::sharded_adamw_step(dp, partition, &mut self.optimizer, params, shard, lr)?,
                },
                (Gradients::Full(grads), _, _) => self.optimizer.step(params, grads, lr)?,
                (Gradients::Shard(_), None, None) => unreachable!("shards only exist under data parallelism"),
            }
            if self.zero3.is_none() && self.master_shard.is_none() {
                self.compute.refresh_from(params)?;
            }
        }
        Ok(StepReport {
            step: self.boundaries,
            lr,
            grad_norm,
            skipped,
            loss_scale,
            skipped_steps: self.skipped_steps(),
        })
    }

    /// The accumulated gradients, reduced over ranks as the ZeRO stage says: all of them
    /// averaged (stage 0), or this rank's shard of their sum (stages 1 and 2).
    fn take_gradients(&mut self) -> Result<Gradients> {
        if let Some(model) = &self.zero3 {
            return Ok(Gradients::Shard(model.take_gradient_shard()?));
        }
        if self.acc.streams() {
            return Ok(Gradients::Shard(self.acc.take_reduced()?));
        }
        let fresh = self.acc.emptied();
        let acc = std::mem::replace(&mut self.acc, fresh);
        match &self.dp {
            // As held (bf16/f16 after one micro-batch in mixed precision): `step` decides.
            None => Ok(Gradients::Full(acc.finish_in_compute_dtype()?)),
            Some((dp, _)) if dp.stage == ZeroStage::Disabled => {
                Ok(Gradients::Full(zero::all_reduce_gradients(dp, acc.finish()?)?))
            }
            Some((dp, partition)) if dp.stage == ZeroStage::OptimizerStates => {
                Ok(Gradients::Shard(zero::reduce_scatter_gradients(dp, partition, acc.finish()?)?))
            }
            Some(_) => {
                let shard = self.grad_shard.take();
                Ok(Gradients::Shard(
                    shard.ok_or_else(|| anyhow::anyhow!("internal error: no gradient shard at the boundary"))?,
                ))
            }
        }
    }
}

/// What an optimizer step works on.
enum Gradients {
    /// One gradient per parameter.
    Full(Vec<Tensor>),
    /// This rank's shard of the flat gradient (ZeRO stages 1 and 2).
    Shard(Tensor),
}

impl Gradients {
    fn tensors_mut(&mut self) -> &mut [Tensor] {
        match self {
            Self::Full(g) => g,
            Self::Shard(s) => std::slice::from_mut(s),
        }
    }
}

/// The log of a fine-tuning loop: a `metrics.jsonl` record per optimizer step and, every
/// `interval` steps, a Megatron-style line with the mean loss, time per step and throughput
/// since the previous line (training time only: evaluation and saving are not counted).
pub struct StepLog {
    interval: u64,
    total: u64,
    /// What `items` counts in the throughput column ("tokens", "pairs").
    unit: &'static str,
    /// fp16: a non-finite loss is an overflow the loss scaler handles (the step is skipped),
    /// not the end of the run.
    tolerate_overflow: bool,
    loss: f64,
    micro_batches: usize,
    items: usize,
    secs: f64,
    steps: u64,
}

impl StepLog {
    pub fn new(interval: u64, total: u64, unit: &'static str) -> Self {
        Self {
            interval,
            total,
            unit,
            tolerate_overflow: false,
            loss: 0.0,
            micro_batches: 0,
            items: 0,
            secs: 0.0,
            steps: 0,
        }
    }

    /// For a trainer with a loss scaler (fp16): non-finite losses are overflows, not fatal.
    pub fn for_trainer(interval: u64, total: u64, unit: &'static str, trainer: &Trainer) -> Self {
        Self { tolerate_overflow: trainer.scaler.is_some(), ..Self::new(interval, total, unit) }
    }

    /// One micro-batch: its loss, the items it held and the seconds it took. A non-finite loss
    /// ends the run with advice (unless fp16's loss scaler will skip the step).
    pub fn micro_batch(&mut self, loss: f32, items: usize, secs: f64, epoch: usize) -> Result<()> {
        if !loss.is_finite() {
            if !self.tolerate_overflow {
                bail!("the loss became {loss} in epoch {epoch}: lower --learning-rate or add --num-warmup-steps");
            }
        } else {
            self.loss += f64::from(loss);
            self.micro_batches += 1;
        }
        self.items += items;
        self.secs += secs;
        Ok(())
    }

    /// After an optimizer step; `loss` is the last micro-batch's.
    pub fn step(&mut self, metrics: &mut Metrics, r: &StepReport, epoch: usize, loss: f32) -> Result<()> {
        metrics.record(json!({
            "step": r.step, "epoch": epoch, "loss": loss, "lr": r.lr, "grad_norm": r.grad_norm,
            "loss_scale": r.loss_scale, "skipped": r.skipped, "skipped_steps": r.skipped_steps,
        }))?;
        metrics.advance(format!("loss {loss:.3}"));
        self.steps += 1;
        if r.step.is_multiple_of(self.interval) || r.step == self.total {
            let line = format!(
                " step {:>6}/{} | epoch {epoch} | elapsed time per step (ms): {:.1} | learning rate: {:.3E} | loss: {:.4} | grad norm: {:.3} | loss scale: {} | skipped steps: {} | {}/s: {:.1} |",
                r.step,
                self.total,
                1000.0 * self.secs / self.steps as f64,
                r.lr,
                self.loss / self.micro_batches.max(1) as f64,
                r.grad_norm,
                r.loss_scale,
                r.skipped_steps,
                self.unit,
                self.items as f64 / self.secs,
            );
            metrics.println(&line);
            metrics.record(json!({"step": r.step, "ms_per_step": 1000.0 * self.secs / self.steps as f64, "interval_loss": self.loss / self.micro_batches.max(1) as f64, format!("{}_per_sec", self.unit): self.items as f64 / self.secs}))?;
            *self =
                Self { tolerate_overflow: self.tolerate_overflow, ..Self::new(self.interval, self.total, self.unit) };
        }
        Ok(())
    }
}

/// Optimizer steps of a run: `epochs` passes over `micro_batches` micro-batches each, stepping
/// every `accumulation` of them and once more for a final partial accumulation.
pub fn total_steps(micro_batches_per_epoch: usize, epochs: usize, accumulation: usize) -> u64 {
    (micro_batches_per_epoch * epochs).div_ceil(accumulation) as u64
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::gpt2::Gpt2Config;
    use crate::training::precision::{Dtype, LossScaling, Precision};
    use crate::training::schedule::DecayStyle;
    use candle_core::{Device, Tensor};

    /// A trainer over its own tiny GPT-2 in fp16, and a micro-batch that overflows or not.
    fn fp16_trainer(seed: u64) -> Result<(ParamStore, crate::model::gpt2::Gpt2, Trainer)> {
        let cfg = Gpt2Config { n_layer: 1, n_embd: 8, n_head: 2, n_positions: 8, vocab_size: 16, ..Gpt2Config::tiny() };
        let cfg = Gpt2Config { resid_pdrop: 0.0, embd_pdrop: 0.0, attn_pdrop: 0.0, ..cfg };
        let params = ParamStore::init(&cfg, seed, &Device::Cpu)?;
        let compute = params.compute_copy(candle_core::DType::F16)?;
        let model = compute.model(&cfg)?;
        let schedule = LrSchedule::constant(0.1);
        let precision = Precision { dtype: Dtype::Fp16, fp32_loss: false };
        let t = Trainer::new(&params, AdamWConfig::default(), schedule, 1, 0.0)?.with_precision(
            precision,
            &compute,
            LossScaling::default(),
        );
        Ok((params, model, t))
    }

    fn backward(model: &crate::model::gpt2::Gpt2, t: &mut Trainer, overflow: bool) -> Result<()> {
        let ids = Tensor::new(&[[1u32, 2, 3]], &Device::Cpu)?;
        let factor = if overflow { 1e30 } else { 1.0 };
        let loss = (model.lm_loss(&ids, &ids, None)? * (factor * t.loss_scale()))?;
        t.grads().add(&loss.backward()?)?;
        Ok(())
    }

    #[test]
    fn aligned_overflow_skips_both_models_and_unaligned_only_the_overflowing_one() -> Result<()> {
        for align in [true, false] {
            let (pa, ma, mut ta) = fp16_trainer(1)?;
            let (pb, mb, mut tb) = fp16_trainer(2)?;
            backward(&ma, &mut ta, true)?;
            backward(&mb, &mut tb, false)?;
            let (ra, rb) = micro_batch_done_pair((&mut ta, &pa), (&mut tb, &pb), align)?;
            let (ra, rb) = (ra.expect("boundary"), rb.expect("boundary"));
            assert!(ra.skipped, "the overflowing model always skips");
            assert_eq!(rb.skipped, align, "the clean one skips only when aligned");
            assert_eq!(tb.optimizer.step, if align { 0 } else { 1 });
            assert_eq!((ra.skipped_steps, rb.skipped_steps), (1, u64::from(align)));
            // Only a real overflow counts against the loss scale's hysteresis.
            assert_eq!(ta.scaler.as_ref().unwrap().skipped_steps, 1);
            assert_eq!(tb.scaler.as_ref().unwrap().skipped_steps, 0);
        }
        Ok(())
    }

    /// As Hugging Face's schedulers and Megatron's step after the optimizer: the first update
    /// of a warmup runs at 0 (the weights stay, Adam's moments fill), the last of the run above
    /// the floor.
    #[test]
    fn each_update_runs_at_the_schedule_of_the_updates_before_it() -> Result<()> {
        let cfg = Gpt2Config { n_layer: 1, n_embd: 8, n_head: 2, n_positions: 8, vocab_size: 16, ..Gpt2Config::tiny() };
        let cfg = Gpt2Config { resid_pdrop: 0.0, embd_pdrop: 0.0, attn_pdrop: 0.0, ..cfg };
        let params = ParamStore::init(&cfg, 0, &Device::Cpu)?;
        let schedule = LrSchedule {
            max_lr: 0.1,
            min_lr: 0.0,
            warmup_iters: 2,
            decay_iters: 4,
            style: DecayStyle::Linear,
            samples_per_iteration: 1,
        };
        let mut t = Trainer::new(&params, AdamWConfig::default(), schedule, 1, 0.0)?;
        let ids = Tensor::new(&[[1u32, 2, 3]], &Device::Cpu)?;
        let values = |p: &ParamStore| -> Result<Vec<f32>> {
            let flat: Result<Vec<Vec<f32>>> =
                p.vars.iter().map(|v| Ok(v.as_tensor().flatten_all()?.to_vec1::<f32>()?)).collect();
            Ok(flat?.concat())
        };
        let mut rates = Vec::new();
        for update in 1..=4 {
            let before = values(&params)?;
            let loss = (params.model(&cfg)?.lm_loss(&ids, &ids, None)? * t.loss_scale())?;
            t.grads().add(&loss.backward()?)?;
            let report = t.micro_batch_done(&params)?.expect("every micro-batch is a boundary");
            assert_eq!(report.lr, t.latest_lr(), "the latest rate, as step 3 logs it");
            let moved = values(&params)? != before;
            assert_eq!(moved, update > 1, "update {update} at {} moved the weights: {moved}", report.lr);
            rates.push(report.lr);
        }
        assert_eq!(rates, [0.0, 0.05, 0.1, 0.05]);
        Ok(())
    }

    #[test]
    fn steps_at_the_boundary_and_flushes_a_partial_accumulation_as_a_mean() -> Result<()> {
        assert_eq!(total_steps(5, 2, 3), 4);
        let cfg = Gpt2Config { n_layer: 1, n_embd: 8, n_head: 2, n_positions: 8, vocab_size: 16, ..Gpt2Config::tiny() };
        let params = ParamStore::init(&cfg, 0, &Device::Cpu)?;
        let schedule = LrSchedule::constant(0.1);
        let mut t = Trainer::new(&params, AdamWConfig::default(), schedule, 2, 0.0)?;
        let ids = Tensor::new(&[[1u32, 2, 3]], &Device::Cpu)?;
        let model = params.model(&cfg)?;
        let backward = |t: &mut Trainer| -> Result<()> {
            let loss = (model.lm_loss(&ids, &ids, None)? * t.loss_scale())?;
            t.grads().add(&loss.backward()?)?;
            Ok(())
        };
        backward(&mut t)?;
        assert!(t.micro_batch_done(&params)?.is_none(), "one of two micro-batches: no step yet");
        backward(&mut t)?;
        let report = t.micro_batch_done(&params)?.expect("boundary");
        assert_eq!((report.step, report.lr), (1, 0.1));
        assert!(t.flush(&params)?.is_none(), "nothing pending");
        // A lone micro-batch flushed gets its full gradient, not the 1/accumulation share.
        let mut full = GradAccumulator::new(&params);
        full.add(&model.lm_loss(&ids, &ids, None)?.backward()?)?;
        let want = crate::training::optim::global_grad_norm(&full.finish()?)?;
        backward(&mut t)?;
        assert!(t.micro_batch_done(&params)?.is_none());
        let flushed = t.flush(&params)?.expect("partial accumulation is applied");
        assert_eq!(flushed.step, 2);
        assert!((flushed.grad_norm - want).abs() < 1e-5 * want, "{} vs {want}", flushed.grad_norm);
        Ok(())
    }
}
