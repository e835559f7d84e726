//! Data parallelism with DeepSpeed's ZeRO stages, over the trainable parameters of one model.
//!
//! Every rank holds the whole model (one candle `Var` per parameter: candle's backward of
//! `narrow` would allocate the full source for every slice, so the parameters are never views of
//! one flat buffer). For communication the parameters are laid end to end in a fixed order, a
//! flat index space padded to a multiple of the world size, and cut into one equal shard per
//! rank ([`Partition`]); a shard maps back to at most one contiguous piece of each parameter.
//!
//! - stage 0 (DDP): gradients are all-reduced in buckets of `reduce_bucket_size` values and
//!   averaged; every rank then takes the same AdamW step.
//! - stage 1: gradients are reduce-scattered at the accumulation boundary; each rank keeps the
//!   Adam moments of its shard only, updates its shard of the weights and all-gathers them.
//!   Under mixed precision each rank keeps only its shard of the fp32 masters too, as
//!   DeepSpeed's stage 1 does: the whole model is the fp16/bf16 compute copy, into which the
//!   updated shards are all-gathered in that dtype (half the bytes of fp32).
//! - stage 2: as stage 1, but every micro-batch's gradient is reduced into a shard-sized
//!   accumulator, in buckets of `reduce_bucket_size` values as backward completes them
//!   ([`GradientBuckets`], on CPU ranks and GPUs alike), so no rank holds a full gradient.
//!
//! Stage 3 (the parameters sharded at rest too) is in [`crate::training::zero3`].
//!
//! The global gradient norm is the square root of the all-reduced squared norms of the shards,
//! so clipping and the fp16 overflow decision (a non-finite norm) are the same on every rank.

use crate::comm::{ProcessGroup, ReduceOp, WireDtype};
use crate::model::params::ParamStore;
use crate::tensor_parallel::shard::Split;
use crate::training::optim::AdamW;
use anyhow::{bail, Result};
use candle_core::{DType, Device, Tensor};
use std::collections::HashMap;
use std::ops::Range;
use std::sync::Arc;

/// DeepSpeed's default `reduce_bucket_size` (values, not bytes).
pub const DEFAULT_BUCKET: usize = 500_000_000;

/// DeepSpeed's ZeRO stages: what each rank of the data-parallel group keeps only its shard of.
/// Each stage shards what the one before it does, and more.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ZeroStage {
    /// Stage 0 (DDP): nothing; gradients all-reduced, every rank updates the whole model.
    Disabled,
    /// Stage 1: the optimizer states (AdamW's moments and the fp32 masters it updates).
    OptimizerStates,
    /// Stage 2: the gradients too, reduce-scattered every micro-batch.
    Gradients,
    /// Stage 3: the parameters too, each block's gathered when it runs.
    Parameters,
}

impl ZeroStage {
    /// The stage numbered as DeepSpeed numbers it (`--zero-stage`, `zero_optimization.stage`).
    pub fn from_number(stage: u8) -> Result<Self> {
        Ok(match stage {
            0 => Self::Disabled,
            1 => Self::OptimizerStates,
            2 => Self::Gradients,
            3 => Self::Parameters,
            _ => bail!("--zero-stage {stage} does not exist: DeepSpeed's stages are 0, 1, 2 and 3"),
        })
    }

    pub fn number(self) -> u8 {
        self as u8
    }

    /// Whether the updated weights are all-gathered after each step (stages 1 and 2, in
    /// rounds of `--allgather-bucket-size`); stage 0 has every weight already, stage 3 gathers
    /// each block when it runs.
    pub fn gathers_after_the_step(self) -> bool {
        matches!(self, Self::OptimizerStates | Self::Gradients)
    }

    /// [`Self::gathers_after_the_step`] of a stage number (none for one that does not exist).
    pub fn number_gathers_after_the_step(stage: u64) -> bool {
        u8::try_from(stage).ok().and_then(|s| Self::from_number(s).ok()).is_some_and(Self::gathers_after_the_step)
    }
}

impl std::fmt::Display for ZeroStage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.number())
    }
}

/// How a model's training is spread over the ranks of a group.
#[derive(Clone)]
pub struct DataParallel {
    pub group: Arc<ProcessGroup>,
    pub stage: ZeroStage,
    /// Values per all-reduce in stage 0 (DeepSpeed's `reduce_bucket_size`).
    pub bucket: usize,
    /// Values per round of stages 1 and 2's all-gather of the updated weights (DeepSpeed's
    /// `allgather_bucket_size`).
    pub gather_bucket: usize,
    /// The type gradients travel in through their reductions.
    pub wire: WireDtype,
    /// `--offload` (DeepSpeed's `offload_optimizer: cpu`): on a GPU, stages 1 and 2 keep this
    /// rank's optimizer states (its shard of the fp32 masters, its Adam moments) in host memory
    /// and step them there, where by default they live and step on the GPU.
    pub offload: bool,
}

impl DataParallel {
    pub fn new(group: Arc<ProcessGroup>, stage: ZeroStage, bucket: usize) -> Self {
        Self {
            group,
            stage,
            bucket: bucket.max(1),
            gather_bucket: DEFAULT_BUCKET,
            wire: WireDtype::F32,
            offload: false,
        }
    }

    /// The optimizer states in host memory on a GPU (`--offload`).
    pub fn with_offload(mut self, offload: bool) -> Self {
        self.offload = offload;
        self
    }

    /// Whether stages 1 and 2 step this rank's shard where the weights on `device` are: on a
    /// GPU unless `--offload` (a CPU run's states are in host memory either way).
    pub fn steps_on_device(&self, device: &Device) -> bool {
        device.is_cuda() && !self.offload
    }

    /// The updated weights all-gathered in rounds of `values` (`--allgather-bucket-size`).
    pub fn with_gather_bucket(mut self, values: usize) -> Self {
        self.gather_bucket = values.max(1);
        self
    }

    /// Gradients reduced as `wire` values (`--communication-data-type`).
    pub fn with_wire(mut self, wire: WireDtype) -> Self {
        self.wire = wire;
        self
    }

    pub fn world(&self) -> usize {
        self.group.world()
    }

    /// Whether the parameters themselves are sharded at rest (stage 3 with more than one rank):
    /// the model is a [`crate::training::zero3::ShardedModel`] trained by `Trainer::sharded`.
    pub fn shards_parameters(&self) -> bool {
        self.stage == ZeroStage::Parameters && self.world() > 1
    }

    /// Whether the optimizer state is sharded (stages 1 and 2 with more than one rank).
    pub fn shards_optimizer(&self) -> bool {
        self.stage >= ZeroStage::OptimizerStates && self.world() > 1
    }
}

/// One parameter's piece of a shard.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Piece {
    pub param: usize,
    /// The piece's values within the flattened parameter.
    pub in_param: Range<usize>,
    /// Where they sit within the shard.
    pub in_shard: Range<usize>,
}

/// The flat index space over the parameters (in store order) and its equal shards.
#[derive(Clone, Debug)]
pub struct Partition {
    offsets: Vec<usize>,
    /// Each parameter's number of values.
    pub sizes: Vec<usize>,
    pub world: usize,
    /// Values per shard: `ceil(total / world)`; the last shard ends in padding.
    pub shard_len: usize,
}

impl Partition {
    pub fn new(sizes: Vec<usize>, world: usize) -> Self {
        let mut offsets = Vec::with_capacity(sizes.len());
        let mut total = 0;
        for s in &sizes {
            offsets.push(total);
            total += s;
        }
        Self { offsets, sizes, world, shard_len: total.div_ceil(world).max(1) }
    }

    pub fn of(params: &ParamStore, world: usize) -> Self {
        Self::new(params.vars.iter().map(|v| v.elem_count()).collect(), world)
    }

    pub fn total(&self) -> usize {
        self.offsets.last().map_or(0, |o| o + self.sizes.last().unwrap())
    }

    /// The flat length with padding: `shard_len * world`.
    pub fn padded(&self) -> usize {
        self.shard_len * self.world
    }

    /// Rank `r`'s shard in the flat space.
    pub fn shard(&self, r: usize) -> Range<usize> {
        r * self.shard_len..(r + 1) * self.shard_len
    }

    /// The parameter pieces of rank `r`'s shard, in order.
    pub fn pieces(&self, r: usize) -> Vec<Piece> {
        let shard = self.shard(r);
        let mut out = Vec::new();
        for (i, (&off, &size)) in self.offsets.iter().zip(&self.sizes).enumerate() {
            let (lo, hi) = (off.max(shard.start), (off + size).min(shard.end));
            if lo < hi {
                out.push(Piece {
                    param: i,
                    in_param: lo - off..hi - off,
                    in_shard: lo - shard.start..hi - shard.start,
                });
            }
        }
        out
    }

    /// The range of each parameter held in rank `r`'s shard (empty where none).
    pub fn ranges(&self, r: usize) -> Vec<Range<usize>> {
        let mut ranges = vec![0..0; self.sizes.len()];
        for p in self.pieces(r) {
            ranges[p.param] = p.in_param;
        }
        ranges
    }

    /// The tensors laid end to end and padded with zeros to [`Self::padded`] values (f32).
    pub fn flatten(&self, tensors: &[Tensor]) -> Result<Tensor> {
        crate::comm::concat_padded(tensors, self.padded())
    }

    /// Cuts a flat tensor back into tensors of `shapes` (the inverse of [`Self::flatten`]).
    pub fn unflatten(&self, flat: &Tensor, shapes: &[&candle_core::Shape]) -> Result<Vec<Tensor>> {
        self.offsets
            .iter()
            .zip(&self.sizes)
            .zip(shapes)
            .map(|((&o, &n), s)| Ok(flat.narrow(0, o, n)?.reshape(*s)?))
            .collect()
    }
}

/// Stage 0: the mean over ranks of each gradient, all-reduced in buckets of about
/// `dp.bucket` values (a bucket holds whole parameters; one larger than a bucket goes alone).
/// The gradients are taken: on the CPU each is freed once copied into its bucket's ring buffer,
/// and the means come back as views of the reduced buckets.
pub fn all_reduce_gradients(dp: &DataParallel, grads: Vec<Tensor>) -> Result<Vec<Tensor>> {
    let world = dp.world();
    if world == 1 {
        return Ok(grads);
    }
    let shapes: Vec<candle_core::Shape> = grads.iter().map(|g| g.shape().clone()).collect();
    let sizes: Vec<usize> = shapes.iter().map(|s| s.elem_count()).collect();
    let mut grads = grads.into_iter();
    let mut out = Vec::with_capacity(shapes.len());
    for bucket in all_reduce_buckets(&sizes, dp.bucket) {
        let parts: Vec<Tensor> = grads.by_ref().take(bucket.len()).collect();
        let summed = dp.group.all_reduce_mean_parts_as(parts, dp.wire)?;
        let mut offset = 0;
        for shape in &shapes[bucket] {
            let n = shape.elem_count();
            out.push(summed.narrow(0, offset, n)?.reshape(shape)?);
            offset += n;
        }
    }
    Ok(out)
}

/// Stage 0's buckets: runs of consecutive parameters (of `sizes` values) of at most `bucket`
/// values together, a parameter larger than a bucket alone in its own.
fn all_reduce_buckets(sizes: &[usize], bucket: usize) -> Vec<Range<usize>> {
    let mut buckets = Vec::new();
    let mut start = 0;
    while start < sizes.len() {
        let mut end = start + 1;
        let mut values = sizes[start];
        while end < sizes.len() && values + sizes[end] <= bucket {
            values += sizes[end];
            end += 1;
        }
        buckets.push(start..end);
        start = end;
    }
    buckets
}

/// Stages 1 and 2: this rank's shard of the summed gradients (not yet averaged), reduce-scattered
/// in rounds of `--reduce-bucket-size` values (DeepSpeed's `reduce_bucket_size`; one round at its
/// default): the collective's buffer is a round, the same sums in the same bytes. The gradients
/// are taken.
pub fn reduce_scatter_gradients(dp: &DataParallel, partition: &Partition, grads: Vec<Tensor>) -> Result<Tensor> {
    dp.group.begin_reduce_scatter_parts_in_rounds_as(grads, partition.padded(), dp.bucket, dp.wire)?.ready()
}

/// ZeRO stage 2's gradient reduction during backward, in buckets of about `reduce_bucket_size`
/// values (DeepSpeed's): a gradient is handed on as soon as backward has completed it and its
/// bucket, and each bucket is reduce-scattered at once into this rank's shard of the sums, so a
/// rank never holds the whole gradient of a micro-batch, only its shard, the part of backward
/// running, and a bucket filling. The buckets follow the order backward completes the
/// parameters (the last block first, the embeddings, final LayerNorm and heads at the end:
/// wte's gradient from the LM head waits for its embedding's) and are the same on every rank,
/// whatever the pattern a rank's gradients arrive in (a rank without rows adds them all at
/// once). A parameter larger than a bucket is reduced in bucket-sized stretches (where
/// DeepSpeed reduces it from its own gradient), so the collective's buffer never exceeds a
/// bucket. Each bucket's values fall unevenly into the ranks' shards of the flat layout
/// ([`Partition`]): its reduce-scatter's chunks are those pieces, so each value has the owner
/// and the ring order of the one-call reduce-scatter, and the sums are the same bits.
///
/// Gradients in host memory take the ring's path straight from their memory. Gradients on a
/// GPU stay there: a bucket is their pieces copied into one buffer in rank order (in the wire's
/// dtype), reduced to each piece's owner (over NCCL a reduce per rank's chunk, as DeepSpeed's
/// stage 2 reduces a bucket, on the communicator's stream: the next block's backward computes
/// meanwhile) and added into this rank's shard on the GPU when the next bucket begins, so a
/// rank holds its shard, one bucket in flight and the part of backward running.
pub struct GradientBuckets {
    dp: DataParallel,
    partition: Partition,
    /// The stretches of parameters each bucket reduces, in the flat layout's order; buckets in
    /// backward's order.
    buckets: Vec<Vec<Stretch>>,
    /// Per bucket: it holds a parameter outside the blocks, complete only when backward ends.
    waits_for_the_end: Vec<bool>,
    /// The next bucket to reduce in this micro-batch.
    next: usize,
    /// This rank's shard of the reduced gradients since the last step.
    reduced: Option<Reduced>,
    /// Where the trained parameters (and the shard handed to the step) are.
    device: Device,
    /// The gradients are reduced from host memory, not as tensors on their device.
    on_host: bool,
    /// The bucket whose reduce was begun last and is not yet added to the shard.
    in_flight: Option<(usize, crate::comm::Pending)>,
}

/// [`GradientBuckets`]' shard of the reduced gradients: in host memory, or on the device.
enum Reduced {
    Host(Vec<f32>),
    Device(Tensor),
}

/// Values `values` of parameter `param`'s (flattened) gradient: a bucket's share of it.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Stretch {
    param: usize,
    values: Range<usize>,
}

impl GradientBuckets {
    /// Buckets over the trained parameters `names` (the partition's, in its order), which live
    /// on `device`.
    pub fn new(dp: DataParallel, partition: Partition, names: &[String], device: &Device) -> Self {
        let block = |name: &str| -> Option<usize> { name.strip_prefix("h.")?.split('.').next()?.parse().ok() };
        // Backward's order: the blocks from the last, then everything else.
        let mut order: Vec<usize> = (0..names.len()).collect();
        order.sort_by_key(|&i| match block(&names[i]) {
            Some(b) => (0, std::cmp::Reverse(b), i),
            None => (1, std::cmp::Reverse(0), i),
        });
        // Greedy: a parameter joins the open bucket if it fits, else opens the next; one larger
        // than a bucket is cut into buckets of its own.
        let mut buckets: Vec<Vec<Stretch>> = Vec::new();
        let mut open: (Vec<Stretch>, usize) = (Vec::new(), 0);
        for &i in &order {
            let size = partition.sizes[i];
            if !open.0.is_empty() && open.1 + size > dp.bucket {
                buckets.push(std::mem::take(&mut open.0));
                open.1 = 0;
            }
            if size > dp.bucket {
                buckets.extend(
                    (0..size)
                        .step_by(dp.bucket)
                        .map(|at| vec![Stretch { param: i, values: at..(at + dp.bucket).min(size) }]),
                );
            } else {
                open.0.push(Stretch { param: i, values: 0..size });
                open.1 += size;
            }
        }
        if !open.0.is_empty() {
            buckets.push(open.0);
        }
        for bucket in &mut buckets {
            bucket.sort_unstable_by_key(|s| s.param);
        }
        let waits_for_the_end =
            buckets.iter().map(|bucket| bucket.iter().any(|s| block(&names[s.param]).is_none())).collect();
        let (device, on_host) = (device.clone(), device.is_cpu());
        Self { dp, partition, buckets, waits_for_the_end, next: 0, reduced: None, device, on_host, in_flight: None }
    }

    /// Reduces as tensors even in host memory: the GPU's path, on CPU ranks (tests).
    #[cfg(test)]
    fn reducing_as_tensors(mut self) -> Self {
        self.on_host = false;
        self
    }

    /// Bucket `b`'s values that fall in rank `r`'s shard, in the flat order: (parameter, its
    /// values, where they sit in the shard).
    fn in_shard_of(&self, b: usize, r: usize) -> Vec<(usize, Range<usize>, Range<usize>)> {
        let mut out = Vec::new();
        for piece in self.partition.pieces(r) {
            for stretch in self.buckets[b].iter().filter(|s| s.param == piece.param) {
                let (lo, hi) =
                    (piece.in_param.start.max(stretch.values.start), piece.in_param.end.min(stretch.values.end));
                if lo < hi {
                    let at = piece.in_shard.start + lo - piece.in_param.start;
                    out.push((piece.param, lo..hi, at..at + hi - lo));
                }
            }
        }
        out
    }

    /// Reduce-scatters bucket `b`'s gradients into this rank's shard; a gradient is taken out
    /// of `grads` with its last stretch.
    fn reduce(&mut self, b: usize, grads: &mut [Option<Tensor>]) -> Result<()> {
        match self.on_host {
            true => self.reduce_on_host(b, grads),
            false => self.begin_as_tensors(b, grads),
        }
    }

    /// The gradients whose last stretch bucket `b` holds, dropped from `grads`.
    fn drop_finished(&self, b: usize, grads: &mut [Option<Tensor>]) {
        for stretch in &self.buckets[b] {
            if stretch.values.end == self.partition.sizes[stretch.param] {
                grads[stretch.param] = None;
            }
        }
    }

    /// [`Self::reduce`] of gradients on a device: the bucket in one buffer of the wire's dtype,
    /// rank r's chunk its values in r's shard, its reduce begun once the one before it is added
    /// to the shard.
    fn begin_as_tensors(&mut self, b: usize, grads: &mut [Option<Tensor>]) -> Result<()> {
        self.add_in_flight()?;
        let wire = self.dp.wire.dtype();
        let mut pieces = Vec::new();
        let mut chunks = Vec::with_capacity(self.dp.world());
        let mut len = 0;
        for r in 0..self.dp.world() {
            let start = len;
            for (param, values, _) in self.in_shard_of(b, r) {
                let grad = grads[param]
                    .as_ref()
                    .ok_or_else(|| anyhow::anyhow!("internal error: parameter {param} received no gradient"))?;
                pieces.push(grad.flatten_all()?.narrow(0, values.start, values.len())?.to_dtype(wire)?);
                len += values.len();
            }
            chunks.push(start..len);
        }
        let bucket = Tensor::cat(&pieces, 0)?;
        drop(pieces);
        self.drop_finished(b, grads);
        self.in_flight = Some((b, self.dp.group.begin_reduce_chunks_as(&bucket, &chunks, self.dp.wire)?));
        Ok(())
    }

    /// Adds the bucket in flight, if any, to this rank's shard on the device.
    fn add_in_flight(&mut self) -> Result<()> {
        let Some((b, pending)) = self.in_flight.take() else { return Ok(()) };
        let pieces = self.in_shard_of(b, self.dp.group.rank());
        if pieces.is_empty() {
            pending.wait();
            return Ok(());
        }
        let mine = pending.ready()?;
        let reduced = match self.reduced.take() {
            Some(Reduced::Device(t)) => t,
            Some(Reduced::Host(_)) => bail!("internal error: gradient buckets reduced on the host and as tensors"),
            None => Tensor::zeros(self.partition.shard_len, DType::F32, mine.device())?,
        };
        let mut at = 0;
        for (_, _, in_shard) in pieces {
            let n = in_shard.len();
            let sum = (reduced.narrow(0, in_shard.start, n)? + mine.narrow(0, at, n)?)?;
            reduced.slice_set(&sum, 0, in_shard.start)?;
            at += n;
        }
        self.reduced = Some(Reduced::Device(reduced));
        Ok(())
    }

    /// [`Self::reduce`] from host memory: each gradient read in place as f32, rank r's chunk
    /// copied into the ring's buffer, the ring's uneven reduce-scatter, this rank's sums added.
    fn reduce_on_host(&mut self, b: usize, grads: &mut [Option<Tensor>]) -> Result<()> {
        let missing = |i: usize| anyhow::anyhow!("internal error: parameter {i} received no gradient");
        // Each gradient as contiguous host f32 (as backward made it in fp32; a half-precision
        // one converted once, not per stretch), to be read in place.
        for stretch in &self.buckets[b] {
            let g = grads[stretch.param].take().ok_or_else(|| missing(stretch.param))?;
            let host_f32 = g.device().is_cpu() && g.dtype() == DType::F32 && g.is_contiguous();
            grads[stretch.param] =
                Some(if host_f32 { g } else { g.to_device(&Device::Cpu)?.to_dtype(DType::F32)?.contiguous()? });
        }
        // Rank r's chunk: the bucket's values in r's shard, in the flat order.
        let world = self.dp.world();
        let mut buf = Vec::with_capacity(self.buckets[b].iter().map(|s| s.values.len()).sum());
        let mut chunks = Vec::with_capacity(world);
        for r in 0..world {
            let start = buf.len();
            for (param, values, _) in self.in_shard_of(b, r) {
                let grad = grads[param].as_ref().ok_or_else(|| missing(param))?;
                let (storage, layout) = grad.storage_and_layout();
                let candle_core::Storage::Cpu(s) = &*storage else { bail!("internal error: a gradient left the host") };
                buf.extend_from_slice(&crate::storage::contiguous_f32(s, layout, "a gradient")?[values]);
            }
            chunks.push(start..buf.len());
        }
        self.drop_finished(b, grads);
        let mine = self.dp.group.reduce_scatter_chunks_as(&mut buf, &chunks, self.dp.wire)?;
        let rank = self.dp.group.rank();
        let mut reduced = match self.reduced.take() {
            Some(Reduced::Host(v)) => v,
            Some(Reduced::Device(_)) => bail!("internal error: gradient buckets reduced on the host and as tensors"),
            None => vec![0f32; self.partition.shard_len],
        };
        let mut at = mine.start;
        for (_, _, in_shard) in self.in_shard_of(b, rank) {
            let n = in_shard.len();
            reduced[in_shard].iter_mut().zip(&buf[at..at + n]).for_each(|(r, v)| *r += v);
            at += n;
        }
        self.reduced = Some(Reduced::Host(reduced));
        Ok(())
    }
}

impl crate::training::optim::GradientSink for GradientBuckets {
    fn take(&mut self, grads: &mut [Option<Tensor>], last: bool) -> Result<()> {
        while self.next < self.buckets.len() {
            let b = self.next;
            let complete = self.buckets[b].iter().all(|s| grads[s.param].is_some());
            if !last && (self.waits_for_the_end[b] || !complete) {
                break;
            }
            self.reduce(b, grads)?;
            self.next += 1;
        }
        if last {
            // The micro-batch's reduces all added: its shard is whole for the step or a check.
            self.add_in_flight()?;
            self.next = 0;
        }
        Ok(())
    }

    fn take_reduced(&mut self) -> Result<Tensor> {
        self.add_in_flight()?;
        let n = self.partition.shard_len;
        Ok(match self.reduced.take() {
            Some(Reduced::Device(t)) => t,
            Some(Reduced::Host(v)) => Tensor::from_vec(v, n, &Device::Cpu)?.to_device(&self.device)?,
            None => Tensor::zeros(n, DType::F32, &self.device)?,
        })
    }

    fn partial(&self) -> Result<Option<Tensor>> {
        Ok(match &self.reduced {
            Some(Reduced::Device(t)) => Some(t.clone()),
            Some(Reduced::Host(v)) => Some(Tensor::from_slice(v, v.len(), &Device::Cpu)?),
            None => None,
        })
    }

    fn buckets(&self) -> usize {
        self.buckets.len()
    }
}

/// The global L2 norm of sharded gradients: every rank's squared norm, summed over ranks.
pub fn sharded_grad_norm(group: &ProcessGroup, shard: &Tensor) -> Result<f64> {
    let mut sq = [crate::training::optim::global_grad_norm(std::slice::from_ref(shard))?.powi(2)];
    group.all_reduce_scalars(&mut sq, ReduceOp::Sum)?;
    Ok(sq[0].sqrt())
}

/// [`sharded_grad_norm`] under tensor parallelism: the shard is this data-parallel rank's piece
/// of the gradients of this TP rank's slices, cut as `splits`; squares are summed over the data-parallel
/// shards, then over the TP ranks, each replicated (whole) parameter counted once.
pub fn sharded_grad_norm_tensor_parallel(
    dp: &ProcessGroup,
    tp: &ProcessGroup,
    (splits, partition): (&[Split], &Partition),
    shard: &Tensor,
) -> Result<f64> {
    let mut sq = [0f64];
    for piece in partition.pieces(dp.rank()) {
        let values = shard.narrow(0, piece.in_shard.start, piece.in_shard.len())?;
        let s = crate::kernels::ops::sum_of_squares(&values)?;
        sq[0] += crate::tensor_parallel::shard::norm_share(splits[piece.param], s, tp.world());
    }
    dp.all_reduce_scalars(&mut sq, ReduceOp::Sum)?;
    tp.all_reduce_scalars(&mut sq, ReduceOp::Sum)?;
    Ok(sq[0].sqrt())
}

/// This rank's shard of `params`' values in the flat layout (zeros where it ends in padding).
pub fn shard_values(partition: &Partition, rank: usize, params: &ParamStore) -> Result<Vec<f32>> {
    let mut shard = vec![0f32; partition.shard_len];
    for piece in partition.pieces(rank) {
        let range = piece.in_param.clone();
        let values = params.vars[piece.param].flatten_all()?.narrow(0, range.start, range.len())?;
        shard[piece.in_shard].copy_from_slice(&values.to_dtype(DType::F32)?.to_vec1::<f32>()?);
    }
    Ok(shard)
}

/// [`shard_values`] as an f32 tensor where the parameters are: their pieces copied there, the
/// padding 0.
pub fn shard_tensor(partition: &Partition, rank: usize, params: &ParamStore) -> Result<Tensor> {
    let device = params.vars.first().map_or(Device::Cpu, |v| v.device().clone());
    let mut parts = Vec::new();
    let mut filled = 0;
    for piece in partition.pieces(rank) {
        let range = piece.in_param;
        parts.push(params.vars[piece.param].flatten_all()?.narrow(0, range.start, range.len())?.to_dtype(DType::F32)?);
        filled = piece.in_shard.end;
    }
    if filled < partition.shard_len {
        parts.push(Tensor::zeros(partition.shard_len - filled, DType::F32, &device)?);
    }
    Ok(Tensor::cat(&parts, 0)?)
}

/// Shard-shaped values as they are held: in host memory, or a tensor where they live (a GPU's
/// shard, which NCCL gathers from there with no trip through host memory); or a stretch of them.
#[derive(Clone)]
pub enum Held<'a> {
    Host(&'a [f32]),
    /// A tensor (a view for a stretch).
    Tensor(Tensor),
}

impl<'a> Held<'a> {
    /// A master shard's values where it keeps them.
    pub fn of(shard: &'a MasterShard) -> Self {
        match shard {
            MasterShard::Host(values) => Self::Host(values),
            MasterShard::Device(t) => Self::Tensor(t.clone()),
        }
    }

    /// The values in `range`.
    pub fn range(&self, range: Range<usize>) -> Result<Held<'a>> {
        Ok(match self {
            Self::Host(values) => Self::Host(&values[range]),
            Self::Tensor(t) => Self::Tensor(t.narrow(0, range.start, range.len())?),
        })
    }

    /// Every rank's values of `group`, in rank order, sent and returned as `dtype` on `device`
    /// (a tensor's own device).
    pub fn all_gather_as(&self, group: &ProcessGroup, dtype: DType, device: &Device) -> Result<Tensor> {
        match self {
            Self::Host(values) => group.all_gather_slice_as(values, dtype, device),
            Self::Tensor(t) => group.all_gather_tensor_as(t, dtype),
        }
    }
}

/// Writes the all-gathered shards of updated weights into every parameter of `params`, sent in
/// their dtype: f32 masters, or under mixed precision the compute copy, in half the bytes (as
/// DeepSpeed all-gathers its fp16 parameters after the fp32 partitions step). The gather runs in
/// rounds of at most `dp.gather_bucket` values (DeepSpeed's `allgather_bucket_size`): each rank
/// sends the same stretch of its shard and every piece that arrives is written straight into its
/// parameter, so the transient buffer is a bucket, not the whole model. Any bucket gives the
/// same weights (the values are copied, not summed).
pub fn all_gather_parameters(
    dp: &DataParallel,
    partition: &Partition,
    params: &ParamStore,
    my_shard: Held,
) -> Result<()> {
    let device = params.vars.first().map_or(Device::Cpu, |v| v.device().clone());
    let flat: Vec<Tensor> =
        params.vars.iter().map(|v| v.as_tensor().flatten_all()).collect::<candle_core::Result<_>>()?;
    let world = dp.world();
    let round = dp.gather_bucket.div_ceil(world).clamp(1, partition.shard_len.max(1));
    let pieces: Vec<Vec<Piece>> = (0..world).map(|r| partition.pieces(r)).collect();
    for start in (0..partition.shard_len).step_by(round) {
        let stretch = start..(start + round).min(partition.shard_len);
        let gathered = my_shard.range(stretch.clone())?.all_gather_as(&dp.group, params.dtype(), &device)?;
        for (r, pieces) in pieces.iter().enumerate() {
            for piece in pieces {
                let (lo, hi) = (piece.in_shard.start.max(stretch.start), piece.in_shard.end.min(stretch.end));
                if lo >= hi {
                    continue;
                }
                let src = gathered.narrow(0, r * stretch.len() + lo - stretch.start, hi - lo)?;
                let at = piece.in_param.start + lo - piece.in_shard.start;
                flat[piece.param].slice_set(&src, 0, at)?;
            }
        }
    }
    Ok(())
}

/// The whole weights generation runs on, from every rank's `shard` of fp32 masters with LoRA
/// adapters (stages 1 and 2 under mixed precision): each adapted linear's weight fused with its
/// adapter on the shard in fp32 (`W + scaling A^T B^T`, [`ParamStore::merged`]'s values bit for
/// bit: the same delta, added value by value), then all-gathered in `like`'s dtype (the compute
/// copy: its names, shapes and LoRA scaling), as stage 0 casts the fused masters. The adapters are
/// first put together whole in fp32 on every rank (each rank's pieces summed with zeros: exact;
/// they are small). Returns the fused weights without the adapters. Every rank must call it.
pub fn gather_fused_weights(
    dp: &DataParallel,
    partition: &Partition,
    like: &ParamStore,
    shard: &[f32],
) -> Result<ParamStore> {
    let Some(scaling) = like.lora_scaling() else { bail!("internal error: fusing a model without LoRA adapters") };
    let device = like.vars.first().map_or(Device::Cpu, |v| v.device().clone());
    let pieces = partition.pieces(dp.group.rank());
    // The adapters, whole: a buffer of all of them, this rank's pieces in place, summed.
    let adapters: Vec<usize> = (0..like.names.len()).filter(|&i| lora::is_adapter_name(&like.names[i])).collect();
    let mut at = HashMap::new();
    let mut len = 0;
    for &i in &adapters {
        at.insert(i, len);
        len += partition.sizes[i];
    }
    let mut mine = vec![0f32; len];
    for piece in pieces.iter().filter(|p| at.contains_key(&p.param)) {
        let start = at[&piece.param] + piece.in_param.start;
        mine[start..start + piece.in_param.len()].copy_from_slice(&shard[piece.in_shard.clone()]);
    }
    let summed = dp.group.all_reduce(&Tensor::from_vec(mine, len, &Device::Cpu)?, ReduceOp::Sum)?;
    let whole = |i: usize| -> Result<Tensor> {
        let shape = like.vars[i].shape();
        Ok(summed.narrow(0, at[&i], partition.sizes[i])?.reshape(shape)?.to_device(&device)?)
    };
    // This rank's shard with each adapted linear's values fused.
    let mut fused = shard.to_vec();
    let adapter = |name: &str| like.names.iter().position(|n| n == name).map(whole);
    for piece in &pieces {
        let values = &mut fused[piece.in_shard.clone()];
        add_lora_delta(values, &like.names[piece.param], piece.in_param.start, scaling, adapter)?;
    }
    let full = dp.group.all_gather_slice_as(&fused, like.dtype(), &device)?;
    let shapes: Vec<&candle_core::Shape> = like.vars.iter().map(|v| v.shape()).collect();
    let mut out = ParamStore::default();
    for ((name, t), i) in like.names.iter().zip(partition.unflatten(&full, &shapes)?).zip(0..) {
        if !at.contains_key(&i) {
            out.push(name, &t)?;
        }
    }
    Ok(out)
}

/// Adds to `values`, weight `name`'s values from `start` (flattened), its LoRA adapter's delta
/// (`lora::delta`, the fusion of `ParamStore::merged` in fp32), the adapter's A and B whole from
/// `adapter(name)`; nothing where `name` is no adapted weight. Sharded masters fuse so, piece by
/// piece, before gathering the fused weights (stages 1-2 here, ZeRO-3's
/// `ShardedModel::gather_fused_everywhere`).
pub fn add_lora_delta(
    values: &mut [f32],
    name: &str,
    start: usize,
    scaling: f64,
    adapter: impl Fn(&str) -> Option<Result<Tensor>>,
) -> Result<()> {
    let Some(module) = name.strip_suffix(".weight").filter(|_| !lora::is_adapter_name(name)) else { return Ok(()) };
    let (a, b) = lora::Adapter::param_names(module);
    let (Some(a), Some(b)) = (adapter(&a), adapter(&b)) else { return Ok(()) };
    let delta = lora::delta(&a?, &b?, scaling)?.flatten_all()?.narrow(0, start, values.len())?.to_vec1::<f32>()?;
    values.iter_mut().zip(delta).for_each(|(w, d)| *w += d);
    Ok(())
}

/// One AdamW step of this rank's shard of the weights, `shard` (the partition's flat layout),
/// from its gradient shard (averaged and clipped), in place.
pub fn step_shard(
    rank: usize,
    partition: &Partition,
    optimizer: &mut AdamW,
    shard: &mut [f32],
    grad_shard: &Tensor,
    lr: f64,
) -> Result<()> {
    with_host_f32(grad_shard, |g| {
        optimizer.step += 1;
        for piece in partition.pieces(rank) {
            optimizer.update_held(piece.param, &mut shard[piece.in_shard.clone()], &g[piece.in_shard], lr);
        }
        Ok(())
    })
}

/// [`step_shard`] of a shard held as an f32 tensor where it lives (the GPU's: DeepSpeed's default
/// place for the optimizer states), updated in place piece by piece with the moments beside it
/// ([`AdamW::update_held_in_place`]); the gradient shard is brought to it (nothing moves where it
/// is there already). The same values as [`step_shard`] (bit for bit on the CPU).
pub fn step_shard_in_place(
    rank: usize,
    partition: &Partition,
    optimizer: &mut AdamW,
    shard: &Tensor,
    grad_shard: &Tensor,
    lr: f64,
) -> Result<()> {
    let pieces = partition.pieces(rank).into_iter().map(|piece| {
        Ok(InPlacePiece {
            param: piece.param,
            values: shard.narrow(0, piece.in_shard.start, piece.in_shard.len())?,
            grad: piece.in_shard,
        })
    });
    step_pieces_in_place(optimizer, (grad_shard, shard.device()), lr, pieces)
}

/// [`step_shard_in_place`] where the shard is this rank's pieces of whole f32 `params` (stages 1
/// and 2 with whole masters): each piece updated in place in its parameter, the moments beside
/// it on the parameters' device.
pub fn step_shard_in_params(
    rank: usize,
    partition: &Partition,
    optimizer: &mut AdamW,
    params: &ParamStore,
    grad_shard: &Tensor,
    lr: f64,
) -> Result<()> {
    let device = params.vars.first().map_or(Device::Cpu, |v| v.device().clone());
    let pieces = partition.pieces(rank).into_iter().map(|piece| {
        // A view of the parameter's own storage: the update lands in the weights.
        let weights = params.vars[piece.param].as_tensor().flatten_all()?;
        Ok(InPlacePiece {
            param: piece.param,
            values: weights.narrow(0, piece.in_param.start, piece.in_param.len())?,
            grad: piece.in_shard,
        })
    });
    step_pieces_in_place(optimizer, (grad_shard, &device), lr, pieces)
}

/// A piece of a shard stepped where it lives.
pub struct InPlacePiece {
    /// The parameter's index in the optimizer.
    pub param: usize,
    /// The piece's values: an f32 view updated in place.
    pub values: Tensor,
    /// Where its gradient is in the gradient shard.
    pub grad: Range<usize>,
}

/// One AdamW step of each of `pieces` from its part of the gradient shard brought to `device`.
pub fn step_pieces_in_place(
    optimizer: &mut AdamW,
    (grad_shard, device): (&Tensor, &Device),
    lr: f64,
    pieces: impl Iterator<Item = Result<InPlacePiece>>,
) -> Result<()> {
    let grad = grad_shard.to_device(device)?.to_dtype(DType::F32)?.contiguous()?;
    optimizer.step += 1;
    for piece in pieces {
        let piece = piece?;
        let g = grad.narrow(0, piece.grad.start, piece.grad.len())?;
        optimizer.update_held_in_place(piece.param, &piece.values, &g, lr)?;
    }
    Ok(())
}

/// This rank's shard of the fp32 masters at ZeRO stages 1 and 2 under mixed precision, in the
/// partition's flat layout: in host memory (a CPU run; a GPU's with `--offload`), or on the GPU
/// (DeepSpeed's default), where it steps with its moments and never crosses to the host but to
/// be all-gathered or saved.
pub enum MasterShard {
    Host(Vec<f32>),
    Device(Tensor),
}

impl MasterShard {
    /// `values` kept where `dp` steps them for weights on `device`.
    pub fn new(values: Vec<f32>, dp: &DataParallel, device: &Device) -> Result<Self> {
        Ok(match dp.steps_on_device(device) {
            true => {
                let n = values.len();
                Self::Device(Tensor::from_vec(values, n, device)?)
            }
            false => Self::Host(values),
        })
    }

    /// Runs `f` on the values: in place in host memory, or a copy of the device's.
    pub fn with_values<R>(&self, f: impl FnOnce(&[f32]) -> Result<R>) -> Result<R> {
        match self {
            Self::Host(values) => f(values),
            Self::Device(t) => with_host_f32(t, f),
        }
    }

    /// One AdamW step of the shard from its gradient shard (averaged, clipped) where it lives.
    pub fn step(
        &mut self,
        rank: usize,
        partition: &Partition,
        optimizer: &mut AdamW,
        grad_shard: &Tensor,
        lr: f64,
    ) -> Result<()> {
        match self {
            Self::Host(values) => step_shard(rank, partition, optimizer, values, grad_shard, lr),
            Self::Device(t) => step_shard_in_place(rank, partition, optimizer, t, grad_shard, lr),
        }
    }

    /// The values in host memory: borrowed there, copied from the device.
    pub fn to_host(&self) -> Result<std::borrow::Cow<'_, [f32]>> {
        Ok(match self {
            Self::Host(values) => std::borrow::Cow::Borrowed(values),
            Self::Device(t) => std::borrow::Cow::Owned(t.flatten_all()?.to_dtype(DType::F32)?.to_vec1()?),
        })
    }

    /// Where the shard lives, for the log.
    pub fn place(&self) -> &'static str {
        match self {
            Self::Host(_) => "host memory",
            Self::Device(_) => "the GPU",
        }
    }
}

/// Runs `f` on `t`'s values (flattened) as f32: read in place from a contiguous f32 tensor in
/// host memory (a gradient shard at the step: no copy of it), else copied out.
pub fn with_host_f32<R>(t: &Tensor, f: impl FnOnce(&[f32]) -> Result<R>) -> Result<R> {
    let t = t.to_dtype(DType::F32)?;
    let on_host = t.device().is_cpu() && t.is_contiguous();
    let copied = if on_host { Vec::new() } else { t.flatten_all()?.to_vec1::<f32>()? };
    let (storage, layout) = t.storage_and_layout();
    match &*storage {
        candle_core::Storage::Cpu(s) if on_host => f(crate::storage::contiguous_f32(s, layout, "a tensor")?),
        _ => f(&copied),
    }
}

/// Stages 1 and 2 with whole fp32 masters: one AdamW step of this rank's shard of `params`
/// from its gradient shard, then the updated weights all-gathered into every parameter. On a
/// GPU (without `--offload`) the shard's pieces step in place in the parameters with their
/// moments on the GPU; else copied to the host, stepped and gathered from there.
pub fn sharded_adamw_step(
    dp: &DataParallel,
    partition: &Partition,
    optimizer: &mut AdamW,
    params: &ParamStore,
    grad_shard: &Tensor,
    lr: f64,
) -> Result<()> {
    let rank = dp.group.rank();
    let device = params.vars.first().map_or(Device::Cpu, |v| v.device().clone());
    if dp.steps_on_device(&device) {
        // Each piece of this rank's shard stepped in place in its parameter on the GPU, the
        // moments beside it; then gathered from there.
        step_shard_in_params(rank, partition, optimizer, params, grad_shard, lr)?;
        return all_gather_parameters(dp, partition, params, Held::Tensor(shard_tensor(partition, rank, params)?));
    }
    let mut shard = shard_values(partition, rank, params)?;
    step_shard(rank, partition, optimizer, &mut shard, grad_shard, lr)?;
    all_gather_parameters(dp, partition, params, Held::Host(&shard))
}

/// The whole fp32 weights put together from every rank's `shard` of them on the group's first
/// rank, named and shaped as `like` (every rank calls it; `None` on the others, which never hold
/// more than their shard): a save of masters kept sharded.
pub fn gather_shards_to_first(
    dp: &DataParallel,
    partition: &Partition,
    like: &ParamStore,
    shard: &[f32],
) -> Result<Option<ParamStore>> {
    let Some(all) = dp.group.gather_to_first(shard, partition.padded())? else { return Ok(None) };
    let shapes: Vec<&candle_core::Shape> = like.vars.iter().map(|v| v.shape()).collect();
    let device = like.vars.first().map_or(Device::Cpu, |v| v.device().clone());
    let mut whole = ParamStore::default();
    for (name, t) in like.names.iter().zip(partition.unflatten(&all, &shapes)?) {
        whole.push(name, &t.to_device(&device)?)?;
    }
    // `like`'s frozen flags and LoRA scaling: a save merges the adapters it holds.
    whole.set_layout(like.frozen(), like.lora_scaling())?;
    Ok(Some(whole))
}

/// A copy of a sharded optimizer with the full moments, gathered on the group's first rank
/// (every rank calls it; the others get `None` and never hold more than their shard): what a
/// checkpoint saves, so that it loads into any world size or stage.
pub fn consolidate(
    dp: &DataParallel,
    partition: &Partition,
    optimizer: &AdamW,
    params: &ParamStore,
) -> Result<Option<AdamW>> {
    if !dp.shards_optimizer() {
        return optimizer.try_clone().map(Some);
    }
    let rank = dp.group.rank();
    let mut moments = Vec::new();
    for which in 0..2 {
        let mut shard = vec![0f32; partition.shard_len];
        for piece in partition.pieces(rank) {
            let (m, v) = optimizer.held_moments(piece.param)?;
            shard[piece.in_shard].copy_from_slice(if which == 0 { &m } else { &v });
        }
        let Some(all) = dp.group.gather_to_first(&shard, partition.shard_len * dp.world())? else {
            continue;
        };
        let shapes: Vec<&candle_core::Shape> = params.vars.iter().map(|v| v.shape()).collect();
        let per_param: Vec<Vec<f32>> = partition
            .unflatten(&all, &shapes)?
            .iter()
            .map(|t| t.flatten_all()?.to_vec1::<f32>())
            .collect::<candle_core::Result<_>>()?;
        moments.push(per_param);
    }
    let Some(exp_avg_sq) = moments.pop() else { return Ok(None) };
    let exp_avg = moments.pop().expect("both moments gathered");
    Ok(Some(optimizer.with_full_moments(exp_avg, exp_avg_sq)))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Stages read and print as DeepSpeed numbers them; what a stage shards depends on there
    /// being ranks to shard over; stages 1-3 step on a GPU unless offloaded, never on the CPU.
    #[test]
    fn stages_are_deepspeeds_numbers_and_shard_only_over_several_ranks() -> Result<()> {
        for n in 0..4u8 {
            let stage = ZeroStage::from_number(n)?;
            assert_eq!((stage.number(), stage.to_string()), (n, n.to_string()));
            assert_eq!(ZeroStage::number_gathers_after_the_step(n as u64), n == 1 || n == 2);
        }
        assert!(ZeroStage::from_number(4).unwrap_err().to_string().contains("--zero-stage 4 does not exist"));
        assert!(!ZeroStage::number_gathers_after_the_step(257), "257 is not stage 1");
        let shards = |dp: &DataParallel| (dp.shards_optimizer(), dp.shards_parameters());
        let one = Arc::new(ProcessGroup::single());
        for n in 0..4 {
            let dp = DataParallel::new(one.clone(), ZeroStage::from_number(n)?, 10);
            assert_eq!(shards(&dp), (false, false), "stage {n} on one rank");
            for offload in [false, true] {
                assert!(!dp.clone().with_offload(offload).steps_on_device(&Device::Cpu));
            }
        }
        let results = crate::comm::on_groups(2, |group| {
            let group = Arc::new(group);
            (0..4).map(|n| Ok(shards(&DataParallel::new(group.clone(), ZeroStage::from_number(n)?, 10)))).collect()
        });
        for result in results {
            let got: Vec<(bool, bool)> = result?;
            assert_eq!(got, [(false, false), (true, false), (true, false), (true, true)]);
        }
        Ok(())
    }

    /// Stage 0 packs consecutive parameters into buckets up to the bucket's size, exactly full
    /// included; a parameter larger than a bucket is a bucket of its own.
    #[test]
    fn all_reduce_buckets_pack_consecutive_parameters_up_to_the_bucket() {
        assert_eq!(all_reduce_buckets(&[5, 3, 2, 10, 1], 5), [0..1, 1..3, 3..4, 4..5]);
        assert_eq!(all_reduce_buckets(&[1, 1, 1, 1], 3), [0..3, 3..4]);
        let one = all_reduce_buckets(&[4, 4], 100);
        assert_eq!((one.len(), &one[0]), (1, &(0..2)), "both in one bucket");
        assert_eq!(all_reduce_buckets(&[], 100), Vec::<Range<usize>>::new());
    }

    /// Stage 0's all-reduce gives every rank the mean of every gradient in its shape, whatever
    /// the buckets (one parameter each, several together, one for all); on 2 and 4 ranks, where
    /// the mean of these small integers is exact.
    #[test]
    fn all_reduced_gradients_are_the_ranks_mean_in_any_buckets() -> Result<()> {
        let shapes: [&[usize]; 3] = [&[2, 3], &[5], &[1]];
        for world in [2, 4] {
            for bucket in [1, 6, 100] {
                let results = crate::comm::on_groups(world, |group| {
                    let dp = DataParallel::new(Arc::new(group), ZeroStage::Disabled, bucket);
                    let r = dp.group.rank();
                    let grads = shapes
                        .iter()
                        .enumerate()
                        .map(|(p, &shape)| {
                            let n: usize = shape.iter().product();
                            let values = (0..n).map(|i| (8 * r + 10 * p + i) as f32).collect::<Vec<_>>();
                            Ok(Tensor::from_vec(values, shape, &Device::Cpu)?)
                        })
                        .collect::<Result<Vec<_>>>()?;
                    all_reduce_gradients(&dp, grads)
                });
                for result in results {
                    for (p, (mean, &shape)) in result?.iter().zip(&shapes).enumerate() {
                        assert_eq!(mean.dims(), shape, "world {world} bucket {bucket}");
                        let want: Vec<f32> = (0..shape.iter().product::<usize>())
                            .map(|i| (4 * (world - 1) + 10 * p + i) as f32)
                            .collect();
                        assert_eq!(mean.flatten_all()?.to_vec1::<f32>()?, want, "world {world} bucket {bucket}");
                    }
                }
            }
        }
        Ok(())
    }

    /// The global norm of sharded gradients sums every rank's squares; under tensor parallelism
    /// a replicated parameter counts once and each TP rank's slice of a split one counts (4 ranks:
    /// TP 2 by data-parallel 2, the flat layout of a 2-value LayerNorm and a 3-value slice).
    #[test]
    fn sharded_gradient_norms_count_every_value_once() -> Result<()> {
        let splits = [Split::Whole, Split::Columns { segments: 1 }];
        let partition = Partition::new(vec![2, 3], 2);
        let results = crate::comm::on_groups(4, |world| {
            let plain = sharded_grad_norm(&world, &Tensor::new(&[world.rank() as f32 + 1.0], &Device::Cpu)?)?;
            let layout = crate::tensor_parallel::layout::ParallelLayout::new(&world, 2)?;
            let t = layout.tp.rank() as f32;
            let flat = [1.0, 2.0, 3.0 + t, 4.0 + t, 5.0 + t, 0.0];
            let d = layout.dp.rank();
            let shard = Tensor::new(&flat[d * 3..(d + 1) * 3], &Device::Cpu)?;
            let tp = sharded_grad_norm_tensor_parallel(&layout.dp, &layout.tp, (&splits, &partition), &shard)?;
            Ok((plain, tp))
        });
        for result in results {
            let (plain, tp) = result?;
            assert!((plain - 30f64.sqrt()).abs() < 1e-12, "{plain}");
            // 1 + 4 once; 9 + 16 + 25 from TP rank 0's slice, 16 + 25 + 36 from rank 1's.
            assert!((tp - 132f64.sqrt()).abs() < 1e-12, "{tp}");
        }
        Ok(())
    }

    #[test]
    fn shards_cover_every_parameter_once_even_when_uneven() {
        // 3 ranks over 4 + 5 + 1 = 10 values: shards of 4, the last ends in 2 values of padding.
        let p = Partition::new(vec![4, 5, 1], 3);
        assert_eq!((p.total(), p.shard_len, p.padded()), (10, 4, 12));
        assert_eq!(p.pieces(0), vec![Piece { param: 0, in_param: 0..4, in_shard: 0..4 }]);
        assert_eq!(p.pieces(1), vec![Piece { param: 1, in_param: 0..4, in_shard: 0..4 }]);
        assert_eq!(
            p.pieces(2),
            vec![
                Piece { param: 1, in_param: 4..5, in_shard: 0..1 },
                Piece { param: 2, in_param: 0..1, in_shard: 1..2 }
            ]
        );
        assert_eq!(p.ranges(2), vec![0..0, 4..5, 0..1]);
        // Every value of every parameter lands in exactly one shard.
        for world in 1..=5 {
            let p = Partition::new(vec![7, 1, 13, 2], world);
            let mut seen = [vec![0; 7], vec![0; 1], vec![0; 13], vec![0; 2]];
            for r in 0..world {
                for piece in p.pieces(r) {
                    assert_eq!(piece.in_param.len(), piece.in_shard.len());
                    piece.in_param.for_each(|i| seen[piece.param][i] += 1);
                }
            }
            assert!(seen.iter().flatten().all(|&c| c == 1), "world {world}: {seen:?}");
        }
    }

    /// Buckets follow backward's order (the last block first, the parameters outside the blocks
    /// at the end, waiting for backward's end), each within the size unless one parameter is
    /// larger, and in the flat layout's order inside.
    #[test]
    fn gradient_buckets_follow_backwards_order() {
        let names: Vec<String> =
            ["wte", "wpe", "h.0.a", "h.0.b", "h.1.a", "h.1.b", "ln_f", "h.1.lora"].map(String::from).to_vec();
        let partition = Partition::new(vec![10, 4, 3, 3, 3, 8, 2, 1], 2);
        let group = Arc::new(ProcessGroup::single());
        let buckets =
            GradientBuckets::new(DataParallel::new(group, ZeroStage::Gradients, 7), partition, &names, &Device::Cpu);
        // Backward completes 4, 5, 7 (block 1), 2, 3 (block 0), then 0, 1, 6; greedy buckets of
        // at most 7 values, h.1.b (8) and wte (10) cut into buckets of their own.
        let whole = |param: usize, n: usize| Stretch { param, values: 0..n };
        let part = |param: usize, values: Range<usize>| vec![Stretch { param, values }];
        assert_eq!(
            buckets.buckets,
            vec![
                vec![whole(4, 3)],
                part(5, 0..7),
                part(5, 7..8),
                vec![whole(2, 3), whole(3, 3), whole(7, 1)],
                part(0, 0..7),
                part(0, 7..10),
                vec![whole(1, 4), whole(6, 2)]
            ]
        );
        assert_eq!(buckets.waits_for_the_end, [false, false, false, false, true, true, true]);
        assert_eq!(crate::training::optim::GradientSink::buckets(&buckets), 7);
    }

    /// Stage 2's buckets reduced as tensors (the GPU's path: a bucket's pieces in one buffer,
    /// the group's bucket reduce, the sums added into a shard tensor when the next bucket
    /// begins) give the host path's shard bit for bit, on 3 ranks whose shards cut parameters
    /// unevenly, over two micro-batches, in fp32 and with bf16 on the wire; and the sums are
    /// those of every rank's gradients added here (fp32, within rounding: the ring adds in its
    /// own order).
    #[test]
    fn gradient_buckets_reduced_as_tensors_are_the_host_buckets() -> Result<()> {
        let names: Vec<String> =
            ["wte", "wpe", "h.0.a", "h.0.b", "h.1.a", "h.1.b", "ln_f", "h.1.lora"].map(String::from).to_vec();
        let sizes = vec![10, 4, 3, 3, 3, 8, 2, 1];
        let world = 3;
        // Backward's parts: block 1, block 0, then the embeddings and what is outside the blocks.
        let parts: [&[usize]; 3] = [&[4, 5, 7], &[2, 3], &[0, 1, 6]];
        let grad = |rank: usize, micro: usize, i: usize| random(sizes[i], (100 * rank + 10 * micro + i) as u64);
        for outcome in crate::comm::on_groups(world, |group| {
            let group = Arc::new(group);
            let rank = group.rank();
            let mut shards = Vec::new();
            for wire in [WireDtype::F32, WireDtype::Bf16] {
                for as_tensors in [false, true] {
                    let dp = DataParallel::new(group.clone(), ZeroStage::Gradients, 7).with_wire(wire);
                    let buckets = GradientBuckets::new(dp, Partition::new(sizes.clone(), world), &names, &Device::Cpu);
                    let mut buckets = if as_tensors { buckets.reducing_as_tensors() } else { buckets };
                    for micro in 0..2 {
                        let mut grads: Vec<Option<Tensor>> = vec![None; sizes.len()];
                        for (k, part) in parts.iter().enumerate() {
                            for &i in *part {
                                grads[i] = Some(Tensor::new(grad(rank, micro, i), &Device::Cpu)?);
                            }
                            crate::training::optim::GradientSink::take(&mut buckets, &mut grads, k == parts.len() - 1)?;
                        }
                        assert!(grads.iter().all(Option::is_none), "every gradient handed on");
                    }
                    let shard = crate::training::optim::GradientSink::take_reduced(&mut buckets)?;
                    shards.push((wire, as_tensors, shard.to_vec1::<f32>()?));
                }
            }
            Ok((rank, shards))
        }) {
            let (rank, shards) = outcome?;
            for pair in shards.chunks(2) {
                let ((wire, _, host), (_, _, tensors)) = (&pair[0], &pair[1]);
                assert_eq!(
                    host.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                    tensors.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                    "rank {rank}, {wire:?}"
                );
            }
            let partition = Partition::new(sizes.clone(), world);
            let mut expected = vec![0f32; partition.shard_len];
            for piece in partition.pieces(rank) {
                for (r, micro) in (0..world).flat_map(|r| (0..2).map(move |m| (r, m))) {
                    let g = grad(r, micro, piece.param);
                    expected[piece.in_shard.clone()]
                        .iter_mut()
                        .zip(&g[piece.in_param.clone()])
                        .for_each(|(e, v)| *e += v);
                }
            }
            let fp32 = &shards[1].2;
            let diff = expected.iter().zip(fp32).fold(0f32, |m, (e, v)| m.max((e - v).abs()));
            assert!(diff < 1e-6, "rank {rank}: the sums differ from every rank's gradients by {diff}");
        }
        Ok(())
    }

    /// Gradients in half precision (bf16 backward) or laid out non-contiguously are read as the
    /// same f32 values contiguous ones are: the buckets' shards are bit for bit the same.
    #[test]
    fn gradient_buckets_read_half_precision_and_strided_gradients_as_f32() -> Result<()> {
        let names: Vec<String> = ["h.0.a", "h.0.b"].map(String::from).to_vec();
        let sizes = vec![6, 4];
        for outcome in crate::comm::on_groups(2, |group| {
            let group = Arc::new(group);
            let r = group.rank() as f32;
            // Small integers: exact in bf16, so the conversion must give the same sums.
            let a = Tensor::new(&[[1f32, 2.0], [3.0, 4.0], [5.0, 6.0]], &Device::Cpu)?.affine(1.0, r as f64)?;
            let b = Tensor::new(&[-1f32, 0.5, 7.0, 8.0], &Device::Cpu)?.affine(1.0, 2.0 * r as f64)?;
            let mut shards = Vec::new();
            let plain = [a.t()?.contiguous()?, b.clone()];
            let odd = [a.t()?, b.to_dtype(DType::BF16)?];
            assert!(!odd[0].is_contiguous());
            for grads in [plain, odd] {
                let dp = DataParallel::new(group.clone(), ZeroStage::Gradients, 3);
                let mut buckets = GradientBuckets::new(dp, Partition::new(sizes.clone(), 2), &names, &Device::Cpu);
                let mut grads: Vec<Option<Tensor>> = grads.into_iter().map(Some).collect();
                crate::training::optim::GradientSink::take(&mut buckets, &mut grads, true)?;
                let shard = crate::training::optim::GradientSink::take_reduced(&mut buckets)?;
                shards.push(shard.to_vec1::<f32>()?);
            }
            Ok((group.rank(), shards))
        }) {
            let (rank, shards) = outcome?;
            // Both ranks' a^T then b, summed: [3, 7, 11, 5, 9, 13] and [0, 3, 16, 18], in shards of 5.
            let sums = [3f32, 7.0, 11.0, 5.0, 9.0, 13.0, 0.0, 3.0, 16.0, 18.0];
            assert_eq!(shards[0], sums[5 * rank..5 * rank + 5]);
            assert_eq!(shards[1], shards[0]);
        }
        Ok(())
    }

    /// LoRA adapters fused on each rank's fp32 shard and gathered are the whole model's merged
    /// weights bit for bit, on 2, 5 and 7 ranks, where shard boundaries fall inside adapters too.
    #[test]
    fn weights_fused_on_the_shards_are_the_whole_models_merged_weights() -> Result<()> {
        let cfg = crate::Gpt2Config {
            n_layer: 2,
            n_embd: 8,
            n_head: 2,
            n_positions: 8,
            vocab_size: 12,
            ..crate::Gpt2Config::tiny()
        };
        let mut whole = ParamStore::init(&cfg, 3, &Device::Cpu)?;
        whole.add_lora(&cfg, &lora::LoraConfig { dim: 2, alpha: Some(4.0), module_name: "h.".into() }, 3)?;
        for (name, var) in whole.iter() {
            if name.ends_with(".lora_B.weight") {
                var.set(&Tensor::randn(0f32, 0.5, var.shape(), &Device::Cpu)?)?;
            }
        }
        let bits = |p: &ParamStore| -> Result<Vec<(String, Vec<u32>)>> {
            p.iter()
                .map(|(n, v)| {
                    Ok((n.to_string(), v.flatten_all()?.to_vec1::<f32>()?.iter().map(|x| x.to_bits()).collect()))
                })
                .collect()
        };
        let want = bits(&whole.merged()?)?;
        let mut split_adapters = 0;
        // 5 and 7 ranks cut an adapter between two shards (counted below).
        for world in [2, 5, 7] {
            let partition = Partition::of(&whole, world);
            split_adapters += (0..world)
                .flat_map(|r| partition.pieces(r))
                .filter(|p| lora::is_adapter_name(&whole.names[p.param]) && p.in_param.start > 0)
                .count();
            for result in crate::comm::on_groups(world, |group| {
                let dp = DataParallel::new(Arc::new(group), ZeroStage::OptimizerStates, 1000);
                let shard = shard_values(&partition, dp.group.rank(), &whole)?;
                bits(&gather_fused_weights(&dp, &partition, &whole, &shard)?)
            }) {
                assert_eq!(result?, want, "{world} ranks");
            }
        }
        assert!(split_adapters > 0, "some shard begins inside an adapter");
        Ok(())
    }

    /// A tensor's values as f32 in its logical order: read in place from contiguous f32, copied
    /// out of a strided or half-precision one.
    #[test]
    fn host_f32_values_are_in_logical_order_whatever_the_layout() -> Result<()> {
        let t = Tensor::new(&[[1f32, 2.0, 3.0], [4.0, 5.0, 6.0]], &Device::Cpu)?;
        for (what, t) in [("contiguous", t.clone()), ("transposed", t.t()?), ("bf16", t.to_dtype(DType::BF16)?)] {
            let want = t.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?;
            assert_eq!(with_host_f32(&t, |v| Ok(v.to_vec()))?, want, "{what}");
        }
        Ok(())
    }

    /// Three parameters over 2 ranks (rank 1's shard: the end of one, a bias, the start of a
    /// third), a weight-decayed and a bias, the LoRA learning-rate scale on one.
    fn shard_fixture(rank: usize) -> (Partition, AdamW, Vec<String>) {
        let names: Vec<String> = ["h.0.attn.c_attn.weight", "h.0.attn.c_attn.bias", "h.0.mlp.c_fc.lora_right_weight"]
            .map(String::from)
            .to_vec();
        let partition = Partition::new(vec![9, 4, 6], 2);
        let config = crate::training::optim::AdamWConfig { weight_decay: 0.1, ..Default::default() };
        let mut optimizer = AdamW::over_ranges(config, &names, partition.ranges(rank));
        optimizer.set_lora_lr(&names, 5e-3, 1e-3);
        (partition, optimizer, names)
    }

    fn random(n: usize, seed: u64) -> Vec<f32> {
        (0..n).map(|i| (((i as u64 * 2654435761 + seed * 97) % 1000) as f32 / 500.0 - 1.0) * 0.3).collect()
    }

    /// The updated weights all-gathered from a shard held as a tensor (a GPU's, gathered by NCCL
    /// where it lives) are those gathered from the same shard in host memory, in f32 and bf16 and
    /// in rounds of any bucket, on 3 ranks; the shard taken out of whole weights as a tensor
    /// ([`shard_tensor`]) is [`shard_values`], padding included.
    #[test]
    fn weights_gathered_from_a_tensor_shard_are_those_from_the_host() -> Result<()> {
        let sizes = vec![9, 4, 6];
        for outcome in crate::comm::on_groups(3, |group| {
            let rank = group.rank();
            let partition = Partition::new(sizes.clone(), 3);
            let mine = random(partition.shard_len, rank as u64 + 1);
            let tensor = Tensor::new(mine.as_slice(), &Device::Cpu)?;
            let group = Arc::new(group);
            for (dtype, bucket) in [(DType::F32, 1 << 20), (DType::BF16, 1 << 20), (DType::F32, 4)] {
                let dp = DataParallel::new(group.clone(), ZeroStage::OptimizerStates, DEFAULT_BUCKET)
                    .with_gather_bucket(bucket);
                let gathered = |held: Held| -> Result<Vec<Vec<f32>>> {
                    let params = ParamStore::of_tensors(
                        sizes
                            .iter()
                            .enumerate()
                            .map(|(i, &n)| Ok((format!("p{i}"), Tensor::zeros(n, dtype, &Device::Cpu)?)))
                            .collect::<Result<Vec<_>>>()?,
                    )?;
                    all_gather_parameters(&dp, &partition, &params, held)?;
                    params.vars.iter().map(|v| Ok(v.to_dtype(DType::F32)?.to_vec1::<f32>()?)).collect()
                };
                let from_host = gathered(Held::Host(&mine))?;
                assert!(from_host.iter().flatten().any(|&x| x != 0.0));
                assert_eq!(from_host, gathered(Held::Tensor(tensor.clone()))?, "{dtype:?}, bucket {bucket}");
                let whole = ParamStore::of_tensors(
                    from_host
                        .iter()
                        .enumerate()
                        .map(|(i, v)| Ok((format!("p{i}"), Tensor::new(v.as_slice(), &Device::Cpu)?)))
                        .collect::<Result<Vec<_>>>()?,
                )?;
                assert_eq!(
                    shard_tensor(&partition, rank, &whole)?.to_vec1::<f32>()?,
                    shard_values(&partition, rank, &whole)?
                );
            }
            Ok(())
        }) {
            outcome?;
        }
        Ok(())
    }

    /// A master shard held as a tensor and stepped in place piece by piece
    /// ([`step_shard_in_place`], how it steps on a GPU) gives the host step's values and moments
    /// bit for bit over three steps, on either rank.
    #[test]
    fn a_master_shard_stepped_in_place_is_the_host_step() -> Result<()> {
        for rank in 0..2 {
            let (partition, mut on_host, _) = shard_fixture(rank);
            let (_, mut in_place, _) = shard_fixture(rank);
            let mut host = MasterShard::Host(random(partition.shard_len, 1));
            let mut tensor = MasterShard::Device(Tensor::new(random(partition.shard_len, 1), &Device::Cpu)?);
            for step in 0..3 {
                let grad = Tensor::new(random(partition.shard_len, 10 + step), &Device::Cpu)?;
                host.step(rank, &partition, &mut on_host, &grad, 1e-3)?;
                tensor.step(rank, &partition, &mut in_place, &grad, 1e-3)?;
            }
            let (a, b) = (host.with_values(|v| Ok(v.to_vec()))?, tensor.with_values(|v| Ok(v.to_vec()))?);
            assert_eq!(a, b, "rank {rank}: the weights");
            assert_ne!(a, random(partition.shard_len, 1), "rank {rank}: the steps moved the weights");
            for piece in partition.pieces(rank) {
                let (m, v) = on_host.held_moments(piece.param)?;
                let (m2, v2) = in_place.held_moments(piece.param)?;
                assert_eq!((m.to_vec(), v.to_vec()), (m2.to_vec(), v2.to_vec()), "rank {rank}: moments of {piece:?}");
            }
        }
        Ok(())
    }

    /// Stages 1 and 2 with whole masters: the pieces stepped in place in the parameters
    /// ([`step_shard_in_params`], a GPU's path) are the host step of the same shard, and the
    /// parameters' values outside this rank's shard are untouched.
    #[test]
    fn a_shard_stepped_in_the_parameters_is_the_host_step() -> Result<()> {
        for rank in 0..2 {
            let (partition, mut on_host, names) = shard_fixture(rank);
            let (_, mut in_place, _) = shard_fixture(rank);
            let whole = random(partition.total(), 3);
            let mut params = ParamStore::default();
            let mut at = 0;
            for (name, &n) in names.iter().zip(&partition.sizes) {
                params.push(name, &Tensor::new(&whole[at..at + n], &Device::Cpu)?)?;
                at += n;
            }
            let mut shard = shard_values(&partition, rank, &params)?;
            for step in 0..3 {
                let grad = Tensor::new(random(partition.shard_len, 20 + step), &Device::Cpu)?;
                step_shard(rank, &partition, &mut on_host, &mut shard, &grad, 1e-3)?;
                step_shard_in_params(rank, &partition, &mut in_place, &params, &grad, 1e-3)?;
            }
            assert_eq!(shard_values(&partition, rank, &params)?, shard, "rank {rank}");
            let other = shard_values(&partition, 1 - rank, &params)?;
            let mut untouched = ParamStore::default();
            let mut at = 0;
            for (name, &n) in names.iter().zip(&partition.sizes) {
                untouched.push(name, &Tensor::new(&whole[at..at + n], &Device::Cpu)?)?;
                at += n;
            }
            assert_eq!(other, shard_values(&partition, 1 - rank, &untouched)?, "rank {rank}: the other shard moved");
        }
        Ok(())
    }

    /// On a GPU: the shard on the device stepped with cuda/adamw.cu's passes against the host
    /// step, three steps (the same arithmetic; the GPU may fuse a multiply-add: within 1e-6 of
    /// the largest weight).
    #[cfg(feature = "cuda")]
    #[test]
    #[ignore = "needs a GPU: scripts/gpu-check.sh runs it (cargo test --features cuda -- --include-ignored)"]
    fn master_shard_cuda_steps_as_the_host() -> Result<()> {
        let gpu = crate::kernels::ops::test_support::gpu();
        let (partition, mut on_host, _) = shard_fixture(1);
        let (_, mut on_gpu, _) = shard_fixture(1);
        let dp = DataParallel::new(Arc::new(ProcessGroup::single()), ZeroStage::OptimizerStates, DEFAULT_BUCKET);
        let mut host = MasterShard::new(random(partition.shard_len, 1), &dp, &Device::Cpu)?;
        let mut device = MasterShard::new(random(partition.shard_len, 1), &dp, &gpu)?;
        assert_eq!((host.place(), device.place()), ("host memory", "the GPU"));
        assert_eq!(MasterShard::new(vec![0.0], &dp.clone().with_offload(true), &gpu)?.place(), "host memory");
        for step in 0..3 {
            let grad = Tensor::new(random(partition.shard_len, 10 + step), &Device::Cpu)?;
            host.step(1, &partition, &mut on_host, &grad, 1e-3)?;
            device.step(1, &partition, &mut on_gpu, &grad.to_device(&gpu)?, 1e-3)?;
        }
        let (a, b) = (host.with_values(|v| Ok(v.to_vec()))?, device.with_values(|v| Ok(v.to_vec()))?);
        let largest = a.iter().fold(0f32, |m, x| m.max(x.abs()));
        let diff = a.iter().zip(&b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
        assert!(diff <= 1e-6 * largest, "weights differ by {diff} (largest {largest})");
        Ok(())
    }

    /// On a GPU: stage 2's buckets of gradients on the device (their pieces copied into a buffer
    /// there, reduced over NCCL with the feature, else through host memory as over gloo, added
    /// into a shard on the device) give the host buckets' shard bit for bit, fp32 and bf16
    /// gradients, fp32 and bf16 on the wire, over two micro-batches (one rank: the bucket reduce
    /// is a copy to rank 0; the chunks of several ranks are the CPU test's above).
    #[cfg(feature = "cuda")]
    #[test]
    #[ignore = "needs a GPU: scripts/gpu-check.sh runs it (cargo test --features cuda -- --include-ignored)"]
    fn gradient_buckets_on_the_gpu_are_the_host_buckets() -> Result<()> {
        let gpu = crate::kernels::ops::test_support::gpu();
        let names: Vec<String> = ["wte", "h.0.a", "h.1.a", "h.1.b", "ln_f"].map(String::from).to_vec();
        let sizes = vec![9, 5, 3, 8, 2];
        let parts: [&[usize]; 3] = [&[2, 3], &[1], &[0, 4]];
        let group = Arc::new(ProcessGroup::single());
        for (dtype, wire) in
            [(DType::F32, WireDtype::F32), (DType::BF16, WireDtype::F32), (DType::F32, WireDtype::Bf16)]
        {
            let mut shards = Vec::new();
            for device in [Device::Cpu, gpu.clone()] {
                let dp = DataParallel::new(group.clone(), ZeroStage::Gradients, 6).with_wire(wire);
                let mut buckets = GradientBuckets::new(dp, Partition::new(sizes.clone(), 1), &names, &device);
                for micro in 0..2 {
                    let mut grads: Vec<Option<Tensor>> = vec![None; sizes.len()];
                    for (k, part) in parts.iter().enumerate() {
                        for &i in *part {
                            let g = Tensor::new(random(sizes[i], (10 * micro + i) as u64), &Device::Cpu)?;
                            grads[i] = Some(g.to_dtype(dtype)?.to_device(&device)?);
                        }
                        crate::training::optim::GradientSink::take(&mut buckets, &mut grads, k == parts.len() - 1)?;
                    }
                }
                let shard = crate::training::optim::GradientSink::take_reduced(&mut buckets)?;
                assert!(shard.device().same_device(&device), "the shard where the parameters are");
                shards.push(shard.to_device(&Device::Cpu)?.to_vec1::<f32>()?);
            }
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&shards[0]), bits(&shards[1]), "{dtype:?} gradients, {wire:?} on the wire");
        }
        Ok(())
    }

    #[test]
    fn flatten_and_unflatten_are_inverse() -> Result<()> {
        let p = Partition::new(vec![6, 3], 4);
        let a = Tensor::arange(0f32, 6., &Device::Cpu)?.reshape((2, 3))?;
        let b = Tensor::arange(6f32, 9., &Device::Cpu)?;
        let flat = p.flatten(&[a.clone(), b.clone()])?;
        assert_eq!(flat.to_vec1::<f32>()?, [0., 1., 2., 3., 4., 5., 6., 7., 8., 0., 0., 0.]);
        let back = p.unflatten(&flat, &[a.shape(), b.shape()])?;
        assert_eq!(back[0].to_vec2::<f32>()?, a.to_vec2::<f32>()?);
        assert_eq!(back[1].to_vec1::<f32>()?, b.to_vec1::<f32>()?);
        Ok(())
    }
}
