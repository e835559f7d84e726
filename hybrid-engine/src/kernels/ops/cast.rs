//! The in-place cast that refreshes mixed precision's compute copy from the fp32 masters without
//! a temporary: on the CPU and on a GPU (cuda/cast.cu), rounding to nearest even as `to_dtype`.

use crate::storage::contiguous_f32;
use candle_core::{CpuStorage, Layout, Result, Tensor};

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
        cuda::cast_into((dst, ld), (src, ls))
    }
}

/// `dst` (contiguous, f32, bf16 or f16) set to contiguous f32 `src` of the same shape, cast.
pub fn cast_into(dst: &Tensor, src: &Tensor) -> Result<()> {
    if dst.shape() != src.shape() || !dst.is_contiguous() || !src.is_contiguous() {
        candle_core::bail!("cast into a tensor: {:?} from {:?}, both contiguous", dst.dims(), src.dims());
    }
    dst.inplace_op2(src, &CastInto)
}

/// The launchers of the CUDA kernels (`cuda_fwd` above calls them).
#[cfg(feature = "cuda")]
pub mod cuda {
    use crate::kernels::cuda::{elementwise, ptx, view};
    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::driver::PushKernelArg;
    use candle_core::cuda_backend::{CudaStorageSlice, WrapErr};
    use candle_core::{CudaStorage, Layout, Result};

    /// Casts contiguous f32 `src` into the existing storage of contiguous bf16 or f16 `dst` of the same
    /// length (cuda/cast.cu), rounding to nearest even.
    pub fn cast_into((dst, ld): (&mut CudaStorage, &Layout), (src, ls): (&CudaStorage, &Layout)) -> Result<()> {
        let src = view::<f32>(src, ls, "the cast's source")?;
        let Some((start, end)) = ld.contiguous_offsets() else {
            candle_core::bail!("cast into a tensor on CUDA takes a contiguous tensor");
        };
        if end - start != src.len() {
            candle_core::bail!("cast into a tensor on CUDA: {} values from {}", end - start, src.len());
        }
        let dev = dst.device().clone();
        let n = src.len() as u64;
        macro_rules! launch {
            ($slice:expr, $suffix:literal) => {{
                let mut out = $slice.slice_mut(start..end);
                let func = dev.get_or_load_custom_func(concat!("cast_into_", $suffix), "rlhf_cast", ptx::CAST)?;
                let mut launch = func.builder();
                launch.arg(&mut out).arg(&src).arg(&n);
                // SAFETY: the arguments match the kernel's signature; it writes n values of out.
                unsafe { launch.launch(elementwise(n as usize)) }.w().map(|_| ())
            }};
        }
        match &mut dst.slice {
            CudaStorageSlice::BF16(x) => launch!(x, "bf16"),
            CudaStorageSlice::F16(x) => launch!(x, "f16"),
            _ => {
                candle_core::bail!("cast into a tensor on CUDA takes a bf16 or f16 destination, not {:?}", dst.dtype())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::ops;
    use crate::kernels::ops::test_support::*;
    use candle_core::{DType, Var};

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
}

/// On a GPU against the CPU (the CUDA build's unit tests, which `scripts/gpu-check.sh` runs from
/// the package); without one they pass after saying so on stderr.
#[cfg(test)]
#[cfg(feature = "cuda")]
mod cuda_tests {
    use crate::kernels::ops::test_support::*;
    use candle_core::{DType, Device, Result, Tensor, Var};

    #[test]
    #[ignore = "needs a GPU: scripts/gpu-check.sh runs it (cargo test --features cuda -- --include-ignored)"]
    fn cast_into_a_variable_is_the_cpu_cast_bit_for_bit() -> Result<()> {
        let gpu = gpu();
        let values = super::tests::cast_probe_values();
        let src = Tensor::new(values, &Device::Cpu)?;
        for dtype in [DType::BF16, DType::F16] {
            let dst = Var::from_tensor(&Tensor::zeros(src.shape(), dtype, &gpu)?)?;
            crate::kernels::ops::cast_into(&dst, &src.to_device(&gpu)?)?;
            let got = dst.as_tensor().to_device(&Device::Cpu)?.to_dtype(DType::F32)?.to_vec1::<f32>()?;
            let want = src.to_dtype(dtype)?.to_dtype(DType::F32)?.to_vec1::<f32>()?;
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&got), bits(&want), "{dtype:?}");
        }
        Ok(())
    }
}
