//! GPT-2's layers, one struct each with a plain `forward`: Hugging Face's Conv1D (`(in, out)`
//! weights, LoRA unfused beside it), LayerNorm, the dropout of a step, causal self-attention on
//! the packed `c_attn`, the `gelu_new` MLP and the pre-LayerNorm block; the KV caches of all layers.

use super::config::Gpt2Config;
use crate::comm::ProcessGroup;
use crate::kernels::ops::{self, DropoutKey};
use crate::tensor_parallel::layers::{column_parallel_linear, row_parallel_linear};
use candle_core::{Result, Tensor};
use candle_nn::VarBuilder;
use lora::LoraLinear;
use std::sync::Arc;

/// Hugging Face's Conv1D: a linear layer whose weight is stored `(in, out)`.
pub struct Conv1D {
    pub(super) weight: Tensor, // (in, out)
    pub(super) bias: Tensor,   // (out,)
    /// A LoRA adapter, unfused: `x W + b + scaling * (x A^T) B^T` (the `lora` crate).
    pub lora: Option<LoraLinear>,
}

impl Conv1D {
    pub(super) fn load(vb: VarBuilder, d_in: usize, d_out: usize) -> Result<Self> {
        Ok(Self { weight: vb.get((d_in, d_out), "weight")?, bias: vb.get(d_out, "bias")?, lora: None })
    }
    pub(super) fn forward(&self, x: &Tensor) -> Result<Tensor> {
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
    pub(super) fn gemm(&self, x: &Tensor) -> Result<Tensor> {
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
    pub(super) weight: Tensor,
    pub(super) bias: Tensor,
    pub(super) eps: f64,
}

impl LayerNorm {
    pub(super) fn load(vb: VarBuilder, size: usize, eps: f64) -> Result<Self> {
        Ok(Self { weight: vb.get(size, "weight")?, bias: vb.get(size, "bias")?, eps })
    }
    pub(super) fn forward(&self, x: &Tensor) -> Result<Tensor> {
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
    pub(super) c_attn: Conv1D,
    pub(super) c_proj: Conv1D,
    /// The heads this rank runs: all of them, or NH / T under tensor parallelism.
    pub(super) n_head: usize,
    pub(super) scale: f64,
    pub(super) tp: Option<Arc<ProcessGroup>>,
}

impl Attention {
    pub(super) fn load(vb: VarBuilder, cfg: &Gpt2Config, layer: usize, tp: Option<&Arc<ProcessGroup>>) -> Result<Self> {
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
    pub(super) fn forward(
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
    pub(super) c_fc: Conv1D,
    pub(super) c_proj: Conv1D,
    exact_gelu: bool,
    pub(super) tp: Option<Arc<ProcessGroup>>,
}

impl Mlp {
    pub(super) fn load(vb: VarBuilder, cfg: &Gpt2Config, tp: Option<&Arc<ProcessGroup>>) -> Result<Self> {
        let (c, inner) = (cfg.n_embd, cfg.inner_dim() / tp.map_or(1, |tp| tp.world()));
        Ok(Self {
            c_fc: Conv1D::load(vb.pp("c_fc"), c, inner)?,
            c_proj: Conv1D::load(vb.pp("c_proj"), inner, c)?,
            exact_gelu: cfg.activation_function == "gelu",
            tp: tp.cloned(),
        })
    }
    pub(super) fn forward(&self, x: &Tensor, dropout: Option<(&Dropout, u64)>) -> Result<Tensor> {
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
    pub(super) ln_1: LayerNorm,
    pub(super) attn: Attention,
    pub(super) ln_2: LayerNorm,
    pub(super) mlp: Mlp,
    pub(super) index: u64,
}

impl Block {
    pub(super) fn load(vb: VarBuilder, cfg: &Gpt2Config, index: usize, tp: Option<&Arc<ProcessGroup>>) -> Result<Self> {
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
    pub(super) fn forward_decoding_fused(
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
    pub(super) fn fuses_decoding(&self) -> bool {
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
