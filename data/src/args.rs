//! DS-Chat's data flags (`--data-path`, `--data-split`, `--sft-only-data-path`,
//! `--data-output-path`) plus the column keys and `--train-on-prompt`, shared by the three
//! steps, and their validation into a [`DataConfig`].

use std::path::PathBuf;

use anyhow::{bail, Result};
use clap::Args;

use crate::phases::DataConfig;
use crate::sources::ColumnKeys;
use crate::tokenizer::{Tokenizer, EOS_TOKEN};

#[derive(Args, Debug, Clone)]
pub struct DataArgs {
    /// Datasets, blended when several: DS-Chat names (Dahoas/rm-static, Dahoas/full-hh-rlhf,
    /// Dahoas/synthetic-instruct-gptj-pairwise, yitingxie/rlhf-reward-datasets,
    /// openai/webgpt_comparisons, stanfordnlp/SHP), local jsonl/json/parquet files or
    /// directories, other hub dataset ids, `demo` (the embedded demo data) or `arithmetic` (the
    /// embedded arithmetic task).
    #[arg(long, num_args = 1.., default_value = "demo", alias = "data_path")]
    pub data_path: Vec<String>,
    /// Shares of phases 1 (SFT), 2 (reward) and 3 (PPO) in every dataset.
    #[arg(long, default_value = "2,4,4", alias = "data_split")]
    pub data_split: String,
    /// Datasets used wholly, and only, for SFT.
    #[arg(long, num_args = 1.., alias = "sft_only_data_path")]
    pub sft_only_data_path: Vec<String>,
    /// Where tokenized datasets are cached (shared by runs and steps). Default: a private
    /// per-user directory, `$XDG_CACHE_HOME/rlhf-rs/data_files` or `~/.cache/rlhf-rs/data_files`
    /// (DS-Chat's `/tmp/data_files` is writable by every local user).
    #[arg(long, alias = "data_output_path", conflicts_with = "no_data_cache")]
    pub data_output_path: Option<PathBuf>,
    /// Never read or write the tokenized-data cache.
    #[arg(long, alias = "no_data_cache")]
    pub no_data_cache: bool,
    /// Column (or JSON field) of the prompt in local files and generic hub datasets.
    #[arg(long, default_value = "prompt", alias = "prompt_key")]
    pub prompt_key: String,
    /// Column (or JSON field) of the preferred answer in local files and generic hub datasets.
    #[arg(long, default_value = "chosen", alias = "chosen_key")]
    pub chosen_key: String,
    /// Column (or JSON field) of the rejected answer, as --chosen-key.
    #[arg(long, default_value = "rejected", alias = "rejected_key")]
    pub rejected_key: String,
    /// Threads that tokenize the datasets (DS-Chat's `--preprocessing_num_workers`; default:
    /// every core).
    #[arg(long, alias = "preprocessing_num_workers", value_parser = clap::value_parser!(u64).range(1..))]
    pub preprocessing_num_workers: Option<u64>,
    /// DS-Chat's `--add_eot_token`: register `--eot-token` as a special token ending every row.
    /// Rows end with the tokenizer's EOS (`<|endoftext|>`, GPT-2's, which is DS-Chat's
    /// `--eot_token`) with or without it; it is accepted when `--eot-token` is that EOS.
    #[arg(long, alias = "add_eot_token")]
    pub add_eot_token: bool,
    /// The end-of-conversation token of `--add-eot-token` (DS-Chat's default `<|endoftext|>`).
    #[arg(long, alias = "eot_token", requires = "add_eot_token")]
    pub eot_token: Option<String>,
}

impl DataArgs {
    /// `tokenizer` with `--preprocessing-num-workers`, once `--add-eot-token`'s token is checked
    /// to be its EOS: a new special token would need an embedding row the model does not have.
    pub fn tokenizer(&self, tokenizer: Tokenizer) -> Result<Tokenizer> {
        if let Some(token) = self.eot_token.as_deref().filter(|t| !tokenizer.is_eos(t)) {
            bail!(
                "--eot-token {token:?} is not the tokenizer's EOS ({EOS_TOKEN}): rows end with the EOS, which is also the padding, and a new special token would need an embedding row the model lacks; drop --eot-token or pass {EOS_TOKEN}"
            );
        }
        tokenizer.with_workers(self.preprocessing_num_workers.map(|n| n as usize))
    }

    /// `--sft-only-data-path` feeds phase 1 alone (as in DS-Chat, which accepts it in every step
    /// and ignores it outside step 1): refused in `step`, where it would have no effect.
    pub fn refuse_sft_only_data(&self, step: &str) -> Result<()> {
        if !self.sft_only_data_path.is_empty() {
            bail!(
                "--sft-only-data-path feeds SFT (step 1) only and would have no effect in {step}: drop it here (put the data in --data-path to use it)"
            );
        }
        Ok(())
    }

    /// The validated data configuration for sequences of `max_seq_len` tokens (phases 1 and 2)
    /// and prompts of `max_prompt_seq_len` (phase 3).
    pub fn config(
        &self,
        seed: u64,
        max_seq_len: usize,
        max_prompt_seq_len: usize,
        train_on_prompt: bool,
    ) -> Result<DataConfig> {
        if self.data_path.iter().chain(&self.sft_only_data_path).any(|p| p.trim().is_empty()) {
            bail!("--data-path and --sft-only-data-path values must not be empty");
        }
        let embedded = |p: &String| p == crate::phases::DEMO_DATA || p == crate::arithmetic::ARITHMETIC_DATA;
        let keys = ColumnKeys {
            prompt: self.prompt_key.clone(),
            chosen: self.chosen_key.clone(),
            rejected: self.rejected_key.clone(),
        };
        let paths: Vec<&String> = self.data_path.iter().chain(&self.sft_only_data_path).collect();
        if !paths.is_empty() && paths.iter().all(|p| embedded(p)) && keys != ColumnKeys::default() {
            bail!("--prompt-key, --chosen-key and --rejected-key name the columns of local files and hub datasets, and every --data-path here is embedded ({}): drop them", paths.iter().map(|p| p.as_str()).collect::<Vec<_>>().join(", "));
        }
        Ok(DataConfig {
            data_paths: self.data_path.clone(),
            sft_only_data_paths: self.sft_only_data_path.clone(),
            data_split: crate::split::parse_data_split(&self.data_split)?,
            keys,
            seed,
            max_seq_len,
            max_prompt_seq_len,
            train_on_prompt,
            data_output_path: if self.no_data_cache {
                None
            } else {
                Some(match &self.data_output_path {
                    Some(dir) => dir.clone(),
                    None => crate::cache::default_cache_dir(
                        std::env::var_os("XDG_CACHE_HOME").as_deref(),
                        std::env::var_os("HOME").as_deref(),
                    )?,
                })
            },
        })
    }
}
