//! DS-Chat's reward-model loss and metrics (`dschat/utils/model/reward_model.py`), as pure
//! functions of the padded ids and the per-token scores.
//!
//! GPT-2 pads with its EOS, so, as in DS-Chat with GPT-2, a row's "first pad" is its EOS: the
//! reported score of a sequence is the score at the token before it (the last token of the
//! answer), which is also where transformers' `GPT2ForSequenceClassification` pools.
//!
//! Shapes: B pairs, T padded length; scores (2B, T), chosen rows first.

use candle_core::{Result, Tensor};

/// Where DS-Chat's loss looks in one pair (positions in the padded rows).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PairSpan {
    /// First position where the two rows differ.
    pub divergence: usize,
    /// One past the span: the later of the two first-pad positions.
    pub end: usize,
    /// First pad position of the chosen row (T if none); its score is at `chosen_end - 1`.
    pub chosen_end: usize,
    /// First pad position of the rejected row (T if none).
    pub rejected_end: usize,
}

/// DS-Chat's positions for one pair of padded rows of equal length T. Identical rows use only
/// the last position (`divergence = T - 1`, `end = T`), and then both ends are the chosen one's.
pub fn pair_span(chosen: &[u32], rejected: &[u32], pad: u32) -> PairSpan {
    pair_span_after(chosen, rejected, pad, 0)
}

/// [`pair_span`] of rows whose tokenizer puts up to `at_beginning` pad tokens at their start
/// (DS-Chat's `--num_padding_at_beginning`: OPT's BOS is its pad): those are not the row's
/// end. Rows that begin with fewer pads are read with as many as they have.
pub fn pair_span_after(chosen: &[u32], rejected: &[u32], pad: u32, at_beginning: usize) -> PairSpan {
    assert_eq!(chosen.len(), rejected.len(), "pair_span: rows of one batch have one padded length");
    let t = chosen.len();
    let first_pad = |row: &[u32]| {
        let leading = row.iter().take(at_beginning).take_while(|&&x| x == pad).count();
        row.iter().skip(leading).position(|&x| x == pad).map_or(t, |p| p + leading)
    };
    let chosen_end = first_pad(chosen);
    match chosen.iter().zip(rejected).position(|(c, r)| c != r) {
        None => PairSpan { divergence: t - 1, end: t, chosen_end, rejected_end: chosen_end },
        Some(divergence) => {
            let rejected_end = first_pad(rejected);
            PairSpan { divergence, end: chosen_end.max(rejected_end), chosen_end, rejected_end }
        }
    }
}

/// The spans of a batch given as (2B, T) ids, chosen rows first.
pub fn batch_spans(ids: &[u32], pairs: usize, t: usize, pad: u32) -> Vec<PairSpan> {
    batch_spans_after(ids, pairs, t, pad, 0)
}

/// [`batch_spans`] with up to `at_beginning` leading pads a row (see [`pair_span_after`]).
pub fn batch_spans_after(ids: &[u32], pairs: usize, t: usize, pad: u32, at_beginning: usize) -> Vec<PairSpan> {
    let row = |r: usize| &ids[r * t..(r + 1) * t];
    (0..pairs).map(|i| pair_span_after(row(i), row(pairs + i), pad, at_beginning)).collect()
}

/// `-log sigmoid(x)` = log(1 + exp(-x)), computed as `m + log(exp(-m) + exp(-x - m))` with
/// `m = max(-x, 0)` detached: exact for any constant m, overflow-free for this one, and its
/// gradient `sigmoid(x) - 1` is exact everywhere (a relu/abs formulation has kinks at 0, where
/// candle's subgradients give a wrong value, and identical pairs sit exactly there).
pub fn neg_log_sigmoid(x: &Tensor) -> Result<Tensor> {
    let m = x.neg()?.relu()?.detach();
    let sum = (m.neg()?.exp()? + (x.neg()? - &m)?.exp()?)?;
    m + sum.log()?
}

/// DS-Chat's loss: per pair, the mean of `-log sigmoid(r_c[t] - r_r[t])` over t in
/// [divergence, end); then the mean over pairs. `scores` (2B, T).
pub fn ds_chat_loss(scores: &Tensor, spans: &[PairSpan]) -> Result<Tensor> {
    let (rows, t) = scores.dims2()?;
    let b = spans.len();
    assert_eq!(rows, 2 * b, "ds_chat_loss: scores hold {rows} rows for {b} pairs");
    // Weights 1/len on each pair's span: a (B, T) mask turns the per-pair means into one sum.
    let mut w = vec![0f32; b * t];
    for (i, s) in spans.iter().enumerate() {
        let len = (s.end - s.divergence) as f32;
        w[i * t + s.divergence..i * t + s.end].fill(1.0 / len);
    }
    let w = Tensor::from_vec(w, (b, t), scores.device())?;
    let diff = (scores.narrow(0, 0, b)? - scores.narrow(0, b, b)?)?; // (B, T)
    (neg_log_sigmoid(&diff)? * w)?.sum_all()? / b as f64
}

/// Each sequence's reported score: at its last token before the first pad. (2B, T) -> (B,), (B,)
pub fn end_scores(scores: &Tensor, spans: &[PairSpan]) -> Result<(Tensor, Tensor)> {
    let (_, t) = scores.dims2()?;
    let b = spans.len();
    let flat = scores.flatten_all()?;
    let at = |rows: Vec<u32>| Tensor::new(rows, scores.device());
    // A row that starts with pad has no token before it: DS-Chat indexes -1 (the last position).
    let pos = |end: usize| if end == 0 { t - 1 } else { end - 1 };
    let chosen = at(spans.iter().enumerate().map(|(i, s)| (i * t + pos(s.chosen_end)) as u32).collect())?;
    let rejected = at(spans.iter().enumerate().map(|(i, s)| ((b + i) * t + pos(s.rejected_end)) as u32).collect())?;
    Ok((flat.index_select(&chosen, 0)?, flat.index_select(&rejected, 0)?))
}

/// `-log sigmoid(score_c - score_r)` on the end scores, mean over pairs.
pub fn last_token_loss(scores: &Tensor, spans: &[PairSpan]) -> Result<Tensor> {
    let (c, r) = end_scores(scores, spans)?;
    neg_log_sigmoid(&(c - r)?)?.mean_all()
}

/// Share of pairs whose chosen score beats the rejected one (DS-Chat's accuracy: strict `>`).
pub fn accuracy(chosen: &[f32], rejected: &[f32]) -> f64 {
    let wins = chosen.iter().zip(rejected).filter(|(c, r)| c > r).count();
    wins as f64 / chosen.len().max(1) as f64
}

/// The `q` quantile of `values` (linear interpolation between order statistics, numpy's
/// default); `values` need not be sorted.
pub fn quantile(values: &[f64], q: f64) -> f64 {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    if v.is_empty() {
        return f64::NAN;
    }
    let pos = q.clamp(0.0, 1.0) * (v.len() - 1) as f64;
    let (lo, hi) = (pos.floor() as usize, pos.ceil() as usize);
    v[lo] + (v[hi] - v[lo]) * (pos - lo as f64)
}

/// Pearson correlation of two equally long samples (NaN when either is constant).
pub fn pearson(x: &[f64], y: &[f64]) -> f64 {
    let n = x.len() as f64;
    let (mx, my) = (x.iter().sum::<f64>() / n, y.iter().sum::<f64>() / n);
    let cov: f64 = x.iter().zip(y).map(|(a, b)| (a - mx) * (b - my)).sum();
    let vx: f64 = x.iter().map(|a| (a - mx).powi(2)).sum();
    let vy: f64 = y.iter().map(|b| (b - my).powi(2)).sum();
    cov / (vx * vy).sqrt()
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    const PAD: u32 = 0;

    fn softplus_neg(x: f64) -> f64 {
        (1.0 + (-x).exp()).ln()
    }

    /// DS-Chat's `--num_padding_at_beginning 1` with OPT, whose BOS is its pad: the BOS is not
    /// the row's end, the next pad is (DS-Chat's `c_inds[1]`); rows without it (GPT-2's) are read
    /// as with 0.
    #[test]
    fn leading_padding_is_not_the_end() {
        let c = [PAD, 5, 7, PAD, PAD];
        let r = [PAD, 5, 8, 8, PAD];
        let want = PairSpan { divergence: 2, end: 4, chosen_end: 3, rejected_end: 4 };
        assert_eq!(pair_span_after(&c, &r, PAD, 1), want);
        // Without the count, the BOS would end both rows at once (identical up to it).
        assert_eq!(pair_span(&c, &r, PAD).chosen_end, 0);
        // GPT-2's rows begin with no padding: the count changes nothing.
        let (c, r) = ([5, 7, PAD, PAD], [5, 8, 8, PAD]);
        assert_eq!(pair_span_after(&c, &r, PAD, 1), pair_span(&c, &r, PAD));
        // Two leading pads asked for, one there: one is skipped.
        assert_eq!(pair_span_after(&[PAD, 5, PAD], &[PAD, 6, PAD], PAD, 2).chosen_end, 2);
        let ids = [PAD, 5, 7, PAD, PAD, PAD, 5, 8, 8, PAD];
        assert_eq!(batch_spans_after(&ids, 1, 5, PAD, 1), vec![want]);
        // Two pairs: the chosen rows first, each pair's rejected row B rows later.
        let ids = [[5, 7, PAD], [5, 6, 6], [5, 8, 8], [5, 6, PAD]].concat();
        let spans = batch_spans(&ids, 2, 3, PAD);
        assert_eq!(spans[0], PairSpan { divergence: 1, end: 3, chosen_end: 2, rejected_end: 3 });
        assert_eq!(spans[1], PairSpan { divergence: 2, end: 3, chosen_end: 3, rejected_end: 2 });
    }

    #[test]
    fn spans_of_different_lengths_and_of_identical_rows() {
        // prompt [5, 6], chosen answer [7] then EOS=pad; rejected answer [8, 8] then pad.
        let c = [5, 6, 7, PAD, PAD, PAD];
        let r = [5, 6, 8, 8, PAD, PAD];
        assert_eq!(pair_span(&c, &r, PAD), PairSpan { divergence: 2, end: 4, chosen_end: 3, rejected_end: 4 });
        // A rejected answer that extends the chosen one diverges where the chosen one ends.
        let r2 = [5, 6, 7, 9, PAD, PAD];
        assert_eq!(pair_span(&c, &r2, PAD), PairSpan { divergence: 3, end: 4, chosen_end: 3, rejected_end: 4 });
        // No pad at all: the ends are T.
        assert_eq!(
            pair_span(&[1, 2, 3], &[1, 2, 4], PAD),
            PairSpan { divergence: 2, end: 3, chosen_end: 3, rejected_end: 3 }
        );
        // Identical rows: only the last position.
        assert_eq!(pair_span(&c, &c, PAD), PairSpan { divergence: 5, end: 6, chosen_end: 3, rejected_end: 3 });
    }

    #[test]
    fn ds_chat_loss_matches_hand_computation() -> anyhow::Result<()> {
        let dev = Device::Cpu;
        // Two pairs, T = 4. Pair 0 span [1, 3), pair 1 span [2, 4).
        let spans = [
            PairSpan { divergence: 1, end: 3, chosen_end: 2, rejected_end: 3 },
            PairSpan { divergence: 2, end: 4, chosen_end: 4, rejected_end: 3 },
        ];
        let scores = [
            [0.0f32, 1.0, 2.0, 8.0], // chosen 0
            [0.0, 0.5, -1.0, 9.0],   // chosen 1
            [0.0, 0.0, 3.0, -9.0],   // rejected 0
            [0.0, 0.5, 1.0, 0.0],    // rejected 1
        ];
        let s = Tensor::new(&scores, &dev)?;
        let got: f32 = ds_chat_loss(&s, &spans)?.to_scalar()?;
        let pair0 = (softplus_neg(1.0 - 0.0) + softplus_neg(2.0 - 3.0)) / 2.0;
        let pair1 = (softplus_neg(-1.0 - 1.0) + softplus_neg(9.0 - 0.0)) / 2.0;
        let want = (pair0 + pair1) / 2.0;
        assert!((got as f64 - want).abs() < 1e-6, "{got} vs {want}");

        // End scores: chosen 0 at position 1, chosen 1 at 3; rejected 0 at 2, rejected 1 at 2.
        let (c, r) = end_scores(&s, &spans)?;
        assert_eq!(c.to_vec1::<f32>()?, [1.0, 9.0]);
        assert_eq!(r.to_vec1::<f32>()?, [3.0, 1.0]);
        let last: f32 = last_token_loss(&s, &spans)?.to_scalar()?;
        let want_last = (softplus_neg(1.0 - 3.0) + softplus_neg(9.0 - 1.0)) / 2.0;
        assert!((last as f64 - want_last).abs() < 1e-6, "{last} vs {want_last}");
        assert_eq!(accuracy(&[1.0, 9.0], &[3.0, 1.0]), 0.5);
        // A tie is not a win (DS-Chat's strict >).
        assert_eq!(accuracy(&[1.0, 9.0, 2.0], &[3.0, 1.0, 2.0]), 1.0 / 3.0);
        assert_eq!(accuracy(&[9.0, 9.0, 0.0], &[1.0, 1.0, 3.0]), 2.0 / 3.0);
        // A row that starts with pad is read at its last position, as DS-Chat's index -1.
        let at_once = [PairSpan { divergence: 0, end: 4, chosen_end: 0, rejected_end: 2 }];
        let (c, r) = end_scores(&s.narrow(0, 1, 2)?, &at_once)?;
        assert_eq!((c.to_vec1::<f32>()?, r.to_vec1::<f32>()?), (vec![9.0], vec![0.0]));
        Ok(())
    }

    #[test]
    fn identical_pairs_give_log_two_and_no_gradient() -> anyhow::Result<()> {
        let dev = Device::Cpu;
        let row = [3u32, 4, PAD];
        let ids: Vec<u32> = [row, row].concat();
        let spans = batch_spans(&ids, 1, 3, PAD);
        let v = Var::new(&[[0.3f32, -0.2, 0.7], [0.3, -0.2, 0.7]], &dev)?;
        let loss = ds_chat_loss(v.as_tensor(), &spans)?;
        assert!((loss.to_scalar::<f32>()? - std::f32::consts::LN_2).abs() < 1e-6);
        let g = loss.backward()?.get(v.as_tensor()).expect("gradient").to_vec2::<f32>()?;
        // The gradient pushes chosen up and rejected down at the last position by 1/2 each:
        // equal scores from equal inputs then receive opposite, cancelling updates.
        assert_eq!(g[0], [0.0, 0.0, -0.5]);
        assert_eq!(g[1], [0.0, 0.0, 0.5]);
        Ok(())
    }

    #[test]
    fn neg_log_sigmoid_is_stable_and_has_the_right_gradient() -> anyhow::Result<()> {
        let v = Var::new(&[-100f32, -1.0, 0.0, 2.0, 100.0], &Device::Cpu)?;
        let y = neg_log_sigmoid(v.as_tensor())?;
        let got = y.to_vec1::<f32>()?;
        for (x, g) in [-100f64, -1.0, 0.0, 2.0, 100.0].iter().zip(&got) {
            let want = if *x < -30.0 { -x } else { softplus_neg(*x) };
            assert!((*g as f64 - want).abs() < 1e-5, "x={x}: {g} vs {want}");
        }
        // d/dx -log sigmoid(x) = sigmoid(x) - 1.
        let g = y.sum_all()?.backward()?.get(v.as_tensor()).expect("gradient").to_vec1::<f32>()?;
        for (x, g) in [-100f64, -1.0, 0.0, 2.0, 100.0].iter().zip(&g) {
            let want = 1.0 / (1.0 + (-x).exp()) - 1.0;
            assert!((*g as f64 - want).abs() < 1e-5, "x={x}: {g} vs {want}");
        }
        Ok(())
    }

    #[test]
    fn quantiles_and_correlation_hand_computed() {
        let v = [4.0, 1.0, 3.0, 2.0];
        assert_eq!(quantile(&v, 0.0), 1.0);
        assert_eq!(quantile(&v, 1.0), 4.0);
        assert_eq!(quantile(&v, 0.5), 2.5);
        assert!((quantile(&v, 0.25) - 1.75).abs() < 1e-12);
        assert!((pearson(&[1.0, 2.0, 3.0], &[2.0, 4.0, 6.0]) - 1.0).abs() < 1e-12);
        assert!((pearson(&[1.0, 2.0, 3.0], &[3.0, 2.0, 1.0]) + 1.0).abs() < 1e-12);
        assert!(pearson(&[1.0, 1.0], &[1.0, 2.0]).is_nan());
    }
}
