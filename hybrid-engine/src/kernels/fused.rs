//! Fused CPU kernels with explicit backward, for the ops whose composed form costs the most.
//!
//! Composed from candle ops, each of these materialises several full-size temporaries forward
//! and more backward, and candle's backward adds a zero fill and an add for every input of
//! every op. Each kernel here is one node of the graph: it reads its inputs once forward and
//! writes each gradient once backward, rows (or (batch, head) pairs) split across candle's CPU
//! thread pool, the per-row arithmetic in `rowops.rs` (vectorised for AVX-512 and AVX2):
//!
//! * linear (`x W + b`, Hugging Face's Conv1D layout): one gemm onto rows holding the bias;
//! * the attention core on `c_attn`'s packed q, k, v: per (batch, head) strided gemms, the
//!   masked softmax and the attention dropout in between, nothing (B, NH, T, T) kept for
//!   backward (it recomputes the probabilities);
//! * LayerNorm: backward recomputes the row statistics and returns dx, dw and db from one pass;
//! * GELU (`gelu_new`), dropout (the mask regenerated from its counter-based key in backward),
//!   the masked softmax on its own (generation over the KV cache);
//! * the tied LM head with the cross-entropy: the (N, V) logits never become a tensor, and
//!   backward turns them into their gradient in place; cross-entropy on given logits too;
//! * the embedding lookup, for its backward on a GPU (one block per distinct id), and the
//!   in-place cast that refreshes mixed precision's compute copy from the fp32 masters.
//!
//! The kernels take f32 tensors on the CPU; dropout, the masked softmax, LayerNorm, GELU, the
//! linear, the embedding's gradient and the cross-entropy on given logits also run on a GPU in
//! f32, bf16 or f16, the attention in bf16 or f16 (their `cuda_fwd`, kernels in `cuda.rs`). The dispatchers in `ops.rs` use them there and fall
//! back to the composed reference (also in `ops.rs`) for other dtypes and devices; the tests
//! below check values and gradients against those references and against finite differences.

use crate::kernels::dropout::DropoutMask;
use crate::kernels::parallel::{
    contiguous_f32, contiguous_u32, for_chunks, for_rows, for_rows_weighted, gemm_f32, par_rows, reduce_rows, SharedOut,
};
use crate::kernels::rowops;
use candle_core::{CpuStorage, CustomOp1, CustomOp2, CustomOp3, Layout, Result, Shape, Tensor};

// ---------------------------------------------------------------------------------------------
// Cross-entropy

/// Per-row `logsumexp(x) - x[target]`: (N, V) f32 logits, (N,) u32 targets -> (N,) f32.
struct CrossEntropyRows;

/// Gradient of [`CrossEntropyRows`] for (logits, targets, (loss, grad) per row):
/// `(softmax(x) - onehot(target)) * grad[row]`, the row's log-sum-exp recovered from its loss
/// as `loss + x[target]`.
struct CrossEntropyRowsGrad;

impl CustomOp2 for CrossEntropyRows {
    fn name(&self) -> &'static str {
        "cross-entropy-rows"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        let (n, v) = l1.shape().dims2()?;
        let logits = contiguous_f32(s1, l1, "logits")?;
        let targets = contiguous_u32(s2, l2, "targets")?;
        if let Some(bad) = targets.iter().find(|&&t| t as usize >= v) {
            candle_core::bail!("target id {bad} is outside the vocabulary of {v}");
        }
        let out = for_rows_weighted(n, 1, n * v, |r, o| {
            let row = &logits[r * v..(r + 1) * v];
            o[0] = rowops::log_sum_exp(row) - row[targets[r] as usize];
        });
        Ok((CpuStorage::F32(out), Shape::from(n)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let n = l1.shape().dims2()?.0;
        Ok((crate::kernels::cuda::cross_entropy_rows((s1, l1), (s2, l2))?, Shape::from(n)))
    }

    fn bwd(
        &self,
        logits: &Tensor,
        targets: &Tensor,
        loss: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let loss_grad = Tensor::stack(&[loss, grad], 1)?; // (N, 2)
        let g = logits.apply_op3_no_bwd(targets, &loss_grad, &CrossEntropyRowsGrad)?;
        Ok((Some(g), None))
    }
}

impl CustomOp3 for CrossEntropyRowsGrad {
    fn name(&self) -> &'static str {
        "cross-entropy-rows-grad"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (n, v) = l1.shape().dims2()?;
        let logits = contiguous_f32(s1, l1, "logits")?;
        let targets = contiguous_u32(s2, l2, "targets")?;
        let loss_grad = contiguous_f32(s3, l3, "loss and gradient")?;
        let out = for_rows(n, v, |r, o| {
            let row = &logits[r * v..(r + 1) * v];
            let (t, loss, g) = (targets[r] as usize, loss_grad[2 * r], loss_grad[2 * r + 1]);
            rowops::softmax_times(row, loss + row[t], g, o);
            o[t] -= g;
        });
        Ok((CpuStorage::F32(out), Shape::from((n, v))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
        s3: &candle_core::CudaStorage,
        l3: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let out = crate::kernels::cuda::cross_entropy_rows_grad((s1, l1), (s2, l2), (s3, l3))?;
        Ok((out, l1.shape().clone()))
    }
}

/// Per-row cross-entropy of `logits` (N, V) against u32 `targets` (N,): f32 logits on the CPU,
/// f32/bf16/f16 on a GPU (read in their dtype, computed in f32). (N,) f32
pub fn cross_entropy_rows(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    logits.contiguous()?.apply_op2(&targets.contiguous()?, CrossEntropyRows)
}

// ---------------------------------------------------------------------------------------------
// LM head and cross-entropy

/// Per-row cross-entropy of the tied LM head's logits `x wte^T` against targets: x (N, C), wte
/// (V, C), targets (N,) u32 -> (N,) f32. The logits (N, V), by far the largest activation of a
/// small GPT-2, never become a tensor: forward keeps them inside the op, and backward turns
/// them in place into d(logits) = softmax - onehot (scaled per row) and multiplies that out to
/// dx = dlogits wte and dwte = dlogits^T x. This saves candle's zero-fill and add of the
/// logits' gradient and a second (N, V) buffer.
struct LmHeadCrossEntropy {
    /// Forward's logits, taken by backward (recomputed should backward run twice).
    logits: std::sync::Mutex<Option<Vec<f32>>>,
    /// Whether to keep the logits for a backward (no input needs a gradient otherwise).
    keep: bool,
}

/// The (N, V) logits `x wte^T`.
fn lm_head_logits(x: &[f32], wte: &[f32], (n, c, v): (usize, usize, usize)) -> Vec<f32> {
    let mut logits = Vec::with_capacity(n * v);
    // SAFETY: x is (N, C), wte (V, C) read as wte^T (C, V), logits (N, V) reserved above.
    unsafe {
        gemm_f32(
            (n, v, c),
            logits.as_mut_ptr(),
            v,
            x.as_ptr(),
            (c, 1),
            wte.as_ptr(),
            (1, c),
            false,
            crate::runtime::threads(),
        );
        logits.set_len(n * v);
    }
    logits
}

impl CustomOp3 for LmHeadCrossEntropy {
    fn name(&self) -> &'static str {
        "lm-head-cross-entropy"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let x = contiguous_f32(s1, l1, "hidden states")?;
        let wte = contiguous_f32(s2, l2, "token embedding")?;
        let targets = contiguous_u32(s3, l3, "targets")?;
        let (n, c) = l1.shape().dims2()?;
        let v = l2.shape().dims2()?.0;
        if let Some(bad) = targets.iter().find(|&&t| t as usize >= v) {
            candle_core::bail!("target id {bad} is outside the vocabulary of {v}");
        }
        let logits = lm_head_logits(x, wte, (n, c, v));
        let out = for_rows_weighted(n, 1, n * v, |r, o| {
            let row = &logits[r * v..(r + 1) * v];
            o[0] = rowops::log_sum_exp(row) - row[targets[r] as usize];
        });
        if self.keep {
            *self.logits.lock().expect("logits lock") = Some(logits);
        }
        Ok((CpuStorage::F32(out), Shape::from(n)))
    }

    fn bwd(
        &self,
        x: &Tensor,
        wte: &Tensor,
        targets: &Tensor,
        loss: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let logits = self.logits.lock().expect("logits lock").take();
        let op = LmHeadCrossEntropyGrad { logits: std::sync::Mutex::new(logits), with_dwte: wte.track_op() };
        // Per row: the target (exact in f32 below 2^24), the loss and the upstream gradient.
        let rows = Tensor::stack(&[&targets.to_dtype(candle_core::DType::F32)?, loss, grad], 1)?; // (N, 3)
        let packed = x.apply_op3_no_bwd(wte, &rows, &op)?; // dx (N, C), then dwte (V, C)
        let n = x.dim(0)?;
        let dx = if x.track_op() { Some(packed.narrow(0, 0, n)?) } else { None };
        let dwte = if wte.track_op() { Some(packed.narrow(0, n, packed.dim(0)? - n)?) } else { None };
        Ok((dx, dwte, None))
    }
}

/// Backward of [`LmHeadCrossEntropy`] for (x, wte, (target, loss, grad) per row): dx (N, C)
/// stacked on dwte (V, C) (left out when wte is frozen).
struct LmHeadCrossEntropyGrad {
    logits: std::sync::Mutex<Option<Vec<f32>>>,
    with_dwte: bool,
}

impl CustomOp3 for LmHeadCrossEntropyGrad {
    fn name(&self) -> &'static str {
        "lm-head-cross-entropy-grad"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let x = contiguous_f32(s1, l1, "hidden states")?;
        let wte = contiguous_f32(s2, l2, "token embedding")?;
        let rows = contiguous_f32(s3, l3, "targets, losses and gradients")?;
        let (n, c) = l1.shape().dims2()?;
        let v = l2.shape().dims2()?.0;
        let mut logits = match self.logits.lock().expect("logits lock").take() {
            Some(l) => l,
            None => lm_head_logits(x, wte, (n, c, v)),
        };
        // d(logits) in place: (softmax - onehot) * grad, the log-sum-exp recovered from the loss.
        let shared = SharedOut { ptr: logits.as_mut_ptr(), len: logits.len() };
        par_rows(n, n * v, |range| {
            for r in range {
                // SAFETY: rows are disjoint.
                let row = unsafe { shared.range(r * v..(r + 1) * v) };
                let (t, loss, g) = (rows[3 * r] as usize, rows[3 * r + 1], rows[3 * r + 2]);
                rowops::softmax_times_in_place(row, loss + row[t], g);
                row[t] -= g;
            }
        });
        let threads = crate::runtime::threads();
        let out_rows = if self.with_dwte { n + v } else { n };
        let mut out = Vec::with_capacity(out_rows * c);
        // SAFETY: dlogits is (N, V), wte (V, C), x (N, C); dx is the first N rows of `out`,
        // dwte the V rows after them, and the gemms write every value of both.
        unsafe {
            let dx = out.as_mut_ptr();
            gemm_f32((n, c, v), dx, c, logits.as_ptr(), (v, 1), wte.as_ptr(), (c, 1), false, threads);
            if self.with_dwte {
                let dwte = dx.add(n * c);
                gemm_f32((v, c, n), dwte, c, logits.as_ptr(), (1, v), x.as_ptr(), (c, 1), false, threads);
            }
            out.set_len(out_rows * c);
        }
        Ok((CpuStorage::F32(out), Shape::from((out_rows, c))))
    }
}

/// Per-row cross-entropy of the LM head's logits `x wte^T` (f32 `x` (N, C) and `wte` (V, C) on
/// the CPU) against u32 `targets` (N,): (N,). See [`LmHeadCrossEntropy`].
pub fn lm_head_cross_entropy_rows(x: &Tensor, wte: &Tensor, targets: &Tensor) -> Result<Tensor> {
    let keep = x.track_op() || wte.track_op();
    let op = LmHeadCrossEntropy { logits: std::sync::Mutex::new(None), keep };
    x.contiguous()?.apply_op3(&wte.contiguous()?, &targets.contiguous()?, op)
}

// ---------------------------------------------------------------------------------------------
// LayerNorm

/// `(x - mean) * rstd * w + b` over the last dimension (biased variance, as torch).
struct LayerNorm {
    eps: f32,
}

/// Gradient of [`LayerNorm`] for (x, w, dy): one (N + 2, C) tensor holding dx (N rows), then dw
/// and db.
struct LayerNormGrad {
    eps: f32,
}

impl CustomOp3 for LayerNorm {
    fn name(&self) -> &'static str {
        "layer-norm"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let x = contiguous_f32(s1, l1, "layer norm input")?;
        let w = contiguous_f32(s2, l2, "layer norm weight")?;
        let b = contiguous_f32(s3, l3, "layer norm bias")?;
        let c = w.len();
        let out = for_rows(x.len() / c, c, |r, o| rowops::layer_norm(&x[r * c..(r + 1) * c], w, b, self.eps, o));
        Ok((CpuStorage::F32(out), l1.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
        s3: &candle_core::CudaStorage,
        l3: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let out = crate::kernels::cuda::layer_norm((s1, l1), (s2, l2), (s3, l3), self.eps)?;
        Ok((out, l1.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _b: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let packed = x.apply_op3_no_bwd(w, &grad.contiguous()?, &LayerNormGrad { eps: self.eps })?; // (N + 2, C)
        let n = packed.dim(0)? - 2;
        let dx = packed.narrow(0, 0, n)?.reshape(x.shape())?;
        Ok((Some(dx), Some(packed.get(n)?), Some(packed.get(n + 1)?)))
    }
}

impl CustomOp3 for LayerNormGrad {
    fn name(&self) -> &'static str {
        "layer-norm-grad"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let x = contiguous_f32(s1, l1, "layer norm input")?;
        let w = contiguous_f32(s2, l2, "layer norm weight")?;
        let dy = contiguous_f32(s3, l3, "layer norm output gradient")?;
        let c = w.len();
        let n = x.len() / c;
        let mut out = Vec::with_capacity((n + 2) * c);
        let dx = SharedOut::new(&mut out, n * c);
        let sums = reduce_rows(n, 2 * c, x.len(), |rows, partial| {
            let (dw, db) = partial.split_at_mut(c);
            let mut scratch = vec![0f32; 2 * c];
            for r in rows {
                let range = r * c..(r + 1) * c;
                // SAFETY: rows are disjoint across blocks.
                let dx = unsafe { dx.range(range.clone()) };
                rowops::layer_norm_grad(&x[range.clone()], w, &dy[range], self.eps, dx, dw, db, &mut scratch);
            }
        });
        // SAFETY: every dx row was written above.
        unsafe { out.set_len(n * c) };
        out.extend_from_slice(&sums);
        Ok((CpuStorage::F32(out), Shape::from((n + 2, c))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
        s3: &candle_core::CudaStorage,
        l3: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let c = l2.shape().elem_count();
        let n = l1.shape().elem_count() / c;
        let out = crate::kernels::cuda::layer_norm_grad((s1, l1), (s2, l2), (s3, l3), self.eps)?;
        Ok((out, Shape::from((n + 2, c))))
    }
}

/// LayerNorm of `x` (.., C) with `weight` and `bias` (C,) of its dtype: f32 on the CPU, or
/// f32/bf16/f16 on a GPU (`kernels::cuda`).
pub fn layer_norm(x: &Tensor, weight: &Tensor, bias: &Tensor, eps: f64) -> Result<Tensor> {
    x.contiguous()?.apply_op3(&weight.contiguous()?, &bias.contiguous()?, LayerNorm { eps: eps as f32 })
}

// ---------------------------------------------------------------------------------------------
// Attention softmax

/// `softmax(att * scale + bias)` over the last dimension: att (B, NH, T, S), bias (B or 1, 1, T, S).
struct MaskedSoftmax {
    scale: f32,
}

/// Gradient of [`MaskedSoftmax`] with respect to att, from its output y and dy.
struct MaskedSoftmaxGrad {
    scale: f32,
}

impl CustomOp2 for MaskedSoftmax {
    fn name(&self) -> &'static str {
        "masked-softmax"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        let (_, nh, t, s) = l1.shape().dims4()?;
        let (bias_rows, _, _, _) = l2.shape().dims4()?;
        let att = contiguous_f32(s1, l1, "attention scores")?;
        let bias = contiguous_f32(s2, l2, "attention bias")?;
        let out = for_rows(att.len() / s, s, |r, o| {
            let (batch, i) = (r / (nh * t), r % t);
            let bias_row = if bias_rows == 1 { i } else { batch * t + i };
            rowops::masked_softmax(&att[r * s..(r + 1) * s], &bias[bias_row * s..(bias_row + 1) * s], self.scale, o);
        });
        Ok((CpuStorage::F32(out), l1.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        Ok((crate::kernels::cuda::masked_softmax(s1, l1, s2, l2, self.scale)?, l1.shape().clone()))
    }

    fn bwd(
        &self,
        _att: &Tensor,
        _bias: &Tensor,
        y: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        // The bias is a constant mask (the dispatcher never passes one that needs a gradient).
        let d = y.apply_op2_no_bwd(&grad.contiguous()?, &MaskedSoftmaxGrad { scale: self.scale })?;
        Ok((Some(d), None))
    }
}

impl CustomOp2 for MaskedSoftmaxGrad {
    fn name(&self) -> &'static str {
        "masked-softmax-grad"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        let s = l1.shape().dims().last().copied().unwrap_or(1);
        let y = contiguous_f32(s1, l1, "softmax output")?;
        let dy = contiguous_f32(s2, l2, "softmax output gradient")?;
        let out = for_rows(y.len() / s, s, |r, o| {
            rowops::masked_softmax_grad(&y[r * s..(r + 1) * s], &dy[r * s..(r + 1) * s], self.scale, o);
        });
        Ok((CpuStorage::F32(out), l1.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        Ok((crate::kernels::cuda::masked_softmax_grad(s1, l1, s2, l2, self.scale)?, l1.shape().clone()))
    }
}

/// `softmax(att * scale + bias)` for `att` (B, NH, T, S) and a constant f32 `bias`
/// (B or 1, 1, T, S): f32 on the CPU, or f32/bf16/f16 `att` on a GPU (`kernels::cuda`).
pub fn masked_softmax(att: &Tensor, scale: f64, bias: &Tensor) -> Result<Tensor> {
    att.contiguous()?.apply_op2(&bias.contiguous()?, MaskedSoftmax { scale: scale as f32 })
}

// ---------------------------------------------------------------------------------------------
// GELU

/// `gelu_new(h)`, GPT-2's tanh approximation.
struct Gelu;

/// Gradient of [`Gelu`] for (h, dy).
struct GeluGrad;

impl CustomOp1 for Gelu {
    fn name(&self) -> &'static str {
        "gelu"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let h = contiguous_f32(s, l, "pre-activation")?;
        let out = for_chunks(h.len(), |range, o| rowops::gelu(&h[range], o));
        Ok((CpuStorage::F32(out), l.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s: &candle_core::CudaStorage, l: &Layout) -> Result<(candle_core::CudaStorage, Shape)> {
        Ok((crate::kernels::cuda::gelu(s, l)?, l.shape().clone()))
    }

    fn bwd(&self, h: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(h.apply_op2_no_bwd(&grad.contiguous()?, &GeluGrad)?))
    }
}

impl CustomOp2 for GeluGrad {
    fn name(&self) -> &'static str {
        "gelu-grad"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        let h = contiguous_f32(s1, l1, "pre-activation")?;
        let dy = contiguous_f32(s2, l2, "activation gradient")?;
        let out = for_chunks(h.len(), |range, o| rowops::gelu_grad(&h[range.clone()], &dy[range], o));
        Ok((CpuStorage::F32(out), l1.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        Ok((crate::kernels::cuda::gelu_grad(s1, l1, s2, l2)?, l1.shape().clone()))
    }
}

/// `gelu_new(h)` (GPT-2's tanh approximation) of `h`: f32 on the CPU, or f32/bf16/f16 on a GPU.
pub fn gelu(h: &Tensor) -> Result<Tensor> {
    h.contiguous()?.apply_op1(Gelu)
}

// ---------------------------------------------------------------------------------------------
// Linear (HF Conv1D)

/// `x W + b` for x (.., in), W (in, out) (Hugging Face's Conv1D layout), b (out,): one gemm
/// accumulating into rows that start as the bias (on a GPU: the gemm, then the bias added by one
/// kernel). One node in the graph, where the composed ops make four (two reshapes, the gemm, the
/// broadcast add), each of which candle's backward adds into a zeros tensor. Backward: dx = dy W^T, dW = x^T dy (both
/// skipped for inputs that need no gradient, e.g. frozen weights), db = column sums of dy.
struct Linear;

/// Column sums of a (N, W) tensor: the bias gradient.
struct ColumnSums;

impl CustomOp3 for Linear {
    fn name(&self) -> &'static str {
        "linear"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let x = contiguous_f32(s1, l1, "linear input")?;
        let w = contiguous_f32(s2, l2, "linear weight")?;
        let b = contiguous_f32(s3, l3, "linear bias")?;
        let (d_in, d_out) = l2.shape().dims2()?;
        let n = x.len() / d_in;
        let mut dims = l1.shape().dims().to_vec();
        *dims.last_mut().expect("linear input has a last dimension") = d_out;
        if n <= crate::kernels::decode::MAX_LINEAR_ROWS && crate::kernels::decode::available() {
            // A decoding step: a few rows, where streaming the weights on every core wins.
            return Ok((CpuStorage::F32(crate::kernels::decode::linear_rows(x, n, w, b)), Shape::from(dims)));
        }
        let mut out = Vec::with_capacity(n * d_out);
        for _ in 0..n {
            out.extend_from_slice(b);
        }
        // SAFETY: x is (n, d_in), w (d_in, d_out) and out (n, d_out), all contiguous.
        unsafe {
            gemm_f32(
                (n, d_out, d_in),
                out.as_mut_ptr(),
                d_out,
                x.as_ptr(),
                (d_in, 1),
                w.as_ptr(),
                (d_out, 1),
                true,
                crate::runtime::threads(),
            )
        };
        Ok((CpuStorage::F32(out), Shape::from(dims)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
        s3: &candle_core::CudaStorage,
        l3: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let mut dims = l1.shape().dims().to_vec();
        *dims.last_mut().expect("linear input has a last dimension") = l2.shape().dims2()?.1;
        Ok((crate::kernels::cuda::linear((s1, l1), (s2, l2), (s3, l3))?, Shape::from(dims)))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        b: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (d_in, d_out) = w.dims2()?;
        let g2 = grad.contiguous()?.reshape(((), d_out))?; // (N, out)
                                                           // Detached operands: the gradients must not carry (and keep alive) a graph.
        let dx = match x.track_op() {
            true => Some(g2.matmul(&w.detach().t()?)?.reshape(x.shape())?),
            false => None,
        };
        let dw = match w.track_op() {
            true => Some(x.detach().reshape(((), d_in))?.t()?.matmul(&g2)?),
            false => None,
        };
        let db = match b.track_op() {
            true => Some(g2.apply_op1_no_bwd(&ColumnSums)?),
            false => None,
        };
        Ok((dx, dw, db))
    }
}

impl CustomOp1 for ColumnSums {
    fn name(&self) -> &'static str {
        "column-sums"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let g = contiguous_f32(s, l, "gradient")?;
        let (n, w) = l.shape().dims2()?;
        let sums = reduce_rows(n, w, g.len(), |rows, acc| {
            for r in rows {
                rowops::add_assign(acc, &g[r * w..(r + 1) * w]);
            }
        });
        Ok((CpuStorage::F32(sums), Shape::from(w)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s: &candle_core::CudaStorage, l: &Layout) -> Result<(candle_core::CudaStorage, Shape)> {
        let w = l.shape().dims2()?.1;
        Ok((crate::kernels::cuda::column_sums(s, l)?, Shape::from(w)))
    }
}

/// `x W + b` for `x` (.., in), `w` (in, out), `b` (out,): f32 on the CPU, or one dtype (f32,
/// bf16, f16) on a GPU (cuBLAS's gemm and `kernels::cuda`'s bias kernels).
pub fn linear(x: &Tensor, w: &Tensor, b: &Tensor) -> Result<Tensor> {
    x.contiguous()?.apply_op3(&w.contiguous()?, &b.contiguous()?, Linear)
}

// ---------------------------------------------------------------------------------------------
// Embedding

/// Rows of a table: `weight` (V, C) at `ids` (N,) gives (N, C), by the backend's own gather
/// (what `index_select` computes). The op exists for its backward, [`EmbeddingGrad`].
struct Embedding;

/// The gradient of [`Embedding`]'s table, dw (V, C): row v the sum of dy's rows at the positions
/// whose id is v, added in f32 in the order of the positions (as candle's `index_add` adds them
/// on the CPU) and rounded once; zeros for absent ids. On a GPU candle's `index_add` gives each of
/// C threads all N ids in turn (4.6 ms a step for gpt2's two tables at 8192 tokens on an H100);
/// here the ids are grouped by row on the host ([`group_ids`]) and one block sums each group.
struct EmbeddingGrad {
    vocab: usize,
    ids: Tensor,
}

/// The positions of `ids` grouped by id, ascending, packed as the GPU kernel reads them: the G
/// distinct ids, then the G + 1 starts of their groups, then the N positions, each group's in
/// ascending order. Returns (packed, G); an error for an id outside the table's `vocab` rows.
fn group_ids(ids: &[u32], vocab: usize) -> Result<(Vec<u32>, usize)> {
    if let Some(bad) = ids.iter().find(|&&id| id as usize >= vocab) {
        candle_core::bail!("embedding: id {bad} is outside the table's {vocab} rows");
    }
    let n = u32::try_from(ids.len()).map_err(|_| candle_core::Error::Msg("embedding: over 2^32 ids".into()))?;
    let mut positions: Vec<u32> = (0..n).collect();
    positions.sort_by_key(|&p| ids[p as usize]); // stable: positions stay ascending within an id
    let (mut rows, mut starts) = (Vec::new(), Vec::new());
    for (k, &p) in positions.iter().enumerate() {
        let id = ids[p as usize];
        if rows.last() != Some(&id) {
            rows.push(id);
            starts.push(k as u32);
        }
    }
    starts.push(n);
    let groups = rows.len();
    rows.extend(starts);
    rows.extend(positions);
    Ok((rows, groups))
}

impl CustomOp2 for Embedding {
    fn name(&self) -> &'static str {
        "embedding"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        use candle_core::backend::BackendStorage;
        let (n, c) = (l2.shape().elem_count(), l1.shape().dims2()?.1);
        Ok((s1.index_select(s2, l1, l2, 0)?, Shape::from((n, c))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        use candle_core::backend::BackendStorage;
        let (n, c) = (l2.shape().elem_count(), l1.shape().dims2()?.1);
        Ok((s1.index_select(s2, l1, l2, 0)?, Shape::from((n, c))))
    }

    fn bwd(
        &self,
        weight: &Tensor,
        ids: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let op = EmbeddingGrad { vocab: weight.dim(0)?, ids: ids.clone() };
        Ok((Some(grad.contiguous()?.apply_op1_no_bwd(&op)?), None))
    }
}

impl EmbeddingGrad {
    /// The ids on the host, grouped by row ([`group_ids`]).
    fn groups(&self, n: usize) -> Result<(Vec<u32>, usize)> {
        let ids = self.ids.flatten_all()?.to_dtype(candle_core::DType::U32)?.to_vec1::<u32>()?;
        if ids.len() != n {
            candle_core::bail!("embedding backward: {} ids for {n} gradient rows", ids.len());
        }
        group_ids(&ids, self.vocab)
    }
}

impl CustomOp1 for EmbeddingGrad {
    fn name(&self) -> &'static str {
        "embedding-grad"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let dy = contiguous_f32(s, l, "embedding gradient")?;
        let (n, c) = l.shape().dims2()?;
        let (groups, g) = self.groups(n)?;
        let (rows, rest) = groups.split_at(g);
        let (starts, positions) = rest.split_at(g + 1);
        let mut dw = vec![0f32; self.vocab * c];
        for (i, &row) in rows.iter().enumerate() {
            let out = &mut dw[row as usize * c..(row as usize + 1) * c];
            for &p in &positions[starts[i] as usize..starts[i + 1] as usize] {
                rowops::add_assign(out, &dy[p as usize * c..(p as usize + 1) * c]);
            }
        }
        Ok((CpuStorage::F32(dw), Shape::from((self.vocab, c))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s: &candle_core::CudaStorage, l: &Layout) -> Result<(candle_core::CudaStorage, Shape)> {
        let (n, c) = l.shape().dims2()?;
        let (groups, g) = self.groups(n)?;
        let dw = crate::kernels::cuda::embedding_grad((s, l), &groups, g, self.vocab)?;
        Ok((dw, Shape::from((self.vocab, c))))
    }
}

/// Rows `ids` (N,) u32 of `weight` (V, C): (N, C), any dtype on the CPU or a GPU; its backward
/// sums per row as described at [`EmbeddingGrad`] (f32 on the CPU; f32, bf16, f16 on a GPU).
pub fn embedding(weight: &Tensor, ids: &Tensor) -> Result<Tensor> {
    weight.contiguous()?.apply_op2(&ids.contiguous()?, Embedding)
}

// ---------------------------------------------------------------------------------------------
// Attention

/// Self-attention's core on the packed projections of `c_attn`: qkv (B, T, 3C) (q, k, v of C
/// columns each, head h at columns h*HD..(h+1)*HD of each) and the additive mask bias (B or 1,
/// 1, T, T) give y (B, T, C), the heads' outputs side by side:
/// `y_h = dropout(softmax(q_h k_h^T * scale + bias)) v_h`.
///
/// One (batch, head) pair per unit of parallel work, its gemms single-threaded and reading the
/// heads in place through strides (no split or merge copies). Nothing (B, NH, T, T) is kept:
/// backward recomputes the probabilities (one more q k^T gemm, small beside the projections),
/// and the dropout mask is regenerated from its key. Dropout's element indices are those of
/// the (B, NH, T, T) probabilities, so the mask equals the composed reference's. On a GPU, for
/// bf16 and f16 with heads of 64, the flash-style kernels of `kernels::cuda` compute the same;
/// their forward leaves the softmax's row statistics and the mask's tile map here for backward,
/// which then skips the pass over the keys that would recompute the one and the kernels that
/// would remake the other.
struct Attention {
    n_head: usize,
    scale: f32,
    dropout: Option<DropoutMask>,
    #[cfg(feature = "cuda")]
    saved: std::sync::Mutex<Option<std::sync::Arc<crate::kernels::cuda::AttentionSaved>>>,
}

/// Gradient of [`Attention`] for (qkv, bias, dy): dqkv (B, T, 3C). The GPU kernels also read the
/// forward's output `y` and what it saved (the row statistics and the mask's tile map), and the
/// mask transposed in its last two dimensions, `bias_t`.
struct AttentionGrad {
    n_head: usize,
    scale: f32,
    dropout: Option<DropoutMask>,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    y: Tensor,
    #[cfg(feature = "cuda")]
    saved: Option<std::sync::Arc<crate::kernels::cuda::AttentionSaved>>,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    bias_t: Option<Tensor>,
}

/// Shapes of one attention call and where a (batch, head) pair's matrices live.
#[derive(Clone, Copy)]
struct AttentionDims {
    t: usize,
    c: usize,
    hd: usize,
    n_head: usize,
    bias_rows: usize,
}

impl AttentionDims {
    fn new(qkv: &Layout, bias: &Layout, n_head: usize) -> Result<Self> {
        let (_, t, c3) = qkv.shape().dims3()?;
        let (bias_rows, _, bt, bs) = bias.shape().dims4()?;
        if bt != t || bs != t || c3 % (3 * n_head) != 0 {
            candle_core::bail!("attention: qkv {:?} and bias {:?} do not fit {n_head} heads", qkv.dims(), bias.dims());
        }
        Ok(Self { t, c: c3 / 3, hd: c3 / 3 / n_head, n_head, bias_rows })
    }

    /// Offset of head `h`'s `part` (0 q, 1 k, 2 v) of batch row `b` in qkv; row stride 3C.
    fn qkv(&self, b: usize, h: usize, part: usize) -> usize {
        b * self.t * 3 * self.c + part * self.c + h * self.hd
    }

    /// The (T, T) mask of batch row `b`.
    fn bias<'a>(&self, bias: &'a [f32], b: usize) -> &'a [f32] {
        let r = if self.bias_rows == 1 { 0 } else { b };
        &bias[r * self.t * self.t..(r + 1) * self.t * self.t]
    }

    /// The probabilities `softmax(q k^T * scale + bias)` of pair (b, h) into `p` (T, T).
    fn probabilities(&self, qkv: &[f32], bias: &[f32], b: usize, h: usize, scale: f32, p: &mut [f32]) {
        let (t, c3) = (self.t, 3 * self.c);
        // SAFETY: q and k are (T, HD) blocks of qkv with row stride 3C; p is (T, T).
        unsafe {
            gemm_f32(
                (t, t, self.hd),
                p.as_mut_ptr(),
                t,
                qkv[self.qkv(b, h, 0)..].as_ptr(),
                (c3, 1),
                qkv[self.qkv(b, h, 1)..].as_ptr(),
                (1, c3), // k^T
                false,
                1,
            )
        };
        let bias = self.bias(bias, b);
        for (row, bias) in p.chunks_exact_mut(t).zip(bias.chunks_exact(t)) {
            rowops::masked_softmax_in_place(row, bias, scale);
        }
    }

    /// Element index of (b, h, i, 0) in the (B, NH, T, T) probabilities (dropout's counter).
    fn prob_index(&self, b: usize, h: usize) -> usize {
        (b * self.n_head + h) * self.t * self.t
    }
}

impl CustomOp2 for Attention {
    fn name(&self) -> &'static str {
        "attention"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        let qkv = contiguous_f32(s1, l1, "qkv")?;
        let bias = contiguous_f32(s2, l2, "attention bias")?;
        let d = AttentionDims::new(l1, l2, self.n_head)?;
        let batch = l1.dims()[0];
        let (t, c) = (d.t, d.c);
        let mut out = Vec::new();
        let y = SharedOut::new(&mut out, batch * t * c);
        par_rows(batch * d.n_head, batch * d.n_head * t * t * d.hd, |pairs| {
            let mut p = vec![0f32; t * t];
            for pair in pairs {
                let (b, h) = (pair / d.n_head, pair % d.n_head);
                d.probabilities(qkv, bias, b, h, self.scale, &mut p);
                if let Some(mask) = &self.dropout {
                    mask.apply_in_place(d.prob_index(b, h), &mut p);
                }
                // SAFETY: pair (b, h) alone writes columns h*HD.. of batch row b's (T, C) block.
                unsafe {
                    gemm_f32(
                        (t, d.hd, t),
                        y.at(b * t * c + h * d.hd),
                        c,
                        p.as_ptr(),
                        (t, 1),
                        qkv[d.qkv(b, h, 2)..].as_ptr(),
                        (3 * c, 1),
                        false,
                        1,
                    )
                };
            }
        });
        // SAFETY: the pairs cover every (row, column) of y.
        unsafe { out.set_len(batch * t * c) };
        Ok((CpuStorage::F32(out), Shape::from((batch, t, c))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (y, saved) = crate::kernels::cuda::attention((s1, l1), (s2, l2), self.n_head, self.scale, self.dropout)?;
        *self
            .saved
            .lock()
            .map_err(|_| candle_core::Error::Msg("the attention's saved state lock poisoned".into()))? =
            Some(std::sync::Arc::new(saved));
        let (b, t, c3) = l1.shape().dims3()?;
        Ok((y, Shape::from((b, t, c3 / 3))))
    }

    fn bwd(&self, qkv: &Tensor, bias: &Tensor, y: &Tensor, grad: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let mut grad = grad.contiguous()?;
        let bias_t = match qkv.device().is_cuda() {
            true => {
                // The kernels' vector loads want dy on a 16-byte boundary.
                if !grad.layout().start_offset().is_multiple_of(8) {
                    grad = grad.copy()?;
                }
                Some(bias.transpose(2, 3)?.contiguous()?)
            }
            false => None,
        };
        let op = AttentionGrad {
            n_head: self.n_head,
            scale: self.scale,
            dropout: self.dropout,
            y: y.clone(),
            #[cfg(feature = "cuda")]
            saved: self
                .saved
                .lock()
                .map_err(|_| candle_core::Error::Msg("the attention's saved state lock poisoned".into()))?
                .clone(),
            bias_t,
        };
        Ok((Some(qkv.apply_op3_no_bwd(bias, &grad, &op)?), None))
    }
}

impl CustomOp3 for AttentionGrad {
    fn name(&self) -> &'static str {
        "attention-grad"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let qkv = contiguous_f32(s1, l1, "qkv")?;
        let bias = contiguous_f32(s2, l2, "attention bias")?;
        let dy = contiguous_f32(s3, l3, "attention output gradient")?;
        let d = AttentionDims::new(l1, l2, self.n_head)?;
        let batch = l1.dims()[0];
        let (t, c, hd) = (d.t, d.c, d.hd);
        let c3 = 3 * c;
        let mut out = Vec::new();
        let dqkv = SharedOut::new(&mut out, qkv.len());
        par_rows(batch * d.n_head, batch * d.n_head * t * t * hd, |pairs| {
            let (mut p, mut pd, mut dp) = (vec![0f32; t * t], vec![0f32; t * t], vec![0f32; t * t]);
            for pair in pairs {
                let (b, h) = (pair / d.n_head, pair % d.n_head);
                d.probabilities(qkv, bias, b, h, self.scale, &mut p);
                let kept: &[f32] = match &self.dropout {
                    Some(mask) => {
                        pd.copy_from_slice(&p);
                        mask.apply_in_place(d.prob_index(b, h), &mut pd);
                        &pd
                    }
                    None => &p,
                };
                let dy_bh = dy[b * t * c + h * hd..].as_ptr(); // (T, HD), row stride C
                                                               // SAFETY (all gemms below): pair (b, h) alone writes columns h*HD.. of the q, k
                                                               // and v parts of batch row b's (T, 3C) block of dqkv; reads are within qkv, dy
                                                               // and the (T, T) scratch buffers.
                unsafe {
                    // dv = kept^T dy
                    gemm_f32((t, hd, t), dqkv.at(d.qkv(b, h, 2)), c3, kept.as_ptr(), (1, t), dy_bh, (c, 1), false, 1);
                    // d(kept) = dy v^T
                    gemm_f32(
                        (t, t, hd),
                        dp.as_mut_ptr(),
                        t,
                        dy_bh,
                        (c, 1),
                        qkv[d.qkv(b, h, 2)..].as_ptr(),
                        (1, c3),
                        false,
                        1,
                    );
                }
                if let Some(mask) = &self.dropout {
                    mask.apply_in_place(d.prob_index(b, h), &mut dp);
                }
                // dS = scale * p * (dp - rowsum(dp * p))
                for (dp, p) in dp.chunks_exact_mut(t).zip(p.chunks_exact(t)) {
                    rowops::masked_softmax_grad_in_place(p, dp, self.scale);
                }
                unsafe {
                    // dq = dS k
                    gemm_f32(
                        (t, hd, t),
                        dqkv.at(d.qkv(b, h, 0)),
                        c3,
                        dp.as_ptr(),
                        (t, 1),
                        qkv[d.qkv(b, h, 1)..].as_ptr(),
                        (c3, 1),
                        false,
                        1,
                    );
                    // dk = dS^T q
                    gemm_f32(
                        (t, hd, t),
                        dqkv.at(d.qkv(b, h, 1)),
                        c3,
                        dp.as_ptr(),
                        (1, t),
                        qkv[d.qkv(b, h, 0)..].as_ptr(),
                        (c3, 1),
                        false,
                        1,
                    );
                }
            }
        });
        // SAFETY: the pairs cover every (row, column) of dqkv.
        unsafe { out.set_len(qkv.len()) };
        Ok((CpuStorage::F32(out), l1.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
        s3: &candle_core::CudaStorage,
        l3: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        use candle_core::Storage;
        let (Some(bias_t), Some(saved)) = (&self.bias_t, &self.saved) else {
            candle_core::bail!("attention backward on CUDA needs the transposed bias and the forward's statistics");
        };
        let (y, ly) = self.y.storage_and_layout();
        let (bias_t, lbt) = bias_t.storage_and_layout();
        let (Storage::Cuda(y), Storage::Cuda(bias_t)) = (&*y, &*bias_t) else {
            candle_core::bail!("attention backward on CUDA: the output and the bias must be on the GPU");
        };
        let dqkv = crate::kernels::cuda::attention_grad(
            (s1, l1),
            (s2, l2),
            (bias_t, lbt),
            (y, ly),
            saved,
            (s3, l3),
            self.n_head,
            self.scale,
            self.dropout,
        )?;
        Ok((dqkv, l1.shape().clone()))
    }
}

/// Self-attention's core for `qkv` (B, T, 3C) and a constant f32 mask `bias` (B or 1, 1, T, T):
/// (B, T, C), f32 on the CPU or bf16/f16 with heads of 64 on a GPU. See [`Attention`].
pub fn attention(
    qkv: &Tensor,
    bias: &Tensor,
    n_head: usize,
    scale: f64,
    dropout: Option<DropoutMask>,
) -> Result<Tensor> {
    let op = Attention {
        n_head,
        scale: scale as f32,
        dropout,
        #[cfg(feature = "cuda")]
        saved: Default::default(),
    };
    qkv.contiguous()?.apply_op2(&bias.contiguous()?, op)
}

// ---------------------------------------------------------------------------------------------
// Decoding step on a GPU (cuda/decode_attention.cu)

/// Writes the new tokens' keys and values of c_attn's output into a KV cache buffer in place.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))] // read by cuda_fwd
struct KvCacheAppend {
    n_head: usize,
    start: usize,
    /// c_attn's bias, when the output is the gemm's alone.
    qkv_bias: Option<Tensor>,
}

impl candle_core::InplaceOp2 for KvCacheAppend {
    fn name(&self) -> &'static str {
        "kv-cache-append"
    }

    fn cpu_fwd(&self, _: &mut CpuStorage, _: &Layout, _: &CpuStorage, _: &Layout) -> Result<()> {
        candle_core::bail!("the KV cache's one-launch append runs on a GPU; the CPU appends the split heads")
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        kv: &mut candle_core::CudaStorage,
        lkv: &Layout,
        qkv: &candle_core::CudaStorage,
        lq: &Layout,
    ) -> Result<()> {
        with_cuda_operands(&self.qkv_bias.iter().collect::<Vec<_>>(), |bias| {
            crate::kernels::cuda::kv_cache_append((kv, lkv), (qkv, lq), bias.first().copied(), self.n_head, self.start)
        })
    }
}

/// Runs `f` with the CUDA storages and layouts of `tensors`, operands an op holds beside its
/// arguments (candle's custom ops take at most three), read-locked meanwhile.
#[cfg(feature = "cuda")]
fn with_cuda_operands<R>(
    tensors: &[&Tensor],
    f: impl FnOnce(&[(&candle_core::CudaStorage, &Layout)]) -> Result<R>,
) -> Result<R> {
    let locked: Vec<_> = tensors.iter().map(|t| t.storage_and_layout()).collect();
    let operands = locked
        .iter()
        .map(|(storage, layout)| match &**storage {
            candle_core::Storage::Cuda(s) => Ok((s, *layout)),
            _ => candle_core::bail!("an operand of a CUDA op is not on the GPU"),
        })
        .collect::<Result<Vec<_>>>()?;
    f(&operands)
}

/// Writes the keys and values of `qkv` (B, T, 3C) into `kv` (2, B, NH, capacity, HD), keys then
/// values, at positions [start, start + T): one launch on a GPU. With `qkv_bias` (3C), c_attn's
/// bias is added to them first (`qkv` is then the gemm's output alone).
pub fn kv_cache_append(
    kv: &Tensor,
    qkv: &Tensor,
    qkv_bias: Option<&Tensor>,
    n_head: usize,
    start: usize,
) -> Result<()> {
    let qkv_bias = qkv_bias.map(Tensor::contiguous).transpose()?;
    kv.inplace_op2(&qkv.contiguous()?, &KvCacheAppend { n_head, start, qkv_bias })
}

/// Attention of the new tokens' queries over a KV cache buffer, from c_attn's output.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))] // read by cuda_fwd
struct DecodeAttention {
    n_head: usize,
    start: usize,
    scale: f32,
    /// c_attn's bias, when the output is the gemm's alone.
    qkv_bias: Option<Tensor>,
}

impl CustomOp3 for DecodeAttention {
    fn name(&self) -> &'static str {
        "decode-attention"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        candle_core::bail!("decode attention from qkv runs on a GPU; the CPU runs decode::cached_attention")
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        qkv: &candle_core::CudaStorage,
        lq: &Layout,
        kv: &candle_core::CudaStorage,
        lkv: &Layout,
        bias: &candle_core::CudaStorage,
        lb: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let y = with_cuda_operands(&self.qkv_bias.iter().collect::<Vec<_>>(), |qkv_bias| {
            let (qkv_bias, n_head, start, scale) = (qkv_bias.first().copied(), self.n_head, self.start, self.scale);
            crate::kernels::cuda::decode_attention((qkv, lq), qkv_bias, (kv, lkv), (bias, lb), n_head, start, scale)
        })?;
        let (b, t, c3) = lq.shape().dims3()?;
        Ok((y, Shape::from((b, t, c3 / 3))))
    }
}

/// `softmax(q k^T * scale + bias) v` per head for the new tokens' queries in `qkv` (B, T, 3C)
/// over the first start + T positions of `kv` (2, B, NH, capacity, HD), where
/// [`kv_cache_append`] has put their own keys and values; bias (B or 1, 1, T, start + T) f32:
/// (B, T, C). With `qkv_bias` (3C), c_attn's bias is added to the queries first. No gradient
/// (generation).
pub fn decode_attention(
    qkv: &Tensor,
    qkv_bias: Option<&Tensor>,
    kv: &Tensor,
    start: usize,
    bias: &Tensor,
    n_head: usize,
    scale: f64,
) -> Result<Tensor> {
    let qkv_bias = qkv_bias.map(Tensor::contiguous).transpose()?;
    let op = DecodeAttention { n_head, start, scale: scale as f32, qkv_bias };
    qkv.contiguous()?.apply_op3_no_bwd(kv, &bias.contiguous()?, &op)
}

/// A decoding step's launch that makes a new residual stream and a LayerNorm of it: (2, .., C).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))] // read by cuda_fwd
enum ResidualThenLayerNorm {
    /// After c_proj's gemm y, on the residual stream x: c_proj's bias and the LayerNorm's weight
    /// and bias.
    AfterBias([Tensor; 3], f32),
    /// From u32 ids and positions: wte, wpe and ln_1's weight and bias.
    Embeddings([Tensor; 4], f32),
}

impl CustomOp2 for ResidualThenLayerNorm {
    fn name(&self) -> &'static str {
        "residual-then-layer-norm"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        candle_core::bail!("the decoding step's fused epilogues run on a GPU")
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        a: &candle_core::CudaStorage,
        la: &Layout,
        b: &candle_core::CudaStorage,
        lb: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        use crate::kernels::cuda;
        let (out, rows) = match self {
            Self::AfterBias([bias, w, beta], eps) => {
                let out = with_cuda_operands(&[bias, w, beta], |v| {
                    cuda::bias_residual_layer_norm((a, la), (b, lb), [v[0], v[1], v[2]], *eps)
                })?;
                (out, la.dims().to_vec())
            }
            Self::Embeddings([wte, wpe, w, beta], eps) => {
                let out = with_cuda_operands(&[wte, wpe, w, beta], |t| {
                    cuda::embed_layer_norm((a, la), (b, lb), [t[0], t[1], t[2], t[3]], *eps)
                })?;
                (out, [la.dims(), &[wte.dim(1)?]].concat())
            }
        };
        Ok((out, Shape::from([&[2], &rows[..]].concat())))
    }
}

impl ResidualThenLayerNorm {
    /// (the new residual stream, its LayerNorm) from the op's two arguments.
    fn apply(self, a: &Tensor, b: &Tensor) -> Result<(Tensor, Tensor)> {
        let both = a.contiguous()?.apply_op2_no_bwd(&b.contiguous()?, &self)?;
        Ok((both.get(0)?, both.get(1)?))
    }
}

/// After c_proj's gemm `y` (.., C) without its bias `b`, on the residual stream `x` of y's shape:
/// the new residual `x + (y + b)` and its LayerNorm with `w`, `beta` (`eps`), in one launch on a
/// GPU, rounded as the bias add, the add and the LayerNorm kernels round. No gradient
/// (generation).
pub fn bias_residual_layer_norm(
    y: &Tensor,
    b: &Tensor,
    x: &Tensor,
    [w, beta]: [&Tensor; 2],
    eps: f64,
) -> Result<(Tensor, Tensor)> {
    let vectors = [b.contiguous()?, w.contiguous()?, beta.contiguous()?];
    ResidualThenLayerNorm::AfterBias(vectors, eps as f32).apply(y, x)
}

/// The embeddings `wte[ids] + wpe[positions]` of u32 `ids` and `positions` (B, T), and their
/// LayerNorm with `w`, `beta` (`eps`): ((B, T, C), (B, T, C)) in one launch on a GPU, rounded as
/// the lookups, the add and the LayerNorm kernel round. No gradient (generation).
pub fn embed_layer_norm(
    ids: &Tensor,
    positions: &Tensor,
    [wte, wpe]: [&Tensor; 2],
    [w, beta]: [&Tensor; 2],
    eps: f64,
) -> Result<(Tensor, Tensor)> {
    let tables = [wte.contiguous()?, wpe.contiguous()?, w.contiguous()?, beta.contiguous()?];
    ResidualThenLayerNorm::Embeddings(tables, eps as f32).apply(ids, positions)
}

/// `gelu_new(y + b)` after c_fc's gemm.
struct BiasGelu;

impl CustomOp2 for BiasGelu {
    fn name(&self) -> &'static str {
        "bias-gelu"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        candle_core::bail!("the decoding step's fused epilogues run on a GPU")
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        y: &candle_core::CudaStorage,
        ly: &Layout,
        b: &candle_core::CudaStorage,
        lb: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        Ok((crate::kernels::cuda::bias_gelu((y, ly), (b, lb))?, ly.shape().clone()))
    }
}

/// `gelu_new(y + b)` for c_fc's gemm output `y` (.., W) without its bias `b` (W): one launch on a
/// GPU, rounded as the bias add and the GELU kernels round. No gradient (generation).
pub fn bias_gelu(y: &Tensor, b: &Tensor) -> Result<Tensor> {
    y.contiguous()?.apply_op2_no_bwd(&b.contiguous()?, &BiasGelu)
}

// ---------------------------------------------------------------------------------------------
// Greedy decoding's choice (cuda/greedy_pick.cu)

/// Per row of logits (B, V): the token greedy decoding takes and its log-probability, (B, 2) f32.
struct GreedyPick {
    /// Ids from here on (Megatron's vocabulary padding) are never chosen; 1 to V.
    limit: usize,
}

impl CustomOp1 for GreedyPick {
    fn name(&self) -> &'static str {
        "greedy-pick"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let (b, v) = l.shape().dims2()?;
        let logits = contiguous_f32(s, l, "logits")?;
        let lse = crate::kernels::decode::log_sum_exp_rows(logits, v);
        let mut out = Vec::with_capacity(2 * b);
        for (row, lse) in logits.chunks_exact(v).zip(lse) {
            let token = rowops::argmax(&row[..self.limit]);
            out.extend([token as f32, (f64::from(row[token]) - lse) as f32]);
        }
        Ok((CpuStorage::F32(out), Shape::from((b, 2))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s: &candle_core::CudaStorage, l: &Layout) -> Result<(candle_core::CudaStorage, Shape)> {
        let b = l.shape().dims2()?.0;
        Ok((crate::kernels::cuda::greedy_pick((s, l), self.limit)?, Shape::from((b, 2))))
    }
}

/// Greedy decoding's next token for each row of `logits` (B, V): the first id below
/// `vocab_limit` with the row's largest logit; and its log-probability under the whole row,
/// `x[token] - logsumexp(x)` with the exponentials summed in f64. On a GPU one launch, and two
/// numbers a row come to the host instead of the row's V logits.
pub fn greedy_pick(logits: &Tensor, vocab_limit: usize) -> Result<(Vec<u32>, Vec<f32>)> {
    let (_, v) = logits.dims2()?;
    let logits = crate::kernels::sample_pick::logits_for_pick(logits, "greedy pick")?;
    let op = GreedyPick { limit: vocab_limit.clamp(1, v) };
    crate::kernels::sample_pick::picks_to_host(&logits.apply_op1_no_bwd(&op)?)
}

// ---------------------------------------------------------------------------------------------
// Dropout

/// Inverted dropout: keeps element i, scaled by 1/(1-p), where `keep(i)` of the mask holds.
struct Dropout {
    mask: DropoutMask,
}

impl Dropout {
    fn apply(&self, x: &[f32]) -> Vec<f32> {
        for_chunks(x.len(), |range, o| self.mask.apply(range.start, &x[range], o))
    }
}

impl CustomOp1 for Dropout {
    fn name(&self) -> &'static str {
        "dropout"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let x = contiguous_f32(s, l, "dropout input")?;
        Ok((CpuStorage::F32(self.apply(x)), l.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s: &candle_core::CudaStorage, l: &Layout) -> Result<(candle_core::CudaStorage, Shape)> {
        Ok((crate::kernels::cuda::dropout(s, l, self.mask)?, l.shape().clone()))
    }

    fn bwd(&self, _x: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        // The same mask times the gradient: dropout is linear in x.
        Ok(Some(grad.contiguous()?.apply_op1_no_bwd(&Dropout { mask: self.mask })?))
    }
}

/// Dropout of `x` with `mask`: f32 on the CPU, or f32/bf16/f16 on a GPU (`kernels::cuda`).
pub fn dropout(x: &Tensor, mask: DropoutMask) -> Result<Tensor> {
    x.contiguous()?.apply_op1(Dropout { mask })
}

// ---------------------------------------------------------------------------------------------
// Cast into

/// Writes an f32 tensor, cast, into the storage of a tensor of the same length: mixed precision's
/// compute copy refreshed from the fp32 masters without a temporary (one kernel on a GPU, where
/// `Var::set(&master.to_dtype(..))` is a cast and a copy). Rounds to nearest even, as `to_dtype`.
struct CastInto;

impl candle_core::InplaceOp2 for CastInto {
    fn name(&self) -> &'static str {
        "cast-into"
    }

    fn cpu_fwd(&self, dst: &mut CpuStorage, ld: &Layout, src: &CpuStorage, ls: &Layout) -> Result<()> {
        let src = contiguous_f32(src, ls, "the cast's source")?;
        let Some((start, end)) = ld.contiguous_offsets() else {
            candle_core::bail!("cast into a tensor takes a contiguous tensor");
        };
        if end - start != src.len() {
            candle_core::bail!("cast into a tensor: {} values from {}", end - start, src.len());
        }
        match dst {
            CpuStorage::F32(d) => d[start..end].copy_from_slice(src),
            CpuStorage::BF16(d) => d[start..end].iter_mut().zip(src).for_each(|(d, &s)| *d = half::bf16::from_f32(s)),
            CpuStorage::F16(d) => d[start..end].iter_mut().zip(src).for_each(|(d, &s)| *d = half::f16::from_f32(s)),
            _ => candle_core::bail!("cast into a tensor takes an f32, bf16 or f16 destination"),
        }
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        dst: &mut candle_core::CudaStorage,
        ld: &Layout,
        src: &candle_core::CudaStorage,
        ls: &Layout,
    ) -> Result<()> {
        crate::kernels::cuda::cast_into((dst, ld), (src, ls))
    }
}

/// `dst` (contiguous, f32, bf16 or f16) set to contiguous f32 `src` of the same shape, cast.
pub fn cast_into(dst: &Tensor, src: &Tensor) -> Result<()> {
    if dst.shape() != src.shape() || !dst.is_contiguous() || !src.is_contiguous() {
        candle_core::bail!("cast into a tensor: {:?} from {:?}, both contiguous", dst.dims(), src.dims());
    }
    dst.inplace_op2(src, &CastInto)
}

// ---------------------------------------------------------------------------------------------
// Gradient norm

/// The sum of squares of a contiguous f32 CPU tensor, read in place and accumulated in f64
/// across threads (`None` for other tensors: the caller falls back to candle's ops).
pub fn sum_of_squares(t: &Tensor) -> Result<Option<f64>> {
    if !t.device().is_cpu() || t.dtype() != candle_core::DType::F32 {
        return Ok(None);
    }
    let (storage, layout) = t.storage_and_layout();
    let (candle_core::Storage::Cpu(CpuStorage::F32(data)), Some((start, end))) =
        (&*storage, layout.contiguous_offsets())
    else {
        return Ok(None);
    };
    let x = &data[start..end];
    const CHUNK: usize = 64 * 1024;
    let chunks = x.len().div_ceil(CHUNK);
    let partial = std::sync::Mutex::new(vec![0f64; chunks]);
    par_rows(chunks, x.len(), |range| {
        for ci in range {
            let s = rowops::sum_of_squares(&x[ci * CHUNK..((ci + 1) * CHUNK).min(x.len())]);
            partial.lock().expect("partial sums lock")[ci] = s;
        }
    });
    // Summed in chunk order: the result does not depend on the threads.
    Ok(Some(partial.into_inner().expect("partial sums lock").iter().sum()))
}

/// The sum of squares of every tensor of `tensors` together, in f64, when all are f32, bf16 or
/// f16 on one GPU: one launch for all (cuda/sum_of_squares.cu) in a fixed order, and one copy of
/// the result to the host (`None` for other tensors: the caller sums them another way).
pub fn sum_of_squares_on_device(tensors: &[Tensor]) -> Result<Option<f64>> {
    #[cfg(feature = "cuda")]
    if !tensors.is_empty() && tensors.iter().all(|t| t.device().is_cuda() && crate::kernels::cuda::is_float(t.dtype()))
    {
        let contiguous: Vec<Tensor> = tensors.iter().map(Tensor::contiguous).collect::<Result<_>>()?;
        return crate::kernels::cuda::sum_of_squares(&contiguous.iter().collect::<Vec<_>>()).map(Some);
    }
    let _ = tensors;
    Ok(None)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::kernels::ops;
    use candle_core::{DType, Device, Var};

    thread_local! {
        static RNG: std::cell::RefCell<rand::rngs::StdRng> =
            std::cell::RefCell::new(rand::SeedableRng::seed_from_u64(0));
    }

    /// Normal draws from a seeded generator, like `Tensor::randn` but reproducible: each test
    /// runs on a thread of its own, so it draws the same numbers on every run and a tolerance
    /// means the same thing in CI and here.
    fn randn(mean: f32, std: f32, shape: impl Into<Shape>, device: &Device) -> Result<Tensor> {
        use rand::Rng;
        let shape = shape.into();
        let values: Vec<f32> = RNG.with(|rng| {
            let mut rng = rng.borrow_mut();
            (0..shape.elem_count())
                .map(|_| {
                    // Box-Muller: two uniforms in (0, 1] and [0, 1) to one standard normal.
                    let (u, v): (f32, f32) = (1.0 - rng.random::<f32>(), rng.random());
                    mean + std * (-2.0 * u.ln()).sqrt() * (std::f32::consts::TAU * v).cos()
                })
                .collect()
        });
        Tensor::from_vec(values, shape, device)
    }

    fn max_abs(t: &Tensor) -> Result<f32> {
        t.abs()?.flatten_all()?.max(0)?.to_scalar()
    }

    /// Largest difference relative to the largest entry of `want`.
    fn rel_diff(got: &Tensor, want: &Tensor) -> Result<f32> {
        Ok(max_abs(&got.sub(want)?)? / max_abs(want)?.max(1e-30))
    }

    /// Value and gradients (with respect to each of `inputs`) of the fused op `fused` and the
    /// composed reference `reference`, with a random upstream gradient.
    fn compare(
        inputs: &[Tensor],
        fused: impl Fn(&[Tensor]) -> Result<Tensor>,
        reference: impl Fn(&[Tensor]) -> Result<Tensor>,
        value_tol: f32,
        grad_tol: f32,
    ) -> Result<()> {
        let vars: Vec<Var> = inputs.iter().map(Var::from_tensor).collect::<Result<_>>()?;
        let ts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
        let (fused, reference) = (fused(&ts)?, reference(&ts)?);
        assert_eq!(fused.dims(), reference.dims());
        let d = rel_diff(&fused, &reference)?;
        assert!(d <= value_tol, "values differ by {d} relative");
        let w = randn(0f32, 1.0, fused.shape(), fused.device())?;
        let gf = fused.mul(&w)?.sum_all()?.backward()?;
        let gr = reference.mul(&w)?.sum_all()?.backward()?;
        for (i, v) in vars.iter().enumerate() {
            match (gf.get(v.as_tensor()), gr.get(v.as_tensor())) {
                (Some(a), Some(b)) => {
                    assert_eq!(a.dims(), b.dims(), "gradient of input {i}");
                    let d = rel_diff(a, b)?;
                    assert!(d <= grad_tol, "gradient of input {i} differs by {d} relative");
                }
                (None, None) => {}
                (a, b) => panic!("input {i}: fused gradient {:?}, reference {:?}", a.is_some(), b.is_some()),
            }
        }
        Ok(())
    }

    /// Central finite differences (in f64, through the fused op on f32 inputs) of
    /// `sum(f(x) * w)` at a few entries of `inputs[which]`, against the fused backward.
    fn finite_differences(
        inputs: &[Tensor],
        which: usize,
        f: impl Fn(&[Tensor]) -> Result<Tensor>,
        tol: f32,
    ) -> Result<()> {
        let vars: Vec<Var> = inputs.iter().map(Var::from_tensor).collect::<Result<_>>()?;
        let ts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
        let y = f(&ts)?;
        let w = randn(0f32, 1.0, y.shape(), y.device())?;
        let grads = y.mul(&w)?.sum_all()?.backward()?;
        let analytic: Vec<f32> = grads.get(vars[which].as_tensor()).expect("no gradient").flatten_all()?.to_vec1()?;
        let base: Vec<f32> = inputs[which].flatten_all()?.to_vec1()?;
        let eps = 1e-2f32;
        let n = base.len();
        let mut worst = 0f32;
        let scale = analytic.iter().fold(0f32, |m, g| m.max(g.abs())).max(1e-3);
        for i in (0..n).step_by((n / 23).max(1)) {
            let eval = |delta: f32| -> Result<f64> {
                let mut v = base.clone();
                v[i] += delta;
                let mut args = inputs.to_vec();
                args[which] = Tensor::from_vec(v, inputs[which].shape(), inputs[which].device())?;
                let y = f(&args)?.to_dtype(DType::F64)?;
                y.mul(&w.to_dtype(DType::F64)?)?.sum_all()?.to_scalar::<f64>()
            };
            let numeric = ((eval(eps)? - eval(-eps)?) / (2.0 * eps as f64)) as f32;
            worst = worst.max((numeric - analytic[i]).abs() / scale);
        }
        assert!(worst < tol, "finite differences of input {which} differ by {worst} relative");
        Ok(())
    }

    fn dev() -> Device {
        Device::Cpu
    }

    #[test]
    fn fused_cross_entropy_matches_the_composed_reference_value_and_gradient() -> Result<()> {
        let logits = randn(0f32, 3.0, (37, 211), &dev())?;
        let targets = Tensor::new((0..37u32).map(|i| (i * 17) % 211).collect::<Vec<_>>(), &dev())?;
        let fused = |t: &[Tensor]| cross_entropy_rows(&t[0], &targets);
        let reference = |t: &[Tensor]| ops::cross_entropy_rows_reference(&t[0], &targets);
        compare(std::slice::from_ref(&logits), fused, reference, 1e-6, 1e-6)?;
        finite_differences(&[logits], 0, fused, 1e-3)
    }

    #[test]
    fn fused_lm_head_cross_entropy_matches_the_reference() -> Result<()> {
        let x = randn(0f32, 1.0, (37, 24), &dev())?;
        let wte = randn(0f32, 0.5, (211, 24), &dev())?;
        let targets = Tensor::new((0..37u32).map(|i| (i * 17) % 211).collect::<Vec<_>>(), &dev())?;
        let fused = |t: &[Tensor]| lm_head_cross_entropy_rows(&t[0], &t[1], &targets);
        let reference = |t: &[Tensor]| ops::lm_head_cross_entropy_rows_reference(&t[0], &t[1], &targets);
        compare(&[x.clone(), wte.clone()], fused, reference, 1e-6, 1e-5)?;
        finite_differences(&[x.clone(), wte.clone()], 0, fused, 2e-3)?;
        finite_differences(&[x.clone(), wte.clone()], 1, fused, 2e-3)?;
        // A frozen embedding gets no gradient; the hidden states still do.
        let xv = Var::from_tensor(&x)?;
        let g = lm_head_cross_entropy_rows(xv.as_tensor(), &wte, &targets)?.sum_all()?.backward()?;
        let want = reference(&[xv.as_tensor().clone(), wte.clone()])?.sum_all()?.backward()?;
        assert!(g.get(&wte).is_none());
        assert!(rel_diff(g.get(xv.as_tensor()).unwrap(), want.get(xv.as_tensor()).unwrap())? < 1e-5);
        Ok(())
    }

    /// The gradient norm's sum, exact to f64 rounding: also for an embedding-like gradient, a few
    /// large rows among many tiny values, where f32 lanes lost 6e-6 relative (measured on a TP
    /// rank's embedding gradient), more than the 1e-5 the parallel layouts are checked against
    /// leaves room for.
    #[test]
    fn sum_of_squares_matches_an_f64_sum() -> Result<()> {
        let x = randn(0f32, 1.0, (300, 1000), &dev())?;
        let scale: Vec<f32> = (0..300).map(|r| if r % 50 == 0 { 30.0 } else { 1e-3 }).collect();
        let skewed = x.broadcast_mul(&Tensor::from_vec(scale, (300, 1), &dev())?)?;
        for x in [x, skewed] {
            let want: f64 = x.flatten_all()?.to_vec1::<f32>()?.iter().map(|&v| f64::from(v) * f64::from(v)).sum();
            let got = sum_of_squares(&x)?.expect("f32 on the CPU");
            assert!((got - want).abs() < 1e-12 * want, "{got} vs {want}");
        }
        let x = randn(0f32, 1.0, (3, 4), &dev())?;
        assert!(sum_of_squares(&x.to_dtype(DType::F64)?)?.is_none());
        Ok(())
    }

    #[test]
    fn ids_are_grouped_by_row_with_their_positions_in_order() -> Result<()> {
        // ids 3 1 3 0 1 3: rows 0, 1, 3; positions [3], [1, 4], [0, 2, 5].
        let (packed, g) = group_ids(&[3, 1, 3, 0, 1, 3], 4)?;
        assert_eq!(g, 3);
        assert_eq!(packed, vec![0, 1, 3, /* starts */ 0, 1, 3, 6, /* positions */ 3, 1, 4, 0, 2, 5]);
        assert_eq!(group_ids(&[], 4)?, (vec![0], 0));
        let err = group_ids(&[1, 4], 4).unwrap_err().to_string();
        assert!(err.contains("id 4 is outside the table's 4 rows"), "{err}");
        Ok(())
    }

    #[test]
    fn embedding_and_its_gradient_are_index_select_and_index_add_bit_for_bit() -> Result<()> {
        // Repeated ids (a row summed from several positions), absent rows (zero gradient).
        let weight = randn(0f32, 1.0, (50, 24), &dev())?;
        let ids = Tensor::new((0..300u32).map(|i| (i * i * 7) % 41).collect::<Vec<_>>(), &dev())?;
        let grads_of = |fused_op: bool| -> Result<(Tensor, Tensor)> {
            let w = Var::from_tensor(&weight)?;
            let y = match fused_op {
                true => embedding(w.as_tensor(), &ids)?,
                false => w.as_tensor().index_select(&ids, 0)?,
            };
            // The same output weights for both: a function of the element's index.
            let fixed: Vec<f32> = (0..y.elem_count()).map(|i| (i * 7919 % 1000) as f32 / 500.0 - 1.0).collect();
            let dy = Tensor::from_vec(fixed, y.shape(), &dev())?;
            let grads = y.mul(&dy)?.sum_all()?.backward()?;
            Ok((y, grads.get(w.as_tensor()).expect("the table has a gradient").clone()))
        };
        let (y, g) = grads_of(true)?;
        let (y_ref, g_ref) = grads_of(false)?;
        assert_eq!(y.dims(), &[300, 24]);
        assert_eq!(y.flatten_all()?.to_vec1::<f32>()?, y_ref.flatten_all()?.to_vec1::<f32>()?);
        assert_eq!(g.dims(), &[50, 24]);
        assert_eq!(g.flatten_all()?.to_vec1::<f32>()?, g_ref.flatten_all()?.to_vec1::<f32>()?);
        let absent = g.get(49)?.abs()?.sum_all()?.to_scalar::<f32>()?;
        assert_eq!(absent, 0.0, "row 49 has no id: its gradient is zero");
        Ok(())
    }

    /// f32 values that round differently in bf16 and f16: ties, subnormals, overflow, infinities.
    pub(crate) fn cast_probe_values() -> Vec<f32> {
        let mut v: Vec<f32> = (0..997).map(|i| ((i * 7919) % 2000) as f32 / 7.0 - 140.0).collect();
        v.extend([1.0 + 1.0 / 256.0, 1.0 + 3.0 / 256.0, 1.0 + 1.0 / 2048.0, 1e-40, -3e-8, 70000.0, 3.4e38]);
        v.extend([f32::INFINITY, f32::NEG_INFINITY, 0.0, -0.0]);
        v
    }

    #[test]
    fn cast_into_a_variable_is_to_dtype_bit_for_bit() -> Result<()> {
        let src = Tensor::new(cast_probe_values(), &dev())?;
        for dtype in [DType::BF16, DType::F16, DType::F32] {
            let dst = Var::from_tensor(&Tensor::zeros(src.shape(), dtype, &dev())?)?;
            ops::cast_into(&dst, &src)?;
            let (got, want) = (dst.as_tensor().to_dtype(DType::F32)?, src.to_dtype(dtype)?.to_dtype(DType::F32)?);
            let bits =
                |t: &Tensor| -> Result<Vec<u32>> { Ok(t.to_vec1::<f32>()?.iter().map(|v| v.to_bits()).collect()) };
            assert_eq!(bits(&got)?, bits(&want)?, "{dtype:?}");
        }
        let err = cast_into(&Tensor::zeros(3, DType::BF16, &dev())?, &src).unwrap_err().to_string();
        assert!(err.contains("cast into a tensor"), "{err}");
        Ok(())
    }

    #[test]
    fn out_of_vocabulary_target_is_an_error() -> Result<()> {
        let logits = Tensor::zeros((2, 4), DType::F32, &dev())?;
        let targets = Tensor::new(&[1u32, 9], &dev())?;
        assert!(cross_entropy_rows(&logits, &targets).is_err());
        Ok(())
    }

    #[test]
    fn fused_layer_norm_matches_the_reference_for_input_weight_and_bias() -> Result<()> {
        let ln = |t: &[Tensor]| layer_norm(&t[0], &t[1], &t[2], 1e-5);
        let ln_reference = |t: &[Tensor]| ops::layer_norm_reference(&t[0], &t[1], &t[2], 1e-5);
        // Large enough (rows x 96) to run on the thread pool and reduce over several blocks.
        for rows in [3, 700] {
            let x = (randn(0f32, 2.0, (rows, 96), &dev())? + 0.5)?;
            let w = randn(1f32, 0.3, 96, &dev())?;
            let b = randn(0f32, 0.3, 96, &dev())?;
            compare(&[x.clone(), w.clone(), b.clone()], ln, ln_reference, 1e-5, 1e-4)?;
            for which in 0..3 {
                finite_differences(&[x.clone(), w.clone(), b.clone()], which, ln, 2e-3)?;
            }
        }
        // (B, T, C) input.
        let x = randn(0f32, 1.0, (2, 5, 16), &dev())?;
        let (w, b) = (randn(1f32, 0.3, 16, &dev())?, randn(0f32, 0.3, 16, &dev())?);
        compare(&[x, w, b], ln, ln_reference, 1e-5, 1e-4)
    }

    /// A causal mask (rows, 1, T, T) with `pad[r]` left-padding keys masked in row r.
    fn causal_bias(rows: usize, t: usize, pad: &[usize]) -> Result<Tensor> {
        let mut bias = vec![0f32; rows * t * t];
        for r in 0..rows {
            for i in 0..t {
                for j in 0..t {
                    if j > i || j < pad[r] {
                        bias[(r * t + i) * t + j] = -1e9;
                    }
                }
            }
        }
        Tensor::from_vec(bias, (rows, 1, t, t), &dev())
    }

    #[test]
    fn fused_masked_softmax_matches_the_reference() -> Result<()> {
        let (b, nh, t) = (2, 3, 70);
        let padded = causal_bias(b, t, &[5, 0])?; // (B, 1, T, T), 5 left-padding keys in row 0
        let causal = causal_bias(1, t, &[0])?; // (1, 1, T, T)
        let att = randn(0f32, 3.0, (b, nh, t, t), &dev())?;
        for bias in [padded, causal] {
            let sm = |x: &[Tensor]| masked_softmax(&x[0], 0.125, &bias);
            let reference = |x: &[Tensor]| ops::masked_softmax_reference(&x[0], 0.125, &bias);
            compare(std::slice::from_ref(&att), sm, reference, 1e-6, 1e-5)?;
        }
        // Finite differences in f32 need few outputs to stay above rounding noise.
        let bias = causal_bias(2, 6, &[0, 0])?; // no fully masked row: f32 cannot see its slope
        let att = randn(0f32, 3.0, (2, 2, 6, 6), &dev())?;
        finite_differences(&[att], 0, |x| masked_softmax(&x[0], 0.125, &bias), 2e-3)
    }

    #[test]
    fn fused_gelu_matches_the_reference() -> Result<()> {
        for rows in [4, 300] {
            let h = randn(0f32, 2.0, (rows, 128), &dev())?;
            let f = |t: &[Tensor]| gelu(&t[0]);
            compare(std::slice::from_ref(&h), f, |t| ops::gelu_reference(&t[0], false), 1e-6, 1e-5)?;
            finite_differences(&[h], 0, f, 2e-3)?;
        }
        Ok(())
    }

    #[test]
    fn fused_linear_matches_the_reference_and_skips_inputs_without_gradient() -> Result<()> {
        let x = randn(0f32, 1.0, (3, 50, 64), &dev())?;
        let w = randn(0f32, 0.2, (64, 96), &dev())?;
        let b = randn(0f32, 0.2, 96, &dev())?;
        let f = |t: &[Tensor]| linear(&t[0], &t[1], &t[2]);
        let reference = |t: &[Tensor]| ops::linear_reference(&t[0], &t[1], &t[2]);
        compare(&[x.clone(), w.clone(), b.clone()], f, reference, 1e-6, 1e-5)?;
        for which in 0..3 {
            finite_differences(&[x.clone(), w.clone(), b.clone()], which, f, 2e-3)?;
        }
        // A frozen (non-variable) weight gets no gradient, and the others still do.
        let xv = Var::from_tensor(&x)?;
        let g = linear(xv.as_tensor(), &w, &b)?.sum_all()?.backward()?;
        assert!(g.get(&w).is_none() && g.get(xv.as_tensor()).is_some());
        Ok(())
    }

    #[test]
    fn fused_attention_matches_the_reference_with_and_without_dropout() -> Result<()> {
        let (b, t, nh, hd) = (2, 40, 3, 8);
        let qkv = randn(0f32, 1.0, (b, t, 3 * nh * hd), &dev())?;
        let key = ops::DropoutKey { seed: 1, step: 2, micro_batch: 3 };
        for (bias, drop) in [(causal_bias(b, t, &[7, 0])?, None), (causal_bias(1, t, &[0])?, Some(key.mask(0.2, 1, 0)))]
        {
            let f = |x: &[Tensor]| attention(&x[0], &bias, nh, 0.3, drop);
            let reference = |x: &[Tensor]| ops::attention_reference(&x[0], &bias, nh, 0.3, drop);
            compare(std::slice::from_ref(&qkv), f, reference, 1e-5, 1e-5)?;
        }
        // Finite differences in f32 need few outputs to stay above rounding noise.
        let qkv = randn(0f32, 1.0, (1, 5, 3 * 2 * 4), &dev())?;
        let bias = causal_bias(1, 5, &[0])?;
        finite_differences(&[qkv], 0, |x| attention(&x[0], &bias, 2, 0.5, None), 2e-3)
    }

    #[test]
    fn fused_dropout_matches_the_reference_and_its_gradient_is_the_mask() -> Result<()> {
        let key = ops::DropoutKey { seed: 3, step: 1, micro_batch: 2 };
        // Several mask chunks, so the parallel path runs.
        let x = randn(0f32, 1.0, (3, 50_000), &dev())?;
        let mask = key.mask(0.1, 4, 1);
        let f = |t: &[Tensor]| dropout(&t[0], mask);
        compare(std::slice::from_ref(&x), f, |t| ops::dropout_reference(&t[0], mask), 0.0, 0.0)?;
        finite_differences(&[x], 0, f, 1e-3)
    }

    /// Logits (B, V) for greedy decoding's pick, seeded normals times 4 with, in every third row
    /// from row 0, the largest value at three ids (first 17 + r, so ties span a GPU block's
    /// threads and strides), and in every third row from row 1 a larger one at an id at or above
    /// `limit` (the vocabulary's padding).
    pub(crate) fn logits_for_greedy_pick(b: usize, v: usize, limit: usize) -> Result<Tensor> {
        let mut rows = (randn(0f32, 1.0, (b, v), &Device::Cpu)? * 4.0)?.to_vec2::<f32>()?;
        for (r, row) in rows.iter_mut().enumerate() {
            match r % 3 {
                0 => [17 + r, 300 + r, limit - 1].iter().for_each(|&j| row[j] = 30.0),
                1 => row[limit + r % (v - limit)] = 50.0,
                _ => {}
            }
        }
        Tensor::new(rows, &Device::Cpu)
    }

    #[test]
    fn greedy_pick_takes_the_first_largest_logit_below_the_limit_and_its_log_probability() -> Result<()> {
        let (b, v, limit) = (7, 1003, 990);
        let logits = logits_for_greedy_pick(b, v, limit)?;
        for dtype in [DType::F32, DType::BF16] {
            let x = logits.to_dtype(dtype)?;
            let (tokens, logprobs) = greedy_pick(&x, limit)?;
            let rows = x.to_dtype(DType::F32)?.to_vec2::<f32>()?;
            for (r, row) in rows.iter().enumerate() {
                // Written out: the first id of the largest value below the limit, and
                // x[token] - (max + ln sum exp(x - max)) over the whole row in f64.
                let best = row[..limit].iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let token = row.iter().position(|&x| x == best).unwrap();
                assert_eq!(tokens[r] as usize, token, "{dtype:?} row {r}");
                if r % 3 == 0 {
                    assert_eq!(token, 17 + r, "{dtype:?} row {r}: the first of the tied ids");
                }
                let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
                let lse = max + row.iter().map(|&x| (x as f64 - max).exp()).sum::<f64>().ln();
                let want = row[token] as f64 - lse;
                assert!((logprobs[r] as f64 - want).abs() < 1e-5, "{dtype:?} row {r}: {} vs {want}", logprobs[r]);
            }
        }
        // A limit of 0 takes id 0, as generation's sampler did.
        assert_eq!(greedy_pick(&logits, 0)?.0, vec![0; b]);
        Ok(())
    }
}
