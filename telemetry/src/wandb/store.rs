//! A wandb run's copy on disk, what makes the service optional: every history line is appended
//! here before anything is sent, so an unreachable service, an offline run or a crash loses
//! nothing, and `train wandb-sync` uploads it later.
//!
//! `<wandb dir>/run-<unix time>-<id>/run.json` says which run it is (id, project, config, exit
//! code once it ended) and `history.jsonl` holds its rows, one per line, each written with one
//! `write`; `<wandb dir>/latest-run` names the newest run directory, the one a resumed training
//! run continues. A new run never touches an older run's directory. `remote-offset`
//! ([`super::stream`]) records, at the first connection, how many of the service's history lines
//! came before this directory's first.

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use std::io::Write;
use std::path::{Path, PathBuf};

pub const RUN_FILE: &str = "run.json";
pub const HISTORY_FILE: &str = "history.jsonl";
pub const LATEST_FILE: &str = "latest-run";

/// `run.json`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RunRecord {
    pub id: String,
    pub project: String,
    pub entity: Option<String>,
    pub display_name: String,
    pub group: Option<String>,
    pub config: serde_json::Map<String, serde_json::Value>,
    pub host: String,
    /// The service the run was meant for (`train wandb-sync` uses it unless WANDB_BASE_URL says
    /// otherwise).
    pub base_url: String,
    /// Unix time of the run's start, in seconds.
    pub started_at: f64,
    /// Set when the training run ended (0: it succeeded); `None` while it runs or after a crash.
    pub exit_code: Option<i32>,
}

pub struct RunDir {
    pub dir: PathBuf,
    pub record: RunRecord,
    history: Option<std::fs::File>,
}

impl RunDir {
    /// A new run directory in `parent` for `record`, named the newest.
    pub fn create(parent: &Path, record: RunRecord) -> Result<Self> {
        let dir = parent.join(format!("run-{}-{}", record.started_at as u64, record.id));
        std::fs::create_dir_all(&dir)
            .with_context(|| format!("cannot create the wandb directory {}", dir.display()))?;
        let run = Self { dir, record, history: None };
        run.save_record()?;
        write_atomically(&parent.join(LATEST_FILE), run.dir.file_name().unwrap_or_default().as_encoded_bytes())?;
        Ok(run)
    }

    /// The run directory `parent/latest-run` names, if there is one.
    pub fn latest(parent: &Path) -> Result<Option<Self>> {
        let pointer = parent.join(LATEST_FILE);
        let Ok(name) = std::fs::read_to_string(&pointer) else { return Ok(None) };
        let name = name.trim();
        if name.is_empty() || name.contains('/') || name.contains('\\') || name == ".." {
            bail!("{} does not name a run directory ({name:?}): remove it to start a new wandb run", pointer.display());
        }
        Self::open(&parent.join(name)).map(Some)
    }

    /// The run in `dir` (a directory holding run.json).
    pub fn open(dir: &Path) -> Result<Self> {
        let path = dir.join(RUN_FILE);
        let text = std::fs::read_to_string(&path).with_context(|| format!("cannot read {}", path.display()))?;
        let record: RunRecord = serde_json::from_str(&text)
            .with_context(|| format!("{} is not a wandb run record of this program", path.display()))?;
        if record.id.is_empty() || !record.id.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_') {
            bail!("{}: the run id {:?} is not letters, digits, - and _", path.display(), record.id);
        }
        Ok(Self { dir: dir.to_path_buf(), record, history: None })
    }

    /// Rewrites run.json (atomically: a crash leaves the old or the new one).
    pub fn save_record(&self) -> Result<()> {
        let text = serde_json::to_string_pretty(&self.record).context("encoding run.json")?;
        write_atomically(&self.dir.join(RUN_FILE), text.as_bytes())
    }

    pub fn history_path(&self) -> PathBuf {
        self.dir.join(HISTORY_FILE)
    }

    /// Appends one history line, in one write.
    pub fn append(&mut self, line: &str) -> Result<()> {
        if self.history.is_none() {
            let path = self.history_path();
            let file = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&path)
                .with_context(|| format!("cannot open {} for appending", path.display()))?;
            self.history = Some(file);
        }
        let file = self.history.as_mut().expect("opened above");
        file.write_all(format!("{line}\n").as_bytes()).with_context(|| format!("writing {}", self.dir.display()))
    }
}

/// The whole lines of a history file from line `from` on (a crash may leave a last line
/// without its newline: it is not a line yet).
pub fn read_history(path: &Path, from: usize) -> Result<Vec<String>> {
    let text = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
        Err(e) => return Err(e).with_context(|| format!("cannot read {}", path.display())),
    };
    let whole = match text.rfind('\n') {
        Some(end) => &text[..end],
        None => return Ok(Vec::new()),
    };
    Ok(whole.split('\n').skip(from).map(str::to_string).collect())
}

/// Writes `path` through a temporary file and a rename.
pub(crate) fn write_atomically(path: &Path, bytes: &[u8]) -> Result<()> {
    durable::write_file_atomically(path, bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(id: &str) -> RunRecord {
        RunRecord {
            id: id.into(),
            project: "p".into(),
            entity: None,
            display_name: "actor".into(),
            group: None,
            config: Default::default(),
            host: "h".into(),
            base_url: "https://api.wandb.ai".into(),
            started_at: 1700000000.0,
            exit_code: None,
        }
    }

    #[test]
    fn a_new_run_gets_its_own_directory_and_becomes_the_latest() -> Result<()> {
        let parent = tempfile::tempdir()?;
        let mut first = RunDir::create(parent.path(), record("aaaa1111"))?;
        first.append("{\"_step\":1}")?;
        let second = RunDir::create(parent.path(), record("bbbb2222"))?;
        let latest = RunDir::latest(parent.path())?.expect("a latest run");
        assert_eq!(latest.record, second.record);
        assert_eq!(read_history(&first.history_path(), 0)?, ["{\"_step\":1}"]);
        assert_eq!(read_history(&second.history_path(), 0)?, Vec::<String>::new());
        Ok(())
    }

    #[test]
    fn only_whole_lines_are_history_and_a_bad_record_is_refused() -> Result<()> {
        let parent = tempfile::tempdir()?;
        let run = RunDir::create(parent.path(), record("cccc3333"))?;
        std::fs::write(run.history_path(), "a\nb\nc-torn")?;
        assert_eq!(read_history(&run.history_path(), 0)?, ["a", "b"]);
        assert_eq!(read_history(&run.history_path(), 1)?, ["b"]);
        std::fs::write(run.dir.join(RUN_FILE), r#"{"id": "../x"}"#)?;
        assert!(RunDir::open(&run.dir).is_err());
        let mut bad = record("ok");
        bad.id = "a/b".into();
        std::fs::write(run.dir.join(RUN_FILE), serde_json::to_string(&bad)?)?;
        let err = format!("{:#}", RunDir::open(&run.dir).err().expect("refused"));
        assert!(err.contains("run id"), "{err}");
        std::fs::write(parent.path().join(LATEST_FILE), "../elsewhere")?;
        assert!(RunDir::latest(parent.path()).is_err());
        Ok(())
    }

    #[test]
    fn the_latest_pointer_names_one_directory_of_the_parent_or_nothing() -> Result<()> {
        let parent = tempfile::tempdir()?;
        assert!(RunDir::latest(parent.path())?.is_none(), "no pointer, no latest run");
        let run = RunDir::create(parent.path(), record("dddd-4_4"))?;
        std::fs::write(
            parent.path().join(LATEST_FILE),
            format!("{}\n", run.dir.file_name().unwrap().to_string_lossy()),
        )?;
        assert_eq!(RunDir::latest(parent.path())?.expect("the run").dir, run.dir);
        for name in ["", " \n", "a/b", "a\\b", ".."] {
            std::fs::write(parent.path().join(LATEST_FILE), name)?;
            let err = RunDir::latest(parent.path()).err().expect("refused").to_string();
            assert!(err.contains("does not name a run directory") && err.contains("remove it"), "{name:?}: {err}");
        }
        Ok(())
    }

    #[test]
    fn a_run_id_of_letters_digits_dashes_and_underscores_opens_and_no_other() -> Result<()> {
        let parent = tempfile::tempdir()?;
        let run = RunDir::create(parent.path(), record("Ab9-_x"))?;
        assert_eq!(RunDir::open(&run.dir)?.record.id, "Ab9-_x");
        for id in ["", "a.b", "a b", "ü"] {
            std::fs::write(run.dir.join(RUN_FILE), serde_json::to_string(&record(id))?)?;
            let err = format!("{:#}", RunDir::open(&run.dir).err().expect("refused"));
            assert!(err.contains("is not letters, digits, - and _"), "{id:?}: {err}");
        }
        Ok(())
    }

    #[test]
    fn a_history_that_cannot_be_read_is_an_error_and_a_missing_one_is_empty() -> Result<()> {
        let dir = tempfile::tempdir()?;
        assert!(read_history(&dir.path().join("absent.jsonl"), 0)?.is_empty());
        let err = format!("{:#}", read_history(dir.path(), 0).expect_err("a directory is no history"));
        assert!(err.contains("cannot read"), "{err}");
        Ok(())
    }
}
