//! What step 3 saves: the models gathered on rank 0 (or written sharded), resumable checkpoints
//! of the loop's position, and the HF directories of the trained models.

use super::stats::PpoSummary;
use crate::args::PpoArgs;
use crate::checkpoint::{ModelSave, SavedModel};
use crate::models::{Ema, PpoModels};
use crate::ppo;
use anyhow::{bail, Result};
use data::Tokenizer;
use hybrid_engine::comm::ProcessGroup;
use hybrid_engine::engine::{Engine, GatheredWeights};
use hybrid_engine::model::reward_model::{causal_lm_config, sequence_classification_config};
use hybrid_engine::training::optim::AdamW;
use hybrid_engine::training::tensor_parallel::TensorParallel;
use hybrid_engine::training::zero3::ShardedModel;
use hybrid_engine::ParamStore;
use std::path::Path;

/// Saves a checkpoint of the ranks' common state, with the models' `gathered` weights: every
/// rank gathers the optimizers of the models whole on rank 0 (a collective) and writes its
/// shards of those saved sharded. Returns the directory on rank 0.
pub(super) fn save_checkpoint(
    group: &ProcessGroup,
    root: &Path,
    models: &PpoModels,
    gathered: &GatheredModels,
    state: &crate::checkpoint::PpoState,
    tokenizer: &Tokenizer,
) -> Result<Option<std::path::PathBuf>> {
    let actor_opt = gathered.actor.as_ref().map(|g| models.actor.gather_optimizer(g)).transpose()?.flatten();
    let critic_opt = match (&models.critic, &gathered.critic) {
        (Some(critic), Some(weights)) => critic.gather_optimizer(weights)?,
        _ => None,
    };
    let optimizers = Optimizers { actor: actor_opt.as_deref(), critic: critic_opt.as_deref() };
    let saved = gathered.saved_models(models, Some(optimizers), tokenizer.eos_id(), group.is_first())?;
    crate::checkpoint::save(group, root, &saved, state, tokenizer)
}

/// A model saved sharded (ZeRO stage 3 without TP), never gathered whole: its HF directory
/// written block by block with its LoRA adapters fused in, its checkpoint's with them apart.
pub(super) fn saved_sharded(engine: &Engine) -> Option<&ShardedModel> {
    engine.sharded().filter(|_| engine.tensor_parallel().is_none())
}

/// The trained models' weights gathered whole on rank 0 (see [`Engine::gather_weights`]) where
/// they are not saved sharded, and the EMA's.
pub(super) struct GatheredModels {
    /// `None` for a model saved sharded.
    pub(super) actor: Option<GatheredWeights>,
    pub(super) critic: Option<GatheredWeights>,
    /// `None` for an EMA that is whole on every rank (stages 0-2 without TP), read directly, or
    /// saved sharded with the actor.
    pub(super) ema: Option<ParamStore>,
}

/// The trained models' whole optimizers on rank 0, for a checkpoint.
#[derive(Clone, Copy)]
pub(super) struct Optimizers<'a> {
    pub(super) actor: Option<&'a AdamW>,
    pub(super) critic: Option<&'a AdamW>,
}

impl GatheredModels {
    /// Every rank must call it (the gathers are collectives).
    pub(super) fn of(models: &PpoModels, tp: Option<&TensorParallel>) -> Result<Self> {
        let actor_sharded = saved_sharded(&models.actor).is_some();
        let actor = (!actor_sharded).then(|| models.actor.gather_weights()).transpose()?;
        let critic =
            models.critic.as_ref().filter(|c| saved_sharded(c).is_none()).map(Engine::gather_weights).transpose()?;
        // A ZeRO-3 EMA is gathered as the actor's weights are: from the shards (onto the first
        // data-parallel rank of each TP rank), then under TP from the TP ranks' slices.
        let ema_slices = match actor_sharded {
            true => None,
            false => models.ema.as_ref().map(|e| e.gather_for_saving(&models.actor)).transpose()?.flatten(),
        };
        let ema = match (tp, &models.ema) {
            (None, _) => ema_slices,
            (Some(tp), Some(Ema::Whole(ema))) => tp.gather(ema, &models.actor.config)?,
            (Some(tp), Some(Ema::Shard(_))) => match &ema_slices {
                Some(slices) => tp.gather(slices, &models.actor.config)?,
                None => None,
            },
            (Some(_), None) => None,
        };
        Ok(Self { actor, critic, ema })
    }

    /// The actor, critic and EMA as a save writes them (HF configs with `eos` as the critic's
    /// pad), with `optimizers` for a checkpoint; `first`: this is rank 0, which holds the
    /// gathered weights.
    pub(super) fn saved_models<'a>(
        &'a self,
        models: &'a PpoModels,
        optimizers: Option<Optimizers<'a>>,
        eos: u32,
        first: bool,
    ) -> Result<Vec<SavedModel<'a>>> {
        let checkpoint = optimizers.is_some();
        let optimizers = optimizers.unwrap_or(Optimizers { actor: None, critic: None });
        let trained = |engine: &'a Engine,
                       gathered: Option<&'a GatheredWeights>,
                       optimizer: Option<&'a AdamW>|
         -> Result<ModelSave<'a>> {
            Ok(match (saved_sharded(engine), gathered) {
                (Some(model), _) => {
                    let optimizer = checkpoint.then_some(&engine.trainer().optimizer);
                    ModelSave::Sharded { model, values: None, optimizer }
                }
                (None, _) if !first => ModelSave::Whole(None),
                (None, Some(g)) if optimizer.is_some() || !checkpoint => {
                    ModelSave::Whole(Some((g.params(engine), optimizer)))
                }
                (None, _) => bail!("internal error: rank 0 lacks the gathered weights or optimizer state"),
            })
        };
        let actor_cfg = &models.actor.config;
        let mut saved = vec![SavedModel {
            name: "actor",
            config: causal_lm_config(actor_cfg),
            save: trained(&models.actor, self.actor.as_ref(), optimizers.actor)?,
        }];
        if let Some(critic) = &models.critic {
            saved.push(SavedModel {
                name: "critic",
                config: sequence_classification_config(&critic.config, eos),
                save: trained(critic, self.critic.as_ref(), optimizers.critic)?,
            });
        }
        let ema = match (&models.ema, saved_sharded(&models.actor)) {
            (None, _) => None,
            (Some(Ema::Shard(values)), Some(model)) => {
                Some(ModelSave::Sharded { model, values: Some(values), optimizer: None })
            }
            (Some(_), _) if !first => Some(ModelSave::Whole(None)),
            (Some(Ema::Whole(ema)), _) => Some(ModelSave::Whole(Some((self.ema.as_ref().unwrap_or(ema), None)))),
            (Some(Ema::Shard(_)), None) => match &self.ema {
                Some(ema) => Some(ModelSave::Whole(Some((ema, None)))),
                None => bail!("internal error: rank 0 lacks the gathered EMA"),
            },
        };
        if let Some(save) = ema {
            saved.push(SavedModel { name: "actor_ema", config: causal_lm_config(actor_cfg), save });
        }
        Ok(saved)
    }
}

/// Where the loop stands: `step` rollouts and `micro` updates done, `batches_done` prompt
/// batches of `epoch`, and the KL coefficient of the next rollout.
pub(super) struct Position {
    pub(super) step: u64,
    pub(super) micro: u64,
    pub(super) epoch: usize,
    pub(super) batches_done: usize,
    pub(super) kl_ctl: f64,
    pub(super) reward_moments: Option<ppo::RunningMoments>,
}

/// What a checkpoint needs to resume from `at`.
pub(super) fn checkpoint_state(
    args: &PpoArgs,
    world: usize,
    at: Position,
    models: &PpoModels,
    ptx_cursor: &data::BlockSampler,
    summary: &PpoSummary,
) -> crate::checkpoint::PpoState {
    let Position { step, micro, epoch, batches_done, kl_ctl, reward_moments } = at;
    crate::checkpoint::PpoState {
        format_version: crate::checkpoint::PPO_FORMAT_VERSION,
        step,
        micro,
        epoch,
        batches_done,
        kl_ctl: Some(kl_ctl),
        reward_moments,
        actor_steps: models.actor.trainer().optimizer.step,
        critic_steps: models.critic.as_ref().map_or(0, |c| c.trainer().optimizer.step),
        ptx_cursor: ptx_cursor.cursor(),
        rollouts_reused: summary.rollouts_reused,
        answers_dropped_short: summary.answers_dropped_short,
        first_reward: summary.first_reward,
        actor_progress: Some(models.actor.trainer().progress()),
        critic_progress: models.critic.as_ref().map(|c| c.trainer().progress()),
        run: args.run_fingerprint(world),
    }
}

/// The bytes of the files under `dir` (what a checkpoint costs on disk).
pub(super) fn directory_bytes(dir: &Path) -> u64 {
    let Ok(entries) = std::fs::read_dir(dir) else { return 0 };
    entries
        .flatten()
        .map(|e| match e.file_type() {
            Ok(t) if t.is_dir() => directory_bytes(&e.path()),
            _ => e.metadata().map_or(0, |m| m.len()),
        })
        .sum()
}
