//! Mixed precision, DeepSpeed semantics: the optimizer keeps fp32 master weights and fp32 Adam
//! moments; forward and backward run on a copy of the weights in the compute dtype (fp32, fp16
//! or bf16), refreshed from the masters after every update. Gradients are accumulated in fp32,
//! unscaled and checked before the update.
//!
//! fp16's narrow range (6e-8 .. 65504) needs a dynamic loss scale: the loss is multiplied by
//! the scale before backward so small gradients do not flush to zero, and the gradients are
//! divided by it before the update. An overflow (an inf or NaN gradient) skips the update;
//! [`LossScaler`] then lowers the scale, and raises it again after a window of clean steps.
//! bf16 has fp32's range, so it needs no scaling.

use anyhow::{bail, Result};
use candle_core::{DType, Tensor};
use serde::{Deserialize, Serialize};

/// The compute dtype (`--dtype`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, clap::ValueEnum, Serialize, Deserialize)]
pub enum Dtype {
    /// Full precision: no copy of the weights, no scaling.
    #[default]
    Fp32,
    /// Half precision with a dynamic loss scale.
    Fp16,
    /// bfloat16: fp32's range at half the bytes; no loss scale.
    Bf16,
}

impl Dtype {
    pub fn dtype(self) -> DType {
        match self {
            Dtype::Fp32 => DType::F32,
            Dtype::Fp16 => DType::F16,
            Dtype::Bf16 => DType::BF16,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            Dtype::Fp32 => "fp32",
            Dtype::Fp16 => "fp16",
            Dtype::Bf16 => "bf16",
        }
    }
}

/// How a step computes: the dtype, and whether losses and log-probs are taken from fp32 logits.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Precision {
    pub dtype: Dtype,
    /// DS-Chat `--compute_fp32_loss`: cast logits (and values, scores) to fp32 before the loss
    /// and log-softmax, instead of computing them in the half dtype.
    pub fp32_loss: bool,
}

/// The fp16 loss scaler's settings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LossScaling {
    pub initial_scale_power: u32,
    pub window: u64,
}

impl Default for LossScaling {
    /// DeepSpeed's initial scale 2^16 with DS-Chat's window of 100.
    fn default() -> Self {
        Self { initial_scale_power: 16, window: 100 }
    }
}

/// DeepSpeed's `DynamicLossScaler` with its config's defaults (`consecutive_hysteresis: false`),
/// which is also Megatron's `DynamicGradScaler`: the first `hysteresis - 1` overflows are only
/// skipped, each later one halves the scale (never below `min_scale`) until the scale grows
/// again; `window` clean steps in a row double it and refill the allowance. A clean step alone
/// does not: isolated overflows a few steps apart spend it as surely as a burst does. An
/// overflow at the minimum scale with no allowance left is fatal.
///
/// DeepSpeed 0.17.1 and later double the scale one clean step later (after `window + 1`); this
/// is Megatron's and the earlier DeepSpeed's count, which DS-Chat was written against.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LossScaler {
    pub scale: f64,
    pub window: u64,
    pub hysteresis: u32,
    pub min_scale: f64,
    /// Clean steps since the last overflow or scale increase.
    clean_steps: u64,
    /// Overflows still tolerated before the scale is halved (refilled when the scale grows).
    hysteresis_left: u32,
    /// Updates skipped for overflow, over the run.
    pub skipped_steps: u64,
}

/// What [`LossScaler::update`] decided for one step.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum ScaleUpdate {
    /// Clean step: the update is applied (the scale may have grown).
    Apply,
    /// Overflow: the update is skipped (the scale may have been halved).
    Skip,
}

impl LossScaler {
    /// DeepSpeed's hysteresis 2 and minimum scale 1.
    pub fn new(s: LossScaling) -> Self {
        Self::with(2f64.powi(s.initial_scale_power as i32), s.window, 2, 1.0)
    }

    pub fn with(scale: f64, window: u64, hysteresis: u32, min_scale: f64) -> Self {
        Self {
            scale,
            window: window.max(1),
            hysteresis: hysteresis.max(1),
            min_scale,
            clean_steps: 0,
            hysteresis_left: hysteresis.max(1),
            skipped_steps: 0,
        }
    }

    /// Records one step's outcome and adjusts the scale.
    pub fn update(&mut self, overflow: bool) -> Result<ScaleUpdate> {
        if !overflow {
            self.clean_steps += 1;
            if self.clean_steps >= self.window {
                self.scale *= 2.0;
                self.clean_steps = 0;
                self.hysteresis_left = self.hysteresis;
            }
            return Ok(ScaleUpdate::Apply);
        }
        self.clean_steps = 0;
        self.skipped_steps += 1;
        if self.hysteresis_left > 1 {
            self.hysteresis_left -= 1;
            return Ok(ScaleUpdate::Skip);
        }
        if self.scale <= self.min_scale {
            bail!(
                "fp16 gradients still overflow with the loss scale at its minimum ({}): train with --dtype bf16 (fp32's range), or lower --learning-rate",
                self.min_scale
            );
        }
        self.scale = (self.scale / 2.0).max(self.min_scale);
        Ok(ScaleUpdate::Skip)
    }
}

/// Whether any gradient holds an inf or a NaN (the sum of squares is then non-finite too).
pub fn has_overflow(grads: &[Tensor]) -> Result<bool> {
    Ok(!crate::training::optim::global_grad_norm(grads)?.is_finite())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overflows_halve_the_scale_after_the_hysteresis_and_clean_windows_double_it() -> Result<()> {
        let mut s = LossScaler::new(LossScaling { initial_scale_power: 16, window: 3 });
        assert_eq!(s.scale, 65536.0);
        // First overflow: skipped, the hysteresis absorbs it.
        assert_eq!(s.update(true)?, ScaleUpdate::Skip);
        assert_eq!((s.scale, s.skipped_steps), (65536.0, 1));
        // A clean step does not refill the allowance: the next overflow, isolated as it is, halves.
        assert_eq!(s.update(false)?, ScaleUpdate::Apply);
        assert_eq!(s.update(true)?, ScaleUpdate::Skip);
        assert_eq!((s.scale, s.skipped_steps), (32768.0, 2));
        // Spent until the scale grows: every overflow halves.
        assert_eq!(s.update(true)?, ScaleUpdate::Skip);
        assert_eq!(s.scale, 16384.0);
        // Three clean steps in a row (the window) double the scale and refill the allowance.
        for _ in 0..2 {
            s.update(false)?;
        }
        assert_eq!(s.scale, 16384.0);
        s.update(false)?;
        assert_eq!(s.scale, 32768.0);
        assert_eq!(s.update(true)?, ScaleUpdate::Skip);
        assert_eq!((s.scale, s.skipped_steps), (32768.0, 4));
        Ok(())
    }

    /// Step by step against DeepSpeed 0.17.0's `DynamicLossScaler` as its config builds it
    /// (hysteresis 2, `consecutive_hysteresis` false, minimum 1; window 3 and 2^8 here), driven
    /// by the same overflows (`scripts/fixtures/ds_loss_scaler.py`): the scale after each step.
    /// A refill on every clean step would end this at 32, not 8.
    #[test]
    fn the_scaler_follows_deepspeeds_defaults_step_by_step() -> Result<()> {
        #[rustfmt::skip]
        let deepspeed = [
            (false, 256.0), (false, 256.0), (false, 512.0), (false, 512.0), (true, 512.0), (false, 512.0),
            (false, 512.0), (true, 256.0), (false, 256.0), (false, 256.0), (false, 512.0), (true, 512.0),
            (true, 256.0), (false, 256.0), (false, 256.0), (false, 512.0), (true, 512.0), (true, 256.0),
            (true, 128.0), (true, 64.0), (true, 32.0), (true, 16.0), (false, 16.0), (false, 16.0),
            (true, 8.0), (false, 8.0), (false, 8.0), (false, 16.0), (false, 16.0), (false, 16.0),
            (true, 16.0), (true, 8.0), (false, 8.0),
        ];
        let mut s = LossScaler::new(LossScaling { initial_scale_power: 8, window: 3 });
        for (step, &(overflow, scale)) in deepspeed.iter().enumerate() {
            let expected = if overflow { ScaleUpdate::Skip } else { ScaleUpdate::Apply };
            assert_eq!(s.update(overflow)?, expected, "step {step}");
            assert_eq!(s.scale, scale, "the scale after step {step}");
        }
        assert_eq!(s.skipped_steps, deepspeed.iter().filter(|(overflow, _)| *overflow).count() as u64);
        Ok(())
    }

    #[test]
    fn overflow_at_the_minimum_scale_is_fatal_with_advice() -> Result<()> {
        let mut s = LossScaler::with(2.0, 100, 2, 1.0);
        s.update(true)?;
        s.update(true)?;
        assert_eq!(s.scale, 1.0);
        let err = s.update(true).unwrap_err().to_string();
        assert!(err.contains("--dtype bf16"), "{err}");
        Ok(())
    }
}
