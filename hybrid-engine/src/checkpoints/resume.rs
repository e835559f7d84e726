//! Checkpoints: per save, a Hugging Face model directory plus the training state (Adam moments,
//! iteration, data cursor, schedule, seed), under `<root>/iter_NNNNNNN/`, with `<root>/latest`
//! naming the newest complete one (Megatron's layout, HF's files).
//!
//! Every write is atomic ([`crate::durable`]): the checkpoint is assembled in a hidden temporary
//! directory, flushed, put in place, and only then is `latest` replaced (itself through a
//! temporary file). A crash at any point leaves the previous checkpoint and pointer intact.
//!
//! With N ranks the optimizer state is written by every rank that holds a distinct piece of it
//! (`optimizer_shards`): each writes its file into a staging directory next to the checkpoints,
//! then rank 0 moves the files into the checkpoint it assembles and puts that in place as above.
//! A rank that dies before that leaves at most the staging directory, which the next save
//! replaces.

use crate::checkpoints::hf_io::{self, ModelFiles, LATEST};
use crate::checkpoints::optimizer_shards::{self, Manifest};
use crate::checkpoints::sharded_io::StreamedSafetensors;
use crate::comm::{ProcessGroup, ReduceOp};
use crate::durable::{failpoint, write_dir_atomically, write_file_atomically};
use crate::model::gpt2::Gpt2Config;
use crate::model::params::ParamStore;
use crate::training::optim::AdamW;
use crate::training::zero3::ShardedModel;
use anyhow::{bail, Context, Result};
use candle_core::{Device, Tensor};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// Bumped whenever the training-state layout changes; checked on load. Format 1 kept the
/// optimizer state in one `optimizer.safetensors`; 2 in per-rank shards with a manifest.
pub const FORMAT_VERSION: u32 = 2;
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

/// Saves a one-process checkpoint for `state.iteration` under `root` and then points `latest`
/// at it. `write_tokenizer` writes tokenizer.json into the directory it is given.
pub fn save_checkpoint(
    root: &Path,
    config: &Gpt2Config,
    params: &ParamStore,
    optimizer: &AdamW,
    state: &TrainerState,
    write_tokenizer: &dyn Fn(&Path) -> Result<()>,
) -> Result<PathBuf> {
    let numels: Vec<usize> = params.vars.iter().map(|v| v.elem_count()).collect();
    let shard = OptimizerShard { optimizer, names: &params.names, numels: &numels, sharded: false };
    let group = ProcessGroup::single();
    let dir =
        save_checkpoint_across(&group, root, config, SavedModel::Whole(Some(params)), shard, state, write_tokenizer)?;
    dir.ok_or_else(|| anyhow::anyhow!("internal error: a one-process save wrote no checkpoint"))
}

/// The model a checkpoint holds, as the ranks hold it.
pub enum SavedModel<'a> {
    /// Whole on rank 0 (`None` on the other ranks).
    Whole(Option<&'a ParamStore>),
    /// Sharded over the ranks (ZeRO stage 3): gathered unit by unit, every rank taking part,
    /// and written by rank 0 as each unit arrives, so no rank holds the whole model.
    Sharded(&'a ShardedModel),
}

impl SavedModel<'_> {
    fn has_lora(&self) -> bool {
        match self {
            Self::Whole(params) => params.is_some_and(|p| p.lora_scaling().is_some()),
            Self::Sharded(model) => model.has_lora(),
        }
    }
}

/// Writes `model.safetensors` of a sharded model into `dir` (on rank 0; `None` on the others),
/// every rank taking part in the gathers: of its weights, or with `values` of every rank's
/// shard-shaped values of its parameters (an EMA of the weights). Its parameters as trained
/// (LoRA adapters apart: a checkpoint's); [`write_sharded_merged_weights`] for a model's.
pub fn write_sharded_weights(model: &ShardedModel, values: Option<&[f32]>, dir: Option<&Path>) -> Result<()> {
    write_streamed_weights(model, values, dir, false)
}

/// [`write_sharded_weights`] of the model as a consolidated save holds it: LoRA adapters fused
/// into their linears, block by block ([`ShardedModel::visit_gathered_merged`]).
pub fn write_sharded_merged_weights(model: &ShardedModel, values: Option<&[f32]>, dir: Option<&Path>) -> Result<()> {
    write_streamed_weights(model, values, dir, true)
}

fn write_streamed_weights(
    model: &ShardedModel,
    values: Option<&[f32]>,
    dir: Option<&Path>,
    merged: bool,
) -> Result<()> {
    let mut file = dir
        .map(|dir| {
            let shapes: Vec<(&str, &candle_core::Shape)> = match merged {
                true => model.merged_shapes().collect(),
                false => model.parameter_shapes().collect(),
            };
            let tensors: Vec<(String, Vec<usize>)> =
                shapes.into_iter().map(|(n, s)| (hf_io::hf_name(n), s.dims().to_vec())).collect();
            StreamedSafetensors::create(&dir.join(hf_io::WEIGHTS), &tensors, &hf_io::weights_metadata())
        })
        .transpose();
    let write = |name: &str, values: &Tensor| match &mut file {
        Ok(Some(file)) => file.write(&hf_io::hf_name(name), values),
        Ok(None) => Ok(()),
        Err(e) => Err(anyhow::anyhow!("{e:#}")),
    };
    match (merged, values) {
        (true, values) => model.visit_gathered_merged(values, write)?,
        (false, Some(values)) => model.visit_gathered(values, write)?,
        (false, None) => model.visit_gathered_params(write)?,
    }
    file?.map_or(Ok(()), StreamedSafetensors::finish)
}

/// What a rank contributes to a checkpoint's optimizer state.
pub struct OptimizerShard<'a> {
    /// Holding the moments of its pieces (all of them without ZeRO sharding).
    pub optimizer: &'a AdamW,
    /// Every parameter's name and number of values, in the model's order.
    pub names: &'a [String],
    pub numels: &'a [usize],
    /// Ranks hold different pieces (ZeRO stages 1-3): each writes its own file. Otherwise rank
    /// 0's copy is the state.
    pub sharded: bool,
}

/// Saves a checkpoint from every rank of `group` together (a collective): the ranks' optimizer
/// files, the model (whole on rank 0, or gathered from the shards and written by rank 0 unit by
/// unit), and from rank 0 the manifest and the trainer state; then `latest`. Returns the
/// directory on rank 0.
pub fn save_checkpoint_across(
    group: &ProcessGroup,
    root: &Path,
    config: &Gpt2Config,
    model: SavedModel,
    shard: OptimizerShard,
    state: &TrainerState,
    write_tokenizer: &dyn Fn(&Path) -> Result<()>,
) -> Result<Option<PathBuf>> {
    let (rank, world) = (group.rank(), group.world());
    let name = checkpoint_name(state.iteration);
    let staging = root.join(format!(".shards-{name}"));
    agree(group, "create the checkpoint's staging directory", || {
        if rank == 0 {
            if model.has_lora() {
                // The model directory holds the merged weights, which cannot be split back into
                // a base and adapters to continue from.
                bail!("resumable checkpoints of a model with LoRA adapters are not supported yet (the saved weights are merged): train without LoRA or without checkpoints");
            }
            let _ = std::fs::remove_dir_all(&staging);
            std::fs::create_dir_all(&staging).with_context(|| format!("cannot create {}", staging.display()))?;
        }
        Ok(())
    })?;
    let writers = if shard.sharded { world } else { 1 };
    agree(group, "write its optimizer shard", || match rank < writers {
        true => optimizer_shards::write_shard(&staging, rank, world, shard.optimizer, shard.names),
        false => Ok(()),
    })?;
    if let SavedModel::Sharded(model) = &model {
        agree(group, "write the model", || {
            write_sharded_weights(model, None, (rank == 0).then_some(staging.as_path()))
        })?;
    }
    let dir = root.join(&name);
    agree(group, "assemble the checkpoint", || {
        if rank != 0 {
            return Ok(());
        }
        let manifest = optimizer_shards::manifest(world, writers, shard.names, shard.numels);
        write_dir_atomically(&dir, |tmp| {
            match &model {
                SavedModel::Whole(params) => {
                    let params =
                        params.ok_or_else(|| anyhow::anyhow!("internal error: rank 0 saves without the model"))?;
                    hf_io::write_model_files(tmp, config, params, &[])?;
                }
                SavedModel::Sharded(_) => {
                    hf_io::write_config_files(tmp, config)?;
                    std::fs::rename(staging.join(hf_io::WEIGHTS), tmp.join(hf_io::WEIGHTS))
                        .context("moving the model's weights into the checkpoint")?;
                }
            }
            write_tokenizer(tmp)?;
            for f in &manifest.files {
                std::fs::rename(staging.join(f), tmp.join(f))
                    .with_context(|| format!("moving {f} into the checkpoint"))?;
            }
            hf_io::write_json(&tmp.join(optimizer_shards::MANIFEST), &serde_json::to_value(&manifest)?)?;
            hf_io::write_json(&tmp.join(TRAINER_STATE), &serde_json::to_value(state)?)
        })?;
        let _ = std::fs::remove_dir_all(&staging);
        failpoint("checkpoint-before-latest");
        write_file_atomically(&root.join(LATEST), format!("{name}\n").as_bytes())
    })?;
    Ok((rank == 0).then_some(dir))
}

/// Runs `f` on every rank and fails on all of them if it failed on any (each failing rank
/// returns its own error; the others say which rank failed), so no rank waits on a rank that
/// gave up.
pub fn agree(group: &ProcessGroup, what: &str, f: impl FnOnce() -> Result<()>) -> Result<()> {
    let result = f();
    if group.world() == 1 {
        return result;
    }
    let mut failed = [if result.is_err() { group.rank() as f64 + 1.0 } else { 0.0 }];
    group.all_reduce_scalars(&mut failed, ReduceOp::Max)?;
    result?;
    if failed[0] > 0.0 {
        bail!("rank {} could not {what}; no checkpoint was written", failed[0] as usize - 1);
    }
    Ok(())
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

/// [`save_model_dir`] of a model sharded over `group`'s ranks (ZeRO stage 3; a collective), or
/// with `values` of every rank's shard-shaped values of its parameters (an EMA): the
/// blocks are gathered one by one and rank 0 writes each into `model.safetensors` as it arrives,
/// LoRA adapters fused into their linears (its peak: its shard plus one block), in a hidden
/// staging directory beside `dir`, then puts the directory in place atomically with
/// `write_extra`'s files, keeping what no save wrote.
pub fn save_sharded_model_dir(
    group: &ProcessGroup,
    dir: &Path,
    config: &Gpt2Config,
    model: &ShardedModel,
    values: Option<&[f32]>,
    write_extra: &dyn Fn(&Path) -> Result<()>,
) -> Result<()> {
    let first = group.is_first();
    let name = dir.file_name().map_or("model".into(), |n| n.to_string_lossy().into_owned());
    let staging = dir.parent().unwrap_or(Path::new(".")).join(format!(".{name}.gathering"));
    agree(group, "create the model's staging directory", || {
        if first {
            let _ = std::fs::remove_dir_all(&staging);
            std::fs::create_dir_all(&staging).with_context(|| format!("cannot create {}", staging.display()))?;
        }
        Ok(())
    })?;
    agree(group, "write the model", || {
        write_sharded_merged_weights(model, values, first.then_some(staging.as_path()))
    })?;
    agree(group, "save the model", || {
        if !first {
            return Ok(());
        }
        let saved = write_dir_atomically(dir, |tmp| {
            hf_io::write_config_files(tmp, config)?;
            std::fs::rename(staging.join(hf_io::WEIGHTS), tmp.join(hf_io::WEIGHTS))
                .context("moving the model's weights into place")?;
            write_extra(tmp)
        })
        .with_context(|| format!("saving the model to {}", dir.display()));
        let _ = std::fs::remove_dir_all(&staging);
        saved
    })
}

/// A checkpoint read back: the model, the optimizer moments and the trainer state.
pub struct Checkpoint {
    pub model: ModelFiles,
    pub optimizer: OptimizerState,
    pub state: TrainerState,
}

/// A checkpoint's AdamW moments, restored into an optimizer of any layout.
pub enum OptimizerState {
    /// Format 1: every moment whole in one file, read.
    Whole(HashMap<String, Tensor>),
    /// Format 2: per-rank files, read when restored.
    Shards { dir: PathBuf, manifest: Manifest },
}

impl OptimizerState {
    /// Fills the moments `optimizer` holds (parameter `i` is `names[i]`, `numels[i]` values),
    /// whatever world size and ZeRO stage wrote them.
    pub fn restore(&self, optimizer: &mut AdamW, names: &[String], numels: &[usize]) -> Result<()> {
        match self {
            Self::Shards { dir, manifest } => optimizer_shards::load_into(dir, manifest, optimizer, names, numels),
            Self::Whole(tensors) => {
                for (i, (name, &n)) in names.iter().zip(numels).enumerate() {
                    let read = |key: &str| -> Result<Vec<f32>> {
                        let k = format!("{key}.{name}");
                        let t = tensors.get(&k).ok_or_else(|| {
                            anyhow::anyhow!("optimizer state lacks {k}: the checkpoint does not match this model")
                        })?;
                        if t.elem_count() != n {
                            bail!("optimizer state {k} has {} values, the model needs {n}", t.elem_count());
                        }
                        Ok(t.flatten_all()?.to_dtype(candle_core::DType::F32)?.to_vec1()?)
                    };
                    let (m, v) = (read("exp_avg")?, read("exp_avg_sq")?);
                    optimizer.fill_held(i, 0..n, &m, &v)?;
                }
                Ok(())
            }
        }
    }
}

/// Loads the checkpoint `root/latest` points to.
pub fn load_checkpoint(root: &Path, device: &Device) -> Result<Checkpoint> {
    let (dir, optimizer, state) = load_training_state(root, device)?;
    let model = hf_io::load_model_dir(&dir, device)?;
    Ok(Checkpoint { model, optimizer, state })
}

/// The checkpoint `root/latest` points to, without its model: its directory (whose model a
/// ZeRO-3 rank reads by slices, [`crate::checkpoints::sharded_io::ModelSlices`]), the optimizer
/// moments and the trainer state.
pub fn load_training_state(root: &Path, device: &Device) -> Result<(PathBuf, OptimizerState, TrainerState)> {
    if !root.join(LATEST).is_file() {
        bail!("{} holds no checkpoint (no `latest` file): check --load, or drop it to start fresh", root.display());
    }
    let dir = hf_io::latest_checkpoint(root)?;
    let state_path = dir.join(TRAINER_STATE);
    let text = std::fs::read_to_string(&state_path).with_context(|| format!("cannot read {}", state_path.display()))?;
    let state: TrainerState = serde_json::from_str(&text)
        .map_err(|e| anyhow::anyhow!("{} is not a valid trainer state: {e}", state_path.display()))?;
    let optimizer = match state.format_version {
        1 => OptimizerState::Whole(hf_io::read_safetensors(&dir.join(OPTIMIZER_STATE), device)?),
        FORMAT_VERSION => OptimizerState::Shards { manifest: optimizer_shards::read_manifest(&dir)?, dir: dir.clone() },
        other => bail!(
            "{} has training-state format {other} but this build reads formats 1 and {FORMAT_VERSION}: resume with the version that wrote it",
            state_path.display(),
        ),
    };
    Ok((dir, optimizer, state))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::on_groups;
    use crate::training::optim::AdamWConfig;

    /// A rank that fails fails every rank: itself with its own error, the others naming it (the
    /// highest such rank when several fail), so no rank goes on to a collective the failed one
    /// will never join.
    #[test]
    fn a_step_that_fails_on_one_rank_fails_on_every_rank_naming_it() {
        for failing in [vec![1], vec![0, 2], vec![]] {
            let results = on_groups(3, |group| {
                agree(&group, "write its shard", || match failing.contains(&group.rank()) {
                    true => bail!("disk full on rank {}", group.rank()),
                    false => Ok(()),
                })
            });
            for (r, result) in results.into_iter().enumerate() {
                match (failing.contains(&r), failing.iter().max(), result) {
                    (true, _, Err(e)) => assert_eq!(e.to_string(), format!("disk full on rank {r}")),
                    (false, Some(worst), Err(e)) => assert_eq!(
                        e.to_string(),
                        format!("rank {worst} could not write its shard; no checkpoint was written")
                    ),
                    (false, None, Ok(())) => {}
                    (_, _, result) => panic!("rank {r} with {failing:?} failing: {result:?}"),
                }
            }
        }
    }

    fn state(iteration: u64) -> TrainerState {
        let run = serde_json::json!({});
        TrainerState {
            format_version: FORMAT_VERSION,
            iteration,
            consumed_samples: 0,
            data_cursor: run.clone(),
            seed: 1,
            run,
        }
    }

    /// Two ranks save their halves of the moments together and the checkpoint restores them
    /// into one rank; a later save that fails on rank 0 fails on both ranks and leaves `latest`
    /// at the first checkpoint, whole, as does the refused save of a model with LoRA adapters.
    #[test]
    fn ranks_save_their_shards_together_and_a_failed_save_keeps_the_last() -> Result<()> {
        let config =
            Gpt2Config { n_layer: 1, n_embd: 8, n_head: 2, n_positions: 8, vocab_size: 12, ..Gpt2Config::tiny() };
        let params = ParamStore::init(&config, 3, &Device::Cpu)?;
        let names = params.names.clone();
        let numels: Vec<usize> = params.vars.iter().map(|v| v.elem_count()).collect();
        // Moment j of parameter i is (i, j) in a number of its own, so a misplaced value shows.
        let moments = |i: usize, r: std::ops::Range<usize>| -> (Vec<f32>, Vec<f32>) {
            r.map(|j| (i as f32 * 1000.0 + j as f32, -(i as f32) - j as f32 / 1000.0)).unzip()
        };
        let root = tempfile::tempdir()?;
        let save = |iteration: u64, fail_on_first: bool| {
            on_groups(2, |group| {
                let halves =
                    numels.iter().map(|&n| if group.rank() == 0 { 0..n / 2 } else { n / 2..n }).collect::<Vec<_>>();
                let mut optimizer = AdamW::over_ranges(AdamWConfig::default(), &names, halves.clone());
                for (i, held) in halves.into_iter().enumerate() {
                    let (m, v) = moments(i, held.clone());
                    optimizer.fill_held(i, held, &m, &v)?;
                }
                let shard = OptimizerShard { optimizer: &optimizer, names: &names, numels: &numels, sharded: true };
                let model = SavedModel::Whole(group.is_first().then_some(&params));
                let tokenizer = |_: &Path| match fail_on_first {
                    true => bail!("no space left for tokenizer.json"),
                    false => Ok(()),
                };
                save_checkpoint_across(&group, root.path(), &config, model, shard, &state(iteration), &tokenizer)
            })
        };
        let saved: Vec<Option<PathBuf>> = save(1, false).into_iter().collect::<Result<_>>()?;
        assert_eq!(saved, [Some(root.path().join("iter_0000001")), None]);
        let failed = save(2, true);
        assert_eq!(failed[0].as_ref().unwrap_err().to_string(), "no space left for tokenizer.json");
        let on_second = failed[1].as_ref().unwrap_err().to_string();
        assert_eq!(on_second, "rank 0 could not assemble the checkpoint; no checkpoint was written");
        assert!(!root.path().join("iter_0000002").exists(), "no partial checkpoint is left in place");

        let (dir, optimizer, trainer) = load_training_state(root.path(), &Device::Cpu)?;
        assert_eq!((dir, trainer), (root.path().join("iter_0000001"), state(1)));
        let whole: Vec<_> = numels.iter().map(|&n| 0..n).collect();
        let mut restored = AdamW::over_ranges(AdamWConfig::default(), &names, whole.clone());
        optimizer.restore(&mut restored, &names, &numels)?;
        for (i, held) in whole.into_iter().enumerate() {
            let (m, v) = restored.held_moments(i)?;
            assert_eq!((m.to_vec(), v.to_vec()), moments(i, held), "{}", names[i]);
        }

        // A model with LoRA adapters is refused (its saved weights would be merged), and the
        // refusal leaves `latest` where it was.
        let mut adapted = ParamStore::init(&config, 3, &Device::Cpu)?;
        adapted.add_lora(&config, &lora::LoraConfig { dim: 2, alpha: None, module_name: "h.".into() }, 3)?;
        let optimizer = AdamW::new(AdamWConfig::default(), &adapted)?;
        let err = save_checkpoint(root.path(), &config, &adapted, &optimizer, &state(3), &|_: &Path| Ok(()))
            .unwrap_err()
            .to_string();
        assert!(err.contains("checkpoints of a model with LoRA adapters are not supported"), "{err}");
        assert_eq!(load_training_state(root.path(), &Device::Cpu)?.2, state(1));
        Ok(())
    }
}
