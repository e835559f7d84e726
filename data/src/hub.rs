//! Hugging Face hub datasets as parquet files: the local hub cache first (no network), the hub
//! API when online, one clear error when `HF_HUB_OFFLINE` is set and the files are missing.
//!
//! Follows the `huggingface_hub` cache layout that hf-hub 0.4 shares:
//! `<cache>/datasets--Org--Name/refs/<revision>` holds a commit hash and
//! `<cache>/datasets--Org--Name/snapshots/<commit>/<repo path>` the files. Datasets whose main
//! branch holds no parquet (script or JSON datasets, e.g. `stanfordnlp/SHP`) are read from the
//! hub's automatic conversion, the revision `refs/convert/parquet`, laid out as
//! `<config>/<split>/NNNN.parquet`. Which files form the train and eval splits is decided by the
//! caller's plan (`sources::plan_splits`), so only those files are downloaded.

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::OsString;
use std::io::IsTerminal;
use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Result};
use hf_hub::api::sync::ApiBuilder;
use hf_hub::{Cache, Repo, RepoType};

use crate::file_splits::SplitPlan;

/// The hub's automatic parquet conversion of a dataset.
pub(crate) const CONVERTED_REVISION: &str = "refs/convert/parquet";
/// Revisions tried in order: the dataset's own files, then the hub's conversion.
const REVISIONS: [&str; 2] = ["main", CONVERTED_REVISION];

/// How the hub is reached: the cache directory, whether the network may be used, and the
/// endpoint. Tests build one by hand so that no environment variable is shared between threads.
#[derive(Clone, Debug)]
pub(crate) struct HubAccess {
    pub cache: Cache,
    /// `HF_HUB_OFFLINE=1`: the cache only.
    pub offline: bool,
    /// `HF_ENDPOINT`, else `https://huggingface.co`.
    pub endpoint: Option<String>,
    /// Download progress bars (only on a terminal).
    pub progress: bool,
}

impl HubAccess {
    /// Resolved as the Python `huggingface_hub` does: the cache is `HF_HUB_CACHE`, else
    /// `HF_HOME/hub`, else `~/.cache/huggingface/hub` (hf-hub 0.4 itself reads only `HF_HOME`).
    pub(crate) fn from_env() -> Self {
        Self::from_vars(|name| std::env::var_os(name), std::io::stderr().is_terminal())
    }

    /// [`Self::from_env`] over the variables `var` gives (a test's, or the process's).
    fn from_vars(var: impl Fn(&str) -> Option<OsString>, progress: bool) -> Self {
        let non_empty = |name: &str| var(name).filter(|v| !v.is_empty());
        let text = |name: &str| var(name).and_then(|v| v.into_string().ok());
        let cache_dir = if let Some(dir) = non_empty("HF_HUB_CACHE") {
            PathBuf::from(dir)
        } else if let Some(home) = non_empty("HF_HOME") {
            PathBuf::from(home).join("hub")
        } else {
            // hf-hub's default panics without a home directory; a relative path cannot.
            let home = non_empty("HOME").map(PathBuf::from).unwrap_or_default();
            home.join(".cache").join("huggingface").join("hub")
        };
        let offline = text("HF_HUB_OFFLINE")
            .is_some_and(|v| ["1", "true", "yes", "on"].contains(&v.trim().to_ascii_lowercase().as_str()));
        let endpoint = text("HF_ENDPOINT").filter(|e| !e.trim().is_empty());
        Self { cache: Cache::new(cache_dir), offline, endpoint, progress }
    }
}

/// The files of one hub dataset chosen for training and evaluation, all on local disk.
#[derive(Clone, Debug)]
pub(crate) struct HubSnapshot {
    /// `main` or [`CONVERTED_REVISION`].
    pub revision: &'static str,
    /// The snapshot's commit hash.
    pub commit: String,
    /// Repo paths of the chosen files (train, then eval), for the fingerprint.
    pub files: Vec<String>,
    pub train: Vec<PathBuf>,
    /// `None`: the plan splits the train files 9:1.
    pub eval: Option<Vec<PathBuf>>,
}

/// What the cache holds for one dataset.
enum Cached {
    Complete(HubSnapshot),
    Missing,
    /// Some files are there but not a usable set; the reason, for the offline error.
    Partial(String),
}

/// The parquet files of hub dataset `id` (of its configuration `config`, the top-level folder
/// `load_dataset(id, config)` reads) that `plan` chooses, from the cache when it holds them all,
/// else downloaded (unless offline).
pub(crate) fn fetch_dataset(
    id: &str,
    config: Option<&str>,
    access: &HubAccess,
    plan: &dyn Fn(&[String]) -> Result<SplitPlan, String>,
) -> Result<HubSnapshot> {
    let partial = match cached_snapshot(id, config, &access.cache, plan) {
        Cached::Complete(snapshot) => return Ok(snapshot),
        Cached::Missing => None,
        Cached::Partial(reason) => Some(reason),
    };
    if access.offline {
        let cache = access.cache.path().display();
        let state = match &partial {
            None => format!("is not in the Hugging Face cache ({cache})"),
            Some(reason) => format!("is only partly in the Hugging Face cache ({cache}: {reason})"),
        };
        bail!(
            "hub dataset {id} {state} and HF_HUB_OFFLINE is set: run once online to download it \
             (unset HF_HUB_OFFLINE), or pass a local directory or file with its data"
        );
    }
    download_snapshot(id, config, access, plan)
}

/// The cached snapshot a ref of `id` points to (main first, then the parquet conversion) whose
/// parquet files make a complete plan: every planned split present, no shard missing.
fn cached_snapshot(
    id: &str,
    config: Option<&str>,
    cache: &Cache,
    plan: &dyn Fn(&[String]) -> Result<SplitPlan, String>,
) -> Cached {
    let mut partial = None;
    for revision in REVISIONS {
        let repo_dir =
            cache.path().join(Repo::with_revision(id.to_string(), RepoType::Dataset, revision.into()).folder_name());
        let Ok(commit) = std::fs::read_to_string(repo_dir.join("refs").join(revision)) else { continue };
        let commit = commit.trim().to_string();
        if commit.is_empty() || commit.contains(['/', '\\', '.']) {
            continue;
        }
        let snapshot = repo_dir.join("snapshots").join(&commit);
        let mut files = Vec::new();
        list_parquet(&snapshot, "", &mut files);
        if files.is_empty() {
            continue;
        }
        let chosen = choose_config(revision, files, config).and_then(|files| plan(&files)).and_then(|p| {
            match missing_shards(p.train.iter().chain(p.eval.iter().flatten())) {
                Some(missing) => Err(missing),
                None => Ok(p),
            }
        });
        match chosen {
            Ok(p) => {
                let local = |files: &[String]| files.iter().map(|f| snapshot.join(f)).collect();
                return Cached::Complete(HubSnapshot {
                    revision,
                    commit,
                    files: p.train.iter().chain(p.eval.iter().flatten()).cloned().collect(),
                    train: local(&p.train),
                    eval: p.eval.as_deref().map(local),
                });
            }
            Err(reason) => partial = partial.or(Some(format!("{revision} snapshot {commit}: {reason}"))),
        }
    }
    partial.map_or(Cached::Missing, Cached::Partial)
}

/// Repo-relative paths (`/`-separated) of the parquet files under `dir`, sorted; files are
/// usually symlinks into `blobs/`, and broken links (an interrupted download) are skipped.
fn list_parquet(dir: &Path, prefix: &str, out: &mut Vec<String>) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    let mut entries: Vec<_> = entries.flatten().collect();
    entries.sort_by_key(|e| e.file_name());
    for entry in entries {
        let Some(name) = entry.file_name().to_str().map(str::to_owned) else { continue };
        if name.starts_with('.') {
            continue;
        }
        let rel = format!("{prefix}{name}");
        let Ok(meta) = std::fs::metadata(entry.path()) else { continue };
        if meta.is_dir() {
            list_parquet(&entry.path(), &format!("{rel}/"), out);
        } else if meta.is_file() && name.to_ascii_lowercase().ends_with(".parquet") {
            out.push(rel);
        }
    }
}

/// The hub's parquet conversion, and datasets with several configurations, put each config in its
/// own top-level folder. The folder `config` names is used; without one, on the conversion, one
/// config or the one named `default`, several others being ambiguous.
fn choose_config(revision: &str, files: Vec<String>, config: Option<&str>) -> Result<Vec<String>, String> {
    let configs: BTreeSet<&str> = files.iter().filter_map(|f| f.split_once('/').map(|(c, _)| c)).collect();
    if let Some(config) = config {
        let prefix = format!("{config}/");
        let chosen: Vec<String> = files.iter().filter(|f| f.starts_with(&prefix)).cloned().collect();
        if chosen.is_empty() {
            let configs: Vec<&str> = configs.into_iter().collect();
            return Err(format!("has no configuration {config:?} (its folders: {})", configs.join(", ")));
        }
        return Ok(chosen);
    }
    if revision != CONVERTED_REVISION {
        return Ok(files);
    }
    if configs.len() <= 1 {
        return Ok(files);
    }
    if configs.contains("default") {
        return Ok(files.iter().filter(|f| f.starts_with("default/")).cloned().collect());
    }
    let configs: Vec<&str> = configs.into_iter().collect();
    Err(format!(
        "its parquet conversion has several configs ({}) and none is `default`; download the \
         config you want and pass its directory as a local path",
        configs.join(", ")
    ))
}

/// A sharded file set named `…-00000-of-00003…` that lacks a shard (an interrupted download).
fn missing_shards<'a>(files: impl Iterator<Item = &'a String>) -> Option<String> {
    let mut groups: BTreeMap<(String, usize), BTreeSet<usize>> = BTreeMap::new();
    for file in files {
        if let Some((stem, index, total)) = shard_of(file) {
            groups.entry((stem, total)).or_default().insert(index);
        }
    }
    groups
        .into_iter()
        .find(|((_, total), present)| present.len() != *total)
        .map(|((stem, total), present)| format!("{} of the {total} shards of {stem} are present", present.len()))
}

/// (`dir/prefix`, index, total) of a shard file name `prefix-00001-of-00004[-hash].parquet`.
fn shard_of(path: &str) -> Option<(String, usize, usize)> {
    let name = path.rsplit('/').next()?;
    let of = name.find("-of-")?;
    let before = &name[..of];
    let dash = before.rfind('-')?;
    let index: usize = before[dash + 1..].parse().ok()?;
    let digits: String = name[of + 4..].chars().take_while(char::is_ascii_digit).collect();
    let total: usize = digits.parse().ok()?;
    Some((format!("{}{}", &path[..path.len() - name.len()], &before[..dash]), index, total))
}

/// Lists the dataset on the hub (main, then its parquet conversion) and downloads the planned
/// files into the cache.
fn download_snapshot(
    id: &str,
    config: Option<&str>,
    access: &HubAccess,
    plan: &dyn Fn(&[String]) -> Result<SplitPlan, String>,
) -> Result<HubSnapshot> {
    let mut builder = ApiBuilder::from_cache(access.cache.clone()).with_progress(access.progress);
    if let Some(endpoint) = &access.endpoint {
        builder = builder.with_endpoint(endpoint.clone());
    }
    let endpoint = access.endpoint.as_deref().unwrap_or("https://huggingface.co");
    let api = builder.build().map_err(|e| anyhow!("hub dataset {id}: the hub client failed to start ({e})"))?;
    for revision in REVISIONS {
        let repo = api.repo(Repo::with_revision(id.to_string(), RepoType::Dataset, revision.into()));
        let info = match repo.info() {
            Ok(info) => info,
            Err(e) if revision == "main" => bail!(
                "cannot list hub dataset {id} at {endpoint} ({e}); check the id and your network \
                 (private or gated datasets need a token from `huggingface-cli login`), or pass a \
                 local directory or file with its data"
            ),
            Err(e) => bail!(
                "hub dataset {id} has no parquet files on its main branch and no parquet \
                 conversion ({CONVERTED_REVISION}: {e}); download its data and pass a local \
                 directory or file"
            ),
        };
        let mut files: Vec<String> = info
            .siblings
            .iter()
            .map(|s| s.rfilename.clone())
            .filter(|f| f.to_ascii_lowercase().ends_with(".parquet") && is_safe_repo_path(f))
            .collect();
        if files.is_empty() {
            continue;
        }
        files.sort();
        let files = choose_config(revision, files, config).map_err(|m| anyhow!("hub dataset {id}: {m}"))?;
        let p = plan(&files).map_err(|m| anyhow!("hub dataset {id} ({revision}): {m}"))?;
        // Files already cached for this very commit are reused; otherwise everything comes from
        // `info.sha` so that train and eval never mix two commits.
        let repo_dir = access
            .cache
            .path()
            .join(Repo::with_revision(id.to_string(), RepoType::Dataset, revision.into()).folder_name());
        let cached_commit = std::fs::read_to_string(repo_dir.join("refs").join(revision)).unwrap_or_default();
        let reuse = cached_commit.trim() == info.sha;
        let cache = access.cache.repo(Repo::with_revision(id.to_string(), RepoType::Dataset, revision.into()));
        let fetch = |file: &String| -> Result<PathBuf> {
            // What `repo.get` does, but only for a file of this very commit.
            if let Some(path) = cache.get(file).filter(|_| reuse) {
                return Ok(path);
            }
            if let Some(line) = download_line(access, file, id, endpoint) {
                eprintln!("{line}");
            }
            repo.download(file).map_err(|e| {
                anyhow!(
                    "downloading {file} of hub dataset {id} from {endpoint} failed ({e}); check \
                     your network and disk space, or pass a local directory or file with its data"
                )
            })
        };
        let train = p.train.iter().map(fetch).collect::<Result<Vec<_>>>()?;
        let eval = p.eval.as_ref().map(|e| e.iter().map(fetch).collect::<Result<Vec<_>>>()).transpose()?;
        return Ok(HubSnapshot {
            revision,
            commit: info.sha,
            files: p.train.iter().chain(p.eval.iter().flatten()).cloned().collect(),
            train,
            eval,
        });
    }
    // Unreachable in practice: the conversion either lists parquet files or fails above.
    bail!("hub dataset {id} has no parquet files; download its data and pass a local directory or file")
}

/// The line a download writes to the log; none on a terminal, where hf-hub draws a bar.
fn download_line(access: &HubAccess, file: &str, id: &str, endpoint: &str) -> Option<String> {
    (!access.progress).then(|| format!("downloading {file} of hub dataset {id} from {endpoint}"))
}

/// A repo path that stays inside the snapshot directory once joined to it.
fn is_safe_repo_path(path: &str) -> bool {
    !path.is_empty()
        && !path.starts_with('/')
        && !path.contains('\\')
        && path.split('/').all(|c| !c.is_empty() && c != "." && c != "..")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{BufRead, BufReader, Write};

    /// A hub file list is server data: names that would leave the snapshot directory are dropped.
    #[test]
    fn hub_file_names_that_escape_the_snapshot_are_refused() {
        for ok in ["data/train-00000-of-00001.parquet", "default/train/0000.parquet", "train.parquet"] {
            assert!(is_safe_repo_path(ok), "{ok}");
        }
        for bad in
            ["../../x.parquet", "/etc/passwd", "data/../../x.parquet", "./x.parquet", "a\\..\\b.parquet", "a//b", ""]
        {
            assert!(!is_safe_repo_path(bad), "{bad}");
        }
    }
    use std::net::{TcpListener, TcpStream};
    use std::sync::{Arc, Mutex};

    /// Train = paths with `train`, eval = paths with `test`; a stand-in for `sources::plan_splits`.
    fn train_test(files: &[String]) -> Result<SplitPlan, String> {
        let pick = |word: &str| files.iter().filter(|f| f.contains(word)).cloned().collect::<Vec<_>>();
        let train = pick("train");
        if train.is_empty() {
            return Err("no train files".into());
        }
        let test = pick("test");
        Ok(SplitPlan { train, eval: (!test.is_empty()).then_some(test) })
    }

    fn access(cache: &Path, offline: bool, endpoint: Option<String>) -> HubAccess {
        HubAccess { cache: Cache::new(cache.to_path_buf()), offline, endpoint, progress: false }
    }

    /// Lays out `files` as hf-hub does: `refs/<revision>` and `snapshots/<commit>/<path>`.
    fn fake_snapshot(cache: &Path, id: &str, revision: &str, commit: &str, files: &[&str]) -> Result<PathBuf> {
        let repo = cache.join(format!("datasets--{}", id.replace('/', "--")));
        let ref_path = repo.join("refs").join(revision);
        std::fs::create_dir_all(ref_path.parent().ok_or_else(|| anyhow!("no parent"))?)?;
        std::fs::write(&ref_path, commit)?;
        let snapshot = repo.join("snapshots").join(commit);
        for file in files {
            let path = snapshot.join(file);
            std::fs::create_dir_all(path.parent().ok_or_else(|| anyhow!("no parent"))?)?;
            std::fs::write(&path, format!("contents of {file}"))?;
        }
        Ok(snapshot)
    }

    #[test]
    fn shard_names_parse_and_gaps_are_found() {
        assert_eq!(
            shard_of("data/train-00001-of-00004-2a1df75c6bce91ab.parquet"),
            Some(("data/train".to_string(), 1, 4))
        );
        assert_eq!(shard_of("default/train/0000.parquet"), None);
        let files = ["data/train-00000-of-00002-a.parquet".to_string(), "data/test-00000-of-00001-b.parquet".into()];
        let missing = missing_shards(files.iter());
        assert_eq!(missing.as_deref(), Some("1 of the 2 shards of data/train are present"));
        let complete = [files[0].clone(), "data/train-00001-of-00002-c.parquet".into(), files[1].clone()];
        assert_eq!(missing_shards(complete.iter()), None);
    }

    #[test]
    fn converted_configs_prefer_default_and_reject_ambiguity() {
        let files = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let one = files(&["en/train/0000.parquet", "en/test/0000.parquet"]);
        assert_eq!(choose_config(CONVERTED_REVISION, one.clone(), None), Ok(one.clone()));
        let with_default = files(&["default/train/0000.parquet", "other/train/0000.parquet"]);
        assert_eq!(choose_config(CONVERTED_REVISION, with_default, None), Ok(files(&["default/train/0000.parquet"])));
        let err =
            choose_config(CONVERTED_REVISION, files(&["a/train/0.parquet", "b/train/0.parquet"]), None).unwrap_err();
        assert!(err.contains("several configs (a, b)"), "{err}");
        // On main the folders are the dataset's own layout, not configs.
        let main = files(&["a/train-x.parquet", "b/train-y.parquet"]);
        assert_eq!(choose_config("main", main.clone(), None), Ok(main.clone()));
        // A named configuration is its folder, on either revision (wikitext's wikitext-2-raw-v1).
        assert_eq!(choose_config("main", main.clone(), Some("b")), Ok(files(&["b/train-y.parquet"])));
        let both = files(&["a/train/0.parquet", "b/train/0.parquet"]);
        assert_eq!(choose_config(CONVERTED_REVISION, both, Some("a")), Ok(files(&["a/train/0.parquet"])));
        let err = choose_config("main", main, Some("c")).unwrap_err();
        assert!(err.contains("no configuration \"c\" (its folders: a, b)"), "{err}");
    }

    #[test]
    fn cached_snapshot_is_used_offline_with_its_commit() -> Result<()> {
        let dir = tempfile::tempdir()?;
        let snapshot = fake_snapshot(
            dir.path(),
            "org/name",
            "main",
            "c0ffee",
            &["data/train-00000-of-00001-a.parquet", "data/test-00000-of-00001-b.parquet", "README.md"],
        )?;
        let got = fetch_dataset("org/name", None, &access(dir.path(), true, None), &train_test)?;
        assert_eq!((got.revision, got.commit.as_str()), ("main", "c0ffee"));
        assert_eq!(got.train, vec![snapshot.join("data/train-00000-of-00001-a.parquet")]);
        assert_eq!(got.eval, Some(vec![snapshot.join("data/test-00000-of-00001-b.parquet")]));
        assert_eq!(got.files, vec!["data/train-00000-of-00001-a.parquet", "data/test-00000-of-00001-b.parquet"]);
        Ok(())
    }

    #[test]
    fn converted_revision_is_found_in_the_cache() -> Result<()> {
        let dir = tempfile::tempdir()?;
        // Main holds only the loading script; the conversion holds the parquet files.
        fake_snapshot(dir.path(), "org/script", "main", "aaa", &["script.py"])?;
        let snapshot =
            fake_snapshot(dir.path(), "org/script", CONVERTED_REVISION, "bbb", &["default/train/0000.parquet"])?;
        let got = fetch_dataset("org/script", None, &access(dir.path(), true, None), &train_test)?;
        assert_eq!((got.revision, got.commit.as_str()), (CONVERTED_REVISION, "bbb"));
        assert_eq!(got.train, vec![snapshot.join("default/train/0000.parquet")]);
        assert_eq!(got.eval, None);
        Ok(())
    }

    #[test]
    fn offline_miss_and_partial_cache_are_clear_errors() -> Result<()> {
        let dir = tempfile::tempdir()?;
        let err =
            fetch_dataset("org/absent", None, &access(dir.path(), true, None), &train_test).unwrap_err().to_string();
        assert!(err.contains("hub dataset org/absent is not in the Hugging Face cache"), "{err}");
        assert!(err.contains(&dir.path().display().to_string()), "{err}");
        assert!(err.contains("HF_HUB_OFFLINE") && err.contains("pass a local directory or file"), "{err}");

        fake_snapshot(dir.path(), "org/half", "main", "c1", &["data/train-00000-of-00002-a.parquet"])?;
        let err =
            fetch_dataset("org/half", None, &access(dir.path(), true, None), &train_test).unwrap_err().to_string();
        assert!(err.contains("only partly in the Hugging Face cache"), "{err}");
        assert!(err.contains("1 of the 2 shards of data/train are present"), "{err}");
        Ok(())
    }

    /// One revision of a fake hub dataset: its name, commit and files (path, bytes).
    struct FakeRevision {
        revision: &'static str,
        commit: &'static str,
        files: Vec<(&'static str, Vec<u8>)>,
    }

    /// A minimal hub: `/api/datasets/<id>/revision/<rev>` lists `files` for `rev`, and
    /// `/datasets/<id>/resolve/<rev>/<path>` serves them with the headers hf-hub reads
    /// (`x-repo-commit`, `etag`, `content-range`). One request per connection.
    fn serve_hub(id: &'static str, revisions: Vec<FakeRevision>) -> Result<String> {
        Ok(serve_hub_logged(id, revisions)?.0)
    }

    /// [`serve_hub`], with the paths it was asked for, in order.
    fn serve_hub_logged(id: &'static str, revisions: Vec<FakeRevision>) -> Result<(String, Arc<Mutex<Vec<String>>>)> {
        let listener = TcpListener::bind("127.0.0.1:0")?;
        let addr = listener.local_addr()?;
        let asked = Arc::new(Mutex::new(Vec::new()));
        let log = Arc::clone(&asked);
        std::thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                let _ = answer(stream, id, &revisions, &log);
            }
        });
        Ok((format!("http://{addr}"), asked))
    }

    fn answer(
        mut stream: TcpStream,
        id: &str,
        revisions: &[FakeRevision],
        asked: &Mutex<Vec<String>>,
    ) -> std::io::Result<()> {
        let mut reader = BufReader::new(stream.try_clone()?);
        let mut request = String::new();
        reader.read_line(&mut request)?;
        let mut range = String::new();
        loop {
            let mut line = String::new();
            if reader.read_line(&mut line)? == 0 || line.trim().is_empty() {
                break;
            }
            if let Some(v) = line.to_ascii_lowercase().strip_prefix("range: bytes=") {
                range = v.trim().to_string();
            }
        }
        let path = request.split_whitespace().nth(1).unwrap_or("");
        asked.lock().expect("the log").push(path.to_string());
        for FakeRevision { revision, commit, files } in revisions {
            let escaped = revision.replace('/', "%2F");
            if path == format!("/api/datasets/{id}/revision/{escaped}") {
                let siblings: Vec<_> = files.iter().map(|(f, _)| serde_json::json!({ "rfilename": f })).collect();
                let body = serde_json::json!({ "sha": commit, "siblings": siblings }).to_string();
                return write!(
                    stream,
                    "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                );
            }
            for (file, bytes) in files {
                if path == format!("/datasets/{id}/resolve/{escaped}/{file}") {
                    // hf-hub asks for `bytes=0-0` to learn the size, then `bytes=N-` for the body.
                    let start = range.split('-').next().and_then(|s| s.parse::<usize>().ok()).unwrap_or(0);
                    let body = if range == "0-0" { &bytes[..1] } else { &bytes[start..] };
                    let head = format!(
                        "HTTP/1.1 206 Partial Content\r\nx-repo-commit: {commit}\r\netag: \"etag-{commit}-{}\"\r\ncontent-range: bytes {start}-{}/{}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
                        file.replace('/', "-"),
                        start + body.len() - 1,
                        bytes.len(),
                        body.len()
                    );
                    stream.write_all(head.as_bytes())?;
                    return stream.write_all(body);
                }
            }
        }
        write!(stream, "HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
    }

    #[test]
    fn online_download_falls_back_to_the_parquet_conversion_then_works_offline() -> Result<()> {
        let endpoint = serve_hub(
            "org/script",
            vec![
                FakeRevision { revision: "main", commit: "mainsha", files: vec![("script.py", b"print()".to_vec())] },
                FakeRevision {
                    revision: CONVERTED_REVISION,
                    commit: "convsha",
                    files: vec![
                        ("default/train/0000.parquet", b"train bytes".to_vec()),
                        ("default/test/0000.parquet", b"test bytes".to_vec()),
                        ("other/train/0000.parquet", b"other config".to_vec()),
                    ],
                },
            ],
        )?;
        let dir = tempfile::tempdir()?;
        let got = fetch_dataset("org/script", None, &access(dir.path(), false, Some(endpoint)), &train_test)?;
        assert_eq!((got.revision, got.commit.as_str()), (CONVERTED_REVISION, "convsha"));
        assert_eq!(got.files, vec!["default/train/0000.parquet", "default/test/0000.parquet"]);
        assert_eq!(std::fs::read(&got.train[0])?, b"train bytes");
        let eval = got.eval.ok_or_else(|| anyhow!("no eval files"))?;
        assert_eq!(std::fs::read(&eval[0])?, b"test bytes");

        // The download went into the cache in hf-hub's layout, so offline now finds it.
        let again = fetch_dataset("org/script", None, &access(dir.path(), true, None), &train_test)?;
        assert_eq!(again.commit, "convsha");
        assert_eq!(std::fs::read(&again.train[0])?, b"train bytes");
        Ok(())
    }

    #[test]
    fn online_unknown_dataset_is_a_clear_error() -> Result<()> {
        let endpoint = serve_hub("org/other", vec![])?;
        let dir = tempfile::tempdir()?;
        let err = fetch_dataset("org/missing", None, &access(dir.path(), false, Some(endpoint.clone())), &train_test)
            .unwrap_err()
            .to_string();
        assert!(err.contains("cannot list hub dataset org/missing at") && err.contains(&endpoint), "{err}");
        assert!(err.contains("check the id and your network"), "{err}");
        Ok(())
    }

    #[test]
    fn the_environment_resolves_as_huggingface_hub_resolves_it() {
        let resolve = |vars: &[(&str, &str)]| {
            HubAccess::from_vars(|name| vars.iter().find(|(k, _)| *k == name).map(|(_, v)| OsString::from(v)), false)
        };
        let cache = |vars| resolve(vars).cache.path().clone();
        assert_eq!(cache(&[("HF_HUB_CACHE", "/c"), ("HF_HOME", "/h"), ("HOME", "/u")]), PathBuf::from("/c"));
        // Set but empty is unset, as in huggingface_hub.
        assert_eq!(cache(&[("HF_HUB_CACHE", ""), ("HF_HOME", "/h")]), PathBuf::from("/h/hub"));
        assert_eq!(cache(&[("HF_HOME", ""), ("HOME", "/u")]), PathBuf::from("/u/.cache/huggingface/hub"));
        assert_eq!(cache(&[]), PathBuf::from(".cache/huggingface/hub"));

        for on in ["1", "true", "TRUE", " yes ", "On"] {
            assert!(resolve(&[("HF_HUB_OFFLINE", on)]).offline, "{on:?}");
        }
        for off in ["0", "false", "", "offline"] {
            assert!(!resolve(&[("HF_HUB_OFFLINE", off)]).offline, "{off:?}");
        }
        assert!(!resolve(&[]).offline);

        assert_eq!(resolve(&[("HF_ENDPOINT", "http://mirror:8080")]).endpoint.as_deref(), Some("http://mirror:8080"));
        assert_eq!(resolve(&[("HF_ENDPOINT", "  ")]).endpoint, None);
        assert_eq!(resolve(&[]).endpoint, None);
    }

    #[test]
    fn a_log_gets_a_line_per_download_and_a_terminal_gets_hf_hubs_bar() {
        let mut to = access(Path::new("/c"), false, None);
        assert_eq!(
            download_line(&to, "data/train.parquet", "org/name", "https://huggingface.co").as_deref(),
            Some("downloading data/train.parquet of hub dataset org/name from https://huggingface.co")
        );
        to.progress = true;
        assert_eq!(download_line(&to, "data/train.parquet", "org/name", "https://huggingface.co"), None);
    }

    #[test]
    fn only_parquet_files_are_listed_and_hidden_or_broken_ones_are_not() -> Result<()> {
        let dir = tempfile::tempdir()?;
        let root = dir.path();
        for file in ["a.parquet", "B.PARQUET", "train.txt", ".hidden.parquet", "sub/c.parquet", ".git/d.parquet"] {
            std::fs::create_dir_all(root.join(file).parent().ok_or_else(|| anyhow!("no parent"))?)?;
            std::fs::write(root.join(file), "x")?;
        }
        std::fs::create_dir_all(root.join("x.parquet"))?;
        std::fs::write(root.join("x.parquet/e.parquet"), "x")?;
        // An interrupted download: the snapshot's link into blobs/ points nowhere.
        std::os::unix::fs::symlink(root.join("blobs/never-written"), root.join("broken.parquet"))?;
        std::os::unix::fs::symlink(root.join("a.parquet"), root.join("linked.parquet"))?;
        let mut files = Vec::new();
        list_parquet(root, "", &mut files);
        assert_eq!(files, ["B.PARQUET", "a.parquet", "linked.parquet", "sub/c.parquet", "x.parquet/e.parquet"]);
        Ok(())
    }

    #[test]
    fn a_ref_that_is_empty_or_a_path_is_not_followed() -> Result<()> {
        let dir = tempfile::tempdir()?;
        let repo = dir.path().join("datasets--org--odd");
        // A snapshot the refs below would reach if they were taken as paths.
        fake_snapshot(dir.path(), "org/odd", "other", "real", &["train.parquet"])?;
        std::fs::create_dir_all(dir.path().join("elsewhere"))?;
        std::fs::write(dir.path().join("elsewhere/train.parquet"), "x")?;
        for commit in ["", "\n", "../../elsewhere", "real/..", "..\\real"] {
            std::fs::write(repo.join("refs/main"), commit)?;
            let err =
                fetch_dataset("org/odd", None, &access(dir.path(), true, None), &train_test).unwrap_err().to_string();
            assert!(err.contains("is not in the Hugging Face cache"), "{commit:?}: {err}");
        }
        // A ref as hf-hub and huggingface_hub write it, and one with a newline, are followed.
        for commit in ["real", "real\n"] {
            std::fs::write(repo.join("refs/main"), commit)?;
            let got = fetch_dataset("org/odd", None, &access(dir.path(), true, None), &train_test)?;
            assert_eq!(got.commit, "real");
        }
        Ok(())
    }

    #[test]
    fn a_cache_missing_a_shard_reuses_its_commits_files_and_a_new_commit_is_downloaded_whole() -> Result<()> {
        let dir = tempfile::tempdir()?;
        let shards = ["data/train-00000-of-00002.parquet", "data/train-00001-of-00002.parquet"];
        let hub = |commit: &'static str, bytes: [&[u8]; 2]| {
            let files = shards.iter().zip(bytes).map(|(f, b)| (*f, b.to_vec())).collect();
            serve_hub_logged("org/moving", vec![FakeRevision { revision: "main", commit, files }])
        };
        let fetch = |endpoint: String| {
            fetch_dataset("org/moving", None, &access(dir.path(), false, Some(endpoint)), &train_test)
        };
        let downloaded = |asked: &Mutex<Vec<String>>| -> BTreeSet<String> {
            let asked = asked.lock().expect("the log");
            asked.iter().filter_map(|p| p.split_once("/resolve/").map(|(_, f)| f.to_string())).collect()
        };
        let contents =
            |got: &HubSnapshot| -> Result<Vec<Vec<u8>>> { got.train.iter().map(|p| Ok(std::fs::read(p)?)).collect() };

        let (endpoint, asked) = hub("one", [b"a1", b"b1"])?;
        let got = fetch(endpoint)?;
        assert_eq!(contents(&got)?, [b"a1", b"b1"]);
        assert_eq!(downloaded(&asked).len(), 2, "{asked:?}");

        // A complete cache is used as it is, without asking the hub (the hub is at a new commit).
        let (endpoint, asked) = hub("two", [b"a2", b"b2"])?;
        assert_eq!(fetch(endpoint)?.commit, "one");
        assert!(asked.lock().expect("the log").is_empty(), "{asked:?}");

        // A shard lost from the cache, the hub still at its commit: only that shard is fetched.
        std::fs::remove_file(&got.train[1])?;
        let (endpoint, asked) = hub("one", [b"a1", b"b1"])?;
        let again = fetch(endpoint)?;
        assert_eq!((again.commit.as_str(), contents(&again)?), ("one", vec![b"a1".to_vec(), b"b1".to_vec()]));
        assert_eq!(downloaded(&asked), BTreeSet::from([format!("main/{}", shards[1])]), "{asked:?}");

        // Lost again, the hub now at a new commit: both shards from it, never one of each.
        std::fs::remove_file(&again.train[1])?;
        let (endpoint, asked) = hub("two", [b"a2", b"b2"])?;
        let new = fetch(endpoint)?;
        assert_eq!((new.commit.as_str(), contents(&new)?), ("two", vec![b"a2".to_vec(), b"b2".to_vec()]));
        assert_eq!(downloaded(&asked).len(), 2, "{asked:?}");
        Ok(())
    }

    #[test]
    fn a_dataset_without_parquet_or_conversion_is_a_clear_error() -> Result<()> {
        let endpoint = serve_hub(
            "org/script",
            vec![FakeRevision { revision: "main", commit: "s", files: vec![("script.py", b"print()".to_vec())] }],
        )?;
        let dir = tempfile::tempdir()?;
        let err = fetch_dataset("org/script", None, &access(dir.path(), false, Some(endpoint)), &train_test)
            .unwrap_err()
            .to_string();
        assert!(err.contains("hub dataset org/script has no parquet files on its main branch"), "{err}");
        assert!(err.contains("and no parquet conversion (refs/convert/parquet:"), "{err}");
        Ok(())
    }
}
