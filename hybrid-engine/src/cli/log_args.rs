//! Where a run's metrics go besides `metrics.jsonl`: TensorBoard (DS-Chat's
//! `--enable_tensorboard` / `--tensorboard_path`, Megatron's `--tensorboard-dir`). Every step and
//! pretraining flatten these flags.

use clap::Args;
use std::path::{Path, PathBuf};

/// `train --enable-tensorboard` reaches the steps as this variable, the default of their flag.
pub const ENABLE_TENSORBOARD_ENV: &str = "RLHF_ENABLE_TENSORBOARD";

#[derive(Args, Debug, Clone, Default)]
pub struct LogArgs {
    /// Write TensorBoard event files: every metric of metrics.jsonl as a scalar, the command line
    /// as text (rank 0 only).
    #[arg(long, alias = "enable_tensorboard", env = ENABLE_TENSORBOARD_ENV, value_parser = clap::builder::FalseyValueParser::new())]
    pub enable_tensorboard: bool,
    /// The event files' directory (implies --enable-tensorboard; default: tensorboard/<name of
    /// the output directory> beside the output directory, so `tensorboard --logdir
    /// output/tensorboard` shows every step of a `train` run).
    #[arg(long, alias = "tensorboard_path", alias = "tensorboard-dir", alias = "tensorboard_dir")]
    pub tensorboard_path: Option<PathBuf>,
}

impl LogArgs {
    /// The TensorBoard directory of a run writing to `output_dir`, if TensorBoard is on.
    pub fn tensorboard_dir(&self, output_dir: &Path) -> Option<PathBuf> {
        if let Some(path) = &self.tensorboard_path {
            return Some(path.clone());
        }
        self.enable_tensorboard.then(|| default_tensorboard_dir(output_dir))
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
}
