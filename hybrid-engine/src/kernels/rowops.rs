//! The per-row arithmetic of the fused kernels (`ops/*.rs`), on plain slices.
//!
//! Written as simple loops over independent lanes (eight or sixteen accumulators for
//! reductions, branch-free `exp` and `tanh`) so that LLVM vectorises them, and compiled three
//! times by [`multiversion!`]: for AVX-512, for AVX2 with FMA, and for the baseline target; the
//! widest the CPU supports is picked at run time, so the binary stays portable (the release
//! build targets baseline x86-64, where libm's scalar `expf` and `tanhf` would dominate).

/// Defines `fn $name(args) -> ret` whose body is compiled for AVX-512, for AVX2 + FMA and for
/// the baseline target, choosing at run time.
macro_rules! multiversion {
    ($(#[$meta:meta])* pub fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)? $body:block) => {
        $(#[$meta])*
        pub fn $name($($arg: $ty),*) $(-> $ret)? {
            #[inline(always)]
            #[allow(clippy::too_many_arguments)]
            fn body($($arg: $ty),*) $(-> $ret)? $body
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,avx512dq,avx512vl,avx512bw,avx2,fma")]
                #[allow(clippy::too_many_arguments)]
                unsafe fn v4($($arg: $ty),*) $(-> $ret)? {
                    body($($arg),*)
                }
                #[target_feature(enable = "avx2,fma")]
                #[allow(clippy::too_many_arguments)]
                unsafe fn v3($($arg: $ty),*) $(-> $ret)? {
                    body($($arg),*)
                }
                match simd_level() {
                    // SAFETY: the CPU has the features (checked at run time).
                    SimdLevel::V4 => return unsafe { v4($($arg),*) },
                    SimdLevel::V3 => return unsafe { v3($($arg),*) },
                    SimdLevel::Baseline => {}
                }
            }
            body($($arg),*)
        }
    };
}

#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum SimdLevel {
    V4,
    V3,
    Baseline,
}

#[cfg(target_arch = "x86_64")]
fn simd_level() -> SimdLevel {
    use std::sync::OnceLock;
    static LEVEL: OnceLock<SimdLevel> = OnceLock::new();
    *LEVEL.get_or_init(|| {
        use std::arch::is_x86_feature_detected as has;
        if has!("avx512f") && has!("avx512dq") && has!("avx512vl") && has!("avx512bw") && has!("avx2") && has!("fma") {
            SimdLevel::V4
        } else if has!("avx2") && has!("fma") {
            SimdLevel::V3
        } else {
            SimdLevel::Baseline
        }
    })
}

/// Whether the CPU has AVX-512 (the F, DQ, VL and BW subsets).
pub fn has_avx512() -> bool {
    #[cfg(target_arch = "x86_64")]
    return simd_level() == SimdLevel::V4;
    #[allow(unreachable_code)]
    false
}

/// Whether the CPU has AVX2 with FMA (or more).
pub fn has_fma() -> bool {
    #[cfg(target_arch = "x86_64")]
    return simd_level() != SimdLevel::Baseline;
    #[allow(unreachable_code)]
    false
}

/// Lanes of the accumulators in reductions: one AVX-512 register of f32.
const LANES: usize = 16;

#[inline(always)]
fn sum(xs: &[f32]) -> f32 {
    let mut acc = [0f32; LANES];
    let chunks = xs.chunks_exact(LANES);
    let tail: f32 = chunks.remainder().iter().sum();
    for c in chunks {
        for (a, x) in acc.iter_mut().zip(c) {
            *a += x;
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// `sum(xs * ys)` in 16 lanes (inlined into the caller's target features).
#[inline(always)]
pub(crate) fn dot(xs: &[f32], ys: &[f32]) -> f32 {
    let mut acc = [0f32; LANES];
    let (cx, cy) = (xs.chunks_exact(LANES), ys.chunks_exact(LANES));
    let tail: f32 = cx.remainder().iter().zip(cy.remainder()).map(|(x, y)| x * y).sum();
    for (a16, b16) in cx.zip(cy) {
        for ((a, x), y) in acc.iter_mut().zip(a16).zip(b16) {
            *a += x * y;
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// The largest value (a plain comparison rather than `f32::max`, whose NaN rules keep LLVM from
/// vectorising; a NaN input still reaches the result through the sums that follow).
#[inline(always)]
fn max(xs: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; LANES];
    let chunks = xs.chunks_exact(LANES);
    let tail = chunks.remainder().iter().copied().fold(f32::NEG_INFINITY, f32::max);
    for c in chunks {
        for (a, x) in acc.iter_mut().zip(c) {
            *a = if *x > *a { *x } else { *a };
        }
    }
    acc.iter().copied().fold(tail, f32::max)
}

/// `exp(x)` to about 2 ulp (Cephes `expf`: x = n ln2 + r, a degree-6 polynomial for e^r,
/// 2^n from the exponent bits), branch-free so loops over it vectorise. 0 below -87.3 (where
/// f32 turns subnormal), +inf-free: inputs above 88 are clamped (softmax and log-sum-exp only
/// pass x <= 0).
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    const ROUND: f32 = 12_582_912.0; // 1.5 * 2^23: adding it rounds to an integer
    let underflow = x < -87.3;
    let x = x.clamp(-87.3, 88.0);
    let n = (x * LOG2E + ROUND) - ROUND;
    let r = x - n * LN2_HI - n * LN2_LO;
    let mut p = 1.987_569_1e-4f32;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 0.5;
    let e = p * r * r + r + 1.0;
    // 2^n from its biased exponent n + 127 (an integer in 1..=254): added to 2^23 it lands in
    // the mantissa bits, and shifting those into the exponent field gives 2^n. A float-to-int
    // cast would do, but Rust's saturating `as` keeps LLVM from vectorising the loop.
    let scale = f32::from_bits((n + (127.0 + 8_388_608.0)).to_bits() << 23);
    if underflow {
        0.0
    } else {
        e * scale
    }
}

/// `tanh(x)` by Eigen's `ptanh_float` rational approximation (a few ulp), branch-free.
#[inline(always)]
pub fn tanh(x: f32) -> f32 {
    let x = x.clamp(-7.905_311, 7.905_311);
    let x2 = x * x;
    let mut p = -2.760_768_5e-16f32;
    p = p * x2 + 2.000_188e-13;
    p = p * x2 + -8.604_672e-11;
    p = p * x2 + 5.122_297e-8;
    p = p * x2 + 1.485_722_4e-5;
    p = p * x2 + 6.372_619_3e-4;
    p = p * x2 + 4.893_524_6e-3;
    let mut q = 1.198_258_4e-6f32;
    q = q * x2 + 1.185_347_1e-4;
    q = q * x2 + 2.268_434_6e-3;
    q = q * x2 + 4.893_525e-3;
    x * p / q
}

/// sqrt(2 / pi) and the cubic coefficient of GPT-2's tanh GELU (`gelu_new`).
const GELU_K0: f32 = 0.797_884_6;
const GELU_K1: f32 = 0.044_715;

multiversion! {
    /// `logsumexp(row)`.
    pub fn log_sum_exp(row: &[f32]) -> f32 {
        let m = max(row);
        let mut acc = [0f32; LANES];
        let chunks = row.chunks_exact(LANES);
        let tail: f32 = chunks.remainder().iter().map(|x| exp(x - m)).sum();
        for c in chunks {
            for (a, x) in acc.iter_mut().zip(c) {
                *a += exp(x - m);
            }
        }
        m + (acc.iter().sum::<f32>() + tail).ln()
    }
}

multiversion! {
    /// The index of the first largest value (NaNs are never chosen; 0 for an empty or all-NaN
    /// row): the vectorised maximum, then a search for it.
    pub fn argmax(row: &[f32]) -> usize {
        let m = max(row);
        row.iter().position(|&x| x == m).unwrap_or(0)
    }
}

multiversion! {
    /// `logsumexp(row)` with the exponentials summed in f64 (generation's log-probs).
    pub fn log_sum_exp_f64(row: &[f32]) -> f64 {
        let m = max(row);
        let mut acc = [0f64; LANES];
        let chunks = row.chunks_exact(LANES);
        let tail: f64 = chunks.remainder().iter().map(|x| exp(x - m) as f64).sum();
        for c in chunks {
            for (a, x) in acc.iter_mut().zip(c) {
                *a += exp(x - m) as f64;
            }
        }
        m as f64 + (acc.iter().sum::<f64>() + tail).ln()
    }
}

multiversion! {
    /// `out = exp(row - lse) * g`: the softmax scaled by the row's upstream gradient.
    pub fn softmax_times(row: &[f32], lse: f32, g: f32, out: &mut [f32]) {
        for (o, x) in out.iter_mut().zip(row) {
            *o = exp(x - lse) * g;
        }
    }
}

multiversion! {
    /// `row = exp(row - lse) * g`.
    pub fn softmax_times_in_place(row: &mut [f32], lse: f32, g: f32) {
        for x in row.iter_mut() {
            *x = exp(*x - lse) * g;
        }
    }
}

/// Softmax in place over a row of scores.
#[inline(always)]
fn softmax_in_place(row: &mut [f32]) {
    let m = max(row);
    for x in row.iter_mut() {
        *x = exp(*x - m);
    }
    let inv = 1.0 / sum(row);
    row.iter_mut().for_each(|x| *x *= inv);
}

multiversion! {
    /// `out = softmax(att * scale + bias)`.
    pub fn masked_softmax(att: &[f32], bias: &[f32], scale: f32, out: &mut [f32]) {
        for ((o, a), b) in out.iter_mut().zip(att).zip(bias) {
            *o = a * scale + b;
        }
        softmax_in_place(out);
    }
}

multiversion! {
    /// `row = softmax(row * scale + bias)`.
    pub fn masked_softmax_in_place(row: &mut [f32], bias: &[f32], scale: f32) {
        for (x, b) in row.iter_mut().zip(bias) {
            *x = *x * scale + b;
        }
        softmax_in_place(row);
    }
}

multiversion! {
    /// `out = scale * y * (dy - sum(dy * y))`: softmax's backward from its output y.
    pub fn masked_softmax_grad(y: &[f32], dy: &[f32], scale: f32, out: &mut [f32]) {
        let d = dot(y, dy);
        for ((o, y), dy) in out.iter_mut().zip(y).zip(dy) {
            *o = scale * y * (dy - d);
        }
    }
}

multiversion! {
    /// [`masked_softmax_grad`] overwriting `dy`.
    pub fn masked_softmax_grad_in_place(y: &[f32], dy: &mut [f32], scale: f32) {
        let d = dot(y, dy);
        for (dy, y) in dy.iter_mut().zip(y) {
            *dy = scale * y * (*dy - d);
        }
    }
}

multiversion! {
    /// `sum(x^2)`, squared and summed in f64 lanes. (f32 lanes lost 6e-6 relative on an
    /// embedding gradient of 400k values, mostly zeros and a few large rows: more than the
    /// reassociation that tensor and data parallelism are checked against.)
    pub fn sum_of_squares(x: &[f32]) -> f64 {
        let mut acc = [0f64; LANES];
        let chunks = x.chunks_exact(LANES);
        let tail: f64 = chunks.remainder().iter().map(|&x| f64::from(x) * f64::from(x)).sum();
        for c in chunks {
            for (a, &x) in acc.iter_mut().zip(c) {
                let x = f64::from(x);
                *a += x * x;
            }
        }
        acc.iter().sum::<f64>() + tail
    }
}

multiversion! {
    /// `acc += x`.
    pub fn add_assign(acc: &mut [f32], x: &[f32]) {
        for (a, x) in acc.iter_mut().zip(x) {
            *a += x;
        }
    }
}

/// Mean and 1 / std (biased variance) of a row.
#[inline(always)]
fn row_stats(row: &[f32], eps: f32) -> (f32, f32) {
    let c = row.len() as f32;
    let mean = sum(row) / c;
    let mut acc = [0f32; LANES];
    let chunks = row.chunks_exact(LANES);
    let tail: f32 = chunks.remainder().iter().map(|x| (x - mean) * (x - mean)).sum();
    for ch in chunks {
        for (a, x) in acc.iter_mut().zip(ch) {
            *a += (x - mean) * (x - mean);
        }
    }
    let var = (acc.iter().sum::<f32>() + tail) / c;
    (mean, 1.0 / (var + eps).sqrt())
}

multiversion! {
    /// `out = (x - mean) * rstd * w + b`.
    pub fn layer_norm(x: &[f32], w: &[f32], b: &[f32], eps: f32, out: &mut [f32]) {
        let (mean, rstd) = row_stats(x, eps);
        for (((o, x), w), b) in out.iter_mut().zip(x).zip(w).zip(b) {
            *o = (x - mean) * rstd * w + b;
        }
    }
}

multiversion! {
    /// LayerNorm's backward for one row: `dx = rstd * (dy*w - mean(dy*w) - xhat * mean(dy*w *
    /// xhat))` into `dx`, and `dw += dy * xhat`, `db += dy`. `scratch` holds 2 * C values.
    #[allow(clippy::too_many_arguments)]
    pub fn layer_norm_grad(
        x: &[f32],
        w: &[f32],
        dy: &[f32],
        eps: f32,
        dx: &mut [f32],
        dw: &mut [f32],
        db: &mut [f32],
        scratch: &mut [f32],
    ) {
        let c = x.len();
        let (mean, rstd) = row_stats(x, eps);
        let (xhat, gw) = scratch.split_at_mut(c);
        for (((xh, gw), (x, g)), w) in xhat.iter_mut().zip(gw.iter_mut()).zip(x.iter().zip(dy)).zip(w) {
            *xh = (x - mean) * rstd;
            *gw = g * w;
        }
        let mean_gw = sum(gw) / c as f32;
        let mean_gw_xhat = dot(gw, xhat) / c as f32;
        for ((o, gw), xh) in dx.iter_mut().zip(gw.iter()).zip(xhat.iter()) {
            *o = rstd * (gw - mean_gw - xh * mean_gw_xhat);
        }
        for (((dw, db), g), xh) in dw.iter_mut().zip(db.iter_mut()).zip(dy).zip(xhat.iter()) {
            *dw += g * xh;
            *db += g;
        }
    }
}

/// `gelu_new(u)` and its derivative.
#[inline(always)]
fn gelu_and_slope(u: f32) -> (f32, f32) {
    let t = tanh(GELU_K0 * u * (1.0 + GELU_K1 * u * u));
    let slope = 0.5 * (1.0 + t) + 0.5 * u * (1.0 - t * t) * GELU_K0 * (1.0 + 3.0 * GELU_K1 * u * u);
    (0.5 * u * (1.0 + t), slope)
}

multiversion! {
    /// `out = gelu_new(h)`.
    pub fn gelu(h: &[f32], out: &mut [f32]) {
        for (o, h) in out.iter_mut().zip(h) {
            *o = gelu_and_slope(*h).0;
        }
    }
}

multiversion! {
    /// `out = dy * gelu_new'(h)`.
    pub fn gelu_grad(h: &[f32], dy: &[f32], out: &mut [f32]) {
        for ((o, h), g) in out.iter_mut().zip(h).zip(dy) {
            *o = g * gelu_and_slope(*h).1;
        }
    }
}

/// SplitMix64's output function: a bijective 64-bit mix.
#[inline(always)]
pub fn splitmix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// SplitMix64's increment (the golden ratio in 64 bits).
pub const GOLDEN_GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

/// Dropout's multiplier of element `i` of the site seeded `seed` (see `ops::DropoutMask`):
/// `scale` where the high half of SplitMix64's `i`-th output is at least `threshold`, else 0.
#[inline(always)]
pub fn dropout_factor(seed: u64, threshold: u32, scale: f32, i: u64) -> f32 {
    let draw = (splitmix64(seed.wrapping_add((i + 1).wrapping_mul(GOLDEN_GAMMA))) >> 32) as u32;
    if draw >= threshold {
        scale
    } else {
        0.0
    }
}

multiversion! {
    /// `out[j] = x[j] * dropout_factor(.., start + j)`.
    pub fn dropout(seed: u64, threshold: u32, scale: f32, start: u64, x: &[f32], out: &mut [f32]) {
        for (j, (o, x)) in out.iter_mut().zip(x).enumerate() {
            *o = x * dropout_factor(seed, threshold, scale, start + j as u64);
        }
    }
}

multiversion! {
    /// [`dropout`] in place.
    pub fn dropout_in_place(seed: u64, threshold: u32, scale: f32, start: u64, x: &mut [f32]) {
        for (j, x) in x.iter_mut().enumerate() {
            *x *= dropout_factor(seed, threshold, scale, start + j as u64);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_and_tanh_are_within_a_few_ulp() {
        let (mut worst_exp, mut worst_tanh) = (0f64, 0f64);
        for i in -1_000_000..=100_000 {
            let x = i as f32 * 8.7e-5; // -87 .. 8.7
            let want = (x as f64).exp();
            worst_exp = worst_exp.max(((exp(x) as f64 - want) / want).abs());
        }
        for i in -200_000..=200_000 {
            let x = i as f32 * 1e-4;
            worst_tanh = worst_tanh.max((tanh(x) as f64 - (x as f64).tanh()).abs());
        }
        assert!(worst_exp < 3e-7, "exp relative error {worst_exp}");
        assert!(worst_tanh < 5e-7, "tanh error {worst_tanh}");
        assert_eq!(exp(-1e9), 0.0);
        assert_eq!(exp(0.0), 1.0);
        assert!((tanh(1e4) - 1.0).abs() < 3e-7 && (tanh(-1e4) + 1.0).abs() < 3e-7);
    }

    #[test]
    fn log_sum_exp_matches_f64() {
        let row: Vec<f32> = (0..1000).map(|i| ((i * 37) % 101) as f32 * 0.1 - 5.0).collect();
        let lse = log_sum_exp(&row);
        let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
        let want = m + row.iter().map(|&x| (x as f64 - m).exp()).sum::<f64>().ln();
        assert!((lse as f64 - want).abs() < 1e-5, "{lse} vs {want}");
    }
}
