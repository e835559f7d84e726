//! ZeRO stage 3: the parameters themselves are sharded at rest. Each rank keeps only its shard
//! of the fp32 master weights, of the summed gradients and of the Adam moments (16 bytes per
//! parameter divided by the world size, DeepSpeed's formula); a layer's full weights exist only
//! while it runs, gathered from every rank's shard and dropped after.
//!
//! The parameters are cut into units, each gathered with one all-gather: one per transformer
//! block, and one for everything outside the blocks (embeddings, the final LayerNorm and any
//! head), which embedding and head share because GPT-2 ties them. Each unit is flattened and
//! split into equal shards ([`Partition`]), so every rank holds a piece of every unit. With LoRA
//! and `--only-optimize-lora` a block's frozen weights form a unit of their own beside its
//! adapters': frozen units are gathered for the forward but get no gradient, no reduce-scatter
//! and no optimizer state, so LoRA at stage 3 moves and keeps only the adapters' gradients.
//!
//! candle keeps the tensors a backward pass needs inside the graph of the forward, so a
//! gathered weight would live until backward if the graph kept it: stage 3 therefore always
//! runs the block-by-block recomputation of activation checkpointing
//! ([`crate::training::train_step`]), gathering each block twice (forward, then backward) and
//! reduce-scattering its gradient as soon as its backward is done. One micro-batch moves
//! 3x the outer unit and 2x every block in all-gathers, and reduce-scatters the outer unit twice
//! (head and embedding) and every block once.
//!
//! Under tensor parallelism the model sharded is this TP rank's slices (the group is then the
//! data-parallel group): the gathered units build the TP rank's layers, and the gradient norm
//! adds the TP ranks' shares ([`crate::tensor_parallel::shard::norm_share`]).

use crate::comm::{Pending, ProcessGroup, ReduceOp};
use crate::model::gpt2::{Block, Dropout, Gpt2, Gpt2Config};
use crate::model::params::{attach_adapters, ParamStore};
use crate::model::positions::Positions;
use crate::model::reward_model::{Heads, SCORE_WEIGHT};
use crate::training::optim::AdamW;
use crate::training::zero::{Held, InPlacePiece, MasterShard, Partition};
use anyhow::{anyhow, bail, Result};
use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Shape, Tensor, Var};
use candle_nn::VarBuilder;
use std::cell::RefCell;
use std::collections::HashMap;
use std::ops::Range;
use std::sync::Arc;

/// The unit of everything outside the blocks; block `i` is unit `i + 1`.
const OUTER: usize = 0;

/// What a gathered part is for: a forward whose output needs no gradient (the first pass of
/// the recomputation, or inference), or the pass whose backward follows.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Pass {
    Forward,
    Backward,
}

/// Parameters gathered together.
struct Unit {
    /// What the unit belongs to: [`OUTER`], or block `i` as `i + 1`.
    part: usize,
    /// Indices of the unit's parameters in the model's order.
    params: Vec<usize>,
    partition: Partition,
    /// Where this rank's shard of the unit starts in [`ShardedModel::shard`].
    offset: usize,
    /// Where this rank's shard of the unit's gradient starts in the gradient shard; `None` for
    /// a unit of frozen parameters.
    grad_offset: Option<usize>,
}

impl Unit {
    /// Where this rank's shard of the unit is in the model's shard.
    fn shard(&self) -> Range<usize> {
        self.offset..self.offset + self.partition.shard_len
    }
}

/// What a sharded model is laid out from: its parameters without their values.
struct ParamLayout {
    names: Vec<String>,
    shapes: Vec<Shape>,
    /// Per parameter: frozen (`--only-optimize-lora`).
    frozen: Vec<bool>,
    lora_scaling: Option<f64>,
}

impl ParamLayout {
    /// A GPT-2 trunk's parameters then `beside`'s.
    fn gpt2(cfg: &Gpt2Config, beside: &Beside) -> Self {
        let trunk = crate::model::params::parameter_shapes(cfg).into_iter().map(|(n, s)| (n, Shape::from(s)));
        let trunk_len = trunk.len();
        let others = beside.tensors.iter().map(|(n, t)| (n.clone(), t.shape().clone()));
        let (names, shapes): (Vec<String>, Vec<Shape>) = trunk.chain(others).unzip();
        let frozen = (0..names.len()).map(|i| beside.frozen_trunk && i < trunk_len).collect();
        Self { frozen, names, shapes, lora_scaling: beside.lora_scaling }
    }
}

/// What a GPT-2 built sharded ([`ShardedModel::init`], [`ShardedModel::read`]) holds beside its
/// trunk, whole on every rank until each keeps its shard: the heads (a reward model's
/// `score.weight`) and LoRA adapters, in the order a [`ParamStore`] puts them after the trunk.
#[derive(Default)]
pub struct Beside {
    pub tensors: Vec<(String, Tensor)>,
    /// The adapters' scaling, when there are adapters.
    pub lora_scaling: Option<f64>,
    /// `--only-optimize-lora`: the trunk is frozen, only the tensors here train.
    pub frozen_trunk: bool,
}

impl Beside {
    /// Heads alone, trained with the trunk.
    pub fn heads(heads: Vec<(String, Tensor)>) -> Self {
        Self { tensors: heads, ..Self::default() }
    }

    /// With LoRA `adapters` after the heads (A then B of each, as [`ParamStore::add_adapters`]
    /// puts them) at `scaling`, the trunk frozen with `frozen_trunk` (`--only-optimize-lora`).
    pub fn with_lora(mut self, adapters: Vec<lora::Adapter>, scaling: f64, frozen_trunk: bool) -> Self {
        for adapter in adapters {
            let (a, b) = lora::Adapter::param_names(&adapter.module);
            self.tensors.extend([(a, adapter.a), (b, adapter.b)]);
        }
        (self.lora_scaling, self.frozen_trunk) = (Some(scaling), frozen_trunk);
        self
    }

    /// Their values in all.
    pub fn numel(&self) -> usize {
        self.tensors.iter().map(|(_, t)| t.elem_count()).sum()
    }
}

/// A GPT-2 whose parameters are sharded over the ranks of a group (ZeRO stage 3).
pub struct ShardedModel {
    group: Arc<ProcessGroup>,
    pub cfg: Gpt2Config,
    names: Vec<String>,
    shapes: Vec<Shape>,
    /// Per parameter: frozen (`--only-optimize-lora`), or its index among the trained ones,
    /// which is its index in the optimizer.
    trained_index: Vec<Option<usize>>,
    trained_names: Vec<String>,
    frozen: Vec<bool>,
    lora_scaling: Option<f64>,
    units: Vec<Unit>,
    /// Per parameter, the range of its (flat) values this rank holds and where they start in
    /// the shard; `None` where it holds none.
    held: Vec<Option<(Range<usize>, usize)>>,
    /// The dtype gathered weights compute in (the masters are fp32).
    dtype: DType,
    device: Device,
    /// Losses read fp32 logits (DS-Chat `--compute_fp32_loss`), as [`Gpt2::fp32_loss`].
    pub fp32_loss: bool,
    /// The type gradients travel in through their reduce-scatters (`--communication-data-type`).
    pub gradient_wire: crate::comm::WireDtype,
    /// Gradient values per round of a unit's reduce-scatter (`--reduce-bucket-size`).
    pub reduce_bucket: usize,
    /// The tensor-parallel group the sharded slices belong to.
    tp: Option<Arc<ProcessGroup>>,
    /// This rank's fp32 master weights: its shard of every unit, end to end, in host memory or
    /// on the device ([`Self::with_shard_on_device`]).
    shard: RefCell<MasterShard>,
    /// Per unit, this rank's shard of the gradients summed over ranks and micro-batches (always
    /// `None` for a frozen unit).
    grads: RefCell<Vec<Option<Tensor>>>,
    /// The last unit's gradient reduce-scatter, begun (on GPUs still running while the next
    /// unit's backward computes) and not yet added to its shard.
    reducing: RefCell<Option<(usize, Pending)>>,
}

impl ShardedModel {
    /// Keeps this rank's shard of `masters` (the whole model's fp32 weights, which the caller
    /// drops after); gathered weights compute in `dtype`.
    /// The masters' frozen flags and LoRA adapters are kept: frozen parameters are gathered
    /// but never trained.
    pub fn new(group: Arc<ProcessGroup>, cfg: &Gpt2Config, masters: &ParamStore, dtype: DType) -> Result<Self> {
        let layout = ParamLayout {
            names: masters.names.clone(),
            shapes: masters.vars.iter().map(|v| v.shape().clone()).collect(),
            frozen: masters.frozen().to_vec(),
            lora_scaling: masters.lora_scaling(),
        };
        let device = masters.vars.first().map_or(Device::Cpu, |v| v.device().clone());
        let model = Self::empty(group, cfg, layout, dtype, &device)?;
        for (i, var) in masters.vars.iter().enumerate() {
            if let Some((range, _)) = model.held[i].clone() {
                let values = var.as_tensor().flatten_all()?.narrow(0, range.start, range.len())?;
                model.fill(i, &values.to_dtype(DType::F32)?.to_vec1()?)?;
            }
        }
        Ok(model)
    }

    /// A freshly initialised model built sharded (DeepSpeed's `zero.Init`): each tensor is drawn
    /// as [`ParamStore::init`] draws it, this rank keeps its shard of it and drops the rest, so
    /// every rank's shard holds the one-rank model's values and no rank ever holds the whole.
    /// `beside` (heads, LoRA adapters) follows the trunk, as [`ParamStore::push`] puts it.
    pub fn init(
        group: Arc<ProcessGroup>,
        cfg: &Gpt2Config,
        seed: u64,
        beside: &Beside,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        let model = Self::empty(group, cfg, ParamLayout::gpt2(cfg, beside), dtype, device)?;
        let mut i = 0;
        ParamStore::draw_initial(cfg, seed, |_, _, values| {
            if let Some((range, _)) = model.held[i].clone() {
                model.fill(i, &values[range])?;
            }
            i += 1;
            Ok(())
        })?;
        model.fill_beside(beside)?;
        Ok(model)
    }

    /// A GPT-2 built sharded from a saved model's values: `read(name, range)` returns the values
    /// of trunk parameter `name` in `range` (its flat indices) as fp32, so a rank reads only its
    /// shard (from a memory-mapped safetensors file, `checkpoints::sharded_io::ModelSlices`);
    /// `beside` as in [`Self::init`].
    pub fn read(
        group: Arc<ProcessGroup>,
        cfg: &Gpt2Config,
        read: impl Fn(&str, Range<usize>) -> Result<Vec<f32>>,
        beside: &Beside,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        let model = Self::empty(group, cfg, ParamLayout::gpt2(cfg, beside), dtype, device)?;
        for (i, name) in model.names.iter().enumerate().take(model.names.len() - beside.tensors.len()) {
            if let Some((range, _)) = model.held[i].clone() {
                model.fill(i, &read(name, range)?)?;
            }
        }
        model.fill_beside(beside)?;
        Ok(model)
    }

    /// This rank's shard of `beside`, the model's last parameters.
    fn fill_beside(&self, beside: &Beside) -> Result<()> {
        let first = self.names.len() - beside.tensors.len();
        for (k, (_, t)) in beside.tensors.iter().enumerate() {
            if let Some((range, _)) = self.held[first + k].clone() {
                let values = t.flatten_all()?.narrow(0, range.start, range.len())?;
                self.fill(first + k, &values.to_dtype(DType::F32)?.to_vec1()?)?;
            }
        }
        Ok(())
    }

    /// The model laid out over `group` with every value 0: the units and this rank's shard of
    /// each; [`Self::fill`] puts the values in.
    fn empty(
        group: Arc<ProcessGroup>,
        cfg: &Gpt2Config,
        layout: ParamLayout,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        let (world, rank) = (group.world(), group.rank());
        let ParamLayout { names, shapes, frozen, lora_scaling } = layout;
        // Unit 2p holds part p's trained parameters, unit 2p + 1 its frozen ones.
        let mut members: Vec<Vec<usize>> = vec![Vec::new(); 2 * (cfg.num_layers() + 1)];
        for (i, name) in names.iter().enumerate() {
            members[2 * unit_of(cfg, name)? + usize::from(frozen[i])].push(i);
        }
        let mut units = Vec::new();
        let mut held = vec![None; names.len()];
        let (mut shard_len, mut grad_len) = (0, 0);
        for (k, params) in members.into_iter().enumerate().filter(|(_, p)| !p.is_empty()) {
            let partition = Partition::new(params.iter().map(|&i| shapes[i].elem_count()).collect(), world);
            for piece in partition.pieces(rank) {
                held[params[piece.param]] = Some((piece.in_param, shard_len + piece.in_shard.start));
            }
            let len = partition.shard_len;
            let grad_offset = (k % 2 == 0).then(|| {
                grad_len += len;
                grad_len - len
            });
            units.push(Unit { part: k / 2, params, partition, offset: shard_len, grad_offset });
            shard_len += len;
        }
        let unit_count = units.len();
        let mut trained_index = Vec::with_capacity(frozen.len());
        let mut trained_names = Vec::new();
        for (name, &frozen) in names.iter().zip(&frozen) {
            trained_index.push((!frozen).then_some(trained_names.len()));
            if !frozen {
                trained_names.push(name.clone());
            }
        }
        Ok(Self {
            group,
            cfg: cfg.clone(),
            names,
            shapes,
            trained_index,
            trained_names,
            frozen,
            lora_scaling,
            units,
            held,
            dtype,
            device: device.clone(),
            fp32_loss: false,
            gradient_wire: crate::comm::WireDtype::F32,
            reduce_bucket: crate::training::zero::DEFAULT_BUCKET,
            tp: None,
            shard: RefCell::new(MasterShard::Host(vec![0.0; shard_len])),
            grads: RefCell::new(vec![None; unit_count]),
            reducing: RefCell::new(None),
        })
    }

    /// Puts `values`, parameter `i`'s values in the range this rank holds of it, into the shard.
    fn fill(&self, i: usize, values: &[f32]) -> Result<()> {
        let Some((range, at)) = self.held[i].clone() else { return Ok(()) };
        if values.len() != range.len() {
            bail!("{}: {} values read for the {} this rank holds", self.names[i], values.len(), range.len());
        }
        match &mut *self.shard.borrow_mut() {
            MasterShard::Host(shard) => shard[at..at + range.len()].copy_from_slice(values),
            MasterShard::Device(_) => bail!("internal error: filling a shard already on the device"),
        }
        Ok(())
    }

    /// Keeps this rank's shard on the device the model computes on, as a `dtype` tensor: on a
    /// GPU, DeepSpeed's default place for ZeRO-3's fp32 master shard (`dtype` f32), whose Adam
    /// moments then live and step beside it ([`AdamW::update_held_in_place`]) and whose units are
    /// gathered from it by NCCL with no trip through host memory; a frozen model's shard in its
    /// compute dtype (PPO's reference and reward models: what their gathers send, nothing more).
    /// Without it (a CPU run, `--offload`) the shard stays in host memory. The same values
    /// either way: the same gathers, the same steps bit for bit on the CPU.
    pub fn with_shard_on_device(self, dtype: DType) -> Result<Self> {
        let tensor = match &*self.shard.borrow() {
            MasterShard::Host(values) => Tensor::from_slice(values, values.len(), &self.device)?.to_dtype(dtype)?,
            MasterShard::Device(t) => t.to_dtype(dtype)?,
        };
        *self.shard.borrow_mut() = MasterShard::Device(tensor);
        Ok(self)
    }

    /// Where this rank's shard lives, for the log.
    pub fn shard_place(&self) -> &'static str {
        self.shard.borrow().place()
    }

    /// The model as a frozen one (PPO's reference and reward models at ZeRO stage 3): every
    /// unit is gathered for forwards only, with no gradient, reduce-scatter or optimizer state.
    /// The shard keeps its layout: a part's units hold the same parameters, trained or frozen.
    pub fn freeze(mut self) -> Self {
        for unit in &mut self.units {
            unit.grad_offset = None;
        }
        self.frozen.fill(true);
        self.trained_index.fill(None);
        self.trained_names.clear();
        self
    }

    /// The model sharded is this rank's slices of a model split over `tp` (tensor parallelism):
    /// its layers are built as `tp`'s.
    pub fn with_tensor_parallel(mut self, tp: Arc<ProcessGroup>) -> Self {
        self.tp = (tp.world() > 1).then_some(tp);
        self
    }

    /// The global norm of the gradients whose (averaged) shard on this rank is `shard`: over
    /// the data-parallel ranks, and under tensor parallelism over the TP ranks' slices too, each
    /// replicated parameter counted once. Every rank calls it.
    pub fn grad_norm(&self, shard: &Tensor) -> Result<f64> {
        let Some(tp) = &self.tp else {
            return crate::training::zero::sharded_grad_norm(&self.group, shard);
        };
        let mut sq = [0f64];
        for (unit, _, piece) in self.trained_pieces() {
            let from = unit.grad_offset.expect("a trained unit") + piece.in_shard.start;
            let s = crate::kernels::ops::sum_of_squares(&shard.narrow(0, from, piece.in_shard.len())?)?;
            let split = self.cfg.split_of(&self.names[unit.params[piece.param]]);
            sq[0] += crate::tensor_parallel::shard::norm_share(split, s, tp.world());
        }
        self.group.all_reduce_scalars(&mut sq, crate::comm::ReduceOp::Sum)?;
        tp.all_reduce_scalars(&mut sq, crate::comm::ReduceOp::Sum)?;
        Ok(sq[0].sqrt())
    }

    pub fn group(&self) -> &Arc<ProcessGroup> {
        &self.group
    }

    /// The dtype gathered weights compute in.
    pub fn compute_dtype(&self) -> DType {
        self.dtype
    }

    /// Where gathered weights compute.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Values in this rank's shard (padding included).
    pub fn shard_len(&self) -> usize {
        self.units.last().map_or(0, |unit| unit.offset + unit.partition.shard_len)
    }

    /// The names of the parameters the optimizer trains (all but the frozen ones), in the
    /// model's order: the optimizer's parameter `i` is `trained_names()[i]`.
    pub fn trained_names(&self) -> &[String] {
        &self.trained_names
    }

    /// The number of values of each trained parameter, as [`Self::trained_names`].
    pub fn trained_numels(&self) -> Vec<usize> {
        self.shapes.iter().zip(&self.trained_index).filter(|(_, t)| t.is_some()).map(|(s, _)| s.elem_count()).collect()
    }

    /// Every parameter's values in fp32, on rank 0 (`None` elsewhere): for saving the model.
    /// Every rank must call it (each unit is all-gathered); the others drop each unit at once,
    /// so only rank 0 ever holds the whole model.
    pub fn gather_params(&self) -> Result<Option<ParamStore>> {
        let shard = self.shard.borrow();
        self.gather_values(&Held::of(&shard), self.group.is_first(), DType::F32)
    }

    /// Every parameter's values in `dtype` on every rank (a collective): PPO's generation mode,
    /// which gathers the whole actor once per rollout and drops it after (DS-Chat's hybrid
    /// engine), so that generation itself needs no collective. Each unit is cast as it arrives:
    /// a rank holds the whole model only in `dtype` (in bf16 or fp16 half the fp32 bytes), plus
    /// one unit in fp32.
    pub fn gather_params_everywhere(&self, dtype: DType) -> Result<ParamStore> {
        let shard = self.shard.borrow();
        self.gather_values(&Held::of(&shard), true, dtype)?
            .ok_or_else(|| anyhow!("internal error: a gather kept nothing"))
    }

    /// A copy of this rank's fp32 weight shard (padding included) in host memory: what a sharded
    /// actor's EMA follows, value by value.
    pub fn shard_values(&self) -> Result<Vec<f32>> {
        Ok(self.shard.borrow().to_host()?.into_owned())
    }

    /// This rank's shard of `store`, a whole model with this model's parameters (an EMA resumed
    /// from a checkpoint), laid out as the weight shard. No collective.
    pub fn shard_of(&self, store: &ParamStore) -> Result<Vec<f32>> {
        if store.names != self.names {
            bail!("internal error: the store to shard does not hold the sharded model's parameters");
        }
        let mut out = Vec::with_capacity(self.shard_len());
        for unit in &self.units {
            let tensors: Vec<Tensor> = unit.params.iter().map(|&i| store.vars[i].as_tensor().clone()).collect();
            let flat = unit.partition.flatten(&tensors)?.to_dtype(DType::F32)?;
            let range = unit.partition.shard(self.group.rank());
            out.extend(flat.narrow(0, range.start, range.len())?.to_vec1::<f32>()?);
        }
        Ok(out)
    }

    /// This rank's shard-shaped values of a model with this model's parameters read by ranges
    /// (`read(name, range)`, as [`Self::read`] reads them): an EMA resumed from its directory,
    /// never whole. Padding is 0. No collective.
    pub fn read_shard_values(&self, read: impl Fn(&str, Range<usize>) -> Result<Vec<f32>>) -> Result<Vec<f32>> {
        let mut out = vec![0f32; self.shard_len()];
        for (i, held) in self.held.iter().enumerate() {
            if let Some((range, at)) = held.clone() {
                let values = read(&self.names[i], range.clone())?;
                if values.len() != range.len() {
                    bail!("{}: {} values read for the {} this rank holds", self.names[i], values.len(), range.len());
                }
                out[at..at + range.len()].copy_from_slice(&values);
            }
        }
        Ok(out)
    }

    /// The whole model whose shards are every rank's `values` (laid out as the weight shard:
    /// the weights, or an EMA of them), on rank 0 (`None` elsewhere). Every rank must call it.
    pub fn gather_shard_values(&self, values: &[f32]) -> Result<Option<ParamStore>> {
        if values.len() != self.shard_len() {
            bail!("internal error: {} values to gather, the shard holds {}", values.len(), self.shard_len());
        }
        self.gather_values(&Held::Host(values), self.group.is_first(), DType::F32)
    }

    /// Whether LoRA adapters are attached.
    pub fn has_lora(&self) -> bool {
        self.lora_scaling.is_some()
    }

    /// Every parameter's name and shape, in the model's order.
    pub fn parameter_shapes(&self) -> impl Iterator<Item = (&str, &Shape)> {
        self.names.iter().map(String::as_str).zip(&self.shapes)
    }

    /// Every parameter's fp32 values gathered unit by unit, handed to `visit` (name, values) on
    /// the first rank, each unit dropped before the next is gathered: its peak is its shard plus
    /// one unit (a consolidated save written as it is gathered). Every rank must call it; after a
    /// failing `visit` the first rank still takes part in the remaining gathers, then returns
    /// the error, so no rank waits on it.
    pub fn visit_gathered_params(&self, visit: impl FnMut(&str, &Tensor) -> Result<()>) -> Result<()> {
        let shard = self.shard.borrow();
        self.visit_gathered_values(&Held::of(&shard), visit)
    }

    /// [`Self::visit_gathered_params`] of every rank's shard-shaped `values` (an EMA of the
    /// weights).
    pub fn visit_gathered(&self, values: &[f32], visit: impl FnMut(&str, &Tensor) -> Result<()>) -> Result<()> {
        if values.len() != self.shard_len() {
            bail!("internal error: {} values to gather, the shard holds {}", values.len(), self.shard_len());
        }
        self.visit_gathered_values(&Held::Host(values), visit)
    }

    /// [`Self::visit_gathered`] of `values` as they are held.
    fn visit_gathered_values(&self, values: &Held, mut visit: impl FnMut(&str, &Tensor) -> Result<()>) -> Result<()> {
        let first = self.group.is_first();
        let mut failed = None;
        self.for_each_gathered(values, DType::F32, |i, t| {
            if first && failed.is_none() {
                failed = visit(&self.names[i], &t).err();
            }
            Ok(())
        })?;
        failed.map_or(Ok(()), Err)
    }

    /// The parameters a consolidated save holds (as [`ParamStore::merged`] leaves them), name and
    /// shape in the model's order: every one but the LoRA adapters, which
    /// [`Self::visit_gathered_merged`] fuses into their linears' weights.
    pub fn merged_shapes(&self) -> impl Iterator<Item = (&str, &Shape)> {
        self.parameter_shapes().filter(|(name, _)| !lora::is_adapter_name(name))
    }

    /// [`Self::visit_gathered`] of the model as a consolidated save holds it ([`Self::merged_shapes`]),
    /// of its weights or of every rank's shard-shaped `values`: gathered part by part (a block's
    /// trained and frozen units together: a LoRA adapter and its linear's weight are in one
    /// part), each adapter fused into its linear's weight (`lora::fuse`, as
    /// [`ParamStore::merged`]) and not visited itself. The first rank's peak is its shard plus one
    /// block. Every rank must call it; errors as in `visit_gathered`.
    pub fn visit_gathered_merged(
        &self,
        values: Option<&[f32]>,
        mut visit: impl FnMut(&str, &Tensor) -> Result<()>,
    ) -> Result<()> {
        let shard = self.shard.borrow();
        let values = match values {
            Some(values) if values.len() != self.shard_len() => {
                bail!("internal error: {} values to gather, the shard holds {}", values.len(), self.shard_len())
            }
            Some(values) => Held::Host(values),
            None => Held::of(&shard),
        };
        let first = self.group.is_first();
        let (mut part, mut failed) = (Vec::new(), None);
        for (k, unit) in self.units.iter().enumerate() {
            let tensors = self.gather_unit(unit, values.range(unit.shard())?, DType::F32)?;
            if first {
                part.extend(unit.params.iter().copied().zip(tensors));
            }
            if self.units.get(k + 1).is_none_or(|next| next.part != unit.part) {
                let done = std::mem::take(&mut part);
                if first && failed.is_none() {
                    failed = self.visit_merged_part(done, &mut visit).err();
                }
            }
        }
        failed.map_or(Ok(()), Err)
    }

    /// One part's gathered parameters (index, values) visited in the model's order, adapters
    /// fused into their linears.
    fn visit_merged_part(
        &self,
        mut tensors: Vec<(usize, Tensor)>,
        visit: &mut impl FnMut(&str, &Tensor) -> Result<()>,
    ) -> Result<()> {
        tensors.sort_by_key(|&(i, _)| i);
        let by_name: HashMap<&str, &Tensor> = tensors.iter().map(|(i, t)| (self.names[*i].as_str(), t)).collect();
        for (i, t) in &tensors {
            let name = &self.names[*i];
            if lora::is_adapter_name(name) {
                continue;
            }
            let adapter = self.lora_scaling.zip(name.strip_suffix(".weight")).and_then(|(scaling, module)| {
                let (a, b) = lora::Adapter::param_names(module);
                Some((*by_name.get(a.as_str())?, *by_name.get(b.as_str())?, scaling))
            });
            match adapter {
                Some((a, b, scaling)) => visit(name, &lora::fuse(t, a, b, scaling)?)?,
                None => visit(name, t)?,
            }
        }
        Ok(())
    }

    /// Whether PPO's rollouts fuse the LoRA adapters on the fp32 shards and gather the fused
    /// weights in the compute dtype ([`Self::gather_fused_everywhere`]): with adapters in fp16 or
    /// bf16, outside tensor parallelism. Otherwise the weights are gathered with their adapters
    /// in fp32 and fused whole.
    pub fn fuses_lora_on_shards(&self) -> bool {
        self.has_lora() && self.dtype != DType::F32 && self.tp.is_none()
    }

    /// The whole weights generation runs on, in `dtype` on every rank (a collective): part by
    /// part, each LoRA adapter fused into its linear's weight on this rank's fp32 shard, then
    /// the fused shard all-gathered in `dtype`, half the bytes of fp32 in fp16/bf16. Bit for
    /// bit the whole fp32 masters fused ([`ParamStore::merged`]) and cast, as stage 0 makes
    /// them; the adapters (summed from every rank's pieces, small) are not in the result.
    pub fn gather_fused_everywhere(&self, dtype: DType) -> Result<ParamStore> {
        let Some(scaling) = self.lora_scaling else { bail!("internal error: fusing a model without LoRA adapters") };
        // The adapters are fused on the host (a GPU's shard copied there once a rollout: a
        // shard of fp32 values, small beside the gathered model).
        let held = self.shard.borrow();
        let shard = held.to_host()?;
        let rank = self.group.rank();
        let index: HashMap<&str, usize> = self.names.iter().enumerate().map(|(i, n)| (n.as_str(), i)).collect();
        let mut full: Vec<Option<Tensor>> = vec![None; self.names.len()];
        for part in 0..=self.cfg.num_layers() {
            let units: Vec<&Unit> = self.units.iter().filter(|unit| unit.part == part).collect();
            // The part's adapters, whole: a buffer of all of them, this rank's pieces in place,
            // summed over ranks.
            let mut at = HashMap::new();
            let mut len = 0;
            for &i in units.iter().flat_map(|unit| &unit.params) {
                if lora::is_adapter_name(&self.names[i]) {
                    at.insert(i, len);
                    len += self.shapes[i].elem_count();
                }
            }
            let mut mine = vec![0f32; len];
            for unit in &units {
                for piece in unit.partition.pieces(rank) {
                    if let Some(&start) = at.get(&unit.params[piece.param]) {
                        let held = unit.offset + piece.in_shard.start..unit.offset + piece.in_shard.end;
                        mine[start + piece.in_param.start..start + piece.in_param.end].copy_from_slice(&shard[held]);
                    }
                }
            }
            // (Every rank has the same layout: a part without adapters makes no collective.)
            let mine = Tensor::from_vec(mine, len, &Device::Cpu)?;
            let adapters = if len == 0 { mine } else { self.group.all_reduce(&mine, ReduceOp::Sum)? };
            let whole = |i: usize| -> Result<Tensor> {
                Ok(adapters.narrow(0, at[&i], self.shapes[i].elem_count())?.reshape(&self.shapes[i])?)
            };
            for unit in &units {
                let mut fused = shard[unit.offset..unit.offset + unit.partition.shard_len].to_vec();
                let adapter = |name: &str| index.get(name).map(|&i| whole(i));
                for piece in unit.partition.pieces(rank) {
                    let name = &self.names[unit.params[piece.param]];
                    let values = &mut fused[piece.in_shard];
                    crate::training::zero::add_lora_delta(values, name, piece.in_param.start, scaling, adapter)?;
                }
                for (&i, t) in unit.params.iter().zip(self.gather_unit(unit, Held::Host(&fused), dtype)?) {
                    if !at.contains_key(&i) {
                        full[i] = Some(t);
                    }
                }
            }
        }
        let named = self.names.iter().zip(full).filter(|(name, _)| !lora::is_adapter_name(name)).map(|(name, t)| {
            t.map(|t| (name.clone(), t)).ok_or_else(|| anyhow!("internal error: {name} is in no unit"))
        });
        ParamStore::of_tensors(named.collect::<Result<Vec<_>>>()?)
    }

    /// The trained parameters gathered whole onto the first rank in fp32, as a store of them
    /// alone (`None` elsewhere): with `--only-optimize-lora` the adapters and heads, a PEFT
    /// adapter's tensors, small beside the frozen trunk. Every rank must call it.
    pub fn gather_trained(&self) -> Result<Option<ParamStore>> {
        let first = self.group.is_first();
        let shard = self.shard.borrow();
        let values = Held::of(&shard);
        let mut trained = Vec::new();
        for unit in self.units.iter().filter(|unit| unit.grad_offset.is_some()) {
            let tensors = self.gather_unit(unit, values.range(unit.shard())?, DType::F32)?;
            if first {
                trained.extend(unit.params.iter().copied().zip(tensors));
            }
        }
        if !first {
            return Ok(None);
        }
        trained.sort_by_key(|&(i, _)| i);
        let count = trained.len();
        let mut store = ParamStore::of_tensors(trained.into_iter().map(|(i, t)| (self.names[i].clone(), t)))?;
        store.set_layout(&vec![false; count], self.lora_scaling)?;
        Ok(Some(store))
    }

    /// Gathers each unit of the shard-shaped `values` and hands its parameters (index, values)
    /// to `take`.
    fn for_each_gathered(
        &self,
        values: &Held,
        dtype: DType,
        mut take: impl FnMut(usize, Tensor) -> Result<()>,
    ) -> Result<()> {
        for unit in &self.units {
            let tensors = self.gather_unit(unit, values.range(unit.shard())?, dtype)?;
            for (&i, t) in unit.params.iter().zip(tensors) {
                take(i, t)?;
            }
        }
        Ok(())
    }

    /// Gathers each unit of the shard-shaped `values`; keeps the whole model in `dtype` when
    /// `keep`.
    fn gather_values(&self, values: &Held, keep: bool, dtype: DType) -> Result<Option<ParamStore>> {
        let mut full: Vec<Option<Tensor>> = vec![None; self.names.len()];
        // Every rank gathers in `dtype` (the same bytes), kept or not.
        self.for_each_gathered(values, dtype, |i, t| {
            if keep {
                full[i] = Some(t);
            }
            Ok(())
        })?;
        if !keep {
            return Ok(None);
        }
        let named = self.names.iter().zip(full).map(|(name, t)| {
            t.map(|t| (name.clone(), t)).ok_or_else(|| anyhow!("internal error: {name} is in no unit"))
        });
        let mut store = ParamStore::of_tensors(named.collect::<Result<Vec<_>>>()?)?;
        store.set_layout(&self.frozen, self.lora_scaling)?;
        Ok(Some(store))
    }

    /// A unit's parameters from every rank's `mine` (this rank's shard of some per-value
    /// quantity of the unit: weights or moments), full on the compute device, gathered in
    /// `dtype` (weights in the compute dtype: half fp32's bytes in fp16/bf16, as DeepSpeed
    /// gathers its fp16 parameters; fp32 for saves).
    fn gather_unit(&self, unit: &Unit, mine: Held, dtype: DType) -> Result<Vec<Tensor>> {
        let full = mine.all_gather_as(&self.group, dtype, &self.device)?;
        let shapes: Vec<&Shape> = unit.params.iter().map(|&i| &self.shapes[i]).collect();
        unit.partition.unflatten(&full, &shapes)
    }

    /// Part `part`'s weights, gathered in the compute dtype. With `Pass::Backward` the trained
    /// ones are variables (gradients computed through them land there), the first of a unit in
    /// the gathered buffer itself, the others copied out of it
    /// ([`ProcessGroup::all_gather_slice_as_variables`]); the frozen ones, and all of them for a
    /// forward without gradients, are constants (views of the gathered buffer).
    fn gather(&self, part: usize, pass: Pass) -> Result<Gathered> {
        self.finish_gather(self.begin_gather(part)?, pass)
    }

    /// Part `part`'s gather begun: from a shard on the GPU, NCCL gathers it on its own stream
    /// while the compute stream goes on (DeepSpeed's prefetch of the next unit while the
    /// current one computes); from a shard in host memory it is gathered when finished.
    fn begin_gather(&self, part: usize) -> Result<PendingPart> {
        let shard = self.shard.borrow();
        let mut units = Vec::new();
        for (u, unit) in self.units.iter().enumerate().filter(|(_, unit)| unit.part == part) {
            let begun = match Held::of(&shard).range(unit.shard())? {
                Held::Tensor(mine) => Some(self.group.begin_all_gather_tensor_as(&mine, self.dtype)?),
                Held::Host(_) => None,
            };
            units.push((u, begun));
        }
        Ok(PendingPart { units })
    }

    /// A begun gather's weights for `pass` (see [`Self::gather`]).
    fn finish_gather(&self, pending: PendingPart, pass: Pass) -> Result<Gathered> {
        let mut trained = Vec::new();
        let mut named = HashMap::new();
        for (u, begun) in pending.units {
            let unit = &self.units[u];
            let shapes: Vec<&Shape> = unit.params.iter().map(|&i| &self.shapes[i]).collect();
            if unit.grad_offset.is_some() && pass == Pass::Backward {
                let vars = match begun {
                    Some(begun) => begun.ready_as_variables(&shapes)?,
                    None => {
                        let shard = self.shard.borrow();
                        let Held::Host(mine) = Held::of(&shard).range(unit.shard())? else {
                            bail!("internal error: a shard on the device finished a gather it never began");
                        };
                        self.group.all_gather_slice_as_variables(mine, self.dtype, &shapes, &self.device)?
                    }
                };
                for (&i, var) in unit.params.iter().zip(&vars) {
                    named.insert(self.names[i].clone(), var.as_tensor().clone());
                }
                trained.push((u, vars));
                continue;
            }
            let tensors = match begun {
                Some(begun) => unit.partition.unflatten(&begun.ready()?, &shapes)?,
                None => self.gather_unit(unit, Held::of(&self.shard.borrow()).range(unit.shard())?, self.dtype)?,
            };
            for (&i, t) in unit.params.iter().zip(tensors) {
                named.insert(self.names[i].clone(), t.to_dtype(self.dtype)?);
            }
        }
        Ok(Gathered { trained, named })
    }

    /// Runs `f` on each of `blocks` in turn, gathered for `pass`, the next one's gather begun
    /// before the current one runs (the first's may be begun already: `first`), and `then`'s
    /// after the last; returns `then`'s begun gather. At most two parts are gathered at once.
    fn for_blocks_prefetched(
        &self,
        blocks: &[usize],
        pass: Pass,
        first: Option<PendingPart>,
        then: Option<usize>,
        mut f: impl FnMut(usize, Block, Gathered) -> Result<()>,
    ) -> Result<Option<PendingPart>> {
        let part_after = |k: usize| blocks.get(k).map(|&i| i + 1).or(then);
        let mut next = match first {
            Some(begun) => Some(begun),
            None => part_after(0).map(|part| self.begin_gather(part)).transpose()?,
        };
        for (k, &i) in blocks.iter().enumerate() {
            let current = next.take().ok_or_else(|| anyhow!("internal error: block {i} was not gathered"))?;
            next = part_after(k + 1).map(|part| self.begin_gather(part)).transpose()?;
            let (block, gathered) = self.block_from(i, self.finish_gather(current, pass)?)?;
            f(i, block, gathered)?;
        }
        Ok(next)
    }

    /// Embeddings, final LayerNorm and heads, gathered: a GPT-2 without blocks, for the
    /// embedding and for the heads (its `lm_head`, `lm_loss_at`, `final_norm` work as usual).
    pub fn outer(&self) -> Result<(Gpt2, Gathered)> {
        self.outer_for(Pass::Backward)
    }

    /// [`Self::outer`] for `pass`.
    fn outer_for(&self, pass: Pass) -> Result<(Gpt2, Gathered)> {
        self.outer_from(self.gather(OUTER, pass)?)
    }

    /// The outer part's model on its gathered weights `g`.
    fn outer_from(&self, g: Gathered) -> Result<(Gpt2, Gathered)> {
        let cfg = self.cfg.clone().with_shape(Some(0), None, None, None);
        let mut model = match &self.tp {
            Some(tp) => Gpt2::load_tensor_parallel(g.var_builder(self), &cfg, tp)?,
            None => Gpt2::load(g.var_builder(self), &cfg)?,
        };
        model.fp32_loss = self.fp32_loss;
        Ok((model, g))
    }

    /// Block `i` on its gathered weights `g`, with its LoRA adapters attached.
    fn block_from(&self, i: usize, g: Gathered) -> Result<(Block, Gathered)> {
        let mut block = Gpt2::load_block(g.var_builder(self), &self.cfg, i, self.tp.as_ref())?;
        if let Some(scaling) = self.lora_scaling {
            attach_adapters(block.linears_mut(), &g.named, scaling);
        }
        Ok((block, g))
    }

    /// The trunk's last hidden state (B, T, C) without gradients, each block gathered in turn.
    pub fn forward_blocks(&self, ids: &Tensor, pos: &Positions) -> Result<Tensor> {
        let (b, t) = ids.dims2()?;
        let (outer, _) = self.outer_for(Pass::Forward)?;
        let bias = outer.attention_bias(b, t, 0, pos, ids.device())?;
        let mut x = outer.embed(ids, pos, 0, None)?;
        drop(outer);
        let blocks: Vec<usize> = (0..self.cfg.num_layers()).collect();
        self.for_blocks_prefetched(&blocks, Pass::Forward, None, None, |_, block, _| {
            x = block.forward(&x, &bias, None, None)?.detach();
            Ok(())
        })?;
        Ok(x)
    }

    /// Forward and backward of `head`'s loss on the trunk's output, block by block with
    /// recomputation; the gradients of `loss * loss_scale` are reduce-scattered into this rank's
    /// gradient shard as each unit's backward ends. `head` gets the gathered head weights (the
    /// outer unit) and the last hidden state (B, T, C, before `ln_f`) and returns a scalar.
    /// Returns the loss.
    pub fn forward_backward(
        &self,
        ids: &Tensor,
        pos: &Positions,
        dropout: Option<&Dropout>,
        loss_scale: f64,
        head: impl Fn(&Heads, &Tensor) -> candle_core::Result<Tensor>,
    ) -> Result<f32> {
        let (b, t) = ids.dims2()?;
        // Forward, keeping only each block's input.
        let (outer, _) = self.outer_for(Pass::Forward)?;
        let bias = outer.attention_bias(b, t, 0, pos, ids.device())?;
        let mut x = outer.embed(ids, pos, 0, dropout)?.detach();
        drop(outer);
        let mut inputs = Vec::with_capacity(self.cfg.num_layers());
        let blocks: Vec<usize> = (0..self.cfg.num_layers()).collect();
        // The outer unit's gather for the head begins while the last block runs.
        let head_weights = self.for_blocks_prefetched(&blocks, Pass::Forward, None, Some(OUTER), |_, block, _| {
            inputs.push(x.clone());
            x = block.forward(&x, &bias, None, dropout)?.detach();
            Ok(())
        })?;

        // The head, with the last hidden state as a leaf so its gradient comes back. Each
        // part's graph, gathered weights and gradients are dropped as soon as they are used, so
        // that a rank holds at most one gathered unit and its gradient at a time (the head's
        // graph would otherwise keep the gathered embedding through every block's backward).
        let head_weights = head_weights.ok_or_else(|| anyhow!("internal error: the head was not gathered"))?;
        // The last block's gather for its backward begins while the head runs.
        let last_block = self.cfg.num_layers().checked_sub(1).map(|i| self.begin_gather(i + 1)).transpose()?;
        let (outer, gathered) = self.outer_from(self.finish_gather(head_weights, Pass::Backward)?)?;
        let last = Var::from_tensor(&x)?;
        let score = gathered.tensor(SCORE_WEIGHT);
        let loss = head(&Heads { trunk: &outer, score: score.as_ref() }, last.as_tensor())?;
        let loss_value = loss.to_dtype(DType::F32)?.to_scalar::<f32>()?;
        let mut store = (&loss * loss_scale)?.backward()?;
        drop((loss, outer, score));
        let mut grad = take_leaf_grad(&mut store, &last)?;
        self.reduce_scatter_gradients(gathered, store)?;

        let backwards: Vec<usize> = (0..self.cfg.num_layers()).rev().collect();
        self.for_blocks_prefetched(&backwards, Pass::Backward, last_block, None, |i, block, gathered| {
            let input = Var::from_tensor(&inputs[i])?;
            let out = block.forward(input.as_tensor(), &bias, None, dropout)?;
            let mut store = out.mul(&grad)?.sum_all()?.backward()?;
            drop((out, block));
            grad = take_leaf_grad(&mut store, &input)?;
            self.reduce_scatter_gradients(gathered, store)
        })?;

        // The embeddings; wte's gradient from the head was reduce-scattered above and adds up.
        // Their backward reads only the ids and the gradient reaching them: the outer unit is
        // not gathered again (under tensor parallelism, whose vocabulary-parallel lookup has
        // its own backward, it is).
        if self.tp.is_none() {
            let (dwte, dwpe) = crate::model::gpt2::embedding_gradients(&self.cfg, ids, pos, dropout, &grad)?;
            drop(grad);
            let mut formed = HashMap::from([("wte.weight", dwte), ("wpe.weight", dwpe)]);
            let taken = self.units_of(OUTER, |i, shape| match formed.remove(self.names[i].as_str()) {
                Some(grad) => Ok(grad.to_dtype(DType::F32)?),
                None => Ok(Tensor::zeros(shape, DType::F32, &self.device)?),
            })?;
            drop(formed);
            self.reduce_scatter_units(taken)?;
        } else {
            let (outer, gathered) = self.outer()?;
            let emb = outer.embed(ids, pos, 0, dropout)?;
            let store = emb.mul(&grad)?.sum_all()?.backward()?;
            drop((emb, outer, grad));
            self.reduce_scatter_gradients(gathered, store)?;
        }
        Ok(loss_value)
    }

    /// Part `part`'s trained units, each with its parameters' gradients made by `grad` (the
    /// parameter's index and shape).
    fn units_of(
        &self,
        part: usize,
        mut grad: impl FnMut(usize, &Shape) -> Result<Tensor>,
    ) -> Result<Vec<(usize, Vec<Tensor>)>> {
        let trained = self.units.iter().enumerate().filter(|(_, unit)| unit.part == part && unit.grad_offset.is_some());
        trained
            .map(|(u, unit)| Ok((u, unit.params.iter().map(|&i| grad(i, &self.shapes[i])).collect::<Result<_>>()?)))
            .collect()
    }

    /// Adds this rank's shard of the gradients `store` holds for a gathered part's trained
    /// units, summed over ranks, to their gradient shards. Parameters the backward did not
    /// reach count as 0. The gathered weights are dropped first and each gradient once copied
    /// for the collective (the caller drops the models built on them before).
    fn reduce_scatter_gradients(&self, g: Gathered, mut store: GradStore) -> Result<()> {
        let mut taken = Vec::new();
        for (u, vars) in g.trained {
            let grads: Vec<Tensor> = vars
                .iter()
                .map(|v| match store.remove(v.as_tensor()) {
                    Some(grad) => grad.detach().to_dtype(DType::F32),
                    None => Tensor::zeros(v.shape(), DType::F32, &self.device),
                })
                .collect::<candle_core::Result<_>>()?;
            taken.push((u, grads));
        }
        drop((g.named, store));
        self.reduce_scatter_units(taken)
    }

    /// Reduce-scatters each unit's whole gradients (`taken`: unit, its parameters' gradients in
    /// f32) into its gradient shard, adding to what earlier micro-batches left there. Each
    /// reduce-scatter is begun and added when the next one begins (or the shard is read): over
    /// NCCL it runs while the next unit's backward computes.
    fn reduce_scatter_units(&self, taken: Vec<(usize, Vec<Tensor>)>) -> Result<()> {
        for (u, grads) in taken {
            self.add_reduced_gradient()?;
            let padded = self.units[u].partition.padded();
            let begun = self.group.begin_reduce_scatter_parts_in_rounds_as(
                grads,
                padded,
                self.reduce_bucket,
                self.gradient_wire,
            )?;
            *self.reducing.borrow_mut() = Some((u, begun));
        }
        Ok(())
    }

    /// Adds the reduce-scatter in flight, if any, to its unit's gradient shard.
    fn add_reduced_gradient(&self) -> Result<()> {
        let Some((u, begun)) = self.reducing.borrow_mut().take() else { return Ok(()) };
        let mine = begun.ready()?;
        let mut slots = self.grads.borrow_mut();
        slots[u] = Some(match slots[u].take() {
            Some(acc) => (acc + mine)?,
            None => mine,
        });
        Ok(())
    }

    /// The gradient shards accumulated so far (for an overflow check).
    pub fn partial_gradients(&self) -> Result<Vec<Tensor>> {
        self.add_reduced_gradient()?;
        Ok(self.grads.borrow().iter().flatten().cloned().collect())
    }

    /// This rank's gradient shard (summed over ranks and micro-batches): the trained units'
    /// shards end to end, each at its `grad_offset`; the accumulation is emptied.
    pub fn take_gradient_shard(&self) -> Result<Tensor> {
        self.add_reduced_gradient()?;
        let mut grads = self.grads.borrow_mut();
        let parts: Vec<Tensor> = self
            .units
            .iter()
            .zip(grads.iter_mut())
            .filter(|(unit, _)| unit.grad_offset.is_some())
            .map(|(_, g)| g.take().ok_or_else(|| anyhow!("internal error: a unit received no gradient")))
            .collect::<Result<_>>()?;
        Ok(Tensor::cat(&parts, 0)?)
    }

    /// The trained units with this rank's pieces of their parameters: (parameter index in the
    /// model, its index in the optimizer, the piece).
    fn trained_pieces(&self) -> impl Iterator<Item = (&Unit, usize, crate::training::zero::Piece)> + '_ {
        let rank = self.group.rank();
        self.units.iter().filter(|unit| unit.grad_offset.is_some()).flat_map(move |unit| {
            unit.partition.pieces(rank).into_iter().map(move |piece| {
                let trained = self.trained_index[unit.params[piece.param]].expect("a trained unit's parameter");
                (unit, trained, piece)
            })
        })
    }

    /// The range of each trained parameter (as [`Self::trained_names`]) whose values this rank
    /// holds.
    pub fn held_ranges(&self) -> Vec<Range<usize>> {
        let mut ranges = vec![0..0; self.trained_names.len()];
        for (_, trained, piece) in self.trained_pieces() {
            ranges[trained] = piece.in_param;
        }
        ranges
    }

    /// An AdamW over this rank's shard of the trained parameters only (the moments of
    /// [`Self::held_ranges`]).
    pub fn optimizer(&self, config: crate::training::optim::AdamWConfig) -> AdamW {
        AdamW::over_ranges(config, &self.trained_names, self.held_ranges())
    }

    /// One AdamW step of this rank's weight shard with its (averaged, clipped) gradient shard.
    /// Nothing is gathered: the next forward gathers the updated weights.
    /// A shard on the device steps there, piece by piece in place with its moments beside it.
    pub fn adamw_step(&self, optimizer: &mut AdamW, grad_shard: &Tensor, lr: f64) -> Result<()> {
        let mut held = self.shard.borrow_mut();
        let shard = match &mut *held {
            MasterShard::Host(shard) => shard,
            MasterShard::Device(shard) => {
                let pieces = self.trained_pieces().map(|(unit, trained, piece)| {
                    let (at, from) = (unit.offset, unit.grad_offset.expect("a trained unit"));
                    Ok(InPlacePiece {
                        param: trained,
                        values: shard.narrow(0, at + piece.in_shard.start, piece.in_shard.len())?,
                        grad: from + piece.in_shard.start..from + piece.in_shard.end,
                    })
                });
                return crate::training::zero::step_pieces_in_place(
                    optimizer,
                    (grad_shard, shard.device()),
                    lr,
                    pieces,
                );
            }
        };
        crate::training::zero::with_host_f32(grad_shard, |g| {
            optimizer.step += 1;
            for (unit, trained, piece) in self.trained_pieces() {
                let (at, from) = (unit.offset, unit.grad_offset.expect("a trained unit"));
                let grad = &g[from + piece.in_shard.start..from + piece.in_shard.end];
                optimizer.update_held(
                    trained,
                    &mut shard[at + piece.in_shard.start..at + piece.in_shard.end],
                    grad,
                    lr,
                );
            }
            Ok(())
        })
    }

    /// A copy of `optimizer` with the full moments gathered from every rank onto the group's
    /// first (a collective; the others get `None` and hold no more than a unit's shard): what a
    /// checkpoint saves, so that it loads into any world size or stage.
    pub fn consolidate(&self, optimizer: &AdamW) -> Result<Option<AdamW>> {
        let rank = self.group.rank();
        let count = self.trained_names.len();
        let mut moments: [Vec<Vec<f32>>; 2] = [vec![Vec::new(); count], vec![Vec::new(); count]];
        for (which, out) in moments.iter_mut().enumerate() {
            for unit in self.units.iter().filter(|unit| unit.grad_offset.is_some()) {
                let mut values = vec![0f32; unit.partition.shard_len];
                for piece in unit.partition.pieces(rank) {
                    let (m, v) = optimizer.held_moments(
                        self.trained_index[unit.params[piece.param]].expect("a trained unit's parameter"),
                    )?;
                    values[piece.in_shard].copy_from_slice(if which == 0 { &m } else { &v });
                }
                let len = unit.partition.shard_len * self.group.world();
                let Some(full) = self.group.gather_to_first(&values, len)? else { continue };
                let shapes: Vec<&Shape> = unit.params.iter().map(|&i| &self.shapes[i]).collect();
                for (&i, t) in unit.params.iter().zip(unit.partition.unflatten(&full, &shapes)?) {
                    if let Some(trained) = self.trained_index[i] {
                        out[trained] = t.flatten_all()?.to_vec1()?;
                    }
                }
            }
        }
        if !self.group.is_first() {
            return Ok(None);
        }
        let [exp_avg, exp_avg_sq] = moments;
        Ok(Some(optimizer.with_full_moments(exp_avg, exp_avg_sq)))
    }
}

/// A part's gather begun ([`ShardedModel::begin_gather`]): per unit, the gather in flight from a
/// shard on the GPU, or `None` for one gathered when finished.
struct PendingPart {
    units: Vec<(usize, Option<Pending>)>,
}

/// A part's gathered weights: alive while this is.
pub struct Gathered {
    /// The part's trained units with their fresh variables (in the unit's parameter order).
    trained: Vec<(usize, Vec<Var>)>,
    /// Every gathered weight by name.
    named: HashMap<String, Tensor>,
}

impl Gathered {
    /// The gathered weight `name` (a head's, such as `score.weight`), if the part holds it.
    pub fn tensor(&self, name: &str) -> Option<Tensor> {
        self.named.get(name).cloned()
    }

    fn var_builder(&self, model: &ShardedModel) -> VarBuilder<'static> {
        VarBuilder::from_tensors(self.named.clone(), model.dtype, &model.device)
    }
}

/// The unit of parameter `name` of a model of config `cfg`: block `i`'s is `i + 1`, the rest
/// (embeddings, final norm, heads) is [`OUTER`]; which block a parameter is in is the model's
/// layout's (`cfg.block_of`).
fn unit_of(cfg: &Gpt2Config, name: &str) -> Result<usize> {
    match cfg.block_of(name)? {
        None => Ok(OUTER),
        Some(i) if i < cfg.num_layers() => Ok(i + 1),
        Some(_) => bail!("internal error: parameter {name} names no block of the {}", cfg.num_layers()),
    }
}

/// The gradient that reached a leaf, taken out of `store` and detached (see
/// `train_step::leaf_grad`).
fn take_leaf_grad(store: &mut GradStore, leaf: &Var) -> Result<Tensor> {
    store
        .remove(leaf.as_tensor())
        .map(|g| g.detach())
        .ok_or_else(|| anyhow!("internal error: no gradient reached a block boundary"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parameters_fall_into_their_blocks_unit() {
        let cfg = Gpt2Config::tiny().with_shape(Some(2), None, None, None);
        assert_eq!(unit_of(&cfg, "wte.weight").unwrap(), OUTER);
        assert_eq!(unit_of(&cfg, "score.weight").unwrap(), OUTER);
        assert_eq!(unit_of(&cfg, "h.0.attn.c_attn.weight").unwrap(), 1);
        assert_eq!(unit_of(&cfg, "h.1.ln_2.bias").unwrap(), 2);
        assert!(unit_of(&cfg, "h.2.ln_2.bias").is_err());
        assert!(unit_of(&cfg, "h.x.ln_2.bias").is_err());
    }

    /// One rank: the sharded forward and backward give the whole model's loss and gradients.
    #[test]
    fn one_rank_matches_the_whole_model() -> Result<()> {
        let cfg = Gpt2Config { n_layer: 2, n_embd: 8, n_head: 2, n_positions: 8, vocab_size: 16, ..Gpt2Config::tiny() };
        let params = ParamStore::init(&cfg, 3, &Device::Cpu)?;
        let group = Arc::new(ProcessGroup::single());
        let sharded = ShardedModel::new(group, &cfg, &params, DType::F32)?;
        let ids = Tensor::new(&[[1u32, 2, 3, 4], [5, 6, 7, 8]], &Device::Cpu)?;
        let targets = Tensor::new(&[[2u32, 3, 4, 5], [6, 7, 8, 9]], &Device::Cpu)?.flatten_all()?;
        let loss = sharded
            .forward_backward(&ids, &Positions::default(), None, 1.0, |w, h| w.trunk.lm_head_loss(h, &targets))?;
        let model = params.model(&cfg)?;
        let want = model.lm_loss(&ids, &targets.reshape((2, 4))?, None)?;
        assert!((loss - want.to_scalar::<f32>()?).abs() < 1e-6);
        let store = want.backward()?;
        // What an overflow check reads before the step: the gradient shard so far, all of it.
        let partial = crate::training::optim::global_grad_norm(&sharded.partial_gradients()?)?;
        let shard_tensor = sharded.take_gradient_shard()?;
        let taken = crate::training::optim::global_grad_norm(std::slice::from_ref(&shard_tensor))?;
        assert!(partial > 0.0 && (partial - taken).abs() <= 1e-6 * taken, "{partial} vs {taken}");
        let shard: Vec<f32> = shard_tensor.to_vec1()?;
        // The gradient's norm is the whole model's, and every parameter is trained.
        let mut squares = 0f64;
        for var in &params.vars {
            let g: Vec<f32> = store.get(var.as_tensor()).unwrap().flatten_all()?.to_vec1()?;
            squares += g.iter().map(|&x| x as f64 * x as f64).sum::<f64>();
        }
        let norm = sharded.grad_norm(&shard_tensor)?;
        assert!((norm - squares.sqrt()).abs() <= 1e-5 * squares.sqrt(), "{norm} vs {}", squares.sqrt());
        assert_eq!(sharded.trained_numels(), params.vars.iter().map(|v| v.elem_count()).collect::<Vec<_>>());
        // The shard is laid out unit by unit: compare each parameter's piece.
        for unit in &sharded.units {
            for piece in unit.partition.pieces(0) {
                let i = unit.params[piece.param];
                let g: Vec<f32> = store.get(params.vars[i].as_tensor()).unwrap().flatten_all()?.to_vec1()?;
                let got = &shard[unit.offset + piece.in_shard.start..unit.offset + piece.in_shard.end];
                for (a, b) in got.iter().zip(&g[piece.in_param]) {
                    assert!((a - b).abs() <= 1e-5 * (1.0 + b.abs()), "{}: {a} vs {b}", params.names[i]);
                }
            }
        }
        let gathered = sharded.gather_params()?.expect("rank 0 of one");
        for (a, b) in gathered.vars.iter().zip(&params.vars) {
            assert_eq!(a.flatten_all()?.to_vec1::<f32>()?, b.flatten_all()?.to_vec1::<f32>()?);
        }
        // The shard of the whole store is the shard itself; gathering it, or the shard-shaped
        // values, gives the whole store back.
        assert_eq!(sharded.shard_of(&params)?, sharded.shard_values()?);
        let everywhere = sharded.gather_params_everywhere(DType::F32)?;
        let from_values = sharded.gather_shard_values(&sharded.shard_values()?)?.expect("rank 0 of one");
        for ((a, b), want) in everywhere.vars.iter().zip(&from_values.vars).zip(&params.vars) {
            let want = want.flatten_all()?.to_vec1::<f32>()?;
            assert_eq!(a.flatten_all()?.to_vec1::<f32>()?, want);
            assert_eq!(b.flatten_all()?.to_vec1::<f32>()?, want);
        }
        assert!(sharded.gather_shard_values(&[0.0]).is_err(), "values of another length");
        // Gathered for generation in bf16: each unit cast as it arrives, the whole cast's values.
        for (a, want) in sharded.gather_params_everywhere(DType::BF16)?.vars.iter().zip(&params.vars) {
            assert_eq!(a.dtype(), DType::BF16);
            let want = want.to_dtype(DType::BF16)?.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
            assert_eq!(a.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?, want);
        }
        let hidden = sharded.forward_blocks(&ids, &Positions::default())?;
        let want = model.forward_blocks(&ids, &Positions::default(), None, None)?;
        assert!((hidden - want)?.abs()?.max_all()?.to_scalar::<f32>()? < 1e-6);
        Ok(())
    }

    /// A reward model's head (`score.weight`, after the trunk) is gathered with the outer unit
    /// for the loss, and its gradient comes back into the shard: for the loss
    /// `sum(hidden @ score^T)` that is the sum of the hidden states, checked against the whole
    /// model's.
    #[test]
    fn a_score_head_is_gathered_for_the_loss_and_gets_its_gradient() -> Result<()> {
        let cfg = Gpt2Config { n_layer: 1, n_embd: 8, n_head: 2, n_positions: 8, vocab_size: 16, ..Gpt2Config::tiny() };
        let mut params = ParamStore::init(&cfg, 3, &Device::Cpu)?;
        let score: Vec<f32> = vec![0.5, -0.25, 0.0, 1.0, 0.0, 0.0, 2.0, -1.0];
        params.push(SCORE_WEIGHT, &Tensor::from_slice(&score, (1, 8), &Device::Cpu)?)?;
        let sharded = ShardedModel::new(Arc::new(ProcessGroup::single()), &cfg, &params, DType::F32)?;
        let ids = Tensor::new(&[[1u32, 2, 3], [4, 5, 6]], &Device::Cpu)?;
        let seen = std::cell::RefCell::new(Vec::new());
        let loss = sharded.forward_backward(&ids, &Positions::default(), None, 1.0, |w, h| {
            let s = w.score.expect("the score head is gathered");
            *seen.borrow_mut() = s.flatten_all()?.to_vec1::<f32>()?;
            h.broadcast_matmul(&s.t()?)?.sum_all()
        })?;
        assert_eq!(*seen.borrow(), score);
        let hidden = params.model(&cfg)?.forward_blocks(&ids, &Positions::default(), None, None)?;
        let want = hidden.broadcast_matmul(&Tensor::from_slice(&score, (8, 1), &Device::Cpu)?)?.sum_all()?;
        assert!((loss - want.to_scalar::<f32>()?).abs() < 1e-5, "{loss} vs {want}");
        let grad_want: Vec<f32> = hidden.sum((0, 1))?.to_vec1()?;
        let shard: Vec<f32> = sharded.take_gradient_shard()?.to_vec1()?;
        let head = params.names.iter().position(|n| n == SCORE_WEIGHT).unwrap();
        let (unit, piece) = sharded
            .units
            .iter()
            .find_map(|u| u.partition.pieces(0).into_iter().find(|p| u.params[p.param] == head).map(|p| (u, p)))
            .expect("the head is in a unit");
        let got = &shard[unit.offset + piece.in_shard.start..unit.offset + piece.in_shard.end];
        for (a, b) in got.iter().zip(&grad_want) {
            assert!((a - b).abs() <= 1e-5 * (1.0 + b.abs()), "{got:?} vs {grad_want:?}");
        }
        Ok(())
    }

    /// A frozen model (PPO's reference and reward model at stage 3) computes the trained one's
    /// forward bit for bit from the same shard, and has nothing to train: no trained names, no
    /// optimizer state, no gradient slots.
    #[test]
    fn a_frozen_model_forwards_as_the_trained_one_and_trains_nothing() -> Result<()> {
        let cfg = Gpt2Config { n_layer: 2, n_embd: 8, n_head: 2, n_positions: 8, vocab_size: 16, ..Gpt2Config::tiny() };
        let params = ParamStore::init(&cfg, 3, &Device::Cpu)?;
        let group = Arc::new(ProcessGroup::single());
        let trained = ShardedModel::new(group.clone(), &cfg, &params, DType::F32)?;
        let frozen = ShardedModel::new(group, &cfg, &params, DType::F32)?.freeze();
        assert_eq!(frozen.shard_values()?, trained.shard_values()?, "the same layout");
        assert!(frozen.trained_names().is_empty() && frozen.held_ranges().is_empty());
        assert!(frozen.units.iter().all(|u| u.grad_offset.is_none()));
        let ids = Tensor::new(&[[1u32, 2, 3, 4], [5, 6, 7, 8]], &Device::Cpu)?;
        let (a, b) =
            (frozen.forward_blocks(&ids, &Positions::default())?, trained.forward_blocks(&ids, &Positions::default())?);
        assert_eq!(a.flatten_all()?.to_vec1::<f32>()?, b.flatten_all()?.to_vec1::<f32>()?);
        let (outer, gathered) = frozen.outer()?;
        assert!(gathered.trained.is_empty(), "no variables: nothing to take a gradient");
        assert!(!outer.lm_head(&a)?.flatten_all()?.to_vec1::<f32>()?.is_empty());
        Ok(())
    }

    /// LoRA with a frozen trunk: the adapters (and the unfrozen head) get the whole model's
    /// gradients, the frozen weights none: no gradient shard, no optimizer state.
    #[test]
    fn lora_with_a_frozen_trunk_trains_only_the_adapters() -> Result<()> {
        let cfg = Gpt2Config { n_layer: 2, n_embd: 8, n_head: 2, n_positions: 8, vocab_size: 16, ..Gpt2Config::tiny() };
        let mut params = ParamStore::init(&cfg, 3, &Device::Cpu)?;
        let lora = lora::LoraConfig { dim: 2, alpha: Some(4.0), module_name: "h.".into() };
        params.add_lora(&cfg, &lora, 5)?;
        // B = 0 would leave A without gradient: give every B values.
        for (name, var) in params.iter().filter(|(n, _)| n.ends_with(lora::LORA_B)) {
            var.set(&Tensor::randn(0f32, 0.1, var.shape(), &Device::Cpu)?).map_err(|e| anyhow!("{name}: {e}"))?;
        }
        params.freeze_trunk();
        let sharded = ShardedModel::new(Arc::new(ProcessGroup::single()), &cfg, &params, DType::F32)?;
        let trainable = params.trainable();
        assert_eq!(sharded.trained_names(), &trainable.names[..]);
        assert!(trainable.names.iter().all(|n| lora::is_adapter_name(n)), "{:?}", trainable.names);

        let ids = Tensor::new(&[[1u32, 2, 3, 4], [5, 6, 7, 8]], &Device::Cpu)?;
        let targets = Tensor::new(&[[2u32, 3, 4, 5], [6, 7, 8, 9]], &Device::Cpu)?.flatten_all()?;
        let loss = sharded
            .forward_backward(&ids, &Positions::default(), None, 1.0, |w, h| w.trunk.lm_head_loss(h, &targets))?;
        let want = params.model(&cfg)?.lm_loss(&ids, &targets.reshape((2, 4))?, None)?;
        assert!((loss - want.to_scalar::<f32>()?).abs() < 1e-6, "the adapters take part in the forward");
        let store = want.backward()?;
        let grad: Vec<f32> = sharded.take_gradient_shard()?.to_vec1()?;
        assert_eq!(grad.len(), trainable.numel(), "one rank: the gradient shard is the adapters' gradient");
        for (unit, trained, piece) in sharded.trained_pieces() {
            let var = &trainable.vars[trained];
            let g: Vec<f32> = store.get(var.as_tensor()).unwrap().flatten_all()?.to_vec1()?;
            let at = unit.grad_offset.unwrap();
            let got = &grad[at + piece.in_shard.start..at + piece.in_shard.end];
            assert!(g.iter().any(|v| *v != 0.0), "{}", trainable.names[trained]);
            for (a, b) in got.iter().zip(&g[piece.in_param]) {
                assert!((a - b).abs() <= 1e-5 * (1.0 + b.abs()), "{}: {a} vs {b}", trainable.names[trained]);
            }
        }
        let held: usize = sharded.held_ranges().iter().map(|r| r.len()).sum();
        assert_eq!(held, trainable.numel(), "optimizer state for the adapters only");
        // The gathered model keeps the layout: its trainable part and its merge are the original's.
        let gathered = sharded.gather_params()?.expect("rank 0 of one");
        assert_eq!(gathered.trainable().names, trainable.names);
        for ((name, a), (_, b)) in gathered.merged()?.iter().zip(params.merged()?.iter()) {
            assert_eq!(a.flatten_all()?.to_vec1::<f32>()?, b.flatten_all()?.to_vec1::<f32>()?, "{name}");
        }
        Ok(())
    }

    /// A small GPT-2 with LoRA adapters on every block's linears, their B not zero (so that
    /// fusing them changes the weights).
    fn small_lora_gpt2(device: &Device) -> Result<(Gpt2Config, ParamStore)> {
        let cfg = Gpt2Config { n_layer: 2, n_embd: 8, n_head: 2, n_positions: 8, vocab_size: 16, ..Gpt2Config::tiny() };
        let mut params = ParamStore::init(&cfg, 3, device)?;
        let lora = lora::LoraConfig { dim: 2, alpha: Some(4.0), module_name: "h.".into() };
        params.add_lora(&cfg, &lora, 5)?;
        for (i, (name, var)) in params.iter().filter(|(n, _)| n.ends_with(lora::LORA_B)).enumerate() {
            let values: Vec<f32> = (0..var.elem_count()).map(|k| ((k * 7 + i * 3) % 11) as f32 / 50.0 - 0.1).collect();
            var.set(&Tensor::from_vec(values, var.shape(), device)?).map_err(|e| anyhow!("{name}: {e}"))?;
        }
        Ok((cfg, params))
    }

    /// Three AdamW steps of [`small_lora_gpt2`] (trunk and adapters trained) at stage 3 in
    /// `dtype` over `group`, its shard on `device` and kept in host memory or, with
    /// `on_device`, as a tensor there; then every way it is gathered: the weights in bf16 for a
    /// rollout and LoRA-fused, in fp32 for a save (whole, trained, merged), the consolidated
    /// moments, and a frozen model's forward from a shard kept in its compute dtype. Returns
    /// the losses, the shard and all those values, in order.
    fn train_and_gather(
        group: Arc<ProcessGroup>,
        device: &Device,
        on_device: bool,
        dtype: DType,
    ) -> Result<Vec<Vec<f32>>> {
        use crate::training::optim::AdamWConfig;
        let (cfg, params) = small_lora_gpt2(device)?;
        let ids = Tensor::new(&[[1u32, 2, 3, 4], [5, 6, 7, 8]], device)?;
        let targets = Tensor::new(&[[2u32, 3, 4, 5], [6, 7, 8, 9]], device)?.flatten_all()?;
        let flat = |t: &Tensor| -> Result<Vec<f32>> { Ok(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?) };
        let stores = |store: &ParamStore| -> Result<Vec<Vec<f32>>> { store.vars.iter().map(|v| flat(v)).collect() };

        let mut model = ShardedModel::new(group.clone(), &cfg, &params, dtype)?;
        if on_device {
            model = model.with_shard_on_device(DType::F32)?;
            assert_eq!(model.shard_place(), "the GPU");
        }
        let mut optimizer = model.optimizer(AdamWConfig { weight_decay: 0.1, ..AdamWConfig::default() });
        let mut out = vec![];
        for _ in 0..3 {
            // Each rank's share of the mean over ranks (the reduce-scatter sums).
            let share = 1.0 / group.world() as f64;
            let loss = model
                .forward_backward(&ids, &Positions::default(), None, share, |w, h| w.trunk.lm_head_loss(h, &targets))?;
            let grad = model.take_gradient_shard()?;
            model.adamw_step(&mut optimizer, &grad, 1e-2)?;
            out.push(vec![loss]);
        }
        out.push(model.shard_values()?);
        out.extend(stores(&model.gather_params_everywhere(DType::BF16)?)?);
        out.extend(stores(&model.gather_fused_everywhere(DType::BF16)?)?);
        out.extend(model.gather_params()?.map(|s| stores(&s)).transpose()?.unwrap_or_default());
        out.extend(model.gather_trained()?.map(|s| stores(&s)).transpose()?.unwrap_or_default());
        model.visit_gathered_merged(None, |_, t| {
            out.push(flat(t)?);
            Ok(())
        })?;
        let consolidated = model.consolidate(&optimizer)?;
        assert_eq!(consolidated.is_some(), group.is_first(), "the moments consolidate on rank 0 alone");
        if let Some(saved) = consolidated {
            for i in 0..model.trained_names().len() {
                let (m, v) = saved.held_moments(i)?;
                if group.world() == 1 {
                    // One rank holds them all: the consolidated moments are its own, in order.
                    assert_eq!((&m, &v), (&optimizer.held_moments(i)?.0, &optimizer.held_moments(i)?.1));
                }
                out.extend([m.to_vec(), v.to_vec()]);
            }
        }
        let frozen = ShardedModel::new(group, &cfg, &params, dtype)?.freeze();
        let frozen = if on_device { frozen.with_shard_on_device(DType::BF16)? } else { frozen };
        out.push(flat(&frozen.forward_blocks(&ids, &Positions::default())?)?);
        Ok(out)
    }

    /// A shard kept as a tensor where the model computes (a GPU's: DeepSpeed's default) trains,
    /// gathers and saves as the host shard does, bit for bit, on 3 ranks. The tensor here is on
    /// the CPU, which runs every path a GPU's takes but NCCL itself: the gathers of a tensor
    /// (weights in bf16 for the forward and as variables for the backward), the AdamW step in
    /// place with the moments beside the shard, and everything [`train_and_gather`] gathers.
    #[test]
    fn a_shard_on_the_device_is_the_host_shard_bit_for_bit() -> Result<()> {
        for outcome in crate::comm::on_groups(3, |group| {
            let group = Arc::new(group);
            let host = train_and_gather(group.clone(), &Device::Cpu, false, DType::BF16)?;
            let device = train_and_gather(group.clone(), &Device::Cpu, true, DType::BF16)?;
            assert!(host[0] != host[2], "the steps train");
            assert_eq!(host, device, "rank {}", group.rank());
            Ok(())
        }) {
            outcome?;
        }
        Ok(())
    }

    /// Two and four ranks train, gather and consolidate as one rank does, bit for bit, in fp32
    /// and bf16: the losses, every gathered weight (bf16 for a rollout, LoRA-fused, fp32 for a
    /// save, trained only, merged), the consolidated moments and a frozen model's forward
    /// (all [`train_and_gather`] returns but the rank's own shard). Every rank computes the same
    /// micro-batch at a power-of-two share, so the sums over ranks are exact. The other ranks
    /// hold what is gathered everywhere, not what rank 0 saves.
    #[test]
    fn ranks_train_and_gather_as_one_rank_bit_for_bit() -> Result<()> {
        for dtype in [DType::F32, DType::BF16] {
            let one = train_and_gather(Arc::new(ProcessGroup::single()), &Device::Cpu, false, dtype)?;
            for world in [2, 4] {
                for outcome in crate::comm::on_groups(world, |group| {
                    let group = Arc::new(group);
                    let many = train_and_gather(group.clone(), &Device::Cpu, false, dtype)?;
                    let at = format!("{dtype:?} on {world} ranks, rank {}", group.rank());
                    assert!(many[3].len() < one[3].len(), "{at}: a rank holds a part of the shard");
                    if group.is_first() {
                        let without_shard = |v: &[Vec<f32>]| -> Vec<Vec<f32>> { [&v[..3], &v[4..]].concat() };
                        assert_eq!(without_shard(&many), without_shard(&one), "{at}");
                    } else {
                        // The losses, the gathers everywhere (bf16, then LoRA-fused), the frozen forward.
                        let everywhere = 4..many.len() - 1;
                        assert!(everywhere.len() > 8, "the gathers everywhere are compared");
                        for k in (0..3).chain(everywhere) {
                            assert_eq!(many[k], one[k], "{at}: value set {k}");
                        }
                        assert_eq!(many.last(), one.last(), "{at}: the frozen forward");
                    }
                    Ok(())
                }) {
                    outcome?;
                }
            }
        }
        Ok(())
    }

    /// On 2 ranks (shards cut parameters): shard-shaped values read by ranges are the shard;
    /// visiting gathered values gives rank 0 every parameter whole (merged: adapters fused)
    /// and the other ranks nothing; values of another length, or a read of another length,
    /// are refused; a visit that fails stops visiting, its error returned after the gathers.
    #[test]
    fn shard_shaped_values_are_read_visited_and_refused_on_two_ranks() -> Result<()> {
        use std::collections::BTreeMap;
        let (cfg, whole) = small_lora_gpt2(&Device::Cpu)?;
        let merged = whole.merged()?;
        let values = |store: &ParamStore| -> Result<Vec<Vec<f32>>> {
            store.vars.iter().map(|v| Ok(v.flatten_all()?.to_vec1::<f32>()?)).collect()
        };
        let (whole_values, merged_values) = (values(&whole)?, values(&merged)?);
        for outcome in crate::comm::on_groups(2, |group| {
            let model = ShardedModel::new(Arc::new(group), &cfg, &whole, DType::BF16)?;
            let read = |name: &str, range: Range<usize>| -> Result<Vec<f32>> {
                Ok(whole_values[whole.names.iter().position(|n| n == name).unwrap()][range].to_vec())
            };
            let shard = model.shard_values()?;
            assert_eq!(model.read_shard_values(read)?, shard, "read by ranges, the shard");
            let err = model.read_shard_values(|name, range| Ok(read(name, range)?[1..].to_vec())).unwrap_err();
            assert!(err.to_string().contains("values read for the"), "{err}");

            let mut visited = vec![];
            model.visit_gathered(&shard, |name, t| {
                visited.push((name.to_string(), t.flatten_all()?.to_vec1::<f32>()?));
                Ok(())
            })?;
            let mut merged_visits = vec![];
            model.visit_gathered_merged(Some(&shard), |name, t| {
                merged_visits.push((name.to_string(), t.flatten_all()?.to_vec1::<f32>()?));
                Ok(())
            })?;
            if model.group().is_first() {
                // In the units' order (the outer unit first): compared by name, each once.
                let by_name = |v: &[(String, Vec<f32>)]| v.iter().cloned().collect::<BTreeMap<_, _>>();
                let (got, merged_got) = (by_name(&visited), by_name(&merged_visits));
                assert_eq!((got.len(), merged_got.len()), (visited.len(), merged_visits.len()), "each once");
                assert!(got == whole.names.iter().cloned().zip(whole_values.clone()).collect(), "the whole model");
                let want: BTreeMap<_, _> = merged.names.iter().cloned().zip(merged_values.clone()).collect();
                assert!(merged_got == want, "the merged model");
            } else {
                assert!(visited.is_empty() && merged_visits.is_empty(), "only rank 0 visits");
            }
            for err in [
                model.visit_gathered(&shard[1..], |_, _| Ok(())).unwrap_err(),
                model.visit_gathered_merged(Some(&shard[1..]), |_, _| Ok(())).unwrap_err(),
            ] {
                assert!(err.to_string().contains("values to gather, the shard holds"), "{err}");
            }
            let mut calls = 0;
            let outcome = model.visit_gathered_merged(None, |_, _| {
                calls += 1;
                bail!("disk full")
            });
            if model.group().is_first() {
                assert_eq!((calls, outcome.unwrap_err().to_string()), (1, "disk full".to_string()));
            } else {
                assert_eq!(calls, 0);
                outcome?;
            }
            assert!(model.has_lora() && model.fuses_lora_on_shards(), "bf16 adapters fuse on the shards");
            Ok(())
        }) {
            outcome?;
        }
        let single = Arc::new(ProcessGroup::single());
        let plain = ParamStore::init(&cfg, 3, &Device::Cpu)?;
        let without = ShardedModel::new(single.clone(), &cfg, &plain, DType::BF16)?;
        assert!(!without.has_lora() && !without.fuses_lora_on_shards());
        let in_fp32 = ShardedModel::new(single, &cfg, &whole, DType::F32)?;
        assert!(in_fp32.has_lora() && !in_fp32.fuses_lora_on_shards(), "fp32 adapters are fused whole");
        Ok(())
    }

    /// The weights a rollout generates with, LoRA fused on the shards and gathered, are the
    /// whole model's `merged()` bit for bit on 2, 3 and 5 ranks, where shards cut adapters
    /// (each rank sums the adapters from every rank's pieces).
    #[test]
    fn adapters_fused_on_shards_cut_through_them_are_the_merged_model() -> Result<()> {
        let (cfg, whole) = small_lora_gpt2(&Device::Cpu)?;
        let merged = whole.merged()?;
        let mut cut = false;
        for world in [2, 3, 5] {
            for outcome in crate::comm::on_groups(world, |group| {
                let model = ShardedModel::new(Arc::new(group), &cfg, &whole, DType::BF16)?;
                let fused = model.gather_fused_everywhere(DType::F32)?;
                assert_eq!(fused.names, merged.names);
                for ((name, a), b) in fused.iter().zip(&merged.vars) {
                    assert_eq!(a.flatten_all()?.to_vec1::<f32>()?, b.flatten_all()?.to_vec1::<f32>()?, "{name}");
                }
                // Whether this rank's shard begins inside an adapter.
                let rank = model.group().rank();
                Ok(model.units.iter().any(|unit| {
                    unit.partition.pieces(rank).iter().any(|piece| {
                        lora::is_adapter_name(&model.names[unit.params[piece.param]]) && piece.in_param.start > 0
                    })
                }))
            }) {
                cut |= outcome?;
            }
        }
        assert!(cut, "some shard begins inside an adapter");
        Ok(())
    }

    /// On a GPU, the shard kept there (stepped by the in-place AdamW kernels) trains as the shard
    /// kept in host memory (stepped on the CPU): the same losses, weights and moments to
    /// rounding.
    #[cfg(feature = "cuda")]
    #[test]
    #[ignore = "needs a GPU: scripts/gpu-check.sh runs it (cargo test --features cuda -- --include-ignored)"]
    fn a_shard_on_the_gpu_trains_as_the_host_shard() -> Result<()> {
        let gpu = crate::kernels::ops::test_support::gpu();
        let group = Arc::new(ProcessGroup::single());
        let host = train_and_gather(group.clone(), &gpu, false, DType::BF16)?;
        let device = train_and_gather(group, &gpu, true, DType::BF16)?;
        assert_eq!(host.len(), device.len());
        for (k, (a, b)) in host.iter().zip(&device).enumerate() {
            assert_eq!(a.len(), b.len(), "value set {k}");
            for (x, y) in a.iter().zip(b) {
                // bf16 gathers may round a last-bit difference of the masters another way.
                assert!((x - y).abs() <= 1e-5 + 1e-2 * x.abs().max(y.abs()), "value set {k}: {x} vs {y}");
            }
        }
        Ok(())
    }
}
