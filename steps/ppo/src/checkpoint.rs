//! Resumable step 3 (DS-Chat cannot resume PPO): a checkpoint holds the trained models as HF
//! directories (`actor/`, `critic/` (PPO only), `actor_ema/`, LoRA merged) and as raw parameters (LoRA
//! unmerged: what a resume restores), both optimizers' moments and step counts,
//! and the loop's position (epoch, prompt batch, rollout and update counters, PTX cursor), under
//! `<save>/iter_NNNNNNN/` with `<save>/latest`, written atomically. The schedules are pure
//! functions of the optimizer steps, and rollout sampling and dropout are seeded by the step and
//! update numbers, so a resumed run continues as the uninterrupted one would. Checkpoints are
//! taken only between training phases, when no rollout is buffered and no gradient is pending.
//!
//! Across ranks a model whole on rank 0 (gathered from ZeRO-1/2 optimizer shards or TP slices)
//! is written by rank 0: `<model>_params.safetensors` and `<model>_optimizer.safetensors`. A model
//! sharded at rest (ZeRO stage 3 without TP) is never gathered whole: every rank writes its
//! optimizer shard into `<model>_optimizer/` (`optimizer_shards`' files and manifest), and rank 0
//! writes its HF directory unit by unit as the units are gathered (which then holds exactly its
//! parameters, LoRA adapters unmerged: no raw file; a resume at stage 3 reads it by slices). The loop position counts global rollouts: a checkpoint
//! loads into any world size, stage and TP size that keeps the global batch sizes.

use anyhow::{bail, Context, Result};
use candle_core::{Device, Tensor};
use data::SamplerCursor;
use data::Tokenizer;
use hybrid_engine::checkpoints::hf_io::{self, LATEST};
use hybrid_engine::checkpoints::optimizer_shards;
use hybrid_engine::checkpoints::resume::{agree, checkpoint_name, write_sharded_weights, OptimizerState};
use hybrid_engine::checkpoints::sharded_io::ModelSlices;
use hybrid_engine::comm::ProcessGroup;
use hybrid_engine::durable::{write_dir_atomically, write_file_atomically};
use hybrid_engine::model::gpt2::Gpt2Config;
use hybrid_engine::training::optim::AdamW;
use hybrid_engine::training::trainer::TrainerProgress;
use hybrid_engine::training::zero3::ShardedModel;
use hybrid_engine::ParamStore;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// Bumped whenever the layout changes; checked on load. Format 1 held every model whole; 2 adds
/// models saved sharded (format 1 checkpoints still load).
pub const PPO_FORMAT_VERSION: u32 = 2;
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
    pub actor: SavedValues,
    /// PPO's critic (GRPO and RLOO train none).
    pub critic: Option<SavedValues>,
    pub ema: Option<SavedValues>,
    pub actor_optimizer: OptimizerState,
    pub critic_optimizer: Option<OptimizerState>,
    pub state: PpoState,
}

/// A trained model's values in a checkpoint.
pub enum SavedValues {
    /// The raw parameters by name (LoRA adapters unmerged), read.
    Raw(HashMap<String, Tensor>),
    /// Saved sharded: its HF directory holds exactly its parameters, read whole or by slices.
    ModelDir(PathBuf),
}

impl SavedValues {
    /// Every parameter by name (the trunk's and a critic's `score.weight`), whole.
    pub fn whole(&self, device: &Device) -> Result<HashMap<String, Tensor>> {
        match self {
            Self::Raw(tensors) => Ok(tensors.clone()),
            Self::ModelDir(dir) => {
                let files = hf_io::load_model_dir(dir, device)?;
                Ok(files.tensors.into_iter().chain(files.extra_tensors).collect())
            }
        }
    }

    /// This rank's shard-shaped values of `model`'s parameters as saved here (a resumed EMA of
    /// a sharded actor): read by slices from a directory, or cut from the raw tensors.
    pub fn read_shard(&self, model: &ShardedModel) -> Result<Vec<f32>> {
        match self {
            Self::ModelDir(dir) => {
                let slices = ModelSlices::open(dir)?;
                model.read_shard_values(|name, range| slices.read(name, range))
            }
            Self::Raw(tensors) => model.read_shard_values(|name, range| {
                let t = tensors.get(name).ok_or_else(|| anyhow::anyhow!("the checkpoint lacks {name}"))?;
                Ok(t.flatten_all()?
                    .narrow(0, range.start, range.len())?
                    .to_dtype(candle_core::DType::F32)?
                    .to_vec1()?)
            }),
        }
    }

    /// The HF directory of a model saved sharded.
    pub fn model_dir(&self) -> Option<&Path> {
        match self {
            Self::ModelDir(dir) => Some(dir),
            Self::Raw(_) => None,
        }
    }
}

/// How a model goes into a checkpoint, as the ranks hold it.
pub enum ModelSave<'a> {
    /// Whole on rank 0 (`None` on the others): the weights and, for a trained model, its
    /// optimizer with whole moments.
    Whole(Option<(&'a ParamStore, Option<&'a AdamW>)>),
    /// Sharded at rest (ZeRO stage 3 without TP): the weights, or with `values` every rank's
    /// shard-shaped values of its parameters (the EMA), and this rank's optimizer shard.
    Sharded { model: &'a ShardedModel, values: Option<&'a [f32]>, optimizer: Option<&'a AdamW> },
}

/// A model of a checkpoint: its name (`actor`, `critic`, `actor_ema`), its HF config, how it is
/// saved.
pub struct SavedModel<'a> {
    pub name: &'static str,
    pub config: Gpt2Config,
    pub save: ModelSave<'a>,
}

/// Saves `models` and `state` under `root`, then points `latest` at it: every rank of `group`
/// together (a collective; models saved sharded are written by every rank, the rest by rank 0).
/// Returns the directory on rank 0.
pub fn save(
    group: &ProcessGroup,
    root: &Path,
    models: &[SavedModel],
    state: &PpoState,
    tokenizer: &Tokenizer,
) -> Result<Option<PathBuf>> {
    let (rank, world, first) = (group.rank(), group.world(), group.is_first());
    let name = checkpoint_name(state.step);
    let staging = root.join(format!(".shards-{name}"));
    let sharded: Vec<_> = models
        .iter()
        .filter_map(|m| match m.save {
            ModelSave::Sharded { model, values, optimizer } => Some((m.name, model, values, optimizer)),
            ModelSave::Whole(_) => None,
        })
        .collect();
    if !sharded.is_empty() {
        agree(group, "create the checkpoint's staging directory", || {
            if first {
                let _ = std::fs::remove_dir_all(&staging);
                for (name, ..) in &sharded {
                    for sub in [name.to_string(), format!("{name}_optimizer")] {
                        let d = staging.join(sub);
                        std::fs::create_dir_all(&d).with_context(|| format!("cannot create {}", d.display()))?;
                    }
                }
            }
            Ok(())
        })?;
    }
    for &(name, model, values, optimizer) in &sharded {
        if let Some(optimizer) = optimizer {
            let dir = staging.join(format!("{name}_optimizer"));
            agree(group, &format!("write its {name} optimizer shard"), || {
                optimizer_shards::write_shard(&dir, rank, world, optimizer, model.trained_names())
            })?;
        }
        let dir = first.then(|| staging.join(name));
        agree(group, &format!("write the {name}"), || write_sharded_weights(model, values, dir.as_deref()))?;
    }
    let dir = root.join(&name);
    agree(group, "assemble the checkpoint", || {
        if !first {
            return Ok(());
        }
        write_dir_atomically(&dir, |tmp| {
            for model in models {
                assemble_model(tmp, model, &staging, world, tokenizer)?;
            }
            hf_io::write_json(&tmp.join(STATE), &serde_json::to_value(state)?)
        })?;
        let _ = std::fs::remove_dir_all(&staging);
        write_file_atomically(&root.join(LATEST), format!("{name}\n").as_bytes())
    })?;
    Ok(first.then_some(dir))
}

/// Rank 0: `model`'s files in the checkpoint being assembled in `tmp`: written from its whole
/// weights and optimizer, or moved from where the ranks staged them.
fn assemble_model(tmp: &Path, model: &SavedModel, staging: &Path, world: usize, tokenizer: &Tokenizer) -> Result<()> {
    let name = model.name;
    let dir = tmp.join(name);
    std::fs::create_dir(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    tokenizer.save(&dir.join("tokenizer.json"))?;
    match &model.save {
        ModelSave::Whole(None) => bail!("internal error: rank 0 saves the {name} without its weights"),
        ModelSave::Whole(Some((params, optimizer))) => {
            hf_io::write_model_files(&dir, &model.config, params, &[])?;
            // The raw parameters (LoRA adapters unmerged): what a resume restores. The HF
            // directory holds the merged weights, for people and other tools.
            let raw: Vec<(String, Tensor)> =
                params.iter().map(|(n, v)| (n.to_string(), v.as_tensor().clone())).collect();
            let raw_path = tmp.join(format!("{name}_params.safetensors"));
            safetensors::serialize_to_file(raw, None, &raw_path)?;
            hybrid_engine::durable::set_created_permissions(&raw_path)?;
            if let Some(optimizer) = optimizer {
                let meta = HashMap::from([("format".to_string(), "rlhf-adamw".to_string())]);
                let moments = optimizer.state_tensors(&params.trainable())?;
                let path = tmp.join(format!("{name}_optimizer.safetensors"));
                safetensors::serialize_to_file(moments, Some(meta), &path)?;
                hybrid_engine::durable::set_created_permissions(&path)?;
            }
        }
        ModelSave::Sharded { model: sharded, optimizer, .. } => {
            hf_io::write_config_files(&dir, &model.config)?;
            std::fs::rename(staging.join(name).join(hf_io::WEIGHTS), dir.join(hf_io::WEIGHTS))
                .with_context(|| format!("moving the {name}'s weights into the checkpoint"))?;
            if optimizer.is_some() {
                let opt_dir = tmp.join(format!("{name}_optimizer"));
                std::fs::rename(staging.join(format!("{name}_optimizer")), &opt_dir)
                    .with_context(|| format!("moving the {name}'s optimizer shards into the checkpoint"))?;
                let manifest =
                    optimizer_shards::manifest(world, world, sharded.trained_names(), &sharded.trained_numels());
                hf_io::write_json(&opt_dir.join(optimizer_shards::MANIFEST), &serde_json::to_value(&manifest)?)?;
            }
        }
    }
    Ok(())
}

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
    if !(1..=PPO_FORMAT_VERSION).contains(&state.format_version) {
        bail!(
            "{} has format {} but this build reads formats 1 to {PPO_FORMAT_VERSION}: resume with the version that wrote it",
            state_path.display(),
            state.format_version
        );
    }
    // Each model's values and optimizer as it was saved: whole files, or a model saved sharded
    // (its HF directory, its optimizer's shards). The critic is optional (the run fingerprint
    // tells which algorithm saved the checkpoint), the EMA too.
    let values = |name: &str| -> Result<Option<SavedValues>> {
        let raw = dir.join(format!("{name}_params.safetensors"));
        if raw.is_file() {
            return Ok(Some(SavedValues::Raw(hf_io::read_safetensors(&raw, device)?)));
        }
        Ok(dir.join(name).join(hf_io::CONFIG).is_file().then(|| SavedValues::ModelDir(dir.join(name))))
    };
    let optimizer = |name: &str| -> Result<Option<OptimizerState>> {
        let whole = dir.join(format!("{name}_optimizer.safetensors"));
        let shards = dir.join(format!("{name}_optimizer"));
        if whole.is_file() {
            Ok(Some(OptimizerState::Whole(hf_io::read_safetensors(&whole, device)?)))
        } else if shards.is_dir() {
            Ok(Some(OptimizerState::Shards { manifest: optimizer_shards::read_manifest(&shards)?, dir: shards }))
        } else {
            Ok(None)
        }
    };
    let missing =
        |what: &str| anyhow::anyhow!("{} lacks the {what}: it is not a complete step-3 checkpoint", dir.display());
    Ok(PpoCheckpoint {
        actor: values("actor")?.ok_or_else(|| missing("actor"))?,
        critic: values("critic")?,
        ema: values("actor_ema")?,
        actor_optimizer: optimizer("actor")?.ok_or_else(|| missing("actor's optimizer"))?,
        critic_optimizer: optimizer("critic")?,
        state,
        dir,
    })
}
