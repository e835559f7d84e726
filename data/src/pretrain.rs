//! Pretraining data with Megatron GPT-dataset semantics (`megatron/data/gpt_dataset.py`):
//! documents joined into one token stream with EOS after each, cut into `seq_length + 1`-token
//! blocks that overlap by one token (input = first `seq_length`, target = last `seq_length`),
//! and a seeded per-epoch shuffle of block indices whose cursor goes into resume checkpoints.
//! The stream is either tokenized here from text, or Megatron's own pre-tokenized
//! `.bin`/`.idx` pair read in place.

use std::borrow::Cow;
use std::ops::Range;

use anyhow::{bail, Result};
use rand::{RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

use crate::indexed_dataset::IndexedDataset;
use crate::tokenizer::Tokenizer;

/// Token ids of each document (no EOS added; [`PackedCorpus::pack`] adds it).
pub fn tokenize_documents(tok: &Tokenizer, docs: &[String]) -> Result<Vec<Vec<u32>>> {
    tok.encode_batch(docs)
}

/// Where a [`PackedCorpus`]'s token stream lives.
#[derive(Debug)]
enum Stream {
    /// Tokenized here.
    Owned(Vec<u32>),
    /// A Megatron indexed dataset's files, mapped; each read is checked below `vocab_size`.
    Indexed { dataset: IndexedDataset, vocab_size: usize },
}

/// All documents as one token stream, each followed by EOS, read as fixed-length blocks.
#[derive(Debug)]
pub struct PackedCorpus {
    tokens: Stream,
    seq_length: usize,
}

impl PackedCorpus {
    /// Joins `docs` as `doc0 EOS doc1 EOS ...` (Megatron's `--append-eod`).
    pub fn pack(docs: &[Vec<u32>], eos_id: u32, seq_length: usize) -> Self {
        assert!(seq_length > 0, "PackedCorpus::pack: seq_length must be > 0");
        let total: usize = docs.iter().map(|d| d.len() + 1).sum();
        let mut tokens = Vec::with_capacity(total);
        for doc in docs {
            tokens.extend_from_slice(doc);
            tokens.push(eos_id);
        }
        Self { tokens: Stream::Owned(tokens), seq_length }
    }

    /// A Megatron indexed dataset's sequences, in order, as the stream (read in place).
    pub fn indexed(dataset: IndexedDataset, seq_length: usize, vocab_size: usize) -> Self {
        assert!(seq_length > 0, "PackedCorpus::indexed: seq_length must be > 0");
        Self { tokens: Stream::Indexed { dataset, vocab_size }, seq_length }
    }

    /// Number of whole blocks: each needs `seq_length + 1` tokens and shares its last token with
    /// the next block, so `(tokens - 1) / seq_length` (Megatron's `num_samples` for one epoch).
    pub fn num_blocks(&self) -> usize {
        self.num_tokens().saturating_sub(1) / self.seq_length
    }

    /// Block `i`: `tokens[i * seq_length ..= (i + 1) * seq_length]`, `seq_length + 1` tokens.
    /// Only an indexed dataset's read can fail (a token beyond the vocabulary).
    pub fn block(&self, i: usize) -> Result<Cow<'_, [u32]>> {
        assert!(
            i < self.num_blocks(),
            "PackedCorpus::block: index {i} out of range, corpus has {} blocks",
            self.num_blocks()
        );
        let range = i * self.seq_length..(i + 1) * self.seq_length + 1;
        Ok(match &self.tokens {
            Stream::Owned(tokens) => Cow::Borrowed(&tokens[range]),
            Stream::Indexed { dataset, vocab_size } => Cow::Owned(dataset.read(range, *vocab_size)?),
        })
    }

    /// Tokens in the stream, EOS included.
    pub fn num_tokens(&self) -> usize {
        match &self.tokens {
            Stream::Owned(tokens) => tokens.len(),
            Stream::Indexed { dataset, .. } => dataset.num_tokens(),
        }
    }

    /// Tokens per training sequence (the block holds one more for the shifted target).
    pub fn seq_length(&self) -> usize {
        self.seq_length
    }
}

/// Where a [`BlockSampler`] stands: the checkpointable state of the sampler. The default is the
/// start of epoch 0, valid for any range.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SamplerCursor {
    /// Epochs completed so far; selects the shuffle of the current epoch.
    pub epoch: u64,
    /// Indices already handed out in the current epoch's order.
    pub position: usize,
    /// Blocks in the range it was drawing from (absent in checkpoints written before it was
    /// recorded, and at the start): over another number of blocks the shuffle is another, so
    /// the cursor means nothing there.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub blocks: Option<usize>,
}

/// Endless stream of block indices from `range`: a fresh seeded shuffle every epoch.
#[derive(Clone, Debug)]
pub struct BlockSampler {
    range: Range<usize>,
    seed: u64,
    /// Which corpus of a blend this samples (0 for a lone corpus): each shuffles on its own.
    stream: u64,
    cursor: SamplerCursor,
    /// The current epoch's order, a permutation of `range`.
    order: Vec<usize>,
}

impl BlockSampler {
    /// A sampler at the start of epoch 0.
    pub fn new(range: Range<usize>, seed: u64) -> Self {
        let cursor = SamplerCursor { blocks: Some(range.len()), ..SamplerCursor::default() };
        let order = epoch_order(&range, seed, cursor.epoch);
        Self { range, seed, stream: 0, cursor, order }
    }

    /// A sampler that continues exactly where the one that produced `cursor` stood, given the
    /// same `range` and `seed`. A cursor saved over another number of blocks is an error: the
    /// data changed since the checkpoint (corpus, split or sequence length), and continuing
    /// would neither repeat the saved run nor start the new data's epoch afresh.
    pub fn with_cursor(range: Range<usize>, seed: u64, cursor: SamplerCursor) -> Result<Self> {
        Self::of_corpus(range, seed, 0, cursor)
    }

    /// [`BlockSampler::with_cursor`] for corpus `corpus` of a blend, whose shuffles are its own
    /// (corpus 0's are a lone corpus's, so a blend of one draws as that corpus alone).
    pub fn of_corpus(range: Range<usize>, seed: u64, corpus: u64, cursor: SamplerCursor) -> Result<Self> {
        let blocks = range.len();
        if let Some(saved) = cursor.blocks.filter(|&saved| saved != blocks) {
            bail!("the checkpoint was drawing from {saved} blocks of data and the data now makes {blocks}");
        }
        if cursor.position > blocks {
            bail!("the checkpoint had drawn {} blocks of this epoch and the data now makes {blocks}", cursor.position);
        }
        let order = epoch_order_of(&range, seed, cursor.epoch, corpus);
        Ok(Self { range, seed, stream: corpus, cursor: SamplerCursor { blocks: Some(blocks), ..cursor }, order })
    }

    /// The next index (see [`BlockSampler::next_indices`]).
    pub fn next_index(&mut self) -> usize {
        self.next_indices(1)[0]
    }

    /// Indices drawn so far, over every epoch.
    pub fn drawn(&self) -> u64 {
        self.cursor.epoch * self.range.len() as u64 + self.cursor.position as u64
    }

    /// The next `n` indices, moving into the next epoch (a new shuffle) as often as needed.
    pub fn next_indices(&mut self, n: usize) -> Vec<usize> {
        assert!(
            n == 0 || !self.range.is_empty(),
            "BlockSampler::next_indices: cannot draw {n} indices from the empty range {:?}",
            self.range
        );
        let mut out = Vec::with_capacity(n);
        while out.len() < n {
            if self.cursor.position == self.order.len() {
                self.cursor = SamplerCursor { epoch: self.cursor.epoch + 1, position: 0, ..self.cursor };
                self.order = epoch_order_of(&self.range, self.seed, self.cursor.epoch, self.stream);
            }
            let take = (n - out.len()).min(self.order.len() - self.cursor.position);
            out.extend_from_slice(&self.order[self.cursor.position..self.cursor.position + take]);
            self.cursor.position += take;
        }
        out
    }

    /// State to save for an exact resume with [`BlockSampler::with_cursor`].
    pub fn cursor(&self) -> SamplerCursor {
        self.cursor
    }

    /// The epoch the next index comes from (or the one just finished, if at its end).
    pub fn epoch(&self) -> u64 {
        self.cursor.epoch
    }
}

/// The shuffle of `range` for `epoch` (of a lone corpus: [`epoch_order_of`] corpus 0).
pub fn epoch_order(range: &Range<usize>, seed: u64, epoch: u64) -> Vec<usize> {
    epoch_order_of(range, seed, epoch, 0)
}

/// The shuffle of `range` for `epoch` of corpus `corpus` of a blend. ChaCha8 is seeded with
/// `seed`, `epoch` and `corpus` side by side in its 32-byte key, so no two such triples share a
/// stream. Fisher-Yates is written out (rather than rand's `shuffle`) so the order, and thus
/// resume, cannot change with a rand upgrade.
pub fn epoch_order_of(range: &Range<usize>, seed: u64, epoch: u64, corpus: u64) -> Vec<usize> {
    let mut key = [0u8; 32];
    key[..8].copy_from_slice(&seed.to_le_bytes());
    key[8..16].copy_from_slice(&epoch.to_le_bytes());
    key[16..24].copy_from_slice(&corpus.to_le_bytes());
    let mut rng = ChaCha8Rng::from_seed(key);
    let mut order: Vec<usize> = range.clone().collect();
    for i in (1..order.len()).rev() {
        // Uniform in 0..=i by multiply-shift; the bias is below (i + 1) / 2^64.
        let j = ((u128::from(rng.next_u64()) * (i as u128 + 1)) >> 64) as usize;
        order.swap(i, j);
    }
    order
}

/// `batches` eval batches of `batch_size` indices, taken in order from `range` and cycling when
/// it is shorter, so every evaluation scores the same blocks. Empty when `range` is empty (a
/// split with weight 0 has nothing to evaluate).
pub fn eval_indices(range: &Range<usize>, batches: usize, batch_size: usize) -> Vec<Vec<usize>> {
    if range.is_empty() {
        return Vec::new();
    }
    let mut cycle = range.clone().cycle();
    (0..batches).map(|_| cycle.by_ref().take(batch_size).collect()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn owned(corpus: &PackedCorpus) -> &Vec<u32> {
        match &corpus.tokens {
            Stream::Owned(tokens) => tokens,
            Stream::Indexed { .. } => panic!("an indexed corpus"),
        }
    }

    fn block(corpus: &PackedCorpus, i: usize) -> Vec<u32> {
        corpus.block(i).unwrap().into_owned()
    }

    #[test]
    fn pack_puts_eos_after_every_document() {
        let packed = PackedCorpus::pack(&[vec![1, 2, 3], vec![], vec![4, 5]], 0, 2);
        assert_eq!(owned(&packed), &vec![1, 2, 3, 0, 0, 4, 5, 0]);
        assert_eq!(packed.num_tokens(), 8);
        // One allocation of exactly the stream's length (`with_capacity` gives exactly what is
        // asked): a pretraining corpus is the largest buffer of the run, and regrowing it would
        // briefly hold it twice.
        assert_eq!(owned(&packed).capacity(), 8);
        let lone_empty = PackedCorpus::pack(&[vec![]], 7, 1);
        assert_eq!((owned(&lone_empty).as_slice(), owned(&lone_empty).capacity()), (&[7][..], 1));
    }

    #[test]
    fn blocks_overlap_by_one_token_and_count_is_tokens_minus_one_over_seq() {
        // Stream 1 2 3 9 4 5 6 9 7 9 (10 tokens), seq 3 -> (10 - 1) / 3 = 3 blocks.
        let packed = PackedCorpus::pack(&[vec![1, 2, 3], vec![4, 5, 6], vec![7]], 9, 3);
        assert_eq!((packed.num_blocks(), packed.seq_length()), (3, 3));
        assert_eq!(block(&packed, 0), [1, 2, 3, 9]);
        assert_eq!(block(&packed, 1), [9, 4, 5, 6]);
        assert_eq!(block(&packed, 2), [6, 9, 7, 9]);
        for i in 0..2 {
            assert_eq!(block(&packed, i).last(), block(&packed, i + 1).first());
        }
        // One token short of a fourth block: 12 tokens would be needed, 10 suffice for 3.
        let packed = PackedCorpus::pack(&[vec![1, 2]], 9, 3);
        assert_eq!(packed.num_blocks(), 0);
        assert_eq!(PackedCorpus::pack(&[], 9, 3).num_blocks(), 0);
        assert_eq!(PackedCorpus::pack(&[vec![1, 2, 3]], 9, 3).num_blocks(), 1);
    }

    #[test]
    #[should_panic(expected = "out of range")]
    fn block_past_the_end_panics() {
        let _ = PackedCorpus::pack(&[vec![1, 2, 3]], 9, 3).block(1);
    }

    fn sorted(mut v: Vec<usize>) -> Vec<usize> {
        v.sort_unstable();
        v
    }

    #[test]
    fn sampler_wraps_into_new_shuffles_each_a_permutation() {
        let range = 10..30;
        let mut sampler = BlockSampler::new(range.clone(), 7);
        // 3.5 epochs in one call: more than the range holds.
        let drawn = sampler.next_indices(70);
        assert_eq!(drawn.len(), 70);
        assert_eq!(sampler.cursor(), SamplerCursor { epoch: 3, position: 10, blocks: Some(range.len()) });
        let epochs: Vec<Vec<usize>> = drawn.chunks(20).map(<[usize]>::to_vec).collect();
        let all: Vec<usize> = range.clone().collect();
        for epoch in &epochs[..3] {
            assert_eq!(sorted(epoch.clone()), all, "each epoch is a permutation of the range");
        }
        assert_ne!(epochs[0], epochs[1], "a new order each epoch");
        assert_ne!(epochs[1], epochs[2], "a new order each epoch");
        assert_ne!(epochs[0], all, "the order is shuffled");
        // The same seed gives the same stream; another seed a different one.
        assert_eq!(BlockSampler::new(range.clone(), 7).next_indices(70), drawn);
        assert_ne!(BlockSampler::new(range, 8).next_indices(70), drawn);
    }

    #[test]
    fn sampler_resumes_exactly_from_a_cursor() -> Result<()> {
        let range = 0..13;
        let mut reference = BlockSampler::new(range.clone(), 42);
        let expected = reference.next_indices(100);

        // Stop at several points, including an epoch boundary (position == len), and resume.
        for stop in [0, 5, 13, 26, 40, 99] {
            let mut original = BlockSampler::new(range.clone(), 42);
            let mut got = original.next_indices(stop);
            let cursor = original.cursor();
            let restored: SamplerCursor = serde_json::from_str(&serde_json::to_string(&cursor)?)?;
            assert_eq!(restored, cursor, "cursor survives JSON");
            let mut resumed = BlockSampler::with_cursor(range.clone(), 42, restored)?;
            got.extend(resumed.next_indices(100 - stop));
            assert_eq!(got, expected, "resume after {stop} indices");
        }
        Ok(())
    }

    #[test]
    fn a_cursor_saved_over_other_data_is_refused_not_a_panic() -> Result<()> {
        let mut saved = BlockSampler::new(0..13, 42);
        saved.next_indices(9);
        let cursor = saved.cursor();
        let fewer = BlockSampler::with_cursor(0..5, 42, cursor).expect_err("5 blocks, not 13").to_string();
        assert!(fewer.contains("13 blocks") && fewer.contains("now makes 5"), "{fewer}");
        let more = BlockSampler::with_cursor(0..20, 42, cursor).expect_err("20 blocks, not 13").to_string();
        assert!(more.contains("13 blocks") && more.contains("now makes 20"), "{more}");
        // A checkpoint from before the block count was recorded: only a position past the end
        // is known to be wrong.
        let unrecorded: SamplerCursor = serde_json::from_str(r#"{"epoch": 0, "position": 9}"#)?;
        assert_eq!(unrecorded.blocks, None);
        assert!(BlockSampler::with_cursor(0..5, 42, unrecorded).is_err());
        assert_eq!(BlockSampler::with_cursor(0..13, 42, unrecorded)?.cursor(), cursor);
        Ok(())
    }

    #[test]
    fn sampler_draws_in_uneven_chunks_like_one_long_draw() {
        let mut whole = BlockSampler::new(3..8, 1);
        let mut chunked = BlockSampler::new(3..8, 1);
        let mut got = Vec::new();
        for n in [1, 4, 0, 7, 3] {
            got.extend(chunked.next_indices(n));
        }
        assert_eq!(got, whole.next_indices(15));
        assert_eq!(chunked.epoch(), 2);
    }

    #[test]
    fn epoch_order_is_pinned_by_a_separate_chacha8() {
        // Computed by scripts/fixtures/epoch_order.py, ChaCha8 and the shuffle written again in
        // Python: resume depends on this order staying the same across rand upgrades. The last
        // case takes 38 words, past ChaCha's 16-word block, and the largest seed.
        assert_eq!(epoch_order(&(0..10), 42, 0), [7, 6, 5, 1, 0, 4, 8, 9, 2, 3]);
        assert_eq!(epoch_order(&(0..10), 42, 3), [0, 1, 7, 8, 4, 2, 9, 6, 3, 5]);
        assert_eq!(
            epoch_order(&(5..25), u64::MAX, 1),
            [18, 11, 5, 20, 19, 15, 12, 24, 9, 8, 6, 10, 13, 22, 14, 21, 23, 17, 7, 16]
        );
        // A blend's corpora 1 and 2: their own streams (corpus 0 is the lone corpus above).
        assert_eq!(epoch_order_of(&(0..10), 42, 0, 1), [8, 6, 0, 2, 5, 4, 1, 3, 7, 9]);
        assert_eq!(epoch_order_of(&(0..10), 42, 3, 2), [7, 6, 8, 3, 0, 9, 4, 2, 1, 5]);
        assert_eq!(epoch_order(&(3..3), 42, 0), Vec::<usize>::new());
        assert_eq!(epoch_order(&(3..4), 42, 0), [3]);
    }

    #[test]
    fn epoch_order_draws_every_permutation_about_equally() {
        // 6000 epochs of a 3-block range: each of the 6 orders about 1000 times (binomial sd
        // about 29, so 850..1150 is over 5 sd). A shuffle that never leaves an element in place
        // (Sattolo's, `j < i`) would draw only the 2 cyclic orders.
        let mut counts = std::collections::BTreeMap::<Vec<usize>, usize>::new();
        for epoch in 0..6000 {
            *counts.entry(epoch_order(&(0..3), 9, epoch)).or_default() += 1;
        }
        assert_eq!(counts.len(), 6, "{counts:?}");
        assert!(counts.values().all(|&c| (850..1150).contains(&c)), "{counts:?}");
    }

    #[test]
    fn drawing_nothing_from_an_empty_range_is_nothing() {
        let mut sampler = BlockSampler::new(4..4, 1);
        assert!(sampler.next_indices(0).is_empty());
        assert_eq!(sampler.cursor(), SamplerCursor { epoch: 0, position: 0, blocks: Some(0) });
    }

    #[test]
    #[should_panic(expected = "cannot draw 2 indices from the empty range 4..4")]
    fn drawing_from_an_empty_range_panics_rather_than_loop() {
        BlockSampler::new(4..4, 1).next_indices(2);
    }

    #[test]
    fn eval_indices_are_in_order_cycle_and_repeat() {
        assert_eq!(eval_indices(&(5..12), 2, 3), vec![vec![5, 6, 7], vec![8, 9, 10]]);
        assert_eq!(
            eval_indices(&(5..8), 3, 2),
            vec![vec![5, 6], vec![7, 5], vec![6, 7]],
            "cycles when the range is shorter than batches * batch_size"
        );
        assert_eq!(eval_indices(&(5..8), 3, 2), eval_indices(&(5..8), 3, 2));
        assert!(eval_indices(&(4..4), 3, 2).is_empty());
    }

    #[test]
    fn tokenize_then_pack_separates_documents_with_gpt2_eos() -> Result<()> {
        let tok = Tokenizer::gpt2_default()?;
        let docs = vec!["Hello world".to_string(), "Hello world".to_string()];
        let ids = tokenize_documents(&tok, &docs)?;
        let packed = PackedCorpus::pack(&ids, tok.eos_id(), 2);
        assert_eq!(owned(&packed), &vec![15496, 995, 50256, 15496, 995, 50256]);
        assert_eq!(packed.num_blocks(), 2);
        assert_eq!(block(&packed, 1), [50256, 15496, 995]);
        Ok(())
    }
}
