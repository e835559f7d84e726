//! GPT-2 with Hugging Face `GPT2LMHeadModel` semantics: learned position embeddings, pre-LayerNorm
//! blocks, `gelu_new`, causal self-attention, an LM head tied to `wte`, HF tensor names and the
//! Conv1D `(in, out)` weight layout. One implementation serves training (logits at every
//! position, dropout when a [`DropoutKey`] is given) and generation (pass a [`KvCache`]).
//!
//! Shapes: B batch, T new tokens, P cached tokens, S = P + T keys, C `n_embd`, NH `n_head`,
//! HD = C / NH, V `vocab_size` (the embedding's real row count, Megatron padding included), L layers.
//!
//! Under tensor parallelism over T ranks ([`Gpt2::load_tensor_parallel`]) each block holds its
//! rank's slice of the weights (`crate::tensor_parallel::shard`): attention runs NH / T heads and
//! the MLP 4C / T columns, each entered through Megatron's `f` and left through its `g`.

use crate::comm::ProcessGroup;
use crate::kernels::ops::{self, DropoutKey};
use crate::tensor_parallel::layers::{column_parallel_linear, row_parallel_linear};
use anyhow::bail;
use candle_core::{DType, Device, Result, Tensor, D};
use candle_nn::VarBuilder;
use lora::LoraLinear;
use serde::{Deserialize, Serialize};
use std::sync::Arc;

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

/// Hugging Face's Conv1D: a linear layer whose weight is stored `(in, out)`.
pub struct Conv1D {
    weight: Tensor, // (in, out)
    bias: Tensor,   // (out,)
    /// A LoRA adapter, unfused: `x W + b + scaling * (x A^T) B^T` (the `lora` crate).
    pub lora: Option<LoraLinear>,
}

impl Conv1D {
    fn load(vb: VarBuilder, d_in: usize, d_out: usize) -> Result<Self> {
        Ok(Self { weight: vb.get((d_in, d_out), "weight")?, bias: vb.get(d_out, "bias")?, lora: None })
    }
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let y = ops::linear(x, &self.weight, &self.bias)?; // (B, T, out)
        match &self.lora {
            Some(lora) => {
                let (b, t, c) = x.dims3()?;
                y + lora.forward(&x.reshape((b * t, c))?)?.reshape((b, t, ()))?
            }
            None => Ok(y),
        }
    }

    /// `x W` without the bias, (.., in) -> (.., out): for a decoding step's fused epilogues,
    /// which add it.
    fn gemm(&self, x: &Tensor) -> Result<Tensor> {
        ops::gemm_rows(x, &self.weight)
    }

    /// `c_attn`, `c_fc`: under tensor parallelism Megatron's `ColumnParallelLinear`
    /// ([`column_parallel_linear`]).
    fn forward_column_parallel(&self, x: &Tensor, tp: Option<&Arc<ProcessGroup>>) -> Result<Tensor> {
        match tp {
            None => self.forward(x),
            Some(tp) => column_parallel_linear(x, &self.weight, &self.bias, self.lora.as_ref(), tp),
        }
    }

    /// `c_proj`: under tensor parallelism Megatron's `RowParallelLinear` ([`row_parallel_linear`]).
    fn forward_rows(&self, x: &Tensor, tp: Option<&Arc<ProcessGroup>>) -> Result<Tensor> {
        match tp {
            None => self.forward(x),
            Some(tp) => row_parallel_linear(x, &self.weight, &self.bias, self.lora.as_ref(), tp),
        }
    }
}

pub struct LayerNorm {
    weight: Tensor,
    bias: Tensor,
    eps: f64,
}

impl LayerNorm {
    fn load(vb: VarBuilder, size: usize, eps: f64) -> Result<Self> {
        Ok(Self { weight: vb.get(size, "weight")?, bias: vb.get(size, "bias")?, eps })
    }
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        ops::layer_norm(x, &self.weight, &self.bias, self.eps)
    }

    /// The new residual `x + (y + b)` and this LayerNorm of it, in one launch (a decoding step
    /// on a GPU).
    fn after_bias_and_residual(&self, y: &Tensor, b: &Tensor, x: &Tensor) -> Result<(Tensor, Tensor)> {
        ops::bias_residual_layer_norm(y, b, x, [&self.weight, &self.bias], self.eps)
    }
}

/// Dropout probabilities and the key of the step being trained; `None` in evaluation.
#[derive(Clone, Copy, Debug)]
pub struct Dropout {
    pub key: DropoutKey,
    pub embd: f64,
    pub attn: f64,
    pub resid: f64,
}

impl Dropout {
    pub fn from_config(cfg: &Gpt2Config, key: DropoutKey) -> Self {
        Self { key, embd: cfg.embd_pdrop, attn: cfg.attn_pdrop, resid: cfg.resid_pdrop }
    }
}

/// One layer's keys and values, preallocated for `max_len` positions on first use.
pub use crate::model::kv_cache::KvCache;

/// The KV caches of all layers.
pub struct Gpt2Cache {
    pub layers: Vec<KvCache>,
}

impl Gpt2Cache {
    pub fn new(cfg: &Gpt2Config, max_len: usize) -> Self {
        Self { layers: (0..cfg.n_layer).map(|_| KvCache::new(max_len)).collect() }
    }
    /// Rewinds every layer for the next rollout, keeping the buffers.
    pub fn reset(&mut self) {
        self.layers.iter_mut().for_each(KvCache::reset);
    }
    /// Frees every layer's buffers.
    pub fn release(&mut self) {
        self.layers.iter_mut().for_each(KvCache::release);
    }
    /// Bytes the buffers hold.
    pub fn allocated_bytes(&self) -> usize {
        self.layers.iter().map(KvCache::allocated_bytes).sum()
    }
    /// Positions each layer can hold.
    pub fn capacity(&self) -> usize {
        self.layers.first().map_or(0, KvCache::capacity)
    }
    /// Tokens already cached (P).
    pub fn len(&self) -> usize {
        self.layers.first().map_or(0, |c| c.current_seq_len())
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Sets every layer's cached positions to `len` (after decoding steps made at positions on
    /// the device).
    pub fn set_len(&mut self, len: usize) -> Result<()> {
        self.layers.iter_mut().try_for_each(|c| c.set_len(len))
    }
}

pub struct Attention {
    c_attn: Conv1D,
    c_proj: Conv1D,
    /// The heads this rank runs: all of them, or NH / T under tensor parallelism.
    n_head: usize,
    scale: f64,
    tp: Option<Arc<ProcessGroup>>,
}

impl Attention {
    fn load(vb: VarBuilder, cfg: &Gpt2Config, layer: usize, tp: Option<&Arc<ProcessGroup>>) -> Result<Self> {
        let c = cfg.n_embd;
        let ranks = tp.map_or(1, |tp| tp.world());
        let mut scale = if cfg.scale_attn_weights { 1.0 / (cfg.head_dim() as f64).sqrt() } else { 1.0 };
        if cfg.scale_attn_by_inverse_layer_idx {
            scale /= (layer + 1) as f64;
        }
        Ok(Self {
            c_attn: Conv1D::load(vb.pp("c_attn"), c, 3 * c / ranks)?,
            c_proj: Conv1D::load(vb.pp("c_proj"), c / ranks, c)?,
            n_head: cfg.n_head / ranks,
            scale,
            tp: tp.cloned(),
        })
    }

    /// `bias` is the additive attention mask (B or 1, 1, T, S): 0 where allowed, a large negative
    /// number where masked (causal and padding).
    fn forward(
        &self,
        x: &Tensor,
        bias: &Tensor,
        cache: Option<&mut KvCache>,
        dropout: Option<(&Dropout, u64)>,
    ) -> Result<Tensor> {
        let tp = self.tp.as_ref();
        let qkv = self.c_attn.forward_column_parallel(x, tp)?; // (B, T, 3C), or this rank's heads'
        let y = match cache {
            None => {
                // Each rank drops its own heads' probabilities: a stream per TP rank.
                let site = tp.map_or(0, |tp| ATTENTION_SITE_OF_TP_RANK + tp.rank() as u64);
                let mask = dropout.filter(|(d, _)| d.attn > 0.0).map(|(d, layer)| d.key.mask(d.attn, layer, site));
                ops::attention(&qkv, bias, self.n_head, self.scale, mask)? // (B, T, C)
            }
            Some(cache) if ops::decode_attention_on_cuda(&qkv, bias, self.n_head) => {
                // Generation on a GPU: into the cache and over it in two launches.
                let (kv, start) = cache.append_qkv(&qkv, None, self.n_head)?;
                ops::decode_attention(&qkv, None, &kv, start, bias, self.n_head, self.scale)?
                // (B, T, C)
            }
            Some(cache) => {
                // Generation: the new tokens' keys and values join the cached ones (no dropout).
                let (q, k, v) = ops::split_heads(&qkv, self.n_head)?; // (B, NH, T, HD)
                let (k, v) = cache.append(&k, &v)?; // (B, NH, S, HD)
                ops::cached_attention(&q, &k, &v, bias, self.scale)? // (B, T, C)
            }
        };
        let y = self.c_proj.forward_rows(&y, tp)?;
        match dropout {
            Some((d, layer)) => ops::dropout(&y, d.resid, &d.key, layer, 1),
            None => Ok(y),
        }
    }
}

/// The dropout site of tensor-parallel rank r's attention probabilities is this plus r (sites 0,
/// 1 and 2 are the one-rank attention and the two residual dropouts).
const ATTENTION_SITE_OF_TP_RANK: u64 = 1 << 16;

pub struct Mlp {
    c_fc: Conv1D,
    c_proj: Conv1D,
    exact_gelu: bool,
    tp: Option<Arc<ProcessGroup>>,
}

impl Mlp {
    fn load(vb: VarBuilder, cfg: &Gpt2Config, tp: Option<&Arc<ProcessGroup>>) -> Result<Self> {
        let (c, inner) = (cfg.n_embd, cfg.inner_dim() / tp.map_or(1, |tp| tp.world()));
        Ok(Self {
            c_fc: Conv1D::load(vb.pp("c_fc"), c, inner)?,
            c_proj: Conv1D::load(vb.pp("c_proj"), inner, c)?,
            exact_gelu: cfg.activation_function == "gelu",
            tp: tp.cloned(),
        })
    }
    fn forward(&self, x: &Tensor, dropout: Option<(&Dropout, u64)>) -> Result<Tensor> {
        let tp = self.tp.as_ref();
        let h = ops::gelu(&self.c_fc.forward_column_parallel(x, tp)?, self.exact_gelu)?; // (B, T, 4C [/ T])
        let y = self.c_proj.forward_rows(&h, tp)?; // (B, T, C)
        match dropout {
            Some((d, layer)) => ops::dropout(&y, d.resid, &d.key, layer, 2),
            None => Ok(y),
        }
    }
}

pub struct Block {
    ln_1: LayerNorm,
    attn: Attention,
    ln_2: LayerNorm,
    mlp: Mlp,
    index: u64,
}

impl Block {
    fn load(vb: VarBuilder, cfg: &Gpt2Config, index: usize, tp: Option<&Arc<ProcessGroup>>) -> Result<Self> {
        let eps = cfg.layer_norm_epsilon;
        Ok(Self {
            ln_1: LayerNorm::load(vb.pp("ln_1"), cfg.n_embd, eps)?,
            attn: Attention::load(vb.pp("attn"), cfg, index, tp)?,
            ln_2: LayerNorm::load(vb.pp("ln_2"), cfg.n_embd, eps)?,
            mlp: Mlp::load(vb.pp("mlp"), cfg, tp)?,
            index: index as u64,
        })
    }

    /// The block's Conv1D linears under their HF module names (`h.0.attn.c_attn`, ...).
    pub fn linears_mut(&mut self) -> [(String, &mut Conv1D); 4] {
        let i = self.index;
        [
            (format!("h.{i}.attn.c_attn"), &mut self.attn.c_attn),
            (format!("h.{i}.attn.c_proj"), &mut self.attn.c_proj),
            (format!("h.{i}.mlp.c_fc"), &mut self.mlp.c_fc),
            (format!("h.{i}.mlp.c_proj"), &mut self.mlp.c_proj),
        ]
    }

    /// A decoding step's block on a GPU in nine launches instead of fifteen, from the residual
    /// stream `x` and `h = ln_1(x)`, which the previous block's last launch made: c_attn's bias
    /// is added inside the cache append and the attention, c_fc's inside the GELU, and c_proj's
    /// inside the launch that adds to the residual and makes the next LayerNorm (`next_ln`: the
    /// next block's ln_1, or ln_f). The values of [`Self::forward`] on a GPU, each rounded where
    /// that rounds it (tested). Returns the new residual stream and `next_ln` of it.
    /// With `start_at` (a u32 on the device: a step captured as a CUDA graph), the new tokens
    /// go to the cache at the position it holds and `bias` spans the cache's capacity.
    fn forward_decoding_fused(
        &self,
        x: &Tensor,
        h: &Tensor,
        bias: &Tensor,
        cache: &mut KvCache,
        start_at: Option<&Tensor>,
        next_ln: &LayerNorm,
    ) -> Result<(Tensor, Tensor)> {
        let (attn, mlp) = (&self.attn, &self.mlp);
        let qkv = attn.c_attn.gemm(h)?; // (B, T, 3C), without the bias
        let qkv_bias = Some(&attn.c_attn.bias);
        let (kv, start) = match start_at {
            None => {
                let (kv, start) = cache.append_qkv(&qkv, qkv_bias, attn.n_head)?;
                (kv, ops::CacheStart::Host(start))
            }
            Some(at) => (cache.append_qkv_at(&qkv, qkv_bias, attn.n_head, at)?, ops::CacheStart::Device(at.clone())),
        };
        let y = ops::decode_attention(&qkv, qkv_bias, &kv, start, bias, attn.n_head, attn.scale)?; // (B, T, C)
        let (x, h) = self.ln_2.after_bias_and_residual(&attn.c_proj.gemm(&y)?, &attn.c_proj.bias, x)?;
        let g = ops::bias_gelu(&mlp.c_fc.gemm(&h)?, &mlp.c_fc.bias)?; // (B, T, 4C)
        next_ln.after_bias_and_residual(&mlp.c_proj.gemm(&g)?, &mlp.c_proj.bias, &x)
    }

    /// Whether [`Self::forward_decoding_fused`] computes this block: GPT-2's tanh GELU and no
    /// unfused LoRA adapter.
    fn fuses_decoding(&self) -> bool {
        let linears = [&self.attn.c_attn, &self.attn.c_proj, &self.mlp.c_fc, &self.mlp.c_proj];
        !self.mlp.exact_gelu && linears.iter().all(|l| l.lora.is_none())
    }

    pub fn forward(
        &self,
        x: &Tensor,
        bias: &Tensor,
        cache: Option<&mut KvCache>,
        dropout: Option<&Dropout>,
    ) -> Result<Tensor> {
        let drop = dropout.map(|d| (d, self.index));
        let x = (x + self.attn.forward(&self.ln_1.forward(x)?, bias, cache, drop)?)?;
        &x + self.mlp.forward(&self.ln_2.forward(&x)?, drop)?
    }
}

/// Where the tokens of a forward pass sit: positions and which keys may be attended to.
#[derive(Default, Clone, Copy)]
pub struct Positions<'a> {
    /// (B, T) u32 position ids; default `P..P+T` for every row.
    pub position_ids: Option<&'a Tensor>,
    /// (B, S) with 1 for real tokens and 0 for padding, over cached and new tokens alike. Read
    /// on the host, where the additive bias is built: on a GPU keep it a CPU tensor (one copy
    /// of the bias to the device, instead of the mask there and back first).
    pub attention_mask: Option<&'a Tensor>,
}

/// The mask value: large enough that exp() underflows to 0, finite so fully masked (padding)
/// rows stay finite instead of NaN.
pub const MASKED: f32 = -1e9;

/// The causal bias (1, 1, T, S) of T new tokens after `past` cached ones, without padding: 0 where
/// j <= past + i, else [`MASKED`]. The last one made is kept and handed out again (read-only), so
/// that a training step at a fixed length neither fills T x S values on the host nor uploads them.
fn causal_bias(t: usize, past: usize, device: &Device) -> Result<Tensor> {
    type Kept = Option<((usize, usize, candle_core::DeviceLocation), Tensor)>;
    static LAST: std::sync::Mutex<Kept> = std::sync::Mutex::new(None);
    let key = (t, past, device.location());
    let mut last =
        LAST.lock().map_err(|_| candle_core::Error::Msg("the causal bias cache's lock is poisoned".into()))?;
    if let Some((k, bias)) = last.as_ref() {
        if *k == key && bias.device().same_device(device) {
            return Ok(bias.clone());
        }
    }
    let s = past + t;
    let bias: Vec<f32> = (0..t).flat_map(|i| (0..s).map(move |j| if j <= past + i { 0.0 } else { MASKED })).collect();
    let bias = Tensor::from_vec(bias, (1, 1, t, s), device)?;
    *last = Some((key, bias.clone()));
    Ok(bias)
}

pub struct Gpt2 {
    wte: Tensor, // (V, C); under tensor parallelism this rank's rows of the padded vocabulary
    wpe: Tensor, // (n_positions, C)
    pub h: Vec<Block>,
    ln_f: LayerNorm,
    pub cfg: Gpt2Config,
    /// Losses and log-probs read fp32 logits in an fp16/bf16 model (DS-Chat
    /// `--compute_fp32_loss`); off, they are computed in the compute dtype.
    pub fp32_loss: bool,
    /// The tensor-parallel group this rank's slices belong to.
    tp: Option<Arc<ProcessGroup>>,
}

/// The gradients of `wte` and `wpe` (in that order) from `grad`, the gradient of
/// [`Gpt2::embed`]'s output for `ids` (B, T) at positions `pos` (no cache), without the
/// tables: the lookups' backward reads only the ids and the gradient reaching them. The sum and
/// dropout run on leaves standing for the lookups' outputs (their backward reads no values);
/// the same bits as `embed`'s own backward. ZeRO-3's embedding backward, which so gathers no
/// weights.
pub fn embedding_gradients(
    cfg: &Gpt2Config,
    ids: &Tensor,
    pos: &Positions,
    dropout: Option<&Dropout>,
    grad: &Tensor,
) -> Result<(Tensor, Tensor)> {
    let (b, t) = ids.dims2()?;
    let (c, dtype, device) = (cfg.n_embd, grad.dtype(), grad.device());
    let tok = candle_core::Var::zeros((b, t, c), dtype, device)?;
    let rows = if pos.position_ids.is_some() { b } else { 1 };
    let pos_emb = candle_core::Var::zeros((rows, t, c), dtype, device)?;
    let x = tok.as_tensor().broadcast_add(pos_emb.as_tensor())?;
    let x = match dropout {
        Some(d) => ops::dropout(&x, d.embd, &d.key, u64::MAX, 0)?,
        None => x,
    };
    let store = x.mul(grad)?.sum_all()?.backward()?;
    let reached = |leaf: &candle_core::Var| {
        store
            .get(leaf.as_tensor())
            .cloned()
            .ok_or_else(|| candle_core::Error::Msg("no gradient reached the embeddings".into()))
    };
    let dwte = ops::embedding_grad(cfg.vocab_size, &ids.flatten_all()?, &reached(&tok)?.reshape((b * t, c))?)?;
    let positions = match pos.position_ids {
        Some(p) => p.flatten_all()?,
        None => Tensor::arange(0u32, t as u32, device)?,
    };
    let dwpe = ops::embedding_grad(cfg.n_positions, &positions, &reached(&pos_emb)?.reshape((rows * t, c))?)?;
    Ok((dwte, dwpe))
}

impl Gpt2 {
    /// Builds the model from tensors named as in HF without the `transformer.` prefix
    /// (`wte.weight`, `h.0.attn.c_attn.weight`, ...).
    pub fn load(vb: VarBuilder, cfg: &Gpt2Config) -> Result<Self> {
        Self::load_with(vb, cfg, None)
    }

    /// The model of one rank of the tensor-parallel group `tp`, from tensors named as for
    /// [`Self::load`] holding this rank's slices (`crate::tensor_parallel::shard::shard`).
    /// `cfg.vocab_size` stays the real vocabulary: the embedding slices hold the vocabulary padded
    /// to 128 x T rows, and the padding takes no probability.
    pub fn load_tensor_parallel(vb: VarBuilder, cfg: &Gpt2Config, tp: &Arc<ProcessGroup>) -> Result<Self> {
        if let Err(e) = crate::tensor_parallel::shard::check_divides(cfg.n_head, cfg.inner_dim(), tp.world()) {
            candle_core::bail!("{e}");
        }
        Self::load_with(vb, cfg, Some(tp))
    }

    fn load_with(vb: VarBuilder, cfg: &Gpt2Config, tp: Option<&Arc<ProcessGroup>>) -> Result<Self> {
        let c = cfg.n_embd;
        let vocab_rows = match tp {
            Some(tp) => crate::tensor_parallel::vocab::padded_vocab_size(cfg.vocab_size, tp.world()) / tp.world(),
            None => cfg.vocab_size,
        };
        Ok(Self {
            wte: vb.get((vocab_rows, c), "wte.weight")?,
            wpe: vb.get((cfg.n_positions, c), "wpe.weight")?,
            h: (0..cfg.n_layer).map(|i| Block::load(vb.pp("h").pp(i), cfg, i, tp)).collect::<Result<_>>()?,
            ln_f: LayerNorm::load(vb.pp("ln_f"), c, cfg.layer_norm_epsilon)?,
            cfg: cfg.clone(),
            fp32_loss: false,
            tp: tp.cloned(),
        })
    }

    /// Block `index` alone, from tensors named as for [`Self::load`] (`h.<index>.attn...`), or
    /// from this rank's slices of them under `tp`: ZeRO stage 3 builds each block from its
    /// gathered weights when it runs.
    pub fn load_block(vb: VarBuilder, cfg: &Gpt2Config, index: usize, tp: Option<&Arc<ProcessGroup>>) -> Result<Block> {
        Block::load(vb.pp("h").pp(index), cfg, index, tp)
    }

    /// Token plus position embeddings, with embedding dropout in training. (B, T, C)
    pub fn embed(&self, ids: &Tensor, pos: &Positions, past: usize, dropout: Option<&Dropout>) -> Result<Tensor> {
        let (b, t) = ids.dims2()?;
        let c = self.cfg.n_embd;
        let tok = match &self.tp {
            Some(tp) => crate::tensor_parallel::vocab::vocab_parallel_embedding(ids, &self.wte, tp)?,
            None => ops::embedding(&self.wte, &ids.flatten_all()?)?.reshape((b, t, c))?,
        };
        let pos_emb = match pos.position_ids {
            Some(p) => ops::embedding(&self.wpe, &p.flatten_all()?)?.reshape((b, t, c))?,
            None => {
                let p = Tensor::arange(past as u32, (past + t) as u32, ids.device())?;
                ops::embedding(&self.wpe, &p)?.unsqueeze(0)? // (1, T, C)
            }
        };
        let x = tok.broadcast_add(&pos_emb)?;
        match dropout {
            Some(d) => ops::dropout(&x, d.embd, &d.key, u64::MAX, 0),
            None => Ok(x),
        }
    }

    /// The additive attention mask (B or 1, 1, T, S) for T new tokens after P cached ones.
    pub fn attention_bias(&self, b: usize, t: usize, past: usize, pos: &Positions, device: &Device) -> Result<Tensor> {
        let s = past + t;
        let keys: Option<Vec<Vec<f32>>> = match pos.attention_mask {
            Some(m) => Some(m.to_dtype(DType::F32)?.to_vec2()?),
            None => return causal_bias(t, past, device),
        };
        let rows = if keys.is_some() { b } else { 1 };
        let mut bias = vec![0f32; rows * t * s];
        for r in 0..rows {
            for i in 0..t {
                for j in 0..s {
                    let causal = j <= past + i;
                    let real = keys.as_ref().is_none_or(|k| k[r][j] != 0.0);
                    if !(causal && real) {
                        bias[(r * t + i) * s + j] = MASKED;
                    }
                }
            }
        }
        Tensor::from_vec(bias, (rows, 1, t, s), device)
    }

    /// The dtype the model computes in (its weights').
    pub fn dtype(&self) -> DType {
        self.wte.dtype()
    }

    /// What a loss or log-softmax reads from a head's output `x`: fp32 with
    /// [`Self::fp32_loss`], else `x` in the compute dtype.
    pub fn loss_input(&self, x: &Tensor) -> Result<Tensor> {
        if self.fp32_loss {
            x.to_dtype(DType::F32)
        } else {
            Ok(x.clone())
        }
    }

    /// The final LayerNorm: the trunk's output that every head reads. (.., C) -> (.., C)
    pub fn final_norm(&self, x: &Tensor) -> Result<Tensor> {
        self.ln_f.forward(x)
    }

    /// Final LayerNorm and the tied LM head, for hidden states of any leading shape:
    /// (B, T, C) -> (B, T, V), or (N, C) -> (N, V) for selected positions.
    pub fn lm_head(&self, x: &Tensor) -> Result<Tensor> {
        let dims = x.dims().to_vec();
        let c = self.cfg.n_embd;
        let x = self.ln_f.forward(x)?.reshape(((), c))?; // (rows, C): one gemm for all positions
        let logits = match &self.tp {
            Some(tp) => {
                use crate::tensor_parallel::vocab::{gather_vocab_parallel_logits, vocab_parallel_logits};
                let local = vocab_parallel_logits(&x, &self.wte, self.cfg.vocab_size, tp)?;
                gather_vocab_parallel_logits(&local, self.cfg.vocab_size, tp)?.to_dtype(x.dtype())?
            }
            None => ops::lm_head_logits(&x, &self.wte)?, // (rows, V)
        };
        let mut out_dims = dims;
        *out_dims.last_mut().expect("hidden states have a last dimension") = self.cfg.vocab_size;
        logits.reshape(out_dims)
    }

    /// Every Conv1D linear under its HF module name (`h.0.attn.c_attn`, `h.0.mlp.c_proj`): where
    /// LoRA adapters attach.
    pub fn linears_mut(&mut self) -> impl Iterator<Item = (String, &mut Conv1D)> {
        self.h.iter_mut().flat_map(Block::linears_mut)
    }

    /// Embeddings and all blocks, before `ln_f`: the trunk's last hidden state. (B, T, C)
    pub fn forward_blocks(
        &self,
        ids: &Tensor,
        pos: &Positions,
        mut cache: Option<&mut Gpt2Cache>,
        dropout: Option<&Dropout>,
    ) -> Result<Tensor> {
        let (b, t) = ids.dims2()?;
        let past = cache.as_ref().map_or(0, |c| c.len());
        if past + t > self.cfg.n_positions {
            candle_core::bail!(
                "sequence of {} tokens exceeds the model's n_positions {}",
                past + t,
                self.cfg.n_positions
            );
        }
        let bias = self.attention_bias(b, t, past, pos, ids.device())?;
        if let Some(cache) = cache.as_deref_mut().filter(|_| self.decodes_fused_on_cuda(&bias, dropout)) {
            return self.forward_blocks_decoding_fused(ids, pos, past, &bias, cache, None);
        }
        let mut x = self.embed(ids, pos, past, dropout)?;
        for (i, block) in self.h.iter().enumerate() {
            let layer_cache = cache.as_mut().map(|c| &mut c.layers[i]);
            x = block.forward(&x, &bias, layer_cache, dropout)?;
        }
        Ok(x)
    }

    /// Whether a decoding step's blocks take [`Block::forward_decoding_fused`]: on a GPU (the
    /// decoding kernels' dtypes, heads and mask), without dropout, tensor parallelism, the exact
    /// GELU or unfused LoRA adapters.
    pub(crate) fn decodes_fused_on_cuda(&self, bias: &Tensor, dropout: Option<&Dropout>) -> bool {
        dropout.is_none()
            && ops::fused_decoding_on_cuda(&self.wte, bias, self.cfg.head_dim())
            && self.fuses_decoding_blocks()
    }

    /// Whether every block computes a decoding step with the fused ops (no tensor parallelism,
    /// GPT-2's tanh GELU, no unfused LoRA adapter), whatever the device.
    pub(crate) fn fuses_decoding_blocks(&self) -> bool {
        self.tp.is_none() && self.h.iter().all(Block::fuses_decoding)
    }

    /// The blocks of a decoding step on a GPU ([`Block::forward_decoding_fused`]), after the
    /// embeddings and ln_1 in one launch when the position ids are given: the last block's
    /// residual stream, as [`Self::forward_blocks`] returns it (its last launch also makes ln_f
    /// of it, which `lm_head` makes again).
    fn forward_blocks_decoding_fused(
        &self,
        ids: &Tensor,
        pos: &Positions,
        past: usize,
        bias: &Tensor,
        cache: &mut Gpt2Cache,
        start_at: Option<&Tensor>,
    ) -> Result<Tensor> {
        let Some(first) = self.h.first() else { return self.embed(ids, pos, past, None) };
        let (mut x, mut h) = match pos.position_ids {
            Some(positions) if ids.dtype() == DType::U32 && positions.dtype() == DType::U32 => {
                let ln_1 = [&first.ln_1.weight, &first.ln_1.bias];
                ops::embed_layer_norm(ids, positions, [&self.wte, &self.wpe], ln_1, first.ln_1.eps)?
            }
            _ => {
                let x = self.embed(ids, pos, past, None)?;
                let h = first.ln_1.forward(&x)?;
                (x, h)
            }
        };
        for (i, (block, layer_cache)) in self.h.iter().zip(cache.layers.iter_mut()).enumerate() {
            let next_ln = self.h.get(i + 1).map_or(&self.ln_f, |next| &next.ln_1);
            (x, h) = block.forward_decoding_fused(&x, &h, bias, layer_cache, start_at, next_ln)?;
        }
        Ok(x)
    }

    /// A decoding step of one new token a row (`ids` and `positions` (B, 1) u32) at the position
    /// of the KV cache that `start_at` ((1,) u32) holds on the device, with `bias` (B, 1, 1,
    /// capacity) f32 over the cache's positions: nothing in it depends on a number the host
    /// knows, so one capture of it as a CUDA graph serves every step
    /// (generation/decode_graph.rs). The cache's length is left as it is ([`Gpt2Cache::set_len`]
    /// after the steps). The last hidden state (B, 1, C), as [`Self::forward_blocks`]'s.
    pub fn decoding_step_at(
        &self,
        ids: &Tensor,
        positions: &Tensor,
        start_at: &Tensor,
        bias: &Tensor,
        cache: &mut Gpt2Cache,
    ) -> Result<Tensor> {
        // On the CPU in f32 too (its forwards of the fused ops: the graph's bookkeeping tested
        // without a GPU).
        let on_cpu = bias.device().is_cpu() && self.dtype() == DType::F32 && self.fuses_decoding_blocks();
        if !on_cpu && !self.decodes_fused_on_cuda(bias, None) {
            candle_core::bail!("a decoding step at a position in memory runs the fused decoding blocks");
        }
        let pos = Positions { position_ids: Some(positions), attention_mask: None };
        self.forward_blocks_decoding_fused(ids, &pos, 0, bias, cache, Some(start_at))
    }

    /// Logits at every position: (B, T) ids -> (B, T, V).
    pub fn forward(
        &self,
        ids: &Tensor,
        pos: &Positions,
        cache: Option<&mut Gpt2Cache>,
        dropout: Option<&Dropout>,
    ) -> Result<Tensor> {
        let x = self.forward_blocks(ids, pos, cache, dropout)?;
        self.lm_head(&x)
    }

    /// Mean next-token cross-entropy of `ids` (B, T) against `targets` (B, T).
    pub fn lm_loss(&self, ids: &Tensor, targets: &Tensor, dropout: Option<&Dropout>) -> Result<Tensor> {
        let hidden = self.forward_blocks(ids, &Positions::default(), None, dropout)?; // (B, T, C)
        self.lm_head_loss(&hidden, &targets.flatten_all()?)
    }

    /// Mean cross-entropy of the LM head on hidden states before `ln_f` ((.., C), N rows in all)
    /// against `targets` (N,): the final LayerNorm, the tied head and the loss in one. In f32 on
    /// the CPU the (N, V) logits never become a tensor; in fp16/bf16 they do, in the compute
    /// dtype, and the loss reads them through [`Self::loss_input`].
    pub fn lm_head_loss(&self, hidden: &Tensor, targets: &Tensor) -> Result<Tensor> {
        let x = self.ln_f.forward(hidden)?.reshape(((), self.cfg.n_embd))?; // (N, C)
        if let Some(tp) = &self.tp {
            use crate::tensor_parallel::vocab::vocab_parallel_cross_entropy;
            return vocab_parallel_cross_entropy(&x, &self.wte, targets, self.cfg.vocab_size, tp);
        }
        if self.dtype() == DType::F32 {
            ops::lm_head_cross_entropy_rows(&x, &self.wte, targets)?.mean_all()
        } else {
            ops::cross_entropy(&self.loss_input(&x.matmul(&self.wte.t()?)?)?, targets)
        }
    }

    /// The log-probability (f32, differentiable) of each next token `next` (B, T) u32 after
    /// hidden states before `ln_f` (B, T, C), and with `with_entropy` the entropy of each
    /// position's distribution (f32, detached): what PPO's losses and diagnostics read, of the
    /// distribution softmax(logits / `temperature`) that rollouts sample from. Under tensor
    /// parallelism from the vocabulary slices, without the full logits on any rank.
    pub fn next_token_log_probs(
        &self,
        hidden: &Tensor,
        next: &Tensor,
        with_entropy: bool,
        temperature: f64,
    ) -> Result<(Tensor, Option<Tensor>)> {
        let (b, t) = next.dims2()?;
        if let Some(tp) = &self.tp {
            let x = self.ln_f.forward(hidden)?.reshape(((), self.cfg.n_embd))?; // (B T, C)
            let out = crate::tensor_parallel::vocab::vocab_parallel_log_probs(
                &x,
                &self.wte,
                &next.flatten_all()?,
                self.cfg.vocab_size,
                tp,
                with_entropy,
                temperature,
            )?;
            let entropy = out.entropy.map(|e| e.reshape((b, t))).transpose()?;
            return Ok((out.log_probs.reshape((b, t))?, entropy));
        }
        let logits = crate::tensor_parallel::vocab::tempered(self.loss_input(&self.lm_head(hidden)?)?, temperature)?;
        let logp_all = ops::log_softmax_last_dim(&logits)?; // (B, T, V)
        let logp = logp_all.gather(&next.unsqueeze(D::Minus1)?.contiguous()?, D::Minus1)?.squeeze(D::Minus1)?;
        let entropy = match with_entropy {
            false => None,
            true => {
                let detached = logp_all.detach().to_dtype(DType::F32)?;
                Some((detached.exp()? * &detached)?.sum(D::Minus1)?.neg()?)
            }
        };
        Ok((logp.to_dtype(DType::F32)?, entropy))
    }

    /// Whether this model is one rank's slices of a tensor-parallel model.
    pub fn is_tensor_parallel(&self) -> bool {
        self.tp.is_some()
    }

    /// Mean cross-entropy over selected positions only: `rows` (N,) u32 indexes the flattened
    /// (B*T) positions of `hidden` (B, T, C) and `targets` (N,) holds their next tokens. The LM
    /// head, by far the costliest layer of a small GPT-2, runs on the N rows alone.
    pub fn lm_loss_at(&self, hidden: &Tensor, rows: &Tensor, targets: &Tensor) -> Result<Tensor> {
        let c = self.cfg.n_embd;
        let selected = hidden.reshape(((), c))?.index_select(rows, 0)?; // (N, C)
        self.lm_head_loss(&selected, targets)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The tables' gradients from the output's gradient alone are the embeddings' own backward,
    /// bit for bit: f32 and bf16, with dropout, with default positions and with position ids
    /// (ids repeated, so rows add up).
    #[test]
    fn embedding_gradients_without_the_tables_are_the_embeddings_backward() -> anyhow::Result<()> {
        let cfg = Gpt2Config { embd_pdrop: 0.25, ..Gpt2Config::tiny() };
        let dev = Device::Cpu;
        let ids = Tensor::new(&[[3u32, 7, 3, 1], [7, 7, 0, 3]], &dev)?;
        let position_ids = Tensor::new(&[[0u32, 1, 2, 3], [5, 6, 7, 8]], &dev)?;
        let dropout = Dropout::from_config(&cfg, DropoutKey { seed: 11, step: 2, micro_batch: 0 });
        for dtype in [DType::F32, DType::BF16] {
            let store = crate::model::params::ParamStore::init(&cfg, 5, &dev)?.compute_copy(dtype)?;
            let model = store.model(&cfg)?;
            let grad = Tensor::randn(0f32, 1.0, (2, 4, cfg.n_embd), &dev)?.to_dtype(dtype)?;
            for pos in [Positions::default(), Positions { position_ids: Some(&position_ids), attention_mask: None }] {
                for dropout in [None, Some(&dropout)] {
                    let backward = model.embed(&ids, &pos, 0, dropout)?.mul(&grad)?.sum_all()?.backward()?;
                    let (dwte, dwpe) = embedding_gradients(&cfg, &ids, &pos, dropout, &grad)?;
                    for (name, got) in [("wte.weight", dwte), ("wpe.weight", dwpe)] {
                        let want = backward.get(store.get(name).unwrap().as_tensor()).unwrap();
                        let bits = |t: &Tensor| -> anyhow::Result<Vec<u32>> {
                            Ok(t.to_dtype(DType::F32)?
                                .flatten_all()?
                                .to_vec1::<f32>()?
                                .iter()
                                .map(|x| x.to_bits())
                                .collect())
                        };
                        assert_eq!(got.dims(), want.dims());
                        assert_eq!(bits(&got)?, bits(want)?, "{name}, {dtype:?}, dropout {}", dropout.is_some());
                    }
                }
            }
        }
        Ok(())
    }

    #[test]
    fn the_checked_parameter_count_matches_the_inventory_and_refuses_overflow() {
        let odd =
            Gpt2Config { n_layer: 3, n_embd: 24, n_head: 4, n_positions: 40, vocab_size: 77, ..Gpt2Config::tiny() };
        let wide_mlp = Gpt2Config { n_inner: Some(50), ..odd.clone() };
        for cfg in [Gpt2Config::from_preset("gpt2").unwrap(), odd, wide_mlp] {
            assert_eq!(cfg.checked_parameter_count(), Some(crate::model::params::parameter_count(&cfg) as u64));
        }
        let huge = Gpt2Config { n_embd: usize::MAX / 2, ..Gpt2Config::tiny() };
        assert_eq!(huge.checked_parameter_count(), None);
        for absurd in [
            huge,
            Gpt2Config { n_embd: 1 << 32, n_head: 1, ..Gpt2Config::tiny() },
            Gpt2Config { vocab_size: usize::MAX, ..Gpt2Config::tiny() },
            Gpt2Config { n_layer: 1 << 50, ..Gpt2Config::tiny() },
        ] {
            let err = absurd.validate().unwrap_err().to_string();
            assert!(err.contains("more parameters than any machine can address"), "{err}");
        }
    }
}
