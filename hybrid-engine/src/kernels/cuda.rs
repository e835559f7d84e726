//! What the CUDA launchers share (`ops/*.rs`, each op's `cuda` module beside its CPU kernel): the
//! engine's kernels compiled to PTX (`hybrid-engine/cuda/*.cu`, by `build.rs`) and loaded on
//! candle's device, the launch shapes, the views of candle's storages by dtype, and the
//! multi-tensor table (one launch over many tensors: the gradient norm, AdamW).

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaView, DevicePtr, DeviceRepr, LaunchConfig};
use candle_core::cuda_backend::{CudaDType, CudaStorageSlice};
use candle_core::{CudaDevice, CudaStorage, DType, Layout, Result, Tensor};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;

pub(crate) mod ptx {
    include!(concat!(env!("OUT_DIR"), "/ptx.rs"));
}

/// Threads per block of the elementwise kernels.
pub(crate) const BLOCK: u32 = 256;
/// At most this many blocks; the kernels stride over the rest.
const MAX_BLOCKS: u64 = 1 << 16;

/// A grid-stride launch over `n` elements.
pub(crate) fn elementwise(n: usize) -> LaunchConfig {
    let blocks = (n as u64).div_ceil(BLOCK as u64).clamp(1, MAX_BLOCKS) as u32;
    LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (BLOCK, 1, 1), shared_mem_bytes: 0 }
}

/// A thread per eight elements, for the kernels that move eight values at a time
/// (common.cuh's `elementwise8`; they stride over the rest).
pub(crate) fn elementwise8(n: usize) -> LaunchConfig {
    elementwise(n.div_ceil(8))
}

/// One thread per element, no stride loop (kernels that return past the end).
pub(crate) fn elementwise_unstrided(n: usize) -> LaunchConfig {
    let blocks = (n as u32).div_ceil(BLOCK).max(1);
    LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (BLOCK, 1, 1), shared_mem_bytes: 0 }
}

/// Rows per block of the row kernels (one warp each, cuda/masked_softmax.cu).
const ROWS_PER_BLOCK: u64 = 4;

/// A launch of one warp per row.
pub(crate) fn warp_per_row(rows: usize) -> LaunchConfig {
    let blocks = (rows as u64).div_ceil(ROWS_PER_BLOCK) as u32;
    LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (32 * ROWS_PER_BLOCK as u32, 1, 1), shared_mem_bytes: 0 }
}

/// Warps of a block of common.cuh's COLUMN_SUMS_SPLIT (its COLUMN_SUM_WARPS).
const COLUMN_SUM_WARPS: u32 = 16;

/// The launch of common.cuh's COLUMN_SUMS_SPLIT over `width` columns: a block of 32 columns.
pub(crate) fn column_sums_split(width: usize) -> LaunchConfig {
    let blocks = (width as u32).div_ceil(32).max(1);
    LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (32 * COLUMN_SUM_WARPS, 1, 1), shared_mem_bytes: 0 }
}

/// Whether the row kernels (cuda/layer_norm.cu, cuda/cross_entropy.cu) may move a row of `c`
/// values eight at a time in 16-byte accesses (`packed`; the kernels also check each pointer's
/// alignment): the switch on (below), C a multiple of 8 and at most `most` (what a lane holds in
/// registers; 0 for no bound).
pub(crate) fn packed_rows(c: usize, most: usize) -> u32 {
    u32::from(packed_rows_on() && c.is_multiple_of(8) && (most == 0 || c <= most))
}

/// Whether the packed row kernels' switch is on (it also picks LayerNorm's column sums).
pub(crate) fn packed_rows_on() -> bool {
    packed_rows_switch().load(Ordering::Relaxed)
}

/// Turns the packed row kernels on or off for this process (the GPU tests run both).
/// On by default (their tests passed on an H200, 2026-11-28, and gpt2's bf16 step took 29.2 ms
/// against 31.6); `HYBRID_ENGINE_PACKED_ROWS=0` turns them off at start, for comparisons.
pub fn set_packed_rows(on: bool) {
    packed_rows_switch().store(on, Ordering::Relaxed)
}

fn packed_rows_switch() -> &'static AtomicBool {
    static ON: OnceLock<AtomicBool> = OnceLock::new();
    ON.get_or_init(|| AtomicBool::new(std::env::var("HYBRID_ENGINE_PACKED_ROWS").map_or(true, |v| v != "0")))
}

/// Threads of the kernels that take a block a row (cuda/cross_entropy.cu, cuda/greedy_pick.cu:
/// their THREADS).
const BLOCK_PER_ROW_THREADS: u32 = 256;

pub(crate) fn block_per_row(rows: usize) -> LaunchConfig {
    LaunchConfig { grid_dim: (rows as u32, 1, 1), block_dim: (BLOCK_PER_ROW_THREADS, 1, 1), shared_mem_bytes: 0 }
}

/// The contiguous elements of `storage` under `layout`, as a view `$s` of element type `$elem`
/// (f32, bf16 or f16), with `$suffix` the kernels' name suffix for it; `$body` makes a new slice,
/// which comes back as a storage on the same device.
macro_rules! for_float_dtype {
    ($storage:expr, $layout:expr, $what:literal, |$s:ident: $elem:ident, $suffix:ident| $body:expr) => {{
        let storage: &candle_core::CudaStorage = $storage;
        let Some((start, end)) = $layout.contiguous_offsets() else {
            candle_core::bail!("{} on CUDA takes a contiguous tensor", $what);
        };
        let dev = candle_core::backend::BackendStorage::device(storage);
        match &storage.slice {
            candle_core::cuda_backend::CudaStorageSlice::F32(x) => {
                #[allow(dead_code)] // not every body names it
                type $elem = f32;
                let ($s, $suffix) = (&x.slice(start..end), "f32");
                candle_core::CudaStorage::wrap_cuda_slice($body?, dev.clone())
            }
            candle_core::cuda_backend::CudaStorageSlice::BF16(x) => {
                #[allow(dead_code)] // not every body names it
                type $elem = half::bf16;
                let ($s, $suffix) = (&x.slice(start..end), "bf16");
                candle_core::CudaStorage::wrap_cuda_slice($body?, dev.clone())
            }
            candle_core::cuda_backend::CudaStorageSlice::F16(x) => {
                #[allow(dead_code)] // not every body names it
                type $elem = half::f16;
                let ($s, $suffix) = (&x.slice(start..end), "f16");
                candle_core::CudaStorage::wrap_cuda_slice($body?, dev.clone())
            }
            _ => candle_core::bail!(
                "{} on CUDA takes f32, bf16 or f16, not {:?}",
                $what,
                candle_core::backend::BackendStorage::dtype(storage)
            ),
        }
    }};
}
pub(crate) use for_float_dtype;

/// Whether the CUDA kernels take tensors of `dtype`.
pub fn is_float(dtype: DType) -> bool {
    matches!(dtype, DType::F32 | DType::BF16 | DType::F16)
}

/// The contiguous elements of an operand as a view of element type `T` (an error if it is not
/// contiguous or not of that dtype: each kernel takes its operands in one dtype).
pub(crate) fn view<'a, T: CudaDType>(storage: &'a CudaStorage, layout: &Layout, what: &str) -> Result<CudaView<'a, T>> {
    let Some((start, end)) = layout.contiguous_offsets() else {
        candle_core::bail!("{what} on CUDA takes a contiguous tensor");
    };
    Ok(T::as_cuda_slice(storage)?.slice(start..end))
}

/// Runs `f` with the CUDA storages and layouts of `tensors`, operands an op holds beside its
/// arguments (candle's custom ops take at most three), read-locked meanwhile.
pub(crate) fn with_cuda_operands<R>(
    tensors: &[&Tensor],
    f: impl FnOnce(&[(&CudaStorage, &Layout)]) -> Result<R>,
) -> Result<R> {
    let locked: Vec<_> = tensors.iter().map(|t| t.storage_and_layout()).collect();
    let operands = locked
        .iter()
        .map(|(storage, layout)| match &**storage {
            candle_core::Storage::Cuda(s) => Ok((s, *layout)),
            _ => candle_core::bail!("an operand of a CUDA op is not on the GPU"),
        })
        .collect::<Result<Vec<_>>>()?;
    f(&operands)
}

/// Values a block of the multi-tensor kernels takes (cuda/multi_tensor.cuh): 64 a thread.
pub(crate) const MULTI_TENSOR_CHUNK: u32 = 64 * BLOCK;

/// A row of cuda/multi_tensor.cuh's table, field for field: one tensor of a multi-tensor launch.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct TensorSlot {
    pub(crate) param: u64,
    pub(crate) grad: u64,
    pub(crate) moments: u64,
    pub(crate) copy: u64,
    pub(crate) n: u64,
    pub(crate) first_chunk: u32,
    pub(crate) grad_dtype: u32,
    pub(crate) copy_dtype: u32,
    pub(crate) decay: f32,
    pub(crate) step_size: f32,
    pub(crate) unused: u32,
}

// SAFETY: plain data of a fixed layout (the kernels' struct), valid for any bits.
unsafe impl DeviceRepr for TensorSlot {}

/// multi_tensor.cuh's code for a slot without a compute copy.
pub(crate) const NO_COPY: u32 = 3;

/// The device address of contiguous `t`'s first value and its dtype's code in
/// cuda/multi_tensor.cuh (f32 0, bf16 1, f16 2). The address stays valid while `t` lives.
pub(crate) fn address(t: &Tensor, what: &str) -> Result<(u64, u32)> {
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
pub(crate) fn common_device(tensors: &[&Tensor]) -> Result<CudaDevice> {
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
pub(crate) fn upload_table(dev: &CudaDevice, slots: &mut [TensorSlot]) -> Result<(CudaSlice<TensorSlot>, u32, u32)> {
    let mut chunks = 0u64;
    for slot in slots.iter_mut() {
        slot.first_chunk = u32::try_from(chunks).map_err(|_| candle_core::Error::Msg("too many chunks".into()))?;
        chunks += slot.n.div_ceil(u64::from(MULTI_TENSOR_CHUNK));
    }
    let too_many = |_| candle_core::Error::Msg(format!("a multi-tensor launch of {chunks} chunks"));
    let (count, chunks) = (u32::try_from(slots.len()).map_err(too_many)?, u32::try_from(chunks).map_err(too_many)?);
    Ok((dev.clone_htod(&*slots)?, count, chunks))
}
