//! Communication between the ranks of a job: who this process is (`env`), how the ranks find
//! each other (`store`), and the collectives (`tcp`: the CPU ring, `nccl`: CUDA tensors).
//! [`ProcessGroup`] is what the rest of the engine sees: all-reduce, reduce-scatter, all-gather,
//! broadcast and barrier on candle tensors, each routed to the backend that owns the tensor's
//! device, plus the scalar reductions (losses, norms, flags) that always go over the ring.

pub mod env;
#[cfg(feature = "nccl")]
pub mod nccl;
pub mod store;
pub mod tcp;

pub use env::RankEnv;
pub use tcp::{chunk, CommStats, ReduceOp};

use anyhow::{bail, Result};
use candle_core::{DType, Tensor};
use std::net::TcpListener;
use std::time::Duration;
use store::Registration;
use tcp::TcpRing;

/// The default wait for a peer, at rendezvous and in every collective (`--dist-timeout`).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

/// Refuses to run `what` as one of several ranks, for the steps that do not train data-parallel
/// yet: each rank would train alone and all would write the same output.
pub fn refuse_distributed(what: &str) -> Result<()> {
    let env = RankEnv::from_process()?;
    if env.is_distributed() {
        bail!(
            "{what} does not train across ranks yet (this process is rank {} of {} from the {} environment): \
             run it as one process (--deployment-type single_gpu)",
            env.rank,
            env.world,
            env.source
        );
    }
    Ok(())
}

/// The ranks of a job and the means to talk to them.
pub struct ProcessGroup {
    pub env: RankEnv,
    ring: TcpRing,
    #[cfg(feature = "nccl")]
    nccl: std::sync::OnceLock<nccl::NcclComm>,
}

impl ProcessGroup {
    /// One rank: every collective is the identity, nothing is opened.
    pub fn single() -> Self {
        Self::over(RankEnv::single(), TcpRing::single())
    }

    fn over(env: RankEnv, ring: TcpRing) -> Self {
        Self {
            env,
            ring,
            #[cfg(feature = "nccl")]
            nccl: std::sync::OnceLock::new(),
        }
    }

    /// Joins the job `env` describes: rank 0 serves the rendezvous store, the others register,
    /// and the ring is connected, all within `timeout`. `flags` are the settings every rank must
    /// share: a rank whose flags hash differently is refused, naming it.
    pub fn init(env: RankEnv, timeout: Duration, flags: &str) -> Result<Self> {
        if !env.is_distributed() {
            return Ok(Self::over(env, TcpRing::single()));
        }
        let listener = TcpListener::bind(("0.0.0.0", 0))?;
        let me = Registration {
            rank: env.rank,
            world: env.world,
            version: env!("CARGO_PKG_VERSION").to_string(),
            config: store::config_hash(flags),
            port: listener.local_addr()?.port(),
        };
        let peers = if env.rank == 0 {
            let store = store::bind_store(env.master_port)?;
            store::serve(&store, &me, &env.master_addr, timeout)?
        } else {
            store::join((&env.master_addr, env.master_port), &me, timeout)?
        };
        let ring = TcpRing::connect(env.rank, peers.addrs, listener, timeout)?;
        Ok(Self::over(env, ring))
    }

    pub fn rank(&self) -> usize {
        self.env.rank
    }

    pub fn world(&self) -> usize {
        self.env.world
    }

    /// Rank 0: the one that logs, writes metrics and saves models.
    pub fn is_first(&self) -> bool {
        self.env.rank == 0
    }

    /// Bytes sent and time spent in collectives so far.
    pub fn stats(&self) -> &CommStats {
        &self.ring.stats
    }

    #[cfg(feature = "nccl")]
    fn nccl_for(&self, t: &Tensor) -> Result<Option<&nccl::NcclComm>> {
        if !t.device().is_cuda() {
            return Ok(None);
        }
        if self.nccl.get().is_none() {
            let comm = nccl::NcclComm::new(&self.ring, t.device())?;
            let _ = self.nccl.set(comm);
        }
        Ok(self.nccl.get())
    }

    /// Runs a ring collective on a host copy of `t` (f32), for CPU tensors.
    fn on_host(&self, t: &Tensor, len: usize, f: impl FnOnce(&mut Vec<f32>) -> Result<()>) -> Result<Tensor> {
        if t.device().is_cuda() {
            bail!("collectives on CUDA tensors need the NCCL build (--features nccl)");
        }
        let mut v: Vec<f32> = t.flatten_all()?.to_dtype(DType::F32)?.to_vec1()?;
        f(&mut v)?;
        v.truncate(len);
        Ok(Tensor::from_vec(v, len, t.device())?)
    }

    /// The element-wise reduction over ranks of `t`, flattened (f32).
    pub fn all_reduce(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor> {
        if self.world() == 1 {
            return Ok(t.flatten_all()?);
        }
        #[cfg(feature = "nccl")]
        if let Some(c) = self.nccl_for(t)? {
            return c.all_reduce(t, op);
        }
        self.on_host(t, t.elem_count(), |v| self.ring.all_reduce(v, op))
    }

    /// The sum over ranks of this rank's chunk of `t` (flattened; its length a multiple of the
    /// world size, as NCCL requires): chunk `r` of `len / world` values on rank `r`.
    pub fn reduce_scatter(&self, t: &Tensor) -> Result<Tensor> {
        let (n, w) = (t.elem_count(), self.world());
        if n % w != 0 {
            bail!("reduce-scatter of {n} values over {w} ranks: pad the buffer to a multiple of the world size");
        }
        if w == 1 {
            return Ok(t.flatten_all()?);
        }
        #[cfg(feature = "nccl")]
        if let Some(c) = self.nccl_for(t)? {
            return c.reduce_scatter(t);
        }
        let r = self.rank();
        let t = t.flatten_all()?;
        let full = self.on_host(&t, n, |v| self.ring.reduce_scatter(v, ReduceOp::Sum).map(|_| ()))?;
        Ok(full.narrow(0, r * n / w, n / w)?.contiguous()?)
    }

    /// Every rank's `t` (flattened, same length on every rank) concatenated in rank order.
    pub fn all_gather(&self, t: &Tensor) -> Result<Tensor> {
        let (n, w, r) = (t.elem_count(), self.world(), self.rank());
        if w == 1 {
            return Ok(t.flatten_all()?);
        }
        #[cfg(feature = "nccl")]
        if let Some(c) = self.nccl_for(t)? {
            return c.all_gather(t);
        }
        let mine: Vec<f32> = t.flatten_all()?.to_dtype(DType::F32)?.to_vec1()?;
        let mut all = vec![0f32; n * w];
        all[r * n..(r + 1) * n].copy_from_slice(&mine);
        self.ring.all_gather(&mut all)?;
        Ok(Tensor::from_vec(all, n * w, t.device())?)
    }

    /// Rank `root`'s `t` (flattened) on every rank.
    pub fn broadcast(&self, t: &Tensor, root: usize) -> Result<Tensor> {
        if self.world() == 1 {
            return Ok(t.flatten_all()?);
        }
        #[cfg(feature = "nccl")]
        if let Some(c) = self.nccl_for(t)? {
            return c.broadcast(t, root);
        }
        self.on_host(t, t.elem_count(), |v| self.ring.broadcast(v, root))
    }

    /// Reduces host scalars (losses, squared norms, counts, flags) in f64 over the ring.
    pub fn all_reduce_scalars(&self, xs: &mut [f64], op: ReduceOp) -> Result<()> {
        self.ring.all_reduce(xs, op)
    }

    /// Sends rank `root`'s bytes to every rank.
    pub fn broadcast_bytes(&self, bytes: &mut [u8], root: usize) -> Result<()> {
        self.ring.broadcast_bytes(bytes, root)
    }

    /// Returns when every rank has reached it.
    pub fn barrier(&self) -> Result<()> {
        self.ring.barrier()
    }

    /// The group of the ranks that pass the same `color` (MPI's `Comm_split`), ranked in their
    /// order here; the rest of the environment (host, local rank) stays this process's. Every
    /// rank of this group calls it together.
    pub fn split(&self, color: usize) -> Result<ProcessGroup> {
        let ring = self.ring.split(color)?;
        let env = RankEnv { rank: ring.rank(), world: ring.world(), ..self.env.clone() };
        Ok(Self::over(env, ring))
    }
}

/// `world` process groups on loopback (one node), one per thread, each running `f`: multi-rank
/// unit tests.
#[cfg(test)]
pub(crate) fn on_groups<T: Send>(world: usize, f: impl Fn(ProcessGroup) -> Result<T> + Sync) -> Vec<Result<T>> {
    tcp::tests::on_ring_owned(world, |ring| {
        let (rank, world) = (ring.rank(), ring.world());
        let env = RankEnv { rank, world, local_rank: rank, local_world: world, ..RankEnv::single() };
        f(ProcessGroup::over(env, ring))
    })
}
