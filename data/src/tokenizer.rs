//! The text <-> token-id boundary: a thin wrapper over HF `tokenizers` that fixes the choices the
//! training code relies on (no automatic special tokens, `<|endoftext|>` as EOS, special tokens
//! kept on decode) and embeds the GPT-2 BPE tokenizer so the binaries run from any directory.
//! Follows HF `GPT2TokenizerFast` behaviour: "Hello world" -> [15496, 995], EOS = 50256.

use std::fs;
use std::path::Path;

use anyhow::{anyhow, bail, Result};

/// The GPT-2 `tokenizer.json` (HF `gpt2`), vendored under `assets/gpt2-tokenizer/`.
pub const GPT2_TOKENIZER_JSON: &[u8] = include_bytes!("../../assets/gpt2-tokenizer/tokenizer.json");

/// The end-of-text token GPT-2 uses both as document separator (pretraining packing) and as the
/// stop token for generation.
pub const EOS_TOKEN: &str = "<|endoftext|>";

/// A HF tokenizer plus the id of its `<|endoftext|>` token.
#[derive(Clone)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    eos_id: u32,
    /// The threads that tokenize a batch (`None`: HF tokenizers' default, every core).
    workers: Option<std::sync::Arc<rayon::ThreadPool>>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer").field("vocab_size", &self.vocab_size()).field("eos_id", &self.eos_id).finish()
    }
}

impl Tokenizer {
    /// The embedded GPT-2 tokenizer (50257 tokens with `<|endoftext|>`).
    pub fn gpt2_default() -> Result<Self> {
        Self::from_json_bytes(GPT2_TOKENIZER_JSON, "the embedded GPT-2 tokenizer.json")
    }

    /// Loads a HF `tokenizer.json`.
    pub fn from_file(path: &Path) -> Result<Self> {
        if path.is_dir() {
            anyhow::bail!("tokenizer path {} is a directory; pass the tokenizer.json file inside it", path.display());
        }
        let bytes = fs::read(path).map_err(|e| {
            anyhow!(
                "cannot read tokenizer file {} ({e}); pass an existing HF tokenizer.json \
                 or omit it to use the embedded GPT-2 tokenizer",
                path.display()
            )
        })?;
        Self::from_json_bytes(&bytes, &path.display().to_string())
    }

    /// Megatron's `--tokenizer-type GPT2BPETokenizer`: GPT-2's byte-level BPE from its
    /// `vocab.json` and `merges.txt` (`--vocab-file`, `--merge-file`), built as HF's
    /// `GPT2TokenizerFast` builds it from the same two files (the embedded GPT-2 tokenizer's
    /// pre-tokenizer, decoder and post-processor, `<|endoftext|>` a special token).
    pub fn from_gpt2_bpe_files(vocab_file: &Path, merge_file: &Path) -> Result<Self> {
        let read = |path: &Path, flag: &str| {
            fs::read(path).map_err(|e| {
                anyhow!(
                    "cannot read {flag} {} ({e}); pass GPT-2's {}",
                    path.display(),
                    if flag == "--vocab-file" { "vocab.json" } else { "merges.txt" }
                )
            })
        };
        let (vocab_bytes, merge_bytes) = (read(vocab_file, "--vocab-file")?, read(merge_file, "--merge-file")?);
        let vocab: serde_json::Map<String, serde_json::Value> = serde_json::from_slice(&vocab_bytes).map_err(|e| {
            anyhow!(
                "--vocab-file {} is not a JSON object of tokens and ids, as GPT-2's vocab.json ({e})",
                vocab_file.display()
            )
        })?;
        if let Some((token, id)) = vocab.iter().find(|(_, id)| id.as_u64().is_none_or(|id| id > u64::from(u32::MAX))) {
            bail!(
                "--vocab-file {}: token {:?} has id {id}, not a token id",
                vocab_file.display(),
                crate::printable_list(&[token])
            );
        }
        let eos = vocab.get(EOS_TOKEN).cloned().ok_or_else(|| {
            anyhow!(
                "--vocab-file {} has no {EOS_TOKEN}, GPT-2's end of document: use GPT-2's vocab.json",
                vocab_file.display()
            )
        })?;
        let text = std::str::from_utf8(&merge_bytes)
            .map_err(|e| anyhow!("--merge-file {} is not UTF-8 text ({e})", merge_file.display()))?;
        let mut merges = Vec::new();
        for (n, line) in text.lines().enumerate() {
            if (n == 0 && line.starts_with("#version")) || line.is_empty() {
                continue;
            }
            match line.split_once(' ') {
                Some((a, b)) if !a.is_empty() && !b.is_empty() && !b.contains(' ') => {
                    if let Some(missing) = [a, b, &format!("{a}{b}")].into_iter().find(|t| !vocab.contains_key(*t)) {
                        bail!(
                            "--merge-file {} line {}: {:?} is not in --vocab-file {}: the two files are not one tokenizer's",
                            merge_file.display(),
                            n + 1,
                            crate::printable_list(&[missing]),
                            vocab_file.display()
                        );
                    }
                    merges.push(serde_json::json!([a, b]))
                }
                _ => bail!(
                    "--merge-file {} line {}: {:?} is not a merge of two tokens separated by a space, as in GPT-2's merges.txt",
                    merge_file.display(),
                    n + 1,
                    crate::printable_list(&[line])
                ),
            }
        }
        let mut json: serde_json::Value =
            serde_json::from_slice(GPT2_TOKENIZER_JSON).map_err(|e| anyhow!("the embedded tokenizer.json: {e}"))?;
        json["model"]["vocab"] = serde_json::Value::Object(vocab);
        json["model"]["merges"] = serde_json::Value::Array(merges);
        json["added_tokens"][0]["id"] = eos;
        let source =
            format!("GPT-2 BPE from --vocab-file {} and --merge-file {}", vocab_file.display(), merge_file.display());
        Self::from_json_bytes(&serde_json::to_vec(&json)?, &source)
    }

    /// `dir/tokenizer.json` when the model directory has one (a fine-tuned HF checkpoint), else
    /// the embedded GPT-2 tokenizer (a bare safetensors checkpoint of a GPT-2 model).
    pub fn from_model_dir_or_default(dir: &Path) -> Result<Self> {
        let path = dir.join("tokenizer.json");
        if path.is_file() {
            Self::from_file(&path)
        } else {
            Self::gpt2_default()
        }
    }

    fn from_json_bytes(bytes: &[u8], source: &str) -> Result<Self> {
        // The tokenizers crate panics on some malformed sections (a decoder it cannot parse,
        // found by tests/fuzz_readers.rs) instead of returning an error.
        let mut inner = crate::panics::contain(source, || {
            tokenizers::Tokenizer::from_bytes(bytes).map_err(|e| {
                anyhow!(
                    "{source} is not a valid HF tokenizer.json ({e}); \
                     pass a tokenizer.json saved by HF tokenizers"
                )
            })
        })?;
        // Packing and prompt batching do their own truncation and padding; a tokenizer.json
        // saved with either enabled would otherwise silently cut or pad every encode.
        inner.with_truncation(None).map_err(|e| anyhow!("{source}: cannot disable truncation ({e})"))?;
        inner.with_padding(None);
        let eos_id = inner.token_to_id(EOS_TOKEN).ok_or_else(|| {
            anyhow!(
                "{source} has no {EOS_TOKEN} token, which packing and generation use as EOS; \
                 use a GPT-2-family tokenizer.json"
            )
        })?;
        Ok(Self { inner, eos_id, workers: None })
    }

    /// Token ids of `text`. Adds no BOS/EOS, but a literal `<|endoftext|>` in the text becomes
    /// its id (it is an added token, matched before BPE), as in HF `GPT2TokenizerFast`.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let encoding =
            self.inner.encode(text, false).map_err(|e| anyhow!("tokenizing a {}-byte text failed: {e}", text.len()))?;
        Ok(encoding.get_ids().to_vec())
    }

    /// Token ids of each text, encoded in parallel by HF tokenizers, a chunk at a time so that
    /// a long corpus shows its progress.
    pub fn encode_batch(&self, texts: &[String]) -> Result<Vec<Vec<u32>>> {
        const CHUNK: usize = 4096;
        let mut progress = telemetry::progress::Phase::start("tokenizing", "texts", texts.len() as u64);
        let mut ids = Vec::with_capacity(texts.len());
        for chunk in texts.chunks(CHUNK) {
            let inputs: Vec<&str> = chunk.iter().map(String::as_str).collect();
            // HF tokenizers' parallel iterators run on the pool they are called from.
            let encode = || self.inner.encode_batch(inputs, false);
            let encodings = match &self.workers {
                Some(pool) => pool.install(encode),
                None => encode(),
            }
            .map_err(|e| anyhow!("tokenizing a batch of {} texts failed: {e}", chunk.len()))?;
            ids.extend(encodings.iter().map(|e| e.get_ids().to_vec()));
            progress.inc(chunk.len() as u64);
        }
        Ok(ids)
    }

    /// Tokenizes batches on `workers` threads (DS-Chat `--preprocessing_num_workers`; `None`:
    /// every core).
    pub fn with_workers(mut self, workers: Option<usize>) -> Result<Self> {
        self.workers = workers
            .map(|n| {
                let pool = rayon::ThreadPoolBuilder::new().num_threads(n).build();
                pool.map(std::sync::Arc::new).map_err(|e| anyhow!("cannot start {n} tokenizing threads: {e}"))
            })
            .transpose()?;
        Ok(self)
    }

    /// Whether `token` is this tokenizer's EOS, the token every row ends with.
    pub fn is_eos(&self, token: &str) -> bool {
        self.inner.token_to_id(token) == Some(self.eos_id)
    }

    /// Text of `ids`, keeping special tokens so that `decode(encode(s)) == s`.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner.decode(ids, false).map_err(|e| anyhow!("decoding {} token ids failed: {e}", ids.len()))
    }

    /// A stable hash of the whole tokenizer (vocabulary, merges, added tokens, normalisation):
    /// part of the tokenized-data cache key.
    pub fn fingerprint(&self) -> u64 {
        let json = self.inner.to_string(false).unwrap_or_default();
        crate::cache::fnv1a64(json.as_bytes())
    }

    /// Id of `<|endoftext|>` (50256 for GPT-2).
    pub fn eos_id(&self) -> u32 {
        self.eos_id
    }

    /// Vocabulary size including added tokens (50257 for GPT-2): the embedding rows a model
    /// needs at least.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// Writes the tokenizer as `tokenizer.json` at `path`, atomically
    /// ([`durable::write_file_atomically`]): a crash never leaves a half-written file next to a
    /// checkpoint.
    pub fn save(&self, path: &Path) -> Result<()> {
        let json = self.inner.to_string(true).map_err(|e| anyhow!("serialising the tokenizer failed: {e}"))?;
        durable::write_file_atomically(path, json.as_bytes()).map_err(|e| {
            anyhow!("cannot write tokenizer to {} ({e:#}); check the directory exists and is writable", path.display())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_eos_token_is_eos_and_debug_shows_the_sizes() -> Result<()> {
        let tok = Tokenizer::gpt2_default()?;
        assert!(tok.is_eos("<|endoftext|>"));
        // "Hello" is token 15496; the others are not tokens of the vocabulary at all.
        for not_eos in ["Hello", "", "</s>", "<|endoftext|> "] {
            assert!(!tok.is_eos(not_eos), "{not_eos:?}");
        }
        assert_eq!(format!("{tok:?}"), "Tokenizer { vocab_size: 50257, eos_id: 50256 }");
        Ok(())
    }

    /// GPT-2's vocab.json and merges.txt (written here from the embedded tokenizer.json, whose
    /// vocabulary and merges HF converted from those two files) make the same tokenizer.
    #[test]
    fn gpt2_bpe_from_vocab_and_merge_files_is_the_embedded_tokenizer() -> Result<()> {
        let dir = tempfile::tempdir()?;
        let json: serde_json::Value = serde_json::from_slice(GPT2_TOKENIZER_JSON)?;
        let (vocab, merges) = (dir.path().join("gpt2-vocab.json"), dir.path().join("gpt2-merges.txt"));
        fs::write(&vocab, serde_json::to_vec(&json["model"]["vocab"])?)?;
        let mut lines = String::from("#version: 0.2\n");
        for pair in json["model"]["merges"].as_array().unwrap() {
            lines += &format!("{} {}\n", pair[0].as_str().unwrap(), pair[1].as_str().unwrap());
        }
        fs::write(&merges, &lines)?;
        let (files, embedded) = (Tokenizer::from_gpt2_bpe_files(&vocab, &merges)?, Tokenizer::gpt2_default()?);
        assert_eq!((files.vocab_size(), files.eos_id()), (50257, 50256));
        for text in ["Hello world", " naïve café 東京 🙂", "a<|endoftext|>b", "  two  spaces\n\ttab", "12345 * 6789"]
        {
            assert_eq!(files.encode(text)?, embedded.encode(text)?, "{text:?}");
        }
        assert_eq!(files.fingerprint(), embedded.fingerprint(), "the same tokenizer.json");

        // Bad files: one line each, naming the file.
        let write = |name: &str, text: &str| {
            let p = dir.path().join(name);
            fs::write(&p, text).unwrap();
            p
        };
        let cases = [
            (write("list.json", "[1, 2]"), merges.clone(), "not a JSON object"),
            (write("neg.json", r#"{"a": -1, "<|endoftext|>": 0}"#), merges.clone(), "has id -1"),
            (write("noeos.json", r#"{"a": 0}"#), merges.clone(), "has no <|endoftext|>"),
            (vocab.clone(), write("bad.txt", "#version: 0.2\nĠ t\nlonely\n"), "line 3"),
            (vocab.clone(), write("three.txt", "a b c\n"), "line 1"),
            (dir.path().join("missing.json"), merges.clone(), "cannot read --vocab-file"),
            (
                vocab.clone(),
                write("unknown.txt", "#version: 0.2\nĠ t\nzzzq qqqz\n"),
                "line 3: \"zzzq\" is not in --vocab-file",
            ),
        ];
        for (v, m, want) in cases {
            let err = format!("{:#}", Tokenizer::from_gpt2_bpe_files(&v, &m).unwrap_err());
            assert!(err.contains(want) && err.lines().count() == 1, "{want}: {err}");
        }
        Ok(())
    }

    #[test]
    fn gpt2_encodes_known_ids() -> Result<()> {
        let tok = Tokenizer::gpt2_default()?;
        assert_eq!(tok.encode("Hello world")?, vec![15496, 995]);
        assert_eq!(tok.encode("<|endoftext|>")?, vec![50256]);
        assert_eq!(tok.encode("Hi<|endoftext|>")?, vec![17250, 50256]);
        assert_eq!(tok.eos_id(), 50256);
        assert_eq!(tok.vocab_size(), 50257);
        Ok(())
    }

    #[test]
    fn gpt2_decode_round_trips_text_and_eos() -> Result<()> {
        let tok = Tokenizer::gpt2_default()?;
        let text = "  First Citizen:\nBefore we proceed, héllo 😀 <|endoftext|>next doc\t\n";
        let ids = tok.encode(text)?;
        assert!(ids.contains(&50256), "literal EOS must map to its id: {ids:?}");
        assert_eq!(tok.decode(&ids)?, text);
        Ok(())
    }

    #[test]
    fn encode_batch_matches_encode() -> Result<()> {
        let tok = Tokenizer::gpt2_default()?;
        let texts = vec!["Hello world".to_string(), String::new(), "to be".to_string()];
        let batch = tok.encode_batch(&texts)?;
        let single: Vec<Vec<u32>> = texts.iter().map(|t| tok.encode(t)).collect::<Result<_>>()?;
        assert_eq!(batch, single);
        assert_eq!(batch[0], vec![15496, 995]);
        assert!(batch[1].is_empty());
        Ok(())
    }

    #[test]
    fn save_then_from_file_and_model_dir_reload_the_same_tokenizer() -> Result<()> {
        let tok = Tokenizer::gpt2_default()?;
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("tokenizer.json");
        tok.save(&path)?;
        // Only tokenizer.json remains: the temp file was renamed.
        let names: Vec<_> =
            fs::read_dir(dir.path())?.map(|e| e.map(|e| e.file_name())).collect::<std::io::Result<_>>()?;
        assert_eq!(names, vec![std::ffi::OsString::from("tokenizer.json")]);
        let loaded = Tokenizer::from_file(&path)?;
        assert_eq!(loaded.encode("Hello world")?, vec![15496, 995]);
        assert_eq!(loaded.vocab_size(), 50257);
        let from_dir = Tokenizer::from_model_dir_or_default(dir.path())?;
        assert_eq!(from_dir.eos_id(), 50256);
        Ok(())
    }

    #[test]
    fn model_dir_without_tokenizer_falls_back_to_gpt2() -> Result<()> {
        let dir = tempfile::tempdir()?;
        let tok = Tokenizer::from_model_dir_or_default(dir.path())?;
        assert_eq!(tok.encode("Hello world")?, vec![15496, 995]);
        Ok(())
    }

    #[test]
    fn from_file_errors_name_the_path() -> Result<()> {
        let dir = tempfile::tempdir()?;
        let missing = dir.path().join("nope.json");
        let err = Tokenizer::from_file(&missing).unwrap_err().to_string();
        assert!(err.contains("nope.json") && err.contains("cannot read"), "{err}");

        let bad = dir.path().join("bad.json");
        fs::write(&bad, "{not json")?;
        let err = Tokenizer::from_file(&bad).unwrap_err().to_string();
        assert!(err.contains("bad.json") && err.contains("not a valid"), "{err}");
        Ok(())
    }

    /// The tokenizers crate panics on a decoder section it cannot parse (found by
    /// tests/fuzz_readers.rs): one error line naming the file.
    #[test]
    fn a_malformed_decoder_is_one_error_naming_the_file() -> Result<()> {
        let json = String::from_utf8(GPT2_TOKENIZER_JSON.to_vec())?;
        let decoder = json.find("\"decoder\":").expect("a decoder section");
        let broken =
            format!("{}\"decoder\":{{\"type\":\"ByteLevel\",\"x\":\"\\ud8\"}},{}", &json[..decoder], &json[decoder..]);
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("tokenizer.json");
        fs::write(&path, broken)?;
        let err = crate::panics::contain("test", || Tokenizer::from_file(&path)).map(drop).unwrap_err().to_string();
        assert!(err.contains("tokenizer.json") && !err.contains('\n'), "{err}");
        assert!(!err.starts_with("test"), "the reader contains it, not the test: {err}");
        Ok(())
    }

    #[test]
    fn tokenizer_without_eos_is_rejected() -> Result<()> {
        let json = String::from_utf8(GPT2_TOKENIZER_JSON.to_vec())?.replace(EOS_TOKEN, "<|eot|>");
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("tokenizer.json");
        fs::write(&path, json)?;
        let err = Tokenizer::from_file(&path).unwrap_err().to_string();
        assert!(err.contains("no <|endoftext|> token"), "{err}");
        Ok(())
    }
}
