//! The hybrid engine's generation mode (DS-Chat's `DeepSpeedHybridEngine`): one trained model
//! that switches between training and fast generation. Entering generation mode (once per
//! rollout, never per token) gathers the weights (under ZeRO-3 the caller passes the whole
//! weights from [`crate::training::zero3::ShardedModel::gather_params_everywhere`] and drops them
//! after the rollout), fuses LoRA into them (`W + scaling * B A`, into a copy: the
//! training weights and adapters are never touched, so leaving the mode restores training state
//! exactly), turns dropout off, and generates into a KV cache preallocated for
//! `max_prompt + max_answer` positions, kept across rollouts unless `release_inference_cache`.

use crate::comm::ProcessGroup;
use crate::generation::generate::{generate_observed, generate_with_cache, Generation, LeftPadded, SamplingConfig};
use crate::model::gpt2::{Gpt2, Gpt2Cache, Gpt2Config};
use crate::model::params::ParamStore;
use crate::tensor_parallel::shard::{check_divides, shard};
use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use std::collections::HashMap;
use std::sync::Arc;

/// The generation side of the engine.
pub struct GenerationMode {
    /// Positions the KV cache holds: max_prompt + max_answer.
    capacity: usize,
    /// Free the KV cache after every rollout (less memory between rollouts, a reallocation per
    /// rollout).
    release_inference_cache: bool,
    cache: Option<Gpt2Cache>,
    /// The dtype generation computes in: the training compute dtype.
    dtype: DType,
    /// The label of the bar a generation draws over its decoding steps (on a terminal, or
    /// relayed to `train`; no log lines): `None` draws none.
    progress: Option<String>,
}

impl GenerationMode {
    pub fn new(max_prompt: usize, max_answer: usize, release_inference_cache: bool) -> Self {
        Self {
            capacity: max_prompt + max_answer,
            release_inference_cache,
            cache: None,
            dtype: DType::F32,
            progress: None,
        }
    }

    /// Each generation draws a bar named `label` over its decoding steps (PPO's rollouts).
    pub fn with_progress(mut self, label: &str) -> Self {
        self.progress = Some(label.to_string());
        self
    }

    /// Generates in `dtype` (the weights are cast once per rollout, with the LoRA fusion).
    pub fn with_dtype(mut self, dtype: DType) -> Self {
        self.dtype = dtype;
        self
    }

    /// The model generation runs: the whole weights `params` with LoRA fused into the targeted ones
    /// (into new tensors: `ParamStore::merged`), detached (generation records no graph), and
    /// dropout off.
    pub fn model(&self, params: &ParamStore, config: &Gpt2Config) -> Result<Gpt2> {
        let fused = params.merged()?;
        let weights: HashMap<String, Tensor> =
            fused.iter().map(|(n, v)| (n.to_string(), v.as_tensor().detach())).collect();
        let device = params.vars.first().map_or(Device::Cpu, |v| v.device().clone());
        let config = Gpt2Config { resid_pdrop: 0.0, embd_pdrop: 0.0, attn_pdrop: 0.0, ..config.clone() };
        Ok(Gpt2::load(VarBuilder::from_tensors(weights, self.dtype, &device), &config)?)
    }

    /// [`Self::model`] laid out over the tensor-parallel group `tp` (DS-Chat's
    /// `--inference_tp_size`): this rank's slices of the fused weights, split by heads, MLP
    /// columns and vocabulary rows as training under tensor parallelism splits them. Every rank
    /// of `tp` generates the same rows together and ends with the same tokens.
    pub fn model_tensor_parallel(
        &self,
        params: &ParamStore,
        config: &Gpt2Config,
        tp: &Arc<ProcessGroup>,
    ) -> Result<Gpt2> {
        check_divides(config.num_heads(), config.inner_dim(), tp.world())?;
        let fused = params.merged()?;
        let mut weights = HashMap::new();
        for (name, var) in fused.iter() {
            let slice = shard(&var.as_tensor().detach(), config.split_of(name), tp.rank(), tp.world())?;
            weights.insert(name.to_string(), slice);
        }
        self.load_tensor_parallel(weights, config, tp)
    }

    /// [`Self::model_tensor_parallel`] of a model trained under tensor parallelism: `slices` are
    /// already this rank's (`crate::training::tensor_parallel::TensorParallel::slice`). Fusing
    /// LoRA into slices gives the slices of the fused weights (`A` or `B` is cut as its linear).
    pub fn model_of_slices(&self, slices: &ParamStore, config: &Gpt2Config, tp: &Arc<ProcessGroup>) -> Result<Gpt2> {
        let fused = slices.merged()?;
        let weights = fused.iter().map(|(n, v)| (n.to_string(), v.as_tensor().detach())).collect();
        self.load_tensor_parallel(weights, config, tp)
    }

    fn load_tensor_parallel(
        &self,
        weights: HashMap<String, Tensor>,
        config: &Gpt2Config,
        tp: &Arc<ProcessGroup>,
    ) -> Result<Gpt2> {
        let device = weights.values().next().map_or(Device::Cpu, |t| t.device().clone());
        let config = Gpt2Config { resid_pdrop: 0.0, embd_pdrop: 0.0, attn_pdrop: 0.0, ..config.clone() };
        Ok(Gpt2::load_tensor_parallel(VarBuilder::from_tensors(weights, self.dtype, &device), &config, tp)?)
    }

    /// One rollout's generation with `model` (from [`Self::model`]).
    pub fn generate(
        &mut self,
        model: &Gpt2,
        prompts: &LeftPadded,
        sampling: &SamplingConfig,
        device: &Device,
    ) -> Result<Generation> {
        let capacity = self.capacity.min(model.cfg.max_positions());
        let cache = self.cache.get_or_insert_with(|| Gpt2Cache::new(&model.cfg, capacity));
        let out = match &self.progress {
            Some(label) => {
                let steps = sampling.max_new_tokens as u64;
                let mut phase = telemetry::progress::Phase::bar_only(label, "tokens", steps);
                generate_observed(model, prompts, sampling, cache, device, &mut || phase.inc(1))
            }
            None => generate_with_cache(model, prompts, sampling, cache, device),
        };
        if self.release_inference_cache {
            self.cache = None;
        }
        out
    }

    /// Bytes the KV cache holds between rollouts.
    pub fn cache_bytes(&self) -> usize {
        self.cache.as_ref().map_or(0, Gpt2Cache::allocated_bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cache_is_kept_between_rollouts_unless_released_and_outputs_agree() -> Result<()> {
        let dev = Device::Cpu;
        let cfg =
            Gpt2Config { n_layer: 2, n_embd: 16, n_head: 2, n_positions: 32, vocab_size: 40, ..Gpt2Config::tiny() };
        let params = ParamStore::init(&cfg, 9, &dev)?;
        let prompts = LeftPadded::new(&[vec![3, 4, 5], vec![7]], 4, 0);
        let sampling = SamplingConfig::greedy(6, None, 0, 40);
        let mut kept = GenerationMode::new(4, 6, false);
        let mut released = GenerationMode::new(4, 6, true);
        let model = kept.model(&params, &cfg)?;
        let a = kept.generate(&model, &prompts, &sampling, &dev)?;
        assert!(kept.cache_bytes() > 0, "the cache stays allocated for the next rollout");
        let b = kept.generate(&model, &prompts, &sampling, &dev)?;
        let c = released.generate(&model, &prompts, &sampling, &dev)?;
        assert_eq!(released.cache_bytes(), 0, "--release-inference-cache frees it");
        assert_eq!(a, b, "a reused cache gives the same rollout");
        assert_eq!(a, c);
        // A progress bar (PPO's rollouts) changes nothing, and counts one tick a decoding step.
        let mut shown = GenerationMode::new(4, 6, false).with_progress("generating the rollout");
        assert_eq!(shown.generate(&model, &prompts, &sampling, &dev)?, a);
        let mut ticks = 0;
        let mut cache = Gpt2Cache::new(&model.cfg, 10);
        let observed = generate_observed(&model, &prompts, &sampling, &mut cache, &dev, &mut || ticks += 1)?;
        assert_eq!(observed, a);
        assert_eq!(ticks, a.tokens.iter().map(Vec::len).max().unwrap_or(0), "one tick a decoding step");
        // Generation mode turns dropout off whatever the training config says (tiny's is 0.1),
        // laid out for tensor parallelism too (here one rank, generating what the whole model
        // generates).
        assert_eq!((cfg.resid_pdrop, cfg.embd_pdrop, cfg.attn_pdrop), (0.1, 0.1, 0.1));
        let tp = Arc::new(ProcessGroup::single());
        let split = kept.model_tensor_parallel(&params, &cfg, &tp)?;
        let mut slices = ParamStore::default();
        for (name, v) in params.iter() {
            slices.push(name, &shard(v, cfg.split_of(name), 0, 1)?)?;
        }
        let sliced = kept.model_of_slices(&slices, &cfg, &tp)?;
        for m in [&model, &split, &sliced] {
            assert_eq!((m.cfg.resid_pdrop, m.cfg.embd_pdrop, m.cfg.attn_pdrop), (0.0, 0.0, 0.0));
            assert_eq!(kept.generate(m, &prompts, &sampling, &dev)?, a);
        }
        // And reads the training weights unchanged when there is nothing to fuse.
        let training = params.model(&cfg)?;
        let ids = Tensor::new(&[[1u32, 2, 3]], &dev)?;
        let pos = crate::model::positions::Positions::default();
        let d =
            (model.forward(&ids, &pos, None, None)? - training.forward(&ids, &pos, None, None)?)?.abs()?.max_all()?;
        assert_eq!(d.to_scalar::<f32>()?, 0.0);
        Ok(())
    }

    #[test]
    fn entering_generation_mode_with_lora_leaves_the_training_state_untouched() -> Result<()> {
        let dev = Device::Cpu;
        let cfg =
            Gpt2Config { n_layer: 2, n_embd: 16, n_head: 2, n_positions: 32, vocab_size: 40, ..Gpt2Config::tiny() };
        let mut params = ParamStore::init(&cfg, 9, &dev)?;
        params.add_lora(&cfg, &lora::LoraConfig { dim: 2, alpha: None, module_name: "h.".into() }, 1)?;
        for (name, var) in params.iter() {
            if name.ends_with("lora_B.weight") {
                var.set(&Tensor::randn(0f32, 0.3, var.shape(), &dev)?)?;
            }
        }
        let snapshot = |p: &ParamStore| -> candle_core::Result<Vec<Vec<f32>>> {
            p.vars.iter().map(|v| v.flatten_all()?.to_vec1()).collect()
        };
        let before = snapshot(&params)?;
        let fused = GenerationMode::new(4, 4, false).model(&params, &cfg)?;
        assert_eq!(before, snapshot(&params)?, "fusing works on a copy: weights and adapters are unchanged");
        // The fused model computes what the unfused training model computes.
        let ids = Tensor::new(&[[1u32, 2, 3, 4]], &dev)?;
        let pos = crate::model::positions::Positions::default();
        let d = (fused.forward(&ids, &pos, None, None)? - params.model(&cfg)?.forward(&ids, &pos, None, None)?)?;
        assert!(d.abs()?.max_all()?.to_scalar::<f32>()? < 1e-5);
        Ok(())
    }
}
