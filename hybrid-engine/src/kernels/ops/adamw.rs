//! AdamW's CUDA launchers (cuda/adamw.cu; the CPU's AdamW is training/optim.rs's own loop): one
//! pass in place per parameter, and the multi-tensor step for every parameter of the model in one
//! launch.

use crate::kernels::cuda::{
    address, common_device, elementwise, ptx, upload_table, view, TensorSlot, BLOCK, MULTI_TENSOR_CHUNK, NO_COPY,
};
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{CudaViewMut, DeviceRepr, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{CudaStorage, Layout, Result, Tensor};

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
