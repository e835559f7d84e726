//! Flags of `sft` (step 1, supervised fine-tuning): DS-Chat's `step1_supervised_finetuning/main.py`
//! names in kebab-case (snake_case accepted), plus ours: `--train-on-prompt` restores DS-Chat's
//! loss over the prompt, `--eval-prompts` runs DS-Chat's `prompt_eval.py` comparison at the end.

use clap::Parser;
use data::args::DataArgs;
use hybrid_engine::cli::heading;
use hybrid_engine::cli::step_args::StepArgs;
use std::path::PathBuf;

/// DS-Chat's step-1 default learning rate.
pub const DEFAULT_LR: f64 = 1e-3;

#[derive(Parser, Debug, Clone)]
#[command(
    args_override_self = true,
    name = "sft",
    about = "Step 1: supervised fine-tuning on prompt + chosen answers (DS-Chat step 1). \
             `sft --from-scratch --help` shows GPT-2 pretraining (Megatron pretrain_gpt2)."
)]
pub struct SftArgs {
    #[command(flatten, next_help_heading = heading::DATA)]
    pub data: DataArgs,
    #[command(flatten)]
    pub train: StepArgs,
    /// Compute the loss over the prompt too, as DS-Chat does (default: the answer and EOS only).
    #[arg(help_heading = heading::TRAINING, long, alias = "train_on_prompt")]
    pub train_on_prompt: bool,
    /// Where the fine-tuned model (a HF directory) and metrics.jsonl go.
    #[arg(help_heading = heading::OUTPUT, long, default_value = "output/actor", alias = "output_dir")]
    pub output_dir: PathBuf,
    /// tokenizer.json (default: the starting model's, else the embedded GPT-2 tokenizer).
    #[arg(help_heading = heading::MODEL, long)]
    pub tokenizer: Option<PathBuf>,
    /// Prompts whose greedy answers by the starting and the fine-tuned model are printed side by
    /// side at the end and saved to prompt_eval.jsonl (a jsonl with a `prompt` field, or text
    /// with one prompt per line; `demo`, `arithmetic` or `arithmetic-phrasings` for an embedded
    /// task's held-out prompts).
    #[arg(help_heading = heading::EVALUATION, long, alias = "eval_prompts")]
    pub eval_prompts: Option<String>,
    /// How many of the eval prompts to answer.
    #[arg(help_heading = heading::EVALUATION, long, default_value_t = 8, alias = "num_eval_prompts", requires = "eval_prompts")]
    pub num_eval_prompts: usize,
    /// New tokens per eval-prompt answer.
    #[arg(help_heading = heading::EVALUATION, long, default_value_t = 32, alias = "max_new_tokens", requires = "eval_prompts")]
    pub max_new_tokens: usize,
}
