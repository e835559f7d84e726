//! Weights & Biases: a run's metrics streamed to wandb (or kept for a later upload), without the
//! wandb SDK. `api` speaks the service's two endpoints, `store` keeps every row on disk first,
//! `stream` uploads from there on a background thread; this file resolves the settings (flags,
//! then wandb's environment variables) and ties them together as a [`WandbRun`].

pub mod api;
mod netrc;
pub mod store;
pub mod stream;

use anyhow::{bail, Context, Result};
use api::{Api, RunInfo};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::time::Duration;
use store::{RunDir, RunRecord};
use stream::{Outcome, Policy, Say, Stream, Uploader};

pub const DEFAULT_BASE_URL: &str = "https://api.wandb.ai";
/// wandb's project for runs that name none.
pub const DEFAULT_PROJECT: &str = "uncategorized";

/// WANDB_MODE.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Stream to the service as the run goes (and keep the rows on disk).
    Online,
    /// Only keep the rows on disk, for `train wandb-sync`.
    Offline,
    /// No wandb at all.
    Disabled,
}

impl Mode {
    /// WANDB_MODE's values, with the SDK's older names (`run`, `dryrun`).
    pub fn parse(text: &str) -> Result<Self> {
        match text.trim().to_ascii_lowercase().as_str() {
            "online" | "run" => Ok(Mode::Online),
            "offline" | "dryrun" => Ok(Mode::Offline),
            "disabled" => Ok(Mode::Disabled),
            other => bail!("WANDB_MODE={other:?} is not a wandb mode: use online, offline or disabled"),
        }
    }
}

/// The wandb flags of a run (`None`: not given).
#[derive(Clone, Debug, Default)]
pub struct Flags {
    pub project: Option<String>,
    pub entity: Option<String>,
    pub run_name: Option<String>,
    pub group: Option<String>,
    /// The directory of the runs' local copies (their parent: each output directory gets its
    /// own subdirectory).
    pub dir: Option<PathBuf>,
}

/// Everything a run needs to know about wandb.
#[derive(Clone, Debug, PartialEq)]
pub struct Settings {
    pub mode: Mode,
    pub base_url: String,
    pub api_key: Option<String>,
    pub project: String,
    pub entity: Option<String>,
    pub display_name: String,
    pub group: Option<String>,
    /// WANDB_RUN_ID: resume (or create) the run with this id instead of a new one.
    pub run_id: Option<String>,
    /// This output directory's run directories go here.
    pub dir: PathBuf,
}

impl Settings {
    /// The settings of a run writing to `output_dir`: each flag, else its wandb environment
    /// variable (WANDB_PROJECT, WANDB_ENTITY, WANDB_NAME, WANDB_RUN_GROUP, WANDB_DIR), else the
    /// default; the key from WANDB_API_KEY or the `~/.netrc` that `wandb login` writes. `env`
    /// reads a variable, `home` is the home directory.
    pub fn resolve(
        flags: &Flags,
        output_dir: &Path,
        env: impl Fn(&str) -> Option<String>,
        home: Option<&Path>,
    ) -> Result<Self> {
        let env = |name: &str| env(name).filter(|v| !v.trim().is_empty());
        let mode = env("WANDB_MODE").map_or(Ok(Mode::Online), |m| Mode::parse(&m))?;
        let base_url = env("WANDB_BASE_URL").unwrap_or_else(|| DEFAULT_BASE_URL.into());
        if !(base_url.starts_with("http://") || base_url.starts_with("https://")) {
            bail!("WANDB_BASE_URL={base_url:?} is not an http(s) URL: use e.g. https://api.wandb.ai");
        }
        let api_key = find_api_key(&base_url, env, home);
        if mode == Mode::Online && api_key.is_none() {
            bail!(
                "wandb needs an API key: set WANDB_API_KEY (or run `wandb login`), or WANDB_MODE=offline to keep the rows for `train wandb-sync`"
            );
        }
        let name = output_name(output_dir);
        let run_id = env("WANDB_RUN_ID");
        if let Some(id) = &run_id {
            if !id.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_') || id.len() > 128 {
                bail!("WANDB_RUN_ID={id:?}: a run id is letters, digits, - and _ (at most 128)");
            }
        }
        let parent = match flags.dir.clone().or_else(|| env("WANDB_DIR").map(PathBuf::from)) {
            Some(dir) => dir,
            None => absolute(output_dir).parent().unwrap_or(Path::new("/")).join("wandb"),
        };
        Ok(Self {
            mode,
            base_url,
            api_key,
            project: flags.project.clone().or_else(|| env("WANDB_PROJECT")).unwrap_or_else(|| DEFAULT_PROJECT.into()),
            entity: flags.entity.clone().or_else(|| env("WANDB_ENTITY")),
            display_name: flags.run_name.clone().or_else(|| env("WANDB_NAME")).unwrap_or_else(|| name.clone()),
            group: flags.group.clone().or_else(|| env("WANDB_RUN_GROUP")),
            run_id,
            dir: parent.join(name),
        })
    }
}

/// Refuses a wandb flag given while wandb is off (`given`: each flag and whether it was given):
/// it would have no effect.
pub fn refuse_flags_when_off(given: &[(&str, bool)]) -> Result<()> {
    match given.iter().find(|(_, given)| *given) {
        Some((flag, _)) => {
            bail!("{flag} is a wandb setting, and wandb is off: add --enable-wandb (or --wandb-project NAME)")
        }
        None => Ok(()),
    }
}

/// The API key for the service at `base_url`: WANDB_API_KEY, else the password of the service's
/// host in `~/.netrc` (where `wandb login` writes it).
pub fn find_api_key(base_url: &str, env: impl Fn(&str) -> Option<String>, home: Option<&Path>) -> Option<String> {
    env("WANDB_API_KEY")
        .filter(|k| !k.trim().is_empty())
        .or_else(|| home.and_then(|h| netrc_password(&h.join(".netrc"), base_url)))
}

/// The last component of an output directory (`output/step3` -> `step3`).
fn output_name(output_dir: &Path) -> String {
    absolute(output_dir).file_name().map_or_else(|| "run".into(), |n| n.to_string_lossy().to_string())
}

fn absolute(path: &Path) -> PathBuf {
    let absolute = std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf());
    absolute.components().collect() // drops "." components
}

/// The password of `base_url`'s host in a netrc file (`wandb login` writes `machine api.wandb.ai
/// login user password <key>`).
fn netrc_password(path: &Path, base_url: &str) -> Option<String> {
    let host = base_url.split("://").nth(1)?.split(['/', ':']).next()?;
    netrc::password(path, host)
}

/// The run configuration this process's flags make, as their parser resolved them (every flag
/// with its value, given or default; [`set_flags_config`]); None before any parse.
pub fn flags_config() -> Option<serde_json::Map<String, Value>> {
    FLAGS_CONFIG.lock().ok()?.clone()
}

/// Keeps `config` as this process's [`flags_config`] (the command-line parser calls it).
pub fn set_flags_config(config: serde_json::Map<String, Value>) {
    if let Ok(mut kept) = FLAGS_CONFIG.lock() {
        *kept = Some(config);
    }
}

static FLAGS_CONFIG: std::sync::Mutex<Option<serde_json::Map<String, Value>>> = std::sync::Mutex::new(None);

/// One entry of wandb's run config: the value and its description.
pub fn config_entry(value: Value, desc: Option<String>) -> Value {
    json!({"value": value, "desc": desc})
}

/// A flag's text as a config value: a number or true/false as such, else the text.
pub fn config_value(text: &str) -> Value {
    match serde_json::from_str::<Value>(text) {
        Ok(v @ (Value::Number(_) | Value::Bool(_))) => v,
        _ => Value::String(text.to_string()),
    }
}

/// A command line as wandb's config, where no parser resolved it ([`flags_config`]): `--flag
/// value` and `--flag=value` as `flag: value` (a number or true/false as such), a bare `--flag`
/// as `flag: true`; the whole line as `command`.
pub fn config_of_args(args: &[String]) -> serde_json::Map<String, Value> {
    let mut config = serde_json::Map::new();
    config.insert("command".into(), config_entry(Value::String(args.join(" ")), None));
    let mut i = 1;
    while i < args.len() {
        if let Some(flag) = args[i].strip_prefix("--").filter(|f| !f.is_empty()) {
            let (key, value) = match flag.split_once('=') {
                Some((k, v)) => (k.to_string(), config_value(v)),
                None => match args.get(i + 1).filter(|next| !next.starts_with("--")) {
                    Some(next) => {
                        i += 1;
                        (flag.to_string(), config_value(next))
                    }
                    None => (flag.to_string(), Value::Bool(true)),
                },
            };
            config.insert(key.replace('-', "_"), config_entry(value, None));
        }
        i += 1;
    }
    config
}

/// One history row as wandb stores it: the scalars, `_step`, `_runtime` (seconds since the
/// run began) and `_timestamp` (Unix time). A NaN or an infinity becomes null (JSON has none).
pub fn history_row(step: i64, runtime: f64, timestamp: f64, scalars: &[(String, f64)]) -> String {
    let mut row = serde_json::Map::new();
    for (key, x) in scalars {
        row.insert(key.clone(), serde_json::Number::from_f64(*x).map_or(Value::Null, Value::Number));
    }
    row.insert("_step".into(), json!(step));
    row.insert("_runtime".into(), json!(runtime));
    row.insert("_timestamp".into(), json!(timestamp));
    Value::Object(row).to_string()
}

fn unix_now() -> f64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64())
}

/// A new run id: 8 lowercase letters and digits, as the SDK makes them.
fn new_run_id() -> String {
    use rand::Rng;
    const ALPHABET: &[u8] = b"abcdefghijklmnopqrstuvwxyz0123456789";
    let mut rng = rand::rng();
    (0..8).map(|_| ALPHABET[rng.random_range(0..ALPHABET.len())] as char).collect()
}

/// A training run's wandb side: rows appended to its directory, uploaded in the background
/// when online.
pub struct WandbRun {
    run: RunDir,
    uploader: Option<Uploader>,
    policy: Policy,
    say: Say,
    finished: bool,
    /// The row of the latest step, written when a record of another step comes or the run
    /// finishes: a step's records (its training scalars, then its evaluation's) make one row,
    /// as wandb's `_step` names one row.
    pending: Option<PendingRow>,
}

struct PendingRow {
    step: i64,
    scalars: Vec<(String, f64)>,
    /// Unix time of the row's latest record.
    at: f64,
}

impl WandbRun {
    /// Starts the run of `settings` (`None` when WANDB_MODE=disabled) with `config`. A resumed
    /// training run (`resume`) continues the wandb run of the newest run directory, appending to
    /// its history; otherwise a new run begins in a new directory.
    pub fn start(
        settings: &Settings,
        resume: bool,
        config: serde_json::Map<String, Value>,
        policy: Policy,
        say: Say,
    ) -> Result<Option<Self>> {
        if settings.mode == Mode::Disabled {
            say("wandb: disabled by WANDB_MODE");
            return Ok(None);
        }
        let latest = if resume { RunDir::latest(&settings.dir)? } else { None };
        let run = match latest.filter(|r| settings.run_id.as_ref().is_none_or(|id| *id == r.record.id)) {
            Some(mut run) => {
                // Running again: this attempt's flags, and no exit code until it ends.
                (run.record.config, run.record.exit_code) = (config, None);
                run.save_record()?;
                run
            }
            None => RunDir::create(
                &settings.dir,
                RunRecord {
                    id: settings.run_id.clone().unwrap_or_else(new_run_id),
                    project: settings.project.clone(),
                    entity: settings.entity.clone(),
                    display_name: settings.display_name.clone(),
                    group: settings.group.clone(),
                    config,
                    host: crate::host_name(),
                    base_url: settings.base_url.clone(),
                    started_at: unix_now(),
                    exit_code: None,
                },
            )?,
        };
        let uploader = match settings.mode {
            Mode::Online => {
                let key = settings.api_key.as_deref().context("wandb: no API key")?;
                let api = Api::new(&settings.base_url, key, policy.request_timeout).map_err(anyhow::Error::msg)?;
                let stream = Stream::new(api, run_info(&run.record), &run.dir);
                say(&format!(
                    "wandb: run {} (id {}) in project {}, streaming to {}; its rows are kept in {}",
                    run.record.display_name,
                    run.record.id,
                    run.record.project,
                    settings.base_url,
                    run.dir.display()
                ));
                Some(Uploader::spawn(stream, policy.clone(), say.clone()))
            }
            Mode::Offline | Mode::Disabled => {
                say(&format!(
                    "wandb: offline; the rows are kept in {} (upload them with: train wandb-sync {0})",
                    run.dir.display()
                ));
                None
            }
        };
        Ok(Some(Self { run, uploader, policy, say, finished: false, pending: None }))
    }

    pub fn dir(&self) -> &Path {
        &self.run.dir
    }

    /// Adds these scalars to step `step`'s row: the row pending when it is that step's (a later
    /// value of a name replaces the earlier), else a new one, the pending row written first and
    /// the uploader told. Never waits for the network.
    pub fn log(&mut self, step: i64, scalars: &[(String, f64)]) -> Result<()> {
        let at = unix_now();
        if let Some(row) = self.pending.as_mut().filter(|row| row.step == step) {
            for (name, value) in scalars {
                match row.scalars.iter_mut().find(|(n, _)| n == name) {
                    Some(slot) => slot.1 = *value,
                    None => row.scalars.push((name.clone(), *value)),
                }
            }
            row.at = at;
            return Ok(());
        }
        self.write_pending()?;
        self.pending = Some(PendingRow { step, scalars: scalars.to_vec(), at });
        Ok(())
    }

    /// Appends the pending row, if any, and lets the uploader know.
    fn write_pending(&mut self) -> Result<()> {
        let Some(row) = self.pending.take() else { return Ok(()) };
        self.run.append(&history_row(row.step, row.at - self.run.record.started_at, row.at, &row.scalars))?;
        if let Some(uploader) = &self.uploader {
            uploader.notify();
        }
        Ok(())
    }

    /// Records the exit code, then gives the upload at most the policy's `finish_timeout` to
    /// send the rest and mark the run finished; says where the rows are when it could not.
    pub fn finish(&mut self, exit_code: i32) -> Result<()> {
        if std::mem::replace(&mut self.finished, true) {
            return Ok(());
        }
        self.write_pending()?;
        self.run.record.exit_code = Some(exit_code);
        self.run.save_record()?;
        let Some(uploader) = self.uploader.take() else { return Ok(()) };
        let dir = self.run.dir.display();
        match uploader.finish(exit_code, self.policy.finish_timeout) {
            Some(Outcome { url, sent, completed: true, .. }) => {
                (self.say)(&format!("wandb: uploaded {sent} rows; run finished: {}", url.unwrap_or_default()))
            }
            Some(Outcome { sent, .. }) => {
                // Counted now, not where the upload stopped: rows logged after a refusal (and
                // the last row, written above) are not uploaded either.
                let pending = store::read_history(&self.run.history_path(), sent).map_or(0, |lines| lines.len());
                (self.say)(&format!(
                    "warning: wandb: the run is not finished on the service ({pending} rows not uploaded); upload it with: train wandb-sync {dir}"
                ))
            }
            None => (self.say)(&format!(
                "warning: wandb: the upload did not end within {} s; upload the rest with: train wandb-sync {dir}",
                self.policy.finish_timeout.as_secs()
            )),
        }
        Ok(())
    }
}

impl Drop for WandbRun {
    /// A run dropped before [`WandbRun::finish`] ended in an error: exit code 1.
    fn drop(&mut self) {
        if !self.finished {
            let _ = self.finish(1);
        }
    }
}

fn run_info(record: &RunRecord) -> RunInfo {
    RunInfo {
        id: record.id.clone(),
        project: record.project.clone(),
        entity: record.entity.clone(),
        display_name: record.display_name.clone(),
        group: record.group.clone(),
        config: record.config.clone(),
        host: record.host.clone(),
    }
}

/// What `train wandb-sync` did to one run directory.
#[derive(Debug)]
pub struct Synced {
    pub dir: PathBuf,
    pub url: Option<String>,
    pub sent: usize,
    /// The exit code the run was marked finished with; `None` for a run still going or
    /// crashed (it has none to report).
    pub completed: Option<i32>,
}

/// Uploads the run directories under `dir` (a run directory, or any directory above some):
/// each one's lines the service lacks, then its exit code when it has one. `base_url` and
/// `api_key` override each run's service.
pub fn sync_dir(dir: &Path, base_url: Option<&str>, api_key: &str, policy: &Policy) -> Result<Vec<Synced>> {
    let runs = find_run_dirs(dir, 4)?;
    if runs.is_empty() {
        bail!(
            "{} holds no wandb run (a directory with {}): give a run's wandb directory",
            dir.display(),
            store::RUN_FILE
        );
    }
    let mut synced = Vec::new();
    for path in runs {
        let run = RunDir::open(&path)?;
        let api = Api::new(base_url.unwrap_or(&run.record.base_url), api_key, policy.request_timeout)
            .map_err(anyhow::Error::msg)?;
        let mut stream = Stream::new(api, run_info(&run.record), &run.dir);
        let mut attempt = 0;
        loop {
            match stream.push(policy.max_lines_per_request, run.record.exit_code) {
                Ok(()) => break,
                Err(api::ApiError::Unreachable(m) | api::ApiError::Failed(m)) if attempt < 3 => {
                    eprintln!("warning: wandb: {m}; retrying");
                    std::thread::sleep(api::backoff(attempt, policy.backoff_base, policy.backoff_max));
                    attempt += 1;
                }
                Err(e) => bail!("uploading {}: {e}", path.display()),
            }
        }
        synced.push(Synced { dir: path, url: stream.url(), sent: stream.sent(), completed: run.record.exit_code });
    }
    Ok(synced)
}

/// The run directories at or below `dir`, at most `depth` levels down, in name order.
fn find_run_dirs(dir: &Path, depth: usize) -> Result<Vec<PathBuf>> {
    if dir.join(store::RUN_FILE).is_file() {
        return Ok(vec![dir.to_path_buf()]);
    }
    let mut found = Vec::new();
    if depth == 0 {
        return Ok(found);
    }
    let entries = std::fs::read_dir(dir).with_context(|| format!("cannot read {}", dir.display()))?;
    let mut subdirs: Vec<PathBuf> = entries.flatten().map(|e| e.path()).filter(|p| p.is_dir()).collect();
    subdirs.sort();
    for sub in subdirs {
        found.extend(find_run_dirs(&sub, depth - 1)?);
    }
    Ok(found)
}

/// The default timings, with `finish_timeout` from RLHF_WANDB_FINISH_TIMEOUT (seconds) when set.
pub fn policy_from_env() -> Result<Policy> {
    policy_with_finish_timeout(std::env::var("RLHF_WANDB_FINISH_TIMEOUT").ok())
}

/// [`policy_from_env`] given RLHF_WANDB_FINISH_TIMEOUT's value.
fn policy_with_finish_timeout(finish_timeout: Option<String>) -> Result<Policy> {
    let mut policy = Policy::default();
    if let Some(text) = finish_timeout {
        let secs: f64 =
            text.trim().parse().ok().filter(|s: &f64| s.is_finite() && *s >= 0.0).with_context(|| {
                format!("RLHF_WANDB_FINISH_TIMEOUT={text:?} is not a number of seconds: use e.g. 60")
            })?;
        policy.finish_timeout = Duration::from_secs_f64(secs);
    }
    Ok(policy)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env_of(pairs: &'static [(&'static str, &'static str)]) -> impl Fn(&str) -> Option<String> {
        move |name| pairs.iter().find(|(k, _)| *k == name).map(|(_, v)| v.to_string())
    }

    #[test]
    fn flags_win_over_the_environment_and_online_needs_a_key() -> Result<()> {
        let out = Path::new("/runs/output/step3");
        let env = env_of(&[
            ("WANDB_API_KEY", "k"),
            ("WANDB_PROJECT", "env-project"),
            ("WANDB_ENTITY", "team"),
            ("WANDB_RUN_GROUP", "g"),
        ]);
        let flags = Flags { project: Some("flag-project".into()), ..Default::default() };
        let s = Settings::resolve(&flags, out, &env, None)?;
        assert_eq!(s.mode, Mode::Online);
        assert_eq!((s.project.as_str(), s.entity.as_deref()), ("flag-project", Some("team")));
        assert_eq!((s.display_name.as_str(), s.group.as_deref()), ("step3", Some("g")));
        assert_eq!(s.dir, PathBuf::from("/runs/output/wandb/step3"));
        assert_eq!(s.base_url, DEFAULT_BASE_URL);

        let none = Settings::resolve(&Flags::default(), out, env_of(&[]), None).unwrap_err().to_string();
        assert!(none.contains("WANDB_API_KEY") && none.contains("offline"), "{none}");
        let offline = Settings::resolve(&Flags::default(), out, env_of(&[("WANDB_MODE", "dryrun")]), None)?;
        assert_eq!((offline.mode, offline.project.as_str()), (Mode::Offline, DEFAULT_PROJECT));
        let bad = Settings::resolve(&Flags::default(), out, env_of(&[("WANDB_MODE", "loud")]), None);
        assert!(bad.unwrap_err().to_string().contains("online, offline or disabled"));
        let bad = Settings::resolve(
            &Flags::default(),
            out,
            env_of(&[("WANDB_MODE", "offline"), ("WANDB_RUN_ID", "a/b")]),
            None,
        );
        assert!(bad.unwrap_err().to_string().contains("WANDB_RUN_ID"));
        Ok(())
    }

    #[test]
    fn a_run_id_is_letters_digits_dashes_and_underscores_up_to_128() -> Result<()> {
        let resolve = |id: String| {
            let env = move |name: &str| match name {
                "WANDB_MODE" => Some("offline".to_string()),
                "WANDB_RUN_ID" => Some(id.clone()),
                _ => None,
            };
            Settings::resolve(&Flags::default(), Path::new("out"), env, None)
        };
        for id in ["a-b_C9".to_string(), "x".repeat(128)] {
            assert_eq!(resolve(id.clone())?.run_id, Some(id));
        }
        for id in ["x".repeat(129), "a.b".into(), "a b".into(), "ü".into()] {
            let err = resolve(id.clone()).unwrap_err().to_string();
            assert!(err.contains("a run id is letters, digits, - and _ (at most 128)"), "{id:?}: {err}");
        }
        Ok(())
    }

    #[test]
    fn a_wandb_flag_while_wandb_is_off_is_refused_naming_it() {
        assert!(refuse_flags_when_off(&[("--wandb-entity", false), ("--wandb-group", false)]).is_ok());
        let err = refuse_flags_when_off(&[("--wandb-entity", false), ("--wandb-group", true), ("--wandb-dir", true)])
            .unwrap_err()
            .to_string();
        assert!(err.starts_with("--wandb-group is a wandb setting, and wandb is off"), "{err}");
        assert!(err.contains("add --enable-wandb"), "{err}");
    }

    #[test]
    fn the_parsers_config_is_kept_for_the_run() {
        let config: serde_json::Map<String, Value> =
            [("seed".to_string(), config_entry(json!(1234), Some("Seed".into())))].into_iter().collect();
        set_flags_config(config.clone());
        assert_eq!(flags_config(), Some(config));
    }

    #[test]
    fn the_finish_timeout_is_a_non_negative_number_of_seconds() -> Result<()> {
        assert_eq!(policy_with_finish_timeout(None)?.finish_timeout, Policy::default().finish_timeout);
        for (text, secs) in [("60", 60.0), (" 2.5 ", 2.5), ("0", 0.0)] {
            let got = policy_with_finish_timeout(Some(text.into()))?.finish_timeout;
            assert_eq!(got, Duration::from_secs_f64(secs), "{text:?}");
        }
        for text in ["-1", "NaN", "inf", "a minute", ""] {
            let err = policy_with_finish_timeout(Some(text.into())).unwrap_err().to_string();
            assert!(err.contains("RLHF_WANDB_FINISH_TIMEOUT") && err.contains("use e.g. 60"), "{text:?}: {err}");
        }
        Ok(())
    }

    #[test]
    fn runs_are_found_at_most_four_levels_down_in_name_order() -> Result<()> {
        let root = tempfile::tempdir()?;
        let run_at = |path: &str| -> Result<PathBuf> {
            let dir = root.path().join(path);
            std::fs::create_dir_all(&dir)?;
            std::fs::write(dir.join(store::RUN_FILE), "{}")?;
            Ok(dir)
        };
        let (deep, b, a) = (run_at("1/2/3/4")?, run_at("b/run")?, run_at("a")?);
        run_at("1/2/3/4/5/too-deep")?;
        // A run directory's own subdirectories are not searched.
        run_at("a/inside")?;
        assert_eq!(find_run_dirs(root.path(), 4)?, [deep, a.clone(), b]);
        assert_eq!(find_run_dirs(&a, 4)?, [a]);
        assert!(find_run_dirs(&root.path().join("1"), 2)?.is_empty());
        Ok(())
    }

    #[test]
    fn a_resumed_run_continues_the_latest_run_unless_wandb_run_id_names_another() -> Result<()> {
        let out = tempfile::tempdir()?;
        let output = out.path().join("sft");
        // The directory and the run's start: a run continued keeps its start, one created in
        // the same second under the same id would have the same directory but a new start.
        let start = |id: &'static str, resume: bool| -> Result<(PathBuf, f64)> {
            let env = move |name: &str| match name {
                "WANDB_MODE" => Some("offline".to_string()),
                "WANDB_RUN_ID" => Some(id.to_string()),
                _ => None,
            };
            let settings = Settings::resolve(&Flags::default(), &output, env, None)?;
            let say: Say = std::sync::Arc::new(|_: &str| {});
            let mut run = WandbRun::start(&settings, resume, Default::default(), Policy::default(), say)?
                .ok_or_else(|| anyhow::anyhow!("wandb is on"))?;
            run.finish(0)?;
            let record = store::RunDir::open(run.dir())?.record;
            assert_eq!(record.id, id);
            Ok((run.dir().to_path_buf(), record.started_at))
        };
        let first = start("first-id", false)?;
        assert_eq!(start("first-id", true)?, first, "the same run id: the same run");
        let other = start("other-id", true)?;
        assert!(other.0 != first.0 && other.1 > first.1, "another run id: a run of its own");
        Ok(())
    }

    #[test]
    fn the_key_comes_from_the_netrc_entry_of_the_services_host() -> Result<()> {
        let home = tempfile::tempdir()?;
        std::fs::write(
            home.path().join(".netrc"),
            "machine example.com login a password nope\nmachine api.wandb.ai\n  login user\n  password secret123\n",
        )?;
        let s = Settings::resolve(&Flags::default(), Path::new("out"), env_of(&[]), Some(home.path()))?;
        assert_eq!(s.api_key.as_deref(), Some("secret123"));
        let other = env_of(&[("WANDB_BASE_URL", "http://localhost:8080")]);
        assert!(Settings::resolve(&Flags::default(), Path::new("out"), other, Some(home.path())).is_err());
        Ok(())
    }

    #[test]
    fn the_command_line_becomes_a_config_of_typed_values() {
        let args: Vec<String> = [
            "ppo",
            "--actor-learning-rate",
            "2e-4",
            "--do-sample",
            "--top-k=2",
            "--data-path",
            "demo",
            "--normalize-reward",
        ]
        .map(String::from)
        .into();
        let config = config_of_args(&args);
        let value = |k: &str| config[k]["value"].clone();
        assert_eq!(value("actor_learning_rate"), json!(2e-4));
        assert_eq!(value("do_sample"), json!(true));
        assert_eq!(value("top_k"), json!(2));
        assert_eq!(value("data_path"), json!("demo"));
        assert_eq!(value("normalize_reward"), json!(true));
        assert_eq!(value("command"), json!(args.join(" ")));
        assert_eq!(config["top_k"]["desc"], Value::Null);
    }

    #[test]
    fn a_history_row_has_wandbs_keys_and_no_nan() {
        let row = history_row(7, 1.5, 1.7e9, &[("loss".into(), 0.25), ("bad".into(), f64::NAN)]);
        let row: Value = serde_json::from_str(&row).unwrap();
        assert_eq!(row, json!({"loss": 0.25, "bad": null, "_step": 7, "_runtime": 1.5, "_timestamp": 1.7e9}));
    }
}
