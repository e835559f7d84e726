//! Command-line flags of `sft --from-scratch` (Megatron's pretraining names, DS-Chat's where they overlap; the
//! snake_case spellings are accepted too), and their validation into a [`PretrainConfig`].

use anyhow::{bail, Context, Result};
use clap::Parser;
use hybrid_engine::cli;
use hybrid_engine::cli::heading;
use hybrid_engine::comm::ProcessGroup;
use hybrid_engine::engine::EngineConfig;
use hybrid_engine::model::gpt2::Gpt2Config;
use hybrid_engine::training::early_exit::ExitPolicy;
use hybrid_engine::training::optim::AdamWConfig;
use hybrid_engine::training::precision::{Dtype, LossScaling};
use hybrid_engine::training::schedule::{DecayStyle, LrSchedule};
use std::path::PathBuf;

#[derive(Parser, Debug, Clone)]
#[command(
    args_override_self = true,
    name = "sft",
    about = "Step 1: supervised fine-tuning; with --from-scratch, GPT-2 pretraining (Megatron pretrain_gpt2)"
)]
pub struct PretrainArgs {
    /// Pretrain a randomly initialised GPT-2 on a text corpus (Megatron's pretrain_gpt2).
    #[arg(help_heading = heading::MODEL, long, alias = "from_scratch")]
    pub from_scratch: bool,
    /// Model shape: a preset (tiny, gpt2, gpt2-medium, gpt2-large, gpt2-xl) or a config.json.
    #[arg(help_heading = heading::MODEL, long, default_value = "tiny", alias = "model-name-or-path", alias = "model_name_or_path", conflicts_with = "finetune")]
    pub model: String,
    /// Override the preset's layer count.
    #[arg(help_heading = heading::MODEL, long, alias = "num_layers")]
    pub num_layers: Option<usize>,
    /// Override the preset's hidden size.
    #[arg(help_heading = heading::MODEL, long, alias = "hidden_size")]
    pub hidden_size: Option<usize>,
    /// Override the preset's attention head count.
    #[arg(help_heading = heading::MODEL, long, alias = "num_attention_heads")]
    pub num_attention_heads: Option<usize>,
    /// Override the preset's context length (n_positions).
    #[arg(help_heading = heading::MODEL, long, alias = "max_position_embeddings")]
    pub max_position_embeddings: Option<usize>,
    /// Pad the embedding to a multiple of this many rows (fast matmuls); the saved config
    /// records the padded size.
    #[arg(help_heading = heading::MODEL, long, default_value_t = 128, alias = "make_vocab_size_divisible_by", conflicts_with = "finetune")]
    pub make_vocab_size_divisible_by: usize,
    /// tokenizer.json to use (default: the embedded GPT-2 tokenizer).
    #[arg(help_heading = heading::MODEL, long, conflicts_with_all = ["vocab_file", "merge_file"])]
    pub tokenizer: Option<PathBuf>,
    /// Megatron's GPT-2 BPE vocabulary (gpt2-vocab.json), with --merge-file.
    #[arg(help_heading = heading::MODEL, long, alias = "vocab_file", requires = "merge_file")]
    pub vocab_file: Option<PathBuf>,
    /// Megatron's GPT-2 BPE merges (gpt2-merges.txt), with --vocab-file.
    #[arg(help_heading = heading::MODEL, long, alias = "merge_file", requires = "vocab_file")]
    pub merge_file: Option<PathBuf>,
    /// Megatron's tokenizer type: GPT2BPETokenizer (GPT-2's byte-level BPE) is the one taken.
    #[arg(help_heading = heading::MODEL, long, alias = "tokenizer_type", conflicts_with = "tokenizer")]
    pub tokenizer_type: Option<String>,
    /// Corpus: a .jsonl/.json, .parquet or plain text file, `shakespeare` (embedded), or
    /// Megatron's pre-tokenized PREFIX of PREFIX.bin and PREFIX.idx (preprocess_data.py's
    /// output, read in place). Or Megatron's blend of several: weights and corpora alternating
    /// (`0.3 A 0.7 B`), or corpora alone (`A B`, weighted by their sizes).
    #[arg(help_heading = heading::DATA, long, default_value = "shakespeare", alias = "data_path", num_args = 1.., value_name = "DATA_PATH")]
    pub data_path: Vec<String>,
    /// Megatron's --train-data-path: the train split's corpora (one, or a blend as
    /// --data-path's), each whole; with --valid-data-path and --test-data-path, instead of
    /// --data-path and --split.
    #[arg(help_heading = heading::DATA, long, alias = "train_data_path", num_args = 1.., value_name = "DATA_PATH", conflicts_with_all = ["data_path", "split"])]
    pub train_data_path: Option<Vec<String>>,
    /// Megatron's --valid-data-path: the validation split's corpora, each whole (none: no
    /// validation).
    #[arg(help_heading = heading::DATA, long, alias = "valid_data_path", num_args = 1.., value_name = "DATA_PATH", requires = "train_data_path")]
    pub valid_data_path: Option<Vec<String>>,
    /// Megatron's --test-data-path: the test split's corpora, each whole (none: no test).
    #[arg(help_heading = heading::DATA, long, alias = "test_data_path", num_args = 1.., value_name = "DATA_PATH", requires = "train_data_path")]
    pub test_data_path: Option<Vec<String>>,
    /// Megatron-DeepSpeed's --data-impl: mmap (or infer) reads --data-path as an indexed
    /// dataset; the older lazy and cached formats are not read.
    #[arg(help_heading = heading::DATA, long, alias = "data_impl")]
    pub data_impl: Option<String>,
    /// Field (jsonl) or column (parquet) holding the text.
    #[arg(help_heading = heading::DATA, long, default_value = data::corpus::DEFAULT_TEXT_KEY, alias = "text_key")]
    pub text_key: String,
    /// Tokens per training sequence.
    #[arg(help_heading = heading::DATA, long, default_value_t = 128, alias = "seq_length", alias = "max-seq-len", alias = "max_seq_len")]
    pub seq_length: usize,
    /// Train/validation/test weights over the packed blocks.
    #[arg(help_heading = heading::DATA, long, default_value = "949,50,1")]
    pub split: String,
    /// Blocks per micro-batch on each rank.
    #[arg(help_heading = heading::TRAINING,
        long,
        default_value_t = 8,
        alias = "micro_batch_size",
        alias = "per-device-train-batch-size",
        alias = "per_device_train_batch_size"
    )]
    pub micro_batch_size: usize,
    /// Micro-batches whose gradients are summed before each optimizer step.
    #[arg(help_heading = heading::TRAINING, long, default_value_t = 1, alias = "gradient_accumulation_steps")]
    pub gradient_accumulation_steps: usize,
    /// Blocks per iteration over all ranks (Megatron's --global-batch-size): the accumulation
    /// steps become global batch / (micro-batch x ranks), which must divide it.
    #[arg(help_heading = heading::TRAINING, long, alias = "global_batch_size", conflicts_with = "gradient_accumulation_steps")]
    pub global_batch_size: Option<usize>,
    /// Optimizer iterations to run (the data wraps around by epoch as needed).
    #[arg(help_heading = heading::TRAINING, long, default_value_t = 200, alias = "train_iters")]
    pub train_iters: u64,
    /// Megatron's --train-samples: train on this many blocks, as whole iterations of the global
    /// batch (the rest dropped, as Megatron does), the schedule then counting samples (instead of
    /// --train-iters).
    #[arg(help_heading = heading::TRAINING, long, alias = "train_samples", conflicts_with_all = ["train_iters", "lr_decay_iters", "lr_warmup_iters"])]
    pub train_samples: Option<u64>,
    /// Megatron's --rampup-batch-size START INCREMENT SAMPLES: refused (the global batch is fixed
    /// here).
    #[arg(help_heading = heading::TRAINING, long, alias = "rampup_batch_size", num_args = 3, value_names = ["START", "INCREMENT", "SAMPLES"])]
    pub rampup_batch_size: Option<Vec<String>>,
    /// The global batch a --train-samples run counts its schedule in, once the ranks are known
    /// (see `count_in_samples`).
    #[arg(skip)]
    samples_per_iteration: Option<u64>,
    /// Peak learning rate, reached after --lr-warmup-iters.
    #[arg(help_heading = heading::OPTIMIZER, long, default_value_t = 1e-3, alias = "learning-rate", alias = "learning_rate", value_parser = cli::positive())]
    pub lr: f64,
    /// Learning rate the decay ends at (Megatron's --min-lr).
    #[arg(help_heading = heading::OPTIMIZER, long, default_value_t = 1e-4, alias = "min_lr", value_parser = cli::non_negative())]
    pub min_lr: f64,
    /// constant, linear or cosine.
    #[arg(help_heading = heading::OPTIMIZER,
        long,
        default_value = "cosine",
        alias = "lr_decay_style",
        alias = "lr-scheduler-type",
        alias = "lr_scheduler_type"
    )]
    pub lr_decay_style: DecayStyle,
    /// Iterations of linear warm-up from 0 to --lr.
    #[arg(help_heading = heading::OPTIMIZER,
        long,
        default_value_t = 20,
        alias = "lr_warmup_iters",
        alias = "num-warmup-steps",
        alias = "num_warmup_steps"
    )]
    pub lr_warmup_iters: u64,
    /// Megatron's --lr-warmup-fraction: the warm-up as a fraction of --lr-decay-iters (a whole
    /// number of iterations; instead of --lr-warmup-iters), or of --lr-decay-samples (a whole
    /// number of samples) with --train-samples.
    #[arg(help_heading = heading::OPTIMIZER, long, alias = "lr_warmup_fraction", conflicts_with = "lr_warmup_iters", value_parser = cli::unit_interval())]
    pub lr_warmup_fraction: Option<f64>,
    /// Iteration where the decay reaches --min-lr (default: --train-iters).
    #[arg(help_heading = heading::OPTIMIZER, long, alias = "lr_decay_iters")]
    pub lr_decay_iters: Option<u64>,
    /// Megatron's --lr-warmup-samples, with --train-samples: the warm-up in samples (default 0,
    /// Megatron's).
    #[arg(help_heading = heading::OPTIMIZER, long, alias = "lr_warmup_samples", requires = "train_samples", conflicts_with = "lr_warmup_fraction")]
    pub lr_warmup_samples: Option<u64>,
    /// Megatron's --lr-decay-samples, with --train-samples: the sample where the decay reaches
    /// --min-lr (default: --train-samples).
    #[arg(help_heading = heading::OPTIMIZER, long, alias = "lr_decay_samples", requires = "train_samples")]
    pub lr_decay_samples: Option<u64>,
    /// AdamW's decoupled weight decay (biases and LayerNorms never decay).
    #[arg(help_heading = heading::OPTIMIZER, long, default_value_t = 0.1, alias = "weight_decay", value_parser = cli::non_negative())]
    pub weight_decay: f64,
    /// Clip gradients to this global norm (0 disables).
    #[arg(help_heading = heading::OPTIMIZER, long, default_value_t = 1.0, aliases = ["clip_grad", "gradient-clipping", "gradient_clipping"], value_parser = cli::non_negative())]
    pub clip_grad: f64,
    /// AdamW's first-moment decay (Megatron's 0.9).
    #[arg(help_heading = heading::OPTIMIZER, long, default_value_t = 0.9, alias = "adam_beta1", value_parser = cli::adam_beta())]
    pub adam_beta1: f64,
    /// AdamW's second-moment decay (0.95, as Megatron's GPT scripts and nanoGPT).
    #[arg(help_heading = heading::OPTIMIZER, long, default_value_t = 0.95, alias = "adam_beta2", value_parser = cli::adam_beta())]
    pub adam_beta2: f64,
    /// AdamW's epsilon, added to the root of the second moment.
    #[arg(help_heading = heading::OPTIMIZER, long, default_value_t = 1e-8, alias = "adam_eps", value_parser = cli::positive())]
    pub adam_eps: f64,
    /// Standard deviation of the initial weights (Megatron's --init-method-std, HF's
    /// initializer_range; the residual projections' is this over sqrt(2 x layers)).
    #[arg(help_heading = heading::MODEL, long, default_value_t = 0.02, alias = "init_method_std", value_parser = cli::positive(), conflicts_with = "finetune")]
    pub init_method_std: f64,
    /// Megatron's pipeline parallelism: only 1 (none) is taken; tensor parallelism and ZeRO
    /// split the model here.
    #[arg(help_heading = heading::PARALLELISM, long, default_value_t = 1, alias = "pipeline_model_parallel_size")]
    pub pipeline_model_parallel_size: u64,
    /// Dropout for embeddings, attention and residuals (default: the model config's, 0.1).
    #[arg(help_heading = heading::MODEL, long, value_parser = cli::dropout())]
    pub dropout: Option<f64>,
    /// Megatron's --attention-dropout: the attention probabilities' dropout (HF's attn_pdrop).
    #[arg(help_heading = heading::MODEL, long, alias = "attention_dropout", conflicts_with = "dropout", value_parser = cli::dropout())]
    pub attention_dropout: Option<f64>,
    /// Megatron's --hidden-dropout: the embeddings' and residual branches' dropout (HF's
    /// embd_pdrop and resid_pdrop).
    #[arg(help_heading = heading::MODEL, long, alias = "hidden_dropout", conflicts_with = "dropout", value_parser = cli::dropout())]
    pub hidden_dropout: Option<f64>,
    /// Seed of the initialisation, the data order and dropout.
    #[arg(help_heading = heading::TRAINING, long, default_value_t = 1234)]
    pub seed: u64,
    /// Evaluate on the validation split every this many iterations (0: only at the end).
    #[arg(help_heading = heading::EVALUATION, long, default_value_t = 50, alias = "eval_interval")]
    pub eval_interval: u64,
    /// Validation batches per evaluation.
    #[arg(help_heading = heading::EVALUATION, long, default_value_t = 10, alias = "eval_iters")]
    pub eval_iters: usize,
    /// Log a line (and the metrics) every this many iterations.
    #[arg(help_heading = heading::LOGGING, long, default_value_t = 10, alias = "log_interval")]
    pub log_interval: u64,
    /// Checkpoint root (default: --output-dir).
    #[arg(help_heading = heading::OUTPUT, long)]
    pub save: Option<PathBuf>,
    /// Save a checkpoint every this many iterations (and always at the end).
    #[arg(help_heading = heading::OUTPUT, long, default_value_t = 0, alias = "save_interval")]
    pub save_interval: u64,
    /// Resume from the checkpoint root's `latest` checkpoint; a root with none yet starts from
    /// scratch, as Megatron's does (so one script with --save DIR --load DIR starts, then resumes).
    #[arg(help_heading = heading::OUTPUT, long)]
    pub load: Option<PathBuf>,
    /// Megatron's --finetune: start from --load's weights (its latest checkpoint, a Hugging Face
    /// model directory, or a hub id such as gpt2) at iteration 0, with a fresh optimizer and
    /// data, the model's shape taken from it.
    #[arg(help_heading = heading::OUTPUT, long, requires = "load", conflicts_with = "exit_on_missing_checkpoint")]
    pub finetune: bool,
    /// Megatron's --no-load-optim: with --finetune, which already starts a fresh optimizer (as
    /// Megatron's does); refused without it.
    #[arg(help_heading = heading::OUTPUT, long, alias = "no_load_optim")]
    pub no_load_optim: bool,
    /// Megatron's --no-load-rng: with --finetune, which loads no random state; refused without it.
    #[arg(help_heading = heading::OUTPUT, long, alias = "no_load_rng")]
    pub no_load_rng: bool,
    /// Megatron's --exit-interval: save a checkpoint and stop after an iteration divisible by
    /// this (the same command with --load resumes).
    #[arg(help_heading = heading::OUTPUT, long, alias = "exit_interval", value_parser = clap::value_parser!(u64).range(1..))]
    pub exit_interval: Option<u64>,
    /// Megatron's --exit-duration-in-mins: save a checkpoint and stop after the first iteration
    /// that ends this many minutes after the start (every rank at the same iteration).
    #[arg(help_heading = heading::OUTPUT, long, alias = "exit_duration_in_mins", value_parser = cli::positive())]
    pub exit_duration_in_mins: Option<f64>,
    /// Megatron's --exit-signal-handler: SIGTERM (a scheduler's warning before it kills the
    /// job) saves a checkpoint after the current iteration and stops, instead of killing.
    #[arg(help_heading = heading::OUTPUT, long, alias = "exit_signal_handler")]
    pub exit_signal_handler: bool,
    /// Megatron's: a --load root without a checkpoint is an error, not a fresh start.
    #[arg(help_heading = heading::OUTPUT, long, alias = "exit_on_missing_checkpoint", requires = "load")]
    pub exit_on_missing_checkpoint: bool,
    /// Where metrics.jsonl (and by default the checkpoints) go.
    #[arg(help_heading = heading::OUTPUT, long, default_value = "output/pretrain", alias = "output_dir")]
    pub output_dir: PathBuf,
    /// Recompute each block's activations in backward instead of storing them.
    #[arg(help_heading = heading::MODEL, long, alias = "checkpoint_activations", alias = "gradient-checkpointing", alias = "gradient_checkpointing")]
    pub checkpoint_activations: bool,
    /// Megatron's --recompute-activations: its selective recompute (attention's core only),
    /// which is not built here; refused in one line naming the full recompute that is.
    #[arg(help_heading = heading::MODEL, long, alias = "recompute_activations")]
    pub recompute_activations: bool,
    /// Megatron's --recompute-granularity: `full` (with --recompute-method and
    /// --recompute-num-layers, as Megatron requires) recomputes each layer in backward from its
    /// input, which is --checkpoint-activations; `selective` is refused.
    #[arg(help_heading = heading::MODEL, long, alias = "recompute_granularity", value_parser = ["full", "selective"])]
    pub recompute_granularity: Option<String>,
    /// Megatron's --recompute-method for full recompute: uniform (groups of --recompute-num-layers
    /// layers; 1 here) or block (the first --recompute-num-layers layers; all of them here).
    #[arg(help_heading = heading::MODEL, long, alias = "recompute_method", value_parser = ["uniform", "block"])]
    pub recompute_method: Option<String>,
    /// Megatron's --recompute-num-layers: the group size (uniform) or the layers recomputed (block).
    #[arg(help_heading = heading::MODEL, long, alias = "recompute_num_layers")]
    pub recompute_num_layers: Option<usize>,
    /// auto (CUDA device 0 when built with --features cuda and a GPU opens, else the CPU), cpu,
    /// cuda or cuda:N.
    #[arg(help_heading = heading::PRECISION, long, default_value = "auto", env = hybrid_engine::device::DEVICE_ENV)]
    pub device: String,
    /// --dtype, --compute-fp32-loss, --loss-scale-window, --initial-scale-power.
    #[command(flatten)]
    pub precision: hybrid_engine::cli::precision_args::PrecisionArgs,
    /// Megatron's --fp16: compute in fp16, the same as --dtype fp16.
    #[arg(help_heading = heading::PRECISION, long, conflicts_with_all = ["bf16", "dtype"])]
    pub fp16: bool,
    /// Megatron's --bf16: compute in bf16, the same as --dtype bf16.
    #[arg(help_heading = heading::PRECISION, long, conflicts_with = "dtype")]
    pub bf16: bool,
    /// Megatron's --initial-loss-scale: fp16's first loss scale, a power of two from 1 to 2^32
    /// (--initial-scale-power of its log2; pretraining's default is Megatron's 2^32).
    #[arg(help_heading = heading::PRECISION, long, alias = "initial_loss_scale", conflicts_with = "initial_scale_power")]
    pub initial_loss_scale: Option<f64>,
    /// ZeRO stage across data-parallel ranks: 0 (gradients all-reduced), 1 (+ optimizer state
    /// sharded), 2 (+ gradients sharded), 3 (+ weights sharded, each block gathered when it runs,
    /// with activation recomputation). Each rank trains on its own --micro-batch-size blocks:
    /// the global batch is micro-batch x ranks x accumulation, as Megatron's.
    #[arg(help_heading = heading::PARALLELISM, long, default_value_t = 0, alias = "zero_stage")]
    pub zero_stage: u8,
    /// Megatron's distributed optimizer: the fp32 masters and Adam moments sharded over the
    /// data-parallel ranks, which is ZeRO stage 1 here (the same as --zero-stage 1).
    #[arg(help_heading = heading::PARALLELISM, long, alias = "use_distributed_optimizer", conflicts_with = "zero_stage")]
    pub use_distributed_optimizer: bool,
    #[command(flatten)]
    pub dist: hybrid_engine::cli::dist_args::DistArgs,
    #[command(flatten)]
    pub log: hybrid_engine::cli::log_args::LogArgs,
}

/// Validated pretraining settings.
pub struct PretrainConfig {
    pub model: Gpt2Config,
    pub schedule: LrSchedule,
    pub adam: AdamWConfig,
    pub save_dir: PathBuf,
}

/// Megatron's fp16 loss-scale defaults (`--initial-loss-scale` 2^32, `--loss-scale-window`
/// 1000), pretraining's; the fine-tuning steps start from DS-Chat's (2^16, 100).
pub const MEGATRON_LOSS_SCALING: LossScaling = LossScaling { initial_scale_power: 32, window: 1000 };

impl PretrainArgs {
    /// Folds Megatron's flags into ours (clap has refused their conflicts): `--fp16`, `--bf16`
    /// and `--initial-loss-scale` into `--dtype` and `--initial-scale-power`, with Megatron's
    /// loss-scale defaults for fp16 where no flag set them; `--use-distributed-optimizer` into
    /// `--zero-stage 1`; the full recompute of every layer into `--checkpoint-activations`.
    /// [`crate::pretrain::run`] calls it first; the run reads ours alone.
    pub fn fold_megatron_flags(&mut self) -> Result<()> {
        if self.use_distributed_optimizer {
            self.zero_stage = 1;
        }
        if self.fp16 {
            self.precision.dtype = Dtype::Fp16;
        }
        if self.bf16 {
            self.precision.dtype = Dtype::Bf16;
        }
        if let Some(scale) = self.initial_loss_scale {
            let power = scale.log2();
            if !(1.0..=2f64.powi(32)).contains(&scale) || power.fract() != 0.0 {
                bail!("--initial-loss-scale {scale}: the loss scale here is a power of two from 1 to 2^32: use one, e.g. 65536");
            }
            if self.precision.dtype != Dtype::Fp16 {
                bail!(
                    "--initial-loss-scale tunes fp16's loss scale, and the dtype is {}: add --fp16 or drop it",
                    self.precision.dtype.name()
                );
            }
            self.precision.initial_scale_power = Some(power as u32);
        }
        if self.precision.dtype == Dtype::Fp16 {
            let p = &mut self.precision;
            p.initial_scale_power.get_or_insert(MEGATRON_LOSS_SCALING.initial_scale_power);
            p.loss_scale_window.get_or_insert(MEGATRON_LOSS_SCALING.window);
        }
        self.fold_recompute()
    }

    /// Megatron's full recompute of every layer as `--checkpoint-activations` (each layer's
    /// input kept, the layer recomputed in backward), the one recompute built here; the other
    /// recomputes are one line each. `--recompute-method block` is checked against the model's
    /// layers by [`Self::check_recompute_layers`], once the model is known.
    fn fold_recompute(&mut self) -> Result<()> {
        const FULL: &str = "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1";
        if self.recompute_activations || self.recompute_granularity.as_deref() == Some("selective") {
            bail!("Megatron's selective recompute (--recompute-activations, --recompute-granularity selective: attention's core only) is not built here; whole layers are recomputed with {FULL} (or --checkpoint-activations)");
        }
        let method = self.recompute_method.as_deref();
        if self.recompute_granularity.is_none() {
            if method.is_some() || self.recompute_num_layers.is_some() {
                bail!("--recompute-method and --recompute-num-layers shape --recompute-granularity full, which is not given: add it ({FULL})");
            }
            return Ok(());
        }
        match (method, self.recompute_num_layers) {
            (None, _) | (_, None) => bail!(
                "--recompute-granularity full needs --recompute-method (uniform or block) and --recompute-num-layers, as Megatron's does: e.g. {FULL}"
            ),
            (Some("uniform"), Some(n)) if n != 1 => bail!(
                "--recompute-method uniform --recompute-num-layers {n} recomputes groups of {n} layers from each group's input; here each layer is recomputed from its own: use --recompute-num-layers 1"
            ),
            _ => self.checkpoint_activations = true,
        }
        Ok(())
    }

    /// `--recompute-method block --recompute-num-layers N` recomputes the first N layers and
    /// stores the rest; here every layer is recomputed or none, so N must cover the model's
    /// `n_layer` layers.
    pub fn check_recompute_layers(&self, layers: usize) -> Result<()> {
        match (self.recompute_method.as_deref(), self.recompute_num_layers) {
            (Some("block"), Some(n)) if n < layers => bail!(
                "--recompute-method block --recompute-num-layers {n} recomputes only the first {n} of the model's {layers} layers; here every layer is recomputed or none: use --recompute-num-layers {layers} (or --recompute-method uniform --recompute-num-layers 1)"
            ),
            _ => Ok(()),
        }
    }

    /// Micro-batches per iteration on each of `world` ranks: --gradient-accumulation-steps, or
    /// derived from --global-batch-size as Megatron does.
    pub fn gradient_accumulation(&self, world: usize) -> Result<usize> {
        let Some(global) = self.global_batch_size else { return Ok(self.gradient_accumulation_steps) };
        let per_step = self.micro_batch_size * world;
        if global == 0 || global % per_step != 0 {
            bail!(
                "--global-batch-size {global} is not a positive multiple of --micro-batch-size {} x {world} data-parallel ranks = {per_step}: change one of them",
                self.micro_batch_size
            );
        }
        Ok(global / per_step)
    }

    /// How the model trains, with `cfg`'s optimizer and schedule, `accumulation` micro-batches an
    /// iteration, over the data-parallel `group` (at `--zero-stage`, said in a line).
    pub fn engine_config(
        &self,
        cfg: &PretrainConfig,
        accumulation: usize,
        group: &ProcessGroup,
    ) -> Result<EngineConfig> {
        Ok(EngineConfig {
            optimizer: cfg.adam.clone(),
            schedule: cfg.schedule.clone(),
            gradient_accumulation_steps: accumulation,
            gradient_clipping: self.clip_grad,
            precision: self.precision.precision(),
            loss_scaling: self.precision.loss_scaling(),
            lora_learning_rate: None,
            checkpoint_activations: self.checkpoint_activations,
            parallel: self.dist.parallel_config(group, self.zero_stage, "")?,
        })
    }

    /// Checks every flag that parsing has not (float ranges are checked there) and derives the model and optimizer configuration.
    pub fn pretrain_config(&self) -> Result<PretrainConfig> {
        if !self.from_scratch {
            bail!("supervised fine-tuning on prompt/answer data is not available yet (it arrives with the SFT issue): pass --from-scratch to pretrain GPT-2 on a corpus");
        }
        hybrid_engine::device::check_device(&self.device)?;
        self.precision.validate()?;
        self.log.validate()?;
        let positive = [
            ("--seq-length", self.seq_length),
            ("--micro-batch-size", self.micro_batch_size),
            ("--gradient-accumulation-steps", self.gradient_accumulation_steps),
            ("--train-iters", self.train_iters as usize),
            ("--log-interval", self.log_interval as usize),
        ];
        for (flag, v) in positive {
            if v == 0 {
                bail!("{flag} must be at least 1");
            }
        }
        let defaults = PretrainArgs::parse_from(["sft", "--from-scratch"]);
        if self.lr_decay_style == DecayStyle::Constant
            && (self.lr_decay_iters.is_some() || self.lr_decay_samples.is_some() || self.min_lr != defaults.min_lr)
        {
            bail!("--lr-decay-iters (or -samples) and --min-lr shape the decay, and --lr-decay-style constant has none: drop them, or use linear or cosine");
        }
        if self.train_samples == Some(0) {
            bail!("--train-samples must be at least 1");
        }
        if self.min_lr > self.lr {
            bail!(
                "--min-lr {} is above --lr {}: the decay ends at --min-lr, so it must be at most --lr",
                self.min_lr,
                self.lr
            );
        }
        let mut model = self.with_dropout(model_config(&self.model)?).with_shape(
            self.num_layers,
            self.hidden_size,
            self.num_attention_heads,
            self.max_position_embeddings,
        );
        model.initializer_range = self.init_method_std;
        model.pad_vocab(self.make_vocab_size_divisible_by);
        model.validate()?;
        if self.seq_length > model.max_positions() {
            bail!(
                "--seq-length {} is larger than the model's context of {} positions: lower --seq-length or raise --max-position-embeddings",
                self.seq_length,
                model.max_positions()
            );
        }
        if let Some(kind) = self.tokenizer_type.as_deref().filter(|&t| t != "GPT2BPETokenizer") {
            bail!("--tokenizer-type {kind}: pretraining takes GPT2BPETokenizer (GPT-2's BPE, from --vocab-file and --merge-file or embedded), or a HF tokenizer.json with --tokenizer");
        }
        self.blend_plan()?;
        self.check_data_impl()?;
        if self.pipeline_model_parallel_size != 1 {
            bail!(
                "--pipeline-model-parallel-size {}: pipeline parallelism is not implemented; split the model with --tensor-model-parallel-size and --zero-stage 3 instead",
                self.pipeline_model_parallel_size
            );
        }
        for (flag, given) in [("--no-load-optim", self.no_load_optim), ("--no-load-rng", self.no_load_rng)] {
            if given && !self.finetune {
                bail!("{flag} without --finetune: a resume here continues the run exactly (the optimizer restored with the weights, the random streams derived from --seed and the iteration); to start from --load's weights with a fresh optimizer, add --finetune (which starts at iteration 0, as Megatron's)");
            }
        }
        if let Some(ramp) = &self.rampup_batch_size {
            bail!(
                "--rampup-batch-size {}: the global batch is fixed for the whole run here (its accumulation steps are set once): drop it and train at --global-batch-size",
                ramp.join(" ")
            );
        }
        Ok(PretrainConfig {
            model,
            schedule: self.schedule()?,
            adam: AdamWConfig {
                beta1: self.adam_beta1,
                beta2: self.adam_beta2,
                eps: self.adam_eps,
                weight_decay: self.weight_decay,
            },
            save_dir: self.save.clone().unwrap_or_else(|| self.output_dir.clone()),
        })
    }

    /// The learning-rate schedule: in iterations, or with `--train-samples` in samples (as
    /// Megatron counts it: `--lr-warmup-samples`, `--lr-decay-samples`, their fraction).
    pub fn schedule(&self) -> Result<LrSchedule> {
        let (decay, warmup, unit) = match self.train_samples {
            None => {
                let decay = self.lr_decay_iters.unwrap_or(self.train_iters);
                let warmup = match self.lr_warmup_fraction {
                    None => self.lr_warmup_iters,
                    Some(fraction) => warmup_of_fraction(fraction, decay, WarmupUnit::Iterations)?,
                };
                (decay, warmup, 1)
            }
            Some(samples) => {
                let decay = self.lr_decay_samples.unwrap_or(samples);
                let warmup = match self.lr_warmup_fraction {
                    None => self.lr_warmup_samples.unwrap_or(0),
                    Some(fraction) => warmup_of_fraction(fraction, decay, WarmupUnit::Samples)?,
                };
                // Before the ranks are known (flags checked early), one sample an iteration.
                (decay, warmup, self.samples_per_iteration.unwrap_or(1))
            }
        };
        Ok(LrSchedule {
            max_lr: self.lr,
            min_lr: self.min_lr,
            warmup_iters: warmup,
            decay_iters: decay,
            style: self.lr_decay_style,
            samples_per_iteration: unit,
        })
    }

    /// With `--train-samples`, the iterations and the schedule's count once the global batch
    /// (`global_batch` blocks an iteration over all ranks) is known; said in a line. Nothing
    /// without it.
    pub fn count_in_samples(&mut self, global_batch: usize) -> Result<Option<String>> {
        let Some(samples) = self.train_samples else { return Ok(None) };
        let batch = global_batch as u64;
        if samples < batch {
            bail!("--train-samples {samples} is less than one global batch of {batch} samples: raise it, or lower the batch");
        }
        self.train_iters = samples / batch;
        self.samples_per_iteration = Some(batch);
        let dropped = samples % batch;
        let rest = if dropped > 0 { format!(" (the last {dropped} dropped, as Megatron does)") } else { String::new() };
        Ok(Some(format!(
            "--train-samples {samples}: {} iterations of {batch} samples{rest}; the learning rate counts samples",
            self.train_iters
        )))
    }

    /// With `--finetune`, the model directory `--load` names (a checkpoint root's latest, a model
    /// directory, or a hub id, downloaded when online).
    pub fn finetune_dir(&self) -> Result<Option<PathBuf>> {
        match (&self.load, self.finetune) {
            (Some(load), true) => {
                let name = load.to_str().with_context(|| format!("--load {} is not UTF-8", load.display()))?;
                Ok(Some(hybrid_engine::checkpoints::hf_io::resolve_model_dir(name)?))
            }
            _ => Ok(None),
        }
    }

    /// The model `--finetune` starts from: `dir`'s config (with the dropout flags), which the
    /// shape flags given must agree with, and which must hold `--seq-length` positions.
    pub fn finetune_model(&self, dir: &std::path::Path) -> Result<Gpt2Config> {
        let model = self.with_dropout(hybrid_engine::checkpoints::hf_io::read_config(&dir.join("config.json"))?);
        let given = [
            ("--num-layers", self.num_layers, "n_layer", model.num_layers()),
            ("--hidden-size", self.hidden_size, "n_embd", model.hidden_size()),
            ("--num-attention-heads", self.num_attention_heads, "n_head", model.num_heads()),
            ("--max-position-embeddings", self.max_position_embeddings, "n_positions", model.max_positions()),
        ];
        for (flag, value, field, has) in given {
            if let Some(v) = value.filter(|&v| v != has) {
                bail!(
                    "{flag} {v}: --finetune takes the model from {}, whose {field} is {has}: drop the flag",
                    dir.display()
                );
            }
        }
        if self.seq_length > model.max_positions() {
            bail!(
                "--seq-length {} is longer than the {} positions of the model --finetune starts from ({}): lower --seq-length",
                self.seq_length,
                model.max_positions(),
                dir.display()
            );
        }
        Ok(model)
    }

    /// Megatron's early exits as the flags ask for them.
    pub fn exit_policy(&self) -> ExitPolicy {
        ExitPolicy {
            interval: self.exit_interval,
            duration: self.exit_duration_in_mins.map(|m| std::time::Duration::from_secs_f64(m * 60.0)),
            on_sigterm: self.exit_signal_handler,
        }
    }

    /// `config` with the dropout flags given (`--dropout`, or Megatron's `--attention-dropout`
    /// and `--hidden-dropout`) in place of its own: a preset's, or a resumed checkpoint's.
    pub fn with_dropout(&self, mut config: Gpt2Config) -> Gpt2Config {
        let (hidden, attention) = match self.dropout {
            Some(p) => (Some(p), Some(p)),
            None => (self.hidden_dropout, self.attention_dropout),
        };
        if let Some(p) = hidden {
            (config.resid_pdrop, config.embd_pdrop) = (p, p);
        }
        if let Some(p) = attention {
            config.attn_pdrop = p;
        }
        config
    }

    /// The tokenizer the flags name: `--tokenizer`'s tokenizer.json, GPT-2's BPE from
    /// `--vocab-file` and `--merge-file` (Megatron's), or the embedded GPT-2 tokenizer.
    pub fn tokenizer(&self) -> Result<data::Tokenizer> {
        match (&self.tokenizer, &self.vocab_file, &self.merge_file) {
            (Some(path), _, _) => data::Tokenizer::from_file(path),
            (None, Some(vocab), Some(merges)) => data::Tokenizer::from_gpt2_bpe_files(vocab, merges),
            _ => data::Tokenizer::gpt2_default(),
        }
    }

    /// Where the splits' corpora come from: `--data-path` split by `--split`, or Megatron's
    /// `--train-data-path` (with `--valid-data-path`, `--test-data-path`), each a blend.
    pub fn blend_plan(&self) -> Result<data::BlendPlan> {
        let Some(train) = &self.train_data_path else {
            let fractions = data::parse_split(&self.split)?;
            return Ok(data::BlendPlan::Split { entries: data::parse_blend(&self.data_path)?, fractions });
        };
        let blend = |words: Option<&Vec<String>>, flag: &str| -> Result<Vec<data::BlendEntry>> {
            words.map_or(Ok(Vec::new()), |w| {
                data::parse_blend(w).map_err(|e| anyhow::anyhow!("{}", e.to_string().replace("--data-path", flag)))
            })
        };
        Ok(data::BlendPlan::PerSplit([
            blend(Some(train), "--train-data-path")?,
            blend(self.valid_data_path.as_ref(), "--valid-data-path")?,
            blend(self.test_data_path.as_ref(), "--test-data-path")?,
        ]))
    }

    /// The data flags as a checkpoint records them: a lone corpus's path, a blend's
    /// `--data-path` words, or each split's words.
    pub fn data_path_text(&self) -> Result<String> {
        Ok(match self.blend_plan()? {
            data::BlendPlan::Split { entries, .. } if entries.len() == 1 => entries[0].path.clone(),
            data::BlendPlan::Split { .. } => self.data_path.join(" "),
            data::BlendPlan::PerSplit(_) => {
                let given = [&self.train_data_path, &self.valid_data_path, &self.test_data_path];
                let words = given
                    .iter()
                    .zip(data::blend::SPLIT_DATA_FLAGS)
                    .filter_map(|(w, flag)| w.as_ref().map(|w| format!("{flag} {}", w.join(" "))));
                words.collect::<Vec<_>>().join(" ")
            }
        })
    }

    /// `--data-impl`: mmap (or infer) must find Megatron's indexed dataset at `--data-path`.
    fn check_data_impl(&self) -> Result<()> {
        match self.data_impl.as_deref() {
            None => Ok(()),
            Some("mmap" | "infer") => {
                let flagged: Vec<(&str, data::BlendEntry)> = match self.blend_plan()? {
                    data::BlendPlan::Split { entries, .. } => entries.into_iter().map(|e| ("--data-path", e)).collect(),
                    data::BlendPlan::PerSplit(per_split) => data::blend::SPLIT_DATA_FLAGS
                        .into_iter()
                        .zip(per_split)
                        .flat_map(|(flag, entries)| entries.into_iter().map(move |e| (flag, e)))
                        .collect(),
                };
                let is_indexed = |e: &data::BlendEntry| matches!(data::CorpusSource::parse(&e.path), data::CorpusSource::Indexed(_));
                match flagged.iter().find(|(_, e)| !is_indexed(e)) {
                    None => Ok(()),
                    Some((flag, text)) => bail!(
                        "--data-impl reads Megatron's indexed dataset, and {flag}'s {} is not the PREFIX of a PREFIX.bin and PREFIX.idx pair: give that prefix, or drop --data-impl for text",
                        text.path
                    ),
                }
            }
            Some(old @ ("lazy" | "cached")) => bail!(
                "--data-impl {old}: Megatron's older {old} format is not read; write the corpus with preprocess_data.py's default (mmap)"
            ),
            Some(other) => bail!("--data-impl {other}: the choices are mmap and infer"),
        }
    }
}

/// What a schedule counts: iterations, or samples (`--train-samples`).
#[derive(Clone, Copy)]
enum WarmupUnit {
    Iterations,
    Samples,
}

/// Megatron's `--lr-warmup-fraction`: that fraction of the decay's `decay` iterations or
/// samples, which must come to a whole number here (Megatron warms up over a fractional count,
/// which this schedule does not represent).
fn warmup_of_fraction(fraction: f64, decay: u64, unit: WarmupUnit) -> Result<u64> {
    let (name, flag) = match unit {
        WarmupUnit::Iterations => ("iterations", "--lr-warmup-iters"),
        WarmupUnit::Samples => ("samples", "--lr-warmup-samples"),
    };
    let count = fraction * decay as f64;
    let whole = count.round();
    if (count - whole).abs() > 1e-6 * whole.max(1.0) {
        bail!(
            "--lr-warmup-fraction {fraction} of {decay} decay {name} is {count} {name}, and the warm-up here is a whole number: give {flag} {whole}, or a fraction that makes a whole number"
        );
    }
    Ok(whole as u64)
}

/// A preset name or a config.json path.
fn model_config(name: &str) -> Result<Gpt2Config> {
    if let Some(cfg) = Gpt2Config::from_preset(name) {
        return Ok(cfg);
    }
    let path = std::path::Path::new(name);
    let file = if path.is_dir() { path.join("config.json") } else { path.to_path_buf() };
    if file.is_file() {
        return hybrid_engine::checkpoints::hf_io::read_config(&file);
    }
    bail!("--model {name:?} is neither a preset ({}) nor a config.json", Gpt2Config::PRESETS)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Megatron's `--fp16`, `--bf16` and `--initial-loss-scale` take effect as `--dtype` and
    /// `--initial-scale-power`; fp16 starts from Megatron's scaler defaults unless a flag says
    /// otherwise; conflicting or impossible values are one error each.
    #[test]
    fn megatrons_precision_flags_fold_into_the_engines() {
        let fold = |extra: &[&str]| -> Result<PretrainArgs> {
            let mut a = PretrainArgs::try_parse_from(["sft", "--from-scratch"].iter().chain(extra))?;
            a.fold_megatron_flags()?;
            Ok(a)
        };
        let scaling = |a: &PretrainArgs| (a.precision.dtype, a.precision.loss_scaling());
        let megatron = MEGATRON_LOSS_SCALING;
        assert_eq!(scaling(&fold(&["--fp16"]).unwrap()), (Dtype::Fp16, megatron));
        assert_eq!(scaling(&fold(&["--dtype", "fp16"]).unwrap()), (Dtype::Fp16, megatron));
        let tuned = fold(&["--fp16", "--initial-loss-scale", "65536", "--loss-scale-window", "4"]).unwrap();
        assert_eq!(scaling(&tuned), (Dtype::Fp16, LossScaling { initial_scale_power: 16, window: 4 }));
        let bf16 = fold(&["--bf16"]).unwrap();
        assert_eq!(bf16.precision.dtype, Dtype::Bf16);
        assert_eq!((bf16.precision.initial_scale_power, bf16.precision.loss_scale_window), (None, None));
        bf16.pretrain_config().expect("bf16 sets no loss-scale flag");
        assert_eq!(fold(&[]).unwrap().precision.dtype, Dtype::Fp32);
        for conflict in [&["--fp16", "--bf16"][..], &["--fp16", "--dtype", "bf16"], &["--bf16", "--dtype", "fp32"]] {
            assert!(fold(conflict).is_err(), "{conflict:?}");
        }
        let both = ["--fp16", "--initial-loss-scale", "1024", "--initial-scale-power", "10"];
        assert!(fold(&both).is_err());
        let err = |extra: &[&str]| fold(extra).unwrap_err().to_string();
        assert!(err(&["--fp16", "--initial-loss-scale", "1000"]).contains("a power of two from 1 to 2^32"));
        assert!(err(&["--fp16", "--initial-loss-scale", "0.5"]).contains("a power of two from 1 to 2^32"));
        assert!(err(&["--bf16", "--initial-loss-scale", "1024"]).contains("the dtype is bf16: add --fp16"));
    }

    /// Megatron's full recompute of each layer is `--checkpoint-activations`, spelled as
    /// Megatron requires it (uniform groups of 1, or block over every layer); selective
    /// recompute, groups of several layers, a block short of the model, and the method or the
    /// count without the granularity are one line each.
    #[test]
    fn megatrons_full_recompute_is_checkpointing_each_layer() {
        let fold = |extra: &str| -> Result<PretrainArgs> {
            let argv = ["sft", "--from-scratch"].into_iter().chain(extra.split_whitespace());
            let mut a = PretrainArgs::try_parse_from(argv)?;
            a.fold_megatron_flags()?;
            Ok(a)
        };
        assert!(!fold("").unwrap().checkpoint_activations);
        assert!(fold("--checkpoint-activations").unwrap().checkpoint_activations);
        let uniform = fold("--recompute-granularity full --recompute-method uniform --recompute-num-layers 1").unwrap();
        assert!(uniform.checkpoint_activations);
        uniform.check_recompute_layers(12).unwrap();
        let block = fold("--recompute_granularity full --recompute_method block --recompute_num_layers 12").unwrap();
        assert!(block.checkpoint_activations);
        block.check_recompute_layers(12).unwrap();
        let err = block.check_recompute_layers(24).unwrap_err().to_string();
        assert!(
            err.contains("only the first 12 of the model's 24 layers") && err.contains("--recompute-num-layers 24")
        );
        let err = |extra: &str| fold(extra).unwrap_err().to_string();
        for selective in ["--recompute-activations", "--recompute-granularity selective"] {
            assert!(
                err(selective).contains("selective recompute") && err(selective).contains("--recompute-num-layers 1")
            );
        }
        let with_full =
            "--recompute-activations --recompute-granularity full --recompute-method uniform --recompute-num-layers 1";
        assert!(err(with_full).contains("selective recompute"), "Megatron's --recompute-activations wins");
        for incomplete in [
            "--recompute-granularity full",
            "--recompute-granularity full --recompute-method uniform",
            "--recompute-granularity full --recompute-num-layers 1",
        ] {
            assert!(err(incomplete).contains("needs --recompute-method"), "{incomplete}");
        }
        assert!(err("--recompute-granularity full --recompute-method uniform --recompute-num-layers 2")
            .contains("groups of 2 layers"));
        for alone in ["--recompute-method uniform", "--recompute-num-layers 1"] {
            assert!(err(alone).contains("add it"), "{alone}");
        }
        assert!(fold("--recompute-granularity partial").is_err(), "clap's choices");
    }

    /// Megatron's `--no-load-optim` and `--no-load-rng` go with `--finetune`, which loads neither
    /// (as Megatron's); without it, a resume restores both, so they are one line.
    #[test]
    fn no_load_optim_and_rng_go_with_finetune() {
        let config = |extra: &str| {
            let argv = ["sft", "--from-scratch", "--load", "ckpt"].into_iter().chain(extra.split_whitespace());
            PretrainArgs::try_parse_from(argv).unwrap().pretrain_config()
        };
        config("--finetune --no-load-optim --no-load-rng").unwrap();
        config("--no_load_optim --no_load_rng --finetune").unwrap();
        for flag in ["--no-load-optim", "--no-load-rng"] {
            let err = config(flag).err().unwrap().to_string();
            assert!(err.starts_with(&format!("{flag} without --finetune")) && err.contains("add --finetune"), "{err}");
        }
    }

    /// A `--train-samples` run's rates, update by update, against megatron-core 0.9.0's own
    /// `OptimizerParamScheduler` stepped by the global batch as Megatron's `train_step` steps it
    /// (`scripts/fixtures/megatron_sample_schedule.py`): a global batch of 8, 100 samples (12
    /// updates), a decay over 90 samples to 0.1, a warm-up of 20 samples or of 0.1 of the decay.
    #[test]
    fn sample_based_schedules_are_megatrons_update_by_update() {
        #[rustfmt::skip]
        let megatron: [(&str, &str, [f64; 12]); 4] = [
            ("linear", "samples", [0.0, 0.4, 0.8, 0.9485714285714285, 0.8457142857142856, 0.7428571428571429, 0.64, 0.5371428571428573, 0.4342857142857143, 0.3314285714285714, 0.22857142857142862, 0.12571428571428572]),
            ("linear", "fraction", [0.0, 0.8888888888888888, 0.9222222222222223, 0.8333333333333334, 0.7444444444444445, 0.6555555555555557, 0.5666666666666668, 0.47777777777777775, 0.38888888888888884, 0.3, 0.2111111111111111, 0.12222222222222223]),
            ("cosine", "samples", [0.0, 0.4, 0.8, 0.9927683148693833, 0.9363019571208397, 0.8305704108364301, 0.6890576474687263, 0.5298108263422685, 0.3731387357557344, 0.2390218079559109, 0.14456400944391146, 0.10181156770214242]),
            ("cosine", "fraction", [0.0, 0.8888888888888888, 0.9835168953771461, 0.9259695151358214, 0.8325154561024444, 0.7120799761621197, 0.5761651730097141, 0.4377514851739085, 0.31005800523923904, 0.20528000059645996, 0.13342421382899936, 0.1013531764744936]),
        ];
        for (style, warmup, want) in megatron {
            let warmup =
                if warmup == "samples" { ["--lr-warmup-samples", "20"] } else { ["--lr-warmup-fraction", "0.1"] };
            let flags = ["--train-samples", "100", "--lr-decay-samples", "90", "--lr", "1", "--min-lr", "0.1"];
            let mut args = PretrainArgs::parse_from(
                [&["sft", "--from-scratch", "--lr-decay-style", style][..], &flags, &warmup].concat(),
            );
            let line = args.count_in_samples(8).unwrap().unwrap();
            assert_eq!(line, "--train-samples 100: 12 iterations of 8 samples (the last 4 dropped, as Megatron does); the learning rate counts samples");
            assert_eq!(args.train_iters, 12);
            let schedule = args.pretrain_config().unwrap().schedule;
            for (done, w) in want.iter().enumerate() {
                let got = schedule.lr(done as u64);
                assert!(
                    (got - w).abs() <= 1e-15,
                    "{style} {warmup:?}, update {}: {got} where Megatron gives {w}",
                    done + 1
                );
            }
        }
        // Without --train-samples nothing changes; a batch larger than the samples is refused.
        let mut iterations = PretrainArgs::parse_from(["sft", "--from-scratch", "--train-iters", "7"]);
        assert_eq!(iterations.count_in_samples(8).unwrap(), None);
        assert_eq!((iterations.train_iters, iterations.schedule().unwrap().samples_per_iteration), (7, 1));
        let mut few = PretrainArgs::parse_from(["sft", "--from-scratch", "--train-samples", "7"]);
        let err = few.count_in_samples(8).err().unwrap().to_string();
        assert!(err.contains("--train-samples 7 is less than one global batch of 8 samples"), "{err}");
        let mut exact = PretrainArgs::parse_from(["sft", "--from-scratch", "--train-samples", "16"]);
        assert_eq!(
            exact.count_in_samples(8).unwrap().unwrap(),
            "--train-samples 16: 2 iterations of 8 samples; the learning rate counts samples"
        );
        let schedule = exact.schedule().unwrap();
        assert_eq!(
            (schedule.warmup_iters, schedule.decay_iters),
            (0, 16),
            "Megatron's defaults: no warm-up, decay over the run"
        );

        let config =
            |more: &[&str]| PretrainArgs::parse_from([&["sft", "--from-scratch"][..], more].concat()).pretrain_config();
        let err = config(&["--train-samples", "100", "--lr-warmup-fraction", "0.15", "--lr-decay-samples", "90"])
            .err()
            .unwrap()
            .to_string();
        assert!(
            err.contains("0.15 of 90 decay samples is 13.5 samples") && err.contains("--lr-warmup-samples 14"),
            "{err}"
        );
        let err = config(&["--rampup-batch-size", "16", "16", "1000"]).err().unwrap().to_string();
        assert!(err.contains("--rampup-batch-size 16 16 1000: the global batch is fixed"), "{err}");
        let err = config(&["--train-samples", "100", "--lr-decay-samples", "90", "--lr-decay-style", "constant"])
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("constant has none"), "{err}");
        assert!(config(&["--train-samples", "0"])
            .err()
            .unwrap()
            .to_string()
            .contains("--train-samples must be at least 1"));
        for mixed in [
            &["sft", "--train-samples", "100", "--train-iters", "5"][..],
            &["sft", "--train-samples", "100", "--lr-decay-iters", "5"],
            &["sft", "--train-samples", "100", "--lr-warmup-iters", "5"],
            &["sft", "--lr-decay-samples", "5"],
            &["sft", "--lr-warmup-samples", "5"],
            &["sft", "--train-samples", "100", "--lr-warmup-samples", "5", "--lr-warmup-fraction", "0.1"],
        ] {
            assert!(PretrainArgs::try_parse_from(mixed).is_err(), "{mixed:?}: samples and iterations do not mix");
        }
    }

    #[test]
    fn megatrons_data_and_schedule_flags_take_effect_or_are_refused() {
        let parse = |more: &[&str]| PretrainArgs::parse_from([&["sft", "--from-scratch"][..], more].concat());
        let config = |more: &[&str]| parse(more).pretrain_config();
        // 1% of 500 decay iterations: 5, as Megatron's lr_warmup_steps.
        let warmup = |more: &[&str]| config(more).unwrap().schedule.warmup_iters;
        assert_eq!(warmup(&["--train-iters", "500", "--lr-warmup-fraction", ".01"]), 5);
        assert_eq!(warmup(&["--train-iters", "50", "--lr-decay-iters", "300", "--lr-warmup-fraction", "0.1"]), 30);
        assert_eq!(warmup(&["--lr-warmup-fraction", "0"]), 0);
        assert_eq!(warmup(&["--lr-warmup-iters", "7"]), 7);
        let err = config(&["--train-iters", "123", "--lr-warmup-fraction", ".01"]).err().unwrap().to_string();
        assert!(err.contains("1.23 iterations") && err.contains("--lr-warmup-iters 1"), "{err}");
        let both = PretrainArgs::try_parse_from(["sft", "--lr-warmup-fraction", ".1", "--lr-warmup-iters", "3"]);
        assert!(both.is_err(), "one warm-up flag or the other");

        let fixture = concat!(env!("CARGO_MANIFEST_DIR"), "/../../data/tests/fixtures/megatron/");
        let indexed = format!("{fixture}corpus_text_document");
        let jsonl = format!("{fixture}corpus.jsonl");
        for imp in ["mmap", "infer"] {
            assert!(config(&["--data-path", &indexed, "--data-impl", imp]).is_ok(), "{imp}");
            let err = config(&["--data-path", &jsonl, "--data-impl", imp]).err().unwrap().to_string();
            assert!(err.contains("is not the PREFIX of a PREFIX.bin and PREFIX.idx pair"), "{err}");
        }
        for (imp, want) in [
            ("lazy", "older lazy format"),
            ("cached", "older cached format"),
            ("mmaps", "the choices are mmap and infer"),
        ] {
            let err = config(&["--data-path", &indexed, "--data-impl", imp]).err().unwrap().to_string();
            assert!(err.contains(want), "{err}");
        }

        let dropouts = |more: &[&str]| {
            let m = config(more).unwrap().model;
            (m.embd_pdrop, m.resid_pdrop, m.attn_pdrop)
        };
        assert_eq!(dropouts(&[]), (0.1, 0.1, 0.1));
        assert_eq!(dropouts(&["--dropout", "0.2"]), (0.2, 0.2, 0.2));
        assert_eq!(dropouts(&["--hidden-dropout", "0.3"]), (0.3, 0.3, 0.1));
        assert_eq!(dropouts(&["--attention-dropout", "0", "--hidden-dropout", "0.05"]), (0.05, 0.05, 0.0));
        assert!(PretrainArgs::try_parse_from(["sft", "--dropout", "0.1", "--hidden-dropout", "0.1"]).is_err());
        let mut distributed = parse(&["--use-distributed-optimizer"]);
        distributed.fold_megatron_flags().unwrap();
        assert_eq!(distributed.zero_stage, 1, "Megatron's distributed optimizer is ZeRO stage 1");
        assert!(PretrainArgs::try_parse_from(["sft", "--use-distributed-optimizer", "--zero-stage", "2"]).is_err());
        assert_eq!(config(&[]).unwrap().model.initializer_range, 0.02);
        assert_eq!(config(&["--init-method-std", "0.006"]).unwrap().model.initializer_range, 0.006);
        assert!(config(&["--pipeline-model-parallel-size", "1"]).is_ok());
        let err = config(&["--pipeline-model-parallel-size", "2"]).err().unwrap().to_string();
        assert!(err.contains("pipeline parallelism is not implemented"), "{err}");
        assert!(PretrainArgs::try_parse_from(["sft", "--exit-on-missing-checkpoint"]).is_err(), "only with --load");

        // Megatron's blends: weights and corpora, or corpora alone; --data-impl wants each indexed.
        let blend = parse(&["--data-path", "0.3", &indexed, "0.7", &jsonl]);
        let data::BlendPlan::Split { entries, .. } = blend.blend_plan().unwrap() else { panic!("--data-path splits") };
        let weights: Vec<Option<f64>> = entries.iter().map(|e| e.weight).collect();
        assert_eq!(weights, [Some(0.3), Some(0.7)]);
        assert_eq!(blend.data_path_text().unwrap(), format!("0.3 {indexed} 0.7 {jsonl}"));
        assert_eq!(parse(&["--data-path", "1", &indexed]).data_path_text().unwrap(), indexed, "a blend of one");
        assert!(config(&["--data-path", &indexed, &jsonl]).is_ok());
        assert!(config(&["--data-path", "0.3", &indexed, "0.7", &indexed, "--data-impl", "mmap"]).is_ok());
        let err = config(&["--data-path", &indexed, &jsonl, "--data-impl", "mmap"]).err().unwrap().to_string();
        assert!(err.contains(&format!("--data-path's {jsonl} is not the PREFIX")), "{err}");
        let err = config(&["--data-path", "0.3", &indexed, "0.7"]).err().unwrap().to_string();
        assert!(err.contains("not weights and corpora in pairs"), "{err}");
        // Each split its own corpora (Megatron's --train-data-path and the others).
        let per_split = parse(&["--train-data-path", "0.5", &indexed, "0.5", &jsonl, "--test-data-path", &indexed]);
        let data::BlendPlan::PerSplit([train, valid, test]) = per_split.blend_plan().unwrap() else {
            panic!("per split")
        };
        assert_eq!((train.len(), valid.len(), test.len()), (2, 0, 1));
        assert_eq!(
            per_split.data_path_text().unwrap(),
            format!("--train-data-path 0.5 {indexed} 0.5 {jsonl} --test-data-path {indexed}")
        );
        let err = config(&["--train-data-path", &indexed, "--valid-data-path", &jsonl, "--data-impl", "mmap"]);
        assert!(err.err().unwrap().to_string().contains(&format!("--valid-data-path's {jsonl} is not the PREFIX")));

        assert!(config(&["--tokenizer-type", "GPT2BPETokenizer"]).is_ok());
        let err = config(&["--tokenizer-type", "SentencePieceTokenizer"]).err().unwrap().to_string();
        assert!(err.contains("--tokenizer-type SentencePieceTokenizer") && err.contains("GPT2BPETokenizer"), "{err}");
        for alone in [&["sft", "--vocab-file", "v.json"][..], &["sft", "--merge-file", "m.txt"]] {
            assert!(PretrainArgs::try_parse_from(alone).is_err(), "{alone:?}: both files or neither");
        }
        let with_json = ["sft", "--tokenizer", "t.json", "--vocab-file", "v.json", "--merge-file", "m.txt"];
        assert!(PretrainArgs::try_parse_from(with_json).is_err(), "a tokenizer.json or the BPE files");
        // The files themselves are read (and checked) by `tokenizer()`.
        let missing = parse(&["--vocab-file", "/nonexistent/v.json", "--merge-file", "m.txt"]).tokenizer();
        assert!(missing.unwrap_err().to_string().contains("cannot read --vocab-file /nonexistent/v.json"));
    }

    #[test]
    fn the_global_batch_size_sets_the_accumulation_per_world_size_or_is_refused() {
        let parse = |extra: &[&str]| {
            PretrainArgs::try_parse_from(["sft", "--from-scratch", "--micro-batch-size", "3"].iter().chain(extra))
        };
        let a = parse(&["--global-batch-size", "12"]).unwrap();
        assert_eq!((a.gradient_accumulation(1).unwrap(), a.gradient_accumulation(2).unwrap()), (4, 2));
        let err = a.gradient_accumulation(3).unwrap_err().to_string();
        assert!(err.contains("not a positive multiple of --micro-batch-size 3 x 3 data-parallel ranks = 9"), "{err}");
        assert_eq!(parse(&[]).unwrap().gradient_accumulation(4).unwrap(), 1, "without it, the flag's accumulation");
        assert!(parse(&["--global-batch-size", "12", "--gradient-accumulation-steps", "2"]).is_err());
    }
}
