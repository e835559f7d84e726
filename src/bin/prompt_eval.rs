//! `prompt_eval`: DS-Chat's `prompt_eval.py`, greedy answers of a baseline and a fine-tuned model
//! to the same prompts, side by side. With `--tensor-model-parallel-size T` both models are
//! split over T ranks this command starts (`rlhf::inference_ranks`); rank 0 prints.

use anyhow::Result;
use clap::Parser;
use hybrid_engine::checkpoints::sharded_io::ModelSlices;

#[derive(Parser, Debug)]
#[command(name = "prompt_eval", about = "Compare greedy answers of a baseline and a fine-tuned model")]
struct Args {
    /// Baseline model: HF directory, checkpoint root or hub id.
    #[arg(long, alias = "model_name_or_path_baseline")]
    model_name_or_path_baseline: String,
    /// Fine-tuned model: HF directory, checkpoint root or hub id.
    #[arg(long, alias = "model_name_or_path_finetune")]
    model_name_or_path_finetune: String,
    /// A jsonl with a `prompt` field, a text file with one prompt per line, `demo`, `arithmetic`
    /// or `arithmetic-phrasings`.
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
    /// Split both models over this many ranks (Megatron's layout; it must divide the attention
    /// heads), started by this command, or by a launcher that sets RANK and WORLD_SIZE.
    #[arg(long, default_value_t = 1, aliases = ["tensor_model_parallel_size", "tp-size", "tp_size"], value_parser = clap::value_parser!(u64).range(1..))]
    tensor_model_parallel_size: u64,
    /// Seconds a rank waits for another (rendezvous and every collective).
    #[arg(long, default_value_t = DEFAULT_DIST_TIMEOUT, alias = "dist_timeout", value_parser = clap::value_parser!(u64).range(1..))]
    dist_timeout: u64,
}

fn run(args: &Args) -> Result<()> {
    if args.tensor_model_parallel_size == 1 && args.dist_timeout != DEFAULT_DIST_TIMEOUT {
        anyhow::bail!("--dist-timeout bounds the waits between tensor-parallel ranks, and --tensor-model-parallel-size is 1 (one process): drop it");
    }
    let device = hybrid_engine::device::parse_device(&args.device)?;
    // Memory-mapped: the configs now, the values when the models are built (whole, or this
    // rank's slices under tensor parallelism).
    let open = |name: &str| -> Result<(ModelSlices, std::path::PathBuf)> {
        let dir = hybrid_engine::checkpoints::hf_io::resolve_model_dir(name)?;
        Ok((ModelSlices::open(&dir)?, dir))
    };
    let (baseline, _) = open(&args.model_name_or_path_baseline)?;
    let (finetuned, dir) = open(&args.model_name_or_path_finetune)?;
    let tok = data::Tokenizer::from_model_dir_or_default(&dir)?;
    let prompts = data::prompts::read_prompts(&args.prompts, args.num_prompts)?;
    // Each split must fit both models: the joining checks the one with fewer heads too.
    let size = args.tensor_model_parallel_size as usize;
    if size > 1 {
        let cfg = &baseline.config;
        hybrid_engine::tensor_parallel::shard::check_divides(cfg.num_heads(), cfg.inner_dim(), size)?;
    }
    let timeout = std::time::Duration::from_secs(args.dist_timeout);
    let ranks = rlhf::inference_ranks::InferenceRanks::join(size, &finetuned.config, timeout)?;
    let model = |slices: &ModelSlices| -> Result<hybrid_engine::Gpt2> {
        match &ranks {
            Some(ranks) => ranks.read_model(slices, &device),
            None => {
                let files = hybrid_engine::checkpoints::hf_io::load_model_dir(&slices.dir, &device)?;
                hybrid_engine::ParamStore::from_tensors(&files.config, &files.tensors, &device)?.model(&files.config)
            }
        }
    };
    let (baseline, finetuned) = (model(&baseline)?, model(&finetuned)?);
    let comparisons = sft::prompt_eval::compare(&baseline, &finetuned, &tok, &prompts, args.max_new_tokens, &device)?;
    match ranks {
        Some(ranks) if !ranks.is_first() => Ok(()),
        ranks => {
            print!("{}", sft::prompt_eval::render(&comparisons));
            ranks.map_or(Ok(()), rlhf::inference_ranks::InferenceRanks::finish)
        }
    }
}

/// Seconds by default (torch.distributed's 300).
const DEFAULT_DIST_TIMEOUT: u64 = 300;

fn main() {
    let args: Args = hybrid_engine::cli::parse_or_exit();
    if let Err(e) = run(&args) {
        hybrid_engine::cli::exit_with(e);
    }
}
