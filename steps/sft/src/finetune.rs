//! Step 1, supervised fine-tuning (DS-Chat `step1_supervised_finetuning/main.py`): the causal-LM
//! loss on `prompt + chosen + EOS` rows (answer and EOS only, unless `--train-on-prompt`),
//! AdamW with DS-Chat's parameter groups, warmup + decay, perplexity on the eval rows before
//! training and after every epoch, and the model saved as a HF directory (LoRA merged, and with
//! `--only-optimize-lora` the adapter alone in `adapter/`, PEFT's layout).

use crate::args::{SftArgs, DEFAULT_LR};
use crate::prompt_eval;
use anyhow::Result;
use candle_core::{Device, Tensor};
use data::batch::{rank_micro_batches, sft_batch, SftBatch};
use data::phases::SftSample;
use data::Tokenizer;
use hybrid_engine::cli::step_args::parameter_counts;
use hybrid_engine::comm::{ProcessGroup, ReduceOp};
use hybrid_engine::engine::epochs::{train_epochs, EpochTask, EvalAt};
use hybrid_engine::engine::{Engine, Head, Ranks};
use hybrid_engine::model::gpt2::Dropout;
use hybrid_engine::model::positions::Positions;
use hybrid_engine::model::reward_model::causal_lm_config;
use hybrid_engine::training::memory::MemoryPlan;
use hybrid_engine::training::metrics::{record_parallel_usage, Metrics};
use hybrid_engine::training::tensor_parallel::data_group;
use hybrid_engine::training::train_step::TrainedModel;
use hybrid_engine::training::trainer::total_steps;
use hybrid_engine::ParamStore;
use serde::Serialize;
use serde_json::json;

/// The greedy answers of the starting and the fine-tuned model, side by side, in the model directory.
pub const PROMPT_EVAL_FILE: &str = "prompt_eval.jsonl";

/// What step 1 achieved (also the last record of metrics.jsonl).
#[derive(Debug, Clone, Serialize)]
pub struct SftSummary {
    pub steps: u64,
    pub epochs: usize,
    /// Eval perplexity before training, then after each epoch.
    pub perplexity: Vec<f64>,
    pub output_dir: std::path::PathBuf,
}

/// Runs step 1.
pub fn run(args: &SftArgs) -> Result<SftSummary> {
    let t = &args.train;
    let lr = t.learning_rate.unwrap_or(DEFAULT_LR);
    t.validate(lr)?;
    let device = t.device()?;
    let group = t.dist.join(&device)?;
    // Under tensor parallelism the ranks of a TP group train on the same rows: the data is split
    // over the data-parallel group (every rank without TP).
    let tp = t.dist.tensor_parallel(&group)?;
    let data_group = data_group(&group, tp.as_ref());
    let world = data_group.world();
    println!("device: {}", hybrid_engine::device::describe(&device));
    // ZeRO-3 across ranks builds the model sharded, unless --eval-prompts needs the starting
    // weights whole on rank 0 to compare with.
    let sharded = t.builds_sharded(world, tp.is_some()) && args.eval_prompts.is_none();
    // Under tensor parallelism each rank reads only its slices, unless --eval-prompts needs them
    // whole likewise.
    let sliced = tp.as_ref().filter(|_| args.eval_prompts.is_none());
    let (mut start, shard_source) = t.starting_model(sharded, sliced, &device)?;
    let tokenizer = args.data.tokenizer(match (&args.tokenizer, &start.dir) {
        (Some(p), _) => Tokenizer::from_file(p)?,
        (None, Some(dir)) => Tokenizer::from_model_dir_or_default(dir)?,
        (None, None) => Tokenizer::gpt2_default()?,
    })?;
    let config = causal_lm_config(&start.config);
    check_fits(&config, &tokenizer, t.max_seq_len)?;

    let data_cfg = args.data.config(t.seed, t.max_seq_len, t.max_seq_len, args.train_on_prompt)?;
    let data = data::phases::sft_data(&data_cfg, &tokenizer)?;
    println!("{}", data.summary);
    // Every rank takes its share of each global micro-batch of per-device x world rows.
    let micro_per_epoch = data.train.len().div_ceil(world).div_ceil(t.per_device_train_batch_size);
    let steps = total_steps(micro_per_epoch, t.num_train_epochs, t.gradient_accumulation_steps);
    let engine_cfg = t.engine_config(lr, steps, &data_group)?;
    // LoRA on a whole model or its TP slices; a model built sharded gets its adapters beside the
    // trunk, each rank keeping its shard of them.
    let beside = t.add_lora(shard_source.is_some(), &mut start.params, Vec::new(), &config, sliced, &device)?;
    let params = std::mem::take(&mut start.params);
    // prompt_eval (rank 0) compares with the starting weights, which training overwrites in place.
    let baseline_weights = (args.eval_prompts.is_some() && group.is_first()).then(|| params.copy()).transpose()?;
    // Tensor parallelism: this rank trains its slices of the weights.
    let params = match (&tp, sliced) {
        (Some(tp), sliced) => {
            println!("{}", tp.describe());
            match sliced {
                Some(_) => params,
                None => tp.slice(params, &config)?,
            }
        }
        (None, _) => params,
    };
    // What the optimizer updates: everything, or with --only-optimize-lora the adapters alone.
    let counts =
        parameter_counts(shard_source.is_some(), &params, &beside, &config, tp.as_ref().map_or(1, |t| t.size()));
    println!(
        "{}",
        MemoryPlan::new(&config, t.per_device_train_batch_size, t.max_seq_len, t.gradient_checkpointing)
            .with_parameters(counts.total, counts.trainable)
            .with_gradient_accumulation(t.gradient_accumulation_steps)
            .with_lora(t.lora().is_some())
            .with_compute_dtype(t.precision.dtype.dtype())
            .on_device(&device)
            .with_tensor_parallel(tp.as_ref().map_or(1, |t| t.size()), counts.held_beside)
            .with_data_parallel(engine_cfg.parallel.zero_stage, world)
            .with_buckets(engine_cfg.parallel.reduce_bucket_size, engine_cfg.parallel.allgather_bucket_size)
            .with_offload(engine_cfg.parallel.offload)
            .report()
    );
    // Read now, so a bad prompts file fails before training rather than after it.
    let prompts =
        args.eval_prompts.as_ref().map(|spec| data::prompts::read_prompts(spec, args.num_eval_prompts)).transpose()?;
    // Forward and backward run on a copy in the compute dtype (the masters themselves in fp32),
    // or under ZeRO-3 on weights gathered in it from this rank's shard of the masters.
    let ranks = Ranks { data: data_group.clone(), tensor: tp.clone() };
    let mut engine = match &shard_source {
        Some(source) => {
            let model =
                source.build(data_group.clone(), &config, &beside, engine_cfg.precision.dtype.dtype(), &device)?;
            Engine::new_sharded(&engine_cfg, &config, model)?
        }
        None => Engine::new(&engine_cfg, &config, Head::Lm, params, ranks)?,
    };
    // Under ZeRO stage 3 each rank keeps only its shard: the whole model goes now.
    engine.release_masters();
    let mut metrics = Metrics::for_rank(group.rank(), &args.output_dir, steps, 0)?.with_sinks(
        args.train.log.sinks(&args.output_dir)?,
        &[],
        0,
    )?;
    let mut task = SftTask {
        args,
        data: &data,
        data_group: &data_group,
        eos: tokenizer.eos_id(),
        device: &device,
        perplexity: Vec::new(),
    };
    let plan = t.epoch_plan((micro_per_epoch, steps), "tokens", 0, &data_group);
    let (rank, rows) = (data_group.rank(), data.train.len());
    let done = train_epochs(&mut engine, &mut task, &plan, &mut metrics, |epoch| {
        let order = data::pretrain::epoch_order(&(0..rows), t.seed, epoch as u64 - 1);
        rank_micro_batches(&order, t.per_device_train_batch_size, rank, world)
    })?;
    let summary = SftSummary {
        steps: done.steps,
        epochs: t.num_train_epochs,
        perplexity: task.perplexity,
        output_dir: args.output_dir.clone(),
    };
    metrics.finish();
    // Before saving, which gathers the model under ZeRO-3: what training itself used.
    record_parallel_usage(&mut metrics, &group, tp.as_ref().map(|t| &t.layout), done.train_secs, summary.steps)?;
    let compare = prompts.zip(baseline_weights);
    save(args, &group, &engine, &tokenizer, compare, &device)?;
    metrics.end_run(&group, &summary)?;
    Ok(summary)
}

/// Step 1's micro-batches, loss and evaluation.
struct SftTask<'a> {
    args: &'a SftArgs,
    data: &'a data::phases::PhaseData<SftSample>,
    /// The ranks the rows are split over.
    data_group: &'a ProcessGroup,
    eos: u32,
    device: &'a Device,
    /// Eval perplexity before training, then after each epoch.
    perplexity: Vec<f64>,
}

impl EpochTask for SftTask<'_> {
    type Batch = SftBatch;

    /// The loss is a mean over the learned tokens.
    fn batch(&self, rows: &[usize]) -> Result<(SftBatch, f64, usize)> {
        let rows: Vec<&SftSample> = rows.iter().map(|&i| &self.data.train[i]).collect();
        let batch = sft_batch(&rows, self.eos, self.args.train_on_prompt);
        let (tokens, items) = (batch.loss_rows.len() as f64, batch.b * batch.t);
        Ok((batch, tokens, items))
    }

    fn forward_backward(
        &mut self,
        engine: &mut Engine,
        batch: &SftBatch,
        dropout: &Dropout,
        share: f64,
    ) -> Result<f32> {
        let (ids, rows, targets) = batch_tensors(batch, self.device)?;
        engine.forward_backward(&ids, &Positions::default(), Some(dropout), share, |w, hidden| {
            w.trunk.lm_loss_at(hidden, &rows, &targets)
        })
    }

    /// The perplexity on the eval rows, logged and kept.
    fn evaluate(&mut self, engine: &Engine, metrics: &mut Metrics, at: EvalAt) -> Result<()> {
        let (t, data) = (&self.args.train, self.data);
        if data.eval.is_empty() {
            return Ok(());
        }
        let (rank, world) = (self.data_group.rank(), self.data_group.world());
        // Each rank evaluates its share of the rows; the loss is the mean over all their tokens.
        let share: Vec<SftSample> = data.eval.iter().skip(rank).step_by(world).cloned().collect();
        let batches = data.eval.len().div_ceil(world).div_ceil(t.per_device_eval_batch_size);
        let (sum, tokens) = eval_loss_sum(
            engine.model(),
            (&share, batches, &data.eval[0]),
            t.per_device_eval_batch_size,
            self.eos,
            self.args.train_on_prompt,
            self.device,
        )?;
        let mut totals = [sum, tokens as f64];
        self.data_group.all_reduce_scalars(&mut totals, ReduceOp::Sum)?;
        let loss = totals[0] / totals[1].max(1.0);
        let ppl = loss.exp();
        metrics.println(&format!("***** Evaluating perplexity, {} *****\nppl: {ppl:.4}, loss: {loss:.4}", at.label()));
        metrics.record(at.record(json!({"eval_loss": loss, "eval_ppl": ppl})))?;
        self.perplexity.push(ppl);
        Ok(())
    }
}

/// Saves the fine-tuned model on rank 0 (every rank takes part in gathering its weights), with
/// the held-out comparison when `compare` holds the prompts and the starting weights: written
/// in the same atomic save, so the directory never holds a comparison of another run's model.
fn save(
    args: &SftArgs,
    group: &ProcessGroup,
    engine: &Engine,
    tokenizer: &Tokenizer,
    compare: Option<(Vec<String>, ParamStore)>,
    device: &Device,
) -> Result<()> {
    // Without prompts to compare (decided alike on every rank), a sharded model is saved as it
    // is gathered, never whole on any rank.
    if args.eval_prompts.is_none() {
        let write_tokenizer = |d: &std::path::Path| tokenizer.save(&d.join("tokenizer.json"));
        return args.train.save_engine_model(
            "fine-tuned model",
            group,
            &args.output_dir,
            engine,
            "CAUSAL_LM",
            &write_tokenizer,
        );
    }
    let gathered = engine.gather_weights()?;
    if !group.is_first() {
        return Ok(());
    }
    let (params, config) = (gathered.params(engine), &engine.config);
    let prompt_eval_lines = match compare {
        Some((prompts, weights)) => {
            let baseline = weights.model(config)?;
            let rebuilt;
            let tuned = match (engine.model(), engine.tensor_parallel()) {
                (TrainedModel::Whole { trunk, .. }, None) => &**trunk,
                _ => {
                    rebuilt = params.model(config)?;
                    &rebuilt
                }
            };
            let comparisons = prompt_eval::compare(&baseline, tuned, tokenizer, &prompts, args.max_new_tokens, device)?;
            print!("{}", prompt_eval::render(&comparisons));
            let lines: Vec<String> = comparisons.iter().map(|c| json!(c).to_string() + "\n").collect();
            Some(lines.concat())
        }
        None => None,
    };
    // The model directory has LoRA merged; a frozen base's adapter is also saved on its own.
    args.train.save_step_model("fine-tuned model", &args.output_dir, config, params, "CAUSAL_LM", &|d| {
        tokenizer.save(&d.join("tokenizer.json"))?;
        match &prompt_eval_lines {
            Some(text) => Ok(std::fs::write(d.join(PROMPT_EVAL_FILE), text)?),
            None => Ok(()),
        }
    })
}

fn batch_tensors(batch: &SftBatch, device: &Device) -> Result<(Tensor, Tensor, Tensor)> {
    Ok((
        Tensor::from_slice(&batch.ids, (batch.b, batch.t), device)?,
        Tensor::from_slice(&batch.loss_rows, batch.loss_rows.len(), device)?,
        Tensor::from_slice(&batch.loss_targets, batch.loss_targets.len(), device)?,
    ))
}

/// The summed loss over the learned tokens of `rows`, and their count (the mean per learned
/// token: DS-Chat averages per-batch means instead; weighting by tokens makes the number
/// independent of the eval batch size). Dropout off.
///
/// `(rows, batches, filler)`: under ZeRO-3 every forward is a collective, so every rank runs
/// `batches` forwards whatever its share of rows; the missing ones run on `filler` and count
/// for nothing.
pub fn eval_loss_sum(
    model: &TrainedModel,
    (rows, batches, filler): (&[SftSample], usize, &SftSample),
    batch_size: usize,
    eos: u32,
    train_on_prompt: bool,
    device: &Device,
) -> Result<(f64, usize)> {
    let chunks: Vec<Vec<&SftSample>> = rows.chunks(batch_size).map(|c| c.iter().collect()).collect();
    let forwards = match model {
        TrainedModel::Sharded(_) => chunks.len().max(batches),
        TrainedModel::Whole { .. } => chunks.len(),
    };
    let (mut total, mut tokens) = (0f64, 0usize);
    let mut progress =
        hybrid_engine::telemetry::progress::Phase::start("evaluating perplexity", "batches", forwards as u64);
    for k in 0..forwards {
        let _done = progress.done_after(1);
        let (refs, counted) = match chunks.get(k) {
            Some(c) => (c.clone(), true),
            None => (vec![filler], false),
        };
        let batch = sft_batch(&refs, eos, train_on_prompt);
        if batch.loss_rows.is_empty() && matches!(model, TrainedModel::Whole { .. }) {
            continue;
        }
        let (ids, rows, targets) = batch_tensors(&batch, device)?;
        let loss = model.with_hidden(&ids, &Positions::default(), |w, hidden| match batch.loss_rows.is_empty() {
            true => Ok(0.0),
            false => Ok(w.trunk.lm_loss_at(hidden, &rows, &targets)?.to_scalar::<f32>()?),
        })?;
        if counted {
            total += loss as f64 * batch.loss_rows.len() as f64;
            tokens += batch.loss_rows.len();
        }
    }
    Ok((total, tokens))
}

/// The model must embed every token id and hold a whole sequence.
pub fn check_fits(config: &hybrid_engine::Gpt2Config, tok: &Tokenizer, max_seq_len: usize) -> Result<()> {
    if tok.vocab_size() > config.vocab_size {
        anyhow::bail!(
            "the tokenizer has {} tokens but the model's embedding only {} rows: pass a matching --tokenizer",
            tok.vocab_size(),
            config.vocab_size
        );
    }
    if max_seq_len > config.max_positions() {
        anyhow::bail!(
            "--max-seq-len {max_seq_len} is larger than the model's context of {} positions: lower --max-seq-len",
            config.max_positions()
        );
    }
    Ok(())
}

/// Used by the launcher's summary: the perplexities as "a -> b".
pub fn describe_perplexity(ppl: &[f64]) -> String {
    match (ppl.first(), ppl.last()) {
        (Some(a), Some(b)) if ppl.len() > 1 => format!("{a:.2} -> {b:.2}"),
        (Some(a), _) => format!("{a:.2}"),
        _ => "n/a (no eval rows)".into(),
    }
}
