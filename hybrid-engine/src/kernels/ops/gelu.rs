//! GPT-2's GELU (`gelu_new`, the tanh approximation) with its backward: the CPU kernel
//! (`rowops::gelu`, chunks over threads) and the CUDA kernels (cuda/gelu.cu, elementwise).

use crate::kernels::parallel::for_chunks;
use crate::kernels::rowops;
use crate::storage::contiguous_f32;
use candle_core::{CpuStorage, CustomOp1, CustomOp2, Layout, Result, Shape, Tensor};

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
        Ok((cuda::gelu(s, l)?, l.shape().clone()))
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
        Ok((cuda::gelu_grad(s1, l1, s2, l2)?, l1.shape().clone()))
    }
}

/// `gelu_new(h)` (GPT-2's tanh approximation) of `h`: f32 on the CPU, or f32/bf16/f16 on a GPU.
pub fn gelu(h: &Tensor) -> Result<Tensor> {
    h.contiguous()?.apply_op1(Gelu)
}

/// The launchers of the CUDA kernels (`cuda_fwd` above calls them).
#[cfg(feature = "cuda")]
pub mod cuda {
    use crate::kernels::cuda::{elementwise8, for_float_dtype, ptx, view};
    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::driver::PushKernelArg;
    use candle_core::cuda_backend::WrapErr;
    use candle_core::{CudaStorage, Layout, Result};

    /// GPT-2's `gelu_new` of contiguous h (cuda/gelu.cu), in f32 inside.
    pub fn gelu(h: &CudaStorage, lh: &Layout) -> Result<CudaStorage> {
        Ok(for_float_dtype!(h, lh, "gelu", |src: Elem, suffix| {
            let dev = h.device();
            // SAFETY: the kernel writes all n elements.
            let out = unsafe { dev.alloc::<Elem>(src.len())? };
            let func = dev.get_or_load_custom_func(&format!("gelu_{suffix}"), "rlhf_gelu", ptx::GELU)?;
            let mut launch = func.builder();
            let n = src.len() as u64;
            launch.arg(src).arg(&out).arg(&n);
            // SAFETY: the arguments match the kernel's signature.
            unsafe { launch.launch(elementwise8(src.len())) }.w().map(|_| out)
        }))
    }

    /// `dy * gelu_new'(h)` for contiguous h and dy of one dtype.
    pub fn gelu_grad(h: &CudaStorage, lh: &Layout, dy: &CudaStorage, ldy: &Layout) -> Result<CudaStorage> {
        Ok(for_float_dtype!(h, lh, "gelu backward", |src: Elem, suffix| {
            let dev = h.device();
            let dy = view::<Elem>(dy, ldy, "the gelu output gradient")?;
            // SAFETY: the kernel writes all n elements.
            let out = unsafe { dev.alloc::<Elem>(src.len())? };
            let func = dev.get_or_load_custom_func(&format!("gelu_grad_{suffix}"), "rlhf_gelu", ptx::GELU)?;
            let mut launch = func.builder();
            let n = src.len() as u64;
            launch.arg(src).arg(&dy).arg(&out).arg(&n);
            // SAFETY: the arguments match the kernel's signature.
            unsafe { launch.launch(elementwise8(src.len())) }.w().map(|_| out)
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::ops;
    use crate::kernels::ops::test_support::*;

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
}

/// On a GPU against the CPU (the CUDA build's unit tests, which `scripts/gpu-check.sh` runs from
/// the package); without one they pass after saying so on stderr.
#[cfg(test)]
#[cfg(feature = "cuda")]
mod cuda_tests {
    use crate::kernels::ops::test_support::*;
    use crate::kernels::ops::{gelu, gelu_reference};
    use candle_core::{DType, Device, Result, Tensor};

    #[test]
    #[ignore = "needs a GPU: scripts/gpu-check.sh runs it (cargo test --features cuda -- --include-ignored)"]
    fn gelu_and_its_gradient_match_the_cpu() -> Result<()> {
        let gpu = gpu();
        let h = (Tensor::randn(0f32, 1f32, (7, 1001), &Device::Cpu)? * 3.0)?;
        let f = |t: &[Tensor]| gelu(&t[0], false);
        let (y_cpu, g_cpu) = value_and_grads(&[&h], &Device::Cpu, f)?;
        let (y_gpu, g_gpu) = value_and_grads(&[&h], &gpu, f)?;
        assert!(max_diff(&y_gpu, &y_cpu)? < 1e-5, "output {}", max_diff(&y_gpu, &y_cpu)?);
        assert!(max_diff(&g_gpu[0], &g_cpu[0])? < 1e-5, "gradient {}", max_diff(&g_gpu[0], &g_cpu[0])?);
        for dtype in [DType::BF16, DType::F16] {
            let want = gelu_reference(&h.to_dtype(dtype)?, false)?;
            let got = gelu(&h.to_dtype(dtype)?.to_device(&gpu)?, false)?;
            let tol = if dtype == DType::BF16 { 0.07 } else { 0.01 };
            assert!(max_diff(&got, &want)? <= tol, "{dtype:?} {}", max_diff(&got, &want)?);
            // A view five values into its buffer (not 16-byte aligned): the same values.
            let flat = h.to_dtype(dtype)?.flatten_all()?.to_device(&gpu)?;
            let shifted = gelu(&flat.narrow(0, 5, flat.elem_count() - 5)?, false)?;
            let whole = gelu(&flat, false)?.narrow(0, 5, flat.elem_count() - 5)?;
            assert_eq!(max_diff(&shifted, &whole)?, 0.0, "{dtype:?} unaligned");
        }
        Ok(())
    }
}
