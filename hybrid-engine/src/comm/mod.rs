//! Communication between the ranks of a job: who this process is (`env`), how the ranks find
//! each other (`store`), and the collectives (`tcp`: the CPU ring, `nccl`: CUDA tensors, watched
//! by `watchdog`).
//! [`ProcessGroup`] is what the rest of the engine sees: all-reduce, reduce-scatter, all-gather,
//! broadcast and barrier on candle tensors, each routed to the backend that owns the tensor's
//! device, plus the scalar reductions (losses, norms, flags) that always go over the ring.

pub mod env;
#[cfg(feature = "nccl")]
pub mod nccl;
pub mod store;
pub mod tcp;
pub mod watchdog;

pub use env::RankEnv;
pub use tcp::{chunk, CommStats, ReduceOp};

use crate::storage::contiguous_f32;
use anyhow::{bail, Result};
use candle_core::{DType, Tensor};
use std::net::TcpListener;
use std::time::Duration;
use store::Registration;
use tcp::TcpRing;

/// The default wait for a peer, at rendezvous and in every collective (`--dist-timeout`).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

/// The type values travel in through a reduction (DeepSpeed's `communication_data_type`):
/// fp32, or half precision for half the bytes, added in that type at every hop.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum WireDtype {
    #[default]
    F32,
    F16,
    Bf16,
}

impl WireDtype {
    /// DeepSpeed's names: `fp32`, `fp16`, `bf16` (also `float32`, `float16`, `bfloat16`).
    pub fn parse(name: &str) -> Result<Self> {
        match name {
            "fp32" | "float32" | "float" => Ok(Self::F32),
            "fp16" | "float16" | "half" => Ok(Self::F16),
            "bf16" | "bfloat16" => Ok(Self::Bf16),
            other => bail!("communication data type {other:?}: use fp32, fp16 or bf16"),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::F32 => "fp32",
            Self::F16 => "fp16",
            Self::Bf16 => "bf16",
        }
    }

    /// The candle dtype values travel as.
    pub fn dtype(self) -> DType {
        match self {
            Self::F32 => DType::F32,
            Self::F16 => DType::F16,
            Self::Bf16 => DType::BF16,
        }
    }
}

/// `$collective` (a ring collective written once for a buffer `$buf` of any element type) on
/// the f32 values `$v` sent as `$wire` values: on `$v` itself in fp32, else on a copy cast to
/// the wire type, whose result is cast back into `$v`.
macro_rules! over_wire {
    ($wire:expr, $v:expr, |$buf:ident| $collective:expr) => {
        match $wire {
            WireDtype::F32 => {
                let $buf = $v;
                $collective
            }
            WireDtype::F16 => through_wire($v, half::f16::from_f32, half::f16::to_f32, |$buf| $collective),
            WireDtype::Bf16 => through_wire($v, half::bf16::from_f32, half::bf16::to_f32, |$buf| $collective),
        }
    };
}

/// [`over_wire`]'s cast down, `collective` on the copy, cast back.
fn through_wire<T: Copy, R>(
    v: &mut [f32],
    down: fn(f32) -> T,
    up: fn(T) -> f32,
    collective: impl FnOnce(&mut [T]) -> Result<R>,
) -> Result<R> {
    let mut wire: Vec<T> = v.iter().map(|&x| down(x)).collect();
    let out = collective(&mut wire)?;
    v.iter_mut().zip(wire).for_each(|(x, w)| *x = up(w));
    Ok(out)
}

/// The ranks of a job and the means to talk to them.
pub struct ProcessGroup {
    pub env: RankEnv,
    ring: TcpRing,
    /// Which backend carries CUDA tensors.
    backend: Backend,
    #[cfg(feature = "nccl")]
    nccl: std::sync::OnceLock<nccl::NcclComm>,
}

/// What carries the collectives of CUDA tensors (Megatron's `--distributed-backend`); CPU
/// tensors always go over the ring.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Backend {
    /// NCCL where this build has it (`--features nccl`), else the ring.
    #[default]
    Nccl,
    /// The TCP ring (as torch's gloo): device tensors copied to host memory and back. Ranks
    /// sharing one GPU (which NCCL refuses), or a build without NCCL.
    Gloo,
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
            backend: Backend::default(),
            #[cfg(feature = "nccl")]
            nccl: std::sync::OnceLock::new(),
        }
    }

    /// Carries CUDA tensors' collectives over `backend` (this group's and its splits').
    pub fn with_backend(mut self, backend: Backend) -> Self {
        self.backend = backend;
        self
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
            let store = store::bind_store(env.store_port)?;
            store::serve(&store, &me, &env.master_addr, timeout)?
        } else {
            store::join((&env.master_addr, env.store_port), &me, timeout)?
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
        if !t.device().is_cuda() || self.backend == Backend::Gloo {
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
        let mut v = Vec::with_capacity(t.elem_count());
        extend_host_f32(&mut v, t)?;
        f(&mut v)?;
        v.truncate(len);
        Ok(Tensor::from_vec(v, len, t.device())?)
    }

    /// The element-wise reduction over ranks of `t`, flattened: f32 over the ring, in `t`'s
    /// dtype through NCCL (tensor parallelism's all-reduces of bf16/f16 activations).
    pub fn all_reduce(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor> {
        #[cfg(feature = "nccl")]
        if self.world() > 1 {
            if let Some(c) = self.nccl_for(t)? {
                return c.all_reduce(t, op);
            }
        }
        self.all_reduce_as(t, op, WireDtype::F32)
    }

    /// [`Self::all_reduce`] with the values sent and added as `wire` values (gradients under
    /// `--communication-data-type`; a CPU buffer, see [`WireDtype::check`]): the result in f32.
    pub fn all_reduce_as(&self, t: &Tensor, op: ReduceOp, wire: WireDtype) -> Result<Tensor> {
        if self.world() == 1 {
            return Ok(t.flatten_all()?);
        }
        #[cfg(feature = "nccl")]
        if let Some(c) = self.nccl_for(t)? {
            return Ok(c.all_reduce(&t.to_dtype(wire.dtype())?, op)?.to_dtype(DType::F32)?);
        }
        self.on_host(t, t.elem_count(), |v| over_wire!(wire, v, |buf| self.ring.all_reduce(buf, op)))
    }

    /// The mean over ranks of `parts` laid end to end (flattened), summed as `wire` values (see
    /// [`Self::all_reduce_as`]): CPU tensors are read in place into the ring's buffer, each
    /// dropped once copied (what the caller no longer holds is freed before the collective
    /// runs), not first concatenated, and divided in it (the bits of `sum / world`). Stage 0's
    /// gradient buckets.
    pub fn all_reduce_mean_parts_as(&self, parts: Vec<Tensor>, wire: WireDtype) -> Result<Tensor> {
        let world = self.world() as f64;
        if self.world() == 1 || parts.iter().any(|t| !t.device().is_cpu()) {
            let flat: Vec<Tensor> = parts.iter().map(|t| t.flatten_all()).collect::<candle_core::Result<_>>()?;
            drop(parts);
            return Ok((self.all_reduce_as(&Tensor::cat(&flat, 0)?, ReduceOp::Sum, wire)? / world)?);
        }
        let mut v = Vec::with_capacity(parts.iter().map(Tensor::elem_count).sum());
        for t in parts {
            extend_host_f32(&mut v, &t)?;
        }
        over_wire!(wire, &mut v[..], |buf| self.ring.all_reduce(buf, ReduceOp::Sum))?;
        // As candle divides a tensor by a number: times the f32 reciprocal, plus zero.
        let reciprocal = (1.0 / world) as f32;
        v.iter_mut().for_each(|x| *x = *x * reciprocal + 0.0);
        let len = v.len();
        Ok(Tensor::from_vec(v, len, &candle_core::Device::Cpu)?)
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
        self.reduce_scatter_on_host(vec![t.clone()], n, WireDtype::F32)
    }

    /// [`Self::reduce_scatter`] of `parts` laid end to end and zero-padded to `len` values
    /// ([`concat_padded`]). CPU tensors are read in place into the ring's buffer, not first
    /// concatenated: ZeRO's gradients are copied once on their way to the ring, not twice.
    pub fn reduce_scatter_parts(&self, parts: Vec<Tensor>, len: usize) -> Result<Tensor> {
        self.reduce_scatter_parts_as(parts, len, WireDtype::F32)
    }

    /// [`Self::reduce_scatter_parts`] with the values sent and added as `wire` values (see
    /// [`Self::all_reduce_as`]).
    pub fn reduce_scatter_parts_as(&self, parts: Vec<Tensor>, len: usize, wire: WireDtype) -> Result<Tensor> {
        let on_cpu = parts.iter().all(|t| t.device().is_cpu());
        if !on_cpu || self.world() == 1 {
            let padded = concat_padded(&parts, len)?.to_dtype(wire.dtype())?;
            return Ok(self.reduce_scatter(&padded)?.to_dtype(DType::F32)?);
        }
        if !len.is_multiple_of(self.world()) {
            bail!(
                "reduce-scatter of {len} values over {} ranks: pad the buffer to a multiple of the world size",
                self.world()
            );
        }
        self.reduce_scatter_on_host(parts, len, wire)
    }

    /// [`Self::reduce_scatter_parts_as`] in rounds of at most `round` values (ZeRO-3's
    /// `--reduce-bucket-size`): each round reduce-scatters the same stretch of every rank's chunk,
    /// read in place from `parts` (host f32; others converted once), so the collective's buffer
    /// is a round rather than the whole of `parts`. Each value keeps its owner and ring order:
    /// the same sums, bit for bit, and the same bytes. The parts are dropped at the end.
    pub fn reduce_scatter_parts_in_rounds_as(
        &self,
        parts: Vec<Tensor>,
        len: usize,
        round: usize,
        wire: WireDtype,
    ) -> Result<Tensor> {
        let w = self.world();
        let on_cpu = parts.iter().all(|t| t.device().is_cpu());
        if !on_cpu || w == 1 || !len.is_multiple_of(w) || round >= len {
            return self.reduce_scatter_parts_as(parts, len, wire);
        }
        let parts: Vec<Tensor> = parts
            .into_iter()
            .map(|t| {
                let host_f32 = t.dtype() == DType::F32 && t.is_contiguous();
                Ok(if host_f32 { t } else { t.to_dtype(DType::F32)?.contiguous()? })
            })
            .collect::<Result<_>>()?;
        let guards: Vec<_> = parts.iter().map(|t| t.storage_and_layout()).collect();
        let values: Vec<&[f32]> = guards
            .iter()
            .map(|(storage, layout)| match &**storage {
                candle_core::Storage::Cpu(s) => Ok(contiguous_f32(s, layout, "a reduce-scatter's part")?),
                _ => bail!("internal error: a host part left the host"),
            })
            .collect::<Result<_>>()?;
        let lens: Vec<usize> = values.iter().map(|v| v.len()).collect();
        let shard = len / w;
        let per_round = round.div_ceil(w).max(1);
        let mut mine = Vec::with_capacity(shard);
        let mut buf = Vec::with_capacity(per_round * w);
        for a in (0..shard).step_by(per_round) {
            let n = per_round.min(shard - a);
            buf.clear();
            for stretch in round_of_parts(&lens, shard, w, a, n) {
                match stretch {
                    Stretch::Part { part, at, n } => buf.extend_from_slice(&values[part][at..at + n]),
                    Stretch::Zeros(n) => buf.resize(buf.len() + n, 0.0),
                }
            }
            let chunk = over_wire!(wire, &mut buf[..], |b| self.ring.reduce_scatter(b, ReduceOp::Sum))?;
            mine.extend_from_slice(&buf[chunk]);
        }
        Ok(Tensor::from_vec(mine, shard, &candle_core::Device::Cpu)?)
    }

    /// [`Self::reduce_scatter_parts_in_rounds_as`] of device tensors, begun: each round's buffer
    /// is cut from `parts` by tensor copies on their device (the whole of them concatenated
    /// only where one round holds them), then reduce-scattered over NCCL on the communicator's
    /// stream, at most [`ROUNDS_IN_FLIGHT`] at a time (the compute stream waits for the oldest
    /// before a round beyond them is cut, so that a bucket's memory, not the unit's, is in
    /// flight), or over the ring through host memory, done at once. The same values in the same
    /// order as the host's rounds: the same sums and bytes.
    fn begin_reduce_scatter_rounds_of_tensors(
        &self,
        parts: Vec<Tensor>,
        len: usize,
        round: usize,
        wire: WireDtype,
    ) -> Result<Pending> {
        let w = self.world();
        let (shard, per_round) = (len / w, round.div_ceil(w).max(1));
        let flat: Vec<Tensor> =
            parts.iter().map(|t| t.flatten_all()?.to_dtype(DType::F32)).collect::<candle_core::Result<_>>()?;
        drop(parts);
        let lens: Vec<usize> = flat.iter().map(Tensor::elem_count).collect();
        let device = flat.first().map_or(candle_core::Device::Cpu, |t| t.device().clone());
        #[cfg(feature = "nccl")]
        let nccl = match flat.first() {
            Some(t) => self.nccl_for(t)?,
            None => None,
        };
        let mut pending = Pending::in_pieces(DType::F32);
        for a in (0..shard).step_by(per_round) {
            let n = per_round.min(shard - a);
            #[cfg(feature = "nccl")]
            if nccl.is_some() {
                pending.wait_for_all_but(ROUNDS_IN_FLIGHT - 1);
            }
            let pieces = round_of_parts(&lens, shard, w, a, n)
                .into_iter()
                .map(|stretch| match stretch {
                    Stretch::Part { part, at, n } => flat[part].narrow(0, at, n),
                    Stretch::Zeros(n) => Tensor::zeros(n, DType::F32, &device),
                })
                .collect::<candle_core::Result<Vec<_>>>()?;
            let buf = Tensor::cat(&pieces, 0)?;
            drop(pieces);
            #[cfg(feature = "nccl")]
            if let Some(c) = nccl {
                let (mine, deferred) = c.reduce_scatter_deferred(&buf.to_dtype(wire.dtype())?)?;
                pending.push(mine, Some(deferred));
                continue;
            }
            pending.push(self.reduce_scatter_on_host(vec![buf], w * n, wire)?, None);
        }
        Ok(pending)
    }

    /// The ring reduce-scatter of CPU `parts`, end to end and zero-padded to `len`, sent as
    /// `wire` values. Each part is dropped once copied into the ring's buffer: what the caller
    /// no longer holds (ZeRO-3's gradients, taken out of their store) is freed before the
    /// collective runs.
    fn reduce_scatter_on_host(&self, parts: Vec<Tensor>, len: usize, wire: WireDtype) -> Result<Tensor> {
        let device = parts.first().map_or(candle_core::Device::Cpu, |t| t.device().clone());
        let mut v = Vec::with_capacity(len);
        for t in parts {
            extend_host_f32(&mut v, &t)?;
        }
        if v.len() > len {
            bail!("internal error: {} values to reduce-scatter into {len}", v.len());
        }
        v.resize(len, 0.0);
        let mine = over_wire!(wire, &mut v[..], |buf| self.ring.reduce_scatter(buf, ReduceOp::Sum))?;
        Ok(Tensor::from_slice(&v[mine.clone()], mine.len(), &device)?)
    }

    /// The ring reduce-scatter (a sum) of the host buffer `v` cut into `chunks`, rank `r`'s
    /// `chunks[r]` (any sizes, the same on every rank), sent and added as `wire` values:
    /// afterwards `v[chunks[rank]]` holds this rank's sums. ZeRO-2's gradient buckets.
    pub fn reduce_scatter_chunks_as(
        &self,
        v: &mut [f32],
        chunks: &[std::ops::Range<usize>],
        wire: WireDtype,
    ) -> Result<std::ops::Range<usize>> {
        over_wire!(wire, v, |buf| self.ring.reduce_scatter_chunks(buf, chunks, ReduceOp::Sum))
    }

    /// Every rank's `t` (flattened, same length on every rank) concatenated in rank order.
    pub fn all_gather(&self, t: &Tensor) -> Result<Tensor> {
        let (n, w) = (t.elem_count(), self.world());
        if w == 1 {
            return Ok(t.flatten_all()?);
        }
        #[cfg(feature = "nccl")]
        if let Some(c) = self.nccl_for(t)? {
            return c.all_gather(t);
        }
        let all = self.all_gather_on_host(n, |all| extend_host_f32(all, t))?;
        Ok(Tensor::from_vec(all, n * w, t.device())?)
    }

    /// [`Self::all_gather`] of this rank's `mine`, the result on `device`. On the CPU `mine` is
    /// copied once, straight into its slot of the ring's buffer (ZeRO-3 gathers a unit's
    /// weights from the shard so at every forward and backward).
    pub fn all_gather_slice(&self, mine: &[f32], device: &candle_core::Device) -> Result<Tensor> {
        let (n, w) = (mine.len(), self.world());
        if w == 1 || !device.is_cpu() {
            return self.all_gather(&Tensor::from_slice(mine, n, device)?);
        }
        let all = self.all_gather_on_host(n, |all| {
            all.extend_from_slice(mine);
            Ok(())
        })?;
        Ok(Tensor::from_vec(all, n * w, device)?)
    }

    /// [`Self::all_gather_slice`] with the values sent as `dtype` (f32, f16 or bf16): the result
    /// a `dtype` tensor. ZeRO stages 1 and 2 under mixed precision gather the updated weights
    /// so, straight into the compute copy, in half the bytes of fp32.
    pub fn all_gather_slice_as(&self, mine: &[f32], dtype: DType, device: &candle_core::Device) -> Result<Tensor> {
        fn gathered<T: tcp::Element + candle_core::WithDType>(
            group: &ProcessGroup,
            mine: &[f32],
            down: fn(f32) -> T,
            device: &candle_core::Device,
        ) -> Result<Tensor> {
            let all = group.all_gather_host(mine, down)?;
            let len = all.len();
            Ok(Tensor::from_vec(all, len, device)?)
        }
        match dtype {
            _ if self.world() == 1 => Ok(self.all_gather_slice(mine, device)?.to_dtype(dtype)?),
            // NCCL gathers the values in `dtype` on the device (the ring in f32).
            _ if !device.is_cpu() => {
                Ok(self.all_gather(&Tensor::from_slice(mine, mine.len(), device)?.to_dtype(dtype)?)?.to_dtype(dtype)?)
            }
            DType::F16 => gathered(self, mine, half::f16::from_f32, device),
            DType::BF16 => gathered(self, mine, half::bf16::from_f32, device),
            DType::F32 => self.all_gather_slice(mine, device),
            other => bail!("internal error: weights gathered as {other:?}"),
        }
    }

    /// [`Self::all_gather_slice_as`] of values held as a tensor where they live (a ZeRO-3 shard
    /// kept on the GPU: fp32 masters, or a frozen model's in its compute dtype), the result on
    /// `mine`'s device: NCCL gathers them there in `dtype` without a trip through host memory;
    /// in host memory (and over the TCP ring from a GPU) the same bytes as from a slice. Always
    /// a fresh tensor, never a view of `mine`.
    pub fn all_gather_tensor_as(&self, mine: &Tensor, dtype: DType) -> Result<Tensor> {
        let device = mine.device();
        if device.is_cpu() {
            return self.all_gather_slice_as(&host_f32(mine)?, dtype, device);
        }
        let cast = match mine.dtype() == dtype {
            true => mine.flatten_all()?.copy()?,
            false => mine.flatten_all()?.to_dtype(dtype)?,
        };
        Ok(self.all_gather(&cast)?.to_dtype(dtype)?)
    }

    /// [`Self::all_gather_tensor_as`] begun, to be read later ([`Pending::ready`]): over NCCL
    /// it runs on the communicator's stream while the compute stream goes on (ZeRO-3's prefetch
    /// of the next unit); elsewhere it is done at once.
    pub fn begin_all_gather_tensor_as(&self, mine: &Tensor, dtype: DType) -> Result<Pending> {
        #[cfg(feature = "nccl")]
        if self.world() > 1 {
            if let Some(c) = self.nccl_for(mine)? {
                let (tensor, deferred) = c.all_gather_deferred(&mine.flatten_all()?.to_dtype(dtype)?)?;
                return Ok(Pending::deferred(tensor, dtype, deferred));
            }
        }
        Ok(Pending::done(self.all_gather_tensor_as(mine, dtype)?))
    }

    /// [`Self::reduce_scatter_parts_in_rounds_as`] begun, read later as f32: over NCCL it runs
    /// on the communicator's stream while the compute stream goes on (ZeRO-3's reduce-scatter
    /// of a unit's gradient during the next unit's backward); elsewhere it is done at once.
    /// Device tensors are cut into rounds on their device
    /// ([`Self::begin_reduce_scatter_rounds_of_tensors`]; one round where `round` holds them
    /// all, DeepSpeed's default), host tensors read in place.
    pub fn begin_reduce_scatter_parts_in_rounds_as(
        &self,
        parts: Vec<Tensor>,
        len: usize,
        round: usize,
        wire: WireDtype,
    ) -> Result<Pending> {
        let w = self.world();
        let on_device = !parts.is_empty() && parts.iter().all(|t| !t.device().is_cpu());
        if w > 1 && len.is_multiple_of(w) && on_device {
            return self.begin_reduce_scatter_rounds_of_tensors(parts, len, round, wire);
        }
        Ok(Pending::done(self.reduce_scatter_parts_in_rounds_as(parts, len, round, wire)?))
    }

    /// The sums over ranks of `bucket`'s consecutive `chunks` (one per rank, any lengths,
    /// together the whole bucket), rank r's delivered to rank r only and read later as f32 on
    /// `bucket`'s device (empty where this rank has no chunk): ZeRO-2's gradient bucket during
    /// backward. Sent and added as `wire` values. Over NCCL a reduce per chunk to its rank, on
    /// the communicator's stream while the compute stream goes on; elsewhere the ring's uneven
    /// reduce-scatter ([`Self::reduce_scatter_chunks_as`]) on a host copy, done at once.
    pub fn begin_reduce_chunks_as(
        &self,
        bucket: &Tensor,
        chunks: &[std::ops::Range<usize>],
        wire: WireDtype,
    ) -> Result<Pending> {
        #[cfg(feature = "nccl")]
        if let Some(c) = self.nccl_for(bucket)? {
            let (tensor, deferred) = c.reduce_chunks_deferred(&bucket.to_dtype(wire.dtype())?, chunks)?;
            return Ok(Pending::deferred(tensor, DType::F32, deferred));
        }
        let mut values = host_f32(bucket)?;
        let mine = self.reduce_scatter_chunks_as(&mut values, chunks, wire)?;
        let n = mine.len();
        values.truncate(mine.end);
        values.drain(..mine.start);
        // An empty result is never read: kept off the device (no zero-length upload).
        let device = if n == 0 { &candle_core::Device::Cpu } else { bucket.device() };
        Ok(Pending::done(Tensor::from_vec(values, n, device)?))
    }

    /// Every rank's `mine` as `T` values (cast by `down`), in rank order: the ring's own buffer.
    fn all_gather_host<T: tcp::Element>(&self, mine: &[f32], down: fn(f32) -> T) -> Result<Vec<T>> {
        let (n, w, r) = (mine.len(), self.world(), self.rank());
        let mut all = vec![T::default(); n * w];
        all[r * n..(r + 1) * n].iter_mut().zip(mine).for_each(|(a, &x)| *a = down(x));
        self.ring.all_gather(&mut all)?;
        Ok(all)
    }

    /// [`Self::all_gather_slice_as`] cut into consecutive tensors of `shapes` (the padding after
    /// them dropped), each a candle variable: ZeRO-3's trained weights gathered for a backward,
    /// whose gradients land in them. In host memory the first keeps the ring's buffer (the outer
    /// unit's embeddings, its largest tensor, are not copied) and the others are copied out of
    /// it; on a device each is copied from the gathered tensor.
    pub fn all_gather_slice_as_variables(
        &self,
        mine: &[f32],
        dtype: DType,
        shapes: &[&candle_core::Shape],
        device: &candle_core::Device,
    ) -> Result<Vec<candle_core::Var>> {
        fn split<T: candle_core::WithDType>(
            mut all: Vec<T>,
            shapes: &[&candle_core::Shape],
            device: &candle_core::Device,
        ) -> Result<Vec<candle_core::Var>> {
            let Some((first, rest)) = shapes.split_first() else { return Ok(Vec::new()) };
            let mut at = first.elem_count();
            let mut others = Vec::with_capacity(rest.len());
            for &shape in rest {
                let n = shape.elem_count();
                others.push(candle_core::Var::from_slice(&all[at..at + n], shape, device)?);
                at += n;
            }
            all.truncate(first.elem_count());
            all.shrink_to_fit();
            let mut vars = vec![candle_core::Var::from_vec(all, *first, device)?];
            vars.extend(others);
            Ok(vars)
        }
        if !device.is_cpu() {
            return split_variables(&self.all_gather_slice_as(mine, dtype, device)?, shapes);
        }
        match dtype {
            DType::F32 => split(self.all_gather_host(mine, |x| x)?, shapes, device),
            DType::F16 => split(self.all_gather_host(mine, half::f16::from_f32)?, shapes, device),
            DType::BF16 => split(self.all_gather_host(mine, half::bf16::from_f32)?, shapes, device),
            other => bail!("internal error: weights gathered as {other:?}"),
        }
    }

    /// The ring all-gather of `n` values a rank, this rank's appended to the buffer by `fill`
    /// in their slot.
    fn all_gather_on_host(&self, n: usize, fill: impl FnOnce(&mut Vec<f32>) -> Result<()>) -> Result<Vec<f32>> {
        let (w, r) = (self.world(), self.rank());
        let mut all = Vec::with_capacity(n * w);
        all.resize(r * n, 0.0);
        fill(&mut all)?;
        all.resize(n * w, 0.0);
        self.ring.all_gather(&mut all)?;
        Ok(all)
    }

    /// Every rank's `mine` (its chunk of `len` values: `len / world` each when it divides),
    /// concatenated in rank order on rank 0, a host tensor; `None` on the others, which never
    /// hold more than a chunk (saves consolidate optimizer state this way, not by all-gathers).
    pub fn gather_to_first(&self, mine: &[f32], len: usize) -> Result<Option<Tensor>> {
        let all = self.ring.gather(mine, len, 0)?;
        Ok(all.map(|all| Tensor::from_vec(all, len, &candle_core::Device::Cpu)).transpose()?)
    }

    /// Rank `root`'s `t` (flattened, in its dtype) on every rank. The ring carries it as f32,
    /// which holds f16 and bf16 values exactly.
    pub fn broadcast(&self, t: &Tensor, root: usize) -> Result<Tensor> {
        if self.world() == 1 {
            return Ok(t.flatten_all()?);
        }
        #[cfg(feature = "nccl")]
        if let Some(c) = self.nccl_for(t)? {
            return c.broadcast(t, root);
        }
        Ok(self.on_host(t, t.elem_count(), |v| self.ring.broadcast(v, root))?.to_dtype(t.dtype())?)
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
        Ok(Self::over(env, ring).with_backend(self.backend))
    }
}

/// `parts` flattened, laid end to end and zero-padded to `len` values (f32 padding).
pub fn concat_padded(parts: &[Tensor], len: usize) -> Result<Tensor> {
    let device = parts.first().map_or(candle_core::Device::Cpu, |t| t.device().clone());
    let mut flat: Vec<Tensor> = parts.iter().map(|t| t.flatten_all()).collect::<candle_core::Result<_>>()?;
    let n: usize = flat.iter().map(Tensor::elem_count).sum();
    if n > len {
        bail!("internal error: {n} values to pad to {len}");
    }
    if len > n {
        flat.push(Tensor::zeros(len - n, DType::F32, &device)?);
    }
    Ok(Tensor::cat(&flat, 0)?)
}

/// Appends `t`'s values as f32 to `out`: read in place when `t` is a contiguous f32 CPU tensor
/// (one copy), converted otherwise. CUDA tensors are refused: they go through NCCL.
fn extend_host_f32(out: &mut Vec<f32>, t: &Tensor) -> Result<()> {
    if !t.device().is_cpu() {
        // A device tensor over the ring (`--distributed-backend gloo`, or no NCCL in the build).
        return extend_host_f32(out, &t.to_device(&candle_core::Device::Cpu)?);
    }
    {
        let (storage, layout) = t.storage_and_layout();
        if let candle_core::Storage::Cpu(s) = &*storage {
            if let Ok(values) = contiguous_f32(s, layout, "a collective's input") {
                out.extend_from_slice(values);
                return Ok(());
            }
        }
    }
    out.extend(t.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?);
    Ok(())
}

/// A collective begun ([`ProcessGroup::begin_all_gather_tensor_as`],
/// [`ProcessGroup::begin_reduce_scatter_parts_in_rounds_as`]), or several whose results are
/// consecutive pieces of one (a reduce-scatter in rounds).
pub struct Pending {
    /// First, so that they are dropped first (fields drop in order): the compute stream then
    /// waits for the collectives before their results' memory can be freed and handed to
    /// another kernel.
    #[cfg(feature = "nccl")]
    deferred: std::collections::VecDeque<nccl::Deferred>,
    /// The result, in pieces read as one.
    pieces: Vec<Tensor>,
    /// The dtype it is read in.
    dtype: DType,
}

/// Rounds of a reduce-scatter in flight at once over NCCL: one reduced while the next is cut.
pub const ROUNDS_IN_FLIGHT: usize = 2;

impl Pending {
    /// A collective done already.
    fn done(tensor: Tensor) -> Self {
        let dtype = tensor.dtype();
        let mut done = Self::in_pieces(dtype);
        done.pieces.push(tensor);
        done
    }

    /// Nothing yet; results to be read in `dtype`.
    fn in_pieces(dtype: DType) -> Self {
        Self {
            #[cfg(feature = "nccl")]
            deferred: std::collections::VecDeque::new(),
            pieces: Vec::new(),
            dtype,
        }
    }

    /// A collective on NCCL's stream, its result `tensor` read in `dtype`.
    #[cfg(feature = "nccl")]
    fn deferred(tensor: Tensor, dtype: DType, deferred: nccl::Deferred) -> Self {
        let mut pending = Self::in_pieces(dtype);
        pending.push(tensor, Some(deferred));
        pending
    }

    /// The next piece of the result, and the collective that makes it where it is not done.
    #[cfg(feature = "nccl")]
    fn push(&mut self, piece: Tensor, deferred: Option<nccl::Deferred>) {
        self.pieces.push(piece);
        self.deferred.extend(deferred);
    }
    #[cfg(not(feature = "nccl"))]
    fn push(&mut self, piece: Tensor, _done: Option<std::convert::Infallible>) {
        self.pieces.push(piece);
    }

    /// Orders the compute stream after all but the last `left` collectives.
    #[cfg(feature = "nccl")]
    fn wait_for_all_but(&mut self, left: usize) {
        while self.deferred.len() > left {
            self.deferred.pop_front();
        }
    }

    /// Orders the compute stream after the collectives without reading their result (a bucket
    /// reduce that delivered nothing to this rank).
    pub fn wait(self) {
        #[cfg(feature = "nccl")]
        drop(self.deferred);
    }

    /// Its result, once the compute stream is ordered after the collectives (their handles
    /// dropped first: the pieces are read after).
    pub fn ready(mut self) -> Result<Tensor> {
        #[cfg(feature = "nccl")]
        self.deferred.clear();
        let whole = match self.pieces.len() {
            1 => self.pieces.pop().expect("one piece"),
            _ => Tensor::cat(&self.pieces, 0)?,
        };
        Ok(whole.to_dtype(self.dtype)?)
    }

    /// [`Self::ready`] cut into variables of `shapes`, copied out of the gathered buffer.
    pub fn ready_as_variables(self, shapes: &[&candle_core::Shape]) -> Result<Vec<candle_core::Var>> {
        split_variables(&self.ready()?, shapes)
    }
}

/// Where values of a reduce-scatter in rounds come from ([`round_of_parts`]).
#[derive(Debug, PartialEq)]
enum Stretch {
    /// `n` values of part `part` from its value `at`.
    Part { part: usize, at: usize, n: usize },
    /// `n` zeros (the padding past the parts' end).
    Zeros(usize),
}

/// The buffer of the round at `a` of a reduce-scatter in rounds of `n` values a rank, of parts
/// of `lens` values laid end to end and zero-padded to `world` chunks of `shard`: for each rank
/// in order, the `n` values from `r * shard + a`.
fn round_of_parts(lens: &[usize], shard: usize, world: usize, a: usize, n: usize) -> Vec<Stretch> {
    let mut stretches = Vec::new();
    for r in 0..world {
        let (mut at, mut left, mut start) = (r * shard + a, n, 0);
        for (part, &len) in lens.iter().enumerate() {
            if left > 0 && at < start + len {
                let take = (start + len - at).min(left);
                stretches.push(Stretch::Part { part, at: at - start, n: take });
                (at, left) = (at + take, left - take);
            }
            start += len;
        }
        if left > 0 {
            stretches.push(Stretch::Zeros(left));
        }
    }
    stretches
}

/// `t`'s values (any float dtype) as f32 in host memory ([`extend_host_f32`]).
fn host_f32(t: &Tensor) -> Result<Vec<f32>> {
    let mut values = Vec::with_capacity(t.elem_count());
    extend_host_f32(&mut values, t)?;
    Ok(values)
}

/// Consecutive variables of `shapes` copied out of the gathered `full` (its padding after them
/// dropped): a unit's weights gathered on a device for a backward.
fn split_variables(full: &Tensor, shapes: &[&candle_core::Shape]) -> Result<Vec<candle_core::Var>> {
    let mut at = 0;
    let mut vars = Vec::with_capacity(shapes.len());
    for &shape in shapes {
        let n = shape.elem_count();
        vars.push(candle_core::Var::from_tensor(&full.narrow(0, at, n)?.reshape(shape)?)?);
        at += n;
    }
    Ok(vars)
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

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// A broadcast gives every rank the root's tensor, flattened, in its own dtype (bf16 here,
    /// carried exactly as f32), and the root's bytes; a barrier returns on no rank before the
    /// last one has reached it (the late rank arrives 100 ms after the others).
    #[test]
    fn broadcasts_reach_every_rank_and_a_barrier_waits_for_the_last() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        let arrived = AtomicUsize::new(0);
        let values = |r: usize| (0..6).map(|i| i as f32 * 0.5 - 10.0 * r as f32).collect::<Vec<f32>>();
        let results = on_groups(3, |group| {
            let r = group.rank();
            let mine = Tensor::from_vec(values(r), (2, 3), &Device::Cpu)?.to_dtype(DType::BF16)?;
            let got = group.broadcast(&mine, 1)?;
            let mut bytes = [r as u8; 5];
            group.broadcast_bytes(&mut bytes, 2)?;
            if r == 2 {
                std::thread::sleep(std::time::Duration::from_millis(100));
            }
            arrived.fetch_add(1, Ordering::SeqCst);
            group.barrier()?;
            let seen = arrived.load(Ordering::SeqCst);
            Ok((got.dtype(), got.dims().to_vec(), got.to_dtype(DType::F32)?.to_vec1::<f32>()?, bytes, seen))
        });
        for (r, res) in results.into_iter().enumerate() {
            let (dtype, dims, got, bytes, seen) = res.unwrap();
            assert_eq!((dtype, dims, got), (DType::BF16, vec![6], values(1)), "rank {r}: rank 1's tensor");
            assert_eq!(bytes, [2; 5], "rank {r}: rank 2's bytes");
            assert_eq!(seen, 3, "rank {r} left the barrier before every rank reached it");
        }
    }

    /// Parts laid end to end: padded with zeros to the length asked, exactly that length
    /// without padding, refused when longer.
    #[test]
    fn concat_padded_pads_to_the_length_and_refuses_more() -> Result<()> {
        let parts = [Tensor::new(&[[1f32, 2.], [3., 4.]], &Device::Cpu)?, Tensor::new(&[5f32], &Device::Cpu)?];
        assert_eq!(concat_padded(&parts, 7)?.to_vec1::<f32>()?, [1., 2., 3., 4., 5., 0., 0.]);
        assert_eq!(concat_padded(&parts, 5)?.to_vec1::<f32>()?, [1., 2., 3., 4., 5.]);
        let err = concat_padded(&parts, 4).unwrap_err().to_string();
        assert_eq!(err, "internal error: 5 values to pad to 4");
        Ok(())
    }

    /// `--communication-data-type` takes DeepSpeed's names and torch's, and names its value
    /// as DeepSpeed does; anything else is refused naming the choices.
    #[test]
    fn wire_types_parse_deepspeeds_and_torchs_names() {
        for (names, wire, dtype) in [
            (&["fp32", "float32", "float"][..], WireDtype::F32, DType::F32),
            (&["fp16", "float16", "half"], WireDtype::F16, DType::F16),
            (&["bf16", "bfloat16"], WireDtype::Bf16, DType::BF16),
        ] {
            for name in names {
                assert_eq!(WireDtype::parse(name).unwrap(), wire, "{name}");
            }
            assert_eq!((WireDtype::parse(wire.name()).unwrap(), wire.dtype()), (wire, dtype));
        }
        assert_eq!(WireDtype::default(), WireDtype::F32);
        let err = WireDtype::parse("fp8").unwrap_err().to_string();
        assert_eq!(err, "communication data type \"fp8\": use fp32, fp16 or bf16");
    }

    /// ZeRO-3's reduce-scatter in rounds is the one-call reduce-scatter bit for bit in the same
    /// bytes, whatever the round (one that divides no chunk, one value, a chunk) and the wire;
    /// its gather into variables is the gather cut, each part a variable.
    #[test]
    fn rounds_and_variables_are_the_one_call_collectives() {
        for world in [2, 3] {
            let results = on_groups(world, |group| {
                let r = group.rank() as f32;
                // Parts of 7 and 4 values (one a transposed view, one bf16), padded to 12 or 15.
                let a = Tensor::arange(0f32, 7., &Device::Cpu)?.affine(1.0 / 3.0, r as f64)?;
                let b = Tensor::new(&[[0.1f32 + r, -2.0], [3.5, 1e-3 * r]], &Device::Cpu)?.t()?;
                let b16 = b.to_dtype(DType::BF16)?;
                let len = 11usize.next_multiple_of(world);
                let bytes = || group.stats().snapshot().0;
                for wire in [WireDtype::F32, WireDtype::Bf16] {
                    let before = bytes();
                    let want = group.reduce_scatter_parts_as(vec![a.clone(), b16.clone()], len, wire)?;
                    let sent = bytes() - before;
                    for round in [1, 5, len / world, len] {
                        let before = bytes();
                        let got =
                            group.reduce_scatter_parts_in_rounds_as(vec![a.clone(), b16.clone()], len, round, wire)?;
                        assert_eq!(bytes() - before, sent, "round {round}: the same bytes");
                        assert_eq!(got.to_vec1::<f32>()?, want.to_vec1::<f32>()?, "round {round}, {wire:?}");
                        // A device's rounds, cut by tensor copies (here of CPU tensors).
                        let before = bytes();
                        let parts = vec![a.clone(), b16.clone()];
                        let got = group.begin_reduce_scatter_rounds_of_tensors(parts, len, round, wire)?.ready()?;
                        assert_eq!(bytes() - before, sent, "round {round} as tensors: the same bytes");
                        let bits = |t: &Tensor| {
                            Ok::<_, anyhow::Error>(t.to_vec1::<f32>()?.iter().map(|x| x.to_bits()).collect::<Vec<_>>())
                        };
                        assert_eq!(bits(&got)?, bits(&want)?, "round {round} as tensors, {wire:?}");
                    }
                }
                let mine: Vec<f32> = (0..len / world).map(|i| i as f32 + 10.0 * r).collect();
                let full = group.all_gather_slice_as(&mine, DType::BF16, &Device::Cpu)?;
                let shapes = [candle_core::Shape::from((2, 3)), candle_core::Shape::from(4)];
                let shapes: Vec<&candle_core::Shape> = shapes.iter().collect();
                let vars = group.all_gather_slice_as_variables(&mine, DType::BF16, &shapes, &Device::Cpu)?;
                let cut = [full.narrow(0, 0, 6)?.reshape((2, 3))?, full.narrow(0, 6, 4)?];
                for (var, want) in vars.iter().zip(&cut) {
                    assert!(var.as_tensor().is_variable());
                    assert_eq!(var.shape(), want.shape());
                    let values = |t: &Tensor| t.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>();
                    assert_eq!(values(var.as_tensor())?, values(want)?);
                }
                Ok(())
            });
            for res in results {
                res.unwrap();
            }
        }
    }

    /// A round's buffer, by hand: parts of 3 and 2 values padded to 2 chunks of 3, in rounds of
    /// 2 values a rank: each rank's stretch in rank order, cut where a part ends, the padding
    /// as zeros.
    #[test]
    fn a_rounds_buffer_is_each_ranks_stretch_of_the_parts() {
        let (part, zeros) = (|part, at, n| Stretch::Part { part, at, n }, Stretch::Zeros);
        assert_eq!(round_of_parts(&[3, 2], 3, 2, 0, 2), vec![part(0, 0, 2), part(1, 0, 2)]);
        assert_eq!(round_of_parts(&[3, 2], 3, 2, 2, 1), vec![part(0, 2, 1), zeros(1)]);
        // A stretch across two parts, and the whole in one round (the padded concatenation).
        assert_eq!(round_of_parts(&[2, 1, 2], 3, 2, 0, 3), vec![part(0, 0, 2), part(1, 0, 1), part(2, 0, 2), zeros(1)]);
        assert_eq!(round_of_parts(&[4], 2, 3, 1, 1), vec![part(0, 1, 1), part(0, 3, 1), zeros(1)]);
    }

    /// Weights gathered as bf16 or f16 are the f32 gather cast, in half its bytes on the ring.
    #[test]
    fn all_gather_in_half_precision_is_the_cast_f32_gather_in_half_the_bytes() {
        for world in [2, 3] {
            let results = on_groups(world, |group| {
                let r = group.rank() as f32;
                let mine: Vec<f32> = (0..5).map(|i| 1.0 + i as f32 / 3.0 + r * 1e3).collect();
                let bytes = || group.stats().snapshot().0;
                let before = bytes();
                let f32s = group.all_gather_slice(&mine, &Device::Cpu)?;
                let f32_bytes = bytes() - before;
                // The ring's volume: each rank sends the other ranks' 5 values on, 4 bytes each.
                assert_eq!(f32_bytes, (world as u64 - 1) * 5 * 4, "{world} ranks");
                for dtype in [DType::BF16, DType::F16] {
                    let before = bytes();
                    let got = group.all_gather_slice_as(&mine, dtype, &Device::Cpu)?;
                    assert_eq!(2 * (bytes() - before), f32_bytes, "{dtype:?}: half the bytes");
                    assert_eq!(got.dtype(), dtype);
                    let want = f32s.to_dtype(dtype)?.to_dtype(DType::F32)?.to_vec1::<f32>()?;
                    assert_eq!(got.to_dtype(DType::F32)?.to_vec1::<f32>()?, want, "{dtype:?}");
                }
                Ok(())
            });
            results.into_iter().for_each(|r| r.unwrap());
        }
    }

    /// The in-place host paths give what the plain collectives give on the concatenation: parts
    /// contiguous, transposed (copied) and a slice at an offset, padding, 2 and 3 ranks; the
    /// all-reduce of parts their whole sum.
    #[test]
    fn reduce_scatter_parts_and_all_gather_slice_equal_the_plain_collectives() {
        for world in [2, 3] {
            let results = on_groups(world, |group| {
                let r = group.rank() as f32;
                let dev = Device::Cpu;
                let a = Tensor::arange(0f32, 6., &dev)?.affine(1.0, f64::from(r))?.reshape((2, 3))?;
                let b = Tensor::arange(0f32, 6., &dev)?.affine(f64::from(r + 1.0), 0.0)?.reshape((3, 2))?.t()?;
                let c = Tensor::new(&[9f32, 1.5, -2.0], &dev)?.affine(1.0, f64::from(r))?.narrow(0, 1, 2)?;
                let len = 15usize.next_multiple_of(group.world());
                let parts = [a, b, c];
                let got = group.reduce_scatter_parts(parts.to_vec(), len)?.to_vec1::<f32>()?;
                let want = group.reduce_scatter(&concat_padded(&parts, len)?)?.to_vec1::<f32>()?;
                // By hand: rank q's values are a + q, the transpose's [0, 2, 4, 1, 3, 5] (q + 1),
                // [1.5, -2] + q, then zeros; this rank keeps its chunk of their sum over ranks.
                let per_rank = |q: f32| -> Vec<f32> {
                    let a = (0..6).map(|i| i as f32 + q);
                    let b = [0f32, 2., 4., 1., 3., 5.].map(|x| x * (q + 1.0));
                    let c = [1.5f32 + q, -2.0 + q];
                    let mut v: Vec<f32> = a.chain(b).chain(c).collect();
                    v.resize(len, 0.0);
                    v
                };
                let sum: Vec<f32> = (0..group.world())
                    .map(|q| per_rank(q as f32))
                    .reduce(|x, y| x.iter().zip(&y).map(|(a, b)| a + b).collect())
                    .unwrap_or_default();
                let chunk = len / group.world();
                let expected = &sum[group.rank() * chunk..(group.rank() + 1) * chunk];
                anyhow::ensure!(got == want && got == expected, "reduce-scatter: {got:?} vs {want:?} vs {expected:?}");
                // The mean of the same parts (no padding): every rank gets the whole sum divided
                // as a tensor is.
                let got = group.all_reduce_mean_parts_as(parts.to_vec(), WireDtype::F32)?.to_vec1::<f32>()?;
                let mean = (Tensor::new(&sum[..14], &dev)? / group.world() as f64)?.to_vec1::<f32>()?;
                anyhow::ensure!(got == mean, "mean of parts: {got:?} vs {mean:?}");
                let mine: Vec<f32> = (0..4).map(|i| r * 10.0 + i as f32).collect();
                let got = group.all_gather_slice(&mine, &dev)?.to_vec1::<f32>()?;
                let want = group.all_gather(&Tensor::new(mine.as_slice(), &dev)?)?.to_vec1::<f32>()?;
                let expected: Vec<f32> =
                    (0..group.world()).flat_map(|q| (0..4).map(move |i| q as f32 * 10.0 + i as f32)).collect();
                anyhow::ensure!(got == want && got == expected, "all-gather: {got:?} vs {want:?}");
                Ok(())
            });
            for res in results {
                res.unwrap();
            }
        }
    }
}
