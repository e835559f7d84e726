//! Step 2's loop (DS-Chat `step2_reward_model_finetuning/main.py`): pairs batched chosen-first,
//! the pairwise loss on the score head, evaluation (accuracy, mean chosen and rejected scores)
//! before training and after every epoch, `reward_eval.json` with the margin distribution and
//! the length correlation, and the model saved as `GPT2ForSequenceClassification` (LoRA merged;
//! with `--only-optimize-lora` also the adapter alone in `adapter/`, PEFT's layout).
//!
//! Data-parallel as step 1: each rank trains on its share of every global micro-batch of pairs
//! and evaluates its share of the eval pairs; rank 0 logs and saves.

use crate::args::{PairLoss, RewardArgs, DEFAULT_LR};
use crate::loss;
use anyhow::Result;
use candle_core::{Device, Tensor};
use data::batch::{pair_batch, rank_micro_batches, PairBatch};
use data::phases::PairSample;
use data::Tokenizer;
use hybrid_engine::cli::step_args::parameter_counts;
use hybrid_engine::cli::step_args::StartingModel;
use hybrid_engine::comm::{ProcessGroup, ReduceOp};
use hybrid_engine::engine::epochs::{train_epochs, EpochTask, EvalAt};
use hybrid_engine::engine::{Engine, Head, Ranks};
use hybrid_engine::model::gpt2::Dropout;
use hybrid_engine::model::positions::Positions;
use hybrid_engine::model::reward_model::{add_score_head, sequence_classification_config, SCORE_WEIGHT};
use hybrid_engine::training::memory::MemoryPlan;
use hybrid_engine::training::metrics::Metrics;
use hybrid_engine::training::tensor_parallel::data_group;
use hybrid_engine::training::train_step::TrainedModel;
use hybrid_engine::training::trainer::total_steps;
use hybrid_engine::ParamStore;
use serde::Serialize;
use serde_json::json;

/// The final evaluation (accuracy, margins, length bias), saved with the reward model.
pub const REWARD_EVAL_FILE: &str = "reward_eval.json";

/// One evaluation over the eval pairs.
#[derive(Clone, Debug, Serialize)]
pub struct RewardEval {
    pub pairs: usize,
    pub accuracy: f64,
    pub chosen_mean_score: f64,
    pub rejected_mean_score: f64,
    /// Quantiles of `score_chosen - score_rejected`.
    pub margin_quantiles: serde_json::Value,
    /// Pearson correlation of a sequence's score with its answer's length in tokens, over chosen
    /// and rejected answers together: a reward model that just likes long answers shows here.
    pub score_length_correlation: f64,
}

/// What step 2 achieved.
#[derive(Clone, Debug, Serialize)]
pub struct RewardSummary {
    pub steps: u64,
    /// Before training, then after each epoch.
    pub evals: Vec<RewardEval>,
    pub output_dir: std::path::PathBuf,
}

/// Runs step 2.
pub fn run(args: &RewardArgs) -> Result<RewardSummary> {
    let t = &args.train;
    let lr = t.learning_rate.unwrap_or(DEFAULT_LR);
    t.validate(lr)?;
    args.data.refuse_sft_only_data("the reward model's step 2")?;
    let device = t.device()?;
    let group = t.dist.join(&device)?;
    // Under tensor parallelism the ranks of a TP group train on the same pairs: the data is split
    // over the data-parallel group (every rank without TP).
    let tp = t.dist.tensor_parallel(&group)?;
    let data_group = data_group(&group, tp.as_ref());
    let world = data_group.world();
    println!("device: {}", hybrid_engine::device::describe(&device));
    // ZeRO-3 across ranks builds the model sharded: no rank holds it whole.
    // Under tensor parallelism each rank reads only its slices.
    let (mut start, shard_source) = t.starting_model(t.builds_sharded(world, tp.is_some()), tp.as_ref(), &device)?;
    let tokenizer = step2_tokenizer(args, &start)?;
    let eos = tokenizer.eos_id();
    let config = sequence_classification_config(&start.config, eos);
    // A reward model directory continues with its head; anything else gets a fresh one (built
    // sharded, the head alone is made whole first: n_embd values).
    let mut heads = ParamStore::default();
    let head_store = if shard_source.is_some() { &mut heads } else { &mut start.params };
    match start.extra.get(SCORE_WEIGHT) {
        Some(w) if w.dims() == [1, config.hidden_size()] => head_store.push(SCORE_WEIGHT, w)?,
        _ => add_score_head(head_store, &config, t.seed, &device)?,
    }
    // LoRA on a whole model or its TP slices; a model built sharded gets its adapters beside the
    // trunk after the head, each rank keeping its shard of them.
    let heads = heads.iter().map(|(n, v)| (n.to_string(), v.as_tensor().clone())).collect();
    let beside = t.add_lora(shard_source.is_some(), &mut start.params, heads, &config, tp.as_ref(), &device)?;
    let params = std::mem::take(&mut start.params);
    // Tensor parallelism: this rank trains its slices of the trunk and the whole score head.
    if let Some(tp) = &tp {
        println!("{}", tp.describe());
    }
    // What the optimizer updates: everything, or with --only-optimize-lora the adapters and head.
    let counts =
        parameter_counts(shard_source.is_some(), &params, &beside, &config, tp.as_ref().map_or(1, |t| t.size()));

    let data_cfg = args.data.config(t.seed, t.max_seq_len, t.max_seq_len, false)?;
    let data = data::phases::reward_data(&data_cfg, &tokenizer)?;
    println!("{}", data.summary);
    let at_beginning = args.num_padding_at_beginning;
    if at_beginning > 0 && !data.train.iter().any(|p| p.chosen.first() == Some(&eos)) {
        println!("--num-padding-at-beginning {at_beginning}: the rows do not begin with padding (GPT-2's tokenizer adds none; OPT's adds its BOS), so their ends are read as with 0");
    }
    // Every rank takes its share of each global micro-batch of per-device x world pairs.
    let micro_per_epoch = data.train.len().div_ceil(world).div_ceil(t.per_device_train_batch_size);
    let steps = total_steps(micro_per_epoch, t.num_train_epochs, t.gradient_accumulation_steps);
    let engine_cfg = t.engine_config(lr, steps, &data_group)?;
    // A batch of B pairs runs 2B sequences.
    println!(
        "{}",
        MemoryPlan::new(&config, 2 * t.per_device_train_batch_size, t.max_seq_len, t.gradient_checkpointing)
            .with_parameters(counts.total, counts.trainable)
            .with_gradient_accumulation(t.gradient_accumulation_steps)
            .with_lora(t.lora().is_some())
            .with_compute_dtype(t.precision.dtype.dtype())
            .on_device(&device)
            .with_score_head()
            .with_tensor_parallel(tp.as_ref().map_or(1, |t| t.size()), counts.held_beside)
            .with_data_parallel(engine_cfg.parallel.zero_stage, world)
            .with_buckets(engine_cfg.parallel.reduce_bucket_size, engine_cfg.parallel.allgather_bucket_size)
            .with_offload(engine_cfg.parallel.offload)
            .report()
    );

    // Forward and backward run on a copy in the compute dtype (the masters themselves in fp32),
    // or under ZeRO-3 on weights gathered in it from this rank's shard of the masters.
    let ranks = Ranks { data: data_group.clone(), tensor: tp.clone() };
    let mut engine = match &shard_source {
        Some(source) => {
            let model =
                source.build(data_group.clone(), &config, &beside, engine_cfg.precision.dtype.dtype(), &device)?;
            Engine::new_sharded(&engine_cfg, &config, model)?
        }
        None => Engine::new(&engine_cfg, &config, Head::Score, params, ranks)?,
    };
    // Under ZeRO stage 3 each rank keeps only its shard: the whole model goes now.
    engine.release_masters();
    let mut metrics = Metrics::for_rank(group.rank(), &args.output_dir, steps, 0)?.with_sinks(
        args.train.log.sinks(&args.output_dir)?,
        &[],
        0,
    )?;
    let mut task = RewardTask {
        args,
        data: &data,
        data_group: &data_group,
        eos,
        at_beginning,
        device: &device,
        evals: Vec::new(),
    };
    let plan = t.epoch_plan((micro_per_epoch, steps), "pairs", args.eval_interval, &data_group);
    let (rank, rows) = (data_group.rank(), data.train.len());
    let done = train_epochs(&mut engine, &mut task, &plan, &mut metrics, |epoch| {
        let order = data::pretrain::epoch_order(&(0..rows), t.seed, epoch as u64 - 1);
        rank_micro_batches(&order, t.per_device_train_batch_size, rank, world)
    })?;
    let summary = RewardSummary { steps: done.steps, evals: task.evals, output_dir: args.output_dir.clone() };
    metrics.finish();

    save(args, &group, &engine, &tokenizer, &summary)?;
    metrics.end_run(&group, &summary)?;
    Ok(summary)
}

/// Saves the reward model on rank 0 (under ZeRO-3 every rank takes part in gathering its
/// weights). The directory has LoRA merged; a frozen trunk's adapter (with the trained head as
/// PEFT's modules_to_save) is also saved on its own. reward_eval.json goes in the same atomic
/// save: the directory never pairs one run's model with another run's evaluation.
fn save(
    args: &RewardArgs,
    group: &ProcessGroup,
    engine: &Engine,
    tokenizer: &Tokenizer,
    summary: &RewardSummary,
) -> Result<()> {
    let report = summary.evals.last().map(
        |last| json!({"final": last, "before_training": summary.evals.first(), "loss": format!("{:?}", args.loss)}),
    );
    args.train.save_engine_model("reward model", group, &args.output_dir, engine, "SEQ_CLS", &|d| {
        tokenizer.save(&d.join("tokenizer.json"))?;
        match &report {
            Some(report) => Ok(std::fs::write(d.join(REWARD_EVAL_FILE), serde_json::to_string_pretty(report)?)?),
            None => Ok(()),
        }
    })
}

/// Step 2's micro-batches of pairs, their loss and the evaluation.
struct RewardTask<'a> {
    args: &'a RewardArgs,
    data: &'a data::phases::PhaseData<PairSample>,
    /// The ranks the pairs are split over.
    data_group: &'a ProcessGroup,
    eos: u32,
    /// `--num-padding-at-beginning`.
    at_beginning: usize,
    device: &'a Device,
    /// Before training, then after each epoch.
    evals: Vec<RewardEval>,
}

impl EpochTask for RewardTask<'_> {
    /// The pairs, their answers' spans and the ids.
    type Batch = (PairBatch, Vec<loss::PairSpan>, Tensor);

    /// The loss is a mean over the pairs.
    fn batch(&self, rows: &[usize]) -> Result<(Self::Batch, f64, usize)> {
        let pairs: Vec<&PairSample> = rows.iter().map(|&i| &self.data.train[i]).collect();
        let batch = pair_batch(&pairs, self.eos);
        let spans = loss::batch_spans_after(&batch.ids, batch.pairs, batch.t, self.eos, self.at_beginning);
        let ids = batch_ids(&batch, self.device)?;
        let pairs = batch.pairs;
        Ok(((batch, spans, ids), pairs as f64, pairs))
    }

    fn forward_backward(
        &mut self,
        engine: &mut Engine,
        batch: &Self::Batch,
        dropout: &Dropout,
        share: f64,
    ) -> Result<f32> {
        let (_, spans, ids) = batch;
        let pair_loss = self.args.loss;
        engine.forward_backward(ids, &Positions::default(), Some(dropout), share, |w, h| {
            let scores = w.token_scores(h)?; // (2B, T)
            match pair_loss {
                PairLoss::DsChat => loss::ds_chat_loss(&scores, spans),
                PairLoss::LastToken => loss::last_token_loss(&scores, spans),
            }
        })
    }

    /// The scores of the eval pairs (`--eval-iters` batches a rank at most), logged; kept in
    /// the summary at the epochs' ends.
    fn evaluate(&mut self, engine: &Engine, metrics: &mut Metrics, at: EvalAt) -> Result<()> {
        let t = &self.args.train;
        let pairs = self.args.eval_pairs(&self.data.eval, self.data_group.world());
        if pairs.is_empty() {
            return Ok(());
        }
        let scoring = (self.eos, self.at_beginning);
        let e = evaluate(engine.model(), pairs, t.per_device_eval_batch_size, scoring, self.device, self.data_group)?;
        metrics.println(&format!(
            "***** Evaluating reward, {} *****\nchosen_last_scores (higher is better) : {:.4}, rejected_last_scores (lower is better) : {:.4}, acc (higher is better) : {:.4}",
            at.label(), e.chosen_mean_score, e.rejected_mean_score, e.accuracy
        ));
        metrics.record(at.record(json!({"eval": e})))?;
        if let EvalAt::Epoch { .. } = at {
            self.evals.push(e);
        }
        Ok(())
    }
}

/// Step 2's tokenizer (`--tokenizer`, else the starting model's, else GPT-2's), checked against
/// the starting model: its vocabulary and context must hold the tokens and `--max-seq-len`.
pub fn step2_tokenizer(args: &RewardArgs, start: &StartingModel) -> Result<Tokenizer> {
    let tokenizer = match (&args.tokenizer, &start.dir) {
        (Some(p), _) => Tokenizer::from_file(p)?,
        (None, Some(dir)) => Tokenizer::from_model_dir_or_default(dir)?,
        (None, None) => Tokenizer::gpt2_default()?,
    };
    let (config, max_seq_len) = (&start.config, args.train.max_seq_len);
    if tokenizer.vocab_size() > config.vocab_size || max_seq_len > config.max_positions() {
        anyhow::bail!(
            "the model (vocabulary {}, context {}) cannot hold the tokenizer's {} tokens or --max-seq-len {}: pass a matching --tokenizer or a lower --max-seq-len",
            config.vocab_size,
            config.max_positions(),
            tokenizer.vocab_size(),
            max_seq_len
        );
    }
    args.data.tokenizer(tokenizer)
}

fn batch_ids(batch: &PairBatch, device: &Device) -> Result<Tensor> {
    Ok(Tensor::from_slice(&batch.ids, (2 * batch.pairs, batch.t), device)?)
}

/// What one pair gives an evaluation: its two end scores and its two answers' lengths in tokens
/// (between the prompt and the sequence's end, its first pad).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PairScore {
    pub chosen: f32,
    pub rejected: f32,
    pub chosen_len: usize,
    pub rejected_len: usize,
}

/// Scores `pairs` in batches of `batch_size`, dropout off. Under ZeRO-3 every forward is a
/// collective, so every rank runs at least `batches` forwards whatever its share of pairs; the
/// extra ones score `filler` and are dropped.
pub fn pair_scores(
    model: &TrainedModel,
    (pairs, batches, filler): (&[&PairSample], usize, &PairSample),
    batch_size: usize,
    (pad, at_beginning): (u32, usize),
    device: &Device,
) -> Result<Vec<PairScore>> {
    let mut out = Vec::with_capacity(pairs.len());
    let chunks: Vec<&[&PairSample]> = pairs.chunks(batch_size).collect();
    let forwards = match model {
        TrainedModel::Sharded(_) => chunks.len().max(batches),
        TrainedModel::Whole { .. } => chunks.len(),
    };
    let mut progress = hybrid_engine::telemetry::progress::Phase::start("scoring pairs", "batches", forwards as u64);
    for k in 0..forwards {
        let _done = progress.done_after(1);
        let Some(&chunk) = chunks.get(k) else {
            let filler = pair_batch(&[filler], pad);
            model.with_hidden(&batch_ids(&filler, device)?, &Positions::default(), |_, _| Ok(()))?;
            continue;
        };
        let batch = pair_batch(chunk, pad);
        let spans = loss::batch_spans_after(&batch.ids, batch.pairs, batch.t, pad, at_beginning);
        let scores = model
            .with_hidden(&batch_ids(&batch, device)?, &Positions::default(), |w, hidden| Ok(w.token_scores(hidden)?))?;
        let (c, r) = loss::end_scores(&scores, &spans)?;
        let (c, r) = (c.to_vec1::<f32>()?, r.to_vec1::<f32>()?);
        for (((chosen, rejected), s), p) in c.into_iter().zip(r).zip(&spans).zip(chunk) {
            out.push(PairScore {
                chosen,
                rejected,
                chosen_len: s.chosen_end.saturating_sub(p.prompt_len),
                rejected_len: s.rejected_end.saturating_sub(p.prompt_len),
            });
        }
    }
    Ok(out)
}

/// Accuracy, mean scores, margin quantiles and the score/length correlation on `pairs`, over the
/// ranks of `group` (every rank must call it): each rank scores pairs `rank, rank + world, ...`,
/// and every rank ends with the evaluation of all of them. Quantiles and the correlation need
/// every value, so the scores themselves are exchanged, not partial statistics: each rank writes
/// its pairs into their slots of a zeroed buffer and the buffers are summed (adding zeros is
/// exact), after which every number is computed from all pairs in the one-rank order.
pub fn evaluate(
    model: &TrainedModel,
    pairs: &[PairSample],
    batch_size: usize,
    (pad, at_beginning): (u32, usize),
    device: &Device,
    group: &ProcessGroup,
) -> Result<RewardEval> {
    let (rank, world) = (group.rank(), group.world());
    let share: Vec<&PairSample> = pairs.iter().skip(rank).step_by(world).collect();
    let batches = pairs.len().div_ceil(world).div_ceil(batch_size);
    let Some(filler) = pairs.first() else { return Ok(summarize(&[])) };
    let mine = pair_scores(model, (&share, batches, filler), batch_size, (pad, at_beginning), device)?;
    const FIELDS: usize = 4;
    let mut all = vec![0f64; FIELDS * pairs.len()];
    for (k, p) in mine.iter().enumerate() {
        let at = FIELDS * (rank + k * world);
        all[at..at + FIELDS].copy_from_slice(&[
            f64::from(p.chosen),
            f64::from(p.rejected),
            p.chosen_len as f64,
            p.rejected_len as f64,
        ]);
    }
    group.all_reduce_scalars(&mut all, ReduceOp::Sum)?;
    // Back to f32 exactly: each value is one rank's f32 plus zeros.
    let every: Vec<PairScore> = all
        .chunks_exact(FIELDS)
        .map(|v| PairScore {
            chosen: v[0] as f32,
            rejected: v[1] as f32,
            chosen_len: v[2] as usize,
            rejected_len: v[3] as usize,
        })
        .collect();
    Ok(summarize(&every))
}

/// The evaluation of scored pairs.
fn summarize(scored: &[PairScore]) -> RewardEval {
    let chosen: Vec<f32> = scored.iter().map(|p| p.chosen).collect();
    let rejected: Vec<f32> = scored.iter().map(|p| p.rejected).collect();
    let n = chosen.len().max(1) as f64;
    let margins: Vec<f64> = chosen.iter().zip(&rejected).map(|(c, r)| (c - r) as f64).collect();
    let qs = [0.0, 0.05, 0.25, 0.5, 0.75, 0.95, 1.0];
    let margin_quantiles: serde_json::Map<String, serde_json::Value> =
        qs.iter().map(|&q| (format!("q{:02}", (q * 100.0) as u32), json!(loss::quantile(&margins, q)))).collect();
    let (mut scores, mut lengths) = (Vec::new(), Vec::new());
    for p in scored {
        scores.extend([f64::from(p.chosen), f64::from(p.rejected)]);
        lengths.extend([p.chosen_len as f64, p.rejected_len as f64]);
    }
    RewardEval {
        pairs: chosen.len(),
        accuracy: loss::accuracy(&chosen, &rejected),
        chosen_mean_score: chosen.iter().map(|&x| x as f64).sum::<f64>() / n,
        rejected_mean_score: rejected.iter().map(|&x| x as f64).sum::<f64>() / n,
        margin_quantiles: margin_quantiles.into(),
        score_length_correlation: loss::pearson(&scores, &lengths),
    }
}
