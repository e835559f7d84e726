//! Batches of the phase datasets, as flat row-major `u32` buffers ready for a (B, T) tensor:
//! right-padded SFT rows with the positions that carry the loss, reward pairs stacked chosen
//! first then rejected (DS-Chat's `DataCollatorReward`), and left-padded PPO prompts
//! (`DataCollatorRLHF`). Pure functions: the step crates turn them into tensors.

use crate::phases::{PairSample, PromptSample, SftSample};

/// A right-padded SFT batch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SftBatch {
    /// (B, T) token ids, padded with `pad` after each row's end.
    pub ids: Vec<u32>,
    pub b: usize,
    pub t: usize,
    /// Flattened positions `row * T + i` whose next token is learned, and that token
    /// (`ids[row][i + 1]`): the answer and its EOS, or every real token with `train_on_prompt`.
    pub loss_rows: Vec<u32>,
    pub loss_targets: Vec<u32>,
}

/// Pads `samples` to the longest of them. Right padding never changes a causal model's
/// outputs at the real positions, so padding to the batch's longest row instead of DS-Chat's
/// fixed `max_seq_len` gives the same loss with less work.
pub fn sft_batch(samples: &[&SftSample], pad: u32, train_on_prompt: bool) -> SftBatch {
    let b = samples.len();
    let t = samples.iter().map(|s| s.ids.len()).max().unwrap_or(0).max(1);
    let mut ids = vec![pad; b * t];
    let (mut loss_rows, mut loss_targets) = (Vec::new(), Vec::new());
    for (row, s) in samples.iter().enumerate() {
        ids[row * t..row * t + s.ids.len()].copy_from_slice(&s.ids);
        for i in 0..s.ids.len().saturating_sub(1) {
            if train_on_prompt || i + 1 >= s.prompt_len {
                loss_rows.push((row * t + i) as u32);
                loss_targets.push(s.ids[i + 1]);
            }
        }
    }
    SftBatch { ids, b, t, loss_rows, loss_targets }
}

/// A reward batch of B pairs: 2B right-padded rows, the B chosen first, then the B rejected.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PairBatch {
    /// (2B, T) token ids.
    pub ids: Vec<u32>,
    /// Pairs in the batch (B).
    pub pairs: usize,
    pub t: usize,
}

pub fn pair_batch(samples: &[&PairSample], pad: u32) -> PairBatch {
    let pairs = samples.len();
    let t = samples.iter().map(|s| s.chosen.len().max(s.rejected.len())).max().unwrap_or(0).max(1);
    let mut ids = vec![pad; 2 * pairs * t];
    for (i, s) in samples.iter().enumerate() {
        ids[i * t..i * t + s.chosen.len()].copy_from_slice(&s.chosen);
        let r = (pairs + i) * t;
        ids[r..r + s.rejected.len()].copy_from_slice(&s.rejected);
    }
    PairBatch { ids, pairs, t }
}

/// PPO prompts left-padded to exactly `len` tokens (DS-Chat pads to `max_prompt_seq_len`), so
/// that every answer starts at the same position `len`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PromptBatch {
    /// (B, len) token ids, `pad` before each prompt.
    pub ids: Vec<u32>,
    /// (B, len): 1 on prompt tokens, 0 on padding.
    pub attention_mask: Vec<u32>,
    pub b: usize,
    pub len: usize,
}

pub fn prompt_batch(samples: &[&PromptSample], pad: u32, len: usize) -> PromptBatch {
    let b = samples.len();
    let mut ids = vec![pad; b * len];
    let mut attention_mask = vec![0; b * len];
    for (row, s) in samples.iter().enumerate() {
        assert!(
            s.ids.len() <= len,
            "prompt_batch: a prompt of {} tokens exceeds the padded length {len}; prompt_samples drops those",
            s.ids.len()
        );
        let start = row * len + len - s.ids.len();
        ids[start..(row + 1) * len].copy_from_slice(&s.ids);
        attention_mask[start..(row + 1) * len].fill(1);
    }
    PromptBatch { ids, attention_mask, b, len }
}

/// This rank's micro-batches of one epoch under data parallelism (torch's `DistributedSampler`
/// under DS-Chat's per-device batches): `order` padded by repeating its start to a multiple of
/// `world` (every rank gets as many rows, so all take the same number of steps), cut into
/// global micro-batches of `per_device * world` rows, of which rank `r` takes rows
/// `r, r + world, ...`. The union over ranks of micro-batch k is then the k-th micro-batch of
/// one rank with `per_device * world` rows, which is what makes N ranks train like one.
pub fn rank_micro_batches(order: &[usize], per_device: usize, rank: usize, world: usize) -> Vec<Vec<usize>> {
    assert!(rank < world && per_device > 0, "rank {rank} of {world}, {per_device} rows per device");
    let padded = order.len().div_ceil(world) * world;
    let rows: Vec<usize> = order.iter().copied().cycle().take(padded).collect();
    rows.chunks(per_device * world).map(|global| global.iter().skip(rank).step_by(world).copied().collect()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_share_each_global_micro_batch_and_pad_to_equal_counts() {
        let order: Vec<usize> = (0..10).rev().collect(); // 9, 8, ..., 0
        let one = rank_micro_batches(&order, 6, 0, 1);
        assert_eq!(one, vec![vec![9, 8, 7, 6, 5, 4], vec![3, 2, 1, 0]]);
        let ranks: Vec<_> = (0..3).map(|r| rank_micro_batches(&order, 2, r, 3)).collect();
        // 10 rows padded to 12 by repeating the start (9, 8), in global micro-batches of 6.
        assert_eq!(ranks[0], vec![vec![9, 6], vec![3, 0]]);
        assert_eq!(ranks[1], vec![vec![8, 5], vec![2, 9]]);
        assert_eq!(ranks[2], vec![vec![7, 4], vec![1, 8]]);
        // Without padding, the union over ranks of micro-batch k is the one-rank micro-batch k.
        let order: Vec<usize> = (0..12).collect();
        let single = rank_micro_batches(&order, 4, 0, 1);
        for (k, want) in single.iter().enumerate() {
            let mut union: Vec<usize> = (0..2).flat_map(|r| rank_micro_batches(&order, 2, r, 2)[k].clone()).collect();
            union.sort();
            assert_eq!(&union, want);
        }
    }

    const PAD: u32 = 0;

    #[test]
    fn sft_batch_masks_the_prompt_and_pads_on_the_right() {
        // Row 0: prompt [5, 6], answer [7], EOS 9. Row 1: prompt [5], answer [8, 8], EOS 9.
        let a = SftSample { ids: vec![5, 6, 7, 9], prompt_len: 2 };
        let b = SftSample { ids: vec![5, 8, 8, 9, 3], prompt_len: 1 };
        let batch = sft_batch(&[&a, &b], PAD, false);
        assert_eq!((batch.b, batch.t), (2, 5));
        assert_eq!(batch.ids, [5, 6, 7, 9, PAD, 5, 8, 8, 9, 3]);
        // Row 0 learns 7 (at position 1) and 9 (at 2); the prompt token 6 (target of 0) is masked.
        // Row 1 learns 8, 8, 9, 3 at positions 0..4 (flattened 5..9).
        assert_eq!(batch.loss_rows, [1, 2, 5, 6, 7, 8]);
        assert_eq!(batch.loss_targets, [7, 9, 8, 8, 9, 3]);
        // DS-Chat behaviour: every real next token, prompt included, never padding.
        let all = sft_batch(&[&a, &b], PAD, true);
        assert_eq!(all.loss_rows, [0, 1, 2, 5, 6, 7, 8]);
        assert_eq!(all.loss_targets, [6, 7, 9, 8, 8, 9, 3]);
    }

    #[test]
    fn pair_batch_stacks_chosen_then_rejected() {
        let p = PairSample { chosen: vec![1, 2, 9], rejected: vec![1, 3, 3, 9], prompt_len: 1 };
        let q = PairSample { chosen: vec![4, 9], rejected: vec![4, 5, 9], prompt_len: 1 };
        let batch = pair_batch(&[&p, &q], PAD);
        assert_eq!((batch.pairs, batch.t), (2, 4));
        assert_eq!(batch.ids, [1, 2, 9, PAD, 4, 9, PAD, PAD, 1, 3, 3, 9, 4, 5, 9, PAD]);
    }

    #[test]
    fn prompt_batch_left_pads_to_the_fixed_length() {
        let p = PromptSample { ids: vec![7, 8] };
        let q = PromptSample { ids: vec![1, 2, 3, 4] };
        let batch = prompt_batch(&[&p, &q], PAD, 4);
        assert_eq!(batch.ids, [PAD, PAD, 7, 8, 1, 2, 3, 4]);
        assert_eq!(batch.attention_mask, [0, 0, 1, 1, 1, 1, 1, 1]);
    }
}
