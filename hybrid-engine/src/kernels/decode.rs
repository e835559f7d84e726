//! CPU kernels for the decoding step of generation, where every weight matrix meets only a few
//! rows (one new token per sequence: 1 to 32 rows).
//!
//! There gemm is the wrong tool. A step reads every weight once and does little arithmetic with
//! it, so its speed is the speed of streaming the weights from memory; gemm's matrix-vector path
//! runs on one core, and its matrix path packs the operands first: for the tied LM head, whose
//! `wte` (V, C) is the wrong way round for gemm's packed layout, that is a copy of all 154 MB of
//! GPT-2's embedding at every step. Attention over the KV cache is worse: candle's batched
//! matmul makes one small gemm call per (batch, head) pair and copies the cache's keys first.
//!
//! The kernels here read each weight where it lies, once, on every core:
//! - [`linear_rows`]: `x W + b`, W (in, out) row-major, column blocks split across threads, each
//!   tile of 1-6 rows x 64-128 columns accumulated in registers down the whole of `in`.
//! - [`lm_head_rows`]: `x wte^T`, vocabulary rows split across threads, dot products of 4 (or 8)
//!   embedding rows with up to 4 input rows at a time; [`lm_head`] takes gemm the right way
//!   round instead for more than [`MAX_LM_HEAD_TILE_ROWS`] rows.
//! - [`cached_attention`]: one pass per (batch, head) over the cached keys and values in place.
//!
//! The linear and LM-head tiles need AVX-512 ([`available`]; elsewhere the callers keep gemm);
//! the attention runs on AVX2 with FMA too, with AVX-512 intrinsics for head sizes 32, 64 and
//! 128. Each is tested against the composed candle ops.

use crate::kernels::parallel::{gemm_f32, par_rows, SharedOut};
use crate::storage::contiguous_f32 as contiguous;
use candle_core::{CpuStorage, CustomOp2, CustomOp3, Layout, Result, Shape, Tensor};
use std::ops::Range;

/// The most rows for which [`linear_rows`] beats gemm (AVX-512, 2 cores, GPT-2's linears: 1.6x
/// at 1 row, 1.9x at 2, 1.2x at 4, equal at 8, slower from 16).
pub const MAX_LINEAR_ROWS: usize = 8;

/// The most rows for which [`lm_head_rows`] beats gemm's transposed product (see [`lm_head`]).
pub const MAX_LM_HEAD_TILE_ROWS: usize = 8;

/// The most rows [`lm_head`] is meant for (a decoding step of up to 64 sequences); more rows
/// are a training-sized product, where the plain matmul is as good.
pub const MAX_LM_HEAD_ROWS: usize = 64;

/// Whether the CPU runs these kernels (AVX-512).
pub fn available() -> bool {
    crate::kernels::rowops::has_avx512()
}

/// Defines `fn $name` whose body is compiled twice, for AVX-512 and for AVX2 + FMA, the one the
/// CPU has chosen at run time (callers check `rowops::has_fma` first). `mul_add` in the body
/// compiles to FMA instructions there; on a CPU without FMA it would be a libm call per value.
macro_rules! fma_kernel {
    ($(#[$meta:meta])* fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $body:block) => {
        $(#[$meta])*
        #[allow(clippy::too_many_arguments)]
        fn $name($($arg: $ty),*) {
            #[inline(always)]
            #[allow(clippy::too_many_arguments)]
            fn body($($arg: $ty),*) $body
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,avx512dq,avx512vl,avx512bw,avx2,fma")]
                #[allow(clippy::too_many_arguments)]
                unsafe fn v4($($arg: $ty),*) { body($($arg),*) }
                #[target_feature(enable = "avx2,fma")]
                #[allow(clippy::too_many_arguments)]
                unsafe fn v3($($arg: $ty),*) { body($($arg),*) }
                if crate::kernels::rowops::has_avx512() {
                    // SAFETY: the CPU has the features (checked at run time).
                    return unsafe { v4($($arg),*) };
                }
                assert!(crate::kernels::rowops::has_fma(), "decode kernels need FMA (check decode::available)");
                // SAFETY: as above.
                return unsafe { v3($($arg),*) };
            }
            #[allow(unreachable_code)]
            body($($arg),*)
        }
    };
}

// ---------------------------------------------------------------------------------------------
// x W + b and x wte^T, with AVX-512 intrinsics (LLVM does not keep a tile of accumulators in
// registers when left to vectorise array loops: measured 7 GFLOP/s against 200 here)

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::SharedOut;
    use std::arch::x86_64::*;

    /// Rows `r0..r0 + MR`, columns `j0..j0 + 16 NV` of `x W + b`: x is `xt` transposed (K, M),
    /// W (K, N). The MR x NV accumulator registers stay live for the whole K loop.
    #[target_feature(enable = "avx512f")]
    #[allow(clippy::too_many_arguments)]
    pub(super) fn linear_tile<const MR: usize, const NV: usize>(
        xt: &[f32],
        m: usize,
        w: &[f32],
        n: usize,
        b: &[f32],
        r0: usize,
        j0: usize,
        out: &SharedOut,
    ) {
        let k = xt.len() / m;
        assert!(r0 + MR <= m && j0 + 16 * NV <= n && w.len() >= k * n && b.len() >= j0 + 16 * NV);
        // SAFETY: every load and store below is within the bounds asserted above.
        unsafe {
            let bias: [__m512; NV] = std::array::from_fn(|v| _mm512_loadu_ps(b.as_ptr().add(j0 + 16 * v)));
            let mut acc = [bias; MR];
            let (xp, wp) = (xt.as_ptr().add(r0), w.as_ptr().add(j0));
            for kk in 0..k {
                let wrow = wp.add(kk * n);
                let wv: [__m512; NV] = std::array::from_fn(|v| _mm512_loadu_ps(wrow.add(16 * v)));
                let xrow = xp.add(kk * m);
                for (r, accr) in acc.iter_mut().enumerate() {
                    let xb = _mm512_set1_ps(*xrow.add(r));
                    for (a, &wvv) in accr.iter_mut().zip(&wv) {
                        *a = _mm512_fmadd_ps(xb, wvv, *a);
                    }
                }
            }
            for (r, accr) in acc.iter().enumerate() {
                let o = out.at((r0 + r) * n + j0); // the row's 16 NV values lie inside (asserted)
                for (v, a) in accr.iter().enumerate() {
                    _mm512_storeu_ps(o.add(16 * v), *a);
                }
            }
        }
    }

    /// One query's attention over S cached positions: `out = softmax(q K^T * scale + bias) V`
    /// for head size 16 HV, keys and values `ks`, `vs` values apart; `scores` holds S values.
    /// Returns true (the head size matched a caller's dispatch).
    #[target_feature(enable = "avx512f")]
    #[allow(clippy::too_many_arguments)]
    pub(super) fn attend<const HV: usize>(
        q: &[f32],
        k: &[f32],
        ks: usize,
        v: &[f32],
        vs: usize,
        bias: &[f32],
        scale: f32,
        scores: &mut [f32],
        out: &mut [f32],
    ) -> bool {
        let s = scores.len();
        assert!(q.len() >= 16 * HV && out.len() >= 16 * HV && bias.len() >= s);
        assert!(s == 0 || (k.len() >= (s - 1) * ks + 16 * HV && v.len() >= (s - 1) * vs + 16 * HV));
        // SAFETY: every load and store is within the bounds asserted above.
        unsafe {
            let qv: [__m512; HV] = std::array::from_fn(|h| _mm512_loadu_ps(q.as_ptr().add(16 * h)));
            for (j, sc) in scores.iter_mut().enumerate() {
                let kp = k.as_ptr().add(j * ks);
                let mut acc = _mm512_mul_ps(qv[0], _mm512_loadu_ps(kp));
                for (h, &qh) in qv.iter().enumerate().skip(1) {
                    acc = _mm512_fmadd_ps(qh, _mm512_loadu_ps(kp.add(16 * h)), acc);
                }
                *sc = _mm512_reduce_add_ps(acc);
            }
            crate::kernels::rowops::masked_softmax_in_place(scores, bias, scale);
            let mut acc = [_mm512_setzero_ps(); HV];
            for (j, &p) in scores.iter().enumerate() {
                let (pb, vp) = (_mm512_set1_ps(p), v.as_ptr().add(j * vs));
                for (h, a) in acc.iter_mut().enumerate() {
                    *a = _mm512_fmadd_ps(pb, _mm512_loadu_ps(vp.add(16 * h)), *a);
                }
            }
            for (h, a) in acc.iter().enumerate() {
                _mm512_storeu_ps(out.as_mut_ptr().add(16 * h), *a);
            }
        }
        true
    }

    /// Logits of vocabulary rows `v0..v0 + VR` for input rows `r0..r0 + MR`: dot products of
    /// length C (a multiple of 16).
    #[target_feature(enable = "avx512f")]
    #[allow(clippy::too_many_arguments)]
    pub(super) fn logits_tile<const VR: usize, const MR: usize>(
        x: &[f32],
        c: usize,
        wte: &[f32],
        vocab: usize,
        v0: usize,
        r0: usize,
        out: &SharedOut,
    ) {
        assert!(c.is_multiple_of(16) && x.len() >= (r0 + MR) * c && wte.len() >= (v0 + VR) * c);
        // SAFETY: every load is within the bounds asserted above.
        unsafe {
            let mut acc = [[_mm512_setzero_ps(); MR]; VR];
            let (xp, wp) = (x.as_ptr().add(r0 * c), wte.as_ptr().add(v0 * c));
            for l in (0..c).step_by(16) {
                let xv: [__m512; MR] = std::array::from_fn(|r| _mm512_loadu_ps(xp.add(r * c + l)));
                for (v, accv) in acc.iter_mut().enumerate() {
                    let wv = _mm512_loadu_ps(wp.add(v * c + l));
                    for (a, &xr) in accv.iter_mut().zip(&xv) {
                        *a = _mm512_fmadd_ps(wv, xr, *a);
                    }
                }
            }
            for (v, accv) in acc.iter().enumerate() {
                for (r, a) in accv.iter().enumerate() {
                    *out.at((r0 + r) * vocab + v0 + v) = _mm512_reduce_add_ps(*a);
                }
            }
        }
    }
}

/// Column blocks `blocks` (of 128 columns for up to two rows, 64 otherwise) of every row of
/// `x W + b`.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
fn linear_blocks(
    xt: &[f32],
    m: usize,
    w: &[f32],
    n: usize,
    b: &[f32],
    width: usize,
    blocks: Range<usize>,
    out: &SharedOut,
) {
    use avx512::linear_tile;
    assert!(crate::kernels::rowops::has_avx512(), "decode kernels need AVX-512 (check decode::available)");
    for blk in blocks {
        let j0 = blk * width;
        let mut r0 = 0;
        // SAFETY (each call): the CPU has AVX-512 (asserted above).
        unsafe {
            if width == 128 {
                while r0 + 2 <= m {
                    linear_tile::<2, 8>(xt, m, w, n, b, r0, j0, out);
                    r0 += 2;
                }
                if r0 < m {
                    linear_tile::<1, 8>(xt, m, w, n, b, r0, j0, out);
                }
            } else {
                // 6 rows x 4 registers: 24 accumulators, 10 loads for 24 FMAs per step of K.
                while r0 + 6 <= m {
                    linear_tile::<6, 4>(xt, m, w, n, b, r0, j0, out);
                    r0 += 6;
                }
                while r0 + 2 <= m {
                    linear_tile::<2, 4>(xt, m, w, n, b, r0, j0, out);
                    r0 += 2;
                }
                if r0 < m {
                    linear_tile::<1, 4>(xt, m, w, n, b, r0, j0, out);
                }
            }
        }
    }
}

/// Columns `cols` (any width) of every row, one column at a time: the tail of N.
fn linear_columns_scalar(xt: &[f32], m: usize, w: &[f32], n: usize, b: &[f32], cols: Range<usize>, out: &SharedOut) {
    for r in 0..m {
        for j in cols.clone() {
            let mut a = b[j];
            for (xk, wk) in xt.chunks_exact(m).zip(w.chunks_exact(n)) {
                a += xk[r] * wk[j];
            }
            // SAFETY: the tail columns belong to this call alone.
            unsafe { *out.at(r * n + j) = a };
        }
    }
}

/// `x W + b` for x (M, K) with M at most [`MAX_LINEAR_ROWS`], W (K, N), b (N,), all row-major:
/// (M, N) row-major. Needs [`available`].
pub fn linear_rows(x: &[f32], m: usize, w: &[f32], b: &[f32]) -> Vec<f32> {
    let k = x.len().checked_div(m).unwrap_or(0);
    let n = b.len();
    assert!(x.len() == m * k && w.len() == k * n, "linear_rows: x {} values, W {} values, N {n}", x.len(), w.len());
    let xt = transpose(x, m, k);
    // Wide blocks for one or two rows (long contiguous runs of each weight row), narrower ones
    // for more rows (more rows per block in registers).
    let width = if m <= 2 { 128 } else { 64 };
    let full = if m == 0 { 0 } else { n / width };
    let mut out = Vec::new();
    let shared = SharedOut::new(&mut out, m * n);
    #[cfg(target_arch = "x86_64")]
    par_rows(full, k * n, |blocks| linear_blocks(&xt, m, w, n, b, width, blocks, &shared));
    #[cfg(not(target_arch = "x86_64"))]
    let full = 0;
    linear_columns_scalar(&xt, m, w, n, b, full * width..n, &shared);
    // SAFETY: the blocks and the tail wrote every value.
    unsafe { out.set_len(m * n) };
    out
}

fn transpose(x: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut t = vec![0f32; x.len()];
    for (r, row) in x.chunks_exact(cols.max(1)).enumerate().take(rows) {
        for (c, &v) in row.iter().enumerate() {
            t[c * rows + r] = v;
        }
    }
    t
}

/// Logits of vocabulary groups `groups` (of 8 ids for up to 3 rows, 4 otherwise) for every
/// input row.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
fn lm_head_groups(
    x: &[f32],
    m: usize,
    c: usize,
    wte: &[f32],
    vocab: usize,
    group: usize,
    groups: Range<usize>,
    out: &SharedOut,
) {
    use avx512::logits_tile;
    assert!(crate::kernels::rowops::has_avx512(), "decode kernels need AVX-512 (check decode::available)");
    for g in groups {
        let v0 = g * group;
        // SAFETY (each call): the CPU has AVX-512 (asserted above).
        unsafe {
            if group == 8 {
                for r0 in 0..m {
                    logits_tile::<8, 1>(x, c, wte, vocab, v0, r0, out);
                }
            } else {
                let mut r0 = 0;
                while r0 + 4 <= m {
                    logits_tile::<4, 4>(x, c, wte, vocab, v0, r0, out);
                    r0 += 4;
                }
                while r0 < m {
                    logits_tile::<4, 1>(x, c, wte, vocab, v0, r0, out);
                    r0 += 1;
                }
            }
        }
    }
}

/// `x wte^T` for x (M, C) and wte (V, C), row-major: the (M, V) logits of the tied LM head,
/// faster than gemm up to [`MAX_LM_HEAD_TILE_ROWS`] rows. Needs [`available`].
pub fn lm_head_rows(x: &[f32], m: usize, wte: &[f32], vocab: usize) -> Vec<f32> {
    let c = wte.len().checked_div(vocab).unwrap_or(0);
    assert!(x.len() == m * c && wte.len() == vocab * c, "lm_head_rows: x {} values, wte {} values", x.len(), wte.len());
    let mut out = Vec::new();
    let shared = SharedOut::new(&mut out, m * vocab);
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    if c.is_multiple_of(16) && c > 0 {
        let group = if m < 4 { 8 } else { 4 };
        let full = vocab / group;
        par_rows(full, vocab * c, |groups| lm_head_groups(x, m, c, wte, vocab, group, groups, &shared));
        done = full * group;
    }
    lm_head_scalar(x, m, c, wte, vocab, done..vocab, &shared);
    // SAFETY: every (row, id) was written.
    unsafe { out.set_len(m * vocab) };
    out
}

fn lm_head_scalar(x: &[f32], m: usize, c: usize, wte: &[f32], vocab: usize, ids: Range<usize>, out: &SharedOut) {
    for v in ids {
        for r in 0..m {
            let dot: f32 = x[r * c..(r + 1) * c].iter().zip(&wte[v * c..(v + 1) * c]).map(|(a, b)| a * b).sum();
            // SAFETY: these ids belong to this call alone.
            unsafe { *out.at(r * vocab + v) = dot };
        }
    }
}

// ---------------------------------------------------------------------------------------------
// softmax(q k^T * scale + bias) v over the KV cache

/// The shapes of one [`cached_attention`] call.
#[derive(Clone, Copy)]
struct AttentionShape {
    b: usize,
    nh: usize,
    t: usize,
    s: usize,
    hd: usize,
}

fma_kernel! {
    /// Heads `pairs` (b * NH + h) of the attention of T queries over S cached keys. `q` is
    /// (B, NH, T, HD) contiguous; `k`, `v` start at `k0`, `v0` with strides `ks`, `vs` over
    /// (B, NH, S, HD) (the cache's buffers, HD contiguous); `bias` (BB, 1, T, S) with BB 1 or B;
    /// `out` (B, T, NH * HD).
    fn attention_pairs(q: &[f32], k: &[f32], k0: usize, ks: [usize; 3], v: &[f32], v0: usize, vs: [usize; 3], bias: &[f32], bias_rows: usize, scale: f32, shape: AttentionShape, pairs: Range<usize>, out: &SharedOut) {
        let AttentionShape { nh, t, s, hd, .. } = shape;
        let mut scores = vec![0f32; s];
        let mut acc = vec![0f32; hd];
        #[cfg(target_arch = "x86_64")]
        let avx512 = crate::kernels::rowops::has_avx512();
        for pair in pairs {
            let (bi, h) = (pair / nh, pair % nh);
            let (kp, vp) = (&k[k0 + bi * ks[0] + h * ks[1]..], &v[v0 + bi * vs[0] + h * vs[1]..]);
            for i in 0..t {
                let qi = &q[(pair * t + i) * hd..][..hd];
                let bias_row = &bias[((if bias_rows == 1 { 0 } else { bi }) * t + i) * s..][..s];
                #[cfg(target_arch = "x86_64")]
                let done = avx512 && {
                    // SAFETY: the CPU has AVX-512 (checked once above).
                    unsafe {
                        match hd {
                            32 => avx512::attend::<2>(qi, kp, ks[2], vp, vs[2], bias_row, scale, &mut scores, &mut acc),
                            64 => avx512::attend::<4>(qi, kp, ks[2], vp, vs[2], bias_row, scale, &mut scores, &mut acc),
                            128 => avx512::attend::<8>(qi, kp, ks[2], vp, vs[2], bias_row, scale, &mut scores, &mut acc),
                            _ => false,
                        }
                    }
                };
                #[cfg(not(target_arch = "x86_64"))]
                let done = false;
                if !done {
                    for (j, sc) in scores.iter_mut().enumerate() {
                        *sc = crate::kernels::rowops::dot(qi, &kp[j * ks[2]..][..hd]);
                    }
                    crate::kernels::rowops::masked_softmax_in_place(&mut scores, bias_row, scale);
                    acc.iter_mut().for_each(|a| *a = 0.0);
                    for (j, &p) in scores.iter().enumerate() {
                        for (a, &vv) in acc.iter_mut().zip(&vp[j * vs[2]..][..hd]) {
                            *a = p.mul_add(vv, *a);
                        }
                    }
                }
                let o = (bi * t + i) * nh * hd + h * hd;
                // SAFETY: each (batch, query, head) slot belongs to one pair.
                unsafe { out.range(o..o + hd) }.copy_from_slice(&acc);
            }
        }
    }
}

/// `logsumexp` of each row of `logits` (rows of `width` values), summed in f64, rows in
/// parallel: the normaliser of every new token's log-probability.
pub fn log_sum_exp_rows(logits: &[f32], width: usize) -> Vec<f64> {
    let rows = logits.len().checked_div(width).unwrap_or(0);
    let mut lse = vec![0f64; rows];
    let shared = SharedOutF64(lse.as_mut_ptr());
    par_rows(rows, logits.len(), |range| {
        for r in range {
            let v = crate::kernels::rowops::log_sum_exp_f64(&logits[r * width..(r + 1) * width]);
            // SAFETY: each row's slot is written by the one worker that has the row.
            unsafe { *shared.slot(r) = v };
        }
    });
    lse
}

/// The output of [`log_sum_exp_rows`], shared with the pool's workers (disjoint slots).
#[derive(Clone, Copy)]
struct SharedOutF64(*mut f64);
impl SharedOutF64 {
    /// Where row `r`'s value goes (the caller keeps `r` below the vector's length).
    fn slot(self, r: usize) -> *mut f64 {
        self.0.wrapping_add(r)
    }
}
// SAFETY: each worker writes its own rows' slots only.
unsafe impl Send for SharedOutF64 {}
// SAFETY: as above.
unsafe impl Sync for SharedOutF64 {}

// ---------------------------------------------------------------------------------------------
// candle ops

/// The whole f32 buffer of `s` (the KV cache's buffers are read through their layouts' strides).
fn f32_slice<'a>(s: &'a CpuStorage, what: &str) -> Result<&'a [f32]> {
    match s {
        CpuStorage::F32(v) => Ok(v),
        _ => candle_core::bail!("{what} must be f32"),
    }
}

/// The tied LM head `x wte^T` for a few rows (CustomOp2; backward dx = dy wte, dwte = dy^T x).
struct LmHead;

impl CustomOp2 for LmHead {
    fn name(&self) -> &'static str {
        "decode-lm-head"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        let x = contiguous(s1, l1, "LM head input")?;
        let wte = contiguous(s2, l2, "wte")?;
        let (vocab, c) = l2.shape().dims2()?;
        let m = x.len() / c.max(1);
        let logits = if m <= MAX_LM_HEAD_TILE_ROWS && available() {
            lm_head_rows(x, m, wte, vocab)
        } else {
            lm_head_gemm(x, m, wte, vocab)
        };
        Ok((CpuStorage::F32(logits), Shape::from((m, vocab))))
    }

    fn bwd(&self, x: &Tensor, wte: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let dx = x.track_op().then(|| grad.matmul(&wte.detach())).transpose()?;
        let dw = wte.track_op().then(|| grad.t()?.matmul(&x.detach())).transpose()?;
        Ok((dx, dw))
    }
}

/// `x wte^T` with gemm the right way round: asked for (M, V) logits, gemm would pack all of
/// `wte` for its left operand at every call; asked for their transpose `wte x^T` (V, M), it
/// reads `wte` in place (1.6-2x faster for 16-64 rows). A blocked transpose then costs M*V
/// values of memory traffic.
fn lm_head_gemm(x: &[f32], m: usize, wte: &[f32], vocab: usize) -> Vec<f32> {
    let c = wte.len().checked_div(vocab).unwrap_or(0);
    let mut t = vec![0f32; vocab * m];
    // SAFETY: wte is (V, C) row-major, x (M, C) read as x^T (C, M), t (V, M) row-major.
    unsafe {
        gemm_f32(
            (vocab, m, c),
            t.as_mut_ptr(),
            m,
            wte.as_ptr(),
            (c, 1),
            x.as_ptr(),
            (1, c),
            false,
            crate::runtime::threads(),
        )
    };
    const BLOCK: usize = 64; // ids per block: the block's (BLOCK, M) slab of t stays in L1
    let mut out = Vec::new();
    let shared = SharedOut::new(&mut out, m * vocab);
    par_rows(vocab.div_ceil(BLOCK), m * vocab, |blocks| {
        for blk in blocks {
            let ids = blk * BLOCK..((blk + 1) * BLOCK).min(vocab);
            for r in 0..m {
                // SAFETY: each block of ids owns these runs of every row.
                let row = unsafe { shared.range(r * vocab + ids.start..r * vocab + ids.end) };
                for (o, v) in row.iter_mut().zip(ids.clone()) {
                    *o = t[v * m + r];
                }
            }
        }
    });
    // SAFETY: every block wrote its runs of every row.
    unsafe { out.set_len(m * vocab) };
    out
}

/// `x wte^T`: (M, C), (V, C) -> (M, V) f32 on the CPU, for M up to about [`MAX_LM_HEAD_ROWS`].
pub fn lm_head(x: &Tensor, wte: &Tensor) -> Result<Tensor> {
    x.contiguous()?.apply_op2(&wte.contiguous()?, LmHead)
}

/// Attention of new queries over the KV cache, without backward (the cache itself is written
/// in place and is not differentiable): the bias travels in the op.
struct CachedAttention {
    bias: Vec<f32>,
    bias_rows: usize,
    scale: f32,
}

impl CustomOp3 for CachedAttention {
    fn name(&self) -> &'static str {
        "decode-cached-attention"
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
        let q = contiguous(s1, l1, "queries")?;
        let (b, nh, t, hd) = l1.shape().dims4()?;
        let s = l2.shape().dims4()?.2;
        let strides = |l: &Layout, what: &str| -> Result<[usize; 3]> {
            let st = l.stride();
            if l.shape().dims4()? != (b, nh, s, hd) || st[3] != 1 {
                candle_core::bail!("decode kernel: the cached {what} must be (B, NH, S, HD) with HD contiguous");
            }
            Ok([st[0], st[1], st[2]])
        };
        let (ks, vs) = (strides(l2, "keys")?, strides(l3, "values")?);
        if self.bias.len() != self.bias_rows * t * s || !(self.bias_rows == 1 || self.bias_rows == b) {
            candle_core::bail!("decode kernel: the attention bias does not match (B, 1, T, S)");
        }
        let (k, v) = (f32_slice(s2, "keys")?, f32_slice(s3, "values")?);
        let shape = AttentionShape { b, nh, t, s, hd };
        let mut out = Vec::new();
        let shared = SharedOut::new(&mut out, b * t * nh * hd);
        par_rows(b * nh, b * nh * t * s * hd, |pairs| {
            attention_pairs(
                q,
                k,
                l2.start_offset(),
                ks,
                v,
                l3.start_offset(),
                vs,
                &self.bias,
                self.bias_rows,
                self.scale,
                shape,
                pairs,
                &shared,
            )
        });
        // SAFETY: every (batch, head) pair wrote its slots.
        unsafe { out.set_len(b * t * nh * hd) };
        Ok((CpuStorage::F32(out), Shape::from((shape.b, t, nh * hd))))
    }
}

/// `softmax(q k^T * scale + bias) v` with heads side by side: q (B, NH, T, HD), the cached keys
/// and values (B, NH, S, HD) as the cache hands them out (views of its buffers: read in place),
/// bias (B or 1, 1, T, S) -> (B, T, NH * HD). f32 on the CPU; no gradient.
pub fn cached_attention(q: &Tensor, k: &Tensor, v: &Tensor, bias: &Tensor, scale: f64) -> Result<Tensor> {
    let bias_rows = bias.dim(0)?;
    let bias = bias.flatten_all()?.to_vec1::<f32>()?;
    q.contiguous()?.apply_op3_no_bwd(k, v, &CachedAttention { bias, bias_rows, scale: scale as f32 })
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device, D};

    fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
        (a - b).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap()
    }

    /// The AVX-512 kernel where the CPU has it; on every CPU, the path the model takes for a
    /// decoding step's rows (`ops::linear`: this kernel, else gemm), so the test always checks
    /// something and says what it skipped.
    #[test]
    fn linear_rows_matches_matmul_for_every_row_count_and_a_ragged_width() -> Result<()> {
        if !available() {
            println!(
                "skipped: no AVX-512 on this CPU, so linear_rows is not run; checking the portable path ops::linear"
            );
        }
        let dev = Device::Cpu;
        // 200 columns: 6 blocks of 32 and a tail of 8 (1 block of 128 and a tail of 72 for M <= 2).
        for (k, n) in [(64, 200), (96, 256)] {
            let w = Tensor::randn(0f32, 1.0, (k, n), &dev)?;
            let b = Tensor::randn(0f32, 1.0, n, &dev)?;
            for m in [1, 2, 3, 4, 5, 8, 13, 32] {
                let x = Tensor::randn(0f32, 1.0, (m, k), &dev)?;
                let want = x.matmul(&w)?.broadcast_add(&b)?;
                let dispatched = crate::kernels::ops::linear(&x, &w, &b)?;
                assert!(max_diff(&dispatched, &want) < 1e-4, "ops::linear m {m} k {k} n {n}");
                if available() {
                    let got = linear_rows(&x.flatten_all()?.to_vec1()?, m, &w.flatten_all()?.to_vec1()?, &b.to_vec1()?);
                    let got = Tensor::from_vec(got, (m, n), &dev)?;
                    assert!(max_diff(&got, &want) < 1e-4, "m {m} k {k} n {n}: {}", max_diff(&got, &want));
                }
            }
        }
        Ok(())
    }

    #[test]
    fn lm_head_matches_matmul_and_has_the_matmul_gradient() -> Result<()> {
        let dev = Device::Cpu;
        // 37 ids: groups of 8 or 4 and a scalar tail; C = 48 (3 x 16) and C = 40 (scalar only).
        for c in [48, 40] {
            let wte = candle_core::Var::randn(0f32, 1.0, (37, c), &dev)?;
            for m in [1, 3, 4, 6, 32] {
                let x = candle_core::Var::randn(0f32, 1.0, (m, c), &dev)?;
                let want = x.matmul(&wte.t()?)?;
                let got = lm_head(&x, &wte)?;
                assert!(max_diff(&got, &want) < 1e-4, "m {m} c {c}");
                let coef = Tensor::randn(0f32, 1.0, (m, 37), &dev)?;
                let (gw, gg) = ((&want * &coef)?.sum_all()?.backward()?, (&got * &coef)?.sum_all()?.backward()?);
                for var in [&x, &wte] {
                    let (a, b) = (gw.get(var).expect("grad"), gg.get(var).expect("grad"));
                    assert!(max_diff(a, b) < 1e-4, "gradient m {m} c {c}");
                }
            }
        }
        Ok(())
    }

    /// The kernel where the CPU has FMA; on every CPU, `ops::cached_attention` (this kernel, else
    /// the composed ops) on the same cache views.
    #[test]
    fn cached_attention_matches_the_composed_ops_on_cache_views() -> Result<()> {
        if !crate::kernels::rowops::has_fma() {
            println!("skipped: no AVX2/FMA on this CPU, so the cached_attention kernel is not run; checking ops::cached_attention");
        }
        let dev = Device::Cpu;
        let (b, nh, cap) = (3, 2, 10);
        // Head sizes 32 and 64 take the AVX-512 path, 24 the portable one.
        for (hd, t, s, bias_rows) in [(24, 1, 7, 3), (32, 1, 9, 3), (64, 4, 7, 1), (64, 2, 9, 3), (24, 2, 1, 1)] {
            // Keys and values as the KV cache hands them out: the first S positions of a larger buffer.
            let kbuf = Tensor::randn(0f32, 1.0, (b, nh, cap, hd), &dev)?;
            let vbuf = Tensor::randn(0f32, 1.0, (b, nh, cap, hd), &dev)?;
            let (k, v) = (kbuf.narrow(2, 0, s)?, vbuf.narrow(2, 0, s)?);
            let q = Tensor::randn(0f32, 1.0, (b, nh, t, hd), &dev)?;
            // A padding-style mask: some keys of some rows masked out.
            let bias: Vec<f32> = (0..bias_rows * t * s).map(|i| if i % 5 == 1 { -1e9 } else { 0.0 }).collect();
            let bias = Tensor::from_vec(bias, (bias_rows, 1, t, s), &dev)?;
            let scale = 1.0 / (hd as f64).sqrt();
            let att = crate::kernels::ops::masked_softmax_reference(&q.matmul(&k.t()?)?, scale, &bias)?;
            let want = crate::kernels::ops::merge_heads(&att.matmul(&v.contiguous()?)?)?;
            let dispatched = crate::kernels::ops::cached_attention(&q, &k, &v, &bias, scale)?;
            assert!(max_diff(&dispatched, &want) < 1e-5, "ops::cached_attention hd {hd} t {t} s {s}");
            if !crate::kernels::rowops::has_fma() {
                continue;
            }
            let got = cached_attention(&q, &k, &v, &bias, scale)?;
            assert_eq!(got.dims(), [b, t, nh * hd]);
            assert!(max_diff(&got, &want) < 1e-5, "hd {hd} t {t} s {s}: {}", max_diff(&got, &want));
            assert_eq!(got.dtype(), DType::F32);
            let _ = got.sum(D::Minus1)?;
        }
        Ok(())
    }
}
