//! Cross-entropy per row with its backward: on given logits (the CPU kernel; the CUDA kernels of
//! cuda/cross_entropy.cu, one block a row reading the logits in their dtype), and fused with the
//! tied LM head on the CPU, where the (N, V) logits never become a tensor and backward turns them
//! into their gradient in place.

use crate::kernels::parallel::{for_rows, for_rows_weighted, gemm_f32, par_rows, SharedOut};
use crate::kernels::rowops;
use crate::storage::{contiguous_f32, contiguous_u32};
use candle_core::{CpuStorage, CustomOp2, CustomOp3, Layout, Result, Shape, Tensor};

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
        Ok((cuda::cross_entropy_rows((s1, l1), (s2, l2))?, Shape::from(n)))
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
        let out = cuda::cross_entropy_rows_grad((s1, l1), (s2, l2), (s3, l3))?;
        Ok((out, l1.shape().clone()))
    }
}

/// Per-row cross-entropy of `logits` (N, V) against u32 `targets` (N,): f32 logits on the CPU,
/// f32/bf16/f16 on a GPU (read in their dtype, computed in f32). (N,) f32
pub fn cross_entropy_rows(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    logits.contiguous()?.apply_op2(&targets.contiguous()?, CrossEntropyRows)
}

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

/// The launchers of the CUDA kernels (`cuda_fwd` above calls them).
#[cfg(feature = "cuda")]
pub mod cuda {
    use crate::kernels::cuda::{block_per_row, for_float_dtype, packed_rows, ptx, view};
    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::driver::PushKernelArg;
    use candle_core::cuda_backend::WrapErr;
    use candle_core::{CudaStorage, Layout, Result};

    /// Per-row `logsumexp(x) - x[target]` of contiguous logits (N, V) in f32, bf16 or f16 against
    /// u32 targets (N,), in f32 without an f32 copy of the logits: (N,) f32 (NaN for a target
    /// outside the vocabulary).
    pub fn cross_entropy_rows(
        (logits, ll): (&CudaStorage, &Layout),
        (targets, lt): (&CudaStorage, &Layout),
    ) -> Result<CudaStorage> {
        let (n, v) = ll.shape().dims2()?;
        let targets = view::<u32>(targets, lt, "the targets")?;
        Ok(for_float_dtype!(logits, ll, "cross-entropy", |src: Elem, suffix| {
            let dev = logits.device();
            // SAFETY: the kernel writes every row's loss.
            let loss = unsafe { dev.alloc::<f32>(n)? };
            let func = dev.get_or_load_custom_func(
                &format!("cross_entropy_{suffix}"),
                "rlhf_cross_entropy",
                ptx::CROSS_ENTROPY,
            )?;
            let mut launch = func.builder();
            let (v32, packed) = (v as u32, packed_rows(v, 0));
            launch.arg(src).arg(&targets).arg(&loss).arg(&v32).arg(&packed);
            // SAFETY: the arguments match the kernel's signature.
            unsafe { launch.launch(block_per_row(n)) }.w().map(|_| loss)
        }))
    }

    /// The gradient of [`cross_entropy_rows`] for (logits, targets, (loss, grad) per row as (N, 2)
    /// f32): `(softmax(x) - onehot(target)) * grad`, (N, V) in the logits' dtype.
    pub fn cross_entropy_rows_grad(
        (logits, ll): (&CudaStorage, &Layout),
        (targets, lt): (&CudaStorage, &Layout),
        (loss_grad, lg): (&CudaStorage, &Layout),
    ) -> Result<CudaStorage> {
        let (n, v) = ll.shape().dims2()?;
        let targets = view::<u32>(targets, lt, "the targets")?;
        let loss_grad = view::<f32>(loss_grad, lg, "the loss and gradient")?;
        Ok(for_float_dtype!(logits, ll, "cross-entropy backward", |src: Elem, suffix| {
            let dev = logits.device();
            // SAFETY: the kernel writes every element.
            let out = unsafe { dev.alloc::<Elem>(n * v)? };
            let func = dev.get_or_load_custom_func(
                &format!("cross_entropy_grad_{suffix}"),
                "rlhf_cross_entropy",
                ptx::CROSS_ENTROPY,
            )?;
            let mut launch = func.builder();
            let (v32, packed) = (v as u32, packed_rows(v, 0));
            launch.arg(src).arg(&targets).arg(&loss_grad).arg(&out).arg(&v32).arg(&packed);
            // SAFETY: the arguments match the kernel's signature.
            unsafe { launch.launch(block_per_row(n)) }.w().map(|_| out)
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::ops;
    use crate::kernels::ops::test_support::*;
    use candle_core::{DType, Var};

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

    #[test]
    fn out_of_vocabulary_target_is_an_error() -> Result<()> {
        let logits = Tensor::zeros((2, 4), DType::F32, &dev())?;
        let targets = Tensor::new(&[1u32, 9], &dev())?;
        assert!(cross_entropy_rows(&logits, &targets).is_err());
        Ok(())
    }
}

/// On a GPU against the CPU (the CUDA build's unit tests, which `scripts/gpu-check.sh` runs from
/// the package); without one they pass after saying so on stderr.
#[cfg(test)]
#[cfg(feature = "cuda")]
mod cuda_tests {
    use crate::kernels::ops::test_support::*;
    use crate::kernels::ops::{cross_entropy_rows, cross_entropy_rows_reference};
    use candle_core::{DType, Device, Result, Tensor};

    #[test]
    #[ignore = "needs a GPU: scripts/gpu-check.sh runs it (cargo test --features cuda -- --include-ignored)"]
    fn cross_entropy_rows_and_their_gradient_match_the_cpu() -> Result<()> {
        let gpu = gpu();
        let was_on = crate::kernels::cuda::packed_rows_on();
        // 37 rows over a vocabulary of 5003 (one value at a time: a block of 256 threads strides 20
        // times, with a tail) and of 5008 (with the packed kernels on, a multiple of 8: eight
        // values at a time, 626 Pack8s).
        for (packed, v) in [(false, 5003), (false, 5008), (true, 5003), (true, 5008)] {
            crate::kernels::cuda::set_packed_rows(packed);
            let n = 37;
            let logits = (Tensor::randn(0f32, 1f32, (n, v), &Device::Cpu)? * 4.0)?;
            let targets: Vec<u32> = (0..n as u32).map(|r| (r * 7919 + 11) % v as u32).collect();
            let targets = Tensor::new(targets, &Device::Cpu)?;
            let t_gpu = targets.to_device(&gpu)?;
            let (l_cpu, g_cpu) = value_and_grads(&[&logits], &Device::Cpu, |t| cross_entropy_rows(&t[0], &targets))?;
            let (l_gpu, g_gpu) = value_and_grads(&[&logits], &gpu, |t| cross_entropy_rows(&t[0], &t_gpu))?;
            assert!(max_diff(&l_gpu, &l_cpu)? < 2e-5, "V {v} packed {packed} loss {}", max_diff(&l_gpu, &l_cpu)?);
            // Each gradient is p * w - [target] * w with p = exp(x - lse): the two devices' lse
            // (about 17 here, an f32 ulp of 1.9e-6) differ by a few ulp, which moves p by as many
            // parts in 1e6 (measured on an H200: 1.25e-6).
            let diff = max_diff(&g_gpu[0], &g_cpu[0])?;
            assert!(diff < 5e-6, "V {v} packed {packed} gradient {diff}");
            // Half precision: the losses against the composed reference on f32 copies of the same
            // half-precision logits (what the kernel reads), then rounded as the loss is; the
            // gradient against the f32 kernel's on those copies (each a few of the dtype's ulps).
            for dtype in [DType::BF16, DType::F16] {
                let half = logits.to_dtype(dtype)?;
                let want = cross_entropy_rows_reference(&half.to_dtype(DType::F32)?, &targets)?;
                let got = cross_entropy_rows(&half.to_device(&gpu)?, &t_gpu)?;
                let scale = want.abs()?.max(0)?.to_scalar::<f32>()?;
                let tol = if dtype == DType::BF16 { 8e-3 } else { 1e-3 } * scale;
                assert!(max_diff(&got, &want)? <= tol, "V {v} packed {packed} {dtype:?} {}", max_diff(&got, &want)?);
                let (_, g_half) = value_and_grads(&[&half], &gpu, |t| cross_entropy_rows(&t[0], &t_gpu))?;
                let (_, g_f32) =
                    value_and_grads(&[&half.to_dtype(DType::F32)?], &gpu, |t| cross_entropy_rows(&t[0], &t_gpu))?;
                let ulps = if dtype == DType::BF16 { 0.03 } else { 0.004 };
                let (scale, diff) = (largest(&g_f32[0])?, max_diff(&g_half[0], &g_f32[0])?);
                assert!(diff <= ulps * scale, "V {v} packed {packed} {dtype:?} gradient {diff} (largest {scale})");
            }
        }
        crate::kernels::cuda::set_packed_rows(was_on);
        Ok(())
    }
}
