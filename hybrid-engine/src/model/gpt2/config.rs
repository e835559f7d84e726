//! GPT-2's `config.json` (`GPT2Config`): the dimensions, dropout rates and special tokens, the
//! presets by size, the checks that refuse what this implementation would get wrong, and the
//! architecture-neutral names the rest of the engine reads the dimensions by.

use anyhow::bail;
use serde::{Deserialize, Serialize};

/// The Hugging Face `GPT2Config` fields we read; unknown fields are kept and written back.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Gpt2Config {
    /// Rows of the token embedding; may exceed the tokenizer's size (Megatron padding).
    pub vocab_size: usize,
    pub n_positions: usize,
    pub n_embd: usize,
    pub n_layer: usize,
    pub n_head: usize,
    /// MLP width; `None` means 4 * n_embd.
    #[serde(default)]
    pub n_inner: Option<usize>,
    #[serde(default = "default_activation")]
    pub activation_function: String,
    #[serde(default = "default_dropout")]
    pub resid_pdrop: f64,
    #[serde(default = "default_dropout")]
    pub embd_pdrop: f64,
    #[serde(default = "default_dropout")]
    pub attn_pdrop: f64,
    #[serde(default = "default_eps")]
    pub layer_norm_epsilon: f64,
    #[serde(default = "default_init_range")]
    pub initializer_range: f64,
    #[serde(default)]
    pub bos_token_id: Option<u32>,
    #[serde(default)]
    pub eos_token_id: Option<u32>,
    #[serde(default = "default_true")]
    pub scale_attn_weights: bool,
    #[serde(default)]
    pub scale_attn_by_inverse_layer_idx: bool,
    #[serde(default = "default_true")]
    pub tie_word_embeddings: bool,
    /// Every other field of config.json, preserved on save.
    #[serde(flatten)]
    pub extra: serde_json::Map<String, serde_json::Value>,
}

fn default_activation() -> String {
    "gelu_new".into()
}
fn default_dropout() -> f64 {
    0.1
}
fn default_eps() -> f64 {
    1e-5
}
fn default_init_range() -> f64 {
    0.02
}
fn default_true() -> bool {
    true
}

/// GPT-2's tokenizer size; presets start here and Megatron padding rounds it up.
pub const GPT2_VOCAB: usize = 50257;
/// `<|endoftext|>`, GPT-2's BOS, EOS and (as in DS-Chat) pad token.
pub const GPT2_EOS: u32 = 50256;

impl Gpt2Config {
    fn preset(n_layer: usize, n_embd: usize, n_head: usize, n_positions: usize) -> Self {
        Self {
            vocab_size: GPT2_VOCAB,
            n_positions,
            n_embd,
            n_layer,
            n_head,
            n_inner: None,
            activation_function: default_activation(),
            resid_pdrop: 0.1,
            embd_pdrop: 0.1,
            attn_pdrop: 0.1,
            layer_norm_epsilon: 1e-5,
            initializer_range: 0.02,
            bos_token_id: Some(GPT2_EOS),
            eos_token_id: Some(GPT2_EOS),
            scale_attn_weights: true,
            scale_attn_by_inverse_layer_idx: false,
            tie_word_embeddings: true,
            extra: Default::default(),
        }
    }
    /// 7.2M parameters (6.4M of them the embedding): tests and the CPU demo.
    pub fn tiny() -> Self {
        Self::preset(4, 128, 4, 256)
    }
    /// 124M parameters.
    pub fn gpt2() -> Self {
        Self::preset(12, 768, 12, 1024)
    }
    /// 355M parameters: Megatron's "345M" shape (24 layers, 1024 hidden, 16 heads).
    pub fn gpt2_medium() -> Self {
        Self::preset(24, 1024, 16, 1024)
    }
    /// 774M parameters.
    pub fn gpt2_large() -> Self {
        Self::preset(36, 1280, 20, 1024)
    }
    /// 1.56B parameters.
    pub fn gpt2_xl() -> Self {
        Self::preset(48, 1600, 25, 1024)
    }

    /// A preset by name (`tiny`, `gpt2`, `gpt2-medium`, `gpt2-large`, `gpt2-xl`).
    pub fn from_preset(name: &str) -> Option<Self> {
        Some(match name {
            "tiny" => Self::tiny(),
            "gpt2" | "gpt2-small" => Self::gpt2(),
            "gpt2-medium" => Self::gpt2_medium(),
            "gpt2-large" => Self::gpt2_large(),
            "gpt2-xl" => Self::gpt2_xl(),
            _ => return None,
        })
    }
    pub const PRESETS: &'static str = "tiny, gpt2, gpt2-medium, gpt2-large, gpt2-xl";

    /// The parameter count (the tied LM head once) from the dimensions alone, with checked
    /// arithmetic: `None` when it overflows 64 bits. Unlike [`crate::model::params::parameter_count`] it
    /// builds no inventory, so [`Gpt2Config::validate`] can size any config, however absurd.
    pub fn checked_parameter_count(&self) -> Option<u64> {
        let n = |x: usize| u64::try_from(x).ok();
        let (v, p, c, l) = (n(self.vocab_size)?, n(self.n_positions)?, n(self.n_embd)?, n(self.n_layer)?);
        let inner = match self.n_inner {
            Some(i) => n(i)?,
            None => c.checked_mul(4)?,
        };
        // A block: c_attn (C x 3C + 3C) and c_proj (C x C + C), c_fc (C x inner + inner) and the
        // MLP's c_proj (inner x C + C), two LayerNorms (2C each).
        let attention = c.checked_mul(c)?.checked_mul(4)?.checked_add(c.checked_mul(4)?)?;
        let mlp = c.checked_mul(inner)?.checked_mul(2)?.checked_add(inner)?.checked_add(c)?;
        let block = attention.checked_add(mlp)?.checked_add(c.checked_mul(4)?)?;
        let embeddings = v.checked_add(p)?.checked_mul(c)?;
        block.checked_mul(l)?.checked_add(embeddings)?.checked_add(c.checked_mul(2)?)
    }

    /// The width of the residual stream (`n_embd`): the dimensions the rest of the engine reads
    /// go by the architecture-neutral names of HF's `PretrainedConfig` (GPT-2's `attribute_map`),
    /// so that nothing outside `model/` names GPT-2's fields.
    pub fn hidden_size(&self) -> usize {
        self.n_embd
    }
    /// Transformer blocks (`n_layer`).
    pub fn num_layers(&self) -> usize {
        self.n_layer
    }
    /// Attention heads (`n_head`); GPT-2 has as many key/value heads.
    pub fn num_heads(&self) -> usize {
        self.n_head
    }
    /// The context: learned positions (`n_positions`).
    pub fn max_positions(&self) -> usize {
        self.n_positions
    }
    /// Megatron's shape flags (`--num-layers`, `--hidden-size`, `--num-attention-heads`,
    /// `--max-position-embeddings`) over this config, each where given.
    pub fn with_shape(
        mut self,
        num_layers: Option<usize>,
        hidden_size: Option<usize>,
        num_heads: Option<usize>,
        max_positions: Option<usize>,
    ) -> Self {
        self.n_layer = num_layers.unwrap_or(self.n_layer);
        self.n_embd = hidden_size.unwrap_or(self.n_embd);
        self.n_head = num_heads.unwrap_or(self.n_head);
        self.n_positions = max_positions.unwrap_or(self.n_positions);
        self
    }
    /// How tensor parallelism cuts parameter `name` (this family's table: [`super::layout`]).
    pub fn split_of(&self, name: &str) -> crate::tensor_parallel::shard::Split {
        super::layout::split_of(name)
    }
    /// The block parameter `name` belongs to (see [`super::layout::block_of`]).
    pub fn block_of(&self, name: &str) -> anyhow::Result<Option<usize>> {
        super::layout::block_of(name)
    }
    pub fn inner_dim(&self) -> usize {
        self.n_inner.unwrap_or(4 * self.n_embd)
    }
    pub fn head_dim(&self) -> usize {
        self.n_embd / self.n_head
    }

    /// Rounds `vocab_size` up to a multiple of `divisor` (Megatron's
    /// `--make-vocab-size-divisible-by`); the padded size is what the checkpoint records.
    pub fn pad_vocab(&mut self, divisor: usize) {
        if divisor > 1 {
            self.vocab_size = self.vocab_size.div_ceil(divisor).saturating_mul(divisor);
        }
    }

    /// Rejects configurations this implementation would silently get wrong.
    pub fn validate(&self) -> anyhow::Result<()> {
        let positive = [
            ("vocab_size", self.vocab_size),
            ("n_positions", self.n_positions),
            ("n_embd", self.n_embd),
            ("n_layer", self.n_layer),
            ("n_head", self.n_head),
        ];
        for (name, v) in positive {
            if v == 0 {
                bail!("invalid GPT-2 config: {name} must be positive");
            }
        }
        // Before anything is sized from these dimensions: an absurd config.json or --hidden-size
        // must be this error, not an arithmetic overflow or an allocation abort later.
        let f32_bytes = self.checked_parameter_count().and_then(|n| n.checked_mul(4));
        if f32_bytes.is_none_or(|bytes| bytes > isize::MAX as u64) {
            bail!(
                "invalid GPT-2 config: vocab_size {}, n_positions {}, n_embd {}, n_layer {} make more parameters than any machine can address: check the dimensions",
                self.vocab_size,
                self.n_positions,
                self.n_embd,
                self.n_layer
            );
        }
        if !self.n_embd.is_multiple_of(self.n_head) {
            bail!("invalid GPT-2 config: n_embd {} is not divisible by n_head {}", self.n_embd, self.n_head);
        }
        if !matches!(self.activation_function.as_str(), "gelu_new" | "gelu_pytorch_tanh" | "gelu" | "gelu_fast") {
            bail!(
                "invalid GPT-2 config: activation_function {:?} is not supported (use gelu_new, gelu_pytorch_tanh or gelu)",
                self.activation_function
            );
        }
        for (name, p) in
            [("resid_pdrop", self.resid_pdrop), ("embd_pdrop", self.embd_pdrop), ("attn_pdrop", self.attn_pdrop)]
        {
            if !(0.0..1.0).contains(&p) {
                bail!("invalid GPT-2 config: {name} = {p} must be in [0, 1)");
            }
        }
        if !self.tie_word_embeddings {
            bail!("invalid GPT-2 config: tie_word_embeddings = false is not supported (GPT-2 ties the LM head to wte)");
        }
        if let Some(t) = self.extra.get("model_type").and_then(|v| v.as_str()) {
            if t != "gpt2" {
                bail!("config.json has model_type {t:?}: only GPT-2 models (model_type \"gpt2\") are supported");
            }
        }
        Ok(())
    }
}
