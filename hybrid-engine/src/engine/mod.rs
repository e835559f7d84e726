//! The training side of the hybrid engine: one [`Engine`] owns a trained model and everything
//! that trains it, as DeepSpeed's engine does: the fp32 masters, what the optimizer updates, the
//! compute-dtype copy forward and backward run on, the model over it (whole, or sharded at rest
//! under ZeRO stage 3), the optimizer with its ZeRO and tensor-parallel state. Every step trains
//! through it: pretraining, SFT, the reward model, DPO, and PPO's actor and critic.
//!
//! An engine is built from an [`EngineConfig`] (what the flags say; `cli/` makes it) and the
//! ranks it trains over ([`Ranks`]). A micro-batch is [`Engine::forward_backward`] with a loss
//! head, then [`Engine::step`]; saves read [`Engine::gather_weights`] and, for a resumable
//! checkpoint, [`Engine::gather_optimizer`].

pub mod epochs;

use crate::comm::{ProcessGroup, WireDtype};
use crate::model::gpt2::{Dropout, Gpt2Config};
use crate::model::params::ParamStore;
use crate::model::positions::Positions;
use crate::model::reward_model::{Heads, RewardModel};
use crate::training::optim::{AdamW, AdamWConfig, SavedOptimizer};
use crate::training::precision::{LossScaling, Precision};
use crate::training::schedule::LrSchedule;
use crate::training::tensor_parallel::TensorParallel;
use crate::training::train_step::{Backward, TrainedModel};
use crate::training::trainer::{micro_batch_done_pair, StepReport, Trainer, TrainerProgress};
use crate::training::zero::{DataParallel, ZeroStage};
use crate::training::zero3::ShardedModel;
use anyhow::{bail, Result};
use candle_core::{DType, Device, Tensor};
use std::collections::HashMap;
use std::rc::Rc;
use std::sync::Arc;

/// What the trunk's last hidden state feeds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Head {
    /// The tied LM head (pretraining, SFT, DPO, PPO's actor).
    Lm,
    /// A scalar score per token (the reward model, PPO's critic): `score.weight` among the
    /// parameters.
    Score,
}

/// How a model's training is spread over the ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ParallelConfig {
    pub zero_stage: ZeroStage,
    /// Gradient values per all-reduce at stage 0 (DeepSpeed's `reduce_bucket_size`).
    pub reduce_bucket_size: usize,
    /// Values per round of stages 1 and 2's all-gather of the updated weights (DeepSpeed's
    /// `allgather_bucket_size`).
    pub allgather_bucket_size: usize,
    /// DS-Chat's `--offload`: the optimizer states in host memory (see [`check_offload`]).
    pub offload: bool,
    /// The type gradients travel in through their reductions (`--communication-data-type`).
    pub communication_data_type: WireDtype,
}

/// Where `--offload` (DeepSpeed's `offload_optimizer: cpu`: the fp32 masters and Adam moments in
/// host memory, the step taken there) holds for a model at `stage` over `world` ranks: on GPUs at
/// ZeRO stages 1-3 across ranks, which step each rank's shard on the host. Elsewhere it would
/// change nothing (a CPU run is all in host memory; a GPU at stage 0 or alone keeps the optimizer
/// on the GPU), so it is refused rather than ignored.
pub fn check_offload(on_gpu: bool, stage: ZeroStage, world: usize) -> Result<()> {
    if !on_gpu {
        bail!("--offload moves the optimizer states off a GPU, and this run is on the CPU (all in host memory): drop --offload")
    }
    if stage == ZeroStage::Disabled || world == 1 {
        bail!(
            "--offload: on a GPU the optimizer states move to host memory at ZeRO stages 1-3 across ranks; \
             at stage {} on {world} rank(s) they stay on the GPU: drop --offload, or train on several ranks at --zero-stage 1-3",
            stage.number()
        )
    }
    Ok(())
}

/// Whether a model trained over `dp` keeps only its shard of the fp32 masters (under tensor
/// parallelism, of its TP slices) at ZeRO stages 1 and 2, as DeepSpeed's do: in fp16/bf16 (in
/// fp32 the masters are the weights the model runs on, whole on every rank at these stages),
/// with every parameter trained (a frozen trunk, `--only-optimize-lora`, keeps them whole; said
/// in the run's log). With LoRA, generation fuses the adapters on the shards
/// ([`Engine::gather_fused_for_generation`]).
pub fn shards_masters(dp: &DataParallel, compute: DType, params: &ParamStore) -> bool {
    dp.shards_optimizer()
        && dp.stage != ZeroStage::Parameters
        && compute != DType::F32
        && params.frozen().iter().all(|f| !f)
}

/// Everything about how a model trains that is not the model itself: what `cli/` makes of the
/// flags, checked there.
#[derive(Clone, Debug)]
pub struct EngineConfig {
    pub optimizer: AdamWConfig,
    pub schedule: LrSchedule,
    /// Micro-batches per optimizer step.
    pub gradient_accumulation_steps: usize,
    /// Global-norm clip (0: none).
    pub gradient_clipping: f64,
    pub precision: Precision,
    /// fp16's dynamic loss scale (read only in fp16).
    pub loss_scaling: LossScaling,
    /// The LoRA adapters' parameter group's peak learning rate, scheduled like the others
    /// (`None`: the schedule's).
    pub lora_learning_rate: Option<f64>,
    /// Recompute each block in backward instead of keeping its activations.
    pub checkpoint_activations: bool,
    pub parallel: ParallelConfig,
}

/// The ranks an engine trains over: the data-parallel group its ZeRO stage shards across and,
/// under tensor parallelism, the TP layout (the parameters given are then this rank's slices).
#[derive(Clone)]
pub struct Ranks {
    pub data: Arc<ProcessGroup>,
    pub tensor: Option<TensorParallel>,
}

/// A trained model and its optimizer; see the module's documentation.
pub struct Engine {
    pub config: Gpt2Config,
    /// Every parameter (trunk, head, LoRA adapters) in fp32; empty once [`Self::release_masters`]
    /// ran under ZeRO stage 3 (the model holds this rank's shard of them) or, under mixed
    /// precision, stages 1 and 2 (the trainer does; [`shards_masters`]).
    masters: ParamStore,
    /// What the optimizer updates: `masters`, or with `--only-optimize-lora` the adapters (and
    /// a score head); shares storage with `masters`.
    trainable: ParamStore,
    /// The trainable part of the compute-dtype copy the model runs on (the masters themselves
    /// in fp32): the parameters whose gradients the trainer accumulates.
    compute: ParamStore,
    model: TrainedModel,
    trainer: Trainer,
    checkpoint_activations: bool,
    tensor: Option<TensorParallel>,
}

impl Engine {
    /// Trains `params` (fp32; under tensor parallelism this rank's slices) as `head` says, as
    /// `cfg` says, over `ranks`. At ZeRO stage 3 across ranks the model keeps this rank's shard
    /// of them; the whole masters stay until [`Self::release_masters`], so that a resumed
    /// optimizer state can be restored first.
    pub fn new(cfg: &EngineConfig, config: &Gpt2Config, head: Head, params: ParamStore, ranks: Ranks) -> Result<Self> {
        let Ranks { data, tensor } = ranks;
        if cfg.parallel.offload {
            let on_gpu = params.vars.first().is_some_and(|v| v.device().is_cuda());
            check_offload(on_gpu, cfg.parallel.zero_stage, data.world())?;
        }
        let dp = DataParallel::new(data, cfg.parallel.zero_stage, cfg.parallel.reduce_bucket_size)
            .with_gather_bucket(cfg.parallel.allgather_bucket_size)
            .with_wire(cfg.parallel.communication_data_type)
            .with_offload(cfg.parallel.offload);
        let trainable = params.trainable();
        let (precision, dtype) = (cfg.precision, cfg.precision.dtype.dtype());
        let accumulation = cfg.gradient_accumulation_steps;
        let (model, mut trainer, compute) = if dp.shards_parameters() {
            let mut sharded = ShardedModel::new(dp.group.clone(), config, &params, dtype)?;
            if let Some(tp) = &tensor {
                sharded = sharded.with_tensor_parallel(tp.tp().clone());
            }
            let (model, trainer) = Self::sharded_parts(cfg, sharded)?;
            (model, trainer, ParamStore::default())
        } else {
            // Forward and backward run on a copy in the compute dtype (the masters stay fp32).
            let compute = params.compute_copy(dtype)?;
            let mut trunk = match &tensor {
                Some(tp) => tp.model(&compute, config)?,
                None => compute.model(config)?,
            };
            trunk.fp32_loss = precision.fp32_loss;
            let model = match head {
                Head::Lm => TrainedModel::lm(trunk),
                Head::Score => TrainedModel::reward(RewardModel::from_trunk(trunk, &compute, config)?),
            };
            let mut trainer = Trainer::new(
                &trainable,
                cfg.optimizer.clone(),
                cfg.schedule.clone(),
                accumulation,
                cfg.gradient_clipping,
            )?
            .with_precision(precision, &compute, cfg.loss_scaling)
            .with_data_parallel(dp.clone());
            if let Some(buckets) = trainer.grads().sink_buckets() {
                println!(
                    "ZeRO stage 2: gradients reduce-scattered during backward in {buckets} buckets of about {} values (--reduce-bucket-size)",
                    dp.bucket
                );
            }
            if dp.shards_optimizer() && dtype != DType::F32 {
                let name = cfg.precision.dtype.name();
                if shards_masters(&dp, dtype, &params) {
                    trainer.shard_masters(&trainable)?;
                    println!(
                        "ZeRO stage {} in {name}: each rank keeps 1/{} of the fp32 masters ({} of {} values) beside the whole {name} copy; updated weights all-gathered in {name}",
                        dp.stage,
                        dp.world(),
                        trainable.numel().div_ceil(dp.world()),
                        trainable.numel()
                    );
                } else {
                    println!(
                        "ZeRO stage {} in {name}: the fp32 masters stay whole on every rank (sharded only with every parameter trained: not with --only-optimize-lora); Adam moments sharded",
                        dp.stage
                    );
                }
            }
            if dp.shards_optimizer() && params.vars.first().is_some_and(|v| v.device().is_cuda()) {
                println!(
                    "ZeRO stage {}: this rank's optimizer states (Adam moments{}) {}",
                    dp.stage,
                    if trainer.shards_masters() { ", its shard of the fp32 masters" } else { "" },
                    match dp.offload {
                        false => "live and step on the GPU (--offload keeps them in host memory)",
                        true => "live and step in host memory (--offload)",
                    }
                );
            }
            (model, trainer, compute.trainable())
        };
        // Under tensor parallelism the gradient norm is the whole model's.
        if let Some(tp) = &tensor {
            let splits = trainable.names.iter().map(|name| config.split_of(name)).collect();
            trainer = trainer.with_tensor_parallel(tp.tp().clone(), splits);
        }
        if let Some(lr) = cfg.lora_learning_rate {
            trainer.set_lora_learning_rate(&trainable, lr);
        }
        Ok(Self {
            config: config.clone(),
            masters: params,
            trainable,
            compute,
            model,
            trainer,
            checkpoint_activations: cfg.checkpoint_activations,
            tensor,
        })
    }

    /// Trains `sharded`, a GPT-2 built sharded over the data-parallel ranks (ZeRO stage 3
    /// without tensor parallelism: [`ShardedModel::init`] or [`ShardedModel::read`], LoRA
    /// adapters included), as `cfg` says: no rank ever holds the whole model.
    /// `config` is the model's (its heads' fields included, as `config.json` says them).
    pub fn new_sharded(cfg: &EngineConfig, config: &Gpt2Config, mut sharded: ShardedModel) -> Result<Self> {
        if cfg.parallel.offload {
            check_offload(!sharded.device().is_cpu(), cfg.parallel.zero_stage, sharded.group().world())?;
        }
        sharded.cfg = config.clone();
        let config = config.clone();
        let lora = sharded.has_lora();
        let trained = sharded.trained_names().to_vec();
        let (model, mut trainer) = Self::sharded_parts(cfg, sharded)?;
        if let Some(lr) = cfg.lora_learning_rate.filter(|_| lora) {
            trainer.set_lora_learning_rate_of(&trained, lr);
        }
        Ok(Self {
            config,
            masters: ParamStore::default(),
            trainable: ParamStore::default(),
            compute: ParamStore::default(),
            model,
            trainer,
            checkpoint_activations: cfg.checkpoint_activations,
            tensor: None,
        })
    }

    /// The model and trainer of a sharded model (ZeRO stage 3).
    fn sharded_parts(cfg: &EngineConfig, mut sharded: ShardedModel) -> Result<(TrainedModel, Trainer)> {
        if sharded.device().is_cuda() {
            if !cfg.parallel.offload {
                sharded = sharded.with_shard_on_device(DType::F32)?;
            }
            println!(
                "ZeRO stage 3: this rank's optimizer states (Adam moments, its shard of the fp32 masters) {}",
                match cfg.parallel.offload {
                    false =>
                        "live and step on the GPU, units gathered from them there (--offload keeps them in host memory)",
                    true => "live and step in host memory (--offload), units gathered to the GPU from there",
                }
            );
        }
        sharded.fp32_loss = cfg.precision.fp32_loss;
        sharded.gradient_wire = cfg.parallel.communication_data_type;
        sharded.reduce_bucket = cfg.parallel.reduce_bucket_size;
        let sharded = Rc::new(sharded);
        let trainer = Trainer::sharded(
            sharded.clone(),
            cfg.optimizer.clone(),
            cfg.schedule.clone(),
            cfg.gradient_accumulation_steps,
            cfg.gradient_clipping,
            cfg.precision,
            cfg.loss_scaling,
        );
        Ok((TrainedModel::Sharded(sharded), trainer))
    }

    /// The model, whole or sharded, for forwards outside training (evaluation, rollouts).
    pub fn model(&self) -> &TrainedModel {
        &self.model
    }

    /// The model sharded at rest (ZeRO stage 3 across ranks), if it is.
    pub fn sharded(&self) -> Option<&ShardedModel> {
        match &self.model {
            TrainedModel::Sharded(model) => Some(model),
            TrainedModel::Whole { .. } => None,
        }
    }

    /// The optimizer side: schedule, loss scale, counters.
    pub fn trainer(&self) -> &Trainer {
        &self.trainer
    }

    /// The fp32 masters (this rank's slices under tensor parallelism); empty under ZeRO stage 3
    /// after [`Self::release_masters`].
    pub fn masters(&self) -> &ParamStore {
        &self.masters
    }

    /// What the optimizer updates (a view of [`Self::masters`]).
    pub fn trainable(&self) -> &ParamStore {
        &self.trainable
    }

    /// The tensor-parallel layout the model is split over.
    pub fn tensor_parallel(&self) -> Option<&TensorParallel> {
        self.tensor.as_ref()
    }

    /// Under ZeRO stage 3, and under mixed precision at stages 1 and 2, drops the whole fp32
    /// masters once the shards and any resumed optimizer state are taken from them: each rank
    /// keeps only its shard (at stages 1 and 2 beside the whole compute copy).
    pub fn release_masters(&mut self) {
        if self.sharded().is_some() {
            (self.masters, self.trainable, self.compute) = Default::default();
        } else if self.trainer.shards_masters() {
            (self.masters, self.trainable) = Default::default();
        }
    }

    /// Whether this rank keeps only its shard of the fp32 masters: ZeRO stage 3 across ranks, or
    /// stages 1 and 2 under mixed precision ([`shards_masters`]).
    pub fn shards_masters(&self) -> bool {
        self.sharded().is_some() || self.trainer.shards_masters()
    }

    /// The weights generation and evaluation read where they are whole on every rank: the fp32
    /// masters, or where only their shard is kept at ZeRO stages 1 and 2, the compute copy (what
    /// generation casts the masters to anyway). Empty under ZeRO stage 3 (gather them:
    /// [`Self::gather_for_generation`]).
    pub fn whole_weights(&self) -> &ParamStore {
        match self.trainer.shards_masters() {
            true => &self.compute,
            false => &self.masters,
        }
    }

    /// The names and element counts of the trained parameters, wherever they are held.
    pub fn trained_inventory(&self) -> (Vec<String>, Vec<usize>) {
        match self.sharded() {
            Some(model) => (model.trained_names().to_vec(), model.trained_numels()),
            None => {
                let trained = self.trainer.compute_params();
                (trained.names.clone(), trained.vars.iter().map(|v| v.elem_count()).collect())
            }
        }
    }

    /// This rank's shard of the fp32 masters' values where it keeps only that
    /// ([`Self::shards_masters`]): what an elementwise companion (step 3's EMA) keeps too.
    pub fn master_shard_values(&self) -> Result<Option<Vec<f32>>> {
        Ok(match self.sharded() {
            Some(model) => Some(model.shard_values()?),
            None => self.trainer.master_shard().map(|(shard, _)| shard.with_values(|v| Ok(v.to_vec()))).transpose()?,
        })
    }

    /// This rank's shard of `store` (the same parameters as the masters, whole) in
    /// [`Self::master_shard_values`]' layout; `None` where the masters are whole.
    pub fn master_shard_of(&self, store: &ParamStore) -> Result<Option<Vec<f32>>> {
        match self.sharded() {
            Some(model) => model.shard_of(store).map(Some),
            None => self.trainer.master_shard_of(store),
        }
    }

    /// The whole fp32 values of shards in [`Self::master_shard_values`]' layout, put together on
    /// rank 0 (under ZeRO-3 with TP, the first data-parallel rank of each TP rank). Every rank
    /// must call it; `None` on the others and where the masters are whole.
    pub fn gather_master_shard_values(&self, values: &[f32]) -> Result<Option<ParamStore>> {
        match self.sharded() {
            Some(model) => model.gather_shard_values(values),
            None => self.trainer.gather_master_shards(values),
        }
    }

    /// How this micro-batch's backward runs: its loss weighs `share` of the accumulated mean
    /// (1 for a whole micro-batch; a rank's share of a global one), times the fp16 loss scale.
    fn backward(&self, share: f64) -> Backward {
        Backward { checkpoint_activations: self.checkpoint_activations, loss_scale: self.trainer.loss_scale() * share }
    }

    /// Runs the trunk on `ids`, hands its last hidden state and the weights of its heads to
    /// `head` (which returns a scalar loss), and accumulates the gradients of the loss weighted
    /// by `share` (see [`Self::backward`]). Returns the unscaled loss.
    pub fn forward_backward(
        &mut self,
        ids: &Tensor,
        pos: &Positions,
        dropout: Option<&Dropout>,
        share: f64,
        head: impl Fn(&Heads, &Tensor) -> candle_core::Result<Tensor>,
    ) -> Result<f32> {
        let how = self.backward(share);
        self.model.forward_backward(ids, pos, dropout, how, self.trainer.grads(), head)
    }

    /// [`Self::forward_backward`] of the mean LM loss of `ids` against `targets` (B, T each).
    pub fn lm_forward_backward(
        &mut self,
        ids: &Tensor,
        targets: &Tensor,
        dropout: Option<&Dropout>,
        share: f64,
    ) -> Result<f32> {
        let how = self.backward(share);
        self.model.lm_forward_backward(ids, targets, dropout, how, self.trainer.grads())
    }

    /// Adds a zero gradient for every trained parameter: a rank with no rows in a global
    /// micro-batch, so that the step and the reductions over ranks run as on the other ranks.
    /// Under ZeRO stage 3 that takes a forward and backward, whose gathers and reduce-scatters
    /// every rank makes together: on a filler row, with a loss that is exactly zero.
    pub fn add_zero_gradients(&mut self, device: &Device) -> Result<()> {
        match &self.model {
            TrainedModel::Whole { .. } => {
                let mut zero: Option<Tensor> = None;
                for var in &self.compute.vars {
                    // Times a zero tensor, not `* 0.0`: candle's backward prunes an affine by 0
                    // from the graph, and the parameter would get no gradient at all.
                    let sum = var.as_tensor().sum_all()?.to_dtype(DType::F32)?;
                    let term = (&sum * sum.zeros_like()?)?;
                    zero = Some(match zero {
                        Some(z) => (z + term)?,
                        None => term,
                    });
                }
                if let Some(z) = zero {
                    self.trainer.grads().add(&z.backward()?)?;
                }
                Ok(())
            }
            TrainedModel::Sharded(model) => {
                let filler = Tensor::zeros((1, 1), DType::U32, device)?;
                model.forward_backward(&filler, &Positions::default(), None, 1.0, |_, hidden| {
                    let sum = hidden.sum_all()?.to_dtype(DType::F32)?;
                    &sum * sum.zeros_like()?
                })?;
                Ok(())
            }
        }
    }

    /// Runs `f` on the trunk's last hidden state of `ids` (no dropout, no gradient) and the
    /// weights of its heads: evaluation. Under ZeRO stage 3 a collective.
    pub fn with_hidden<R>(
        &self,
        ids: &Tensor,
        pos: &Positions,
        f: impl FnOnce(&Heads, &Tensor) -> Result<R>,
    ) -> Result<R> {
        self.model.with_hidden(ids, pos, f)
    }

    /// Ends a micro-batch: at an accumulation boundary, clips and applies the accumulated
    /// gradients (or skips on an fp16 overflow) and reports the step.
    pub fn step(&mut self) -> Result<Option<StepReport>> {
        self.trainer.micro_batch_done(&self.trainable)
    }

    /// Applies what is left in the accumulator at the end of a run, as a mean of what it holds.
    pub fn flush(&mut self) -> Result<Option<StepReport>> {
        self.trainer.flush(&self.trainable)
    }

    /// Ends a micro-batch of two engines trained on the same data (PPO's actor and critic):
    /// with `align`, an fp16 overflow of either skips both updates (DS-Chat `--align_overflow`).
    pub fn step_both(a: &mut Self, b: &mut Self, align: bool) -> Result<(Option<StepReport>, Option<StepReport>)> {
        micro_batch_done_pair((&mut a.trainer, &a.trainable), (&mut b.trainer, &b.trainable), align)
    }

    /// The hybrid engine's switch to generation: under ZeRO stage 3 the whole weights (this
    /// rank's TP slices under tensor parallelism) gathered on every rank (a collective), which
    /// the caller drops before training resumes; `None` where [`Self::masters`] are them. In the
    /// compute dtype, which generation runs in (DS-Chat gathers the fp16 parameters), LoRA
    /// adapters unfused (the training forward's weights, for the old log-probs; generation's
    /// fused ones are [`Self::gather_fused_for_generation`]'s); with LoRA under tensor
    /// parallelism in fp32, as the masters the adapters are fused into.
    pub fn gather_for_generation(&self) -> Result<Option<ParamStore>> {
        let Some(model) = self.sharded() else { return Ok(None) };
        let fp32_for_fusion = model.has_lora() && !model.fuses_lora_on_shards();
        let dtype = if fp32_for_fusion { DType::F32 } else { model.compute_dtype() };
        model.gather_params_everywhere(dtype).map(Some)
    }

    /// The hybrid engine's switch to generation where a rank keeps only its shard of the fp32
    /// masters and they carry LoRA adapters (ZeRO stage 3, and stages 1 and 2 in fp16/bf16): the
    /// whole weights with the adapters fused in fp32 on the shards and all-gathered in the
    /// compute dtype (stage 0's fused masters cast, bit for bit; a collective), dropped after
    /// the rollout. `None` otherwise: the weights are [`Self::whole_weights`] (or, under ZeRO
    /// stage 3 in fp32 or with tensor parallelism, [`Self::gather_for_generation`]'s, fused
    /// after).
    pub fn gather_fused_for_generation(&self) -> Result<Option<ParamStore>> {
        match self.sharded() {
            Some(model) if model.fuses_lora_on_shards() => {
                model.gather_fused_everywhere(model.compute_dtype()).map(Some)
            }
            Some(_) => Ok(None),
            None => self.trainer.gather_fused_masters(),
        }
    }

    /// Where a rank keeps only its shard of the fp32 masters (ZeRO-3; stages 1 and 2 in
    /// fp16/bf16), the whole masters (under TP, this TP rank's slices) put together on the first
    /// data-parallel rank; `None` on the others and where the masters are whole. Every rank must
    /// call it (a collective).
    pub fn gather_slices(&self) -> Result<Option<ParamStore>> {
        match self.trainer.master_shard() {
            Some((shard, _)) => shard.with_values(|values| self.trainer.gather_master_shards(values)),
            None => self.model.gather_sharded_params(),
        }
    }

    /// The whole fp32 weights for a save, put together from the ZeRO-3 shards and the TP
    /// slices. Every rank must call it (collectives); see [`GatheredWeights::params`].
    pub fn gather_weights(&self) -> Result<GatheredWeights> {
        let slices = self.gather_slices()?;
        match &self.tensor {
            None => Ok(GatheredWeights { whole: slices, slices: None }),
            Some(tp) => {
                let whole = tp.gather(slices.as_ref().unwrap_or(&self.masters), &self.config)?;
                Ok(GatheredWeights { whole, slices })
            }
        }
    }

    /// The whole optimizer state for a resumable checkpoint (every rank's moments put together,
    /// across ZeRO shards and TP slices), on rank 0; `gathered` is [`Self::gather_weights`]'s.
    /// Every rank must call it; none but the first of each data-parallel group ever holds more
    /// than its shard of the moments.
    pub fn gather_optimizer(&self, gathered: &GatheredWeights) -> Result<Option<SavedOptimizer<'_>>> {
        // Under ZeRO the first data-parallel rank of each TP rank gets its slices' moments; the
        // TP groups of the other data-parallel ranks, all of whose members got none, stop here.
        let Some(consolidated) = self.trainer.consolidated_optimizer()? else { return Ok(None) };
        match &self.tensor {
            None => Ok(Some(consolidated)),
            Some(tp) => Ok(tp
                .gather_optimizer(&consolidated, gathered.slices.as_ref().unwrap_or(&self.trainable), &self.config)?
                .map(SavedOptimizer::Gathered)),
        }
    }

    /// Restores a checkpoint's optimizer: `whole` moments by parameter name (this rank keeps its
    /// TP slices and ZeRO shard of them), the optimizer's `step`, and the trainer's counters.
    /// Before [`Self::release_masters`].
    pub fn load_optimizer(
        &mut self,
        whole: &HashMap<String, Tensor>,
        step: u64,
        progress: Option<&TrainerProgress>,
    ) -> Result<()> {
        let sliced = self.tensor.as_ref().map(|tp| tp.slice_optimizer_tensors(whole, &self.config)).transpose()?;
        self.trainer.optimizer.load_state(&self.trainable, step, sliced.as_ref().unwrap_or(whole))?;
        if let Some(progress) = progress {
            self.trainer.restore_progress(progress)?;
        }
        Ok(())
    }

    /// Restores a checkpoint's optimizer held in another form (pretraining's, whole or in
    /// ZeRO shards): `restore` fills an optimizer over the whole parameters (their names and
    /// element counts) with what it holds of them; this rank keeps its TP slices. Then the
    /// optimizer's `step` and the trainer's counters. Before [`Self::release_masters`].
    pub fn restore_optimizer(
        &mut self,
        restore: impl FnOnce(&mut AdamW, &[String], &[usize]) -> Result<()>,
        step: u64,
        progress: &TrainerProgress,
    ) -> Result<()> {
        let names = &self.masters.names;
        match &self.tensor {
            // Restored whole, then this rank's slices kept.
            Some(tp) => {
                let numels = tp.whole_numels(&self.masters, &self.config);
                let ranges = numels.iter().map(|&n| 0..n).collect();
                let mut whole = AdamW::over_ranges(self.trainer.optimizer.config.clone(), names, ranges);
                restore(&mut whole, names, &numels)?;
                tp.slice_optimizer(&whole, &self.masters, &mut self.trainer.optimizer, &self.config)?;
            }
            // Built sharded: no whole masters, the sharded model knows the trained parameters.
            None if self.masters.vars.is_empty() && self.sharded().is_some() => {
                let sharded = self.sharded().expect("checked");
                let (names, numels) = (sharded.trained_names().to_vec(), sharded.trained_numels());
                restore(&mut self.trainer.optimizer, &names, &numels)?
            }
            None => {
                let numels: Vec<usize> = self.masters.vars.iter().map(|v| v.elem_count()).collect();
                restore(&mut self.trainer.optimizer, names, &numels)?
            }
        }
        self.trainer.optimizer.step = step;
        self.trainer.restore_progress(progress)
    }
}

/// [`Engine::gather_weights`]'s result.
pub struct GatheredWeights {
    /// The whole weights on rank 0 when the engine's masters are not (ZeRO-3, TP).
    whole: Option<ParamStore>,
    /// Under TP and ZeRO-3, on the first data-parallel rank of each TP rank: its slices put
    /// together from the shards (what the optimizer's TP gather reads).
    slices: Option<ParamStore>,
}

impl GatheredWeights {
    /// The whole weights to save on rank 0: the gathered ones, or the engine's own masters
    /// where they are whole. (Other ranks get what they hold, which they must not save: under
    /// mixed precision at ZeRO stages 1 and 2 the compute copy.)
    pub fn params<'a>(&'a self, engine: &'a Engine) -> &'a ParamStore {
        self.whole.as_ref().unwrap_or(engine.whole_weights())
    }

    /// The gathered weights alone (`None` where the engine's masters are whole, and off rank 0).
    pub fn whole(&self) -> Option<&ParamStore> {
        self.whole.as_ref()
    }

    /// [`Self::whole`], taken.
    pub fn into_whole(self) -> Option<ParamStore> {
        self.whole
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::training::precision::Dtype;

    fn tiny() -> Gpt2Config {
        let cfg = Gpt2Config { n_layer: 2, n_embd: 8, n_head: 2, n_positions: 8, vocab_size: 16, ..Gpt2Config::tiny() };
        Gpt2Config { resid_pdrop: 0.0, embd_pdrop: 0.0, attn_pdrop: 0.0, ..cfg }
    }

    /// What a rank of [`train_bf16`] ends with.
    struct Trained {
        /// The whole fp32 weights as a save gets them (`None` off rank 0 where they are sharded).
        saved: Option<Vec<Vec<f32>>>,
        /// This rank's bf16 compute copy, as f32.
        compute: Vec<Vec<f32>>,
        /// The engine kept only its shard of the masters.
        sharded: bool,
        /// The most gradient values the rank held at once.
        peak_held: usize,
        /// How many reduce-scatters a micro-batch's gradients go in (stage 2's buckets).
        buckets: Option<usize>,
    }

    /// Trains a tiny GPT-2 over `group` at `stage` in bf16 for 3 steps of 2 micro-batches (each
    /// rank its own rows).
    fn train_bf16(group: ProcessGroup, stage: ZeroStage) -> Result<Trained> {
        train(group, stage, Dtype::Bf16, 1 << 20)
    }

    /// The tests' training: at `stage` in `dtype` with ZeRO-2's buckets of `bucket` values.
    fn test_config(stage: ZeroStage, dtype: Dtype, bucket: usize) -> EngineConfig {
        EngineConfig {
            // Adam's eps at 1e-4, as the multi-rank tests: at 1e-8 it turns the rounding noise of
            // near-zero gradients summed in another order into full-size steps of either sign.
            optimizer: AdamWConfig { eps: 1e-4, ..AdamWConfig::default() },
            schedule: LrSchedule::constant(1e-2),
            gradient_accumulation_steps: 2,
            gradient_clipping: 1.0,
            precision: Precision { dtype, fp32_loss: false },
            loss_scaling: LossScaling::default(),
            lora_learning_rate: None,
            checkpoint_activations: false,
            parallel: ParallelConfig {
                zero_stage: stage,
                reduce_bucket_size: bucket,
                allgather_bucket_size: crate::training::zero::DEFAULT_BUCKET,
                offload: false,
                communication_data_type: WireDtype::F32,
            },
        }
    }

    /// One micro-batch of rank `rank`'s rows at `step` (2 x 4 tokens of the tiny vocabulary),
    /// forward, backward and the step.
    fn train_step(engine: &mut Engine, step: u32, rank: u32) -> Result<()> {
        let dev = Device::Cpu;
        let ids: Vec<u32> = (0..8).map(|t| (t * 3 + step * 5 + rank * 7) % 16).collect();
        let targets: Vec<u32> = ids.iter().map(|i| (i + 1) % 16).collect();
        let (ids, targets) = (Tensor::from_vec(ids, (2, 4), &dev)?, Tensor::from_vec(targets, (2, 4), &dev)?);
        engine.lm_forward_backward(&ids, &targets, None, 1.0)?;
        engine.step()?;
        Ok(())
    }

    /// [`train_bf16`] in `dtype` with ZeRO-2's buckets of `bucket` values, the updated weights
    /// all-gathered in rounds of as many.
    fn train(group: ProcessGroup, stage: ZeroStage, dtype: Dtype, bucket: usize) -> Result<Trained> {
        let cfg = tiny();
        let dev = Device::Cpu;
        let params = ParamStore::init(&cfg, 7, &dev)?;
        let mut engine_cfg = test_config(stage, dtype, bucket);
        engine_cfg.parallel.allgather_bucket_size = bucket;
        let rank = group.rank() as u32;
        let group = Arc::new(group);
        let mut engine = Engine::new(&engine_cfg, &cfg, Head::Lm, params, Ranks { data: group, tensor: None })?;
        engine.release_masters();
        for step in 0..6u32 {
            // A rank without rows in one micro-batch adds its zero gradients all at once.
            if step == 3 && rank == 1 {
                engine.add_zero_gradients(&dev)?;
                engine.step()?;
                continue;
            }
            train_step(&mut engine, step, rank)?;
        }
        let values = |p: &ParamStore| -> Result<Vec<Vec<f32>>> {
            p.vars.iter().map(|v| Ok(v.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?)).collect()
        };
        let gathered = engine.gather_weights()?;
        let saved = match (gathered.whole(), engine.shards_masters()) {
            (Some(whole), _) => Some(values(whole)?),
            (None, true) => None,
            (None, false) => Some(values(engine.masters())?),
        };
        let compute = values(engine.trainer().compute_params())?;
        let (peak_held, buckets) = (engine.trainer.grads().peak_held_values(), engine.trainer.grads().sink_buckets());
        Ok(Trained { saved, compute, sharded: engine.shards_masters(), peak_held, buckets })
    }

    /// DeepSpeed's stages 1 and 2 under mixed precision: each rank keeps only its shard of the
    /// fp32 masters, steps it, and all-gathers the bf16 weights into its compute copy. Training
    /// is the same as with whole masters on every rank (stage 0, whose all-reduce sums in the
    /// ring's order as the reduce-scatter does): the saved fp32 weights within float rounding
    /// of the mean's division, the bf16 copies identical up to one bf16 rounding of them.
    #[test]
    fn stages_1_and_2_in_bf16_keep_a_shard_of_the_masters_and_train_as_stage_0() -> Result<()> {
        let run = |stage| -> Result<Vec<Trained>> {
            crate::comm::on_groups(2, |group| train_bf16(group, stage)).into_iter().collect()
        };
        let whole = run(ZeroStage::Disabled)?;
        assert!(whole.iter().all(|r| !r.sharded), "stage 0 keeps whole masters");
        let start = ParamStore::init(
            &Gpt2Config { n_layer: 2, n_embd: 8, n_head: 2, n_positions: 8, vocab_size: 16, ..Gpt2Config::tiny() },
            7,
            &Device::Cpu,
        )?;
        let start: Vec<Vec<f32>> =
            start.vars.iter().map(|v| v.flatten_all().unwrap().to_vec1::<f32>().unwrap()).collect();
        let want = whole[0].saved.clone().expect("rank 0 saves");
        let moved =
            want.iter().zip(&start).flat_map(|(a, b)| a.iter().zip(b).map(|(x, y)| (x - y).abs())).fold(0f32, f32::max);
        assert!(moved > 1e-3, "the weights must move for the comparison to mean something: {moved}");
        for stage in [ZeroStage::OptimizerStates, ZeroStage::Gradients] {
            let ranks = run(stage)?;
            assert!(ranks.iter().all(|r| r.sharded), "stage {stage}: masters sharded");
            assert!(ranks[1].saved.is_none(), "stage {stage}: only rank 0 gets the whole masters");
            let got = ranks[0].saved.as_ref().expect("rank 0 saves");
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                let diff = g.iter().zip(w).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
                assert!(diff <= 1e-6, "stage {stage}, parameter {i}: fp32 masters differ by {diff}");
            }
            // Each rank's bf16 copy is the cast of the masters (one bf16 step apart at most,
            // where the masters' last bits differ across a rounding boundary).
            for rank in &ranks {
                for (c, w) in rank.compute.iter().zip(&want) {
                    for (a, b) in c.iter().zip(w) {
                        let cast = half::bf16::from_f32(*b).to_f32();
                        assert!(
                            (a - cast).abs() <= (cast.abs() * 2f32.powi(-7)).max(1e-30),
                            "stage {stage}: {a} vs {cast}"
                        );
                    }
                }
            }
        }
        Ok(())
    }

    /// A save reads a whole optimizer (one rank; stage 0 on two) where it is, not a copy of its
    /// moments (8 bytes a parameter; measured: step 3's one-rank run peaked 1.8 GiB higher while
    /// the actor's and critic's copies were saved); at stage 1 the moments are put together on
    /// rank 0 from the shards (both moments of every parameter), and rank 1 saves none.
    #[test]
    fn a_whole_optimizer_is_saved_in_place_and_shards_are_gathered() -> Result<()> {
        let (cfg, dev) = (tiny(), Device::Cpu);
        let params = ParamStore::init(&cfg, 7, &dev)?;
        let ranks = Ranks { data: Arc::new(ProcessGroup::single()), tensor: None };
        let mut engine =
            Engine::new(&test_config(ZeroStage::Disabled, Dtype::Fp32, 1 << 20), &cfg, Head::Lm, params, ranks)?;
        train_step(&mut engine, 0, 0)?;
        let saved = engine.trainer().consolidated_optimizer()?.expect("one rank saves");
        assert!(matches!(saved, SavedOptimizer::Held(held) if std::ptr::eq(held, &engine.trainer().optimizer)));
        // On two ranks: (saved in place, gathered, how many moment tensors) per rank.
        for stage in [ZeroStage::Disabled, ZeroStage::OptimizerStates] {
            let results = crate::comm::on_groups(2, |group| -> Result<Option<(bool, bool, usize)>> {
                let params = ParamStore::init(&cfg, 7, &dev)?;
                let rank = group.rank() as u32;
                let ranks = Ranks { data: Arc::new(group), tensor: None };
                let mut engine = Engine::new(&test_config(stage, Dtype::Fp32, 1 << 20), &cfg, Head::Lm, params, ranks)?;
                train_step(&mut engine, 0, rank)?;
                let trainer = engine.trainer();
                let Some(saved) = trainer.consolidated_optimizer()? else { return Ok(None) };
                let in_place = matches!(saved, SavedOptimizer::Held(held) if std::ptr::eq(held, &trainer.optimizer));
                let gathered = matches!(saved, SavedOptimizer::Gathered(_));
                Ok(Some((in_place, gathered, saved.state_tensors(engine.masters())?.len())))
            });
            let got: Vec<Option<(bool, bool, usize)>> = results.into_iter().collect::<Result<_>>()?;
            let moments = 2 * ParamStore::init(&cfg, 7, &dev)?.vars.len();
            match stage {
                ZeroStage::Disabled => {
                    assert_eq!(got, vec![Some((true, false, moments)); 2], "stage 0: every rank's own")
                }
                _ => assert_eq!(got, vec![Some((false, true, moments)), None], "stage 1: gathered on rank 0 only"),
            }
        }
        Ok(())
    }

    /// With LoRA at stages 1 and 3 in bf16 the masters stay sharded, and generation's weights,
    /// the adapters fused in fp32 on each rank's shard and all-gathered in bf16, are on every
    /// rank exactly the whole fp32 masters fused as stage 0 fuses them ([`ParamStore::merged`])
    /// and cast to bf16, bit for bit, adapters dropped (after training steps, so B is not zero).
    /// At stage 3 the unfused weights for the old log-probs are gathered in bf16 too.
    #[test]
    fn lora_on_sharded_masters_in_bf16_generates_from_the_fused_shards() -> Result<()> {
        for stage in [ZeroStage::OptimizerStates, ZeroStage::Parameters] {
            lora_generates_from_the_fused_shards(stage)?;
        }
        Ok(())
    }

    fn lora_generates_from_the_fused_shards(stage: ZeroStage) -> Result<()> {
        // Per rank: its fused weights' bf16 bits, and on rank 0 those of stage 0's fusion.
        type Bits = Vec<Vec<u16>>;
        let results = crate::comm::on_groups(2, |group| -> Result<(Bits, Option<Bits>)> {
            let (cfg, dev) = (tiny(), Device::Cpu);
            let mut params = ParamStore::init(&cfg, 7, &dev)?;
            params.add_lora(&cfg, &lora::LoraConfig { dim: 2, alpha: Some(4.0), module_name: "h.".into() }, 7)?;
            let engine_cfg = test_config(stage, Dtype::Bf16, 1 << 20);
            let rank = group.rank() as u32;
            let ranks = Ranks { data: Arc::new(group), tensor: None };
            let mut engine = Engine::new(&engine_cfg, &cfg, Head::Lm, params, ranks)?;
            engine.release_masters();
            assert!(engine.shards_masters(), "LoRA keeps the masters sharded");
            for step in 0..3u32 {
                train_step(&mut engine, step, rank)?;
            }
            let bits = |p: &ParamStore| -> Result<Vec<Vec<u16>>> {
                p.vars
                    .iter()
                    .map(|v| {
                        Ok(v.flatten_all()?
                            .to_dtype(DType::BF16)?
                            .to_vec1::<half::bf16>()?
                            .iter()
                            .map(|x| x.to_bits())
                            .collect())
                    })
                    .collect()
            };
            let fused = engine.gather_fused_for_generation()?.expect("sharded masters with LoRA fuse on the shards");
            if let Some(unfused) = engine.gather_for_generation()? {
                assert_eq!(stage, ZeroStage::Parameters);
                assert!(unfused.lora_scaling().is_some() && unfused.dtype() == DType::BF16, "unfused, in bf16");
            }
            assert!(fused.names.iter().all(|n| !lora::is_adapter_name(n)) && fused.lora_scaling().is_none());
            let gathered = engine.gather_weights()?;
            let want = gathered.whole().map(|whole| -> Result<_> {
                let merged = whole.merged()?;
                assert_eq!(merged.names, fused.names);
                let moved = whole.iter().filter(|(n, _)| n.ends_with("lora_B.weight")).any(|(_, v)| {
                    v.as_tensor().abs().and_then(|a| a.max_all()).and_then(|m| m.to_scalar::<f32>()).unwrap() > 0.0
                });
                assert!(moved, "B trained off zero: the fusion changes the weights");
                bits(&merged)
            });
            Ok((bits(&fused)?, want.transpose()?))
        });
        let results = results.into_iter().collect::<Result<Vec<_>>>()?;
        let want = results[0].1.as_ref().expect("rank 0 gets the whole masters");
        for (rank, (got, _)) in results.iter().enumerate() {
            assert_eq!(got.len(), want.len());
            for (i, (g, w)) in got.iter().zip(want).enumerate() {
                let differ = g.iter().zip(w).filter(|(a, b)| a != b).count();
                assert_eq!(differ, 0, "{stage:?}, rank {rank}, parameter {i}: {differ} of {} values differ", g.len());
            }
        }
        Ok(())
    }

    /// ZeRO-2 reduce-scatters the gradients in buckets as backward completes them: with buckets
    /// of 200 values (the embeddings cut into many; the weights all-gathered in rounds of 200
    /// too) a rank never holds the whole gradient of a micro-batch, and the trained
    /// weights are the same bits as with one bucket as large as the model (the micro-batch's
    /// whole gradient reduce-scattered at its end: each value is summed by the same owner in
    /// the same ring order), and those of stage 0 to float rounding. A rank without rows in one micro-batch adds its
    /// zero gradients at once and still makes the same bucket collectives.
    #[test]
    fn stage_2_reduces_gradients_in_buckets_during_backward() -> Result<()> {
        let run = |stage, bucket| -> Result<Vec<Trained>> {
            crate::comm::on_groups(2, |group| train(group, stage, Dtype::Fp32, bucket)).into_iter().collect()
        };
        let params = ParamStore::init(&tiny(), 7, &Device::Cpu)?;
        let total = params.numel();
        let block: usize = params.iter().filter(|(n, _)| n.starts_with("h.1.")).map(|(_, v)| v.elem_count()).sum();
        let whole = run(ZeroStage::Disabled, total)?;
        let one_bucket = run(ZeroStage::Gradients, total)?;
        let small = run(ZeroStage::Gradients, 200)?;
        // Rank 0 always has rows (rank 1's zero gradients of a micro-batch without rows come
        // at once): it held a block's gradients beside the head's, never the whole gradient.
        let peak = small[0].peak_held;
        assert!(peak >= block && peak < total * 3 / 4, "buckets of 200: held {peak} of {total} (a block {block})");
        // The count the run's log line gives. Stage 0, and a bucket the model's size (one
        // reduce-scatter at the micro-batch's end), hand nothing on during backward.
        assert_eq!((whole[0].buckets, one_bucket[0].buckets), (None, None));
        let buckets = small[0].buckets.expect("stage 2 has buckets");
        assert!(buckets >= total / 200 && buckets <= params.vars.len() + total / 200, "{buckets} buckets of 200");
        let saved = |r: &[Trained]| r[0].saved.clone().expect("rank 0 saves");
        assert_eq!(saved(&small), saved(&one_bucket), "the buckets change no bit");
        for (g, w) in saved(&small).iter().zip(&saved(&whole)) {
            let diff = g.iter().zip(w).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            assert!(diff <= 1e-6, "stage 2 against stage 0: {diff}");
        }
        Ok(())
    }

    /// `--offload` holds on GPUs at stages 1-3 across ranks; elsewhere (a CPU run, a GPU at
    /// stage 0 or alone) it is refused.
    #[test]
    fn offload_is_accepted_where_it_moves_the_optimizer_to_host_memory() {
        use ZeroStage::*;
        for stage in [Disabled, OptimizerStates, Gradients, Parameters] {
            for world in [1, 2] {
                let err = check_offload(false, stage, world).unwrap_err().to_string();
                assert!(err.contains("this run is on the CPU"), "{err}");
                let on_host = stage != Disabled && world > 1;
                assert_eq!(check_offload(true, stage, world).is_ok(), on_host, "stage {stage:?}, {world} ranks");
            }
        }
        let err = check_offload(true, Disabled, 4).unwrap_err().to_string();
        assert!(err.contains("at stage 0 on 4 rank(s) they stay on the GPU: drop --offload"), "{err}");
    }
}
