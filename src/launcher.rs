//! `train`: the pipeline launcher. With no arguments it runs the embedded demo. Today the demo is
//! GPT-2 pretraining on the embedded Shakespeare corpus followed by a sample from the trained
//! model; the three RLHF steps (`--step 1 2 3`) arrive with the SFT/reward and PPO issues.

use anyhow::{bail, Result};
use clap::Parser;
use hybrid_engine::generate::SamplingConfig;
use std::path::PathBuf;

#[derive(Parser, Debug)]
#[command(
    args_override_self = true,
    name = "train",
    about = "Run the RLHF pipeline (with no arguments: the embedded CPU demo)"
)]
pub struct TrainArgs {
    /// Steps to run (1: SFT, 2: reward model, 3: PPO).
    #[arg(long, num_args = 1..)]
    pub step: Vec<u32>,
    /// single_gpu, single_node or multi_node.
    #[arg(long, alias = "deployment_type")]
    pub deployment_type: Option<String>,
    #[arg(long, alias = "actor_model")]
    pub actor_model: Option<String>,
    #[arg(long, alias = "reward_model")]
    pub reward_model: Option<String>,
    #[arg(long, default_value = "output", alias = "output_dir")]
    pub output_dir: PathBuf,
    /// Demo: pretraining iterations.
    #[arg(long, default_value_t = 200, alias = "train_iters")]
    pub train_iters: u64,
}

pub fn run(args: &TrainArgs) -> Result<()> {
    if !args.step.is_empty()
        || args.deployment_type.is_some()
        || args.actor_model.is_some()
        || args.reward_model.is_some()
    {
        bail!("the RLHF steps (--step 1 2 3) are not available yet: they arrive with the SFT/reward and PPO issues; run `train` with no arguments for the pretraining demo, or `sft --from-scratch` directly");
    }
    let out = args.output_dir.join("pretrain");
    println!("---=== Pretraining demo: tiny GPT-2 on the embedded Shakespeare corpus, CPU ===---");
    let started = std::time::Instant::now();
    let sft_args = sft::SftArgs::parse_from([
        "sft".to_string(),
        "--from-scratch".into(),
        "--model".into(),
        "tiny".into(),
        "--micro-batch-size".into(),
        "4".into(),
        "--train-iters".into(),
        args.train_iters.to_string(),
        "--lr-warmup-iters".into(),
        (args.train_iters / 10).to_string(),
        "--eval-interval".into(),
        (args.train_iters / 4).max(1).to_string(),
        "--eval-iters".into(),
        "8".into(),
        "--save-interval".into(),
        (args.train_iters / 2).max(1).to_string(),
        "--output-dir".into(),
        out.display().to_string(),
    ]);
    let summary = sft::pretrain::run(&sft_args)?;
    println!("---=== Pretraining finished in {:.0}s ===---", started.elapsed().as_secs_f64());
    if let (Some(first), Some(last)) = (summary.first_loss, summary.last_loss) {
        println!("train loss {first:.3} -> {last:.3}");
    }
    if let Some(ppl) = summary.valid_ppl {
        println!("validation perplexity {ppl:.1}");
    }

    let chat = crate::chat::ChatModel::load(&out.display().to_string())?;
    let prompt = "ROMEO:";
    let eos = chat.tokenizer.eos_id();
    let sampling = SamplingConfig {
        max_new_tokens: 48,
        temperature: Some(0.8),
        top_k: Some(50),
        top_p: Some(0.95),
        eos_token_id: Some(eos),
        pad_token_id: eos,
        vocab_limit: chat.tokenizer.vocab_size(),
        seed: 1,
    };
    let ids = chat.tokenizer.encode(prompt)?;
    let completion = chat.tokenizer.decode(&chat.complete(&ids, &sampling)?)?;
    println!("---=== Sample from {} ===---\n{prompt}{completion}", out.display());
    println!("Chat with it: chat --path {}", out.display());
    Ok(())
}
