//! Step 3's setup before the loop: the checkpoint to resume and where the loop starts, the
//! tensor-parallel layouts, the PTX corpus, the frozen models read whole, the reward functions
//! started, the memory plan checked, the sampling of a rollout; and the warning for dropout.

use super::saves::Position;
use super::stats::PpoSummary;
use crate::args::PpoArgs;
use crate::models::{lm_on, read_model, read_reward_model, reward_model_on, PpoModels};
use crate::ppo;
use crate::reward_fn::RewardFn;
use anyhow::{bail, Context, Result};
use candle_core::Device;
use data::{PackedCorpus, Tokenizer};
use hybrid_engine::comm::ProcessGroup;
use hybrid_engine::engine::{Engine, EngineConfig};
use hybrid_engine::generation::generate::SamplingConfig;
use hybrid_engine::model::gpt2::Gpt2Config;
use hybrid_engine::tensor_parallel::layout::ParallelLayout;
use hybrid_engine::tensor_parallel::shard::check_divides;
use hybrid_engine::training::tensor_parallel::TensorParallel;
use hybrid_engine::training::train_step::TrainedModel;
use std::path::Path;
use std::sync::Arc;

/// Prints step 3's memory plan for the models as built (see [`crate::memory_plan`]) and on the
/// CPU refuses one beyond the machine; `process_mib`, the process's own live memory (measured
/// once its inputs were read, less the models' values), is counted where it shares the plan's
/// memory (the CPU).
pub(super) fn check_memory_plan(
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
    pub(super) fn shape<'a>(
        args: &PpoArgs,
        engine: &'a Engine,
        tp: usize,
        lora_dim: usize,
        checkpoint: bool,
    ) -> TrainedShape<'a> {
        // Counted whole, as MemoryPlan takes them: under tensor parallelism the engine trains slices.
        let (names, numels) = engine.trained_inventory();
        let whole = |(name, n): (&String, &usize)| {
            hybrid_engine::tensor_parallel::shard::whole_numel(
                engine.config.split_of(name),
                *n,
                tp,
                engine.config.vocab_size,
            )
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
pub(super) fn optimizer_steps(
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
pub(super) fn inference_tp_group(
    args: &PpoArgs,
    group: &ProcessGroup,
    actor: &Gpt2Config,
) -> Result<Option<Arc<ProcessGroup>>> {
    match args.inference_tp_size as usize {
        1 => Ok(None),
        t => {
            check_divides(actor.num_heads(), actor.inner_dim(), t)?;
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
pub(super) fn ptx_corpus(args: &PpoArgs, tokenizer: &Tokenizer, vocab_size: usize) -> Result<Option<PackedCorpus>> {
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
pub(super) fn read_checkpoint(
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
pub(super) fn starting_point(
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

/// The reference and the reward model (of `reward_cfg`, if any) whole, in the compute dtype,
/// read again from their directories: for rank 0's held-out evaluation where the ranks hold
/// slices or shards of them.
pub(super) fn read_whole_frozen_models(
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
pub(super) fn start_reward_fns(args: &PpoArgs, rank: usize) -> Result<Vec<RewardFn>> {
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

/// `--tensor-model-parallel-size`: the TP layout of the ranks, or `None` without TP. Every
/// rank calls it together. `--inference-tp-size` has nothing to do under it (one line).
pub(super) fn tensor_parallel(args: &PpoArgs, group: &ProcessGroup) -> Result<Option<TensorParallel>> {
    let size = args.dist.tensor_model_parallel_size;
    if size > 1 && args.inference_tp_size > 1 {
        bail!("--inference-tp-size re-lays a TP=1 actor out for generation, but under --tensor-model-parallel-size {size} the actor already generates split over its TP group: drop --inference-tp-size");
    }
    args.dist.tensor_parallel(group)
}

/// A warning when the actor trains with dropout: its rollout log-probs are computed without it
/// (generation mode), so the PPO ratio of an unchanged policy departs from 1 by dropout noise
/// alone and clipping reacts to it. DS-Chat passes `--actor_dropout 0.0`.
pub(super) fn actor_dropout_warning(cfg: &Gpt2Config) -> Option<String> {
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
pub(super) fn sampling_config(args: &PpoArgs, eos: u32, vocab_limit: usize, step: u64) -> SamplingConfig {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn actor_dropout_above_0_is_warned_about() {
        let without = Gpt2Config { resid_pdrop: 0.0, embd_pdrop: 0.0, attn_pdrop: 0.0, ..Gpt2Config::tiny() };
        assert_eq!(actor_dropout_warning(&without), None);
        let line = actor_dropout_warning(&Gpt2Config { attn_pdrop: 0.1, ..without }).expect("a warning");
        assert!(line.contains("dropout 0.1") && line.contains("--actor-dropout 0"), "{line}");
    }
}
