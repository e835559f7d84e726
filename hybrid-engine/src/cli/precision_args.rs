//! The precision flags every step shares, turned into the engine's [`Precision`] and
//! [`LossScaling`] and checked.

use crate::cli::heading;
use crate::training::precision::{Dtype, LossScaling, Precision};
use anyhow::{bail, Result};

/// The environment variable `train` passes its `--dtype` to the steps in (their default).
pub const DTYPE_ENV: &str = "RLHF_DTYPE";

/// The precision flags every step shares (DS-Chat's `--dtype`, `--compute_fp32_loss`, and the
/// DeepSpeed config's `loss_scale_window`).
#[derive(clap::Args, Debug, Clone, Copy, PartialEq)]
pub struct PrecisionArgs {
    /// Compute dtype: fp32, fp16 (dynamic loss scaling) or bf16. Master weights and Adam moments
    /// stay fp32 either way.
    #[arg(help_heading = heading::PRECISION, long, value_enum, default_value_t = Dtype::Fp32, env = DTYPE_ENV)]
    pub dtype: Dtype,
    /// Compute losses and log-probs from fp32 logits (and fp32 values and scores) rather than in
    /// the fp16/bf16 compute dtype.
    #[arg(help_heading = heading::PRECISION, long, alias = "compute_fp32_loss")]
    pub compute_fp32_loss: bool,
    /// fp16 only: double the loss scale after this many steps without overflow (default 100,
    /// DS-Chat's; in pretraining 1000, Megatron's).
    #[arg(help_heading = heading::PRECISION, long, alias = "loss_scale_window")]
    pub loss_scale_window: Option<u64>,
    /// fp16 only: the loss scale starts at 2^this (DeepSpeed's initial_scale_power; default 16;
    /// in pretraining 32, Megatron's).
    #[arg(help_heading = heading::PRECISION, long, alias = "initial_scale_power")]
    pub initial_scale_power: Option<u32>,
}

impl PrecisionArgs {
    pub fn precision(&self) -> Precision {
        Precision { dtype: self.dtype, fp32_loss: self.compute_fp32_loss }
    }
    /// The fp16 loss scaler's settings: the flags, else DeepSpeed's and DS-Chat's defaults.
    pub fn loss_scaling(&self) -> LossScaling {
        let default = LossScaling::default();
        LossScaling {
            initial_scale_power: self.initial_scale_power.unwrap_or(default.initial_scale_power),
            window: self.loss_scale_window.unwrap_or(default.window),
        }
    }
    /// Refuses the loss-scaling flags outside fp16 (they would do nothing) and values out of range.
    pub fn validate(&self) -> Result<()> {
        if self.dtype != Dtype::Fp16 && (self.loss_scale_window.is_some() || self.initial_scale_power.is_some()) {
            bail!(
                "--loss-scale-window and --initial-scale-power tune fp16's loss scale, and the dtype is {}: add --dtype fp16 or drop them",
                self.dtype.name()
            );
        }
        let scaling = self.loss_scaling();
        if scaling.window == 0 {
            bail!("--loss-scale-window must be at least 1");
        }
        if scaling.initial_scale_power > 32 {
            bail!(
                "--initial-scale-power {} is beyond fp16's range of use: use at most 32 (default 16)",
                scaling.initial_scale_power
            );
        }
        Ok(())
    }
}
