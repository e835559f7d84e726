//! Megatron's blend of several pretraining corpora (`--data-path 0.3 A 0.7 B`, megatron-core's
//! `BlendedDataset`): each corpus packed and split into train, validation and test on its own,
//! and each sample of a split taken from the corpus furthest below its share so far (the rule of
//! megatron-core's `helpers.cpp` `build_blending_indices`), from that corpus's own shuffled
//! blocks. A lone corpus is a blend of one: it draws exactly as [`BlockSampler`] alone.

use std::borrow::Cow;
use std::ops::Range;

use anyhow::{bail, Result};
use serde::{Deserialize, Serialize};

use crate::corpus::{read_packed_corpus, CorpusSource};
use crate::pretrain::{BlockSampler, PackedCorpus, SamplerCursor};
use crate::split::{check_split, split_ranges};
use crate::tokenizer::Tokenizer;

/// One corpus of `--data-path` and its weight, when the blend gives weights.
#[derive(Clone, Debug, PartialEq)]
pub struct BlendEntry {
    pub weight: Option<f64>,
    pub path: String,
}

/// `--data-path`'s words as Megatron's `get_blend_from_list` reads them: one corpus; weights and
/// corpora alternating (`0.3 A 0.7 B`, any positive weights, normalized); or corpora alone (`A B`,
/// each then weighted by its blocks in the split drawn from). A list that mixes the two, or a
/// weight that is not positive, is one line saying so.
pub fn parse_blend(words: &[String]) -> Result<Vec<BlendEntry>> {
    const EXAMPLE: &str = "give one corpus, weights and corpora alternating (--data-path 0.3 A 0.7 B), or corpora alone (--data-path A B)";
    let is_number = |w: &String| w.trim().parse::<f64>().is_ok();
    let paths_alone = |words: &[String]| words.iter().map(|w| BlendEntry { weight: None, path: w.clone() }).collect();
    match words {
        [] => bail!("--data-path names no corpus; {EXAMPLE}"),
        [one] => return Ok(paths_alone(std::slice::from_ref(one))),
        _ => {}
    }
    let (weights, paths): (Vec<&String>, Vec<&String>) =
        (words.iter().step_by(2).collect(), words.iter().skip(1).step_by(2).collect());
    let weighted = words.len().is_multiple_of(2) && weights.iter().all(|w| is_number(w));
    if !weighted {
        if let Some(number) = words.iter().find(|w| is_number(w)) {
            bail!("--data-path {}: {number:?} reads as a weight, but the words are not weights and corpora in pairs; {EXAMPLE}", words.join(" "));
        }
        return Ok(paths_alone(words));
    }
    if let Some(path) = paths.iter().find(|p| is_number(p)) {
        bail!("--data-path {}: {path:?} stands where a corpus should, after a weight; {EXAMPLE}", words.join(" "));
    }
    weights
        .iter()
        .zip(paths)
        .map(|(w, path)| match w.trim().parse::<f64>() {
            Ok(weight) if weight.is_finite() && weight > 0.0 => {
                Ok(BlendEntry { weight: Some(weight), path: path.clone() })
            }
            _ => bail!("--data-path {}: the weight {w} of {path} is not a positive number; {EXAMPLE}", words.join(" ")),
        })
        .collect()
}

/// `weights` divided by their sum (megatron-core's `normalize`). numpy's sum adds fewer than
/// eight numbers left to right, as this does; over more it sums in eight lanes, so a blend of
/// eight corpora or more may differ from Megatron's weights in their last bit.
fn normalize(weights: &[f64]) -> Vec<f64> {
    let total: f64 = weights.iter().sum();
    weights.iter().map(|w| w / total).collect()
}

/// The corpus that sample `sample` of a blend comes from, given the samples each corpus has
/// given so far: the one furthest below its share `weight * sample`, the first of equals.
/// Megatron's `build_blending_indices` to the letter, `max(sample, 1)` included (so samples 0
/// and 1 are measured against the same share), so that a blend draws its corpora in Megatron's
/// order.
pub fn blend_choice(weights: &[f64], drawn: &[u64], sample: u64) -> usize {
    let share = (sample as f64).max(1.0);
    let mut best = 0;
    let mut max_error = weights[0] * share - drawn[0] as f64;
    for (i, (w, &n)) in weights.iter().zip(drawn).enumerate().skip(1) {
        let error = w * share - n as f64;
        if error > max_error {
            (best, max_error) = (i, error);
        }
    }
    best
}

/// Where a pretraining run's data sampler stands, as a checkpoint holds it: a lone corpus's
/// cursor (the form checkpoints had before blends), or one cursor per corpus of a blend.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum DataCursor {
    Blend { blend: Vec<SamplerCursor> },
    One(SamplerCursor),
}

impl Default for DataCursor {
    fn default() -> Self {
        Self::One(SamplerCursor::default())
    }
}

/// The flags that give each split its own corpora (Megatron's), by split.
pub const SPLIT_DATA_FLAGS: [&str; 3] = ["--train-data-path", "--valid-data-path", "--test-data-path"];

/// Where the splits' corpora come from.
#[derive(Clone, Debug, PartialEq)]
pub enum BlendPlan {
    /// One blend, each corpus split by `--split`'s fractions (Megatron's `--data-path`).
    Split { entries: Vec<BlendEntry>, fractions: [f64; 3] },
    /// A blend per split (train, validation, test; an empty one for none), each corpus whole in
    /// its split (Megatron's `--train-data-path`, `--valid-data-path`, `--test-data-path`).
    PerSplit([Vec<BlendEntry>; 3]),
}

/// One corpus of a blend: its blocks sit at `offset..offset + corpus.num_blocks()` of the
/// blend's block numbers.
#[derive(Debug)]
pub struct BlendPart {
    pub source: CorpusSource,
    /// The flag's word for it.
    pub name: String,
    pub weight: Option<f64>,
    pub corpus: PackedCorpus,
    pub documents: usize,
    /// The split it serves whole (a per-split blend's), or `None`: split by `--split`.
    pub serves: Option<usize>,
    offset: usize,
    /// Train, validation and test, in the blend's block numbers.
    splits: [Range<usize>; 3],
}

impl BlendPart {
    /// The blocks of split `which` (0 train, 1 validation, 2 test), in the blend's numbers.
    pub fn split(&self, which: usize) -> Range<usize> {
        self.splits[which].clone()
    }
}

/// Several packed corpora read as one: block `i` of the blend is a block of one of them.
#[derive(Debug)]
pub struct BlendedCorpus {
    parts: Vec<BlendPart>,
    seq_length: usize,
}

/// A corpus read for a blend: its entry, where it came from, its blocks and documents, and the
/// split it serves whole (or `None`: split by `--split`).
pub struct ReadCorpus {
    pub entry: BlendEntry,
    pub source: CorpusSource,
    pub corpus: PackedCorpus,
    pub documents: usize,
    pub serves: Option<usize>,
}

/// `plan`'s corpora (from [`parse_blend`]), each read as [`read_packed_corpus`] reads it.
pub fn read_blend(
    plan: &BlendPlan,
    text_key: &str,
    tokenizer: &Tokenizer,
    seq_length: usize,
    vocab_size: usize,
) -> Result<BlendedCorpus> {
    let (listed, fractions): (Vec<(&BlendEntry, Option<usize>)>, [f64; 3]) = match plan {
        BlendPlan::Split { entries, fractions } => (entries.iter().map(|e| (e, None)).collect(), *fractions),
        BlendPlan::PerSplit(per_split) => (
            per_split.iter().enumerate().flat_map(|(which, es)| es.iter().map(move |e| (e, Some(which)))).collect(),
            [0.0; 3],
        ),
    };
    let mut parts = Vec::with_capacity(listed.len());
    for (entry, serves) in listed {
        let source = CorpusSource::parse(&entry.path);
        let (corpus, documents) = read_packed_corpus(&source, text_key, tokenizer, seq_length, vocab_size)?;
        parts.push(ReadCorpus { entry: entry.clone(), source, corpus, documents, serves });
    }
    BlendedCorpus::new(parts, &fractions)
}

impl BlendedCorpus {
    /// The blend of `parts`, each split by `split` or whole in the split it serves. A corpus too
    /// small for a split with a positive weight (or for one block, serving a split) is an error
    /// naming it; so is a blend without a train corpus.
    pub fn new(parts: Vec<ReadCorpus>, split: &[f64; 3]) -> Result<Self> {
        let seq_length = parts.first().map_or(1, |p| p.corpus.seq_length());
        let named = parts.len() > 1 || parts.iter().any(|p| p.serves.is_some());
        if !parts.iter().any(|p| p.serves.is_none_or(|s| s == 0)) {
            bail!("no corpus for the train split: give --data-path, or --train-data-path with the others");
        }
        let (mut blended, mut offset) = (Vec::with_capacity(parts.len()), 0);
        for ReadCorpus { entry, source, corpus, documents, serves } in parts {
            assert_eq!(corpus.seq_length(), seq_length, "BlendedCorpus::new: corpora of different block lengths");
            let n = corpus.num_blocks();
            let ranges = match serves {
                None => split_ranges(n, split),
                Some(which) => std::array::from_fn(|s| if s == which { 0..n } else { 0..0 }),
            };
            let checked = match serves {
                None => check_split(n, split, &ranges),
                Some(_) if n == 0 => check_split(0, split, &ranges),
                Some(_) => Ok(()),
            };
            checked.map_err(|e| match (named, serves) {
                (false, _) => e,
                (true, None) => anyhow::anyhow!("corpus {} of --data-path: {e}", entry.path),
                (true, Some(which)) => anyhow::anyhow!("corpus {} of {}: {e}", entry.path, SPLIT_DATA_FLAGS[which]),
            })?;
            let splits = ranges.map(|r| offset + r.start..offset + r.end);
            blended.push(BlendPart {
                source,
                name: entry.path,
                weight: entry.weight,
                corpus,
                documents,
                serves,
                offset,
                splits,
            });
            offset += n;
        }
        Ok(Self { parts: blended, seq_length })
    }

    pub fn parts(&self) -> &[BlendPart] {
        &self.parts
    }

    /// Blocks over all corpora.
    pub fn num_blocks(&self) -> usize {
        self.parts.iter().map(|p| p.corpus.num_blocks()).sum()
    }

    pub fn num_tokens(&self) -> usize {
        self.parts.iter().map(|p| p.corpus.num_tokens()).sum()
    }

    /// Tokens per training sequence.
    pub fn seq_length(&self) -> usize {
        self.seq_length
    }

    /// Block `i` of the blend, `seq_length + 1` tokens (see [`PackedCorpus::block`]).
    pub fn block(&self, i: usize) -> Result<Cow<'_, [u32]>> {
        let part =
            self.parts.iter().rfind(|p| p.offset <= i).filter(|p| i < p.offset + p.corpus.num_blocks()).unwrap_or_else(
                || panic!("BlendedCorpus::block: index {i} out of range, the blend has {} blocks", self.num_blocks()),
            );
        part.corpus.block(i - part.offset)
    }

    /// The corpora with blocks in split `which` (their indices in [`Self::parts`]) and their
    /// weights there, normalized: the given weights, or each corpus's share of the split's blocks
    /// when its blend gave none (Megatron weighs such a blend by its datasets' lengths).
    pub fn split_weights(&self, which: usize) -> (Vec<usize>, Vec<f64>) {
        let members: Vec<usize> = (0..self.parts.len()).filter(|&i| !self.parts[i].splits[which].is_empty()).collect();
        let given: Option<Vec<f64>> = members.iter().map(|&i| self.parts[i].weight).collect();
        let raw = given.unwrap_or_else(|| members.iter().map(|&i| self.parts[i].splits[which].len() as f64).collect());
        (members, normalize(&raw))
    }

    /// The training sampler, where `cursor` left it (the default: the start). A cursor saved
    /// over another number of corpora or blocks is an error.
    pub fn train_sampler(&self, seed: u64, cursor: &DataCursor) -> Result<BlendedSampler> {
        let (members, weights) = self.split_weights(0);
        let cursors = match (cursor, members.len()) {
            (DataCursor::One(c), 1) => vec![*c],
            (DataCursor::One(c), n) if *c == SamplerCursor::default() => vec![*c; n],
            (DataCursor::Blend { blend }, n) if blend.len() == n => blend.clone(),
            (saved, n) => {
                let saved = match saved {
                    DataCursor::One(_) => 1,
                    DataCursor::Blend { blend } => blend.len(),
                };
                let corpora = |n: usize| if n == 1 { "1 corpus".to_string() } else { format!("{n} corpora") };
                bail!("the checkpoint was drawing from {} and the data flags now give {}", corpora(saved), corpora(n))
            }
        };
        // The k-th train corpus shuffles in stream k: a lone train corpus as it always has.
        let samplers = members
            .iter()
            .zip(cursors)
            .enumerate()
            .map(|(k, (&i, c))| BlockSampler::of_corpus(self.parts[i].split(0), seed, k as u64, c))
            .collect::<Result<Vec<_>>>()?;
        Ok(BlendedSampler::new(weights, samplers))
    }

    /// `batches` evaluation batches of `batch_size` blocks of split `which` (1 validation, 2
    /// test): the corpora chosen as in training, each corpus's blocks taken in order and
    /// cycling, so every evaluation scores the same blocks. A lone corpus gives
    /// [`crate::eval_indices`]'s batches. Empty when the split is.
    pub fn eval_batches(&self, which: usize, batches: usize, batch_size: usize) -> Vec<Vec<usize>> {
        let (members, weights) = self.split_weights(which);
        if members.is_empty() {
            return Vec::new();
        }
        let ranges: Vec<Range<usize>> = members.iter().map(|&i| self.parts[i].split(which)).collect();
        let mut drawn = vec![0u64; ranges.len()];
        let next = |sample: u64| {
            let i = blend_choice(&weights, &drawn, sample);
            let range = &ranges[i];
            let block = range.start + (drawn[i] % range.len() as u64) as usize;
            drawn[i] += 1;
            block
        };
        let picks: Vec<usize> = (0..(batches * batch_size) as u64).map(next).collect();
        picks.chunks(batch_size.max(1)).map(<[usize]>::to_vec).collect()
    }
}

/// The endless training stream of a blend's block numbers: each from the corpus
/// [`blend_choice`] picks, drawn from that corpus's own [`BlockSampler`].
#[derive(Clone, Debug)]
pub struct BlendedSampler {
    weights: Vec<f64>,
    corpora: Vec<BlockSampler>,
    /// Blocks each corpus has given, over every epoch.
    drawn: Vec<u64>,
}

impl BlendedSampler {
    fn new(weights: Vec<f64>, corpora: Vec<BlockSampler>) -> Self {
        let drawn = corpora.iter().map(BlockSampler::drawn).collect();
        Self { weights, corpora, drawn }
    }

    /// The next `n` block numbers.
    pub fn next_indices(&mut self, n: usize) -> Vec<usize> {
        if let [only] = &mut self.corpora[..] {
            // A lone corpus: its sampler's stream as it is, drawn in one go.
            self.drawn[0] += n as u64;
            return only.next_indices(n);
        }
        (0..n)
            .map(|_| {
                let sample = self.drawn.iter().sum();
                let i = blend_choice(&self.weights, &self.drawn, sample);
                self.drawn[i] += 1;
                self.corpora[i].next_index()
            })
            .collect()
    }

    /// State to save for an exact resume with [`BlendedCorpus::train_sampler`].
    pub fn cursor(&self) -> DataCursor {
        match &self.corpora[..] {
            [only] => DataCursor::One(only.cursor()),
            many => DataCursor::Blend { blend: many.iter().map(BlockSampler::cursor).collect() },
        }
    }

    /// Blocks drawn from each corpus so far.
    pub fn drawn(&self) -> &[u64] {
        &self.drawn
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Value;

    fn words(s: &str) -> Vec<String> {
        s.split_whitespace().map(str::to_string).collect()
    }

    fn entry(weight: Option<f64>, path: &str) -> BlendEntry {
        BlendEntry { weight, path: path.to_string() }
    }

    #[test]
    fn data_path_reads_as_megatrons_get_blend_from_list() -> Result<()> {
        assert_eq!(parse_blend(&words("A"))?, [entry(None, "A")]);
        assert_eq!(parse_blend(&words("0.3 A 0.7 B"))?, [entry(Some(0.3), "A"), entry(Some(0.7), "B")]);
        assert_eq!(parse_blend(&words("30 A 70 B"))?, [entry(Some(30.0), "A"), entry(Some(70.0), "B")]);
        assert_eq!(parse_blend(&words("A B"))?, [entry(None, "A"), entry(None, "B")]);
        assert_eq!(parse_blend(&words("A B C"))?, [entry(None, "A"), entry(None, "B"), entry(None, "C")]);
        // A lone word is a corpus even when it reads as a number (Megatron: an odd count is
        // corpora alone).
        assert_eq!(parse_blend(&words("7"))?, [entry(None, "7")]);
        // A weighted lone corpus is that corpus.
        assert_eq!(parse_blend(&words("1 A"))?, [entry(Some(1.0), "A")]);
        let refused = [
            ("", "names no corpus"),
            ("0.3 A 0.7", "\"0.3\" reads as a weight"),
            ("0.3 A B C", "\"0.3\" reads as a weight"),
            ("A 0.3 B 0.7", "\"0.3\" reads as a weight"),
            ("0.3 0.5 0.7 B", "\"0.5\" stands where a corpus should"),
            ("0 A 1 B", "the weight 0 of A is not a positive number"),
            ("-1 A 2 B", "the weight -1 of A is not a positive number"),
            ("inf A 2 B", "the weight inf of A is not a positive number"),
        ];
        for (given, want) in refused {
            let e = parse_blend(&words(given)).expect_err(given).to_string();
            assert!(e.contains(want) && e.contains("--data-path 0.3 A 0.7 B") && !e.contains('\n'), "{given}: {e}");
        }
        Ok(())
    }

    /// megatron-core 0.9.0's own `build_blending_indices` on seven blends of 240 samples
    /// (`scripts/fixtures/megatron_blending.py`): the same corpus for every sample, and the same
    /// sample number within it.
    #[test]
    fn blend_choice_is_megatrons_blending_index() -> Result<()> {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/megatron/blending.json");
        let fixture: Value = serde_json::from_slice(&std::fs::read(path)?)?;
        let cases = fixture["cases"].as_array().expect("cases");
        assert_eq!(cases.len(), 7);
        for case in cases {
            let given: Vec<String> =
                case["data_path"].as_array().unwrap().iter().map(|w| w.as_str().unwrap().to_string()).collect();
            let entries = parse_blend(&given)?;
            let weights = normalize(&entries.iter().map(|e| e.weight.unwrap()).collect::<Vec<_>>());
            let want: Vec<f64> = case["weights"].as_array().unwrap().iter().map(|w| w.as_f64().unwrap()).collect();
            assert_eq!(weights, want, "{given:?}: megatron-core's normalized weights, bit for bit");
            let mut drawn = vec![0u64; weights.len()];
            for (sample, (corpus, within)) in case["dataset_index"]
                .as_array()
                .unwrap()
                .iter()
                .zip(case["dataset_sample_index"].as_array().unwrap())
                .enumerate()
            {
                let i = blend_choice(&weights, &drawn, sample as u64);
                assert_eq!(
                    (i as u64, drawn[i]),
                    (corpus.as_u64().unwrap(), within.as_u64().unwrap()),
                    "{given:?} sample {sample}"
                );
                drawn[i] += 1;
            }
        }
        Ok(())
    }

    fn packed(blocks: usize) -> PackedCorpus {
        // seq_length 2: 2 * blocks + 1 tokens make `blocks` blocks; token t is t.
        PackedCorpus::pack(&[(0..2 * blocks as u32).collect()], 2 * blocks as u32, 2)
    }

    fn read(i: usize, weight: Option<f64>, blocks: usize, serves: Option<usize>) -> ReadCorpus {
        let name = format!("c{i}");
        let source = CorpusSource::File(name.clone().into());
        ReadCorpus { entry: entry(weight, &name), source, corpus: packed(blocks), documents: 1, serves }
    }

    fn blend(parts: &[(Option<f64>, usize)], split: [f64; 3]) -> Result<BlendedCorpus> {
        let parts = parts.iter().enumerate().map(|(i, &(w, blocks))| read(i, w, blocks, None)).collect();
        BlendedCorpus::new(parts, &split)
    }

    #[test]
    fn a_lone_corpus_draws_as_its_block_sampler_and_evaluates_as_eval_indices() -> Result<()> {
        for weight in [None, Some(0.5)] {
            let corpus = blend(&[(weight, 40)], [0.8, 0.15, 0.05])?;
            let train = corpus.parts()[0].split(0);
            assert_eq!(train, 0..32);
            let mut sampler = corpus.train_sampler(7, &DataCursor::default())?;
            let mut alone = BlockSampler::new(train, 7);
            for n in [3, 50, 1] {
                assert_eq!(sampler.next_indices(n), alone.next_indices(n));
            }
            assert_eq!(sampler.cursor(), DataCursor::One(alone.cursor()));
            assert_eq!(sampler.drawn(), [54]);
            for which in [1, 2] {
                let range = corpus.parts()[0].split(which);
                assert_eq!(corpus.eval_batches(which, 3, 4), crate::eval_indices(&range, 3, 4));
            }
        }
        Ok(())
    }

    #[test]
    fn a_blend_draws_each_corpus_at_its_weight_from_its_own_train_split() -> Result<()> {
        // 0.25 and 0.75 of 100 and 20 blocks (train 0..80 and 100..116).
        let corpus = blend(&[(Some(1.0), 100), (Some(3.0), 20)], [0.8, 0.1, 0.1])?;
        let trains: Vec<Range<usize>> = corpus.parts().iter().map(|p| p.split(0)).collect();
        assert_eq!(trains, [0..80, 100..116]);
        let mut sampler = corpus.train_sampler(3, &DataCursor::default())?;
        let drawn = sampler.next_indices(400);
        let from: Vec<usize> = drawn.iter().map(|&b| trains.iter().position(|t| t.contains(&b)).unwrap()).collect();
        assert_eq!(sampler.drawn(), [100, 300]);
        assert_eq!(from.iter().filter(|&&c| c == 0).count(), 100, "a quarter from the first corpus");
        // Megatron's order of corpora: the same as blend_choice on these weights.
        let mut counts = [0u64; 2];
        for (sample, &c) in from.iter().enumerate() {
            assert_eq!(c, blend_choice(&[0.25, 0.75], &counts, sample as u64));
            counts[c] += 1;
        }
        // Each corpus's blocks come in its own epochs: the second one's 16 blocks 18 times over,
        // the first's 80 once and 20 more; each epoch a permutation.
        let second: Vec<usize> = drawn.iter().copied().filter(|b| trains[1].contains(b)).collect();
        for epoch in second.chunks(16).take(18) {
            let mut sorted = epoch.to_vec();
            sorted.sort_unstable();
            assert_eq!(sorted, trains[1].clone().collect::<Vec<_>>());
        }
        let first: Vec<usize> = drawn.iter().copied().filter(|b| trains[0].contains(b)).collect();
        assert_eq!(first[..80], crate::pretrain::epoch_order_of(&trains[0], 3, 0, 0)[..]);
        assert_eq!(second[..16], crate::pretrain::epoch_order_of(&trains[1], 3, 0, 1)[..]);
        // 100 + 20 blocks of 2 tokens, from 201 + 41 tokens.
        assert_eq!((corpus.num_blocks(), corpus.num_tokens(), corpus.seq_length()), (120, 242, 2));
        // Blocks read across corpora: block 100 is the second corpus's block 0.
        assert_eq!(corpus.block(100)?.as_ref(), [0, 1, 2]);
        assert_eq!(corpus.block(99)?.as_ref(), [198, 199, 200]);
        Ok(())
    }

    #[test]
    #[should_panic(expected = "index 30 out of range, the blend has 30 blocks")]
    fn a_block_past_the_blend_panics_naming_the_blend() {
        let _ = blend(&[(None, 10), (None, 20)], [1.0, 0.0, 0.0]).unwrap().block(30);
    }

    #[test]
    fn corpora_alone_are_weighted_by_their_blocks_in_each_split() -> Result<()> {
        let corpus = blend(&[(None, 30), (None, 10)], [0.8, 0.2, 0.0])?;
        assert_eq!(corpus.split_weights(0), (vec![0, 1], vec![24.0 / 32.0, 8.0 / 32.0]));
        assert_eq!(corpus.split_weights(1), (vec![0, 1], vec![6.0 / 8.0, 2.0 / 8.0]));
        let mut sampler = corpus.train_sampler(1, &DataCursor::default())?;
        sampler.next_indices(32);
        assert_eq!(sampler.drawn(), [24, 8], "one epoch of each in 32 samples");
        assert!(corpus.eval_batches(2, 3, 2).is_empty(), "no test split");
        Ok(())
    }

    #[test]
    fn a_blend_resumes_exactly_from_its_cursor() -> Result<()> {
        let corpus = blend(&[(Some(0.3), 23), (Some(0.7), 11), (Some(0.2), 7)], [1.0, 0.0, 0.0])?;
        let whole = corpus.train_sampler(42, &DataCursor::default())?.next_indices(300);
        for stop in [0, 1, 2, 7, 55, 299] {
            let mut first = corpus.train_sampler(42, &DataCursor::default())?;
            let mut got = first.next_indices(stop);
            let saved: DataCursor = serde_json::from_str(&serde_json::to_string(&first.cursor())?)?;
            assert!(matches!(&saved, DataCursor::Blend { blend } if blend.len() == 3));
            got.extend(corpus.train_sampler(42, &saved)?.next_indices(300 - stop));
            assert_eq!(got, whole, "resumed after {stop}");
        }
        // A lone corpus's cursor is the plain form older checkpoints hold.
        let lone = blend(&[(None, 9)], [1.0, 0.0, 0.0])?;
        let old: DataCursor = serde_json::from_str(r#"{"epoch": 2, "position": 4, "blocks": 9}"#)?;
        let mut resumed = lone.train_sampler(5, &old)?;
        let mut alone = BlockSampler::new(0..9, 5);
        alone.next_indices(22);
        assert_eq!(resumed.next_indices(10), alone.next_indices(10));
        // Another number of corpora, or of blocks in one of them, is refused.
        let two = blend(&[(Some(0.3), 23), (Some(0.7), 11)], [1.0, 0.0, 0.0])?;
        let mut three = corpus.train_sampler(42, &DataCursor::default())?;
        three.next_indices(5);
        let e = two.train_sampler(42, &three.cursor()).expect_err("3 corpora saved").to_string();
        assert!(e.contains("from 3 corpora and the data flags now give 2 corpora"), "{e}");
        let e = two.train_sampler(42, &old).expect_err("1 corpus saved").to_string();
        assert!(e.contains("from 1 corpus and the data flags now give 2 corpora"), "{e}");
        let bigger = blend(&[(Some(0.3), 24), (Some(0.7), 11), (Some(0.2), 7)], [1.0, 0.0, 0.0])?;
        let e = bigger.train_sampler(42, &three.cursor()).expect_err("23 blocks saved").to_string();
        assert!(e.contains("23 blocks") && e.contains("now makes 24"), "{e}");
        Ok(())
    }

    #[test]
    fn evaluation_blends_each_corpus_s_split_in_order() -> Result<()> {
        // Validation: block 8 of the first corpus (0..8 train), block 12 of the second (0..12
        // train; Megatron's rounding), which is the blend's block 22.
        let corpus = blend(&[(Some(0.5), 10), (Some(0.5), 14)], [0.8, 0.1, 0.1])?;
        let valid: Vec<Range<usize>> = corpus.parts().iter().map(|p| p.split(1)).collect();
        assert_eq!(valid, [8..9, 22..23]);
        assert_eq!(corpus.eval_batches(1, 2, 3), [vec![8, 22, 8], vec![22, 8, 22]]);
        assert_eq!(corpus.eval_batches(1, 2, 3), corpus.eval_batches(1, 2, 3), "the same every time");
        Ok(())
    }

    #[test]
    fn a_blend_per_split_serves_each_corpus_whole_in_its_split() -> Result<()> {
        // Train: 0.3/0.7 of corpora 0 and 1; validation: corpora 2 and 3 by size; no test.
        let parts = vec![
            read(0, Some(0.3), 10, Some(0)),
            read(1, Some(0.7), 20, Some(0)),
            read(2, None, 3, Some(1)),
            read(3, None, 1, Some(1)),
        ];
        let corpus = BlendedCorpus::new(parts, &[0.0; 3])?;
        let ranges: Vec<[Range<usize>; 3]> = corpus.parts().iter().map(|p| [0, 1, 2].map(|s| p.split(s))).collect();
        // Each corpus whole in its split; its empty ranges sit at its offset.
        let want = [[0..10, 0..0, 0..0], [10..30, 10..10, 10..10], [30..30, 30..33, 30..30], [33..33, 33..34, 33..33]];
        assert_eq!(ranges, want);
        assert_eq!(corpus.split_weights(0), (vec![0, 1], vec![0.3, 0.7]));
        assert_eq!(corpus.split_weights(1), (vec![2, 3], vec![0.75, 0.25]));
        assert_eq!(corpus.split_weights(2), (vec![], vec![]));
        assert!(corpus.eval_batches(2, 2, 2).is_empty());
        // Validation in Megatron's order of corpora, each in order and cycling.
        assert_eq!(corpus.eval_batches(1, 2, 4), [vec![30, 33, 31, 32], vec![30, 33, 31, 32]]);
        let mut sampler = corpus.train_sampler(9, &DataCursor::default())?;
        assert_eq!(sampler.next_indices(100).iter().filter(|&&b| b < 10).count(), 30);
        assert_eq!(sampler.drawn(), [30, 70]);
        Ok(())
    }

    #[test]
    fn a_lone_train_corpus_beside_its_own_validation_draws_as_alone() -> Result<()> {
        let parts = vec![read(0, None, 12, Some(0)), read(1, None, 5, Some(1)), read(2, None, 4, Some(2))];
        let corpus = BlendedCorpus::new(parts, &[0.0; 3])?;
        let mut sampler = corpus.train_sampler(4, &DataCursor::default())?;
        assert_eq!(sampler.next_indices(30), BlockSampler::new(0..12, 4).next_indices(30));
        assert!(matches!(sampler.cursor(), DataCursor::One(_)));
        assert_eq!(corpus.eval_batches(1, 1, 6), [vec![12, 13, 14, 15, 16, 12]]);
        assert_eq!(corpus.eval_batches(2, 1, 2), [vec![17, 18]]);
        // Without a train corpus, or with a corpus of no block, it is one line naming the flag.
        let e = BlendedCorpus::new(vec![read(0, None, 5, Some(1))], &[0.0; 3]).expect_err("no train").to_string();
        assert!(e.contains("no corpus for the train split"), "{e}");
        let e = BlendedCorpus::new(vec![read(0, None, 5, Some(0)), read(1, None, 0, Some(2))], &[0.0; 3])
            .expect_err("an empty test corpus")
            .to_string();
        assert!(e.starts_with("corpus c1 of --test-data-path: the corpus gives 0 blocks"), "{e}");
        Ok(())
    }

    #[test]
    fn a_corpus_too_small_for_a_split_is_named() {
        let e = blend(&[(Some(0.5), 40), (Some(0.5), 3)], [0.9, 0.05, 0.05]).expect_err("3 blocks").to_string();
        assert!(e.starts_with("corpus c1 of --data-path: --split gives the validation split 0 of the 3 blocks"), "{e}");
        let lone = blend(&[(None, 3)], [0.9, 0.05, 0.05]).expect_err("3 blocks").to_string();
        assert!(lone.starts_with("--split gives the validation split 0"), "{lone}");
    }
}
