//! The progress of a long phase (tokenizing, evaluation, generation, training): on a terminal
//! an indicatif bar with its ETA; otherwise plain log lines on stderr (as tqdm's; stdout may be
//! a tool's data, `policy_eval`'s table), a status line every [`LOG_EVERY`] and one at the end
//! of a phase that took a while, so piped output and log files get no bar drawing. Every bar joins one `MultiProgress`: a phase inside the training loop (an
//! evaluation) stacks its bar under the training bar instead of drawing over it.

use indicatif::{MultiProgress, ProgressBar, ProgressStyle};
use std::io::IsTerminal;
use std::sync::LazyLock;
use std::time::{Duration, Instant};

/// Off a terminal, a running phase logs its status this often.
pub const LOG_EVERY: Duration = Duration::from_secs(30);
/// Off a terminal, a phase that took at least this long logs a line when it ends.
pub const LOG_IF_LONGER: Duration = Duration::from_secs(2);

static BARS: LazyLock<MultiProgress> = LazyLock::new(MultiProgress::new);

/// Whether bars are drawn: stderr is a terminal.
pub fn on_terminal() -> bool {
    std::io::stderr().is_terminal()
}

/// A bar of `total` steps, `done` of them already, in the shared stack; `None` off a terminal.
/// `template` is indicatif's (the training bar's has its own fields).
pub fn bar(total: u64, done: u64, template: &str) -> Option<ProgressBar> {
    on_terminal().then(|| {
        let style = ProgressStyle::with_template(template).unwrap_or_else(|_| ProgressStyle::default_bar());
        BARS.add(ProgressBar::new(total).with_position(done).with_style(style))
    })
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
}

impl Phase {
    /// A phase of `total` `unit`s ("batches", "prompts", "texts") named `label`.
    pub fn start(label: &str, unit: &'static str, total: u64) -> Self {
        let template = format!("{label}: {{bar:30}} {{pos}}/{{len}} {unit} [{{elapsed_precise}} < {{eta_precise}}]");
        let now = Instant::now();
        Self { label: label.into(), unit, total, done: 0, bar: bar(total, 0, &template), started: now, last_log: now }
    }

    /// Counts `n` done when the returned guard drops: at the end of a loop's body, however the
    /// iteration ends, so that the bar counts work finished, not work begun (a bar at 58/58
    /// while the last batch still runs has an early ETA).
    pub fn done_after(&mut self, n: u64) -> Done<'_> {
        Done { phase: self, n }
    }

    /// `n` more done.
    pub fn inc(&mut self, n: u64) {
        self.done += n;
        match &self.bar {
            Some(bar) => bar.inc(n),
            None if self.last_log.elapsed() >= LOG_EVERY => {
                self.last_log = Instant::now();
                eprintln!("{}", status_line(&self.label, self.unit, self.done, self.total, self.started.elapsed()));
            }
            None => {}
        }
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
        match self.bar.take() {
            Some(bar) => remove(&bar),
            None if self.started.elapsed() >= LOG_IF_LONGER => {
                eprintln!("{}", end_line(&self.label, self.unit, self.done, self.started.elapsed()))
            }
            None => {}
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
    fn off_a_terminal_a_phase_draws_no_bar() {
        // Tests run with stderr captured or piped: no bar, whatever the phase does.
        if on_terminal() {
            return;
        }
        let mut phase = Phase::start("x", "items", 3);
        phase.inc(3);
        assert!(phase.bar.is_none());
        assert!(bar(10, 0, "{bar}").is_none());
    }
}
