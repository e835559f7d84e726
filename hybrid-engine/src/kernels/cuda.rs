//! The engine's own CUDA kernels (`hybrid-engine/cuda/*.cu`, compiled to PTX by `build.rs`),
//! launched on candle's stream as the `cuda_fwd` of the custom ops in `fused.rs`. Each computes
//! what its CPU kernel computes, and `examples/gpu_check.rs` compares the two on a GPU.

use crate::kernels::dropout::DropoutMask;
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{CudaView, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::{CudaDType, CudaStorageSlice, WrapErr};
use candle_core::{CudaStorage, DType, Layout, Result};

mod ptx {
    include!(concat!(env!("OUT_DIR"), "/ptx.rs"));
}

/// Threads per block of the elementwise kernels.
const BLOCK: u32 = 256;
/// At most this many blocks; the kernels stride over the rest.
const MAX_BLOCKS: u64 = 1 << 16;

/// A grid-stride launch over `n` elements.
fn elementwise(n: usize) -> LaunchConfig {
    let blocks = (n as u64).div_ceil(BLOCK as u64).clamp(1, MAX_BLOCKS) as u32;
    LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (BLOCK, 1, 1), shared_mem_bytes: 0 }
}

/// The contiguous elements of `storage` under `layout`, as a view `$s` of element type `$elem`
/// (f32, bf16 or f16), with `$suffix` the kernels' name suffix for it; `$body` makes a new slice,
/// which comes back as a storage on the same device.
macro_rules! for_float_dtype {
    ($storage:expr, $layout:expr, $what:literal, |$s:ident: $elem:ident, $suffix:ident| $body:expr) => {{
        let storage: &CudaStorage = $storage;
        let Some((start, end)) = $layout.contiguous_offsets() else {
            candle_core::bail!("{} on CUDA takes a contiguous tensor", $what);
        };
        let dev = storage.device();
        match &storage.slice {
            CudaStorageSlice::F32(x) => {
                type $elem = f32;
                let ($s, $suffix) = (&x.slice(start..end), "f32");
                CudaStorage::wrap_cuda_slice($body?, dev.clone())
            }
            CudaStorageSlice::BF16(x) => {
                type $elem = half::bf16;
                let ($s, $suffix) = (&x.slice(start..end), "bf16");
                CudaStorage::wrap_cuda_slice($body?, dev.clone())
            }
            CudaStorageSlice::F16(x) => {
                type $elem = half::f16;
                let ($s, $suffix) = (&x.slice(start..end), "f16");
                CudaStorage::wrap_cuda_slice($body?, dev.clone())
            }
            _ => candle_core::bail!("{} on CUDA takes f32, bf16 or f16, not {:?}", $what, storage.dtype()),
        }
    }};
}

/// Whether the CUDA kernels take tensors of `dtype`.
pub fn is_float(dtype: DType) -> bool {
    matches!(dtype, DType::F32 | DType::BF16 | DType::F16)
}

/// The contiguous f32 elements of `storage` under `layout`.
fn f32_view<'a>(storage: &'a CudaStorage, layout: &Layout, what: &str) -> Result<CudaView<'a, f32>> {
    match (&storage.slice, layout.contiguous_offsets()) {
        (CudaStorageSlice::F32(x), Some((start, end))) => Ok(x.slice(start..end)),
        _ => candle_core::bail!("{what} on CUDA must be contiguous f32"),
    }
}

/// The same contiguous view of a second operand of `first`'s dtype (the kernels take one dtype).
fn same_dtype<'a, T: CudaDType>(storage: &'a CudaStorage, layout: &Layout, what: &str) -> Result<CudaView<'a, T>> {
    let Some((start, end)) = layout.contiguous_offsets() else {
        candle_core::bail!("{what} on CUDA takes a contiguous tensor");
    };
    Ok(T::as_cuda_slice(storage)?.slice(start..end))
}

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
        let mut b = func.builder();
        let n = n as u64;
        b.arg(src).arg(&out).arg(&n).arg(&seed).arg(&threshold).arg(&scale);
        // SAFETY: the arguments match the kernel's signature.
        unsafe { b.launch(elementwise(n as usize)) }.w().map(|_| out)
    }))
}

/// Rows per block of the row kernels (one warp each, cuda/masked_softmax.cu).
const ROWS_PER_BLOCK: u64 = 4;

/// A launch of one warp per row.
fn warp_per_row(rows: usize) -> LaunchConfig {
    let blocks = (rows as u64).div_ceil(ROWS_PER_BLOCK) as u32;
    LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (32 * ROWS_PER_BLOCK as u32, 1, 1), shared_mem_bytes: 0 }
}

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
    let bias = f32_view(bias, lb, "the attention bias")?;
    Ok(for_float_dtype!(att, la, "masked softmax", |src: Elem, suffix| {
        let dev = att.device();
        let rows = src.len() / s;
        // SAFETY: the kernel writes every row.
        let out = unsafe { dev.alloc::<Elem>(src.len())? };
        let func =
            dev.get_or_load_custom_func(&format!("masked_softmax_{suffix}"), "rlhf_softmax", ptx::MASKED_SOFTMAX)?;
        let mut b = func.builder();
        let (rows64, s, nh, t) = (rows as u64, s as u32, nh as u32, t as u32);
        b.arg(src).arg(&bias).arg(&out).arg(&rows64).arg(&s).arg(&nh).arg(&t).arg(&bias_batches).arg(&scale);
        // SAFETY: the arguments match the kernel's signature.
        unsafe { b.launch(warp_per_row(rows)) }.w().map(|_| out)
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
        let dy = same_dtype::<Elem>(dy, ldy, "the softmax's output gradient")?;
        let rows = src.len() / s;
        // SAFETY: the kernel writes every row.
        let out = unsafe { dev.alloc::<Elem>(src.len())? };
        let func =
            dev.get_or_load_custom_func(&format!("masked_softmax_grad_{suffix}"), "rlhf_softmax", ptx::MASKED_SOFTMAX)?;
        let mut b = func.builder();
        let (rows64, s) = (rows as u64, s as u32);
        b.arg(src).arg(&dy).arg(&out).arg(&rows64).arg(&s).arg(&scale);
        // SAFETY: the arguments match the kernel's signature.
        unsafe { b.launch(warp_per_row(rows)) }.w().map(|_| out)
    }))
}

/// These run on a GPU (the CUDA build's unit tests, which `scripts/gpu-check.sh` runs from the
/// package); without one they pass after saying so on stderr.
#[cfg(test)]
mod tests {
    use crate::kernels::ops::{dropout, dropout_reference, masked_softmax, masked_softmax_reference, DropoutKey};
    use candle_core::{DType, Device, Result, Tensor, Var};

    fn gpu() -> Option<Device> {
        match Device::new_cuda(0) {
            Ok(d) => Some(d),
            Err(e) => {
                eprintln!("no GPU, the CUDA kernel test checks nothing: {e}");
                None
            }
        }
    }

    /// max |a - b| over all elements, both as f32 on the CPU.
    fn max_diff(a: &Tensor, b: &Tensor) -> Result<f32> {
        let a = a.to_device(&Device::Cpu)?.to_dtype(DType::F32)?;
        let b = b.to_device(&Device::Cpu)?.to_dtype(DType::F32)?;
        (a - b)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()
    }

    #[test]
    fn dropout_draws_the_cpu_mask_in_every_dtype_and_its_backward_is_the_same_mask() -> Result<()> {
        let Some(gpu) = gpu() else { return Ok(()) };
        let key = DropoutKey { seed: 7, step: 3, micro_batch: 1 };
        // Odd sizes: the grid-stride loop's tail.
        let x = Tensor::randn(0f32, 1f32, (5, 333, 77), &Device::Cpu)?;
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            let x = x.to_dtype(dtype)?;
            let want = dropout_reference(&x, key.mask(0.25, 2, 1))?;
            let got = dropout(&x.to_device(&gpu)?, 0.25, &key, 2, 1)?;
            assert_eq!(max_diff(&got, &want)?, 0.0, "{dtype:?}");
        }
        let v = Var::from_tensor(&x.to_device(&gpu)?)?;
        let weights = Tensor::randn(0f32, 1f32, x.shape(), &gpu)?;
        let grads = dropout(v.as_tensor(), 0.25, &key, 2, 1)?.mul(&weights)?.sum_all()?.backward()?;
        let want = dropout_reference(&weights.to_device(&Device::Cpu)?, key.mask(0.25, 2, 1))?;
        assert_eq!(max_diff(grads.get(v.as_tensor()).expect("a gradient"), &want)?, 0.0);
        Ok(())
    }

    #[test]
    fn masked_softmax_and_its_gradient_match_the_cpu() -> Result<()> {
        let Some(gpu) = gpu() else { return Ok(()) };
        // (B, NH, T, S) scores; a per-batch causal mask with padding (B, 1, T, S), and the
        // broadcast causal mask (1, 1, T, S); S = 70 spans three warp strides.
        let (b, nh, t) = (2, 3, 70);
        let att = (Tensor::randn(0f32, 1f32, (b, nh, t, t), &Device::Cpu)? * 3.0)?;
        let mut per_batch = vec![0f32; b * t * t];
        for (i, m) in per_batch.iter_mut().enumerate() {
            let (batch, row, col) = (i / (t * t), i / t % t, i % t);
            if col > row || (batch == 1 && col < 5) {
                *m = -1e9;
            }
        }
        let per_batch = Tensor::from_vec(per_batch, (b, 1, t, t), &Device::Cpu)?;
        let causal = per_batch.narrow(0, 0, 1)?.contiguous()?;
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
