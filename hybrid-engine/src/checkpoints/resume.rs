//! Checkpoints: per save, a Hugging Face model directory plus the training state (Adam moments,
//! iteration, data cursor, schedule, seed), under `<root>/iter_NNNNNNN/`, with `<root>/latest`
//! naming the newest complete one (Megatron's layout, HF's files).
//!
//! Every write is atomic ([`crate::durable`]): the checkpoint is assembled in a hidden temporary
//! directory, flushed, put in place, and only then is `latest` replaced (itself through a
//! temporary file). A crash at any point leaves the previous checkpoint and pointer intact.

use crate::checkpoints::hf_io::{self, ModelFiles, LATEST};
use crate::durable::{failpoint, write_dir_atomically, write_file_atomically};
use crate::model::gpt2::Gpt2Config;
use crate::model::params::ParamStore;
use crate::training::optim::AdamW;
use anyhow::{bail, Context, Result};
use candle_core::{Device, Tensor};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// Bumped whenever the training-state layout changes; checked on load.
pub const FORMAT_VERSION: u32 = 1;
pub const TRAINER_STATE: &str = "trainer_state.json";
pub const OPTIMIZER_STATE: &str = "optimizer.safetensors";

/// Everything besides tensors that a resumed run needs to continue exactly.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct TrainerState {
    pub format_version: u32,
    /// Completed optimizer iterations.
    pub iteration: u64,
    pub consumed_samples: u64,
    /// The data sampler's cursor, owned by the step that wrote it.
    pub data_cursor: serde_json::Value,
    pub seed: u64,
    /// The learning-rate schedule and anything else the step wants to check on resume.
    pub run: serde_json::Value,
}

pub fn checkpoint_name(iteration: u64) -> String {
    format!("iter_{iteration:07}")
}

/// Saves a checkpoint for `state.iteration` under `root` and then points `latest` at it.
/// `write_tokenizer` writes tokenizer.json into the directory it is given.
pub fn save_checkpoint(
    root: &Path,
    config: &Gpt2Config,
    params: &ParamStore,
    optimizer: &AdamW,
    state: &TrainerState,
    write_tokenizer: &dyn Fn(&Path) -> Result<()>,
) -> Result<PathBuf> {
    if params.lora_scaling().is_some() {
        // The model directory holds the merged weights, which cannot be split back into a base
        // and adapters to continue from.
        bail!("resumable checkpoints of a model with LoRA adapters are not supported yet (the saved weights are merged): train without LoRA or without checkpoints");
    }
    let name = checkpoint_name(state.iteration);
    let dir = root.join(&name);
    write_dir_atomically(&dir, |tmp| {
        hf_io::write_model_files(tmp, config, params, &[])?;
        write_tokenizer(tmp)?;
        let tensors = optimizer.state_tensors(params)?;
        let meta = HashMap::from([("format".to_string(), "rlhf-adamw".to_string())]);
        safetensors::serialize_to_file(tensors, Some(meta), &tmp.join(OPTIMIZER_STATE))?;
        hf_io::write_json(&tmp.join(TRAINER_STATE), &serde_json::to_value(state)?)
    })?;
    failpoint("checkpoint-before-latest");
    write_file_atomically(&root.join(LATEST), format!("{name}\n").as_bytes())?;
    Ok(dir)
}

/// Saves a finished model as a HF directory at `dir` (replacing a previous one atomically):
/// config.json, model.safetensors (LoRA merged), generation_config.json and, through
/// `write_extra`, tokenizer.json and anything else the step keeps with the model (a LoRA
/// adapter's `adapter/`). What a step hands to the next step or to `chat`.
pub fn save_model_dir(
    dir: &Path,
    config: &Gpt2Config,
    params: &ParamStore,
    write_extra: &dyn Fn(&Path) -> Result<()>,
) -> Result<()> {
    write_dir_atomically(dir, |tmp| {
        hf_io::write_model_files(tmp, config, params, &[])?;
        write_extra(tmp)
    })
    .with_context(|| format!("saving the model to {}", dir.display()))
}

/// A checkpoint read back: the model, the optimizer moments and the trainer state.
pub struct Checkpoint {
    pub model: ModelFiles,
    pub optimizer: HashMap<String, Tensor>,
    pub state: TrainerState,
}

/// Loads the checkpoint `root/latest` points to.
pub fn load_checkpoint(root: &Path, device: &Device) -> Result<Checkpoint> {
    if !root.join(LATEST).is_file() {
        bail!("{} holds no checkpoint (no `latest` file): check --load, or drop it to start fresh", root.display());
    }
    let dir = hf_io::latest_checkpoint(root)?;
    let state_path = dir.join(TRAINER_STATE);
    let text = std::fs::read_to_string(&state_path).with_context(|| format!("cannot read {}", state_path.display()))?;
    let state: TrainerState = serde_json::from_str(&text)
        .map_err(|e| anyhow::anyhow!("{} is not a valid trainer state: {e}", state_path.display()))?;
    if state.format_version != FORMAT_VERSION {
        bail!(
            "{} has training-state format {} but this build reads format {FORMAT_VERSION}: resume with the version that wrote it",
            state_path.display(),
            state.format_version
        );
    }
    let model = hf_io::load_model_dir(&dir, device)?;
    let optimizer = hf_io::read_safetensors(&dir.join(OPTIMIZER_STATE), device)?;
    Ok(Checkpoint { model, optimizer, state })
}
