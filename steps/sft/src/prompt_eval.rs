//! DS-Chat's `prompt_eval.py`: greedy answers of a baseline and a fine-tuned model to the same
//! prompts, side by side. Used at the end of `sft` and by the `prompt_eval` binary.

use anyhow::Result;
use candle_core::Device;
use data::Tokenizer;
use hybrid_engine::generation::generate::{generate, SamplingConfig};
use hybrid_engine::Gpt2;
use serde::Serialize;

/// One prompt and both answers.
#[derive(Clone, Debug, Serialize)]
pub struct Comparison {
    pub prompt: String,
    pub baseline: String,
    pub finetuned: String,
}

/// Greedy answers (up to `max_new_tokens`, stopping at EOS) of both models to every prompt.
pub fn compare(
    baseline: &Gpt2,
    finetuned: &Gpt2,
    tok: &Tokenizer,
    prompts: &[String],
    max_new_tokens: usize,
    device: &Device,
) -> Result<Vec<Comparison>> {
    let ids: Vec<Vec<u32>> = prompts.iter().map(|p| tok.encode(p)).collect::<Result<_>>()?;
    let answer = |model: &Gpt2| -> Result<Vec<String>> {
        let limit = tok.vocab_size().min(model.cfg.vocab_size);
        let cfg = SamplingConfig::greedy(max_new_tokens, Some(tok.eos_id()), tok.eos_id(), limit);
        let out = generate(model, &ids, &cfg, device)?;
        out.iter().map(|a| tok.decode(a.strip_suffix(&[tok.eos_id()]).unwrap_or(a))).collect()
    };
    let (base, tuned) = (answer(baseline)?, answer(finetuned)?);
    Ok(prompts
        .iter()
        .zip(base.into_iter().zip(tuned))
        .map(|(p, (baseline, finetuned))| Comparison { prompt: p.clone(), baseline, finetuned })
        .collect())
}

/// The comparisons as text, DS-Chat style.
pub fn render(comparisons: &[Comparison]) -> String {
    let mut s = String::new();
    for c in comparisons {
        s += &format!(
            "==========prompt=========\n{}\n==========baseline========\n{}\n==========finetuned=======\n{}\n",
            c.prompt.trim(),
            c.baseline.trim(),
            c.finetuned.trim()
        );
    }
    s
}
