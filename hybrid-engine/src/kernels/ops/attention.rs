//! Self-attention's core on c_attn's packed q, k, v with its backward: on the CPU per (batch,
//! head) strided gemms with the masked softmax and the dropout in between, nothing (B, NH, T, T)
//! kept (backward recomputes the probabilities); on a GPU in bf16 or f16 with heads of 64 the
//! flash-style kernels (cuda/flash_attention.cu).

use crate::kernels::dropout::DropoutMask;
use crate::kernels::parallel::{gemm_f32, par_rows, SharedOut};
use crate::kernels::rowops;
use crate::storage::contiguous_f32;
use candle_core::{CpuStorage, CustomOp2, CustomOp3, Layout, Result, Shape, Tensor};

/// Self-attention's core on the packed projections of `c_attn`: qkv (B, T, 3C) (q, k, v of C
/// columns each, head h at columns h*HD..(h+1)*HD of each) and the additive mask bias (B or 1,
/// 1, T, T) give y (B, T, C), the heads' outputs side by side:
/// `y_h = dropout(softmax(q_h k_h^T * scale + bias)) v_h`.
///
/// One (batch, head) pair per unit of parallel work, its gemms single-threaded and reading the
/// heads in place through strides (no split or merge copies). Nothing (B, NH, T, T) is kept:
/// backward recomputes the probabilities (one more q k^T gemm, small beside the projections),
/// and the dropout mask is regenerated from its key. Dropout's element indices are those of
/// the (B, NH, T, T) probabilities, so the mask equals the composed reference's. On a GPU, for
/// bf16 and f16 with heads of 64, the flash-style kernels (the `cuda` launchers below) compute the same;
/// their forward leaves the softmax's row statistics and the mask's tile map here for backward,
/// which then skips the pass over the keys that would recompute the one and the kernels that
/// would remake the other.
struct Attention {
    heads: usize,
    scale: f32,
    dropout: Option<DropoutMask>,
    #[cfg(feature = "cuda")]
    saved: std::sync::Mutex<Option<std::sync::Arc<cuda::AttentionSaved>>>,
}

/// Gradient of [`Attention`] for (qkv, bias, dy): dqkv (B, T, 3C). The GPU kernels also read the
/// forward's output `y` and what it saved (the row statistics and the mask's tile map), and the
/// mask transposed in its last two dimensions, `bias_t`.
struct AttentionGrad {
    heads: usize,
    scale: f32,
    dropout: Option<DropoutMask>,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    y: Tensor,
    #[cfg(feature = "cuda")]
    saved: Option<std::sync::Arc<cuda::AttentionSaved>>,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    bias_t: Option<Tensor>,
}

/// Shapes of one attention call and where a (batch, head) pair's matrices live.
#[derive(Clone, Copy)]
struct AttentionDims {
    t: usize,
    c: usize,
    hd: usize,
    heads: usize,
    bias_rows: usize,
}

impl AttentionDims {
    fn new(qkv: &Layout, bias: &Layout, heads: usize) -> Result<Self> {
        let (_, t, c3) = qkv.shape().dims3()?;
        let (bias_rows, _, bt, bs) = bias.shape().dims4()?;
        if bt != t || bs != t || c3 % (3 * heads) != 0 {
            candle_core::bail!("attention: qkv {:?} and bias {:?} do not fit {heads} heads", qkv.dims(), bias.dims());
        }
        Ok(Self { t, c: c3 / 3, hd: c3 / 3 / heads, heads, bias_rows })
    }

    /// Offset of head `h`'s `part` (0 q, 1 k, 2 v) of batch row `b` in qkv; row stride 3C.
    fn qkv(&self, b: usize, h: usize, part: usize) -> usize {
        b * self.t * 3 * self.c + part * self.c + h * self.hd
    }

    /// The (T, T) mask of batch row `b`.
    fn bias<'a>(&self, bias: &'a [f32], b: usize) -> &'a [f32] {
        let r = if self.bias_rows == 1 { 0 } else { b };
        &bias[r * self.t * self.t..(r + 1) * self.t * self.t]
    }

    /// The probabilities `softmax(q k^T * scale + bias)` of pair (b, h) into `p` (T, T).
    fn probabilities(&self, qkv: &[f32], bias: &[f32], b: usize, h: usize, scale: f32, p: &mut [f32]) {
        let (t, c3) = (self.t, 3 * self.c);
        // SAFETY: q and k are (T, HD) blocks of qkv with row stride 3C; p is (T, T).
        unsafe {
            gemm_f32(
                (t, t, self.hd),
                p.as_mut_ptr(),
                t,
                qkv[self.qkv(b, h, 0)..].as_ptr(),
                (c3, 1),
                qkv[self.qkv(b, h, 1)..].as_ptr(),
                (1, c3), // k^T
                false,
                1,
            )
        };
        let bias = self.bias(bias, b);
        for (row, bias) in p.chunks_exact_mut(t).zip(bias.chunks_exact(t)) {
            rowops::masked_softmax_in_place(row, bias, scale);
        }
    }

    /// Element index of (b, h, i, 0) in the (B, NH, T, T) probabilities (dropout's counter).
    fn prob_index(&self, b: usize, h: usize) -> usize {
        (b * self.heads + h) * self.t * self.t
    }
}

impl CustomOp2 for Attention {
    fn name(&self) -> &'static str {
        "attention"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        let qkv = contiguous_f32(s1, l1, "qkv")?;
        let bias = contiguous_f32(s2, l2, "attention bias")?;
        let d = AttentionDims::new(l1, l2, self.heads)?;
        let batch = l1.dims()[0];
        let (t, c) = (d.t, d.c);
        let mut out = Vec::new();
        let y = SharedOut::new(&mut out, batch * t * c);
        par_rows(batch * d.heads, batch * d.heads * t * t * d.hd, |pairs| {
            let mut p = vec![0f32; t * t];
            for pair in pairs {
                let (b, h) = (pair / d.heads, pair % d.heads);
                d.probabilities(qkv, bias, b, h, self.scale, &mut p);
                if let Some(mask) = &self.dropout {
                    mask.apply_in_place(d.prob_index(b, h), &mut p);
                }
                // SAFETY: pair (b, h) alone writes columns h*HD.. of batch row b's (T, C) block.
                unsafe {
                    gemm_f32(
                        (t, d.hd, t),
                        y.at(b * t * c + h * d.hd),
                        c,
                        p.as_ptr(),
                        (t, 1),
                        qkv[d.qkv(b, h, 2)..].as_ptr(),
                        (3 * c, 1),
                        false,
                        1,
                    )
                };
            }
        });
        // SAFETY: the pairs cover every (row, column) of y.
        unsafe { out.set_len(batch * t * c) };
        Ok((CpuStorage::F32(out), Shape::from((batch, t, c))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (y, saved) = cuda::attention((s1, l1), (s2, l2), self.heads, self.scale, self.dropout)?;
        *self
            .saved
            .lock()
            .map_err(|_| candle_core::Error::Msg("the attention's saved state lock poisoned".into()))? =
            Some(std::sync::Arc::new(saved));
        let (b, t, c3) = l1.shape().dims3()?;
        Ok((y, Shape::from((b, t, c3 / 3))))
    }

    fn bwd(&self, qkv: &Tensor, bias: &Tensor, y: &Tensor, grad: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let mut grad = grad.contiguous()?;
        let bias_t = match qkv.device().is_cuda() {
            true => {
                // The kernels' vector loads want dy on a 16-byte boundary.
                if !grad.layout().start_offset().is_multiple_of(8) {
                    grad = grad.copy()?;
                }
                Some(bias.transpose(2, 3)?.contiguous()?)
            }
            false => None,
        };
        let op = AttentionGrad {
            heads: self.heads,
            scale: self.scale,
            dropout: self.dropout,
            y: y.clone(),
            #[cfg(feature = "cuda")]
            saved: self
                .saved
                .lock()
                .map_err(|_| candle_core::Error::Msg("the attention's saved state lock poisoned".into()))?
                .clone(),
            bias_t,
        };
        Ok((Some(qkv.apply_op3_no_bwd(bias, &grad, &op)?), None))
    }
}

impl CustomOp3 for AttentionGrad {
    fn name(&self) -> &'static str {
        "attention-grad"
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
        let qkv = contiguous_f32(s1, l1, "qkv")?;
        let bias = contiguous_f32(s2, l2, "attention bias")?;
        let dy = contiguous_f32(s3, l3, "attention output gradient")?;
        let d = AttentionDims::new(l1, l2, self.heads)?;
        let batch = l1.dims()[0];
        let (t, c, hd) = (d.t, d.c, d.hd);
        let c3 = 3 * c;
        let mut out = Vec::new();
        let dqkv = SharedOut::new(&mut out, qkv.len());
        par_rows(batch * d.heads, batch * d.heads * t * t * hd, |pairs| {
            let (mut p, mut pd, mut dp) = (vec![0f32; t * t], vec![0f32; t * t], vec![0f32; t * t]);
            for pair in pairs {
                let (b, h) = (pair / d.heads, pair % d.heads);
                d.probabilities(qkv, bias, b, h, self.scale, &mut p);
                let kept: &[f32] = match &self.dropout {
                    Some(mask) => {
                        pd.copy_from_slice(&p);
                        mask.apply_in_place(d.prob_index(b, h), &mut pd);
                        &pd
                    }
                    None => &p,
                };
                let dy_bh = dy[b * t * c + h * hd..].as_ptr(); // (T, HD), row stride C
                                                               // SAFETY (all gemms below): pair (b, h) alone writes columns h*HD.. of the q, k
                                                               // and v parts of batch row b's (T, 3C) block of dqkv; reads are within qkv, dy
                                                               // and the (T, T) scratch buffers.
                unsafe {
                    // dv = kept^T dy
                    gemm_f32((t, hd, t), dqkv.at(d.qkv(b, h, 2)), c3, kept.as_ptr(), (1, t), dy_bh, (c, 1), false, 1);
                    // d(kept) = dy v^T
                    gemm_f32(
                        (t, t, hd),
                        dp.as_mut_ptr(),
                        t,
                        dy_bh,
                        (c, 1),
                        qkv[d.qkv(b, h, 2)..].as_ptr(),
                        (1, c3),
                        false,
                        1,
                    );
                }
                if let Some(mask) = &self.dropout {
                    mask.apply_in_place(d.prob_index(b, h), &mut dp);
                }
                // dS = scale * p * (dp - rowsum(dp * p))
                for (dp, p) in dp.chunks_exact_mut(t).zip(p.chunks_exact(t)) {
                    rowops::masked_softmax_grad_in_place(p, dp, self.scale);
                }
                unsafe {
                    // dq = dS k
                    gemm_f32(
                        (t, hd, t),
                        dqkv.at(d.qkv(b, h, 0)),
                        c3,
                        dp.as_ptr(),
                        (t, 1),
                        qkv[d.qkv(b, h, 1)..].as_ptr(),
                        (c3, 1),
                        false,
                        1,
                    );
                    // dk = dS^T q
                    gemm_f32(
                        (t, hd, t),
                        dqkv.at(d.qkv(b, h, 1)),
                        c3,
                        dp.as_ptr(),
                        (1, t),
                        qkv[d.qkv(b, h, 0)..].as_ptr(),
                        (c3, 1),
                        false,
                        1,
                    );
                }
            }
        });
        // SAFETY: the pairs cover every (row, column) of dqkv.
        unsafe { out.set_len(qkv.len()) };
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
        let (Some(bias_t), Some(saved)) = (&self.bias_t, &self.saved) else {
            candle_core::bail!("attention backward on CUDA needs the transposed bias and the forward's statistics");
        };
        let dqkv = crate::kernels::cuda::with_cuda_operands(&[&self.y, bias_t], |held| {
            let (y, bias_t) = (held[0], held[1]);
            cuda::attention_grad((s1, l1), (s2, l2), bias_t, y, saved, (s3, l3), self.heads, self.scale, self.dropout)
        })?;
        Ok((dqkv, l1.shape().clone()))
    }
}

/// Self-attention's core for `qkv` (B, T, 3C) and a constant f32 mask `bias` (B or 1, 1, T, T):
/// (B, T, C), f32 on the CPU or bf16/f16 with heads of 64 on a GPU. See [`Attention`].
pub fn attention(
    qkv: &Tensor,
    bias: &Tensor,
    heads: usize,
    scale: f64,
    dropout: Option<DropoutMask>,
) -> Result<Tensor> {
    let op = Attention {
        heads,
        scale: scale as f32,
        dropout,
        #[cfg(feature = "cuda")]
        saved: Default::default(),
    };
    qkv.contiguous()?.apply_op2(&bias.contiguous()?, op)
}

/// The launchers of the CUDA kernels (`cuda_fwd` above calls them).
#[cfg(feature = "cuda")]
pub mod cuda {
    use crate::kernels::cuda::{for_float_dtype, ptx, view};
    use crate::kernels::dropout::DropoutMask;
    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaView, LaunchConfig, PushKernelArg};
    use candle_core::cuda_backend::CudaDType;
    use candle_core::cuda_backend::WrapErr;
    use candle_core::{CudaStorage, DType, Layout, Result};

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
    fn attention_dims(lq: &Layout, lb: &Layout, heads: usize) -> Result<(usize, usize, usize, usize)> {
        let (b, t, c3) = lq.shape().dims3()?;
        let (bias_batches, _, bt, bs) = lb.shape().dims4()?;
        if c3 != 3 * heads * ATTENTION_HEAD_DIM || bt != t || bs != t || (bias_batches != 1 && bias_batches != b) {
            candle_core::bail!(
                "flash attention on CUDA: qkv {:?} and bias {:?} do not fit {heads} heads of {ATTENTION_HEAD_DIM}",
                lq.dims(),
                lb.dims()
            );
        }
        Ok((b, t, heads, bias_batches))
    }

    /// A block of four warps per 64 rows of each (batch, head) pair.
    fn attention_grid(b: usize, t: usize, heads: usize) -> LaunchConfig {
        LaunchConfig {
            grid_dim: (t.div_ceil(ATTENTION_TILE) as u32, (b * heads) as u32, 1),
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
    pub(super) fn attention_tile_liveness(
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
        let config = LaunchConfig {
            grid_dim: (tiles32, bb32, 1),
            block_dim: (ATTENTION_TILE as u32, 1, 1),
            shared_mem_bytes: 0,
        };
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
        heads: usize,
        scale: f32,
        dropout: Option<DropoutMask>,
    ) -> Result<(CudaStorage, AttentionSaved)> {
        half_precision_only(qkv, "flash attention")?;
        check_aligned(&[lq])?;
        let (b, t, nh, bias_batches) = attention_dims(lq, lb, heads)?;
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
        heads: usize,
        scale: f32,
        dropout: Option<DropoutMask>,
    ) -> Result<CudaStorage> {
        half_precision_only(qkv, "flash attention backward")?;
        check_aligned(&[lq, ly, ldy])?;
        let (b, t, nh, bias_batches) = attention_dims(lq, lb, heads)?;
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
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::ops;
    use crate::kernels::ops::test_support::*;

    #[test]
    fn fused_attention_matches_the_reference_with_and_without_dropout() -> Result<()> {
        let (b, t, nh, hd) = (2, 40, 3, 8);
        let qkv = randn(0f32, 1.0, (b, t, 3 * nh * hd), &dev())?;
        let key = ops::DropoutKey { seed: 1, step: 2, micro_batch: 3 };
        for (bias, drop) in [(causal_bias(b, t, &[7, 0])?, None), (causal_bias(1, t, &[0])?, Some(key.mask(0.2, 1, 0)))]
        {
            let f = |x: &[Tensor]| attention(&x[0], &bias, nh, 0.3, drop);
            let reference = |x: &[Tensor]| ops::attention_reference(&x[0], &bias, nh, 0.3, drop);
            compare(std::slice::from_ref(&qkv), f, reference, 1e-5, 1e-5)?;
        }
        // Finite differences in f32 need few outputs to stay above rounding noise.
        let qkv = randn(0f32, 1.0, (1, 5, 3 * 2 * 4), &dev())?;
        let bias = causal_bias(1, 5, &[0])?;
        finite_differences(&[qkv], 0, |x| attention(&x[0], &bias, 2, 0.5, None), 2e-3)
    }
}

/// On a GPU against the CPU (the CUDA build's unit tests, which `scripts/gpu-check.sh` runs from
/// the package); without one they pass after saying so on stderr.
#[cfg(test)]
#[cfg(feature = "cuda")]
mod cuda_tests {
    use crate::kernels::ops::test_support::*;
    use crate::kernels::ops::{attention, attention_reference, DropoutKey};
    use candle_core::{DType, Device, Result, Tensor};

    #[test]
    #[ignore = "needs a GPU: scripts/gpu-check.sh runs it (cargo test --features cuda -- --include-ignored)"]
    fn flash_attention_and_its_gradient_match_the_cpu_and_are_deterministic() -> Result<()> {
        let gpu = gpu();
        // Two heads of 64; T = 100 is one full tile of 64 and a partial one, T = 300 five tiles
        // (the one-pass forward rescales its rows as their max moves). The per-batch mask pads
        // batch row 1 on the left by 5, so its first 5 queries see no key at all (a softmax over
        // masked scores only: uniform over the T keys).
        let dev = gpu.as_cuda_device()?;
        eprintln!(
            "attention kernels' blocks an SM (forward, dq, dk/dv): {:?}",
            super::cuda::attention_blocks_per_sm(dev, DType::BF16)?
        );
        let nh = 2;
        let c = nh * super::cuda::ATTENTION_HEAD_DIM;
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
    #[ignore = "needs a GPU: scripts/gpu-check.sh runs it (cargo test --features cuda -- --include-ignored)"]
    fn attention_tile_liveness_marks_masked_plain_and_dead_row_tiles() -> Result<()> {
        let gpu = gpu();
        let dev = gpu.as_cuda_device()?;
        for t in [100, 300] {
            let (per_batch, _) = causal_masks(2, t)?;
            let on_gpu = per_batch.to_device(&gpu)?;
            let (storage, layout) = on_gpu.storage_and_layout();
            let candle_core::Storage::Cuda(storage) = &*storage else { candle_core::bail!("not on the GPU") };
            let bias = crate::kernels::cuda::view::<f32>(storage, layout, "the attention bias")?;
            let got = dev.clone_dtoh(&super::cuda::attention_tile_liveness(dev, &bias, 2, t)?)?;
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
}
