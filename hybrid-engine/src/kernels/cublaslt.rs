//! cuBLASLt's matmul with a fused epilogue, for the linear layer on a GPU: the bias added inside
//! the gemm (forward, `CUBLASLT_EPILOGUE_BIAS`) and the bias gradient summed inside the weight
//! gradient's gemm (backward, `CUBLASLT_EPILOGUE_BGRADA`), where cuBLAS's gemm and separate
//! kernels took two or three launches and another pass over the output.
//!
//! A plan (the descriptors, the layouts and the algorithm cuBLASLt's heuristic picks) is made
//! once per shape and kept: cudarc's safe `Matmul` makes them and asks the heuristic on every
//! call, host time a training step cannot spare. A shape cuBLASLt has no algorithm for is
//! remembered too, and its caller takes the unfused path. `HYBRID_ENGINE_CUBLASLT=0` turns the
//! fused path off, so that one build can time both.

use candle_core::cuda_backend::cudarc::cublaslt::{result, sys};
use candle_core::cuda_backend::cudarc::driver::sys::CUdeviceptr;
use candle_core::{CudaDevice, DType, Result};
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};

/// What the epilogue does with its vector `v` (m values).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Epilogue {
    /// D = A op(B) + v, v added to every column (the bias of a linear's output).
    Bias,
    /// D = A op(B), and v = the sums of A over k (the bias gradient beside the weight's).
    BiasGradA,
}

/// Whether the fused path is on (`HYBRID_ENGINE_CUBLASLT=0` turns it off).
pub fn enabled() -> bool {
    switch().load(Ordering::Relaxed)
}

/// Turns the fused path on or off for this process (the GPU tests compare the two paths).
pub fn set_enabled(on: bool) {
    switch().store(on, Ordering::Relaxed)
}

fn switch() -> &'static AtomicBool {
    static ON: OnceLock<AtomicBool> = OnceLock::new();
    ON.get_or_init(|| AtomicBool::new(std::env::var("HYBRID_ENGINE_CUBLASLT").map_or(true, |v| v != "0")))
}

/// Matmuls this process ran through cuBLASLt's epilogues, and those it could not (cuBLASLt had no
/// algorithm for the shape, or the fused path is off): the benchmark reports both, and the GPU
/// test asserts that the fused path ran.
pub fn counts() -> (u64, u64) {
    (FUSED.load(Ordering::Relaxed), UNFUSED.load(Ordering::Relaxed))
}

static FUSED: AtomicU64 = AtomicU64::new(0);
static UNFUSED: AtomicU64 = AtomicU64::new(0);

/// One matmul, column-major as cuBLAS counts: D (m x n, leading dimension m) = A (m x k, leading
/// dimension m) times op(B) (k x n), where op(B) is B (k x n, leading dimension k) or, with
/// `transpose_b`, the transpose of B stored (n x k, leading dimension n); `v` the epilogue's
/// vector of m values. Every pointer is a device address on `dev` holding `dtype` values.
pub struct Operands {
    pub dtype: DType,
    pub epilogue: Epilogue,
    pub transpose_b: bool,
    pub m: u64,
    pub n: u64,
    pub k: u64,
    pub a: CUdeviceptr,
    pub b: CUdeviceptr,
    pub d: CUdeviceptr,
    pub v: CUdeviceptr,
}

/// Runs `op` on `dev`'s stream. Returns false, having run nothing, where the fused path is off or
/// cuBLASLt has no algorithm for the shape: the caller then computes the same without it.
///
/// # Safety
/// The addresses must hold the values and room the shapes say, on `dev`, and stay valid until the
/// stream has run the matmul.
pub unsafe fn matmul(dev: &CudaDevice, op: &Operands) -> Result<bool> {
    let counted = |fused: bool| {
        if fused { &FUSED } else { &UNFUSED }.fetch_add(1, Ordering::Relaxed);
        fused
    };
    // candle's reduced-precision f16 gemms compute in f16 with f16 scalars: not this path's.
    let f16_in_f16 = op.dtype == DType::F16 && candle_core::cuda_backend::gemm_reduced_precision_f16();
    if !enabled()
        || !matches!(op.dtype, DType::F32 | DType::BF16 | DType::F16)
        || f16_in_f16
        || !op.v.is_multiple_of(16)
    {
        return Ok(counted(false));
    }
    let stream = dev.cuda_stream();
    let mut devices =
        DEVICES.lock().map_err(|_| candle_core::Error::Msg("the cuBLASLt state lock is poisoned".into()))?;
    let device = match devices.get_or_insert_with(HashMap::new).entry(stream.context().cu_ctx() as usize) {
        std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
        std::collections::hash_map::Entry::Vacant(e) => e.insert(LtDevice::new(dev)?),
    };
    let key = PlanKey::of(op);
    let plan = match device.plans.entry(key) {
        std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
        std::collections::hash_map::Entry::Vacant(e) => {
            let plan = Plan::new(device.handle, &key);
            if let Err(why) = &plan {
                // Once per shape: the unfused path is slower, not wrong.
                eprintln!("cuBLASLt: no {:?} gemm for {key:?} ({why}); the unfused linear runs", key.epilogue);
            }
            e.insert(plan.ok())
        }
    };
    let Some(plan) = plan else { return Ok(counted(false)) };
    // The bias's address, or where the bias gradient goes: the one attribute that changes per call.
    set_desc(plan.desc, sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_BIAS_POINTER, &op.v)?;
    let (alpha, beta) = (1f32, 0f32);
    result::matmul(
        device.handle,
        plan.desc,
        (&alpha as *const f32).cast(),
        (&beta as *const f32).cast(),
        op.a as *const c_void,
        plan.a,
        op.b as *const c_void,
        plan.b,
        op.d as *const c_void,
        plan.d,
        op.d as *mut c_void,
        plan.d,
        &plan.algo,
        device.workspace as *mut c_void,
        WORKSPACE_BYTES,
        stream.cu_stream() as *mut _,
    )
    .map_err(|e| candle_core::Error::Msg(format!("cuBLASLt matmul ({:?}): {e:?}", op.epilogue)))?;
    Ok(counted(true))
}

/// The workspace NVIDIA recommends for Hopper (and cudarc allocates): 32 MiB.
const WORKSPACE_BYTES: usize = 32 << 20;

/// The cuBLASLt state of each CUDA context (one a GPU: candle opens each device's primary
/// context), by the context; the matmuls run on the calling device's stream.
static DEVICES: Mutex<Option<HashMap<usize, LtDevice>>> = Mutex::new(None);

/// A handle, its workspace and the plans made on one device.
struct LtDevice {
    handle: sys::cublasLtHandle_t,
    /// Allocated outside the stream's memory pool (cuMemAlloc), as cuBLAS's own workspace is, so
    /// that the pool's high-water mark stays the tensors' (the memory plan's measure); never freed.
    workspace: CUdeviceptr,
    plans: HashMap<PlanKey, Option<Plan>>,
    /// Held so that the context, and with it the workspace, outlives every candle device on it
    /// (a primary context released by its last user would be destroyed, and its address could
    /// name a later one).
    _context: std::sync::Arc<candle_core::cuda_backend::cudarc::driver::CudaContext>,
}

// SAFETY: the handle and the plans' descriptors are used under DEVICES's lock only.
unsafe impl Send for LtDevice {}

impl LtDevice {
    fn new(dev: &CudaDevice) -> Result<Self> {
        let failed = |what: &str, e: &dyn std::fmt::Debug| candle_core::Error::Msg(format!("cuBLASLt {what}: {e:?}"));
        dev.cuda_stream().context().bind_to_thread().map_err(|e| failed("device", &e))?;
        let handle = result::create_handle().map_err(|e| failed("handle", &e))?;
        // SAFETY: a plain allocation on the current context.
        let workspace = unsafe { candle_core::cuda_backend::cudarc::driver::result::malloc_sync(WORKSPACE_BYTES) }
            .map_err(|e| failed("workspace", &e))?;
        Ok(Self { handle, workspace, plans: HashMap::new(), _context: dev.cuda_stream().context().clone() })
    }
}

/// What a plan depends on: the dtype, the epilogue, the shape and each matrix's alignment (the
/// heuristic may pick a kernel that needs more than a pointer offset into a buffer has).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct PlanKey {
    dtype: DType,
    epilogue: Epilogue,
    transpose_b: bool,
    m: u64,
    n: u64,
    k: u64,
    align: [u32; 3],
}

impl PlanKey {
    fn of(op: &Operands) -> Self {
        let align = |p: CUdeviceptr| 1u32 << p.trailing_zeros().min(8);
        let Operands { dtype, epilogue, transpose_b, m, n, k, .. } = *op;
        Self { dtype, epilogue, transpose_b, m, n, k, align: [align(op.a), align(op.b), align(op.d)] }
    }
}

/// The descriptors of one shape and the algorithm the heuristic chose for them.
struct Plan {
    desc: sys::cublasLtMatmulDesc_t,
    a: sys::cublasLtMatrixLayout_t,
    b: sys::cublasLtMatrixLayout_t,
    d: sys::cublasLtMatrixLayout_t,
    algo: sys::cublasLtMatmulAlgo_t,
}

impl Plan {
    /// The plan of `key`, or an error where cuBLASLt refuses it (the descriptors made so far are
    /// released).
    fn new(handle: sys::cublasLtHandle_t, key: &PlanKey) -> std::result::Result<Self, String> {
        let (data, compute) = match key.dtype {
            DType::F32 => (sys::cudaDataType_t::CUDA_R_32F, compute_f32()),
            DType::BF16 => (sys::cudaDataType_t::CUDA_R_16BF, compute_bf16()),
            _ => (sys::cudaDataType_t::CUDA_R_16F, sys::cublasComputeType_t::CUBLAS_COMPUTE_32F),
        };
        fn err(what: &'static str) -> impl Fn(result::CublasError) -> String {
            move |e| format!("{what}: {e:?}")
        }
        let desc = result::create_matmul_desc(compute, sys::cudaDataType_t::CUDA_R_32F).map_err(err("descriptor"))?;
        let mut plan = Self {
            desc,
            a: std::ptr::null_mut(),
            b: std::ptr::null_mut(),
            d: std::ptr::null_mut(),
            algo: unsafe { std::mem::zeroed() },
        };
        let PlanKey { m, n, k, .. } = *key;
        plan.a = result::create_matrix_layout(data, m, k, m as i64).map_err(err("layout of A"))?;
        plan.b = match key.transpose_b {
            false => result::create_matrix_layout(data, k, n, k as i64),
            true => result::create_matrix_layout(data, n, k, n as i64),
        }
        .map_err(err("layout of B"))?;
        plan.d = result::create_matrix_layout(data, m, n, m as i64).map_err(err("layout of D"))?;
        let epilogue = match key.epilogue {
            Epilogue::Bias => sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_BIAS,
            Epilogue::BiasGradA => sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_BGRADA,
        };
        // cublasOperation_t::CUBLAS_OP_T (cublas_api.h), which cudarc's cublasLt bindings lack.
        let transpose: i32 = 1;
        // SAFETY: each attribute gets a value of its documented type.
        unsafe {
            if key.transpose_b {
                set_desc(plan.desc, sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSB, &transpose)
                    .map_err(|e| e.to_string())?;
            }
            set_desc(plan.desc, sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue)
                .map_err(|e| e.to_string())?;
        }
        plan.algo = plan.heuristic(handle, key.align)?;
        Ok(plan)
    }

    /// The heuristic's first algorithm for this plan under the workspace and the operands'
    /// alignment.
    fn heuristic(
        &self,
        handle: sys::cublasLtHandle_t,
        align: [u32; 3],
    ) -> std::result::Result<sys::cublasLtMatmulAlgo_t, String> {
        use sys::cublasLtMatmulPreferenceAttributes_t as Pref;
        let pref = result::create_matmul_pref().map_err(|e| format!("preference: {e:?}"))?;
        let set = |attr, value: &dyn Fn() -> (*const c_void, usize)| {
            let (p, size) = value();
            // SAFETY: each attribute gets a value of its documented type and size.
            unsafe { result::set_matmul_pref_attribute(pref, attr, p, size) }.map_err(|e| format!("preference: {e:?}"))
        };
        let workspace = WORKSPACE_BYTES as u64;
        let found = (|| {
            set(Pref::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &|| ((&workspace as *const u64).cast(), 8))?;
            for (attr, bytes) in [
                (Pref::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &align[0]),
                (Pref::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &align[1]),
                (Pref::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &align[2]),
                (Pref::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &align[2]),
            ] {
                set(attr, &|| ((bytes as *const u32).cast(), 4))?;
            }
            // SAFETY: the descriptors and the preference are live.
            unsafe { result::get_matmul_algo_heuristic(handle, self.desc, self.a, self.b, self.d, self.d, pref) }
                .map(|h| h.algo)
                .map_err(|e| format!("no algorithm: {e:?}"))
        })();
        // SAFETY: made above, used no more.
        let _ = unsafe { result::destroy_matmul_pref(pref) };
        found
    }
}

impl Drop for Plan {
    fn drop(&mut self) {
        // SAFETY: each was made by Plan::new (null where it failed first) and is used no more.
        unsafe {
            for layout in [self.a, self.b, self.d] {
                if !layout.is_null() {
                    let _ = result::destroy_matrix_layout(layout);
                }
            }
            let _ = result::destroy_matmul_desc(self.desc);
        }
    }
}

/// Sets one attribute of a matmul descriptor to `value`.
///
/// # Safety
/// `T` must be the attribute's documented type.
unsafe fn set_desc<T>(
    desc: sys::cublasLtMatmulDesc_t,
    attr: sys::cublasLtMatmulDescAttributes_t,
    value: &T,
) -> Result<()> {
    result::set_matmul_desc_attribute(desc, attr, (value as *const T).cast(), std::mem::size_of::<T>())
        .map_err(|e| candle_core::Error::Msg(format!("cuBLASLt descriptor: {e:?}")))
}

/// The compute types candle's own gemms use, so that a linear rounds as a plain matmul does
/// (candle's reduced-precision switches, off by default; f16's is refused in `matmul`).
fn compute_f32() -> sys::cublasComputeType_t {
    match candle_core::cuda_backend::gemm_reduced_precision_f32() {
        true => sys::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32,
        false => sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
    }
}

fn compute_bf16() -> sys::cublasComputeType_t {
    match candle_core::cuda_backend::gemm_reduced_precision_bf16() {
        true => sys::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_16BF,
        false => sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
    }
}
