//! `chat --path DIR`: an interactive multi-turn chat with a model directory in DS-Chat's
//! `Human:`/`Assistant:` format (`clear` forgets the history, `quit` exits), or with `--prompt`
//! a one-shot completion of the text given verbatim that prints only the completion (scripts).
//! With `--tensor-model-parallel-size T` the model is split over T ranks that this process
//! starts (`crate::inference_ranks`); it stays the one that reads and prints.

use crate::inference_ranks::InferenceRanks;
use anyhow::{bail, Context, Result};
use candle_core::Device;
use clap::Parser;
use data::Tokenizer;
use hybrid_engine::checkpoints::hf_io::{load_model_dir, resolve_model_dir};
use hybrid_engine::checkpoints::sharded_io::ModelSlices;
use hybrid_engine::generation::generate::{generate, SamplingConfig};
use hybrid_engine::{Gpt2, ParamStore};
use std::io::{BufRead, Write};
use std::time::Duration;

#[derive(Parser, Debug)]
#[command(
    args_override_self = true,
    name = "chat",
    about = "Chat with a trained model (a Hugging Face GPT-2 directory)"
)]
pub struct ChatArgs {
    /// Model directory (config.json + model.safetensors), a checkpoint root with a `latest`
    /// pointer, or a hub id such as gpt2.
    #[arg(long, alias = "model-name-or-path", alias = "model_name_or_path")]
    pub path: String,
    /// Complete this text once (verbatim) and print only the completion.
    #[arg(long)]
    pub prompt: Option<String>,
    /// With --prompt: wrap the text as a chat turn ("\n\nHuman: TEXT\n\nAssistant:").
    #[arg(long, alias = "chat_format", requires = "prompt")]
    pub chat_format: bool,
    /// Greedy decoding instead of sampling (the sampling flags are refused with it).
    #[arg(long)]
    pub greedy: bool,
    #[arg(long, default_value_t = 128, alias = "max_new_tokens")]
    pub max_new_tokens: usize,
    #[arg(long, default_value_t = 0.7, value_parser = hybrid_engine::cli::positive(), conflicts_with = "greedy")]
    pub temperature: f64,
    #[arg(long, default_value_t = 50, alias = "top_k", conflicts_with = "greedy")]
    pub top_k: usize,
    #[arg(long, default_value_t = 0.9, alias = "top_p", value_parser = hybrid_engine::cli::top_p(), conflicts_with = "greedy")]
    pub top_p: f64,
    #[arg(long, default_value_t = 42, conflicts_with = "greedy")]
    pub seed: u64,
    /// auto (CUDA device 0 when built with --features cuda and a GPU opens, else the CPU), cpu,
    /// cuda or cuda:N.
    #[arg(long, default_value = "auto", env = hybrid_engine::device::DEVICE_ENV)]
    pub device: String,
    /// Split the model over this many ranks (Megatron's layout; it must divide the attention
    /// heads), started by this command, or by a launcher that sets RANK and WORLD_SIZE.
    #[arg(long, default_value_t = 1, aliases = ["tensor_model_parallel_size", "tp-size", "tp_size"], value_parser = clap::value_parser!(u64).range(1..))]
    pub tensor_model_parallel_size: u64,
}

/// How long a rank of a split model waits for the next prompt: a person may pause for hours.
const IDLE_LIMIT: Duration = Duration::from_secs(7 * 24 * 3600);

/// A loaded model with its tokenizer, ready to complete token sequences.
pub struct ChatModel {
    pub model: Gpt2,
    pub tokenizer: Tokenizer,
    device: Device,
}

impl ChatModel {
    /// Loads a model directory, checkpoint root or hub id onto `device`: the whole model, or
    /// with `tp_size` above 1 this rank's slices of it, joining the ranks it is split over.
    pub fn load(path: &str, device: &Device, tp_size: usize) -> Result<(Self, Option<InferenceRanks>)> {
        let dir = resolve_model_dir(path)?;
        let device = device.clone();
        // Memory-mapped: the config and the tensors' shapes now, the values as they are read.
        let slices = ModelSlices::open(&dir)?;
        let config = slices.config.clone();
        let tokenizer = Tokenizer::from_model_dir_or_default(&dir)?;
        if tokenizer.vocab_size() > config.vocab_size {
            bail!(
                "{}: tokenizer.json has {} tokens but the model only {}: the directory's tokenizer does not belong to this model",
                dir.display(),
                tokenizer.vocab_size(),
                config.vocab_size
            );
        }
        let ranks = InferenceRanks::join(tp_size, &config, IDLE_LIMIT)?;
        let model = match &ranks {
            Some(ranks) => ranks.read_model(&slices, &device)?,
            None => {
                let files = load_model_dir(&dir, &device)?;
                ParamStore::from_tensors(&files.config, &files.tensors, &device)?.model(&files.config)?
            }
        };
        Ok((Self { model, tokenizer, device }, ranks))
    }

    /// Completes `prompt_ids`; returns the new ids without the final EOS.
    pub fn complete(&self, prompt_ids: &[u32], sampling: &SamplingConfig) -> Result<Vec<u32>> {
        let mut out = generate(&self.model, &[prompt_ids.to_vec()], sampling, &self.device)?.remove(0);
        if out.last() == sampling.eos_token_id.as_ref() {
            out.pop();
        }
        Ok(out)
    }
}

/// Runs the chat command.
pub fn run(args: &ChatArgs) -> Result<()> {
    if args.max_new_tokens == 0 {
        bail!("--max-new-tokens must be at least 1");
    }
    let device = hybrid_engine::device::parse_device(&args.device)?;
    let (chat, ranks) = ChatModel::load(&args.path, &device, args.tensor_model_parallel_size as usize)?;
    let eos = chat.tokenizer.eos_id();
    let sampling = SamplingConfig {
        max_new_tokens: args.max_new_tokens,
        temperature: if args.greedy { None } else { Some(args.temperature) },
        top_k: Some(args.top_k),
        top_p: Some(args.top_p),
        eos_token_id: Some(eos),
        pad_token_id: eos,
        vocab_limit: chat.tokenizer.vocab_size(),
        seed: args.seed,
    };
    match (&args.prompt, ranks) {
        (Some(text), ranks) => {
            // Every rank completes the same text in lockstep; rank 0 prints.
            let text = one_shot(&chat, text, args, &sampling)?;
            if ranks.as_ref().is_none_or(InferenceRanks::is_first) {
                println!("{text}");
            }
            ranks.map_or(Ok(()), InferenceRanks::finish)
        }
        (None, None) => interactive(&chat, &sampling, None),
        (None, Some(ranks)) if ranks.is_first() => {
            interactive(&chat, &sampling, Some(&ranks))?;
            ranks.finish()
        }
        (None, Some(ranks)) => follow(&chat, &sampling, &ranks),
    }
}

/// The completion of `text`.
fn one_shot(chat: &ChatModel, text: &str, args: &ChatArgs, sampling: &SamplingConfig) -> Result<String> {
    let text = if args.chat_format { chat_turn(text) } else { text.to_string() };
    let ids = chat.tokenizer.encode(&text)?;
    if ids.is_empty() {
        bail!("--prompt is empty: give some text to complete");
    }
    let n_pos = chat.model.cfg.max_positions();
    if ids.len() >= n_pos {
        bail!("--prompt has {} tokens but the model's context is {n_pos}: shorten it", ids.len());
    }
    let out = chat.complete(&ids, sampling)?;
    chat.tokenizer.decode(&out)
}

/// DS-Chat's prompt format for one human turn.
pub fn chat_turn(text: &str) -> String {
    format!("\n\nHuman: {text}\n\nAssistant:")
}

/// The terminal session; with `ranks`, each prompt is sent to the other ranks before it is
/// completed, and the end of the session too.
fn interactive(chat: &ChatModel, sampling: &SamplingConfig, ranks: Option<&InferenceRanks>) -> Result<()> {
    let end = || ranks.map_or(Ok(None), |r| r.share_prompt(None)).map(|_| ());
    let split = ranks.map_or(String::new(), |r| format!(" (split over {} ranks)", r.size()));
    println!("Chatting with the model{split}. Type `clear` to start over, `quit` to exit.");
    let stdin = std::io::stdin();
    let mut history = String::new();
    let n_pos = chat.model.cfg.max_positions();
    let keep = n_pos.saturating_sub(sampling.max_new_tokens.min(n_pos / 2)).max(1);
    loop {
        print!("Human: ");
        std::io::stdout().flush()?;
        let mut line = String::new();
        if stdin.lock().read_line(&mut line).context("reading from stdin")? == 0 {
            println!();
            return end();
        }
        let input = line.trim();
        match input {
            "" => continue,
            "quit" | "exit" => return end(),
            "clear" => {
                history.clear();
                println!("[history cleared]");
                continue;
            }
            _ => {}
        }
        history.push_str(&chat_turn(input));
        let mut ids = chat.tokenizer.encode(&history)?;
        if ids.len() > keep {
            ids.drain(..ids.len() - keep); // keep the most recent turns that fit the context
        }
        if let Some(ranks) = ranks {
            ranks.share_prompt(Some(&ids))?;
        }
        let out = chat.complete(&ids, sampling)?;
        let answer = chat.tokenizer.decode(&out)?;
        // A model that keeps writing the dialogue on its own is cut at its next "Human:" turn.
        let answer = answer.split("Human:").next().unwrap_or("").trim_end().to_string();
        println!("Assistant:{answer}");
        history.push_str(&answer);
    }
}

/// A rank other than 0 of a split model: completes rank 0's prompts with it until the session
/// ends.
fn follow(chat: &ChatModel, sampling: &SamplingConfig, ranks: &InferenceRanks) -> Result<()> {
    while let Some(ids) = ranks.share_prompt(None)? {
        chat.complete(&ids, sampling)?;
    }
    Ok(())
}
