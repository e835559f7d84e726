//! `x W + b` (Hugging Face's Conv1D layout) with its backward: on the CPU one gemm onto rows
//! holding the bias (decode.rs's few-row kernel for a decoding step), on a GPU cuBLAS's gemm and
//! the bias added by one kernel (cuda/linear.cu); the bias gradient's column sums on both.

use crate::kernels::parallel::{contiguous_f32, gemm_f32, reduce_rows};
use crate::kernels::rowops;
use candle_core::{CpuStorage, CustomOp1, CustomOp3, Layout, Result, Shape, Tensor};

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
        Ok((cuda::linear((s1, l1), (s2, l2), (s3, l3))?, Shape::from(dims)))
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
        Ok((cuda::column_sums(s, l)?, Shape::from(w)))
    }
}

/// `x W + b` for `x` (.., in), `w` (in, out), `b` (out,): f32 on the CPU, or one dtype (f32,
/// bf16, f16) on a GPU (cuBLAS's gemm and the bias kernels of the `cuda` launchers below).
pub fn linear(x: &Tensor, w: &Tensor, b: &Tensor) -> Result<Tensor> {
    x.contiguous()?.apply_op3(&w.contiguous()?, &b.contiguous()?, Linear)
}

/// The launchers of the CUDA kernels (`cuda_fwd` above calls them).
#[cfg(feature = "cuda")]
pub mod cuda {
    use crate::kernels::cuda::{for_float_dtype, ptx, view, BLOCK};
    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
    use candle_core::cuda_backend::WrapErr;
    use candle_core::{CudaStorage, Layout, Result};

    /// `x W + b` for contiguous x (.., in), W (in, out), b (out,) of one dtype: cuBLAS's gemm (candle's
    /// own matmul on the storages), then the bias added to each row by one kernel (cuda/linear.cu):
    /// (N, out), N the rows of x.
    pub fn linear(
        (x, lx): (&CudaStorage, &Layout),
        (w, lw): (&CudaStorage, &Layout),
        (b, lb): (&CudaStorage, &Layout),
    ) -> Result<CudaStorage> {
        let (d_in, d_out) = lw.shape().dims2()?;
        let rows = lx.shape().elem_count() / d_in.max(1);
        if lx.dims().last() != Some(&d_in) || lb.shape().elem_count() != d_out || !lx.is_contiguous() {
            candle_core::bail!("linear on CUDA: input {:?}, weight {:?}, bias {:?}", lx.dims(), lw.dims(), lb.dims());
        }
        let x_rows = Layout::contiguous_with_offset((rows, d_in), lx.start_offset());
        let xw = x.matmul(w, (1, rows, d_out, d_in), &x_rows, lw)?;
        let lxw = Layout::contiguous((rows, d_out));
        Ok(for_float_dtype!(&xw, &lxw, "linear bias", |src: Elem, suffix| {
            let dev = xw.device();
            let b = view::<Elem>(b, lb, "the linear bias")?;
            // SAFETY: the kernel writes every element.
            let out = unsafe { dev.alloc::<Elem>(src.len())? };
            let func = dev.get_or_load_custom_func(&format!("add_bias_rows_{suffix}"), "rlhf_linear", ptx::LINEAR)?;
            let mut launch = func.builder();
            let (n, w32) = (rows as u64, d_out as u32);
            launch.arg(src).arg(&b).arg(&out).arg(&n).arg(&w32);
            let cfg = LaunchConfig {
                grid_dim: ((d_out as u32).div_ceil(BLOCK).max(1), rows.clamp(1, 65535) as u32, 1),
                block_dim: (BLOCK, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: the arguments match the kernel's signature.
            unsafe { launch.launch(cfg) }.w().map(|_| out)
        }))
    }

    /// Rows a block of the column-sum kernel adds at least, and chunks of rows at most.
    const COLUMN_SUM_ROWS: usize = 64;
    const COLUMN_SUM_CHUNKS: usize = 256;

    /// The column sums of contiguous g (N, W) in f32, rounded to g's dtype (cuda/linear.cu): the
    /// linear's bias gradient. Deterministic: chunks of rows summed per column, then the chunks in
    /// order.
    pub fn column_sums(g: &CudaStorage, lg: &Layout) -> Result<CudaStorage> {
        let (n, w) = lg.shape().dims2()?;
        Ok(for_float_dtype!(g, lg, "column sums", |src: Elem, suffix| {
            let dev = g.device();
            let chunks = n.div_ceil(COLUMN_SUM_ROWS).clamp(1, COLUMN_SUM_CHUNKS);
            let rows_per_chunk = n.div_ceil(chunks).max(1) as u64;
            // SAFETY: every (chunk, column) partial is written, then every column's sum.
            let partial = unsafe { dev.alloc::<f32>(chunks * w)? };
            let out = unsafe { dev.alloc::<Elem>(w)? };
            let (n64, w32, chunks32) = (n as u64, w as u32, chunks as u32);
            let columns = (w as u32).div_ceil(BLOCK).max(1);
            let sums =
                dev.get_or_load_custom_func(&format!("column_sums_partial_{suffix}"), "rlhf_linear", ptx::LINEAR)?;
            let mut launch = sums.builder();
            launch.arg(src).arg(&partial).arg(&n64).arg(&w32).arg(&rows_per_chunk);
            let cfg = LaunchConfig { grid_dim: (columns, chunks32, 1), block_dim: (BLOCK, 1, 1), shared_mem_bytes: 0 };
            // SAFETY: the arguments match the kernel's signature.
            unsafe { launch.launch(cfg) }.w()?;
            let finish =
                dev.get_or_load_custom_func(&format!("column_sums_finish_{suffix}"), "rlhf_linear", ptx::LINEAR)?;
            let mut launch = finish.builder();
            launch.arg(&partial).arg(&out).arg(&chunks32).arg(&w32);
            let cfg = LaunchConfig { grid_dim: (columns, 1, 1), block_dim: (BLOCK, 1, 1), shared_mem_bytes: 0 };
            // SAFETY: the arguments match the kernel's signature.
            unsafe { launch.launch(cfg) }.w().map(|_| out)
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::ops;
    use crate::kernels::ops::test_support::*;
    use candle_core::Var;

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
}

/// On a GPU against the CPU (the CUDA build's unit tests, which `scripts/gpu-check.sh` runs from
/// the package); without one they pass after saying so on stderr.
#[cfg(test)]
#[cfg(feature = "cuda")]
mod cuda_tests {
    use crate::kernels::ops::test_support::*;
    use candle_core::{DType, Device, Result, Tensor};

    #[test]
    fn linear_and_its_gradients_match_the_cpu_and_the_bias_gradient_is_deterministic() -> Result<()> {
        let Some(gpu) = gpu() else { return Ok(()) };
        // (2, 150, 96) rows into 200 columns: 300 rows span 5 chunks of the column sums, 200
        // columns a partial block.
        let x = Tensor::randn(0f32, 1f32, (2, 150, 96), &Device::Cpu)?;
        let w = (Tensor::randn(0f32, 1f32, (96, 200), &Device::Cpu)? * 0.1)?;
        let b = Tensor::randn(0f32, 1f32, 200, &Device::Cpu)?;
        let f = |t: &[Tensor]| crate::kernels::ops::linear(&t[0], &t[1], &t[2]);
        let (y_cpu, g_cpu) = value_and_grads(&[&x, &w, &b], &Device::Cpu, f)?;
        let (y_gpu, g_gpu) = value_and_grads(&[&x, &w, &b], &gpu, f)?;
        // cuBLAS's f32 gemm (TF32 off) against the CPU's: sums of 96 or 300 products.
        assert!(max_diff(&y_gpu, &y_cpu)? <= 1e-4 * largest(&y_cpu)?, "output {}", max_diff(&y_gpu, &y_cpu)?);
        for (name, gc, gg) in [("dx", &g_cpu[0], &g_gpu[0]), ("dw", &g_cpu[1], &g_gpu[1]), ("db", &g_cpu[2], &g_gpu[2])]
        {
            assert!(max_diff(gg, gc)? <= 1e-4 * largest(gc)?, "{name}: {}", max_diff(gg, gc)?);
        }
        let (_, again) = value_and_grads(&[&x, &w, &b], &gpu, f)?;
        assert_eq!(max_diff(&again[2], &g_gpu[2])?, 0.0, "db differs between two runs");
        // Half precision against the composed reference in that dtype.
        for dtype in [DType::BF16, DType::F16] {
            let (xh, wh, bh) = (x.to_dtype(dtype)?, w.to_dtype(dtype)?, b.to_dtype(dtype)?);
            let want = crate::kernels::ops::linear_reference(
                &xh.to_device(&gpu)?,
                &wh.to_device(&gpu)?,
                &bh.to_device(&gpu)?,
            )?;
            let (got, grads) = value_and_grads(&[&xh, &wh, &bh], &gpu, f)?;
            assert!(max_diff(&got, &want)? <= 1e-2 * largest(&want)?, "{dtype:?} output {}", max_diff(&got, &want)?);
            let db_want = g_cpu[2].to_dtype(dtype)?;
            assert!(max_diff(&grads[2], &db_want)? <= 2e-2 * largest(&db_want)?, "{dtype:?} db");
        }
        Ok(())
    }
}
