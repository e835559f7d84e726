//! Where a run's metrics go besides `metrics.jsonl`: TensorBoard (DS-Chat's
//! `--enable_tensorboard` / `--tensorboard_path`, Megatron's `--tensorboard-dir`) and wandb
//! (OpenRLHF's and TRL's; Megatron's `--wandb-project` / `--wandb-exp-name` /
//! `--wandb-save-dir`). Every step and pretraining flatten these flags.

use crate::cli::heading;
use crate::training::metrics::Sinks;
use anyhow::Result;
use clap::Args;
use std::path::{Path, PathBuf};
use telemetry::wandb::{Flags, Settings};

/// `train --enable-tensorboard` reaches the steps as this variable, the default of their flag.
pub const ENABLE_TENSORBOARD_ENV: &str = "RLHF_ENABLE_TENSORBOARD";
/// `train --enable-wandb` reaches the steps as this variable, the default of their flag.
pub const ENABLE_WANDB_ENV: &str = "RLHF_ENABLE_WANDB";

#[derive(Args, Debug, Clone, Default)]
pub struct LogArgs {
    /// Write TensorBoard event files: every metric of metrics.jsonl as a scalar, the command line
    /// as text (rank 0 only).
    #[arg(help_heading = heading::LOGGING, long, alias = "enable_tensorboard", env = ENABLE_TENSORBOARD_ENV, value_parser = clap::builder::FalseyValueParser::new())]
    pub enable_tensorboard: bool,
    /// The event files' directory (implies --enable-tensorboard; default: tensorboard/<name of
    /// the output directory> beside the output directory, so `tensorboard --logdir
    /// output/tensorboard` shows every step of a `train` run).
    #[arg(help_heading = heading::LOGGING, long, alias = "tensorboard_path", alias = "tensorboard-dir", alias = "tensorboard_dir")]
    pub tensorboard_path: Option<PathBuf>,
    /// Stream every metric to Weights & Biases as history rows, the flags as the run's config
    /// (rank 0 only). The key comes from WANDB_API_KEY or `wandb login`'s ~/.netrc, the service
    /// from WANDB_BASE_URL; WANDB_MODE=offline only keeps the rows on disk (upload them with
    /// `train wandb-sync DIR`), WANDB_MODE=disabled turns wandb off.
    #[arg(help_heading = heading::LOGGING, long, alias = "enable_wandb", env = ENABLE_WANDB_ENV, value_parser = clap::builder::FalseyValueParser::new())]
    pub enable_wandb: bool,
    /// The wandb project (implies --enable-wandb; default: WANDB_PROJECT, else "uncategorized").
    #[arg(help_heading = heading::LOGGING, long, alias = "wandb_project")]
    pub wandb_project: Option<String>,
    /// The wandb entity (team or user; default: WANDB_ENTITY, else the API key's own).
    #[arg(help_heading = heading::LOGGING, long, alias = "wandb_entity")]
    pub wandb_entity: Option<String>,
    /// The run's name in wandb (default: WANDB_NAME, else the output directory's name).
    #[arg(help_heading = heading::LOGGING, long, alias = "wandb_run_name", alias = "wandb-exp-name", alias = "wandb_exp_name")]
    pub wandb_run_name: Option<String>,
    /// The wandb group the run belongs to (default: WANDB_RUN_GROUP; `train` groups its steps).
    #[arg(help_heading = heading::LOGGING, long, alias = "wandb_group")]
    pub wandb_group: Option<String>,
    /// Where the runs' local copies go, one directory per output directory (default: WANDB_DIR,
    /// else wandb/ beside the output directory).
    #[arg(help_heading = heading::LOGGING, long, alias = "wandb_dir", alias = "wandb-save-dir", alias = "wandb_save_dir")]
    pub wandb_dir: Option<PathBuf>,
}

impl LogArgs {
    /// The TensorBoard directory of a run writing to `output_dir`, if TensorBoard is on.
    pub fn tensorboard_dir(&self, output_dir: &Path) -> Option<PathBuf> {
        if let Some(path) = &self.tensorboard_path {
            return Some(path.clone());
        }
        self.enable_tensorboard.then(|| default_tensorboard_dir(output_dir))
    }

    /// The wandb settings of a run writing to `output_dir`, if wandb is on (--enable-wandb or
    /// --wandb-project), from the flags and then wandb's environment variables. A wandb flag
    /// without wandb on, a bad WANDB_MODE or a missing key is an error.
    pub fn wandb(&self, output_dir: &Path) -> Result<Option<Settings>> {
        if !self.enable_wandb && self.wandb_project.is_none() {
            telemetry::wandb::refuse_flags_when_off(&[
                ("--wandb-entity", self.wandb_entity.is_some()),
                ("--wandb-run-name", self.wandb_run_name.is_some()),
                ("--wandb-group", self.wandb_group.is_some()),
                ("--wandb-dir", self.wandb_dir.is_some()),
            ])?;
            return Ok(None);
        }
        let flags = Flags {
            project: self.wandb_project.clone(),
            entity: self.wandb_entity.clone(),
            run_name: self.wandb_run_name.clone(),
            group: self.wandb_group.clone(),
            dir: self.wandb_dir.clone(),
        };
        let home = std::env::var_os("HOME").map(PathBuf::from);
        Settings::resolve(&flags, output_dir, |name| std::env::var(name).ok(), home.as_deref()).map(Some)
    }

    /// Checks the flags and the environment they depend on (at parse time, before any work).
    pub fn validate(&self) -> Result<()> {
        self.wandb(Path::new("output")).map(drop)
    }

    /// The sinks of a run writing to `output_dir`.
    pub fn sinks(&self, output_dir: &Path) -> Result<Sinks> {
        Ok(Sinks { tensorboard: self.tensorboard_dir(output_dir), wandb: self.wandb(output_dir)? })
    }
}

/// `<parent>/tensorboard/<name>` for an output directory `<parent>/<name>`. Not inside the output
/// directory: saving a model there replaces the directory, and the event files must outlive it.
pub fn default_tensorboard_dir(output_dir: &Path) -> PathBuf {
    let absolute = std::path::absolute(output_dir).unwrap_or_else(|_| output_dir.to_path_buf());
    let absolute: PathBuf = absolute.components().collect(); // drops "." components
    let name = absolute.file_name().map_or_else(|| "run".into(), |n| n.to_string_lossy().to_string());
    absolute.parent().unwrap_or(Path::new("/")).join("tensorboard").join(name)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        log: LogArgs,
    }

    #[test]
    fn tensorboard_is_off_by_default_and_a_path_in_any_spelling_turns_it_on() {
        let parse = |args: &[&str]| Cli::parse_from(std::iter::once("x").chain(args.iter().copied())).log;
        assert_eq!(parse(&[]).tensorboard_dir(Path::new("/runs/out/actor")), None);
        let on = parse(&["--enable_tensorboard"]);
        assert_eq!(
            on.tensorboard_dir(Path::new("/runs/out/actor")),
            Some(PathBuf::from("/runs/out/tensorboard/actor"))
        );
        for flag in ["--tensorboard-path", "--tensorboard_path", "--tensorboard-dir", "--tensorboard_dir"] {
            let log = parse(&[flag, "/tb"]);
            assert_eq!(log.tensorboard_dir(Path::new("out")), Some(PathBuf::from("/tb")), "{flag}");
        }
        let cwd = std::env::current_dir().unwrap();
        assert_eq!(default_tensorboard_dir(Path::new("./step3/")), cwd.join("tensorboard/step3"));
    }

    #[test]
    fn wandb_is_off_by_default_a_project_turns_it_on_and_its_other_flags_need_it() {
        let parse = |args: &[&str]| Cli::parse_from(std::iter::once("x").chain(args.iter().copied())).log;
        assert!(parse(&[]).wandb(Path::new("out")).unwrap().is_none());
        for flag in ["--wandb-entity", "--wandb_run_name", "--wandb-exp-name", "--wandb-group", "--wandb-save-dir"] {
            let err = parse(&[flag, "x"]).wandb(Path::new("out")).unwrap_err().to_string();
            assert!(err.contains("wandb is off") && err.contains("--enable-wandb"), "{flag}: {err}");
        }
        // On (by the project), the flags reach the settings; the key comes from the environment.
        if std::env::var_os("WANDB_API_KEY").is_none() && std::env::var_os("WANDB_MODE").is_none() {
            let on = parse(&["--wandb_project", "p", "--wandb-run-name", "n", "--wandb-dir", "/w"]);
            let err = on.wandb(Path::new("out")).unwrap_err().to_string();
            assert!(err.contains("WANDB_API_KEY"), "{err}");
        }
    }
}
