//! A model's `config.json`, whatever its architecture: read by its `model_type`, the one place
//! that lists the families this engine implements. Each family's own config struct lives in its
//! folder (`gpt2/config.rs`); this enum is what a reader of an unknown directory gets back.

use super::gpt2::Gpt2Config;
use anyhow::{anyhow, bail, Result};

/// A config.json read and checked, one variant per family.
#[derive(Clone, Debug)]
pub enum ModelConfig {
    Gpt2(Gpt2Config),
}

/// The `model_type`s implemented here, as HF names them.
pub const SUPPORTED_MODEL_TYPES: &[&str] = &["gpt2"];

impl ModelConfig {
    /// Reads config.json's `text` by its `model_type` (absent: GPT-2, as directories written
    /// before it was recorded); a type not implemented is one error naming it, the class the
    /// config declares and the supported types, before any of its fields is read.
    pub fn from_json(text: &str) -> Result<Self> {
        let value: serde_json::Value = serde_json::from_str(text).map_err(|e| anyhow!("not valid JSON: {e}"))?;
        if !value.is_object() {
            bail!("not a JSON object");
        }
        let model_type = match value.get("model_type") {
            None => "gpt2",
            Some(serde_json::Value::String(t)) => t.as_str(),
            Some(other) => bail!("model_type must be a string, not {other}"),
        };
        match model_type {
            "gpt2" => {
                let cfg: Gpt2Config =
                    serde_json::from_value(value).map_err(|e| anyhow!("not a valid GPT-2 config.json: {e}"))?;
                cfg.validate()?;
                Ok(Self::Gpt2(cfg))
            }
            other => {
                let class = value
                    .get("architectures")
                    .and_then(|a| a.get(0))
                    .and_then(|a| a.as_str())
                    .map(|a| format!(" ({a})"))
                    .unwrap_or_default();
                bail!(
                    "model_type {other:?}{class} is not supported here: the supported model types are {}",
                    SUPPORTED_MODEL_TYPES.join(", ")
                )
            }
        }
    }

    /// The `model_type` config.json records.
    pub fn model_type(&self) -> &'static str {
        match self {
            Self::Gpt2(_) => "gpt2",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_config_is_read_by_its_model_type_and_an_unknown_one_is_named() {
        let gpt2 = serde_json::to_string(&Gpt2Config::tiny()).unwrap();
        let ModelConfig::Gpt2(read) = ModelConfig::from_json(&gpt2).unwrap();
        assert_eq!((read.hidden_size(), read.num_layers()), (128, 4));
        let tagged = gpt2.replacen('{', r#"{"model_type": "gpt2", "#, 1);
        assert_eq!(ModelConfig::from_json(&tagged).unwrap().model_type(), "gpt2");
        // Qwen2.5-0.5B's config.json (its first fields): named, with its class, before its fields
        // are read as GPT-2's (which it lacks).
        let qwen = r#"{"architectures": ["Qwen2ForCausalLM"], "hidden_size": 896, "model_type": "qwen2"}"#;
        let e = ModelConfig::from_json(qwen).unwrap_err().to_string();
        assert!(e.contains(r#"model_type "qwen2" (Qwen2ForCausalLM) is not supported"#) && e.contains("gpt2"), "{e}");
        for (bad, want) in [("[1]", "JSON object"), ("{", "not valid JSON"), (r#"{"model_type": 3}"#, "a string")] {
            let e = ModelConfig::from_json(bad).unwrap_err().to_string();
            assert!(e.contains(want), "{bad}: {e}");
        }
        let broken = r#"{"model_type": "gpt2", "n_embd": 8}"#;
        assert!(ModelConfig::from_json(broken).unwrap_err().to_string().contains("not a valid GPT-2 config.json"));
    }
}
