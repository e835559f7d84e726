//! Data for every training step: the GPT-2 tokenizer; raw pretraining corpora (jsonl / text /
//! parquet, or Megatron's pre-tokenized .bin/.idx) with Megatron-style packing, splits, blends and the resumable block sampler; DS-Chat's
//! preference datasets (named, local, hub), their phase split and phase datasets, batching and
//! the tokenized-data cache; and the embedded demo data with its scorer.

pub mod args;
pub mod arithmetic;
pub mod batch;
pub mod blend;
pub mod cache;
pub mod corpus;
pub mod demo;
pub mod file_splits;
pub mod hub;
pub mod indexed_dataset;
pub mod panics;
pub mod phases;
pub mod pretrain;
pub mod prompts;
pub mod sources;
pub mod split;
pub mod tasks;
pub mod tokenizer;

pub use blend::{parse_blend, read_blend, BlendEntry, BlendPlan, BlendedCorpus, BlendedSampler, DataCursor};
pub use corpus::{read_documents, read_packed_corpus, CorpusFormat, CorpusSource, SHAKESPEARE_JSONL};
pub use indexed_dataset::IndexedDataset;
pub use pretrain::{eval_indices, tokenize_documents, BlockSampler, PackedCorpus, SamplerCursor};
pub use sources::{load_raw_dataset, rows_from_json_bytes, ColumnKeys, PreferenceRow, RawDataset};
pub use split::{check_split, parse_split, split_ranges};
pub use tokenizer::{Tokenizer, GPT2_TOKENIZER_JSON};

/// Names read from a file (columns, fields, file names) joined for an error message, with control
/// characters escaped: a corrupt or crafted file must not break an error into several lines or
/// smuggle terminal escapes.
pub fn printable_list<S: AsRef<str>>(names: &[S]) -> String {
    let printable = |name: &str| -> String {
        name.chars().map(|c| if c.is_control() { c.escape_default().collect() } else { c.to_string() }).collect()
    };
    names.iter().map(|n| printable(n.as_ref())).collect::<Vec<_>>().join(", ")
}
