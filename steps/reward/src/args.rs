//! Flags of `reward` (step 2): DS-Chat's `step2_reward_model_finetuning/main.py` names in
//! kebab-case (snake_case accepted), plus `--loss last-token`, the common alternative to
//! DS-Chat's loss over the divergent span.

use clap::{Parser, ValueEnum};
use data::args::DataArgs;
use hybrid_engine::cli::step_args::StepArgs;
use std::path::PathBuf;

/// DS-Chat's step-2 default learning rate.
pub const DEFAULT_LR: f64 = 5e-5;

/// Which pairwise loss trains the reward model.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum PairLoss {
    /// DS-Chat: mean of `-log sigmoid(r_c[t] - r_r[t])` over the tokens where the pair differs.
    #[value(name = "ds-chat", alias = "ds_chat", alias = "divergent-span")]
    DsChat,
    /// `-log sigmoid(score_c - score_r)` on the two sequences' final scores (InstructGPT, TRL).
    #[value(name = "last-token", alias = "last_token")]
    LastToken,
}

#[derive(Parser, Debug, Clone)]
#[command(
    args_override_self = true,
    name = "reward",
    about = "Step 2: train a reward model on chosen/rejected pairs (DS-Chat step 2)"
)]
pub struct RewardArgs {
    #[command(flatten)]
    pub data: DataArgs,
    #[command(flatten)]
    pub train: StepArgs,
    /// Pairwise loss: ds-chat (over the divergent span) or last-token.
    #[arg(long, value_enum, default_value = "ds-chat")]
    pub loss: PairLoss,
    /// Where the reward model (a HF GPT2ForSequenceClassification directory), metrics.jsonl and
    /// reward_eval.json go.
    #[arg(long, default_value = "output/reward", alias = "output_dir")]
    pub output_dir: PathBuf,
    /// tokenizer.json (default: the starting model's, else the embedded GPT-2 tokenizer).
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
}
