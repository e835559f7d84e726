//! Flags of `reward` (step 2): DS-Chat's `step2_reward_model_finetuning/main.py` names in
//! kebab-case (snake_case accepted), plus `--loss last-token`, the common alternative to
//! DS-Chat's loss over the divergent span.

use anyhow::{bail, Result};
use clap::{Parser, ValueEnum};
use data::args::DataArgs;
use hybrid_engine::cli::heading;
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

/// What step 2 trains.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, ValueEnum)]
pub enum Step2Algorithm {
    /// DS-Chat: a reward model (a score head on a GPT-2 trunk) for step 3.
    #[default]
    #[value(name = "reward-model", alias = "reward_model", alias = "rm")]
    RewardModel,
    /// DPO: the step-1 actor itself, on the pairs against its frozen copy (no step 3 needed).
    Dpo,
}

/// DPO's loss on the policy's and the reference's log-ratio difference `h`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum DpoLoss {
    /// `-log sigmoid(beta h)` (Rafailov et al.; TRL's default).
    Sigmoid,
    /// `(h - 1 / (2 beta))^2` on per-token mean log-probs (Azar et al.'s IPO, as TRL).
    Ipo,
}

/// DPO's default beta (TRL's).
pub const DEFAULT_BETA: f64 = 0.1;

#[derive(Parser, Debug, Clone)]
#[command(
    args_override_self = true,
    name = "reward",
    about = "Step 2: train a reward model on chosen/rejected pairs (DS-Chat step 2)"
)]
pub struct RewardArgs {
    #[command(flatten, next_help_heading = heading::DATA)]
    pub data: DataArgs,
    #[command(flatten)]
    pub train: StepArgs,
    /// What to train: `reward-model` (DS-Chat's step 2) or `dpo` (the step-1 actor directly on
    /// the pairs, against its frozen copy: the alternative to steps 2 and 3).
    #[arg(help_heading = heading::ALGORITHM, long, value_enum, default_value = "reward-model")]
    pub algorithm: Step2Algorithm,
    /// Pairwise loss: ds-chat (over the divergent span) or last-token.
    #[arg(help_heading = heading::ALGORITHM, long, value_enum, default_value = "ds-chat")]
    pub loss: PairLoss,
    /// DPO's beta: how far from the reference the policy may move (default 0.1).
    #[arg(help_heading = heading::ALGORITHM, long, value_parser = hybrid_engine::cli::positive())]
    pub beta: Option<f64>,
    /// DPO's loss: sigmoid (default) or ipo.
    #[arg(help_heading = heading::ALGORITHM, long, value_enum, alias = "dpo_loss")]
    pub dpo_loss: Option<DpoLoss>,
    /// RPO's weight (TRL's `rpo_alpha`, Pang et al.): DPO's loss plus this times the chosen
    /// answers' negative log-likelihood per token (default 0: DPO alone).
    #[arg(help_heading = heading::ALGORITHM, long, value_parser = hybrid_engine::cli::non_negative(), alias = "rpo_alpha")]
    pub rpo_alpha: Option<f64>,
    /// Where the reward model (a HF GPT2ForSequenceClassification directory), metrics.jsonl and
    /// reward_eval.json go.
    #[arg(help_heading = heading::OUTPUT, long, default_value = "output/reward", alias = "output_dir")]
    pub output_dir: PathBuf,
    /// tokenizer.json (default: the starting model's, else the embedded GPT-2 tokenizer).
    #[arg(help_heading = heading::MODEL, long)]
    pub tokenizer: Option<PathBuf>,
    /// DS-Chat's `--num_padding_at_beginning`: the padding tokens a tokenizer puts at the start
    /// of every row (OPT's BOS is its pad: 1), which are not the row's end. GPT-2's tokenizer
    /// adds none (0); rows that do not begin with padding are read as with 0, said in a line.
    #[arg(help_heading = heading::DATA, long, default_value_t = 0, alias = "num_padding_at_beginning")]
    pub num_padding_at_beginning: usize,
    /// Also evaluate after every this many optimizer steps (DS-Chat's `--eval_interval`; 0:
    /// after each epoch only).
    #[arg(help_heading = heading::EVALUATION, long, default_value_t = 0, alias = "eval_interval")]
    pub eval_interval: u64,
    /// Evaluate on at most this many batches per rank (DS-Chat's `--eval_iters`; default: every
    /// eval pair).
    #[arg(help_heading = heading::EVALUATION, long, alias = "eval_iters", value_parser = clap::value_parser!(u64).range(1..))]
    pub eval_iters: Option<u64>,
}

impl RewardArgs {
    /// The eval pairs `--eval-iters` keeps of `eval` over `world` ranks: the first
    /// `eval_iters x per-device eval batch x world` (each rank's first `--eval-iters` batches).
    pub fn eval_pairs<'a, T>(&self, eval: &'a [T], world: usize) -> &'a [T] {
        let cap = self.eval_iters.map_or(usize::MAX, |n| n as usize * self.train.per_device_eval_batch_size * world);
        &eval[..eval.len().min(cap)]
    }

    /// Refuses the flags of the other algorithm: each would have no effect.
    pub fn refuse_other_algorithms_flags(&self) -> Result<()> {
        match self.algorithm {
            Step2Algorithm::RewardModel => {
                if self.beta.is_some() || self.dpo_loss.is_some() || self.rpo_alpha.is_some() {
                    bail!("--beta, --dpo-loss and --rpo-alpha set DPO, and step 2 trains a reward model: add --algorithm dpo or drop them");
                }
            }
            Step2Algorithm::Dpo => {
                if self.loss != PairLoss::DsChat {
                    bail!("--loss sets the reward model's pairwise loss, and --algorithm dpo trains the actor: use --dpo-loss sigmoid|ipo instead");
                }
            }
        }
        Ok(())
    }
}
