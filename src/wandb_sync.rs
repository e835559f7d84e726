//! `train wandb-sync DIR`: uploads the wandb runs kept on disk (an offline run, or the rows an
//! unreachable service missed) to the service: each run's history lines the service lacks, then
//! its exit code. Running it again sends nothing twice.

use anyhow::{bail, Result};
use hybrid_engine::telemetry::wandb::{find_api_key, sync_dir, DEFAULT_BASE_URL};
use std::path::PathBuf;

/// `train wandb-sync`'s arguments.
#[derive(clap::Args, Debug)]
pub struct WandbSyncArgs {
    /// A run's directory (output/wandb/step3/run-...), or a directory above runs (output/wandb,
    /// output/wandb/step3).
    pub dir: PathBuf,
}

pub fn main(args: &WandbSyncArgs) -> Result<()> {
    // The key and service as a training run finds them; the runs keep their own service unless
    // WANDB_BASE_URL names another.
    let base_url = std::env::var("WANDB_BASE_URL").ok().filter(|u| !u.trim().is_empty());
    let home = std::env::var_os("HOME").map(PathBuf::from);
    let key = find_api_key(base_url.as_deref().unwrap_or(DEFAULT_BASE_URL), |n| std::env::var(n).ok(), home.as_deref());
    let Some(key) = key else { bail!("wandb needs an API key: set WANDB_API_KEY (or run `wandb login`)") };
    let policy = hybrid_engine::telemetry::wandb::stream::Policy::default();
    for run in sync_dir(&args.dir, base_url.as_deref(), &key, &policy)? {
        let state = match run.completed {
            Some(code) => format!("finished with exit code {code}"),
            None => "not finished (it crashed, or is still running)".into(),
        };
        println!("{}: {} rows on the service, {state}: {}", run.dir.display(), run.sent, run.url.unwrap_or_default());
    }
    Ok(())
}
