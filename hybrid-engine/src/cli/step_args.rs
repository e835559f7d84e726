//! The training flags DS-Chat's step 1 and step 2 share (their `main.py` parsers), in kebab-case
//! with the snake_case spelling accepted, and their validation into the optimizer, the schedule
//! and LoRA (`--lora-dim`, `--lora-module-name`, `--only-optimize-lora`, `--lora-learning-rate`,
//! plus PEFT's `--lora-alpha`).
//! Each step flattens these into its own flags and supplies its own learning-rate default
//! (DS-Chat: 1e-3 in step 1, 5e-5 in step 2).

use crate::cli::heading;
use crate::cli::precision_args::PrecisionArgs;
use crate::comm::ProcessGroup;
use crate::engine::epochs::EpochPlan;
use crate::engine::EngineConfig;
use crate::model::gpt2::Gpt2Config;
use crate::model::params::ParamStore;
use crate::training::optim::AdamWConfig;
use crate::training::schedule::{HfScheduler, LrSchedule};
use crate::training::tensor_parallel::TensorParallel;
use crate::training::zero3::{Beside, ShardedModel};
use anyhow::{bail, Result};
use candle_core::{Device, Tensor};
use clap::Args;
use lora::peft::PeftAdapter;
use lora::LoraConfig;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// Where a step saves the LoRA adapter alone, inside its output directory.
pub const ADAPTER_DIR: &str = "adapter";

#[derive(Args, Debug, Clone)]
pub struct StepArgs {
    /// Starting model: a GPT-2 size (gpt2, gpt2-medium, gpt2-large, gpt2-xl: the hub's pretrained
    /// checkpoint, openai-community/<size>), a Hugging Face model directory or hub id, or random
    /// weights: random:<size> (also random:tiny), or tiny (the demo's size, never pretrained).
    #[arg(help_heading = heading::MODEL, long, default_value = "tiny", alias = "model_name_or_path")]
    pub model_name_or_path: String,
    /// Rows per training micro-batch on each rank: the global batch is this x data-parallel
    /// ranks x --gradient-accumulation-steps.
    #[arg(help_heading = heading::TRAINING, long, default_value_t = 16, alias = "per_device_train_batch_size")]
    pub per_device_train_batch_size: usize,
    /// Rows per evaluation batch on each rank.
    #[arg(help_heading = heading::TRAINING, long, default_value_t = 16, alias = "per_device_eval_batch_size")]
    pub per_device_eval_batch_size: usize,
    /// Tokens per sequence (prompt + answer + EOS); longer rows are truncated.
    #[arg(help_heading = heading::DATA, long, default_value_t = 512, alias = "max_seq_len")]
    pub max_seq_len: usize,
    /// Peak learning rate (default: 1e-3 in step 1, 5e-5 in step 2, as DS-Chat).
    #[arg(help_heading = heading::OPTIMIZER, long, alias = "learning_rate", alias = "lr", value_parser = crate::cli::positive())]
    pub learning_rate: Option<f64>,
    /// AdamW's decoupled weight decay (biases and LayerNorms never decay, as DS-Chat's
    /// parameter groups).
    #[arg(help_heading = heading::OPTIMIZER, long, default_value_t = 0.0, alias = "weight_decay", value_parser = crate::cli::non_negative())]
    pub weight_decay: f64,
    /// AdamW's epsilon (HF's adam_epsilon; DS-Chat's DeepSpeed default 1e-8).
    #[arg(help_heading = heading::OPTIMIZER, long, default_value_t = 1e-8, alias = "adam_eps", alias = "adam-epsilon", alias = "adam_epsilon", value_parser = crate::cli::positive())]
    pub adam_eps: f64,
    /// Passes over the training rows.
    #[arg(help_heading = heading::TRAINING, long, default_value_t = 1, alias = "num_train_epochs")]
    pub num_train_epochs: usize,
    /// Micro-batches whose gradients are summed before each optimizer step.
    #[arg(help_heading = heading::TRAINING, long, default_value_t = 1, alias = "gradient_accumulation_steps")]
    pub gradient_accumulation_steps: usize,
    /// HF's scheduler types: linear, cosine, cosine_with_restarts, polynomial, constant (no
    /// warmup) or constant_with_warmup; the decays end at 0 (polynomial at 1e-7), as HF's do.
    #[arg(help_heading = heading::OPTIMIZER, long, default_value = "cosine", alias = "lr_scheduler_type")]
    pub lr_scheduler_type: HfScheduler,
    /// Optimizer steps of linear warm-up from 0 to the learning rate.
    #[arg(help_heading = heading::OPTIMIZER, long, default_value_t = 0, alias = "num_warmup_steps")]
    pub num_warmup_steps: u64,
    /// Seed of the data order and splits, the initialisation and dropout (DS-Chat's 1234).
    #[arg(help_heading = heading::TRAINING, long, default_value_t = 1234)]
    pub seed: u64,
    /// Dropout of embeddings, attention and residuals (default: the model config's).
    #[arg(help_heading = heading::MODEL, long, value_parser = crate::cli::dropout())]
    pub dropout: Option<f64>,
    /// Dropout off (earlier DS-Chat's `--disable_dropout`): `--dropout 0`.
    #[arg(help_heading = heading::MODEL, long, alias = "disable_dropout", conflicts_with = "dropout")]
    pub disable_dropout: bool,
    /// Recompute each block's activations in backward instead of storing them.
    #[arg(help_heading = heading::MODEL, long, alias = "gradient_checkpointing")]
    pub gradient_checkpointing: bool,
    /// Clip gradients to this global norm (DS-Chat's DeepSpeed config: 1.0; 0 disables).
    #[arg(help_heading = heading::OPTIMIZER, long, default_value_t = 1.0, alias = "gradient_clipping", value_parser = crate::cli::non_negative())]
    pub gradient_clipping: f64,
    /// ZeRO stage: 0 (gradients all-reduced), 1 (+ optimizer state sharded), 2 (+ gradients
    /// sharded), 3 (+ weights sharded at rest; step 1 only). With one process there is nothing to shard and every stage trains alike.
    #[arg(help_heading = heading::PARALLELISM, long, default_value_t = 0, alias = "zero_stage")]
    pub zero_stage: u8,
    #[command(flatten)]
    pub dist: crate::cli::dist_args::DistArgs,
    #[command(flatten)]
    pub log: crate::cli::log_args::LogArgs,
    /// Print a log line every this many optimizer steps.
    #[arg(help_heading = heading::LOGGING, long, default_value_t = 10, alias = "log_interval")]
    pub log_interval: u64,
    /// Every rank prints each micro-batch's loss, as DS-Chat's `--print_loss`
    /// ("Epoch: e, Step: s, Rank: r, loss = l").
    #[arg(help_heading = heading::LOGGING, long, alias = "print_loss")]
    pub print_loss: bool,
    /// auto (CUDA device 0 when built with --features cuda and a GPU opens, else the CPU), cpu,
    /// cuda or cuda:N.
    #[arg(help_heading = heading::PRECISION, long, default_value = "auto", env = crate::device::DEVICE_ENV)]
    pub device: String,
    #[command(flatten)]
    pub precision: PrecisionArgs,
    /// LoRA rank r on the linears --lora-module-name selects (0: no LoRA). The saved model has
    /// the adapters merged; with --only-optimize-lora they are also saved alone, in PEFT's
    /// layout, to <output-dir>/adapter. The other LoRA flags need it.
    #[arg(help_heading = heading::LORA, long, default_value_t = 0, alias = "lora_dim")]
    pub lora_dim: usize,
    /// LoRA goes on the linears whose names (h.0.attn.c_attn, h.0.mlp.c_fc, ...) contain this:
    /// h. selects every block, attn the attention only.
    #[arg(help_heading = heading::LORA, long, default_value = DEFAULT_LORA_MODULES, alias = "lora_module_name", requires = "lora_dim")]
    pub lora_module_name: String,
    /// PEFT's lora_alpha: scaling alpha/r instead of DS-Chat's 1/r.
    #[arg(help_heading = heading::LORA, long, alias = "lora_alpha", value_parser = crate::cli::positive(), requires = "lora_dim")]
    pub lora_alpha: Option<f64>,
    /// Train only the LoRA adapters (and a reward model's score head); the trunk stays frozen.
    #[arg(help_heading = heading::LORA, long, alias = "only_optimize_lora")]
    pub only_optimize_lora: bool,
    /// Learning rate of the LoRA adapters' parameter group, scheduled like --learning-rate.
    #[arg(help_heading = heading::LORA, long, default_value_t = DEFAULT_LORA_LEARNING_RATE, alias = "lora_learning_rate", value_parser = crate::cli::positive(), requires = "lora_dim")]
    pub lora_learning_rate: f64,
}

impl StepArgs {
    /// Checks what parsing cannot: flags that depend on each other, and `lr`, the step's resolved
    /// learning rate (its default is the step's). Float ranges are checked while parsing.
    pub fn validate(&self, lr: f64) -> Result<()> {
        let positive = [
            ("--per-device-train-batch-size", self.per_device_train_batch_size),
            ("--per-device-eval-batch-size", self.per_device_eval_batch_size),
            ("--max-seq-len", self.max_seq_len),
            ("--num-train-epochs", self.num_train_epochs),
            ("--gradient-accumulation-steps", self.gradient_accumulation_steps),
            ("--log-interval", self.log_interval as usize),
        ];
        for (flag, v) in positive {
            if v == 0 {
                bail!("{flag} must be at least 1");
            }
        }
        if !(lr > 0.0 && lr.is_finite()) {
            bail!("--learning-rate must be a positive number (got {lr})");
        }
        if self.zero_stage > 3 {
            bail!("--zero-stage {} does not exist: use 0, 1, 2 or 3", self.zero_stage);
        }
        if self.lr_scheduler_type == HfScheduler::Constant && self.num_warmup_steps > 0 {
            bail!("--num-warmup-steps warms up the learning rate, and --lr-scheduler-type constant has no warm-up: use constant_with_warmup, or drop --num-warmup-steps");
        }
        self.precision.validate()?;
        self.log.validate()?;
        if let Some(lora) = self.lora() {
            lora.validate()?;
        } else if self.only_optimize_lora {
            bail!("--only-optimize-lora trains only LoRA adapters, but --lora-dim is 0: add --lora-dim (e.g. 8)");
        } else if self.lora_alpha.is_some() {
            bail!(
                "--lora-alpha scales LoRA adapters, but --lora-dim is 0: add --lora-dim (e.g. 8) or drop --lora-alpha"
            );
        } else if let Some(flag) = lora_flag_set(&self.lora_module_name, self.lora_learning_rate, "") {
            bail!("{flag} sets LoRA adapters, but --lora-dim is 0 (none): add --lora-dim (e.g. 8) or drop {flag}");
        }
        crate::device::check_device(&self.device)?;
        Ok(())
    }

    /// DS-Chat's optimizer: AdamW, betas (0.9, 0.95), no decay on biases and LayerNorm.
    pub fn adam(&self) -> AdamWConfig {
        AdamWConfig::ds_chat(self.adam_eps, self.weight_decay)
    }

    /// Warmup then decay over `total_steps` optimizer steps (HF `get_scheduler`).
    pub fn schedule(&self, lr: f64, total_steps: u64) -> LrSchedule {
        self.lr_scheduler_type.schedule(lr, self.num_warmup_steps, total_steps)
    }

    /// How a fine-tuning step's model trains at peak learning rate `lr` for `steps` optimizer
    /// steps over the data-parallel `group` (at `--zero-stage`, said in a line).
    pub fn engine_config(&self, lr: f64, steps: u64, group: &ProcessGroup) -> Result<EngineConfig> {
        Ok(EngineConfig {
            optimizer: self.adam(),
            schedule: self.schedule(lr, steps),
            gradient_accumulation_steps: self.gradient_accumulation_steps,
            gradient_clipping: self.gradient_clipping,
            precision: self.precision.precision(),
            loss_scaling: self.precision.loss_scaling(),
            lora_learning_rate: Some(self.lora_learning_rate),
            checkpoint_activations: self.gradient_checkpointing,
            parallel: self.dist.parallel_config(group, self.zero_stage, "")?,
        })
    }

    /// Whether the step builds its model sharded (ZeRO stage 3 across the `world` data-parallel
    /// ranks, without tensor parallelism): then no rank ever holds the whole model (LoRA
    /// adapters, drawn whole, are cut too: [`Self::beside_trunk`]).
    pub fn builds_sharded(&self, world: usize, tensor_parallel: bool) -> bool {
        self.zero_stage == 3 && world > 1 && !tensor_parallel
    }

    /// LoRA as the flags ask, said in a line: on `params` (a whole model, or under `sliced` this
    /// TP rank's slices), or for a model built sharded (`sharded`), beside its trunk after
    /// `heads` ([`Self::beside_trunk`]). Returns what the sharded model holds beside its trunk
    /// (nothing otherwise).
    pub fn add_lora(
        &self,
        sharded: bool,
        params: &mut ParamStore,
        heads: Vec<(String, Tensor)>,
        cfg: &Gpt2Config,
        sliced: Option<&TensorParallel>,
        device: &Device,
    ) -> Result<Beside> {
        if sharded {
            return self.beside_trunk(heads, cfg, device);
        }
        if let Some(line) = self.apply_lora(params, cfg, sliced)? {
            println!("{line}");
        }
        Ok(Beside::default())
    }

    /// What a model built sharded holds beside its trunk: `heads`, then the LoRA adapters the
    /// flags ask for, drawn whole as one rank draws them (small: r x (in + out) a linear), with
    /// `--only-optimize-lora` the trunk frozen. Says what LoRA does in a line.
    pub fn beside_trunk(&self, heads: Vec<(String, Tensor)>, cfg: &Gpt2Config, device: &Device) -> Result<Beside> {
        let Some(lora) = self.lora() else { return Ok(Beside::heads(heads)) };
        let (targets, adapters) = crate::model::params::lora_adapters(cfg, &lora, self.seed, device)?;
        let beside = Beside::heads(heads).with_lora(adapters, lora.scaling(), self.only_optimize_lora);
        let total = crate::model::params::parameter_count(cfg) + beside.numel();
        let trainable = if self.only_optimize_lora { beside.numel() } else { total };
        println!("{}", self.lora_line(cfg, &targets, (trainable, total)));
        Ok(beside)
    }

    /// The line saying what LoRA does: its rank, linears, scaling and learning rate, and with
    /// `--only-optimize-lora` how many of the `(trainable, total)` parameters train.
    fn lora_line(&self, cfg: &Gpt2Config, targets: &[String], (trainable, total): (usize, usize)) -> String {
        let Some(lora) = self.lora() else { return String::new() };
        let added: usize = crate::model::params::linear_shapes(cfg)
            .iter()
            .filter(|(name, _, _)| targets.contains(name))
            .map(|(_, d_in, d_out)| lora.dim * (d_in + d_out))
            .sum();
        let scaling = match lora.alpha {
            Some(a) => format!("alpha/r = {a}/{}", lora.dim),
            None => format!("1/r = 1/{}", lora.dim),
        };
        let mut line = format!(
            "LoRA: rank {} on {} linears matching {:?} ({added} adapter parameters), scaling {scaling}, lr {:e}",
            lora.dim,
            targets.len(),
            lora.module_name,
            self.lora_learning_rate
        );
        if self.only_optimize_lora {
            line += &format!("; only LoRA is optimized: {trainable} of {total} parameters train");
        }
        line
    }

    /// `--model-name-or-path` as the step starts from it: whole ([`starting_model`]), with
    /// `sharded` without its trunk weights and where each rank reads its shard of them
    /// ([`starting_model_sharded`]), or with `sliced` this tensor-parallel rank's slices of them
    /// ([`starting_model_sliced`]). Says which in a line.
    pub fn starting_model(
        &self,
        sharded: bool,
        sliced: Option<&TensorParallel>,
        device: &Device,
    ) -> Result<(StartingModel, Option<ShardSource>)> {
        let (name, seed, dropout) = (&self.model_name_or_path, self.seed, self.dropout());
        let (start, source) = match (sharded, sliced) {
            (true, _) => starting_model_sharded(name, seed, dropout).map(|(start, source)| (start, Some(source)))?,
            (false, Some(tp)) => (starting_model_sliced(name, seed, dropout, tp, device)?, None),
            (false, None) => (starting_model(name, seed, dropout, device)?, None),
        };
        println!("starting model: {}", start.description);
        Ok((start, source))
    }

    /// The epoch loop of a step with `micro_per_epoch` global micro-batches an epoch and `steps`
    /// optimizer steps in all, its throughput counted in `unit`s, evaluating every
    /// `eval_interval` steps too (0: at the epochs' ends only), its rows split over `group`.
    pub fn epoch_plan<'a>(
        &self,
        (micro_per_epoch, steps): (usize, u64),
        unit: &'static str,
        eval_interval: u64,
        group: &'a ProcessGroup,
    ) -> EpochPlan<'a> {
        EpochPlan {
            epochs: self.num_train_epochs,
            micro_per_epoch,
            steps,
            seed: self.seed,
            log_interval: self.log_interval,
            unit,
            print_loss: self.print_loss,
            eval_interval,
            group,
        }
    }

    /// `--dropout`, or 0 with `--disable-dropout` (`None`: the model config's).
    pub fn dropout(&self) -> Option<f64> {
        if self.disable_dropout {
            Some(0.0)
        } else {
            self.dropout
        }
    }

    /// Opens `--device` (see [`crate::device::parse_device`]).
    pub fn device(&self) -> Result<Device> {
        crate::device::parse_device(&self.device)
    }

    /// The LoRA configuration, `None` when `--lora-dim` is 0.
    pub fn lora(&self) -> Option<LoraConfig> {
        (self.lora_dim > 0).then(|| LoraConfig {
            dim: self.lora_dim,
            alpha: self.lora_alpha,
            module_name: self.lora_module_name.clone(),
        })
    }

    /// Adds the LoRA adapters the flags ask for to `params` (after any head, so that freezing
    /// leaves the head trainable) and, with `--only-optimize-lora`, freezes the trunk. Returns a
    /// line describing what was done, `None` without LoRA.
    /// With `sliced`, `params` are a tensor-parallel rank's slices: the adapters are drawn whole
    /// (the one-rank draws) and cut as their linears are.
    pub fn apply_lora(
        &self,
        params: &mut ParamStore,
        cfg: &Gpt2Config,
        sliced: Option<&TensorParallel>,
    ) -> Result<Option<String>> {
        let Some(lora) = self.lora() else { return Ok(None) };
        let targets = params.add_lora_cut(cfg, &lora, self.seed, |name, whole| match sliced {
            Some(tp) => tp.cut(cfg, name, whole),
            None => Ok(whole.clone()),
        })?;
        if self.only_optimize_lora {
            params.freeze_trunk();
        }
        Ok(Some(self.lora_line(cfg, &targets, (params.trainable().numel(), params.numel()))))
    }

    /// The adapters alone, in PEFT's layout, when they are meaningful on their own: only with
    /// `--only-optimize-lora`, where the base they apply to is the unchanged starting model.
    /// `task_type` is PEFT's (`CAUSAL_LM`, `SEQ_CLS`); heads that trained are its
    /// `modules_to_save`.
    pub fn peft_adapter(&self, params: &ParamStore, task_type: &str) -> Option<PeftAdapter> {
        let lora = self.lora().filter(|_| self.only_optimize_lora)?;
        let mut adapter = PeftAdapter::new(&lora, &self.model_name_or_path, task_type, params.adapters());
        let trainable = params.trainable();
        adapter.modules_to_save = trainable
            .iter()
            .filter(|(n, _)| !lora::is_adapter_name(n))
            .map(|(n, v)| (n.to_string(), v.as_tensor().clone()))
            .collect();
        Some(adapter)
    }

    /// Saves the model `engine` trains as [`Self::save_step_model`] does, every rank of `group`
    /// together: a model sharded at rest (ZeRO-3 without TP) is gathered block by block and
    /// written by rank 0 as it arrives, LoRA adapters fused in, so no rank holds it whole (with
    /// `--only-optimize-lora`, the PEFT adapter's tensors, small, are gathered whole onto rank 0
    /// first); otherwise rank 0 gets the whole weights and saves them.
    pub fn save_engine_model(
        &self,
        what: &str,
        group: &ProcessGroup,
        dir: &Path,
        engine: &crate::engine::Engine,
        task_type: &str,
        write_extra: &dyn Fn(&Path) -> Result<()>,
    ) -> Result<()> {
        if let (Some(sharded), None) = (engine.sharded(), engine.tensor_parallel()) {
            let trained = match self.lora().is_some() && self.only_optimize_lora {
                true => sharded.gather_trained()?,
                false => None,
            };
            let adapter = trained.as_ref().and_then(|params| self.peft_adapter(params, task_type));
            crate::checkpoints::resume::save_sharded_model_dir(group, dir, &engine.config, sharded, None, &|d| {
                write_extra(d)?;
                match &adapter {
                    Some(a) => lora::peft::save_peft_adapter(&d.join(ADAPTER_DIR), a),
                    None => Ok(()),
                }
            })?;
            if group.is_first() {
                println!("saved the {what} to {} (written block by block from the ZeRO-3 shards)", dir.display());
                if adapter.is_some() {
                    println!("saved the LoRA adapter (PEFT layout) to {}", dir.join(ADAPTER_DIR).display());
                }
            }
            return Ok(());
        }
        let gathered = engine.gather_weights()?;
        if !group.is_first() {
            return Ok(());
        }
        self.save_step_model(what, dir, &engine.config, gathered.params(engine), task_type, write_extra)
    }

    /// Saves a step's model directory at `dir` atomically (LoRA merged) with its tokenizer
    /// (`write_tokenizer`), plus, with `--only-optimize-lora`, the PEFT adapter in
    /// `dir/adapter/`. Prints where they went (`what`: "fine-tuned model", "reward model").
    pub fn save_step_model(
        &self,
        what: &str,
        dir: &std::path::Path,
        config: &Gpt2Config,
        params: &ParamStore,
        task_type: &str,
        write_tokenizer: &dyn Fn(&std::path::Path) -> Result<()>,
    ) -> Result<()> {
        let adapter = self.peft_adapter(params, task_type);
        crate::checkpoints::resume::save_model_dir(dir, config, params, &|d| {
            write_tokenizer(d)?;
            match &adapter {
                Some(a) => lora::peft::save_peft_adapter(&d.join(ADAPTER_DIR), a),
                None => Ok(()),
            }
        })?;
        println!("saved the {what} to {}", dir.display());
        if adapter.is_some() {
            println!("saved the LoRA adapter (PEFT layout) to {}", dir.join(ADAPTER_DIR).display());
        }
        Ok(())
    }
}

/// A starting model: its config, trunk parameters and any head tensors its directory holds.
pub struct StartingModel {
    pub config: Gpt2Config,
    pub params: ParamStore,
    /// Tensors beyond the trunk (a reward model's `score.weight`), by HF name.
    pub extra: HashMap<String, Tensor>,
    /// The directory it was read from (`None` for random weights).
    pub dir: Option<PathBuf>,
    /// What it is, for the log: pretrained weights from where, or random ones of which size.
    pub description: String,
}

/// Asks for random weights of a preset size: `random:gpt2-medium`.
pub const RANDOM_PREFIX: &str = "random:";

/// Where a model name points.
#[derive(Debug, PartialEq)]
pub enum ModelSource {
    /// Random weights (HF's initialisation) of a preset size.
    Random(String),
    /// A Hugging Face directory or hub id.
    Files(String),
}

/// What `--model-name-or-path` (and `train --actor-model`) means, as in Hugging Face's
/// `from_pretrained`: a GPT-2 size name is the hub's pretrained checkpoint
/// (`gpt2-medium` -> `openai-community/gpt2-medium`) unless a directory of that name exists;
/// random weights only when asked for, as `random:<size>`, or `tiny`, the demo's size, of which
/// no pretrained checkpoint exists.
pub fn model_source(name: &str) -> Result<ModelSource> {
    let exists = Path::new(name).exists();
    if let Some(size) = name.strip_prefix(RANDOM_PREFIX) {
        if Gpt2Config::from_preset(size).is_none() {
            bail!("{name:?} asks for random weights of an unknown size {size:?}: use one of {}", Gpt2Config::PRESETS);
        }
        return Ok(ModelSource::Random(size.to_string()));
    }
    if name == "tiny" && !exists {
        return Ok(ModelSource::Random(name.to_string()));
    }
    match Gpt2Config::from_preset(name) {
        Some(_) if !exists => {
            let size = if name == "gpt2-small" { "gpt2" } else { name };
            Ok(ModelSource::Files(format!("openai-community/{size}")))
        }
        _ => Ok(ModelSource::Files(name.to_string())),
    }
}

/// `--model-name-or-path` as [`model_source`] reads it: random weights are initialised from
/// `seed` (HF's initialisation, the tokenizer's 50257-row vocabulary), anything else is read as a
/// HF directory or hub id. `dropout` overrides the config's three dropout probabilities (DS-Chat
/// `--dropout`).
pub fn starting_model(name_or_path: &str, seed: u64, dropout: Option<f64>, device: &Device) -> Result<StartingModel> {
    let (mut config, tensors, extra, dir, description) = match model_source(name_or_path)? {
        ModelSource::Random(size) => {
            let config = Gpt2Config::from_preset(&size).expect("model_source checked the size");
            (config, None, HashMap::new(), None, format!("random weights of size {size} (seed {seed})"))
        }
        ModelSource::Files(source) => {
            let dir = resolve_files(name_or_path, &source)?;
            let files = crate::checkpoints::hf_io::load_model_dir(&dir, device)?;
            let description = match source == name_or_path {
                true => format!("pretrained weights from {}", dir.display()),
                false => format!("pretrained weights of {source} ({})", dir.display()),
            };
            (files.config, Some(files.tensors), files.extra_tensors, Some(dir), description)
        }
    };
    if let Some(p) = dropout {
        (config.resid_pdrop, config.embd_pdrop, config.attn_pdrop) = (p, p, p);
    }
    let params = match tensors {
        Some(t) => ParamStore::from_tensors(&config, &t, device)?,
        None => ParamStore::init(&config, seed, device)?,
    };
    Ok(StartingModel { config, params, extra, dir, description })
}

/// [`starting_model`] for a tensor-parallel rank: its slices of the trunk, drawn from the seed
/// as one rank draws them, or read tensor by tensor from the memory-mapped directory (a rank
/// never holds more than its slices and one whole tensor); heads (`extra`) whole.
pub fn starting_model_sliced(
    name_or_path: &str,
    seed: u64,
    dropout: Option<f64>,
    tp: &TensorParallel,
    device: &Device,
) -> Result<StartingModel> {
    let (mut config, params, extra, dir, description) = match model_source(name_or_path)? {
        ModelSource::Random(size) => {
            let config = Gpt2Config::from_preset(&size).expect("model_source checked the size");
            let params = tp.init(&config, seed, device)?;
            let description = format!("random weights of size {size} (seed {seed}), drawn in TP slices");
            (config, params, HashMap::new(), None, description)
        }
        ModelSource::Files(source) => {
            let dir = resolve_files(name_or_path, &source)?;
            let slices = crate::checkpoints::sharded_io::ModelSlices::open(&dir)?;
            let params = tp.read(&slices.config, device, |n, r| slices.read(n, r))?;
            let mut extra = HashMap::new();
            for (name, t) in slices.heads()? {
                extra.insert(name, t.to_device(device)?);
            }
            let description = format!("pretrained weights from {}, read in TP slices", dir.display());
            (slices.config.clone(), params, extra, Some(dir), description)
        }
    };
    if let Some(p) = dropout {
        (config.resid_pdrop, config.embd_pdrop, config.attn_pdrop) = (p, p, p);
    }
    Ok(StartingModel { config, params, extra, dir, description })
}

/// The parameters a step's memory plan counts.
#[derive(Debug, PartialEq)]
pub struct ParameterCounts {
    /// Of the whole model, as [`crate::training::memory::MemoryPlan::with_parameters`] takes
    /// them: all of them and the trained ones.
    pub total: usize,
    pub trainable: usize,
    /// What this rank holds beyond the trunk (heads, LoRA adapters; under tensor parallelism its
    /// slices of them), as [`crate::training::memory::MemoryPlan::with_tensor_parallel`] takes it.
    pub held_beside: usize,
}

/// The parameters a step's memory plan counts: those of `params` (whole, or a rank's slices over
/// `tp` tensor-parallel ranks, counted whole), or for a model built sharded (`sharded`) its
/// trunk and what is `beside` it.
pub fn parameter_counts(
    sharded: bool,
    params: &ParamStore,
    beside: &Beside,
    cfg: &Gpt2Config,
    tp: usize,
) -> ParameterCounts {
    if !sharded {
        let whole = |store: &ParamStore| -> usize {
            store
                .iter()
                .map(|(name, v)| {
                    crate::tensor_parallel::shard::whole_numel(cfg.split_of(name), v.elem_count(), tp, cfg.vocab_size)
                })
                .sum()
        };
        let held_beside = crate::model::params::numel_beside_trunk(params.iter().map(|(n, v)| (n, v.elem_count())));
        return ParameterCounts { total: whole(params), trainable: whole(&params.trainable()), held_beside };
    }
    let total = crate::model::params::parameter_count(cfg) + beside.numel();
    let trainable = if beside.frozen_trunk { beside.numel() } else { total };
    ParameterCounts { total, trainable, held_beside: beside.numel() }
}

/// Where a model built sharded over the ranks (ZeRO stage 3) takes its trunk's values.
pub enum ShardSource {
    /// Drawn from the seed as one rank draws them.
    Drawn(u64),
    /// Read by slices from a model directory's memory-mapped files.
    Slices(Box<crate::checkpoints::sharded_io::ModelSlices>),
}

impl ShardSource {
    /// The model with `config`'s trunk and `beside` it (heads, LoRA adapters), sharded over
    /// `group`, gathered weights computing in `dtype`.
    pub fn build(
        &self,
        group: std::sync::Arc<crate::comm::ProcessGroup>,
        config: &Gpt2Config,
        beside: &Beside,
        dtype: candle_core::DType,
        device: &Device,
    ) -> Result<ShardedModel> {
        match self {
            Self::Drawn(seed) => ShardedModel::init(group, config, *seed, beside, dtype, device),
            Self::Slices(slices) => ShardedModel::read(group, config, |n, r| slices.read(n, r), beside, dtype, device),
        }
    }
}

/// [`starting_model`] for a model built sharded (ZeRO stage 3 across ranks, DeepSpeed's
/// `zero.Init`): its config, description and directory's head tensors, with no trunk weights
/// (`params` empty), and where each rank reads its shard of them.
pub fn starting_model_sharded(
    name_or_path: &str,
    seed: u64,
    dropout: Option<f64>,
) -> Result<(StartingModel, ShardSource)> {
    let (mut config, extra, dir, description, source) = match model_source(name_or_path)? {
        ModelSource::Random(size) => {
            let config = Gpt2Config::from_preset(&size).expect("model_source checked the size");
            let description = format!("random weights of size {size} (seed {seed}), drawn sharded");
            (config, HashMap::new(), None, description, ShardSource::Drawn(seed))
        }
        ModelSource::Files(source) => {
            let dir = resolve_files(name_or_path, &source)?;
            let slices = crate::checkpoints::sharded_io::ModelSlices::open(&dir)?;
            let description = format!("pretrained weights from {}, read by slices", dir.display());
            (slices.config.clone(), slices.heads()?, Some(dir), description, ShardSource::Slices(Box::new(slices)))
        }
    };
    if let Some(p) = dropout {
        (config.resid_pdrop, config.embd_pdrop, config.attn_pdrop) = (p, p, p);
    }
    Ok((StartingModel { config, params: ParamStore::default(), extra, dir, description }, source))
}

/// The model directory `source` (what `name_or_path` names) resolves to.
fn resolve_files(name_or_path: &str, source: &str) -> Result<PathBuf> {
    crate::checkpoints::hf_io::resolve_model_dir(source).map_err(|e| {
        anyhow::anyhow!(
            "--model-name-or-path {name_or_path:?}: {e:#} (or random weights: {RANDOM_PREFIX}<size>, sizes {})",
            Gpt2Config::PRESETS
        )
    })
}

/// Where LoRA adapters go by default: every linear of the blocks (`h.N.`).
pub const DEFAULT_LORA_MODULES: &str = "h.";
/// The adapters' learning rate by default (DS-Chat's).
pub const DEFAULT_LORA_LEARNING_RATE: f64 = 5e-4;

/// The LoRA flag (of `--{prefix}lora-...`) set away from its default, for a refusal where the
/// rank is 0: clap's `requires` accepts an explicit `--lora-dim 0`.
pub fn lora_flag_set(module_name: &str, learning_rate: f64, prefix: &str) -> Option<String> {
    if module_name != DEFAULT_LORA_MODULES {
        Some(format!("--{prefix}lora-module-name"))
    } else if learning_rate != DEFAULT_LORA_LEARNING_RATE {
        Some(format!("--{prefix}lora-learning-rate"))
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        step: StepArgs,
    }

    fn parse(args: &[&str]) -> StepArgs {
        Cli::try_parse_from(std::iter::once("step").chain(args.iter().copied())).expect("flags parse").step
    }

    /// The plan's counts are the whole model's, from a whole store and from a tensor-parallel
    /// rank's slices of it (the vocabulary's padding left out): all of them, and the adapters
    /// alone trained on a frozen trunk; what is held beside the trunk is the rank's own slices.
    #[test]
    fn parameter_counts_are_the_whole_models_from_a_tp_ranks_slices() -> Result<()> {
        use crate::tensor_parallel::shard::shard;
        let cfg = Gpt2Config::tiny();
        let mut whole = ParamStore::init(&cfg, 0, &Device::Cpu)?;
        whole.add_lora(&cfg, &lora::LoraConfig { dim: 2, alpha: None, module_name: "h.".into() }, 1)?;
        whole.freeze_trunk();
        let beside = Beside::heads(Vec::new());
        let counts = parameter_counts(false, &whole, &beside, &cfg, 1);
        // r (in + out) an adapter, on c_attn, attn.c_proj, c_fc and mlp.c_proj of 4 blocks.
        let adapters = 4 * 2 * ((128 + 384) + (128 + 128) + (128 + 512) + (512 + 128));
        assert_eq!(whole.trainable().numel(), adapters);
        let p = crate::model::params::parameter_count(&cfg);
        assert_eq!(counts, ParameterCounts { total: p + adapters, trainable: adapters, held_beside: adapters });
        let cut = whole.iter().map(|(name, v)| Ok((name.to_string(), shard(v.as_tensor(), cfg.split_of(name), 1, 2)?)));
        let mut slices = ParamStore::of_tensors(cut.collect::<Result<Vec<_>>>()?)?;
        slices.set_layout(whole.frozen(), whole.lora_scaling())?;
        // A rank's slices: the column-parallel linears' (c_attn, c_fc) A (r, in) whole and half of
        // B (out, r), the row-parallel ones' (the c_projs) half of A and B whole.
        let held = 4 * 2 * ((128 + 384 / 2) + (128 / 2 + 128) + (128 + 512 / 2) + (512 / 2 + 128));
        assert!(slices.numel() < whole.numel(), "the trunk cut too");
        assert_eq!(slices.trainable().numel(), held);
        let sliced = parameter_counts(false, &slices, &beside, &cfg, 2);
        assert_eq!(sliced, ParameterCounts { held_beside: held, ..counts });
        Ok(())
    }

    /// Size names are the hub's pretrained checkpoints, as `from_pretrained` reads them; random
    /// weights only when asked for.
    #[test]
    fn size_names_mean_pretrained_weights_and_random_ones_are_explicit() {
        let files = |s: &str| Ok::<_, anyhow::Error>(ModelSource::Files(s.into()));
        assert_eq!(model_source("gpt2").unwrap(), files("openai-community/gpt2").unwrap());
        assert_eq!(model_source("gpt2-small").unwrap(), files("openai-community/gpt2").unwrap());
        assert_eq!(model_source("gpt2-xl").unwrap(), files("openai-community/gpt2-xl").unwrap());
        assert_eq!(model_source("openai-community/gpt2-large").unwrap(), files("openai-community/gpt2-large").unwrap());
        assert_eq!(model_source("./output/actor").unwrap(), files("./output/actor").unwrap());
        assert_eq!(model_source("random:gpt2-medium").unwrap(), ModelSource::Random("gpt2-medium".into()));
        assert_eq!(model_source("tiny").unwrap(), ModelSource::Random("tiny".into()));
        let err = model_source("random:gpt5").unwrap_err().to_string();
        assert!(err.contains("gpt5") && err.contains("gpt2-medium"), "{err}");
    }

    #[test]
    fn lora_flags_parse_in_both_spellings_and_default_to_off() -> Result<()> {
        let off = parse(&[]);
        assert_eq!((off.lora(), off.lora_module_name.as_str(), off.lora_learning_rate), (None, "h.", 5e-4));
        let on = parse(&["--lora_dim", "4", "--lora_module_name", "attn", "--only_optimize_lora", "--lora_alpha", "8"]);
        assert_eq!(on.lora(), Some(LoraConfig { dim: 4, alpha: Some(8.0), module_name: "attn".into() }));
        assert!(on.only_optimize_lora);
        on.validate(1e-3)?;
        let kebab = parse(&["--lora-dim", "2", "--lora-learning-rate", "1e-3"]);
        assert_eq!((kebab.lora_dim, kebab.lora_learning_rate), (2, 1e-3));
        Ok(())
    }

    #[test]
    fn inconsistent_lora_flags_are_one_line_errors_naming_the_flag() {
        let err = |args: &[&str]| parse(args).validate(1e-3).unwrap_err().to_string();
        assert!(err(&["--only-optimize-lora"]).contains("--lora-dim"));
        assert!(err(&["--lora-dim", "0", "--lora-alpha", "8"]).contains("--lora-dim is 0"));
        assert!(err(&["--lora-dim", "4", "--lora-module-name", ""]).contains("--lora-module-name"));
        // Out-of-range floats do not get past parsing.
        let parse_err = |args: &[&str]| match Cli::try_parse_from(std::iter::once("step").chain(args.iter().copied())) {
            Ok(_) => panic!("{args:?} parsed"),
            Err(e) => e.to_string(),
        };
        assert!(parse_err(&["--lora-dim", "4", "--lora-alpha", "0"]).contains("--lora-alpha"));
        assert!(parse_err(&["--lora-dim", "4", "--lora-learning-rate=-1"]).contains("--lora-learning-rate"));
    }

    #[test]
    fn only_optimize_lora_freezes_the_trunk_and_exports_a_peft_adapter() -> Result<()> {
        let cfg = Gpt2Config { n_layer: 1, n_embd: 8, n_head: 2, n_positions: 8, vocab_size: 16, ..Gpt2Config::tiny() };
        let mut params = ParamStore::init(&cfg, 0, &Device::Cpu)?;
        let args = parse(&["--lora-dim", "2", "--only-optimize-lora", "--model-name-or-path", "some/base"]);
        let line = args.apply_lora(&mut params, &cfg, None)?.expect("LoRA is on");
        assert!(line.contains("rank 2 on 4 linears") && line.contains("only LoRA"), "{line}");
        assert_eq!(params.trainable().names.len(), 8);
        let adapter = args.peft_adapter(&params, "CAUSAL_LM").expect("frozen base: the adapter stands alone");
        assert_eq!((adapter.adapters.len(), adapter.base_model_name_or_path.as_str()), (4, "some/base"));
        assert!(adapter.modules_to_save.is_empty());
        // Trained together with the trunk, the adapter means nothing without the trained trunk.
        let mut params = ParamStore::init(&cfg, 0, &Device::Cpu)?;
        let both = parse(&["--lora-dim", "2"]);
        both.apply_lora(&mut params, &cfg, None)?;
        assert!(both.peft_adapter(&params, "CAUSAL_LM").is_none());
        assert_eq!(params.trainable().names.len(), params.names.len());
        Ok(())
    }
}
