//! Training telemetry: every metric appended as one JSON object per line to `metrics.jsonl`
//! (so a crashed run keeps what it logged) and, with `--enable-tensorboard`, as scalars to a
//! TensorBoard event file, with `--enable-wandb` as a wandb history row; the run's curves as a
//! PNG at its end; a Megatron-style text line per log interval, a progress bar only when stderr
//! is a terminal, and the process's peak memory.
//!
//! Each line is written with a single `write` on a file opened for appending, so a crash leaves at
//! worst a torn last line, never two records interleaved; [`read_records`] skips such a line.

use anyhow::{Context, Result};
use indicatif::ProgressBar;
use std::io::Write;
use std::path::{Path, PathBuf};
use telemetry::plots::{plot_records, CURVES_FILE};
use telemetry::tensorboard::{EventWriter, RecordScalars};
use telemetry::wandb::{Settings as WandbSettings, WandbRun};

pub const METRICS_FILE: &str = "metrics.jsonl";
/// How a run's log line with its command line starts (rank 0 prints it when the log opens).
pub const COMMAND_PREFIX: &str = "command: ";

pub struct Metrics {
    path: PathBuf,
    /// `None` on the ranks other than 0: they log nothing (rank 0 logs for the group).
    file: Option<std::fs::File>,
    bar: Option<ProgressBar>,
    /// The scalars and step of each record, for the sinks below (`None` without any).
    scalars: Option<RecordScalars>,
    tensorboard: Option<EventWriter>,
    wandb: Option<WandbRun>,
}

/// Where a run's records go besides metrics.jsonl (the `LogArgs` flags resolved).
#[derive(Default)]
pub struct Sinks {
    /// The TensorBoard event files' directory.
    pub tensorboard: Option<PathBuf>,
    pub wandb: Option<WandbSettings>,
}

impl Metrics {
    /// Opens `<dir>/metrics.jsonl`: a run that starts from the beginning (`done == 0`) starts a
    /// fresh file, a resumed run appends to the one it continues. `total` sizes the progress
    /// bar; `done` is where it starts. Saving the model into `dir` keeps it (no save wrote it:
    /// [`crate::durable`]).
    pub fn open(dir: &Path, total: u64, done: u64) -> Result<Self> {
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create output directory {}", dir.display()))?;
        let path = dir.join(METRICS_FILE);
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .with_context(|| format!("cannot open {} for appending", path.display()))?;
        if done == 0 {
            file.set_len(0).with_context(|| format!("cannot start {} afresh", path.display()))?;
        }
        // The run's flags, in its log (the run report of `train` quotes them).
        println!("{COMMAND_PREFIX}{}", command_line());
        let bar = telemetry::progress::bar(
            total,
            done,
            "{bar:40} {pos}/{len} iters [{elapsed_precise} < {eta_precise}] {msg}",
        );
        Ok(Self::without_sinks(path, Some(file), bar))
    }

    fn without_sinks(path: PathBuf, file: Option<std::fs::File>, bar: Option<ProgressBar>) -> Self {
        Self { path, file, bar, scalars: None, tensorboard: None, wandb: None }
    }

    /// [`Self::open`] on rank 0; on the other ranks a log that records and prints nothing.
    pub fn for_rank(rank: usize, dir: &Path, total: u64, done: u64) -> Result<Self> {
        if rank == 0 {
            Self::open(dir, total, done)
        } else {
            Ok(Self::without_sinks(dir.join(METRICS_FILE), None, None))
        }
    }

    /// Also sends every record to the `sinks` (rank 0 only): a new TensorBoard event file in
    /// its directory, with the command line as text; a wandb run (a resumed run, `done > 0`,
    /// continues the wandb run of its first attempt), with the parsed flags as its config. Both
    /// get the record's scalars under its keys, or the `aliases` other systems use for them
    /// where they have one (`telemetry::tensorboard::MEGATRON_TAGS`, ...: one tag per value), at
    /// the record's step (or pretraining's
    /// iteration); a resumed run continues at `done`.
    pub fn with_sinks(
        mut self,
        sinks: Sinks,
        aliases: &'static [(&'static str, &'static str, f64)],
        done: u64,
    ) -> Result<Self> {
        if self.file.is_none() || (sinks.tensorboard.is_none() && sinks.wandb.is_none()) {
            return Ok(self);
        }
        if let Some(dir) = &sinks.tensorboard {
            let mut writer = EventWriter::create(dir)?;
            writer.text(done as i64, "flags", &format!("```\n{}\n```", command_line()))?;
            // The flags as parsed (defaults too) in the HPARAMS tab; its metrics are the scalars.
            if let Some(config) = telemetry::wandb::flags_config() {
                writer.hparams_start(telemetry::hparams::of_config(&config))?;
            }
            self.println(&format!("TensorBoard: {}", writer.path().display()));
            self.tensorboard = Some(writer);
        }
        if let Some(settings) = &sinks.wandb {
            // The flags as parsed, defaults included; else the command line as typed.
            let config = telemetry::wandb::flags_config()
                .unwrap_or_else(|| telemetry::wandb::config_of_args(&std::env::args().collect::<Vec<_>>()));
            let policy = telemetry::wandb::policy_from_env()?;
            // The upload thread's messages, above the progress bars.
            let say: telemetry::wandb::stream::Say = std::sync::Arc::new(telemetry::progress::eprintln);
            self.wandb = WandbRun::start(settings, done > 0, config, policy, say)?;
        }
        self.scalars = Some(RecordScalars::new(aliases, done as i64));
        Ok(self)
    }

    /// Appends one record, as one line in one write.
    pub fn record(&mut self, value: serde_json::Value) -> Result<()> {
        let Some(file) = &mut self.file else { return Ok(()) };
        file.write_all(format!("{value}\n").as_bytes()).with_context(|| format!("writing {}", self.path.display()))?;
        let Some(steps) = &mut self.scalars else { return Ok(()) };
        let (step, scalars) = steps.of(&value);
        if let Some(writer) = &mut self.tensorboard {
            writer.scalars(step, &scalars)?;
        }
        if let Some(wandb) = &mut self.wandb {
            wandb.log(step, &scalars)?;
        }
        Ok(())
    }

    /// Appends the run's last record, finishes the wandb run (exit code 0; a `Metrics` dropped
    /// without `end` marks it failed), then draws its curves ([`CURVES_FILE`] beside
    /// metrics.jsonl) from every record the file holds, a resumed run's earlier ones included. A
    /// drawing failure is a warning: the run itself has succeeded.
    /// A step's last record once its work is done: rank 0's peak memory printed and recorded
    /// with `summary` ([`Self::end`]), then every rank of `group` waits for the others, so that
    /// none exits while another still works.
    pub fn end_run(&mut self, group: &crate::comm::ProcessGroup, summary: &impl serde::Serialize) -> Result<()> {
        let peak = peak_rss_mib().filter(|_| group.is_first());
        if let Some(p) = peak {
            println!("peak memory (RSS): {p:.1} MiB");
        }
        self.end(serde_json::json!({"event": "end", "summary": summary, "peak_rss_mib": peak}))?;
        group.barrier()
    }

    pub fn end(&mut self, value: serde_json::Value) -> Result<()> {
        self.record(value)?;
        if let Some(writer) = &mut self.tensorboard {
            writer.hparams_end(true)?;
        }
        if let Some(wandb) = &mut self.wandb {
            wandb.finish(0)?;
        }
        if self.file.is_none() {
            return Ok(());
        }
        let out = self.path.with_file_name(CURVES_FILE);
        match read_records(&self.path).and_then(|records| plot_records(&records, &out)) {
            Ok(Some(plotted)) => {
                self.println(&format!("training curves: {} ({})", out.display(), plotted.panels.join(", ")));
            }
            Ok(None) => {}
            Err(e) => eprintln!("warning: could not draw the training curves: {e:#}"),
        }
        Ok(())
    }

    /// A text panel (markdown) at `step` in the TensorBoard event file, when there is one.
    pub fn text(&mut self, step: i64, tag: &str, markdown: &str) -> Result<()> {
        match &mut self.tensorboard {
            Some(writer) => writer.text(step, tag, markdown),
            None => Ok(()),
        }
    }

    /// Prints a log line to stdout without tearing the progress bar.
    pub fn println(&self, line: &str) {
        if self.file.is_none() {
            return;
        }
        telemetry::progress::println(line);
    }

    pub fn advance(&self, message: String) {
        if let Some(bar) = &self.bar {
            bar.inc(1);
            bar.set_message(message);
        }
    }

    pub fn finish(&self) {
        if let Some(bar) = &self.bar {
            telemetry::progress::remove(bar);
        }
    }
}

/// This process's arguments, as one line.
fn command_line() -> String {
    std::env::args().collect::<Vec<_>>().join(" ")
}

/// The records of a `metrics.jsonl`. A last line that is not valid JSON and has no newline is
/// what a crash in the middle of a write leaves: it is skipped with a warning. Any other invalid
/// line is an error.
pub fn read_records(path: &Path) -> Result<Vec<serde_json::Value>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    let torn_tail = !text.is_empty() && !text.ends_with('\n');
    let lines: Vec<&str> = text.lines().collect();
    let mut records = Vec::with_capacity(lines.len());
    for (i, line) in lines.iter().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        match serde_json::from_str(line) {
            Ok(value) => records.push(value),
            Err(_) if torn_tail && i + 1 == lines.len() => {
                eprintln!(
                    "warning: {} ends with a partly written line (a run was interrupted while logging); skipped it",
                    path.display()
                );
            }
            Err(e) => anyhow::bail!("{} line {} is not JSON ({e}): the file is damaged", path.display(), i + 1),
        }
    }
    Ok(records)
}

/// Peak resident memory of this process in MiB (Linux `VmHWM`), if the platform reports it.
pub fn peak_rss_mib() -> Option<f64> {
    status_mib("VmHWM:")
}

/// Resident memory of this process now in MiB (Linux `VmRSS`), if the platform reports it.
pub fn current_rss_mib() -> Option<f64> {
    status_mib("VmRSS:")
}

/// The process's resident memory that is live: its RSS less the freed memory its heap keeps
/// for reuse ([`crate::runtime::retain_freed_memory`]: reading a model's files leaves buffers
/// there that later allocations take), by glibc's own count (`mallinfo2`).
pub fn live_rss_mib() -> Option<f64> {
    let rss = current_rss_mib()?;
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: mallinfo2 only reads the allocator's statistics.
        let info = unsafe { libc::mallinfo2() };
        Some((rss - info.fordblks as f64 / (1024.0 * 1024.0)).max(0.0))
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    Some(rss)
}

fn status_mib(field: &str) -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with(field))?;
    let kib: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib / 1024.0)
}

/// One rank's use of the machine over its training loop, `train_secs` long (every rank prints
/// its own line; the record is for rank 0's metrics.jsonl): its peak memory so far and what
/// its collectives sent and how long they took, waiting for slower ranks included.
pub fn rank_usage(
    group: &crate::comm::ProcessGroup,
    subgroups: &[&crate::comm::ProcessGroup],
    train_secs: f64,
) -> (String, serde_json::Value) {
    let (mut bytes, mut comm_secs, mut calls) = group.stats().snapshot();
    for g in subgroups {
        let (b, s, c) = g.stats().snapshot();
        (bytes, comm_secs, calls) = (bytes + b, comm_secs + s, calls + c);
    }
    let peak = peak_rss_mib();
    let share = 100.0 * comm_secs / train_secs.max(1e-9);
    let line = format!(
        "rank {} of {}: peak memory in training (RSS) {} | communication: {:.1} MiB sent in {calls} collectives, {comm_secs:.2} s = {share:.1}% of {train_secs:.2} s training",
        group.rank(),
        group.world(),
        peak.map_or("n/a".into(), |p| format!("{p:.1} MiB")),
        bytes as f64 / (1024.0 * 1024.0),
    );
    let record = serde_json::json!({
        "event": "rank_usage", "rank": group.rank(), "world": group.world(), "peak_rss_mib": peak,
        "comm_bytes": bytes, "comm_secs": comm_secs, "comm_calls": calls, "train_secs": train_secs,
    });
    (line, record)
}

/// What this rank sent per iteration inside its tensor-parallel group (the activations' and
/// their gradients' all-reduces in every layer) and its data-parallel group (the gradients),
/// over `iterations` iterations: the two kinds of traffic Megatron's layout trades.
pub fn parallel_traffic(
    tp: &crate::comm::ProcessGroup,
    dp: &crate::comm::ProcessGroup,
    iterations: u64,
) -> (String, serde_json::Value) {
    let per_iteration = |g: &crate::comm::ProcessGroup| {
        let (bytes, secs, calls) = g.stats().snapshot();
        let n = iterations.max(1) as f64;
        (bytes as f64 / n, secs / n, calls as f64 / n)
    };
    let ((tp_bytes, tp_secs, tp_calls), (dp_bytes, dp_secs, dp_calls)) = (per_iteration(tp), per_iteration(dp));
    let mib = |b: f64| b / (1024.0 * 1024.0);
    let line = format!(
        "sent per training step: tensor parallel {:.2} MiB in {tp_calls:.0} collectives ({tp_secs:.3} s), data parallel {:.2} MiB in {dp_calls:.0} collectives ({dp_secs:.3} s)",
        mib(tp_bytes),
        mib(dp_bytes)
    );
    let record = serde_json::json!({
        "event": "parallel_traffic", "iterations": iterations,
        "tp_bytes_per_iteration": tp_bytes, "tp_calls_per_iteration": tp_calls, "tp_secs_per_iteration": tp_secs,
        "dp_bytes_per_iteration": dp_bytes, "dp_calls_per_iteration": dp_calls, "dp_secs_per_iteration": dp_secs,
    });
    (line, record)
}

/// After a training loop of `train_secs` over `steps` steps, with more than one rank: each
/// rank's [`rank_usage`] line and, under tensor parallelism (`layout`), the
/// [`parallel_traffic`] per step, printed and recorded in `metrics`.
pub fn record_parallel_usage(
    metrics: &mut Metrics,
    world: &crate::comm::ProcessGroup,
    layout: Option<&crate::tensor_parallel::layout::ParallelLayout>,
    train_secs: f64,
    steps: u64,
) -> anyhow::Result<()> {
    if world.world() > 1 {
        let subgroups: Vec<&crate::comm::ProcessGroup> = layout.iter().flat_map(|l| [&*l.tp, &*l.dp]).collect();
        let (line, record) = rank_usage(world, &subgroups, train_secs);
        println!("{line}");
        metrics.record(record)?;
    }
    if let Some(layout) = layout {
        let (line, record) = parallel_traffic(&layout.tp, &layout.dp, steps);
        println!("{line}");
        metrics.record(record)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_torn_last_line_is_skipped_and_other_damage_is_an_error() -> Result<()> {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join(METRICS_FILE);
        std::fs::write(&path, "{\"step\":1}\n{\"step\":2}\n{\"step\":3,\"lo")?;
        let records = read_records(&path)?;
        assert_eq!(records, vec![serde_json::json!({"step": 1}), serde_json::json!({"step": 2})]);
        std::fs::write(&path, "{\"step\":1}\n{\"st\n{\"step\":3}\n")?;
        let err = read_records(&path).unwrap_err().to_string();
        assert!(err.contains("line 2") && !err.contains('\n'), "{err}");
        Ok(())
    }

    #[test]
    fn records_are_whole_lines_and_a_fresh_run_starts_a_fresh_file() -> Result<()> {
        let dir = tempfile::tempdir()?;
        std::fs::write(dir.path().join(METRICS_FILE), "{\"stale\":true}\n")?;
        let mut m = Metrics::open(dir.path(), 2, 0)?;
        m.record(serde_json::json!({"step": 1}))?;
        drop(m);
        let mut m = Metrics::open(dir.path(), 2, 1)?; // resumed: appends
        m.record(serde_json::json!({"step": 2}))?;
        let text = std::fs::read_to_string(dir.path().join(METRICS_FILE))?;
        assert_eq!(text, "{\"step\":1}\n{\"step\":2}\n");
        Ok(())
    }
}
