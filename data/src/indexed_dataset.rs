//! Megatron's indexed dataset, the pre-tokenized corpus its `tools/preprocess_data.py` writes
//! (`PREFIX.bin` + `PREFIX.idx`, megatron-core's `IndexedDataset`, Megatron-DeepSpeed's
//! `--data-impl mmap`), read in place: both files are memory-mapped, so a corpus of billions of
//! tokens costs no heap and the ranks of a node share one copy in the page cache.
//!
//! `.idx`, little-endian: the magic `MMIDIDX\0\0`, version 1 (u64), the token dtype's code (u8),
//! the sequence count S and the document-index count D (u64 each), then S sequence lengths (i32,
//! in tokens), S sequence pointers (i64, byte offsets into `.bin`), D document indices (i64: the
//! first sequence of each document, from 0, and S last), and for multimodal datasets S modes
//! (i8). `.bin` holds the sequences' tokens back to back. A document is one sequence, or several
//! with `--split-sentences`; `--append-eod` ends each document with `<|endoftext|>`.
//!
//! Both files are untrusted: every count, length and pointer is checked against the files'
//! sizes before any is used, and a token is checked when it is read.

use std::fs::File;
use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Result};

/// The `.idx` file's first bytes.
const MAGIC: &[u8; 9] = b"MMIDIDX\x00\x00";
/// Magic, version, dtype code, sequence count, document-index count.
const HEADER_BYTES: usize = 9 + 8 + 1 + 8 + 8;

/// The integer types Megatron stores tokens in (megatron-core's `DType` codes); its tools pick
/// uint16 below 65500 tokens of vocabulary and int32 above.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TokenDtype {
    U8,
    I8,
    I16,
    I32,
    I64,
    U16,
}

impl TokenDtype {
    fn from_code(code: u8) -> Result<Self, String> {
        Ok(match code {
            1 => Self::U8,
            2 => Self::I8,
            3 => Self::I16,
            4 => Self::I32,
            5 => Self::I64,
            8 => Self::U16,
            6 | 7 => return Err(format!("dtype code {code} (floating point), which holds no token ids")),
            _ => return Err(format!("unknown dtype code {code} (megatron-core writes 1 to 8)")),
        })
    }

    /// Bytes per token.
    pub fn size(self) -> usize {
        match self {
            Self::U8 | Self::I8 => 1,
            Self::I16 | Self::U16 => 2,
            Self::I32 => 4,
            Self::I64 => 8,
        }
    }

    /// NumPy's name, as Megatron's tools print it.
    pub fn name(self) -> &'static str {
        match self {
            Self::U8 => "uint8",
            Self::I8 => "int8",
            Self::I16 => "int16",
            Self::I32 => "int32",
            Self::I64 => "int64",
            Self::U16 => "uint16",
        }
    }

    /// The token stored in `bytes` (exactly [`TokenDtype::size`] of them), widened.
    fn decode(self, bytes: &[u8]) -> i64 {
        match self {
            Self::U8 => i64::from(bytes[0]),
            Self::I8 => i64::from(bytes[0] as i8),
            Self::I16 => i64::from(i16::from_le_bytes([bytes[0], bytes[1]])),
            Self::U16 => i64::from(u16::from_le_bytes([bytes[0], bytes[1]])),
            Self::I32 => i64::from(i32::from_le_bytes(bytes.try_into().expect("4 bytes"))),
            Self::I64 => i64::from_le_bytes(bytes.try_into().expect("8 bytes")),
        }
    }
}

/// An opened and checked `PREFIX.bin` / `PREFIX.idx` pair. Pretraining reads it as one token
/// stream (every sequence in order), which is what Megatron's GPT dataset samples from.
pub struct IndexedDataset {
    prefix: PathBuf,
    dtype: TokenDtype,
    index: memmap2::Mmap,
    tokens: memmap2::Mmap,
    sequences: usize,
    documents: usize,
}

impl std::fmt::Debug for IndexedDataset {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IndexedDataset")
            .field("prefix", &self.prefix)
            .field("dtype", &self.dtype)
            .field("sequences", &self.sequences)
            .field("documents", &self.documents)
            .field("tokens", &self.num_tokens())
            .finish()
    }
}

/// The `.bin` and `.idx` paths of a prefix.
pub fn indexed_paths(prefix: &Path) -> (PathBuf, PathBuf) {
    let with = |ext: &str| {
        let mut p = prefix.as_os_str().to_owned();
        p.push(ext);
        PathBuf::from(p)
    };
    (with(".bin"), with(".idx"))
}

/// The prefix `s` names when it is an indexed dataset: `PREFIX` whose `.bin` and `.idx` both
/// exist (Megatron's `--data-path`), or either file's own path.
pub fn indexed_prefix(s: &str) -> Option<PathBuf> {
    let path = Path::new(s);
    let prefix = match path.extension().and_then(|e| e.to_str()) {
        Some("bin" | "idx") if path.is_file() => path.with_extension(""),
        _ => path.to_path_buf(),
    };
    let (bin, idx) = indexed_paths(&prefix);
    (bin.is_file() && idx.is_file()).then_some(prefix)
}

impl IndexedDataset {
    /// Opens `PREFIX.bin` and `PREFIX.idx` and checks that they are a well-formed pair.
    pub fn open(prefix: &Path) -> Result<Self> {
        let (bin_path, idx_path) = indexed_paths(prefix);
        let map = |path: &Path| -> Result<memmap2::Mmap> {
            let file = File::open(path).map_err(|e| {
                anyhow!(
                    "cannot open {} ({e}); --data-path PREFIX reads Megatron's PREFIX.bin and PREFIX.idx",
                    path.display()
                )
            })?;
            // SAFETY: the map is read-only and lives as long as `self`. As with Megatron's and
            // safetensors' maps, the files must not be truncated while a run reads them.
            unsafe { memmap2::Mmap::map(&file) }.map_err(|e| anyhow!("cannot map {} ({e})", path.display()))
        };
        let (index, tokens) = (map(&idx_path)?, map(&bin_path)?);
        let bad = |why: String| anyhow!("{} is not a Megatron indexed dataset's index: {why}", idx_path.display());
        let header = parse_header(&index).map_err(bad)?;
        let stream_bytes = check_sequences(&index, &header).map_err(bad)?;
        if stream_bytes != tokens.len() as u64 {
            bail!(
                "{} holds {} bytes and {} describes {stream_bytes}: they are not the two halves of one dataset (write both again with preprocess_data.py)",
                bin_path.display(),
                tokens.len(),
                idx_path.display()
            );
        }
        Ok(Self {
            prefix: prefix.to_path_buf(),
            dtype: header.dtype,
            index,
            tokens,
            sequences: header.sequences,
            documents: header.document_indices - 1,
        })
    }

    /// The prefix the files were opened by.
    pub fn prefix(&self) -> &Path {
        &self.prefix
    }

    /// The dtype the tokens are stored in.
    pub fn dtype(&self) -> TokenDtype {
        self.dtype
    }

    /// Documents (each one or more sequences).
    pub fn num_documents(&self) -> usize {
        self.documents
    }

    /// Sequences (documents, or sentences with `--split-sentences`).
    pub fn num_sequences(&self) -> usize {
        self.sequences
    }

    /// Tokens in all sequences together.
    pub fn num_tokens(&self) -> usize {
        self.tokens.len() / self.dtype.size()
    }

    /// The tokens `range` of the stream (every sequence in order), each checked to be a token
    /// id below `vocab_size`.
    pub fn read(&self, range: std::ops::Range<usize>, vocab_size: usize) -> Result<Vec<u32>> {
        assert!(range.end <= self.num_tokens(), "IndexedDataset::read: {range:?} past {} tokens", self.num_tokens());
        let size = self.dtype.size();
        let bytes = &self.tokens[range.start * size..range.end * size];
        bytes
            .chunks_exact(size)
            .enumerate()
            .map(|(k, b)| {
                let id = self.dtype.decode(b);
                u32::try_from(id).ok().filter(|&id| (id as usize) < vocab_size).ok_or_else(|| {
                    anyhow!(
                        "token {} of {}.bin is {id}, not a token id of the model's {vocab_size}-row vocabulary: the data was written with another tokenizer (check --vocab-file, or the model's --make-vocab-size-divisible-by)",
                        range.start + k,
                        self.prefix.display()
                    )
                })
            })
            .collect()
    }

    /// Sequence `i`'s tokens (as megatron-core's `IndexedDataset[i]`), checked below `vocab_size`.
    pub fn sequence(&self, i: usize, vocab_size: usize) -> Result<Vec<u32>> {
        assert!(i < self.sequences, "IndexedDataset::sequence: {i} of {}", self.sequences);
        let (start, len) = (self.pointer(i) as usize / self.dtype.size(), self.length(i) as usize);
        self.read(start..start + len, vocab_size)
    }

    /// The sequence indices where each document starts, and the sequence count last.
    pub fn document_indices(&self) -> Vec<usize> {
        let at = HEADER_BYTES + self.sequences * 12;
        (0..=self.documents).map(|d| read_i64(&self.index, at + 8 * d) as usize).collect()
    }

    fn length(&self, i: usize) -> i32 {
        read_i32(&self.index, HEADER_BYTES + 4 * i)
    }

    fn pointer(&self, i: usize) -> i64 {
        read_i64(&self.index, HEADER_BYTES + self.sequences * 4 + 8 * i)
    }
}

/// What the `.idx` header says.
#[derive(Debug)]
struct Header {
    dtype: TokenDtype,
    sequences: usize,
    document_indices: usize,
}

fn read_u64(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

fn read_i64(b: &[u8], at: usize) -> i64 {
    i64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

fn read_i32(b: &[u8], at: usize) -> i32 {
    i32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

/// The header, and the file's size checked against its counts (with or without the multimodal
/// modes).
fn parse_header(index: &[u8]) -> Result<Header, String> {
    if index.len() < HEADER_BYTES {
        return Err(format!("{} bytes, shorter than the {HEADER_BYTES}-byte header", index.len()));
    }
    if &index[..9] != MAGIC {
        let hint = if index.starts_with(b"TNTIDX\x00\x00") {
            " (this is the older `lazy`/`cached` format: convert it with Megatron's tools, or preprocess again with the mmap format)"
        } else {
            ""
        };
        return Err(format!("it does not start with MMIDIDX{hint}"));
    }
    let version = read_u64(index, 9);
    if version != 1 {
        return Err(format!("version {version}, and Megatron's tools write version 1"));
    }
    let dtype = TokenDtype::from_code(index[17])?;
    let (sequences, document_indices) = (read_u64(index, 18), read_u64(index, 26));
    // Checked arithmetic: the counts are the file's, and a huge one must not wrap.
    let arrays = sequences
        .checked_mul(12)
        .and_then(|s| document_indices.checked_mul(8).and_then(|d| s.checked_add(d)))
        .and_then(|a| a.checked_add(HEADER_BYTES as u64));
    let len = index.len() as u64;
    match arrays {
        Some(want) if len == want || Some(len) == want.checked_add(sequences) => {}
        _ => {
            return Err(format!(
                "{len} bytes, and its header counts {sequences} sequences and {document_indices} document indices (the file is truncated, or not an index)"
            ))
        }
    }
    if document_indices == 0 {
        return Err("no document indices (even an empty dataset has its 0)".into());
    }
    Ok(Header { dtype, sequences: sequences as usize, document_indices: document_indices as usize })
}

/// Checks the lengths, pointers and document indices, and returns the bytes the sequences
/// take in `.bin`. Megatron's builder writes the sequences back to back from offset 0, which is
/// what reading the stream in place needs; other layouts are refused.
fn check_sequences(index: &[u8], h: &Header) -> Result<u64, String> {
    let size = h.dtype.size() as u64;
    let (lengths, pointers, documents) =
        (HEADER_BYTES, HEADER_BYTES + 4 * h.sequences, HEADER_BYTES + 12 * h.sequences);
    let mut offset = 0u64;
    for i in 0..h.sequences {
        let length = read_i32(index, lengths + 4 * i);
        let pointer = read_i64(index, pointers + 8 * i);
        if length < 0 {
            return Err(format!("sequence {i} has length {length}"));
        }
        if pointer < 0 || pointer as u64 != offset {
            return Err(format!(
                "sequence {i} starts at byte {pointer} of .bin, not at {offset} right after the one before (Megatron's tools write the sequences back to back)"
            ));
        }
        offset += length as u64 * size;
    }
    let mut previous = 0i64;
    for d in 0..h.document_indices {
        let at = read_i64(index, documents + 8 * d);
        let first = d == 0;
        if (first && at != 0) || at < previous || at as u64 > h.sequences as u64 {
            return Err(format!("document index {d} is {at}: they must rise from 0 to the {} sequences", h.sequences));
        }
        previous = at;
    }
    if previous as u64 != h.sequences as u64 {
        return Err(format!("the last document index is {previous}, and there are {} sequences", h.sequences));
    }
    Ok(offset)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture(name: &str) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/megatron").join(name)
    }

    /// What megatron-core's own `IndexedDataset` read from the files its builder wrote
    /// (`scripts/fixtures/megatron_indexed.py`).
    fn expected(name: &str) -> (String, Vec<Vec<u32>>, Vec<usize>) {
        let all: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(fixture("expected.json")).unwrap()).unwrap();
        let e = &all[name];
        (
            e["dtype"].as_str().unwrap().to_string(),
            serde_json::from_value(e["sequences"].clone()).unwrap(),
            serde_json::from_value(e["document_indices"].clone()).unwrap(),
        )
    }

    #[test]
    fn reads_what_megatron_core_wrote_in_both_dtypes() -> Result<()> {
        for name in ["corpus_text_document", "corpus_sentences_int32"] {
            let (dtype, sequences, documents) = expected(name);
            let ds = IndexedDataset::open(&fixture(name))?;
            assert_eq!(ds.dtype().name(), dtype, "{name}");
            assert_eq!((ds.num_sequences(), ds.num_documents()), (sequences.len(), documents.len() - 1), "{name}");
            assert_eq!(ds.document_indices(), documents, "{name}");
            for (i, want) in sequences.iter().enumerate() {
                assert_eq!(&ds.sequence(i, 50257)?, want, "{name} sequence {i}");
            }
            let stream: Vec<u32> = sequences.concat();
            assert_eq!(ds.num_tokens(), stream.len());
            assert_eq!(ds.read(0..stream.len(), 50257)?, stream, "{name}: the stream is the sequences in order");
            assert_eq!(ds.read(5..9, 50257)?, stream[5..9], "{name}");
        }
        // The same corpus both ways: the documents end where the sentences' pairs end.
        let (_, documents, _) = expected("corpus_text_document");
        let (_, sentences, _) = expected("corpus_sentences_int32");
        assert_eq!(documents.concat(), sentences.concat());
        assert_eq!(documents.len() * 2, sentences.len());
        Ok(())
    }

    #[test]
    fn a_token_beyond_the_vocabulary_is_an_error_naming_it() -> Result<()> {
        let ds = IndexedDataset::open(&fixture("corpus_text_document"))?;
        // Token 10 is the first document's <|endoftext|>, 50256.
        assert_eq!(ds.read(10..11, 50257)?, [50256]);
        let err = ds.read(8..12, 50256).unwrap_err().to_string();
        assert!(err.contains("token 10 of") && err.contains("is 50256") && err.contains("50256-row"), "{err}");
        Ok(())
    }

    #[test]
    fn prefixes_and_file_names_find_the_pair() {
        let prefix = fixture("corpus_text_document");
        let s = |p: &Path| p.to_str().unwrap().to_string();
        assert_eq!(indexed_prefix(&s(&prefix)), Some(prefix.clone()));
        assert_eq!(indexed_prefix(&(s(&prefix) + ".bin")), Some(prefix.clone()));
        assert_eq!(indexed_prefix(&(s(&prefix) + ".idx")), Some(prefix.clone()));
        assert_eq!(indexed_prefix(&s(&fixture("corpus.jsonl"))), None);
        assert_eq!(indexed_prefix(&s(&fixture("missing"))), None);
        assert_eq!(indexed_paths(Path::new("a/b.c")), (PathBuf::from("a/b.c.bin"), PathBuf::from("a/b.c.idx")));
        // A prefix that itself ends in .bin names its own pair, not a file of that name.
        let dir = tempfile::tempdir().unwrap();
        for ext in ["bin", "idx"] {
            std::fs::write(dir.path().join(format!("odd.bin.{ext}")), b"").unwrap();
        }
        let odd = dir.path().join("odd.bin");
        assert_eq!(indexed_prefix(&s(&odd)), Some(odd));
        // Half a pair is not a dataset.
        std::fs::write(dir.path().join("half.bin"), b"").unwrap();
        assert_eq!(indexed_prefix(&s(&dir.path().join("half"))), None);
    }

    #[test]
    fn debug_shows_what_was_opened() -> Result<()> {
        let ds = IndexedDataset::open(&fixture("corpus_sentences_int32"))?;
        let shown = format!("{ds:?}");
        for part in ["corpus_sentences_int32", "dtype: I32", "sequences: 24", "documents: 12", "tokens: 239"] {
            assert!(shown.contains(part), "{part}: {shown}");
        }
        Ok(())
    }

    /// Writes `idx` and `bin` as a dataset in `dir` and opens it.
    fn open_bytes(dir: &Path, idx: &[u8], bin: &[u8]) -> Result<IndexedDataset> {
        let prefix = dir.join("d");
        std::fs::write(dir.join("d.idx"), idx)?;
        std::fs::write(dir.join("d.bin"), bin)?;
        IndexedDataset::open(&prefix)
    }

    /// An index of uint16 sequences of these lengths, back to back, one document each.
    fn index(lengths: &[i32]) -> Vec<u8> {
        let mut b = MAGIC.to_vec();
        b.extend(1u64.to_le_bytes());
        b.push(8);
        b.extend((lengths.len() as u64).to_le_bytes());
        b.extend((lengths.len() as u64 + 1).to_le_bytes());
        lengths.iter().for_each(|l| b.extend(l.to_le_bytes()));
        let mut at = 0i64;
        for l in lengths {
            b.extend(at.to_le_bytes());
            at += i64::from(*l) * 2;
        }
        (0..=lengths.len() as i64).for_each(|d| b.extend(d.to_le_bytes()));
        b
    }

    #[test]
    fn malformed_pairs_are_one_error_each_never_a_panic() -> Result<()> {
        let dir = tempfile::tempdir()?;
        let bin = [1u8, 0, 2, 0, 3, 0];
        let good = index(&[2, 1]);
        let ds = open_bytes(dir.path(), &good, &bin)?;
        assert_eq!((ds.read(0..3, 10)?, ds.document_indices()), (vec![1, 2, 3], vec![0, 1, 2]));
        // With the multimodal modes after the arrays: read the same.
        let mut modes = good.clone();
        modes.extend([0u8, 0]);
        assert_eq!(open_bytes(dir.path(), &modes, &bin)?.read(0..3, 10)?, [1, 2, 3]);

        let patch = |at: usize, bytes: &[u8]| {
            let mut b = good.clone();
            b[at..at + bytes.len()].copy_from_slice(bytes);
            b
        };
        let cases: Vec<(&str, Vec<u8>, &[u8], &str)> = vec![
            ("empty", vec![], &bin, "shorter than the 34-byte header"),
            ("truncated", good[..good.len() - 3].to_vec(), &bin, "the file is truncated"),
            ("bad magic", patch(0, b"NOTANIDX\0"), &bin, "does not start with MMIDIDX"),
            ("old format", patch(0, b"TNTIDX\0\0\0"), &bin, "older `lazy`/`cached` format"),
            ("version 2", patch(9, &[2]), &bin, "version 2"),
            ("float tokens", patch(17, &[6]), &bin, "floating point"),
            ("unknown dtype", patch(17, &[9]), &bin, "unknown dtype code 9"),
            ("huge counts", patch(18, &u64::MAX.to_le_bytes()), &bin, "the file is truncated"),
            ("negative length", patch(34, &(-1i32).to_le_bytes()), &bin, "sequence 0 has length -1"),
            ("gap", patch(50, &6i64.to_le_bytes()), &bin, "sequence 1 starts at byte 6"),
            ("document past the end", patch(66, &3i64.to_le_bytes()), &bin, "document index 1 is 3"),
            ("documents fall", patch(74, &0i64.to_le_bytes()), &bin, "document index 2 is 0"),
            ("short .bin", good.clone(), &bin[..4], "holds 4 bytes"),
            ("long .bin", good.clone(), &[0u8; 8], "holds 8 bytes"),
        ];
        for (what, idx, bin, want) in cases {
            let err = open_bytes(dir.path(), &idx, bin).expect_err(what).to_string();
            assert!(err.contains(want) && err.lines().count() == 1, "{what}: {err}");
        }
        let missing = IndexedDataset::open(&dir.path().join("nothing")).unwrap_err().to_string();
        assert!(missing.contains("nothing.idx") && missing.contains("PREFIX.bin and PREFIX.idx"), "{missing}");
        Ok(())
    }

    #[test]
    fn every_dtype_decodes_little_endian_and_negative_ids_are_refused() -> Result<()> {
        assert_eq!(TokenDtype::I8.decode(&[0xff]), -1);
        assert_eq!(TokenDtype::U8.decode(&[0xff]), 255);
        assert_eq!(TokenDtype::I16.decode(&[0x01, 0x80]), -32767);
        assert_eq!(TokenDtype::U16.decode(&[0x01, 0x80]), 32769);
        assert_eq!(TokenDtype::I32.decode(&[1, 0, 0, 0x80]), i64::from(i32::MIN) + 1);
        assert_eq!(TokenDtype::I64.decode(&5i64.to_le_bytes()), 5);
        let sizes: Vec<usize> = [1, 2, 3, 4, 5, 8].iter().map(|&c| TokenDtype::from_code(c).unwrap().size()).collect();
        assert_eq!(sizes, [1, 1, 2, 4, 8, 2]);
        // int16 tokens, one of them negative.
        let dir = tempfile::tempdir()?;
        let mut idx = index(&[2]);
        idx[17] = 3;
        let ds = open_bytes(dir.path(), &idx, &[7, 0, 0xff, 0xff])?;
        let err = ds.read(0..2, 100).unwrap_err().to_string();
        assert!(err.contains("token 1 of") && err.contains("is -1"), "{err}");
        Ok(())
    }
}
