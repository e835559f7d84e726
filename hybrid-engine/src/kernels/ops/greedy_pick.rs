//! Greedy decoding's choice per row of logits: the first id of the largest logit below the
//! vocabulary limit and its log-probability, on the CPU and on a GPU (cuda/greedy_pick.cu, one
//! block a row), two numbers a row to the host.

use crate::kernels::rowops;
use crate::storage::contiguous_f32;
use candle_core::{CpuStorage, CustomOp1, Layout, Result, Shape, Tensor};

/// Per row of logits (B, V): the token greedy decoding takes and its log-probability, (B, 2) f32.
struct GreedyPick {
    /// Ids from here on (Megatron's vocabulary padding) are never chosen; 1 to V.
    limit: usize,
}

impl CustomOp1 for GreedyPick {
    fn name(&self) -> &'static str {
        "greedy-pick"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let (b, v) = l.shape().dims2()?;
        let logits = contiguous_f32(s, l, "logits")?;
        let lse = crate::kernels::decode::log_sum_exp_rows(logits, v);
        let mut out = Vec::with_capacity(2 * b);
        for (row, lse) in logits.chunks_exact(v).zip(lse) {
            let token = rowops::argmax(&row[..self.limit]);
            out.extend([token as f32, (f64::from(row[token]) - lse) as f32]);
        }
        Ok((CpuStorage::F32(out), Shape::from((b, 2))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s: &candle_core::CudaStorage, l: &Layout) -> Result<(candle_core::CudaStorage, Shape)> {
        let b = l.shape().dims2()?.0;
        Ok((cuda::greedy_pick((s, l), self.limit)?, Shape::from((b, 2))))
    }
}

/// Greedy decoding's next token for each row of `logits` (B, V): the first id below
/// `vocab_limit` with the row's largest logit; and its log-probability under the whole row,
/// `x[token] - logsumexp(x)` with the exponentials summed in f64. On a GPU one launch, and two
/// numbers a row come to the host instead of the row's V logits.
pub fn greedy_pick(logits: &Tensor, vocab_limit: usize) -> Result<(Vec<u32>, Vec<f32>)> {
    crate::kernels::ops::sample_pick::picks_to_host(&greedy_pick_in_place(logits, vocab_limit)?)
}

/// [`greedy_pick`] with the picks left on the logits' device: (B, 2) f32, each row's token (an
/// exact integer) and its log-probability.
pub fn greedy_pick_in_place(logits: &Tensor, vocab_limit: usize) -> Result<Tensor> {
    let (_, v) = logits.dims2()?;
    let logits = crate::kernels::ops::sample_pick::logits_for_pick(logits, "greedy pick")?;
    logits.apply_op1_no_bwd(&GreedyPick { limit: vocab_limit.clamp(1, v) })
}

/// The launchers of the CUDA kernels (`cuda_fwd` above calls them).
#[cfg(feature = "cuda")]
pub mod cuda {
    use crate::kernels::cuda::{block_per_row, for_float_dtype, ptx};
    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::driver::PushKernelArg;
    use candle_core::cuda_backend::WrapErr;
    use candle_core::{CudaStorage, Layout, Result};

    /// Greedy decoding's choice per row of contiguous logits (B, V) in f32, bf16 or f16: the first id
    /// below `limit` (1 to V) with the row's largest logit and its log-probability under the row,
    /// as (B, 2) f32 (cuda/greedy_pick.cu, one block a row).
    pub fn greedy_pick((logits, ll): (&CudaStorage, &Layout), limit: usize) -> Result<CudaStorage> {
        let (b, v) = ll.shape().dims2()?;
        if limit == 0 || limit > v || v >= 1 << 24 {
            candle_core::bail!("greedy pick on CUDA: ids below {limit} of a vocabulary of {v} (under 2^24)");
        }
        let (v32, limit32) = (v as u32, limit as u32);
        Ok(for_float_dtype!(logits, ll, "greedy pick", |src: Elem, suffix| {
            let dev = logits.device();
            // SAFETY: the kernel writes both values of every row.
            let out = unsafe { dev.alloc::<f32>(2 * b)? };
            let func =
                dev.get_or_load_custom_func(&format!("greedy_pick_{suffix}"), "rlhf_greedy_pick", ptx::GREEDY_PICK)?;
            let mut launch = func.builder();
            launch.arg(src).arg(&out).arg(&v32).arg(&limit32);
            // SAFETY: the arguments match the kernel's signature; it reads the B rows of V values.
            unsafe { launch.launch(block_per_row(b)) }.w().map(|_| out)
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::ops::test_support::*;
    use candle_core::{DType, Device};

    /// Logits (B, V) for greedy decoding's pick, seeded normals times 4 with, in every third row
    /// from row 0, the largest value at three ids (first 17 + r, so ties span a GPU block's
    /// threads and strides), and in every third row from row 1 a larger one at an id at or above
    /// `limit` (the vocabulary's padding).
    pub(crate) fn logits_for_greedy_pick(b: usize, v: usize, limit: usize) -> Result<Tensor> {
        let mut rows = (randn(0f32, 1.0, (b, v), &Device::Cpu)? * 4.0)?.to_vec2::<f32>()?;
        for (r, row) in rows.iter_mut().enumerate() {
            match r % 3 {
                0 => [17 + r, 300 + r, limit - 1].iter().for_each(|&j| row[j] = 30.0),
                1 => row[limit + r % (v - limit)] = 50.0,
                _ => {}
            }
        }
        Tensor::new(rows, &Device::Cpu)
    }

    #[test]
    fn greedy_pick_takes_the_first_largest_logit_below_the_limit_and_its_log_probability() -> Result<()> {
        let (b, v, limit) = (7, 1003, 990);
        let logits = logits_for_greedy_pick(b, v, limit)?;
        for dtype in [DType::F32, DType::BF16] {
            let x = logits.to_dtype(dtype)?;
            let (tokens, logprobs) = greedy_pick(&x, limit)?;
            let rows = x.to_dtype(DType::F32)?.to_vec2::<f32>()?;
            for (r, row) in rows.iter().enumerate() {
                // Written out: the first id of the largest value below the limit, and
                // x[token] - (max + ln sum exp(x - max)) over the whole row in f64.
                let best = row[..limit].iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let token = row.iter().position(|&x| x == best).unwrap();
                assert_eq!(tokens[r] as usize, token, "{dtype:?} row {r}");
                if r % 3 == 0 {
                    assert_eq!(token, 17 + r, "{dtype:?} row {r}: the first of the tied ids");
                }
                let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
                let lse = max + row.iter().map(|&x| (x as f64 - max).exp()).sum::<f64>().ln();
                let want = row[token] as f64 - lse;
                assert!((logprobs[r] as f64 - want).abs() < 1e-5, "{dtype:?} row {r}: {} vs {want}", logprobs[r]);
            }
        }
        // A limit of 0 takes id 0, as generation's sampler did.
        assert_eq!(greedy_pick(&logits, 0)?.0, vec![0; b]);
        Ok(())
    }
}

/// On a GPU against the CPU (the CUDA build's unit tests, which `scripts/gpu-check.sh` runs from
/// the package); without one they pass after saying so on stderr.
#[cfg(test)]
#[cfg(feature = "cuda")]
mod cuda_tests {
    use crate::kernels::ops::greedy_pick;
    use crate::kernels::ops::test_support::*;
    use candle_core::{DType, Result};

    /// Greedy decoding's pick on the GPU against the CPU's on the same values (37 rows of 5003, the
    /// last 13 ids beyond the limit): the same token in every row, where several ids share the
    /// largest value too (the first, as the CPU's argmax) and where a larger value lies beyond
    /// the limit (never taken); bf16 and f16 read as they are, the CPU reading f32 copies of
    /// the same values. Log-probabilities: both sum the exponentials in f64, which differ by
    /// an f32 ulp or so (1e-6 of a log-probability of about -20).
    #[test]
    #[ignore = "needs a GPU: scripts/gpu-check.sh runs it (cargo test --features cuda -- --include-ignored)"]
    fn greedy_pick_matches_the_cpu_on_ties_and_the_vocabulary_limit() -> Result<()> {
        let gpu = gpu();
        let (b, v, limit) = (37, 5003, 4990);
        let logits = super::tests::logits_for_greedy_pick(b, v, limit)?;
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            let x = logits.to_dtype(dtype)?;
            let (want_tokens, want_logprobs) = greedy_pick(&x, limit)?;
            let (tokens, logprobs) = greedy_pick(&x.to_device(&gpu)?, limit)?;
            assert_eq!(tokens, want_tokens, "{dtype:?}");
            for (r, (got, want)) in logprobs.iter().zip(&want_logprobs).enumerate() {
                assert!((got - want).abs() < 2e-5, "{dtype:?} row {r}: {got} vs {want}");
            }
        }
        Ok(())
    }
}
