//! A decoding step's ops on a GPU (generation; no gradient): the KV cache's append from c_attn's
//! output and the attention over the cache (cuda/decode_attention.cu, c_attn's bias added there
//! when given apart), and the fused epilogues of cuda/decode_layer.cu: c_proj's bias + the
//! residual + the next LayerNorm, the embeddings + ln_1, c_fc's bias + GELU. The CPU's
//! generation keeps the split heads and `kernels::decode`'s kernels; these ops' CPU forwards
//! (`cpu` below, f32) are their reference and run a decoding step at a position in memory on
//! the CPU (generation/decode_graph.rs's bookkeeping, tested without a GPU).

use crate::storage::{contiguous_f32, contiguous_f32_mut, contiguous_u32};
use candle_core::{CpuStorage, CustomOp2, CustomOp3, Layout, Result, Shape, Tensor};

/// How many positions a KV cache holds before a decoding step's new tokens: a number the host
/// knows, or a u32 on the device (a step captured as a CUDA graph, which serves every position:
/// generation/decode_graph.rs), read there by the kernels.
#[derive(Clone, Debug)]
pub enum CacheStart {
    Host(usize),
    /// (1,) u32 on the GPU.
    Device(Tensor),
}

impl From<usize> for CacheStart {
    fn from(start: usize) -> Self {
        Self::Host(start)
    }
}

impl CacheStart {
    /// The host's number (0 for the device's: the kernels read theirs).
    fn on_host(&self) -> usize {
        match self {
            Self::Host(start) => *start,
            Self::Device(_) => 0,
        }
    }

    /// The device's u32, if that is where it is.
    fn on_device(&self) -> Option<&Tensor> {
        match self {
            Self::Host(_) => None,
            Self::Device(t) => Some(t),
        }
    }
}

/// A decoding step's shape, what both backends' kernels take: B rows of T new tokens, NH heads
/// of HD values, a KV cache of `capacity` positions.
#[derive(Clone, Copy, Debug)]
struct StepShape {
    b: usize,
    t: usize,
    heads: usize,
    head_dim: usize,
    capacity: usize,
}

impl StepShape {
    /// From c_attn's output (B, T, 3C) and the cache (2, B, NH, capacity, HD).
    fn of(lq: &Layout, lkv: &Layout, heads: usize) -> Result<Self> {
        let (b, t, c3) = lq.shape().dims3()?;
        let (two, kb, nh, capacity, head_dim) = lkv.shape().dims5()?;
        if two != 2 || kb != b || nh != heads || c3 != 3 * nh * head_dim {
            candle_core::bail!("a decoding step's qkv {:?} and a cache {:?} of {heads} heads", lq.dims(), lkv.dims());
        }
        Ok(Self { b, t, heads, head_dim, capacity })
    }

    fn c(&self) -> usize {
        self.heads * self.head_dim
    }

    /// Where value d of head h of row bi at position j of keys (`which` 0) or values (1) sits.
    fn at(&self, which: usize, bi: usize, h: usize, j: usize, d: usize) -> usize {
        (((which * self.b + bi) * self.heads + h) * self.capacity + j) * self.head_dim + d
    }
}

/// The start as a number: the host's, or read from the u32 in memory (a CPU tensor).
fn start_on_cpu(start: &CacheStart) -> Result<usize> {
    match start.on_device() {
        Some(t) => Ok(t.flatten_all()?.to_vec1::<u32>()?.first().copied().unwrap_or(0) as usize),
        None => Ok(start.on_host()),
    }
}

/// Runs `f` with the f32 values of `tensors`, contiguous in host memory, read-locked meanwhile:
/// the operands a CPU forward holds beside its arguments.
fn with_cpu_operands<R>(tensors: &[&Tensor], f: impl FnOnce(&[&[f32]]) -> Result<R>) -> Result<R> {
    let locked: Vec<_> = tensors.iter().map(|t| t.storage_and_layout()).collect();
    let values = locked
        .iter()
        .map(|(storage, layout)| match &**storage {
            candle_core::Storage::Cpu(s) => contiguous_f32(s, layout, "a decoding op's operand"),
            _ => candle_core::bail!("an operand of a CPU op is not in host memory"),
        })
        .collect::<Result<Vec<_>>>()?;
    f(&values)
}

/// Runs `f` with the CUDA storages of an op's optional operands `bias` (c_attn's) and the
/// device's cache length in `start`, each `None` where absent.
#[cfg(feature = "cuda")]
fn with_bias_and_start<R>(
    bias: Option<&Tensor>,
    start: &CacheStart,
    f: impl FnOnce(Option<(&candle_core::CudaStorage, &Layout)>, Option<(&candle_core::CudaStorage, &Layout)>) -> Result<R>,
) -> Result<R> {
    let operands: Vec<&Tensor> = bias.into_iter().chain(start.on_device()).collect();
    crate::kernels::cuda::with_cuda_operands(&operands, |v| {
        let mut v = v.iter().copied();
        let bias = bias.and_then(|_| v.next());
        let start = start.on_device().and_then(|_| v.next());
        f(bias, start)
    })
}

/// Writes the new tokens' keys and values of c_attn's output into a KV cache buffer in place.
struct KvCacheAppend {
    heads: usize,
    start: CacheStart,
    /// c_attn's bias, when the output is the gemm's alone.
    qkv_bias: Option<Tensor>,
}

impl candle_core::InplaceOp2 for KvCacheAppend {
    fn name(&self) -> &'static str {
        "kv-cache-append"
    }

    fn cpu_fwd(&self, kv: &mut CpuStorage, lkv: &Layout, qkv: &CpuStorage, lq: &Layout) -> Result<()> {
        let shape = StepShape::of(lq, lkv, self.heads)?;
        let start = start_on_cpu(&self.start)?;
        if start + shape.t > shape.capacity {
            candle_core::bail!(
                "KV cache overflow: {start} cached + {} new positions exceed {}",
                shape.t,
                shape.capacity
            );
        }
        let qkv = contiguous_f32(qkv, lq, "the decoding step's qkv")?;
        let kv = contiguous_f32_mut(kv, lkv, "the KV cache")?;
        with_cpu_operands(&self.qkv_bias.iter().collect::<Vec<_>>(), |bias| {
            cpu::kv_cache_append(kv, qkv, bias.first().copied(), shape, start);
            Ok(())
        })
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        kv: &mut candle_core::CudaStorage,
        lkv: &Layout,
        qkv: &candle_core::CudaStorage,
        lq: &Layout,
    ) -> Result<()> {
        with_bias_and_start(self.qkv_bias.as_ref(), &self.start, |bias, start_at| {
            cuda::kv_cache_append((kv, lkv), (qkv, lq), bias, self.heads, self.start.on_host(), start_at)
        })
    }
}

/// Writes the keys and values of `qkv` (B, T, 3C) into `kv` (2, B, NH, capacity, HD), keys then
/// values, at positions [start, start + T): one launch on a GPU. With `qkv_bias` (3C), c_attn's
/// bias is added to them first (`qkv` is then the gemm's output alone). With the start on the
/// device, the caller has made sure that start + T is within the capacity.
pub fn kv_cache_append(
    kv: &Tensor,
    qkv: &Tensor,
    qkv_bias: Option<&Tensor>,
    heads: usize,
    start: impl Into<CacheStart>,
) -> Result<()> {
    let qkv_bias = qkv_bias.map(Tensor::contiguous).transpose()?;
    kv.inplace_op2(&qkv.contiguous()?, &KvCacheAppend { heads, start: start.into(), qkv_bias })
}

/// Attention of the new tokens' queries over a KV cache buffer, from c_attn's output.
struct DecodeAttention {
    heads: usize,
    start: CacheStart,
    scale: f32,
    /// c_attn's bias, when the output is the gemm's alone.
    qkv_bias: Option<Tensor>,
}

impl CustomOp3 for DecodeAttention {
    fn name(&self) -> &'static str {
        "decode-attention"
    }

    fn cpu_fwd(
        &self,
        qkv: &CpuStorage,
        lq: &Layout,
        kv: &CpuStorage,
        lkv: &Layout,
        bias: &CpuStorage,
        lb: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let shape = StepShape::of(lq, lkv, self.heads)?;
        let start = start_on_cpu(&self.start)?;
        // The mask's rows: over the positions attended to, or over the whole capacity.
        let stride = match self.start.on_device() {
            Some(_) => shape.capacity,
            None => start + shape.t,
        };
        let (bias_batches, one, bt, bs) = lb.shape().dims4()?;
        let fits = (bias_batches == 1 || bias_batches == shape.b) && one == 1 && bt == shape.t && bs == stride;
        if !fits || start + shape.t > shape.capacity {
            candle_core::bail!("decode attention: a bias {:?} for {start} + {} positions", lb.dims(), shape.t);
        }
        let qkv = contiguous_f32(qkv, lq, "the decoding step's qkv")?;
        let kv = contiguous_f32(kv, lkv, "the KV cache")?;
        let mask = cpu::Mask {
            values: contiguous_f32(bias, lb, "the decoding step's bias")?,
            per_row: bias_batches > 1,
            stride,
        };
        let y = with_cpu_operands(&self.qkv_bias.iter().collect::<Vec<_>>(), |qkv_bias| {
            Ok(cpu::decode_attention(qkv, qkv_bias.first().copied(), kv, &mask, shape, start, self.scale))
        })?;
        Ok((CpuStorage::F32(y), Shape::from((shape.b, shape.t, shape.c()))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        qkv: &candle_core::CudaStorage,
        lq: &Layout,
        kv: &candle_core::CudaStorage,
        lkv: &Layout,
        bias: &candle_core::CudaStorage,
        lb: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let y = with_bias_and_start(self.qkv_bias.as_ref(), &self.start, |qkv_bias, start_at| {
            let (heads, start, scale) = (self.heads, (self.start.on_host(), start_at), self.scale);
            cuda::decode_attention((qkv, lq), qkv_bias, (kv, lkv), (bias, lb), heads, start, scale)
        })?;
        let (b, t, c3) = lq.shape().dims3()?;
        Ok((y, Shape::from((b, t, c3 / 3))))
    }
}

/// `softmax(q k^T * scale + bias) v` per head for the new tokens' queries in `qkv` (B, T, 3C)
/// over the first start + T positions of `kv` (2, B, NH, capacity, HD), where
/// [`kv_cache_append`] has put their own keys and values; bias (B or 1, 1, T, start + T) f32, or
/// with the start on the device (B or 1, 1, T, capacity), read up to start + T: (B, T, C). With
/// `qkv_bias` (3C), c_attn's bias is added to the queries first. No gradient (generation).
pub fn decode_attention(
    qkv: &Tensor,
    qkv_bias: Option<&Tensor>,
    kv: &Tensor,
    start: impl Into<CacheStart>,
    bias: &Tensor,
    heads: usize,
    scale: f64,
) -> Result<Tensor> {
    let qkv_bias = qkv_bias.map(Tensor::contiguous).transpose()?;
    let op = DecodeAttention { heads, start: start.into(), scale: scale as f32, qkv_bias };
    qkv.contiguous()?.apply_op3_no_bwd(kv, &bias.contiguous()?, &op)
}

/// A decoding step's launch that makes a new residual stream and a LayerNorm of it: (2, .., C).
enum ResidualThenLayerNorm {
    /// After c_proj's gemm y, on the residual stream x: c_proj's bias and the LayerNorm's weight
    /// and bias.
    AfterBias([Tensor; 3], f32),
    /// From u32 ids and positions: wte, wpe and ln_1's weight and bias.
    Embeddings([Tensor; 4], f32),
}

impl CustomOp2 for ResidualThenLayerNorm {
    fn name(&self) -> &'static str {
        "residual-then-layer-norm"
    }

    fn cpu_fwd(&self, a: &CpuStorage, la: &Layout, b: &CpuStorage, lb: &Layout) -> Result<(CpuStorage, Shape)> {
        let (out, rows) = match self {
            Self::AfterBias([bias, w, beta], eps) => {
                let (y, x) = (contiguous_f32(a, la, "c_proj's output")?, contiguous_f32(b, lb, "the residual")?);
                if la.dims() != lb.dims() {
                    candle_core::bail!("bias, residual and LayerNorm: y {:?}, x {:?}", la.dims(), lb.dims());
                }
                let out = with_cpu_operands(&[bias, w, beta], |v| {
                    cpu::bias_residual_layer_norm(y, x, [v[0], v[1], v[2]], *eps)
                })?;
                (out, la.dims().to_vec())
            }
            Self::Embeddings([wte, wpe, w, beta], eps) => {
                let (ids, positions) =
                    (contiguous_u32(a, la, "the token ids")?, contiguous_u32(b, lb, "the positions")?);
                let out = with_cpu_operands(&[wte, wpe, w, beta], |t| {
                    cpu::embed_layer_norm(ids, positions, [t[0], t[1]], [t[2], t[3]], *eps)
                })?;
                (out, [la.dims(), &[wte.dim(1)?]].concat())
            }
        };
        Ok((CpuStorage::F32(out), Shape::from([&[2], &rows[..]].concat())))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        a: &candle_core::CudaStorage,
        la: &Layout,
        b: &candle_core::CudaStorage,
        lb: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (out, rows) = match self {
            Self::AfterBias([bias, w, beta], eps) => {
                let out = crate::kernels::cuda::with_cuda_operands(&[bias, w, beta], |v| {
                    cuda::bias_residual_layer_norm((a, la), (b, lb), [v[0], v[1], v[2]], *eps)
                })?;
                (out, la.dims().to_vec())
            }
            Self::Embeddings([wte, wpe, w, beta], eps) => {
                let out = crate::kernels::cuda::with_cuda_operands(&[wte, wpe, w, beta], |t| {
                    cuda::embed_layer_norm((a, la), (b, lb), [t[0], t[1], t[2], t[3]], *eps)
                })?;
                (out, [la.dims(), &[wte.dim(1)?]].concat())
            }
        };
        Ok((out, Shape::from([&[2], &rows[..]].concat())))
    }
}

impl ResidualThenLayerNorm {
    /// (the new residual stream, its LayerNorm) from the op's two arguments.
    fn apply(self, a: &Tensor, b: &Tensor) -> Result<(Tensor, Tensor)> {
        let both = a.contiguous()?.apply_op2_no_bwd(&b.contiguous()?, &self)?;
        Ok((both.get(0)?, both.get(1)?))
    }
}

/// After c_proj's gemm `y` (.., C) without its bias `b`, on the residual stream `x` of y's shape:
/// the new residual `x + (y + b)` and its LayerNorm with `w`, `beta` (`eps`), in one launch on a
/// GPU, rounded as the bias add, the add and the LayerNorm kernels round. No gradient
/// (generation).
pub fn bias_residual_layer_norm(
    y: &Tensor,
    b: &Tensor,
    x: &Tensor,
    [w, beta]: [&Tensor; 2],
    eps: f64,
) -> Result<(Tensor, Tensor)> {
    let vectors = [b.contiguous()?, w.contiguous()?, beta.contiguous()?];
    ResidualThenLayerNorm::AfterBias(vectors, eps as f32).apply(y, x)
}

/// The embeddings `wte[ids] + wpe[positions]` of u32 `ids` and `positions` (B, T), and their
/// LayerNorm with `w`, `beta` (`eps`): ((B, T, C), (B, T, C)) in one launch on a GPU, rounded as
/// the lookups, the add and the LayerNorm kernel round. No gradient (generation).
pub fn embed_layer_norm(
    ids: &Tensor,
    positions: &Tensor,
    [wte, wpe]: [&Tensor; 2],
    [w, beta]: [&Tensor; 2],
    eps: f64,
) -> Result<(Tensor, Tensor)> {
    let tables = [wte.contiguous()?, wpe.contiguous()?, w.contiguous()?, beta.contiguous()?];
    ResidualThenLayerNorm::Embeddings(tables, eps as f32).apply(ids, positions)
}

/// `gelu_new(y + b)` after c_fc's gemm.
struct BiasGelu;

impl CustomOp2 for BiasGelu {
    fn name(&self) -> &'static str {
        "bias-gelu"
    }

    fn cpu_fwd(&self, y: &CpuStorage, ly: &Layout, b: &CpuStorage, lb: &Layout) -> Result<(CpuStorage, Shape)> {
        let (y_values, b_values) = (contiguous_f32(y, ly, "c_fc's output")?, contiguous_f32(b, lb, "c_fc's bias")?);
        if b_values.is_empty() || !y_values.len().is_multiple_of(b_values.len()) {
            candle_core::bail!("bias and GELU: y {:?}, bias {:?}", ly.dims(), lb.dims());
        }
        Ok((CpuStorage::F32(cpu::bias_gelu(y_values, b_values)), ly.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        y: &candle_core::CudaStorage,
        ly: &Layout,
        b: &candle_core::CudaStorage,
        lb: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        Ok((cuda::bias_gelu((y, ly), (b, lb))?, ly.shape().clone()))
    }
}

/// `gelu_new(y + b)` for c_fc's gemm output `y` (.., W) without its bias `b` (W): one launch on a
/// GPU, rounded as the bias add and the GELU kernels round. No gradient (generation).
pub fn bias_gelu(y: &Tensor, b: &Tensor) -> Result<Tensor> {
    y.contiguous()?.apply_op2_no_bwd(&b.contiguous()?, &BiasGelu)
}

/// What a decoding step captured as a CUDA graph reads and writes besides the model and its KV
/// cache (generation/decode_graph.rs), all on the GPU, in fixed buffers that every replay of the
/// graph finds where the capture left them.
pub struct DecodeState {
    /// (B, 1) u32: the next step's input tokens.
    pub ids: Tensor,
    /// (B, 1) u32: their positions.
    pub positions: Tensor,
    /// (B,) u32: 1 for a row that has emitted EOS.
    pub done: Tensor,
    /// (3,) u32: the positions cached before the next step, the step being made, the rows still
    /// running.
    pub state: Tensor,
    /// (steps, B) u32 and f32: each step's token and log-probability per row.
    pub tokens: Tensor,
    pub logprobs: Tensor,
    /// Sampling: (B,) f64, the uniform draws the next step's pick reads, and (steps, B) f64 every
    /// step's.
    pub draws: Option<(Tensor, Tensor)>,
}

/// The end of a decoding step on the device (cuda/decode_graph.cu, one launch): from the step's
/// `picks` (B, 2) f32 (`greedy_pick_in_place`, `sample_pick_in_place`), a finished row's token
/// replaced by `pad`, each row's token and log-probability recorded at the step, the rows that
/// emit `eos` marked done, the tokens made the next input one position further, the KV cache's
/// length after `p` prompt positions advanced, the next step's draws put in place, and the rows
/// still running counted: what generate.rs's loop does on the host between two steps.
pub fn advance_decoding(picks: &Tensor, s: &DecodeState, p: usize, pad: u32, eos: Option<u32>) -> Result<()> {
    let (b, two) = picks.dims2()?;
    let steps = s.tokens.dim(0)?;
    if two != 2 || s.tokens.dims() != [steps, b] || s.ids.elem_count() != b || s.state.dims() != [3] {
        candle_core::bail!("advancing decoding: picks {:?} for tokens {:?}", picks.dims(), s.tokens.dims());
    }
    if picks.device().is_cpu() {
        return advance_decoding_on_cpu(picks, s, [b, steps, p], pad, eos);
    }
    #[cfg(feature = "cuda")]
    {
        let fixed = [picks, &s.ids, &s.positions, &s.done, &s.state, &s.tokens, &s.logprobs];
        let draws = s.draws.iter().flat_map(|(now, all)| [now, all]);
        let operands: Vec<&Tensor> = fixed.into_iter().chain(draws).collect();
        let eos = eos.unwrap_or(u32::MAX);
        crate::kernels::cuda::with_cuda_operands(&operands, |v| cuda::advance_decoding(v, [b, steps, p], pad, eos))
    }
    #[cfg(not(feature = "cuda"))]
    candle_core::bail!("the picks are on a device this build has no kernels for")
}

/// [`advance_decoding`] of a state in host memory: read, advanced as the kernel does, written back.
fn advance_decoding_on_cpu(
    picks: &Tensor,
    s: &DecodeState,
    shape: [usize; 3],
    pad: u32,
    eos: Option<u32>,
) -> Result<()> {
    let u32s = |t: &Tensor| t.flatten_all()?.to_vec1::<u32>();
    let (mut ids, mut positions, mut done) = (u32s(&s.ids)?, u32s(&s.positions)?, u32s(&s.done)?);
    let (mut state, mut tokens) = (u32s(&s.state)?, u32s(&s.tokens)?);
    let mut logprobs = s.logprobs.flatten_all()?.to_vec1::<f32>()?;
    let mut draws = match &s.draws {
        Some((now, all)) => Some((now.to_vec1::<f64>()?, all.flatten_all()?.to_vec1::<f64>()?)),
        None => None,
    };
    let advance = cpu::Advance {
        ids: &mut ids,
        positions: &mut positions,
        done: &mut done,
        state: &mut state,
        tokens: &mut tokens,
        logprobs: &mut logprobs,
        draws: draws.as_mut().map(|(now, all)| (now.as_mut_slice(), all.as_slice())),
    };
    cpu::advance_decoding(&picks.flatten_all()?.to_vec1::<f32>()?, advance, shape, pad, eos);
    let write = |t: &Tensor, values: Tensor| t.slice_set(&values.reshape(t.shape())?, 0, 0);
    let device = picks.device();
    write(&s.ids, Tensor::new(ids, device)?)?;
    write(&s.positions, Tensor::new(positions, device)?)?;
    write(&s.done, Tensor::new(done, device)?)?;
    write(&s.state, Tensor::new(state, device)?)?;
    write(&s.tokens, Tensor::new(tokens, device)?)?;
    write(&s.logprobs, Tensor::new(logprobs, device)?)?;
    if let (Some((now, _)), Some((values, _))) = (&s.draws, draws) {
        write(now, Tensor::new(values, device)?)?;
    }
    Ok(())
}

/// The launchers of the CUDA kernels (`cuda_fwd` above calls them).
#[cfg(feature = "cuda")]
pub mod cuda {
    use crate::kernels::cuda::{elementwise, for_float_dtype, ptx, view, warp_per_row};
    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::driver::{CudaView, LaunchConfig, PushKernelArg};
    use candle_core::cuda_backend::CudaDType;
    use candle_core::cuda_backend::WrapErr;
    use candle_core::{CudaStorage, DType, Layout, Result};

    /// A decoding step's shape ([`super::StepShape`]) where cuda/decode_attention.cu takes it:
    /// heads of 32 to 128 values by 32, and room in the cache for `start` + T positions (an error
    /// naming what does not fit).
    fn decode_shape(lq: &Layout, lkv: &Layout, heads: usize, start: usize) -> Result<super::StepShape> {
        let shape = super::StepShape::of(lq, lkv, heads)?;
        let hd = shape.head_dim;
        if hd % 32 != 0 || hd > 128 || start + shape.t > shape.capacity {
            candle_core::bail!(
                "decode attention on CUDA: qkv {:?} and a cache {:?} of {heads} heads (of 32, 64, 96 or 128 values) with {start} + {} positions",
                lq.dims(),
                lkv.dims(),
                shape.t
            );
        }
        Ok(shape)
    }

    /// The kernels' shape arguments: B, T, NH, HD, capacity, start.
    fn shape_args(shape: &super::StepShape, start: usize) -> [u32; 6] {
        [shape.b, shape.t, shape.heads, shape.head_dim, shape.capacity, start].map(|v| v as u32)
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
    /// With `start_at` (a u32 on the device), the kernel reads the start there (`start` is then
    /// ignored; the caller has checked that every start it will hold leaves room for T).
    pub fn kv_cache_append(
        (kv, lkv): (&mut CudaStorage, &Layout),
        (qkv, lq): (&CudaStorage, &Layout),
        qkv_bias: Option<(&CudaStorage, &Layout)>,
        heads: usize,
        start: usize,
        start_at: Option<(&CudaStorage, &Layout)>,
    ) -> Result<()> {
        let shape = decode_shape(lq, lkv, heads, start)?;
        let start_at = start_at.map(|(s, l)| view::<u32>(s, l, "the KV cache's length")).transpose()?;
        let [b, t, nh, hd, cap, start] = shape_args(&shape, start);
        let n = 2 * shape.b * shape.t * shape.heads * shape.head_dim;
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
                match &start_at {
                    Some(at) => launch.arg(at),
                    None => launch.arg(&NULL),
                };
                // SAFETY: the arguments match the kernel's signature; it writes 2 B T C values of
                // the buffer, at positions the shape check (or the caller, for a start on the
                // device) keeps below its capacity.
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
    /// T, start + T) f32: (B, T, C), heads side by side (cuda/decode_attention.cu, one warp a row, a
    /// lane a key).
    /// With `qkv_bias`, c_attn's bias (3C) is added to the queries first. With the start on the
    /// device (`start`'s second half, a u32 there; the first is then ignored), `bias` is (B or 1,
    /// 1, T, capacity), read up to start + T.
    pub fn decode_attention(
        (qkv, lq): (&CudaStorage, &Layout),
        qkv_bias: Option<(&CudaStorage, &Layout)>,
        (kv, lkv): (&CudaStorage, &Layout),
        (bias, lb): (&CudaStorage, &Layout),
        heads: usize,
        (start, start_at): (usize, Option<(&CudaStorage, &Layout)>),
        scale: f32,
    ) -> Result<CudaStorage> {
        let shape = decode_shape(lq, lkv, heads, start)?;
        let start_at = start_at.map(|(s, l)| view::<u32>(s, l, "the KV cache's length")).transpose()?;
        // The bias's row: the positions attended to, or the whole capacity when the device says how many.
        let s = if start_at.is_some() { shape.capacity } else { start + shape.t };
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
        let [b, t, nh, hd, cap, _] = shape_args(&shape, start);
        let (s32, bb32) = (s as u32, bias_batches as u32);
        let rows = shape.b * shape.heads * shape.t;
        Ok(for_float_dtype!(qkv, lq, "decode attention", |src: Elem, suffix| {
            let dev = qkv.device();
            let cache = view::<Elem>(kv, lkv, "the KV cache")?;
            let qkv_bias = qkv_bias_view::<Elem>(qkv_bias, lq)?;
            // SAFETY: the kernel writes every head of every row.
            let y = unsafe { dev.alloc::<Elem>(shape.b * shape.t * shape.heads * shape.head_dim)? };
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
            match &start_at {
                Some(at) => launch.arg(at),
                None => launch.arg(&NULL),
            };
            launch.arg(&s32);
            // SAFETY: the arguments match the kernel's signature; it reads the first s positions
            // (start + T, at most the capacity, with the start on the device).
            unsafe { launch.launch(warp_per_row(rows)) }.w().map(|_| y)
        }))
    }

    /// cuda/decode_graph.cu's `decode_graph_advance` on [picks, ids, positions, done, state,
    /// tokens, logprobs, and with sampling draws and all_draws] (see `super::DecodeState`), for
    /// [B, steps, p]: one block.
    pub fn advance_decoding(
        operands: &[(&CudaStorage, &Layout)],
        [b, steps, p]: [usize; 3],
        pad: u32,
        eos: u32,
    ) -> Result<()> {
        let u32s = |i: usize, what: &str| view::<u32>(operands[i].0, operands[i].1, what);
        let picks = view::<f32>(operands[0].0, operands[0].1, "the picks")?;
        let (ids, positions, done) = (u32s(1, "the ids")?, u32s(2, "the positions")?, u32s(3, "the rows done")?);
        let (state, tokens) = (u32s(4, "the decoding state")?, u32s(5, "the tokens")?);
        let logprobs = view::<f32>(operands[6].0, operands[6].1, "the log-probabilities")?;
        let draws = match operands.len() {
            9 => Some((
                view::<f64>(operands[7].0, operands[7].1, "the draws")?,
                view::<f64>(operands[8].0, operands[8].1, "every step's draws")?,
            )),
            _ => None,
        };
        let dev = operands[0].0.device();
        let func = dev.get_or_load_custom_func("decode_graph_advance", "rlhf_decode_graph", ptx::DECODE_GRAPH)?;
        let mut launch = func.builder();
        launch.arg(&picks).arg(&ids).arg(&positions).arg(&done).arg(&state).arg(&tokens).arg(&logprobs);
        match &draws {
            Some((now, all)) => launch.arg(now).arg(all),
            None => launch.arg(&NULL).arg(&NULL),
        };
        let [b32, steps32, p32] = [b, steps, p].map(|v| v as u32);
        launch.arg(&b32).arg(&steps32).arg(&p32).arg(&pad).arg(&eos);
        let threads = (b32.next_multiple_of(32)).clamp(32, 1024);
        let config = LaunchConfig { grid_dim: (1, 1, 1), block_dim: (threads, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: the arguments match the kernel's signature; the buffers are the decoding state's
        // own (written through views: no tensor outside the state reads them while it runs), of
        // the sizes `super::advance_decoding` checked.
        unsafe { launch.launch(config) }.w().map(|_| ())
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
        let ((vocab, c), (position_rows, c2)) = (wte.1.shape().dims2()?, wpe.1.shape().dims2()?);
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
            let [wpe, w, beta] = [(wpe, "wpe"), (w, "ln_1's weight"), (beta, "ln_1's bias")]
                .map(|((s, l), what)| view::<Elem>(s, l, what));
            let (wpe, w, beta) = (wpe?, w?, beta?);
            // SAFETY: the kernel writes both halves of every row.
            let out = unsafe { dev.alloc::<Elem>(2 * rows * c)? };
            let func = dev.get_or_load_custom_func(
                &format!("embed_layer_norm_{suffix}"),
                "rlhf_decode_layer",
                ptx::DECODE_LAYER,
            )?;
            let mut launch = func.builder();
            let (rows64, c32, vocab32, n_pos32) = (rows as u64, c as u32, vocab as u32, position_rows as u32);
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
}

/// On a GPU against the CPU (the CUDA build's unit tests, which `scripts/gpu-check.sh` runs from
/// the package); without one they pass after saying so on stderr.
/// The CPU's forward of the decoding ops, in f32, the arithmetic the GPU's kernels do (each
/// product and sum in f32; the attention's softmax in one pass over its scores, where the GPU
/// keeps a running maximum: the same values within rounding).
mod cpu {
    use super::StepShape as Shape;
    use crate::kernels::rowops;
    use candle_core::Result;

    /// c_attn's output channel `ch` of row (bi, ti), its bias added when given apart.
    fn qkv_value(qkv: &[f32], bias: Option<&[f32]>, shape: Shape, bi: usize, ti: usize, ch: usize) -> f32 {
        let v = qkv[(bi * shape.t + ti) * 3 * shape.c() + ch];
        match bias {
            Some(bias) => v + bias[ch],
            None => v,
        }
    }

    /// The new tokens' keys and values into the cache at positions [start, start + T).
    pub fn kv_cache_append(kv: &mut [f32], qkv: &[f32], bias: Option<&[f32]>, shape: Shape, start: usize) {
        let c = shape.c();
        for which in 0..2 {
            for bi in 0..shape.b {
                for ti in 0..shape.t {
                    for ch in 0..c {
                        let (h, d) = (ch / shape.head_dim, ch % shape.head_dim);
                        kv[shape.at(which, bi, h, start + ti, d)] =
                            qkv_value(qkv, bias, shape, bi, ti, (1 + which) * c + ch);
                    }
                }
            }
        }
    }

    /// The additive mask of a decoding step: a row (of `stride` values) per new token, one per
    /// batch row or one for all.
    pub struct Mask<'a> {
        pub values: &'a [f32],
        pub per_row: bool,
        pub stride: usize,
    }

    /// `softmax(q k^T * scale + mask) v` per head of each new token over the first start + T
    /// positions of the cache: (B, T, C).
    pub fn decode_attention(
        qkv: &[f32],
        bias: Option<&[f32]>,
        kv: &[f32],
        mask: &Mask,
        shape: Shape,
        start: usize,
        scale: f32,
    ) -> Vec<f32> {
        let (c, hd, s) = (shape.c(), shape.head_dim, start + shape.t);
        let mut y = vec![0f32; shape.b * shape.t * c];
        let mut scores = vec![0f32; s];
        for bi in 0..shape.b {
            for ti in 0..shape.t {
                let row = (if mask.per_row { bi } else { 0 }) * shape.t + ti;
                let mask_row = &mask.values[row * mask.stride..row * mask.stride + s];
                for h in 0..shape.heads {
                    let q: Vec<f32> = (0..hd).map(|d| qkv_value(qkv, bias, shape, bi, ti, h * hd + d)).collect();
                    for (j, score) in scores.iter_mut().enumerate() {
                        let key = &kv[shape.at(0, bi, h, j, 0)..shape.at(0, bi, h, j, 0) + hd];
                        *score = q.iter().zip(key).map(|(a, b)| a * b).sum::<f32>() * scale + mask_row[j];
                    }
                    let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                    scores.iter_mut().for_each(|x| *x = (*x - max).exp());
                    let sum: f32 = scores.iter().sum();
                    let out = &mut y[(bi * shape.t + ti) * c + h * hd..(bi * shape.t + ti) * c + (h + 1) * hd];
                    for (j, p) in scores.iter().enumerate() {
                        let value = &kv[shape.at(1, bi, h, j, 0)..shape.at(1, bi, h, j, 0) + hd];
                        out.iter_mut().zip(value).for_each(|(o, v)| *o += p * v);
                    }
                    out.iter_mut().for_each(|o| *o /= sum);
                }
            }
        }
        y
    }

    /// The LayerNorm of each row of `x` (C values) after it: (2, N, C) as one buffer.
    fn with_layer_norm(x: Vec<f32>, w: &[f32], beta: &[f32], eps: f32) -> Result<Vec<f32>> {
        let c = w.len();
        if c == 0 || beta.len() != c || !x.len().is_multiple_of(c) {
            candle_core::bail!("a LayerNorm of {c} values on rows of {} values in all", x.len());
        }
        let mut out = x;
        let n = out.len();
        out.resize(2 * n, 0.0);
        let (x, normed) = out.split_at_mut(n);
        for (row, o) in x.chunks(c).zip(normed.chunks_mut(c)) {
            rowops::layer_norm(row, w, beta, eps, o);
        }
        Ok(out)
    }

    /// `x + (y + b)` and its LayerNorm with `w`, `beta`.
    pub fn bias_residual_layer_norm(y: &[f32], x: &[f32], [b, w, beta]: [&[f32]; 3], eps: f32) -> Result<Vec<f32>> {
        let c = b.len();
        if c == 0 || y.len() != x.len() || !y.len().is_multiple_of(c) {
            candle_core::bail!("bias, residual and LayerNorm: {} and {} values, a bias of {c}", y.len(), x.len());
        }
        let residual = y.iter().zip(x).enumerate().map(|(i, (y, x))| x + (y + b[i % c])).collect();
        with_layer_norm(residual, w, beta, eps)
    }

    /// `wte[id] + wpe[position]` of each row and its LayerNorm (rows of NaN for an id or position
    /// outside its table, as the GPU's kernel).
    pub fn embed_layer_norm(
        ids: &[u32],
        positions: &[u32],
        [wte, wpe]: [&[f32]; 2],
        [w, beta]: [&[f32]; 2],
        eps: f32,
    ) -> Result<Vec<f32>> {
        let c = w.len();
        if ids.len() != positions.len() || c == 0 {
            candle_core::bail!("embeddings and LayerNorm: {} ids, {} positions", ids.len(), positions.len());
        }
        let mut x = Vec::with_capacity(ids.len() * c);
        for (&id, &pos) in ids.iter().zip(positions) {
            let (id, pos) = (id as usize, pos as usize);
            match (wte.get(id * c..(id + 1) * c), wpe.get(pos * c..(pos + 1) * c)) {
                (Some(tok), Some(at)) => x.extend(tok.iter().zip(at).map(|(a, b)| a + b)),
                _ => x.extend(std::iter::repeat_n(f32::NAN, c)),
            }
        }
        with_layer_norm(x, w, beta, eps)
    }

    /// `gelu_new(y + b)`, `b` repeated along each row.
    pub fn bias_gelu(y: &[f32], b: &[f32]) -> Vec<f32> {
        let h: Vec<f32> = y.iter().enumerate().map(|(i, y)| y + b[i % b.len()]).collect();
        let mut out = vec![0f32; h.len()];
        rowops::gelu(&h, &mut out);
        out
    }

    /// The state a decoding step ends with (cuda/decode_graph.cu, which says what each is).
    pub struct Advance<'a> {
        pub ids: &'a mut [u32],
        pub positions: &'a mut [u32],
        pub done: &'a mut [u32],
        pub state: &'a mut [u32],
        pub tokens: &'a mut [u32],
        pub logprobs: &'a mut [f32],
        pub draws: Option<(&'a mut [f64], &'a [f64])>,
    }

    /// cuda/decode_graph.cu's `decode_graph_advance` for `picks` (B, 2).
    pub fn advance_decoding(picks: &[f32], s: Advance, [b, steps, p]: [usize; 3], pad: u32, eos: Option<u32>) {
        let step = s.state[1] as usize;
        let mut running = 0;
        for r in 0..b {
            let was_done = s.done[r] != 0;
            let token = if was_done { pad } else { picks[2 * r] as u32 };
            if step < steps {
                s.tokens[step * b + r] = token;
                s.logprobs[step * b + r] = picks[2 * r + 1];
            }
            let now_done = was_done || eos == Some(token);
            s.done[r] = u32::from(now_done);
            running += u32::from(!now_done);
            s.ids[r] = token;
            s.positions[r] = s.positions[r].wrapping_add(1);
        }
        if let Some((now, all)) = s.draws {
            if step + 1 < steps {
                now.copy_from_slice(&all[(step + 1) * b..(step + 2) * b]);
            }
        }
        s.state[0] = (p + step) as u32;
        s.state[1] = step as u32 + 1;
        s.state[2] = running;
    }
}

#[cfg(test)]
#[cfg(feature = "cuda")]
mod cuda_tests {
    use crate::kernels::ops::test_support::*;
    use candle_core::{DType, Device, Result, Tensor};

    /// A prefill of 7 tokens and three decoding steps of 3 rows (the first left-padded by 2, so
    /// its first query sees no key), heads of 64, 32 and 128 values: the GPU's two-launch step
    /// (KvCache::append_qkv, ops::decode_attention) against the CPU's split heads, cache and
    /// cached attention in f32. The cache holds the same values; the output agrees to 1e-5 of
    /// the largest value in f32, 2e-2 in bf16 and 4e-3 in f16 (the attention test's bounds).
    /// Given c_attn's gemm output and bias apart, the two launches make the same cache and the
    /// same output, bit for bit, as from the biased qkv that the linear's bias add rounds.
    #[test]
    #[ignore = "needs a GPU: scripts/gpu-check.sh runs it (cargo test --features cuda -- --include-ignored)"]
    fn decode_attention_from_qkv_matches_the_cpu_cache_and_cached_attention() -> Result<()> {
        use crate::model::kv_cache::KvCache;
        use crate::model::positions::MASKED;
        let gpu = gpu();
        let (b, capacity, pad) = (3usize, 16usize, 2usize);
        for (heads, head_dim) in [(2usize, 64usize), (4, 32), (1, 128)] {
            let c = heads * head_dim;
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
                    let (q, k, v) = crate::kernels::ops::split_heads(&exact, heads)?;
                    let (k, v) = on_cpu.append(&k, &v)?;
                    let scale = 1.0 / (head_dim as f64).sqrt();
                    let want = crate::kernels::ops::cached_attention(&q, &k, &v, &bias, scale)?;
                    let (qkv, bias) = (qkv.to_device(&gpu)?, bias.to_device(&gpu)?);
                    assert!(crate::kernels::ops::decode_attention_on_cuda(&qkv, &bias, heads));
                    let (kv, cached) = on_gpu.append_qkv(&qkv, None, heads)?;
                    assert_eq!(cached, start);
                    let got = crate::kernels::ops::decode_attention(&qkv, None, &kv, start, &bias, heads, scale)?;
                    let what = format!("{dtype:?}, {heads} heads of {head_dim}, {t} tokens after {start}");
                    let (y, qkv_bias) = (y.to_device(&gpu)?, qkv_bias.to_device(&gpu)?);
                    let (kv_apart, _) = bias_apart.append_qkv(&y, Some(&qkv_bias), heads)?;
                    let got_apart = crate::kernels::ops::decode_attention(
                        &y,
                        Some(&qkv_bias),
                        &kv_apart,
                        start,
                        &bias,
                        heads,
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

    /// A decoding step's fused blocks (model/gpt2/layers.rs's Block::forward_decoding_on_cuda, nine launches
    /// a layer) against the same blocks one op a launch (Block::forward, on the GPU's kernels
    /// too), on a 3-layer GPT-2 with heads of 64 and of 32: a prefill of 5 tokens with row 0
    /// left-padded by 2, then 4 steps, in f32, bf16 and f16. The fused kernels round each
    /// intermediate where the unfused ops store it, so the hidden states (and so the caches
    /// the later steps read) are the same bit for bit. The unfused LayerNorm is the warp-a-row
    /// kernel the fused blocks' follows: the packed rows' (on by default, its own test against
    /// the CPU) sums a row in another order, 5e-8 off in f32 (H200, 2026-11-28).
    #[test]
    #[ignore = "needs a GPU: scripts/gpu-check.sh runs it (cargo test --features cuda -- --include-ignored)"]
    fn fused_decoding_blocks_are_the_unfused_blocks_bit_for_bit() -> anyhow::Result<()> {
        let gpu = gpu();
        let was_on = crate::kernels::cuda::packed_rows_on();
        crate::kernels::cuda::set_packed_rows(false);
        let compared = compare_fused_decoding_blocks(&gpu);
        crate::kernels::cuda::set_packed_rows(was_on);
        compared
    }

    fn compare_fused_decoding_blocks(gpu: &Device) -> anyhow::Result<()> {
        use crate::model::gpt2::{Gpt2, Gpt2Cache};
        use crate::model::positions::Positions;
        let gpu = gpu.clone();
        let (b, p) = (3usize, 5usize);
        for heads in [2usize, 4] {
            let cfg = crate::Gpt2Config {
                n_layer: 3,
                n_head: heads,
                vocab_size: 500,
                n_positions: 32,
                ..crate::Gpt2Config::tiny()
            };
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
                    assert_eq!(diff, 0.0, "{dtype:?}, {heads} heads, step {step}: hidden states differ by {diff}");
                    ids = Tensor::from_vec(vec![(step * 7 + 1) as u32; b], (b, 1), &gpu)?;
                    pos = Tensor::from_vec(next_pos.clone(), (b, 1), &gpu)?;
                    next_pos.iter_mut().for_each(|x| *x += 1);
                    mask.iter_mut().for_each(|m| m.push(1));
                }
            }
        }
        Ok(())
    }
}
