//! Step 3's loop (DS-Chat `step3_rlhf_finetuning/main.py`): load the four models, then per batch
//! of prompts generate experience; every `--generation-batches` rollouts run `--ppo-epochs`
//! passes of PPO updates over their micro-batches; log the diagnostics users need each step;
//! save `step3/{actor,critic,actor_ema}` as HF directories.
//!
//! `--algorithm grpo|rloo` runs the same loop without a critic: each prompt comes
//! `--num-samples-per-prompt` times in a rollout, and once every rank has scored its rows the
//! group advantages are formed from all the ranks' rewards (`critic_free_advantages`).
//!
//! Across N data-parallel ranks (DS-Chat under deepspeed) every rank holds the four models; a
//! rollout is `--per-device-generation-batch-size` x N prompts of one seeded order, each rank
//! generating and scoring its share; the actor's and the critic's gradients are averaged over the
//! ranks at their own ZeRO stages. Every loss, statistic and decision that spans the rollout is
//! reduced over the ranks, so N ranks train as one rank would at the same global batch. Rank 0
//! logs and saves.
//!
//! Under ZeRO stage 3 the actor and the critic are sharded at rest. The hybrid engine's
//! generation mode then gathers the whole actor on every rank once per rollout, generates and
//! scores with it, and drops it before training (DS-Chat's hybrid engine); the critic's forwards
//! gather it block by block. The frozen reference and reward models stay whole on every rank.
//!
//! Under tensor parallelism (`--tensor-model-parallel-size T`, world = T x D) all four models
//! are split over each TP group of T consecutive ranks (Megatron's layout), which holds the
//! same rows: a rollout's prompts and the PPO micro-batches are split over the D data-parallel
//! groups, generation runs on the training slices in lockstep in each TP group, log-probs come
//! from the vocabulary slices, and the gradients are averaged over the data-parallel group.
//! Saves and checkpoints are consolidated (rank 0's TP group gathers them).

use crate::advantages::compute_advantages;
use crate::args::PpoArgs;
use crate::checkpoint::{ModelSave, SavedModel};
use crate::eval::{evaluate_policy, heldout_countries_clause, score_text, PolicyEval};
use crate::experience::{generate_experience, rollout_share, Experience, ExternalRewards, RolloutModels};
use crate::models::{
    build_models, lm_on, read_model, read_reward_model, read_starting_models, reward_model_on, Sharding,
};
use crate::models::{Ema, PpoModels};
use crate::ppo;
use crate::reward_fn::{Answer, RewardFn, ScoringFailed};
use crate::trainer::{answer_tokens, MicroBatch, PtxBatch, UpdateStats};
use anyhow::{bail, Context, Result};
use candle_core::{Device, Tensor};
use data::{PackedCorpus, Tokenizer};
use hybrid_engine::checkpoints::resume::{save_model_dir, save_sharded_model_dir};
use hybrid_engine::comm::{ProcessGroup, ReduceOp};
use hybrid_engine::engine::{Engine, EngineConfig, GatheredWeights, Ranks};
use hybrid_engine::generation::engine::GenerationMode;
use hybrid_engine::generation::generate::{Generation, LeftPadded, SamplingConfig};
use hybrid_engine::kernels::ops::DropoutKey;
use hybrid_engine::model::gpt2::{Gpt2, Gpt2Config};
use hybrid_engine::model::reward_model::{causal_lm_config, sequence_classification_config};
use hybrid_engine::tensor_parallel::layout::ParallelLayout;
use hybrid_engine::tensor_parallel::shard::check_divides;
use hybrid_engine::training::metrics::{peak_rss_mib, Metrics};
use hybrid_engine::training::optim::AdamW;
use hybrid_engine::training::tensor_parallel::{data_group, TensorParallel};
use hybrid_engine::training::train_step::TrainedModel;
use hybrid_engine::training::zero3::ShardedModel;
use hybrid_engine::ParamStore;
use serde::Serialize;
use serde_json::json;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

/// What step 3 did.
#[derive(Clone, Debug, Serialize)]
pub struct PpoSummary {
    pub steps: u64,
    /// The starting (SFT) actor and the PPO actor on `--eval-prompts`.
    pub sft_eval: Option<PolicyEval>,
    pub ppo_eval: Option<PolicyEval>,
    pub rollouts_reused: u64,
    pub answers_dropped_short: u64,
    /// Mean reward-model score of the rollouts in the first and last step.
    pub first_reward: Option<f64>,
    pub last_reward: Option<f64>,
    pub output_dir: std::path::PathBuf,
}

/// Runs step 3.
pub fn run(args: &PpoArgs) -> Result<PpoSummary> {
    args.validate()?;
    let device = hybrid_engine::device::parse_device(&args.device)?;
    let group = args.dist.join(&device)?;
    // Under tensor parallelism the ranks of a TP group hold the same rows: the rollouts and
    // the micro-batches are split over the data-parallel group (every rank without TP).
    let tp = tensor_parallel(args, &group)?;
    let data = data_group(&group, tp.as_ref());
    let (rank, world) = (group.rank(), data.world());
    println!("device: {}", hybrid_engine::device::describe(&device));
    let cfg = args.ppo_config();

    // Models: actor and reference from step 1, critic and reward from step 2.
    // Resume: the trained models' values and optimizers from the checkpoint (the frozen ones
    // from their directories).
    let resume = args.load.as_deref().map(|root| read_checkpoint(args, root, world, &device)).transpose()?;
    let sharding = Sharding::of(args, &data, tp.as_ref(), resume.as_ref());
    let start = read_starting_models(args, &sharding, resume.as_ref(), &device)?;
    let tokenizer = args.data.tokenizer(Tokenizer::from_model_dir_or_default(&start.actor_dir)?)?;
    let eos = tokenizer.eos_id();
    start.check_fits(args, &tokenizer)?;
    let actor_cfg = start.actor_cfg.clone();
    let reward_cfg = start.reward.as_ref().map(|(c, _)| c.clone());
    let context = args.max_prompt_seq_len + args.max_answer_seq_len;

    // The hybrid engine's inference tensor parallelism: groups of consecutive ranks generate
    // together (the layout and the actor's heads are checked now, before any work).
    let inference_tp = inference_tp_group(args, &group, &actor_cfg)?;

    // Data: phase-3 prompts; optional PTX blocks.
    let data_cfg = args.data.config(args.seed, context, args.max_prompt_seq_len, false)?;
    let prompts = data::phases::prompt_data(&data_cfg, &tokenizer)?;
    println!("{}", prompts.summary);
    let unsupervised = ptx_corpus(args, &tokenizer, actor_cfg.vocab_size)?;
    let process_mib = start.process_mib();
    // The global batches: a rollout's prompts and a PPO micro-batch's rows over all ranks.
    let global_generation = args.per_device_generation_batch_size * world;
    let global_micro = args.per_device_training_batch_size * world;

    let rollouts_per_epoch = prompts.train.len().div_ceil(global_generation);
    let steps = optimizer_steps(args, rollouts_per_epoch, (global_generation, global_micro));
    let actor_engine = args.engine_config(false, steps, &data)?;
    let critic_engine = args.engine_config(true, steps, &data)?;
    let ranks = Ranks { data: data.clone(), tensor: tp.clone() };
    let models = build_models(args, start, resume.as_ref(), ranks, (&actor_engine, &critic_engine), &device)?;
    let (tp_size, engines) = (tp.as_ref().map_or(1, |t| t.size()), (&actor_engine, &critic_engine));
    check_memory_plan(args, &models, reward_cfg.as_ref(), engines, (world, tp_size), &device, process_mib)?;
    let dtype = args.precision.precision().dtype.dtype();
    let engine = GenerationMode::new(args.max_prompt_seq_len, args.max_answer_seq_len, args.release_inference_cache)
        .with_dtype(dtype)
        .with_progress("generating the rollout");

    let total_rollouts =
        ((args.num_train_epochs * rollouts_per_epoch) as u64).min(args.stop_after().unwrap_or(u64::MAX));
    let done = resume.as_ref().map_or(0, |ck| ck.state.step);
    let metrics = Metrics::for_rank(rank, &args.output_dir, total_rollouts, done)?.with_sinks(
        args.log.sinks(&args.output_dir)?,
        hybrid_engine::telemetry::tensorboard::DS_CHAT_STEP3_TAGS,
        done,
    )?;
    let eval_prompts =
        args.eval_prompts.as_deref().map(|spec| data::prompts::read_prompts(spec, usize::MAX)).transpose()?;
    let mut summary = PpoSummary {
        steps: 0,
        sft_eval: None,
        ppo_eval: None,
        rollouts_reused: 0,
        answers_dropped_short: 0,
        first_reward: None,
        last_reward: None,
        output_dir: args.output_dir.clone(),
    };
    let reward_fns = start_reward_fns(args, rank)?;
    let ptx_blocks = unsupervised.as_ref().map_or(0, PackedCorpus::num_blocks);
    let (at, ptx_cursor) = starting_point(args, resume.as_ref(), ptx_blocks, &mut summary)?;
    // Once every input is checked, so that bad input stays one error line.
    if let Some(line) = actor_dropout_warning(&actor_cfg).filter(|_| group.is_first()) {
        eprintln!("{line}");
    }
    let save_root = args.save.clone().unwrap_or_else(|| args.output_dir.join("checkpoints"));
    let batches_per_epoch = prompts.train.len().div_ceil(global_generation);
    let ctx = Ctx {
        args,
        cfg,
        group: &data,
        tp: tp.as_ref(),
        device: device.clone(),
        actor_cfg: actor_cfg.clone(),
        eos,
        vocab: tokenizer.vocab_size(),
        global_micro,
        inference_tp,
    };
    let mut ppo_loop = PpoLoop {
        ctx,
        whole: &group,
        tokenizer: &tokenizer,
        prompts: &prompts.train,
        unsupervised: unsupervised.as_ref(),
        models,
        engine,
        metrics,
        summary,
        buffer: Vec::new(),
        last_experience: None,
        micro: at.micro,
        step: at.step,
        ptx_cursor,
        kl_ctl: at.kl_ctl,
        reward_moments: at.reward_moments,
        reward_fns,
        save_root,
        save_pending: false,
        last_saved_step: at.step,
        total_rollouts,
    };
    ppo_loop.run_epochs(at.epoch, at.batches_done, global_generation)?;
    ppo_loop.finish(batches_per_epoch, eval_prompts.as_deref(), reward_cfg.as_ref())
}

/// Prints step 3's memory plan for the models as built (see [`crate::memory_plan`]) and on the
/// CPU refuses one beyond the machine; `process_mib`, the process's own live memory (measured
/// once its inputs were read, less the models' values), is counted where it shares the plan's
/// memory (the CPU).
fn check_memory_plan(
    args: &PpoArgs,
    models: &PpoModels,
    reward: Option<&Gpt2Config>,
    (actor_engine, critic_engine): (&EngineConfig, &EngineConfig),
    (world, tp): (usize, usize),
    device: &Device,
    process_mib: f64,
) -> Result<()> {
    use crate::memory_plan::{Step3Plan, Step3Shapes, TrainedShape};
    // Trained parameters from the engine; with `--only-optimize-lora` the frozen trunk beside.
    fn shape<'a>(args: &PpoArgs, engine: &'a Engine, tp: usize, lora_dim: usize, checkpoint: bool) -> TrainedShape<'a> {
        // Counted whole, as MemoryPlan takes them: under tensor parallelism the engine trains slices.
        let (names, numels) = engine.trained_inventory();
        let whole = |(name, n): (&String, &usize)| {
            hybrid_engine::tensor_parallel::shard::whole_numel(name, *n, tp, engine.config.vocab_size)
        };
        let trainable: usize = names.iter().zip(&numels).map(whole).sum();
        let frozen = if args.only_optimize_lora && lora_dim > 0 {
            hybrid_engine::model::params::parameter_count(&engine.config)
        } else {
            0
        };
        let held_beside = hybrid_engine::model::params::numel_beside_trunk(
            names.iter().map(String::as_str).zip(numels.iter().copied()),
        );
        TrainedShape {
            cfg: &engine.config,
            total: trainable + frozen,
            trainable,
            held_beside,
            lora: lora_dim > 0,
            checkpoint,
        }
    }
    let precision = args.precision.precision();
    let plan = Step3Plan::new(&Step3Shapes {
        actor: shape(args, &models.actor, tp, args.actor_lora_dim, args.actor_gradient_checkpointing),
        critic: models
            .critic
            .as_ref()
            .map(|c| shape(args, c, tp, args.critic_lora_dim, args.critic_gradient_checkpointing)),
        reward,
        generation_rows: args.per_device_generation_batch_size * args.num_samples_per_prompt,
        training_rows: args.per_device_training_batch_size,
        positions: args.max_prompt_seq_len + args.max_answer_seq_len,
        answer_positions: args.max_answer_seq_len,
        dtype: precision.dtype.dtype(),
        fp32_loss: precision.fp32_loss,
        device,
        world,
        actor_stage: actor_engine.parallel.zero_stage,
        critic_stage: critic_engine.parallel.zero_stage,
        buckets: (actor_engine.parallel.reduce_bucket_size, actor_engine.parallel.allgather_bucket_size),
        tensor_parallel: tp,
        gradient_accumulation: args.gradient_accumulation_steps,
        offload: actor_engine.parallel.offload,
        offload_reference: args.offload_reference_model,
        ema: args.enable_ema,
        process_bytes: (process_mib * 1024.0 * 1024.0) as u64,
    });
    println!("{}", plan.report());
    plan.check_fits(device)
}

/// The actor's and the critic's optimizer steps over the run: each rollout (its prompts'
/// answers, `global_generation` prompts) is sliced into micro-batches of `global_micro` rows,
/// each an actor and a critic micro-step (PTX adds its loss to the actor's micro-step: no step
/// of its own).
fn optimizer_steps(
    args: &PpoArgs,
    rollouts_per_epoch: usize,
    (global_generation, global_micro): (usize, usize),
) -> u64 {
    let micro_per_rollout = (global_generation * args.num_samples_per_prompt).div_ceil(global_micro);
    let micro_total = args.num_train_epochs * rollouts_per_epoch * micro_per_rollout * args.ppo_epochs;
    micro_total.div_ceil(args.gradient_accumulation_steps) as u64
}

/// `--inference-tp-size`: the group of consecutive ranks this one generates rollouts with (the
/// layout and the actor's heads checked now, before any work), `None` without it.
fn inference_tp_group(args: &PpoArgs, group: &ProcessGroup, actor: &Gpt2Config) -> Result<Option<Arc<ProcessGroup>>> {
    match args.inference_tp_size as usize {
        1 => Ok(None),
        t => {
            check_divides(actor.n_head, actor.inner_dim(), t)?;
            let layout = ParallelLayout::new(group, t)?;
            println!(
                "inference tensor parallel: each rollout generated by groups of {t} ranks, the actor split by heads"
            );
            Ok(Some(layout.tp))
        }
    }
}

/// `--unsupervised-dataset-name`, when given: the PTX corpus packed in blocks of a prompt and an
/// answer (text, or a Megatron `.bin`/`.idx` whose tokens must fit the actor's `vocab_size`).
fn ptx_corpus(args: &PpoArgs, tokenizer: &Tokenizer, vocab_size: usize) -> Result<Option<PackedCorpus>> {
    let Some(name) = args.unsupervised_dataset_name.as_deref() else { return Ok(None) };
    let context = args.max_prompt_seq_len + args.max_answer_seq_len;
    let (corpus, _) = data::read_packed_corpus(&args.ptx_source(name)?, "text", tokenizer, context, vocab_size)?;
    if corpus.num_blocks() == 0 {
        bail!("--unsupervised-dataset-name {name}: the corpus is shorter than one block of {context} tokens");
    }
    println!("PTX: {} blocks of {context} tokens from {name}, coefficient {}", corpus.num_blocks(), args.unsup_coef);
    Ok(Some(corpus))
}

/// `--load`'s checkpoint, refused when made with other training flags (on `world` ranks).
fn read_checkpoint(
    args: &PpoArgs,
    root: &Path,
    world: usize,
    device: &Device,
) -> Result<crate::checkpoint::PpoCheckpoint> {
    let ck = crate::checkpoint::load(root, device)?;
    if ck.state.run != args.run_fingerprint(world) {
        bail!(
            "--load {}: the checkpoint was made with other training flags ({}); resume with the flags it was saved with",
            ck.dir.display(),
            ck.state.run
        );
    }
    Ok(ck)
}

/// Where the loop starts: at the beginning, or where `resume` left it (also its counts in
/// `summary`), with the PTX sampler over `ptx_blocks` blocks at its cursor.
fn starting_point(
    args: &PpoArgs,
    resume: Option<&crate::checkpoint::PpoCheckpoint>,
    ptx_blocks: usize,
    summary: &mut PpoSummary,
) -> Result<(Position, data::BlockSampler)> {
    // --normalize-reward: the running moments of the scores.
    let reward_moments = args.normalize_reward.then(ppo::RunningMoments::default);
    let Some(ck) = resume else {
        let at = Position { step: 0, micro: 0, epoch: 1, batches_done: 0, kl_ctl: args.kl_ctl, reward_moments };
        return Ok((at, data::BlockSampler::new(0..ptx_blocks, args.seed)));
    };
    let st = &ck.state;
    let at = Position {
        step: st.step,
        micro: st.micro,
        epoch: st.epoch,
        batches_done: st.batches_done,
        // The KL coefficient of the next rollout's rewards: --kl-ctl, adapted with --kl-target.
        kl_ctl: st.kl_ctl.unwrap_or(args.kl_ctl),
        reward_moments: reward_moments.map(|_| st.reward_moments.unwrap_or_default()),
    };
    let ptx_cursor = data::BlockSampler::with_cursor(0..ptx_blocks, args.seed, st.ptx_cursor).context(
        "cannot resume: the --unsupervised-dataset-name corpus differs from the run that saved the checkpoint (use the same, or start anew without --load)",
    )?;
    (summary.rollouts_reused, summary.answers_dropped_short, summary.first_reward) =
        (st.rollouts_reused, st.answers_dropped_short, st.first_reward);
    Ok((at, ptx_cursor))
}

/// What the stages of the loop read: the flags, the ranks, the device.
struct Ctx<'a> {
    args: &'a PpoArgs,
    cfg: crate::PpoConfig,
    /// The ranks the rollouts and micro-batches are split over: every rank, or under tensor
    /// parallelism the data-parallel group.
    group: &'a ProcessGroup,
    /// `--tensor-model-parallel-size`: the models are this rank's slices.
    tp: Option<&'a TensorParallel>,
    device: Device,
    actor_cfg: Gpt2Config,
    eos: u32,
    vocab: usize,
    /// Rows of a PPO micro-batch over all ranks.
    global_micro: usize,
    /// `--inference-tp-size`: the ranks this one generates rollouts with.
    inference_tp: Option<Arc<ProcessGroup>>,
}

/// The rollout loop, DS-Chat's `ppo_trainer.py` stages in order for each batch of prompts:
/// generate the experience, compute its advantages, train the actor and critic on it, save a
/// checkpoint when one is due, log. It owns what a PPO step carries to the next (and what a
/// checkpoint records).
struct PpoLoop<'a> {
    ctx: Ctx<'a>,
    /// Every rank of the job (checkpoints are written by its first).
    whole: &'a ProcessGroup,
    tokenizer: &'a Tokenizer,
    prompts: &'a [data::phases::PromptSample],
    unsupervised: Option<&'a PackedCorpus>,
    models: PpoModels,
    engine: GenerationMode,
    metrics: Metrics,
    summary: PpoSummary,
    /// Rollouts waiting for training (`--generation-batches`).
    buffer: Vec<Experience>,
    /// DS-Chat's `last_generated_experience`: what a rollout of only too-short answers reuses.
    last_experience: Option<Experience>,
    micro: u64,
    step: u64,
    ptx_cursor: data::BlockSampler,
    /// The KL coefficient of the next rollout's rewards: --kl-ctl, adapted with --kl-target.
    kl_ctl: f64,
    /// --normalize-reward: the running moments of the scores.
    reward_moments: Option<ppo::RunningMoments>,
    /// `--reward-fn`: the scorers whose rewards are added to the reward model's score.
    reward_fns: Vec<RewardFn>,
    save_root: PathBuf,
    /// A --save-interval checkpoint waiting for a safe point.
    save_pending: bool,
    last_saved_step: u64,
    total_rollouts: u64,
}

impl PpoLoop<'_> {
    /// The epochs from `first_epoch` on, skipping its first `skip_batches` batches of prompts
    /// (a resumed run), `global_generation` prompts a batch.
    fn run_epochs(&mut self, first_epoch: usize, skip_batches: usize, global_generation: usize) -> Result<()> {
        let args = self.ctx.args;
        for epoch in first_epoch..=args.num_train_epochs {
            let order = data::pretrain::epoch_order(&(0..self.prompts.len()), args.seed, epoch as u64 - 1);
            let skip = if epoch == first_epoch { skip_batches } else { 0 };
            for (batch_index, chunk) in order.chunks(global_generation).enumerate().skip(skip) {
                if let Some(stop) = args.stop_after().filter(|&n| self.step >= n) {
                    self.metrics.println(&format!("--enable-test-mode: stopping after {stop} rollouts"));
                    return Ok(());
                }
                self.ppo_step(epoch, batch_index, chunk)?;
            }
        }
        Ok(())
    }

    /// One PPO step on the batch of prompts `chunk` (indices into the training prompts).
    fn ppo_step(&mut self, epoch: usize, batch_index: usize, chunk: &[usize]) -> Result<()> {
        self.step += 1;
        let rollout_started = Instant::now();
        let cfg = crate::PpoConfig { kl_ctl: self.kl_ctl, ..self.ctx.cfg.clone() };
        let (experience, groups_zero_std, generate_secs) = match self.make_experience(chunk, &cfg) {
            Err(e) if e.downcast_ref::<ScoringFailed>().is_some() => {
                return Err(self.save_after_failed_scoring(epoch, batch_index, e))
            }
            made => made?,
        };
        let rollout_secs = rollout_started.elapsed().as_secs_f64();
        let stats = RolloutStats { groups_zero_std, ..RolloutStats::of(&experience, self.ctx.group)? };
        let rollout_kl_ctl = self.adapt_kl_coefficient(&stats);
        let args = self.ctx.args;
        let every = args.print_answers_every();
        if every > 0 && (self.step - 1).is_multiple_of(every) {
            print_answers(&mut self.metrics, self.step, &experience, self.tokenizer, self.ctx.eos, 2)?;
        }
        self.summary.first_reward.get_or_insert(stats.reward_mean);
        self.summary.last_reward = Some(stats.reward_mean).filter(|r| r.is_finite());

        let train_started = Instant::now();
        let means = self.train_rlhf(experience, &cfg)?;
        let train_secs = train_started.elapsed().as_secs_f64();
        self.summary.steps = self.step;
        self.checkpoint_if_due(epoch, batch_index)?;
        let times = PhaseSecs { generate: generate_secs, rollout: rollout_secs, train: train_secs };
        let rollout = RolloutReport { stats: &stats, kl_ctl: rollout_kl_ctl, adaptive: args.kl_target.is_some() };
        let step = self.step;
        log_step(&mut self.metrics, epoch, step, self.total_rollouts, &rollout, &means, times, &self.models)
    }

    /// The stages before training: this rank's share of the rollout generated and scored
    /// (`generate_experience`), its advantages (`compute_advantages`), or the previous rollout
    /// again when no rank kept an answer; with GRPO's and RLOO's share of groups whose answers
    /// all scored the same, and this rank's seconds of generation.
    fn make_experience(&mut self, chunk: &[usize], cfg: &crate::PpoConfig) -> Result<(Experience, Option<f64>, f64)> {
        let samples = self.ctx.args.num_samples_per_prompt;
        // Each prompt --num-samples-per-prompt times in a row: a group of consecutive positions.
        let rollout: Vec<&[u32]> =
            chunk.iter().flat_map(|&i| std::iter::repeat_n(self.prompts[i].ids.as_slice(), samples)).collect();
        let (tokenizer, reward_fns, whole) = (self.tokenizer, &mut self.reward_fns, self.whole);
        let mut external = |rows: &[(&[u32], &[u32])]| {
            let scored = external_rewards(reward_fns, tokenizer, rows);
            scored_on_every_rank(whole, scored, !reward_fns.is_empty())
        };
        let scoring = Scoring { external: &mut external, moments: &mut self.reward_moments };
        let (mut experience, totals) =
            generate_share(&self.ctx, &self.models, &mut self.engine, &rollout, self.step, cfg, scoring)?;
        let mut groups_zero_std = None;
        if let Some(exp) = &mut experience {
            groups_zero_std = compute_advantages(exp, self.ctx.group, samples, cfg)?;
        }
        self.summary.answers_dropped_short += totals.dropped_short as u64;
        let experience = match experience {
            Some(e) => e,
            None => match &self.last_experience {
                // DS-Chat's `last_generated_experience`: every answer was too short.
                Some(previous) => {
                    self.summary.rollouts_reused += 1;
                    self.metrics.println(&format!(
                        " step {}: all {} answers had at most one token; reusing the previous rollout",
                        self.step, totals.generated
                    ));
                    previous.clone()
                }
                None => bail!("the actor's first rollout gave only empty or one-token answers: check the step-1 model and --max-answer-seq-len"),
            },
        };
        self.last_experience = Some(experience.clone());
        Ok((experience, groups_zero_std, totals.generate_secs))
    }

    /// --kl-target: the next rollout's KL coefficient from this one's KL. Returns the
    /// coefficient this rollout's rewards used.
    fn adapt_kl_coefficient(&mut self, stats: &RolloutStats) -> f64 {
        let used = self.kl_ctl;
        let args = self.ctx.args;
        if let Some(target) = args.kl_target {
            let (kl, rows) = (stats.kl_ref_sequence, stats.rows);
            if kl.is_finite() {
                self.kl_ctl = ppo::adaptive_kl_coefficient(self.kl_ctl, kl, target, rows, args.kl_horizon);
            }
        }
        used
    }

    /// DS-Chat's `train_rlhf`: once `--generation-batches` rollouts are buffered, the PPO epochs
    /// over them (actor, critic, PTX); the phase's means over every rank (NaN while collecting).
    fn train_rlhf(&mut self, experience: Experience, cfg: &crate::PpoConfig) -> Result<UpdateMeans> {
        self.buffer.push(experience);
        let mut updates = Updates::default();
        if self.buffer.len() == self.ctx.args.generation_batches {
            let ptx = self.unsupervised.map(|corpus| (corpus, &mut self.ptx_cursor));
            updates = ppo_epochs(&self.ctx, &mut self.models, &self.buffer, self.step, &mut self.micro, ptx, cfg)?;
            self.buffer.clear();
        }
        updates.global_means(self.ctx.group)
    }

    /// A --save-interval checkpoint, at a safe point (no rollout buffered, no gradient pending);
    /// an interval that falls elsewhere is moved to the next safe point, and the log says so.
    fn checkpoint_if_due(&mut self, epoch: usize, batch_index: usize) -> Result<()> {
        let (args, step) = (self.ctx.args, self.step);
        let models = &self.models;
        let safe_point = self.buffer.is_empty()
            && models.actor.trainer().at_boundary()
            && models.critic.as_ref().is_none_or(|c| c.trainer().at_boundary());
        let at_interval = args.save_interval > 0 && step % args.save_interval == 0;
        if at_interval && !safe_point && !self.save_pending {
            self.metrics.println(&format!(
                " rollout {step}: the --save-interval checkpoint moves to the next safe point (rollouts are buffered for --generation-batches or gradients are accumulating)"
            ));
        }
        self.save_pending |= at_interval;
        if !(self.save_pending && safe_point) {
            return Ok(());
        }
        let at = Position {
            step,
            micro: self.micro,
            epoch,
            batches_done: batch_index + 1,
            kl_ctl: self.kl_ctl,
            reward_moments: self.reward_moments,
        };
        let world = self.ctx.group.world();
        let state = checkpoint_state(args, world, at, models, &self.ptx_cursor, &self.summary);
        let gathered = GatheredModels::of(models, self.ctx.tp)?;
        if let Some(dir) = save_checkpoint(self.whole, &self.save_root, models, &gathered, &state, self.tokenizer)? {
            self.metrics.println(&format!(" saved a step-3 checkpoint at rollout {step} to {}", dir.display()));
        }
        (self.save_pending, self.last_saved_step) = (false, step);
        Ok(())
    }
}

impl PpoLoop<'_> {
    /// A rollout that could not be scored ends the run, every rank together, without losing what
    /// it trained: the rollouts before this one (batch `batch_index` of `epoch`) are saved as a
    /// checkpoint whatever --save-interval says, and the error returned says how to resume. The
    /// models are as that rollout's end left them: generating and scoring change nothing
    /// a checkpoint keeps (the rollout's sampling is keyed by its number).
    fn save_after_failed_scoring(&mut self, epoch: usize, batch_index: usize, error: anyhow::Error) -> anyhow::Error {
        let done = self.step - 1;
        let root = self.save_root.display().to_string();
        let resume = format!("once the reward function works, resume with the same command and --load {root}");
        let models = &self.models;
        let safe_point = self.buffer.is_empty()
            && models.actor.trainer().at_boundary()
            && models.critic.as_ref().is_none_or(|c| c.trainer().at_boundary());
        let what = if done == 0 {
            "no rollout was done, so nothing is saved".to_string()
        } else if done == self.last_saved_step {
            format!("the checkpoint of rollout {done} is saved already; {resume}")
        } else if !safe_point {
            let last = match self.last_saved_step {
                0 => "no checkpoint was saved".to_string(),
                step => format!("the last checkpoint is rollout {step}'s; {resume}"),
            };
            format!("rollout {done} is no point to save at (rollouts are buffered for --generation-batches or gradients are accumulating): {last}")
        } else {
            let at = Position {
                step: done,
                micro: self.micro,
                epoch,
                batches_done: batch_index,
                kl_ctl: self.kl_ctl,
                reward_moments: self.reward_moments,
            };
            let state =
                checkpoint_state(self.ctx.args, self.ctx.group.world(), at, models, &self.ptx_cursor, &self.summary);
            let saved = GatheredModels::of(models, self.ctx.tp).and_then(|gathered| {
                save_checkpoint(self.whole, &self.save_root, models, &gathered, &state, self.tokenizer)
            });
            match saved {
                Ok(_) => format!("saved a checkpoint of rollouts 1-{done} to {root}; {resume}"),
                Err(save) => return save.context(format!("saving the rollouts done after: {error:#}")),
            }
        };
        anyhow::anyhow!("{error:#}; {what}")
    }

    /// The end of the run: the trained models saved, the final checkpoint, then on rank 0 the
    /// held-out evaluation of `eval_prompts` (with the reward model of `reward_cfg`, if any).
    fn finish(
        mut self,
        batches_per_epoch: usize,
        eval_prompts: Option<&[String]>,
        reward_cfg: Option<&Gpt2Config>,
    ) -> Result<PpoSummary> {
        self.models.flush()?;
        self.metrics.finish();
        // The models first: the held-out evaluation below can take long, and a run stopped
        // during it must not lose what it trained.
        let gathered = self.save_models()?;
        self.final_checkpoint(&gathered, batches_per_epoch)?;
        // The other ranks end once rank 0 has saved; it evaluates alone, with no collective (on
        // the whole actor gathered for the save under ZeRO-3).
        self.whole.barrier()?;
        if !self.whole.is_first() {
            return Ok(self.summary);
        }
        hybrid_engine::durable::failpoint("ppo-before-eval");
        if let Some(prompts) = eval_prompts {
            self.evaluate_held_out(&gathered, prompts, reward_cfg)?;
        }
        let peak = peak_rss_mib();
        self.metrics.end(json!({"event": "end", "summary": self.summary, "peak_rss_mib": peak}))?;
        Ok(self.summary)
    }

    /// The actor, critic and EMA as HF directories, every rank together: a model sharded at
    /// rest without TP is gathered block by block and written by rank 0 as the blocks arrive,
    /// LoRA adapters fused in (no rank holds it whole); the others are gathered whole onto rank 0
    /// (under TP), or are whole there, and rank 0 saves them.
    fn save_models(&self) -> Result<GatheredModels> {
        let (args, models) = (self.ctx.args, &self.models);
        let gathered = GatheredModels::of(models, self.ctx.tp)?;
        let first = self.whole.is_first();
        let write_tok = |d: &Path| self.tokenizer.save(&d.join("tokenizer.json"));
        let save = |name: &str, config: &Gpt2Config, save: ModelSave| -> Result<()> {
            let dir = args.output_dir.join(name);
            match save {
                ModelSave::Sharded { model, values, .. } => {
                    save_sharded_model_dir(self.whole, &dir, config, model, values, &write_tok)
                }
                ModelSave::Whole(Some((params, _))) => save_model_dir(&dir, config, params, &write_tok),
                ModelSave::Whole(None) => Ok(()),
            }
        };
        for model in gathered.saved_models(models, None, self.ctx.eos, first)? {
            save(model.name, &model.config, model.save)?;
        }
        let actor_dir = args.output_dir.join("actor");
        if first {
            println!("saved the PPO actor to {} (chat --path {})", actor_dir.display(), actor_dir.display());
        }
        Ok(gathered)
    }

    /// The end of the run is resumable: a checkpoint of the final state (its models the ones
    /// just saved, `gathered`), unless the last interval already wrote it or
    /// --no-final-checkpoint.
    fn final_checkpoint(&self, gathered: &GatheredModels, batches_per_epoch: usize) -> Result<()> {
        let (args, step) = (self.ctx.args, self.step);
        if step == self.last_saved_step || args.no_final_checkpoint {
            return Ok(());
        }
        let at = Position {
            step,
            micro: self.micro,
            epoch: args.num_train_epochs,
            batches_done: batches_per_epoch,
            kl_ctl: self.kl_ctl,
            reward_moments: self.reward_moments,
        };
        let world = self.ctx.group.world();
        let state = checkpoint_state(args, world, at, &self.models, &self.ptx_cursor, &self.summary);
        let written = save_checkpoint(self.whole, &self.save_root, &self.models, gathered, &state, self.tokenizer)?;
        if let Some(dir) = written {
            let size = directory_bytes(&dir) as f64 / (1u64 << 30) as f64;
            println!(
                "saved the final step-3 checkpoint (rollout {step}, {size:.2} GiB) to {} (--no-final-checkpoint skips it)",
                dir.display()
            );
        }
        Ok(())
    }

    /// Rank 0: the starting (SFT) actor against the trained one on the held-out `prompts`, by
    /// the reward model's score (when there is one), the task score and the KL to the reference.
    fn evaluate_held_out(
        &mut self,
        gathered: &GatheredModels,
        prompts: &[String],
        reward_cfg: Option<&Gpt2Config>,
    ) -> Result<()> {
        let (args, device, actor_cfg) = (self.ctx.args, &self.ctx.device, &self.ctx.actor_cfg);
        // Under tensor parallelism the frozen models are slices, under ZeRO stage 3 shards:
        // rank 0, evaluating alone, reads them whole again.
        let resident = self.models.reference.resident()?;
        let whole_frozen;
        let (reference, reward) = match (resident.whole_trunk(), &self.models.reward) {
            (Some(reference), reward @ (None | Some(TrainedModel::Whole { .. }))) if self.ctx.tp.is_none() => {
                (reference, reward.as_ref())
            }
            _ => {
                whole_frozen = read_whole_frozen_models(args, actor_cfg, reward_cfg, device)?;
                (&whole_frozen.0, whole_frozen.1.as_ref())
            }
        };
        let evaluate = |actor: (&str, &hybrid_engine::Gpt2)| {
            evaluate_policy(
                actor,
                reference,
                reward,
                self.tokenizer,
                prompts,
                args.max_prompt_seq_len,
                args.max_answer_seq_len,
                args.per_device_generation_batch_size,
                device,
            )
        };
        // An actor saved sharded is read back from its directory.
        let saved;
        let final_actor = match &gathered.actor {
            Some(weights) => weights.params(&self.models.actor),
            None => {
                let dir = args.output_dir.join("actor").display().to_string();
                saved = read_model(&dir, "the saved actor", Some(0.0), device)?.1;
                &saved
            }
        };
        let name = args.algorithm.label();
        let trained = self.engine.model(final_actor, actor_cfg)?;
        let (before, after) = (evaluate(("SFT actor", reference))?, evaluate((&format!("{name} actor"), &trained))?);
        let task = |e: &PolicyEval| score_text(e.task_success);
        let score = |e: &PolicyEval| score_text(e.reward_mean);
        println!(
            "held-out prompts ({}): reward score SFT {} -> {name} {}; task score SFT {} -> {name} {}; answer length {:.1} -> {:.1} tokens; KL to SFT {:.3} nats{}",
            before.prompts,
            score(&before),
            score(&after),
            task(&before),
            task(&after),
            before.answer_len_mean,
            after.answer_len_mean,
            after.kl_to_reference,
            heldout_countries_clause(
                before.heldout_country_prompts,
                before.heldout_country_task_success,
                after.heldout_country_task_success,
                name
            ),
        );
        self.metrics.record(json!({"event": "eval", "sft": before, "ppo": after}))?;
        (self.summary.sft_eval, self.summary.ppo_eval) = (Some(before), Some(after));
        Ok(())
    }
}

/// The reference and the reward model (of `reward_cfg`, if any) whole, in the compute dtype,
/// read again from their directories: for rank 0's held-out evaluation where the ranks hold
/// slices or shards of them.
fn read_whole_frozen_models(
    args: &PpoArgs,
    actor_cfg: &Gpt2Config,
    reward_cfg: Option<&Gpt2Config>,
    device: &Device,
) -> Result<(hybrid_engine::Gpt2, Option<TrainedModel>)> {
    let precision = args.precision.precision();
    let dtype = precision.dtype.dtype();
    let (_, reference, _) =
        read_model(&args.actor_model_name_or_path, "--actor-model-name-or-path", Some(0.0), device)?;
    let reward = match reward_cfg {
        Some(cfg) => {
            let (_, reward) =
                read_reward_model(&args.critic_model_name_or_path, "--critic-model-name-or-path", Some(0.0), device)?;
            Some(TrainedModel::reward(reward_model_on(&reward.compute_copy(dtype)?, cfg, precision.fp32_loss, None)?))
        }
        None => None,
    };
    Ok((lm_on(&reference.compute_copy(dtype)?, actor_cfg, precision.fp32_loss, None)?, reward))
}

/// `--reward-fn`'s scorers, started (an `exec:` process for each rank), said in a line by the
/// first rank.
fn start_reward_fns(args: &PpoArgs, rank: usize) -> Result<Vec<RewardFn>> {
    if args.reward_fn.is_empty() {
        return Ok(Vec::new());
    }
    let timeout = std::time::Duration::from_secs_f64(args.reward_fn_timeout);
    let fns =
        args.reward_fn.iter().map(|spec| spec.start(timeout, args.reward_fn_tries)).collect::<Result<Vec<_>>>()?;
    if rank == 0 {
        let specs: Vec<String> = args.reward_fn.iter().map(|s| s.to_string()).collect();
        let model = if args.no_reward_model { "" } else { "the reward model's score + " };
        println!("rewards: {model}{} (each rank runs its own scorers on its answers)", specs.join(" + "));
    }
    Ok(fns)
}

/// The sum of `--reward-fn`'s rewards of each of a rollout's answers, given as the prompt's
/// tokens (padding removed) and the answer's (EOS removed); zeros without any.
fn external_rewards(fns: &mut [RewardFn], tokenizer: &Tokenizer, rows: &[(&[u32], &[u32])]) -> Result<Vec<f32>> {
    if fns.is_empty() {
        return Ok(vec![0.0; rows.len()]);
    }
    let mut total = vec![0f64; rows.len()];
    let answers = rows
        .iter()
        .map(|(p, a)| Ok(Answer { prompt: tokenizer.decode(p)?, answer: tokenizer.decode(a)? }))
        .collect::<Result<Vec<_>>>()?;
    for f in fns {
        for (t, r) in total.iter_mut().zip(f.score(&answers)?) {
            *t += r;
        }
    }
    Ok(total.into_iter().map(|t| t as f32).collect())
}

/// A rollout's `--reward-fn` rewards on this rank (`scored`), once every rank of `group` knows
/// that all of them scored theirs (one scalar reduction a rollout; none without scorers, `any`
/// false): otherwise [`ScoringFailed`] on every rank, with this rank's error or the first
/// failing rank's number.
fn scored_on_every_rank(group: &ProcessGroup, scored: Result<Vec<f32>>, any: bool) -> Result<Vec<f32>> {
    if !any {
        return scored;
    }
    let world = group.world();
    // The first failing rank r as world - r, the largest over the ranks; 0: none failed.
    let mut first_failed = [if scored.is_err() { (world - group.rank()) as f64 } else { 0.0 }];
    group.all_reduce_scalars(&mut first_failed, ReduceOp::Max)?;
    match scored {
        Err(e) => Err(ScoringFailed(format!("{e:#}")).into()),
        Ok(_) if first_failed[0] > 0.0 => {
            let rank = world - first_failed[0] as usize;
            Err(ScoringFailed(format!("rank {rank}'s --reward-fn failed (its log says how)")).into())
        }
        Ok(rewards) => Ok(rewards),
    }
}

/// Rows of a rollout over all ranks.
#[derive(Clone, Copy, Debug, Default)]
struct RolloutTotals {
    generated: usize,
    dropped_short: usize,
    /// This rank's seconds in the actor's generation (the rest of the rollout is the experience:
    /// log-probs, values, scores, advantages).
    generate_secs: f64,
}

/// Generation and scoring of this rank's share of the rollout `prompts` (the whole rollout, in
/// order), each row sampled from the stream of its position in the rollout, so that what it
/// samples does not depend on the world size. Returns this rank's experience, empty when only
/// the other ranks kept rows, or `None` when no rank did; and the rollout's totals.
fn generate_share(
    ctx: &Ctx,
    models: &PpoModels,
    engine: &mut GenerationMode,
    prompts: &[&[u32]],
    step: u64,
    cfg: &crate::PpoConfig,
    scoring: Scoring,
) -> Result<(Option<Experience>, RolloutTotals)> {
    let (args, group) = (ctx.args, ctx.group);
    let share = rollout_share(prompts.len(), ctx.global_micro, group.rank(), group.world());
    let batch: Vec<Vec<u32>> = share.iter().map(|&i| prompts[i].to_vec()).collect();
    let padded =
        LeftPadded::new(&batch, args.max_prompt_seq_len, ctx.eos).with_keys(share.iter().map(|&i| i as u64).collect());
    let sampling = sampling_config(args, ctx.eos, ctx.vocab, step);
    // Generation mode, once per rollout: gather, fuse, dropout off. Under ZeRO stage 3 every
    // rank gathers the whole actor here (one collective per rollout, in the compute dtype; with
    // LoRA in fp16/bf16 twice, fused for generation and unfused for the old log-probs, in fp32
    // once under TP) and drops it when this function returns, before training. Each rank then generates its own rows with its full
    // copy: generation makes no collective, so a rank whose answers all ended early, or that
    // has no prompt at all, cannot leave another waiting. With --inference-tp-size the actor is
    // instead cut into this rank's slices and its TP group generates all the group's rows in
    // lockstep (the same rows and tokens on every rank of the group).
    let gathered_actor = models.actor.gather_for_generation()?;
    // With LoRA on sharded masters in fp16/bf16, the adapters fused on the fp32 shards.
    let fused_actor = models.actor.gather_fused_for_generation()?;
    let whole_actor = fused_actor.as_ref().or(gathered_actor.as_ref()).unwrap_or(models.actor.whole_weights());
    // The old log-probs come from the gathered actor too, read as the training loss reads them
    // (generation ignores `fp32_loss`). With LoRA that is with the adapters unfused: a fused
    // weight rounds differently from the training forward's `x W + s (x A^T) B^T`.
    let precision = args.precision.precision();
    let unfused_actor = match &gathered_actor {
        Some(gathered) if gathered.lora_scaling().is_some() => {
            let compute = gathered.compute_copy(precision.dtype.dtype())?;
            let mut model = match ctx.tp {
                Some(tp) => compute.model_tensor_parallel(&ctx.actor_cfg, tp.tp())?,
                None => compute.model(&ctx.actor_cfg)?,
            };
            model.fp32_loss = precision.fp32_loss;
            Some(model)
        }
        _ => None,
    };
    // Trained under tensor parallelism, the actor generates from its own slices.
    let mut split_actor = match (ctx.tp, &ctx.inference_tp) {
        (Some(tp), _) => Some(engine.model_of_slices(whole_actor, &ctx.actor_cfg, tp.tp())?),
        (None, Some(tp)) => Some(engine.model_tensor_parallel(whole_actor, &ctx.actor_cfg, tp)?),
        (None, None) => None,
    };
    // The whole generation model: to generate with, or under ZeRO-3 (without LoRA) as the
    // actor's forward for the old log-probs.
    let needs_whole =
        split_actor.is_none() || (gathered_actor.is_some() && unfused_actor.is_none() && ctx.tp.is_none());
    let mut whole_model = needs_whole.then(|| engine.model(whole_actor, &ctx.actor_cfg)).transpose()?;
    // The gathered weights are not needed once in the models (which share them where no cast
    // or LoRA fusion made new tensors).
    drop(gathered_actor);
    // Under ZeRO-3 and TP the split generation model is the forward too.
    let forward_model = match ctx.tp {
        Some(_) => split_actor.as_mut(),
        None => whole_model.as_mut(),
    };
    if let (TrainedModel::Sharded(_), None, Some(m)) = (models.actor.model(), &unfused_actor, forward_model) {
        m.fp32_loss = precision.fp32_loss;
    }
    let actor_forward = match (models.actor.model(), &unfused_actor, &whole_model, &split_actor) {
        (TrainedModel::Whole { trunk, .. }, ..) => &**trunk,
        (TrainedModel::Sharded(_), Some(unfused), ..) => unfused,
        (TrainedModel::Sharded(_), None, Some(whole), _) => whole,
        (TrainedModel::Sharded(_), None, None, Some(split)) => split,
        (TrainedModel::Sharded(_), None, None, None) => bail!("internal error: no actor for the old log-probs"),
    };
    // An offloaded reference comes to the device for this rollout only.
    let reference = models.reference.resident()?;
    let rollout = RolloutModels {
        actor: actor_forward,
        reference: &reference,
        critic: models.critic.as_ref().map(Engine::model),
        reward: models.reward.as_ref(),
    };
    let mut generate = |padded: &LeftPadded| match (&split_actor, &ctx.inference_tp, &whole_model) {
        (Some(split), Some(tp), _) => generate_with_group(ctx, engine, split, tp, prompts, &sampling),
        // Under training TP every rank of the TP group holds the same rows.
        (Some(split), None, _) => engine.generate(split, padded, &sampling, &ctx.device),
        (_, _, Some(whole)) => engine.generate(whole, padded, &sampling, &ctx.device),
        _ => bail!("internal error: no actor to generate with"),
    };
    let Scoring { external, moments } = scoring;
    let mut normalize = |scores: &[f32]| normalize_scores(moments, group, scores);
    let mut generate_secs = 0.0;
    let timed_generate = |padded: &LeftPadded| {
        let started = Instant::now();
        let generation = generate(padded);
        generate_secs = started.elapsed().as_secs_f64();
        generation
    };
    let (experience, counts) = generate_experience(
        &rollout,
        timed_generate,
        &padded,
        prompts.len(),
        &sampling,
        cfg,
        external,
        &mut normalize,
        &ctx.device,
    )?;
    let kept = experience.as_ref().map_or(0, |e| e.b);
    let mut totals = [kept as f64, counts.dropped_short as f64, counts.generated as f64];
    group.all_reduce_scalars(&mut totals, ReduceOp::Sum)?;
    let totals_rows = RolloutTotals { generated: totals[2] as usize, dropped_short: totals[1] as usize, generate_secs };
    // Reusing the previous rollout is the ranks' common decision: each reuses its own share.
    let experience = match experience {
        None if totals[0] > 0.0 => Some(Experience::empty(args.max_prompt_seq_len, prompts.len())),
        e => e,
    };
    Ok((experience, totals_rows))
}

/// What turns a rollout's answers into scores besides the reward model: `--reward-fn`'s
/// rewards ([`external_rewards`]) added to its score, then `--normalize-reward`'s running moments.
struct Scoring<'a, 'f> {
    external: &'a mut ExternalRewards<'f>,
    moments: &'a mut Option<ppo::RunningMoments>,
}

/// `--normalize-reward`: `scores` normalised by the running moments, which first take this
/// rollout's scores over every rank of `group` (unchanged without the flag: `moments` `None`).
fn normalize_scores(
    moments: &mut Option<ppo::RunningMoments>,
    group: &ProcessGroup,
    scores: &[f32],
) -> Result<Vec<f32>> {
    let Some(moments) = moments.as_mut() else { return Ok(scores.to_vec()) };
    let mut batch = [scores.len() as f64, 0.0, 0.0];
    for &x in scores {
        (batch[1], batch[2]) = (batch[1] + f64::from(x), batch[2] + f64::from(x) * f64::from(x));
    }
    group.all_reduce_scalars(&mut batch, ReduceOp::Sum)?;
    moments.update(batch[0], batch[1], batch[2]);
    Ok(scores.iter().map(|&x| moments.normalize(f64::from(x)) as f32).collect())
}

/// `--inference-tp-size`: the rows of every rank of this rank's inference TP group `tp`, each
/// keyed by its position in the rollout `prompts`, generated together by the group with the
/// split actor `model` (a collective in every layer, so every rank of the group runs the same
/// rows to the same end); this rank's own rows of the result, in the order of its share.
fn generate_with_group(
    ctx: &Ctx,
    engine: &mut GenerationMode,
    model: &Gpt2,
    tp: &ProcessGroup,
    prompts: &[&[u32]],
    sampling: &SamplingConfig,
) -> Result<Generation> {
    let (rank, world) = (ctx.group.rank(), ctx.group.world());
    let first = rank - tp.rank();
    let shares: Vec<Vec<usize>> =
        (first..first + tp.world()).map(|r| rollout_share(prompts.len(), ctx.global_micro, r, world)).collect();
    let rows = shares.concat();
    let mine = shares[tp.rank()].len();
    if rows.is_empty() {
        return Ok(Generation { tokens: Vec::new(), logprobs: Vec::new() });
    }
    let batch: Vec<Vec<u32>> = rows.iter().map(|&i| prompts[i].to_vec()).collect();
    let padded = LeftPadded::new(&batch, ctx.args.max_prompt_seq_len, ctx.eos)
        .with_keys(rows.iter().map(|&i| i as u64).collect());
    let all = engine.generate(model, &padded, sampling, &ctx.device)?;
    let offset: usize = shares[..tp.rank()].iter().map(Vec::len).sum();
    Ok(Generation {
        tokens: all.tokens[offset..offset + mine].to_vec(),
        logprobs: all.logprobs[offset..offset + mine].to_vec(),
    })
}

/// What a training phase measured on this rank (its parts of the global means).
#[derive(Default)]
struct Updates {
    stats: Vec<UpdateStats>,
    /// This rank's PTX loss of each update.
    ptx_losses: Vec<f64>,
    /// With `--target-kl`: the micro-batches gone through and planned, when the phase stopped
    /// early.
    stopped_early: Option<(usize, usize)>,
}

/// Means over a training phase's updates of the global micro-batches' measurements.
struct UpdateMeans {
    stats: UpdateStats,
    /// Over the updates after the phase's first, whose ratio is 1 by construction: where the
    /// policy has moved and clipping can act. `None` with fewer than two updates.
    later: Option<UpdateStats>,
    ptx_loss: Option<f64>,
    stopped_early: Option<(usize, usize)>,
}

impl Updates {
    /// The means over the phase's updates, each update's values reduced over the ranks (every
    /// rank ran the same updates). NaN when the phase had none (rollouts are being collected).
    fn global_means(&self, group: &ProcessGroup) -> Result<UpdateMeans> {
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
fn ppo_epochs(
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

/// Saves a checkpoint of the ranks' common state, with the models' `gathered` weights: every
/// rank gathers the optimizers of the models whole on rank 0 (a collective) and writes its
/// shards of those saved sharded. Returns the directory on rank 0.
fn save_checkpoint(
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
fn saved_sharded(engine: &Engine) -> Option<&ShardedModel> {
    engine.sharded().filter(|_| engine.tensor_parallel().is_none())
}

/// The trained models' weights gathered whole on rank 0 (see [`Engine::gather_weights`]) where
/// they are not saved sharded, and the EMA's.
struct GatheredModels {
    /// `None` for a model saved sharded.
    actor: Option<GatheredWeights>,
    critic: Option<GatheredWeights>,
    /// `None` for an EMA that is whole on every rank (stages 0-2 without TP), read directly, or
    /// saved sharded with the actor.
    ema: Option<ParamStore>,
}

/// The trained models' whole optimizers on rank 0, for a checkpoint.
#[derive(Clone, Copy)]
struct Optimizers<'a> {
    actor: Option<&'a AdamW>,
    critic: Option<&'a AdamW>,
}

impl GatheredModels {
    /// Every rank must call it (the gathers are collectives).
    fn of(models: &PpoModels, tp: Option<&TensorParallel>) -> Result<Self> {
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
    fn saved_models<'a>(
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
struct Position {
    step: u64,
    micro: u64,
    epoch: usize,
    batches_done: usize,
    kl_ctl: f64,
    reward_moments: Option<ppo::RunningMoments>,
}

/// What a checkpoint needs to resume from `at`.
fn checkpoint_state(
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

/// `--tensor-model-parallel-size`: the TP layout of the ranks, or `None` without TP. Every
/// rank calls it together. `--inference-tp-size` has nothing to do under it (one line).
fn tensor_parallel(args: &PpoArgs, group: &ProcessGroup) -> Result<Option<TensorParallel>> {
    let size = args.dist.tensor_model_parallel_size;
    if size > 1 && args.inference_tp_size > 1 {
        bail!("--inference-tp-size re-lays a TP=1 actor out for generation, but under --tensor-model-parallel-size {size} the actor already generates split over its TP group: drop --inference-tp-size");
    }
    args.dist.tensor_parallel(group)
}

/// A warning when the actor trains with dropout: its rollout log-probs are computed without it
/// (generation mode), so the PPO ratio of an unchanged policy departs from 1 by dropout noise
/// alone and clipping reacts to it. DS-Chat passes `--actor_dropout 0.0`.
fn actor_dropout_warning(cfg: &Gpt2Config) -> Option<String> {
    let p = cfg.resid_pdrop.max(cfg.embd_pdrop).max(cfg.attn_pdrop);
    (p > 0.0).then(|| {
        format!(
            "warning: the actor trains with dropout {p} but its rollout log-probs are computed without, so the PPO ratio \
             and clipping react to dropout noise: pass --actor-dropout 0 (as DS-Chat does)"
        )
    })
}

/// Rollout sampling: DS-Chat's greedy decoding, or sampling with `--do-sample` (a new seed per
/// step so rollouts differ).
fn sampling_config(args: &PpoArgs, eos: u32, vocab_limit: usize, step: u64) -> SamplingConfig {
    let greedy = SamplingConfig::greedy(args.max_answer_seq_len, Some(eos), eos, vocab_limit);
    if !args.do_sample {
        return greedy;
    }
    SamplingConfig {
        temperature: Some(args.temperature),
        top_k: (args.top_k > 0).then_some(args.top_k),
        top_p: (args.top_p < 1.0).then_some(args.top_p),
        seed: args.seed.wrapping_mul(1_000_003).wrapping_add(step),
        ..greedy
    }
}

/// Inputs and next-token targets of PTX blocks: (B, T) each.
fn ptx_batch(corpus: &PackedCorpus, idx: &[usize], device: &Device) -> Result<(Tensor, Tensor)> {
    let t = corpus.seq_length();
    let (mut x, mut y) = (Vec::new(), Vec::new());
    for &i in idx {
        let block = corpus.block(i)?;
        x.extend_from_slice(&block[..t]);
        y.extend_from_slice(&block[1..]);
    }
    Ok((Tensor::from_vec(x, (idx.len(), t), device)?, Tensor::from_vec(y, (idx.len(), t), device)?))
}

/// Sums over a rollout's rows behind [`RolloutStats`]: summed over the ranks, they give the
/// statistics of the whole rollout.
#[derive(Clone, Copy, Debug, Default)]
struct RolloutSums {
    rows: f64,
    reward: f64,
    reward_sq: f64,
    kl_k1: f64,
    kl_k3: f64,
    /// Per answer, the KL to the reference summed over its tokens (k1).
    kl_sequence: f64,
    answer_len: f64,
    eos: f64,
    /// Per answer, the mean advantage over its tokens: their sum and sum of squares.
    adv: f64,
    adv_sq: f64,
    /// Over the unmasked answer actions: their count, the returns and the critic's errors.
    actions: f64,
    ret: f64,
    ret_sq: f64,
    err: f64,
    err_sq: f64,
}

impl RolloutSums {
    fn of(exp: &Experience) -> Self {
        let mut s = Self { rows: exp.b as f64, ..Self::default() };
        let width = exp.actions() - exp.start;
        for r in 0..exp.b {
            let score = f64::from(exp.scores[r]);
            (s.reward, s.reward_sq) = (s.reward + score, s.reward_sq + score * score);
            let mask = &exp.row(&exp.action_mask, r)[exp.start..];
            let (k1, k3) = ppo::kl_estimates(
                &exp.row(&exp.logprobs, r)[exp.start..],
                &exp.row(&exp.ref_logprobs, r)[exp.start..],
                mask,
            );
            (s.kl_k1, s.kl_k3) = (s.kl_k1 + k1, s.kl_k3 + k3);
            s.kl_sequence += k1 * mask.iter().map(|&m| f64::from(m)).sum::<f64>();
            s.answer_len += exp.answer_lens[r] as f64;
            s.eos += f64::from(u8::from(exp.ended_with_eos[r]));
            let values = &exp.row(&exp.values, r)[exp.start..];
            let returns = &exp.returns[r * width..(r + 1) * width];
            let advantages = &exp.advantages[r * width..(r + 1) * width];
            let tokens = mask.iter().map(|&m| f64::from(m)).sum::<f64>();
            let adv = mask.iter().zip(advantages).map(|(&m, &a)| f64::from(m * a)).sum::<f64>() / tokens.max(1.0);
            (s.adv, s.adv_sq) = (s.adv + adv, s.adv_sq + adv * adv);
            for ((&m, &v), &g) in mask.iter().zip(values).zip(returns) {
                if m > 0.0 {
                    let (g, e) = (f64::from(g), f64::from(g - v));
                    s.actions += 1.0;
                    (s.ret, s.ret_sq, s.err, s.err_sq) = (s.ret + g, s.ret_sq + g * g, s.err + e, s.err_sq + e * e);
                }
            }
        }
        s
    }

    fn to_array(self) -> [f64; 15] {
        [
            self.rows,
            self.reward,
            self.reward_sq,
            self.kl_k1,
            self.kl_k3,
            self.kl_sequence,
            self.answer_len,
            self.eos,
            self.adv,
            self.adv_sq,
            self.actions,
            self.ret,
            self.ret_sq,
            self.err,
            self.err_sq,
        ]
    }

    fn from_array(a: [f64; 15]) -> Self {
        let [rows, reward, reward_sq, kl_k1, kl_k3, kl_sequence, answer_len, eos, adv, adv_sq, actions, ret, ret_sq, err, err_sq] =
            a;
        Self {
            rows,
            reward,
            reward_sq,
            kl_k1,
            kl_k3,
            kl_sequence,
            answer_len,
            eos,
            adv,
            adv_sq,
            actions,
            ret,
            ret_sq,
            err,
            err_sq,
        }
    }

    /// The sums over every rank's rows.
    fn over_ranks(self, group: &ProcessGroup) -> Result<Self> {
        let mut a = self.to_array();
        group.all_reduce_scalars(&mut a, ReduceOp::Sum)?;
        Ok(Self::from_array(a))
    }
}

/// The population variance of values with `n`, `sum` and `sum_sq`.
fn variance(n: f64, sum: f64, sum_sq: f64) -> f64 {
    let mean = sum / n.max(1.0);
    (sum_sq / n.max(1.0) - mean * mean).max(0.0)
}

/// What a rollout says about the policy, over every rank's rows: reward, KL to the reference,
/// answer lengths, EOS share, how well the critic explains the returns.
/// A rollout's statistics over every rank: the log line's and metrics.jsonl's `rollout` (these
/// names; NaN is written as null).
#[derive(Clone, Copy, Debug, serde::Serialize)]
struct RolloutStats {
    reward_mean: f64,
    reward_std: f64,
    kl_ref_k1: f64,
    kl_ref_sequence: f64,
    kl_ref_k3: f64,
    explained_variance: f64,
    answer_len_mean: f64,
    advantage_mean: f64,
    advantage_std: f64,
    eos_share: f64,
    rows: f64,
    /// GRPO and RLOO: the share of the rollout's groups whose answers all scored the same.
    #[serde(skip_serializing_if = "Option::is_none")]
    groups_zero_std: Option<f64>,
}

impl RolloutStats {
    fn of(exp: &Experience, group: &ProcessGroup) -> Result<Self> {
        let s = RolloutSums::of(exp).over_ranks(group)?;
        let n = s.rows.max(1.0);
        Ok(Self {
            reward_mean: s.reward / n,
            reward_std: variance(s.rows, s.reward, s.reward_sq).sqrt(),
            kl_ref_k1: s.kl_k1 / n,
            kl_ref_sequence: s.kl_sequence / n,
            kl_ref_k3: s.kl_k3 / n,
            explained_variance: 1.0 - variance(s.actions, s.err, s.err_sq) / variance(s.actions, s.ret, s.ret_sq),
            answer_len_mean: s.answer_len / n,
            advantage_mean: s.adv / n,
            advantage_std: variance(s.rows, s.adv, s.adv_sq).sqrt(),
            eos_share: s.eos / n,
            rows: s.rows,
            groups_zero_std: None,
        })
    }
}

/// A rollout's statistics for the log, with the KL coefficient its rewards used.
struct RolloutReport<'a> {
    stats: &'a RolloutStats,
    kl_ctl: f64,
    /// `--kl-target` adapts the coefficient: the log line shows it.
    adaptive: bool,
}

/// The bytes of the files under `dir` (what a checkpoint costs on disk).
fn directory_bytes(dir: &Path) -> u64 {
    let Ok(entries) = std::fs::read_dir(dir) else { return 0 };
    entries
        .flatten()
        .map(|e| match e.file_type() {
            Ok(t) if t.is_dir() => directory_bytes(&e.path()),
            _ => e.metadata().map_or(0, |m| m.len()),
        })
        .sum()
}

/// A PPO step's seconds on this rank: the rollout (`generate`, then the experience) and training.
#[derive(Clone, Copy)]
struct PhaseSecs {
    generate: f64,
    rollout: f64,
    train: f64,
}

#[allow(clippy::too_many_arguments)]
fn log_step(
    metrics: &mut Metrics,
    epoch: usize,
    step: u64,
    total: u64,
    rollout: &RolloutReport,
    updates: &UpdateMeans,
    times: PhaseSecs,
    models: &PpoModels,
) -> Result<()> {
    let (u, stats, critic) = (&updates.stats, rollout.stats, models.critic.as_ref());
    // The ratio and the clip fraction the log line shows: over the updates after the phase's
    // first (whose ratio is 1 by construction) when there are some.
    let shown = updates.later.unwrap_or(*u);
    let record = json!({
        "step": step,
        "epoch": epoch,
        "rollout": stats,
        "kl_ctl": rollout.kl_ctl,
        "actor_loss": u.actor_loss,
        "critic_loss": critic.map(|_| u.critic_loss),
        "ratio_mean": u.ratio_mean,
        "clip_fraction": u.clip_fraction,
        "approx_kl": u.approx_kl,
        "ratio_mean_after_first": updates.later.map(|l| l.ratio_mean),
        "clip_fraction_after_first": updates.later.map(|l| l.clip_fraction),
        "approx_kl_after_first": updates.later.map(|l| l.approx_kl),
        "updates_stopped_early": updates.stopped_early.map(|(done, planned)| json!({"done": done, "planned": planned})),
        "entropy": u.entropy,
        "ptx_loss": updates.ptx_loss,
        "actor_lr": models.actor.trainer().latest_lr(),
        "critic_lr": critic.map(|c| c.trainer().latest_lr()),
        "actor_loss_scale": models.actor.trainer().dynamic_loss_scale(),
        "critic_loss_scale": critic.map(|c| c.trainer().dynamic_loss_scale()),
        "actor_skipped_steps": models.actor.trainer().skipped_steps(),
        "critic_skipped_steps": critic.map(|c| c.trainer().skipped_steps()),
        "generation_secs": times.rollout,
        "generate_secs": times.generate,
        "experience_secs": times.rollout - times.generate,
        "training_secs": times.train,
    });
    // fp16 runs also show each model's loss scale and skipped updates.
    let actor = models.actor.trainer();
    let scaling = match (&actor.scaler, critic.map(|c| (&c.trainer().scaler, c.trainer().skipped_steps()))) {
        (Some(a), Some((Some(c), skipped))) => {
            format!(" loss scale {}/{} | skipped {}/{skipped} |", a.scale, c.scale, actor.skipped_steps())
        }
        (Some(a), None) => format!(" loss scale {} | skipped {} |", a.scale, actor.skipped_steps()),
        _ => String::new(),
    };
    let kl_ctl = if rollout.adaptive { format!(" (kl_ctl {:.4})", rollout.kl_ctl) } else { String::new() };
    let stopped = match updates.stopped_early {
        Some((done, planned)) => format!(" | stopped at target KL after {done}/{planned} updates"),
        None => String::new(),
    };
    // The critic's loss and how much of the return it explains, when there is one.
    let critic_loss =
        critic.map(|_| format!(" | critic loss {:.4} | expl var {:.3}", u.critic_loss, stats.explained_variance));
    metrics.println(&format!(
        " step {step:>5}/{total} | epoch {epoch} | reward {:.3} (std {:.3}) | kl_ref {:.4}{kl_ctl} | actor loss {:.4}{} | ratio {:.3} | clip {:.3} | approx kl {:.2e} | entropy {:.3} | answer len {:.1} | eos {:.2} | generate {:.1}s experience {:.1}s train {:.1}s{stopped} |{scaling}",
        stats.reward_mean,
        stats.reward_std,
        stats.kl_ref_k3,
        u.actor_loss,
        critic_loss.unwrap_or_default(),
        shown.ratio_mean,
        shown.clip_fraction,
        shown.approx_kl,
        u.entropy,
        stats.answer_len_mean,
        stats.eos_share,
        times.generate,
        times.rollout - times.generate,
        times.train,
    ));
    metrics.record(record)?;
    metrics.advance(format!("reward {:.3}", stats.reward_mean));
    Ok(())
}

/// A few decoded rollouts (DS-Chat `--print_answers`), printed, and as a table in TensorBoard's
/// text panel `rollout/samples` at `step`.
fn print_answers(
    metrics: &mut Metrics,
    step: u64,
    exp: &Experience,
    tok: &Tokenizer,
    pad: u32,
    n: usize,
) -> Result<()> {
    let p = exp.start + 1;
    let mut table = String::from("| prompt | answer | reward |\n|---|---|---|\n");
    let cell = hybrid_engine::telemetry::markdown_cell;
    for r in 0..exp.b.min(n) {
        let row = &exp.seq[r * exp.l..(r + 1) * exp.l];
        let prompt: Vec<u32> =
            row[..p].iter().zip(&exp.attention_mask[r * exp.l..]).filter(|(_, m)| **m == 1).map(|(t, _)| *t).collect();
        let answer: Vec<u32> = row[p..].iter().copied().take_while(|&t| t != pad).collect();
        let (prompt, answer) = (tok.decode(&prompt)?, tok.decode(&answer)?);
        metrics.println(&format!("--- prompt: {prompt:?}\n--- answer: {answer:?} (reward {:.3})", exp.scores[r]));
        table.push_str(&format!("| {} | {} | {:.3} |\n", cell(&prompt), cell(&answer), exp.scores[r]));
    }
    metrics.text(step as i64, "rollout/samples", &table)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;
    use hybrid_engine::engine::Head;
    use hybrid_engine::model::reward_model::add_score_head;
    use hybrid_engine::training::optim::AdamW;
    use hybrid_engine::training::optim::AdamWConfig;

    fn tiny_config() -> Gpt2Config {
        Gpt2Config {
            n_layer: 1,
            n_embd: 16,
            n_head: 2,
            n_positions: 16,
            vocab_size: 40,
            resid_pdrop: 0.0,
            embd_pdrop: 0.0,
            attn_pdrop: 0.0,
            ..Gpt2Config::tiny()
        }
    }

    /// Step 3's models on one rank, as `run` builds them from `flags`, over tiny random GPT-2s;
    /// the actor trains at `actor_lr` (the CLI refuses 0), the critic at 1e-3. Also returns a
    /// copy of the actor's starting weights.
    fn tiny_models(flags: &str, actor_lr: f64) -> (PpoArgs, PpoModels, ParamStore) {
        let args = PpoArgs::try_parse_from(std::iter::once("ppo").chain(flags.split_whitespace())).unwrap();
        let (cfg, cpu) = (tiny_config(), Device::Cpu);
        let group = std::sync::Arc::new(ProcessGroup::single());
        let actor = ParamStore::init(&cfg, 1, &cpu).unwrap();
        let start = actor.copy().unwrap();
        let mut critic = ParamStore::init(&cfg, 2, &cpu).unwrap();
        add_score_head(&mut critic, &cfg, 3, &cpu).unwrap();
        let (reference, reward) =
            (lm_on(&start, &cfg, false, None).unwrap(), reward_model_on(&critic, &cfg, false, None).unwrap());
        // As `run` configures them, over 10 optimizer steps at the given learning rates.
        let engine = |critic: bool, lr: f64| EngineConfig {
            schedule: args.lr_scheduler_type.schedule(lr, args.num_warmup_steps, 10),
            lora_learning_rate: Some(lr),
            ..args.engine_config(critic, 10, &group).unwrap()
        };
        let ranks = Ranks { data: group.clone(), tensor: None };
        let models = PpoModels {
            actor: Engine::new(&engine(false, actor_lr), &cfg, Head::Lm, actor, ranks.clone()).unwrap(),
            critic: Some(Engine::new(&engine(true, 1e-3), &cfg, Head::Score, critic.copy().unwrap(), ranks).unwrap()),
            reference: crate::models::Reference::Loaded(TrainedModel::lm(reference)),
            reward: Some(TrainedModel::reward(reward)),
            ema: args.enable_ema.then(|| Ema::Whole(start.copy().unwrap())),
            align_overflow: false,
        };
        (args, models, start)
    }

    /// Two rows of a 3-token prompt and a 3-token answer (the second ends early: pad 0), with
    /// the actor's own log-probs as the rollout's and advantages of both signs.
    fn tiny_experience(actor: &hybrid_engine::Gpt2) -> Experience {
        tiny_experience_at(actor, 1.0)
    }

    /// [`tiny_experience`] sampled at `temperature`.
    fn tiny_experience_at(actor: &hybrid_engine::Gpt2, temperature: f64) -> Experience {
        let (b, l, p, pad) = (2, 6, 3, 0u32);
        let seq = vec![5u32, 9, 13, 21, 7, 30, 2, 4, 6, 8, 11, pad];
        let attention_mask: Vec<u32> = seq.iter().map(|&t| u32::from(t != pad)).collect();
        let inputs = crate::experience::ForwardInputs::new(&seq, &attention_mask, b, l, &Device::Cpu)
            .unwrap()
            .with_temperature(temperature);
        let logprobs = inputs.logprobs(actor).unwrap();
        let mut exp = Experience::empty(p, b);
        let actions = (l - 1) * b;
        exp.action_mask = seq.chunks(l).flat_map(|row| ppo::action_mask(row, pad, p - 1, true)).collect();
        exp.advantages = vec![1.5, -0.7, 0.4, -1.2, 0.9, 0.3];
        exp.returns = vec![0.5, 0.2, -0.3, 0.1, 0.6, -0.4];
        exp.values = vec![0.0; actions];
        exp.ref_logprobs = logprobs.clone();
        exp.rewards = vec![0.0; actions];
        exp.scores = vec![1.0, -1.0];
        exp.reward_scores = exp.scores.clone();
        exp.answer_lens = vec![3, 2];
        exp.ended_with_eos = vec![false, true];
        exp.positions = vec![0, 1];
        Experience { seq, attention_mask, b, l, logprobs, ..exp }
    }

    fn micro_batch(exp: &Experience, micro: u64) -> MicroBatch<'_> {
        let rows = 0..exp.b;
        MicroBatch {
            exp,
            global_tokens: answer_tokens(exp, &rows),
            global_rows: rows.len() as f64,
            rows,
            rank: 0,
            world: 1,
            micro,
        }
    }

    fn actor_trunk(models: &PpoModels) -> &hybrid_engine::Gpt2 {
        match models.actor.model() {
            TrainedModel::Whole { trunk, .. } => trunk,
            TrainedModel::Sharded(_) => unreachable!("one rank"),
        }
    }

    fn values(store: &ParamStore) -> Vec<f32> {
        store.vars.iter().flat_map(|v| v.flatten_all().unwrap().to_vec1::<f32>().unwrap()).collect()
    }

    fn max_diff(a: &[f32], b: &[f32]) -> f32 {
        a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
    }

    /// The training forward reproduces the rollout's log-probs: at learning rate 0 every
    /// update sees ratio 1 and approx KL 0; after a real step the ratio departs from 1.
    #[test]
    fn the_ratio_is_1_until_the_policy_moves() {
        for (lr, moves) in [(0.0, false), (1e-2, true)] {
            // No warmup: DS-Chat's default of 100 steps makes the first update's rate 0.
            let (args, mut models, _) = tiny_models("--gradient-accumulation-steps 1 --num-warmup-steps 0", lr);
            let exp = tiny_experience(actor_trunk(&models));
            let first = models.train_rlhf(&micro_batch(&exp, 1), &args.ppo_config(), 7, None, &Device::Cpu).unwrap();
            assert!(first.actor_step.is_some(), "one micro-batch per step");
            let second = models.train_rlhf(&micro_batch(&exp, 2), &args.ppo_config(), 7, None, &Device::Cpu).unwrap();
            for (n, stats) in [(1, first.stats), (2, second.stats)] {
                let departed = (stats.ratio_mean - 1.0).abs() > 1e-4 && stats.approx_kl > 1e-8;
                if n == 1 || !moves {
                    assert!((stats.ratio_mean - 1.0).abs() < 1e-6, "lr {lr}, update {n}: {stats:?}");
                    assert!(stats.approx_kl.abs() < 1e-12, "lr {lr}, update {n}: {stats:?}");
                } else {
                    assert!(departed, "lr {lr}, update {n}: {stats:?}");
                }
            }
        }
    }

    /// Rollouts sampled at a temperature: the old log-probs and the training forward's are both
    /// of softmax(logits / T), so the ratio is 1 before the policy moves; read at another
    /// temperature than they were sampled at, it is not. The tempered log-probs are
    /// log_softmax(logits / T) at each action's token.
    #[test]
    fn the_ratio_reads_the_policy_at_the_temperature_it_sampled() {
        let (args, mut models, _) = tiny_models("--gradient-accumulation-steps 1 --do-sample --temperature 0.7", 0.0);
        let cfg = args.ppo_config();
        assert_eq!(cfg.temperature, 0.7);
        let exp = tiny_experience_at(actor_trunk(&models), 0.7);
        let logits = actor_trunk(&models)
            .forward(
                &Tensor::from_slice(&exp.seq, (exp.b, exp.l), &Device::Cpu).unwrap(),
                &Default::default(),
                None,
                None,
            )
            .unwrap();
        let logits: Vec<f32> = logits.flatten_all().unwrap().to_vec1().unwrap();
        let v = logits.len() / (exp.b * exp.l);
        for (r, t) in [(0, 2), (1, 3)] {
            let row = &logits[(r * exp.l + t) * v..(r * exp.l + t + 1) * v];
            let z: f64 = row.iter().map(|&x| (f64::from(x) / 0.7).exp()).sum();
            let token = exp.seq[r * exp.l + t + 1] as usize;
            let want = f64::from(row[token]) / 0.7 - z.ln();
            let got = f64::from(exp.logprobs[r * exp.actions() + t]);
            assert!((got - want).abs() < 1e-4, "row {r} action {t}: {got} vs {want}");
        }
        let stats = models.train_rlhf(&micro_batch(&exp, 1), &cfg, 7, None, &Device::Cpu).unwrap().stats;
        assert!((stats.ratio_mean - 1.0).abs() < 1e-6 && stats.approx_kl.abs() < 1e-12, "{stats:?}");
        let untempered = tiny_experience(actor_trunk(&models));
        let stats = models.train_rlhf(&micro_batch(&untempered, 2), &cfg, 7, None, &Device::Cpu).unwrap().stats;
        assert!((stats.ratio_mean - 1.0).abs() > 1e-3, "read at T = 0.7, sampled at 1: {stats:?}");
    }

    /// The action that emits EOS trains the actor and the critic (TRL, OpenRLHF): with every
    /// advantage and return zero but that action's, one update moves both models;
    /// `--mask-eos-action` (DS-Chat's mask) leaves them where they were.
    #[test]
    fn the_eos_action_trains_the_actor_and_the_critic_unless_masked() {
        for (flags, trains) in [("", true), ("--mask-eos-action", false)] {
            let flags = format!("--gradient-accumulation-steps 1 --num-warmup-steps 0 {flags}");
            let (args, mut models, start) = tiny_models(&flags, 1e-2);
            let cfg = args.ppo_config();
            assert_eq!(cfg.eos_action, trains);
            let mut exp = tiny_experience(actor_trunk(&models));
            // Row 1 is [2, 4, 6, 8, 11, pad]: its answer 8, 11, then EOS (= pad), emitted by
            // action 4, the third of its answer's actions.
            exp.action_mask =
                exp.seq.chunks(exp.l).flat_map(|row| ppo::action_mask(row, 0, exp.start, trains)).collect();
            let eos = exp.actions() - exp.start + 2;
            exp.advantages = vec![0.0; exp.advantages.len()];
            (exp.advantages[eos], exp.returns[eos]) = (1.0, 1.0);
            // The critic's own values as the old values and the returns: no error to learn
            // from but the EOS action's, whose return is its value plus 1.
            let critic = models.critic.as_ref().expect("PPO has a critic");
            let inputs =
                crate::experience::ForwardInputs::new(&exp.seq, &exp.attention_mask, exp.b, exp.l, &Device::Cpu)
                    .unwrap();
            let token_values = inputs.token_values(critic.model()).unwrap();
            exp.values = token_values.chunks(exp.l).flat_map(|row| row[..exp.l - 1].to_vec()).collect();
            exp.returns = exp.values.chunks(exp.actions()).flat_map(|row| row[exp.start..].to_vec()).collect();
            exp.returns[eos] += 1.0;
            let critic_start = values(critic.masters());
            models.train_rlhf(&micro_batch(&exp, 1), &cfg, 7, None, &Device::Cpu).unwrap();
            let actor_moved = max_diff(&values(models.actor.masters()), &values(&start));
            let critic_moved = max_diff(&values(models.critic.as_ref().unwrap().masters()), &critic_start);
            assert_eq!(actor_moved > 1e-6, trains, "{flags:?}: actor moved by {actor_moved}");
            assert_eq!(critic_moved > 1e-6, trains, "{flags:?}: critic moved by {critic_moved}");
        }
    }

    #[test]
    fn actor_dropout_above_0_is_warned_about() {
        assert_eq!(actor_dropout_warning(&tiny_config()), None);
        let line = actor_dropout_warning(&Gpt2Config { attn_pdrop: 0.1, ..tiny_config() }).expect("a warning");
        assert!(line.contains("dropout 0.1") && line.contains("--actor-dropout 0"), "{line}");
    }

    /// PTX adds `unsup_coef * L_LM` to the actor's PPO loss: one AdamW step on the sum's
    /// gradient (computed here by plain autodiff on a whole model), one EMA update.
    #[test]
    fn ptx_makes_one_update_from_the_summed_loss() {
        let cfg = tiny_config();
        let ptx_ids = Tensor::new(&[[3u32, 8, 12, 19, 25], [1, 2, 3, 4, 5]], &Device::Cpu).unwrap();
        let ptx_targets = Tensor::new(&[[8u32, 12, 19, 25, 31], [2, 3, 4, 5, 6]], &Device::Cpu).unwrap();
        let trained_with = |coef: f64| {
            let flags = "--gradient-accumulation-steps 1 --gradient-clipping 0 --enable-ema --adam-eps 1e-6 --num-warmup-steps 0";
            let (args, mut models, start) = tiny_models(flags, 1e-2);
            let exp = tiny_experience(actor_trunk(&models));
            let key = DropoutKey { seed: 7, step: 1, micro_batch: 0 };
            let ptx = PtxBatch { ids: ptx_ids.clone(), targets: ptx_targets.clone(), coef, key };
            let out =
                models.train_rlhf(&micro_batch(&exp, 1), &args.ppo_config(), 7, Some(&ptx), &Device::Cpu).unwrap();
            assert!(out.actor_step.is_some_and(|s| !s.skipped) && out.ptx_loss.is_some());
            assert_eq!(models.actor.trainer().optimizer.step, 1, "one optimizer step per update");
            let ema = match &models.ema {
                Some(Ema::Whole(ema)) => values(ema),
                _ => unreachable!(),
            };
            (args, models, start, exp, ema)
        };

        let coef = 0.5;
        let (args, models, start, exp, ema) = trained_with(coef);
        // The reference: the summed loss on a fresh model over the starting weights.
        let model = start.model(&cfg).unwrap();
        let inputs =
            crate::experience::ForwardInputs::new(&exp.seq, &exp.attention_mask, exp.b, exp.l, &Device::Cpu).unwrap();
        let logits = model.forward(&inputs.ids, &inputs.as_positions(), None, None).unwrap();
        let logp_all = candle_nn::ops::log_softmax(&logits, candle_core::D::Minus1).unwrap();
        let answer = exp.start..exp.l - 1;
        let next = inputs.ids.narrow(1, answer.start + 1, answer.len()).unwrap();
        let logp = logp_all
            .narrow(1, answer.start, answer.len())
            .unwrap()
            .contiguous()
            .unwrap()
            .gather(&next.unsqueeze(2).unwrap().contiguous().unwrap(), 2)
            .unwrap()
            .squeeze(2)
            .unwrap();
        let per_action = |a: &[f32]| {
            let rows: Vec<f32> = (0..exp.b).flat_map(|r| exp.row(a, r)[answer.clone()].to_vec()).collect();
            Tensor::from_vec(rows, (exp.b, answer.len()), &Device::Cpu).unwrap()
        };
        let old = per_action(&exp.logprobs);
        let mask = per_action(&exp.action_mask);
        let adv = Tensor::from_slice(&exp.advantages, (exp.b, answer.len()), &Device::Cpu).unwrap();
        let ppo_loss = ppo::actor_loss(&logp, &old, &adv, &mask, &args.ppo_config()).unwrap();
        let lm_loss = model.lm_loss(&ptx_ids, &ptx_targets, None).unwrap();
        let loss = (ppo_loss + (lm_loss * coef).unwrap()).unwrap();
        let grads = loss.backward().unwrap();
        let grads: Vec<Tensor> = start.vars.iter().map(|v| grads.get(v.as_tensor()).unwrap().clone()).collect();
        let adam = AdamWConfig::ds_chat(1e-6, 0.0);
        let mut optimizer = AdamW::new(adam, &start).unwrap();
        let lr = models.actor.trainer().schedule.lr(0);
        let before = values(&start);
        optimizer.step(&start, &grads, lr).unwrap();
        let (want, got) = (values(&start), values(models.actor.masters()));
        let moved = max_diff(&want, &before);
        assert!(moved > 1e-3, "the step moved the weights by {moved}");
        assert!(max_diff(&got, &want) < 1e-5, "off by {} (moved {moved})", max_diff(&got, &want));
        // One EMA update after the one step: 0.992 start + 0.008 updated.
        let want_ema: Vec<f32> = before.iter().zip(&got).map(|(s, a)| 0.992 * s + 0.008 * a).collect();
        assert!(max_diff(&ema, &want_ema) < 1e-6);

        // The coefficient matters: without PTX the update is another.
        let (_, without, ..) = trained_with(0.0);
        let differs = max_diff(&values(without.actor.masters()), &got);
        assert!(differs > 1e-4, "--unsup-coef 0 and {coef} gave updates {differs} apart");
    }
}
