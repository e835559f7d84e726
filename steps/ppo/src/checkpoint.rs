//! Resumable step 3 (DS-Chat cannot resume PPO): a checkpoint holds the trained models as HF
//! directories (`actor/`, `critic/` (PPO only), `actor_ema/`, LoRA merged) and as raw parameters (LoRA
//! unmerged: what a resume restores), both optimizers' moments and step counts,
//! and the loop's position (epoch, prompt batch, rollout and update counters, PTX cursor), under
//! `<save>/iter_NNNNNNN/` with `<save>/latest`, written atomically. The schedules are pure
//! functions of the optimizer steps, and rollout sampling and dropout are seeded by the step and
//! update numbers, so a resumed run continues as the uninterrupted one would. Checkpoints are
//! taken only between training phases, when no rollout is buffered and no gradient is pending.
//! Across ranks rank 0 writes them, with the optimizers (and under ZeRO-3 the weights and the
//! EMA) gathered whole from the ZeRO shards, and the loop position counts global rollouts: a
//! checkpoint loads into any world size and stage that keeps the global batch sizes.

use anyhow::{bail, Context, Result};
use candle_core::{Device, Tensor};
use data::SamplerCursor;
use data::Tokenizer;
use hybrid_engine::checkpoints::hf_io::{self, LATEST};
use hybrid_engine::checkpoints::resume::checkpoint_name;
use hybrid_engine::durable::{write_dir_atomically, write_file_atomically};
use hybrid_engine::model::gpt2::Gpt2Config;
use hybrid_engine::model::reward_model::{causal_lm_config, sequence_classification_config};
use hybrid_engine::training::optim::AdamW;
use hybrid_engine::training::trainer::TrainerProgress;
use hybrid_engine::ParamStore;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// Bumped whenever the layout changes; checked on load.
pub const PPO_FORMAT_VERSION: u32 = 1;
const STATE: &str = "ppo_state.json";

/// Where the loop stands.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PpoState {
    pub format_version: u32,
    /// Rollouts done (the step counter of the logs).
    pub step: u64,
    /// PPO updates done (dropout keys).
    pub micro: u64,
    /// 1-based epoch and the number of prompt batches of it already rolled out.
    pub epoch: usize,
    pub batches_done: usize,
    pub actor_steps: u64,
    pub critic_steps: u64,
    pub ptx_cursor: SamplerCursor,
    pub rollouts_reused: u64,
    pub answers_dropped_short: u64,
    pub first_reward: Option<f64>,
    /// The KL coefficient the next rollout uses (`--kl-target` adapts it).
    #[serde(default)]
    pub kl_ctl: Option<f64>,
    /// `--normalize-reward`: the scores' running moments so far.
    #[serde(default)]
    pub reward_moments: Option<crate::ppo::RunningMoments>,
    /// Accumulation boundaries, skipped steps and the fp16 loss scale of each model.
    #[serde(default)]
    pub actor_progress: Option<TrainerProgress>,
    #[serde(default)]
    pub critic_progress: Option<TrainerProgress>,
    /// The flags that shape training; a resume must use the same.
    pub run: serde_json::Value,
}

/// A checkpoint read back.
pub struct PpoCheckpoint {
    pub dir: PathBuf,
    pub actor: HashMap<String, Tensor>,
    /// PPO's critic (GRPO and RLOO train none).
    pub critic: Option<HashMap<String, Tensor>>,
    pub ema: Option<HashMap<String, Tensor>>,
    pub actor_optimizer: HashMap<String, Tensor>,
    pub critic_optimizer: Option<HashMap<String, Tensor>>,
    pub state: PpoState,
}

/// The whole weights of the trained models, as saved: the models' own parameters, or under
/// ZeRO stage 3 those gathered from the ranks' shards.
pub struct SavedWeights<'a> {
    pub actor: &'a ParamStore,
    pub critic: Option<&'a ParamStore>,
    pub ema: Option<&'a ParamStore>,
}

/// Saves the models' `weights`, the optimizers (`actor_opt`, `critic_opt`: whole, consolidated
/// from the ranks' shards) and `state` under `root`, then points `latest` at it.
pub fn save(
    root: &Path,
    (actor_cfg, critic_cfg): (&Gpt2Config, Option<&Gpt2Config>),
    weights: &SavedWeights,
    (actor_opt, critic_opt): (&AdamW, Option<&AdamW>),
    state: &PpoState,
    tokenizer: &Tokenizer,
) -> Result<PathBuf> {
    let name = checkpoint_name(state.step);
    let dir = root.join(&name);
    let eos = tokenizer.eos_id();
    write_dir_atomically(&dir, |tmp| {
        let model_dir = |sub: &str| -> Result<PathBuf> {
            let d = tmp.join(sub);
            std::fs::create_dir(&d).with_context(|| format!("cannot create {}", d.display()))?;
            tokenizer.save(&d.join("tokenizer.json"))?;
            Ok(d)
        };
        hf_io::write_model_files(&model_dir("actor")?, &causal_lm_config(actor_cfg), weights.actor, &[])?;
        if let (Some(critic_cfg), Some(weights)) = (critic_cfg, weights.critic) {
            let critic_cfg = sequence_classification_config(critic_cfg, eos);
            hf_io::write_model_files(&model_dir("critic")?, &critic_cfg, weights, &[])?;
        }
        if let Some(ema) = weights.ema {
            hf_io::write_model_files(&model_dir("actor_ema")?, &causal_lm_config(actor_cfg), ema, &[])?;
        }
        // The raw parameters (LoRA adapters unmerged): what a resume restores. The HF
        // directories above hold the merged weights, for people and other tools.
        let raw = |params: &ParamStore| -> Vec<(String, Tensor)> {
            params.iter().map(|(n, v)| (n.to_string(), v.as_tensor().clone())).collect()
        };
        safetensors::serialize_to_file(raw(weights.actor), None, &tmp.join("actor_params.safetensors"))?;
        if let Some(critic) = weights.critic {
            safetensors::serialize_to_file(raw(critic), None, &tmp.join("critic_params.safetensors"))?;
        }
        if let Some(ema) = weights.ema {
            safetensors::serialize_to_file(raw(ema), None, &tmp.join("actor_ema_params.safetensors"))?;
        }
        let meta = HashMap::from([("format".to_string(), "rlhf-adamw".to_string())]);
        // The optimizers cover the trainable parameters (all of them under ZeRO-3, which
        // refuses LoRA).
        let actor_opt = actor_opt.state_tensors(&weights.actor.trainable())?;
        safetensors::serialize_to_file(actor_opt, Some(meta.clone()), &tmp.join("actor_optimizer.safetensors"))?;
        if let (Some(critic_opt), Some(critic)) = (critic_opt, weights.critic) {
            let critic_opt = critic_opt.state_tensors(&critic.trainable())?;
            safetensors::serialize_to_file(critic_opt, Some(meta), &tmp.join("critic_optimizer.safetensors"))?;
        }
        hf_io::write_json(&tmp.join(STATE), &serde_json::to_value(state)?)
    })?;
    write_file_atomically(&root.join(LATEST), format!("{name}\n").as_bytes())?;
    Ok(dir)
}

/// Reads the checkpoint `root/latest` names.
/// Overwrites every parameter of `params` with the checkpoint's value of the same name.
pub fn restore_values(params: &hybrid_engine::ParamStore, saved: &HashMap<String, Tensor>, what: &str) -> Result<()> {
    for (name, var) in params.iter() {
        let Some(t) = saved.get(name) else {
            bail!("the checkpoint's {what} lacks {name}: resume with the flags it was saved with (LoRA included)");
        };
        if t.dims() != var.dims() {
            bail!("the checkpoint's {what} {name} has shape {:?}, the model needs {:?}", t.dims(), var.dims());
        }
        var.set(&t.to_dtype(candle_core::DType::F32)?)?;
    }
    Ok(())
}

/// Reads the checkpoint `root/latest` names.
pub fn load(root: &Path, device: &Device) -> Result<PpoCheckpoint> {
    if !root.join(LATEST).is_file() {
        bail!(
            "{} holds no step-3 checkpoint (no `latest` file): check --load, or drop it to start fresh",
            root.display()
        );
    }
    let dir = hf_io::latest_pointer(root)?;
    let state_path = dir.join(STATE);
    let text = std::fs::read_to_string(&state_path)
        .with_context(|| format!("cannot read {} (is it a step-3 checkpoint?)", state_path.display()))?;
    let state: PpoState = serde_json::from_str(&text)
        .map_err(|e| anyhow::anyhow!("{} is not a valid step-3 state: {e}", state_path.display()))?;
    if state.format_version != PPO_FORMAT_VERSION {
        bail!(
            "{} has format {} but this build reads format {PPO_FORMAT_VERSION}: resume with the version that wrote it",
            state_path.display(),
            state.format_version
        );
    }
    let raw = |file: &str| hf_io::read_safetensors(&dir.join(file), device);
    // The optional files: the EMA, and the critic that only PPO trains (the run fingerprint
    // tells which algorithm saved the checkpoint).
    let optional = |file: &str| if dir.join(file).is_file() { raw(file).map(Some) } else { Ok(None) };
    Ok(PpoCheckpoint {
        actor: raw("actor_params.safetensors")?,
        critic: optional("critic_params.safetensors")?,
        ema: optional("actor_ema_params.safetensors")?,
        actor_optimizer: raw("actor_optimizer.safetensors")?,
        critic_optimizer: optional("critic_optimizer.safetensors")?,
        state,
        dir,
    })
}
