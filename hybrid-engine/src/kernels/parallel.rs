//! How the CPU kernels share work: rows (or chunks) of an output split across candle's thread
//! pool, written through a shared pointer to disjoint ranges, and gemm with arbitrary strides.
//! Used by the training kernels (`ops/*.rs`) and the decoding kernels (`decode.rs`).

use std::ops::Range;

/// Below this many output values a kernel runs on the calling thread: waking the pool costs
/// more than it saves (candle's own element-wise ops use 64k).
pub(crate) const PARALLEL_MIN: usize = 32 * 1024;

/// The spare capacity of an output vector, which the pool's workers write in disjoint pieces
/// before the owner sets its length (outputs are fully overwritten: no zero fill first).
#[derive(Clone, Copy)]
pub(crate) struct SharedOut {
    pub(crate) ptr: *mut f32,
    pub(crate) len: usize,
}

// SAFETY: only used to hand disjoint ranges of one buffer to the pool's workers (see `range`).
unsafe impl Send for SharedOut {}
unsafe impl Sync for SharedOut {}

impl SharedOut {
    /// The first `len` values of `out`'s buffer (reserved here), which must be empty.
    pub(crate) fn new(out: &mut Vec<f32>, len: usize) -> Self {
        assert!(out.is_empty(), "SharedOut writes from the start of an empty vector");
        out.reserve_exact(len);
        Self { ptr: out.as_mut_ptr(), len }
    }

    /// A pointer to value `offset`, for strided writes (gemm): the caller keeps them disjoint.
    pub(crate) fn at(&self, offset: usize) -> *mut f32 {
        assert!(offset < self.len, "offset {offset} outside a buffer of {}", self.len);
        // SAFETY: within the reserved buffer.
        unsafe { self.ptr.add(offset) }
    }

    /// # Safety
    /// No two live slices may overlap: callers derive ranges from disjoint row ranges.
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn range(&self, r: Range<usize>) -> &mut [f32] {
        assert!(r.start <= r.end && r.end <= self.len, "range {r:?} outside a buffer of {}", self.len);
        // Writing through a slice of uninitialised f32 is sound in practice (every bit pattern
        // is a valid f32) and is what candle's own kernels do; the callers only write.
        std::slice::from_raw_parts_mut(self.ptr.add(r.start), r.len())
    }
}

/// Runs `f(row_range)` over `rows` rows on candle's CPU thread pool (the calling thread when
/// the work, about `work` values touched, is small).
pub(crate) fn par_rows(rows: usize, work: usize, f: impl Fn(Range<usize>) + Sync) {
    if work < PARALLEL_MIN || rows < 2 {
        f(0..rows);
    } else {
        candle_core::utils::barrier_pool().execute_chunked(rows, f);
    }
}

/// A new (rows * width) buffer, row r written by `f(r, row)` in parallel.
pub(crate) fn for_rows(rows: usize, width: usize, f: impl Fn(usize, &mut [f32]) + Sync) -> Vec<f32> {
    for_rows_weighted(rows, width, rows * width, f)
}

/// A new buffer of `len` values written by `f(range, out)` over chunks in parallel.
pub(crate) fn for_chunks(len: usize, f: impl Fn(Range<usize>, &mut [f32]) + Sync) -> Vec<f32> {
    const CHUNK: usize = 16 * 1024;
    let mut out = Vec::new();
    let shared = SharedOut::new(&mut out, len);
    par_rows(len.div_ceil(CHUNK), len, |chunks| {
        for ci in chunks {
            let range = ci * CHUNK..((ci + 1) * CHUNK).min(len);
            // SAFETY: chunks are disjoint.
            f(range.clone(), unsafe { shared.range(range) });
        }
    });
    // SAFETY: the chunks cover every value.
    unsafe { out.set_len(len) };
    out
}

/// [`for_rows`] where the work per row is not its width (a row-wise reduction).
pub(crate) fn for_rows_weighted(
    rows: usize,
    width: usize,
    work: usize,
    f: impl Fn(usize, &mut [f32]) + Sync,
) -> Vec<f32> {
    let mut out = Vec::new();
    let shared = SharedOut::new(&mut out, rows * width);
    par_rows(rows, work, |range| {
        for r in range {
            // SAFETY: the pool hands out disjoint row ranges.
            f(r, unsafe { shared.range(r * width..(r + 1) * width) });
        }
    });
    // SAFETY: every row was written by `f`.
    unsafe { out.set_len(rows * width) };
    out
}

/// Blocks of rows in a parallel reduction: a fixed number, so the result does not depend on
/// the thread count.
const REDUCE_BLOCKS: usize = 16;

/// Runs `f(row_range, partial)` over `rows` rows split into blocks, each with its own zeroed
/// `width`-value accumulator, and returns the sum of the accumulators. The blocks and the order
/// of the final sum do not depend on which thread runs what: the result is deterministic.
pub(crate) fn reduce_rows(
    rows: usize,
    width: usize,
    work: usize,
    f: impl Fn(Range<usize>, &mut [f32]) + Sync,
) -> Vec<f32> {
    let blocks = if work < PARALLEL_MIN { 1 } else { REDUCE_BLOCKS.min(rows).max(1) };
    let per = rows.div_ceil(blocks).max(1);
    let mut partials = vec![0f32; blocks * width];
    let shared = SharedOut { ptr: partials.as_mut_ptr(), len: partials.len() };
    par_rows(blocks, work, |bs| {
        for blk in bs {
            // SAFETY: each block owns its accumulator.
            let partial = unsafe { shared.range(blk * width..(blk + 1) * width) };
            f(blk * per..((blk + 1) * per).min(rows), partial);
        }
    });
    let (sum, rest) = partials.split_at_mut(width);
    for partial in rest.chunks(width) {
        sum.iter_mut().zip(partial).for_each(|(s, p)| *s += p);
    }
    partials.truncate(width);
    partials
}

/// `dst (m x n) = lhs (m x k) * rhs (k x n)`, plus `dst` when `accumulate`, by gemm with
/// arbitrary (row, column) strides; `threads` > 1 splits it over rayon as candle's matmul does.
///
/// # Safety
/// The pointers must address matrices of these shapes and strides, `dst` not overlapping the
/// others nor any matrix another thread writes.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn gemm_f32(
    (m, n, k): (usize, usize, usize),
    dst: *mut f32,
    dst_rs: usize,
    lhs: *const f32,
    (lhs_rs, lhs_cs): (usize, usize),
    rhs: *const f32,
    (rhs_rs, rhs_cs): (usize, usize),
    accumulate: bool,
    threads: usize,
) {
    let parallelism = if threads > 1 { gemm::Parallelism::Rayon(threads) } else { gemm::Parallelism::None };
    gemm::gemm(
        m,
        n,
        k,
        dst,
        1,
        dst_rs as isize,
        accumulate,
        lhs,
        lhs_cs as isize,
        lhs_rs as isize,
        rhs,
        rhs_cs as isize,
        rhs_rs as isize,
        1.0,
        1.0,
        false,
        false,
        false,
        parallelism,
    )
}
