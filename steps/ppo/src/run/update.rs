//! The training phase (DS-Chat's `train_rlhf` over buffered rollouts): `--ppo-epochs` passes of
//! actor, critic and PTX updates over each rank's share of the global micro-batches, stopped
//! early at `--target-kl`; the phase's means over every rank.

use super::context::Ctx;
use crate::experience::Experience;
use crate::models::PpoModels;
use crate::trainer::{answer_tokens, MicroBatch, PtxBatch, UpdateStats};
use anyhow::Result;
use candle_core::{Device, Tensor};
use data::PackedCorpus;
use hybrid_engine::comm::{ProcessGroup, ReduceOp};
use hybrid_engine::kernels::ops::DropoutKey;

/// What a training phase measured on this rank (its parts of the global means).
#[derive(Default)]
pub(super) struct Updates {
    pub(super) stats: Vec<UpdateStats>,
    /// This rank's PTX loss of each update.
    pub(super) ptx_losses: Vec<f64>,
    /// With `--target-kl`: the micro-batches gone through and planned, when the phase stopped
    /// early.
    pub(super) stopped_early: Option<(usize, usize)>,
}

/// Means over a training phase's updates of the global micro-batches' measurements.
pub(super) struct UpdateMeans {
    pub(super) stats: UpdateStats,
    /// Over the updates after the phase's first, whose ratio is 1 by construction: where the
    /// policy has moved and clipping can act. `None` with fewer than two updates.
    pub(super) later: Option<UpdateStats>,
    pub(super) ptx_loss: Option<f64>,
    pub(super) stopped_early: Option<(usize, usize)>,
}

impl Updates {
    /// The means over the phase's updates, each update's values reduced over the ranks (every
    /// rank ran the same updates). NaN when the phase had none (rollouts are being collected).
    pub(super) fn global_means(&self, group: &ProcessGroup) -> Result<UpdateMeans> {
        // All updates' sums, the PTX loss, then the sums of the updates after the first.
        let mut sums = [0f64; 13];
        for (i, u) in self.stats.iter().enumerate() {
            for (k, v) in u.to_array().into_iter().enumerate() {
                sums[k] += v;
                if i > 0 {
                    sums[7 + k] += v;
                }
            }
        }
        // Every rank holds as many PTX blocks: the global loss is the ranks' mean.
        sums[6] = self.ptx_losses.iter().sum::<f64>() / group.world() as f64;
        group.all_reduce_scalars(&mut sums, ReduceOp::Sum)?;
        let means = |from: usize, n: usize| {
            let mut stats = [0f64; 6];
            for (m, s) in stats.iter_mut().zip(&sums[from..from + 6]) {
                *m = if n == 0 { f64::NAN } else { s / n as f64 };
            }
            UpdateStats::from_array(stats)
        };
        let n = self.stats.len();
        Ok(UpdateMeans {
            stats: means(0, n),
            later: (n > 1).then(|| means(7, n - 1)),
            ptx_loss: (!self.ptx_losses.is_empty()).then(|| sums[6] / self.ptx_losses.len() as f64),
            stopped_early: self.stopped_early,
        })
    }
}

/// The PPO epochs over the buffered rollouts: each pass shuffles their global micro-batches (one
/// seeded order, the same on every rank) and runs one update per micro-batch, each followed by a
/// PTX update when `ptx` gives a corpus and its sampler. `cfg` holds the KL coefficient of the
/// last rollout (GRPO's loss term reads it).
pub(super) fn ppo_epochs(
    ctx: &Ctx,
    models: &mut PpoModels,
    buffer: &[Experience],
    step: u64,
    micro: &mut u64,
    mut ptx: Option<(&PackedCorpus, &mut data::BlockSampler)>,
    cfg: &crate::PpoConfig,
) -> Result<Updates> {
    let (args, group) = (ctx.args, ctx.group);
    let (rank, world) = (group.rank(), group.world());
    let mut updates = Updates::default();
    // --target-kl: this rank's shares of the approximate KL of the updates since the last step.
    let mut step_kl: Vec<f64> = Vec::new();
    let mut visited = 0;
    'epochs: for ppo_epoch in 0..args.ppo_epochs {
        // Global micro-batches, counted from the rollouts' sizes: the same on every rank,
        // whatever rows each dropped.
        let slices: Vec<(usize, usize)> = buffer
            .iter()
            .enumerate()
            .flat_map(|(e, exp)| (0..exp.micro_batches(ctx.global_micro)).map(move |k| (e, k)))
            .collect();
        let shuffle = data::pretrain::epoch_order(&(0..slices.len()), args.seed ^ step, ppo_epoch as u64);
        for k in shuffle {
            let (e, k) = slices[k];
            let exp = &buffer[e];
            let rows = exp.micro_batch_rows(k, ctx.global_micro);
            *micro += 1;
            visited += 1;
            let mut global = [answer_tokens(exp, &rows), rows.len() as f64];
            group.all_reduce_scalars(&mut global, ReduceOp::Sum)?;
            if global[0] == 0.0 {
                // Every row of this micro-batch was dropped, on every rank: nothing to learn.
                continue;
            }
            let [global_tokens, global_rows] = global;
            let mb = MicroBatch { exp, rows, global_tokens, global_rows, rank, world, micro: *micro };
            let ptx_blocks = match ptx.as_mut() {
                Some((corpus, cursor)) => {
                    // Every rank draws the global micro-batch's blocks and trains on its slice.
                    let per_device = args.per_device_training_batch_size;
                    let idx = cursor.next_indices(ctx.global_micro);
                    let (ids, targets) =
                        ptx_batch(corpus, &idx[rank * per_device..(rank + 1) * per_device], &ctx.device)?;
                    let key = DropoutKey { seed: args.seed, step: *micro, micro_batch: rank as u64 };
                    Some(PtxBatch { ids, targets, coef: args.unsup_coef, key })
                }
                None => None,
            };
            let outcome = models.train_rlhf(&mb, cfg, args.seed, ptx_blocks.as_ref(), &ctx.device)?;
            updates.stats.push(outcome.stats);
            updates.ptx_losses.extend(outcome.ptx_loss.map(f64::from));
            // At an optimizer step, the mean over its micro-batches of their global approx KL.
            if let Some(limit) = args.target_kl {
                step_kl.push(outcome.stats.approx_kl);
                if outcome.actor_step.is_some() {
                    let n = step_kl.len() as f64;
                    let mut kl = [step_kl.drain(..).sum::<f64>()];
                    group.all_reduce_scalars(&mut kl, ReduceOp::Sum)?;
                    let planned = args.ppo_epochs * slices.len();
                    if kl[0] / n > limit && visited < planned {
                        updates.stopped_early = Some((visited, planned));
                        break 'epochs;
                    }
                }
            }
        }
    }
    Ok(updates)
}

/// Inputs and next-token targets of PTX blocks: (B, T) each.
pub(super) fn ptx_batch(corpus: &PackedCorpus, idx: &[usize], device: &Device) -> Result<(Tensor, Tensor)> {
    let t = corpus.seq_length();
    let (mut x, mut y) = (Vec::new(), Vec::new());
    for &i in idx {
        let block = corpus.block(i)?;
        x.extend_from_slice(&block[..t]);
        y.extend_from_slice(&block[1..]);
    }
    Ok((Tensor::from_vec(x, (idx.len(), t), device)?, Tensor::from_vec(y, (idx.len(), t), device)?))
}
