//! The GPU backend: NCCL through cudarc's result API, one communicator per group. Collectives
//! run on a stream of their own, ordered by events: the communication stream waits for the
//! compute stream's work so far (the kernels that produced the input), and the compute stream
//! waits for the collective before it uses the result, so no host synchronisation is needed and
//! a collective can later overlap compute that does not read it. The unique id is made by rank 0
//! and sent to the others over the CPU ring that the rendezvous built (NCCL's own bootstrap
//! needs exactly this side channel).
//!
//! Each collective is a candle custom op whose CUDA forward calls NCCL into a fresh buffer, as
//! candle's `llama_multiprocess` example does, in the tensor's dtype (f32, bf16 or f16: tensor
//! parallelism's all-reduces in the compute dtype, half-precision gradient reductions); the CPU
//! forward refuses (CPU tensors go over the ring). NCCL allows a communicator to be used from
//! any thread but not from two at once, so it sits behind a mutex, which makes process groups
//! shareable by the ops that tensor parallelism stores in candle's graph.
//!
//! A [`Watchdog`] watches the communicator's creation and every collective, from before NCCL is
//! called (its host calls can block too: `ncclCommInitRank` until every rank joins) to an event
//! recorded after it: one still incomplete after `--dist-timeout` (a peer died, hangs or called
//! another collective) has its communicator's asynchronous error read (`ncclCommGetAsyncError`),
//! the communicator aborted (`ncclCommAbort`) and the process ended with one line naming the
//! collective and the rank.

use crate::comm::tcp::{ReduceOp, TcpRing};
use crate::comm::watchdog::{poll_interval, Stuck, Watchdog};
use anyhow::{anyhow, Result};
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{CudaEvent, CudaStream, DevicePtr, DevicePtrMut};
use candle_core::cuda_backend::cudarc::nccl::{result, sys, NcclType};
use candle_core::cuda_backend::{cudarc, CudaError};
use candle_core::{CpuStorage, CudaStorage, CustomOp1, DType, Device, Layout, Shape, Tensor};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

/// One NCCL communicator for the ranks of a group, with its stream and its watchdog.
pub struct NcclComm {
    comm: Mutex<RawComm>,
    /// The stream collectives run on.
    stream: Arc<CudaStream>,
    rank: usize,
    world: usize,
    /// `None` for a wait without end (a group of one).
    watchdog: Option<Watchdog>,
}

/// A collective the compute stream has not yet waited for. Dropping it makes the compute stream
/// wait (no host synchronisation); until then the input is kept, so that its memory is not
/// reused while NCCL reads it.
pub struct Deferred {
    done: Arc<CudaEvent>,
    compute: Arc<CudaStream>,
    _input: Tensor,
}

impl Drop for Deferred {
    fn drop(&mut self) {
        if let Err(e) = self.compute.wait(&self.done) {
            // Without the wait the result could be read before it is written: nothing can go on.
            eprintln!("error: the compute stream could not wait for an NCCL collective: {e:?}");
            std::process::exit(1);
        }
    }
}

/// The communicator's handle. NCCL forbids concurrent use of one communicator, not use from
/// another thread: every collective goes through `NcclComm::comm`'s lock; the watchdog uses
/// its copy only to abort, which NCCL allows from another thread while a collective hangs.
#[derive(Clone, Copy)]
struct RawComm(sys::ncclComm_t);

// SAFETY: see `RawComm`; shared, it is only copied (the watchdog's copy, set once created).
unsafe impl Send for RawComm {}
unsafe impl Sync for RawComm {}

/// NCCL's name for `code`.
fn nccl_error(code: sys::ncclResult_t) -> String {
    // SAFETY: NCCL returns a static string for every code.
    let text = unsafe { std::ffi::CStr::from_ptr(sys::ncclGetErrorString(code)) };
    format!("{} ({code:?})", text.to_string_lossy())
}

impl NcclComm {
    /// Creates the communicator collectively: every rank of `ring` calls this in the same order.
    /// A collective still incomplete after the ring's timeout (`--dist-timeout`) ends the
    /// process with one line naming it.
    pub fn new(ring: &TcpRing, device: &Device) -> Result<Self> {
        let (rank, world, timeout) = (ring.rank(), ring.world(), ring.timeout());
        Self::create(ring, device, timeout, move |stuck, raw| exit_on_stuck(stuck, raw, rank, world, timeout))
    }

    /// The communicator, watched from its creation on: whatever is in flight past `timeout` goes
    /// to `on_stuck` with the communicator (`None` while it is being created), unwatched where
    /// the timeout has no end (a group of one).
    fn create(
        ring: &TcpRing,
        device: &Device,
        timeout: Duration,
        on_stuck: impl FnOnce(Stuck, Option<RawComm>) + Send + 'static,
    ) -> Result<Self> {
        let created = Arc::new(OnceLock::new());
        let watchdog = (timeout != Duration::MAX).then(|| {
            let created = created.clone();
            Watchdog::start(timeout, poll_interval(timeout), move |stuck| on_stuck(stuck, created.get().copied()))
        });
        let cuda = device.as_cuda_device()?;
        let mut id = match ring.rank() {
            0 => result::get_uniqueid().map_err(|e| anyhow!("NCCL could not make a unique id: {}", nccl_error(e.0)))?,
            _ => sys::ncclUniqueId { internal: [0; 128] },
        };
        let mut bytes = id.internal.map(|c| c as u8);
        ring.broadcast_bytes(&mut bytes, 0)?;
        id.internal = bytes.map(|b| b as core::ffi::c_char);
        let stream = cuda.cuda_stream().context().new_stream()?;
        // The init waits for every rank to join: a peer that died since the id went round would
        // hold it forever.
        let joined = Arc::new(AtomicBool::new(false));
        if let Some(watchdog) = &watchdog {
            let joined = joined.clone();
            watchdog.watch("communicator creation (ncclCommInitRank)", move || joined.load(Ordering::Acquire));
        }
        let mut comm = std::mem::MaybeUninit::uninit();
        // SAFETY: `comm` is written by a successful init; rank and world are the ring's.
        let comm = unsafe {
            result::comm_init_rank(comm.as_mut_ptr(), ring.world() as i32, id, ring.rank() as i32).map_err(|e| {
                anyhow!("NCCL could not create the communicator of rank {}: {}", ring.rank(), nccl_error(e.0))
            })?;
            comm.assume_init()
        };
        let _ = created.set(RawComm(comm));
        joined.store(true, Ordering::Release);
        Ok(Self { comm: Mutex::new(RawComm(comm)), stream, rank: ring.rank(), world: ring.world(), watchdog })
    }

    fn run(&self, t: &Tensor, kind: Kind<'_>) -> Result<Tensor> {
        Ok(self.launch(t, kind, None)?.0)
    }

    /// The collective `kind` of `t` enqueued on the communicator's stream; with `deferred`, the
    /// compute stream does not wait for it here (the caller's [`Deferred`] does), else it does.
    /// Returns the result and the flattened input.
    fn launch(
        &self,
        t: &Tensor,
        kind: Kind<'_>,
        deferred: Option<&Mutex<Option<Arc<CudaEvent>>>>,
    ) -> Result<(Tensor, Tensor)> {
        let t = t.flatten_all()?.contiguous()?;
        let comm = self.comm.lock().map_err(|_| anyhow!("an NCCL collective panicked earlier"))?;
        let out = t.apply_op1_no_bwd(&Collective { comm: *comm, nccl: self, kind, deferred })?;
        Ok((out, t))
    }

    /// [`Self::all_gather`] begun on the communicator's stream while the compute stream goes on
    /// (ZeRO-3's prefetch of the next unit while the current one computes): the result may be
    /// read only after [`Deferred`] is dropped, which orders the compute stream after the
    /// gather.
    pub fn all_gather_deferred(&self, t: &Tensor) -> Result<(Tensor, Deferred)> {
        self.deferred(t, Kind::AllGather)
    }

    /// [`Self::reduce_scatter`] begun as [`Self::all_gather_deferred`] (ZeRO-3's gradient
    /// reduce-scatter while the next unit's backward computes).
    pub fn reduce_scatter_deferred(&self, t: &Tensor) -> Result<(Tensor, Deferred)> {
        self.deferred(t, Kind::ReduceScatter)
    }

    /// The sums over ranks of `t`'s consecutive `chunks` (one per rank, any lengths, together
    /// the whole of `t`), each delivered to its rank only, begun as [`Self::all_gather_deferred`]:
    /// ZeRO-2's gradient bucket during backward, whose values fall unevenly into the ranks'
    /// shards (NCCL's reduce-scatter takes equal chunks only). One `ncclReduce` per rank's
    /// chunk, rooted at that rank, in one NCCL group, as DeepSpeed's stage 2 reduces a bucket;
    /// as many bytes on the wire as a reduce-scatter. The result: this rank's chunk (empty
    /// where it has none: then never read it).
    pub fn reduce_chunks_deferred(&self, t: &Tensor, chunks: &[std::ops::Range<usize>]) -> Result<(Tensor, Deferred)> {
        self.deferred(t, Kind::ReduceChunks(chunks))
    }

    fn deferred(&self, t: &Tensor, kind: Kind<'_>) -> Result<(Tensor, Deferred)> {
        let slot = Mutex::new(None);
        let (out, input) = self.launch(t, kind, Some(&slot))?;
        let done = slot
            .into_inner()
            .ok()
            .flatten()
            .ok_or_else(|| anyhow!("internal error: a deferred collective recorded no event"))?;
        let compute = t.device().as_cuda_device()?.cuda_stream();
        Ok((out, Deferred { done, compute, _input: input }))
    }

    pub fn all_reduce(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor> {
        self.run(t, Kind::AllReduce(op))
    }

    pub fn reduce_scatter(&self, t: &Tensor) -> Result<Tensor> {
        self.run(t, Kind::ReduceScatter)
    }

    pub fn all_gather(&self, t: &Tensor) -> Result<Tensor> {
        self.run(t, Kind::AllGather)
    }

    pub fn broadcast(&self, t: &Tensor, root: usize) -> Result<Tensor> {
        self.run(t, Kind::Broadcast(root))
    }
}

#[derive(Clone, Copy)]
enum Kind<'a> {
    AllReduce(ReduceOp),
    ReduceScatter,
    AllGather,
    Broadcast(usize),
    /// Rank r receives the sum of chunk r (see [`NcclComm::reduce_chunks_deferred`]).
    ReduceChunks(&'a [std::ops::Range<usize>]),
}

struct Collective<'a> {
    comm: RawComm,
    nccl: &'a NcclComm,
    kind: Kind<'a>,
    /// Where a deferred collective leaves its completion event (the compute stream then does
    /// not wait for it).
    deferred: Option<&'a Mutex<Option<Arc<CudaEvent>>>>,
}

impl Kind<'_> {
    fn name(self) -> &'static str {
        match self {
            Kind::AllReduce(_) => "all-reduce",
            Kind::ReduceScatter => "reduce-scatter",
            Kind::AllGather => "all-gather",
            Kind::Broadcast(_) => "broadcast",
            Kind::ReduceChunks(_) => "bucket reduce",
        }
    }
}

/// Whether `chunks` are one per rank of `world`, consecutive from 0, together `n` values.
fn chunks_cover(chunks: &[std::ops::Range<usize>], world: usize, n: usize) -> bool {
    chunks.len() == world
        && chunks.first().is_some_and(|c| c.start == 0)
        && chunks.windows(2).all(|w| w[0].end == w[1].start && w[0].start <= w[0].end)
        && chunks.last().is_some_and(|c| c.start <= c.end && c.end == n)
}

impl CustomOp1 for Collective<'_> {
    fn name(&self) -> &'static str {
        "nccl-collective"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        candle_core::bail!("NCCL collectives take CUDA tensors; CPU tensors use the CPU ring")
    }

    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> candle_core::Result<(CudaStorage, Shape)> {
        let Some((start, end)) = l.contiguous_offsets() else {
            candle_core::bail!("NCCL collectives need a contiguous tensor")
        };
        match s.dtype() {
            DType::F32 => self.on::<f32>(s, start..end),
            DType::BF16 => self.on::<half::bf16>(s, start..end),
            DType::F16 => self.on::<half::f16>(s, start..end),
            other => candle_core::bail!("NCCL collectives take f32, bf16 or f16 tensors, not {other:?}"),
        }
    }
}

impl Collective<'_> {
    /// The collective on `s`'s values `range` of element type `T` (f32, bf16, f16: NCCL adds
    /// half-precision values in their type), into a fresh buffer of the same type, on the
    /// communicator's stream between two events (see the module's comment).
    fn on<T>(&self, s: &CudaStorage, range: std::ops::Range<usize>) -> candle_core::Result<(CudaStorage, Shape)>
    where
        T: NcclType
            + candle_core::cuda_backend::CudaDType
            + cudarc::driver::DeviceRepr
            + cudarc::driver::ValidAsZeroBits,
    {
        let dev = s.device();
        let (compute, stream) = (dev.cuda_stream(), &self.nccl.stream);
        let (n, world) = (range.len(), self.nccl.world);
        let src = s.as_cuda_slice::<T>()?.slice(range);
        let out_len = match self.kind {
            Kind::AllReduce(_) | Kind::Broadcast(_) => n,
            Kind::ReduceScatter if !n.is_multiple_of(world) => {
                candle_core::bail!("reduce-scatter of {n} values over {world} ranks: pad to a multiple")
            }
            Kind::ReduceScatter => n / world,
            Kind::AllGather => n * world,
            Kind::ReduceChunks(chunks) if !chunks_cover(chunks, world, n) => {
                candle_core::bail!("internal error: bucket chunks {chunks:?} do not cut {n} values among {world} ranks")
            }
            Kind::ReduceChunks(chunks) => chunks[self.nccl.rank].len(),
        };
        // Allocated (and zeroed) on the compute stream, before the event the collective waits on;
        // never empty (a rank without a chunk of a bucket still takes part in its reduces).
        let mut dst = dev.alloc_zeros::<T>(out_len.max(1))?;
        let no_timing = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DISABLE_TIMING);
        stream.wait(&compute.record_event(no_timing).map_err(CudaError::from)?).map_err(CudaError::from)?;
        // Watched from before the call, which may block on the host (NCCL connects to its peers
        // at a communicator's first collectives), to the event recorded after it; a call that
        // fails is not watched (the error goes back to the caller).
        let recorded: Arc<OnceLock<Option<Arc<CudaEvent>>>> = Arc::new(OnceLock::new());
        if let Some(watchdog) = &self.nccl.watchdog {
            let what = format!("{} of {n} {:?} values", self.kind.name(), s.dtype());
            let (recorded, context) = (recorded.clone(), stream.context().clone());
            watchdog.watch(what, move || match recorded.get() {
                None => false,
                Some(None) => true,
                Some(Some(done)) => completed(&context, done),
            });
        }
        let status = {
            let (send, _read) = src.device_ptr(stream);
            let (recv, _written) = dst.device_ptr_mut(stream);
            let (send, recv) = (send as *const core::ffi::c_void, recv as *mut core::ffi::c_void);
            let (comm, on) = (self.comm.0, stream.cu_stream() as _);
            let ty = T::as_nccl_type();
            let op = |op: ReduceOp| match op {
                ReduceOp::Sum => sys::ncclRedOp_t::ncclSum,
                ReduceOp::Max => sys::ncclRedOp_t::ncclMax,
            };
            // SAFETY: both buffers live on this device for `n` and `out_len` values, and the
            // compute stream waits for the collective before anything reads or frees them.
            unsafe {
                match self.kind {
                    Kind::AllReduce(reduce) => result::all_reduce(send, recv, n, ty, op(reduce), comm, on),
                    Kind::ReduceScatter => result::reduce_scatter(send, recv, out_len, ty, op(ReduceOp::Sum), comm, on),
                    Kind::AllGather => result::all_gather(send, recv, n, ty, comm, on),
                    Kind::Broadcast(root) => result::broadcast(send, recv, n, ty, root as i32, comm, on),
                    Kind::ReduceChunks(chunks) => reduce_chunks(send, recv, chunks, ty, size_of::<T>(), comm, on),
                }
            }
        };
        status.map_err(|e| {
            let _ = recorded.set(None);
            candle_core::Error::Cuda(
                format!(
                    "NCCL {} of {n} values failed on rank {}: {}",
                    self.kind.name(),
                    self.nccl.rank,
                    nccl_error(e.0)
                )
                .into(),
            )
        })?;
        let done = match stream.record_event(no_timing) {
            Ok(done) => Arc::new(done),
            Err(e) => {
                // The collective is enqueued: its buffers are freed on the compute stream when
                // this returns, so it must be over first.
                let _ = stream.synchronize();
                let _ = recorded.set(None);
                return Err(CudaError::from(e).into());
            }
        };
        let _ = recorded.set(Some(done.clone()));
        match self.deferred {
            Some(slot) => *slot.lock().unwrap_or_else(|e| e.into_inner()) = Some(done.clone()),
            None => compute.wait(&done).map_err(CudaError::from)?,
        }
        Ok((CudaStorage::wrap_cuda_slice(dst, dev.clone()), Shape::from(out_len)))
    }
}

/// Whether the work before `done` has completed, asked from the watchdog's thread: bound to the
/// device's context directly (cudarc's `bind_to_thread` would first take the errors its other
/// calls stored for the main thread to find), and an error counts as completed (the main thread's
/// next call reports it; waiting it out would name a hung peer instead).
fn completed(context: &cudarc::driver::CudaContext, done: &CudaEvent) -> bool {
    // SAFETY: the context is alive (held by the caller); making it current changes only this
    // thread's binding.
    let bound = unsafe { cudarc::driver::result::ctx::set_current(context.cu_ctx()) }.is_ok();
    bound && !matches!(done.try_is_complete(), Ok(false))
}

/// One `ncclReduce` of each non-empty chunk of `send` (values of NCCL type `ty`, `size` bytes
/// each) to the rank it belongs to, into `recv` there, grouped so that NCCL runs them as one
/// operation.
///
/// # Safety
/// `send` holds every chunk's values and `recv` this rank's chunk (at least one value), both on
/// the communicator's device and alive until the stream `on` has run the group.
unsafe fn reduce_chunks(
    send: *const core::ffi::c_void,
    recv: *mut core::ffi::c_void,
    chunks: &[std::ops::Range<usize>],
    ty: sys::ncclDataType_t,
    size: usize,
    comm: sys::ncclComm_t,
    on: sys::cudaStream_t,
) -> Result<result::NcclStatus, result::NcclError> {
    result::group_start()?;
    let mut status = Ok(result::NcclStatus::Success);
    for (root, chunk) in chunks.iter().enumerate().filter(|(_, c)| !c.is_empty()) {
        let from = send.cast::<u8>().add(chunk.start * size).cast::<core::ffi::c_void>();
        status = result::reduce(from, recv, chunk.len(), ty, sys::ncclRedOp_t::ncclSum, root as i32, comm, on);
        if status.is_err() {
            break;
        }
    }
    // The group is closed whatever happened inside it (NCCL reports a failed member here too).
    let ended = result::group_end();
    status.and(ended)
}

/// What a rank does with a collective stuck past `--dist-timeout`: one line naming it, the
/// rank and NCCL's asynchronous error (a network failure, or none: a peer that hangs or never
/// called it), the communicator aborted so that nothing waits on it, and the process ended
/// (the launcher then stops the other ranks). `comm` is `None` while the communicator is being
/// created (a peer that never joined). The process ends without its exit handlers: the CUDA
/// runtime's and NCCL's teardown could wait on the main thread, which may be stuck in a call.
fn exit_on_stuck(stuck: Stuck, comm: Option<RawComm>, rank: usize, world: usize, timeout: Duration) {
    let error = match comm {
        None => "no communicator yet: a peer rank did not join".to_string(),
        Some(comm) => {
            let mut code = sys::ncclResult_t::ncclSuccess;
            // SAFETY: the communicator is alive (the watchdog stops before it is destroyed).
            let asked = unsafe { sys::ncclCommGetAsyncError(comm.0, &mut code) };
            let error = match (asked, code) {
                (sys::ncclResult_t::ncclSuccess, sys::ncclResult_t::ncclSuccess) => {
                    "no NCCL error: a peer rank is hung, died or called another collective".to_string()
                }
                (sys::ncclResult_t::ncclSuccess, code) => format!("NCCL's asynchronous error: {}", nccl_error(code)),
                (failed, _) => format!("NCCL's error could not be read: {}", nccl_error(failed)),
            };
            // SAFETY: as above; NCCL allows an abort while a collective of the communicator hangs.
            let _ = unsafe { result::comm_abort(comm.0) };
            format!("{error}; the communicator was aborted")
        }
    };
    eprintln!(
        "error: rank {rank} of {world}: NCCL {} did not complete within --dist-timeout {}s ({} waited; {error}). Check the other ranks' logs, or raise --dist-timeout if a rank is only slow",
        stuck.what,
        timeout.as_secs(),
        humantime(stuck.waited)
    );
    // SAFETY: ends the process at once; the line above is written (stderr is unbuffered).
    unsafe { libc::_exit(1) };
}

fn humantime(d: Duration) -> String {
    format!("{:.1}s", d.as_secs_f64())
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        // The watchdog first: it holds the communicator's handle.
        self.watchdog.take();
        let comm = self.comm.lock().unwrap_or_else(|e| e.into_inner());
        // SAFETY: nothing uses the communicator after this; an abort never waits on a peer.
        let _ = unsafe { result::comm_abort(comm.0) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// At world size 1 (one GPU), a collective runs on the communicator's stream and its result
    /// is ordered before the compute stream's next use; the watchdog sees it complete. A
    /// collective that never completes (an event that is never recorded done) reaches the
    /// stuck handler with its name, which aborts the communicator.
    #[test]
    #[ignore = "needs a GPU: scripts/gpu-check.sh runs it (cargo test --features cuda -- --include-ignored)"]
    fn a_watched_collective_completes_and_a_stuck_one_is_reported() -> Result<()> {
        let gpu = crate::kernels::ops::test_support::gpu();
        let ring = TcpRing::single();
        let (tx, rx) = std::sync::mpsc::channel();
        // Long enough for NCCL's first init and connections (watched too), short for a test.
        let comm = NcclComm::create(&ring, &gpu, Duration::from_secs(5), move |stuck, raw| {
            // SAFETY: the test's communicator is alive until it is dropped below.
            let aborted = raw.is_some_and(|raw| unsafe { result::comm_abort(raw.0) }.is_ok());
            tx.send((stuck.what, aborted)).unwrap();
        })?;
        let x = Tensor::arange(0f32, 6f32, &gpu)?;
        let summed = comm.all_reduce(&(&x * 2.0)?, ReduceOp::Sum)?;
        assert_eq!(summed.to_vec1::<f32>()?, vec![0.0, 2.0, 4.0, 6.0, 8.0, 10.0]);
        let gathered = comm.all_gather(&x.to_dtype(DType::BF16)?)?;
        assert_eq!(gathered.to_dtype(DType::F32)?.to_vec1::<f32>()?, x.to_vec1::<f32>()?);
        // Deferred: the compute stream goes on, then waits when the handle is dropped.
        let (prefetched, deferred) = comm.all_gather_deferred(&(&x + 1.0)?)?;
        drop(deferred);
        assert_eq!(prefetched.to_vec1::<f32>()?, vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
        let (scattered, deferred) = comm.reduce_scatter_deferred(&(&x * 3.0)?)?;
        drop(deferred);
        assert_eq!(scattered.to_vec1::<f32>()?, vec![0.0, 3.0, 6.0, 9.0, 12.0, 15.0]);
        // A bucket's uneven chunks: at world size 1 the one chunk is the whole bucket, reduced
        // to rank 0 (in the wire's bf16 too); chunks that do not cut the bucket are refused.
        let whole = std::slice::from_ref(&(0..6));
        let (bucket, deferred) = comm.reduce_chunks_deferred(&(&x * 5.0)?, whole)?;
        drop(deferred);
        assert_eq!(bucket.to_vec1::<f32>()?, vec![0.0, 5.0, 10.0, 15.0, 20.0, 25.0]);
        let (bucket, deferred) = comm.reduce_chunks_deferred(&(&x - 1.0)?.to_dtype(DType::BF16)?, whole)?;
        drop(deferred);
        assert_eq!(bucket.to_dtype(DType::F32)?.to_vec1::<f32>()?, vec![-1.0, 0.0, 1.0, 2.0, 3.0, 4.0]);
        assert!(comm.reduce_chunks_deferred(&x, std::slice::from_ref(&(0..5))).is_err());
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        let dog = comm.watchdog.as_ref().expect("watched");
        while dog.in_flight() > 0 && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(dog.in_flight(), 0, "the collectives seen complete");
        dog.watch("all-gather of 8 BF16 values", || false);
        let (what, aborted) = rx.recv_timeout(Duration::from_secs(30)).expect("the stuck collective is reported");
        assert_eq!(what, "all-gather of 8 BF16 values");
        assert!(aborted);
        // Aborted already: dropping it must not abort twice.
        std::mem::forget(comm);
        Ok(())
    }
}
