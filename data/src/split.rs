//! Train/valid/test split of the packed blocks: Megatron's `--split 949,50,1`, with the arithmetic
//! of `megatron/data/gpt_dataset.py` `get_train_valid_test_split_`, plus a check that turns an
//! empty split into an error saying what to change.

use std::ops::Range;

use anyhow::{bail, Result};

const SPLIT_NAMES: [&str; 3] = ["train", "validation", "test"];

/// Parses `--split` weights ("949,50,1", "98,2", "90/5/5") into fractions summing to 1.
/// Missing trailing weights are 0, as in Megatron.
pub fn parse_split(s: &str) -> Result<[f64; 3]> {
    const EXAMPLE: &str = "e.g. --split 949,50,1 (train, validation, test weights)";
    let separator = if s.contains('/') { '/' } else { ',' };
    let parts: Vec<&str> = s.split(separator).map(str::trim).collect();
    if parts.len() > 3 {
        bail!("--split {s:?} has {} weights; give at most 3, {EXAMPLE}", parts.len());
    }
    let mut weights = [0.0f64; 3];
    for (weight, part) in weights.iter_mut().zip(&parts) {
        *weight = match part.parse::<f64>() {
            Ok(w) if w.is_finite() && w >= 0.0 => w,
            _ => bail!("--split {s:?}: {part:?} is not a finite weight >= 0; {EXAMPLE}"),
        };
    }
    let total: f64 = weights.iter().sum();
    if total <= 0.0 {
        bail!("--split {s:?}: the weights sum to 0; {EXAMPLE}");
    }
    Ok(weights.map(|w| w / total))
}

/// Block ranges of the three splits of `n` blocks, contiguous and covering `0..n`.
///
/// Megatron: each boundary is the previous one plus `round(fraction * n)`, then every boundary is
/// shifted by `last - n` so the end is exactly `n`. Python's `round` rounds half to even, hence
/// `round_ties_even`. Deviation: Megatron can produce a negative boundary when the shift exceeds
/// an earlier boundary (e.g. `--split 0,1,1` with n = 3); we clamp boundaries into `0..=n`.
pub fn split_ranges(n: usize, fractions: &[f64; 3]) -> [Range<usize>; 3] {
    let n_f = n as f64;
    let mut bounds = [0i64; 4];
    for i in 0..3 {
        bounds[i + 1] = bounds[i] + (fractions[i] * n_f).round_ties_even() as i64;
    }
    let diff = bounds[3] - n as i64;
    for bound in &mut bounds[1..] {
        *bound -= diff;
    }
    let mut clamped = [0usize; 4];
    for i in 1..4 {
        clamped[i] = (bounds[i].clamp(0, n as i64) as usize).max(clamped[i - 1]);
    }
    clamped[3] = n;
    [clamped[0]..clamped[1], clamped[1]..clamped[2], clamped[2]..clamped[3]]
}

/// Errors when train is empty or a split with a positive weight received no blocks: Megatron
/// would build an empty dataset and fail later with a shape error far from the cause.
pub fn check_split(n_blocks: usize, fractions: &[f64; 3], ranges: &[Range<usize>; 3]) -> Result<()> {
    if n_blocks == 0 {
        bail!(
            "the corpus gives 0 blocks at this --seq-length (it has fewer than seq_length + 1 \
             tokens); use a shorter --seq-length or more data"
        );
    }
    for (i, range) in ranges.iter().enumerate() {
        let name = SPLIT_NAMES[i];
        if range.is_empty() && (i == 0 || fractions[i] > 0.0) {
            let fix = if i == 0 {
                "give train a larger weight such as --split 949,50,1".to_string()
            } else {
                format!("give {name} a larger weight such as --split 900,90,10")
            };
            bail!(
                "--split gives the {name} split 0 of the {n_blocks} blocks the corpus gives at \
                 this --seq-length; {fix}, use a shorter --seq-length, or add more data"
            );
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn assert_fractions(got: [f64; 3], want: [f64; 3]) {
        for (g, w) in got.iter().zip(want) {
            assert!((g - w).abs() < 1e-12, "got {got:?}, want {want:?}");
        }
    }

    #[test]
    fn parse_split_normalises_weights() -> Result<()> {
        assert_fractions(parse_split("949,50,1")?, [0.949, 0.05, 0.001]);
        assert_fractions(parse_split("98,2")?, [0.98, 0.02, 0.0]);
        assert_fractions(parse_split("90/5/5")?, [0.9, 0.05, 0.05]);
        assert_fractions(parse_split(" 1 , 1 ")?, [0.5, 0.5, 0.0]);
        assert_fractions(parse_split("100")?, [1.0, 0.0, 0.0]);
        Ok(())
    }

    #[test]
    fn parse_split_rejects_bad_weights_naming_the_flag() {
        for bad in ["", "a,b", "1,-1,0", "0,0,0", "1,2,3,4", "inf,1", "NaN"] {
            let err = parse_split(bad).unwrap_err().to_string();
            assert!(err.contains("--split") && err.contains("949,50,1"), "{bad:?}: {err}");
        }
    }

    #[test]
    fn megatron_arithmetic_on_1000_blocks() {
        let ranges = split_ranges(1000, &[0.949, 0.05, 0.001]);
        assert_eq!(ranges, [0..949, 949..999, 999..1000]);
    }

    #[test]
    fn megatron_shift_when_rounding_overshoots_or_undershoots() {
        // n=10, thirds: round(3.33)=3 each -> [0,3,6,9], diff -1 -> [0,4,7,10].
        assert_eq!(split_ranges(10, &[1.0 / 3.0; 3]), [0..4, 4..7, 7..10]);
        // n=5, halves: round(2.5)=2 (ties to even) twice -> [0,2,4,4], diff -1 -> [0,3,5,5].
        assert_eq!(split_ranges(5, &[0.5, 0.5, 0.0]), [0..3, 3..5, 5..5]);
        // n=7, [0.5,0.5,0]: round(3.5)=4 twice -> [0,4,8,8], diff 1 -> [0,3,7,7].
        assert_eq!(split_ranges(7, &[0.5, 0.5, 0.0]), [0..3, 3..7, 7..7]);
        // Megatron would give a boundary of -1 here; we clamp to 0.
        assert_eq!(split_ranges(3, &[0.0, 0.5, 0.5]), [0..0, 0..1, 1..3]);
        assert_eq!(split_ranges(0, &[0.949, 0.05, 0.001]), [0..0, 0..0, 0..0]);
    }

    #[test]
    fn small_corpus_leaves_test_empty_and_check_says_what_to_change() {
        let fractions = [0.949, 0.05, 0.001];
        // round(9.49)=9, round(0.5)=0, round(0.01)=0 -> [0,9,9,9], diff -1 -> [0,10,10,10].
        let ranges = split_ranges(10, &fractions);
        assert_eq!(ranges, [0..10, 10..10, 10..10]);
        let err = check_split(10, &fractions, &ranges).unwrap_err().to_string();
        assert!(err.contains("validation split 0 of the 10 blocks"), "{err}");
        assert!(err.contains("--split 900,90,10") && err.contains("--seq-length"), "{err}");

        // With a zero test weight an empty test split is intended.
        let fractions = parse_split("90,10,0").unwrap_or([0.0; 3]);
        let ranges = split_ranges(10, &fractions);
        assert_eq!(ranges, [0..9, 9..10, 10..10]);
        assert!(check_split(10, &fractions, &ranges).is_ok());
    }

    #[test]
    fn check_split_rejects_empty_train_and_empty_corpus() {
        let fractions = [0.0, 1.0, 0.0];
        let ranges = split_ranges(4, &fractions);
        let err = check_split(4, &fractions, &ranges).unwrap_err().to_string();
        assert!(err.contains("train split 0 of the 4 blocks"), "{err}");
        let err = check_split(0, &[1.0, 0.0, 0.0], &split_ranges(0, &[1.0, 0.0, 0.0])).unwrap_err().to_string();
        assert!(err.contains("0 blocks") && err.contains("--seq-length"), "{err}");
    }
}
