//! Data for every training step: the GPT-2 tokenizer, raw pretraining corpora (jsonl / text /
//! parquet), Megatron-style packing into blocks, the `--split` train/valid/test split and the
//! resumable per-epoch block sampler.

pub mod corpus;
pub mod pretrain;
pub mod split;
pub mod tokenizer;

pub use corpus::{read_documents, CorpusFormat, CorpusSource, SHAKESPEARE_JSONL};
pub use pretrain::{eval_indices, tokenize_documents, BlockSampler, PackedCorpus, SamplerCursor};
pub use split::{check_split, parse_split, split_ranges};
pub use tokenizer::{Tokenizer, GPT2_TOKENIZER_JSON};
