//! Uploading a run's history from its directory ([`super::store`]) to the service: [`Stream`]
//! knows which lines the service holds and sends the rest; [`Uploader`] runs a stream on a
//! background thread so that training never waits for the network; `train wandb-sync` runs one
//! in the foreground.
//!
//! The queue between training and the thread is the history file itself plus a wake-up channel
//! of capacity one: logging a row is one append and a `try_send` that never blocks, and the
//! thread sends whatever lines the file holds past the service's count, so no row is dropped
//! however long the service is away.

use super::api::{backoff, complete_body, file_stream_body, Api, ApiError, Bucket, RunInfo};
use super::store::{read_history, write_atomically};
use serde_json::Value;
use std::path::PathBuf;
use std::sync::mpsc::{sync_channel, Receiver, RecvTimeoutError, SyncSender};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// Where the stream's messages go (stderr, or a test's list). Warnings start with "warning:".
pub type Say = Arc<dyn Fn(&str) + Send + Sync>;

/// The timings of an upload.
#[derive(Clone, Debug)]
pub struct Policy {
    /// One request's limit, connecting included.
    pub request_timeout: Duration,
    /// The first wait after a failed request; it doubles up to `backoff_max`.
    pub backoff_base: Duration,
    pub backoff_max: Duration,
    /// Rows are gathered this long before a request (the service is not sent one per row).
    pub batch_interval: Duration,
    /// With nothing to send, an empty request this often tells the service the run is alive
    /// (it marks a silent run as crashed after a few minutes).
    pub heartbeat: Duration,
    /// How long the end of a training run waits for the upload to finish.
    pub finish_timeout: Duration,
    pub max_lines_per_request: usize,
}

impl Default for Policy {
    fn default() -> Self {
        Self {
            request_timeout: Duration::from_secs(20),
            backoff_base: Duration::from_secs(1),
            backoff_max: Duration::from_secs(60),
            batch_interval: Duration::from_secs(2),
            heartbeat: Duration::from_secs(30),
            finish_timeout: Duration::from_secs(60),
            max_lines_per_request: 1000,
        }
    }
}

/// The service's view of one run directory's history.
pub struct Stream {
    api: Api,
    run: RunInfo,
    history: PathBuf,
    /// `remote_offset` of the directory (see [`super::store`]): the service's lines before ours.
    offset_file: PathBuf,
    bucket: Option<Bucket>,
    remote_offset: u64,
    /// Lines of the history file the service holds.
    sent: usize,
    summary: serde_json::Map<String, Value>,
}

/// The file of a run directory that holds how many of the service's history lines came before
/// the directory's first (written once, at the first connection).
pub const REMOTE_OFFSET_FILE: &str = "remote-offset";

impl Stream {
    pub fn new(api: Api, run: RunInfo, dir: &std::path::Path) -> Self {
        Self {
            api,
            run,
            history: dir.join(super::store::HISTORY_FILE),
            offset_file: dir.join(REMOTE_OFFSET_FILE),
            bucket: None,
            remote_offset: 0,
            sent: 0,
            summary: Default::default(),
        }
    }

    pub fn is_connected(&self) -> bool {
        self.bucket.is_some()
    }

    /// Lines of the history file the service holds.
    pub fn sent(&self) -> usize {
        self.sent
    }

    /// The run's page, once connected.
    pub fn url(&self) -> Option<String> {
        let bucket = self.bucket.as_ref()?;
        let app = self.api.base_url().replacen("://api.", "://", 1);
        Some(format!("{app}/{}/{}/runs/{}", bucket.entity, bucket.project, self.run.id))
    }

    /// Creates or resumes the run and learns which of the file's lines the service holds.
    pub fn connect(&mut self) -> Result<(), ApiError> {
        let bucket = self.api.upsert_run(&self.run)?;
        let local = |e: anyhow::Error| ApiError::Refused(format!("{e:#}"));
        self.remote_offset = match std::fs::read_to_string(&self.offset_file) {
            Ok(text) => text.trim().parse().map_err(|_| {
                ApiError::Refused(format!("{} is not a line count: remove it", self.offset_file.display()))
            })?,
            Err(_) => {
                let offset = bucket.history_line_count;
                write_atomically(&self.offset_file, offset.to_string().as_bytes()).map_err(local)?;
                offset
            }
        };
        let lines = read_history(&self.history, 0).map_err(local)?;
        let held = bucket.history_line_count.saturating_sub(self.remote_offset) as usize;
        self.sent = held.min(lines.len());
        self.summary.clear();
        for line in &lines[..self.sent] {
            fold_summary(&mut self.summary, line);
        }
        self.bucket = Some(bucket);
        Ok(())
    }

    /// Sends up to `max_lines` of the lines the service lacks; the number sent.
    pub fn send_pending(&mut self, max_lines: usize) -> Result<usize, ApiError> {
        let bucket = self.bucket.as_ref().ok_or_else(|| ApiError::Failed("not connected".into()))?;
        let mut lines = read_history(&self.history, self.sent).map_err(|e| ApiError::Refused(format!("{e:#}")))?;
        lines.truncate(max_lines);
        if lines.is_empty() {
            return Ok(0);
        }
        let mut summary = self.summary.clone();
        for line in &lines {
            fold_summary(&mut summary, line);
        }
        let offset = self.remote_offset + self.sent as u64;
        let summary_value = Value::Object(summary);
        self.api.file_stream(bucket, &self.run.id, &file_stream_body(offset, &lines, Some(&summary_value)))?;
        let Value::Object(summary) = summary_value else { unreachable!("built as an object") };
        self.summary = summary;
        self.sent += lines.len();
        Ok(lines.len())
    }

    /// An empty request: the run is alive.
    pub fn heartbeat(&self) -> Result<(), ApiError> {
        let bucket = self.bucket.as_ref().ok_or_else(|| ApiError::Failed("not connected".into()))?;
        self.api.file_stream(bucket, &self.run.id, &file_stream_body(0, &[], None))
    }

    /// Marks the run finished with `exit_code`.
    pub fn complete(&self, exit_code: i32) -> Result<(), ApiError> {
        let bucket = self.bucket.as_ref().ok_or_else(|| ApiError::Failed("not connected".into()))?;
        self.api.file_stream(bucket, &self.run.id, &complete_body(exit_code))
    }

    /// Connects if needed, sends every pending line, then completes the run when `exit_code`
    /// is given: one pass, the first error ends it.
    pub fn push(&mut self, max_lines: usize, exit_code: Option<i32>) -> Result<(), ApiError> {
        if !self.is_connected() {
            self.connect()?;
        }
        while self.send_pending(max_lines)? > 0 {}
        match exit_code {
            Some(code) => self.complete(code),
            None => Ok(()),
        }
    }
}

/// wandb's summary is each key's last value.
fn fold_summary(summary: &mut serde_json::Map<String, Value>, line: &str) {
    if let Ok(Value::Object(row)) = serde_json::from_str::<Value>(line) {
        summary.extend(row);
    }
}

/// How an upload ended.
#[derive(Debug)]
pub struct Outcome {
    pub url: Option<String>,
    pub sent: usize,
    /// Whether the run was marked finished.
    pub completed: bool,
}

/// The state the training thread shares with the upload thread: the exit code once the run
/// ended, and the condition variable that cuts a backoff short then.
type Finish = Arc<(Mutex<Option<i32>>, Condvar)>;

/// A [`Stream`] on its own thread.
pub struct Uploader {
    wake: SyncSender<()>,
    finish: Finish,
    done: Receiver<Outcome>,
}

impl Uploader {
    pub fn spawn(stream: Stream, policy: Policy, say: Say) -> Self {
        let (wake, wake_rx) = sync_channel(1);
        let (done_tx, done) = sync_channel(1);
        let finish: Finish = Arc::new((Mutex::new(None), Condvar::new()));
        let shared = finish.clone();
        std::thread::Builder::new()
            .name("wandb-upload".into())
            .spawn(move || {
                let outcome = upload(stream, &policy, &say, &wake_rx, &shared);
                let _ = done_tx.send(outcome);
            })
            .expect("spawning the wandb upload thread");
        Self { wake, finish, done }
    }

    /// New lines are in the file (never blocks: a wake-up already queued covers them).
    pub fn notify(&self) {
        let _ = self.wake.try_send(());
    }

    /// Tells the thread the run ended with `exit_code` and waits for it at most `timeout`;
    /// `None` when it is still busy then (it is left to the process's exit).
    pub fn finish(self, exit_code: i32, timeout: Duration) -> Option<Outcome> {
        let (lock, condvar) = &*self.finish;
        *lock.lock().unwrap_or_else(|e| e.into_inner()) = Some(exit_code);
        condvar.notify_all();
        self.notify();
        self.done.recv_timeout(timeout).ok()
    }
}

/// The upload thread: connect, then send what the file holds every `batch_interval` after a
/// wake-up, retrying with backoff; at the end, send the rest and complete the run. A refusal
/// ends the upload (the rows stay on disk); a failing service is warned about once; at the end
/// an unreachable one gets one more try rather than holding the process up.
fn upload(mut stream: Stream, policy: &Policy, say: &Say, wake: &Receiver<()>, finish: &Finish) -> Outcome {
    let exit_code = || *finish.0.lock().unwrap_or_else(|e| e.into_inner());
    let mut failures = 0u32;
    let mut warned = false;
    let mut last_request;
    let mut deadline = None;
    let completed = loop {
        let code = exit_code();
        if code.is_some() && deadline.is_none() {
            deadline = Some(Instant::now() + policy.finish_timeout);
        }
        match stream.push(policy.max_lines_per_request, code) {
            Ok(()) if code.is_some() => break true,
            Ok(()) => {
                if warned {
                    say(&format!("wandb: the service answers again; uploaded {} rows so far", stream.sent()));
                }
                (failures, warned) = (0, false);
                last_request = Instant::now();
            }
            Err(ApiError::Refused(m)) => {
                say(&format!("warning: wandb: {m}; not retrying"));
                break false;
            }
            Err(e @ (ApiError::Unreachable(_) | ApiError::Failed(_))) => {
                let unreachable = matches!(e, ApiError::Unreachable(_));
                // At the end, an unreachable service gets one try (it was already away: the
                // rows wait on disk); an erring one gets retries until the finish deadline.
                if code.is_some() && ((unreachable && warned) || deadline.is_some_and(|d| Instant::now() >= d)) {
                    break false;
                }
                let m = e.to_string();
                if !warned {
                    say(&format!("warning: wandb: {m}; training goes on, retrying in the background"));
                    warned = true;
                }
                let wait = backoff(failures, policy.backoff_base, policy.backoff_max);
                failures += 1;
                let (lock, condvar) = &**finish;
                let guard = lock.lock().unwrap_or_else(|e| e.into_inner());
                // The end of the run cuts the wait short (one last try).
                drop(condvar.wait_timeout_while(guard, wait, |code| code.is_none()));
                continue;
            }
        }
        // Healthy and not finished: wait for rows (or the end), then gather for a while.
        match wake.recv_timeout(policy.heartbeat) {
            Ok(()) | Err(RecvTimeoutError::Disconnected) => {
                let until = last_request + policy.batch_interval;
                while exit_code().is_none() && Instant::now() < until {
                    let _ = wake.recv_timeout(until.saturating_duration_since(Instant::now()));
                }
            }
            // A failed heartbeat needs no report of its own: the next push meets the same error.
            Err(RecvTimeoutError::Timeout) => drop(stream.heartbeat()),
        }
    };
    Outcome { url: stream.url(), sent: stream.sent(), completed }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_runs_page_is_on_the_app_host_once_connected() {
        let run = RunInfo {
            id: "abcd1234".into(),
            project: "proj".into(),
            entity: None,
            display_name: "actor".into(),
            group: None,
            config: Default::default(),
            host: "h".into(),
        };
        let page = |base_url: &str| {
            let api = Api::new(base_url, "k", Duration::from_secs(1)).unwrap();
            let mut stream = Stream::new(api, run.clone(), std::path::Path::new("unused"));
            assert_eq!(stream.url(), None, "not connected");
            stream.bucket = Some(Bucket { entity: "ent".into(), project: "proj".into(), history_line_count: 0 });
            stream.url()
        };
        assert_eq!(page("https://api.wandb.ai").as_deref(), Some("https://wandb.ai/ent/proj/runs/abcd1234"));
        // A local server has no api. host: its own address serves the page.
        assert_eq!(page("http://127.0.0.1:8080/").as_deref(), Some("http://127.0.0.1:8080/ent/proj/runs/abcd1234"));
    }
}
