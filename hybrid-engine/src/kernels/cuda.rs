//! The engine's own CUDA kernels (`hybrid-engine/cuda/*.cu`, compiled to PTX by `build.rs`),
//! launched on candle's stream as the `cuda_fwd` of the custom ops in `fused.rs`. Each computes
//! what its CPU kernel computes: the tests at the end compare the two on a GPU (the package's
//! `unit-tests`, run by `scripts/gpu-check.sh`), as `examples/gpu_check.rs` does for a model.

use crate::kernels::dropout::DropoutMask;
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{
    CudaSlice, CudaView, CudaViewMut, DevicePtr, DeviceRepr, LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::{CudaDType, CudaStorageSlice, WrapErr};
use candle_core::{CudaDevice, CudaStorage, DType, Layout, Result, Tensor};

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
                #[allow(dead_code)] // not every body names it
                type $elem = f32;
                let ($s, $suffix) = (&x.slice(start..end), "f32");
                CudaStorage::wrap_cuda_slice($body?, dev.clone())
            }
            CudaStorageSlice::BF16(x) => {
                #[allow(dead_code)] // not every body names it
                type $elem = half::bf16;
                let ($s, $suffix) = (&x.slice(start..end), "bf16");
                CudaStorage::wrap_cuda_slice($body?, dev.clone())
            }
            CudaStorageSlice::F16(x) => {
                #[allow(dead_code)] // not every body names it
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

/// The contiguous elements of an operand as a view of element type `T` (an error if it is not
/// contiguous or not of that dtype: each kernel takes its operands in one dtype).
fn view<'a, T: CudaDType>(storage: &'a CudaStorage, layout: &Layout, what: &str) -> Result<CudaView<'a, T>> {
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
        let mut launch = func.builder();
        let n = n as u64;
        launch.arg(src).arg(&out).arg(&n).arg(&seed).arg(&threshold).arg(&scale);
        // SAFETY: the arguments match the kernel's signature.
        unsafe { launch.launch(elementwise(n as usize)) }.w().map(|_| out)
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
        let func =
            dev.get_or_load_custom_func(&format!("masked_softmax_grad_{suffix}"), "rlhf_softmax", ptx::MASKED_SOFTMAX)?;
        let mut launch = func.builder();
        let (rows64, s) = (rows as u64, s as u32);
        launch.arg(src).arg(&dy).arg(&out).arg(&rows64).arg(&s).arg(&scale);
        // SAFETY: the arguments match the kernel's signature.
        unsafe { launch.launch(warp_per_row(rows)) }.w().map(|_| out)
    }))
}

/// `(x - mean) * rstd * w + b` over the last dimension of contiguous x (.., C), w and b (C,) of
/// x's dtype (cuda/layer_norm.cu), in f32 inside.
pub fn layer_norm(
    (x, lx): (&CudaStorage, &Layout),
    (w, lw): (&CudaStorage, &Layout),
    (b, lb): (&CudaStorage, &Layout),
    eps: f32,
) -> Result<CudaStorage> {
    let c = lw.shape().elem_count();
    Ok(for_float_dtype!(x, lx, "layer norm", |src: Elem, suffix| {
        let dev = x.device();
        let (w, b) = (view::<Elem>(w, lw, "the layer norm weight")?, view::<Elem>(b, lb, "the layer norm bias")?);
        let rows = src.len() / c;
        // SAFETY: the kernel writes every row.
        let out = unsafe { dev.alloc::<Elem>(src.len())? };
        let func = dev.get_or_load_custom_func(&format!("layer_norm_{suffix}"), "rlhf_layer_norm", ptx::LAYER_NORM)?;
        let mut launch = func.builder();
        let (rows64, c32) = (rows as u64, c as u32);
        launch.arg(src).arg(&w).arg(&b).arg(&out).arg(&rows64).arg(&c32).arg(&eps);
        // SAFETY: the arguments match the kernel's signature.
        unsafe { launch.launch(warp_per_row(rows)) }.w().map(|_| out)
    }))
}

/// Blocks of LayerNorm's backward: each adds the dw, db of its warps' rows in order.
const LAYER_NORM_GRAD_BLOCKS: usize = 1024;
/// Warps of a block of LayerNorm's backward at most; fewer where their 2C f32 sums each would not
/// fit the 48 KiB of shared memory a block gets without asking (C over 1536).
const LAYER_NORM_GRAD_WARPS: usize = 4;

/// LayerNorm's backward for (x, w, dy): one (N + 2, C) tensor of x's dtype holding dx (N rows),
/// then dw and db, summed over the rows in f32 in a fixed order (deterministic).
pub fn layer_norm_grad(
    (x, lx): (&CudaStorage, &Layout),
    (w, lw): (&CudaStorage, &Layout),
    (dy, ldy): (&CudaStorage, &Layout),
    eps: f32,
) -> Result<CudaStorage> {
    let c = lw.shape().elem_count();
    Ok(for_float_dtype!(x, lx, "layer norm backward", |src: Elem, suffix| {
        let dev = x.device();
        let w = view::<Elem>(w, lw, "the layer norm weight")?;
        let dy = view::<Elem>(dy, ldy, "the layer norm output gradient")?;
        let rows = src.len() / c;
        let warps = (48 * 1024 / (2 * c.max(1) * std::mem::size_of::<f32>())).clamp(1, LAYER_NORM_GRAD_WARPS);
        let blocks = rows.div_ceil(warps).clamp(1, LAYER_NORM_GRAD_BLOCKS);
        // SAFETY: the kernels write every row of dx, every partial sum and then dw and db.
        let mut out = unsafe { dev.alloc::<Elem>((rows + 2) * c)? };
        let partial = unsafe { dev.alloc::<f32>(blocks * 2 * c)? };
        let grad =
            dev.get_or_load_custom_func(&format!("layer_norm_grad_{suffix}"), "rlhf_layer_norm", ptx::LAYER_NORM)?;
        let mut launch = grad.builder();
        let (rows64, c32) = (rows as u64, c as u32);
        launch.arg(src).arg(&w).arg(&dy).arg(&out).arg(&partial).arg(&rows64).arg(&c32).arg(&eps);
        let cfg = LaunchConfig {
            grid_dim: (blocks as u32, 1, 1),
            block_dim: (32 * warps as u32, 1, 1),
            shared_mem_bytes: (warps * 2 * c * std::mem::size_of::<f32>()) as u32,
        };
        // SAFETY: the arguments match the kernel's signature; shared memory holds 2C floats a warp.
        unsafe { launch.launch(cfg) }.w()?;
        let sums = dev.get_or_load_custom_func(&format!("column_sums_{suffix}"), "rlhf_layer_norm", ptx::LAYER_NORM)?;
        let mut dw_db = out.slice_mut(rows * c..);
        let mut launch = sums.builder();
        let (blocks32, width) = (blocks as u32, 2 * c as u32);
        launch.arg(&partial).arg(&mut dw_db).arg(&blocks32).arg(&width);
        // SAFETY: the arguments match the kernel's signature.
        unsafe { launch.launch(elementwise_unstrided(2 * c)) }.w()?;
        Ok::<_, candle_core::Error>(out)
    }))
}

/// One thread per element, no stride loop (kernels that return past the end).
fn elementwise_unstrided(n: usize) -> LaunchConfig {
    let blocks = (n as u32).div_ceil(BLOCK).max(1);
    LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (BLOCK, 1, 1), shared_mem_bytes: 0 }
}

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
        unsafe { launch.launch(elementwise(src.len())) }.w().map(|_| out)
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
        unsafe { launch.launch(elementwise(src.len())) }.w().map(|_| out)
    }))
}

/// Threads of the kernels that take a block a row (cuda/cross_entropy.cu, cuda/greedy_pick.cu:
/// their THREADS).
const BLOCK_PER_ROW_THREADS: u32 = 256;

fn block_per_row(rows: usize) -> LaunchConfig {
    LaunchConfig { grid_dim: (rows as u32, 1, 1), block_dim: (BLOCK_PER_ROW_THREADS, 1, 1), shared_mem_bytes: 0 }
}

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
        let func =
            dev.get_or_load_custom_func(&format!("cross_entropy_{suffix}"), "rlhf_cross_entropy", ptx::CROSS_ENTROPY)?;
        let mut launch = func.builder();
        let v32 = v as u32;
        launch.arg(src).arg(&targets).arg(&loss).arg(&v32);
        // SAFETY: the arguments match the kernel's signature.
        unsafe { launch.launch(block_per_row(n)) }.w().map(|_| loss)
    }))
}

/// Greedy decoding's choice per row of contiguous logits (B, V) in f32, bf16 or f16: the first id
/// below `limit` (1 to V) with the row's largest logit and its log-probability under the row,
/// as (B, 2) f32 (cuda/greedy_pick.cu, one block a row).
pub fn greedy_pick((logits, ll): (&CudaStorage, &Layout), limit: usize) -> Result<CudaStorage> {
    let (b, v) = ll.shape().dims2()?;
    if limit == 0 || limit > v || v >= 1 << 24 {
        candle_core::bail!("greedy pick on CUDA: ids below {limit} of a vocabulary of {v} (under 2^24)");
    }
    let (v32, limit32) = (v as u32, limit as u32);
    Ok(for_float_dtype!(logits, ll, "greedy pick", |src: Elem, suffix| {
        let dev = logits.device();
        // SAFETY: the kernel writes both values of every row.
        let out = unsafe { dev.alloc::<f32>(2 * b)? };
        let func =
            dev.get_or_load_custom_func(&format!("greedy_pick_{suffix}"), "rlhf_greedy_pick", ptx::GREEDY_PICK)?;
        let mut launch = func.builder();
        launch.arg(src).arg(&out).arg(&v32).arg(&limit32);
        // SAFETY: the arguments match the kernel's signature; it reads the B rows of V values.
        unsafe { launch.launch(block_per_row(b)) }.w().map(|_| out)
    }))
}

/// Sampling's choice per row of contiguous logits (B, V) in f32, bf16 or f16 with the row's
/// uniform draw in `draws` (B,) f64: the token `kernels::sample_pick::sample_with_draw` picks for
/// ids below `limit` at temperature `t`, with `top_k` and `top_p` (None: all), and its
/// log-probability under the row, as (B, 2) f32 (cuda/sample_pick.cu, one block a row).
pub fn sample_pick(
    (logits, ll): (&CudaStorage, &Layout),
    (draws, ld): (&CudaStorage, &Layout),
    (limit, t, top_k, top_p): (usize, f64, Option<usize>, Option<f64>),
) -> Result<CudaStorage> {
    let (b, v) = ll.shape().dims2()?;
    if limit == 0 || limit > v || v >= 1 << 24 {
        candle_core::bail!("sampling on CUDA: ids below {limit} of a vocabulary of {v} (under 2^24)");
    }
    let draws = view::<f64>(draws, ld, "the draws")?;
    if draws.len() != b {
        candle_core::bail!("sampling on CUDA: {b} rows and {} draws", draws.len());
    }
    // The kernel's "none": a top-k of 0, a top-p of 1.
    let top_k = top_k.filter(|&k| k < limit).unwrap_or(0) as u32;
    let top_p = top_p.filter(|&p| p < 1.0).unwrap_or(1.0);
    let (v32, limit32) = (v as u32, limit as u32);
    Ok(for_float_dtype!(logits, ll, "sampling", |src: Elem, suffix| {
        let dev = logits.device();
        // SAFETY: the kernel writes both values of every row.
        let out = unsafe { dev.alloc::<f32>(2 * b)? };
        let func =
            dev.get_or_load_custom_func(&format!("sample_pick_{suffix}"), "rlhf_sample_pick", ptx::SAMPLE_PICK)?;
        let mut launch = func.builder();
        launch.arg(src).arg(&draws).arg(&out).arg(&v32).arg(&limit32).arg(&t).arg(&top_k).arg(&top_p);
        // SAFETY: the arguments match the kernel's signature; it reads the B rows of V values.
        unsafe { launch.launch(block_per_row(b)) }.w().map(|_| out)
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
        let v32 = v as u32;
        launch.arg(src).arg(&targets).arg(&loss_grad).arg(&out).arg(&v32);
        // SAFETY: the arguments match the kernel's signature.
        unsafe { launch.launch(block_per_row(n)) }.w().map(|_| out)
    }))
}

/// The contiguous f32 elements of an operand updated in place.
fn view_mut<'a>(storage: &'a mut CudaStorage, layout: &Layout, what: &str) -> Result<CudaViewMut<'a, f32>> {
    let Some((start, end)) = layout.contiguous_offsets() else {
        candle_core::bail!("{what} on CUDA takes a contiguous tensor");
    };
    Ok(storage.as_cuda_slice_mut::<f32>()?.slice_mut(start..end))
}

/// One pass of AdamW in place (cuda/adamw.cu): kernel `adamw_{pass}_f32` updates `out` from
/// `input` with four f32 coefficients, for a parameter of n values: the `moments` pass updates
/// m then v (2n) from the gradient (n) with `[b1, 1 - b1, b2, 1 - b2]`, the `param` pass the
/// parameter (n) from the moments (2n) with `[decay, step_size, bc2_sqrt, eps]`, each rounded to
/// f32 as the CPU rounds it.
pub fn adamw_pass(
    pass: &str,
    (out, lo): (&mut CudaStorage, &Layout),
    (input, li): (&CudaStorage, &Layout),
    coefficients: [f32; 4],
) -> Result<()> {
    let dev = out.device().clone();
    let input = view::<f32>(input, li, "AdamW's input")?;
    let mut out = view_mut(out, lo, "AdamW's output")?;
    let n = out.len().min(input.len());
    if out.len().max(input.len()) != 2 * n {
        candle_core::bail!(
            "AdamW on CUDA: {} values from {}, one of them should be twice the other",
            out.len(),
            input.len()
        );
    }
    let func = dev.get_or_load_custom_func(&format!("adamw_{pass}_f32"), "rlhf_adamw", ptx::ADAMW)?;
    let mut launch = func.builder();
    let n64 = n as u64;
    launch.arg(&mut out).arg(&input).arg(&n64);
    for k in &coefficients {
        launch.arg(k);
    }
    // SAFETY: the arguments match the kernel's signature; it touches n values and 2n moments.
    unsafe { launch.launch(elementwise(n)) }.w().map(|_| ())
}

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
        _ => candle_core::bail!("cast into a tensor on CUDA takes a bf16 or f16 destination, not {:?}", dst.dtype()),
    }
}

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

/// The embedding table's gradient (cuda/embedding.cu): dw (vocab, C) in dy's dtype from contiguous
/// dy (N, C) and the ids grouped by row on the host (`groups`: the G rows, the G + 1 starts of
/// their positions, the N positions; fused.rs's `group_ids`), each row's sum in f32 in the order
/// of the positions, zeros for the rows of absent ids. Deterministic.
pub fn embedding_grad(
    (dy, ldy): (&CudaStorage, &Layout),
    groups: &[u32],
    n_groups: usize,
    vocab: usize,
) -> Result<CudaStorage> {
    let (n, c) = ldy.shape().dims2()?;
    if groups.len() != 2 * n_groups + 1 + n {
        candle_core::bail!(
            "embedding gradient on CUDA: {} group entries for {n_groups} groups of {n} ids",
            groups.len()
        );
    }
    Ok(for_float_dtype!(dy, ldy, "embedding gradient", |src: Elem, suffix| {
        let dev = dy.device();
        let dw = dev.alloc_zeros::<Elem>(vocab * c)?;
        if n_groups > 0 {
            let groups = dev.clone_htod(groups)?;
            let func =
                dev.get_or_load_custom_func(&format!("embedding_grad_{suffix}"), "rlhf_embedding", ptx::EMBEDDING)?;
            let mut launch = func.builder();
            let (g32, c32) = (n_groups as u32, c as u32);
            launch.arg(src).arg(&groups).arg(&g32).arg(&dw).arg(&c32);
            let cfg = LaunchConfig { grid_dim: (g32, 1, 1), block_dim: (BLOCK, 1, 1), shared_mem_bytes: 0 };
            // SAFETY: the arguments match the kernel's signature; the groups' rows are below vocab
            // and their positions below N (fused.rs's group_ids checks both).
            unsafe { launch.launch(cfg) }.w()?;
        }
        Ok::<_, candle_core::Error>(dw)
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
        let sums = dev.get_or_load_custom_func(&format!("column_sums_partial_{suffix}"), "rlhf_linear", ptx::LINEAR)?;
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

/// Values a block of the multi-tensor kernels takes (cuda/multi_tensor.cuh): 64 a thread.
const MULTI_TENSOR_CHUNK: u32 = 64 * BLOCK;

/// A row of cuda/multi_tensor.cuh's table, field for field: one tensor of a multi-tensor launch.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct TensorSlot {
    param: u64,
    grad: u64,
    moments: u64,
    copy: u64,
    n: u64,
    first_chunk: u32,
    grad_dtype: u32,
    copy_dtype: u32,
    decay: f32,
    step_size: f32,
    unused: u32,
}

// SAFETY: plain data of a fixed layout (the kernels' struct), valid for any bits.
unsafe impl DeviceRepr for TensorSlot {}

/// multi_tensor.cuh's code for a slot without a compute copy.
const NO_COPY: u32 = 3;

/// The device address of contiguous `t`'s first value and its dtype's code in
/// cuda/multi_tensor.cuh (f32 0, bf16 1, f16 2). The address stays valid while `t` lives.
fn address(t: &Tensor, what: &str) -> Result<(u64, u32)> {
    let (storage, layout) = t.storage_and_layout();
    let candle_core::Storage::Cuda(storage) = &*storage else {
        candle_core::bail!("{what}: a multi-tensor kernel takes tensors on a CUDA device");
    };
    let Some((start, end)) = layout.contiguous_offsets() else {
        candle_core::bail!("{what}: a multi-tensor kernel takes contiguous tensors");
    };
    let stream = storage.device().cuda_stream();
    macro_rules! address_of {
        ($slice:expr, $code:expr) => {{
            let view = $slice.slice(start..end);
            let (address, _sync) = view.device_ptr(&stream);
            (address, $code)
        }};
    }
    Ok(match &storage.slice {
        CudaStorageSlice::F32(x) => address_of!(x, 0),
        CudaStorageSlice::BF16(x) => address_of!(x, 1),
        CudaStorageSlice::F16(x) => address_of!(x, 2),
        _ => candle_core::bail!("{what}: a multi-tensor kernel takes f32, bf16 or f16, not {:?}", t.dtype()),
    })
}

/// The CUDA device all of `tensors` are on (an error if they are not on one).
fn common_device(tensors: &[&Tensor]) -> Result<CudaDevice> {
    let Some(first) = tensors.first() else { candle_core::bail!("a multi-tensor kernel takes at least one tensor") };
    let candle_core::Device::Cuda(dev) = first.device() else {
        candle_core::bail!("a multi-tensor kernel takes tensors on a CUDA device");
    };
    if tensors.iter().any(|t| !t.device().same_device(first.device())) {
        candle_core::bail!("a multi-tensor kernel takes tensors on one device");
    }
    Ok(dev.clone())
}

/// Numbers the chunks of `slots` (their `first_chunk`, in order) and uploads the table: the
/// table on the device, its length and the chunks in all (one block each). Slots must hold at
/// least one value.
fn upload_table(dev: &CudaDevice, slots: &mut [TensorSlot]) -> Result<(CudaSlice<TensorSlot>, u32, u32)> {
    let mut chunks = 0u64;
    for slot in slots.iter_mut() {
        slot.first_chunk = u32::try_from(chunks).map_err(|_| candle_core::Error::Msg("too many chunks".into()))?;
        chunks += slot.n.div_ceil(u64::from(MULTI_TENSOR_CHUNK));
    }
    let too_many = |_| candle_core::Error::Msg(format!("a multi-tensor launch of {chunks} chunks"));
    let (count, chunks) = (u32::try_from(slots.len()).map_err(too_many)?, u32::try_from(chunks).map_err(too_many)?);
    Ok((dev.clone_htod(&*slots)?, count, chunks))
}

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

/// One parameter's part in [`adamw_multi_tensor`]: the f32 master updated in place, its gradient
/// (f32, bf16 or f16), its moments (m then v, 2n f32 values) and, in mixed precision, the
/// compute copy to write (bf16 or f16), with the parameter's own AdamW coefficients.
pub struct AdamWTensor<'a> {
    pub param: &'a Tensor,
    pub grad: &'a Tensor,
    pub moments: &'a Tensor,
    pub copy: Option<&'a Tensor>,
    /// `1 - lr wd` and `lr / (1 - b1^step)` for this parameter, rounded to f32.
    pub decay: f32,
    pub step_size: f32,
}

/// AdamW's coefficients every parameter of a step shares (cuda/adamw.cu's `AdamWShared`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct AdamWShared {
    /// What every gradient value is multiplied by first (1: unchanged).
    pub grad_scale: f32,
    pub b1: f32,
    pub one_minus_b1: f32,
    pub b2: f32,
    pub one_minus_b2: f32,
    pub bc2_sqrt: f32,
    pub eps: f32,
}

// SAFETY: plain f32s in the kernel's layout, passed by value.
unsafe impl DeviceRepr for AdamWShared {}

/// AdamW on every parameter of a step in one launch (cuda/adamw.cu's `adamw_multi_tensor`): the
/// gradients read in their dtype and scaled, the moments and the masters updated in place, the
/// compute copies written.
pub fn adamw_multi_tensor(tensors: &[AdamWTensor], shared: AdamWShared) -> Result<()> {
    let dev = common_device(&tensors.iter().map(|t| t.param).collect::<Vec<_>>())?;
    let mut slots = Vec::with_capacity(tensors.len());
    for t in tensors.iter().filter(|t| t.param.elem_count() > 0) {
        let n = t.param.elem_count();
        let (param, param_dtype) = address(t.param, "AdamW's parameter")?;
        let (moments, moments_dtype) = address(t.moments, "AdamW's moments")?;
        let (grad, grad_dtype) = address(t.grad, "AdamW's gradient")?;
        let (copy, copy_dtype) = match t.copy {
            Some(c) => address(c, "AdamW's compute copy")?,
            None => (0, NO_COPY),
        };
        let lengths_agree =
            t.grad.elem_count() == n && t.moments.elem_count() == 2 * n && t.copy.is_none_or(|c| c.elem_count() == n);
        if param_dtype != 0 || moments_dtype != 0 || copy_dtype == 0 || !lengths_agree {
            candle_core::bail!(
                "AdamW on CUDA: an f32 parameter of n values, its gradient (n), f32 moments (2n) and a bf16/f16 copy (n), got {:?} {:?}, {:?} {:?}, {:?} {:?}",
                t.param.dtype(),
                t.param.dims(),
                t.moments.dtype(),
                t.moments.dims(),
                t.grad.dtype(),
                t.grad.dims()
            );
        }
        let n = n as u64;
        slots.push(TensorSlot {
            param,
            grad,
            moments,
            copy,
            n,
            grad_dtype,
            copy_dtype,
            decay: t.decay,
            step_size: t.step_size,
            ..Default::default()
        });
    }
    if slots.is_empty() {
        return Ok(());
    }
    let (table, count, chunks) = upload_table(&dev, &mut slots)?;
    let func = dev.get_or_load_custom_func("adamw_multi_tensor", "rlhf_adamw", ptx::ADAMW)?;
    let mut launch = func.builder();
    launch.arg(&table).arg(&count).arg(&MULTI_TENSOR_CHUNK).arg(&shared);
    let per_chunk = LaunchConfig { grid_dim: (chunks, 1, 1), block_dim: (BLOCK, 1, 1), shared_mem_bytes: 0 };
    // SAFETY: the arguments match the kernel's signature; every address in the table is of a
    // tensor the caller holds, of the length and dtype its slot says (checked above). The kernel
    // writes the parameters, moments and copies that the caller's tensors own, in place, as
    // candle's in-place ops do.
    unsafe { launch.launch(per_chunk) }.w().map(|_| ())
}

/// A decoding step's shape (cuda/decode_attention.cu): B rows of T new tokens, NH heads of HD
/// values, a KV cache of `capacity` positions with `start` of them cached before these tokens.
#[derive(Clone, Copy, Debug)]
pub struct DecodeShape {
    pub b: usize,
    pub t: usize,
    pub n_head: usize,
    pub head_dim: usize,
    pub capacity: usize,
    pub start: usize,
}

impl DecodeShape {
    /// From c_attn's output qkv (B, T, 3C) and the cache buffer (2, B, NH, capacity, HD), both
    /// contiguous (an error naming what does not fit).
    fn of(lq: &Layout, lkv: &Layout, n_head: usize, start: usize) -> Result<Self> {
        let (b, t, c3) = lq.shape().dims3()?;
        let (two, kb, nh, capacity, head_dim) = lkv.shape().dims5()?;
        let shaped = two == 2 && kb == b && nh == n_head && c3 == 3 * nh * head_dim;
        if !shaped || head_dim % 32 != 0 || head_dim > 128 || start + t > capacity {
            candle_core::bail!(
                "decode attention on CUDA: qkv {:?} and a cache {:?} of {n_head} heads (of 32, 64, 96 or 128 values) with {start} + {t} positions",
                lq.dims(),
                lkv.dims()
            );
        }
        Ok(Self { b, t, n_head, head_dim, capacity, start })
    }

    fn args(&self) -> [u32; 6] {
        [self.b, self.t, self.n_head, self.head_dim, self.capacity, self.start].map(|v| v as u32)
    }
}

/// A null pointer, for a kernel's optional operand.
const NULL: u64 = 0;

/// c_attn's bias (3C) as the decoding kernels' optional operand: checked against qkv's width.
fn qkv_bias_view<'a, T: CudaDType>(
    bias: Option<(&'a CudaStorage, &Layout)>,
    lq: &Layout,
) -> Result<Option<CudaView<'a, T>>> {
    let Some((bias, lb)) = bias else { return Ok(None) };
    if lb.shape().elem_count() != lq.dims().last().copied().unwrap_or(0) {
        candle_core::bail!("decode attention on CUDA: a bias {:?} for qkv {:?}", lb.dims(), lq.dims());
    }
    view::<T>(bias, lb, "c_attn's bias").map(Some)
}

/// Writes the new tokens' keys and values of qkv (B, T, 3C) into the KV cache buffer `kv`
/// (2, B, NH, capacity, HD) at positions [start, start + T), in place (one launch); with
/// `qkv_bias`, c_attn's bias (3C) is added to them first (qkv is then the gemm's output alone).
pub fn kv_cache_append(
    (kv, lkv): (&mut CudaStorage, &Layout),
    (qkv, lq): (&CudaStorage, &Layout),
    qkv_bias: Option<(&CudaStorage, &Layout)>,
    n_head: usize,
    start: usize,
) -> Result<()> {
    let shape = DecodeShape::of(lq, lkv, n_head, start)?;
    let [b, t, nh, hd, cap, start] = shape.args();
    let n = 2 * shape.b * shape.t * shape.n_head * shape.head_dim;
    let dev = kv.device().clone();
    macro_rules! launch {
        ($elem:ty, $suffix:literal) => {{
            let src = view::<$elem>(qkv, lq, "the decoding step's qkv")?;
            let bias = qkv_bias_view::<$elem>(qkv_bias, lq)?;
            let Some((from, to)) = lkv.contiguous_offsets() else {
                candle_core::bail!("the KV cache on CUDA must be contiguous");
            };
            let mut dst = <$elem>::as_cuda_slice_mut(kv)?.slice_mut(from..to);
            let module = ("rlhf_decode_attention", ptx::DECODE_ATTENTION);
            let func = dev.get_or_load_custom_func(concat!("kv_cache_append_", $suffix), module.0, module.1)?;
            let mut launch = func.builder();
            launch.arg(&src);
            match &bias {
                Some(bias) => launch.arg(bias),
                None => launch.arg(&NULL),
            };
            launch.arg(&mut dst).arg(&b).arg(&t).arg(&nh).arg(&hd).arg(&cap).arg(&start);
            // SAFETY: the arguments match the kernel's signature; it writes 2 B T C values of
            // the buffer, at positions the shape check keeps below its capacity.
            unsafe { launch.launch(elementwise(n)) }.w().map(|_| ())
        }};
    }
    match qkv.dtype() {
        DType::F32 => launch!(f32, "f32"),
        DType::BF16 => launch!(half::bf16, "bf16"),
        DType::F16 => launch!(half::f16, "f16"),
        other => candle_core::bail!("decode attention on CUDA takes f32, bf16 or f16, not {other:?}"),
    }
}

/// Attention of the new tokens' queries in qkv (B, T, 3C) over the first start + T positions of
/// the KV cache buffer `kv` (2, B, NH, capacity, HD), with the additive mask `bias` (B or 1, 1,
/// T, start + T) f32: (B, T, C), heads side by side (cuda/decode_attention.cu, one warp a row).
/// With `qkv_bias`, c_attn's bias (3C) is added to the queries first.
pub fn decode_attention(
    (qkv, lq): (&CudaStorage, &Layout),
    qkv_bias: Option<(&CudaStorage, &Layout)>,
    (kv, lkv): (&CudaStorage, &Layout),
    (bias, lb): (&CudaStorage, &Layout),
    n_head: usize,
    start: usize,
    scale: f32,
) -> Result<CudaStorage> {
    let shape = DecodeShape::of(lq, lkv, n_head, start)?;
    let s = start + shape.t;
    let (bias_batches, one, bt, bs) = lb.shape().dims4()?;
    if (bias_batches != 1 && bias_batches != shape.b) || one != 1 || bt != shape.t || bs != s {
        candle_core::bail!(
            "decode attention on CUDA: a bias {:?} for {} rows of {} tokens over {s} positions",
            lb.dims(),
            shape.b,
            shape.t
        );
    }
    let bias = view::<f32>(bias, lb, "the decoding step's bias")?;
    let [b, t, nh, hd, cap, _] = shape.args();
    let (s32, bb32) = (s as u32, bias_batches as u32);
    let rows = shape.b * shape.n_head * shape.t;
    Ok(for_float_dtype!(qkv, lq, "decode attention", |src: Elem, suffix| {
        let dev = qkv.device();
        let cache = view::<Elem>(kv, lkv, "the KV cache")?;
        let qkv_bias = qkv_bias_view::<Elem>(qkv_bias, lq)?;
        // SAFETY: the kernel writes every head of every row.
        let y = unsafe { dev.alloc::<Elem>(shape.b * shape.t * shape.n_head * shape.head_dim)? };
        let func = dev.get_or_load_custom_func(
            &format!("decode_attention_{suffix}"),
            "rlhf_decode_attention",
            ptx::DECODE_ATTENTION,
        )?;
        let mut launch = func.builder();
        launch.arg(src);
        match &qkv_bias {
            Some(qkv_bias) => launch.arg(qkv_bias),
            None => launch.arg(&NULL),
        };
        launch.arg(&cache).arg(&bias).arg(&y);
        launch.arg(&b).arg(&t).arg(&nh).arg(&hd).arg(&cap).arg(&s32).arg(&bb32).arg(&scale);
        // SAFETY: the arguments match the kernel's signature; it reads the first s positions.
        unsafe { launch.launch(warp_per_row(rows)) }.w().map(|_| y)
    }))
}

/// A decoding step's epilogue after c_proj's gemm (cuda/decode_layer.cu, one warp a row): from
/// y and the residual x (N, C) contiguous and c_proj's bias, the next LayerNorm's weight and
/// bias ([b, w, beta], each (C,)), all of one dtype: (2, N, C), the new residual x + (y + b)
/// then its LayerNorm.
pub fn bias_residual_layer_norm(
    (y, ly): (&CudaStorage, &Layout),
    (x, lx): (&CudaStorage, &Layout),
    [b, w, beta]: [(&CudaStorage, &Layout); 3],
    eps: f32,
) -> Result<CudaStorage> {
    let c = ly.dims().last().copied().unwrap_or(0);
    let rows = ly.shape().elem_count() / c.max(1);
    let vectors_fit = [b, w, beta].iter().all(|(_, l)| l.shape().elem_count() == c);
    if c == 0 || lx.dims() != ly.dims() || !vectors_fit {
        candle_core::bail!(
            "bias, residual and LayerNorm on CUDA: y {:?}, x {:?}, vectors of {c}",
            ly.dims(),
            lx.dims()
        );
    }
    Ok(for_float_dtype!(y, ly, "bias, residual and LayerNorm", |src: Elem, suffix| {
        let dev = y.device();
        let x = view::<Elem>(x, lx, "the residual")?;
        let [b, w, beta] = [(b, "c_proj's bias"), (w, "the LayerNorm's weight"), (beta, "the LayerNorm's bias")]
            .map(|((s, l), what)| view::<Elem>(s, l, what));
        let (b, w, beta) = (b?, w?, beta?);
        // SAFETY: the kernel writes both halves of every row.
        let out = unsafe { dev.alloc::<Elem>(2 * rows * c)? };
        let func = dev.get_or_load_custom_func(
            &format!("bias_residual_layer_norm_{suffix}"),
            "rlhf_decode_layer",
            ptx::DECODE_LAYER,
        )?;
        let mut launch = func.builder();
        let (rows64, c32) = (rows as u64, c as u32);
        launch.arg(src).arg(&b).arg(&x).arg(&w).arg(&beta).arg(&out).arg(&rows64).arg(&c32).arg(&eps);
        // SAFETY: the arguments match the kernel's signature.
        unsafe { launch.launch(warp_per_row(rows)) }.w().map(|_| out)
    }))
}

/// A decoding step's embeddings and the first LayerNorm (cuda/decode_layer.cu, one warp a row):
/// for u32 ids and positions (N,) and [wte (V, C), wpe (n_positions, C), w, beta (C,)] of one
/// dtype, all contiguous: (2, N, C), wte[id] + wpe[position] then ln_1 of it (rows of NaN for an
/// id or position outside its table).
pub fn embed_layer_norm(
    (ids, li): (&CudaStorage, &Layout),
    (positions, lp): (&CudaStorage, &Layout),
    [wte, wpe, w, beta]: [(&CudaStorage, &Layout); 4],
    eps: f32,
) -> Result<CudaStorage> {
    let rows = li.shape().elem_count();
    let ((vocab, c), (n_positions, c2)) = (wte.1.shape().dims2()?, wpe.1.shape().dims2()?);
    let vectors_fit = w.1.shape().elem_count() == c && beta.1.shape().elem_count() == c;
    if lp.shape().elem_count() != rows || c2 != c || !vectors_fit {
        candle_core::bail!(
            "embeddings and LayerNorm on CUDA: {rows} ids, {} positions, tables {:?} and {:?}",
            lp.shape().elem_count(),
            wte.1.dims(),
            wpe.1.dims()
        );
    }
    let ids = view::<u32>(ids, li, "the token ids")?;
    let positions = view::<u32>(positions, lp, "the positions")?;
    Ok(for_float_dtype!(wte.0, wte.1, "embeddings and LayerNorm", |table: Elem, suffix| {
        let dev = wte.0.device();
        let [wpe, w, beta] =
            [(wpe, "wpe"), (w, "ln_1's weight"), (beta, "ln_1's bias")].map(|((s, l), what)| view::<Elem>(s, l, what));
        let (wpe, w, beta) = (wpe?, w?, beta?);
        // SAFETY: the kernel writes both halves of every row.
        let out = unsafe { dev.alloc::<Elem>(2 * rows * c)? };
        let func =
            dev.get_or_load_custom_func(&format!("embed_layer_norm_{suffix}"), "rlhf_decode_layer", ptx::DECODE_LAYER)?;
        let mut launch = func.builder();
        let (rows64, c32, vocab32, n_pos32) = (rows as u64, c as u32, vocab as u32, n_positions as u32);
        launch.arg(&ids).arg(&positions).arg(table).arg(&wpe).arg(&w).arg(&beta).arg(&out);
        launch.arg(&rows64).arg(&c32).arg(&vocab32).arg(&n_pos32).arg(&eps);
        // SAFETY: the arguments match the kernel's signature; it reads table rows below the
        // sizes it is given.
        unsafe { launch.launch(warp_per_row(rows)) }.w().map(|_| out)
    }))
}

/// `gelu_new(y + b)` for c_fc's gemm output y (N, W) without its bias b (W,), both contiguous and
/// of one dtype (cuda/decode_layer.cu).
pub fn bias_gelu((y, ly): (&CudaStorage, &Layout), (b, lb): (&CudaStorage, &Layout)) -> Result<CudaStorage> {
    let width = ly.dims().last().copied().unwrap_or(0);
    if width == 0 || lb.shape().elem_count() != width {
        candle_core::bail!("bias and GELU on CUDA: y {:?}, bias {:?}", ly.dims(), lb.dims());
    }
    Ok(for_float_dtype!(y, ly, "bias and GELU", |src: Elem, suffix| {
        let dev = y.device();
        let b = view::<Elem>(b, lb, "c_fc's bias")?;
        let n = src.len();
        // SAFETY: the kernel writes all n elements.
        let out = unsafe { dev.alloc::<Elem>(n)? };
        let func =
            dev.get_or_load_custom_func(&format!("bias_gelu_{suffix}"), "rlhf_decode_layer", ptx::DECODE_LAYER)?;
        let mut launch = func.builder();
        let (n64, w32) = (n as u64, width as u32);
        launch.arg(src).arg(&b).arg(&out).arg(&n64).arg(&w32);
        // SAFETY: the arguments match the kernel's signature.
        unsafe { launch.launch(elementwise(n)) }.w().map(|_| out)
    }))
}

/// The dropout arguments of the attention kernels: the site's seed, threshold and keep scale, and
/// whether to drop at all.
fn dropout_args(mask: Option<DropoutMask>) -> (u64, u32, f32, u32) {
    match mask {
        Some(mask) => {
            let (seed, threshold, scale) = mask.parts();
            (seed, threshold, scale, 1)
        }
        None => (0, 0, 1.0, 0),
    }
}

/// The attention kernels' head dimension (cuda/flash_attention.cu; every GPT-2 size has 64).
pub const ATTENTION_HEAD_DIM: usize = 64;
/// Rows of a block of the attention kernels.
const ATTENTION_TILE: usize = 64;

/// Shapes of an attention call on the GPU: (B, T, NH, bias batches), checked against the kernels.
fn attention_dims(lq: &Layout, lb: &Layout, n_head: usize) -> Result<(usize, usize, usize, usize)> {
    let (b, t, c3) = lq.shape().dims3()?;
    let (bias_batches, _, bt, bs) = lb.shape().dims4()?;
    if c3 != 3 * n_head * ATTENTION_HEAD_DIM || bt != t || bs != t || (bias_batches != 1 && bias_batches != b) {
        candle_core::bail!(
            "flash attention on CUDA: qkv {:?} and bias {:?} do not fit {n_head} heads of {ATTENTION_HEAD_DIM}",
            lq.dims(),
            lb.dims()
        );
    }
    Ok((b, t, n_head, bias_batches))
}

/// A block of four warps per 64 rows of each (batch, head) pair.
fn attention_grid(b: usize, t: usize, n_head: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (t.div_ceil(ATTENTION_TILE) as u32, (b * n_head) as u32, 1),
        block_dim: (128, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn half_precision_only(storage: &CudaStorage, what: &str) -> Result<()> {
    match storage.dtype() {
        DType::BF16 | DType::F16 => Ok(()),
        d => candle_core::bail!("{what} on CUDA takes bf16 or f16, not {d:?}"),
    }
}

/// Whether a half-precision operand starts on a 16-byte boundary, as the attention kernels'
/// vector loads need (a fresh tensor does; a view into one may not).
pub fn aligned_for_attention(layout: &Layout) -> bool {
    layout.start_offset().is_multiple_of(8)
}

fn check_aligned(layouts: &[&Layout]) -> Result<()> {
    if !layouts.iter().all(|l| aligned_for_attention(l)) {
        candle_core::bail!("flash attention on CUDA: an operand does not start on a 16-byte boundary");
    }
    Ok(())
}

/// Attention kernel `$name` (cuda/flash_attention.cu), preferring shared memory to L1 (a block
/// takes 36 KiB of it; the kernels read little through L1), so that the blocks its registers allow
/// fit an SM. (A macro: candle does not export the type of its loaded functions.)
macro_rules! attention_kernel {
    ($dev:expr, $name:expr) => {{
        use candle_core::cuda_backend::cudarc::driver::sys::CUfunction_attribute;
        let func = $dev.get_or_load_custom_func($name, "rlhf_flash_attention", ptx::FLASH_ATTENTION)?;
        func.set_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, 100).w()?;
        func
    }};
}

/// Blocks an SM holds of each attention kernel for `dtype` (bf16 or f16), as the driver computes
/// it: (forward, dq, dk/dv).
pub fn attention_blocks_per_sm(dev: &candle_core::CudaDevice, dtype: DType) -> Result<(u32, u32, u32)> {
    let suffix = if dtype == DType::F16 { "f16" } else { "bf16" };
    let blocks = |name: &str| -> Result<u32> {
        attention_kernel!(dev, &format!("{name}_{suffix}"))
            .occupancy_max_active_blocks_per_multiprocessor(128, 0, None)
            .w()
    };
    Ok((blocks("attention_forward")?, blocks("attention_backward_dq")?, blocks("attention_backward_dkv")?))
}

/// Which (query tile, key tile) pairs of the mask the attention kernels walk, per bias batch (u8,
/// (bias batches, tiles, tiles)): 0 where every entry is masked, 2 where every entry is 0 (not
/// read), else 1; a query tile with a row that has no live key at all is walked whole
/// (cuda/flash_attention.cu's `attention_tile_liveness` and `attention_dead_rows`).
fn attention_tile_liveness(
    dev: &candle_core::CudaDevice,
    bias: &CudaView<'_, f32>,
    bias_batches: usize,
    t: usize,
) -> Result<candle_core::cuda_backend::cudarc::driver::CudaSlice<u8>> {
    let tiles = t.div_ceil(ATTENTION_TILE);
    let (tiles32, bb32, t32) = (tiles as u32, bias_batches as u32, t as u32);
    // SAFETY: the first kernel writes every entry.
    let live = unsafe { dev.alloc::<u8>(bias_batches * tiles * tiles)? };
    let row_live = dev.alloc_zeros::<u32>(bias_batches * t)?;
    let func = attention_kernel!(dev, "attention_tile_liveness");
    let mut launch = func.builder();
    launch.arg(bias).arg(&live).arg(&row_live).arg(&t32);
    let config = LaunchConfig { grid_dim: (tiles32, tiles32, bb32), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
    // SAFETY: the arguments match the kernel's signature.
    unsafe { launch.launch(config) }.w()?;
    let func = attention_kernel!(dev, "attention_dead_rows");
    let mut launch = func.builder();
    launch.arg(&live).arg(&row_live).arg(&t32);
    let config =
        LaunchConfig { grid_dim: (tiles32, bb32, 1), block_dim: (ATTENTION_TILE as u32, 1, 1), shared_mem_bytes: 0 };
    // SAFETY: the arguments match the kernel's signature; the same stream orders it after the first.
    unsafe { launch.launch(config) }.w()?;
    Ok(live)
}

/// What [`attention`] keeps for [`attention_grad`]: the softmax's row statistics (f32: the
/// B * NH * T row maxima, then as many 1 / row sums) and the mask's tile map, so that backward
/// reads the one and does not make the other again.
pub struct AttentionSaved {
    stats: CudaStorage,
    live: CudaSlice<u8>,
}

/// Flash attention (cuda/flash_attention.cu): from qkv (B, T, 3C) in bf16 or f16 and the
/// additive mask (B or 1, 1, T, T) f32, `dropout(softmax(q k^T * scale + bias)) v` per head,
/// (B, T, C), without the (B, NH, T, T) probabilities in memory; and what backward needs of it.
pub fn attention(
    (qkv, lq): (&CudaStorage, &Layout),
    (bias, lb): (&CudaStorage, &Layout),
    n_head: usize,
    scale: f32,
    dropout: Option<DropoutMask>,
) -> Result<(CudaStorage, AttentionSaved)> {
    half_precision_only(qkv, "flash attention")?;
    check_aligned(&[lq])?;
    let (b, t, nh, bias_batches) = attention_dims(lq, lb, n_head)?;
    let bias = view::<f32>(bias, lb, "the attention bias")?;
    let (seed, threshold, keep, on) = dropout_args(dropout);
    let dev = qkv.device();
    let live = attention_tile_liveness(dev, &bias, bias_batches, t)?;
    // SAFETY: the kernel writes the statistics of every (batch, head, query).
    let stats = unsafe { dev.alloc::<f32>(2 * b * nh * t)? };
    let y = for_float_dtype!(qkv, lq, "flash attention", |src: Elem, suffix| {
        // SAFETY: the kernel writes every row of every head.
        let y = unsafe { dev.alloc::<Elem>(b * t * nh * ATTENTION_HEAD_DIM)? };
        let func = attention_kernel!(dev, &format!("attention_forward_{suffix}"));
        let mut launch = func.builder();
        let (t32, nh32, bb32) = (t as u32, nh as u32, bias_batches as u32);
        launch.arg(src).arg(&bias).arg(&live).arg(&y).arg(&stats).arg(&t32).arg(&nh32).arg(&bb32).arg(&scale);
        launch.arg(&seed).arg(&threshold).arg(&keep).arg(&on);
        // SAFETY: the arguments match the kernel's signature.
        unsafe { launch.launch(attention_grid(b, t, nh)) }.w().map(|_| y)
    });
    Ok((y, AttentionSaved { stats: CudaStorage::wrap_cuda_slice(stats, dev.clone()), live }))
}

/// The gradient of [`attention`] with respect to qkv, (B, T, 3C), from its output y (B, T, C) and
/// what it saved, the output gradient dy (B, T, C), the mask and the mask transposed in its last
/// two dimensions (what the key-tile kernel reads along the queries). Deterministic: every element
/// is summed by one thread in a fixed order.
#[allow(clippy::too_many_arguments)]
pub fn attention_grad(
    (qkv, lq): (&CudaStorage, &Layout),
    (bias, lb): (&CudaStorage, &Layout),
    (bias_t, lbt): (&CudaStorage, &Layout),
    (y, ly): (&CudaStorage, &Layout),
    saved: &AttentionSaved,
    (dy, ldy): (&CudaStorage, &Layout),
    n_head: usize,
    scale: f32,
    dropout: Option<DropoutMask>,
) -> Result<CudaStorage> {
    half_precision_only(qkv, "flash attention backward")?;
    check_aligned(&[lq, ly, ldy])?;
    let (b, t, nh, bias_batches) = attention_dims(lq, lb, n_head)?;
    if lbt.dims() != lb.dims() {
        candle_core::bail!("flash attention backward: transposed bias {:?}, bias {:?}", lbt.dims(), lb.dims());
    }
    let bias = view::<f32>(bias, lb, "the attention bias")?;
    let bias_t = view::<f32>(bias_t, lbt, "the transposed attention bias")?;
    let tiles = t.div_ceil(ATTENTION_TILE);
    if <f32 as CudaDType>::as_cuda_slice(&saved.stats)?.len() != 2 * b * nh * t
        || saved.live.len() != bias_batches * tiles * tiles
    {
        candle_core::bail!("flash attention backward: what the forward saved is not of this call's shape");
    }
    let stats = view::<f32>(&saved.stats, &Layout::contiguous(2 * b * nh * t), "the attention statistics")?;
    let live = &saved.live;
    let (seed, threshold, keep, on) = dropout_args(dropout);
    let dev = qkv.device();
    Ok(for_float_dtype!(qkv, lq, "flash attention backward", |src: Elem, suffix| {
        let y = view::<Elem>(y, ly, "the attention output")?;
        let dy = view::<Elem>(dy, ldy, "the attention output gradient")?;
        // SAFETY: the dq kernel writes the q part of every row and D of every (batch, head,
        // query); the dk/dv kernel the k and v parts.
        let dqkv = unsafe { dev.alloc::<Elem>(src.len())? };
        let dsum = unsafe { dev.alloc::<f32>(b * nh * t)? };
        let (t32, nh32, bb32) = (t as u32, nh as u32, bias_batches as u32);
        let dq = attention_kernel!(dev, &format!("attention_backward_dq_{suffix}"));
        let mut launch = dq.builder();
        launch.arg(src).arg(&bias).arg(live).arg(&y).arg(&dy).arg(&dqkv).arg(&stats).arg(&dsum);
        launch.arg(&t32).arg(&nh32).arg(&bb32).arg(&scale).arg(&seed).arg(&threshold).arg(&keep).arg(&on);
        // SAFETY: the arguments match the kernel's signature.
        unsafe { launch.launch(attention_grid(b, t, nh)) }.w()?;
        let dkv = attention_kernel!(dev, &format!("attention_backward_dkv_{suffix}"));
        let mut launch = dkv.builder();
        launch.arg(src).arg(&bias_t).arg(live).arg(&dy).arg(&stats).arg(&dsum).arg(&dqkv);
        launch.arg(&t32).arg(&nh32).arg(&bb32).arg(&scale).arg(&seed).arg(&threshold).arg(&keep).arg(&on);
        // SAFETY: the arguments match the kernel's signature; D was written above, on the same
        // stream.
        unsafe { launch.launch(attention_grid(b, t, nh)) }.w().map(|_| dqkv)
    }))
}

/// These run on a GPU (the CUDA build's unit tests, which `scripts/gpu-check.sh` runs from the
/// package); without one they pass after saying so on stderr.
#[cfg(test)]
mod tests {
    use crate::kernels::ops::{
        attention, attention_reference, cross_entropy_rows, cross_entropy_rows_reference, dropout, dropout_reference,
        gelu, gelu_reference, greedy_pick, layer_norm, layer_norm_reference, masked_softmax, masked_softmax_reference,
        DropoutKey,
    };
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

    /// The attention masks the tests use: per batch row (B, 1, T, T), causal with batch row 1
    /// padded on the left by 5 (its first 5 queries see no key at all), and the broadcast causal
    /// mask (1, 1, T, T).
    fn causal_masks(b: usize, t: usize) -> Result<(Tensor, Tensor)> {
        let mut per_batch = vec![0f32; b * t * t];
        for (i, m) in per_batch.iter_mut().enumerate() {
            let (batch, row, col) = (i / (t * t), i / t % t, i % t);
            if col > row || (batch == 1 && col < 5) {
                *m = -1e9;
            }
        }
        let per_batch = Tensor::from_vec(per_batch, (b, 1, t, t), &Device::Cpu)?;
        let causal = per_batch.narrow(0, 0, 1)?.contiguous()?;
        Ok((per_batch, causal))
    }

    /// The largest |value| of a tensor, as f32.
    fn largest(t: &Tensor) -> Result<f32> {
        t.to_device(&Device::Cpu)?.to_dtype(DType::F32)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()
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

    /// `f` of the inputs and its gradients with respect to each (the loss: the output times
    /// fixed weights, summed), on `device`.
    fn value_and_grads(
        inputs: &[&Tensor],
        device: &Device,
        f: impl Fn(&[Tensor]) -> Result<Tensor>,
    ) -> Result<(Tensor, Vec<Tensor>)> {
        let vars = inputs.iter().map(|t| Var::from_tensor(&t.to_device(device)?)).collect::<Result<Vec<_>>>()?;
        let y = f(&vars.iter().map(|v| v.as_tensor().clone()).collect::<Vec<_>>())?;
        // The same weights in [-1, 1) on both devices, a function of the element's index.
        let fixed: Vec<f32> = (0..y.elem_count()).map(|i| (i * 7919 % 1000) as f32 / 500.0 - 1.0).collect();
        let weights = Tensor::from_vec(fixed, y.shape(), &Device::Cpu)?.to_dtype(y.dtype())?.to_device(device)?;
        let grads = y.mul(&weights)?.sum_all()?.backward()?;
        let g = vars.iter().map(|v| grads.get(v.as_tensor()).expect("every input has a gradient").clone()).collect();
        Ok((y, g))
    }

    #[test]
    fn layer_norm_and_its_gradients_match_the_cpu_and_are_deterministic() -> Result<()> {
        let Some(gpu) = gpu() else { return Ok(()) };
        // 2100 rows: more rows than backward blocks; C = 200 is not a multiple of 32.
        let x = Tensor::randn(0f32, 1f32, (3, 700, 200), &Device::Cpu)?.affine(2.0, 0.5)?;
        let w = Tensor::randn(1f32, 0.2, 200, &Device::Cpu)?;
        let b = Tensor::randn(0f32, 0.2, 200, &Device::Cpu)?;
        let ln = |t: &[Tensor]| layer_norm(&t[0], &t[1], &t[2], 1e-5);
        let (y_cpu, g_cpu) = value_and_grads(&[&x, &w, &b], &Device::Cpu, ln)?;
        let (y_gpu, g_gpu) = value_and_grads(&[&x, &w, &b], &gpu, ln)?;
        assert!(max_diff(&y_gpu, &y_cpu)? < 1e-5, "output {}", max_diff(&y_gpu, &y_cpu)?);
        for (name, gc, gg) in [("dx", &g_cpu[0], &g_gpu[0]), ("dw", &g_cpu[1], &g_gpu[1]), ("db", &g_cpu[2], &g_gpu[2])]
        {
            let scale = largest(gc)?;
            assert!(max_diff(gg, gc)? <= 1e-5 * scale.max(1.0), "{name}: {} (largest {scale})", max_diff(gg, gc)?);
        }
        let (_, again) = value_and_grads(&[&x, &w, &b], &gpu, ln)?;
        assert_eq!(max_diff(&again[1], &g_gpu[1])?, 0.0, "dw differs between two runs");
        // Half precision against the composed reference in that dtype (which rounds more often).
        for dtype in [DType::BF16, DType::F16] {
            let (xh, wh, bh) = (x.to_dtype(dtype)?, w.to_dtype(dtype)?, b.to_dtype(dtype)?);
            let want = layer_norm_reference(&xh, &wh, &bh, 1e-5)?;
            let got = layer_norm(&xh.to_device(&gpu)?, &wh.to_device(&gpu)?, &bh.to_device(&gpu)?, 1e-5)?;
            let tol = if dtype == DType::BF16 { 0.1 } else { 0.01 };
            assert!(max_diff(&got, &want)? <= tol, "{dtype:?} {}", max_diff(&got, &want)?);
        }
        Ok(())
    }

    #[test]
    fn gelu_and_its_gradient_match_the_cpu() -> Result<()> {
        let Some(gpu) = gpu() else { return Ok(()) };
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
        }
        Ok(())
    }

    #[test]
    fn cross_entropy_rows_and_their_gradient_match_the_cpu() -> Result<()> {
        let Some(gpu) = gpu() else { return Ok(()) };
        // 37 rows over a vocabulary of 5003: a block of 256 threads strides 20 times, with a tail.
        let (n, v) = (37, 5003);
        let logits = (Tensor::randn(0f32, 1f32, (n, v), &Device::Cpu)? * 4.0)?;
        let targets: Vec<u32> = (0..n as u32).map(|r| (r * 7919 + 11) % v as u32).collect();
        let targets = Tensor::new(targets, &Device::Cpu)?;
        let t_gpu = targets.to_device(&gpu)?;
        let (l_cpu, g_cpu) = value_and_grads(&[&logits], &Device::Cpu, |t| cross_entropy_rows(&t[0], &targets))?;
        let (l_gpu, g_gpu) = value_and_grads(&[&logits], &gpu, |t| cross_entropy_rows(&t[0], &t_gpu))?;
        assert!(max_diff(&l_gpu, &l_cpu)? < 2e-5, "loss {}", max_diff(&l_gpu, &l_cpu)?);
        // Each gradient is p * w - [target] * w with p = exp(x - lse): the two devices' lse
        // (about 17 here, an f32 ulp of 1.9e-6) differ by a few ulp, which moves p by as many
        // parts in 1e6 (measured on an H200: 1.25e-6).
        assert!(max_diff(&g_gpu[0], &g_cpu[0])? < 5e-6, "gradient {}", max_diff(&g_gpu[0], &g_cpu[0])?);
        // Half precision: the losses against the composed reference on f32 copies of the same
        // half-precision logits (what the kernel reads), then rounded as the loss is.
        for dtype in [DType::BF16, DType::F16] {
            let half = logits.to_dtype(dtype)?;
            let want = cross_entropy_rows_reference(&half.to_dtype(DType::F32)?, &targets)?;
            let got = cross_entropy_rows(&half.to_device(&gpu)?, &t_gpu)?;
            let scale = want.abs()?.max(0)?.to_scalar::<f32>()?;
            let tol = if dtype == DType::BF16 { 8e-3 } else { 1e-3 } * scale;
            assert!(max_diff(&got, &want)? <= tol, "{dtype:?} {}", max_diff(&got, &want)?);
        }
        Ok(())
    }

    /// Greedy decoding's pick on the GPU against the CPU's on the same values (37 rows of 5003, the
    /// last 13 ids beyond the limit): the same token in every row, where several ids share the
    /// largest value too (the first, as the CPU's argmax) and where a larger value lies beyond
    /// the limit (never taken); bf16 and f16 read as they are, the CPU reading f32 copies of
    /// the same values. Log-probabilities: both sum the exponentials in f64, which differ by
    /// an f32 ulp or so (1e-6 of a log-probability of about -20).
    #[test]
    fn greedy_pick_matches_the_cpu_on_ties_and_the_vocabulary_limit() -> Result<()> {
        let Some(gpu) = gpu() else { return Ok(()) };
        let (b, v, limit) = (37, 5003, 4990);
        let logits = crate::kernels::fused::tests::logits_for_greedy_pick(b, v, limit)?;
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            let x = logits.to_dtype(dtype)?;
            let (want_tokens, want_logprobs) = greedy_pick(&x, limit)?;
            let (tokens, logprobs) = greedy_pick(&x.to_device(&gpu)?, limit)?;
            assert_eq!(tokens, want_tokens, "{dtype:?}");
            for (r, (got, want)) in logprobs.iter().zip(&want_logprobs).enumerate() {
                assert!((got - want).abs() < 2e-5, "{dtype:?} row {r}: {got} vs {want}");
            }
        }
        Ok(())
    }

    /// Sampling's pick on the GPU against the CPU's on the same values and draws (37 rows of
    /// 5003 on a grid of 1/8, so many ids tie; the last 13 ids beyond the limit): the same token
    /// in every row for temperature alone, top-k, top-p, both, and the greedy settings, in f32,
    /// bf16 and f16 (the CPU reading f32 copies of the same values); log-probabilities as
    /// greedy_pick's.
    #[test]
    fn sample_pick_matches_the_cpu_for_every_setting_and_dtype() -> Result<()> {
        use crate::kernels::sample_pick::{sample_pick, tests::sampling_cases};
        let Some(gpu) = gpu() else { return Ok(()) };
        let (logits, draws, settings) = sampling_cases(37, 5003);
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            let x = logits.to_dtype(dtype)?;
            for params in &settings {
                let (want_tokens, want_logprobs) = sample_pick(&x, &draws, params)?;
                let (tokens, logprobs) = sample_pick(&x.to_device(&gpu)?, &draws, params)?;
                assert_eq!(tokens, want_tokens, "{dtype:?} {params:?}");
                for (r, (got, want)) in logprobs.iter().zip(&want_logprobs).enumerate() {
                    assert!((got - want).abs() < 2e-5, "{dtype:?} {params:?} row {r}: {got} vs {want}");
                }
            }
        }
        Ok(())
    }

    #[test]
    fn flash_attention_and_its_gradient_match_the_cpu_and_are_deterministic() -> Result<()> {
        let Some(gpu) = gpu() else { return Ok(()) };
        // Two heads of 64; T = 100 is one full tile of 64 and a partial one, T = 300 five tiles
        // (the one-pass forward rescales its rows as their max moves). The per-batch mask pads
        // batch row 1 on the left by 5, so its first 5 queries see no key at all (a softmax over
        // masked scores only: uniform over the T keys).
        let dev = gpu.as_cuda_device()?;
        eprintln!(
            "attention kernels' blocks an SM (forward, dq, dk/dv): {:?}",
            super::attention_blocks_per_sm(dev, DType::BF16)?
        );
        let nh = 2;
        let c = nh * super::ATTENTION_HEAD_DIM;
        let key = DropoutKey { seed: 11, step: 2, micro_batch: 0 };
        let scale = 0.125;
        let cases = [(2, 100), (2, 300)].into_iter().map(|(b, t)| -> Result<_> {
            let qkv = Tensor::randn(0f32, 1f32, (b, t, 3 * c), &Device::Cpu)?;
            let (per_batch, causal) = causal_masks(b, t)?;
            Ok([
                (qkv.clone(), per_batch.clone(), None),
                (qkv.clone(), causal, Some(key.mask(0.1, 0, 0))),
                (qkv, per_batch, Some(key.mask(0.1, 3, 0))),
            ])
        });
        for (qkv, bias, drop) in cases.collect::<Result<Vec<_>>>()?.into_iter().flatten() {
            let bias = &bias;
            for dtype in [DType::BF16, DType::F16] {
                // The same half-precision inputs on both sides: the CPU's fused f32 kernel is the
                // reference.
                let half = qkv.to_dtype(dtype)?;
                let f = |x: &[Tensor]| {
                    let bias = bias.to_device(x[0].device())?;
                    attention(&x[0], &bias, nh, scale, drop)
                };
                let (y_cpu, g_cpu) = value_and_grads(&[&half.to_dtype(DType::F32)?], &Device::Cpu, f)?;
                let (y_gpu, g_gpu) = value_and_grads(&[&half], &gpu, f)?;
                // Half precision rounds the probabilities and the score gradients once each.
                let tol = if dtype == DType::BF16 { 2e-2 } else { 4e-3 };
                let (dy, dg) = (max_diff(&y_gpu, &y_cpu)?, max_diff(&g_gpu[0], &g_cpu[0])?);
                eprintln!(
                    "flash attention {dtype:?} dropout {}: y {dy:.2e} of {:.2e}, dqkv {dg:.2e} of {:.2e}",
                    drop.is_some(),
                    largest(&y_cpu)?,
                    largest(&g_cpu[0])?
                );
                assert!(dy <= tol * largest(&y_cpu)?, "{dtype:?} output {dy}");
                assert!(dg <= tol * largest(&g_cpu[0])?, "{dtype:?} gradient {dg}");
                // The composed ops on the GPU (the path before the kernels) agree as well.
                let composed = attention_reference(&half.to_device(&gpu)?, &bias.to_device(&gpu)?, nh, scale, drop)?;
                assert!(max_diff(&composed, &y_cpu)? <= tol * largest(&y_cpu)?, "{dtype:?} composed");
                let (_, again) = value_and_grads(&[&half], &gpu, f)?;
                assert_eq!(max_diff(&again[0], &g_gpu[0])?, 0.0, "the gradient differs between two runs");
            }
        }
        Ok(())
    }

    /// attention_tile_liveness's map computed plainly: per (bias batch, query tile, key tile), 0
    /// where every entry is masked, 2 where every entry is 0, else 1; a query tile with a row that
    /// has no live key at all has no 0.
    fn tile_liveness_reference(bias: &[f32], batches: usize, t: usize) -> Vec<u8> {
        let tiles = t.div_ceil(64);
        let at = |b: usize, i: usize, j: usize| bias[(b * t + i) * t + j];
        let mut map = vec![0u8; batches * tiles * tiles];
        for b in 0..batches {
            for qt in 0..tiles {
                let rows = qt * 64..(qt * 64 + 64).min(t);
                let dead_row = rows.clone().any(|i| (0..t).all(|j| at(b, i, j) <= -5e8));
                for kt in 0..tiles {
                    let cols = kt * 64..(kt * 64 + 64).min(t);
                    let entries: Vec<f32> = rows.clone().flat_map(|i| cols.clone().map(move |j| at(b, i, j))).collect();
                    let live = entries.iter().any(|&v| v > -5e8);
                    let plain = entries.iter().all(|&v| v == 0.0);
                    map[(b * tiles + qt) * tiles + kt] = match (live, plain) {
                        (true, true) => 2,
                        (true, false) => 1,
                        (false, _) => dead_row as u8,
                    };
                }
            }
        }
        map
    }

    #[test]
    fn attention_tile_liveness_marks_masked_plain_and_dead_row_tiles() -> Result<()> {
        let Some(gpu) = gpu() else { return Ok(()) };
        let dev = gpu.as_cuda_device()?;
        for t in [100, 300] {
            let (per_batch, _) = causal_masks(2, t)?;
            let on_gpu = per_batch.to_device(&gpu)?;
            let (storage, layout) = on_gpu.storage_and_layout();
            let candle_core::Storage::Cuda(storage) = &*storage else { candle_core::bail!("not on the GPU") };
            let bias = super::view::<f32>(storage, layout, "the attention bias")?;
            let got = dev.clone_dtoh(&super::attention_tile_liveness(dev, &bias, 2, t)?)?;
            let want = tile_liveness_reference(&per_batch.flatten_all()?.to_vec1::<f32>()?, 2, t);
            assert_eq!(got, want, "T = {t}");
            // By hand: batch 0's causal mask: the diagonal tile 1, below it 2, above it 0; batch
            // 1's first 5 queries see no key, so its first query tile walks every key tile.
            let tiles = t.div_ceil(64);
            assert_eq!((got[0], got[1], got[tiles]), (1, 0, 2), "T = {t}");
            assert!(got[tiles * tiles..tiles * tiles + tiles].iter().all(|&v| v == 1), "T = {t}");
        }
        Ok(())
    }

    #[test]
    fn sum_of_squares_matches_the_cpu_in_f64_and_is_deterministic() -> Result<()> {
        let Some(gpu) = gpu() else { return Ok(()) };
        let exact = |ts: &[Tensor]| -> Result<f64> {
            let mut sum = 0.0;
            for t in ts {
                sum += t.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?.iter().map(|v| v * v).sum::<f64>();
            }
            Ok(sum)
        };
        let sum = |ts: &[Tensor]| -> Result<f64> {
            Ok(crate::kernels::fused::sum_of_squares_on_device(ts)?.expect("tensors on a GPU"))
        };
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
        let chunk = super::MULTI_TENSOR_CHUNK as usize;
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

    /// A prefill of 7 tokens and three decoding steps of 3 rows (the first left-padded by 2, so
    /// its first query sees no key), heads of 64, 32 and 128 values: the GPU's two-launch step
    /// (KvCache::append_qkv, ops::decode_attention) against the CPU's split heads, cache and
    /// cached attention in f32. The cache holds the same values; the output agrees to 1e-5 of
    /// the largest value in f32, 2e-2 in bf16 and 4e-3 in f16 (the attention test's bounds).
    /// Given c_attn's gemm output and bias apart, the two launches make the same cache and the
    /// same output, bit for bit, as from the biased qkv that the linear's bias add rounds.
    #[test]
    fn decode_attention_from_qkv_matches_the_cpu_cache_and_cached_attention() -> Result<()> {
        use crate::model::gpt2::MASKED;
        use crate::model::kv_cache::KvCache;
        let Some(gpu) = gpu() else { return Ok(()) };
        let (b, capacity, pad) = (3usize, 16usize, 2usize);
        for (n_head, head_dim) in [(2usize, 64usize), (4, 32), (1, 128)] {
            let c = n_head * head_dim;
            for (dtype, bound) in [(DType::F32, 1e-5f32), (DType::BF16, 2e-2), (DType::F16, 4e-3)] {
                let (mut on_cpu, mut on_gpu) = (KvCache::new(capacity), KvCache::new(capacity));
                let mut bias_apart = KvCache::new(capacity);
                let mut start = 0;
                for t in [7usize, 1, 1, 1] {
                    let s = start + t;
                    // Causal over the positions so far, row 0's first `pad` keys masked.
                    let mut bias = vec![0f32; b * t * s];
                    for (r, i, j) in (0..b).flat_map(|r| (0..t).flat_map(move |i| (0..s).map(move |j| (r, i, j)))) {
                        if j > start + i || (r == 0 && j < pad) {
                            bias[(r * t + i) * s + j] = MASKED;
                        }
                    }
                    let bias = Tensor::from_vec(bias, (b, 1, t, s), &Device::Cpu)?;
                    // qkv = y + qkv_bias as the linear's bias add makes it: in f32, rounded once.
                    let y = Tensor::randn(0f32, 1f32, (b, t, 3 * c), &Device::Cpu)?.to_dtype(dtype)?;
                    let qkv_bias = Tensor::randn(0f32, 0.5f32, 3 * c, &Device::Cpu)?.to_dtype(dtype)?;
                    let exact_sum = y.to_dtype(DType::F32)?.broadcast_add(&qkv_bias.to_dtype(DType::F32)?)?;
                    let qkv = exact_sum.to_dtype(dtype)?;
                    let exact = qkv.to_dtype(DType::F32)?;
                    let (q, k, v) = crate::kernels::ops::split_heads(&exact, n_head)?;
                    let (k, v) = on_cpu.append(&k, &v)?;
                    let scale = 1.0 / (head_dim as f64).sqrt();
                    let want = crate::kernels::ops::cached_attention(&q, &k, &v, &bias, scale)?;
                    let (qkv, bias) = (qkv.to_device(&gpu)?, bias.to_device(&gpu)?);
                    assert!(crate::kernels::ops::decode_attention_on_cuda(&qkv, &bias, n_head));
                    let (kv, cached) = on_gpu.append_qkv(&qkv, None, n_head)?;
                    assert_eq!(cached, start);
                    let got = crate::kernels::ops::decode_attention(&qkv, None, &kv, start, &bias, n_head, scale)?;
                    let what = format!("{dtype:?}, {n_head} heads of {head_dim}, {t} tokens after {start}");
                    let (y, qkv_bias) = (y.to_device(&gpu)?, qkv_bias.to_device(&gpu)?);
                    let (kv_apart, _) = bias_apart.append_qkv(&y, Some(&qkv_bias), n_head)?;
                    let got_apart = crate::kernels::ops::decode_attention(
                        &y,
                        Some(&qkv_bias),
                        &kv_apart,
                        start,
                        &bias,
                        n_head,
                        scale,
                    )?;
                    let written = |kv: &Tensor| kv.narrow(3, 0, s);
                    assert_eq!(max_diff(&written(&kv_apart)?, &written(&kv)?)?, 0.0, "the cache, bias apart, {what}");
                    assert_eq!(max_diff(&got_apart, &got)?, 0.0, "the output from the bias apart, {what}");
                    let cache = kv.to_device(&Device::Cpu)?.to_dtype(DType::F32)?.narrow(3, 0, s)?;
                    assert_eq!(max_diff(&cache.get(0)?, &k)?, 0.0, "keys, {what}");
                    assert_eq!(max_diff(&cache.get(1)?, &v)?, 0.0, "values, {what}");
                    let got = got.to_device(&Device::Cpu)?.to_dtype(DType::F32)?;
                    assert_eq!(got.dims(), [b, t, c]);
                    let diff = max_diff(&got, &want)?;
                    assert!(diff <= bound * largest(&want)?, "{what}: max |diff| {diff}");
                    start = s;
                }
            }
        }
        Ok(())
    }

    /// A decoding step's fused blocks (gpt2.rs's Block::forward_decoding_on_cuda, nine launches
    /// a layer) against the same blocks one op a launch (Block::forward, on the GPU's kernels
    /// too), on a 3-layer GPT-2 with heads of 64 and of 32: a prefill of 5 tokens with row 0
    /// left-padded by 2, then 4 steps, in f32, bf16 and f16. The fused kernels round each
    /// intermediate where the unfused ops store it, so the hidden states (and so the caches
    /// the later steps read) are the same bit for bit.
    #[test]
    fn fused_decoding_blocks_are_the_unfused_blocks_bit_for_bit() -> anyhow::Result<()> {
        use crate::model::gpt2::{Gpt2, Gpt2Cache, Positions};
        let Some(gpu) = gpu() else { return Ok(()) };
        let (b, p) = (3usize, 5usize);
        for n_head in [2usize, 4] {
            let cfg =
                crate::Gpt2Config { n_layer: 3, n_head, vocab_size: 500, n_positions: 32, ..crate::Gpt2Config::tiny() };
            let params = crate::ParamStore::init(&cfg, 11, &Device::Cpu)?;
            for dtype in [DType::F32, DType::BF16, DType::F16] {
                let on_gpu = params.tensors().into_iter().map(|(k, v)| Ok((k, v.to_dtype(dtype)?.to_device(&gpu)?)));
                let weights = on_gpu.collect::<Result<std::collections::HashMap<_, _>>>()?;
                let model = Gpt2::load(candle_nn::VarBuilder::from_tensors(weights, dtype, &gpu), &cfg)?;
                let mut mask: Vec<Vec<u32>> =
                    (0..b).map(|r| (0..p).map(|j| u32::from(r != 0 || j >= 2)).collect()).collect();
                let positions = crate::generation::generate::position_ids(&mask.concat(), b, p);
                let mut ids = Tensor::from_vec((0..b * p).map(|i| (i * 37 % 500) as u32).collect(), (b, p), &gpu)?;
                let mut pos = Tensor::from_vec(positions, (b, p), &gpu)?;
                let mut next_pos: Vec<u32> = mask.iter().map(|m| m.iter().sum()).collect();
                let (mut fused_cache, mut plain_cache) = (Gpt2Cache::new(&cfg, 16), Gpt2Cache::new(&cfg, 16));
                for step in 0..5 {
                    let mask_t = Tensor::new(mask.clone(), &Device::Cpu)?;
                    let positions = Positions { position_ids: Some(&pos), attention_mask: Some(&mask_t) };
                    let (t, past) = (ids.dim(1)?, plain_cache.len());
                    let bias = model.attention_bias(b, t, past, &positions, &gpu)?;
                    assert!(model.decodes_fused_on_cuda(&bias, None), "the fused path applies");
                    let mut plain = model.embed(&ids, &positions, past, None)?;
                    let fused = model.forward_blocks(&ids, &positions, Some(&mut fused_cache), None)?;
                    for (block, layer) in model.h.iter().zip(plain_cache.layers.iter_mut()) {
                        plain = block.forward(&plain, &bias, Some(layer), None)?;
                    }
                    let diff = max_diff(&fused, &plain)?;
                    assert_eq!(diff, 0.0, "{dtype:?}, {n_head} heads, step {step}: hidden states differ by {diff}");
                    ids = Tensor::from_vec(vec![(step * 7 + 1) as u32; b], (b, 1), &gpu)?;
                    pos = Tensor::from_vec(next_pos.clone(), (b, 1), &gpu)?;
                    next_pos.iter_mut().for_each(|x| *x += 1);
                    mask.iter_mut().for_each(|m| m.push(1));
                }
            }
        }
        Ok(())
    }

    #[test]
    fn cast_into_a_variable_is_the_cpu_cast_bit_for_bit() -> Result<()> {
        let Some(gpu) = gpu() else { return Ok(()) };
        let values = crate::kernels::fused::tests::cast_probe_values();
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

    #[test]
    fn embedding_gradient_is_the_cpu_sum_per_row_bit_for_bit() -> Result<()> {
        let Some(gpu) = gpu() else { return Ok(()) };
        // 3000 ids over 467 of 500 rows (the rest absent), many repeated; 300 columns stride
        // past a block of 256 threads.
        let table = Tensor::randn(0f32, 1f32, (500, 300), &Device::Cpu)?;
        let ids = Tensor::new((0..3000u32).map(|i| (i * i * 13 + 7) % 467).collect::<Vec<_>>(), &Device::Cpu)?;
        let f = |t: &[Tensor]| crate::kernels::ops::embedding(&t[0], &ids.to_device(t[0].device())?);
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            let table = table.to_dtype(dtype)?;
            let (y, g) = value_and_grads(&[&table], &gpu, f)?;
            assert_eq!(max_diff(&y, &table.index_select(&ids, 0)?)?, 0.0, "{dtype:?} rows");
            // value_and_grads' output weights in this dtype, added per row in f32 in the order of
            // the positions by candle's CPU index_add, rounded once.
            let fixed: Vec<f32> = (0..y.elem_count()).map(|i| (i * 7919 % 1000) as f32 / 500.0 - 1.0).collect();
            let dy = Tensor::from_vec(fixed, y.shape(), &Device::Cpu)?.to_dtype(dtype)?.to_dtype(DType::F32)?;
            let want = Tensor::zeros((500, 300), DType::F32, &Device::Cpu)?.index_add(&ids, &dy, 0)?.to_dtype(dtype)?;
            assert_eq!(max_diff(&g[0], &want)?, 0.0, "{dtype:?} gradient");
        }
        Ok(())
    }

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
