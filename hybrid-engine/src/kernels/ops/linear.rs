//! `x W + b` (Hugging Face's Conv1D layout) with its backward: on the CPU one gemm onto rows
//! holding the bias (decode.rs's few-row kernel for a decoding step), on a GPU cuBLAS's gemm and
//! the bias added by one kernel (cuda/linear.cu); the bias gradient's column sums on both.

use crate::kernels::parallel::{gemm_f32, reduce_rows};
use crate::kernels::rowops;
use crate::storage::contiguous_f32;
use candle_core::{CpuStorage, CustomOp1, CustomOp3, Layout, Result, Shape, Tensor};

/// `x W + b` for x (.., in), W (in, out) (Hugging Face's Conv1D layout), b (out,): one gemm
/// accumulating into rows that start as the bias (on a GPU: the gemm, then the bias added by one
/// kernel). One node in the graph, where the composed ops make four (two reshapes, the gemm, the
/// broadcast add), each of which candle's backward adds into a zeros tensor. Backward: dx = dy W^T, dW = x^T dy (both
/// skipped for inputs that need no gradient, e.g. frozen weights), db = column sums of dy.
struct Linear;

/// Column sums of a (N, W) tensor: the bias gradient.
struct ColumnSums;

/// The weight's and the bias's gradients of a linear from its input x (N, in) and output
/// gradient dy (N, out), in one (in + 1, out) tensor: x^T dy in the first `in` rows, the column
/// sums of dy in the last. On a GPU one cuBLASLt gemm whose epilogue sums the bias gradient
/// (`cublaslt::Epilogue::BiasGradA`), where the gemm and [`ColumnSums`] took three launches.
struct WeightAndBiasGrads;

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
        let rows = |x: &Tensor| x.detach().reshape(((), d_in)); // (N, in)
        let (dw, db) = match (w.track_op(), b.track_op()) {
            // On a GPU both from one gemm, the bias gradient summed in its epilogue.
            (true, true) if fused_weight_and_bias_grads(&g2) => {
                let both = rows(x)?.apply_op2_no_bwd(&g2, &WeightAndBiasGrads)?; // (in + 1, out)
                (Some(both.narrow(0, 0, d_in)?), Some(both.narrow(0, d_in, 1)?.reshape(d_out)?))
            }
            (dw, db) => (
                dw.then(|| rows(x)?.t()?.matmul(&g2)).transpose()?,
                db.then(|| g2.apply_op1_no_bwd(&ColumnSums)).transpose()?,
            ),
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
        let sums = column_sums(g, n, w);
        Ok((CpuStorage::F32(sums), Shape::from(w)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s: &candle_core::CudaStorage, l: &Layout) -> Result<(candle_core::CudaStorage, Shape)> {
        let w = l.shape().dims2()?.1;
        Ok((cuda::column_sums(s, l)?, Shape::from(w)))
    }
}

/// Whether a linear's weight and bias gradients of `dy` come from [`WeightAndBiasGrads`]: on a
/// GPU with cuBLASLt's epilogues on (off, the gemm and [`ColumnSums`] run as they did before).
fn fused_weight_and_bias_grads(dy: &Tensor) -> bool {
    #[cfg(feature = "cuda")]
    return dy.device().is_cuda() && crate::kernels::cublaslt::enabled();
    #[cfg(not(feature = "cuda"))]
    {
        let _ = dy;
        false
    }
}

/// The column sums of g (n, w), row-major.
fn column_sums(g: &[f32], n: usize, w: usize) -> Vec<f32> {
    reduce_rows(n, w, g.len(), |rows, acc| {
        for r in rows {
            rowops::add_assign(acc, &g[r * w..(r + 1) * w]);
        }
    })
}

impl candle_core::CustomOp2 for WeightAndBiasGrads {
    fn name(&self) -> &'static str {
        "weight-and-bias-grads"
    }

    fn cpu_fwd(&self, sx: &CpuStorage, lx: &Layout, sg: &CpuStorage, lg: &Layout) -> Result<(CpuStorage, Shape)> {
        let (x, g) = (contiguous_f32(sx, lx, "linear input")?, contiguous_f32(sg, lg, "gradient")?);
        let ((n, d_in), d_out) = (lx.shape().dims2()?, lg.shape().dims2()?.1);
        let mut out = vec![0f32; (d_in + 1) * d_out];
        // SAFETY: x is (n, d_in) read transposed, g (n, d_out), out's first d_in rows (d_in, d_out).
        unsafe {
            gemm_f32(
                (d_in, d_out, n),
                out.as_mut_ptr(),
                d_out,
                x.as_ptr(),
                (1, d_in),
                g.as_ptr(),
                (d_out, 1),
                false,
                crate::runtime::threads(),
            )
        };
        out[d_in * d_out..].copy_from_slice(&column_sums(g, n, d_out));
        Ok((CpuStorage::F32(out), Shape::from((d_in + 1, d_out))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        sx: &candle_core::CudaStorage,
        lx: &Layout,
        sg: &candle_core::CudaStorage,
        lg: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let ((_, d_in), d_out) = (lx.shape().dims2()?, lg.shape().dims2()?.1);
        Ok((cuda::weight_and_bias_grads((sx, lx), (sg, lg))?, Shape::from((d_in + 1, d_out))))
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
    use crate::kernels::cublaslt::{self, Epilogue, Operands};
    use crate::kernels::cuda::{for_float_dtype, ptx, view, BLOCK};
    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::driver::{
        CudaSlice, DevicePtr, DevicePtrMut, DeviceRepr, LaunchConfig, PushKernelArg,
    };
    use candle_core::cuda_backend::{CudaDType, CudaStorageSlice, WrapErr};
    use candle_core::{CudaDevice, CudaStorage, Layout, Result, WithDType};

    /// What the fused paths below take: a float dtype candle stores on the GPU.
    trait Float: CudaDType + WithDType + DeviceRepr {}
    impl<T: CudaDType + WithDType + DeviceRepr> Float for T {}

    /// Evaluates `$call` with `$t` the element type of `$storage` (f32, bf16 or f16), wrapping the
    /// slice it may return as a storage; any other dtype is an error naming `$what`.
    macro_rules! by_dtype {
        ($storage:expr, $what:literal, |$t:ident| $call:expr) => {{
            let dev = $storage.device().clone();
            match &$storage.slice {
                CudaStorageSlice::F32(_) => {
                    type $t = f32;
                    $call.map(|s| s.map(|s| CudaStorage::wrap_cuda_slice(s, dev)))
                }
                CudaStorageSlice::BF16(_) => {
                    type $t = half::bf16;
                    $call.map(|s| s.map(|s| CudaStorage::wrap_cuda_slice(s, dev)))
                }
                CudaStorageSlice::F16(_) => {
                    type $t = half::f16;
                    $call.map(|s| s.map(|s| CudaStorage::wrap_cuda_slice(s, dev)))
                }
                _ => candle_core::bail!("{} on CUDA takes f32, bf16 or f16, not {:?}", $what, $storage.dtype()),
            }
        }};
    }

    /// `x W + b` for contiguous x (.., in), W (in, out), b (out,) of one dtype: one cuBLASLt gemm
    /// with the bias added in its epilogue, or where cuBLASLt cannot, cuBLAS's gemm (candle's own
    /// matmul on the storages) and then the bias added to each row by one kernel
    /// (cuda/linear.cu): (N, out), N the rows of x.
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
        let fused = by_dtype!(x, "linear", |T| fused_linear::<T>((x, lx), (w, lw), (b, lb), (rows, d_in, d_out)))?;
        if let Some(out) = fused {
            return Ok(out);
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

    /// [`linear`] by one cuBLASLt gemm with the bias in its epilogue; None where cuBLASLt cannot.
    /// Column-major, as cuBLAS counts: out^T (out x N) = W^T (out x in) x^T (in x N) + b.
    fn fused_linear<T: Float>(
        (x, lx): (&CudaStorage, &Layout),
        (w, lw): (&CudaStorage, &Layout),
        (b, lb): (&CudaStorage, &Layout),
        (rows, d_in, d_out): (usize, usize, usize),
    ) -> Result<Option<CudaSlice<T>>> {
        if !cublaslt::enabled() {
            return Ok(None);
        }
        let dev = x.device();
        let (xv, wv, bv) =
            (view::<T>(x, lx, "linear input")?, view::<T>(w, lw, "linear weight")?, view::<T>(b, lb, "linear bias")?);
        // SAFETY: the gemm writes every element (or, refused, nothing and the slice is dropped).
        let mut out = unsafe { dev.alloc::<T>(rows * d_out)? };
        let stream = dev.cuda_stream();
        let ran = {
            let ((a, _a), (bb, _b), (v, _v)) = (wv.device_ptr(&stream), xv.device_ptr(&stream), bv.device_ptr(&stream));
            let (d, _d) = out.device_ptr_mut(&stream);
            let op = Operands {
                dtype: T::DTYPE,
                epilogue: Epilogue::Bias,
                transpose_b: false,
                m: d_out as u64,
                n: rows as u64,
                k: d_in as u64,
                a,
                b: bb,
                d,
                v,
            };
            // SAFETY: W holds in x out values, x rows x in, b out, and out rows x out, all on dev.
            unsafe { cublaslt::matmul(dev, &op)? }
        };
        Ok(ran.then_some(out))
    }

    /// [`super::WeightAndBiasGrads`] on the GPU for contiguous x (N, in) and dy (N, out) of one
    /// dtype: (in + 1, out), dW = x^T dy then db. One cuBLASLt gemm, column-major dW^T (out x in)
    /// = dy^T (out x N) x (N x in) with dy^T's row sums (over N) in its epilogue; where cuBLASLt
    /// cannot, candle's gemm and [`column_sums`], copied in.
    pub fn weight_and_bias_grads(
        (x, lx): (&CudaStorage, &Layout),
        (g, lg): (&CudaStorage, &Layout),
    ) -> Result<CudaStorage> {
        let grads = by_dtype!(x, "the linear's weight gradient", |T| weight_and_bias_grads_as::<T>((x, lx), (g, lg))
            .map(Some))?;
        grads.ok_or_else(|| candle_core::Error::Msg("the linear's weight gradient: no result".into()))
    }

    fn weight_and_bias_grads_as<T: Float>(
        (x, lx): (&CudaStorage, &Layout),
        (g, lg): (&CudaStorage, &Layout),
    ) -> Result<CudaSlice<T>> {
        let ((n, d_in), (n_g, d_out)) = (lx.shape().dims2()?, lg.shape().dims2()?);
        if n != n_g {
            candle_core::bail!("the linear's weight gradient: input {:?} against gradient {:?}", lx.dims(), lg.dims());
        }
        let dev: &CudaDevice = x.device();
        let (xv, gv) = (view::<T>(x, lx, "linear input")?, view::<T>(g, lg, "linear output gradient")?);
        // SAFETY: the gemm (or the copies below) writes every element.
        let mut out = unsafe { dev.alloc::<T>((d_in + 1) * d_out)? };
        let stream = dev.cuda_stream();
        let ran = {
            let ((a, _a), (b, _b)) = (gv.device_ptr(&stream), xv.device_ptr(&stream));
            let (d, _d) = out.device_ptr_mut(&stream);
            let op = Operands {
                dtype: T::DTYPE,
                epilogue: Epilogue::BiasGradA,
                transpose_b: true,
                m: d_out as u64,
                n: d_in as u64,
                k: n as u64,
                a,
                b,
                d,
                v: d + (d_in * d_out * std::mem::size_of::<T>()) as u64,
            };
            // SAFETY: dy holds N x out values, x N x in, and out (in + 1) x out, all on dev.
            unsafe { cublaslt::matmul(dev, &op)? }
        };
        if !ran {
            let dw = x.matmul(g, (1, d_in, d_out, n), &lx.transpose(0, 1)?, lg)?;
            let db = column_sums(g, lg)?;
            stream.memcpy_dtod(T::as_cuda_slice(&dw)?, &mut out.slice_mut(0..d_in * d_out)).w()?;
            stream.memcpy_dtod(T::as_cuda_slice(&db)?, &mut out.slice_mut(d_in * d_out..)).w()?;
        }
        Ok(out)
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

    #[test]
    fn weight_and_bias_grads_are_the_gemm_and_the_column_sums() -> Result<()> {
        let x = randn(0f32, 1.0, (70, 24), &dev())?;
        let g = randn(0f32, 1.0, (70, 40), &dev())?;
        let both = x.apply_op2_no_bwd(&g, &WeightAndBiasGrads)?;
        assert_eq!(both.dims(), [25, 40]);
        let dw = x.t()?.matmul(&g)?;
        let db = g.sum(0)?;
        let diff = |a: &Tensor, b: &Tensor| -> Result<f32> { (a - b)?.abs()?.max_all()?.to_scalar::<f32>() };
        assert!(diff(&both.narrow(0, 0, 24)?, &dw)? < 1e-4, "dW");
        assert!(diff(&both.narrow(0, 24, 1)?.reshape(40)?, &db)? < 1e-4, "db");
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
    fn linear_and_its_gradients_match_the_cpu_and_the_bias_gradient_is_deterministic() -> Result<()> {
        let gpu = gpu();
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
        // The forward's and the weight gradient's gemms took cuBLASLt's fused epilogues.
        let (fused, unfused) = crate::kernels::cublaslt::counts();
        assert!(fused >= 2, "cuBLASLt's epilogues ran {fused} times, the unfused path {unfused}");
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

    /// The fused path (cuBLASLt's bias and bias-gradient epilogues) against the unfused one
    /// (cuBLAS's gemm and the bias kernels) on the same GPU, in every dtype: the same gemm
    /// arithmetic, the bias added before rounding instead of after.
    #[test]
    #[ignore = "needs a GPU: scripts/gpu-check.sh runs it (cargo test --features cuda -- --include-ignored)"]
    fn cublaslt_epilogues_match_the_unfused_linear() -> Result<()> {
        let gpu = gpu();
        use crate::kernels::cublaslt;
        let x = Tensor::randn(0f32, 1f32, (4, 64, 128), &Device::Cpu)?;
        let w = (Tensor::randn(0f32, 1f32, (128, 384), &Device::Cpu)? * 0.1)?;
        let b = Tensor::randn(0f32, 1f32, 384, &Device::Cpu)?;
        let f = |t: &[Tensor]| crate::kernels::ops::linear(&t[0], &t[1], &t[2]);
        for (dtype, bound) in [(DType::F32, 1e-5), (DType::BF16, 1e-2), (DType::F16, 2e-3)] {
            let t: Vec<Tensor> = [&x, &w, &b].iter().map(|t| t.to_dtype(dtype)).collect::<Result<_>>()?;
            let before = cublaslt::counts();
            let (y, grads) = value_and_grads(&[&t[0], &t[1], &t[2]], &gpu, f)?;
            let after = cublaslt::counts();
            // (At least: other tests may run matmuls meanwhile.)
            assert!(after.0 - before.0 >= 2, "{dtype:?}: the fused path ran {} times", after.0 - before.0);
            cublaslt::set_enabled(false);
            let unfused = value_and_grads(&[&t[0], &t[1], &t[2]], &gpu, f);
            cublaslt::set_enabled(true);
            let (y_ref, grads_ref) = unfused?;
            assert!(max_diff(&y, &y_ref)? <= bound * largest(&y_ref)?, "{dtype:?} output {}", max_diff(&y, &y_ref)?);
            for (name, got, want) in
                [("dx", &grads[0], &grads_ref[0]), ("dw", &grads[1], &grads_ref[1]), ("db", &grads[2], &grads_ref[2])]
            {
                assert!(max_diff(got, want)? <= bound * largest(want)?, "{dtype:?} {name}: {}", max_diff(got, want)?);
            }
        }
        Ok(())
    }
}
