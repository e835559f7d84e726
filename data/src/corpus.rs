//! Raw pretraining documents from a jsonl, plain-text or parquet file, or the embedded
//! Shakespeare corpus, and any of them (or Megatron's pre-tokenized pair) as a packed corpus.
//! Mirrors Megatron's `tools/preprocess_data.py` input: one JSON object per line with the
//! document under `--json-keys` (our `--text-key`), or a HF-datasets parquet shard.

use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};

use crate::hub::HubAccess;
use crate::indexed_dataset::IndexedDataset;
use crate::pretrain::{tokenize_documents, PackedCorpus};
use crate::tokenizer::Tokenizer;
use anyhow::{anyhow, bail, Result};
use parquet::basic::Type as PhysicalType;
use parquet::file::reader::{FileReader, SerializedFileReader};
use parquet::record::Field;
use parquet::schema::types::Type as SchemaType;

/// Eight Shakespeare plays (`title`, `text` per line), vendored under `assets/corpus/`.
pub const SHAKESPEARE_JSONL: &[u8] = include_bytes!("../../assets/corpus/shakespeare.jsonl");

/// Where the documents come from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CorpusSource {
    /// [`SHAKESPEARE_JSONL`], compiled into the binary.
    EmbeddedShakespeare,
    /// A file whose format follows from its extension, see [`CorpusFormat::from_path`].
    File(PathBuf),
    /// The train split of a hub dataset (its parquet files, from the Hugging Face cache or
    /// downloaded), of configuration `config` when given: `load_dataset(id, config)["train"]`.
    Hub { id: String, config: Option<String> },
    /// Megatron's pre-tokenized `PREFIX.bin` + `PREFIX.idx` (`crate::indexed_dataset`): no text,
    /// read by [`read_packed_corpus`] only.
    Indexed(PathBuf),
}

impl CorpusSource {
    /// `"shakespeare"` or `"embedded"` is the embedded corpus; a Megatron dataset's prefix (or
    /// its `.bin` or `.idx`) is that dataset; an existing path or a name with a corpus file's
    /// extension is a file; `org/name` otherwise is a hub dataset.
    pub fn parse(s: &str) -> Self {
        if matches!(s, "shakespeare" | "embedded") {
            return Self::EmbeddedShakespeare;
        }
        if let Some(prefix) = crate::indexed_dataset::indexed_prefix(s) {
            return Self::Indexed(prefix);
        }
        let path = Path::new(s);
        let is_file_name = path.extension().is_some_and(|e| {
            ["jsonl", "json", "txt", "parquet"].contains(&e.to_string_lossy().to_ascii_lowercase().as_str())
        });
        if !path.exists() && !is_file_name && crate::sources::looks_like_hub_id(s) {
            Self::Hub { id: s.to_string(), config: None }
        } else {
            Self::File(PathBuf::from(s))
        }
    }

    /// [`CorpusSource::parse`] with a hub configuration (DS-Chat's
    /// `--unsupervised_dataset_config_name`): the name is then a hub dataset, with or without an
    /// organisation (`wikitext`); a configuration of the embedded corpus or a local file is an error.
    pub fn with_config(s: &str, config: Option<&str>) -> Result<Self> {
        let Some(config) = config else { return Ok(Self::parse(s)) };
        match Self::parse(s) {
            Self::EmbeddedShakespeare => bail!("the embedded corpus {s} has no configuration {config:?}: drop it"),
            Self::File(path) if path.exists() => {
                bail!("{s} is a local file, and configuration {config:?} picks part of a hub dataset: drop one of them")
            }
            Self::Indexed(_) => {
                bail!("{s} is a local Megatron dataset, and configuration {config:?} picks part of a hub dataset: drop one of them")
            }
            _ => Ok(Self::Hub { id: s.to_string(), config: Some(config.to_string()) }),
        }
    }
}

/// How a corpus file is laid out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CorpusFormat {
    /// One JSON object per line, the document in a string field.
    Jsonl,
    /// The whole file is one document.
    Text,
    /// A parquet file with the documents in a string column.
    Parquet,
}

impl CorpusFormat {
    /// `.jsonl`/`.json` -> Jsonl, `.parquet` -> Parquet, anything else -> Text.
    pub fn from_path(path: &Path) -> Self {
        let ext = path.extension().and_then(|e| e.to_str()).map(str::to_ascii_lowercase);
        match ext.as_deref() {
            Some("jsonl" | "json") => Self::Jsonl,
            Some("parquet") => Self::Parquet,
            _ => Self::Text,
        }
    }
}

/// `src` as a [`PackedCorpus`] of `seq_length`-token blocks, and its document count: text
/// tokenized by `tokenizer` with its EOS after each document, or a Megatron indexed dataset's
/// stream as its files hold it (`--append-eod` put the EOS there), each token checked below
/// `vocab_size` as it is read.
pub fn read_packed_corpus(
    src: &CorpusSource,
    text_key: &str,
    tokenizer: &Tokenizer,
    seq_length: usize,
    vocab_size: usize,
) -> Result<(PackedCorpus, usize)> {
    if let CorpusSource::Indexed(prefix) = src {
        let dataset = IndexedDataset::open(prefix)?;
        let documents = dataset.num_documents();
        return Ok((PackedCorpus::indexed(dataset, seq_length, vocab_size), documents));
    }
    let docs = read_documents(src, text_key)?;
    let tokens = tokenize_documents(tokenizer, &docs)?;
    Ok((PackedCorpus::pack(&tokens, tokenizer.eos_id(), seq_length), docs.len()))
}

/// The jsonl field or parquet column of a document's text by default.
pub const DEFAULT_TEXT_KEY: &str = "text";

/// All non-empty documents of `src`; `text_key` names the jsonl field or parquet column.
pub fn read_documents(src: &CorpusSource, text_key: &str) -> Result<Vec<String>> {
    read_documents_in(src, text_key, &HubAccess::from_env())
}

/// [`read_documents`] with the hub cache, offline flag and endpoint given.
fn read_documents_in(src: &CorpusSource, text_key: &str, hub: &HubAccess) -> Result<Vec<String>> {
    let (docs, name) = match src {
        CorpusSource::Indexed(prefix) => bail!(
            "{} is Megatron's pre-tokenized data (.bin/.idx), which holds no text: pretraining reads it (sft --from-scratch --data-path); here give a .jsonl, .txt or .parquet file",
            prefix.display()
        ),
        CorpusSource::Hub { id, config } => {
            let snapshot = crate::hub::fetch_dataset(id, config.as_deref(), hub, &train_split)?;
            let mut docs = Vec::new();
            for path in &snapshot.train {
                let name = path.display().to_string();
                let file = File::open(path).map_err(|e| anyhow!("cannot open {name} of hub dataset {id} ({e})"))?;
                docs.extend(read_parquet(file, &name, text_key)?);
            }
            let config = config.as_ref().map_or(String::new(), |c| format!(" ({c})"));
            (docs, format!("hub dataset {id}{config}"))
        }
        CorpusSource::EmbeddedShakespeare => {
            let name = "embedded shakespeare.jsonl";
            (read_jsonl(SHAKESPEARE_JSONL, name, text_key)?, name.to_string())
        }
        CorpusSource::File(path) => {
            let name = path.display().to_string();
            if path.is_dir() {
                bail!("corpus path {name} is a directory; pass a .jsonl, .txt or .parquet file");
            }
            let file = File::open(path).map_err(|e| {
                anyhow!(
                    "cannot open corpus file {name} ({e}); pass an existing .jsonl, .txt or \
                     .parquet file, or `shakespeare` for the embedded corpus"
                )
            })?;
            let docs = match CorpusFormat::from_path(path) {
                CorpusFormat::Jsonl => read_jsonl(BufReader::new(file), &name, text_key)?,
                CorpusFormat::Text if text_key != DEFAULT_TEXT_KEY => bail!(
                    "--text-key {text_key} names a jsonl field or a parquet column, and {name} is plain text (read whole): drop --text-key"
                ),
                CorpusFormat::Text => read_text(file, &name)?,
                CorpusFormat::Parquet => read_parquet(file, &name, text_key)?,
            };
            (docs, name)
        }
    };
    if docs.is_empty() {
        bail!("corpus {name} has no non-empty documents; pass a corpus with text in it");
    }
    Ok(docs)
}

/// The train split among a hub dataset's parquet files: those whose file or folder name starts
/// with `train` (`train-00000-of-00001.parquet`, the conversion's `train/0000.parquet`).
fn train_split(files: &[String]) -> Result<crate::file_splits::SplitPlan, String> {
    let is_train = |f: &&String| f.split('/').rev().take(2).any(|part| part.starts_with("train"));
    let train: Vec<String> = files.iter().filter(is_train).cloned().collect();
    if train.is_empty() {
        return Err(format!("no train split among its parquet files ({})", files.join(", ")));
    }
    Ok(crate::file_splits::SplitPlan { train, eval: None })
}

/// One document per JSON line, blank lines skipped; errors carry the 1-based line number.
fn read_jsonl(reader: impl BufRead, name: &str, text_key: &str) -> Result<Vec<String>> {
    let mut docs = Vec::new();
    for (index, line) in reader.lines().enumerate() {
        let line_no = index + 1;
        let line = line.map_err(|e| anyhow!("{name} line {line_no}: cannot read ({e})"))?;
        // Some editors on Windows start UTF-8 files with a byte-order mark serde_json rejects.
        let line = line.strip_prefix('\u{feff}').unwrap_or(&line);
        if line.trim().is_empty() {
            continue;
        }
        let value: serde_json::Value =
            serde_json::from_str(line).map_err(|e| anyhow!("{name} line {line_no}: invalid JSON ({e})"))?;
        let serde_json::Value::Object(object) = value else {
            bail!("{name} line {line_no}: expected a JSON object with a \"{text_key}\" field");
        };
        match object.get(text_key) {
            Some(serde_json::Value::String(text)) => {
                if !text.is_empty() {
                    docs.push(text.clone());
                }
            }
            _ => {
                let keys: Vec<&str> = object.keys().map(String::as_str).collect();
                bail!(
                    "{name} line {line_no}: no string field \"{text_key}\" (fields: {}); \
                     set --text-key to the field that holds the document text",
                    crate::printable_list(&keys)
                );
            }
        }
    }
    Ok(docs)
}

/// The whole file as one document.
fn read_text(mut file: File, name: &str) -> Result<Vec<String>> {
    let mut text = String::new();
    std::io::Read::read_to_string(&mut file, &mut text)
        .map_err(|e| anyhow!("cannot read corpus file {name} as UTF-8 text ({e}); pass a UTF-8 text file"))?;
    Ok(if text.is_empty() { vec![] } else { vec![text] })
}

/// The string column `text_key` of every row group; nulls and empty strings skipped. The
/// parquet crate's panics on malformed files are contained ([`crate::panics`]).
fn read_parquet(file: File, name: &str, text_key: &str) -> Result<Vec<String>> {
    crate::panics::contain(name, || read_parquet_uncontained(file, name, text_key))
}

fn read_parquet_uncontained(file: File, name: &str, text_key: &str) -> Result<Vec<String>> {
    let reader = SerializedFileReader::new(file)
        .map_err(|e| anyhow!("{name} is not a valid parquet file ({e}); pass an intact file"))?;
    let root = reader.metadata().file_metadata().schema_descr().root_schema();
    let field = root.get_fields().iter().find(|f| f.name() == text_key).cloned().ok_or_else(|| {
        let columns: Vec<&str> = root.get_fields().iter().map(|f| f.name()).collect();
        anyhow!(
            "{name} has no column \"{text_key}\" (columns: {}); set --text-key to the \
                 column that holds the document text",
            crate::printable_list(&columns)
        )
    })?;
    if !field.is_primitive() || field.get_physical_type() != PhysicalType::BYTE_ARRAY {
        bail!(
            "{name} column \"{text_key}\" is not a string column; set --text-key to a \
             string (BYTE_ARRAY/UTF8) column"
        );
    }
    // Project onto the one column so the other columns are never decoded.
    let projection = SchemaType::group_type_builder(root.name())
        .with_fields(vec![field])
        .build()
        .map_err(|e| anyhow!("{name}: cannot project onto column \"{text_key}\" ({e})"))?;
    let rows = reader
        .get_row_iter(Some(projection))
        .map_err(|e| anyhow!("{name}: cannot read column \"{text_key}\" ({e})"))?;
    let mut docs = Vec::new();
    for (row_no, row) in rows.enumerate() {
        let row = row.map_err(|e| anyhow!("{name} row {row_no}: cannot read ({e}); the file may be truncated"))?;
        for (_, value) in row.get_column_iter() {
            let text = match value {
                Field::Null => continue,
                Field::Str(text) => text.clone(),
                // A BYTE_ARRAY column without the UTF8 annotation: accept it when it is UTF-8.
                Field::Bytes(bytes) => String::from_utf8(bytes.data().to_vec())
                    .map_err(|_| anyhow!("{name} row {row_no}: column \"{text_key}\" is not UTF-8 text"))?,
                other => bail!("{name} row {row_no}: column \"{text_key}\" holds {other:?}, not a string"),
            };
            if !text.is_empty() {
                docs.push(text);
            }
        }
    }
    Ok(docs)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Megatron's preprocess_data.py with --append-eod and our own tokenizing and packing of
    /// the same jsonl make the same stream, so pretraining on either trains the same: the
    /// fixture's .bin/.idx pairs were written by megatron-core's builder
    /// (`scripts/fixtures/megatron_indexed.py`), in uint16 a document a sequence and in int32
    /// split in two sequences a document.
    #[test]
    fn megatrons_indexed_dataset_packs_as_its_jsonl_does() -> Result<()> {
        let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/megatron");
        let tok = Tokenizer::gpt2_default()?;
        let (text, docs) =
            read_packed_corpus(&CorpusSource::File(fixtures.join("corpus.jsonl")), "text", &tok, 16, 50257)?;
        assert_eq!((docs, text.num_tokens(), text.num_blocks()), (12, 239, 14));
        for prefix in ["corpus_text_document", "corpus_sentences_int32"] {
            let src = CorpusSource::parse(fixtures.join(prefix).to_str().unwrap());
            assert_eq!(src, CorpusSource::Indexed(fixtures.join(prefix)));
            let (indexed, docs) = read_packed_corpus(&src, "ignored", &tok, 16, 50257)?;
            assert_eq!((docs, indexed.num_tokens(), indexed.num_blocks()), (12, 239, 14), "{prefix}");
            for i in 0..text.num_blocks() {
                assert_eq!(indexed.block(i)?, text.block(i)?, "{prefix} block {i}");
                assert!(matches!(indexed.block(i)?, std::borrow::Cow::Owned(_)));
                assert!(matches!(text.block(i)?, std::borrow::Cow::Borrowed(_)));
            }
            // A model whose vocabulary lacks <|endoftext|>: the first block holding one fails.
            let (small, _) = read_packed_corpus(&src, "text", &tok, 16, 50256)?;
            let err = small.block(0).unwrap_err().to_string();
            assert!(err.contains("token 10 of") && err.contains(prefix), "{err}");
        }
        Ok(())
    }
    use parquet::data_type::{ByteArray, ByteArrayType, Int64Type};
    use parquet::file::properties::WriterProperties;
    use parquet::file::writer::SerializedFileWriter;
    use parquet::schema::parser::parse_message_type;
    use std::sync::Arc;

    fn write(dir: &tempfile::TempDir, name: &str, contents: &str) -> Result<PathBuf> {
        let path = dir.path().join(name);
        std::fs::write(&path, contents)?;
        Ok(path)
    }

    fn err_of(src: &CorpusSource, key: &str) -> String {
        match read_documents(src, key) {
            Ok(docs) => panic!("expected an error, got {} documents", docs.len()),
            Err(e) => e.to_string(),
        }
    }

    /// `text` is a nullable UTF8 column (`None` writes a null), `id` an INT64 column.
    fn write_parquet(path: &Path, texts: &[Option<&str>]) -> Result<()> {
        let schema = parse_message_type("message doc { optional binary text (UTF8); required int64 id; }")?;
        let mut writer = SerializedFileWriter::new(
            File::create(path)?,
            Arc::new(schema),
            Arc::new(WriterProperties::builder().build()),
        )?;
        let mut row_group = writer.next_row_group()?;
        let values: Vec<ByteArray> = texts.iter().flatten().map(|t| ByteArray::from(*t)).collect();
        let def_levels: Vec<i16> = texts.iter().map(|t| i16::from(t.is_some())).collect();
        let mut text_col = row_group.next_column()?.ok_or_else(|| anyhow!("no text column"))?;
        text_col.typed::<ByteArrayType>().write_batch(&values, Some(&def_levels), None)?;
        text_col.close()?;
        let ids: Vec<i64> = (0..texts.len() as i64).collect();
        let mut id_col = row_group.next_column()?.ok_or_else(|| anyhow!("no id column"))?;
        id_col.typed::<Int64Type>().write_batch(&ids, None, None)?;
        id_col.close()?;
        row_group.close()?;
        writer.close()?;
        Ok(())
    }

    #[test]
    fn parse_source_and_infer_format() {
        assert_eq!(CorpusSource::parse("shakespeare"), CorpusSource::EmbeddedShakespeare);
        assert_eq!(CorpusSource::parse("embedded"), CorpusSource::EmbeddedShakespeare);
        assert_eq!(CorpusSource::parse("a/b.txt"), CorpusSource::File("a/b.txt".into()));
        assert_eq!(CorpusSource::parse("a/b.parquet"), CorpusSource::File("a/b.parquet".into()));
        assert_eq!(CorpusSource::parse("org/corpus"), CorpusSource::Hub { id: "org/corpus".into(), config: None });
        assert_eq!(CorpusSource::parse("corpus"), CorpusSource::File("corpus".into()));
        assert_eq!(CorpusFormat::from_path(Path::new("x.jsonl")), CorpusFormat::Jsonl);
        assert_eq!(CorpusFormat::from_path(Path::new("x.JSON")), CorpusFormat::Jsonl);
        assert_eq!(CorpusFormat::from_path(Path::new("x.parquet")), CorpusFormat::Parquet);
        assert_eq!(CorpusFormat::from_path(Path::new("x.txt")), CorpusFormat::Text);
        assert_eq!(CorpusFormat::from_path(Path::new("README")), CorpusFormat::Text);
    }

    /// DS-Chat's PTX source `--unsupervised_dataset_name wikitext --unsupervised_dataset_config_name
    /// wikitext-2-raw-v1`: the named configuration's train split, read from the hub cache (offline),
    /// not another configuration's nor the test split.
    #[test]
    fn a_hub_dataset_configuration_reads_its_train_split() -> Result<()> {
        let cache = tempfile::tempdir()?;
        let snapshot = cache.path().join("datasets--wikitext").join("snapshots").join("c0ffee");
        std::fs::create_dir_all(cache.path().join("datasets--wikitext/refs"))?;
        std::fs::write(cache.path().join("datasets--wikitext/refs/main"), "c0ffee")?;
        for (file, text) in [
            ("wikitext-2-raw-v1/train-00000-of-00001.parquet", "two train"),
            ("wikitext-2-raw-v1/test-00000-of-00001.parquet", "two test"),
            ("wikitext-103-raw-v1/train-00000-of-00001.parquet", "103 train"),
        ] {
            std::fs::create_dir_all(snapshot.join(file).parent().unwrap())?;
            write_parquet(&snapshot.join(file), &[Some(text), None, Some("")])?;
        }
        let hub = HubAccess {
            cache: hf_hub::Cache::new(cache.path().into()),
            offline: true,
            endpoint: None,
            progress: false,
        };
        let src = CorpusSource::with_config("wikitext", Some("wikitext-2-raw-v1"))?;
        assert_eq!(src, CorpusSource::Hub { id: "wikitext".into(), config: Some("wikitext-2-raw-v1".into()) });
        assert_eq!(read_documents_in(&src, "text", &hub)?, ["two train"]);
        let other = CorpusSource::with_config("wikitext", Some("wikitext-9"))?;
        let err = read_documents_in(&other, "text", &hub).unwrap_err().to_string();
        assert!(
            err.contains("only partly in the Hugging Face cache") && err.contains("no configuration \"wikitext-9\""),
            "{err}"
        );
        let missing = CorpusSource::parse("org/absent");
        assert_eq!(missing, CorpusSource::Hub { id: "org/absent".into(), config: None });
        let err = read_documents_in(&missing, "text", &hub).unwrap_err().to_string();
        assert!(err.contains("hub dataset org/absent is not in the Hugging Face cache"), "{err}");
        let local = snapshot.join("wikitext-2-raw-v1/train-00000-of-00001.parquet");
        let err = CorpusSource::with_config(local.to_str().unwrap(), Some("x")).unwrap_err().to_string();
        assert!(err.contains("is a local file, and configuration \"x\" picks part of a hub dataset"), "{err}");
        assert!(CorpusSource::with_config("shakespeare", Some("x")).is_err());
        Ok(())
    }

    #[test]
    fn embedded_shakespeare_reads_as_eight_plays() -> Result<()> {
        let docs = read_documents(&CorpusSource::EmbeddedShakespeare, "text")?;
        assert_eq!(docs.len(), 8);
        assert!(docs[0].starts_with("THE TEMPEST"), "{}", &docs[0][..40]);
        let bytes: usize = docs.iter().map(String::len).sum();
        assert!(bytes > 1_000_000, "{bytes} bytes");
        Ok(())
    }

    #[test]
    fn jsonl_reads_text_field_skipping_blank_lines_and_empty_docs() -> Result<()> {
        let dir = tempfile::tempdir()?;
        let path = write(
            &dir,
            "c.jsonl",
            "{\"text\": \"one\", \"n\": 1}\n\n   \n{\"text\": \"\"}\n{\"text\": \"two\\nlines\"}\n",
        )?;
        let docs = read_documents(&CorpusSource::File(path), "text")?;
        assert_eq!(docs, vec!["one".to_string(), "two\nlines".to_string()]);
        Ok(())
    }

    #[test]
    fn jsonl_malformed_line_names_file_and_line_number() -> Result<()> {
        let dir = tempfile::tempdir()?;
        let path = write(&dir, "corpus.jsonl", "{\"text\": \"a\"}\n\n{\"text\": oops}\n")?;
        let err = err_of(&CorpusSource::File(path), "text");
        assert!(err.contains("corpus.jsonl line 3: invalid JSON ("), "{err}");
        Ok(())
    }

    #[test]
    fn jsonl_missing_key_names_line_fields_and_flag() -> Result<()> {
        let dir = tempfile::tempdir()?;
        let path = write(&dir, "c.jsonl", "{\"text\": \"a\"}\n{\"content\": \"b\"}\n")?;
        let err = err_of(&CorpusSource::File(path.clone()), "text");
        assert!(err.contains("c.jsonl line 2: no string field \"text\""), "{err}");
        assert!(err.contains("fields: content") && err.contains("--text-key"), "{err}");
        // A non-string value under the key is the same error.
        let path = write(&dir, "d.jsonl", "{\"text\": 5}\n")?;
        let err = err_of(&CorpusSource::File(path), "text");
        assert!(err.contains("d.jsonl line 1: no string field"), "{err}");
        Ok(())
    }

    #[test]
    fn missing_file_directory_and_empty_file_are_errors_naming_the_path() -> Result<()> {
        let dir = tempfile::tempdir()?;
        let missing = dir.path().join("absent.jsonl");
        let err = err_of(&CorpusSource::File(missing), "text");
        assert!(err.contains("cannot open corpus file") && err.contains("absent.jsonl"), "{err}");

        let err = err_of(&CorpusSource::File(dir.path().to_path_buf()), "text");
        assert!(err.contains("is a directory"), "{err}");

        let empty = write(&dir, "empty.jsonl", "\n\n")?;
        let err = err_of(&CorpusSource::File(empty), "text");
        assert!(err.contains("empty.jsonl has no non-empty documents"), "{err}");

        let empty_txt = write(&dir, "empty.txt", "")?;
        let err = err_of(&CorpusSource::File(empty_txt), "text");
        assert!(err.contains("empty.txt has no non-empty documents"), "{err}");
        Ok(())
    }

    /// A text file is one document, read whole; a --text-key, which it has no use for, is
    /// refused naming it.
    #[test]
    fn text_file_is_one_document() -> Result<()> {
        let dir = tempfile::tempdir()?;
        let body = "line one\n\nline {\"not\": json}\n";
        let path = write(&dir, "play.txt", body)?;
        assert_eq!(read_documents(&CorpusSource::File(path.clone()), DEFAULT_TEXT_KEY)?, vec![body]);
        let err = read_documents(&CorpusSource::File(path), "body").unwrap_err().to_string();
        assert!(err.contains("--text-key body") && err.contains("plain text"), "{err}");
        Ok(())
    }

    #[test]
    fn parquet_reads_text_column_skipping_nulls() -> Result<()> {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("shard.parquet");
        write_parquet(&path, &[Some("first doc"), None, Some(""), Some("third, héllo")])?;
        let docs = read_documents(&CorpusSource::File(path), "text")?;
        assert_eq!(docs, vec!["first doc".to_string(), "third, héllo".to_string()]);
        Ok(())
    }

    #[test]
    fn parquet_missing_column_lists_columns() -> Result<()> {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("shard.parquet");
        write_parquet(&path, &[Some("a")])?;
        let err = err_of(&CorpusSource::File(path.clone()), "content");
        assert!(err.contains("no column \"content\" (columns: text, id)"), "{err}");
        assert!(err.contains("--text-key"), "{err}");
        let err = err_of(&CorpusSource::File(path), "id");
        assert!(err.contains("\"id\" is not a string column"), "{err}");
        Ok(())
    }

    #[test]
    fn truncated_parquet_is_an_error_naming_the_path() -> Result<()> {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("cut.parquet");
        write_parquet(&path, &[Some("a document")])?;
        let bytes = std::fs::read(&path)?;
        std::fs::write(&path, &bytes[..bytes.len() / 2])?;
        let err = err_of(&CorpusSource::File(path), "text");
        assert!(err.contains("cut.parquet is not a valid parquet file"), "{err}");
        Ok(())
    }
}
