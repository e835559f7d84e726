//! Sampling's choice of the next token, on either device: temperature, then top-k, then top-p
//! (transformers' order), and a draw among what is left. The uniform draw of each row comes from
//! the caller (generation's per-row streams, on the host), so the GPU kernel (cuda/sample_pick.cu)
//! picks the token the CPU picks for the same logits and draw, and only two numbers a row come
//! back to the host instead of the row's V logits.

use crate::storage::contiguous_f32;
use candle_core::{CpuStorage, CustomOp2, Layout, Result, Shape, Tensor};

/// How a row is sampled (generation's `SamplingConfig` less what the decoding loop keeps).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SamplingParams {
    /// Ids from here on (Megatron's vocabulary padding) are never chosen; 1 to V.
    pub vocab_limit: usize,
    /// Divides the logits (above 0).
    pub temperature: f64,
    /// Keep the k most likely ids (None, 0 or at least the limit: all).
    pub top_k: Option<usize>,
    /// Then the fewest most likely ids whose probability reaches this (None or 1 and above: all).
    pub top_p: Option<f64>,
}

/// The token sampled from one row of logits for the uniform draw `u` in [0, 1).
///
/// The weights are `exp((x - max) / t)` in f64. Top-k keeps the first k ids in the order
/// "logit descending, id ascending" (a total order, so the set is one however it is found); top-p
/// then the shortest prefix of that order whose share of the weight reaches top_p (at least one
/// id). The draw walks the kept ids in id order, not by logit: in the sorted order two nearly
/// equal logits swap places on a rounding difference, and the draw would then pick another token
/// although no probability moved beyond rounding (a flat distribution has thousands of such
/// pairs). This way a token changes only when the draw falls within rounding of a boundary.
pub fn sample_with_draw(logits: &[f32], params: &SamplingParams, u: f64) -> u32 {
    let limit = params.vocab_limit.min(logits.len());
    let logits = &logits[..limit];
    let t = params.temperature;
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let weight = |i: usize| ((logits[i] as f64 - max) / t).exp();
    let top_k = params.top_k.filter(|&k| k > 0 && k < limit);
    let top_p = params.top_p.filter(|&p| p < 1.0);
    let mut candidates: Vec<usize> = (0..limit).collect();
    if top_k.is_some() || top_p.is_some() {
        // Selecting the top k is O(V); sorting the vocabulary for each token was a tenth of a
        // CPU PPO step's time at top-k 2.
        let by_logit = |a: &usize, b: &usize| logits[*b].total_cmp(&logits[*a]).then(a.cmp(b));
        if let Some(k) = top_k {
            candidates.select_nth_unstable_by(k - 1, by_logit);
            candidates.truncate(k);
        }
        if let Some(top_p) = top_p {
            candidates.sort_unstable_by(by_logit);
            let total: f64 = candidates.iter().map(|&i| weight(i)).sum();
            let mut cum = 0.0;
            let keep = candidates.iter().take_while(|&&i| {
                let before = cum;
                cum += weight(i) / total;
                before < top_p
            });
            let n = keep.count().max(1);
            candidates.truncate(n);
        }
        candidates.sort_unstable();
    }
    let weights: Vec<f64> = candidates.iter().map(|&i| weight(i)).collect();
    let mut u = u * weights.iter().sum::<f64>();
    for (i, w) in candidates.iter().zip(&weights) {
        if u < *w {
            return *i as u32;
        }
        u -= w;
    }
    *candidates.last().expect("at least one candidate") as u32
}

/// Per row of logits (B, V) and its draw (B,) f64: the sampled token and its log-probability,
/// (B, 2) f32.
struct SamplePick {
    params: SamplingParams,
}

impl CustomOp2 for SamplePick {
    fn name(&self) -> &'static str {
        "sample-pick"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        let (b, v) = l1.shape().dims2()?;
        let logits = contiguous_f32(s1, l1, "logits")?;
        let draws = match (s2, l2.contiguous_offsets()) {
            (CpuStorage::F64(d), Some((start, end))) => &d[start..end],
            _ => candle_core::bail!("the draws must be contiguous f64"),
        };
        let lse = crate::kernels::decode::log_sum_exp_rows(logits, v);
        let mut out = Vec::with_capacity(2 * b);
        for ((row, lse), &u) in logits.chunks_exact(v).zip(lse).zip(draws) {
            let token = sample_with_draw(row, &self.params, u);
            out.extend([token as f32, (f64::from(row[token as usize]) - lse) as f32]);
        }
        Ok((CpuStorage::F32(out), Shape::from((b, 2))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        logits: &candle_core::CudaStorage,
        ll: &Layout,
        draws: &candle_core::CudaStorage,
        ld: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let b = ll.shape().dims2()?.0;
        let p = &self.params;
        let settings = (p.vocab_limit, p.temperature, p.top_k, p.top_p);
        Ok((cuda::sample_pick((logits, ll), (draws, ld), settings)?, Shape::from((b, 2))))
    }
}

/// Sampling's next token for each row of `logits` (B, V) with the row's uniform draw in
/// `draws` ([`sample_with_draw`]), and its log-probability under the whole row (before
/// temperature, top-k or top-p), `x[token] - logsumexp(x)` with the exponentials summed in f64.
/// On a GPU one launch, and two numbers a row come to the host.
pub fn sample_pick(logits: &Tensor, draws: &[f64], params: &SamplingParams) -> Result<(Vec<u32>, Vec<f32>)> {
    let draws = Tensor::from_slice(draws, draws.len(), logits.device())?;
    picks_to_host(&sample_pick_in_place(logits, &draws, params)?)
}

/// [`sample_pick`] with the draws (B,) f64 on the logits' device, the picks left there: (B, 2)
/// f32, each row's token (an exact integer) and its log-probability (a decoding step captured as
/// a CUDA graph reads them on the device).
pub fn sample_pick_in_place(logits: &Tensor, draws: &Tensor, params: &SamplingParams) -> Result<Tensor> {
    let (b, v) = logits.dims2()?;
    let logits = logits_for_pick(logits, "sampling")?;
    if draws.dims() != [b] || draws.dtype() != candle_core::DType::F64 {
        candle_core::bail!("sampling {b} rows with draws {:?} {:?}: one f64 a row", draws.dims(), draws.dtype());
    }
    if params.temperature.is_nan() || params.temperature <= 0.0 {
        candle_core::bail!(
            "sampling at temperature {}: it must be above 0 (greedy decoding is greedy_pick)",
            params.temperature
        );
    }
    let op = SamplePick { params: SamplingParams { vocab_limit: params.vocab_limit.clamp(1, v), ..*params } };
    logits.apply_op2_no_bwd(draws, &op)
}

/// The (B, V) logits a pick (greedy or sampled) reads, contiguous: f32 for the CPU kernel, in
/// their own dtype for the GPU's. The ids travel back as exact f32, so V is below 2^24.
pub(crate) fn logits_for_pick(logits: &Tensor, what: &str) -> Result<Tensor> {
    let (_, v) = logits.dims2()?;
    if v == 0 || v >= 1 << 24 {
        candle_core::bail!("{what} over a vocabulary of {v} ids: 1 to 2^24 (the ids travel as exact f32)");
    }
    let logits = if logits.device().is_cpu() { logits.to_dtype(candle_core::DType::F32)? } else { logits.clone() };
    logits.contiguous()
}

/// A pick's (B, 2) f32 output on the host: each row's token and its log-probability.
pub(crate) fn picks_to_host(picks: &Tensor) -> Result<(Vec<u32>, Vec<f32>)> {
    Ok(picks.to_vec2::<f32>()?.into_iter().map(|row| (row[0] as u32, row[1])).unzip())
}

/// The launcher of the CUDA kernel (`cuda_fwd` above calls it).
#[cfg(feature = "cuda")]
pub mod cuda {
    use crate::kernels::cuda::{block_per_row, for_float_dtype, ptx, view};
    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::driver::PushKernelArg;
    use candle_core::cuda_backend::WrapErr;
    use candle_core::{CudaStorage, Layout, Result};

    /// Sampling's choice per row of contiguous logits (B, V) in f32, bf16 or f16 with the row's
    /// uniform draw in `draws` (B,) f64: the token [`super::sample_with_draw`] picks for
    /// ids below `limit` at temperature `t`, with `top_k` and `top_p` (None: all), and its
    /// log-probability under the row, as (B, 2) f32 (cuda/sample_pick.cu, one block a row).
    pub fn sample_pick(
        (logits, ll): (&CudaStorage, &Layout),
        (draws, ld): (&CudaStorage, &Layout),
        (limit, t, top_k, top_p): (usize, f64, Option<usize>, Option<f64>),
    ) -> Result<CudaStorage> {
        let (b, v) = ll.shape().dims2()?;
        if limit == 0 || limit > v || v >= 1 << 24 {
            candle_core::bail!("sampling on CUDA: ids below {limit} of a vocabulary of {v} (under 2^24)");
        }
        let draws = view::<f64>(draws, ld, "the draws")?;
        if draws.len() != b {
            candle_core::bail!("sampling on CUDA: {b} rows and {} draws", draws.len());
        }
        // The kernel's "none": a top-k of 0, a top-p of 1.
        let top_k = top_k.filter(|&k| k < limit).unwrap_or(0) as u32;
        let top_p = top_p.filter(|&p| p < 1.0).unwrap_or(1.0);
        let (v32, limit32) = (v as u32, limit as u32);
        Ok(for_float_dtype!(logits, ll, "sampling", |src: Elem, suffix| {
            let dev = logits.device();
            // SAFETY: the kernel writes both values of every row.
            let out = unsafe { dev.alloc::<f32>(2 * b)? };
            let func =
                dev.get_or_load_custom_func(&format!("sample_pick_{suffix}"), "rlhf_sample_pick", ptx::SAMPLE_PICK)?;
            let mut launch = func.builder();
            launch.arg(src).arg(&draws).arg(&out).arg(&v32).arg(&limit32).arg(&t).arg(&top_k).arg(&top_p);
            // SAFETY: the arguments match the kernel's signature; it reads the B rows of V values.
            unsafe { launch.launch(block_per_row(b)) }.w().map(|_| out)
        }))
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::kernels::rowops;
    use candle_core::Device;
    use rand::{Rng, SeedableRng};

    /// Logits (B, V) on a coarse grid (multiples of 1/8 up to about ±10, exact in bf16 and f16,
    /// so every dtype holds the same values and many ids tie), draws and sampling settings for
    /// comparing the CPU and GPU pickers: temperature alone, top-k, top-p, both, a top-k of 1 and
    /// a tiny top-p (greedy), each row with its own draw (0 and nearly 1 among them).
    pub(crate) fn sampling_cases(b: usize, v: usize) -> (Tensor, Vec<f64>, Vec<SamplingParams>) {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(17);
        let rows: Vec<f32> = (0..b * v).map(|_| (rng.random::<f32>() * 160.0 - 80.0).round() / 8.0).collect();
        let mut draws: Vec<f64> = (0..b).map(|_| rng.random()).collect();
        draws[0] = 0.0;
        draws[1] = 1.0 - f64::EPSILON;
        let limit = v - 13;
        let p = |temperature, top_k, top_p| SamplingParams { vocab_limit: limit, temperature, top_k, top_p };
        let params = vec![
            p(1.0, None, None),
            p(0.7, Some(50), None),
            p(1.3, None, Some(0.9137)),
            p(1.0, Some(400), Some(0.7731)),
            p(1.0, Some(1), None),
            p(0.5, None, Some(1e-6)),
            p(2.0, Some(limit + 5), Some(1.0)),
        ];
        (Tensor::from_vec(rows, (b, v), &Device::Cpu).unwrap(), draws, params)
    }

    #[test]
    fn the_op_samples_each_row_with_its_draw_and_gives_the_log_probability() -> Result<()> {
        let (b, v) = (9, 503);
        let (logits, draws, params) = sampling_cases(b, v);
        let rows = logits.to_vec2::<f32>()?;
        for p in &params {
            let (tokens, logprobs) = sample_pick(&logits, &draws, p)?;
            for (r, row) in rows.iter().enumerate() {
                assert_eq!(tokens[r], sample_with_draw(row, p, draws[r]), "{p:?} row {r}");
                assert!((tokens[r] as usize) < p.vocab_limit, "{p:?} row {r}: an id beyond the limit");
                let lse = rowops::log_sum_exp_f64(row);
                assert!((logprobs[r] as f64 - (row[tokens[r] as usize] as f64 - lse)).abs() < 1e-5);
            }
        }
        // Greedy settings take the largest logit (the first of its ids).
        for p in &params[4..6] {
            let (tokens, _) = sample_pick(&logits, &draws, p)?;
            for (r, row) in rows.iter().enumerate() {
                assert_eq!(tokens[r] as usize, rowops::argmax(&row[..p.vocab_limit]), "{p:?} row {r}");
            }
        }
        Ok(())
    }

    #[test]
    fn a_draw_picks_in_proportion_to_the_weights_left() {
        // Weights 1, 2, 4, 8 (logits ln of them): top-k 3 keeps ids 1, 2, 3 with 2/14, 4/14, 8/14;
        // the draw walks them in id order.
        let logits: Vec<f32> = [1f32, 2.0, 4.0, 8.0].iter().map(|w| w.ln()).collect();
        let p = SamplingParams { vocab_limit: 4, temperature: 1.0, top_k: Some(3), top_p: None };
        let edges = [(0.0, 1), (2.0 / 14.0 - 1e-9, 1), (2.0 / 14.0 + 1e-9, 2), (6.0 / 14.0 + 1e-9, 3), (0.999, 3)];
        for (u, want) in edges {
            assert_eq!(sample_with_draw(&logits, &p, u), want, "u {u}");
        }
        // Top-p 0.5 of the four (shares 8/15, 4/15, ...): id 3 alone reaches it.
        let p = SamplingParams { top_k: None, top_p: Some(0.5), ..p };
        assert_eq!(sample_with_draw(&logits, &p, 0.0), 3);
        // Top-p 0.6: ids 3 and 2 (8/15 < 0.6), drawn in id order: 4/12 for id 2 first.
        let p = SamplingParams { top_p: Some(0.6), ..p };
        assert_eq!(sample_with_draw(&logits, &p, 0.3), 2);
        assert_eq!(sample_with_draw(&logits, &p, 0.34), 3);
    }

    /// The temperature divides the logits before the weights: ids with logits 0 and ln 4 weigh
    /// 1 and 4 at temperature 1 (id 0's share 1/5), 1 and 2 at 2 (1/3), 1 and 16 at 0.5 (1/17).
    /// Logits of 400 (whose exponentials overflow f64) weigh as their differences from the
    /// maximum. A top-k of 0, like None, keeps every id.
    #[test]
    fn temperature_scales_the_logits_and_large_logits_stay_finite() {
        let p = |temperature, top_k| SamplingParams { vocab_limit: 2, temperature, top_k, top_p: None };
        let logits = [0.0, 4f32.ln()];
        let edges = [(1.0, 0.19, 0), (1.0, 0.21, 1), (2.0, 0.32, 0), (2.0, 0.34, 1), (0.5, 0.058, 0), (0.5, 0.06, 1)];
        for (temperature, u, want) in edges {
            assert_eq!(sample_with_draw(&logits, &p(temperature, None), u), want, "t {temperature} u {u}");
        }
        let large = [400.0, 400.0 + 3f32.ln()];
        assert_eq!(sample_with_draw(&large, &p(1.0, None), 0.24), 0);
        assert_eq!(sample_with_draw(&large, &p(1.0, None), 0.26), 1);
        let weights: Vec<f32> = [1f32, 2.0, 4.0, 8.0].iter().map(|w| w.ln()).collect();
        let all = SamplingParams { vocab_limit: 4, temperature: 1.0, top_k: Some(0), top_p: None };
        assert_eq!(sample_with_draw(&weights, &all, 0.05), 0, "id 0's share, 1/15");
        assert_eq!(sample_with_draw(&weights, &all, 0.15), 1, "id 1's, from 1/15 to 3/15");
    }

    /// Boundaries: each id's share of the draw is half-open, [start, end), so a draw on a
    /// boundary picks the id above it; top-p keeps ids while the share before them is below p,
    /// so of two equal ids top-p 0.5 keeps the first alone (transformers drops the ids whose
    /// cumulative share, ascending, is at most 1 - p).
    #[test]
    fn a_draw_on_a_boundary_and_a_share_equal_to_top_p() {
        let p = SamplingParams { vocab_limit: 2, temperature: 1.0, top_k: None, top_p: None };
        let equal = [0.0f32, 0.0];
        assert_eq!([0.0, 0.4999, 0.5].map(|u| sample_with_draw(&equal, &p, u)), [0, 0, 1]);
        let half = SamplingParams { top_p: Some(0.5), ..p };
        assert_eq!(sample_with_draw(&equal, &half, 0.9), 0);
    }

    /// The op refuses draws that are not one f64 a row, a temperature that is not above 0 and an
    /// empty vocabulary, each in one line; a vocabulary limit of 0 is taken as 1 (id 0 alone).
    #[test]
    fn sampling_refuses_bad_draws_temperatures_and_vocabularies() -> Result<()> {
        let logits = Tensor::new(&[[0f32, 1.0, 2.0], [2.0, 1.0, 0.0]], &Device::Cpu)?;
        let p = SamplingParams { vocab_limit: 3, temperature: 1.0, top_k: None, top_p: None };
        let refused = |logits: &Tensor, draws: Tensor, p: &SamplingParams| {
            sample_pick_in_place(logits, &draws, p).unwrap_err().to_string()
        };
        let short = refused(&logits, Tensor::new(&[0.5f64], &Device::Cpu)?, &p);
        assert!(short.starts_with("sampling 2 rows with draws [1] F64: one f64 a row"), "{short}");
        let f32_draws = refused(&logits, Tensor::new(&[0.5f32, 0.5], &Device::Cpu)?, &p);
        assert!(f32_draws.starts_with("sampling 2 rows with draws [2] F32: one f64 a row"), "{f32_draws}");
        for temperature in [0.0, -1.0, f64::NAN] {
            let cold =
                refused(&logits, Tensor::new(&[0.5f64, 0.5], &Device::Cpu)?, &SamplingParams { temperature, ..p });
            assert!(cold.starts_with(&format!("sampling at temperature {temperature}: it must be above 0")), "{cold}");
        }
        let empty = refused(
            &Tensor::zeros((2, 0), candle_core::DType::F32, &Device::Cpu)?,
            Tensor::new(&[0.5f64, 0.5], &Device::Cpu)?,
            &p,
        );
        assert!(empty.starts_with("sampling over a vocabulary of 0 ids"), "{empty}");
        let (tokens, _) = sample_pick(&logits, &[0.9, 0.9], &SamplingParams { vocab_limit: 0, ..p })?;
        assert_eq!(tokens, [0, 0]);
        Ok(())
    }
}

/// On a GPU against the CPU (the CUDA build's unit tests); without one it passes after saying
/// so on stderr.
#[cfg(test)]
#[cfg(feature = "cuda")]
mod cuda_tests {
    use crate::kernels::ops::test_support::*;
    use candle_core::{DType, Result};

    /// Sampling's pick on the GPU against the CPU's on the same values and draws (37 rows of
    /// 5003 on a grid of 1/8, so many ids tie; the last 13 ids beyond the limit): the same token
    /// in every row for temperature alone, top-k, top-p, both, and the greedy settings, in f32,
    /// bf16 and f16 (the CPU reading f32 copies of the same values); log-probabilities as
    /// greedy_pick's.
    #[test]
    #[ignore = "needs a GPU: scripts/gpu-check.sh runs it (cargo test --features cuda -- --include-ignored)"]
    fn sample_pick_matches_the_cpu_for_every_setting_and_dtype() -> Result<()> {
        use super::{sample_pick, tests::sampling_cases};
        let gpu = gpu();
        let (logits, draws, settings) = sampling_cases(37, 5003);
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            let x = logits.to_dtype(dtype)?;
            for params in &settings {
                let (want_tokens, want_logprobs) = sample_pick(&x, &draws, params)?;
                let (tokens, logprobs) = sample_pick(&x.to_device(&gpu)?, &draws, params)?;
                assert_eq!(tokens, want_tokens, "{dtype:?} {params:?}");
                for (r, (got, want)) in logprobs.iter().zip(&want_logprobs).enumerate() {
                    assert!((got - want).abs() < 2e-5, "{dtype:?} {params:?} row {r}: {got} vs {want}");
                }
            }
        }
        Ok(())
    }
}
