//! Fused CPU kernels with explicit backward, for the ops whose composed form costs the most.
//!
//! Cross-entropy over GPT-2's 50k-word vocabulary dominates a small model's step: composed from
//! candle ops it materialises about ten (N, V) tensors forward and backward. The fused kernel
//! reads the logits once forward (a per-row log-sum-exp) and writes the gradient once
//! backward (`softmax - onehot`), rows split across threads. The composed version in `ops.rs`
//! stays as the reference it is tested against, and serves devices this kernel does not cover.

use candle_core::{CpuStorage, CustomOp2, CustomOp3, DType, Layout, Result, Shape, Tensor};

/// Per-row `logsumexp(x) - x[target]`: (N, V) f32 logits, (N,) u32 targets -> (N,) f32.
struct CrossEntropyRows;

/// Gradient of [`CrossEntropyRows`]: `(softmax(x) - onehot(target)) * grad[row]`.
struct CrossEntropyRowsGrad;

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

/// Runs `f(row_index, row_chunk_out)` over rows in parallel; `out` has `width` values per row.
fn for_rows(out: &mut [f32], width: usize, f: impl Fn(usize, &mut [f32]) + Sync) {
    let rows = out.len() / width.max(1);
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).min(rows.max(1));
    let per = rows.div_ceil(threads).max(1);
    std::thread::scope(|s| {
        for (chunk_index, chunk) in out.chunks_mut(per * width).enumerate() {
            let f = &f;
            s.spawn(move || {
                for (i, row) in chunk.chunks_mut(width).enumerate() {
                    f(chunk_index * per + i, row);
                }
            });
        }
    });
}

fn log_sum_exp(row: &[f32]) -> f32 {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f32 = row.iter().map(|x| (x - max).exp()).sum();
    max + sum.ln()
}

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
        let mut out = vec![0f32; n];
        for_rows(&mut out, 1, |r, o| {
            let row = &logits[r * v..(r + 1) * v];
            o[0] = log_sum_exp(row) - row[targets[r] as usize];
        });
        Ok((CpuStorage::F32(out), Shape::from(n)))
    }

    fn bwd(
        &self,
        logits: &Tensor,
        targets: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let g = logits.apply_op3_no_bwd(targets, &grad.contiguous()?, &CrossEntropyRowsGrad)?;
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
        let grad = contiguous_f32(s3, l3, "grad")?;
        let mut out = vec![0f32; n * v];
        for_rows(&mut out, v, |r, o| {
            let row = &logits[r * v..(r + 1) * v];
            let lse = log_sum_exp(row);
            let g = grad[r];
            for (o, x) in o.iter_mut().zip(row) {
                *o = (x - lse).exp() * g;
            }
            o[targets[r] as usize] -= g;
        });
        Ok((CpuStorage::F32(out), Shape::from((n, v))))
    }
}

/// Per-row cross-entropy of `logits` (N, V) against `targets` (N,): fused on the CPU, the
/// composed reference elsewhere. Returns (N,) f32. Half-precision logits get PyTorch's
/// half-precision loss: accumulated in f32, the losses (and so their gradients) rounded to the
/// logits' dtype. Cast the logits to f32 first for an fp32 loss (`--compute-fp32-loss`).
pub fn cross_entropy_rows(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    let rows = if logits.device().is_cpu() {
        let logits32 = logits.to_dtype(DType::F32)?.contiguous()?;
        logits32.apply_op2(&targets.to_dtype(DType::U32)?.contiguous()?, CrossEntropyRows)?
    } else {
        crate::ops::cross_entropy_rows_reference(&logits.to_dtype(DType::F32)?, targets)?
    };
    rows.to_dtype(logits.dtype())?.to_dtype(DType::F32)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    #[test]
    fn fused_cross_entropy_matches_the_composed_reference_value_and_gradient() -> Result<()> {
        let dev = Device::Cpu;
        let logits = Var::from_tensor(&Tensor::randn(0f32, 3.0, (37, 211), &dev)?)?;
        let targets = Tensor::new((0..37u32).map(|i| (i * 17) % 211).collect::<Vec<_>>(), &dev)?;
        let w = Tensor::randn(0f32, 1.0, 37, &dev)?; // a non-uniform upstream gradient
        let fused = cross_entropy_rows(logits.as_tensor(), &targets)?;
        let reference = crate::ops::cross_entropy_rows_reference(logits.as_tensor(), &targets)?;
        let d: f32 = fused.sub(&reference)?.abs()?.max(0)?.to_scalar()?;
        assert!(d < 1e-5, "values differ by {d}");
        let gf = fused.mul(&w)?.sum_all()?.backward()?.get(logits.as_tensor()).unwrap().clone();
        let gr = reference.mul(&w)?.sum_all()?.backward()?.get(logits.as_tensor()).unwrap().clone();
        // Relative to the largest gradient entry: the inputs are unseeded random draws, and f32
        // rounding of softmax * w reaches about 1e-6 absolute on unlucky draws.
        let d: f32 = gf.sub(&gr)?.abs()?.flatten_all()?.max(0)?.to_scalar()?;
        let scale: f32 = gr.abs()?.flatten_all()?.max(0)?.to_scalar()?;
        assert!(d <= 1e-6 * scale.max(1.0), "gradients differ by {d} (largest entry {scale})");
        Ok(())
    }

    #[test]
    fn out_of_vocabulary_target_is_an_error() -> Result<()> {
        let logits = Tensor::zeros((2, 4), DType::F32, &Device::Cpu)?;
        let targets = Tensor::new(&[1u32, 9], &Device::Cpu)?;
        assert!(cross_entropy_rows(&logits, &targets).is_err());
        Ok(())
    }
}
