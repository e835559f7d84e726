//! A rollout, each rank's share (DS-Chat's `generate_experience` around the experience module):
//! the hybrid engine's generation mode for the actor, the answers scored by the reward model and
//! `--reward-fn` (the ranks agreeing that every rank scored its share), `--normalize-reward`'s
//! running moments, and generation by an inference tensor-parallel group.

use super::context::Ctx;
use super::setup::sampling_config;
use crate::experience::{generate_experience, rollout_share, Experience, ExternalRewards, RolloutModels};
use crate::models::PpoModels;
use crate::ppo;
use crate::reward_fn::{Answer, RewardFn, ScoringFailed};
use anyhow::{bail, Result};
use data::Tokenizer;
use hybrid_engine::comm::{ProcessGroup, ReduceOp};
use hybrid_engine::engine::Engine;
use hybrid_engine::generation::generate::{Generation, LeftPadded, SamplingConfig};
use hybrid_engine::generation::mode::GenerationMode;
use hybrid_engine::model::gpt2::Gpt2;
use hybrid_engine::training::train_step::TrainedModel;
use std::time::Instant;

/// The sum of `--reward-fn`'s rewards of each of a rollout's answers, given as the prompt's
/// tokens (padding removed) and the answer's (EOS removed); zeros without any.
pub(super) fn external_rewards(
    fns: &mut [RewardFn],
    tokenizer: &Tokenizer,
    rows: &[(&[u32], &[u32])],
) -> Result<Vec<f32>> {
    // A rank that kept no answer asks no scorer (an HTTP server is sent no empty rollout).
    if fns.is_empty() || rows.is_empty() {
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
pub(super) fn scored_on_every_rank(group: &ProcessGroup, scored: Result<Vec<f32>>, any: bool) -> Result<Vec<f32>> {
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
pub(super) struct RolloutTotals {
    pub(super) generated: usize,
    pub(super) dropped_short: usize,
    /// This rank's seconds in the actor's generation (the rest of the rollout is the experience:
    /// log-probs, values, scores, advantages).
    pub(super) generate_secs: f64,
}

/// Generation and scoring of this rank's share of the rollout `prompts` (the whole rollout, in
/// order), each row sampled from the stream of its position in the rollout, so that what it
/// samples does not depend on the world size. Returns this rank's experience, empty when only
/// the other ranks kept rows, or `None` when no rank did; and the rollout's totals.
pub(super) fn generate_share(
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
pub(super) struct Scoring<'a, 'f> {
    pub(super) external: &'a mut ExternalRewards<'f>,
    pub(super) moments: &'a mut Option<ppo::RunningMoments>,
}

/// `--normalize-reward`: `scores` normalised by the running moments, which first take this
/// rollout's scores over every rank of `group` (unchanged without the flag: `moments` `None`).
pub(super) fn normalize_scores(
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
pub(super) fn generate_with_group(
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
