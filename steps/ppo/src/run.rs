//! Step 3's loop (DS-Chat `step3_rlhf_finetuning/main.py`): load the four models, then per batch
//! of prompts generate experience; every `--generation-batches` rollouts run `--ppo-epochs`
//! passes of PPO updates over their micro-batches; log the diagnostics users need each step;
//! save `step3/{actor,critic,actor_ema}` as HF directories.

use crate::args::PpoArgs;
use crate::eval::{evaluate_policy, PolicyEval};
use crate::experience::{generate_experience, Experience, RolloutModels};
use crate::ppo;
use crate::trainer::{PpoModels, Trained, UpdateStats};
use anyhow::{bail, Context, Result};
use candle_core::{Device, Tensor};
use data::{PackedCorpus, Tokenizer};
use hybrid_engine::checkpoints::hf_io::{load_model_dir, resolve_model_dir};
use hybrid_engine::checkpoints::resume::save_model_dir;
use hybrid_engine::generation::engine::GenerationMode;
use hybrid_engine::generation::generate::{LeftPadded, SamplingConfig};
use hybrid_engine::model::gpt2::Gpt2Config;
use hybrid_engine::model::reward_model::{causal_lm_config, sequence_classification_config, RewardModel, SCORE_WEIGHT};
use hybrid_engine::training::metrics::{peak_rss_mib, Metrics};
use hybrid_engine::training::optim::AdamWConfig;
use hybrid_engine::training::schedule::LrSchedule;
use hybrid_engine::training::trainer::Trainer;
use hybrid_engine::ParamStore;
use serde::Serialize;
use serde_json::json;
use std::path::Path;
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

/// A model directory's config and tensors (trunk and heads), with a dropout override.
fn read_model(
    name: &str,
    flag: &str,
    dropout: Option<f64>,
    device: &Device,
) -> Result<(Gpt2Config, ParamStore, hybrid_engine::checkpoints::hf_io::ModelFiles)> {
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
fn read_reward_model(
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

fn schedule(args: &PpoArgs, lr: f64, total: u64) -> LrSchedule {
    LrSchedule {
        max_lr: lr,
        min_lr: 0.0,
        warmup_iters: args.num_warmup_steps,
        decay_iters: total,
        style: args.lr_scheduler_type,
    }
}

/// Runs step 3.
pub fn run(args: &PpoArgs) -> Result<PpoSummary> {
    args.validate()?;
    let device = hybrid_engine::device::parse_device(&args.device)?;
    println!("device: {}", hybrid_engine::device::describe(&device));
    let cfg = args.ppo_config();

    // Models: actor and reference from step 1, critic and reward from step 2.
    let (actor_cfg, actor_params, actor_files) =
        read_model(&args.actor_model_name_or_path, "--actor-model-name-or-path", args.actor_dropout, &device)?;
    let tokenizer = Tokenizer::from_model_dir_or_default(&actor_files.dir)?;
    let eos = tokenizer.eos_id();
    let (_, ref_params, _) =
        read_model(&args.actor_model_name_or_path, "--actor-model-name-or-path", Some(0.0), &device)?;
    let (critic_cfg, critic_params) = read_reward_model(
        &args.critic_model_name_or_path,
        "--critic-model-name-or-path",
        args.critic_dropout,
        &device,
    )?;
    let (reward_cfg, reward_params) =
        read_reward_model(&args.critic_model_name_or_path, "--critic-model-name-or-path", Some(0.0), &device)?;
    let context = args.max_prompt_seq_len + args.max_answer_seq_len;
    for (what, c) in [("actor", &actor_cfg), ("critic", &critic_cfg)] {
        if context > c.n_positions {
            bail!("--max-prompt-seq-len + --max-answer-seq-len = {context} exceeds the {what}'s context of {} positions: lower them", c.n_positions);
        }
        if tokenizer.vocab_size() > c.vocab_size {
            bail!("the {what} embeds {} tokens but the actor's tokenizer has {}: pass models trained with the same tokenizer", c.vocab_size, tokenizer.vocab_size());
        }
    }

    // Data: phase-3 prompts; optional PTX blocks.
    let data_cfg = args.data.config(args.seed, context, args.max_prompt_seq_len, false)?;
    let prompts = data::phases::prompt_data(&data_cfg, &tokenizer)?;
    println!("{}", prompts.summary);
    let unsupervised = match &args.unsupervised_dataset_name {
        None => None,
        Some(name) => {
            let docs = data::read_documents(&data::CorpusSource::parse(name), "text")?;
            let tokens = data::tokenize_documents(&tokenizer, &docs)?;
            let corpus = PackedCorpus::pack(&tokens, eos, context);
            if corpus.num_blocks() == 0 {
                bail!("--unsupervised-dataset-name {name}: the corpus is shorter than one block of {context} tokens");
            }
            println!(
                "PTX: {} blocks of {context} tokens from {name}, coefficient {}",
                corpus.num_blocks(),
                args.unsup_coef
            );
            Some(corpus)
        }
    };
    hybrid_engine::comm::refuse_distributed("step 3 (PPO)")?;
    for (flag, stage) in
        [("--actor-zero-stage", args.actor_zero_stage), ("--critic-zero-stage", args.critic_zero_stage)]
    {
        if stage > 0 {
            println!("{flag} {stage} with 1 process: nothing to shard, training as stage 0");
        }
    }

    // Optimizer steps: each rollout is sliced into micro-batches, each an actor and a critic
    // micro-step (and a PTX actor micro-step).
    let rollouts_per_epoch = prompts.train.len().div_ceil(args.per_device_generation_batch_size);
    let micro_per_rollout = args.per_device_generation_batch_size.div_ceil(args.per_device_training_batch_size);
    let micro_total = args.num_train_epochs * rollouts_per_epoch * micro_per_rollout * args.ppo_epochs;
    let critic_steps = micro_total.div_ceil(args.gradient_accumulation_steps) as u64;
    let actor_steps = critic_steps * if unsupervised.is_some() { 2 } else { 1 };
    // LoRA: fresh adapters on the trained models (the step-1 and step-2 saves are merged).
    let (mut actor_params, mut critic_params) = (actor_params, critic_params);
    for (what, params, cfg, dim, module, lr) in [
        (
            "actor",
            &mut actor_params,
            &actor_cfg,
            args.actor_lora_dim,
            &args.actor_lora_module_name,
            args.actor_lora_learning_rate,
        ),
        (
            "critic",
            &mut critic_params,
            &critic_cfg,
            args.critic_lora_dim,
            &args.critic_lora_module_name,
            args.critic_lora_learning_rate,
        ),
    ] {
        if let Some(lora) = PpoArgs::lora(dim, module) {
            let targets = params.add_lora(cfg, &lora, args.seed)?;
            println!(
                "{what} LoRA: rank {dim} on {} linears matching {module:?}, scaling 1/{dim}, lr {lr:e}",
                targets.len()
            );
            if args.only_optimize_lora {
                params.freeze_trunk();
            }
        }
    }
    // Resume: the trained models' values from the checkpoint (the frozen ones from their dirs).
    let resume = args.load.as_deref().map(|root| crate::checkpoint::load(root, &device)).transpose()?;
    if let Some(ck) = &resume {
        if ck.state.run != args.run_fingerprint() {
            bail!(
                "--load {}: the checkpoint was made with other training flags ({}); resume with the flags it was saved with",
                ck.dir.display(),
                ck.state.run
            );
        }
        crate::checkpoint::restore_values(&actor_params, &ck.actor, "actor")?;
        crate::checkpoint::restore_values(&critic_params, &ck.critic, "critic")?;
    }
    // Forward and backward run on copies in the compute dtype (the masters themselves in fp32).
    let precision = args.precision.precision();
    let dtype = precision.dtype.dtype();
    let actor_compute = actor_params.compute_copy(dtype)?;
    let critic_compute = critic_params.compute_copy(dtype)?;
    let actor_model = lm_on(&actor_compute, &actor_cfg, precision.fp32_loss)?;
    let critic_model = reward_model_on(&critic_compute, &critic_cfg, precision.fp32_loss)?;
    let ema = match (args.enable_ema, resume.as_ref().and_then(|ck| ck.ema.as_ref())) {
        (false, _) => None,
        (true, saved) => {
            let ema = actor_params.copy()?;
            if let Some(saved) = saved {
                crate::checkpoint::restore_values(&ema, saved, "actor_ema")?;
            }
            Some(ema)
        }
    };
    let mut models = PpoModels {
        actor: trained(
            args,
            actor_params,
            &actor_compute,
            &actor_cfg,
            actor_model,
            args.actor_learning_rate,
            args.actor_lora_learning_rate,
            args.actor_weight_decay,
            actor_steps,
            args.actor_gradient_checkpointing,
        )?,
        critic: trained(
            args,
            critic_params,
            &critic_compute,
            &critic_cfg,
            critic_model,
            args.critic_learning_rate,
            args.critic_lora_learning_rate,
            args.critic_weight_decay,
            critic_steps,
            args.critic_gradient_checkpointing,
        )?,
        reference: lm_on(&ref_params.compute_copy(dtype)?, &actor_cfg, precision.fp32_loss)?,
        reward: reward_model_on(&reward_params.compute_copy(dtype)?, &reward_cfg, precision.fp32_loss)?,
        ema,
        align_overflow: args.align_overflow,
    };
    if let Some(ck) = &resume {
        let (a, c) = (&mut models.actor, &mut models.critic);
        a.trainer.optimizer.load_state(&a.trainable, ck.state.actor_steps, &ck.actor_optimizer)?;
        c.trainer.optimizer.load_state(&c.trainable, ck.state.critic_steps, &ck.critic_optimizer)?;
        if let (Some(ap), Some(cp)) = (&ck.state.actor_progress, &ck.state.critic_progress) {
            a.trainer.restore_progress(ap)?;
            c.trainer.restore_progress(cp)?;
        }
        println!("resumed from {} at rollout {}", ck.dir.display(), ck.state.step);
    }
    let mut engine =
        GenerationMode::new(args.max_prompt_seq_len, args.max_answer_seq_len, args.release_inference_cache)
            .with_dtype(dtype);

    let total_rollouts = (args.num_train_epochs * rollouts_per_epoch) as u64;
    let mut metrics = Metrics::open(&args.output_dir, total_rollouts, resume.as_ref().map_or(0, |ck| ck.state.step))?;
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
    let mut buffer: Vec<Experience> = Vec::new();
    let mut last_experience: Option<Experience> = None;
    let (mut micro, mut step) = (0u64, 0u64);
    let ptx_range = 0..unsupervised.as_ref().map_or(0, PackedCorpus::num_blocks);
    let mut ptx_cursor = data::BlockSampler::new(ptx_range.clone(), args.seed);
    let (mut first_epoch, mut skip_batches) = (1, 0);
    if let Some(ck) = &resume {
        let st = &ck.state;
        (micro, step, first_epoch, skip_batches) = (st.micro, st.step, st.epoch, st.batches_done);
        ptx_cursor = data::BlockSampler::with_cursor(ptx_range.clone(), args.seed, st.ptx_cursor).context(
            "cannot resume: the --unsupervised-dataset-name corpus differs from the run that saved the checkpoint (use the same, or start anew without --load)",
        )?;
        (summary.rollouts_reused, summary.answers_dropped_short, summary.first_reward) =
            (st.rollouts_reused, st.answers_dropped_short, st.first_reward);
    }
    let save_root = args.save.clone().unwrap_or_else(|| args.output_dir.join("checkpoints"));
    let (mut save_pending, mut last_saved_step) = (false, step);
    let batches_per_epoch = prompts.train.len().div_ceil(args.per_device_generation_batch_size);
    for epoch in first_epoch..=args.num_train_epochs {
        let order = data::pretrain::epoch_order(&(0..prompts.train.len()), args.seed, epoch as u64 - 1);
        let skip = if epoch == first_epoch { skip_batches } else { 0 };
        for (batch_index, chunk) in order.chunks(args.per_device_generation_batch_size).enumerate().skip(skip) {
            step += 1;
            let rollout_started = Instant::now();
            let batch: Vec<Vec<u32>> = chunk.iter().map(|&i| prompts.train[i].ids.clone()).collect();
            let padded = LeftPadded::new(&batch, args.max_prompt_seq_len, eos);
            let sampling = sampling_config(args, eos, tokenizer.vocab_size(), step);
            // Generation mode, once per rollout: gather, fuse, dropout off.
            let generation_model = engine.model(&models.actor.params, &actor_cfg)?;
            let rollout = RolloutModels {
                actor_generation: &generation_model,
                actor: &models.actor.model,
                reference: &models.reference,
                critic: &models.critic.model,
                reward: &models.reward,
            };
            let (experience, counts) = generate_experience(&rollout, &mut engine, &padded, &sampling, &cfg, &device)?;
            summary.answers_dropped_short += counts.dropped_short as u64;
            let experience = match experience {
                Some(e) => e,
                None => match &last_experience {
                    // DS-Chat's `last_generated_experience`: every answer was too short.
                    Some(previous) => {
                        summary.rollouts_reused += 1;
                        metrics.println(&format!(" step {step}: all {} answers had at most one token; reusing the previous rollout", counts.generated));
                        previous.clone()
                    }
                    None => bail!("the actor's first rollout gave only empty or one-token answers: check the step-1 model and --max-answer-seq-len"),
                },
            };
            let generation_secs = rollout_started.elapsed().as_secs_f64();
            let rollout_stats = rollout_stats(&experience);
            if args.print_answers_interval > 0 && (step - 1) % args.print_answers_interval == 0 {
                print_answers(&metrics, &experience, &tokenizer, eos, 2)?;
            }
            last_experience = Some(experience.clone());
            buffer.push(experience);
            summary.first_reward.get_or_insert(rollout_stats["reward_mean"].as_f64().unwrap_or(f64::NAN));
            summary.last_reward = rollout_stats["reward_mean"].as_f64();

            // Training: once `generation_batches` rollouts are collected.
            let train_started = Instant::now();
            let mut updates: Vec<UpdateStats> = Vec::new();
            let mut ptx_losses = Vec::new();
            if buffer.len() == args.generation_batches {
                for ppo_epoch in 0..args.ppo_epochs {
                    let mut slices: Vec<(usize, std::ops::Range<usize>)> = Vec::new();
                    for (e, exp) in buffer.iter().enumerate() {
                        for s in (0..exp.b).step_by(args.per_device_training_batch_size) {
                            slices.push((e, s..(s + args.per_device_training_batch_size).min(exp.b)));
                        }
                    }
                    let shuffle = data::pretrain::epoch_order(&(0..slices.len()), args.seed ^ step, ppo_epoch as u64);
                    for k in shuffle {
                        let (e, rows) = slices[k].clone();
                        micro += 1;
                        let (stats, _, _) = models.train_rlhf(&buffer[e], rows, &cfg, args.seed, micro, &device)?;
                        updates.push(stats);
                        if let Some(corpus) = &unsupervised {
                            let idx = ptx_cursor.next_indices(args.per_device_training_batch_size);
                            let (ids, targets) = ptx_batch(corpus, &idx, &device)?;
                            let (loss, _) =
                                models.train_unsupervised(&ids, &targets, args.unsup_coef, args.seed, micro)?;
                            ptx_losses.push(f64::from(loss));
                        }
                    }
                }
                buffer.clear();
            }
            let train_secs = train_started.elapsed().as_secs_f64();
            summary.steps = step;
            let safe_point =
                buffer.is_empty() && models.actor.trainer.at_boundary() && models.critic.trainer.at_boundary();
            // A checkpoint needs a safe point (no rollout buffered, no gradient pending); an
            // interval that falls elsewhere is moved to the next safe point, and the log says so.
            let at_interval = args.save_interval > 0 && step % args.save_interval == 0;
            if at_interval && !safe_point && !save_pending {
                metrics.println(&format!(
                    " rollout {step}: the --save-interval checkpoint moves to the next safe point (rollouts are buffered for --generation-batches or gradients are accumulating)"
                ));
            }
            save_pending |= at_interval;
            if save_pending && safe_point {
                let state = checkpoint_state(args, step, micro, epoch, batch_index + 1, &models, &ptx_cursor, &summary);
                let dir = crate::checkpoint::save(&save_root, &models, &state, &tokenizer)?;
                metrics.println(&format!(" saved a step-3 checkpoint at rollout {step} to {}", dir.display()));
                (save_pending, last_saved_step) = (false, step);
            }
            log_step(
                &mut metrics,
                epoch,
                step,
                total_rollouts,
                &rollout_stats,
                &updates,
                &ptx_losses,
                generation_secs,
                train_secs,
                &models,
            )?;
        }
    }
    models.flush()?;
    metrics.finish();

    // The models first: the held-out evaluation below can take long, and a run stopped during
    // it must not lose what it trained.
    let actor_dir = args.output_dir.join("actor");
    let write_tok = |d: &Path| tokenizer.save(&d.join("tokenizer.json"));
    save_model_dir(&actor_dir, &causal_lm_config(&actor_cfg), &models.actor.params, &write_tok)?;
    save_model_dir(
        &args.output_dir.join("critic"),
        &sequence_classification_config(&critic_cfg, eos),
        &models.critic.params,
        &write_tok,
    )?;
    if let Some(ema) = &models.ema {
        save_model_dir(&args.output_dir.join("actor_ema"), &causal_lm_config(&actor_cfg), ema, &write_tok)?;
    }
    println!("saved the PPO actor to {} (chat --path {})", actor_dir.display(), actor_dir.display());
    // The end of the run is always resumable: a checkpoint of the final state (its models are
    // the ones just saved), unless the last interval already wrote it.
    if step != last_saved_step {
        let state = checkpoint_state(
            args,
            step,
            micro,
            args.num_train_epochs,
            batches_per_epoch,
            &models,
            &ptx_cursor,
            &summary,
        );
        let dir = crate::checkpoint::save(&save_root, &models, &state, &tokenizer)?;
        println!("saved the final step-3 checkpoint (rollout {step}) to {}", dir.display());
    }

    hybrid_engine::durable::failpoint("ppo-before-eval");
    if let Some(prompts) = &eval_prompts {
        let evaluate = |actor: &hybrid_engine::Gpt2| {
            evaluate_policy(
                actor,
                &models.reward,
                &tokenizer,
                prompts,
                args.max_prompt_seq_len,
                args.max_answer_seq_len,
                args.per_device_generation_batch_size,
                &device,
            )
        };
        let (before, after) =
            (evaluate(&models.reference)?, evaluate(&engine.model(&models.actor.params, &actor_cfg)?)?);
        let task = |e: &PolicyEval| e.task_success.map_or("n/a".to_string(), |t| format!("{t:.3}"));
        println!(
            "held-out prompts ({}): reward score SFT {:.3} -> PPO {:.3}; task score SFT {} -> PPO {}",
            prompts.len(),
            before.reward_mean,
            after.reward_mean,
            task(&before),
            task(&after)
        );
        metrics.record(json!({"event": "eval", "sft": before, "ppo": after}))?;
        (summary.sft_eval, summary.ppo_eval) = (Some(before), Some(after));
    }

    let peak = peak_rss_mib();
    metrics.record(json!({"event": "end", "summary": summary, "peak_rss_mib": peak}))?;
    Ok(summary)
}

/// Where the loop stands after `step` rollouts, `batches_done` of them in `epoch`: what a
/// checkpoint needs to resume.
#[allow(clippy::too_many_arguments)]
fn checkpoint_state(
    args: &PpoArgs,
    step: u64,
    micro: u64,
    epoch: usize,
    batches_done: usize,
    models: &PpoModels,
    ptx_cursor: &data::BlockSampler,
    summary: &PpoSummary,
) -> crate::checkpoint::PpoState {
    crate::checkpoint::PpoState {
        format_version: crate::checkpoint::PPO_FORMAT_VERSION,
        step,
        micro,
        epoch,
        batches_done,
        actor_steps: models.actor.trainer.optimizer.step,
        critic_steps: models.critic.trainer.optimizer.step,
        ptx_cursor: ptx_cursor.cursor(),
        rollouts_reused: summary.rollouts_reused,
        answers_dropped_short: summary.answers_dropped_short,
        first_reward: summary.first_reward,
        actor_progress: Some(models.actor.trainer.progress()),
        critic_progress: Some(models.critic.trainer.progress()),
        run: args.run_fingerprint(),
    }
}

/// A trained model with its optimizer over what it trains (everything, or with
/// `--only-optimize-lora` the adapters and heads), LoRA at its own learning rate.
#[allow(clippy::too_many_arguments)]
fn trained<M>(
    args: &PpoArgs,
    params: ParamStore,
    compute: &ParamStore,
    config: &Gpt2Config,
    model: M,
    lr: f64,
    lora_lr: f64,
    weight_decay: f64,
    steps: u64,
    checkpoint_activations: bool,
) -> Result<Trained<M>> {
    let trainable = params.trainable();
    let adam = AdamWConfig { beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay };
    let mut trainer = Trainer::new(&trainable, adam, schedule(args, lr, steps), args.gradient_accumulation_steps, 1.0)?
        .with_precision(args.precision.precision(), compute, args.precision.loss_scaling());
    trainer.set_lora_learning_rate(&trainable, lora_lr);
    Ok(Trained { trainer, config: config.clone(), params, trainable, model, checkpoint_activations })
}

/// A language model over `params` (the actor, or the frozen reference) in their dtype.
fn lm_on(params: &ParamStore, config: &Gpt2Config, fp32_loss: bool) -> Result<hybrid_engine::Gpt2> {
    let mut model = params.model(config)?;
    model.fp32_loss = fp32_loss;
    Ok(model)
}

/// A reward model over `params` (the critic, or the frozen reward model) in their dtype.
fn reward_model_on(params: &ParamStore, config: &Gpt2Config, fp32_loss: bool) -> Result<RewardModel> {
    let mut model = RewardModel::new(params, config)?;
    model.trunk.fp32_loss = fp32_loss;
    Ok(model)
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
        let block = corpus.block(i);
        x.extend_from_slice(&block[..t]);
        y.extend_from_slice(&block[1..]);
    }
    Ok((Tensor::from_vec(x, (idx.len(), t), device)?, Tensor::from_vec(y, (idx.len(), t), device)?))
}

fn mean_std(x: &[f64]) -> (f64, f64) {
    let n = x.len().max(1) as f64;
    let m = x.iter().sum::<f64>() / n;
    (m, (x.iter().map(|v| (v - m).powi(2)).sum::<f64>() / n).sqrt())
}

/// What a rollout says about the policy: reward, KL to the reference, answer lengths, EOS share,
/// how well the critic explains the returns.
fn rollout_stats(exp: &Experience) -> serde_json::Value {
    let scores: Vec<f64> = exp.scores.iter().map(|&s| f64::from(s)).collect();
    let (reward_mean, reward_std) = mean_std(&scores);
    let (mut k1, mut k3) = (0f64, 0f64);
    let (mut values, mut returns, mut masks) = (Vec::new(), Vec::new(), Vec::new());
    let width = exp.actions() - exp.start;
    for r in 0..exp.b {
        let mask = &exp.row(&exp.action_mask, r)[exp.start..];
        let (a, b) = ppo::kl_estimates(
            &exp.row(&exp.logprobs, r)[exp.start..],
            &exp.row(&exp.ref_logprobs, r)[exp.start..],
            mask,
        );
        k1 += a;
        k3 += b;
        values.extend_from_slice(&exp.row(&exp.values, r)[exp.start..]);
        returns.extend_from_slice(&exp.returns[r * width..(r + 1) * width]);
        masks.extend_from_slice(mask);
    }
    let n = exp.b as f64;
    let lens: Vec<f64> = exp.answer_lens.iter().map(|&l| l as f64).collect();
    json!({
        "reward_mean": reward_mean,
        "reward_std": reward_std,
        "kl_ref_k1": k1 / n,
        "kl_ref_k3": k3 / n,
        "explained_variance": ppo::explained_variance(&values, &returns, &masks),
        "answer_len_mean": mean_std(&lens).0,
        "eos_share": exp.ended_with_eos.iter().filter(|e| **e).count() as f64 / n,
        "rows": exp.b,
    })
}

#[allow(clippy::too_many_arguments)]
fn log_step(
    metrics: &mut Metrics,
    epoch: usize,
    step: u64,
    total: u64,
    rollout: &serde_json::Value,
    updates: &[UpdateStats],
    ptx: &[f64],
    generation_secs: f64,
    train_secs: f64,
    models: &PpoModels,
) -> Result<()> {
    let avg = |f: &dyn Fn(&UpdateStats) -> f64| {
        if updates.is_empty() {
            f64::NAN
        } else {
            updates.iter().map(f).sum::<f64>() / updates.len() as f64
        }
    };
    let record = json!({
        "step": step,
        "epoch": epoch,
        "rollout": rollout,
        "actor_loss": avg(&|u| u.actor_loss),
        "critic_loss": avg(&|u| u.critic_loss),
        "ratio_mean": avg(&|u| u.ratio_mean),
        "clip_fraction": avg(&|u| u.clip_fraction),
        "approx_kl": avg(&|u| u.approx_kl),
        "entropy": avg(&|u| u.entropy),
        "ptx_loss": if ptx.is_empty() { None } else { Some(ptx.iter().sum::<f64>() / ptx.len() as f64) },
        "actor_lr": models.actor.trainer.schedule.lr(models.actor.trainer.optimizer.step.max(1)),
        "critic_lr": models.critic.trainer.schedule.lr(models.critic.trainer.optimizer.step.max(1)),
        "actor_loss_scale": models.actor.trainer.dynamic_loss_scale(),
        "critic_loss_scale": models.critic.trainer.dynamic_loss_scale(),
        "actor_skipped_steps": models.actor.trainer.skipped_steps(),
        "critic_skipped_steps": models.critic.trainer.skipped_steps(),
        "generation_secs": generation_secs,
        "training_secs": train_secs,
    });
    // fp16 runs also show each model's loss scale and skipped updates.
    let scaling = match (&models.actor.trainer.scaler, &models.critic.trainer.scaler) {
        (Some(a), Some(c)) => format!(
            " loss scale {}/{} | skipped {}/{} |",
            a.scale,
            c.scale,
            models.actor.trainer.skipped_steps(),
            models.critic.trainer.skipped_steps()
        ),
        _ => String::new(),
    };
    metrics.println(&format!(
        " step {step:>5}/{total} | epoch {epoch} | reward {:.3} (std {:.3}) | kl_ref {:.4} | actor loss {:.4} | critic loss {:.4} | ratio {:.3} | clip {:.3} | entropy {:.3} | expl var {:.3} | answer len {:.1} | eos {:.2} | gen {:.1}s train {:.1}s |{scaling}",
        rollout["reward_mean"].as_f64().unwrap_or(f64::NAN),
        rollout["reward_std"].as_f64().unwrap_or(f64::NAN),
        rollout["kl_ref_k3"].as_f64().unwrap_or(f64::NAN),
        record["actor_loss"].as_f64().unwrap_or(f64::NAN),
        record["critic_loss"].as_f64().unwrap_or(f64::NAN),
        record["ratio_mean"].as_f64().unwrap_or(f64::NAN),
        record["clip_fraction"].as_f64().unwrap_or(f64::NAN),
        record["entropy"].as_f64().unwrap_or(f64::NAN),
        rollout["explained_variance"].as_f64().unwrap_or(f64::NAN),
        rollout["answer_len_mean"].as_f64().unwrap_or(f64::NAN),
        rollout["eos_share"].as_f64().unwrap_or(f64::NAN),
        generation_secs,
        train_secs,
    ));
    metrics.record(record)?;
    metrics.advance(format!("reward {:.3}", rollout["reward_mean"].as_f64().unwrap_or(f64::NAN)));
    Ok(())
}

/// A few decoded rollouts (DS-Chat `--print_answers`).
fn print_answers(metrics: &Metrics, exp: &Experience, tok: &Tokenizer, pad: u32, n: usize) -> Result<()> {
    let p = exp.start + 1;
    for r in 0..exp.b.min(n) {
        let row = &exp.seq[r * exp.l..(r + 1) * exp.l];
        let prompt: Vec<u32> =
            row[..p].iter().zip(&exp.attention_mask[r * exp.l..]).filter(|(_, m)| **m == 1).map(|(t, _)| *t).collect();
        let answer: Vec<u32> = row[p..].iter().copied().take_while(|&t| t != pad).collect();
        metrics.println(&format!(
            "--- prompt: {:?}\n--- answer: {:?} (reward {:.3})",
            tok.decode(&prompt)?,
            tok.decode(&answer)?,
            exp.scores[r]
        ));
    }
    Ok(())
}
