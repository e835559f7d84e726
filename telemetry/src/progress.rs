//! The progress of a long phase (tokenizing, evaluation, generation, training): on a terminal
//! an indicatif bar with its ETA; otherwise plain log lines on stderr (as tqdm's; stdout may be
//! a tool's data, `policy_eval`'s table), a status line every [`LOG_EVERY`] and one at the end
//! of a phase that took a while, so piped output and log files get no bar drawing. Every bar joins one `MultiProgress`: a phase inside the training loop (an
//! evaluation) stacks its bar under the training bar instead of drawing over it.
//!
//! A step that `train` runs writes into a pipe (the launcher keeps its training.log), so it
//! could draw no bar. When the launcher's own stderr is a terminal it sets [`RELAY_ENV`]: the
//! step then also relays each bar, a few times a second, as a line marked with [`RELAY_MARK`] on
//! stderr, which the launcher draws on its terminal and keeps out of the log
//! ([`relayed_line`]); the step's log lines stay as they are off a terminal.

use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle, TermLike};
use std::io::{IsTerminal, Write};
use std::sync::{LazyLock, Mutex};
use std::time::{Duration, Instant};

/// Set to 1 by `train` for its steps when it draws their bars.
pub const RELAY_ENV: &str = "RLHF_PROGRESS_RELAY";
/// The first character of a relayed bar's line (ASCII's record separator: no log line has it).
pub const RELAY_MARK: char = '\u{1e}';
/// Relayed frames per second.
const RELAY_HZ: u8 = 2;

/// Off a terminal, a running phase logs its status this often.
pub const LOG_EVERY: Duration = Duration::from_secs(30);
/// Off a terminal, a phase that took at least this long logs a line when it ends.
pub const LOG_IF_LONGER: Duration = Duration::from_secs(2);

static BARS: LazyLock<MultiProgress> = LazyLock::new(MultiProgress::new);

/// Whether bars are drawn: stderr is a terminal.
pub fn on_terminal() -> bool {
    std::io::stderr().is_terminal()
}

/// Whether bars are relayed to `train` ([`RELAY_ENV`]), off a terminal only.
fn relaying() -> bool {
    !on_terminal() && std::env::var(RELAY_ENV).is_ok_and(|v| v == "1")
}

/// A bar of `total` steps, `done` of them already: in the shared stack on a terminal, relayed
/// under `train` ([`RELAY_ENV`]), else `None`. `template` is indicatif's (the training bar's has
/// its own fields).
pub fn bar(total: u64, done: u64, template: &str) -> Option<ProgressBar> {
    let style = ProgressStyle::with_template(template).unwrap_or_else(|_| ProgressStyle::default_bar());
    if on_terminal() {
        return Some(BARS.add(ProgressBar::new(total).with_position(done).with_style(style)));
    }
    relaying().then(|| relayed_bar(total, done, style, Box::new(std::io::stderr())))
}

/// A bar whose frames go to `out` as marked lines ([`Relay`]).
fn relayed_bar(total: u64, done: u64, style: ProgressStyle, out: Box<dyn Write + Send>) -> ProgressBar {
    let target = ProgressDrawTarget::term_like_with_hz(Box::new(Relay::new(out)), RELAY_HZ);
    ProgressBar::with_draw_target(Some(total), target).with_position(done).with_style(style)
}

/// A terminal for indicatif that writes each frame's last line as one [`RELAY_MARK`]ed line,
/// and a bare mark when the bar is cleared.
struct Relay {
    out: Mutex<Box<dyn Write + Send>>,
    /// The frame being drawn, and whether it cleared a line.
    frame: Mutex<(String, bool)>,
}

impl Relay {
    fn new(out: Box<dyn Write + Send>) -> Self {
        Self { out: Mutex::new(out), frame: Mutex::new((String::new(), false)) }
    }

    fn frame(&self) -> std::sync::MutexGuard<'_, (String, bool)> {
        self.frame.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

impl std::fmt::Debug for Relay {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Relay")
    }
}

impl TermLike for Relay {
    fn width(&self) -> u16 {
        100
    }
    fn move_cursor_up(&self, _: usize) -> std::io::Result<()> {
        Ok(())
    }
    fn move_cursor_down(&self, _: usize) -> std::io::Result<()> {
        Ok(())
    }
    fn move_cursor_right(&self, _: usize) -> std::io::Result<()> {
        Ok(())
    }
    fn move_cursor_left(&self, _: usize) -> std::io::Result<()> {
        Ok(())
    }
    fn write_line(&self, s: &str) -> std::io::Result<()> {
        self.write_str(s)
    }
    fn write_str(&self, s: &str) -> std::io::Result<()> {
        if !s.trim().is_empty() {
            self.frame().0 = s.to_string();
        }
        Ok(())
    }
    fn clear_line(&self) -> std::io::Result<()> {
        self.frame().1 = true;
        Ok(())
    }
    fn flush(&self) -> std::io::Result<()> {
        let (text, cleared) = std::mem::take(&mut *self.frame());
        if text.is_empty() && !cleared {
            return Ok(());
        }
        // One write: the step's other threads print to the same stderr.
        let line = format!("{RELAY_MARK}{}\n", text.replace(['\n', '\r', RELAY_MARK], " ").trim_end());
        let mut out = self.out.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        out.write_all(line.as_bytes())?;
        out.flush()
    }
}

/// A relayed bar's text when `line` is one (empty: the bar was cleared); `None` for a log line.
pub fn relayed_line(line: &str) -> Option<&str> {
    line.strip_prefix(RELAY_MARK)
}

/// `train`'s side of the relay: one line at the bottom of its terminal showing the running
/// step's latest relayed frame.
#[derive(Clone)]
pub struct RelayedBar(ProgressBar);

impl RelayedBar {
    /// On a terminal, the line (empty until a frame comes); `None` elsewhere, where the steps
    /// are not asked to relay.
    pub fn on_terminal() -> Option<Self> {
        on_terminal().then(|| {
            let style = ProgressStyle::with_template("{msg}").unwrap_or_else(|_| ProgressStyle::default_spinner());
            Self(BARS.add(ProgressBar::new_spinner().with_style(style)))
        })
    }

    /// Shows a relayed frame ([`relayed_line`]); an empty one blanks the line.
    pub fn show(&self, frame: &str) {
        self.0.set_message(frame.to_string());
    }

    /// Runs `print` with the line out of the way, so that a log line does not tear it.
    pub fn suspend<R>(&self, print: impl FnOnce() -> R) -> R {
        self.0.suspend(print)
    }

    /// Takes the line off the terminal.
    pub fn finish(&self) {
        remove(&self.0);
    }
}

/// Takes a finished bar out of the stack.
pub fn remove(bar: &ProgressBar) {
    bar.finish_and_clear();
    BARS.remove(bar);
}

/// Prints a line to stdout without tearing the bars.
pub fn println(line: &str) {
    BARS.suspend(|| println!("{line}"));
}

/// Prints a line to stderr without tearing the bars.
pub fn eprintln(line: &str) {
    BARS.suspend(|| eprintln!("{line}"));
}

/// One phase's progress.
pub struct Phase {
    label: String,
    unit: &'static str,
    total: u64,
    done: u64,
    bar: Option<ProgressBar>,
    started: Instant,
    last_log: Instant,
    /// Whether the phase writes status and end lines: off a terminal, unless it is a phase a
    /// run's own log already reports ([`Self::bar_only`]).
    logs: bool,
}

impl Phase {
    /// A phase of `total` `unit`s ("batches", "prompts", "texts") named `label`.
    pub fn start(label: &str, unit: &'static str, total: u64) -> Self {
        let template = format!("{label}: {{bar:30}} {{pos}}/{{len}} {unit} [{{elapsed_precise}} < {{eta_precise}}]");
        let now = Instant::now();
        let bar = bar(total, 0, &template);
        Self { label: label.into(), unit, total, done: 0, bar, started: now, last_log: now, logs: !on_terminal() }
    }

    /// [`Self::start`] without the status lines off a terminal: a bar only (on a terminal, or
    /// relayed to `train`), for a phase short and frequent enough that lines would flood the log
    /// (each PPO rollout's generation, which its step line times).
    pub fn bar_only(label: &str, unit: &'static str, total: u64) -> Self {
        let mut phase = Self::start(label, unit, total);
        phase.logs = false;
        phase
    }

    /// Counts `n` done when the returned guard drops: at the end of a loop's body, however the
    /// iteration ends, so that the bar counts work finished, not work begun (a bar at 58/58
    /// while the last batch still runs has an early ETA).
    pub fn done_after(&mut self, n: u64) -> Done<'_> {
        Done { phase: self, n }
    }

    /// `n` more done. Off a terminal (a relayed bar included) the log gets its status lines.
    pub fn inc(&mut self, n: u64) {
        self.done += n;
        if let Some(bar) = &self.bar {
            bar.inc(n);
        }
        if let Some(line) = self.status_line_due(Instant::now()) {
            eprintln!("{line}");
        }
    }

    /// The status line due at `now`, [`LOG_EVERY`] after the last one (or the start).
    fn status_line_due(&mut self, now: Instant) -> Option<String> {
        if !self.logs || now.saturating_duration_since(self.last_log) < LOG_EVERY {
            return None;
        }
        self.last_log = now;
        Some(status_line(&self.label, self.unit, self.done, self.total, now.saturating_duration_since(self.started)))
    }

    /// The end line, when the phase ending at `now` took at least [`LOG_IF_LONGER`].
    fn end_line_due(&self, now: Instant) -> Option<String> {
        let elapsed = now.saturating_duration_since(self.started);
        (self.logs && elapsed >= LOG_IF_LONGER).then(|| end_line(&self.label, self.unit, self.done, elapsed))
    }
}

/// [`Phase::done_after`]'s guard.
pub struct Done<'a> {
    phase: &'a mut Phase,
    n: u64,
}

impl Drop for Done<'_> {
    fn drop(&mut self) {
        self.phase.inc(self.n);
    }
}

impl Drop for Phase {
    /// The bar goes; off a terminal a long phase says how long it took.
    fn drop(&mut self) {
        if let Some(bar) = self.bar.take() {
            remove(&bar);
        }
        if let Some(line) = self.end_line_due(Instant::now()) {
            eprintln!("{line}");
        }
    }
}

/// "tokenizing: 1200/5000 texts (24%), 12 s so far, about 38 s left".
pub fn status_line(label: &str, unit: &str, done: u64, total: u64, elapsed: Duration) -> String {
    let share = if total == 0 { 100.0 } else { 100.0 * done as f64 / total as f64 };
    let secs = elapsed.as_secs_f64();
    let left = match done {
        0 => "time left unknown".to_string(),
        _ => format!("about {} left", seconds(secs * (total.saturating_sub(done)) as f64 / done as f64)),
    };
    format!("{label}: {done}/{total} {unit} ({share:.0}%), {} so far, {left}", seconds(secs))
}

/// "tokenizing: 5000 texts in 48 s".
pub fn end_line(label: &str, unit: &str, done: u64, elapsed: Duration) -> String {
    format!("{label}: {done} {unit} in {}", seconds(elapsed.as_secs_f64()))
}

/// Whether `line` is a phase's [`status_line`] or [`end_line`]: the log's timing, which a
/// reader of a step's stderr looking for its error line sets apart (a loaded machine makes even
/// a short phase last long enough to print its end line).
pub fn is_phase_line(line: &str) -> bool {
    let count = |t: &str| !t.is_empty() && t.bytes().all(|b| b.is_ascii_digit());
    !line.starts_with("error")
        && line.match_indices(": ").any(|(at, _)| {
            let words: Vec<&str> = line[at + 2..].split(' ').collect();
            match words.as_slice() {
                [done, _unit, "in", ..] => count(done),
                [progress, _unit, share, ..] => {
                    progress.split_once('/').is_some_and(|(d, t)| count(d) && count(t))
                        && share.ends_with("%),")
                        && line.contains(" so far, ")
                }
                _ => false,
            }
        })
}

/// "48 s", "3 min 05 s".
fn seconds(secs: f64) -> String {
    let s = secs.round() as u64;
    match s {
        0..60 => format!("{s} s"),
        _ => format!("{} min {:02} s", s / 60, s % 60),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn phase_lines_are_told_from_other_lines() {
        let (s, min) = (Duration::from_secs(3), Duration::from_secs(185));
        for line in [
            end_line("tokenizing", "texts", 8, s),
            end_line("evaluating: reward", "batches", 12, min),
            status_line("tokenizing", "texts", 1200, 5000, s),
            status_line("generating", "prompts", 0, 64, s),
        ] {
            assert!(is_phase_line(&line), "{line}");
        }
        for line in [
            "error: the checkpoint has n_embd (--hidden-size) = 32 but the flags ask for 64: resume with them",
            "error: 3 texts in 2 s",
            "step 1: loss 2.5 in 3 s",
            "tokenizing: done",
            "warning: 12/40 rows (30%), dropped",
            "",
        ] {
            assert!(!is_phase_line(line), "{line}");
        }
    }

    #[test]
    fn a_step_counts_when_its_work_is_done() {
        let mut phase = Phase::start("evaluating", "batches", 3);
        for k in 0..3u64 {
            let _done = phase.done_after(1);
            if k == 1 {
                continue; // an iteration that ends early counts too
            }
            assert_eq!(phase_done(&_done), k, "while batch {k} runs, {k} are done");
        }
        assert_eq!(phase.done, 3);
    }

    fn phase_done(done: &Done) -> u64 {
        done.phase.done
    }

    #[test]
    fn log_lines_give_the_share_the_time_and_the_time_left() {
        let line = status_line("tokenizing", "texts", 1200, 5000, Duration::from_secs(12));
        assert_eq!(line, "tokenizing: 1200/5000 texts (24%), 12 s so far, about 38 s left");
        let line = status_line("evaluating", "batches", 0, 10, Duration::from_secs(1));
        assert_eq!(line, "evaluating: 0/10 batches (0%), 1 s so far, time left unknown");
        let line = status_line("generating", "prompts", 10, 40, Duration::from_secs(61));
        assert_eq!(line, "generating: 10/40 prompts (25%), 1 min 01 s so far, about 3 min 03 s left");
        assert_eq!(
            end_line("tokenizing", "texts", 5000, Duration::from_millis(48_400)),
            "tokenizing: 5000 texts in 48 s"
        );
    }

    #[test]
    fn off_a_terminal_a_phase_logs_every_30_s_and_at_its_end_after_2_s() {
        let mut phase = Phase::start("tokenizing", "texts", 10);
        assert_eq!(phase.logs, !on_terminal(), "status lines off a terminal only");
        phase.logs = true;
        let t0 = phase.started;
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        phase.inc(4);
        assert_eq!(phase.status_line_due(at(29_999)), None, "not before 30 s");
        let line = phase.status_line_due(at(30_000));
        assert_eq!(line.as_deref(), Some("tokenizing: 4/10 texts (40%), 30 s so far, about 45 s left"));
        assert_eq!(phase.status_line_due(at(59_999)), None, "30 s after the last line, not after the start");
        assert!(phase.status_line_due(at(60_000)).is_some());
        assert_eq!(phase.end_line_due(at(1_999)), None, "a short phase ends without a line");
        assert_eq!(phase.end_line_due(at(2_000)).as_deref(), Some("tokenizing: 4 texts in 2 s"));

        let mut quiet = Phase::bar_only("generating", "prompts", 10);
        assert!(!quiet.logs);
        assert_eq!(quiet.status_line_due(at(600_000)), None, "a bar-only phase writes no status line");
        assert_eq!(quiet.end_line_due(at(600_000)), None, "nor an end line");
    }

    #[test]
    fn off_a_terminal_a_phase_draws_no_bar() {
        // Tests run with stderr captured or piped: no bar, whatever the phase does.
        if on_terminal() {
            return;
        }
        if relaying() {
            return;
        }
        let mut phase = Phase::start("x", "items", 3);
        phase.inc(3);
        assert!(phase.bar.is_none());
        assert!(bar(10, 0, "{bar}").is_none());
    }

    /// A buffer the relay writes into, readable by the test.
    #[derive(Clone, Default)]
    struct Shared(std::sync::Arc<Mutex<Vec<u8>>>);

    impl Write for Shared {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn a_relayed_bar_writes_marked_lines_that_read_back_as_its_frames() {
        let out = Shared::default();
        let style = ProgressStyle::with_template("evaluating: {pos}/{len} batches").unwrap();
        let bar = relayed_bar(10, 2, style, Box::new(out.clone()));
        bar.inc(1);
        std::thread::sleep(Duration::from_millis(600)); // past a frame of RELAY_HZ
        bar.inc(2);
        bar.finish_and_clear();
        let text = String::from_utf8(out.0.lock().unwrap().clone()).unwrap();
        let frames: Vec<&str> = text.lines().map(|l| relayed_line(l).expect("every line is marked")).collect();
        assert!(frames.iter().any(|f| f.starts_with("evaluating: ") && f.ends_with("/10 batches")), "{frames:?}");
        assert_eq!(frames.last(), Some(&""), "clearing the bar relays an empty frame: {frames:?}");
        assert_eq!(relayed_line("step 1 | loss 2.5"), None, "a log line is not a frame");
    }
}
