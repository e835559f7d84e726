//! The CPU backend: collectives between processes over TCP, with the ring algorithms NCCL uses
//! for large buffers. Each rank keeps two sockets, one to the next rank and one from the
//! previous; every step of a ring sends one chunk forward while receiving one from behind, so an
//! all-reduce sends 2(N-1)/N of the buffer from each rank whatever N is (bandwidth-optimal), and
//! a reduce-scatter or an all-gather half of that.
//!
//! Every read and write has the group's timeout. A rank that dies closes its sockets, so its
//! neighbours fail at once and the failure travels round the ring; a rank that hangs makes its
//! neighbours time out. Either way each rank fails with one line naming the rank it lost.

use anyhow::{anyhow, bail, Context, Result};
use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// How values meet in a reduction.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReduceOp {
    Sum,
    Max,
}

/// What the ring moves: plain numbers sent as their bytes.
pub trait Element: bytemuck::Pod + Default + PartialOrd + std::ops::AddAssign + Send + Sync {
    fn is_nan(self) -> bool;
}

impl Element for f32 {
    fn is_nan(self) -> bool {
        f32::is_nan(self)
    }
}

impl Element for f64 {
    fn is_nan(self) -> bool {
        f64::is_nan(self)
    }
}

/// Gradients sent in half precision (DeepSpeed's `communication_data_type`): the ring adds them
/// in that type at every hop, as NCCL's half-precision reductions do.
impl Element for half::bf16 {
    fn is_nan(self) -> bool {
        half::bf16::is_nan(self)
    }
}

impl Element for half::f16 {
    fn is_nan(self) -> bool {
        half::f16::is_nan(self)
    }
}

impl ReduceOp {
    fn apply<T: Element>(self, acc: &mut [T], x: &[T]) {
        match self {
            Self::Sum => acc.iter_mut().zip(x).for_each(|(a, &b)| *a += b),
            // NaN wins, so an overflow flag or a NaN norm is never lost.
            Self::Max => acc.iter_mut().zip(x).for_each(|(a, &b)| {
                if b.is_nan() || b > *a {
                    *a = b
                }
            }),
        }
    }
}

/// Bytes sent and seconds spent in collectives, for the communication report.
#[derive(Debug, Default)]
pub struct CommStats {
    pub bytes_sent: AtomicU64,
    pub nanos: AtomicU64,
    pub calls: AtomicU64,
}

impl CommStats {
    pub fn snapshot(&self) -> (u64, f64, u64) {
        (
            self.bytes_sent.load(Ordering::Relaxed),
            self.nanos.load(Ordering::Relaxed) as f64 * 1e-9,
            self.calls.load(Ordering::Relaxed),
        )
    }
}

/// Rank `r`'s chunk of a buffer of `len` values split over `world` ranks: equal chunks of
/// `ceil(len / world)`, the last ones shorter (or empty) when `len` does not divide.
pub fn chunk(len: usize, world: usize, r: usize) -> Range<usize> {
    let size = len.div_ceil(world);
    (r * size).min(len)..((r + 1) * size).min(len)
}

/// One rank's two ring connections.
pub struct TcpRing {
    rank: usize,
    world: usize,
    /// To rank + 1 and from rank - 1 (`None` for a world of one).
    links: Option<(TcpStream, TcpStream)>,
    addrs: Vec<SocketAddr>,
    timeout: Duration,
    pub stats: CommStats,
}

const HELLO: u64 = 0x524c_4846_7269_6e67; // "RLHFring"

impl TcpRing {
    /// A world of one: every collective is the identity.
    pub fn single() -> Self {
        Self { rank: 0, world: 1, links: None, addrs: Vec::new(), timeout: Duration::MAX, stats: CommStats::default() }
    }

    /// How long a peer is waited for (`--dist-timeout`; without end for a world of one).
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Connects rank `rank` to the next rank's listener and accepts the previous rank on
    /// `listener`, each within `timeout`.
    pub fn connect(rank: usize, addrs: Vec<SocketAddr>, listener: TcpListener, timeout: Duration) -> Result<Self> {
        let world = addrs.len();
        if world == 1 {
            return Ok(Self::single());
        }
        let deadline = Instant::now() + timeout;
        let (next, prev) = ((rank + 1) % world, (rank + world - 1) % world);
        let to_next = loop {
            match TcpStream::connect_timeout(&addrs[next], Duration::from_secs(2)) {
                Ok(s) => break s,
                Err(e) if Instant::now() >= deadline => {
                    bail!("rank {rank}: cannot connect to rank {next} at {}: {e}", addrs[next])
                }
                Err(_) => std::thread::sleep(Duration::from_millis(10)),
            }
        };
        to_next.set_nodelay(true)?;
        to_next.set_write_timeout(Some(timeout))?;
        (&to_next).write_all(&[HELLO.to_le_bytes(), (rank as u64).to_le_bytes()].concat())?;
        listener.set_nonblocking(true)?;
        let from_prev = loop {
            match listener.accept() {
                Ok((s, _)) => {
                    s.set_nonblocking(false)?;
                    s.set_read_timeout(Some(timeout))?;
                    let mut hello = [0u8; 16];
                    if (&s).read_exact(&mut hello).is_err()
                        || hello[..8] != HELLO.to_le_bytes()
                        || u64::from_le_bytes(hello[8..].try_into().unwrap()) != prev as u64
                    {
                        continue; // not our previous rank: a stray connection
                    }
                    break s;
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => {
                    if Instant::now() >= deadline {
                        bail!("rank {rank}: rank {prev} never connected within {}s", timeout.as_secs());
                    }
                    std::thread::sleep(Duration::from_millis(2));
                }
                Err(e) => return Err(e).context("the ring listener failed"),
            }
        };
        from_prev.set_nodelay(true)?;
        Ok(Self { rank, world, links: Some((to_next, from_prev)), addrs, timeout, stats: CommStats::default() })
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn world(&self) -> usize {
        self.world
    }

    fn next(&self) -> usize {
        (self.rank + 1) % self.world
    }

    fn prev(&self) -> usize {
        (self.rank + self.world - 1) % self.world
    }

    /// The error of losing rank `peer` during `what`.
    fn lost(&self, peer: usize, what: &str, e: std::io::Error) -> anyhow::Error {
        let addr = self.addrs.get(peer).map_or(String::new(), |a| format!(" at {a}"));
        match e.kind() {
            ErrorKind::WouldBlock | ErrorKind::TimedOut => anyhow!(
                "rank {}: rank {peer}{addr} sent nothing for {}s during {what}: it is stuck or dead (see its log; --dist-timeout sets the wait)",
                self.rank,
                self.timeout.as_secs()
            ),
            _ => anyhow!(
                "rank {}: lost rank {peer}{addr} during {what} ({e}): it exited or crashed; see its log",
                self.rank
            ),
        }
    }

    /// Sends `out` to the next rank while receiving `into` from the previous one.
    fn exchange(&self, out: &[u8], into: &mut [u8], what: &str) -> Result<()> {
        let Some((to_next, from_prev)) = &self.links else { bail!("a world of one has no peers") };
        let (next, prev) = (self.next(), self.prev());
        std::thread::scope(|s| {
            let sender = s.spawn(move || {
                let mut w = to_next;
                w.write_all(out)
            });
            let mut r = from_prev;
            let received = r.read_exact(into).map_err(|e| {
                let e = if e.kind() == ErrorKind::UnexpectedEof {
                    std::io::Error::new(ErrorKind::ConnectionAborted, "connection closed")
                } else {
                    e
                };
                self.lost(prev, what, e)
            });
            let sent = sender.join().map_err(|_| anyhow!("the sending thread panicked"))?;
            received?;
            sent.map_err(|e| self.lost(next, what, e))
        })?;
        self.stats.bytes_sent.fetch_add(out.len() as u64, Ordering::Relaxed);
        Ok(())
    }

    fn timed<T>(&self, f: impl FnOnce() -> Result<T>) -> Result<T> {
        let t0 = Instant::now();
        let out = f();
        self.stats.nanos.fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
        self.stats.calls.fetch_add(1, Ordering::Relaxed);
        out
    }

    /// Ring reduce-scatter in place: afterwards `buf[chunk(len, world, rank)]` holds the
    /// reduction over all ranks of that chunk (the rest of `buf` is scratch). Returns the range.
    pub fn reduce_scatter<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<Range<usize>> {
        let (n, len) = (self.world, buf.len());
        let chunks: Vec<Range<usize>> = (0..n).map(|r| chunk(len, n, r)).collect();
        self.reduce_scatter_chunks(buf, &chunks, op)
    }

    /// [`Self::reduce_scatter`] with chunks of any sizes, `chunks[r]` rank `r`'s (the same on
    /// every rank; consecutive, covering `buf`, some possibly empty): ZeRO-2's buckets, whose
    /// parameters fall unevenly into the ranks' shards. Each rank sends every chunk but its own.
    pub fn reduce_scatter_chunks<T: Element>(
        &self,
        buf: &mut [T],
        chunks: &[Range<usize>],
        op: ReduceOp,
    ) -> Result<Range<usize>> {
        let (n, r) = (self.world, self.rank);
        if chunks.len() != n || chunks.last().is_some_and(|c| c.end != buf.len()) {
            bail!("internal error: a reduce-scatter of {} values in {} chunks over {n} ranks", buf.len(), chunks.len());
        }
        if n == 1 {
            return Ok(chunks[0].clone());
        }
        self.timed(|| {
            let mut incoming = vec![T::default(); chunks.iter().map(Range::len).max().unwrap_or(0)];
            // Step s sends chunk r-s-1 (reduced so far) and receives chunk r-s-2 from the
            // previous rank; after n-1 steps chunk r has met every rank.
            for s in 0..n - 1 {
                let send = chunks[(r + 2 * n - s - 1) % n].clone();
                let recv = chunks[(r + 2 * n - s - 2) % n].clone();
                let into = &mut incoming[..recv.len()];
                self.exchange(bytemuck::cast_slice(&buf[send]), bytemuck::cast_slice_mut(into), "a reduce-scatter")?;
                op.apply(&mut buf[recv], into);
            }
            Ok(chunks[r].clone())
        })
    }

    /// Ring all-gather in place: every rank holds its own chunk of `buf`
    /// (`chunk(len, world, rank)`), and afterwards all of it.
    pub fn all_gather<T: Element>(&self, buf: &mut [T]) -> Result<()> {
        let (n, r, len) = (self.world, self.rank, buf.len());
        if n == 1 {
            return Ok(());
        }
        self.timed(|| {
            let mut incoming = vec![T::default(); len.div_ceil(n)];
            for s in 0..n - 1 {
                let send = chunk(len, n, (r + n - s) % n);
                let recv = chunk(len, n, (r + 2 * n - s - 1) % n);
                let into = &mut incoming[..recv.len()];
                self.exchange(bytemuck::cast_slice(&buf[send]), bytemuck::cast_slice_mut(into), "an all-gather")?;
                buf[recv].copy_from_slice(into);
            }
            Ok(())
        })
    }

    /// Ring gather to `root`: every rank's `mine`, its chunk of a `len`-value buffer
    /// (`chunk(len, world, rank)`), reaches `root`, which returns the whole buffer; the others
    /// return `None` and hold no more than one chunk meanwhile (where an all-gather would give
    /// each the whole). The ranks after `root` form a chain to it round the ring: each sends its
    /// own chunk, then forwards the ones that reach it from the chain's earlier ranks.
    pub fn gather<T: Element>(&self, mine: &[T], len: usize, root: usize) -> Result<Option<Vec<T>>> {
        let (n, r) = (self.world, self.rank);
        if mine.len() != chunk(len, n, r).len() {
            bail!(
                "internal error: rank {r}'s part of a gather holds {} values, its chunk {}",
                mine.len(),
                chunk(len, n, r).len()
            );
        }
        if n == 1 {
            return Ok(Some(mine.to_vec()));
        }
        let Some((to_next, from_prev)) = &self.links else { unreachable!("world > 1 has links") };
        // Chain positions: root + 1 is 1, ..., root - 1 (root's previous rank) is n - 1.
        let position = |rank: usize| (rank + n - root) % n;
        self.timed(|| {
            if r == root {
                // The chain's end sends its own chunk first, then the earlier ranks' in reverse.
                let mut all = vec![T::default(); len];
                all[chunk(len, n, r)].copy_from_slice(mine);
                for p in (1..n).rev() {
                    let from = (root + p) % n;
                    let into = &mut all[chunk(len, n, from)];
                    (&*from_prev)
                        .read_exact(bytemuck::cast_slice_mut(into))
                        .map_err(|e| self.lost(self.prev(), "a gather", e))?;
                }
                return Ok(Some(all));
            }
            let send = |bytes: &[u8]| -> Result<()> {
                (&*to_next).write_all(bytes).map_err(|e| self.lost(self.next(), "a gather", e))?;
                self.stats.bytes_sent.fetch_add(bytes.len() as u64, Ordering::Relaxed);
                Ok(())
            };
            send(bytemuck::cast_slice(mine))?;
            let mut passing = vec![T::default(); len.div_ceil(n)];
            for p in (1..position(r)).rev() {
                let into = &mut passing[..chunk(len, n, (root + p) % n).len()];
                (&*from_prev)
                    .read_exact(bytemuck::cast_slice_mut(into))
                    .map_err(|e| self.lost(self.prev(), "a gather", e))?;
                send(bytemuck::cast_slice(into))?;
            }
            Ok(None)
        })
    }

    /// Ring all-reduce in place: a reduce-scatter, then an all-gather of the reduced chunks.
    pub fn all_reduce<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        self.reduce_scatter(buf, op)?;
        self.all_gather(buf)
    }

    /// Broadcast from `root` in place, pipelined round the ring in segments so that a large
    /// buffer streams through every rank at once.
    pub fn broadcast_bytes(&self, buf: &mut [u8], root: usize) -> Result<()> {
        if self.world == 1 {
            return Ok(());
        }
        let Some((to_next, from_prev)) = &self.links else { unreachable!("world > 1 has links") };
        const SEGMENT: usize = 1 << 20;
        let forward = self.next() != root;
        self.timed(|| {
            for seg in buf.chunks_mut(SEGMENT) {
                if self.rank != root {
                    (&*from_prev).read_exact(seg).map_err(|e| self.lost(self.prev(), "a broadcast", e))?;
                }
                if forward {
                    (&*to_next).write_all(seg).map_err(|e| self.lost(self.next(), "a broadcast", e))?;
                    self.stats.bytes_sent.fetch_add(seg.len() as u64, Ordering::Relaxed);
                }
            }
            Ok(())
        })
    }

    pub fn broadcast<T: Element>(&self, buf: &mut [T], root: usize) -> Result<()> {
        self.broadcast_bytes(bytemuck::cast_slice_mut(buf), root)
    }

    /// Returns when every rank has called it (or fails naming the rank that never did).
    pub fn barrier(&self) -> Result<()> {
        self.all_reduce(&mut [0f32], ReduceOp::Sum)
    }

    /// The ring of the ranks that pass the same `color`, in their order here (MPI's
    /// `Comm_split`): tensor parallelism cuts the world into TP and DP rings this way. Every
    /// rank of this ring calls it together: each opens a listener and the ports are all-gathered
    /// over this ring, then each new ring connects as [`Self::connect`] does.
    pub fn split(&self, color: usize) -> Result<TcpRing> {
        if self.world == 1 {
            return Ok(Self::single());
        }
        let listener = TcpListener::bind(("0.0.0.0", 0))?;
        // Two f64 per rank (exact for any color and port): chunk r of 2 x world values is rank r's.
        let mut table = vec![0f64; 2 * self.world];
        table[2 * self.rank] = color as f64;
        table[2 * self.rank + 1] = f64::from(listener.local_addr()?.port());
        self.all_gather(&mut table)?;
        let members: Vec<usize> = (0..self.world).filter(|&q| table[2 * q] == color as f64).collect();
        let addrs = members.iter().map(|&q| SocketAddr::new(self.addrs[q].ip(), table[2 * q + 1] as u16)).collect();
        let rank = members.iter().position(|&q| q == self.rank).expect("a rank is a member of its own color");
        Self::connect(rank, addrs, listener, self.timeout)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// `world` rings on loopback, one per thread, each running `f`.
    pub(crate) fn on_ring<T: Send>(world: usize, f: impl Fn(&TcpRing) -> Result<T> + Sync) -> Vec<Result<T>> {
        on_ring_owned(world, |ring| f(&ring))
    }

    /// [`on_ring`], handing each thread its ring.
    pub(crate) fn on_ring_owned<T: Send>(world: usize, f: impl Fn(TcpRing) -> Result<T> + Sync) -> Vec<Result<T>> {
        let listeners: Vec<TcpListener> = (0..world).map(|_| TcpListener::bind("127.0.0.1:0").unwrap()).collect();
        let addrs: Vec<SocketAddr> = listeners.iter().map(|l| l.local_addr().unwrap()).collect();
        std::thread::scope(|s| {
            let handles: Vec<_> = listeners
                .into_iter()
                .enumerate()
                .map(|(r, l)| {
                    let (addrs, f) = (addrs.clone(), &f);
                    s.spawn(move || f(TcpRing::connect(r, addrs, l, Duration::from_secs(5))?))
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    /// Uneven chunks (one empty, one holding most of the buffer): each rank ends with the sum
    /// of its own chunk over the ranks and sends every chunk but its own.
    #[test]
    fn reduce_scatter_takes_chunks_of_any_sizes() -> Result<()> {
        let chunks = [0..5, 5..5, 5..7];
        let results = on_ring(3, |ring| {
            let r = ring.rank() as f32;
            let mut buf: Vec<f32> = (0..7).map(|i| i as f32 + 10.0 * r).collect();
            let mine = ring.reduce_scatter_chunks(&mut buf, &chunks, ReduceOp::Sum)?;
            let sent = ring.stats.snapshot().0;
            Ok((buf[mine].to_vec(), sent))
        });
        // Value i summed over ranks 0, 1, 2: 3 i + 30.
        let sums = |range: Range<usize>| range.map(|i| 3.0 * i as f32 + 30.0).collect::<Vec<f32>>();
        for (r, res) in results.into_iter().enumerate() {
            let (got, sent) = res?;
            assert_eq!(got, sums(chunks[r].clone()), "rank {r}");
            assert_eq!(sent, 4 * (7 - chunks[r].len()) as u64, "rank {r} sends every chunk but its own");
        }
        // Chunks that are not one a rank, or that leave part of the buffer out, are refused.
        let single = TcpRing::single();
        for chunks in [&[0..2, 2..3][..], std::slice::from_ref(&(0..2))] {
            let err = single.reduce_scatter_chunks(&mut [0f32; 3], chunks, ReduceOp::Sum).unwrap_err();
            assert!(err.to_string().starts_with("internal error: a reduce-scatter of 3 values"), "{chunks:?}");
        }
        Ok(())
    }

    /// Splitting 4 ranks by `rank / 2` and by `rank % 2` gives rings of 2 whose collectives
    /// reach exactly their members, and a second split of the world still works.
    #[test]
    fn split_rings_reduce_over_their_members_only() -> Result<()> {
        let results = on_ring(4, |ring| {
            let r = ring.rank();
            let (tp, dp) = (ring.split(r / 2)?, ring.split(r % 2)?);
            let mut a = [r as f32 + 1.0];
            tp.all_reduce(&mut a, ReduceOp::Sum)?;
            let mut b = [10.0 * (r as f32 + 1.0)];
            dp.all_reduce(&mut b, ReduceOp::Sum)?;
            let mut all = [1f32];
            ring.all_reduce(&mut all, ReduceOp::Sum)?;
            Ok((tp.rank(), tp.world(), a[0], dp.rank(), dp.world(), b[0], all[0]))
        });
        let want = [(0, 2, 3.0, 0, 2, 40.0), (1, 2, 3.0, 0, 2, 60.0), (0, 2, 7.0, 1, 2, 40.0), (1, 2, 7.0, 1, 2, 60.0)];
        for (r, (res, w)) in results.into_iter().zip(want).enumerate() {
            let (tr, tw, a, dr, dw, b, all) = res?;
            assert_eq!((tr, tw, a, dr, dw, b, all), (w.0, w.1, w.2, w.3, w.4, w.5, 4.0), "rank {r}");
        }
        // A color of its own: a ring of one, whose collectives are the identity.
        for res in on_ring(3, |ring| {
            let solo = ring.split(ring.rank())?;
            let mut x = [ring.rank() as f32];
            solo.all_reduce(&mut x, ReduceOp::Sum)?;
            Ok((solo.world(), x[0] as usize == ring.rank()))
        }) {
            assert_eq!(res?, (1, true));
        }
        Ok(())
    }

    fn data(rank: usize, len: usize) -> Vec<f32> {
        (0..len).map(|i| ((i * 7 + rank * 13) % 17) as f32 - 8.0 + rank as f32 * 0.25).collect()
    }

    #[test]
    fn chunks_cover_the_buffer_in_order_even_when_uneven() {
        for (len, world) in [(10, 3), (2, 3), (0, 2), (9, 3), (1, 1)] {
            let ranges: Vec<_> = (0..world).map(|r| chunk(len, world, r)).collect();
            assert_eq!(ranges.first().unwrap().start, 0);
            assert_eq!(ranges.last().unwrap().end, len);
            assert!(ranges.windows(2).all(|w| w[0].end == w[1].start), "{len} {world}: {ranges:?}");
        }
        assert_eq!(chunk(10, 3, 2), 8..10);
        assert_eq!(chunk(2, 3, 2), 2..2);
    }

    /// A gather reaches its root whole, in rank order, from any root and with uneven chunks;
    /// the other ranks get nothing.
    #[test]
    fn a_gather_brings_every_chunk_to_its_root_only() -> Result<()> {
        for world in [2, 3, 4] {
            for len in [1, 7, 65_537] {
                for root in 0..world {
                    let results = on_ring(world, |ring| {
                        let r = ring.rank();
                        ring.gather(&data(r, len)[chunk(len, world, r)], len, root)
                    });
                    let want: Vec<f32> = (0..world).flat_map(|q| data(q, len)[chunk(len, world, q)].to_vec()).collect();
                    for (r, got) in results.into_iter().enumerate() {
                        match got? {
                            Some(all) => assert!(r == root && all == want, "w{world} n{len} root {root} rank {r}"),
                            None => assert_ne!(r, root, "w{world} n{len}: the root got nothing"),
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// Half-precision buffers (gradients under `--communication-data-type`): the sums of the f32
    /// values to the type's precision, each hop adding in it, in half the bytes of f32.
    #[test]
    fn half_precision_reductions_sum_to_their_precision_in_half_the_bytes() -> Result<()> {
        let (world, len) = (3, 10_001);
        let want: Vec<f32> = (0..len).map(|i| (0..world).map(|r| data(r, len)[i]).sum()).collect();
        let results = on_ring(world, |ring| {
            let mut b: Vec<half::bf16> = data(ring.rank(), len).into_iter().map(half::bf16::from_f32).collect();
            ring.all_reduce(&mut b, ReduceOp::Sum)?;
            let mut f: Vec<half::f16> = data(ring.rank(), len).into_iter().map(half::f16::from_f32).collect();
            let sent_before = ring.stats.snapshot().0;
            ring.all_reduce(&mut f, ReduceOp::Sum)?;
            Ok((b, f, ring.stats.snapshot().0 - sent_before))
        });
        for res in results {
            let (b, f, sent) = res?;
            for ((b, f), w) in b.iter().zip(&f).zip(&want) {
                // Three roundings of the running sum (two hops and the operand's own).
                assert!((b.to_f32() - w).abs() <= 3.0 * 2f32.powi(-8) * w.abs().max(1.0), "bf16 {b} vs {w}");
                assert!((f.to_f32() - w).abs() <= 3.0 * 2f32.powi(-11) * w.abs().max(1.0), "f16 {f} vs {w}");
            }
            // 2 (N - 1) / N of the buffer, 2 bytes a value (chunks rounded up).
            let ideal = 2.0 * 2.0 * len as f64 * (world - 1) as f64 / world as f64;
            assert!((sent as f64 - ideal).abs() <= 8.0 * world as f64, "{sent} bytes, ideal {ideal}");
        }
        Ok(())
    }

    #[test]
    fn collectives_match_their_definitions_for_two_three_and_four_ranks() -> Result<()> {
        for world in [2, 3, 4] {
            for len in [1, 2, 7, 1000, 65_537] {
                let inputs: Vec<Vec<f32>> = (0..world).map(|r| data(r, len)).collect();
                let want_sum: Vec<f32> = (0..len).map(|i| inputs.iter().map(|d| d[i]).sum()).collect();
                let want_max: Vec<f32> =
                    (0..len).map(|i| inputs.iter().map(|d| d[i]).fold(f32::MIN, f32::max)).collect();
                let results = on_ring(world, |ring| {
                    let r = ring.rank();
                    let mut sum = data(r, len);
                    ring.all_reduce(&mut sum, ReduceOp::Sum)?;
                    let mut max = data(r, len);
                    ring.all_reduce(&mut max, ReduceOp::Max)?;
                    let mut rs = data(r, len);
                    let mine = ring.reduce_scatter(&mut rs, ReduceOp::Sum)?;
                    let mut gathered = vec![-1.0; len];
                    let own = chunk(len, world, r);
                    gathered[own.clone()].copy_from_slice(&data(r, len)[own]);
                    ring.all_gather(&mut gathered)?;
                    let mut b = if r == 1 { data(9, len) } else { vec![0.0; len] };
                    ring.broadcast(&mut b, 1)?;
                    ring.barrier()?;
                    Ok((sum, max, rs[mine.clone()].to_vec(), mine, gathered, b, ring.stats.snapshot().0))
                });
                for (r, res) in results.into_iter().enumerate() {
                    let (sum, max, rs, mine, gathered, b, sent) = res?;
                    // Sums are added in ring order, not left to right: allow rounding.
                    assert!(sum.iter().zip(&want_sum).all(|(a, b)| (a - b).abs() < 1e-4), "sum w{world} n{len}");
                    assert_eq!(max, want_max, "max w{world} n{len}");
                    assert!(rs.iter().zip(&want_sum[mine]).all(|(a, b)| (a - b).abs() < 1e-4), "rs w{world} n{len}");
                    let all: Vec<f32> = (0..world).flat_map(|q| inputs[q][chunk(len, world, q)].to_vec()).collect();
                    assert_eq!(gathered, all, "all-gather w{world} n{len} rank {r}");
                    assert_eq!(b, data(9, len), "broadcast w{world} n{len} rank {r}");
                    if len == 65_537 {
                        // Two all-reduces, a reduce-scatter and an all-gather: 2 + 2 + 1 + 1 times
                        // (n-1)/n of the buffer, plus the broadcast's forwarding and the barrier.
                        let per_pass = (world - 1) * len.div_ceil(world) * 4;
                        assert!(sent as usize >= 6 * per_pass - 6 * 4 * world, "rank {r} sent {sent}");
                        assert!(sent as usize <= 6 * per_pass + len * 4 + 64, "rank {r} sent {sent}: not a ring");
                    }
                }
            }
        }
        Ok(())
    }

    /// A ring forms past connections that are not its previous rank's (another program's
    /// greeting from the right rank, ours from a rank that is not the previous one), with a
    /// rank whose listener opens late; a rank that never listens fails the ring's first rank
    /// at the timeout, naming it.
    #[test]
    fn a_ring_forms_past_strays_and_a_late_rank_and_not_without_one() -> Result<()> {
        let first = TcpListener::bind("127.0.0.1:0")?;
        // Free until rank 1 binds it.
        let late = SocketAddr::from(([127, 0, 0, 1], TcpListener::bind("127.0.0.1:0")?.local_addr()?.port()));
        let addrs = vec![first.local_addr()?, late];
        let hello = |magic: u64, rank: u64| [magic.to_le_bytes(), rank.to_le_bytes()].concat();
        let mut strays = Vec::new();
        for greeting in [hello(HELLO, 5), hello(!HELLO, 1)] {
            let mut stray = TcpStream::connect(addrs[0])?;
            stray.write_all(&greeting)?;
            strays.push(stray);
        }
        let sum_over = |ring: TcpRing| -> Result<f32> {
            let mut x = [ring.rank() as f32 + 1.0];
            ring.all_reduce(&mut x, ReduceOp::Sum)?;
            Ok(x[0])
        };
        let timeout = Duration::from_secs(5);
        let (sum0, sum1) = std::thread::scope(|s| {
            let rank0 = s.spawn(|| sum_over(TcpRing::connect(0, addrs.clone(), first, timeout)?));
            let rank1 = s.spawn(|| {
                std::thread::sleep(Duration::from_millis(300));
                sum_over(TcpRing::connect(1, addrs.clone(), TcpListener::bind(late)?, timeout)?)
            });
            (rank0.join().unwrap(), rank1.join().unwrap())
        });
        assert_eq!((sum0?, sum1?), (3.0, 3.0));
        drop(strays);
        let alone = TcpListener::bind("127.0.0.1:0")?;
        let addrs = vec![alone.local_addr()?, late];
        let err = TcpRing::connect(0, addrs, alone, Duration::from_millis(300)).err().expect("no ring").to_string();
        assert!(err.contains("cannot connect to rank 1"), "{err}");
        Ok(())
    }

    /// A maximum over ranks in each element type: the largest value, and NaN wherever one rank
    /// holds a NaN (an overflow flag or a norm is never lost to a comparison that NaN fails).
    #[test]
    fn a_max_is_the_largest_value_and_nan_wins_in_every_type() -> Result<()> {
        fn max_over_ranks<T: Element + std::fmt::Debug>(of: fn(f32) -> T) -> Result<()> {
            let results = on_ring(3, |ring| {
                let r = ring.rank() as f32;
                // Slot 0: rank 1 holds a NaN. Slot 1: rank 2 holds the largest. Slot 2: rank 0 does.
                let mut buf = [if r == 1.0 { f32::NAN } else { r }, r, 5.0 - r].map(of);
                ring.all_reduce(&mut buf, ReduceOp::Max)?;
                Ok(buf)
            });
            for res in results {
                let [nan, largest, first] = res?;
                assert!(nan.is_nan(), "{nan:?}");
                assert_eq!((largest, first), (of(2.0), of(5.0)));
                assert!(!largest.is_nan() && !first.is_nan());
            }
            Ok(())
        }
        max_over_ranks(|x| x)?;
        max_over_ranks(f64::from)?;
        max_over_ranks(half::bf16::from_f32)?;
        max_over_ranks(half::f16::from_f32)
    }

    /// The statistics a collective leaves: one call, its seconds (within the wall time it took),
    /// and the group's timeout (without end for a world of one).
    #[test]
    fn a_collective_is_counted_and_timed_and_the_timeout_kept() -> Result<()> {
        assert_eq!(TcpRing::single().timeout(), Duration::MAX);
        for res in on_ring(2, |ring| {
            let t0 = Instant::now();
            ring.all_gather(&mut [0f32; 1000])?;
            let wall = t0.elapsed().as_secs_f64();
            let (_, seconds, calls) = ring.stats.snapshot();
            Ok((seconds, wall, calls, ring.timeout()))
        }) {
            let (seconds, wall, calls, timeout) = res?;
            assert!(seconds > 0.0 && seconds <= wall, "{seconds} s in a call of {wall} s");
            assert_eq!((calls, timeout), (1, Duration::from_secs(5)));
        }
        Ok(())
    }

    /// The rank after a dead one (rank 0, after rank 2 of 3) reads the end of its connection
    /// first, and names that rank and its address.
    #[test]
    fn the_rank_after_a_dead_one_names_it() {
        let results = on_ring(3, |ring| {
            if ring.rank() == 2 {
                return Ok(());
            }
            ring.all_reduce(&mut [1.0; 100], ReduceOp::Sum)
        });
        let err = results[0].as_ref().unwrap_err().to_string();
        assert!(err.starts_with("rank 0: lost rank 2 at 127.0.0.1:"), "{err}");
    }

    #[test]
    fn a_rank_that_dies_fails_the_others_with_its_name_and_one_that_hangs_times_them_out() {
        let results = on_ring(3, |ring| {
            if ring.rank() == 1 {
                return Ok(()); // leaves: its sockets close
            }
            std::thread::sleep(Duration::from_millis(50));
            ring.all_reduce(&mut [1.0; 100], ReduceOp::Sum)
        });
        for r in [0, 2] {
            let err = results[r].as_ref().unwrap_err().to_string();
            assert!(err.contains("rank 1") || err.contains("lost rank"), "rank {r}: {err}");
        }
        let t0 = Instant::now();
        let listeners: Vec<TcpListener> = (0..2).map(|_| TcpListener::bind("127.0.0.1:0").unwrap()).collect();
        let addrs: Vec<SocketAddr> = listeners.iter().map(|l| l.local_addr().unwrap()).collect();
        let results: Vec<Result<()>> = std::thread::scope(|s| {
            let hs: Vec<_> = listeners
                .into_iter()
                .enumerate()
                .map(|(r, l)| {
                    let addrs = addrs.clone();
                    s.spawn(move || {
                        let ring = TcpRing::connect(r, addrs, l, Duration::from_millis(300))?;
                        if r == 1 {
                            std::thread::sleep(Duration::from_millis(900)); // stuck, sockets open
                            return Ok(());
                        }
                        ring.all_reduce(&mut [1.0; 10], ReduceOp::Sum)
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let err = results[0].as_ref().unwrap_err().to_string();
        assert!(err.contains("rank 1") && err.contains("stuck or dead"), "{err}");
        assert!(t0.elapsed() < Duration::from_secs(3), "failed within the timeout");
    }
}
