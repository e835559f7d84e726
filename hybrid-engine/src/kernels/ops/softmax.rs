//! The attention's masked softmax on its own, `softmax(att * scale + bias)` over the last
//! dimension, with its backward (generation over the KV cache; training's composed attention on a
//! GPU in f32): the CPU kernel (`rowops::masked_softmax`) and the CUDA kernels
//! (cuda/masked_softmax.cu, one warp a row in f32).

use crate::kernels::parallel::for_rows;
use crate::kernels::rowops;
use crate::storage::contiguous_f32;
use candle_core::{CpuStorage, CustomOp2, Layout, Result, Shape, Tensor};

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
        Ok((cuda::masked_softmax(s1, l1, s2, l2, self.scale)?, l1.shape().clone()))
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
        Ok((cuda::masked_softmax_grad(s1, l1, s2, l2, self.scale)?, l1.shape().clone()))
    }
}

/// `softmax(att * scale + bias)` for `att` (B, NH, T, S) and a constant f32 `bias`
/// (B or 1, 1, T, S): f32 on the CPU, or f32/bf16/f16 `att` on a GPU (the `cuda` launchers below).
pub fn masked_softmax(att: &Tensor, scale: f64, bias: &Tensor) -> Result<Tensor> {
    att.contiguous()?.apply_op2(&bias.contiguous()?, MaskedSoftmax { scale: scale as f32 })
}

/// The launchers of the CUDA kernels (`cuda_fwd` above calls them).
#[cfg(feature = "cuda")]
pub mod cuda {
    use crate::kernels::cuda::{for_float_dtype, ptx, view, warp_per_row};
    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::driver::PushKernelArg;
    use candle_core::cuda_backend::WrapErr;
    use candle_core::{CudaStorage, Layout, Result};

    /// `softmax(att * scale + bias)` over the last dimension, in f32: att (B, NH, T, S) f32, bf16 or
    /// f16, bias (B or 1, 1, T, S) f32; the probabilities in att's dtype.
    pub fn masked_softmax(
        att: &CudaStorage,
        la: &Layout,
        bias: &CudaStorage,
        lb: &Layout,
        scale: f32,
    ) -> Result<CudaStorage> {
        let (_, nh, t, s) = la.shape().dims4()?;
        let bias_batches = lb.shape().dims4()?.0 as u32;
        let bias = view::<f32>(bias, lb, "the attention bias")?;
        Ok(for_float_dtype!(att, la, "masked softmax", |src: Elem, suffix| {
            let dev = att.device();
            let rows = src.len() / s;
            // SAFETY: the kernel writes every row.
            let out = unsafe { dev.alloc::<Elem>(src.len())? };
            let func =
                dev.get_or_load_custom_func(&format!("masked_softmax_{suffix}"), "rlhf_softmax", ptx::MASKED_SOFTMAX)?;
            let mut launch = func.builder();
            let (rows64, s, nh, t) = (rows as u64, s as u32, nh as u32, t as u32);
            launch.arg(src).arg(&bias).arg(&out).arg(&rows64).arg(&s).arg(&nh).arg(&t).arg(&bias_batches).arg(&scale);
            // SAFETY: the arguments match the kernel's signature.
            unsafe { launch.launch(warp_per_row(rows)) }.w().map(|_| out)
        }))
    }

    /// The gradient of [`masked_softmax`] with respect to att, from its output y and dy (same shape
    /// and dtype): `scale * y * (dy - sum(y * dy))` per row, in f32.
    pub fn masked_softmax_grad(
        y: &CudaStorage,
        ly: &Layout,
        dy: &CudaStorage,
        ldy: &Layout,
        scale: f32,
    ) -> Result<CudaStorage> {
        let s = ly.shape().dims().last().copied().unwrap_or(1);
        Ok(for_float_dtype!(y, ly, "masked softmax backward", |src: Elem, suffix| {
            let dev = y.device();
            let dy = view::<Elem>(dy, ldy, "the softmax's output gradient")?;
            let rows = src.len() / s;
            // SAFETY: the kernel writes every row.
            let out = unsafe { dev.alloc::<Elem>(src.len())? };
            let func = dev.get_or_load_custom_func(
                &format!("masked_softmax_grad_{suffix}"),
                "rlhf_softmax",
                ptx::MASKED_SOFTMAX,
            )?;
            let mut launch = func.builder();
            let (rows64, s) = (rows as u64, s as u32);
            launch.arg(src).arg(&dy).arg(&out).arg(&rows64).arg(&s).arg(&scale);
            // SAFETY: the arguments match the kernel's signature.
            unsafe { launch.launch(warp_per_row(rows)) }.w().map(|_| out)
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::ops;
    use crate::kernels::ops::test_support::*;

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
}

/// On a GPU against the CPU (the CUDA build's unit tests, which `scripts/gpu-check.sh` runs from
/// the package); without one they pass after saying so on stderr.
#[cfg(test)]
#[cfg(feature = "cuda")]
mod cuda_tests {
    use crate::kernels::ops::test_support::*;
    use crate::kernels::ops::{masked_softmax, masked_softmax_reference};
    use candle_core::{DType, Device, Result, Tensor, Var};

    #[test]
    #[ignore = "needs a GPU: scripts/gpu-check.sh runs it (cargo test --features cuda -- --include-ignored)"]
    fn masked_softmax_and_its_gradient_match_the_cpu() -> Result<()> {
        let gpu = gpu();
        // (B, NH, T, S) scores; a per-batch causal mask with padding (B, 1, T, S), and the
        // broadcast causal mask (1, 1, T, S); S = 70 spans three warp strides.
        let (b, nh, t) = (2, 3, 70);
        let att = (Tensor::randn(0f32, 1f32, (b, nh, t, t), &Device::Cpu)? * 3.0)?;
        let (per_batch, causal) = causal_masks(b, t)?;
        let dy = Tensor::randn(0f32, 1f32, att.shape(), &Device::Cpu)?;
        for bias in [&per_batch, &causal] {
            let v_cpu = Var::from_tensor(&att)?;
            let y_cpu = masked_softmax(v_cpu.as_tensor(), 0.125, bias)?;
            let g_cpu = y_cpu.mul(&dy)?.sum_all()?.backward()?;
            let v_gpu = Var::from_tensor(&att.to_device(&gpu)?)?;
            let y_gpu = masked_softmax(v_gpu.as_tensor(), 0.125, &bias.to_device(&gpu)?)?;
            let g_gpu = y_gpu.mul(&dy.to_device(&gpu)?)?.sum_all()?.backward()?;
            assert!(max_diff(&y_gpu, &y_cpu)? < 1e-6, "probabilities");
            let (gc, gg) = (g_cpu.get(v_cpu.as_tensor()).unwrap(), g_gpu.get(v_gpu.as_tensor()).unwrap());
            assert!(max_diff(gg, gc)? < 1e-6, "gradient {}", max_diff(gg, gc)?);
            // Half precision: scores upcast, normalised in f32, rounded once, as the reference.
            for dtype in [DType::BF16, DType::F16] {
                let want = masked_softmax_reference(&att.to_dtype(dtype)?, 0.125, bias)?;
                let got = masked_softmax(&att.to_dtype(dtype)?.to_device(&gpu)?, 0.125, &bias.to_device(&gpu)?)?;
                let tol = if dtype == DType::BF16 { 4e-3 } else { 5e-4 };
                assert!(max_diff(&got, &want)? <= tol, "{dtype:?} {}", max_diff(&got, &want)?);
            }
        }
        Ok(())
    }
}
