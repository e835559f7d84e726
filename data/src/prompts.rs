//! Prompt lists for evaluation (DS-Chat's `prompt_eval.py` prompts, the demo's held-out
//! prompts): `demo`, `arithmetic`, a jsonl with a `prompt` field per line, or a text file with
//! one prompt per line.

use anyhow::{bail, Context, Result};
use std::path::Path;

/// Prompts from `spec`: `demo` or `arithmetic` (an embedded task's held-out prompts),
/// `arithmetic-phrasings` (the arithmetic task's trained pairs in held-out phrasings), a jsonl file with a `prompt`
/// field per line, or a text file with one prompt per line (`\n` escapes become newlines, so a
/// line can hold a `\n\nHuman: ...\n\nAssistant:` prompt).
pub fn read_prompts(spec: &str, limit: usize) -> Result<Vec<String>> {
    let prompts: Vec<String> = if spec == crate::phases::DEMO_DATA {
        crate::demo::evaluation_prompts()?.into_iter().map(|p| p.prompt).collect()
    } else if spec == crate::arithmetic::ARITHMETIC_DATA {
        crate::arithmetic::heldout_prompts()
    } else if spec == crate::arithmetic::ARITHMETIC_PHRASINGS {
        crate::arithmetic::heldout_phrasing_prompts()
    } else {
        let path = Path::new(spec);
        let text =
            std::fs::read_to_string(path).with_context(|| format!("cannot read prompt file {}", path.display()))?;
        let is_jsonl = path.extension().is_some_and(|e| e == "jsonl" || e == "json");
        let mut out = Vec::new();
        for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
            out.push(if is_jsonl {
                let v: serde_json::Value = serde_json::from_str(line)
                    .map_err(|e| anyhow::anyhow!("{} line {}: invalid JSON ({e})", path.display(), i + 1))?;
                match v.get("prompt").and_then(|p| p.as_str()) {
                    Some(p) => p.to_string(),
                    None => bail!("{} line {}: no string field \"prompt\"", path.display(), i + 1),
                }
            } else {
                line.replace("\\n", "\n")
            });
        }
        out
    };
    if prompts.is_empty() {
        bail!("prompt {spec} holds no prompts");
    }
    Ok(prompts.into_iter().take(limit).collect())
}
