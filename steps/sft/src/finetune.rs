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
use hybrid_engine::cli::step_args::starting_model;
use hybrid_engine::comm::{ProcessGroup, ReduceOp};
use hybrid_engine::kernels::ops::DropoutKey;
use hybrid_engine::model::gpt2::{Dropout, Positions};
use hybrid_engine::model::reward_model::causal_lm_config;
use hybrid_engine::training::memory::MemoryPlan;
use hybrid_engine::training::metrics::{peak_rss_mib, Metrics};
use hybrid_engine::training::tensor_parallel::{data_group, gather_for_saving};
use hybrid_engine::training::train_step::{Backward, TrainedModel};
use hybrid_engine::training::trainer::{total_steps, StepLog, Trainer};
use hybrid_engine::ParamStore;
use serde::Serialize;
use serde_json::json;
use std::time::Instant;

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
    let group = t.dist.join()?;
    // Under tensor parallelism the ranks of a TP group train on the same rows: the data is split
    // over the data-parallel group (every rank without TP).
    let tp = t.dist.tensor_parallel(&group)?;
    let data_group = data_group(&group, tp.as_ref());
    let (rank, world) = (data_group.rank(), data_group.world());
    println!("device: {}", hybrid_engine::device::describe(&device));
    let mut start = starting_model(&t.model_name_or_path, t.seed, t.dropout, &device)?;
    println!("starting model: {}", start.description);
    let tokenizer = match (&args.tokenizer, &start.dir) {
        (Some(p), _) => Tokenizer::from_file(p)?,
        (None, Some(dir)) => Tokenizer::from_model_dir_or_default(dir)?,
        (None, None) => Tokenizer::gpt2_default()?,
    };
    let config = causal_lm_config(&start.config);
    check_fits(&config, &tokenizer, t.max_seq_len)?;

    let data_cfg = args.data.config(t.seed, t.max_seq_len, t.max_seq_len, args.train_on_prompt)?;
    let data = data::phases::sft_data(&data_cfg, &tokenizer)?;
    println!("{}", data.summary);
    let dp = t.dist.data_parallel_with_stage3(&data_group, t.zero_stage)?;
    if let Some(line) = t.apply_lora(&mut start.params, &config)? {
        println!("{line}");
    }
    let params = std::mem::take(&mut start.params);
    // prompt_eval (rank 0) compares with the starting weights, which training overwrites in place.
    let baseline_weights = (args.eval_prompts.is_some() && group.is_first()).then(|| params.copy()).transpose()?;
    // Tensor parallelism: this rank trains its slices of the weights.
    let params = match &tp {
        Some(tp) => {
            println!("{}", tp.describe());
            tp.slice(params, &config)?
        }
        None => params,
    };
    // What the optimizer updates: everything, or with --only-optimize-lora the adapters alone.
    let trainable = params.trainable();
    println!(
        "{}",
        MemoryPlan::new(&config, t.per_device_train_batch_size, t.max_seq_len, t.gradient_checkpointing)
            .with_parameters(params.numel(), trainable.numel())
            .with_gradient_accumulation(t.gradient_accumulation_steps)
            .with_lora(t.lora().is_some())
            .with_compute_dtype(t.precision.dtype.dtype())
            .on_device(&device)
            .with_tensor_parallel(tp.as_ref().map_or(1, |t| t.size()))
            .with_data_parallel(dp.stage, world)
            .report()
    );
    // Forward and backward run on a copy in the compute dtype (the masters themselves in fp32).
    let precision = t.precision.precision();
    // Read now, so a bad prompts file fails before training rather than after it.
    let prompts =
        args.eval_prompts.as_ref().map(|spec| data::prompts::read_prompts(spec, args.num_eval_prompts)).transpose()?;
    // Every rank takes its share of each global micro-batch of per-device x world rows.
    let micro_per_epoch = data.train.len().div_ceil(world).div_ceil(t.per_device_train_batch_size);
    let steps = total_steps(micro_per_epoch, t.num_train_epochs, t.gradient_accumulation_steps);
    let (model, mut trainer) =
        t.trained_model(dp, &config, (&params, &trainable), (lr, steps), tp.as_ref(), |compute| {
            let mut model = match &tp {
                Some(tp) => tp.model(compute, &config)?,
                None => compute.model(&config)?,
            };
            model.fp32_loss = precision.fp32_loss;
            Ok(TrainedModel::lm(model))
        })?;
    trainer.set_lora_learning_rate(&trainable, t.lora_learning_rate);
    // Under ZeRO stage 3 each rank keeps only its shard: the whole model goes now.
    let (params, trainable) = match &model {
        TrainedModel::Whole { .. } => (params, trainable),
        TrainedModel::Sharded(_) => (ParamStore::default(), ParamStore::default()),
    };
    let mut metrics = Metrics::for_rank(group.rank(), &args.output_dir, steps, 0)?.with_sinks(
        args.train.log.sinks(&args.output_dir)?,
        &[],
        0,
    )?;
    let eos = tokenizer.eos_id();

    let mut summary = SftSummary {
        steps: 0,
        epochs: t.num_train_epochs,
        perplexity: Vec::new(),
        output_dir: args.output_dir.clone(),
    };
    let report_eval = |metrics: &mut Metrics, epoch: usize, summary: &mut SftSummary| -> Result<()> {
        if data.eval.is_empty() {
            return Ok(());
        }
        // Each rank evaluates its share of the rows; the loss is the mean over all their tokens.
        let share: Vec<SftSample> = data.eval.iter().skip(rank).step_by(world).cloned().collect();
        let batches = data.eval.len().div_ceil(world).div_ceil(t.per_device_eval_batch_size);
        let (sum, tokens) = eval_loss_sum(
            &model,
            (&share, batches, &data.eval[0]),
            t.per_device_eval_batch_size,
            eos,
            args.train_on_prompt,
            &device,
        )?;
        let mut totals = [sum, tokens as f64];
        data_group.all_reduce_scalars(&mut totals, ReduceOp::Sum)?;
        let loss = totals[0] / totals[1].max(1.0);
        let ppl = loss.exp();
        metrics.println(&format!(
            "***** Evaluating perplexity, Epoch {epoch}/{} *****\nppl: {ppl:.4}, loss: {loss:.4}",
            t.num_train_epochs
        ));
        metrics.record(json!({"epoch": epoch, "eval_loss": loss, "eval_ppl": ppl}))?;
        summary.perplexity.push(ppl);
        Ok(())
    };
    report_eval(&mut metrics, 0, &mut summary)?;

    let mut log = StepLog::for_trainer(t.log_interval, steps, "tokens", &trainer);
    let mut micro_index = 0u64;
    let mut train_secs = 0f64;
    for epoch in 1..=t.num_train_epochs {
        metrics.println(&format!(
            "Beginning of Epoch {epoch}/{}, Total Micro Batches {micro_per_epoch}",
            t.num_train_epochs
        ));
        let order = data::pretrain::epoch_order(&(0..data.train.len()), t.seed, epoch as u64 - 1);
        for chunk in rank_micro_batches(&order, t.per_device_train_batch_size, rank, world) {
            let started = Instant::now();
            let rows: Vec<&SftSample> = chunk.iter().map(|&i| &data.train[i]).collect();
            let batch = sft_batch(&rows, eos, args.train_on_prompt);
            micro_index += 1;
            // Each rank draws its own masks (its rows differ); rank 0 draws one rank's masks.
            let key = DropoutKey { seed: t.seed, step: micro_index, micro_batch: rank as u64 };
            let dropout = Dropout::from_config(&config, key);
            // The loss is a mean over the learned tokens of the whole global micro-batch, as one
            // rank holding all of it would compute: each rank's mean weighs by its share of them.
            let local_tokens = batch.loss_rows.len() as f64;
            let mut tokens = [local_tokens];
            data_group.all_reduce_scalars(&mut tokens, ReduceOp::Sum)?;
            let share = local_tokens * world as f64 / tokens[0].max(1.0);
            let how =
                Backward { checkpoint_activations: t.gradient_checkpointing, loss_scale: trainer.loss_scale() * share };
            let loss = sft_forward_backward(&model, &batch, Some(&dropout), how, &mut trainer, &device)?;
            // The logged loss is the global micro-batch's.
            let mut sums = [f64::from(loss) * local_tokens];
            data_group.all_reduce_scalars(&mut sums, ReduceOp::Sum)?;
            let loss = (sums[0] / tokens[0].max(1.0)) as f32;
            let stepped = trainer.micro_batch_done(&trainable)?;
            train_secs += started.elapsed().as_secs_f64();
            log.micro_batch(loss, batch.b * batch.t * world, started.elapsed().as_secs_f64(), epoch)?;
            if let Some(r) = stepped {
                summary.steps = r.step;
                log.step(&mut metrics, &r, epoch, loss)?;
            }
        }
        if epoch == t.num_train_epochs {
            if let Some(r) = trainer.flush(&trainable)? {
                summary.steps = r.step;
            }
        }
        report_eval(&mut metrics, epoch, &mut summary)?;
    }
    metrics.finish();
    // Before saving, which gathers the model under ZeRO-3: what training itself used.
    if group.world() > 1 {
        let subgroups: Vec<&ProcessGroup> = tp.iter().flat_map(|t| [&*t.layout.tp, &*t.layout.dp]).collect();
        let (line, record) = hybrid_engine::training::metrics::rank_usage(&group, &subgroups, train_secs);
        println!("{line}");
        metrics.record(record)?;
    }
    if let Some(tp) = &tp {
        let (line, record) =
            hybrid_engine::training::metrics::parallel_traffic(&tp.layout.tp, &tp.layout.dp, summary.steps);
        println!("{line}");
        metrics.record(record)?;
    }

    // The held-out comparison is written with the model, in the same atomic save, so the
    // directory never holds a comparison of another run's model. Under ZeRO-3 every rank takes
    // part in gathering the weights.
    let gathered = gather_for_saving(&model, &params, tp.as_ref(), &config)?;
    if !group.is_first() {
        // Rank 0 saves the model the ranks share and compares it on the prompts.
        group.barrier()?;
        return Ok(summary);
    }
    let params = gathered.as_ref().unwrap_or(&params);
    let prompt_eval_lines = match (&prompts, baseline_weights) {
        (Some(prompts), Some(weights)) => {
            let baseline = weights.model(&config)?;
            let rebuilt;
            let tuned = match (&model, &tp) {
                (TrainedModel::Whole { trunk, .. }, None) => &**trunk,
                _ => {
                    rebuilt = params.model(&config)?;
                    &rebuilt
                }
            };
            let comparisons =
                prompt_eval::compare(&baseline, tuned, &tokenizer, prompts, args.max_new_tokens, &device)?;
            print!("{}", prompt_eval::render(&comparisons));
            let lines: Vec<String> = comparisons.iter().map(|c| json!(c).to_string() + "\n").collect();
            Some(lines.concat())
        }
        _ => None,
    };
    // The model directory has LoRA merged; a frozen base's adapter is also saved on its own.
    t.save_step_model("fine-tuned model", &args.output_dir, &config, params, "CAUSAL_LM", &|d| {
        tokenizer.save(&d.join("tokenizer.json"))?;
        match &prompt_eval_lines {
            Some(text) => Ok(std::fs::write(d.join(PROMPT_EVAL_FILE), text)?),
            None => Ok(()),
        }
    })?;
    let peak = peak_rss_mib();
    if let Some(p) = peak {
        println!("peak memory (RSS): {p:.1} MiB");
    }
    metrics.end(json!({"event": "end", "summary": summary, "peak_rss_mib": peak}))?;
    group.barrier()?;
    Ok(summary)
}

/// The loss of one micro-batch, its gradients added to the trainer's accumulator.
fn sft_forward_backward(
    model: &TrainedModel,
    batch: &SftBatch,
    dropout: Option<&Dropout>,
    how: Backward,
    trainer: &mut Trainer,
    device: &Device,
) -> Result<f32> {
    let (ids, rows, targets) = batch_tensors(batch, device)?;
    model.forward_backward(&ids, &Positions::default(), dropout, how, trainer.grads(), |w, hidden| {
        w.trunk.lm_loss_at(hidden, &rows, &targets)
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
        progress.inc(1);
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
    if max_seq_len > config.n_positions {
        anyhow::bail!(
            "--max-seq-len {max_seq_len} is larger than the model's context of {} positions: lower --max-seq-len",
            config.n_positions
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
