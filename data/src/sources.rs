//! Raw preference datasets: one `--data-path` value (a local file or directory, one of
//! DS-Chat's dataset names, or a hub dataset id) turned into prompt/chosen/rejected rows with a
//! train and an eval split. Follows DS-Chat `dschat/utils/data/raw_datasets.py` (the per-dataset
//! column mappings, in `sources/rows.rs`, and which split is eval) and `data_utils.py`
//! (`get_raw_dataset`, and the 9:1 train/eval split of train-only datasets). Hub access is in
//! `hub.rs`.
//!
//! Resolution of a spec, in order:
//! 1. an existing path: a `.jsonl`/`.json` (JSON lines or a JSON array of objects) or `.parquet`
//!    file, or a directory of them. In a directory the files are told apart by name (see
//!    `plan_splits`): `train` is train, `test` or `eval`/`valid`/`validation`/`dev` is eval
//!    (DS-Chat's local layout is `train.json` + `eval.json`; hub layouts such as
//!    `data/train-00000-of-00001.parquet` work too). Columns come from `--prompt-key`,
//!    `--chosen-key`, `--rejected-key`, and values are taken verbatim (rm-static's form). A path
//!    that contains a DS-Chat dataset name (`…/stanfordnlp/SHP/`) gets that dataset's mapping
//!    instead, as DS-Chat's substring match does, unless the keys were set;
//! 2. one of DS-Chat's dataset names (`rows::DsChat`), mapped as `raw_datasets.py` maps it and
//!    read from the hub's parquet files, and `local/jsonfile` (DS-Chat's `data/train.json` +
//!    `data/eval.json` under the current directory, with its leading-space mapping);
//! 3. any other `org/name`: a hub dataset read through its parquet files with the column keys;
//! 4. anything else is an error listing what is accepted.
//!
//! A single file, or a source with no eval files, is split 9:1 into train/eval with a seeded
//! shuffle: DS-Chat does this for its train-only datasets (`get_raw_dataset_split_index` with
//! "9,1"); the boundaries follow its arithmetic, the permutation is ChaCha8's, not numpy's.

use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Result};
use rand::{RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::file_splits::{plan_splits, EvalSplit};
use crate::hub::{fetch_dataset, HubAccess};

mod rows;
use rows::{extension, file_rows, json_rows, DsChat, Mapping};

/// One record in DS-Chat's prompt/chosen/rejected form, exactly as the source mapping produced it
/// (prompt already formatted, e.g. "\n\nHuman: ...\n\nAssistant:"; answers with their leading space).
/// A field is None when the source row lacked it; the phase builders skip and count such rows.
#[derive(Clone, Debug, PartialEq)]
pub struct PreferenceRow {
    pub prompt: Option<String>,
    pub chosen: Option<String>,
    pub rejected: Option<String>,
}

/// Column names for local files and generic hub datasets (--prompt-key, --chosen-key, --rejected-key).
#[derive(Clone, Debug, PartialEq, Eq, Hash, serde::Serialize)]
pub struct ColumnKeys {
    pub prompt: String,
    pub chosen: String,
    pub rejected: String,
}

impl Default for ColumnKeys {
    fn default() -> Self {
        Self { prompt: "prompt".into(), chosen: "chosen".into(), rejected: "rejected".into() }
    }
}

/// A dataset's train and eval rows, plus a fingerprint that changes whenever its inputs change
/// (used as part of the tokenized-cache key by the caller).
#[derive(Clone, Debug, PartialEq)]
pub struct RawDataset {
    pub name: String,
    pub train: Vec<PreferenceRow>,
    pub eval: Vec<PreferenceRow>,
    pub fingerprint: String,
}

/// Bumped whenever a mapping or the split changes, so that old tokenized caches are not reused.
const FINGERPRINT_VERSION: &str = "raw-sources-v1";

/// Loads one `--data-path` value: a DS-Chat dataset name, a local file or directory, or a hub dataset id.
pub fn load_raw_dataset(spec: &str, keys: &ColumnKeys, seed: u64) -> Result<RawDataset> {
    load_raw_dataset_in(spec, keys, seed, &HubAccess::from_env())
}

/// Rows of a jsonl (or JSON array) text held in memory, with the given keys; `name` is for errors.
/// (Used by the caller for the embedded demo dataset.)
pub fn rows_from_json_bytes(bytes: &[u8], name: &str, keys: &ColumnKeys) -> Result<Vec<PreferenceRow>> {
    json_rows(bytes, name, &Mapping::Keys(keys.clone()))
}

/// [`load_raw_dataset`] with the hub cache, offline flag and endpoint given rather than read
/// from the environment.
pub(crate) fn load_raw_dataset_in(spec: &str, keys: &ColumnKeys, seed: u64, hub: &HubAccess) -> Result<RawDataset> {
    let path = Path::new(spec);
    if !spec.is_empty() && path.exists() {
        return load_local(spec, keys, seed);
    }
    if let Some(ds) = DsChat::from_name(spec) {
        let mapping = Mapping::DsChat(ds);
        return load_hub(ds.name(), &mapping, ds.eval_split(), seed, hub);
    }
    if spec == LOCAL_JSONFILE {
        return load_dschat_local_jsonfile(Path::new("."), keys);
    }
    if looks_like_hub_id(spec) {
        return load_hub(spec, &Mapping::Keys(keys.clone()), EvalSplit::Auto, seed, hub);
    }
    let names: Vec<&str> = DsChat::ALL.iter().map(|d| d.name()).collect();
    bail!(
        "data path {spec:?} is not an existing file or directory nor a known dataset; pass one of \
         DS-Chat's datasets ({}, {LOCAL_JSONFILE}), a local .jsonl/.json/.parquet file or directory, \
         or a hub dataset id such as org/name",
        names.join(", ")
    )
}

/// DS-Chat's `get_raw_dataset_split_index(..., "9,1", ...)`: boundaries `round(0.9 n)` and
/// `round(0.1 n)` shifted to end at n; train takes the first share of a seeded permutation, eval
/// the rest, both in permutation order. Deviation: the permutation is a ChaCha8 Fisher-Yates,
/// not numpy's `RandomState(seed).shuffle`, so the same seed picks different rows than DS-Chat.
fn split_nine_to_one(rows: Vec<PreferenceRow>, seed: u64) -> (Vec<PreferenceRow>, Vec<PreferenceRow>) {
    let n = rows.len();
    let [train_range, _, _] = crate::split::split_ranges(n, &[0.9, 0.1, 0.0]);
    let mut key = [0u8; 32];
    key[..8].copy_from_slice(&seed.to_le_bytes());
    key[8..16].copy_from_slice(b"train9:1"); // a stream of its own, apart from the epoch shuffles
    let mut rng = ChaCha8Rng::from_seed(key);
    let mut order: Vec<usize> = (0..n).collect();
    for i in (1..n).rev() {
        // Uniform in 0..=i by multiply-shift; the bias is below (i + 1) / 2^64.
        let j = ((u128::from(rng.next_u64()) * (i as u128 + 1)) >> 64) as usize;
        order.swap(i, j);
    }
    let mut slots: Vec<Option<PreferenceRow>> = rows.into_iter().map(Some).collect();
    let mut take = |idx: &[usize]| idx.iter().filter_map(|&i| slots[i].take()).collect::<Vec<_>>();
    let train = take(&order[train_range.clone()]);
    let eval = take(&order[train_range.end..]);
    (train, eval)
}

// ---------------------------------------------------------------------------------------------
// The three kinds of source.

/// A local file or directory.
fn load_local(spec: &str, keys: &ColumnKeys, seed: u64) -> Result<RawDataset> {
    let path = Path::new(spec);
    // A path naming one of DS-Chat's datasets keeps that dataset's mapping, as DS-Chat's
    // substring match does, unless the column keys were set explicitly.
    let ds = DsChat::in_path(spec).filter(|_| *keys == ColumnKeys::default());
    let mapping = ds.map_or_else(|| Mapping::Keys(keys.clone()), Mapping::DsChat);
    let (train_files, eval_files) = if path.is_dir() {
        let mut files = Vec::new();
        list_data_files(path, "", 0, &mut files);
        let plan =
            plan_splits(&files, ds.map_or(EvalSplit::Auto, DsChat::eval_split)).map_err(|m| anyhow!("{spec} {m}"))?;
        let local = |files: &[String]| files.iter().map(|f| path.join(f)).collect::<Vec<_>>();
        (local(&plan.train), plan.eval.as_deref().map(local))
    } else {
        (vec![path.to_path_buf()], None)
    };
    let mut parts = vec![format!("local:{}", mapping.describe())];
    let mut read = |files: &[PathBuf], split: &str| -> Result<Vec<PreferenceRow>> {
        let mut rows = Vec::new();
        for file in files {
            parts.push(format!("{split}:{}", file_identity(file)?));
            rows.extend(file_rows(file, &mapping)?);
        }
        Ok(rows)
    };
    let train = read(&train_files, "train")?;
    let eval = eval_files.as_deref().map(|f| read(f, "eval")).transpose()?;
    finish(spec.to_string(), train, eval, seed, parts)
}

/// Data files under `dir` (relative, `/`-separated, sorted), a few levels deep, skipping hidden
/// entries and the metadata JSON of `datasets.save_to_disk`.
fn list_data_files(dir: &Path, prefix: &str, depth: usize, out: &mut Vec<String>) {
    const METADATA: [&str; 4] = ["dataset_info.json", "dataset_infos.json", "dataset_dict.json", "state.json"];
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    let mut entries: Vec<_> = entries.flatten().collect();
    entries.sort_by_key(|e| e.file_name());
    for entry in entries {
        let Some(name) = entry.file_name().to_str().map(str::to_owned) else { continue };
        if name.starts_with('.') || METADATA.contains(&name.as_str()) {
            continue;
        }
        let rel = format!("{prefix}{name}");
        let Ok(meta) = std::fs::metadata(entry.path()) else { continue };
        if meta.is_dir() && depth < 4 {
            list_data_files(&entry.path(), &format!("{rel}/"), depth + 1, out);
        } else if meta.is_file() && matches!(extension(Path::new(&name)).as_deref(), Some("jsonl" | "json" | "parquet"))
        {
            out.push(rel);
        }
    }
}

/// Canonical path, size and modification time: a changed file changes the fingerprint.
fn file_identity(path: &Path) -> Result<String> {
    let canonical = path
        .canonicalize()
        .map_err(|e| anyhow!("cannot open {} ({e}); pass an existing, readable file", path.display()))?;
    let meta = std::fs::metadata(&canonical).map_err(|e| anyhow!("cannot stat {} ({e})", canonical.display()))?;
    let mtime = meta.modified().ok().and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok()).unwrap_or_default();
    Ok(format!("{}|{}|{}", canonical.display(), meta.len(), mtime.as_nanos()))
}

/// The spec naming DS-Chat's local dataset (read from the current directory).
const LOCAL_JSONFILE: &str = "local/jsonfile";

/// DS-Chat's `local/jsonfile`: `data/train.json` and `data/eval.json` under `root`, with a space
/// put before the prompt and before each answer as its `LocalJsonFileDataset` does.
fn load_dschat_local_jsonfile(root: &Path, keys: &ColumnKeys) -> Result<RawDataset> {
    let mapping = Mapping::LocalJsonfile(keys.clone());
    let mut parts = vec![format!("local:{}", mapping.describe())];
    let mut read = |file: &str| -> Result<Vec<PreferenceRow>> {
        let path = root.join(file);
        let path = path.as_path();
        if !path.is_file() {
            bail!(
                "{LOCAL_JSONFILE} reads data/train.json and data/eval.json under the current \
                 directory, and {file} is missing; create it, or pass your files' path instead"
            );
        }
        parts.push(file_identity(path)?);
        file_rows(path, &mapping)
    };
    let train = read("data/train.json")?;
    let eval = read("data/eval.json")?;
    finish(LOCAL_JSONFILE.to_string(), train, Some(eval), 0, parts)
}

/// A hub dataset through its parquet files.
fn load_hub(id: &str, mapping: &Mapping, eval: EvalSplit, seed: u64, hub: &HubAccess) -> Result<RawDataset> {
    let snapshot = fetch_dataset(id, None, hub, &|files| plan_splits(files, eval))?;
    let read = |files: &[PathBuf]| -> Result<Vec<PreferenceRow>> {
        let mut rows = Vec::new();
        for file in files {
            rows.extend(file_rows(file, mapping)?);
        }
        Ok(rows)
    };
    let train = read(&snapshot.train)?;
    let eval = snapshot.eval.as_deref().map(read).transpose()?;
    let mut parts = vec![format!("hub:{id}@{}:{}", snapshot.revision, snapshot.commit), mapping.describe()];
    parts.extend(snapshot.files);
    finish(id.to_string(), train, eval, seed, parts)
}

/// Applies the 9:1 split when there is no eval data and seals the fingerprint.
fn finish(
    name: String,
    train: Vec<PreferenceRow>,
    eval: Option<Vec<PreferenceRow>>,
    seed: u64,
    mut parts: Vec<String>,
) -> Result<RawDataset> {
    if train.is_empty() {
        bail!("dataset {name} has no training rows; pass a dataset with data in its train split");
    }
    let (train, eval) = match eval {
        Some(eval) => (train, eval),
        None => {
            parts.push(format!("split 9:1 seed {seed}"));
            split_nine_to_one(train, seed)
        }
    };
    Ok(RawDataset { name, train, eval, fingerprint: fingerprint(&parts) })
}

/// 128-bit FNV-1a of the parts (with the format version), as 32 hex digits: stable across
/// builds and platforms, unlike `std`'s hashers.
fn fingerprint(parts: &[String]) -> String {
    let mut hash: u128 = 0x6c62272e07bb014262b821756295c58d;
    for part in std::iter::once(FINGERPRINT_VERSION).chain(parts.iter().map(String::as_str)) {
        for byte in part.bytes().chain([0xff]) {
            hash ^= u128::from(byte);
            hash = hash.wrapping_mul(0x0000000001000000000000000000013b);
        }
    }
    format!("{hash:032x}")
}

/// `org/name` with the characters the hub allows.
pub(crate) fn looks_like_hub_id(spec: &str) -> bool {
    let part_ok = |p: &str| {
        !p.is_empty()
            && !p.starts_with(['.', '-'])
            && !p.ends_with('.')
            && !p.contains("..")
            && p.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
    };
    matches!(spec.split_once('/'), Some((org, name)) if part_ok(org) && part_ok(name))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Dataset names crafted to escape the hub cache are not hub ids (and so never reach it).
    #[test]
    fn dataset_names_crafted_to_escape_are_not_hub_ids() {
        for ok in ["Dahoas/rm-static", "org/name.v2", "stanfordnlp/SHP"] {
            assert!(looks_like_hub_id(ok), "{ok}");
        }
        for bad in
            ["../x", "org/..", "org/../../x", "/etc/passwd", "../../etc/passwd", "org/.x", "-o/x", "a/b/c", "org/"]
        {
            assert!(!looks_like_hub_id(bad), "{bad}");
        }
    }
    use parquet::data_type::{ByteArray, ByteArrayType, DoubleType};
    use parquet::file::properties::WriterProperties;
    use parquet::file::writer::SerializedFileWriter;
    use parquet::schema::parser::parse_message_type;
    use serde_json::{json, Value};
    use std::fs::File;
    use std::sync::Arc;

    fn row(prompt: &str, chosen: &str, rejected: &str) -> PreferenceRow {
        PreferenceRow { prompt: Some(prompt.into()), chosen: Some(chosen.into()), rejected: Some(rejected.into()) }
    }

    fn keys() -> ColumnKeys {
        ColumnKeys::default()
    }

    /// A hub access that never touches the network or the environment.
    fn offline(cache: &Path) -> HubAccess {
        HubAccess { cache: hf_hub::Cache::new(cache.to_path_buf()), offline: true, endpoint: None, progress: false }
    }

    fn load(spec: &Path, keys: &ColumnKeys, seed: u64) -> Result<RawDataset> {
        let spec = spec.to_str().ok_or_else(|| anyhow!("non-UTF-8 temp path"))?;
        load_raw_dataset_in(spec, keys, seed, &offline(Path::new("/nonexistent-hf-cache")))
    }

    fn err_of(result: Result<RawDataset>) -> String {
        match result {
            Ok(ds) => panic!("expected an error, got {} train rows", ds.train.len()),
            Err(e) => e.to_string(),
        }
    }

    fn jsonl(rows: &[Value]) -> String {
        rows.iter().map(|r| format!("{r}\n")).collect()
    }

    /// Nullable UTF8 columns `columns`, one `rows` entry per row (`None` writes a null).
    fn write_text_parquet(path: &Path, columns: &[&str], rows: &[Vec<Option<&str>>]) -> Result<()> {
        let fields: String = columns.iter().map(|c| format!("optional binary {c} (UTF8); ")).collect();
        let schema = parse_message_type(&format!("message m {{ {fields}}}"))?;
        let props = Arc::new(WriterProperties::builder().build());
        let mut writer = SerializedFileWriter::new(File::create(path)?, Arc::new(schema), props)?;
        let mut group = writer.next_row_group()?;
        for c in 0..columns.len() {
            let cells: Vec<Option<&str>> = rows.iter().map(|r| r[c]).collect();
            let values: Vec<ByteArray> = cells.iter().flatten().map(|t| ByteArray::from(*t)).collect();
            let defs: Vec<i16> = cells.iter().map(|t| i16::from(t.is_some())).collect();
            let mut col = group.next_column()?.ok_or_else(|| anyhow!("missing column {c}"))?;
            col.typed::<ByteArrayType>().write_batch(&values, Some(&defs), None)?;
            col.close()?;
        }
        group.close()?;
        writer.close()?;
        Ok(())
    }

    /// webgpt_comparisons' shape: `question` is a struct holding `full_text`; scores are doubles.
    /// Each entry: (question, answer_0, answer_1, score_0, score_1).
    fn write_webgpt_parquet(path: &Path, rows: &[(&str, &str, &str, f64, f64)]) -> Result<()> {
        let schema = parse_message_type(
            "message webgpt {
                optional group question { optional binary full_text (UTF8); }
                optional binary answer_0 (UTF8);
                optional binary answer_1 (UTF8);
                optional double score_0;
                optional double score_1;
            }",
        )?;
        let props = Arc::new(WriterProperties::builder().build());
        let mut writer = SerializedFileWriter::new(File::create(path)?, Arc::new(schema), props)?;
        let mut group = writer.next_row_group()?;
        let texts: [Vec<&str>; 3] = [
            rows.iter().map(|r| r.0).collect(),
            rows.iter().map(|r| r.1).collect(),
            rows.iter().map(|r| r.2).collect(),
        ];
        // question.full_text sits under an optional group: definition level 2 means present.
        for (texts, def) in texts.iter().zip([2i16, 1, 1]) {
            let values: Vec<ByteArray> = texts.iter().map(|t| ByteArray::from(*t)).collect();
            let mut col = group.next_column()?.ok_or_else(|| anyhow!("missing text column"))?;
            col.typed::<ByteArrayType>().write_batch(&values, Some(&vec![def; rows.len()]), None)?;
            col.close()?;
        }
        for scores in [rows.iter().map(|r| r.3).collect::<Vec<_>>(), rows.iter().map(|r| r.4).collect()] {
            let mut col = group.next_column()?.ok_or_else(|| anyhow!("missing score column"))?;
            col.typed::<DoubleType>().write_batch(&scores, Some(&vec![1; rows.len()]), None)?;
            col.close()?;
        }
        group.close()?;
        writer.close()?;
        Ok(())
    }

    /// A dataset in the hub cache exactly as hf-hub lays it out.
    fn hub_snapshot(cache: &Path, id: &str, commit: &str) -> Result<PathBuf> {
        let repo = cache.join(format!("datasets--{}", id.replace('/', "--")));
        std::fs::create_dir_all(repo.join("refs"))?;
        std::fs::write(repo.join("refs/main"), commit)?;
        let snapshot = repo.join("snapshots").join(commit);
        std::fs::create_dir_all(snapshot.join("data"))?;
        Ok(snapshot)
    }

    // --- DS-Chat mappings -------------------------------------------------------------------

    #[test]
    fn ds_chat_names_need_their_org_prefix_and_paths_match_by_substring() {
        assert_eq!(DsChat::from_name("Dahoas/rm-static"), Some(DsChat::RmStatic));
        assert_eq!(DsChat::from_name("stanfordnlp/SHP"), Some(DsChat::StanfordnlpShp));
        assert_eq!(DsChat::from_name("rm-static"), None);
        assert_eq!(
            DsChat::in_path("/data/openai/webgpt_comparisons/train.jsonl"),
            Some(DsChat::OpenaiWebgptComparisons)
        );
        assert!(looks_like_hub_id("Anthropic/hh-rlhf") && looks_like_hub_id("org_1/name.v2"));
        for bad in ["rm-static", "a/b/c", "/abs", "./x/y", "../a", "org/", "org/..", "o rg/x"] {
            assert!(!looks_like_hub_id(bad), "{bad}");
        }
    }

    // --- Hub datasets through a fake hf-hub cache ------------------------------------------

    #[test]
    fn rm_static_is_read_from_the_hub_cache_offline() -> Result<()> {
        let cache = tempfile::tempdir()?;
        let snapshot = hub_snapshot(cache.path(), "Dahoas/rm-static", "0123abcd")?;
        let columns = ["prompt", "response", "chosen", "rejected"];
        write_text_parquet(
            &snapshot.join("data/train-00000-of-00001-2a1df75c6bce91ab.parquet"),
            &columns,
            &[
                vec![Some("\n\nHuman: A?\n\nAssistant:"), Some(" a"), Some(" yes"), Some(" no")],
                vec![Some("\n\nHuman: B?\n\nAssistant:"), Some(" b"), Some(" sure"), None],
            ],
        )?;
        write_text_parquet(
            &snapshot.join("data/test-00000-of-00001-8c7c51afc6d45980.parquet"),
            &columns,
            &[vec![Some("\n\nHuman: C?\n\nAssistant:"), Some(" c"), Some(" ok"), Some(" bad")]],
        )?;
        let ds = load_raw_dataset_in("Dahoas/rm-static", &keys(), 7, &offline(cache.path()))?;
        assert_eq!(ds.name, "Dahoas/rm-static");
        assert_eq!(
            ds.train,
            vec![
                row("\n\nHuman: A?\n\nAssistant:", " yes", " no"),
                PreferenceRow {
                    prompt: Some("\n\nHuman: B?\n\nAssistant:".into()),
                    chosen: Some(" sure".into()),
                    rejected: None
                },
            ]
        );
        assert_eq!(ds.eval, vec![row("\n\nHuman: C?\n\nAssistant:", " ok", " bad")]);

        // The same files under another commit are another dataset version: a new fingerprint.
        let again = load_raw_dataset_in("Dahoas/rm-static", &keys(), 7, &offline(cache.path()))?;
        assert_eq!(again.fingerprint, ds.fingerprint);
        let repo = cache.path().join("datasets--Dahoas--rm-static");
        std::fs::rename(repo.join("snapshots/0123abcd"), repo.join("snapshots/4567ef01"))?;
        std::fs::write(repo.join("refs/main"), "4567ef01")?;
        let moved = load_raw_dataset_in("Dahoas/rm-static", &keys(), 7, &offline(cache.path()))?;
        assert_eq!((moved.train.len(), moved.eval.len()), (2, 1));
        assert_ne!(moved.fingerprint, ds.fingerprint);
        Ok(())
    }

    #[test]
    fn hub_dataset_missing_offline_names_the_dataset_cache_and_fix() -> Result<()> {
        let cache = tempfile::tempdir()?;
        let err = err_of(load_raw_dataset_in("Dahoas/full-hh-rlhf", &keys(), 0, &offline(cache.path())));
        assert!(err.contains("hub dataset Dahoas/full-hh-rlhf is not in the Hugging Face cache"), "{err}");
        assert!(err.contains(&cache.path().display().to_string()), "{err}");
        assert!(err.contains("HF_HUB_OFFLINE is set: run once online"), "{err}");
        assert!(err.contains("pass a local directory or file"), "{err}");

        // rm-static without its test split in the cache is incomplete, not a 9:1 split.
        let snapshot = hub_snapshot(cache.path(), "Dahoas/rm-static", "abc")?;
        write_text_parquet(&snapshot.join("data/train-00000-of-00001-x.parquet"), &["prompt"], &[vec![Some("p")]])?;
        let err = err_of(load_raw_dataset_in("Dahoas/rm-static", &keys(), 0, &offline(cache.path())));
        assert!(err.contains("only partly in the Hugging Face cache"), "{err}");
        assert!(err.contains("has no test files"), "{err}");
        Ok(())
    }

    #[test]
    fn webgpt_from_the_hub_cache_reads_the_nested_question_and_splits_9_to_1() -> Result<()> {
        let cache = tempfile::tempdir()?;
        let snapshot = hub_snapshot(cache.path(), "openai/webgpt_comparisons", "feed")?;
        let questions: Vec<String> = (0..20).map(|i| format!("Question {i}?")).collect();
        let rows: Vec<(&str, &str, &str, f64, f64)> = questions
            .iter()
            .enumerate()
            .map(|(i, q)| (q.as_str(), "Good [1].", "Bad (2).", if i & 1 == 0 { 1.0 } else { -1.0 }, 0.0))
            .collect();
        write_webgpt_parquet(&snapshot.join("data/train-00000-of-00001-w.parquet"), &rows)?;
        let ds = load_raw_dataset_in("openai/webgpt_comparisons", &keys(), 3, &offline(cache.path()))?;
        assert_eq!((ds.train.len(), ds.eval.len()), (18, 2));
        let mut prompts: Vec<String> = ds.train.iter().chain(&ds.eval).filter_map(|r| r.prompt.clone()).collect();
        prompts.sort();
        let mut want: Vec<String> = questions.iter().map(|q| format!(" Human: {q} Assistant:")).collect();
        want.sort();
        assert_eq!(prompts, want);
        for r in ds.train.iter().chain(&ds.eval) {
            let prompt = r.prompt.as_deref().unwrap_or_default();
            let index: usize =
                prompt.trim_start_matches(" Human: Question ").trim_end_matches("? Assistant:").parse()?;
            let (chosen, rejected) = if index & 1 == 0 { (" Good.", " Bad.") } else { (" Bad.", " Good.") };
            assert_eq!((r.chosen.as_deref(), r.rejected.as_deref()), (Some(chosen), Some(rejected)), "{prompt}");
        }
        Ok(())
    }

    // --- Local files ------------------------------------------------------------------------

    #[test]
    fn local_directory_reads_train_and_eval_files() -> Result<()> {
        let dir = tempfile::tempdir()?;
        let train =
            [json!({"prompt": "P1", "chosen": " c1", "rejected": " r1"}), json!({"prompt": "P2", "chosen": " c2"})];
        std::fs::write(dir.path().join("train.jsonl"), jsonl(&train))?;
        std::fs::write(
            dir.path().join("eval.jsonl"),
            jsonl(&[json!({"prompt": "P3", "chosen": " c3", "rejected": " r3"})]),
        )?;
        std::fs::write(dir.path().join("README.md"), "not data")?;
        let ds = load(dir.path(), &keys(), 0)?;
        assert_eq!(
            ds.train,
            vec![
                row("P1", " c1", " r1"),
                PreferenceRow { prompt: Some("P2".into()), chosen: Some(" c2".into()), rejected: None }
            ]
        );
        assert_eq!(ds.eval, vec![row("P3", " c3", " r3")]);

        // Editing a file changes the fingerprint.
        let before = ds.fingerprint;
        std::fs::write(dir.path().join("eval.jsonl"), jsonl(&[json!({"prompt": "P3 longer", "chosen": " c3"})]))?;
        assert_ne!(load(dir.path(), &keys(), 0)?.fingerprint, before);
        Ok(())
    }

    #[test]
    fn hub_layout_directory_with_data_subfolder_reads_parquet() -> Result<()> {
        let dir = tempfile::tempdir()?;
        std::fs::create_dir(dir.path().join("data"))?;
        let cols = ["prompt", "chosen", "rejected"];
        write_text_parquet(
            &dir.path().join("data/train-00000-of-00001.parquet"),
            &cols,
            &[vec![Some("P"), Some(" c"), Some(" r")]],
        )?;
        write_text_parquet(
            &dir.path().join("data/test-00000-of-00001.parquet"),
            &cols,
            &[vec![Some("T"), Some(" x"), Some(" y")]],
        )?;
        let ds = load(dir.path(), &keys(), 0)?;
        assert_eq!((ds.train, ds.eval), (vec![row("P", " c", " r")], vec![row("T", " x", " y")]));
        Ok(())
    }

    #[test]
    fn data_files_are_listed_four_levels_deep_without_hidden_or_metadata_files() -> Result<()> {
        let dir = tempfile::tempdir()?;
        let files = [
            "a.jsonl",
            "b.JSON",
            ".hidden.jsonl",
            "dataset_info.json",
            "dataset_dict.json",
            "state.json",
            "notes.txt",
            ".cache/c.jsonl",
            "train/d.parquet",
            "train/dataset_infos.json",
            "1/2/3/4/deep.json",
            "1/2/3/4/5/too_deep.json",
        ];
        for f in files {
            let path = dir.path().join(f);
            std::fs::create_dir_all(path.parent().expect("a parent"))?;
            std::fs::write(path, "[]")?;
        }
        let mut listed = Vec::new();
        list_data_files(dir.path(), "", 0, &mut listed);
        assert_eq!(listed, ["1/2/3/4/deep.json", "a.jsonl", "b.JSON", "train/d.parquet"]);
        Ok(())
    }

    #[test]
    fn the_9_to_1_shuffle_draws_every_order_about_equally_often() {
        // Three rows all go to train (round(2.7) = 3), in the shuffle's order: over 600 seeds each
        // of the 6 orders should come about 100 times (a standard deviation of about 9).
        let rows: Vec<PreferenceRow> = (0..3).map(|i| row(&format!("p{i}"), " c", " r")).collect();
        let mut counts: std::collections::BTreeMap<Vec<String>, usize> = Default::default();
        for seed in 0..600 {
            let (train, eval) = split_nine_to_one(rows.clone(), seed);
            assert!(eval.is_empty());
            *counts.entry(train.into_iter().filter_map(|r| r.prompt).collect()).or_default() += 1;
        }
        assert_eq!(counts.len(), 6, "{counts:?}");
        assert!(counts.values().all(|&n| (60..=140).contains(&n)), "{counts:?}");
    }

    #[test]
    fn fingerprints_are_fnv1a_128_over_the_version_and_each_part() {
        // Computed by a separate implementation of FNV-1a 128 (offset basis and prime from the
        // FNV specification) over "raw-sources-v1", then each part, each followed by 0xff. They
        // name the users' cache files: changing them must come with a new FINGERPRINT_VERSION.
        assert_eq!(fingerprint(&[]), "c501cf5e32ad08113052f9244fa4cbf9");
        let parts = ["local:a.jsonl".to_string(), "split 9:1 seed 1".to_string()];
        assert_eq!(fingerprint(&parts), "fc7b9f8735a2f29b40bdc297c7be8907");
    }

    #[test]
    fn a_parquet_value_that_is_not_text_names_its_row() -> Result<()> {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("scores.parquet");
        write_webgpt_parquet(&path, &[("Q", " a", " b", 1.0, 0.0), ("R", " c", " d", 0.0, 1.0)])?;
        let numbers_as_prompts =
            ColumnKeys { prompt: "score_0".into(), chosen: "answer_0".into(), rejected: "answer_1".into() };
        let e = format!("{:#}", load(&path, &numbers_as_prompts, 0).unwrap_err());
        assert!(e.contains("scores.parquet row 1: ") && e.contains("--prompt-key"), "{e}");
        Ok(())
    }

    #[test]
    fn single_file_splits_9_to_1_deterministically_by_seed() -> Result<()> {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("pairs.jsonl");
        let records: Vec<Value> =
            (0..50).map(|i| json!({"prompt": format!("p{i}"), "chosen": " c", "rejected": " r"})).collect();
        std::fs::write(&path, jsonl(&records))?;
        let a = load(&path, &keys(), 1)?;
        let b = load(&path, &keys(), 1)?;
        let c = load(&path, &keys(), 2)?;
        assert_eq!((a.train.len(), a.eval.len()), (45, 5));
        assert_eq!((&a.train, &a.eval), (&b.train, &b.eval));
        assert_eq!(a.fingerprint, b.fingerprint);
        assert_ne!(a.train, c.train, "another seed should shuffle differently");
        assert_ne!(a.fingerprint, c.fingerprint, "the split depends on the seed");
        for ds in [&a, &c] {
            let mut prompts: Vec<String> = ds.train.iter().chain(&ds.eval).filter_map(|r| r.prompt.clone()).collect();
            prompts.sort();
            let mut want: Vec<String> = (0..50).map(|i| format!("p{i}")).collect();
            want.sort();
            assert_eq!(prompts, want, "every row exactly once");
        }
        Ok(())
    }

    #[test]
    fn json_array_file_and_custom_keys() -> Result<()> {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("pairs.json");
        let records: Vec<Value> = (0..10)
            .map(|i| json!({"question": format!("q{i}"), "good": " g", "bad": " b", "prompt": "ignored"}))
            .collect();
        std::fs::write(&path, serde_json::to_string_pretty(&records)?)?;
        let custom = ColumnKeys { prompt: "question".into(), chosen: "good".into(), rejected: "bad".into() };
        let ds = load(&path, &custom, 0)?;
        assert_eq!((ds.train.len(), ds.eval.len()), (9, 1));
        assert!(ds.train.iter().chain(&ds.eval).all(|r| r.prompt.as_deref().is_some_and(|p| p.starts_with('q'))));
        assert!(ds.train.iter().all(|r| r.chosen.as_deref() == Some(" g") && r.rejected.as_deref() == Some(" b")));
        // Other keys give another fingerprint even on the same file.
        let other = ColumnKeys { prompt: "prompt".into(), ..custom };
        assert_ne!(load(&path, &other, 0)?.fingerprint, ds.fingerprint);
        Ok(())
    }

    #[test]
    fn malformed_line_error_names_file_and_line_number() -> Result<()> {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("bad.jsonl");
        std::fs::write(&path, "{\"prompt\": \"a\", \"chosen\": \" b\"}\n\n{\"prompt\": oops}\n")?;
        let err = err_of(load(&path, &keys(), 0));
        assert!(err.contains("bad.jsonl line 3: invalid JSON ("), "{err}");
        std::fs::write(&path, "{\"prompt\": \"a\"}\n[1, 2]\n")?;
        let err = err_of(load(&path, &keys(), 0));
        assert!(err.contains("bad.jsonl line 2: expected a JSON object"), "{err}");
        Ok(())
    }

    #[test]
    fn file_without_any_key_column_names_columns_and_flags() -> Result<()> {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("qa.jsonl");
        std::fs::write(&path, jsonl(&[json!({"question": "q", "answer": "a"})]))?;
        let err = err_of(load(&path, &keys(), 0));
        assert!(err.contains("qa.jsonl has none of the columns \"prompt\", \"chosen\", \"rejected\""), "{err}");
        assert!(err.contains("(columns: answer, question)") && err.contains("--prompt-key"), "{err}");

        let path = dir.path().join("qa.parquet");
        write_text_parquet(&path, &["question", "answer"], &[vec![Some("q"), Some("a")]])?;
        let err = err_of(load(&path, &keys(), 0));
        assert!(err.contains("qa.parquet has none of the columns \"prompt\""), "{err}");
        assert!(err.contains("(columns: question, answer)") && err.contains("--chosen-key"), "{err}");
        Ok(())
    }

    #[test]
    fn unknown_name_lists_known_datasets_and_other_forms() {
        let err = err_of(load_raw_dataset_in("rm-static", &keys(), 0, &offline(Path::new("/nonexistent"))));
        assert!(err.contains("data path \"rm-static\" is not an existing file or directory"), "{err}");
        assert!(err.contains("Dahoas/rm-static") && err.contains("stanfordnlp/SHP"), "{err}");
        assert!(err.contains("local .jsonl/.json/.parquet file or directory") && err.contains("org/name"), "{err}");
    }

    #[test]
    fn local_path_naming_a_ds_chat_dataset_keeps_its_mapping() -> Result<()> {
        let dir = tempfile::tempdir()?;
        let shp = dir.path().join("stanfordnlp/SHP");
        std::fs::create_dir_all(&shp)?;
        let record = |h: &str| json!({"history": h, "human_ref_A": "A", "human_ref_B": "B", "labels": 0});
        std::fs::write(shp.join("train.json"), jsonl(&[record("h1")]))?;
        std::fs::write(shp.join("validation.json"), jsonl(&[record("h2")]))?;
        std::fs::write(shp.join("test.json"), jsonl(&[record("h3")]))?;
        let ds = load(&shp, &keys(), 0)?;
        assert_eq!(ds.train, vec![row(" Human: h1 Assistant:", " B", " A")]);
        assert_eq!(ds.eval, vec![row(" Human: h2 Assistant:", " B", " A")], "SHP evaluates on validation");
        Ok(())
    }

    #[test]
    fn ds_chat_local_jsonfile_reads_data_dir_with_leading_spaces() -> Result<()> {
        let dir = tempfile::tempdir()?;
        std::fs::create_dir(dir.path().join("data"))?;
        std::fs::write(
            dir.path().join("data/train.json"),
            jsonl(&[json!({"prompt": "Q", "chosen": "A", "rejected": "B"})]),
        )?;
        let err = load_dschat_local_jsonfile(dir.path(), &keys()).map(|_| ()).unwrap_err().to_string();
        assert!(err.contains("data/eval.json is missing"), "{err}");
        std::fs::write(dir.path().join("data/eval.json"), "[{\"prompt\": \"Q2\", \"chosen\": \"A2\"}]")?;
        let ds = load_dschat_local_jsonfile(dir.path(), &keys())?;
        assert_eq!(ds.train, vec![row(" Q", " A", " B")]);
        assert_eq!(
            ds.eval,
            vec![PreferenceRow { prompt: Some(" Q2".into()), chosen: Some(" A2".into()), rejected: None }]
        );
        Ok(())
    }

    #[test]
    fn rows_from_json_bytes_reads_lines_arrays_and_a_bom() -> Result<()> {
        let lines = "\u{feff}{\"prompt\": \"P\", \"chosen\": \" c\", \"rejected\": \" r\"}\n\n{\"prompt\": \"Q\"}\n";
        let got = rows_from_json_bytes(lines.as_bytes(), "demo.jsonl", &keys())?;
        assert_eq!(
            got,
            vec![row("P", " c", " r"), PreferenceRow { prompt: Some("Q".into()), chosen: None, rejected: None }]
        );
        let array = br#"[{"prompt": "P", "chosen": " c", "rejected": " r"}]"#;
        assert_eq!(rows_from_json_bytes(array, "demo.json", &keys())?, vec![row("P", " c", " r")]);
        assert!(rows_from_json_bytes(b"", "empty", &keys())?.is_empty());
        let err = rows_from_json_bytes(b"[{\"prompt\": 1,}]", "demo.json", &keys()).unwrap_err().to_string();
        assert!(err.contains("demo.json: invalid JSON array"), "{err}");
        let err = rows_from_json_bytes(b"[{\"prompt\": 1}]", "demo.json", &keys()).unwrap_err().to_string();
        assert!(err.contains("demo.json element 1: field \"prompt\" holds a number"), "{err}");
        Ok(())
    }
}
