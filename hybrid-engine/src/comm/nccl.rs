//! The GPU backend: NCCL through cudarc, one communicator per group, created on the stream candle
//! computes on so that every collective is ordered after the kernels that produce its input
//! (no synchronisation needed). The unique id is made by rank 0 and sent to the others over the
//! CPU ring that the rendezvous built (NCCL's own bootstrap needs exactly this side channel).
//!
//! Each collective is a candle custom op whose CUDA forward calls NCCL into a fresh buffer, as
//! candle's `llama_multiprocess` example does, in the tensor's dtype (f32, bf16 or f16: tensor
//! parallelism's all-reduces in the compute dtype, half-precision gradient reductions); the CPU
//! forward refuses (CPU tensors go over the ring). `cudarc::nccl::Comm` is neither Send nor Sync; NCCL allows a communicator to be used
//! from any thread but not from two at once, so it sits behind a mutex, which makes process
//! groups shareable by the ops that tensor parallelism stores in candle's graph.

use crate::comm::tcp::{ReduceOp, TcpRing};
use anyhow::{anyhow, Result};
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc;
use candle_core::cuda_backend::cudarc::nccl::safe::{Comm, Id, NcclType, ReduceOp as NcclOp};
use candle_core::{CpuStorage, CudaStorage, CustomOp1, DType, Device, Layout, Shape, Tensor};
use std::sync::Mutex;

/// One NCCL communicator for the ranks of a group, on `device`'s stream.
pub struct NcclComm {
    comm: Mutex<SendComm>,
}

/// A communicator that may move between threads: NCCL forbids concurrent use of one
/// communicator, not use from another thread, and the mutex rules out concurrent use.
struct SendComm(Comm);

// SAFETY: see `SendComm`; every use goes through `NcclComm::comm`'s lock.
unsafe impl Send for SendComm {}

impl NcclComm {
    /// Creates the communicator collectively: every rank of `ring` calls this in the same order.
    pub fn new(ring: &TcpRing, device: &Device) -> Result<Self> {
        let cuda = device.as_cuda_device()?;
        let mut bytes = [0u8; 128];
        if ring.rank() == 0 {
            let id = Id::new().map_err(|e| anyhow!("NCCL could not make a unique id: {e:?}"))?;
            for (b, c) in bytes.iter_mut().zip(id.internal()) {
                *b = *c as u8;
            }
        }
        ring.broadcast_bytes(&mut bytes, 0)?;
        let id = Id::uninit(bytes.map(|b| b as core::ffi::c_char));
        let comm = Comm::from_rank(cuda.cuda_stream(), ring.rank(), ring.world(), id)
            .map_err(|e| anyhow!("NCCL could not create the communicator of rank {}: {e:?}", ring.rank()))?;
        Ok(Self { comm: Mutex::new(SendComm(comm)) })
    }

    fn run(&self, t: &Tensor, kind: Kind) -> Result<Tensor> {
        let t = t.flatten_all()?.contiguous()?;
        let comm = self.comm.lock().map_err(|_| anyhow!("an NCCL collective panicked earlier"))?;
        Ok(t.apply_op1_no_bwd(&Collective { comm: &comm.0, kind })?)
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
enum Kind {
    AllReduce(ReduceOp),
    ReduceScatter,
    AllGather,
    Broadcast(usize),
}

struct Collective<'a> {
    comm: &'a Comm,
    kind: Kind,
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
    /// half-precision values in their type), into a fresh buffer of the same type.
    fn on<T>(&self, s: &CudaStorage, range: std::ops::Range<usize>) -> candle_core::Result<(CudaStorage, Shape)>
    where
        T: NcclType
            + candle_core::cuda_backend::CudaDType
            + cudarc::driver::DeviceRepr
            + cudarc::driver::ValidAsZeroBits,
    {
        let dev = s.device();
        let n = range.len();
        let world = self.comm.world_size();
        let src = s.as_cuda_slice::<T>()?.slice(range);
        let err = |e| candle_core::Error::Cuda(format!("NCCL failed: {e:?}").into());
        let (out_len, out) = match self.kind {
            Kind::AllReduce(op) => {
                let mut dst = dev.alloc_zeros::<T>(n)?;
                let op = if op == ReduceOp::Sum { NcclOp::Sum } else { NcclOp::Max };
                self.comm.all_reduce(&src, &mut dst, &op).map_err(err)?;
                (n, dst)
            }
            Kind::ReduceScatter => {
                if !n.is_multiple_of(world) {
                    candle_core::bail!("reduce-scatter of {n} values over {world} ranks: pad to a multiple");
                }
                let mut dst = dev.alloc_zeros::<T>(n / world)?;
                self.comm.reduce_scatter(&src, &mut dst, &NcclOp::Sum).map_err(err)?;
                (n / world, dst)
            }
            Kind::AllGather => {
                let mut dst = dev.alloc_zeros::<T>(n * world)?;
                self.comm.all_gather(&src, &mut dst).map_err(err)?;
                (n * world, dst)
            }
            Kind::Broadcast(root) => {
                let mut dst = dev.alloc_zeros::<T>(n)?;
                self.comm.broadcast(Some(&src), &mut dst, root as i32).map_err(err)?;
                (n, dst)
            }
        };
        Ok((CudaStorage::wrap_cuda_slice(out, dev.clone()), Shape::from(out_len)))
    }
}
