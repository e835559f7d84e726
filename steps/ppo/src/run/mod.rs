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
//!
//! A rollout that no `--reward-fn` could score, on any rank, stops every rank at that rollout
//! with a checkpoint of the rollouts done (`save_after_failed_scoring`).

mod context;
mod rollout;
mod saves;
mod setup;
mod stats;
mod update;

use self::context::Ctx;
use self::rollout::{external_rewards, generate_share, scored_on_every_rank, Scoring};
use self::saves::{checkpoint_state, directory_bytes, save_checkpoint, GatheredModels, Position};
use self::setup::{
    actor_dropout_warning, check_memory_plan, inference_tp_group, optimizer_steps, ptx_corpus, read_checkpoint,
    read_whole_frozen_models, start_reward_fns, starting_point, tensor_parallel,
};
use self::stats::{log_step, print_answers, PhaseSecs, RolloutReport, RolloutStats};
use self::update::{ppo_epochs, UpdateMeans, Updates};
use crate::advantages::compute_advantages;
use crate::args::PpoArgs;
use crate::checkpoint::ModelSave;
use crate::eval::{evaluate_policy, heldout_countries_clause, score_text, PolicyEval};
use crate::experience::Experience;
use crate::models::{build_models, read_model, read_starting_models, PpoModels, Sharding};
use crate::ppo;
use crate::reward_fn::{RewardFn, ScoringFailed};
use anyhow::{bail, Result};
use data::{PackedCorpus, Tokenizer};
use hybrid_engine::checkpoints::resume::{save_model_dir, save_sharded_model_dir};
use hybrid_engine::comm::ProcessGroup;
use hybrid_engine::engine::Ranks;
use hybrid_engine::generation::mode::GenerationMode;
use hybrid_engine::model::gpt2::Gpt2Config;
use hybrid_engine::training::metrics::{peak_rss_mib, Metrics};
use hybrid_engine::training::tensor_parallel::data_group;
use hybrid_engine::training::train_step::TrainedModel;
use serde_json::json;
use std::path::{Path, PathBuf};
use std::time::Instant;

pub use self::stats::PpoSummary;

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
        last_saved_root: args.load.clone().unwrap_or_else(|| save_root.clone()),
        save_root,
        save_pending: false,
        last_saved_step: at.step,
        total_rollouts,
    };
    ppo_loop.run_epochs(at.epoch, at.batches_done, global_generation)?;
    ppo_loop.finish(batches_per_epoch, eval_prompts.as_deref(), reward_cfg.as_ref())
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
    /// Where the checkpoint of `last_saved_step` is: --load's root until this run saves one.
    last_saved_root: PathBuf,
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
        self.last_saved_root = self.save_root.clone();
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
        let resume_from = |root: &Path| {
            format!("once the reward function works, resume with the same command and --load {}", root.display())
        };
        let resume = resume_from(&self.save_root);
        let models = &self.models;
        let safe_point = self.buffer.is_empty()
            && models.actor.trainer().at_boundary()
            && models.critic.as_ref().is_none_or(|c| c.trainer().at_boundary());
        let what = if done == 0 {
            "no rollout was done, so nothing is saved".to_string()
        } else if done == self.last_saved_step {
            format!("the checkpoint of rollout {done} is saved already; {}", resume_from(&self.last_saved_root))
        } else if !safe_point {
            let last = match self.last_saved_step {
                0 => "no checkpoint was saved".to_string(),
                step => format!("the last checkpoint is rollout {step}'s; {}", resume_from(&self.last_saved_root)),
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
