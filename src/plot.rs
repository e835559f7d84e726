//! `train plot DIR`: redraws the training curves (`curves.png`) of any run from its
//! `metrics.jsonl`: a step's output directory, or a `train` output directory (each step in it).

use anyhow::{bail, Result};
use hybrid_engine::telemetry::plots::{plot_records, Plotted, CURVES_FILE};
use hybrid_engine::training::metrics::{read_records, METRICS_FILE};
use std::path::{Path, PathBuf};

/// `train plot`'s arguments.
#[derive(clap::Args, Debug)]
pub struct PlotArgs {
    /// A step's output directory (output/actor, output/step3, ...) or a train --output-dir.
    pub dir: PathBuf,
}

/// The run directories under `dir`: itself when it holds a metrics.jsonl, else its immediate
/// subdirectories that do, in name order.
pub fn run_dirs(dir: &Path) -> Result<Vec<PathBuf>> {
    if dir.join(METRICS_FILE).is_file() {
        return Ok(vec![dir.to_path_buf()]);
    }
    let Ok(entries) = std::fs::read_dir(dir) else {
        bail!(
            "{} is not a directory: pass a step's output directory (output/step3) or a train --output-dir",
            dir.display()
        )
    };
    let mut runs: Vec<PathBuf> =
        entries.flatten().map(|e| e.path()).filter(|p| p.join(METRICS_FILE).is_file()).collect();
    runs.sort();
    if runs.is_empty() {
        bail!("no {METRICS_FILE} in {} or its subdirectories: pass a step's output directory (output/step3) or a train --output-dir", dir.display());
    }
    Ok(runs)
}

/// Draws `curves.png` in each run directory under `dir`; the runs with nothing to draw are left
/// out.
pub fn plot(dir: &Path) -> Result<Vec<Plotted>> {
    let mut plotted = Vec::new();
    for run in run_dirs(dir)? {
        let records = read_records(&run.join(METRICS_FILE))?;
        plotted.extend(plot_records(&records, &run.join(CURVES_FILE))?);
    }
    Ok(plotted)
}

pub fn main(args: &PlotArgs) -> Result<()> {
    for p in plot(&args.dir)? {
        println!("{} ({}x{}): {}", p.path.display(), p.size.0, p.size.1, p.panels.join(", "));
    }
    Ok(())
}
