//! A tensor-parallel rank's training state: its slices of the fp32 master weights and of the
//! Adam moments, cut from whole ones (a fresh model, a checkpoint) and put back together for a
//! save, which is always consolidated, so that any layout resumes it.

use crate::comm::ProcessGroup;
use crate::model::gpt2::{Gpt2, Gpt2Config};
use crate::model::params::ParamStore;
use crate::tensor_parallel::layout::ParallelLayout;
use crate::tensor_parallel::shard::{check_divides, gather_parameter, shard, whole_shape};
use crate::training::optim::AdamW;
use anyhow::{bail, Result};
use candle_core::{Device, Tensor};
use std::collections::HashMap;
use std::sync::Arc;

/// A run whose model is split over tensor-parallel groups: this rank's groups, and how to cut
/// the whole model (of a given config) into this rank's slices and put it back together.
#[derive(Clone)]
pub struct TensorParallel {
    pub layout: ParallelLayout,
}

impl TensorParallel {
    /// The layout of `world` in TP groups of `size` ranks (every rank calls it together), or
    /// `None` for `size` 1. A size that does not divide the ranks or a node's ranks is one line.
    pub fn new(world: &ProcessGroup, size: usize) -> Result<Option<Self>> {
        if size <= 1 {
            return Ok(None);
        }
        Ok(Some(Self { layout: ParallelLayout::new(world, size)? }))
    }

    pub fn size(&self) -> usize {
        self.layout.tp.world()
    }

    /// The TP group: the ranks that split each layer with this one.
    pub fn tp(&self) -> &Arc<ProcessGroup> {
        &self.layout.tp
    }

    /// The log line that says how the ranks are laid out.
    pub fn describe(&self) -> String {
        format!("tensor parallel: {} ranks per layer, {} data-parallel groups", self.size(), self.layout.dp.world())
    }

    /// This rank's slices of the whole model `whole` of config `cfg` (fp32 masters; LoRA
    /// adapters cut as their linears, frozen flags kept), each whole tensor freed once cut. A
    /// model whose heads or MLP width the TP size does not divide is refused.
    pub fn slice(&self, whole: ParamStore, cfg: &Gpt2Config) -> Result<ParamStore> {
        self.check_model(cfg)?;
        let (frozen, lora_scaling) = (whole.frozen().to_vec(), whole.lora_scaling());
        let mut local = ParamStore::default();
        for (name, var) in whole.names.into_iter().zip(whole.vars) {
            let piece = self.cut(cfg, &name, var.as_tensor())?;
            drop(var);
            local.push(&name, &piece)?;
        }
        local.set_layout(&frozen, lora_scaling)?;
        Ok(local)
    }

    /// This rank's slices of a freshly initialised model (`ParamStore::init`'s weights), drawn
    /// tensor by tensor: a rank never holds more than its slices and one whole tensor.
    pub fn init(&self, cfg: &Gpt2Config, seed: u64, device: &Device) -> Result<ParamStore> {
        self.check_model(cfg)?;
        ParamStore::init_each(cfg, seed, device, |name, t| self.cut(cfg, name, &t))
    }

    /// This rank's slices of a saved model's trunk of config `cfg`: `read(name, range)` returns
    /// the values of trunk parameter `name` in `range` of its flat indices as fp32 (a memory-mapped
    /// directory, `checkpoints::sharded_io::ModelSlices`). Read tensor by tensor: a rank never
    /// holds more than its slices and one whole tensor.
    pub fn read(
        &self,
        cfg: &Gpt2Config,
        device: &Device,
        read: impl Fn(&str, std::ops::Range<usize>) -> Result<Vec<f32>>,
    ) -> Result<ParamStore> {
        self.check_model(cfg)?;
        let mut local = ParamStore::default();
        for (name, shape) in crate::model::params::parameter_shapes(cfg) {
            let whole = Tensor::from_vec(read(&name, 0..shape.iter().product())?, shape, device)?;
            local.push(&name, &self.cut(cfg, &name, &whole)?)?;
        }
        Ok(local)
    }

    /// This rank's slice of parameter `name`'s whole value (trunk, head or LoRA adapter) of a
    /// model of config `cfg`, cut as the model's layout says.
    pub fn cut(&self, cfg: &Gpt2Config, name: &str, whole: &Tensor) -> Result<Tensor> {
        shard(whole, cfg.split_of(name), self.layout.tp.rank(), self.size())
    }

    /// Whether `cfg` splits over this TP group: callers check it before any other work, so that
    /// a bad layout is refused before the data is read.
    pub fn check_model(&self, cfg: &Gpt2Config) -> Result<()> {
        check_divides(cfg.num_heads(), cfg.inner_dim(), self.size())
    }

    /// For a consolidated save by rank 0: on the ranks of its TP group (the first data-parallel
    /// rank), a collective that gives TP rank 0 the whole model from every rank's slices `local`
    /// (`None` on the others); the other TP groups hold the same slices and skip it.
    pub fn gather(&self, local: &ParamStore, cfg: &Gpt2Config) -> Result<Option<ParamStore>> {
        match self.layout.dp.rank() {
            0 => gather_params(local, cfg, &self.layout.tp),
            _ => Ok(None),
        }
    }

    /// [`Self::gather`] for the optimizer over the slices `params`.
    pub fn gather_optimizer(&self, local: &AdamW, params: &ParamStore, cfg: &Gpt2Config) -> Result<Option<AdamW>> {
        match self.layout.dp.rank() {
            0 => gather_optimizer(local, params, cfg, &self.layout.tp),
            _ => Ok(None),
        }
    }

    /// Fills `local`, an optimizer over this rank's slices `params`, from `whole`, one over the
    /// whole parameters.
    pub fn slice_optimizer(
        &self,
        whole: &AdamW,
        params: &ParamStore,
        local: &mut AdamW,
        cfg: &Gpt2Config,
    ) -> Result<()> {
        shard_optimizer(whole, params, local, (self.layout.tp.rank(), self.size()), cfg)
    }

    /// This rank's slices of saved whole optimizer state (`AdamW::state_tensors`, named
    /// `exp_avg.<parameter>` and `exp_avg_sq.<parameter>`) of a model of config `cfg`: each
    /// moment cut as its parameter is.
    pub fn slice_optimizer_tensors(
        &self,
        whole: &HashMap<String, Tensor>,
        cfg: &Gpt2Config,
    ) -> Result<HashMap<String, Tensor>> {
        let (rank, ranks) = (self.layout.tp.rank(), self.size());
        let mut local = HashMap::with_capacity(whole.len());
        for (key, t) in whole {
            let Some((_, name)) = key.split_once('.') else {
                bail!(
                    "optimizer state {key:?} is not named <moment>.<parameter>: the checkpoint is not this program's"
                );
            };
            local.insert(key.clone(), shard(t, cfg.split_of(name), rank, ranks)?);
        }
        Ok(local)
    }

    /// The element counts of the whole parameters of which `local` holds this rank's slices.
    pub fn whole_numels(&self, local: &ParamStore, cfg: &Gpt2Config) -> Vec<usize> {
        let shapes =
            local.iter().map(|(name, var)| whole_shape(cfg.split_of(name), var.dims(), self.size(), cfg.vocab_size));
        shapes.map(|s| s.iter().product()).collect()
    }

    /// This rank's model over its slices `local` (in the compute dtype).
    pub fn model(&self, local: &ParamStore, cfg: &Gpt2Config) -> Result<Gpt2> {
        local.model_tensor_parallel(cfg, &self.layout.tp)
    }
}

/// The group a run's data is split over: the data-parallel group under tensor parallelism, else
/// every rank.
pub fn data_group(world: &Arc<ProcessGroup>, tp: Option<&TensorParallel>) -> Arc<ProcessGroup> {
    tp.map_or_else(|| world.clone(), |t| t.layout.dp.clone())
}

/// The whole parameters of a model of config `cfg` from every rank's slices `local` (a
/// collective over `tp`), the embedding cut to its `vocab_size` rows (the TP padding dropped),
/// kept by TP rank 0 only (`None` on the others, which drop each tensor as soon as it is gathered).
pub fn gather_params(local: &ParamStore, cfg: &Gpt2Config, tp: &ProcessGroup) -> Result<Option<ParamStore>> {
    let mut whole = ParamStore::default();
    for (name, var) in local.iter() {
        let t = gather_parameter(cfg.split_of(name), var.as_tensor(), cfg.vocab_size, tp)?;
        if tp.rank() == 0 {
            whole.push(name, &t)?;
        }
    }
    if tp.rank() != 0 {
        return Ok(None);
    }
    whole.set_layout(local.frozen(), local.lora_scaling())?;
    Ok(Some(whole))
}

/// The whole optimizer from every rank's `local` one over the slices `params` (a collective
/// over `tp`): what a consolidated checkpoint saves. Kept by TP rank 0 only, as [`gather_params`].
pub fn gather_optimizer(
    local: &AdamW,
    params: &ParamStore,
    cfg: &Gpt2Config,
    tp: &ProcessGroup,
) -> Result<Option<AdamW>> {
    let keep = tp.rank() == 0;
    let (mut m, mut v) = (Vec::new(), Vec::new());
    for (i, (name, var)) in params.iter().enumerate() {
        let (mi, vi) = local.held_moments(i)?;
        for (moments, out) in [(mi, &mut m), (vi, &mut v)] {
            let slice = Tensor::from_slice(&moments, var.shape(), &Device::Cpu)?;
            let gathered = gather_parameter(cfg.split_of(name), &slice, cfg.vocab_size, tp)?;
            if keep {
                out.push(gathered.flatten_all()?.to_vec1::<f32>()?);
            }
        }
    }
    if !keep {
        return Ok(None);
    }
    Ok(Some(local.with_full_moments(m, v)))
}

/// Puts rank `rank`'s slices of the moments of `whole` (an optimizer over the whole parameters)
/// into `local`, one over this rank's slices `params` (of a model of config `cfg`), where it holds
/// them (all of each slice, or under ZeRO 1/2 its data-parallel shard).
pub fn shard_optimizer(
    whole: &AdamW,
    params: &ParamStore,
    local: &mut AdamW,
    (rank, ranks): (usize, usize),
    cfg: &Gpt2Config,
) -> Result<()> {
    for (i, (name, var)) in params.iter().enumerate() {
        let (mi, vi) = whole.held_moments(i)?;
        let split = cfg.split_of(name);
        let shape = whole_shape(split, var.dims(), ranks, cfg.vocab_size);
        let slice = |moments: &[f32]| -> Result<Vec<f32>> {
            let t = Tensor::from_slice(moments, shape.as_slice(), &Device::Cpu)?;
            Ok(shard(&t, split, rank, ranks)?.flatten_all()?.to_vec1::<f32>()?)
        };
        let (m, v) = (slice(&mi)?, slice(&vi)?);
        local.fill_held(i, 0..m.len(), &m, &v)?;
    }
    local.step = whole.step;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::on_groups;
    use crate::model::gpt2::Gpt2Config;
    use crate::training::optim::AdamWConfig;

    /// Weights and moments cut over 2 ranks and gathered back (by rank 0) are the whole ones.
    #[test]
    fn sliced_weights_and_moments_gather_back_whole() -> Result<()> {
        let cfg = Gpt2Config { n_layer: 1, n_embd: 8, n_head: 2, n_positions: 8, vocab_size: 20, ..Gpt2Config::tiny() };
        let whole = ParamStore::init(&cfg, 5, &Device::Cpu)?;
        let fake = |p: &ParamStore| -> Vec<Vec<f32>> {
            p.vars
                .iter()
                .map(|v| v.flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().map(|x| x * 3.0).collect())
                .collect()
        };
        let mut optimizer = AdamW::new(AdamWConfig::default(), &whole)?.with_full_moments(
            fake(&whole),
            fake(&whole).into_iter().map(|m| m.iter().map(|x| x * x).collect()).collect(),
        );
        optimizer.step = 7;
        assert_eq!(optimizer.held_moments(0)?.0.as_ref(), fake(&whole)[0], "the moments compared are not zeros");
        for res in on_groups(2, |tp| {
            let mut local = ParamStore::default();
            for (name, var) in whole.iter() {
                local.push(name, &shard(var.as_tensor(), cfg.split_of(name), tp.rank(), 2)?)?;
            }
            let mut local_opt = AdamW::new(AdamWConfig::default(), &local)?;
            shard_optimizer(&optimizer, &local, &mut local_opt, (tp.rank(), 2), &cfg)?;
            let params = gather_params(&local, &cfg, &tp)?;
            let opt = gather_optimizer(&local_opt, &local, &cfg, &tp)?;
            Ok((params, opt))
        }) {
            let (Some(params), Some(opt)) = res? else { continue };
            assert_eq!(opt.step, 7);
            for (i, ((name, a), b)) in params.iter().zip(&whole.vars).enumerate() {
                assert_eq!(a.dims(), b.dims(), "{name}");
                assert_eq!(a.flatten_all()?.to_vec1::<f32>()?, b.flatten_all()?.to_vec1::<f32>()?, "{name}");
                assert_eq!(opt.held_moments(i)?, optimizer.held_moments(i)?, "{name}");
            }
        }
        Ok(())
    }
}
