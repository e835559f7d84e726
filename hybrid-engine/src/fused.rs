//! Fused CPU kernels with explicit backward, for the ops whose composed form costs the most.
//!
//! Composed from candle ops, each of these materialises several full-size temporaries forward
//! and more backward (candle's backward also allocates a zero tensor and adds into it for every
//! input of every op). Each kernel here reads its inputs once forward and writes each gradient
//! once backward, rows split across candle's CPU thread pool:
//!
//! * cross-entropy over GPT-2's 50k-word vocabulary: a per-row log-sum-exp forward,
//!   `softmax - onehot` backward;
//! * LayerNorm: `(x - mean) * rstd * w + b` forward; backward recomputes the row statistics
//!   and returns dx, dw and db from one pass (one packed tensor, split into three views);
//! * the attention softmax with its scale and additive mask: `softmax(att * scale + bias)`
//!   forward, `scale * y * (dy - sum(dy * y))` backward from the saved output;
//! * bias add and GPT-2's tanh GELU: `gelu(h + b)` forward, dh and db from one pass backward;
//! * dropout: the mask is a pure function of the element index (see [`crate::ops::DropoutKey`]),
//!   so backward regenerates it instead of keeping it.
//!
//! The kernels take f32 tensors on the CPU. The dispatchers in `ops.rs` use them there and fall
//! back to the composed reference (also in `ops.rs`) for other dtypes and devices; the tests
//! below check value and gradient against that reference and against finite differences.

use crate::rowops;
use candle_core::{CpuStorage, CustomOp1, CustomOp2, CustomOp3, Layout, Result, Shape, Tensor};
use std::ops::Range;

/// Below this many output values a kernel runs on the calling thread: waking the pool costs
/// more than it saves (candle's own element-wise ops use 64k).
const PARALLEL_MIN: usize = 32 * 1024;

fn contiguous_f32<'a>(s: &'a CpuStorage, l: &Layout, what: &str) -> Result<&'a [f32]> {
    let (start, end) =
        l.contiguous_offsets().ok_or_else(|| candle_core::Error::Msg(format!("{what} must be contiguous")))?;
    match s {
        CpuStorage::F32(v) => Ok(&v[start..end]),
        _ => candle_core::bail!("{what} must be f32"),
    }
}

fn contiguous_u32<'a>(s: &'a CpuStorage, l: &Layout, what: &str) -> Result<&'a [u32]> {
    let (start, end) =
        l.contiguous_offsets().ok_or_else(|| candle_core::Error::Msg(format!("{what} must be contiguous")))?;
    match s {
        CpuStorage::U32(v) => Ok(&v[start..end]),
        _ => candle_core::bail!("{what} must be u32"),
    }
}

/// The spare capacity of an output vector, which the pool's workers write in disjoint pieces
/// before the owner sets its length (outputs are fully overwritten: no zero fill first).
#[derive(Clone, Copy)]
struct SharedOut {
    ptr: *mut f32,
    len: usize,
}

// SAFETY: only used to hand disjoint ranges of one buffer to the pool's workers (see `range`).
unsafe impl Send for SharedOut {}
unsafe impl Sync for SharedOut {}

impl SharedOut {
    /// The first `len` values of `out`'s buffer (reserved here), which must be empty.
    fn new(out: &mut Vec<f32>, len: usize) -> Self {
        assert!(out.is_empty(), "SharedOut writes from the start of an empty vector");
        out.reserve_exact(len);
        Self { ptr: out.as_mut_ptr(), len }
    }

    /// # Safety
    /// No two live slices may overlap: callers derive ranges from disjoint row ranges.
    #[allow(clippy::mut_from_ref)]
    unsafe fn range(&self, r: Range<usize>) -> &mut [f32] {
        assert!(r.start <= r.end && r.end <= self.len, "range {r:?} outside a buffer of {}", self.len);
        // Writing through a slice of uninitialised f32 is sound in practice (every bit pattern
        // is a valid f32) and is what candle's own kernels do; the callers only write.
        std::slice::from_raw_parts_mut(self.ptr.add(r.start), r.len())
    }
}

/// Runs `f(row_range)` over `rows` rows on candle's CPU thread pool (the calling thread when
/// the work, about `work` values touched, is small).
fn par_rows(rows: usize, work: usize, f: impl Fn(Range<usize>) + Sync) {
    if work < PARALLEL_MIN || rows < 2 {
        f(0..rows);
    } else {
        candle_core::utils::barrier_pool().execute_chunked(rows, f);
    }
}

/// A new (rows * width) buffer, row r written by `f(r, row)` in parallel.
fn for_rows(rows: usize, width: usize, f: impl Fn(usize, &mut [f32]) + Sync) -> Vec<f32> {
    for_rows_weighted(rows, width, rows * width, f)
}

/// [`for_rows`] where the work per row is not its width (a row-wise reduction).
fn for_rows_weighted(rows: usize, width: usize, work: usize, f: impl Fn(usize, &mut [f32]) + Sync) -> Vec<f32> {
    let mut out = Vec::new();
    let shared = SharedOut::new(&mut out, rows * width);
    par_rows(rows, work, |range| {
        for r in range {
            // SAFETY: the pool hands out disjoint row ranges.
            f(r, unsafe { shared.range(r * width..(r + 1) * width) });
        }
    });
    // SAFETY: every row was written by `f`.
    unsafe { out.set_len(rows * width) };
    out
}

/// Blocks of rows in a parallel reduction: a fixed number, so the result does not depend on
/// the thread count.
const REDUCE_BLOCKS: usize = 16;

/// Runs `f(row_range, partial)` over `rows` rows split into blocks, each with its own zeroed
/// `width`-value accumulator, and returns the sum of the accumulators. The blocks and the order
/// of the final sum do not depend on which thread runs what: the result is deterministic.
fn reduce_rows(rows: usize, width: usize, work: usize, f: impl Fn(Range<usize>, &mut [f32]) + Sync) -> Vec<f32> {
    let blocks = if work < PARALLEL_MIN { 1 } else { REDUCE_BLOCKS.min(rows).max(1) };
    let per = rows.div_ceil(blocks).max(1);
    let mut partials = vec![0f32; blocks * width];
    let shared = SharedOut { ptr: partials.as_mut_ptr(), len: partials.len() };
    par_rows(blocks, work, |bs| {
        for blk in bs {
            // SAFETY: each block owns its accumulator.
            let partial = unsafe { shared.range(blk * width..(blk + 1) * width) };
            f(blk * per..((blk + 1) * per).min(rows), partial);
        }
    });
    let (sum, rest) = partials.split_at_mut(width);
    for partial in rest.chunks(width) {
        sum.iter_mut().zip(partial).for_each(|(s, p)| *s += p);
    }
    partials.truncate(width);
    partials
}

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
}

/// Per-row cross-entropy of f32 `logits` (N, V) against u32 `targets` (N,) on the CPU. (N,)
pub fn cross_entropy_rows(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    logits.contiguous()?.apply_op2(&targets.contiguous()?, CrossEntropyRows)
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
}

/// LayerNorm of f32 `x` (.., C) with f32 `weight` and `bias` (C,) on the CPU.
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
}

/// `softmax(att * scale + bias)` for f32 `att` (B, NH, T, S) and a constant f32 `bias`
/// (B or 1, 1, T, S) on the CPU.
pub fn masked_softmax(att: &Tensor, scale: f64, bias: &Tensor) -> Result<Tensor> {
    att.contiguous()?.apply_op2(&bias.contiguous()?, MaskedSoftmax { scale: scale as f32 })
}

// ---------------------------------------------------------------------------------------------
// Bias add and GELU

/// `gelu_new(h + b)`: h (.., W), b (W,).
struct BiasGelu;

/// Gradient of [`BiasGelu`] for (h, b, dy): one (N + 1, W) tensor holding dh (N rows), then db.
struct BiasGeluGrad;

impl CustomOp2 for BiasGelu {
    fn name(&self) -> &'static str {
        "bias-gelu"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        let h = contiguous_f32(s1, l1, "pre-activation")?;
        let b = contiguous_f32(s2, l2, "bias")?;
        let w = b.len();
        let out = for_rows(h.len() / w, w, |r, o| rowops::bias_gelu(&h[r * w..(r + 1) * w], b, o));
        Ok((CpuStorage::F32(out), l1.shape().clone()))
    }

    fn bwd(&self, h: &Tensor, b: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let packed = h.apply_op3_no_bwd(b, &grad.contiguous()?, &BiasGeluGrad)?; // (N + 1, W)
        let n = packed.dim(0)? - 1;
        Ok((Some(packed.narrow(0, 0, n)?.reshape(h.shape())?), Some(packed.get(n)?)))
    }
}

impl CustomOp3 for BiasGeluGrad {
    fn name(&self) -> &'static str {
        "bias-gelu-grad"
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
        let h = contiguous_f32(s1, l1, "pre-activation")?;
        let b = contiguous_f32(s2, l2, "bias")?;
        let dy = contiguous_f32(s3, l3, "activation gradient")?;
        let w = b.len();
        let n = h.len() / w;
        let mut out = Vec::with_capacity((n + 1) * w);
        let dh = SharedOut::new(&mut out, n * w);
        let db = reduce_rows(n, w, h.len(), |rows, db| {
            for r in rows {
                let range = r * w..(r + 1) * w;
                // SAFETY: rows are disjoint across blocks.
                let dh = unsafe { dh.range(range.clone()) };
                rowops::bias_gelu_grad(&h[range.clone()], b, &dy[range], dh, db);
            }
        });
        // SAFETY: every dh row was written above.
        unsafe { out.set_len(n * w) };
        out.extend_from_slice(&db);
        Ok((CpuStorage::F32(out), Shape::from((n + 1, w))))
    }
}

/// `gelu_new(h + b)` (GPT-2's tanh approximation) for f32 `h` (.., W) and `b` (W,) on the CPU.
pub fn bias_gelu(h: &Tensor, b: &Tensor) -> Result<Tensor> {
    h.contiguous()?.apply_op2(&b.contiguous()?, BiasGelu)
}

// ---------------------------------------------------------------------------------------------
// Dropout

/// Inverted dropout: keeps element i, scaled by 1/(1-p), where `keep(i)` of the mask holds.
struct Dropout {
    mask: crate::ops::DropoutMask,
}

impl Dropout {
    fn apply(&self, x: &[f32]) -> Vec<f32> {
        let mut out = Vec::new();
        let shared = SharedOut::new(&mut out, x.len());
        let chunk = crate::ops::DropoutMask::CHUNK;
        par_rows(x.len().div_ceil(chunk), x.len(), |chunks| {
            for ci in chunks {
                let range = ci * chunk..((ci + 1) * chunk).min(x.len());
                // SAFETY: chunks are disjoint.
                let o = unsafe { shared.range(range.clone()) };
                self.mask.apply(range.start, &x[range], o);
            }
        });
        // SAFETY: the chunks cover every element.
        unsafe { out.set_len(x.len()) };
        out
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

    fn bwd(&self, _x: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        // The same mask times the gradient: dropout is linear in x.
        Ok(Some(grad.contiguous()?.apply_op1_no_bwd(&Dropout { mask: self.mask })?))
    }
}

/// Dropout of f32 `x` on the CPU with `mask`.
pub fn dropout(x: &Tensor, mask: crate::ops::DropoutMask) -> Result<Tensor> {
    x.contiguous()?.apply_op1(Dropout { mask })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops;
    use candle_core::{DType, Device, Var};

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
        let w = Tensor::randn(0f32, 1.0, fused.shape(), fused.device())?;
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
        let w = Tensor::randn(0f32, 1.0, y.shape(), y.device())?;
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
        let logits = Tensor::randn(0f32, 3.0, (37, 211), &dev())?;
        let targets = Tensor::new((0..37u32).map(|i| (i * 17) % 211).collect::<Vec<_>>(), &dev())?;
        let fused = |t: &[Tensor]| cross_entropy_rows(&t[0], &targets);
        let reference = |t: &[Tensor]| ops::cross_entropy_rows_reference(&t[0], &targets);
        compare(std::slice::from_ref(&logits), fused, reference, 1e-6, 1e-6)?;
        finite_differences(&[logits], 0, fused, 1e-3)
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
            let x = (Tensor::randn(0f32, 2.0, (rows, 96), &dev())? + 0.5)?;
            let w = Tensor::randn(1f32, 0.3, 96, &dev())?;
            let b = Tensor::randn(0f32, 0.3, 96, &dev())?;
            compare(&[x.clone(), w.clone(), b.clone()], ln, ln_reference, 1e-5, 1e-4)?;
            for which in 0..3 {
                finite_differences(&[x.clone(), w.clone(), b.clone()], which, ln, 2e-3)?;
            }
        }
        // (B, T, C) input.
        let x = Tensor::randn(0f32, 1.0, (2, 5, 16), &dev())?;
        let (w, b) = (Tensor::randn(1f32, 0.3, 16, &dev())?, Tensor::randn(0f32, 0.3, 16, &dev())?);
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
        let att = Tensor::randn(0f32, 3.0, (b, nh, t, t), &dev())?;
        for bias in [padded, causal] {
            let sm = |x: &[Tensor]| masked_softmax(&x[0], 0.125, &bias);
            let reference = |x: &[Tensor]| ops::masked_softmax_reference(&x[0], 0.125, &bias);
            compare(std::slice::from_ref(&att), sm, reference, 1e-6, 1e-5)?;
        }
        // Finite differences in f32 need few outputs to stay above rounding noise.
        let bias = causal_bias(2, 6, &[0, 0])?; // no fully masked row: f32 cannot see its slope
        let att = Tensor::randn(0f32, 3.0, (2, 2, 6, 6), &dev())?;
        finite_differences(&[att], 0, |x| masked_softmax(&x[0], 0.125, &bias), 2e-3)
    }

    #[test]
    fn fused_bias_gelu_matches_the_reference() -> Result<()> {
        for rows in [4, 300] {
            let h = Tensor::randn(0f32, 2.0, (rows, 128), &dev())?;
            let b = Tensor::randn(0f32, 0.5, 128, &dev())?;
            let f = |t: &[Tensor]| bias_gelu(&t[0], &t[1]);
            let reference = |t: &[Tensor]| ops::bias_gelu_reference(&t[0], &t[1], false);
            compare(&[h.clone(), b.clone()], f, reference, 1e-6, 1e-5)?;
            finite_differences(&[h.clone(), b.clone()], 0, f, 2e-3)?;
            finite_differences(&[h, b], 1, f, 2e-3)?;
        }
        Ok(())
    }

    #[test]
    fn fused_dropout_matches_the_reference_and_its_gradient_is_the_mask() -> Result<()> {
        let key = ops::DropoutKey { seed: 3, step: 1, micro_batch: 2 };
        // Several mask chunks, so the parallel path runs.
        let x = Tensor::randn(0f32, 1.0, (3, 50_000), &dev())?;
        let mask = key.mask(0.1, 4, 1);
        let f = |t: &[Tensor]| dropout(&t[0], mask);
        compare(std::slice::from_ref(&x), f, |t| ops::dropout_reference(&t[0], mask), 0.0, 0.0)?;
        finite_differences(&[x], 0, f, 1e-3)
    }
}
