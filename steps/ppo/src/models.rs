//! Step 3's four models, as DS-Chat's `DeepSpeedRLHFEngine` builds them: the actor and its
//! frozen reference from the step-1 directory, the critic and the frozen reward model from the
//! step-2 directory; LoRA adapters on the trained ones, a resumed checkpoint's values and
//! optimizer state, tensor-parallel slices, and the actor's EMA.

use crate::args::PpoArgs;
use crate::checkpoint::{restore_values, PpoCheckpoint, SavedValues};
use crate::ppo;
use anyhow::{bail, Context, Result};
use candle_core::{Device, Tensor};
use data::Tokenizer;
use hybrid_engine::checkpoints::hf_io::{load_model_dir, resolve_model_dir, ModelFiles};
use hybrid_engine::checkpoints::resume::OptimizerState;
use hybrid_engine::checkpoints::sharded_io::ModelSlices;
use hybrid_engine::comm::ProcessGroup;
use hybrid_engine::engine::{Engine, EngineConfig, Head, Ranks};
use hybrid_engine::model::gpt2::{Gpt2, Gpt2Config};
use hybrid_engine::model::reward_model::{RewardModel, SCORE_WEIGHT};
use hybrid_engine::training::tensor_parallel::TensorParallel;
use hybrid_engine::training::train_step::TrainedModel;
use hybrid_engine::training::trainer::TrainerProgress;
use hybrid_engine::training::zero3::{Beside, ShardedModel};
use hybrid_engine::ParamStore;
use std::path::PathBuf;
use std::rc::Rc;
use std::sync::Arc;

/// A model directory's config and tensors (trunk and heads), with a dropout override.
pub fn read_model(
    name: &str,
    flag: &str,
    dropout: Option<f64>,
    device: &Device,
) -> Result<(Gpt2Config, ParamStore, ModelFiles)> {
    let dir = resolve_model_dir(name).with_context(|| format!("{flag} {name:?}"))?;
    let files = load_model_dir(&dir, device)?;
    let mut config = files.config.clone();
    if let Some(p) = dropout {
        (config.resid_pdrop, config.embd_pdrop, config.attn_pdrop) = (p, p, p);
    }
    let params = ParamStore::from_tensors(&config, &files.tensors, device)?;
    Ok((config, params, files))
}

/// A reward-model directory's trunk and score head.
pub fn read_reward_model(
    name: &str,
    flag: &str,
    dropout: Option<f64>,
    device: &Device,
) -> Result<(Gpt2Config, ParamStore)> {
    let (config, mut params, files) = read_model(name, flag, dropout, device)?;
    let Some(score) = files.extra_tensors.get(SCORE_WEIGHT) else {
        bail!("{flag} {name:?} has no {SCORE_WEIGHT}: pass the reward model step 2 saved (a GPT2ForSequenceClassification directory)");
    };
    params.push(SCORE_WEIGHT, score)?;
    Ok((config, params))
}

/// A model's starting weights: whole; under tensor parallelism this rank's slices, read tensor
/// by tensor; or at ZeRO stage 3 across ranks only this rank's shard of them, read by slices
/// from its directory (DeepSpeed's `zero.Init`: no rank ever holds the whole model).
pub enum Weights {
    Whole(ParamStore),
    Sliced(ParamStore),
    Sharded(Box<ShardedModel>),
}

/// Which of step 3's models are built sharded over the data-parallel `group` (ZeRO stage 3
/// across ranks, without tensor parallelism), as DS-Chat's `DeepSpeedRLHFEngine` decides it: the
/// reference follows the actor's stage, the reward model the critic's. The trained models are
/// built sharded (LoRA adapters beside their trunks) where nothing whole comes first: a resume
/// only from a checkpoint that saved them sharded (else it restores whole values).
///
/// Under tensor parallelism each rank reads its slices of the frozen models, and of the trained
/// ones on a fresh start (a resume restores whole values, then slices them).
pub struct Sharding {
    pub group: Arc<ProcessGroup>,
    pub tp: Option<TensorParallel>,
    /// The trained models are read in TP slices.
    pub sliced_trained: bool,
    pub reference: bool,
    pub reward: bool,
    pub actor: bool,
    pub critic: bool,
}

impl Sharding {
    /// The models `args` builds sharded over `group` (the data-parallel group), or under `tp`
    /// in slices.
    pub fn of(
        args: &PpoArgs,
        group: &Arc<ProcessGroup>,
        tp: Option<&TensorParallel>,
        resume: Option<&PpoCheckpoint>,
    ) -> Self {
        let across = group.world() > 1 && tp.is_none();
        let (reference, reward) = (across && args.actor_zero_stage == 3, across && args.critic_zero_stage == 3);
        let reward = reward && !args.no_reward_model;
        // A resumed model is read by slices where the checkpoint saved it sharded.
        let by_slices =
            |saved: Option<&SavedValues>| resume.is_none() || saved.is_some_and(|v| v.model_dir().is_some());
        Self {
            group: group.clone(),
            tp: tp.cloned(),
            sliced_trained: tp.is_some() && resume.is_none(),
            reference,
            reward,
            actor: reference && by_slices(resume.map(|ck| &ck.actor)),
            critic: reward && args.algorithm.has_critic() && by_slices(resume.and_then(|ck| ck.critic.as_ref())),
        }
    }
}

/// The four models' starting weights, as their directories hold them (whole or sharded).
pub struct StartingModels {
    pub actor_cfg: Gpt2Config,
    pub actor: Weights,
    /// The actor's directory (its tokenizer).
    pub actor_dir: PathBuf,
    /// The frozen reference: the actor's weights, dropout off.
    pub reference: Weights,
    /// PPO's critic (config, weights); GRPO and RLOO train none.
    pub critic: Option<(Gpt2Config, Weights)>,
    /// The frozen reward model (config, weights), dropout off; none with `--no-reward-model`.
    pub reward: Option<(Gpt2Config, Weights)>,
}

/// Reads the actor and reference from `--actor-model-name-or-path`, the critic (PPO only) and
/// the reward model from `--critic-model-name-or-path`, each whole or, as `sharding` says, this
/// rank's shard of it (gathered weights computing in the run's dtype).
/// A trained model built sharded on a resume is read from the checkpoint (`resume`).
pub fn read_starting_models(
    args: &PpoArgs,
    sharding: &Sharding,
    resume: Option<&PpoCheckpoint>,
    device: &Device,
) -> Result<StartingModels> {
    let dtype = args.precision.precision().dtype.dtype();
    // `trained`: the actor or the critic; `score`: a reward model's directory.
    let read = |name: &str, flag: &str, dropout: Option<f64>, sharded: bool, trained: Option<&str>, score: bool| {
        let sliced = sharding.tp.as_ref().filter(|_| !sharded && (trained.is_none() || sharding.sliced_trained));
        if !sharded && sliced.is_none() {
            return match score {
                false => read_model(name, flag, dropout, device).map(|(c, p, f)| (c, Weights::Whole(p), f.dir)),
                true => {
                    read_reward_model(name, flag, dropout, device).map(|(c, p)| (c, Weights::Whole(p), PathBuf::new()))
                }
            };
        }
        let dir = resolve_model_dir(name).with_context(|| format!("{flag} {name:?}"))?;
        let slices = ModelSlices::open(&dir)?;
        let mut config = slices.config.clone();
        if let Some(p) = dropout {
            (config.resid_pdrop, config.embd_pdrop, config.attn_pdrop) = (p, p, p);
        }
        let mut stored = slices.heads()?;
        let heads = match score {
            false => Vec::new(),
            true => match stored.remove(SCORE_WEIGHT) {
                Some(head) => vec![(SCORE_WEIGHT.to_string(), head)],
                None => bail!("{flag} {name:?} has no {SCORE_WEIGHT}: pass the reward model step 2 saved (a GPT2ForSequenceClassification directory)"),
            },
        };
        let weights = match sliced {
            Some(tp) => {
                let mut params = tp.read(&config, device, |n, r| slices.read(n, r))?;
                for (name, head) in &heads {
                    params.push(name, &head.to_device(device)?)?;
                }
                Weights::Sliced(params)
            }
            None => Weights::Sharded(Box::new(ShardedModel::read(
                sharding.group.clone(),
                &config,
                |n, r| slices.read(n, r),
                &sharded_beside(args, heads, &config, trained, &stored, &dir, device)?,
                dtype,
                device,
            )?)),
        };
        Ok((config, weights, dir))
    };
    let saved = |values: Option<&SavedValues>| values.and_then(SavedValues::model_dir).map(|d| d.display().to_string());
    let (actor_flag, actor_name) = ("--actor-model-name-or-path", &args.actor_model_name_or_path);
    let (critic_flag, critic_name) = ("--critic-model-name-or-path", &args.critic_model_name_or_path);
    let (trained_actor, trained_critic) = match resume.filter(|_| sharding.actor || sharding.critic) {
        Some(ck) => (saved(Some(&ck.actor)), saved(ck.critic.as_ref())),
        None => (None, None),
    };
    let trained_actor = trained_actor.filter(|_| sharding.actor).unwrap_or_else(|| actor_name.clone());
    let trained_critic = trained_critic.filter(|_| sharding.critic).unwrap_or_else(|| critic_name.clone());
    let (actor_cfg, actor, _) =
        read(&trained_actor, actor_flag, args.actor_dropout(), sharding.actor, Some("actor"), false)?;
    let (_, reference, actor_dir) = read(actor_name, actor_flag, Some(0.0), sharding.reference, None, false)?;
    let critic = args
        .algorithm
        .has_critic()
        .then(|| {
            read(&trained_critic, critic_flag, args.critic_dropout(), sharding.critic, Some("critic"), true)
                .map(|(c, w, _)| (c, w))
        })
        .transpose()?;
    let reward = (!args.no_reward_model)
        .then(|| read(critic_name, critic_flag, Some(0.0), sharding.reward, None, true).map(|(c, w, _)| (c, w)))
        .transpose()?;
    let said = [
        ("actor", sharding.actor),
        ("reference", sharding.reference),
        ("critic", sharding.critic),
        ("reward model", sharding.reward),
    ];
    let sharded: Vec<&str> = said.iter().filter(|(_, s)| *s).map(|(what, _)| *what).collect();
    if !sharded.is_empty() {
        println!(
            "ZeRO stage 3: the {} built sharded over {} ranks (read by slices: no rank holds them whole)",
            sharded.join(", "),
            sharding.group.world()
        );
    }
    let sliced = [("actor", &actor), ("reference", &reference)]
        .into_iter()
        .chain(reward.as_ref().map(|(_, w)| ("reward model", w)))
        .chain(critic.as_ref().map(|(_, w)| ("critic", w)))
        .filter(|(_, w)| matches!(w, Weights::Sliced(_)))
        .map(|(what, _)| what)
        .collect::<Vec<_>>();
    if !sliced.is_empty() {
        println!("tensor parallel: the {} read in this rank's slices (no rank holds them whole)", sliced.join(", "));
    }
    Ok(StartingModels { actor_cfg, actor, actor_dir, reference, critic, reward })
}

/// What a trained model built sharded holds beside its trunk (`trained`: "actor" or "critic",
/// `None` for a frozen one): its heads and, with LoRA, its adapters, drawn whole as one rank
/// draws them (to be cut into shards), or restored from `dir` when its tensors beside the trunk,
/// `stored`, hold them (a checkpoint that saved the model sharded). A whole or sliced model gets
/// its adapters later (`StartingModels::add_lora`).
fn sharded_beside(
    args: &PpoArgs,
    heads: Vec<(String, Tensor)>,
    cfg: &Gpt2Config,
    trained: Option<&str>,
    stored: &std::collections::HashMap<String, Tensor>,
    dir: &std::path::Path,
    device: &Device,
) -> Result<Beside> {
    let Some((what, dim, module, lr)) = trained.and_then(|what| args.lora_of(what)) else {
        return Ok(Beside::heads(heads));
    };
    let lora = PpoArgs::lora(dim, module).expect("lora_of gives a rank above 0");
    let (targets, mut adapters) = hybrid_engine::model::params::lora_adapters(cfg, &lora, args.seed, device)?;
    let mut restored = 0;
    for adapter in &mut adapters {
        let (a, b) = lora::Adapter::param_names(&adapter.module);
        if let (Some(a), Some(b)) = (stored.get(&a), stored.get(&b)) {
            if (a.dims(), b.dims()) != (adapter.a.dims(), adapter.b.dims()) {
                bail!("{} holds {what} LoRA adapters of another rank than --{what}-lora-dim {dim}: resume with the run's LoRA flags", dir.display());
            }
            let restore = |t: &Tensor| t.to_dtype(candle_core::DType::F32)?.to_device(device);
            (adapter.a, adapter.b) = (restore(a)?, restore(b)?);
            restored += 1;
        }
    }
    if restored != 0 && restored != adapters.len() {
        bail!("{} holds {restored} of the {} {what} LoRA adapters --{what}-lora-module-name {module:?} makes: resume with the run's LoRA flags", dir.display(), adapters.len());
    }
    let from = if restored > 0 { ", restored from the checkpoint" } else { "" };
    println!(
        "{what} LoRA: rank {dim} on {} linears matching {module:?}, scaling 1/{dim}, lr {lr:e}{from}",
        targets.len()
    );
    Ok(Beside::heads(heads).with_lora(adapters, lora.scaling(), args.only_optimize_lora))
}

impl StartingModels {
    /// The process's own memory for step 3's plan, once its inputs are read (tokenizer, data):
    /// all it holds live but these models' values.
    pub fn process_mib(&self) -> f64 {
        let live = hybrid_engine::training::metrics::live_rss_mib().unwrap_or(0.0);
        (live - self.host_bytes() as f64 / (1024.0 * 1024.0)).max(0.0)
    }

    /// The bytes of the models' values held in host memory as read (a tensor the actor and
    /// the reference share counted once): what the process's resident memory holds of them
    /// before they are built into engines.
    fn host_bytes(&self) -> u64 {
        let mut seen = std::collections::HashSet::new();
        let mut bytes = 0u64;
        let critic = self.critic.iter().map(|(_, w)| w);
        let reward = self.reward.iter().map(|(_, w)| w);
        for weights in [&self.actor, &self.reference].into_iter().chain(critic).chain(reward) {
            match weights {
                Weights::Whole(params) | Weights::Sliced(params) => {
                    for var in params.vars.iter().filter(|v| v.device().is_cpu() && seen.insert(v.id())) {
                        bytes += (var.elem_count() * var.dtype().size_in_bytes()) as u64;
                    }
                }
                // Built in host memory; moved to a GPU, if at all, when the engines are made.
                Weights::Sharded(model) => bytes += 4 * model.shard_len() as u64,
            }
        }
        bytes
    }

    /// The actor and the reward model must hold a prompt and its answer and embed every token.
    pub fn check_fits(&self, args: &PpoArgs, tokenizer: &Tokenizer) -> Result<()> {
        let context = args.max_prompt_seq_len + args.max_answer_seq_len;
        let reward = self.reward.as_ref().map(|(c, _)| ("reward model", c));
        for (what, c) in std::iter::once(("actor", &self.actor_cfg)).chain(reward) {
            if context > c.max_positions() {
                bail!("--max-prompt-seq-len + --max-answer-seq-len = {context} exceeds the {what}'s context of {} positions: lower them", c.max_positions());
            }
            if tokenizer.vocab_size() > c.vocab_size {
                bail!("the {what} embeds {} tokens but the actor's tokenizer has {}: pass models trained with the same tokenizer", c.vocab_size, tokenizer.vocab_size());
            }
        }
        Ok(())
    }

    /// Fresh LoRA adapters on the trained models (the step-1 and step-2 saves are merged), each
    /// said in a line; with `--only-optimize-lora` their trunks frozen. On models read in
    /// `tp`'s slices, the adapters drawn whole are cut as their linears.
    fn add_lora(&mut self, args: &PpoArgs, tp: Option<&TensorParallel>) -> Result<()> {
        let mut targets = vec![(
            "actor",
            &mut self.actor,
            &self.actor_cfg,
            args.actor_lora_dim,
            &args.actor_lora_module_name,
            args.actor_lora_learning_rate,
        )];
        if let Some((critic_cfg, critic)) = &mut self.critic {
            targets.push((
                "critic",
                critic,
                critic_cfg,
                args.critic_lora_dim,
                &args.critic_lora_module_name,
                args.critic_lora_learning_rate,
            ));
        }
        for (what, weights, cfg, dim, module, lr) in targets {
            if let Some(lora) = PpoArgs::lora(dim, module) {
                let (params, cut) = match (weights, tp) {
                    (Weights::Whole(params), _) => (params, None),
                    (Weights::Sliced(params), Some(tp)) => (params, Some(tp)),
                    // Built sharded with its adapters (`read_starting_models`).
                    (Weights::Sharded(_), _) => continue,
                    _ => bail!("internal error: the {what} was read in slices without TP"),
                };
                let linears = params.add_lora_cut(cfg, &lora, args.seed, |name, whole| match cut {
                    Some(tp) => tp.cut(cfg, name, whole),
                    None => Ok(whole.clone()),
                })?;
                println!(
                    "{what} LoRA: rank {dim} on {} linears matching {module:?}, scaling 1/{dim}, lr {lr:e}",
                    linears.len()
                );
                if args.only_optimize_lora {
                    params.freeze_trunk();
                }
            }
        }
        Ok(())
    }
}

/// The models step 3 trains and reads: LoRA added, a checkpoint's values restored (`resume`,
/// its fingerprint already checked), each rank's TP slices kept, the actor and the critic
/// engines built as `engines` say (their optimizer state resumed; at ZeRO stage 3 only this
/// rank's shards kept), the frozen ones in the compute dtype (or sharded at rest), the EMA when
/// asked for.
pub fn build_models(
    args: &PpoArgs,
    mut start: StartingModels,
    resume: Option<&PpoCheckpoint>,
    ranks: Ranks,
    (actor_engine, critic_engine): (&EngineConfig, &EngineConfig),
    device: &Device,
) -> Result<PpoModels> {
    let tp = ranks.tensor.as_ref();
    start.add_lora(args, tp)?;
    // A resume restores the values of a whole model; one built sharded read them by slices.
    if let Some(ck) = resume {
        if let Weights::Whole(actor) = &start.actor {
            restore_values(actor, &ck.actor.whole(device)?, "actor")?;
        }
        if let (Some((_, Weights::Whole(critic))), Some(saved)) = (&start.critic, &ck.critic) {
            restore_values(critic, &saved.whole(device)?, "critic")?;
        }
    }
    // The EMA of a whole or sliced actor starts as its copy (a sharded actor's, below, as its
    // shard).
    let ema_sliced = matches!(start.actor, Weights::Sliced(_));
    let ema = match (args.enable_ema, &start.actor) {
        (true, Weights::Whole(actor) | Weights::Sliced(actor)) => {
            let ema = actor.copy()?;
            if let Some(saved) = resume.and_then(|ck| ck.ema.as_ref()) {
                restore_values(&ema, &saved.whole(device)?, "actor_ema")?;
            }
            Some(ema)
        }
        _ => None,
    };
    let StartingModels { actor_cfg, actor, reference, critic, reward, .. } = start;
    // Tensor parallelism: each rank keeps its slices of the four models (and of the EMA);
    // from here on a whole model's weights are this rank's slices.
    if let Some(tp) = tp {
        println!("{}", tp.describe());
    }
    let slice = |weights: Weights, cfg: &Gpt2Config| match (weights, tp) {
        (Weights::Whole(params), Some(tp)) => tp.slice(params, cfg).map(Weights::Whole),
        (Weights::Sliced(params), _) => Ok(Weights::Whole(params)),
        (weights, _) => Ok(weights),
    };
    let (actor, reference) = (slice(actor, &actor_cfg)?, slice(reference, &actor_cfg)?);
    let reward = reward.map(|(cfg, w)| slice(w, &cfg).map(|w| (cfg, w))).transpose()?;
    let critic = critic.map(|(cfg, w)| slice(w, &cfg).map(|w| (cfg, w))).transpose()?;
    let ema = match (ema, tp) {
        (Some(ema), Some(tp)) if !ema_sliced => Some(tp.slice(ema, &actor_cfg)?),
        (ema, _) => ema,
    };
    let engine = |cfg: &EngineConfig, config: &Gpt2Config, head: Head, weights: Weights| match weights {
        Weights::Whole(params) | Weights::Sliced(params) => Engine::new(cfg, config, head, params, ranks.clone()),
        Weights::Sharded(model) => Engine::new_sharded(cfg, config, *model),
    };
    let mut models = PpoModels {
        reference: frozen_reference(args, reference, &actor_cfg, tp)?,
        reward: reward.map(|(cfg, w)| frozen_reward_model(args, w, &cfg, tp)).transpose()?,
        actor: engine(actor_engine, &actor_cfg, Head::Lm, actor)?,
        critic: critic.map(|(cfg, w)| engine(critic_engine, &cfg, Head::Score, w)).transpose()?,
        ema: None,
        align_overflow: args.align_overflow,
    };
    // The EMA of an actor whose masters are sharded (ZeRO-3; stages 1 and 2 in mixed
    // precision) is kept shard by shard, as they are.
    let saved_ema = resume.and_then(|ck| ck.ema.as_ref());
    models.ema = match (ema, models.actor.sharded()) {
        (None, Some(sharded)) if args.enable_ema => Some(Ema::Shard(match saved_ema {
            Some(saved) => saved.read_shard(sharded)?,
            None => sharded.shard_values()?,
        })),
        (None, _) => None,
        (Some(ema), _) => match models.actor.master_shard_of(&ema)? {
            Some(shard) => Some(Ema::Shard(shard)),
            None => Some(Ema::Whole(ema)),
        },
    };
    if let Some(ck) = resume {
        let st = &ck.state;
        restore_optimizer(&mut models.actor, &ck.actor_optimizer, st.actor_steps, st.actor_progress.as_ref())?;
        match (&mut models.critic, &ck.critic_optimizer) {
            (Some(critic), Some(saved)) => restore_optimizer(critic, saved, st.critic_steps, st.critic_progress.as_ref())?,
            (None, None) => {}
            _ => bail!("--load {}: the checkpoint's critic does not match --algorithm {}: resume with the flags it was saved with", ck.dir.display(), args.algorithm.name()),
        }
        println!("resumed from {} at rollout {}", ck.dir.display(), ck.state.step);
    }
    // Under ZeRO stage 3 the whole masters go once the shards and optimizer state are taken.
    models.actor.release_masters();
    if let Some(critic) = &mut models.critic {
        critic.release_masters();
    }
    Ok(models)
}

/// Restores a checkpoint's optimizer into `engine`: whole moments (this rank keeps its TP
/// slices and ZeRO shard of them), or the shards of a model saved sharded (each rank reads the
/// pieces that overlap what it holds, in any layout).
fn restore_optimizer(
    engine: &mut Engine,
    saved: &OptimizerState,
    steps: u64,
    progress: Option<&TrainerProgress>,
) -> Result<()> {
    match (saved, progress) {
        (OptimizerState::Whole(tensors), _) => engine.load_optimizer(tensors, steps, progress),
        (shards, Some(progress)) => {
            engine.restore_optimizer(|opt, names, numels| shards.restore(opt, names, numels), steps, progress)
        }
        (_, None) => bail!("the checkpoint's optimizer shards come without the trainer's progress: it is damaged"),
    }
}

/// Whether the reference model waits in host memory between rollouts: on a GPU with
/// `--offload-reference-model`. On the CPU the flag says it has no effect instead of being
/// refused: DS-Chat's scripts pass it, and run here on any device.
fn offloads_reference(args: &PpoArgs, device: &Device) -> bool {
    if args.offload_reference_model && device.is_cpu() {
        println!(
            "--offload-reference-model: no effect on the CPU, where the reference model is in host memory already"
        );
    }
    args.offload_reference_model && !device.is_cpu()
}

/// The frozen reference in the compute dtype: whole (or this rank's TP slices) on the device,
/// with `--offload-reference-model` in host memory between uses, or sharded at rest.
fn frozen_reference(
    args: &PpoArgs,
    weights: Weights,
    cfg: &Gpt2Config,
    tp: Option<&TensorParallel>,
) -> Result<Reference> {
    let precision = args.precision.precision();
    let reference = match weights {
        Weights::Sharded(model) => {
            let offload = offloads_reference(args, model.device());
            if offload {
                println!("--offload-reference-model: this rank's shard of the reference stays in host memory, its units gathered to the device for each rollout's log-probs");
            }
            return Ok(Reference::Loaded(frozen_sharded(*model, precision.fp32_loss, offload)?));
        }
        Weights::Whole(params) | Weights::Sliced(params) => params.compute_copy(precision.dtype.dtype())?,
    };
    let device = reference.vars.first().map_or(Device::Cpu, |v| v.device().clone());
    if !offloads_reference(args, &device) {
        return Ok(Reference::Loaded(TrainedModel::lm(lm_on(&reference, cfg, precision.fp32_loss, tp)?)));
    }
    println!("--offload-reference-model: the reference stays in host memory, on the device only for each rollout's log-probs");
    Ok(Reference::OnHost(Box::new(FrozenOnHost {
        params: reference.to_device(&Device::Cpu)?,
        config: cfg.clone(),
        fp32_loss: precision.fp32_loss,
        tp: tp.cloned(),
        device,
    })))
}

/// The frozen reward model in the compute dtype: whole (or this rank's TP slices), or sharded at
/// rest.
fn frozen_reward_model(
    args: &PpoArgs,
    weights: Weights,
    cfg: &Gpt2Config,
    tp: Option<&TensorParallel>,
) -> Result<TrainedModel> {
    let precision = args.precision.precision();
    match weights {
        Weights::Sharded(model) => frozen_sharded(*model, precision.fp32_loss, false),
        Weights::Whole(params) | Weights::Sliced(params) => {
            let compute = params.compute_copy(precision.dtype.dtype())?;
            Ok(TrainedModel::reward(reward_model_on(&compute, cfg, precision.fp32_loss, tp)?))
        }
    }
}

/// A frozen model sharded at rest (ZeRO stage 3), each unit gathered as a forward runs (a
/// collective every rank makes): on a GPU its shard lives there in the compute dtype, unless
/// `offload` keeps it in host memory.
fn frozen_sharded(model: ShardedModel, fp32_loss: bool, offload: bool) -> Result<TrainedModel> {
    let mut model = model.freeze();
    if model.device().is_cuda() && !offload {
        let dtype = model.compute_dtype();
        model = model.with_shard_on_device(dtype)?;
    }
    model.fp32_loss = fp32_loss;
    Ok(TrainedModel::Sharded(Rc::new(model)))
}

/// The frozen reference model: on the device, or with `--offload-reference-model` in host
/// memory between uses (DS-Chat's ZeRO offload of the reference), brought to the device for a
/// rollout's log-probs and dropped after.
pub enum Reference {
    /// Whole on the device (this rank's TP slices under TP), or at ZeRO stage 3 sharded at rest
    /// (its shard in host memory, each unit gathered to the device as a forward runs).
    Loaded(TrainedModel),
    OnHost(Box<FrozenOnHost>),
}

/// A frozen model's compute-dtype weights in host memory and what builds it on `device`.
pub struct FrozenOnHost {
    params: ParamStore,
    config: Gpt2Config,
    fp32_loss: bool,
    tp: Option<TensorParallel>,
    device: Device,
}

/// The reference where a forward can read it: borrowed, or uploaded for this use.
pub enum Resident<'a> {
    Borrowed(&'a TrainedModel),
    Uploaded(Box<TrainedModel>),
}

impl std::ops::Deref for Resident<'_> {
    type Target = TrainedModel;
    fn deref(&self) -> &TrainedModel {
        match self {
            Self::Borrowed(model) => model,
            Self::Uploaded(model) => model,
        }
    }
}

impl Reference {
    /// The model on the device (uploaded from host memory when offloaded: drop it after use).
    pub fn resident(&self) -> Result<Resident<'_>> {
        match self {
            Self::Loaded(model) => Ok(Resident::Borrowed(model)),
            Self::OnHost(h) => {
                let params = h.params.to_device(&h.device)?;
                let model = lm_on(&params, &h.config, h.fp32_loss, h.tp.as_ref())?;
                Ok(Resident::Uploaded(Box::new(TrainedModel::lm(model))))
            }
        }
    }
}

/// The EMA of the actor's weights (DS-Chat `actor_ema`).
pub enum Ema {
    /// Of the whole actor.
    Whole(ParamStore),
    /// Of this rank's shard of a ZeRO-3 actor, laid out as [`hybrid_engine::training::zero3::ShardedModel::shard_values`]:
    /// the EMA is elementwise, so the ranks' shards together are the one-rank EMA.
    Shard(Vec<f32>),
}

impl Ema {
    /// The whole EMA for saving, as [`Engine::gather_weights`]: `None` for [`Ema::Whole`]
    /// (read it directly) and off rank 0. Every rank must call it.
    pub fn gather_for_saving(&self, actor: &Engine) -> Result<Option<ParamStore>> {
        match self {
            Self::Shard(values) => actor.gather_master_shard_values(values),
            Self::Whole(_) => Ok(None),
        }
    }

    /// One step of DS-Chat's `moving_average` towards the actor's weights.
    pub fn update(&mut self, actor: &Engine) -> Result<()> {
        match (self, actor.master_shard_values()?) {
            (Self::Whole(ema), None) => update_ema(ema, actor.masters()),
            (Self::Shard(ema), Some(shard)) => {
                ppo::ema_update(ema, &shard, EMA_BETA);
                Ok(())
            }
            _ => anyhow::bail!("internal error: the EMA and the actor are not sharded alike"),
        }
    }
}

/// Actor, critic, the frozen reference and reward models, and the optional EMA.
pub struct PpoModels {
    pub actor: Engine,
    /// PPO's critic; GRPO and RLOO have none.
    pub critic: Option<Engine>,
    pub reference: Reference,
    /// The frozen reward model: whole, or sharded at rest; none with `--no-reward-model` (the
    /// scores are then `--reward-fn`'s alone).
    pub reward: Option<TrainedModel>,
    pub ema: Option<Ema>,
    /// Skip both updates when either model's gradients overflowed (`--align-overflow`).
    pub align_overflow: bool,
}

/// DS-Chat's `moving_average` beta.
const EMA_BETA: f32 = 0.992;

/// DS-Chat's `moving_average` of a whole actor.
fn update_ema(ema: &ParamStore, actor: &ParamStore) -> Result<()> {
    for ((_, e), (_, a)) in ema.iter().zip(actor.iter()) {
        let mut ev: Vec<f32> = e.flatten_all()?.to_vec1()?;
        let av: Vec<f32> = a.flatten_all()?.to_vec1()?;
        ppo::ema_update(&mut ev, &av, EMA_BETA);
        e.set(&Tensor::from_vec(ev, e.shape(), e.device())?)?;
    }
    Ok(())
}

/// A language model over `params` (the actor, or the frozen reference) in their dtype: the whole
/// model, or under `tp` this rank's slices.
pub fn lm_on(params: &ParamStore, config: &Gpt2Config, fp32_loss: bool, tp: Option<&TensorParallel>) -> Result<Gpt2> {
    let mut model = match tp {
        Some(tp) => tp.model(params, config)?,
        None => params.model(config)?,
    };
    model.fp32_loss = fp32_loss;
    Ok(model)
}

/// A reward model over `params` (the critic, or the frozen reward model) in their dtype, as
/// [`lm_on`]; the score head is whole on every rank.
pub fn reward_model_on(
    params: &ParamStore,
    config: &Gpt2Config,
    fp32_loss: bool,
    tp: Option<&TensorParallel>,
) -> Result<RewardModel> {
    let trunk = lm_on(params, config, fp32_loss, tp)?;
    RewardModel::from_trunk(trunk, params, config)
}

#[cfg(test)]
mod tests {
    use super::*;
    use hybrid_engine::model::positions::Positions;

    /// An offloaded reference, brought to its device, computes what the resident one does.
    #[test]
    fn an_offloaded_reference_gives_the_residents_logits() -> Result<()> {
        let cfg = Gpt2Config { n_layer: 1, n_embd: 8, n_head: 2, n_positions: 8, vocab_size: 16, ..Gpt2Config::tiny() };
        let params = ParamStore::init(&cfg, 3, &Device::Cpu)?;
        let on_device = Reference::Loaded(TrainedModel::lm(lm_on(&params, &cfg, false, None)?));
        let host = FrozenOnHost {
            params: params.copy()?,
            config: cfg.clone(),
            fp32_loss: false,
            tp: None,
            device: Device::Cpu,
        };
        let on_host = Reference::OnHost(Box::new(host));
        let ids = candle_core::Tensor::new(&[[1u32, 5, 7]], &Device::Cpu)?;
        let logits = |r: &Reference| -> Result<Vec<f32>> {
            let resident = r.resident()?;
            let model = resident.whole_trunk().expect("a whole model");
            Ok(model.forward(&ids, &Positions::default(), None, None)?.flatten_all()?.to_vec1()?)
        };
        assert!(matches!(on_host.resident()?, Resident::Uploaded(_)));
        assert_eq!(logits(&on_device)?, logits(&on_host)?);
        Ok(())
    }
}
