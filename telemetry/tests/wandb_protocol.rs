//! The wandb client against a local service started by each test: every request's method,
//! path, auth and body checked; the service slow, down, failing and refusing; offline runs and
//! `wandb-sync`; resumed runs.

use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use telemetry::wandb::api::{Api, RunInfo};
use telemetry::wandb::stream::{Policy, Say, Stream, Uploader};
use telemetry::wandb::{config_of_args, store, sync_dir, Flags, Mode, Settings, WandbRun};

const KEY: &str = "testkey";
/// base64("api:testkey"): HTTP basic auth as the wandb SDK sends it.
const AUTH: &str = "Basic YXBpOnRlc3RrZXk=";

#[derive(Clone, Debug)]
struct Request {
    method: String,
    path: String,
    auth: Option<String>,
    body: Value,
}

/// What the fake service does with the next requests.
#[derive(Default)]
struct Behaviour {
    /// Answer this status (and nothing else) to the next `count` file_stream requests.
    fail_stream: Option<(u16, usize)>,
    /// Answer this status to every GraphQL request.
    refuse_graphql: Option<u16>,
    /// Wait this long before answering.
    delay: Duration,
}

#[derive(Default)]
struct RunState {
    history: Vec<String>,
    summary: Value,
    exit_code: Option<i64>,
    upserts: usize,
}

#[derive(Default)]
struct State {
    requests: Vec<Request>,
    runs: BTreeMap<String, RunState>,
    behaviour: Behaviour,
}

/// A wandb service on a free local port: GraphQL `upsertBucket` (entity "ent") and file_stream,
/// holding each run's history. An offset that is not the history's length is a 400: a client
/// that re-sends or skips lines is caught.
struct FakeWandb {
    url: String,
    state: Arc<Mutex<State>>,
    stop: Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl FakeWandb {
    fn start() -> Self {
        let server = tiny_http::Server::http("127.0.0.1:0").expect("a local port");
        let url = format!("http://{}", server.server_addr().to_ip().expect("an IP address"));
        let state = Arc::new(Mutex::new(State::default()));
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (s, st) = (state.clone(), stop.clone());
        let thread = std::thread::spawn(move || {
            while !st.load(std::sync::atomic::Ordering::SeqCst) {
                let Ok(Some(mut request)) = server.recv_timeout(Duration::from_millis(20)) else { continue };
                let mut body = String::new();
                std::io::Read::read_to_string(request.as_reader(), &mut body).expect("a body");
                let auth = request
                    .headers()
                    .iter()
                    .find(|h| h.field.equiv("Authorization"))
                    .map(|h| h.value.as_str().to_string());
                let req = Request {
                    method: request.method().as_str().to_string(),
                    path: request.url().to_string(),
                    auth,
                    body: serde_json::from_str(&body).unwrap_or(Value::Null),
                };
                let delay = s.lock().unwrap().behaviour.delay;
                std::thread::sleep(delay);
                let (status, answer) = answer(&mut s.lock().unwrap(), req);
                let response = tiny_http::Response::from_string(answer.to_string()).with_status_code(status);
                let _ = request.respond(response);
            }
        });
        Self { url, state, stop, thread: Some(thread) }
    }

    fn requests(&self) -> Vec<Request> {
        self.state.lock().unwrap().requests.clone()
    }

    fn history(&self, id: &str) -> Vec<Value> {
        let state = self.state.lock().unwrap();
        state.runs.get(id).map_or(Vec::new(), |r| r.history.iter().map(|l| serde_json::from_str(l).unwrap()).collect())
    }

    fn exit_code(&self, id: &str) -> Option<i64> {
        self.state.lock().unwrap().runs.get(id).and_then(|r| r.exit_code)
    }

    fn set(&self, f: impl FnOnce(&mut Behaviour)) {
        f(&mut self.state.lock().unwrap().behaviour)
    }
}

impl Drop for FakeWandb {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The fake service's answer to one request (recorded first).
fn answer(state: &mut State, req: Request) -> (u16, Value) {
    state.requests.push(req.clone());
    if req.method != "POST" || req.auth.as_deref() != Some(AUTH) {
        return (401, json!({"error": "unauthorized"}));
    }
    if req.path == "/graphql" {
        if let Some(status) = state.behaviour.refuse_graphql {
            return (status, json!({"error": "refused"}));
        }
        let vars = &req.body["variables"];
        let id = vars["name"].as_str().unwrap_or_default().to_string();
        let run = state.runs.entry(id.clone()).or_default();
        run.upserts += 1;
        let bucket = json!({
            "id": format!("storage-{id}"), "name": id, "displayName": vars["displayName"],
            "historyLineCount": run.history.len(),
            "project": {"name": vars["project"], "entity": {"name": vars["entity"].as_str().unwrap_or("ent")}},
        });
        return (200, json!({"data": {"upsertBucket": {"bucket": bucket, "inserted": run.upserts == 1}}}));
    }
    let parts: Vec<&str> = req.path.trim_start_matches('/').split('/').collect();
    let ["files", "ent", "proj", id, "file_stream"] = parts[..] else { return (404, json!({"error": "no route"})) };
    if let Some((status, count)) = state.behaviour.fail_stream {
        state.behaviour.fail_stream = (count > 1).then_some((status, count - 1));
        return (status, json!({"error": "injected"}));
    }
    let Some(run) = state.runs.get_mut(id) else { return (404, json!({"error": "no such run"})) };
    if let Some(history) = req.body["files"].get("wandb-history.jsonl") {
        if history["offset"].as_u64() != Some(run.history.len() as u64) {
            return (400, json!({"error": "offset is not the history's length"}));
        }
        run.history.extend(history["content"].as_array().unwrap().iter().map(|l| l.as_str().unwrap().to_string()));
    }
    if let Some(summary) = req.body["files"].get("wandb-summary.json") {
        run.summary = serde_json::from_str(summary["content"][0].as_str().unwrap()).unwrap();
    }
    if req.body["complete"] == json!(true) {
        run.exit_code = req.body["exitcode"].as_i64();
    }
    (200, json!({"exitcode": null, "limits": {}}))
}

fn fast_policy() -> Policy {
    Policy {
        request_timeout: Duration::from_secs(2),
        backoff_base: Duration::from_millis(50),
        backoff_max: Duration::from_millis(200),
        batch_interval: Duration::from_millis(50),
        heartbeat: Duration::from_secs(5),
        finish_timeout: Duration::from_secs(10),
        max_lines_per_request: 16,
    }
}

fn settings(mode: Mode, base_url: &str, output: &Path) -> Settings {
    let env = move |name: &str| match name {
        "WANDB_API_KEY" => Some(KEY.to_string()),
        "WANDB_BASE_URL" => Some(base_url.to_string()),
        "WANDB_MODE" => Some(if mode == Mode::Offline { "offline" } else { "online" }.to_string()),
        _ => None,
    };
    let flags = Flags { project: Some("proj".into()), ..Default::default() };
    Settings::resolve(&flags, output, env, None).expect("valid settings")
}

/// Messages the client printed.
fn collector() -> (Say, Arc<Mutex<Vec<String>>>) {
    let lines = Arc::new(Mutex::new(Vec::new()));
    let l = lines.clone();
    (Arc::new(move |line: &str| l.lock().unwrap().push(line.to_string())), lines)
}

fn warnings(lines: &Mutex<Vec<String>>) -> Vec<String> {
    lines.lock().unwrap().iter().filter(|l| l.starts_with("warning:")).cloned().collect()
}

/// A new wandb run in `mode` for the output directory `output`, and the messages it prints.
fn start_run(mode: Mode, base_url: &str, output: &Path, policy: Policy) -> (WandbRun, Arc<Mutex<Vec<String>>>) {
    let (say, said) = collector();
    let s = settings(mode, base_url, output);
    (WandbRun::start(&s, false, Default::default(), policy, say).unwrap().unwrap(), said)
}

/// Logs `n` rows (step `start + i`, loss 1/(i+1)); the longest a `log` call took.
fn log_rows(run: &mut WandbRun, start: i64, n: usize) -> Duration {
    let mut slowest = Duration::ZERO;
    for i in 0..n {
        let t = Instant::now();
        run.log(start + i as i64, &[("loss".into(), 1.0 / (i + 1) as f64), ("lr".into(), 1e-3)]).unwrap();
        slowest = slowest.max(t.elapsed());
    }
    slowest
}

fn run_id(run: &WandbRun) -> String {
    store::RunDir::open(run.dir()).unwrap().record.id
}

fn local_history(dir: &Path) -> Vec<Value> {
    store::read_history(&dir.join(store::HISTORY_FILE), 0)
        .unwrap()
        .iter()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

#[test]
fn a_run_streams_its_config_rows_summary_and_exit_code() {
    let service = FakeWandb::start();
    let out = tempfile::tempdir().unwrap();
    let (say, said) = collector();
    let args: Vec<String> = ["sft", "--learning-rate", "0.1", "--zero-stage", "2"].map(String::from).into();
    let s = settings(Mode::Online, &service.url, &out.path().join("actor"));
    let mut run = WandbRun::start(&s, false, config_of_args(&args), fast_policy(), say).unwrap().unwrap();
    let id = run_id(&run);
    log_rows(&mut run, 0, 40);
    run.finish(0).unwrap();

    let requests = service.requests();
    let upsert = &requests[0];
    assert_eq!((upsert.method.as_str(), upsert.path.as_str()), ("POST", "/graphql"));
    assert!(upsert.body["query"].as_str().unwrap().contains("upsertBucket("));
    let vars = &upsert.body["variables"];
    assert_eq!((vars["name"].as_str(), vars["project"].as_str()), (Some(id.as_str()), Some("proj")));
    assert_eq!((vars["entity"].clone(), vars["displayName"].as_str()), (Value::Null, Some("actor")));
    let config: Value = serde_json::from_str(vars["config"].as_str().unwrap()).unwrap();
    assert_eq!(config["learning_rate"], json!({"value": 0.1, "desc": null}));
    assert_eq!(config["zero_stage"]["value"], json!(2));
    for r in &requests {
        assert_eq!((r.method.as_str(), r.auth.as_deref()), ("POST", Some(AUTH)), "{}", r.path);
    }
    let streams: Vec<&Request> = requests[1..].iter().collect();
    for r in &streams {
        assert_eq!(r.path, format!("/files/ent/proj/{id}/file_stream"));
    }
    // Every row once, in order, batched (not a request per row), the same rows as on disk.
    let history = service.history(&id);
    assert_eq!(history, local_history(run.dir()));
    assert_eq!(history.len(), 40);
    for (i, row) in history.iter().enumerate() {
        assert_eq!(row["_step"], json!(i));
        assert_eq!(row["loss"], json!(1.0 / (i + 1) as f64));
        assert!(row["_runtime"].as_f64().unwrap() >= 0.0 && row["_timestamp"].as_f64().unwrap() > 1.6e9);
    }
    assert!(streams.len() < 20, "{} requests for 40 rows", streams.len());
    let last = streams.last().unwrap();
    assert_eq!(last.body, json!({"complete": true, "exitcode": 0}));
    let summary = service.state.lock().unwrap().runs[&id].summary.clone();
    assert_eq!((summary["loss"].clone(), summary["_step"].clone()), (json!(1.0 / 40.0), json!(39)));
    assert_eq!(service.exit_code(&id), Some(0));
    assert!(warnings(&said).is_empty(), "{:?}", said.lock().unwrap());
    assert_eq!(store::RunDir::open(run.dir()).unwrap().record.exit_code, Some(0));
}

#[test]
fn the_service_down_slows_nothing_and_sync_uploads_everything_later() {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let down = format!("http://127.0.0.1:{port}"); // nothing listens there now
    let out = tempfile::tempdir().unwrap();
    let (mut run, said) = start_run(Mode::Online, &down, &out.path().join("reward"), fast_policy());
    let started = Instant::now();
    let slowest = log_rows(&mut run, 0, 300);
    std::thread::sleep(Duration::from_millis(300)); // a few retries
    let t = Instant::now();
    run.finish(3).unwrap();
    let (finish, logging) = (t.elapsed(), started.elapsed());
    assert!(slowest < Duration::from_millis(100), "one log call took {slowest:?}");
    assert!(finish < Duration::from_secs(3), "finishing with the service down took {finish:?}");
    let warned = warnings(&said);
    assert_eq!(warned.len(), 2, "one warning when it went down, one at the end: {warned:?} ({logging:?})");
    assert!(warned[0].contains("cannot reach") && warned[1].contains("train wandb-sync"), "{warned:?}");
    assert_eq!(local_history(run.dir()).len(), 300);
    let dir = run.dir().to_path_buf();
    let id = run_id(&run);
    drop(run);

    // Later, with the service up: every row, then the exit code.
    let service = FakeWandb::start();
    let synced = sync_dir(out.path(), Some(&service.url), KEY, &fast_policy()).unwrap();
    assert_eq!(synced.len(), 1);
    assert_eq!((synced[0].dir.as_path(), synced[0].sent, synced[0].completed), (dir.as_path(), 300, Some(3)));
    assert_eq!(service.history(&id), local_history(&dir));
    assert_eq!(service.exit_code(&id), Some(3));
    // Syncing again sends no line twice.
    let again = sync_dir(&dir, Some(&service.url), KEY, &fast_policy()).unwrap();
    assert_eq!(again[0].sent, 300);
    assert_eq!(service.history(&id).len(), 300);
}

#[test]
fn offline_runs_send_nothing_and_keep_every_row_for_sync() {
    let service = FakeWandb::start();
    let out = tempfile::tempdir().unwrap();
    let (mut run, said) = start_run(Mode::Offline, &service.url, &out.path().join("step3"), fast_policy());
    let id = run_id(&run);
    log_rows(&mut run, 5, 25);
    run.finish(0).unwrap();
    let ended = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs_f64();
    assert!(service.requests().is_empty());
    // Each row's `_runtime` is its `_timestamp` less the run's start, both within the run.
    let started = store::RunDir::open(run.dir()).unwrap().record.started_at;
    for row in local_history(run.dir()) {
        let (runtime, at) = (row["_runtime"].as_f64().unwrap(), row["_timestamp"].as_f64().unwrap());
        assert!((runtime - (at - started)).abs() < 1e-6 && (started..=ended).contains(&at), "{row} {started}");
    }
    assert!(said.lock().unwrap()[0].contains("train wandb-sync"), "{:?}", said.lock().unwrap());
    sync_dir(&out.path().join("wandb"), Some(&service.url), KEY, &fast_policy()).unwrap();
    let history = service.history(&id);
    assert_eq!(history.len(), 25);
    assert_eq!((history[0]["_step"].clone(), history[24]["_step"].clone()), (json!(5), json!(29)));
    assert_eq!(service.exit_code(&id), Some(0));
}

/// A step's records (training scalars, then its evaluation's) make one row: wandb's `_step`
/// names one row. A later value of a name in the same step replaces the earlier; the last step's
/// row is written when the run finishes.
#[test]
fn each_step_is_one_row() {
    let out = tempfile::tempdir().unwrap();
    let (mut run, _) = start_run(Mode::Offline, "http://127.0.0.1:9", &out.path().join("sft"), fast_policy());
    run.log(10, &[("loss".into(), 2.0), ("lr".into(), 1e-3)]).unwrap();
    run.log(10, &[("eval_loss".into(), 2.5)]).unwrap();
    run.log(20, &[("loss".into(), 1.0)]).unwrap();
    run.log(20, &[("loss".into(), 0.9), ("eval_loss".into(), 1.2)]).unwrap();
    let dir = run.dir().to_path_buf();
    assert_eq!(local_history(&dir).len(), 1, "the first step's row is written once the next step begins");
    run.finish(0).unwrap();
    let rows = local_history(&dir);
    let row = |i: usize, key: &str| rows[i][key].clone();
    assert_eq!(rows.len(), 2);
    assert_eq!(
        (row(0, "_step"), row(0, "loss"), row(0, "lr"), row(0, "eval_loss")),
        (json!(10), json!(2.0), json!(1e-3), json!(2.5))
    );
    assert_eq!((row(1, "_step"), row(1, "loss"), row(1, "eval_loss")), (json!(20), json!(0.9), json!(1.2)));
}

#[test]
fn a_slow_service_does_not_hold_training_up() {
    let service = FakeWandb::start();
    service.set(|b| b.delay = Duration::from_millis(250));
    let out = tempfile::tempdir().unwrap();
    let (mut run, _) = start_run(Mode::Online, &service.url, &out.path().join("actor"), fast_policy());
    let id = run_id(&run);
    let mut slowest = Duration::ZERO;
    for i in 0..60 {
        slowest = slowest.max(log_rows(&mut run, i, 1));
        std::thread::sleep(Duration::from_millis(10)); // a training step
    }
    assert!(slowest < Duration::from_millis(100), "one log call took {slowest:?} with a 250 ms service");
    run.finish(0).unwrap();
    assert_eq!(service.history(&id).len(), 60);
    assert_eq!(service.exit_code(&id), Some(0));
}

#[test]
fn server_errors_are_retried_without_duplicates_and_refusals_are_not() {
    let service = FakeWandb::start();
    service.set(|b| b.fail_stream = Some((503, 3)));
    let out = tempfile::tempdir().unwrap();
    let (mut run, said) = start_run(Mode::Online, &service.url, &out.path().join("actor"), fast_policy());
    let id = run_id(&run);
    log_rows(&mut run, 0, 50);
    run.finish(0).unwrap();
    // The offsets were right every time (the fake answers 400 otherwise) and nothing is lost.
    assert_eq!(service.history(&id), local_history(run.dir()));
    assert_eq!(service.exit_code(&id), Some(0));
    let warned = warnings(&said);
    assert_eq!(warned.len(), 1, "{warned:?}");
    assert!(warned[0].contains("HTTP 503"), "{warned:?}");

    // A refused key: one request, no retries, the rows on disk.
    let refusing = FakeWandb::start();
    refusing.set(|b| b.refuse_graphql = Some(403));
    let (mut run, said) = start_run(Mode::Online, &refusing.url, &out.path().join("reward"), fast_policy());
    log_rows(&mut run, 0, 10);
    std::thread::sleep(Duration::from_millis(200));
    run.finish(0).unwrap();
    assert_eq!(refusing.requests().len(), 1);
    let warned = warnings(&said);
    assert!(warned[0].contains("HTTP 403") && warned[0].contains("not retrying"), "{warned:?}");
    assert!(warned[1].contains("not finished on the service (10 rows not uploaded)"), "{warned:?}");
    assert_eq!(local_history(run.dir()).len(), 10);
}

#[test]
fn a_resumed_training_run_continues_its_wandb_run_including_rows_never_sent() {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let out = tempfile::tempdir().unwrap();
    let output = out.path().join("step3");
    // First attempt: the service is down and the run dies (dropped without finishing).
    let (mut run, _) = start_run(Mode::Online, &format!("http://127.0.0.1:{port}"), &output, fast_policy());
    let (id, first_dir) = (run_id(&run), run.dir().to_path_buf());
    log_rows(&mut run, 0, 7);
    drop(run);
    assert_eq!(store::RunDir::open(&first_dir).unwrap().record.exit_code, Some(1));

    // The resumed training run, service up: the same run id and directory, all 7 + 5 rows.
    let service = FakeWandb::start();
    let (say, _) = collector();
    let s = settings(Mode::Online, &service.url, &output);
    let mut run = WandbRun::start(&s, true, Default::default(), fast_policy(), say).unwrap().unwrap();
    assert_eq!((run_id(&run), run.dir()), (id.clone(), first_dir.as_path()));
    log_rows(&mut run, 7, 5);
    run.finish(0).unwrap();
    let steps: Vec<i64> = service.history(&id).iter().map(|r| r["_step"].as_i64().unwrap()).collect();
    assert_eq!(steps, (0..12).collect::<Vec<_>>());
    assert_eq!(service.exit_code(&id), Some(0));

    // A fresh (not resumed) run in the same output directory is a new run in a new directory.
    let (say, _) = collector();
    let run = WandbRun::start(&s, false, Default::default(), fast_policy(), say).unwrap().unwrap();
    assert_ne!(run_id(&run), id);
    assert_ne!(run.dir(), first_dir.as_path());
    assert_eq!(local_history(&first_dir).len(), 12);
}

/// `train wandb-sync` retries a service that fails (not one that refuses) three times, then
/// names the run it could not upload.
#[test]
fn sync_retries_a_failing_service_three_times_then_names_the_run() {
    let out = tempfile::tempdir().unwrap();
    let (mut run, _) = start_run(Mode::Offline, "http://127.0.0.1:9", &out.path().join("sft"), fast_policy());
    let (id, dir) = (run_id(&run), run.dir().to_path_buf());
    log_rows(&mut run, 0, 5);
    run.finish(0).unwrap();
    let streams = |service: &FakeWandb| service.requests().iter().filter(|r| r.path.ends_with("/file_stream")).count();

    let down = FakeWandb::start();
    down.set(|b| b.fail_stream = Some((503, 1000)));
    let err = sync_dir(&dir, Some(&down.url), KEY, &fast_policy()).unwrap_err().to_string();
    assert!(err.starts_with(&format!("uploading {}: ", dir.display())) && err.contains("HTTP 503"), "{err}");
    assert_eq!(streams(&down), 4, "one try and three retries");
    assert!(down.history(&id).is_empty());

    let flaky = FakeWandb::start();
    flaky.set(|b| b.fail_stream = Some((503, 3)));
    let synced = sync_dir(&dir, Some(&flaky.url), KEY, &fast_policy()).unwrap();
    assert_eq!((synced[0].sent, synced[0].completed), (5, Some(0)));
    assert_eq!(flaky.history(&id), local_history(&dir));
    assert_eq!(flaky.exit_code(&id), Some(0));
}

/// Rows reach the service while the run goes on (each log wakes the upload), and an idle run
/// sends a heartbeat: an empty request that tells the service the run is alive.
#[test]
fn rows_go_up_as_they_are_logged_and_an_idle_run_sends_heartbeats() {
    let service = FakeWandb::start();
    let out = tempfile::tempdir().unwrap();
    let policy = Policy { heartbeat: Duration::from_millis(300), ..fast_policy() };
    let (mut run, _) = start_run(Mode::Online, &service.url, &out.path().join("actor"), policy);
    let id = run_id(&run);
    let until = |deadline: Duration, done: &dyn Fn() -> bool| {
        let start = Instant::now();
        while !done() && start.elapsed() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        done()
    };
    // Six steps write five rows (the sixth waits for its step's other records).
    log_rows(&mut run, 0, 6);
    assert!(until(Duration::from_secs(3), &|| service.history(&id).len() == 5), "{:?}", service.history(&id));
    let empty = || service.requests().iter().filter(|r| r.body == json!({"files": {}})).count();
    assert!(until(Duration::from_secs(3), &|| empty() >= 2), "{} heartbeats", empty());
    run.finish(0).unwrap();
    assert_eq!(service.history(&id).len(), 6);
}

/// At the end of a run, a service that keeps failing is retried until the policy's finish
/// deadline, then the upload reports what it did not send, rather than running on.
#[test]
fn at_the_end_a_failing_service_is_retried_until_the_finish_deadline() {
    let service = FakeWandb::start();
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join(store::HISTORY_FILE), "{\"_step\":0}\n{\"_step\":1}\n").unwrap();
    let run = RunInfo {
        id: "deadline1".into(),
        project: "proj".into(),
        entity: None,
        display_name: "actor".into(),
        group: None,
        config: Default::default(),
        host: "h".into(),
    };
    let policy = Policy { finish_timeout: Duration::from_millis(400), ..fast_policy() };
    let api = Api::new(&service.url, KEY, policy.request_timeout).unwrap();
    service.set(|b| b.fail_stream = Some((503, 100_000)));
    let (say, _) = collector();
    let uploader = Uploader::spawn(Stream::new(api, run, dir.path()), policy, say);
    let started = Instant::now();
    // Waiting far longer than the deadline: the upload ends by itself at about 0.4 s.
    let outcome = uploader.finish(0, Duration::from_secs(10)).expect("the upload ended");
    assert!(started.elapsed() < Duration::from_secs(5), "{:?}", started.elapsed());
    assert_eq!((outcome.completed, outcome.sent), (false, 0));
    let streams = service.requests().iter().filter(|r| r.path.ends_with("/file_stream")).count();
    assert!(streams >= 2, "retried: {streams} requests");
}

/// Rows logged in a burst go up together: after a request the upload gathers rows for the
/// policy's `batch_interval` (the service is not sent one request a row), and the end of the
/// run cuts that wait short. The margins are wide: a slower machine only batches more.
#[test]
fn rows_are_gathered_for_the_batch_interval_and_the_end_cuts_it_short() {
    let service = FakeWandb::start();
    let out = tempfile::tempdir().unwrap();
    let policy = Policy { batch_interval: Duration::from_secs(4), ..fast_policy() };
    let (mut run, _) = start_run(Mode::Online, &service.url, &out.path().join("actor"), policy);
    let id = run_id(&run);
    for i in 0..20 {
        log_rows(&mut run, i, 1);
        std::thread::sleep(Duration::from_millis(10));
    }
    let ending = Instant::now();
    run.finish(0).unwrap();
    assert!(ending.elapsed() < Duration::from_secs(2), "the end waited {:?} for the batch", ending.elapsed());
    assert_eq!(service.history(&id).len(), 20);
    let with_rows = service.requests().iter().filter(|r| r.body["files"].get("wandb-history.jsonl").is_some()).count();
    assert!(with_rows <= 4, "20 rows in {with_rows} requests");
}

/// A failing service is retried with a backoff that doubles (20, 40, 80 ... 640 ms): in 1.5 s a
/// handful of tries, not one every 20 ms.
#[test]
fn retries_back_off() {
    let service = FakeWandb::start();
    service.set(|b| b.fail_stream = Some((503, 100_000)));
    let out = tempfile::tempdir().unwrap();
    let (say, _) = collector();
    let s = settings(Mode::Online, &service.url, &out.path().join("actor"));
    let policy = Policy {
        backoff_base: Duration::from_millis(20),
        backoff_max: Duration::from_millis(640),
        finish_timeout: Duration::from_millis(300),
        ..fast_policy()
    };
    let mut run = WandbRun::start(&s, false, Default::default(), policy, say).unwrap().unwrap();
    log_rows(&mut run, 0, 3);
    std::thread::sleep(Duration::from_millis(1500));
    let tries = service.requests().iter().filter(|r| r.path.ends_with("/file_stream")).count();
    assert!((2..=12).contains(&tries), "{tries} tries in 1.5 s");
    run.finish(0).unwrap();
}
