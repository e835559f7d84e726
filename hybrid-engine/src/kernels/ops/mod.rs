//! The ops the model calls, and the dispatch that chooses how each runs.
//!
//! candle 0.11's fused `softmax_last_dim`, `ops::layer_norm` and `nn::LayerNorm` have no backward:
//! gradients silently stop at them, so the training path never uses them. Each op here has two
//! implementations: a fused kernel with explicit backward, a candle custom op in a file of its own
//! below (its CPU kernel for f32 on the CPU, its CUDA launcher for a GPU, and its tests side by
//! side), and a reference composed of ops candle can differentiate (each has a finite-difference
//! test below), used for other dtypes and devices and by [`with_reference_ops`]. The kernels are
//! tested against the references.
//!
//! The ops' files import only what is below `ops` (`rowops`, `parallel`, `dropout`, `cuda`,
//! `decode`) and, for the picks, `sample_pick`; this file imports them.

#[cfg(feature = "cuda")]
pub mod adamw;
pub mod attention;
pub mod cast;
pub mod cross_entropy;
pub mod decode;
pub mod dropout;
pub mod embedding;
pub mod gelu;
pub mod grad_norm;
pub mod greedy_pick;
pub mod layer_norm;
pub mod linear;
pub mod sample_pick;
pub mod softmax;
#[cfg(test)]
pub(crate) mod test_support;

use candle_core::{DType, Result, Tensor, D};
use std::cell::Cell;

thread_local! {
    static REFERENCE_OPS: Cell<bool> = const { Cell::new(false) };
}

/// Runs `f` with the composed reference ops in place of the fused kernels on this thread (tests
/// compare the two; benchmarks can measure what the kernels buy). Setting the environment
/// variable `HYBRID_ENGINE_REFERENCE_OPS=1` does the same for a whole process.
pub fn with_reference_ops<R>(f: impl FnOnce() -> R) -> R {
    struct Restore(bool);
    impl Drop for Restore {
        fn drop(&mut self) {
            REFERENCE_OPS.set(self.0);
        }
    }
    let _restore = Restore(REFERENCE_OPS.replace(true));
    f()
}

pub(crate) fn reference_ops() -> bool {
    static ENV: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    REFERENCE_OPS.get() || *ENV.get_or_init(|| std::env::var("HYBRID_ENGINE_REFERENCE_OPS").is_ok_and(|v| v == "1"))
}

/// Whether the CUDA kernels (each op's `cuda` launchers) apply: a CUDA build, every tensor on a
/// GPU in f32, bf16 or f16, and not in reference mode.
fn on_cuda(tensors: &[&Tensor]) -> bool {
    #[cfg(feature = "cuda")]
    {
        !reference_ops() && tensors.iter().all(|t| t.device().is_cuda() && crate::kernels::cuda::is_float(t.dtype()))
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = tensors;
        false
    }
}

/// Whether the fused CPU kernels apply: every tensor f32 on the CPU, and not in reference mode.
fn fused(tensors: &[&Tensor]) -> bool {
    !reference_ops() && tensors.iter().all(|t| t.device().is_cpu() && t.dtype() == DType::F32)
}

/// Softmax over the last dimension. The max is detached: softmax is shift-invariant, so the
/// gradient through it is zero in exact arithmetic and only costs time. Half precision is
/// computed in f32 and rounded back, as PyTorch does: a sum of 50k terms in fp16 stalls at 2048.
pub fn softmax_last_dim(x: &Tensor) -> Result<Tensor> {
    let dtype = x.dtype();
    let x = upcast(x)?;
    let max = x.max_keepdim(D::Minus1)?.detach();
    let e = x.broadcast_sub(&max)?.exp()?;
    let sum = e.sum_keepdim(D::Minus1)?;
    e.broadcast_div(&sum)?.to_dtype(dtype)
}

/// log-softmax over the last dimension (max detached and half precision computed in f32, as in
/// [`softmax_last_dim`]).
pub fn log_softmax_last_dim(x: &Tensor) -> Result<Tensor> {
    let dtype = x.dtype();
    let x = upcast(x)?;
    let max = x.max_keepdim(D::Minus1)?.detach();
    let shifted = x.broadcast_sub(&max)?;
    let lse = shifted.exp()?.sum_keepdim(D::Minus1)?.log()?;
    shifted.broadcast_sub(&lse)?.to_dtype(dtype)
}

/// Half precision is upcast to f32 for reductions; f32 and f64 stay as they are.
fn upcast(x: &Tensor) -> Result<Tensor> {
    match x.dtype() {
        DType::F16 | DType::BF16 => x.to_dtype(DType::F32),
        _ => Ok(x.clone()),
    }
}

/// LayerNorm over the last dimension, biased variance as in `torch.nn.LayerNorm`.
pub fn layer_norm(x: &Tensor, weight: &Tensor, bias: &Tensor, eps: f64) -> Result<Tensor> {
    let one_dtype = weight.dtype() == x.dtype() && bias.dtype() == x.dtype();
    if fused(&[x, weight, bias]) || (on_cuda(&[x, weight, bias]) && one_dtype) {
        layer_norm::layer_norm(x, weight, bias, eps)
    } else {
        layer_norm_reference(x, weight, bias, eps)
    }
}

/// [`layer_norm()`] composed of candle ops, computed in at least f32.
pub fn layer_norm_reference(x: &Tensor, weight: &Tensor, bias: &Tensor, eps: f64) -> Result<Tensor> {
    let dtype = x.dtype();
    let x = upcast(x)?;
    let mean = x.mean_keepdim(D::Minus1)?; // (.., 1)
    let centered = x.broadcast_sub(&mean)?;
    let var = centered.sqr()?.mean_keepdim(D::Minus1)?; // (.., 1)
    let normed = centered.broadcast_div(&(var + eps)?.sqrt()?)?;
    normed.to_dtype(dtype)?.broadcast_mul(weight)?.broadcast_add(bias)
}

/// `softmax(att * scale + bias)` over the last dimension: the attention probabilities from raw
/// scores `att` (B, NH, T, S) and the additive mask `bias` (B or 1, 1, T, S), a constant.
pub fn masked_softmax(att: &Tensor, scale: f64, bias: &Tensor) -> Result<Tensor> {
    let constant_mask = !bias.track_op() && bias.rank() == 4;
    let on_gpu = on_cuda(&[att, bias]) && bias.dtype() == DType::F32;
    if (fused(&[att, bias]) || on_gpu) && constant_mask {
        softmax::masked_softmax(att, scale, bias)
    } else {
        masked_softmax_reference(att, scale, bias)
    }
}

/// [`masked_softmax`] composed of candle ops. Half-precision scores are masked and normalised in
/// f32 (Megatron's attention_softmax_in_fp32: the f32 mask's -1e9 is -inf in fp16, and fully
/// masked padding rows would turn NaN) and the probabilities rounded back.
pub fn masked_softmax_reference(att: &Tensor, scale: f64, bias: &Tensor) -> Result<Tensor> {
    softmax_last_dim(&(upcast(att)? * scale)?.broadcast_add(bias)?)?.to_dtype(att.dtype())
}

/// GELU: GPT-2's tanh approximation (`gelu_new`), or with `exact` the erf form (`gelu`).
pub fn gelu(h: &Tensor, exact: bool) -> Result<Tensor> {
    if !exact && (fused(&[h]) || on_cuda(&[h])) {
        gelu::gelu(h)
    } else {
        gelu_reference(h, exact)
    }
}

/// [`gelu()`] by candle's ops (candle's `gelu` is the tanh approximation).
pub fn gelu_reference(h: &Tensor, exact: bool) -> Result<Tensor> {
    if exact {
        h.gelu_erf()
    } else {
        h.gelu()
    }
}

/// Sets the variable `dst` to `src` cast to `dst`'s dtype: in place from a contiguous f32 `src`
/// of the same shape (the fused op: one kernel on a GPU, no temporary), else by `Var::set`.
pub fn cast_into(dst: &candle_core::Var, src: &Tensor) -> Result<()> {
    if src.dtype() == DType::F32 && dst.is_contiguous() && src.is_contiguous() && dst.shape() == src.shape() {
        cast::cast_into(dst.as_tensor(), src)
    } else {
        dst.set(&src.to_dtype(dst.dtype())?)
    }
}

/// Rows `ids` (N,) u32 of the table `weight` (V, C): (N, C). On a GPU the fused op, whose
/// backward sums each row's gradient in one block (candle's `index_add` there is one thread a
/// column over every id); elsewhere candle's `index_select`, which adds in the same order.
pub fn embedding(weight: &Tensor, ids: &Tensor) -> Result<Tensor> {
    if on_cuda(&[weight]) && ids.dtype() == DType::U32 {
        embedding::embedding(weight, ids)
    } else {
        weight.index_select(ids, 0)
    }
}

/// The gradient of [`embedding`]'s table (`vocab` rows) from `ids` (N,) and the gradient of its
/// output `grad` (N, C), without the table: what its backward computes, bit for bit (the
/// custom op's on a GPU; on the CPU candle's index-select backward, zeros with the rows added in
/// the order of the positions, which the custom op's f32 kernel reproduces in one buffer).
pub fn embedding_grad(vocab: usize, ids: &Tensor, grad: &Tensor) -> Result<Tensor> {
    let custom =
        ids.dtype() == DType::U32 && (on_cuda(&[grad]) || (grad.device().is_cpu() && grad.dtype() == DType::F32));
    if custom {
        embedding::embedding_grad(vocab, ids, grad)
    } else {
        let c = grad.dim(1)?;
        Tensor::zeros((vocab, c), grad.dtype(), grad.device())?.index_add(&ids.contiguous()?, grad, 0)
    }
}

/// `x W + b` for `x` (.., in), `w` (in, out) (Hugging Face's Conv1D layout), `b` (out,).
pub fn linear(x: &Tensor, w: &Tensor, b: &Tensor) -> Result<Tensor> {
    let one_dtype = w.dtype() == x.dtype() && b.dtype() == x.dtype();
    if fused(&[x, w, b]) || (on_cuda(&[x, w, b]) && one_dtype) {
        linear::linear(x, w, b)
    } else {
        linear_reference(x, w, b)
    }
}

/// [`linear()`] composed of candle ops: one (rows, in) x (in, out) gemm, then the bias.
pub fn linear_reference(x: &Tensor, w: &Tensor, b: &Tensor) -> Result<Tensor> {
    gemm_rows(x, w)?.broadcast_add(b)
}

/// `x W` for `x` (.., in) and `w` (in, out) as one (rows, in) x (in, out) gemm: (.., out).
pub fn gemm_rows(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    let mut dims = x.dims().to_vec();
    let Some(last) = dims.last_mut() else { candle_core::bail!("a linear's input has no last dimension") };
    let d_in = std::mem::replace(last, w.dim(1)?);
    x.reshape(((), d_in))?.matmul(w)?.reshape(dims)
}

/// Splits `c_attn`'s output (B, T, 3C) into q, k, v, each (B, NH, T, HD) and contiguous (the
/// layout the batched gemm wants).
pub fn split_heads(qkv: &Tensor, heads: usize) -> Result<(Tensor, Tensor, Tensor)> {
    let (b, t, c3) = qkv.dims3()?;
    let c = c3 / 3;
    let head = |i: usize| -> Result<Tensor> {
        qkv.narrow(D::Minus1, i * c, c)?.reshape((b, t, heads, c / heads))?.transpose(1, 2)?.contiguous()
    };
    Ok((head(0)?, head(1)?, head(2)?))
}

/// The heads' outputs (B, NH, T, HD) side by side: (B, T, C).
pub fn merge_heads(y: &Tensor) -> Result<Tensor> {
    let (b, nh, t, hd) = y.dims4()?;
    y.transpose(1, 2)?.reshape((b, t, nh * hd))
}

/// Attention of new queries over the KV cache during generation: q (B, NH, T, HD), the cached
/// keys and values (B, NH, S, HD), bias (B or 1, 1, T, S) -> (B, T, C). No gradient flows into
/// the cache (it is written in place), so none is kept here.
pub fn cached_attention(q: &Tensor, k: &Tensor, v: &Tensor, bias: &Tensor, scale: f64) -> Result<Tensor> {
    if fused(&[q, k, v, bias]) && crate::kernels::rowops::has_fma() && bias.rank() == 4 {
        crate::kernels::decode::cached_attention(q, k, v, bias, scale)
    } else {
        let att = masked_softmax(&q.matmul(&k.t()?)?, scale, bias)?; // (B, NH, T, S)
        merge_heads(&att.matmul(v)?)
    }
}

/// Whether a decoding step's attention runs from c_attn's output straight into and over the KV
/// cache in two launches ([`decode::decode_attention`]): on a GPU, heads of 32 to
/// 128 values (a multiple of 32), an f32 mask of rank 4. Elsewhere the cache takes the split
/// heads and [`cached_attention`] runs.
pub fn decode_attention_on_cuda(qkv: &Tensor, bias: &Tensor, heads: usize) -> bool {
    let head_dim = qkv.dims().last().map_or(0, |c3| c3 / 3 / heads.max(1));
    decoding_kernels_take(qkv, bias, head_dim)
}

/// Whether a decoding step's blocks run fused on a GPU (`model/gpt2/layers.rs`'s
/// `Block::forward_decoding_on_cuda`: the biases added inside the cache append, the attention,
/// [`bias_residual_layer_norm`] and [`bias_gelu`]; [`embed_layer_norm`] first), for weights `x`,
/// the step's mask `bias` and heads of `head_dim` values: what [`decode_attention_on_cuda`] asks,
/// unless `HYBRID_ENGINE_FUSED_DECODING=0` keeps one op a launch (benchmarks measure what the
/// fusion buys).
pub fn fused_decoding_on_cuda(x: &Tensor, bias: &Tensor, head_dim: usize) -> bool {
    static OFF: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let off = *OFF.get_or_init(|| std::env::var("HYBRID_ENGINE_FUSED_DECODING").is_ok_and(|v| v == "0"));
    !off && decoding_kernels_take(x, bias, head_dim)
}

fn decoding_kernels_take(x: &Tensor, bias: &Tensor, head_dim: usize) -> bool {
    on_cuda(&[x, bias])
        && bias.dtype() == DType::F32
        && bias.rank() == 4
        && head_dim.is_multiple_of(32)
        && (32..=128).contains(&head_dim)
}

pub use self::decode::{
    advance_decoding, bias_gelu, bias_residual_layer_norm, decode_attention, embed_layer_norm, kv_cache_append,
    CacheStart, DecodeState,
};

/// Greedy decoding's token and log-probability per row of logits, on either device (on a GPU in
/// one launch, two numbers a row to the host).
pub use self::greedy_pick::{greedy_pick, greedy_pick_in_place};

/// Sampling's token and log-probability per row of logits for the row's uniform draw, on either
/// device (the same token on both; on a GPU one launch, two numbers a row to the host).
pub use self::sample_pick::{sample_pick, sample_pick_in_place, sample_with_draw, SamplingParams};

/// The tied LM head `x wte^T`: (N, C), (V, C) -> (N, V). For the few rows of a decoding step
/// on the CPU, [`crate::kernels::decode::lm_head`] (1.4-3.5x the matmul's speed there); the plain
/// matmul otherwise.
pub fn lm_head_logits(x: &Tensor, wte: &Tensor) -> Result<Tensor> {
    if fused(&[x, wte]) && x.dim(0)? <= crate::kernels::decode::MAX_LM_HEAD_ROWS {
        crate::kernels::decode::lm_head(x, wte)
    } else {
        x.matmul(&wte.t()?)
    }
}

/// Self-attention's core: from `c_attn`'s output `qkv` (B, T, 3C) and the additive mask `bias`
/// (B or 1, 1, T, T), `dropout(softmax(q k^T * scale + bias)) v` per head, heads side by side:
/// (B, T, C). `dropout` is the mask of the attention probabilities (B, NH, T, T).
pub fn attention(
    qkv: &Tensor,
    bias: &Tensor,
    heads: usize,
    scale: f64,
    dropout: Option<DropoutMask>,
) -> Result<Tensor> {
    if (fused(&[qkv, bias]) || flash_attention_on_cuda(qkv, bias, heads)) && !bias.track_op() && bias.rank() == 4 {
        attention::attention(qkv, bias, heads, scale, dropout)
    } else {
        attention_reference(qkv, bias, heads, scale, dropout)
    }
}

/// Whether [`attention()`] runs the flash-style CUDA kernels: on a GPU with an f32 mask, aligned
/// operands and [`flash_attention_takes`] the dtype and head size.
fn flash_attention_on_cuda(qkv: &Tensor, bias: &Tensor, heads: usize) -> bool {
    #[cfg(feature = "cuda")]
    {
        let head_dim = qkv.dims().last().map(|c3| c3 / 3 / heads.max(1));
        on_cuda(&[qkv, bias])
            && attention::cuda::aligned_for_attention(qkv.layout())
            && bias.dtype() == DType::F32
            && head_dim.is_some_and(|hd| flash_attention_takes(qkv.dtype(), hd))
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (qkv, bias, heads);
        false
    }
}

/// The head size the flash attention kernels are built for (`attention::cuda::ATTENTION_HEAD_DIM`, which a
/// build without CUDA lacks: the memory plan needs the rule there too).
const FLASH_ATTENTION_HEAD_DIM: usize = 64;
#[cfg(feature = "cuda")]
const _: () = assert!(FLASH_ATTENTION_HEAD_DIM == attention::cuda::ATTENTION_HEAD_DIM);

/// Whether a GPU's [`attention()`] in `dtype` with heads of `head_dim` takes the flash kernels: bf16
/// or f16 with heads of 64 (f32 on a GPU stays on the composed ops, which match the CPU to 1e-5),
/// unless `HYBRID_ENGINE_FLASH_ATTENTION=0` keeps the composed ops (benchmarks measure what it
/// buys). The memory plan asks it too: the two keep very different tensors for backward.
pub(crate) fn flash_attention_takes(dtype: DType, head_dim: usize) -> bool {
    static OFF: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let off = *OFF.get_or_init(|| std::env::var("HYBRID_ENGINE_FLASH_ATTENTION").is_ok_and(|v| v == "0"));
    !off && matches!(dtype, DType::BF16 | DType::F16) && head_dim == FLASH_ATTENTION_HEAD_DIM
}

/// [`attention()`] composed of candle ops. On a GPU its masked softmax and dropout are the CUDA
/// kernels; elsewhere their composed references, so that the CPU's fused attention is tested
/// against an independent composition.
pub fn attention_reference(
    qkv: &Tensor,
    bias: &Tensor,
    heads: usize,
    scale: f64,
    dropout: Option<DropoutMask>,
) -> Result<Tensor> {
    let (q, k, v) = split_heads(qkv, heads)?;
    let scores = q.matmul(&k.t()?)?; // (B, NH, T, T)
    let att = match on_cuda(&[&scores, bias]) {
        true => masked_softmax(&scores, scale, bias)?,
        false => masked_softmax_reference(&scores, scale, bias)?,
    };
    let att = match dropout {
        Some(mask) if on_cuda(&[&att]) => apply_dropout(&att, mask)?,
        Some(mask) => dropout_reference(&att, mask)?,
        None => att,
    };
    merge_heads(&att.matmul(&v)?)
}

/// Mean token cross-entropy of `logits` (N, V) against `targets` (N,) u32.
/// `sum(t^2)` in f64, what gradient norms add up: the fused kernel reads contiguous f32 on the CPU
/// in place (no squared copy); anything else is squared and summed by candle, then widened.
pub fn sum_of_squares(t: &Tensor) -> Result<f64> {
    match grad_norm::sum_of_squares(t)? {
        Some(s) => Ok(s),
        None => t.sqr()?.sum_all()?.to_dtype(DType::F64)?.to_scalar::<f64>(),
    }
}

pub fn cross_entropy(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    cross_entropy_rows(logits, targets)?.mean_all()
}

/// Per-row cross-entropy of the tied LM head's logits `x wte^T` against `targets`: x (N, C),
/// wte (V, C), targets (N,) u32 -> (N,) f32. Fused on the CPU for f32 (the logits never become
/// a tensor, see `cross_entropy::LmHeadCrossEntropy`).
pub fn lm_head_cross_entropy_rows(x: &Tensor, wte: &Tensor, targets: &Tensor) -> Result<Tensor> {
    if fused(&[x, wte]) {
        cross_entropy::lm_head_cross_entropy_rows(x, wte, &targets.to_dtype(DType::U32)?)
    } else {
        lm_head_cross_entropy_rows_reference(x, wte, targets)
    }
}

/// [`lm_head_cross_entropy_rows`] as the logits' matmul and then [`cross_entropy_rows`].
pub fn lm_head_cross_entropy_rows_reference(x: &Tensor, wte: &Tensor, targets: &Tensor) -> Result<Tensor> {
    cross_entropy_rows(&x.matmul(&wte.t()?)?, targets)
}

/// Per-row cross-entropy: (N, V), (N,) -> (N,) f32, fused on the CPU and on a GPU.
/// Half-precision logits get PyTorch's half-precision loss: accumulated in f32, the losses (and
/// so their gradients) rounded to the logits' dtype. Cast the logits to f32 first for an fp32 loss
/// (`--compute-fp32-loss`).
pub fn cross_entropy_rows(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    let rows = if on_cuda(&[logits]) {
        // The kernel reads the logits in their dtype and sums in f32: no f32 copy of (N, V).
        cross_entropy::cross_entropy_rows(logits, &targets.to_dtype(DType::U32)?)?
    } else if logits.device().is_cpu() && !reference_ops() {
        cross_entropy::cross_entropy_rows(&logits.to_dtype(DType::F32)?, &targets.to_dtype(DType::U32)?)?
    } else {
        cross_entropy_rows_reference(&logits.to_dtype(DType::F32)?, targets)?
    };
    rows.to_dtype(logits.dtype())?.to_dtype(DType::F32)
}

/// Per-row cross-entropy composed of differentiable candle ops, in the logits' dtype: the
/// reference the fused kernel is tested against. (N, V), (N,) -> (N,)
pub fn cross_entropy_rows_reference(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    let logp = log_softmax_last_dim(logits)?; // (N, V)
    logp.gather(&targets.unsqueeze(1)?, 1)?.squeeze(1)?.neg()
}

pub use crate::kernels::dropout::{DropoutKey, DropoutMask};

/// Inverted dropout with probability `p`, its mask drawn from `key` at (`layer`, `site`).
pub fn dropout(x: &Tensor, p: f64, key: &DropoutKey, layer: u64, site: u64) -> Result<Tensor> {
    if p <= 0.0 {
        return Ok(x.clone());
    }
    apply_dropout(x, key.mask(p, layer, site))
}

/// `x` times `mask`'s factors: the fused kernel on the CPU (f32) and on a GPU, where the mask is
/// drawn on the device; the composed reference otherwise.
fn apply_dropout(x: &Tensor, mask: DropoutMask) -> Result<Tensor> {
    if fused(&[x]) || on_cuda(&[x]) {
        self::dropout::dropout(x, mask)
    } else {
        dropout_reference(x, mask)
    }
}

/// [`dropout()`] composed of candle ops: the mask as a tensor, multiplied in. The factors are drawn
/// on the host, on every core (a GPU without the CUDA kernel, or in reference mode, comes here:
/// the attention probabilities of gpt2 at B8 T1024 are 1.2G factors a step).
pub fn dropout_reference(x: &Tensor, mask: DropoutMask) -> Result<Tensor> {
    let factors = crate::kernels::parallel::for_chunks(x.elem_count(), |range, out| {
        for (o, i) in out.iter_mut().zip(range) {
            *o = mask.factor(i);
        }
    });
    let factors = Tensor::from_vec(factors, x.shape(), x.device())?.to_dtype(x.dtype())?;
    x.mul(&factors)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    /// Central finite differences of `f` (a scalar function) at every element of `x`, compared
    /// with candle's autograd gradient.
    fn check_grad(x: &Tensor, f: impl Fn(&Tensor) -> Result<Tensor>) -> Result<f32> {
        let var = Var::from_tensor(x)?;
        let grads = f(var.as_tensor())?.backward()?;
        let analytic: Vec<f32> = grads.get(&var).expect("no grad").to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
        let base: Vec<f64> = x.to_dtype(DType::F64)?.flatten_all()?.to_vec1()?;
        let eps = 1e-4;
        let mut worst = 0f32;
        for i in 0..base.len() {
            let eval = |delta: f64| -> Result<f64> {
                let mut v = base.clone();
                v[i] += delta;
                let t = Tensor::from_vec(v, x.shape(), x.device())?;
                f(&t)?.to_dtype(DType::F64)?.to_scalar::<f64>()
            };
            let numeric = (eval(eps)? - eval(-eps)?) / (2.0 * eps);
            worst = worst.max((numeric as f32 - analytic[i]).abs());
        }
        Ok(worst)
    }

    fn weights(n: usize) -> Result<Tensor> {
        Tensor::randn(0f64, 1.0, n, &Device::Cpu)
    }

    #[test]
    fn softmax_gradient_matches_finite_differences() -> Result<()> {
        let x = Tensor::randn(0f64, 2.0, (3, 5), &Device::Cpu)?;
        let w = Tensor::randn(0f64, 1.0, (3, 5), &Device::Cpu)?;
        let err = check_grad(&x, |t| softmax_last_dim(t)?.mul(&w)?.sum_all())?;
        assert!(err < 1e-6, "softmax grad error {err}");
        let err = check_grad(&x, |t| log_softmax_last_dim(t)?.mul(&w)?.sum_all())?;
        assert!(err < 1e-6, "log-softmax grad error {err}");
        Ok(())
    }

    #[test]
    fn layer_norm_gradients_match_finite_differences_for_input_weight_and_bias() -> Result<()> {
        let x = Tensor::randn(0f64, 1.0, (4, 6), &Device::Cpu)?;
        let (g, b) = (weights(6)?, weights(6)?);
        let w = Tensor::randn(0f64, 1.0, (4, 6), &Device::Cpu)?;
        let err = check_grad(&x, |t| layer_norm_reference(t, &g, &b, 1e-5)?.mul(&w)?.sum_all())?;
        assert!(err < 1e-5, "layer norm dx error {err}");
        let err = check_grad(&g, |t| layer_norm_reference(&x, t, &b, 1e-5)?.mul(&w)?.sum_all())?;
        assert!(err < 1e-5, "layer norm dweight error {err}");
        let err = check_grad(&b, |t| layer_norm_reference(&x, &g, t, 1e-5)?.mul(&w)?.sum_all())?;
        assert!(err < 1e-5, "layer norm dbias error {err}");
        Ok(())
    }

    #[test]
    fn masked_softmax_reference_matches_finite_differences() -> Result<()> {
        let att = Tensor::randn(0f64, 2.0, (1, 2, 3, 3), &Device::Cpu)?;
        let bias =
            Tensor::new(&[[0f64, -1e9, -1e9], [0., 0., -1e9], [0., 0., 0.]], &Device::Cpu)?.reshape((1, 1, 3, 3))?;
        let w = Tensor::randn(0f64, 1.0, (1, 2, 3, 3), &Device::Cpu)?;
        let err = check_grad(&att, |t| masked_softmax_reference(t, 0.3, &bias)?.mul(&w)?.sum_all())?;
        assert!(err < 1e-6, "masked softmax grad error {err}");
        Ok(())
    }

    #[test]
    fn layer_norm_matches_definition() -> Result<()> {
        let x = Tensor::new(&[[1f32, 2., 3., 6.]], &Device::Cpu)?;
        let y = layer_norm_reference(
            &x,
            &Tensor::ones(4, DType::F32, &Device::Cpu)?,
            &Tensor::zeros(4, DType::F32, &Device::Cpu)?,
            0.0,
        )?;
        // mean 3, biased variance (4+1+0+9)/4 = 3.5
        let s = 3.5f32.sqrt();
        let want = [-2. / s, -1. / s, 0., 3. / s];
        for (a, b) in y.flatten_all()?.to_vec1::<f32>()?.iter().zip(want) {
            assert!((a - b).abs() < 1e-6, "{a} vs {b}");
        }
        Ok(())
    }

    #[test]
    fn reference_cross_entropy_matches_hand_computed_and_finite_differences() -> Result<()> {
        let logits = Tensor::new(&[[0f64, 0., 0.], [1., 2., 3.]], &Device::Cpu)?;
        let targets = Tensor::new(&[1u32, 2], &Device::Cpu)?;
        let ce = cross_entropy_rows_reference(&logits, &targets)?.mean_all()?.to_scalar::<f64>()?;
        let row2 = -(3f64 - (1f64.exp() + 2f64.exp() + 3f64.exp()).ln());
        let want = ((3f64).ln() + row2) / 2.0;
        assert!((ce - want).abs() < 1e-12, "{ce} vs {want}");
        let err = check_grad(&logits, |t| cross_entropy_rows_reference(t, &targets)?.mean_all())?;
        assert!(err < 1e-6, "cross entropy grad error {err}");
        Ok(())
    }

    /// Our GELU as the model calls it (`gelu`: the fused kernel for f32 on the CPU), against the
    /// formulas and against finite differences, for both forms.
    #[test]
    fn gelu_is_the_tanh_approximation_or_erf_with_a_gradient() -> Result<()> {
        let xs = [-2f64, -0.5, 0.0, 0.7, 3.0];
        let x = Tensor::new(&xs, &Device::Cpu)?.to_dtype(DType::F32)?;
        let c = (2.0 / std::f64::consts::PI).sqrt();
        let tanh_form = |x: f64| 0.5 * x * (1.0 + (c * (x + 0.044715 * x.powi(3))).tanh());
        // erf(x / sqrt 2) through the normal CDF's relation to tanh is not exact: integrate
        // the density instead (Simpson's rule, far finer than f32).
        let erf_form = |x: f64| {
            let n = 20_000;
            let (a, h) = (0.0, x / n as f64);
            let pdf = |t: f64| (-t * t / 2.0).exp() / (2.0 * std::f64::consts::PI).sqrt();
            let sum: f64 = (0..=n)
                .map(|i| {
                    let w = if i == 0 || i == n {
                        1.0
                    } else if i % 2 == 1 {
                        4.0
                    } else {
                        2.0
                    };
                    w * pdf(a + i as f64 * h)
                })
                .sum();
            x * (0.5 + sum * h / 3.0)
        };
        for (exact, form) in [(false, &tanh_form as &dyn Fn(f64) -> f64), (true, &erf_form)] {
            let y: Vec<f32> = gelu(&x, exact)?.to_vec1()?;
            for (xi, yi) in xs.iter().zip(y) {
                let want = form(*xi);
                assert!((f64::from(yi) - want).abs() < 1e-5, "gelu({xi}, exact {exact}) = {yi}, want {want}");
            }
            // Finite differences of our own function, in f32 where it runs (element-wise, so
            // one shifted evaluation gives every element's slope).
            let var = Var::from_tensor(&x)?;
            let grads = gelu(var.as_tensor(), exact)?.sum_all()?.backward()?;
            let analytic: Vec<f32> = grads.get(&var).expect("gelu has a gradient").to_vec1()?;
            let eps = 1e-2;
            let (up, down) = (gelu(&(&x + eps)?, exact)?, gelu(&(&x - eps)?, exact)?);
            let numeric: Vec<f32> = ((up - down)? / (2.0 * eps))?.to_vec1()?;
            for (i, (a, n)) in analytic.iter().zip(&numeric).enumerate() {
                assert!((a - n).abs() < 1e-3, "gelu'(x = {}, exact {exact}): {a} vs finite differences {n}", xs[i]);
            }
        }
        Ok(())
    }

    #[test]
    fn dropout_is_a_pure_function_of_its_key_and_keeps_the_mean() -> Result<()> {
        let x = Tensor::ones((64, 64), DType::F32, &Device::Cpu)?;
        let key = DropoutKey { seed: 1, step: 3, micro_batch: 0 };
        let a = dropout(&x, 0.1, &key, 2, 0)?;
        let b = dropout(&x, 0.1, &key, 2, 0)?;
        let c = dropout(&x, 0.1, &key, 2, 1)?;
        let diff = |p: &Tensor, q: &Tensor| -> Result<f32> { p.sub(q)?.abs()?.sum_all()?.to_scalar() };
        assert_eq!(diff(&a, &b)?, 0.0, "same key and site must give the same mask");
        assert!(diff(&a, &c)? > 0.0, "another site must give another mask");
        let zeros = a.eq(0f32)?.to_dtype(DType::F32)?.mean_all()?.to_scalar::<f32>()?;
        assert!((zeros - 0.1).abs() < 0.02, "drop rate {zeros}");
        let mean = a.mean_all()?.to_scalar::<f32>()?;
        assert!((mean - 1.0).abs() < 0.03, "inverted dropout keeps the mean, got {mean}");
        Ok(())
    }

    #[test]
    fn reference_dropout_drawn_in_parallel_is_the_mask_factor_by_factor() -> Result<()> {
        // Large enough for several chunks on several threads; the values count which is which.
        let n = 300_001;
        let x = Tensor::arange(0f32, n as f32, &Device::Cpu)?;
        let mask = DropoutKey { seed: 7, step: 1, micro_batch: 2 }.mask(0.25, 3, 1);
        let got: Vec<f32> = dropout_reference(&x, mask)?.to_vec1()?;
        let want: Vec<f32> = (0..n).map(|i| i as f32 * mask.factor(i)).collect();
        assert_eq!(got, want);
        Ok(())
    }
}
