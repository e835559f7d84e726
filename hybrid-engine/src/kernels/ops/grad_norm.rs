//! The gradient norm's sum of squares in f64: a contiguous f32 CPU tensor read in place across
//! threads, and every tensor on a GPU in one multi-tensor launch (cuda/sum_of_squares.cu), summed
//! in a fixed order.

use crate::kernels::parallel::par_rows;
use crate::kernels::rowops;
use candle_core::{CpuStorage, Result, Tensor};

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
        return cuda::sum_of_squares(&contiguous.iter().collect::<Vec<_>>()).map(Some);
    }
    let _ = tensors;
    Ok(None)
}

/// The launcher of the CUDA kernels ([`sum_of_squares_on_device`] calls it).
#[cfg(feature = "cuda")]
pub mod cuda {
    use crate::kernels::cuda::{address, common_device, ptx, upload_table, TensorSlot, BLOCK, MULTI_TENSOR_CHUNK};
    use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
    use candle_core::cuda_backend::WrapErr;
    use candle_core::{Result, Tensor};

    /// The sum of squares of `tensors` (contiguous f32, bf16 or f16, on one GPU) in f64, what a
    /// gradient norm adds up (cuda/sum_of_squares.cu): every tensor in one launch, each chunk summed
    /// by a block and the chunks' sums added in order by a second kernel, so every run gives the
    /// same bits; the one value is then copied to the host.
    pub fn sum_of_squares(tensors: &[&Tensor]) -> Result<f64> {
        let dev = common_device(tensors)?;
        let mut slots = Vec::with_capacity(tensors.len());
        for t in tensors.iter().filter(|t| t.elem_count() > 0) {
            let (grad, grad_dtype) = address(t, "sum of squares")?;
            slots.push(TensorSlot { grad, grad_dtype, n: t.elem_count() as u64, ..Default::default() });
        }
        if slots.is_empty() {
            return Ok(0.0);
        }
        let (table, count, chunks) = upload_table(&dev, &mut slots)?;
        // SAFETY: each block writes its chunk's sum, then the second kernel the one value.
        let partial = unsafe { dev.alloc::<f64>(chunks as usize)? };
        let out = unsafe { dev.alloc::<f64>(1)? };
        let module = ("rlhf_sum_of_squares", ptx::SUM_OF_SQUARES);
        let func = dev.get_or_load_custom_func("sum_of_squares_multi_tensor", module.0, module.1)?;
        let mut launch = func.builder();
        launch.arg(&table).arg(&count).arg(&MULTI_TENSOR_CHUNK).arg(&partial);
        let per_chunk = LaunchConfig { grid_dim: (chunks, 1, 1), block_dim: (BLOCK, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: the arguments match the kernel's signature; the table's slots hold the tensors.
        unsafe { launch.launch(per_chunk) }.w()?;
        let sum = dev.get_or_load_custom_func("sum_partials_f64", module.0, module.1)?;
        let mut launch = sum.builder();
        launch.arg(&partial).arg(&chunks).arg(&out);
        let one = LaunchConfig { grid_dim: (1, 1, 1), block_dim: (BLOCK, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: the arguments match the kernel's signature.
        unsafe { launch.launch(one) }.w()?;
        Ok(dev.clone_dtoh(&out)?[0])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::ops::test_support::*;
    use candle_core::DType;

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
}

/// On a GPU against the CPU (the CUDA build's unit tests, which `scripts/gpu-check.sh` runs from
/// the package); without one they pass after saying so on stderr.
#[cfg(test)]
#[cfg(feature = "cuda")]
mod cuda_tests {
    use crate::kernels::ops::test_support::*;
    use candle_core::{DType, Device, Result, Tensor};

    #[test]
    #[ignore = "needs a GPU: scripts/gpu-check.sh runs it (cargo test --features cuda -- --include-ignored)"]
    fn sum_of_squares_matches_the_cpu_in_f64_and_is_deterministic() -> Result<()> {
        let gpu = gpu();
        let exact = |ts: &[Tensor]| -> Result<f64> {
            let mut sum = 0.0;
            for t in ts {
                sum += t.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?.iter().map(|v| v * v).sum::<f64>();
            }
            Ok(sum)
        };
        let sum =
            |ts: &[Tensor]| -> Result<f64> { Ok(super::sum_of_squares_on_device(ts)?.expect("tensors on a GPU")) };
        // One tensor of 3 x 333 333 values (61 chunks, the last partial), in each dtype.
        let x = (Tensor::randn(0f32, 1f32, (3, 333_333), &Device::Cpu)? * 0.01)?;
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            let x = x.to_dtype(dtype)?;
            let (want, on_gpu) = (exact(std::slice::from_ref(&x))?, [x.to_device(&gpu)?]);
            let got = sum(&on_gpu)?;
            assert!((got - want).abs() <= 1e-12 * want, "{dtype:?}: {got} against {want}");
            assert_eq!(sum(&on_gpu)?.to_bits(), got.to_bits(), "{dtype:?}: differs between two runs");
        }
        // Many tensors in one launch: the three dtypes mixed, an empty one, one value, exactly a
        // chunk and a chunk and one.
        let chunk = crate::kernels::cuda::MULTI_TENSOR_CHUNK as usize;
        let many: Vec<Tensor> = [
            (0, DType::F32),
            (1, DType::BF16),
            (chunk, DType::F16),
            (chunk + 1, DType::F32),
            (777, DType::BF16),
            (3 * chunk - 5, DType::F32),
        ]
        .iter()
        .map(|&(n, dtype)| (Tensor::randn(0f32, 1f32, n, &Device::Cpu)? + 0.5)?.to_dtype(dtype))
        .collect::<Result<_>>()?;
        let want = exact(&many)?;
        let on_gpu: Vec<Tensor> = many.iter().map(|t| t.to_device(&gpu)).collect::<Result<_>>()?;
        let got = sum(&on_gpu)?;
        assert!((got - want).abs() <= 1e-12 * want, "many tensors: {got} against {want}");
        assert_eq!(sum(&on_gpu)?.to_bits(), got.to_bits(), "many tensors: differs between two runs");
        Ok(())
    }
}
