//! Training telemetry: every metric appended as one JSON object per line to `metrics.jsonl`
//! (so a crashed run keeps what it logged), a Megatron-style text line per log interval, a
//! progress bar only when stderr is a terminal, and the process's peak memory.

use anyhow::{Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};

pub struct Metrics {
    path: PathBuf,
    file: std::fs::File,
    bar: Option<ProgressBar>,
}

impl Metrics {
    /// Appends to `<dir>/metrics.jsonl` (a resumed run continues the same file). `total` sizes the
    /// progress bar; `done` is where it starts.
    pub fn open(dir: &Path, total: u64, done: u64) -> Result<Self> {
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create output directory {}", dir.display()))?;
        let path = dir.join("metrics.jsonl");
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .with_context(|| format!("cannot open {} for appending", path.display()))?;
        let bar = std::io::stderr().is_terminal().then(|| {
            let bar = ProgressBar::new(total).with_position(done);
            bar.set_style(
                ProgressStyle::with_template("{bar:40} {pos}/{len} iters [{elapsed_precise} < {eta_precise}] {msg}")
                    .expect("valid template"),
            );
            bar
        });
        Ok(Self { path, file, bar })
    }

    /// Appends one record.
    pub fn record(&mut self, value: serde_json::Value) -> Result<()> {
        writeln!(self.file, "{value}").with_context(|| format!("writing {}", self.path.display()))
    }

    /// Prints a log line to stdout without tearing the progress bar.
    pub fn println(&self, line: &str) {
        match &self.bar {
            Some(bar) => bar.suspend(|| println!("{line}")),
            None => println!("{line}"),
        }
    }

    pub fn advance(&self, message: String) {
        if let Some(bar) = &self.bar {
            bar.inc(1);
            bar.set_message(message);
        }
    }

    pub fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }
}

/// Peak resident memory of this process in MiB (Linux `VmHWM`), if the platform reports it.
pub fn peak_rss_mib() -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib / 1024.0)
}
