//! GPT-2 pretraining from scratch (`sft --from-scratch`), the analogue of Megatron's
//! `pretrain_gpt2.py`: pack a corpus into blocks, split train/valid/test, train with AdamW and a
//! warmup + decay schedule, evaluate perplexity, checkpoint atomically and resume exactly.
//! `--dtype fp16|bf16` computes in half precision on fp32 master weights, as every step does
//! (the [`Engine`]: Megatron's `--fp16` with its dynamic loss scale, or `--bf16`).

pub mod args;

use crate::pretrain::args::{PretrainArgs, PretrainConfig};
use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use data::{BlendedCorpus, BlendedSampler, CorpusSource, DataCursor, Tokenizer};
use hybrid_engine::checkpoints::hf_io;
use hybrid_engine::checkpoints::resume::{self, OptimizerShard, SavedModel, TrainerState, FORMAT_VERSION};
use hybrid_engine::checkpoints::sharded_io::ModelSlices;
use hybrid_engine::cli::step_args::ShardSource;
use hybrid_engine::comm::{ProcessGroup, ReduceOp};
use hybrid_engine::engine::{Engine, Head, Ranks};
use hybrid_engine::kernels::ops::DropoutKey;
use hybrid_engine::model::gpt2::Dropout;
use hybrid_engine::model::positions::Positions;
use hybrid_engine::training::early_exit::{ExitPolicy, ExitReason};
use hybrid_engine::training::memory::MemoryPlan;
use hybrid_engine::training::metrics::{peak_rss_mib, record_parallel_usage, Metrics};
use hybrid_engine::training::optim::{AdamW, AdamWConfig};
use hybrid_engine::training::schedule::LrSchedule;
use hybrid_engine::training::tensor_parallel::{data_group, TensorParallel};
use hybrid_engine::training::trainer::{StepReport, Trainer, TrainerProgress};
use hybrid_engine::training::zero::ZeroStage;
use hybrid_engine::training::zero3::ShardedModel;
use hybrid_engine::ParamStore;
use serde::{Deserialize, Serialize};
use serde_json::json;
use std::ops::Range;
use std::sync::Arc;
use std::time::Instant;

/// What a pretraining run reports at the end (also the last record of metrics.jsonl).
#[derive(Debug, Clone, Default, Serialize)]
pub struct PretrainSummary {
    pub iterations: u64,
    pub first_loss: Option<f32>,
    pub last_loss: Option<f32>,
    pub valid_loss: Option<f64>,
    pub valid_ppl: Option<f64>,
    pub test_loss: Option<f64>,
    pub checkpoint: Option<std::path::PathBuf>,
}

/// What a pretraining checkpoint's trainer state holds beyond the common fields (`run`).
#[derive(Debug, Clone, Serialize, Deserialize)]
struct PretrainRunState {
    schedule: LrSchedule,
    adam: AdamWConfig,
    data: DataLayout,
    /// Checkpoints from before --dtype hold neither this nor the two below: fp32, every
    /// iteration an update.
    #[serde(default)]
    dtype: Option<String>,
    #[serde(default)]
    optimizer_step: Option<u64>,
    #[serde(default)]
    trainer: Option<TrainerProgress>,
}

/// The data-dependent facts a resumed run must agree with, stored in the trainer state.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct DataLayout {
    /// A lone corpus's path, or a blend's `--data-path` words.
    data_path: String,
    seq_length: usize,
    /// Over all corpora.
    num_blocks: usize,
    /// A lone corpus's train blocks; empty for a blend, whose corpora's are in `blend`.
    train: Range<usize>,
    /// Per rank.
    micro_batch_size: usize,
    gradient_accumulation_steps: usize,
    /// Blocks per iteration over all ranks; absent from checkpoints made before data
    /// parallelism, which ran one rank (micro-batch x accumulation).
    #[serde(default)]
    global_batch_size: usize,
    /// Each corpus of a blend (absent for a lone corpus).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    blend: Option<Vec<BlendPartLayout>>,
}

/// One corpus of a blend, as a resumed run must find it again.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct BlendPartLayout {
    data_path: String,
    weight: Option<f64>,
    num_blocks: usize,
    /// In the blend's block numbers.
    train: Range<usize>,
}

impl DataLayout {
    /// The layout of `corpus` read for `args`, drawn `accumulation` micro-batches an
    /// iteration on each of `world` data-parallel ranks.
    fn of(corpus: &BlendedCorpus, args: &PretrainArgs, world: usize, accumulation: usize) -> Result<Self> {
        let parts = corpus.parts();
        let blend = (parts.len() > 1).then(|| {
            parts
                .iter()
                .map(|p| BlendPartLayout {
                    data_path: p.name.clone(),
                    weight: p.weight,
                    num_blocks: p.corpus.num_blocks(),
                    train: p.split(0),
                })
                .collect()
        });
        Ok(DataLayout {
            data_path: args.data_path_text()?,
            seq_length: args.seq_length,
            num_blocks: corpus.num_blocks(),
            train: if blend.is_some() { 0..0 } else { parts[0].split(0) },
            micro_batch_size: args.micro_batch_size,
            gradient_accumulation_steps: accumulation,
            global_batch_size: args.micro_batch_size * world * accumulation,
            blend,
        })
    }

    fn global_batch(&self) -> usize {
        match self.global_batch_size {
            0 => self.micro_batch_size * self.gradient_accumulation_steps,
            g => g,
        }
    }

    /// Whether a run laid out as `self` continues one saved as `saved`: the same blocks in the
    /// same order. The sampler draws the global batch block after block, so how it is cut into
    /// ranks and micro-batches does not matter (Megatron resumes at another data-parallel size
    /// the same way).
    fn continues(&self, saved: &DataLayout) -> bool {
        (&self.data_path, self.seq_length, self.num_blocks, &self.train, self.global_batch(), &self.blend)
            == (&saved.data_path, saved.seq_length, saved.num_blocks, &saved.train, saved.global_batch(), &saved.blend)
    }
}

/// Runs `sft --from-scratch`.
pub fn run(args: &PretrainArgs) -> Result<PretrainSummary> {
    let started = Instant::now();
    if args.exit_signal_handler {
        hybrid_engine::training::early_exit::catch_sigterm()?;
    }
    let mut folded = args.clone();
    folded.fold_megatron_flags()?;
    let mut cfg = folded.pretrain_config()?;
    // Megatron's --finetune: the model, its shape included, from --load's weights.
    let finetune = folded.finetune_dir()?;
    if let Some(dir) = &finetune {
        cfg.model = folded.finetune_model(dir)?;
    }
    folded.check_recompute_layers(cfg.model.num_layers())?;
    let device = hybrid_engine::device::parse_device(&folded.device)?;
    let group = folded.dist.join(&device)?;
    // Tensor parallelism: the ranks of a TP group train on the same data, so the data is split
    // over the data-parallel group (the whole world without TP).
    let tp = folded.dist.tensor_parallel(&group)?;
    if let Some(tp) = &tp {
        // Refused before the corpus is tokenized (a checkpoint to resume has this shape too).
        tp.check_model(&cfg.model)?;
        println!("{}", tp.describe());
    }
    let data_group = data_group(&group, tp.as_ref());
    let world = data_group.world();
    let accumulation = folded.gradient_accumulation(world)?;
    // --train-samples becomes iterations, the schedule counting samples, once the batch is known.
    if let Some(line) = folded.count_in_samples(folded.micro_batch_size * world * accumulation)? {
        println!("{line}");
        cfg.schedule = folded.schedule()?;
    }
    let args = &folded;
    println!("device: {}", hybrid_engine::device::describe(&device));

    // Data: tokenize, pack, split. Every failure here happens before any training.
    let tokenizer = args.tokenizer()?;
    let corpus = read_corpus(args, &cfg, &tokenizer)?;
    let layout = DataLayout::of(&corpus, args, world, accumulation)?;

    // Model and optimizer: fresh, or exactly as the checkpoint left them.
    let mut model_cfg = cfg.model.clone();
    model_cfg.bos_token_id = Some(tokenizer.eos_id());
    model_cfg.eos_token_id = Some(tokenizer.eos_id());
    // Refused here, before the weights and the first micro-batch are allocated, rather than by an
    // allocation abort. The weights first: the plan counts parameters through their inventory,
    // one entry per tensor, which an absurd layer count would make enormous itself.
    hybrid_engine::model::params::check_weights_fit(&model_cfg, &device)?;
    let plan = MemoryPlan::new(&model_cfg, args.micro_batch_size, args.seq_length, args.checkpoint_activations)
        .with_gradient_accumulation(accumulation)
        .with_compute_dtype(args.precision.dtype.dtype())
        .on_device(&device)
        // Pretraining trains the trunk alone: nothing beside it.
        .with_tensor_parallel(tp.as_ref().map_or(1, |t| t.size()), 0)
        .with_data_parallel(ZeroStage::from_number(args.zero_stage)?, world)
        .with_buckets(args.dist.reduce_bucket_size as usize, args.dist.allgather_bucket_size as usize)
        .with_offload(args.dist.offload)
        .with_process_baseline();
    hybrid_engine::training::memory::check_plan_fits(&plan, &device)?;
    // ZeRO-3 across ranks without tensor parallelism builds the model sharded: no rank ever
    // holds it whole (DeepSpeed's zero.Init); otherwise each rank starts from the whole model
    // (or its TP slices).
    let dtype = args.precision.dtype.dtype();
    let shard_over = (ZeroStage::from_number(args.zero_stage)? == ZeroStage::Parameters && world > 1 && tp.is_none())
        .then(|| (data_group.clone(), dtype));
    let (weights, start, cursor, resume) =
        start_or_resume(args, &layout, finetune.as_deref(), &mut model_cfg, tp.as_ref(), shard_over, &device)?;
    let resumed = resume.is_some();
    if tokenizer.vocab_size() > model_cfg.vocab_size {
        bail!(
            "the tokenizer has {} tokens but the model's embedding only {} rows: use a matching --tokenizer",
            tokenizer.vocab_size(),
            model_cfg.vocab_size
        );
    }
    // Forward and backward run on a copy in the compute dtype (the masters themselves in fp32);
    // the engine accumulates, unscales, checks and applies the gradients to the fp32 masters.
    // Under tensor parallelism the masters are this rank's slices.
    let engine_cfg = args.engine_config(&cfg, accumulation, &data_group)?;
    let ranks = Ranks { data: data_group.clone(), tensor: tp.clone() };
    let engine = start_engine(&engine_cfg, &model_cfg, weights, ranks, resume.as_ref(), start)?;
    let sampler = corpus.train_sampler(args.seed, &cursor).context(
        "cannot resume: --data-path, --split or --seq-length differ from the run that saved the checkpoint (use the same, or start anew without --load)",
    )?;
    println!("{}", plan.report());
    if engine_cfg.precision.dtype != hybrid_engine::training::precision::Dtype::Fp32 {
        println!("compute dtype: {} (fp32 master weights and Adam moments)", engine_cfg.precision.dtype.name());
    }

    let metrics = Metrics::for_rank(group.rank(), &args.output_dir, args.train_iters, start)?.with_sinks(
        args.log.sinks(&args.output_dir)?,
        hybrid_engine::telemetry::tensorboard::MEGATRON_TAGS,
        start,
    )?;
    let mut run = Pretraining {
        args,
        cfg: &cfg,
        layout: &layout,
        corpus: &corpus,
        group: &group,
        data_group: &data_group,
        tokenizer: &tokenizer,
        device: &device,
        eval_batches: corpus.eval_batches(1, args.eval_iters, args.micro_batch_size),
        engine,
        metrics,
        sampler,
        summary: PretrainSummary { iterations: start, ..PretrainSummary::default() },
        last_saved: resumed.then_some(start),
        exit_policy: args.exit_policy(),
        started,
    };
    let train_secs = run.train(start)?;
    run.finish(start, train_secs)
}

/// `--data-path` tokenized (or Megatron's pre-tokenized `.bin`/`.idx`), packed in blocks of
/// `--seq-length` tokens and split into train, valid and test blocks, each corpus of a blend on
/// its own (said in a line each). Every failure here happens before any training, but a token
/// of a Megatron dataset beyond the model's vocabulary, found when its block is read.
fn read_corpus(args: &PretrainArgs, cfg: &PretrainConfig, tokenizer: &Tokenizer) -> Result<BlendedCorpus> {
    let corpus =
        data::read_blend(&args.blend_plan()?, &args.text_key, tokenizer, args.seq_length, cfg.model.vocab_size)?;
    let named = corpus.parts().len() > 1 || corpus.parts().iter().any(|p| p.serves.is_some());
    for (i, part) in corpus.parts().iter().enumerate() {
        let kind = if matches!(part.source, CorpusSource::Indexed(_)) {
            " (Megatron's indexed dataset, read in place)"
        } else {
            ""
        };
        // Its share of the samples of the split it serves (train, when split by --split).
        let which = part.serves.unwrap_or(0);
        let (members, weights) = corpus.split_weights(which);
        let share = members.iter().position(|&m| m == i).map_or(0.0, |k| weights[k]);
        let split = ["train", "validation", "test"][which];
        let name = if named { format!(" {} at {share:.3} of the {split} samples", part.name) } else { String::new() };
        let [train, valid, test] = [0, 1, 2].map(|s| part.split(s).len());
        println!(
            "corpus{name}{kind}: {} documents, {} tokens, {} blocks of {} tokens: train {train}, valid {valid}, test {test}",
            part.documents,
            part.corpus.num_tokens(),
            part.corpus.num_blocks(),
            args.seq_length,
        );
    }
    Ok(corpus)
}

/// What a checkpoint restores beyond the weights: the optimizer state, its step (fewer than
/// the iterations when fp16 skipped some) and the trainer's counters.
struct Resume {
    optimizer: resume::OptimizerState,
    optimizer_step: u64,
    progress: Option<TrainerProgress>,
}

/// The weights to train (this rank's slices under tensor parallelism), the iteration they are
/// at, the data cursor and what else to restore: fresh weights of `model_cfg`, `--finetune`'s
/// model directory `finetune` at iteration 0, or `--load`'s checkpoint (whose config then
/// replaces `model_cfg`, with `--dropout` applied), checked against this run's `layout`.
fn start_or_resume(
    args: &PretrainArgs,
    layout: &DataLayout,
    finetune: Option<&std::path::Path>,
    model_cfg: &mut hybrid_engine::Gpt2Config,
    tp: Option<&TensorParallel>,
    shard_over: Option<(Arc<ProcessGroup>, DType)>,
    device: &Device,
) -> Result<(StartingWeights, u64, DataCursor, Option<Resume>)> {
    if let Some(dir) = finetune {
        let weights = read_weights(dir, args, model_cfg, tp, shard_over, device)?;
        println!("--finetune: the weights of {} at iteration 0, with a fresh optimizer and data", dir.display());
        return Ok((weights, 0, DataCursor::default(), None));
    }
    // Megatron's scripts pass --save DIR --load DIR from the first run on: a root without a
    // checkpoint yet is a fresh start there (unless --exit-on-missing-checkpoint).
    let load = match &args.load {
        Some(root) if !root.join(hf_io::LATEST).is_file() && !args.exit_on_missing_checkpoint => {
            println!(
                "--load {}: no checkpoint there yet (no `latest`): starting from iteration 0, as Megatron does (--exit-on-missing-checkpoint makes this an error)",
                root.display()
            );
            None
        }
        load => load.as_ref(),
    };
    let Some(root) = load else {
        // Under tensor parallelism each rank draws the same weights but keeps its slices; under
        // ZeRO-3 its shard.
        let weights = match (tp, shard_over) {
            (_, Some((group, dtype))) => StartingWeights::Sharded(Box::new(ShardSource::Drawn(args.seed).build(
                group,
                model_cfg,
                &Default::default(),
                dtype,
                device,
            )?)),
            (Some(tp), None) => StartingWeights::Whole(tp.init(model_cfg, args.seed, device)?),
            (None, None) => StartingWeights::Whole(ParamStore::init(model_cfg, args.seed, device)?),
        };
        return Ok((weights, 0, DataCursor::default(), None));
    };
    let (dir, optimizer, state) = resume::load_training_state(root, device)?;
    let run: PretrainRunState = serde_json::from_value(state.run.clone())
        .context("checkpoint's trainer_state.json lacks pretraining's run state (data layout, schedule, optimizer)")?;
    let saved = run.data;
    if !layout.continues(&saved) {
        bail!(
            "--load {}: the checkpoint was trained on different data or batching ({saved:?}); resume with the same --data-path, --seq-length, --split and global batch (--micro-batch-size x ranks x --gradient-accumulation-steps = {} now, {} then)",
            root.display(),
            layout.global_batch(),
            saved.global_batch()
        );
    }
    let cursor: DataCursor =
        serde_json::from_value(state.data_cursor.clone()).context("checkpoint's data cursor is malformed")?;
    let optimizer_step = run.optimizer_step.unwrap_or(state.iteration);
    let weights = read_weights(&dir, args, model_cfg, tp, shard_over, device)?;
    println!("resumed from {} at iteration {}", dir.display(), state.iteration);
    let resume = Resume { optimizer, optimizer_step, progress: run.trainer };
    Ok((weights, state.iteration, cursor, Some(resume)))
}

/// The weights of the model directory `dir` (`model_cfg`'s shape, which its config then
/// replaces, with the dropout flags): whole, this rank's tensor-parallel slices, or its ZeRO-3
/// shard.
fn read_weights(
    dir: &std::path::Path,
    args: &PretrainArgs,
    model_cfg: &mut hybrid_engine::Gpt2Config,
    tp: Option<&TensorParallel>,
    shard_over: Option<(Arc<ProcessGroup>, DType)>,
    device: &Device,
) -> Result<StartingWeights> {
    // Under ZeRO-3 a rank reads only its shard of each tensor from the memory-mapped weights.
    Ok(match (shard_over, tp) {
        (Some((group, dtype)), _) => {
            let slices = ModelSlices::open(dir)?;
            check_same_shape(&slices.config, model_cfg)?;
            *model_cfg = args.with_dropout(slices.config.clone());
            let source = ShardSource::Slices(Box::new(slices));
            StartingWeights::Sharded(Box::new(source.build(group, model_cfg, &Default::default(), dtype, device)?))
        }
        // Checkpoints are consolidated: under tensor parallelism each rank reads its slices of
        // the memory-mapped weights, tensor by tensor.
        (None, Some(tp)) => {
            let slices = ModelSlices::open(dir)?;
            check_same_shape(&slices.config, model_cfg)?;
            *model_cfg = args.with_dropout(slices.config.clone());
            StartingWeights::Whole(tp.read(model_cfg, device, |n, r| slices.read(n, r))?)
        }
        (None, None) => {
            let model = hf_io::load_model_dir(dir, device)?;
            check_same_shape(&model.config, model_cfg)?;
            *model_cfg = args.with_dropout(model.config.clone());
            StartingWeights::Whole(ParamStore::from_tensors(model_cfg, &model.tensors, device)?)
        }
    })
}

/// The engine that trains `weights`, with a resumed checkpoint's optimizer state (`resume`,
/// at iteration `start`) restored. A checkpoint holds the whole optimizer state as pieces, so it
/// loads into any world size or stage: each rank keeps its shard of the moments.
fn start_engine(
    engine_cfg: &hybrid_engine::engine::EngineConfig,
    model_cfg: &hybrid_engine::Gpt2Config,
    weights: StartingWeights,
    ranks: Ranks,
    resume: Option<&Resume>,
    start: u64,
) -> Result<Engine> {
    let mut engine = match weights {
        StartingWeights::Whole(params) => Engine::new(engine_cfg, model_cfg, Head::Lm, params, ranks)?,
        StartingWeights::Sharded(sharded) => Engine::new_sharded(engine_cfg, model_cfg, *sharded)?,
    };
    if let Some(r) = resume {
        let progress =
            r.progress.clone().unwrap_or(TrainerProgress { boundaries: start, forced_skips: 0, scaler: None });
        engine.restore_optimizer(
            |opt, names, numels| r.optimizer.restore(opt, names, numels),
            r.optimizer_step,
            &progress,
        )?;
    }
    // Under ZeRO stage 3 from whole masters each rank keeps only its shard: the whole model goes now.
    engine.release_masters();
    Ok(engine)
}

/// The model pretraining starts from: whole (or this rank's TP slices), or built sharded.
enum StartingWeights {
    Whole(ParamStore),
    Sharded(Box<ShardedModel>),
}

/// Pretraining's loop and what it carries from one iteration to the next.
struct Pretraining<'a> {
    args: &'a PretrainArgs,
    cfg: &'a PretrainConfig,
    layout: &'a DataLayout,
    corpus: &'a BlendedCorpus,
    /// Every rank (checkpoints are collectives over all of them).
    group: &'a ProcessGroup,
    /// The ranks the data is split over.
    data_group: &'a ProcessGroup,
    tokenizer: &'a Tokenizer,
    device: &'a Device,
    /// The validation batches (the same at every evaluation).
    eval_batches: Vec<Vec<usize>>,
    engine: Engine,
    metrics: Metrics,
    sampler: BlendedSampler,
    summary: PretrainSummary,
    /// The iteration of the last checkpoint this run saved or resumed from.
    last_saved: Option<u64>,
    /// Megatron's early exits, and when the run started (their clock).
    exit_policy: ExitPolicy,
    started: Instant,
}

impl Pretraining<'_> {
    /// The iterations after `start` up to `--train-iters`, logging, evaluating and saving at
    /// their intervals; returns the seconds spent training (not evaluating or saving).
    fn train(&mut self, start: u64) -> Result<f64> {
        let args = self.args;
        let tokens_per_iter = (self.layout.global_batch() * args.seq_length) as f64;
        let (mut interval_loss, mut interval_iters, mut interval_secs) = (0f64, 0u64, 0f64);
        let mut train_secs = 0f64;
        for iteration in start + 1..=args.train_iters {
            let started = Instant::now();
            let (loss, report) = self.iteration(iteration)?;
            interval_secs += started.elapsed().as_secs_f64();
            train_secs += started.elapsed().as_secs_f64();
            let (lr, grad_norm) = (report.lr, report.grad_norm);
            let consumed = iteration * self.layout.global_batch() as u64;
            self.summary.first_loss.get_or_insert(loss);
            self.summary.last_loss = Some(loss);
            self.summary.iterations = iteration;
            self.metrics.record(json!({
                "iteration": iteration,
                "lm_loss": loss,
                "lr": lr,
                "grad_norm": grad_norm,
                "loss_scale": report.loss_scale,
                "skipped": report.skipped,
                "skipped_iterations": report.skipped_steps,
                "consumed_samples": consumed,
            }))?;
            self.metrics.advance(format!("loss {loss:.3}"));
            interval_loss += loss as f64;
            interval_iters += 1;

            if iteration % args.log_interval == 0 || iteration == args.train_iters {
                let ms = 1000.0 * interval_secs / interval_iters as f64;
                let tps = tokens_per_iter * interval_iters as f64 / interval_secs;
                self.metrics.println(&format!(
                    " iteration {iteration:>8}/{:>8} | consumed samples: {consumed:>10} | elapsed time per iteration (ms): {ms:.1} | learning rate: {lr:.3E} | lm loss: {:.6E} | loss scale: {:.1} | grad norm: {grad_norm:.3} | number of skipped iterations: {:>3} | tokens/s: {tps:.0} |",
                    args.train_iters,
                    interval_loss / interval_iters as f64,
                    report.loss_scale,
                    report.skipped_steps,
                ));
                self.metrics.record(json!({"iteration": iteration, "ms_per_iteration": ms, "tokens_per_sec": tps, "interval_lm_loss": interval_loss / interval_iters as f64}))?;
                (interval_loss, interval_iters, interval_secs) = (0.0, 0, 0.0);
            }
            if args.eval_interval > 0 && iteration % args.eval_interval == 0 && iteration != args.train_iters {
                let l = evaluate(&self.engine, self.corpus, &self.eval_batches, "validation", self.device)?;
                report_eval(&self.metrics, "validation", iteration, l);
                self.metrics.record(json!({"iteration": iteration, "valid_loss": l, "valid_ppl": l.exp()}))?;
            }
            if args.save_interval > 0 && iteration % args.save_interval == 0 {
                if let Some(dir) = self.save(iteration)? {
                    self.metrics.println(&format!(" saved checkpoint at iteration {iteration} to {}", dir.display()));
                }
            }
            // An early exit stops before --train-iters; at it the run ends anyway.
            let early_exit = if iteration < args.train_iters { self.exit_requested(iteration)? } else { None };
            if let Some(reason) = early_exit {
                if self.last_saved != Some(iteration) {
                    if let Some(dir) = self.save(iteration)? {
                        self.metrics
                            .println(&format!(" saved checkpoint at iteration {iteration} to {}", dir.display()));
                    }
                }
                self.metrics.println(&format!(" exiting program at iteration {iteration}: {reason}"));
                break;
            }
        }
        Ok(train_secs)
    }

    /// Whether to stop after `iteration` (Megatron's early exits): every rank decides alike,
    /// agreeing on the clock and the signal by a maximum over the world when they are asked for.
    fn exit_requested(&self, iteration: u64) -> Result<Option<ExitReason>> {
        let policy = self.exit_policy;
        let mut vote = [policy.local_vote(self.started.elapsed())];
        if policy.needs_agreement() {
            self.group.all_reduce_scalars(&mut vote, ReduceOp::Max)?;
        }
        Ok(policy.decide(iteration, vote[0]))
    }

    /// One iteration: every micro-batch's forward and backward, then the optimizer step.
    /// Returns the global batch's loss and the step's report.
    fn iteration(&mut self, iteration: u64) -> Result<(f32, StepReport)> {
        let args = self.args;
        let (rank, world) = (self.data_group.rank(), self.data_group.world());
        let accumulation = self.layout.gradient_accumulation_steps;
        let mut loss = 0f32;
        let mut report = None;
        for micro in 0..accumulation {
            // Every rank draws the global micro-batch (so the sampler, and its checkpointed
            // cursor, is the same everywhere) and trains on its own slice of it.
            let global = self.sampler.next_indices(args.micro_batch_size * world);
            let mine = &global[rank * args.micro_batch_size..(rank + 1) * args.micro_batch_size];
            let (x, y) = batch(self.corpus, mine, self.device)?;
            let key = DropoutKey { seed: args.seed, step: iteration, micro_batch: (micro * world + rank) as u64 };
            let dropout = Dropout::from_config(&self.engine.config, key);
            loss += self.engine.lm_forward_backward(&x, &y, Some(&dropout), 1.0)? / accumulation as f32;
            report = self.engine.step()?;
        }
        let report = report.context("internal error: an iteration ended without an optimizer step")?;
        // The loss of the global batch: the mean over ranks (each one's is over equal blocks).
        let mut losses = [f64::from(loss)];
        self.data_group.all_reduce_scalars(&mut losses, ReduceOp::Sum)?;
        let loss = (losses[0] / world as f64) as f32;
        // In fp16 an infinite loss is an overflow like any other: the scaler skips the update.
        if !loss.is_finite() && self.engine.trainer().scaler.is_none() {
            bail!("loss became {loss} at iteration {iteration}: lower --lr or raise --lr-warmup-iters");
        }
        Ok((loss, report))
    }

    /// Saves a checkpoint at `iteration` (every rank together); its directory on rank 0.
    fn save(&mut self, iteration: u64) -> Result<Option<std::path::PathBuf>> {
        let state = trainer_state(iteration, self.args, &self.sampler, self.cfg, self.layout, self.engine.trainer());
        let dir = save(self.group, &self.cfg.save_dir, &self.engine, &state, self.tokenizer)?;
        if dir.is_some() {
            self.summary.checkpoint.clone_from(&dir);
        }
        self.last_saved = Some(iteration);
        Ok(dir)
    }

    /// After the loop: what training used, the last checkpoint, the last validation and the
    /// test evaluation, the summary.
    fn finish(mut self, start: u64, train_secs: f64) -> Result<PretrainSummary> {
        let (args, group) = (self.args, self.group);
        self.metrics.finish();
        // Before saving, which gathers the model under ZeRO-3: what training itself used.
        if group.world() == 1 {
            if let Some(p) = peak_rss_mib() {
                println!("peak memory in training (RSS): {p:.1} MiB");
            }
        }
        let layout = self.engine.tensor_parallel().map(|t| t.layout.clone());
        let iterations = self.summary.iterations - start;
        record_parallel_usage(&mut self.metrics, group, layout.as_ref(), train_secs, iterations)?;

        let end = self.summary.iterations;
        if self.last_saved != Some(end) {
            if let Some(dir) = self.save(end)? {
                println!(" saved checkpoint at iteration {end} to {}", dir.display());
            }
        } else if self.summary.checkpoint.is_none() && group.is_first() {
            self.summary.checkpoint = Some(hybrid_engine::checkpoints::hf_io::latest_checkpoint(&self.cfg.save_dir)?);
        }
        // The last evaluations as records too, so that the validation curve reaches the end.
        if !self.eval_batches.is_empty() {
            let l = evaluate(&self.engine, self.corpus, &self.eval_batches, "validation", self.device)?;
            report_eval(&self.metrics, "validation", end, l);
            self.metrics.record(json!({"iteration": end, "valid_loss": l, "valid_ppl": l.exp()}))?;
            (self.summary.valid_loss, self.summary.valid_ppl) = (Some(l), Some(l.exp()));
        }
        let test_batches = self.corpus.eval_batches(2, args.eval_iters, args.micro_batch_size);
        if !test_batches.is_empty() {
            let l = evaluate(&self.engine, self.corpus, &test_batches, "test", self.device)?;
            report_eval(&self.metrics, "test", end, l);
            self.metrics.record(json!({"iteration": end, "test_loss": l, "test_ppl": l.exp()}))?;
            self.summary.test_loss = Some(l);
        }
        let peak = peak_rss_mib();
        if let Some(p) = peak {
            println!("peak memory (RSS): {p:.1} MiB");
        }
        self.metrics.end(json!({"event": "end", "summary": self.summary, "peak_rss_mib": peak}))?;
        group.barrier()?;
        Ok(self.summary)
    }
}

/// Saves a checkpoint (all ranks call this together): each rank writes the optimizer state it
/// holds, rank 0 the model (under ZeRO-3 written unit by unit as it is gathered from every
/// rank's shard, under tensor parallelism gathered from every TP rank's slices with the
/// optimizer's moments: a checkpoint is always consolidated, so any layout resumes it). No rank runs ahead of a checkpoint that a
/// restart would resume from. Returns the directory on rank 0.
fn save(
    group: &ProcessGroup,
    save_dir: &std::path::Path,
    engine: &Engine,
    state: &TrainerState,
    tokenizer: &Tokenizer,
) -> Result<Option<std::path::PathBuf>> {
    let (trainer, model_cfg) = (engine.trainer(), &engine.config);
    let mut optimizer = &trainer.optimizer;
    let whole_optimizer: AdamW;
    let slices;
    let masters = engine.masters();
    let inventory;
    let (gathered, names, numels) = match (engine.sharded(), engine.tensor_parallel()) {
        (Some(sharded), None) => (None, sharded.trained_names(), sharded.trained_numels()),
        // Mixed precision at ZeRO stages 1 and 2: the masters' shards put together on rank 0.
        (None, None) if engine.shards_masters() => {
            inventory = engine.trained_inventory();
            (engine.gather_weights()?.into_whole(), &inventory.0[..], inventory.1.clone())
        }
        (_, Some(tp)) => {
            // Only rank 0 writes the model and the optimizer state: its TP group gathers them,
            // the slices first put together from the data-parallel shards where the masters are
            // sharded (the first data-parallel rank of each TP rank holds them).
            slices = engine.gather_slices()?;
            let masters = slices.as_ref().unwrap_or(masters);
            let whole = tp.gather(masters, model_cfg)?;
            // Under ZeRO 1-3 the moments come together on the first data-parallel rank of each
            // TP rank; the TP groups of the other data-parallel ranks (none of whose members
            // holds them) write nothing and gather nothing.
            let consolidated = trainer.consolidated_optimizer()?;
            if let Some(gathered) =
                consolidated.as_deref().map(|l| tp.gather_optimizer(l, masters, model_cfg)).transpose()?.flatten()
            {
                whole_optimizer = gathered;
                optimizer = &whole_optimizer;
            }
            let numels = tp.whole_numels(masters, model_cfg);
            (whole.filter(|_| group.is_first()), &masters.names[..], numels)
        }
        (None, None) => (None, &masters.names[..], masters.vars.iter().map(|v| v.elem_count()).collect()),
    };
    let model = match (engine.sharded(), engine.tensor_parallel()) {
        (Some(sharded), None) => SavedModel::Sharded(sharded),
        _ => SavedModel::Whole(gathered.as_ref().or(group.is_first().then_some(masters))),
    };
    // Under tensor parallelism rank 0 holds the consolidated optimizer.
    let sharded = trainer.shards_optimizer() && engine.tensor_parallel().is_none();
    let shard = OptimizerShard { optimizer, names, numels: &numels, sharded };
    resume::save_checkpoint_across(group, save_dir, model_cfg, model, shard, state, &|d| {
        tokenizer.save(&d.join("tokenizer.json"))
    })
}

/// Inputs and next-token targets for the blocks `idx`: (B, T) each.
fn batch(corpus: &BlendedCorpus, idx: &[usize], device: &Device) -> Result<(Tensor, Tensor)> {
    let t = corpus.seq_length();
    let mut x = Vec::with_capacity(idx.len() * t);
    let mut y = Vec::with_capacity(idx.len() * t);
    for &i in idx {
        let block = corpus.block(i)?; // T + 1 tokens
        x.extend_from_slice(&block[..t]);
        y.extend_from_slice(&block[1..]);
    }
    Ok((Tensor::from_vec(x, (idx.len(), t), device)?, Tensor::from_vec(y, (idx.len(), t), device)?))
}

/// Mean LM loss over the given batches of `split` ("validation", "test"), dropout off.
fn evaluate(
    engine: &Engine,
    corpus: &BlendedCorpus,
    batches: &[Vec<usize>],
    split: &str,
    device: &Device,
) -> Result<f64> {
    let mut total = 0f64;
    let label = format!("evaluating on the {split} split");
    let mut progress = hybrid_engine::telemetry::progress::Phase::start(&label, "batches", batches.len() as u64);
    for idx in batches {
        let _done = progress.done_after(1);
        let (x, y) = batch(corpus, idx, device)?;
        let targets = y.flatten_all()?;
        let loss = engine.with_hidden(&x, &Positions::default(), |w, hidden| {
            Ok(w.trunk.lm_head_loss(hidden, &targets)?.to_scalar::<f32>()?)
        })?;
        total += loss as f64;
    }
    Ok(total / batches.len() as f64)
}

fn report_eval(metrics: &Metrics, split: &str, iteration: u64, loss: f64) {
    let line = format!(
        " {split} loss at iteration {iteration} | lm loss value: {loss:.6E} | lm loss PPL: {:.6E} |",
        loss.exp()
    );
    let rule = "-".repeat(line.len());
    metrics.println(&format!("{rule}\n{line}\n{rule}"));
}

fn trainer_state(
    iteration: u64,
    args: &PretrainArgs,
    sampler: &BlendedSampler,
    cfg: &PretrainConfig,
    layout: &DataLayout,
    trainer: &Trainer,
) -> TrainerState {
    TrainerState {
        format_version: FORMAT_VERSION,
        iteration,
        consumed_samples: iteration * layout.global_batch() as u64,
        data_cursor: json!(sampler.cursor()),
        seed: args.seed,
        run: json!(PretrainRunState {
            schedule: cfg.schedule.clone(),
            adam: cfg.adam.clone(),
            data: layout.clone(),
            dtype: Some(trainer.precision.dtype.name().to_string()),
            optimizer_step: Some(trainer.optimizer.step),
            trainer: Some(trainer.progress()),
        }),
    }
}

/// A checkpoint can only resume a run of the same model shape.
fn check_same_shape(saved: &hybrid_engine::Gpt2Config, asked: &hybrid_engine::Gpt2Config) -> Result<()> {
    let fields = [
        ("n_layer (--num-layers)", saved.num_layers(), asked.num_layers()),
        ("n_embd (--hidden-size)", saved.hidden_size(), asked.hidden_size()),
        ("n_head (--num-attention-heads)", saved.num_heads(), asked.num_heads()),
        ("n_positions (--max-position-embeddings)", saved.max_positions(), asked.max_positions()),
        ("vocab_size (--make-vocab-size-divisible-by)", saved.vocab_size, asked.vocab_size),
    ];
    for (name, s, a) in fields {
        if s != a {
            bail!(
                "the checkpoint has {name} = {s} but the flags ask for {a}: resume with the flags it was trained with"
            );
        }
    }
    Ok(())
}
