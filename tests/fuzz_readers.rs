//! Property-based fuzzing of every reader of untrusted files: dataset rows (jsonl/json), parquet
//! (preference datasets and pretraining corpora), `config.json`, safetensors weights, a
//! checkpoint's `trainer_state.json` and `latest`, a user's `tokenizer.json`, Megatron's
//! `.bin`/`.idx` corpora and the tokenized-data cache. Inputs are valid files mutated
//! by proptest (byte flips, truncation, inserted bytes, splices of two seeds) plus random bytes.
//! Every input must give `Ok` or an error of one line naming the file; no panic. Each reader gets
//! `RLHF_FUZZ_SECS` seconds (default 3) and the test prints how many inputs it tried.

use anyhow::Result;
use candle_core::Device;
use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use std::path::Path;
use std::time::{Duration, Instant};

/// A mutation of one of the seeds: a splice with another seed, byte edits, a truncation and an
/// insertion, each drawn by proptest (so a failure shrinks to a small mutation).
#[derive(Clone, Debug)]
struct Mutation {
    seed: usize,
    splice: Option<(usize, usize, usize)>,
    edits: Vec<(usize, u8)>,
    truncate: Option<usize>,
    insert: Option<(usize, Vec<u8>)>,
    random: Option<Vec<u8>>,
}

fn mutation(seeds: usize) -> impl Strategy<Value = Mutation> {
    (
        0..seeds,
        proptest::option::of((0..seeds, any::<usize>(), any::<usize>())),
        proptest::collection::vec((any::<usize>(), any::<u8>()), 0..6),
        proptest::option::weighted(0.3, any::<usize>()),
        proptest::option::weighted(0.3, (any::<usize>(), proptest::collection::vec(any::<u8>(), 1..12))),
        proptest::option::weighted(0.05, proptest::collection::vec(any::<u8>(), 0..256)),
    )
        .prop_map(|(seed, splice, edits, truncate, insert, random)| Mutation {
            seed,
            splice,
            edits,
            truncate,
            insert,
            random,
        })
}

fn apply(m: &Mutation, seeds: &[Vec<u8>]) -> Vec<u8> {
    if let Some(random) = &m.random {
        return random.clone();
    }
    let mut bytes = seeds[m.seed].clone();
    if let Some((other, at, from)) = m.splice {
        let other = &seeds[other];
        let (at, from) = (at % (bytes.len() + 1), from % (other.len() + 1));
        bytes.truncate(at);
        bytes.extend_from_slice(&other[from..]);
    }
    for &(at, byte) in &m.edits {
        if !bytes.is_empty() {
            let at = at % bytes.len();
            bytes[at] ^= byte.max(1);
        }
    }
    if let Some(len) = m.truncate {
        bytes.truncate(len % (bytes.len() + 1));
    }
    if let Some((at, ins)) = &m.insert {
        let at = at % (bytes.len() + 1);
        bytes.splice(at..at, ins.iter().copied());
    }
    bytes
}

/// Runs `read` on mutations of `seeds` for the time budget; returns the number of inputs tried.
/// Every rejection must be one line, and name `file` (the file a user would have to fix).
fn fuzz(reader: &str, file: &str, seeds: Vec<Vec<u8>>, read: impl Fn(&[u8]) -> Result<()>) -> u64 {
    quiet_contained_panics();
    let budget = std::env::var("RLHF_FUZZ_SECS").ok().and_then(|s| s.parse().ok()).unwrap_or(3.0);
    let deadline = Instant::now() + Duration::from_secs_f64(budget);
    let strategy = mutation(seeds.len());
    let mut tried = 0u64;
    let mut round = 0u32;
    while Instant::now() < deadline {
        // A fixed seed per round: a failure is reproducible from the round number.
        let config = Config { cases: 64, failure_persistence: None, ..Config::default() };
        let mut seed = [7u8; 32];
        seed[..4].copy_from_slice(&round.to_le_bytes());
        let rng = proptest::test_runner::TestRng::from_seed(proptest::test_runner::RngAlgorithm::ChaCha, &seed);
        let mut runner = TestRunner::new_with_rng(config, rng);
        let result = runner.run(&strategy, |m| {
            let bytes = apply(&m, &seeds);
            let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| read(&bytes)));
            match outcome {
                Err(_) => Err(TestCaseError::fail(format!("{reader}: panicked on {} bytes", bytes.len()))),
                Ok(Err(e)) if format!("{e:#}").contains('\n') => {
                    Err(TestCaseError::fail(format!("{reader}: a multi-line error: {e:#}")))
                }
                Ok(Err(e)) if !format!("{e:#}").contains(file) => {
                    Err(TestCaseError::fail(format!("{reader}: the error does not name {file}: {e:#}")))
                }
                Ok(_) => Ok(()),
            }
        });
        if let Err(e) = result {
            panic!("{reader} (round {round}): {e}");
        }
        tried += 64;
        round += 1;
    }
    println!("{reader}: {tried} inputs in {budget} s, no panic, every rejection one line naming {file}");
    tried
}

/// A third-party reader's panic that our reader boundary contains (`data::panics`) is bad input
/// reported as an error, not news: as the binaries' hook does, print nothing for it.
fn quiet_contained_panics() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let default = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if !data::panics::panic_is_contained() {
                default(info)
            }
        }));
    });
}

/// Writes `bytes` as `name` in a fresh directory and runs `read` on the path.
fn as_file(name: &str, bytes: &[u8], read: impl Fn(&Path) -> Result<()>) -> Result<()> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join(name);
    std::fs::write(&path, bytes)?;
    read(&path)
}

fn parquet_bytes(columns: &[&str], rows: &[Vec<&str>]) -> Vec<u8> {
    use parquet::data_type::{ByteArray, ByteArrayType};
    use parquet::file::properties::WriterProperties;
    use parquet::file::writer::SerializedFileWriter;
    let fields: String = columns.iter().map(|c| format!("optional binary {c} (UTF8); ")).collect();
    let schema = parquet::schema::parser::parse_message_type(&format!("message m {{ {fields}}}")).unwrap();
    let mut out = Vec::new();
    let props = std::sync::Arc::new(WriterProperties::builder().build());
    let mut writer = SerializedFileWriter::new(&mut out, std::sync::Arc::new(schema), props).unwrap();
    let mut group = writer.next_row_group().unwrap();
    for c in 0..columns.len() {
        let values: Vec<ByteArray> = rows.iter().map(|r| ByteArray::from(r[c])).collect();
        let defs = vec![1i16; rows.len()];
        let mut col = group.next_column().unwrap().unwrap();
        col.typed::<ByteArrayType>().write_batch(&values, Some(&defs), None).unwrap();
        col.close().unwrap();
    }
    group.close().unwrap();
    writer.close().unwrap();
    out
}

#[test]
fn dataset_rows_jsonl_and_json() {
    let keys = data::ColumnKeys::default();
    let seeds = vec![
        br#"{"prompt": "Q: a?", "chosen": " yes", "rejected": " no"}
{"prompt": "Q: b?", "chosen": " b", "rejected": " c"}"#
            .to_vec(),
        br#"[{"prompt": "x", "chosen": "y", "rejected": "z"}, {"prompt": null, "chosen": 3}]"#.to_vec(),
        data::demo::TRAIN_JSONL[..2000.min(data::demo::TRAIN_JSONL.len())].to_vec(),
    ];
    fuzz("jsonl/json dataset rows", "fuzz.jsonl", seeds, |b| {
        data::rows_from_json_bytes(b, "fuzz.jsonl", &keys).map(|_| ())
    });
}

#[test]
fn parquet_datasets_and_corpora() {
    let keys = data::ColumnKeys::default();
    let seeds = vec![
        parquet_bytes(&["prompt", "chosen", "rejected"], &[vec!["Q1", " yes", " no"], vec!["Q2", " a", " b"]]),
        parquet_bytes(&["text"], &[vec!["To be, or not to be"], vec!["that is the question"]]),
    ];
    let read = |b: &[u8]| {
        as_file("train.parquet", b, |p| {
            let dataset = data::load_raw_dataset(p.to_str().unwrap(), &keys, 0).map(|_| ());
            let corpus = data::read_documents(&data::CorpusSource::File(p.to_path_buf()), "text").map(|_| ());
            dataset.and(corpus)
        })
    };
    // What the fuzzer found, kept as regression cases: a footer that makes the parquet crate
    // panic, and a column name corrupted into holding a newline (a two-line error).
    for (seed, at, byte) in [(1, 16430209418721586738u64, 5u8), (0, 2147266935819836027, 126)] {
        let mut bytes = seeds[seed].clone();
        let at = (at % bytes.len() as u64) as usize;
        bytes[at] ^= byte;
        let err = read(&bytes).expect_err("a corrupt file");
        assert!(!format!("{err:#}").contains('\n'), "{err:#}");
    }
    let tried = fuzz("parquet (datasets and corpora)", "train.parquet", seeds, read);
    assert!(tried > 0);
}

#[test]
fn tokenized_data_cache() {
    let dir = tempfile::tempdir().unwrap();
    let key = serde_json::json!({"phase": 1});
    let path = data::cache::cache_path(dir.path(), "phase1", &key);
    let columns = vec![("train.ids".to_string(), vec![vec![1u32, 2, 3], vec![4]])];
    data::cache::save(&path, &key, &columns, &serde_json::json!({"kept": 2})).unwrap();
    let seeds = vec![std::fs::read(&path).unwrap()];
    fuzz("tokenized-data cache", "", seeds, |b| {
        std::fs::write(&path, b)?;
        // The cache never errors: anything unusable is a miss, rebuilt by the caller.
        let _ = data::cache::load(&path, &key, &["train.ids"]);
        Ok(())
    });
}

fn tiny_config() -> hybrid_engine::Gpt2Config {
    hybrid_engine::Gpt2Config {
        n_layer: 1,
        n_embd: 8,
        n_head: 2,
        n_positions: 8,
        vocab_size: 16,
        ..hybrid_engine::Gpt2Config::tiny()
    }
}

#[test]
fn config_json() {
    let dir = tempfile::tempdir().unwrap();
    let params = hybrid_engine::ParamStore::init(&tiny_config(), 1, &Device::Cpu).unwrap();
    hybrid_engine::checkpoints::resume::save_model_dir(&dir.path().join("m"), &tiny_config(), &params, &|_| Ok(()))
        .unwrap();
    let seeds = vec![std::fs::read(dir.path().join("m/config.json")).unwrap()];
    fuzz("config.json", "config.json", seeds, |b| {
        as_file("config.json", b, |p| hybrid_engine::checkpoints::hf_io::read_config(p).map(|_| ()))
    });
}

#[test]
fn safetensors_weights_in_a_model_directory() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("fuzzed-model");
    let params = hybrid_engine::ParamStore::init(&tiny_config(), 1, &Device::Cpu).unwrap();
    hybrid_engine::checkpoints::resume::save_model_dir(&model, &tiny_config(), &params, &|_| Ok(())).unwrap();
    let weights = model.join("model.safetensors");
    let seeds = vec![std::fs::read(&weights).unwrap()];
    // Errors name the model directory (what the user passed) or the file in it.
    fuzz("safetensors (model.safetensors)", "fuzzed-model", seeds, |b| {
        std::fs::write(&weights, b)?;
        hybrid_engine::checkpoints::hf_io::load_model_dir(&model, &Device::Cpu).map(|_| ())
    });
}

#[test]
fn a_checkpoints_trainer_state() {
    use hybrid_engine::checkpoints::resume::{save_checkpoint, TrainerState, FORMAT_VERSION, TRAINER_STATE};
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("ckpt");
    let params = hybrid_engine::ParamStore::init(&tiny_config(), 1, &Device::Cpu).unwrap();
    let adam = hybrid_engine::training::optim::AdamWConfig::ds_chat(1e-8, 0.0);
    let optimizer = hybrid_engine::training::optim::AdamW::new(adam.clone(), &params).unwrap();
    let state = TrainerState {
        format_version: FORMAT_VERSION,
        iteration: 3,
        consumed_samples: 12,
        data_cursor: serde_json::json!({"epoch": 0, "position": 12}),
        seed: 1,
        run: serde_json::json!({"lr": 1e-3}),
    };
    let saved = save_checkpoint(&root, &tiny_config(), &params, &optimizer, &state, &|_| Ok(())).unwrap();
    let state_file = saved.join(TRAINER_STATE);
    let seeds = [std::fs::read(&state_file).unwrap(), std::fs::read(root.join("latest")).unwrap()];
    fuzz("trainer_state.json", TRAINER_STATE, vec![seeds[0].clone()], |b| {
        std::fs::write(&state_file, b)?;
        hybrid_engine::checkpoints::resume::load_checkpoint(&root, &Device::Cpu).map(|_| ())
    });
    std::fs::write(&state_file, &seeds[0]).unwrap();
    fuzz("the latest pointer", "latest", vec![seeds[1].clone()], |b| {
        std::fs::write(root.join("latest"), b)?;
        hybrid_engine::checkpoints::resume::load_checkpoint(&root, &Device::Cpu).map(|_| ())
    });
    std::fs::write(root.join("latest"), &seeds[1]).unwrap();
    // The optimizer state: its manifest, then a rank's shard, each restored into an optimizer.
    let numels: Vec<usize> = params.vars.iter().map(|v| v.elem_count()).collect();
    let restore = || -> anyhow::Result<()> {
        let ck = hybrid_engine::checkpoints::resume::load_checkpoint(&root, &Device::Cpu)?;
        let mut opt = hybrid_engine::training::optim::AdamW::new(adam.clone(), &params)?;
        ck.optimizer.restore(&mut opt, &params.names, &numels)
    };
    restore().expect("the seeds restore");
    for file in ["optimizer-manifest.json", "optimizer-rank-000-of-001.safetensors"] {
        let path = saved.join(file);
        let seed = std::fs::read(&path).unwrap();
        fuzz(file, file, vec![seed.clone()], |b| {
            std::fs::write(&path, b)?;
            restore()
        });
        std::fs::write(&path, seed).unwrap();
    }
}

/// Megatron's pre-tokenized corpus: its `.idx` mutated beside the `.bin` it indexes (megatron-
/// core's own files, `data/tests/fixtures/megatron`), then every token, sequence and document
/// index read, as pretraining reads them.
#[test]
fn a_megatron_indexed_dataset() {
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("data/tests/fixtures/megatron");
    let dir = tempfile::tempdir().unwrap();
    let prefix = dir.path().join("megatron_corpus");
    std::fs::copy(fixtures.join("corpus_text_document.bin"), prefix.with_extension("bin")).unwrap();
    let seeds: Vec<Vec<u8>> = ["corpus_text_document.idx", "corpus_sentences_int32.idx"]
        .iter()
        .map(|name| std::fs::read(fixtures.join(name)).unwrap())
        .collect();
    let read = |idx: &[u8]| -> Result<()> {
        std::fs::write(prefix.with_extension("idx"), idx)?;
        let dataset = data::IndexedDataset::open(&prefix)?;
        dataset.read(0..dataset.num_tokens(), 50304)?;
        for i in 0..dataset.num_sequences() {
            dataset.sequence(i, 50304)?;
        }
        assert_eq!(dataset.document_indices().len(), dataset.num_documents() + 1);
        Ok(())
    };
    read(&seeds[0]).expect("the seed is a valid dataset");
    fuzz("Megatron .bin/.idx", "megatron_corpus", seeds, read);
}

/// A user's `tokenizer.json` (`--tokenizer`, or one in a model directory): loaded, then used to
/// encode and decode, since a poisoned tokenizer could load and fail only when used.
#[test]
fn a_tokenizer_json() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tokenizer.json");
    // A small byte-level BPE (GPT-2's layout, a handful of merges) and the embedded GPT-2 one's
    // opening (its pre-tokenizer, normalizer and added tokens).
    let small = br#"{"version":"1.0","truncation":null,"padding":null,"added_tokens":[{"id":5,"content":"<|endoftext|>","single_word":false,"lstrip":false,"rstrip":false,"normalized":true,"special":true}],"normalizer":null,"pre_tokenizer":{"type":"ByteLevel","add_prefix_space":false,"trim_offsets":true,"use_regex":true},"post_processor":{"type":"ByteLevel","add_prefix_space":true,"trim_offsets":false,"use_regex":true},"decoder":{"type":"ByteLevel","add_prefix_space":true,"trim_offsets":true,"use_regex":true},"model":{"type":"BPE","dropout":null,"unk_token":null,"continuing_subword_prefix":"","end_of_word_suffix":"","fuse_unk":false,"byte_fallback":false,"vocab":{"a":0,"b":1,"ab":2,"\u0120":3,"\u0120ab":4,"<|endoftext|>":5},"merges":["a b","\u0120 ab"]}}"#;
    let seeds = vec![small.to_vec()];
    std::fs::write(&path, small).unwrap();
    let tok = data::Tokenizer::from_file(&path).expect("the seed is a valid tokenizer");
    assert_eq!(tok.encode("ab ab").unwrap(), vec![2, 4], "and it tokenizes");
    fuzz("tokenizer.json", "tokenizer.json", seeds, |b| {
        std::fs::write(&path, b)?;
        let tok = data::Tokenizer::from_file(&path)?;
        let ids = tok.encode("ab ab<|endoftext|> b")?;
        tok.decode(&ids).map(drop)
    });
}

/// The malformed parquet file the fuzzer found (one byte of the corpus seed's footer changed,
/// which makes the parquet crate panic): through the real binary it is one error line naming the
/// file, exit 2, not an internal error.
#[test]
fn the_malformed_parquet_the_fuzzer_found_is_one_error_line() {
    let mut bytes = parquet_bytes(&["text"], &[vec!["To be, or not to be"], vec!["that is the question"]]);
    let at = (16430209418721586738u64 % bytes.len() as u64) as usize;
    bytes[at] ^= 5;
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("bad.parquet");
    std::fs::write(&bad, &bytes).unwrap();
    let sft = dir.path().join("sft");
    std::os::unix::fs::symlink(env!("CARGO_BIN_EXE_train"), &sft).unwrap();
    let out = std::process::Command::new(&sft)
        .args(["--from-scratch", "--model", "tiny", "--train-iters", "1", "--data-path"])
        .arg(&bad)
        .arg("--output-dir")
        .arg(dir.path().join("out"))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(stderr.starts_with("error:") && stderr.contains("bad.parquet") && stderr.contains("malformed"), "{stderr}");
}
