//! The epoch loop DS-Chat's step 1 and step 2 share (SFT, the reward model, DPO): evaluate,
//! then each epoch's micro-batches of this rank's rows, each weighted by its share of the global
//! micro-batch so that N ranks train as one rank would, stepping at the accumulation
//! boundaries, flushing a partial accumulation at the very end, evaluating after each epoch.
//! What differs between the steps, the batch and its loss, is an [`EpochTask`].

use crate::comm::{ProcessGroup, ReduceOp};
use crate::engine::Engine;
use crate::kernels::ops::DropoutKey;
use crate::model::gpt2::Dropout;
use crate::training::metrics::Metrics;
use crate::training::trainer::StepLog;
use anyhow::Result;
use std::time::Instant;

/// What one step trains on and how it evaluates.
pub trait EpochTask {
    type Batch;

    /// The micro-batch of the training rows `rows` (indices into the training set), what its
    /// loss is a mean over on this rank (its learned tokens, its pairs) and how many items it
    /// holds for the throughput column (tokens, pairs).
    fn batch(&self, rows: &[usize]) -> Result<(Self::Batch, f64, usize)>;

    /// The micro-batch's forward and backward on `engine`, its gradients weighted by `share`
    /// (see [`Engine::forward_backward`]). Returns this rank's mean loss.
    fn forward_backward(
        &mut self,
        engine: &mut Engine,
        batch: &Self::Batch,
        dropout: &Dropout,
        share: f64,
    ) -> Result<f32>;

    /// Evaluates `at` an epoch's end (0: before training) or a step, logging to `metrics`.
    fn evaluate(&mut self, engine: &Engine, metrics: &mut Metrics, at: EvalAt) -> Result<()>;

    /// After `epoch`'s micro-batches, before its evaluation (DPO logs its training pairs' rewards).
    fn epoch_done(&mut self, _metrics: &mut Metrics, _epoch: usize) -> Result<()> {
        Ok(())
    }
}

/// When an evaluation runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EvalAt {
    /// After this epoch (0: before training), of `epochs`.
    Epoch { epoch: usize, epochs: usize },
    /// After this optimizer step (`--eval-interval`).
    Step(u64),
}

impl EvalAt {
    /// DS-Chat's words for it: "Epoch 1/2", "Step 40".
    pub fn label(self) -> String {
        match self {
            Self::Epoch { epoch, epochs } => format!("Epoch {epoch}/{epochs}"),
            Self::Step(step) => format!("Step {step}"),
        }
    }

    /// Its key in a metrics record: `"epoch": e` or `"step": s`.
    pub fn record(self, mut value: serde_json::Value) -> serde_json::Value {
        match self {
            Self::Epoch { epoch, .. } => value["epoch"] = epoch.into(),
            Self::Step(step) => value["step"] = step.into(),
        }
        value
    }
}

/// The loop's shape.
pub struct EpochPlan<'a> {
    pub epochs: usize,
    /// Global micro-batches an epoch (for its first line).
    pub micro_per_epoch: usize,
    /// Optimizer steps of the run (for the log).
    pub steps: u64,
    /// Dropout's seed.
    pub seed: u64,
    /// A log line every this many optimizer steps.
    pub log_interval: u64,
    /// What the throughput column counts ("tokens", "pairs").
    pub unit: &'static str,
    /// Every rank prints each micro-batch's loss (DS-Chat's `--print_loss`).
    pub print_loss: bool,
    /// Also evaluate after every this many optimizer steps (DS-Chat step 2's `--eval_interval`;
    /// 0: at the epochs' ends only).
    pub eval_interval: u64,
    /// The ranks the rows are split over.
    pub group: &'a ProcessGroup,
}

/// What the loop did.
pub struct EpochsDone {
    /// The last optimizer step (0 when there was none).
    pub steps: u64,
    /// Seconds spent in training micro-batches (not evaluating).
    pub train_secs: f64,
}

/// Runs `plan.epochs` epochs of `task` on `engine`; `micro_batches(epoch)` is this rank's rows of
/// each of the epoch's global micro-batches (1-based epochs). Every rank calls it together.
pub fn train_epochs<T: EpochTask>(
    engine: &mut Engine,
    task: &mut T,
    plan: &EpochPlan,
    metrics: &mut Metrics,
    micro_batches: impl Fn(usize) -> Vec<Vec<usize>>,
) -> Result<EpochsDone> {
    let (rank, world) = (plan.group.rank(), plan.group.world());
    let epoch_end = |epoch| EvalAt::Epoch { epoch, epochs: plan.epochs };
    task.evaluate(engine, metrics, epoch_end(0))?;
    let mut log = StepLog::for_trainer(plan.log_interval, plan.steps, plan.unit, engine.trainer());
    let mut done = EpochsDone { steps: 0, train_secs: 0.0 };
    let mut micro_index = 0u64;
    for epoch in 1..=plan.epochs {
        metrics.println(&format!(
            "Beginning of Epoch {epoch}/{}, Total Micro Batches {}",
            plan.epochs, plan.micro_per_epoch
        ));
        for (step_in_epoch, rows) in micro_batches(epoch).into_iter().enumerate() {
            let started = Instant::now();
            let (batch, weight, items) = task.batch(&rows)?;
            micro_index += 1;
            // Each rank draws its own masks (its rows differ); rank 0 draws one rank's masks.
            let key = DropoutKey { seed: plan.seed, step: micro_index, micro_batch: rank as u64 };
            let dropout = Dropout::from_config(&engine.config, key);
            // The loss is a mean over the whole global micro-batch, as one rank holding all of
            // it would compute: each rank's mean weighs by its share of what it averages over.
            let mut total = [weight];
            plan.group.all_reduce_scalars(&mut total, ReduceOp::Sum)?;
            let share = weight * world as f64 / total[0].max(1.0);
            let loss = task.forward_backward(engine, &batch, &dropout, share)?;
            if plan.print_loss {
                println!("Epoch: {}, Step: {step_in_epoch}, Rank: {rank}, loss = {loss}", epoch - 1);
            }
            // The logged loss is the global micro-batch's: every rank then agrees on whether it
            // is finite, and a rank that stopped alone would leave the others waiting.
            let mut sums = [f64::from(loss) * weight];
            plan.group.all_reduce_scalars(&mut sums, ReduceOp::Sum)?;
            let loss = (sums[0] / total[0].max(1.0)) as f32;
            let stepped = engine.step()?;
            done.train_secs += started.elapsed().as_secs_f64();
            log.micro_batch(loss, items * world, started.elapsed().as_secs_f64(), epoch)?;
            if let Some(r) = stepped {
                done.steps = r.step;
                log.step(metrics, &r, epoch, loss)?;
                if plan.eval_interval > 0 && r.step.is_multiple_of(plan.eval_interval) {
                    task.evaluate(engine, metrics, EvalAt::Step(r.step))?;
                }
            }
        }
        if epoch == plan.epochs {
            if let Some(r) = engine.flush()? {
                done.steps = r.step;
            }
        }
        task.epoch_done(metrics, epoch)?;
        task.evaluate(engine, metrics, epoch_end(epoch))?;
    }
    Ok(done)
}
