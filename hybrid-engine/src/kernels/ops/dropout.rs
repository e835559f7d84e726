//! Inverted dropout with a counter-based mask (`kernels::dropout`), regenerated from its key in
//! backward: the CPU kernel (chunks over threads) and the CUDA kernel (cuda/dropout.cu, the same
//! hash drawn on the device, so both drop the same elements).

use crate::kernels::dropout::DropoutMask;
use crate::kernels::parallel::for_chunks;
use crate::storage::contiguous_f32;
use candle_core::{CpuStorage, CustomOp1, Layout, Result, Shape, Tensor};

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
        Ok((cuda::dropout(s, l, self.mask)?, l.shape().clone()))
    }

    fn bwd(&self, _x: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        // The same mask times the gradient: dropout is linear in x.
        Ok(Some(grad.contiguous()?.apply_op1_no_bwd(&Dropout { mask: self.mask })?))
    }
}

/// Dropout of `x` with `mask`: f32 on the CPU, or f32/bf16/f16 on a GPU (the `cuda` launchers below).
pub fn dropout(x: &Tensor, mask: DropoutMask) -> Result<Tensor> {
    x.contiguous()?.apply_op1(Dropout { mask })
}

/// The launchers of the CUDA kernels (`cuda_fwd` above calls them).
#[cfg(feature = "cuda")]
pub mod cuda {
    use crate::kernels::cuda::{elementwise8, for_float_dtype, ptx};
    use crate::kernels::dropout::DropoutMask;
    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::driver::PushKernelArg;
    use candle_core::cuda_backend::WrapErr;
    use candle_core::{CudaStorage, Layout, Result};

    /// `x * mask` for contiguous f32, bf16 or f16 `x` (cuda/dropout.cu): the mask's factors drawn on
    /// the GPU by the counter hash the CPU uses.
    pub fn dropout(x: &CudaStorage, layout: &Layout, mask: DropoutMask) -> Result<CudaStorage> {
        let (seed, threshold, scale) = mask.parts();
        Ok(for_float_dtype!(x, layout, "dropout", |src: Elem, suffix| {
            let dev = x.device();
            let n = src.len();
            // SAFETY: the kernel writes all n elements.
            let out = unsafe { dev.alloc::<Elem>(n)? };
            let func = dev.get_or_load_custom_func(&format!("dropout_{suffix}"), "rlhf_dropout", ptx::DROPOUT)?;
            let mut launch = func.builder();
            let n = n as u64;
            launch.arg(src).arg(&out).arg(&n).arg(&seed).arg(&threshold).arg(&scale);
            // SAFETY: the arguments match the kernel's signature.
            unsafe { launch.launch(elementwise8(n as usize)) }.w().map(|_| out)
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::ops;
    use crate::kernels::ops::test_support::*;

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
}

/// On a GPU against the CPU (the CUDA build's unit tests, which `scripts/gpu-check.sh` runs from
/// the package); without one they pass after saying so on stderr.
#[cfg(test)]
#[cfg(feature = "cuda")]
mod cuda_tests {
    use crate::kernels::ops::test_support::*;
    use crate::kernels::ops::{dropout, dropout_reference, DropoutKey};
    use candle_core::{DType, Device, Result, Tensor, Var};

    #[test]
    #[ignore = "needs a GPU: scripts/gpu-check.sh runs it (cargo test --features cuda -- --include-ignored)"]
    fn dropout_draws_the_cpu_mask_in_every_dtype_and_its_backward_is_the_same_mask() -> Result<()> {
        let gpu = gpu();
        let key = DropoutKey { seed: 7, step: 3, micro_batch: 1 };
        // Odd sizes: the grid-stride loop's tail.
        let x = Tensor::randn(0f32, 1f32, (5, 333, 77), &Device::Cpu)?;
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            let x = x.to_dtype(dtype)?;
            let want = dropout_reference(&x, key.mask(0.25, 2, 1))?;
            let got = dropout(&x.to_device(&gpu)?, 0.25, &key, 2, 1)?;
            assert_eq!(max_diff(&got, &want)?, 0.0, "{dtype:?}");
            // A view three values into its buffer: not 16-byte aligned, one value at a time.
            let flat = x.flatten_all()?;
            let view = flat.to_device(&gpu)?.narrow(0, 3, flat.elem_count() - 3)?;
            let want = dropout_reference(&flat.narrow(0, 3, flat.elem_count() - 3)?, key.mask(0.25, 2, 1))?;
            assert_eq!(max_diff(&dropout(&view, 0.25, &key, 2, 1)?, &want)?, 0.0, "{dtype:?} unaligned");
        }
        let v = Var::from_tensor(&x.to_device(&gpu)?)?;
        let weights = Tensor::randn(0f32, 1f32, x.shape(), &gpu)?;
        let grads = dropout(v.as_tensor(), 0.25, &key, 2, 1)?.mul(&weights)?.sum_all()?.backward()?;
        let want = dropout_reference(&weights.to_device(&Device::Cpu)?, key.mask(0.25, 2, 1))?;
        assert_eq!(max_diff(grads.get(v.as_tensor()).expect("a gradient"), &want)?, 0.0);
        Ok(())
    }
}
