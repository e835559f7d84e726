//! Step 1 of the pipeline. Today: GPT-2 pretraining from scratch (`--from-scratch`, Megatron's
//! `pretrain_gpt2`). Supervised fine-tuning on prompt/answer data arrives with the SFT issue.

pub mod args;
pub mod pretrain;

pub use args::SftArgs;
