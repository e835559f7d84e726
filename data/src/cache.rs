//! The tokenized-dataset cache under `--data-output-path` (DS-Chat caches its phase datasets there
//! as `.pt` files keyed by a hash of the arguments). Ours are safetensors files, never pickle,
//! named by a hash of everything that shapes their contents (sources and their fingerprints,
//! split, phase, seed, tokenizer, lengths, masking), written atomically so that concurrent ranks
//! and interrupted runs never leave a half-written file, and checked on load: a file that does
//! not parse, or whose recorded key differs, is rebuilt rather than trusted.
//!
//! The cache is untrusted input that a run trains on, so it is kept private: the default
//! directory is per user ([`default_cache_dir`]), directories are created 0700 and files 0600
//! (the temporary file with `O_EXCL | O_NOFOLLOW`), a directory that another user owns or could
//! write into is refused ([`check_cache_dir`]), a symlinked entry is never followed, and every
//! entry carries the SHA-256 of its data, checked before use.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Context, Result};
use safetensors::tensor::{Dtype, TensorView};
use sha2::{Digest, Sha256};
use std::ffi::OsStr;
use std::io::Read;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};

/// Bumped whenever the cached layout or the meaning of a field changes.
pub const CACHE_FORMAT_VERSION: u32 = 2;

/// 64-bit FNV-1a: a stable hash (Rust's `DefaultHasher` may change between releases), enough to
/// name cache files; the full key is stored inside the file and compared on load.
pub fn fnv1a64(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// The default cache directory: `$XDG_CACHE_HOME/rlhf-rs/data_files` (an absolute
/// `XDG_CACHE_HOME`, as the XDG spec asks), else `$HOME/.cache/rlhf-rs/data_files`.
pub fn default_cache_dir(xdg_cache_home: Option<&OsStr>, home: Option<&OsStr>) -> Result<PathBuf> {
    let base = match (xdg_cache_home.map(Path::new).filter(|p| p.is_absolute()), home) {
        (Some(xdg), _) => xdg.to_path_buf(),
        (None, Some(home)) if !home.is_empty() => Path::new(home).join(".cache"),
        _ => bail!("neither XDG_CACHE_HOME nor HOME is set, so there is no private data cache: set --data-output-path (or --no-data-cache)"),
    };
    Ok(base.join("rlhf-rs").join("data_files"))
}

/// Creates `dir` (mode 0700) if needed and refuses it when it is not a real directory owned by
/// this user and closed to other users' writes: anyone who can write there could plant a
/// dataset that a later run trains on.
pub fn check_cache_dir(dir: &Path) -> Result<()> {
    std::fs::DirBuilder::new().recursive(true).mode(0o700).create(dir).map_err(|e| {
        anyhow!(
            "cannot create the data cache directory {} ({e}); set --data-output-path to a writable directory",
            dir.display()
        )
    })?;
    let meta = std::fs::symlink_metadata(dir).with_context(|| format!("cannot inspect {}", dir.display()))?;
    // SAFETY: geteuid has no preconditions and cannot fail.
    let me = unsafe { libc::geteuid() };
    if meta.file_type().is_symlink() || !meta.is_dir() {
        bail!(
            "the data cache {} is a symlink or not a directory: refused; set --data-output-path to a private directory",
            dir.display()
        );
    }
    if meta.uid() != me {
        bail!(
            "the data cache directory {} belongs to another user (uid {}): refused, since they could plant datasets; set --data-output-path to a directory of your own",
            dir.display(),
            meta.uid()
        );
    }
    if meta.mode() & 0o022 != 0 {
        bail!(
            "the data cache directory {} is writable by other users (mode {:o}): refused, since they could plant datasets; run `chmod go-w {}` or set --data-output-path to a private directory",
            dir.display(),
            meta.mode() & 0o777,
            dir.display()
        );
    }
    Ok(())
}

/// SHA-256 of the tensors' names and bytes, in the order given (the file's own, sorted).
fn content_hash<'a>(tensors: impl Iterator<Item = (&'a str, &'a [u8])>) -> String {
    let mut hash = Sha256::new();
    for (name, bytes) in tensors {
        hash.update((name.len() as u64).to_le_bytes());
        hash.update(name.as_bytes());
        hash.update((bytes.len() as u64).to_le_bytes());
        hash.update(bytes);
    }
    hash.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

/// Variable-length token sequences stored column by column (`chosen`, `rejected`, ...).
pub type Columns = Vec<(String, Vec<Vec<u32>>)>;

/// The cache file for `key` (a JSON value naming every input) with the given file-name prefix.
pub fn cache_path(dir: &Path, prefix: &str, key: &serde_json::Value) -> PathBuf {
    let text = key.to_string(); // serde_json maps keep insertion order: build keys deterministically
    dir.join(format!("{prefix}_{:016x}.safetensors", fnv1a64(text.as_bytes())))
}

/// Writes `columns`, the key and `info` (JSON kept beside the data, e.g. row counts) to `path`
/// atomically (temporary file in the same directory, then rename). Each column is stored as its
/// concatenated ids plus the length of every sequence.
pub fn save(path: &Path, key: &serde_json::Value, columns: &Columns, info: &serde_json::Value) -> Result<()> {
    let dir = path.parent().with_context(|| format!("cache path {} has no parent directory", path.display()))?;
    check_cache_dir(dir)?;
    let mut buffers: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    for (name, rows) in columns {
        let flat: Vec<u8> = rows.iter().flatten().flat_map(|id| id.to_le_bytes()).collect();
        let lens: Vec<u8> = rows.iter().flat_map(|r| (r.len() as u32).to_le_bytes()).collect();
        buffers.push((format!("{name}.ids"), vec![flat.len() / 4], flat));
        buffers.push((format!("{name}.lens"), vec![rows.len()], lens));
    }
    let views: Vec<(String, TensorView)> = buffers
        .iter()
        .map(|(n, shape, bytes)| Ok((n.clone(), TensorView::new(Dtype::U32, shape.clone(), bytes)?)))
        .collect::<Result<_, safetensors::SafeTensorError>>()?;
    let mut sorted: Vec<&(String, Vec<usize>, Vec<u8>)> = buffers.iter().collect();
    sorted.sort_by(|a, b| a.0.cmp(&b.0));
    let sha256 = content_hash(sorted.iter().map(|(n, _, b)| (n.as_str(), b.as_slice())));
    let metadata = HashMap::from([
        ("sha256".to_string(), sha256),
        ("key".to_string(), key.to_string()),
        ("format_version".to_string(), CACHE_FORMAT_VERSION.to_string()),
        ("info".to_string(), info.to_string()),
    ]);
    let bytes = safetensors::tensor::serialize(views, Some(metadata))?;

    // Readable by its user only; created anew (O_EXCL), never written through a file or symlink
    // someone else placed at the temporary name.
    if let Err(e) = durable::write_file_atomically_with_mode(path, &bytes, 0o600) {
        bail!("cannot write the data cache {} ({e:#}); set --data-output-path to a writable directory", path.display());
    }
    Ok(())
}

/// The columns and info cached at `path` for `key`, or `None` when there is no usable cache
/// (missing, unreadable, another format version or another key): the caller rebuilds it.
/// A symlink is not followed, and an entry whose data does not match its recorded SHA-256
/// (tampered with or damaged) is refused with a warning.
pub fn load(path: &Path, key: &serde_json::Value, names: &[&str]) -> Option<(Columns, serde_json::Value)> {
    let mut file = std::fs::OpenOptions::new().read(true).custom_flags(libc::O_NOFOLLOW).open(path).ok()?;
    if !file.metadata().ok()?.is_file() {
        return None;
    }
    let mut bytes = Vec::new();
    file.read_to_end(&mut bytes).ok()?;
    let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).ok()?;
    let metadata = meta.metadata().as_ref()?;
    if metadata.get("format_version")? != &CACHE_FORMAT_VERSION.to_string() || metadata.get("key")? != &key.to_string()
    {
        return None;
    }
    let info: serde_json::Value = serde_json::from_str(metadata.get("info")?).ok()?;
    let st = safetensors::SafeTensors::deserialize(&bytes).ok()?;
    let mut tensors = st.tensors();
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    let actual = content_hash(tensors.iter().map(|(n, v)| (n.as_str(), v.data())));
    if metadata.get("sha256") != Some(&actual) {
        eprintln!(
            "warning: the data cache {} does not match its recorded SHA-256 (damaged or tampered with): rebuilding it",
            path.display()
        );
        return None;
    }
    let u32s = |name: &str| -> Option<Vec<u32>> {
        let view = st.tensor(name).ok()?;
        if view.dtype() != Dtype::U32 {
            return None;
        }
        Some(view.data().chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect())
    };
    let mut columns = Vec::new();
    for name in names {
        let flat = u32s(&format!("{name}.ids"))?;
        let lens = u32s(&format!("{name}.lens"))?;
        if lens.iter().map(|&l| l as usize).sum::<usize>() != flat.len() {
            return None;
        }
        let mut rows = Vec::with_capacity(lens.len());
        let mut at = 0;
        for len in lens {
            rows.push(flat[at..at + len as usize].to_vec());
            at += len as usize;
        }
        columns.push((name.to_string(), rows));
    }
    Some((columns, info))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn fnv1a64_matches_the_published_test_vectors() {
        assert_eq!(fnv1a64(b""), 0xcbf29ce484222325);
        assert_eq!(fnv1a64(b"a"), 0xaf63dc4c8601ec8c);
        assert_eq!(fnv1a64(b"foobar"), 0x85944171f73967e8);
    }

    #[test]
    fn columns_round_trip_and_a_changed_key_or_corrupt_file_is_a_miss() -> Result<()> {
        let dir = tempfile::tempdir()?;
        let key = json!({"phase": 1, "seed": 3});
        let path = cache_path(dir.path(), "phase1", &key);
        let columns: Columns = vec![
            ("ids".into(), vec![vec![1, 2, 3], vec![], vec![50256]]),
            ("prompt_len".into(), vec![vec![2], vec![0], vec![1]]),
        ];
        assert!(load(&path, &key, &["ids", "prompt_len"]).is_none(), "nothing cached yet");
        save(&path, &key, &columns, &json!({"kept": 3}))?;
        assert_eq!(load(&path, &key, &["ids", "prompt_len"]), Some((columns.clone(), json!({"kept": 3}))));
        // Only the final file remains: the temporary one was renamed.
        assert_eq!(std::fs::read_dir(dir.path())?.count(), 1);

        let other = json!({"phase": 1, "seed": 4});
        assert_ne!(cache_path(dir.path(), "phase1", &other), path, "another key, another file");
        assert!(load(&path, &other, &["ids"]).is_none(), "a key mismatch is never trusted");
        assert!(load(&path, &key, &["missing_column"]).is_none());

        let bytes = std::fs::read(&path)?;
        std::fs::write(&path, &bytes[..bytes.len() - 3])?;
        assert!(load(&path, &key, &["ids", "prompt_len"]).is_none(), "a truncated file is rebuilt");
        Ok(())
    }

    fn sample() -> (serde_json::Value, Columns) {
        (json!({"phase": 2}), vec![("ids".into(), vec![vec![7, 8, 9], vec![10]])])
    }

    #[test]
    fn files_are_private_and_a_tampered_or_symlinked_entry_is_not_used() -> Result<()> {
        let root = tempfile::tempdir()?;
        let dir = root.path().join("a/cache");
        let (key, columns) = sample();
        let path = cache_path(&dir, "phase2", &key);
        save(&path, &key, &columns, &json!({}))?;
        assert_eq!(std::fs::metadata(&dir)?.mode() & 0o777, 0o700, "directories 0700");
        assert_eq!(std::fs::metadata(&path)?.mode() & 0o777, 0o600, "files 0600");
        assert!(load(&path, &key, &["ids"]).is_some());

        // One token id changed inside the data, the file otherwise valid: the hash catches it.
        let mut bytes = std::fs::read(&path)?;
        let at = bytes.len() - 12; // inside `ids.ids`, the last tensor's data
        bytes[at] ^= 1;
        std::fs::write(&path, &bytes)?;
        assert!(safetensors::SafeTensors::deserialize(&bytes).is_ok(), "still a well-formed file");
        assert!(load(&path, &key, &["ids"]).is_none(), "a tampered entry is never used");

        // A symlink planted at the entry's name is not followed, even to a valid entry.
        let elsewhere = root.path().join("valid.safetensors");
        save(&elsewhere, &key, &columns, &json!({}))?;
        std::fs::remove_file(&path)?;
        std::os::unix::fs::symlink(&elsewhere, &path)?;
        assert!(load(&path, &key, &["ids"]).is_none(), "symlinks are not followed");
        // Saving replaces the link itself and leaves its target alone.
        save(&path, &key, &columns, &json!({}))?;
        assert!(!std::fs::symlink_metadata(&path)?.file_type().is_symlink());
        assert!(load(&path, &key, &["ids"]).is_some());
        Ok(())
    }

    #[test]
    fn a_cache_directory_others_can_write_or_own_is_refused() -> Result<()> {
        let root = tempfile::tempdir()?;
        let open = root.path().join("open");
        std::fs::create_dir(&open)?;
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777))?;
        let (key, columns) = sample();
        let err = save(&cache_path(&open, "phase2", &key), &key, &columns, &json!({})).unwrap_err().to_string();
        assert!(err.contains("writable by other users") && err.contains("chmod go-w") && !err.contains('\n'), "{err}");
        assert_eq!(std::fs::read_dir(&open)?.count(), 0, "nothing written into it");

        let link = root.path().join("link");
        std::os::unix::fs::symlink(root.path().join("elsewhere"), &link)?;
        std::fs::create_dir(root.path().join("elsewhere"))?;
        let err = check_cache_dir(&link).unwrap_err().to_string();
        assert!(err.contains("symlink"), "{err}");
        // A regular file where the directory should be is refused when it is created; the
        // `!is_dir()` beside `is_symlink()` covers it being swapped in between the two calls.
        let file = root.path().join("file");
        std::fs::write(&file, b"not a directory")?;
        let err = check_cache_dir(&file).unwrap_err().to_string();
        assert!(err.contains("cannot create the data cache directory") && err.contains("--data-output-path"), "{err}");
        assert_eq!(std::fs::read(&file)?, b"not a directory", "the file is left as it was");

        // SAFETY: geteuid cannot fail.
        if unsafe { libc::geteuid() } == 0 {
            let theirs = root.path().join("theirs");
            std::fs::create_dir(&theirs)?;
            std::os::unix::fs::chown(&theirs, Some(65534), Some(65534))?;
            let err = check_cache_dir(&theirs).unwrap_err().to_string();
            assert!(err.contains("belongs to another user"), "{err}");
        } else {
            println!("skipped the other-owner case: it needs root to give a directory away");
        }
        Ok(())
    }

    #[test]
    fn the_default_directory_is_per_user_and_honours_xdg_cache_home() -> Result<()> {
        let os = |s: &'static str| Some(OsStr::new(s));
        assert_eq!(default_cache_dir(os("/x/cache"), os("/home/u"))?, Path::new("/x/cache/rlhf-rs/data_files"));
        assert_eq!(default_cache_dir(None, os("/home/u"))?, Path::new("/home/u/.cache/rlhf-rs/data_files"));
        // The XDG spec ignores a relative XDG_CACHE_HOME.
        assert_eq!(default_cache_dir(os("rel"), os("/home/u"))?, Path::new("/home/u/.cache/rlhf-rs/data_files"));
        let err = default_cache_dir(None, None).unwrap_err().to_string();
        assert!(err.contains("--data-output-path"), "{err}");
        // An empty HOME is no home: `.cache` relative to the working directory would be a cache
        // shared with whoever else runs there.
        let err = default_cache_dir(None, os("")).unwrap_err().to_string();
        assert!(err.contains("neither XDG_CACHE_HOME nor HOME is set"), "{err}");
        let err = default_cache_dir(os(""), os("")).unwrap_err().to_string();
        assert!(err.contains("--data-output-path"), "{err}");
        Ok(())
    }
}
