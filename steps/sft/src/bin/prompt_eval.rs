//! `prompt_eval`: DS-Chat's `prompt_eval.py`, greedy answers of a baseline and a fine-tuned model
//! to the same prompts, side by side.

use anyhow::Result;
use clap::Parser;

#[derive(Parser, Debug)]
#[command(name = "prompt_eval", about = "Compare greedy answers of a baseline and a fine-tuned model")]
struct Args {
    /// Baseline model: HF directory, checkpoint root or hub id.
    #[arg(long, alias = "model_name_or_path_baseline")]
    model_name_or_path_baseline: String,
    /// Fine-tuned model: HF directory, checkpoint root or hub id.
    #[arg(long, alias = "model_name_or_path_finetune")]
    model_name_or_path_finetune: String,
    /// A jsonl with a `prompt` field, a text file with one prompt per line, or `demo`.
    #[arg(long, default_value = "demo")]
    prompts: String,
    #[arg(long, default_value_t = 8, alias = "num_prompts")]
    num_prompts: usize,
    #[arg(long, default_value_t = 32, alias = "max_new_tokens")]
    max_new_tokens: usize,
    /// auto (CUDA device 0 when built with --features cuda and a GPU opens, else the CPU), cpu,
    /// cuda or cuda:N.
    #[arg(long, default_value = "auto", env = hybrid_engine::device::DEVICE_ENV)]
    device: String,
}

fn run(args: &Args) -> Result<()> {
    let device = hybrid_engine::device::parse_device(&args.device)?;
    let load = |name: &str| -> Result<(hybrid_engine::Gpt2, std::path::PathBuf)> {
        let dir = hybrid_engine::checkpoints::hf_io::resolve_model_dir(name)?;
        let files = hybrid_engine::checkpoints::hf_io::load_model_dir(&dir, &device)?;
        let params = hybrid_engine::ParamStore::from_tensors(&files.config, &files.tensors, &device)?;
        Ok((params.model(&files.config)?, dir))
    };
    let (baseline, _) = load(&args.model_name_or_path_baseline)?;
    let (finetuned, dir) = load(&args.model_name_or_path_finetune)?;
    let tok = data::Tokenizer::from_model_dir_or_default(&dir)?;
    let prompts = data::prompts::read_prompts(&args.prompts, args.num_prompts)?;
    let comparisons = sft::prompt_eval::compare(&baseline, &finetuned, &tok, &prompts, args.max_new_tokens, &device)?;
    print!("{}", sft::prompt_eval::render(&comparisons));
    Ok(())
}

fn main() {
    let args: Args = hybrid_engine::cli::parse_or_exit();
    if let Err(e) = run(&args) {
        hybrid_engine::cli::exit_with(e);
    }
}
