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
use crate::model::gpt2::{Dropout, Gpt2Config, Positions};
use crate::model::params::ParamStore;
use crate::model::reward_model::{Heads, RewardModel};
use crate::training::optim::{AdamW, AdamWConfig};
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
    /// Every parameter (trunk, head, LoRA adapters) in fp32; empty under ZeRO stage 3 once
    /// [`Self::release_masters`] ran: the model then holds this rank's shard of them.
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
        let on_gpu = params.vars.first().is_some_and(|v| v.device().is_cuda());
        cfg.parallel.communication_data_type.check(on_gpu && data.world() > 1)?;
        let dp = DataParallel::new(data, cfg.parallel.zero_stage, cfg.parallel.reduce_bucket_size)
            .with_wire(cfg.parallel.communication_data_type);
        let trainable = params.trainable();
        let (precision, dtype) = (cfg.precision, cfg.precision.dtype.dtype());
        let accumulation = cfg.gradient_accumulation_steps;
        let (model, mut trainer, compute) = if dp.shards_parameters() {
            let mut sharded = ShardedModel::new(dp.group.clone(), config, &params, dtype)?;
            if let Some(tp) = &tensor {
                sharded = sharded.with_tensor_parallel(tp.tp().clone());
            }
            let (model, trainer) = Self::sharded_parts(cfg, sharded);
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
            let trainer = Trainer::new(
                &trainable,
                cfg.optimizer.clone(),
                cfg.schedule.clone(),
                accumulation,
                cfg.gradient_clipping,
            )?
            .with_precision(precision, &compute, cfg.loss_scaling)
            .with_data_parallel(dp);
            (model, trainer, compute.trainable())
        };
        // Under tensor parallelism the gradient norm is the whole model's.
        if let Some(tp) = &tensor {
            trainer = trainer.with_tensor_parallel(tp.tp().clone(), &trainable);
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
    /// without tensor parallelism: [`ShardedModel::init`] or [`ShardedModel::read`]), as `cfg`
    /// says: no rank ever holds the whole model.
    /// `config` is the model's (its heads' fields included, as `config.json` says them).
    pub fn new_sharded(cfg: &EngineConfig, config: &Gpt2Config, mut sharded: ShardedModel) -> Result<Self> {
        if cfg.parallel.offload {
            check_offload(!sharded.device().is_cpu(), cfg.parallel.zero_stage, sharded.group().world())?;
        }
        cfg.parallel.communication_data_type.check(!sharded.device().is_cpu() && sharded.group().world() > 1)?;
        sharded.cfg = config.clone();
        let config = config.clone();
        // Built from a GPT-2's own parameters: no LoRA adapters, so no LoRA learning rate.
        let (model, trainer) = Self::sharded_parts(cfg, sharded);
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
    fn sharded_parts(cfg: &EngineConfig, mut sharded: ShardedModel) -> (TrainedModel, Trainer) {
        sharded.fp32_loss = cfg.precision.fp32_loss;
        sharded.gradient_wire = cfg.parallel.communication_data_type;
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
        (TrainedModel::Sharded(sharded), trainer)
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

    /// Under ZeRO stage 3, drops the whole fp32 masters once the shards and any resumed
    /// optimizer state are taken from them: each rank keeps only its shard.
    pub fn release_masters(&mut self) {
        if self.sharded().is_some() {
            (self.masters, self.trainable, self.compute) = Default::default();
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
    /// compute dtype, which generation runs in (DS-Chat gathers the fp16 parameters); with LoRA
    /// in fp32, as the masters the adapters are fused into.
    pub fn gather_for_generation(&self) -> Result<Option<ParamStore>> {
        let Some(model) = self.sharded() else { return Ok(None) };
        let dtype = if model.has_lora() { DType::F32 } else { model.compute_dtype() };
        model.gather_params_everywhere(dtype).map(Some)
    }

    /// The whole fp32 weights for a save, put together from the ZeRO-3 shards and the TP
    /// slices. Every rank must call it (collectives); see [`GatheredWeights::params`].
    pub fn gather_weights(&self) -> Result<GatheredWeights> {
        // Under ZeRO-3 the first data-parallel rank of each TP rank gets that rank's slices.
        let slices = self.model.gather_sharded_params()?;
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
    pub fn gather_optimizer(&self, gathered: &GatheredWeights) -> Result<Option<AdamW>> {
        // Under ZeRO the first data-parallel rank of each TP rank gets its slices' moments; the
        // TP groups of the other data-parallel ranks, all of whose members got none, stop here.
        let Some(consolidated) = self.trainer.consolidated_optimizer(&self.trainable)? else { return Ok(None) };
        match &self.tensor {
            None => Ok(Some(consolidated)),
            Some(tp) => {
                tp.gather_optimizer(&consolidated, gathered.slices.as_ref().unwrap_or(&self.trainable), &self.config)
            }
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
        let sliced = self.tensor.as_ref().map(|tp| tp.slice_optimizer_tensors(whole)).transpose()?;
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
    /// where they are whole. (Other ranks get what they hold, which they must not save.)
    pub fn params<'a>(&'a self, engine: &'a Engine) -> &'a ParamStore {
        self.whole.as_ref().unwrap_or(&engine.masters)
    }

    /// The gathered weights alone (`None` where the engine's masters are whole, and off rank 0).
    pub fn whole(&self) -> Option<&ParamStore> {
        self.whole.as_ref()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
