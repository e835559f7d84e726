//! GPT-2 with Hugging Face `GPT2LMHeadModel` semantics: learned position embeddings, pre-LayerNorm
//! blocks, `gelu_new`, causal self-attention, an LM head tied to `wte`, HF tensor names and the
//! Conv1D `(in, out)` weight layout. One implementation serves training (logits at every
//! position, dropout when a [`crate::kernels::ops::DropoutKey`] is given) and generation (pass a
//! [`KvCache`]). The config is `config.rs`, the layers (one struct each) `layers.rs`; this file is
//! the model over them.
//!
//! Shapes: B batch, T new tokens, P cached tokens, S = P + T keys, C `n_embd`, NH `n_head`,
//! HD = C / NH, V `vocab_size` (the embedding's real row count, Megatron padding included), L layers.
//!
//! Under tensor parallelism over T ranks ([`Gpt2::load_tensor_parallel`]) each block holds its
//! rank's slice of the weights (`crate::tensor_parallel::shard`): attention runs NH / T heads and
//! the MLP 4C / T columns, each entered through Megatron's `f` and left through its `g`.

mod config;
mod layers;
pub mod layout;

pub use self::config::{Gpt2Config, GPT2_EOS, GPT2_VOCAB};
pub use self::layers::{Attention, Block, Conv1D, Dropout, Gpt2Cache, KvCache, LayerNorm, Mlp};

use crate::comm::ProcessGroup;
use crate::kernels::ops;
use crate::model::positions::{causal_bias, Positions, MASKED};
use candle_core::{DType, Device, Result, Tensor, D};
use candle_nn::VarBuilder;
use std::sync::Arc;

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
    use crate::kernels::ops::DropoutKey;

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
