//! Rewards from outside the reward model (`--reward-fn`): rule-based and remote scorers, as
//! OpenRLHF's `--remote_rm_url` and TRL's `reward_funcs` give them.
//!
//! - `exec:COMMAND`: a process started once (`sh -c COMMAND`) that reads one JSON line
//!   `{"prompt": ..., "answer": ...}` per answer on its stdin and writes one JSON number per line
//!   on its stdout, in order;
//! - `http://...` or `https://...`: OpenRLHF's remote reward protocol, one POST per rollout of
//!   `{"query": [prompt + answer, ...], "prompts": [...]}` answered by `{"rewards": [...]}`;
//! - `builtin:NAME`: a scorer compiled in ([`Builtin`]).
//!
//! A failed try (a time-out, a line that is not a number, a count that is not the answers', a
//! process that died, an HTTP error) is a warning line and the rollout is sent again
//! (`--reward-fn-tries`, an `exec:` process started anew); the last try's failure is one error
//! naming the scorer and the answer, before anything of the rollout is trained on, which the
//! loop turns into a saved checkpoint and an exit ([`ScoringFailed`]).

use anyhow::{anyhow, bail, Context, Result};
use std::io::{BufRead, BufReader, Write};
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::time::{Duration, Instant};

/// A rollout that could not be scored: a `--reward-fn` failed its last try on some rank (or
/// gave what is no reward). Every rank returns it for the same rollout (the ranks decide
/// together), so that all of them save the rollouts done and stop.
#[derive(Debug)]
pub struct ScoringFailed(pub String);

impl std::fmt::Display for ScoringFailed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for ScoringFailed {}

/// One answer to score: the prompt as the actor saw it and the answer's text (up to EOS).
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Answer {
    pub prompt: String,
    pub answer: String,
}

/// A `--reward-fn` as given on the command line, checked but not started.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RewardFnSpec {
    Exec(String),
    Http(String),
    Builtin(Builtin),
}

/// The scorers compiled in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Builtin {
    /// The demo's task (`data::demo::score_answer`): 1 when the answer names the capital of the
    /// country the prompt asks about and no other city, else 0.
    Capitals,
    /// The arithmetic task (`data::arithmetic::score_answer`): 1 when the answer's only number
    /// is the sum the prompt asks for, else 0.
    Arithmetic,
}

impl Builtin {
    const ALL: [(&'static str, Builtin); 2] = [("capitals", Builtin::Capitals), ("arithmetic", Builtin::Arithmetic)];

    fn score(self, answer: &Answer) -> Result<f64> {
        let right = match self {
            Builtin::Capitals => match data::demo::score_answer(&answer.prompt, &answer.answer) {
                Some(score) => score.correct,
                None => bail!("the prompt names no single country of the demo's table: {:?}", answer.prompt),
            },
            Builtin::Arithmetic => match data::arithmetic::score_answer(&answer.prompt, &answer.answer) {
                Some(right) => right,
                None => bail!("the prompt asks for no sum of two numbers: {:?}", answer.prompt),
            },
        };
        Ok(f64::from(u8::from(right)))
    }
}

impl std::str::FromStr for RewardFnSpec {
    type Err = String;

    /// `exec:COMMAND`, `http(s)://URL` or `builtin:NAME`.
    fn from_str(spec: &str) -> Result<Self, String> {
        if let Some(command) = spec.strip_prefix("exec:") {
            return match command.trim() {
                "" => Err("exec: needs a command, e.g. exec:'python3 score.py'".into()),
                command => Ok(Self::Exec(command.to_string())),
            };
        }
        if spec.starts_with("http://") || spec.starts_with("https://") {
            return Ok(Self::Http(spec.to_string()));
        }
        if let Some(name) = spec.strip_prefix("builtin:") {
            return Builtin::ALL.iter().find(|(n, _)| *n == name).map(|&(_, b)| Self::Builtin(b)).ok_or_else(|| {
                let known: Vec<&str> = Builtin::ALL.iter().map(|(n, _)| *n).collect();
                format!("no built-in scorer {name:?}; the built-in ones: {}", known.join(", "))
            });
        }
        Err(format!("{spec:?} is none of exec:COMMAND, http://URL, https://URL, builtin:NAME"))
    }
}

impl std::fmt::Display for RewardFnSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Exec(command) => write!(f, "exec:{command}"),
            Self::Http(url) => f.write_str(url),
            Self::Builtin(b) => {
                let name = Builtin::ALL.iter().find(|(_, x)| x == b).map_or("?", |(n, _)| n);
                write!(f, "builtin:{name}")
            }
        }
    }
}

impl RewardFnSpec {
    /// Starts the scorer (an `exec:` process is spawned here), each try waiting at most
    /// `timeout` for its rewards, a rollout tried `tries` times (`None`: [`Self::default_tries`]).
    pub fn start(&self, timeout: Duration, tries: Option<u32>) -> Result<RewardFn> {
        let scorer = match self {
            Self::Exec(command) => Scorer::Exec(ExecScorer::spawn(command)?),
            Self::Http(url) => Scorer::Http(
                reqwest::blocking::Client::builder().timeout(timeout).build().context("the HTTP client")?,
                url.clone(),
            ),
            Self::Builtin(b) => Scorer::Builtin(*b),
        };
        let tries = match self {
            Self::Builtin(_) => 1,
            _ => tries.unwrap_or(self.default_tries()).max(1),
        };
        Ok(RewardFn { spec: self.clone(), scorer, timeout, tries, first_pause: Duration::from_secs(1) })
    }

    /// How many times a rollout is tried by default: an HTTP server 5 times (OpenRLHF's
    /// `remote_rm_fn`), a command 3 (a process that crashed or hung is started anew each time); a
    /// built-in scorer once (its errors are the prompt's, the same every time).
    pub fn default_tries(&self) -> u32 {
        match self {
            Self::Exec(_) => 3,
            Self::Http(_) => 5,
            Self::Builtin(_) => 1,
        }
    }
}

/// A started `--reward-fn`.
pub struct RewardFn {
    spec: RewardFnSpec,
    scorer: Scorer,
    timeout: Duration,
    /// Tries of a rollout before its error ends the run.
    tries: u32,
    /// The pause before the second try, doubled before each next one.
    first_pause: Duration,
}

enum Scorer {
    Exec(ExecScorer),
    Http(reqwest::blocking::Client, String),
    Builtin(Builtin),
}

impl RewardFn {
    /// One reward per answer, in order. A try that fails is said in a warning line and tried
    /// again after a pause (1 s, doubled each time), an `exec:` process first killed and started
    /// anew; the last try's error names this scorer, its tries and the answer at fault.
    pub fn score(&mut self, answers: &[Answer]) -> Result<Vec<f64>> {
        let (mut attempt, mut pause) = (1, self.first_pause);
        loop {
            let error = match self.score_once(answers) {
                Ok(rewards) => return Ok(rewards),
                Err(e) => e,
            };
            if attempt >= self.tries {
                let tries = if attempt > 1 { format!(" (tried {attempt} times)") } else { String::new() };
                return Err(error.context(format!("--reward-fn {}{tries}", self.spec)));
            }
            let again = match self.scorer {
                Scorer::Exec(_) => "restarting it and sending the rollout again",
                _ => "sending the rollout again",
            };
            eprintln!(
                "warning: --reward-fn {}: {error:#}; {again} in {} s (try {} of {})",
                self.spec,
                pause.as_secs_f64(),
                attempt + 1,
                self.tries
            );
            std::thread::sleep(pause);
            pause *= 2;
            if let Scorer::Exec(process) = &mut self.scorer {
                // Whatever state the process is in (ended, hung, out of step with its answers),
                // the next try starts from a new one.
                process.end(Duration::ZERO);
                *process = ExecScorer::spawn(&process.command)?;
            }
            attempt += 1;
        }
    }

    fn score_once(&mut self, answers: &[Answer]) -> Result<Vec<f64>> {
        match &mut self.scorer {
            Scorer::Exec(process) => process.score(answers, self.timeout),
            Scorer::Http(client, url) => score_http(client, url, answers),
            Scorer::Builtin(b) => answers
                .iter()
                .enumerate()
                .map(|(i, a)| b.score(a).map_err(|e| anyhow!("{}: {e}", answer_named(i, a))))
                .collect(),
        }
    }
}

/// "answer 3 (\" Paris is ...\")": how an error names the answer it is about.
fn answer_named(i: usize, answer: &Answer) -> String {
    let text: String = answer.answer.chars().take(60).collect();
    let more = if answer.answer.chars().count() > 60 { "..." } else { "" };
    format!("answer {} ({text:?}{more})", i + 1)
}

/// A reward read from JSON: a finite number.
fn reward_of(value: &serde_json::Value) -> Option<f64> {
    value.as_f64().filter(|x| x.is_finite())
}

/// OpenRLHF's `remote_rm_fn`: `query` holds each prompt followed by its answer.
fn score_http(client: &reqwest::blocking::Client, url: &str, answers: &[Answer]) -> Result<Vec<f64>> {
    let body = serde_json::json!({
        "query": answers.iter().map(|a| format!("{}{}", a.prompt, a.answer)).collect::<Vec<_>>(),
        "prompts": answers.iter().map(|a| a.prompt.as_str()).collect::<Vec<_>>(),
    });
    let response = client.post(url).json(&body).send().with_context(|| format!("POST {url}"))?;
    let status = response.status();
    let text = response.text().with_context(|| format!("reading the answer of {url}"))?;
    if !status.is_success() {
        bail!("{url} answered {status}: {}", text.chars().take(200).collect::<String>());
    }
    let reply: serde_json::Value = serde_json::from_str(&text).map_err(|e| {
        anyhow!("{url} answered what is not JSON ({e}): {}", text.chars().take(200).collect::<String>())
    })?;
    let Some(rewards) = reply.get("rewards").and_then(|r| r.as_array()) else {
        bail!("{url} answered without a \"rewards\" list: {}", text.chars().take(200).collect::<String>());
    };
    if rewards.len() != answers.len() {
        bail!("{url} gave {} rewards for {} answers", rewards.len(), answers.len());
    }
    rewards
        .iter()
        .zip(answers)
        .enumerate()
        .map(|(i, (r, a))| {
            reward_of(r).ok_or_else(|| anyhow!("{}: the reward {r} is not a finite number", answer_named(i, a)))
        })
        .collect()
}

/// A scorer process: its stdin, and its stdout's lines as a reader thread receives them (so
/// that a reply can be waited for with a deadline, and a silent process times out). `sh` leads
/// a process group of its own, so that what the command starts (`sh -c` forks it) is ended
/// with it: a scorer killed at its time-out leaves no process behind.
struct ExecScorer {
    child: Child,
    /// The writer thread's queue: a rollout's JSON lines go to the process's stdin from a thread
    /// of their own, so that a process that stops reading blocks that thread, not the run (the
    /// deadline covers the writing too). Dropping it closes the process's stdin.
    to_stdin: Option<Sender<Vec<u8>>>,
    lines: Receiver<std::io::Result<String>>,
    command: String,
    /// Once `sh` is reaped (after its group was killed): its status if it had ended by itself.
    reaped: Option<Option<ExitStatus>>,
}

impl ExecScorer {
    fn spawn(command: &str) -> Result<Self> {
        let mut child = Command::new("sh")
            .args(["-c", command])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .process_group(0)
            .spawn()
            .with_context(|| format!("starting `{command}`"))?;
        let stdout = child.stdout.take().expect("stdout is piped");
        let (send, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                if send.send(line).is_err() {
                    break;
                }
            }
        });
        let mut stdin = child.stdin.take().expect("stdin is piped");
        let (to_stdin, inputs) = mpsc::channel::<Vec<u8>>();
        // A write that fails (the process ended: EPIPE) ends the thread; the reader then sees
        // the process's output close, and the error names how it ended.
        std::thread::spawn(move || {
            for input in inputs {
                if stdin.write_all(&input).and_then(|()| stdin.flush()).is_err() {
                    break;
                }
            }
        });
        Ok(Self { to_stdin: Some(to_stdin), child, lines, command: command.to_string(), reaped: None })
    }

    /// Whether `sh` has ended, without reaping it: while it is unreaped its pid, the process
    /// group's id, cannot be taken by another process, so the group can still be signalled.
    fn has_ended(&self) -> bool {
        // SAFETY: a zeroed siginfo_t is a valid value; waitid only writes into it.
        let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
        let options = libc::WEXITED | libc::WNOHANG | libc::WNOWAIT;
        // SAFETY: waitid on our own child, writing into `info` on this frame.
        let rc = unsafe { libc::waitid(libc::P_PID, self.child.id(), &mut info, options) };
        // An error (ECHILD: already reaped) counts as ended; else ended when it names the child.
        rc != 0 || unsafe { info.si_pid() } != 0
    }

    /// Waits up to `patience` for `sh` to end, then kills its process group (`sh` and whatever
    /// it started) and reaps it: `sh`'s status when it ended by itself.
    fn end(&mut self, patience: Duration) -> Option<ExitStatus> {
        if let Some(status) = self.reaped {
            return status; // the group is not signalled again: its id may be another's by now
        }
        let deadline = Instant::now() + patience;
        let mut ended = self.has_ended();
        while !ended && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
            ended = self.has_ended();
        }
        // SAFETY: signals the process group of our child, which is not reaped yet.
        unsafe { libc::kill(-(self.child.id() as libc::pid_t), libc::SIGKILL) };
        let status = self.child.wait().ok().filter(|_| ended);
        self.reaped = Some(status);
        status
    }

    /// Why the process can answer no more: its exit status when it ends within a second (its
    /// output closes a moment before it is reaped).
    fn ended(&mut self) -> String {
        match self.end(Duration::from_secs(1)) {
            Some(status) => format!("`{}` exited ({status})", self.command),
            None => format!("`{}` closed its output", self.command),
        }
    }

    fn score(&mut self, answers: &[Answer], timeout: Duration) -> Result<Vec<f64>> {
        // A line left from the last rollout: the process answered more lines than answers.
        if let Ok(line) = self.lines.try_recv() {
            bail!("`{}` wrote a line no answer asked for: {:?}", self.command, line.unwrap_or_default());
        }
        let mut input = String::new();
        for a in answers {
            input.push_str(&serde_json::to_string(a)?);
            input.push('\n');
        }
        // The deadline covers writing, scoring and reading: the writer thread sends the whole
        // rollout while the reader thread drains the replies, so a process that answers as it
        // reads cannot block on a full pipe, and one that stops reading times out here.
        let deadline = Instant::now() + timeout;
        let to_stdin = self.to_stdin.as_ref().expect("stdin is kept until drop");
        if to_stdin.send(input.into_bytes()).is_err() {
            bail!("{} before reading the answers", self.ended());
        }
        let mut rewards = Vec::with_capacity(answers.len());
        for (i, a) in answers.iter().enumerate() {
            let wait = deadline.saturating_duration_since(Instant::now());
            let line = match self.lines.recv_timeout(wait) {
                Ok(Ok(line)) => line,
                Ok(Err(e)) => bail!("reading `{}`'s output at {}: {e}", self.command, answer_named(i, a)),
                Err(RecvTimeoutError::Timeout) => {
                    bail!(
                        "no reward for {} within {} s (--reward-fn-timeout)",
                        answer_named(i, a),
                        timeout.as_secs_f64()
                    )
                }
                Err(RecvTimeoutError::Disconnected) => bail!("{} before scoring {}", self.ended(), answer_named(i, a)),
            };
            let reward = serde_json::from_str::<serde_json::Value>(line.trim()).ok().as_ref().and_then(reward_of);
            match reward {
                Some(r) => rewards.push(r),
                None => bail!("{}: expected one JSON number a line, got {line:?}", answer_named(i, a)),
            }
        }
        Ok(rewards)
    }
}

impl Drop for ExecScorer {
    /// Closing stdin ends a well-behaved scorer; one that does not stop within 2 s is killed,
    /// and so is anything it left running.
    fn drop(&mut self) {
        drop(self.to_stdin.take());
        self.end(Duration::from_secs(2));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;
    use std::net::TcpListener;

    fn answers(texts: &[&str]) -> Vec<Answer> {
        let prompt = "\n\nHuman: What is the capital of France?\n\nAssistant:";
        texts.iter().map(|t| Answer { prompt: prompt.to_string(), answer: t.to_string() }).collect()
    }

    /// A scorer tried once: each failure is its own.
    fn start(spec: &str, timeout_s: f64) -> RewardFn {
        start_tried(spec, timeout_s, 1)
    }

    /// A scorer tried `tries` times, 10 ms apart at first.
    fn start_tried(spec: &str, timeout_s: f64, tries: u32) -> RewardFn {
        let mut f =
            spec.parse::<RewardFnSpec>().unwrap().start(Duration::from_secs_f64(timeout_s), Some(tries)).unwrap();
        f.first_pause = Duration::from_millis(10);
        f
    }

    fn error(result: Result<Vec<f64>>) -> String {
        format!("{:#}", result.expect_err("an error"))
    }

    #[test]
    fn specs_parse_or_say_what_is_accepted() {
        assert_eq!("exec:./score.sh --x".parse(), Ok(RewardFnSpec::Exec("./score.sh --x".into())));
        assert_eq!(
            "http://127.0.0.1:5000/get_reward".parse(),
            Ok(RewardFnSpec::Http("http://127.0.0.1:5000/get_reward".into()))
        );
        assert_eq!("builtin:capitals".parse(), Ok(RewardFnSpec::Builtin(Builtin::Capitals)));
        let unknown = "builtin:sudoku".parse::<RewardFnSpec>().unwrap_err();
        assert!(unknown.contains("capitals"), "{unknown}");
        let other = "score.py".parse::<RewardFnSpec>().unwrap_err();
        assert!(other.contains("exec:COMMAND"), "{other}");
        assert!("exec: ".parse::<RewardFnSpec>().is_err());
        for spec in ["exec:./score.sh --x", "https://rm.example/score", "builtin:capitals"] {
            assert_eq!(spec.parse::<RewardFnSpec>().unwrap().to_string(), spec);
        }
    }

    #[test]
    fn the_builtin_capitals_scorer_is_the_demo_task_score() {
        let mut f = start("builtin:capitals", 1.0);
        assert_eq!(
            f.score(&answers(&[" Paris.", " Lyon is the capital.", " Paris or Berlin."])).unwrap(),
            [1.0, 0.0, 0.0]
        );
        let off = vec![Answer { prompt: "Human: hello".into(), answer: " hi".into() }];
        let e = error(f.score(&off));
        assert!(e.contains("builtin:capitals") && e.contains("answer 1") && e.contains("no single country"), "{e}");
        let mut sums = start("builtin:arithmetic", 1.0);
        let sum =
            |answer: &str| Answer { prompt: "\n\nHuman: What is 27 + 15?\n\nAssistant:".into(), answer: answer.into() };
        assert_eq!(sums.score(&[sum(" 42."), sum(" 32."), sum(" 42 or 43")]).unwrap(), [1.0, 0.0, 0.0]);
        let e = error(sums.score(&answers(&[" Paris."])));
        assert!(e.contains("builtin:arithmetic") && e.contains("no sum"), "{e}");
    }

    #[test]
    fn an_exec_scorer_answers_each_rollout_in_order_from_one_process() {
        // Reads the JSON lines, scores "Paris" 1 and anything else -0.5, and counts its lines:
        // the second rollout's rewards show that the same process served both.
        let script = r#"n=0; while IFS= read -r line; do n=$((n+1)); case "$line" in *Paris*) echo 1;; *) echo "-0.$n";; esac; done"#;
        let mut f = start(&format!("exec:{script}"), 10.0);
        assert_eq!(f.score(&answers(&[" Paris.", " Lyon."])).unwrap(), [1.0, -0.2]);
        assert_eq!(f.score(&answers(&[" Nice.", " Paris!"])).unwrap(), [-0.3, 1.0]);
    }

    #[test]
    fn exec_scorer_failures_name_the_answer() {
        let e = error(start("exec:while read l; do echo oops; done", 10.0).score(&answers(&[" Paris."])));
        assert!(e.contains("answer 1") && e.contains("JSON number") && e.contains("oops"), "{e}");
        let e = error(start("exec:read l; echo 1; exit 3", 10.0).score(&answers(&[" Paris.", " Lyon."])));
        assert!(e.contains("answer 2") && e.contains("exited"), "{e}");
        let e = error(start("exec:sleep 30", 0.3).score(&answers(&[" Paris."])));
        assert!(e.contains("within 0.3 s") && e.contains("answer 1"), "{e}");
        let mut twice = start("exec:while read l; do echo 1; echo 2; done", 10.0);
        assert_eq!(twice.score(&answers(&[" Paris."])).unwrap(), [1.0]);
        std::thread::sleep(Duration::from_millis(200));
        let e = error(twice.score(&answers(&[" Paris."])));
        assert!(e.contains("no answer asked for"), "{e}");
        let e = error(start("exec:echo nan; cat > /dev/null", 10.0).score(&answers(&[" Paris."])));
        assert!(e.contains("JSON number"), "{e}");
    }

    #[test]
    fn a_scorer_that_stops_reading_times_out_however_long_the_rollout() {
        // 256 answers of 1 KiB: four times a pipe's 64 KiB, so writing the rollout blocks once
        // the scorer stops reading after its first line; the deadline covers that write.
        let long = " Paris".repeat(170);
        let rollout = answers(&vec![long.as_str(); 256]);
        let mut stuck = start("exec:read l; echo 1; sleep 60", 0.5);
        let started = Instant::now();
        let e = error(stuck.score(&rollout));
        assert!(e.contains("within 0.5 s") && e.contains("answer 2"), "{e}");
        assert!(started.elapsed() < Duration::from_secs(5), "took {:?}", started.elapsed());
        let started = Instant::now();
        drop(stuck);
        assert!(started.elapsed() < Duration::from_secs(5), "the stuck scorer's end took {:?}", started.elapsed());
    }

    /// Whether process `pid` is gone (or a zombie, which its new parent reaps).
    fn gone(pid: u32) -> bool {
        match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
            // The state follows the command's closing parenthesis.
            Ok(stat) => stat.rsplit_once(')').is_some_and(|(_, rest)| rest.trim_start().starts_with('Z')),
            Err(_) => true,
        }
    }

    fn wait_until_gone(pid: u32) -> bool {
        let deadline = Instant::now() + Duration::from_secs(5);
        while !gone(pid) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        gone(pid)
    }

    #[test]
    fn what_a_scorer_started_ends_with_it() {
        // The scorer's first reply is the pid of a process it started and left running: a
        // scorer that hangs (here at its second rollout) is killed with all it started.
        let scorer = "exec:sleep 60 & echo $!; read l; read l; sleep 60";
        let mut hung = start(scorer, 0.3);
        let child = hung.score(&answers(&[" Paris."])).unwrap()[0] as u32;
        assert!(!gone(child), "the scorer's child runs");
        let e = error(hung.score(&answers(&[" Paris."])));
        assert!(e.contains("within 0.3 s"), "{e}");
        drop(hung);
        assert!(wait_until_gone(child), "the timed-out scorer's child {child} was left running");
        // A scorer that ends at the end of its input leaves nothing running either.
        let mut done = start("exec:sleep 60 & echo $!; cat > /dev/null", 10.0);
        let child = done.score(&answers(&[" Paris."])).unwrap()[0] as u32;
        drop(done);
        assert!(wait_until_gone(child), "the ended scorer's child {child} was left running");
    }

    /// An HTTP server on a free port that answers one request per reply of `replies` (status and
    /// body), each on its own connection; hands back the requests' bodies.
    fn serve(replies: &[(&str, &str)]) -> (String, std::thread::JoinHandle<Vec<String>>) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}/get_reward", listener.local_addr().unwrap());
        let replies: Vec<String> = replies
            .iter()
            .map(|(status, body)| format!("HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}", body.len()))
            .collect();
        let server = std::thread::spawn(move || {
            let mut bodies = Vec::new();
            for reply in replies {
                let (mut stream, _) = listener.accept().unwrap();
                stream.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
                let mut request = Vec::new();
                let mut buf = [0u8; 4096];
                // Headers, then Content-Length bytes of body.
                let body_start = loop {
                    let n = stream.read(&mut buf).unwrap();
                    request.extend_from_slice(&buf[..n]);
                    if let Some(i) = request.windows(4).position(|w| w == b"\r\n\r\n") {
                        break i + 4;
                    }
                };
                let head = String::from_utf8_lossy(&request[..body_start]).to_lowercase();
                let length: usize = head
                    .lines()
                    .find_map(|l| l.strip_prefix("content-length:"))
                    .map(|v| v.trim().parse().unwrap())
                    .unwrap();
                while request.len() < body_start + length {
                    let n = stream.read(&mut buf).unwrap();
                    request.extend_from_slice(&buf[..n]);
                }
                stream.write_all(reply.as_bytes()).unwrap();
                bodies.push(String::from_utf8(request[body_start..].to_vec()).unwrap());
            }
            bodies
        });
        (url, server)
    }

    fn serve_once(status: &str, body: &str) -> (String, std::thread::JoinHandle<Vec<String>>) {
        serve(&[(status, body)])
    }

    #[test]
    fn an_http_scorer_speaks_openrlhfs_remote_reward_protocol() {
        let (url, server) = serve_once("200 OK", r#"{"rewards": [0.5, -1]}"#);
        let rewards = start(&url, 10.0).score(&answers(&[" Paris.", " Lyon."])).unwrap();
        assert_eq!(rewards, [0.5, -1.0]);
        let request: serde_json::Value = serde_json::from_str(&server.join().unwrap()[0]).unwrap();
        let prompt = &answers(&[""])[0].prompt;
        assert_eq!(request["prompts"], serde_json::json!([prompt, prompt]));
        assert_eq!(request["query"], serde_json::json!([format!("{prompt} Paris."), format!("{prompt} Lyon.")]));
    }

    #[test]
    fn http_scorer_failures_say_what_came_back() {
        for (status, body, want) in [
            ("200 OK", r#"{"rewards": [0.5]}"#, "1 rewards for 2 answers"),
            ("200 OK", r#"{"scores": [0.5, 1]}"#, "without a \"rewards\" list"),
            ("200 OK", r#"{"rewards": [0.5, "x"]}"#, "answer 2"),
            ("500 Internal Server Error", "boom", "500"),
        ] {
            let (url, server) = serve_once(status, body);
            let e = error(start(&url, 10.0).score(&answers(&[" Paris.", " Lyon."])));
            assert!(e.contains(want) && e.contains(&url), "{status} {body}: {e}");
            server.join().unwrap();
        }
        // Nobody listening: the connection error, named.
        let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let e = error(start(&format!("http://127.0.0.1:{port}/r"), 2.0).score(&answers(&[" Paris."])));
        assert!(e.contains("POST"), "{e}");
    }
    #[test]
    fn a_scorer_that_crashes_or_hangs_once_is_restarted_and_the_rollout_sent_again() {
        let dir = tempfile::tempdir().unwrap();
        // The first process crashes after reading a line (or hangs); the one started next answers.
        let serve = "while read l; do echo 1; done";
        let marker = dir.path().join("started");
        let crash = format!("exec:if mkdir '{}' 2>/dev/null; then read l; exit 1; fi; {serve}", marker.display());
        assert_eq!(start_tried(&crash, 10.0, 2).score(&answers(&[" Paris.", " Lyon."])).unwrap(), [1.0, 1.0]);
        std::fs::remove_dir(&marker).unwrap();
        let e = error(start_tried(&crash, 10.0, 1).score(&answers(&[" Paris."])));
        assert!(e.contains("exited") && !e.contains("tried"), "one try: its error alone: {e}");
        std::fs::remove_dir(&marker).unwrap();
        let hang = format!("exec:if mkdir '{}' 2>/dev/null; then sleep 60; fi; {serve}", marker.display());
        let mut f = start_tried(&hang, 0.3, 3);
        assert_eq!(f.score(&answers(&[" Paris."])).unwrap(), [1.0]);
        // The restarted process serves the next rollouts.
        assert_eq!(f.score(&answers(&[" Nice."])).unwrap(), [1.0]);
        // Gone for good: each try fails, the last one's error says how many there were.
        let e = error(start_tried("exec:read l; exit 3", 10.0, 3).score(&answers(&[" Paris."])));
        assert!(e.contains("tried 3 times") && e.contains("exited") && e.contains("exit status: 3"), "{e}");
    }

    #[test]
    fn an_http_scorer_is_tried_again_after_an_error() {
        let ok = r#"{"rewards": [0.5]}"#;
        let (url, server) = serve(&[("503 Service Unavailable", "busy"), ("200 OK", "not json"), ("200 OK", ok)]);
        assert_eq!(start_tried(&url, 10.0, 3).score(&answers(&[" Paris."])).unwrap(), [0.5]);
        let bodies = server.join().unwrap();
        assert!(bodies.len() == 3 && bodies.iter().all(|b| b == &bodies[0]), "the same rollout each time: {bodies:?}");
        let (url, server) = serve(&[("503 Service Unavailable", "busy"), ("500 Internal Server Error", "boom")]);
        let e = error(start_tried(&url, 10.0, 2).score(&answers(&[" Paris."])));
        assert!(e.contains("tried 2 times") && e.contains("500") && e.contains("boom"), "{e}");
        server.join().unwrap();
        // The defaults: OpenRLHF's 5 tries over HTTP, 3 starts of a command, a built-in once.
        let tries = |spec: &str| spec.parse::<RewardFnSpec>().unwrap().default_tries();
        assert_eq!([tries("http://x/r"), tries("exec:x"), tries("builtin:capitals")], [5, 3, 1]);
    }
}
