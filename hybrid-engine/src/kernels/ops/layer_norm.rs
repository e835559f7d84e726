//! LayerNorm over the last dimension with its backward (dx, dw and db from one pass that
//! recomputes the row statistics): the CPU kernel (`rowops::layer_norm`) and the CUDA kernels
//! (cuda/layer_norm.cu, one warp a row; dw and db summed in a fixed order).

use crate::kernels::parallel::{for_rows, reduce_rows, SharedOut};
use crate::kernels::rowops;
use crate::storage::contiguous_f32;
use candle_core::{CpuStorage, CustomOp3, Layout, Result, Shape, Tensor};

/// `(x - mean) * rstd * w + b` over the last dimension (biased variance, as torch).
struct LayerNorm {
    eps: f32,
}

/// Gradient of [`LayerNorm`] for (x, w, dy): one (N + 2, C) tensor holding dx (N rows), then dw
/// and db.
struct LayerNormGrad {
    eps: f32,
}

impl CustomOp3 for LayerNorm {
    fn name(&self) -> &'static str {
        "layer-norm"
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
        let x = contiguous_f32(s1, l1, "layer norm input")?;
        let w = contiguous_f32(s2, l2, "layer norm weight")?;
        let b = contiguous_f32(s3, l3, "layer norm bias")?;
        let c = w.len();
        let out = for_rows(x.len() / c, c, |r, o| rowops::layer_norm(&x[r * c..(r + 1) * c], w, b, self.eps, o));
        Ok((CpuStorage::F32(out), l1.shape().clone()))
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
        let out = cuda::layer_norm((s1, l1), (s2, l2), (s3, l3), self.eps)?;
        Ok((out, l1.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _b: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let packed = x.apply_op3_no_bwd(w, &grad.contiguous()?, &LayerNormGrad { eps: self.eps })?; // (N + 2, C)
        let n = packed.dim(0)? - 2;
        let dx = packed.narrow(0, 0, n)?.reshape(x.shape())?;
        Ok((Some(dx), Some(packed.get(n)?), Some(packed.get(n + 1)?)))
    }
}

impl CustomOp3 for LayerNormGrad {
    fn name(&self) -> &'static str {
        "layer-norm-grad"
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
        let x = contiguous_f32(s1, l1, "layer norm input")?;
        let w = contiguous_f32(s2, l2, "layer norm weight")?;
        let dy = contiguous_f32(s3, l3, "layer norm output gradient")?;
        let c = w.len();
        let n = x.len() / c;
        let mut out = Vec::with_capacity((n + 2) * c);
        let dx = SharedOut::new(&mut out, n * c);
        let sums = reduce_rows(n, 2 * c, x.len(), |rows, partial| {
            let (dw, db) = partial.split_at_mut(c);
            let mut scratch = vec![0f32; 2 * c];
            for r in rows {
                let range = r * c..(r + 1) * c;
                // SAFETY: rows are disjoint across blocks.
                let dx = unsafe { dx.range(range.clone()) };
                rowops::layer_norm_grad(&x[range.clone()], w, &dy[range], self.eps, dx, dw, db, &mut scratch);
            }
        });
        // SAFETY: every dx row was written above.
        unsafe { out.set_len(n * c) };
        out.extend_from_slice(&sums);
        Ok((CpuStorage::F32(out), Shape::from((n + 2, c))))
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
        let c = l2.shape().elem_count();
        let n = l1.shape().elem_count() / c;
        let out = cuda::layer_norm_grad((s1, l1), (s2, l2), (s3, l3), self.eps)?;
        Ok((out, Shape::from((n + 2, c))))
    }
}

/// LayerNorm of `x` (.., C) with `weight` and `bias` (C,) of its dtype: f32 on the CPU, or
/// f32/bf16/f16 on a GPU (the `cuda` launchers below).
pub fn layer_norm(x: &Tensor, weight: &Tensor, bias: &Tensor, eps: f64) -> Result<Tensor> {
    x.contiguous()?.apply_op3(&weight.contiguous()?, &bias.contiguous()?, LayerNorm { eps: eps as f32 })
}

/// The launchers of the CUDA kernels (`cuda_fwd` above calls them).
#[cfg(feature = "cuda")]
pub mod cuda {
    use crate::kernels::cuda::{
        column_sums_split, elementwise_unstrided, for_float_dtype, packed_rows, packed_rows_on, ptx, view, warp_per_row,
    };
    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
    use candle_core::cuda_backend::WrapErr;
    use candle_core::{CudaStorage, Layout, Result};

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
            let func =
                dev.get_or_load_custom_func(&format!("layer_norm_{suffix}"), "rlhf_layer_norm", ptx::LAYER_NORM)?;
            let mut launch = func.builder();
            let (rows64, c32, packed) = (rows as u64, c as u32, packed_rows(c, PACKED_MOST));
            launch.arg(src).arg(&w).arg(&b).arg(&out).arg(&rows64).arg(&c32).arg(&eps).arg(&packed);
            // SAFETY: the arguments match the kernel's signature.
            unsafe { launch.launch(warp_per_row(rows)) }.w().map(|_| out)
        }))
    }

    /// The widest row the packed kernels hold in registers (layer_norm.cu's 32 x 8 x PACKS_PER_LANE).
    const PACKED_MOST: usize = 1024;

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
            let (rows64, c32, packed) = (rows as u64, c as u32, packed_rows(c, PACKED_MOST));
            launch.arg(src).arg(&w).arg(&dy).arg(&out).arg(&partial).arg(&rows64).arg(&c32).arg(&eps).arg(&packed);
            let cfg = LaunchConfig {
                grid_dim: (blocks as u32, 1, 1),
                block_dim: (32 * warps as u32, 1, 1),
                shared_mem_bytes: (warps * 2 * c * std::mem::size_of::<f32>()) as u32,
            };
            // SAFETY: the arguments match the kernel's signature; shared memory holds 2C floats a warp.
            unsafe { launch.launch(cfg) }.w()?;
            // The packed kernels' switch also picks the column sums' second pass: a block of
            // warps for 32 columns (common.cuh's COLUMN_SUMS_SPLIT), or a thread a column.
            let (sums_name, sums_cfg) = if packed_rows_on() {
                ("column_sums_split", column_sums_split(2 * c))
            } else {
                ("column_sums", elementwise_unstrided(2 * c))
            };
            let sums =
                dev.get_or_load_custom_func(&format!("{sums_name}_{suffix}"), "rlhf_layer_norm", ptx::LAYER_NORM)?;
            let mut dw_db = out.slice_mut(rows * c..);
            let mut launch = sums.builder();
            let (blocks32, width) = (blocks as u32, 2 * c as u32);
            launch.arg(&partial).arg(&mut dw_db).arg(&blocks32).arg(&width);
            // SAFETY: the arguments match the kernel's signature.
            unsafe { launch.launch(sums_cfg) }.w()?;
            Ok::<_, candle_core::Error>(out)
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::ops;
    use crate::kernels::ops::test_support::*;

    #[test]
    fn fused_layer_norm_matches_the_reference_for_input_weight_and_bias() -> Result<()> {
        let ln = |t: &[Tensor]| layer_norm(&t[0], &t[1], &t[2], 1e-5);
        let ln_reference = |t: &[Tensor]| ops::layer_norm_reference(&t[0], &t[1], &t[2], 1e-5);
        // Large enough (rows x 96) to run on the thread pool and reduce over several blocks.
        for rows in [3, 700] {
            let x = (randn(0f32, 2.0, (rows, 96), &dev())? + 0.5)?;
            let w = randn(1f32, 0.3, 96, &dev())?;
            let b = randn(0f32, 0.3, 96, &dev())?;
            compare(&[x.clone(), w.clone(), b.clone()], ln, ln_reference, 1e-5, 1e-4)?;
            for which in 0..3 {
                finite_differences(&[x.clone(), w.clone(), b.clone()], which, ln, 2e-3)?;
            }
        }
        // (B, T, C) input.
        let x = randn(0f32, 1.0, (2, 5, 16), &dev())?;
        let (w, b) = (randn(1f32, 0.3, 16, &dev())?, randn(0f32, 0.3, 16, &dev())?);
        compare(&[x, w, b], ln, ln_reference, 1e-5, 1e-4)
    }
}

/// On a GPU against the CPU (the CUDA build's unit tests, which `scripts/gpu-check.sh` runs from
/// the package); without one they pass after saying so on stderr.
#[cfg(test)]
#[cfg(feature = "cuda")]
mod cuda_tests {
    use crate::kernels::ops::test_support::*;
    use crate::kernels::ops::{layer_norm, layer_norm_reference};
    use candle_core::{DType, Device, Result, Tensor};

    #[test]
    #[ignore = "needs a GPU: scripts/gpu-check.sh runs it (cargo test --features cuda -- --include-ignored)"]
    fn layer_norm_and_its_gradients_match_the_cpu_and_are_deterministic() -> Result<()> {
        let gpu = gpu();
        let was_on = crate::kernels::cuda::packed_rows_on();
        // Both kernels: packed, C = 200 and 768 take the Pack8 path (a multiple of 8 up to 1024: 25
        // and 96 Pack8s, some lanes without a last one), 201 (not a multiple of 32 either) and 1600
        // the value-at-a-time one, as every C does unpacked. 2100 rows: more than backward blocks.
        for (packed, c, rows) in [200, 201, 768, 1600]
            .into_iter()
            .zip([700, 700, 300, 100])
            .flat_map(|(c, rows)| [(false, c, rows), (true, c, rows)])
        {
            crate::kernels::cuda::set_packed_rows(packed);
            let x = Tensor::randn(0f32, 1f32, (3, rows, c), &Device::Cpu)?.affine(2.0, 0.5)?;
            let w = Tensor::randn(1f32, 0.2, c, &Device::Cpu)?;
            let b = Tensor::randn(0f32, 0.2, c, &Device::Cpu)?;
            let ln = |t: &[Tensor]| layer_norm(&t[0], &t[1], &t[2], 1e-5);
            let (y_cpu, g_cpu) = value_and_grads(&[&x, &w, &b], &Device::Cpu, ln)?;
            let (y_gpu, g_gpu) = value_and_grads(&[&x, &w, &b], &gpu, ln)?;
            assert!(max_diff(&y_gpu, &y_cpu)? < 1e-5, "C {c} packed {packed} output {}", max_diff(&y_gpu, &y_cpu)?);
            for (name, gc, gg) in
                [("dx", &g_cpu[0], &g_gpu[0]), ("dw", &g_cpu[1], &g_gpu[1]), ("db", &g_cpu[2], &g_gpu[2])]
            {
                let scale = largest(gc)?;
                let diff = max_diff(gg, gc)?;
                assert!(diff <= 1e-5 * scale.max(1.0), "C {c} packed {packed} {name}: {diff} (largest {scale})");
            }
            let (_, again) = value_and_grads(&[&x, &w, &b], &gpu, ln)?;
            assert_eq!(max_diff(&again[1], &g_gpu[1])?, 0.0, "C {c} packed {packed}: dw differs between two runs");
            // Half precision against the composed reference in that dtype (which rounds more often).
            for dtype in [DType::BF16, DType::F16] {
                let (xh, wh, bh) = (x.to_dtype(dtype)?, w.to_dtype(dtype)?, b.to_dtype(dtype)?);
                let want = layer_norm_reference(&xh, &wh, &bh, 1e-5)?;
                let got = layer_norm(&xh.to_device(&gpu)?, &wh.to_device(&gpu)?, &bh.to_device(&gpu)?, 1e-5)?;
                let tol = if dtype == DType::BF16 { 0.1 } else { 0.01 };
                assert!(max_diff(&got, &want)? <= tol, "C {c} packed {packed} {dtype:?} {}", max_diff(&got, &want)?);
                // The backward in half precision against the f32 kernel's on the same inputs: the
                // output gradient (the fixed weights) and each result rounded to the dtype, a few of
                // its ulps (2^-8 bf16, 2^-11 f16) of the largest.
                let up = |t: &Tensor| t.to_dtype(DType::F32);
                let (_, g_half) = value_and_grads(&[&xh, &wh, &bh], &gpu, ln)?;
                let (_, g_f32) = value_and_grads(&[&up(&xh)?, &up(&wh)?, &up(&bh)?], &gpu, ln)?;
                let ulps = if dtype == DType::BF16 { 0.03 } else { 0.004 };
                for (name, gh, gf) in [("dx", &g_half[0], &g_f32[0]), ("dw", &g_half[1], &g_f32[1])] {
                    let (scale, diff) = (largest(gf)?, max_diff(gh, gf)?);
                    assert!(diff <= ulps * scale, "C {c} packed {packed} {dtype:?} {name}: {diff} (largest {scale})");
                }
            }
        }
        crate::kernels::cuda::set_packed_rows(was_on);
        Ok(())
    }
}
