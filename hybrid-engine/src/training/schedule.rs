//! Learning-rate schedules: linear warmup, then constant, linear or cosine decay to a floor
//! (Megatron's `AnnealingLR`; DS-Chat's `--lr-scheduler-type` with `--num-warmup-steps`).
//! A pure function of the iteration, so resuming needs no scheduler state beyond the iteration.

use serde::{Deserialize, Serialize};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DecayStyle {
    Constant,
    Linear,
    Cosine,
}

impl std::str::FromStr for DecayStyle {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "constant" | "constant_with_warmup" => Ok(Self::Constant),
            "linear" => Ok(Self::Linear),
            "cosine" => Ok(Self::Cosine),
            _ => Err(format!("unknown schedule {s:?}: use constant, linear or cosine")),
        }
    }
}

/// Hugging Face's `get_scheduler` types, DS-Chat's `--lr_scheduler_type` choices, with HF's
/// semantics: `constant` ignores the warmup; `cosine_with_restarts` has HF's default single cycle
/// (the `cosine` curve); `polynomial` has HF's defaults, power 1 down to `lr_end` 1e-7.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HfScheduler {
    Linear,
    Cosine,
    CosineWithRestarts,
    Polynomial,
    Constant,
    ConstantWithWarmup,
}

/// HF's `get_polynomial_decay_schedule_with_warmup` default end learning rate.
const POLYNOMIAL_LR_END: f64 = 1e-7;

impl std::str::FromStr for HfScheduler {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Ok(match s {
            "linear" => Self::Linear,
            "cosine" => Self::Cosine,
            "cosine_with_restarts" => Self::CosineWithRestarts,
            "polynomial" => Self::Polynomial,
            "constant" => Self::Constant,
            "constant_with_warmup" => Self::ConstantWithWarmup,
            _ => {
                return Err(format!(
                    "unknown scheduler {s:?}: use linear, cosine, cosine_with_restarts, polynomial, constant or constant_with_warmup"
                ))
            }
        })
    }
}

impl HfScheduler {
    /// The schedule of `total` optimizer steps at peak `max_lr` after `warmup` steps.
    pub fn schedule(self, max_lr: f64, warmup: u64, total: u64) -> LrSchedule {
        let (style, min_lr, warmup_iters) = match self {
            Self::Linear => (DecayStyle::Linear, 0.0, warmup),
            Self::Cosine | Self::CosineWithRestarts => (DecayStyle::Cosine, 0.0, warmup),
            Self::Polynomial => (DecayStyle::Linear, POLYNOMIAL_LR_END.min(max_lr), warmup),
            Self::Constant => (DecayStyle::Constant, 0.0, 0),
            Self::ConstantWithWarmup => (DecayStyle::Constant, 0.0, warmup),
        };
        LrSchedule { max_lr, min_lr, warmup_iters, decay_iters: total, style, samples_per_iteration: 1 }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LrSchedule {
    pub max_lr: f64,
    pub min_lr: f64,
    pub warmup_iters: u64,
    /// Iteration at which the decay reaches `min_lr` (Megatron `--lr-decay-iters`, default the
    /// run's length).
    pub decay_iters: u64,
    pub style: DecayStyle,
    /// 1: `warmup_iters` and `decay_iters` count iterations. Above 1 they count samples, each
    /// iteration consuming this many (the global batch): Megatron's `--train-samples` runs,
    /// with `--lr-warmup-samples` and `--lr-decay-samples`.
    #[serde(default = "one_per_iteration", skip_serializing_if = "is_one_per_iteration")]
    pub samples_per_iteration: u64,
}

fn one_per_iteration() -> u64 {
    1
}

fn is_one_per_iteration(n: &u64) -> bool {
    *n == 1
}

impl LrSchedule {
    /// `lr` for every update: no warm-up, no decay.
    pub fn constant(lr: f64) -> Self {
        Self {
            max_lr: lr,
            min_lr: lr,
            warmup_iters: 0,
            decay_iters: 0,
            style: DecayStyle::Constant,
            samples_per_iteration: 1,
        }
    }

    /// Learning rate of the update made after `iteration` updates. Hugging Face's schedulers (as
    /// DS-Chat steps them) and Megatron's `OptimizerParamScheduler` both step after the
    /// optimizer, so the first update runs at the schedule's value at 0 (0 during a warmup, which
    /// only fills Adam's moments) and the last of a run of T at T - 1 (above the floor).
    /// A schedule counting samples, Megatron's `OptimizerParamScheduler` stepped by the global
    /// batch, gives the update after `iteration` updates the value at `iteration x global batch`.
    pub fn lr(&self, iteration: u64) -> f64 {
        let iteration = iteration * self.samples_per_iteration;
        if self.warmup_iters > 0 && iteration <= self.warmup_iters {
            return self.max_lr * iteration as f64 / self.warmup_iters as f64;
        }
        if self.style == DecayStyle::Constant {
            return self.max_lr;
        }
        if iteration >= self.decay_iters {
            return self.min_lr;
        }
        let span = (self.decay_iters - self.warmup_iters).max(1) as f64;
        let ratio = (iteration - self.warmup_iters) as f64 / span;
        let coeff = match self.style {
            DecayStyle::Linear => 1.0 - ratio,
            DecayStyle::Cosine => 0.5 * (1.0 + (std::f64::consts::PI * ratio).cos()),
            DecayStyle::Constant => 1.0,
        };
        self.min_lr + coeff * (self.max_lr - self.min_lr)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sched(style: DecayStyle) -> LrSchedule {
        LrSchedule { max_lr: 1.0, min_lr: 0.1, warmup_iters: 10, decay_iters: 110, style, samples_per_iteration: 1 }
    }

    /// HF's six names: `constant` ignores the warmup, `constant_with_warmup` does not, the
    /// restarts' single cycle is the cosine, polynomial ends at 1e-7 (hand-computed halfway:
    /// (1 - 1e-7) / 2 + 1e-7).
    #[test]
    fn hf_schedulers_hand_computed() {
        let s = |name: &str| name.parse::<HfScheduler>().unwrap().schedule(1.0, 10, 110);
        assert_eq!(s("constant").lr(1), 1.0);
        assert_eq!(s("constant_with_warmup").lr(1), 0.1);
        assert_eq!(s("constant_with_warmup").lr(100), 1.0);
        for it in [1, 10, 35, 60, 109, 110] {
            assert_eq!(s("cosine_with_restarts").lr(it), s("cosine").lr(it));
        }
        assert!((s("polynomial").lr(60) - ((1.0 - 1e-7) / 2.0 + 1e-7)).abs() < 1e-15);
        assert_eq!(s("polynomial").lr(110), 1e-7);
        assert_eq!(s("linear").lr(110), 0.0);
        assert!("cosine_restarts".parse::<HfScheduler>().unwrap_err().contains("cosine_with_restarts"));
    }

    /// Each update's rate as `transformers.get_scheduler` gives it when stepped after the
    /// optimizer, as DS-Chat steps it: peak 1, 3 warmup steps, 10 updates
    /// (`scripts/fixtures/hf_schedules.py`, transformers 5.24.0). The first update runs at 0, the
    /// last above 0.
    #[test]
    fn hf_schedulers_match_transformers_update_by_update() {
        let warmup = [0.0, 0.3333333333333333, 0.6666666666666666, 1.0];
        let cosine = [
            0.9504844339512095,
            0.8117449009293668,
            0.6112604669781572,
            0.38873953302184283,
            0.18825509907063326,
            0.04951556604879048,
        ];
        let linear = [
            0.8571428571428571,
            0.7142857142857143,
            0.5714285714285714,
            0.42857142857142855,
            0.2857142857142857,
            0.14285714285714285,
        ];
        let polynomial = [
            0.8571428714285715,
            0.7142857428571429,
            0.5714286142857142,
            0.42857148571428577,
            0.28571435714285714,
            0.14285722857142863,
        ];
        let then = |decay: &[f64]| [&warmup[..], decay].concat();
        let expected = [
            ("linear", then(&linear)),
            ("cosine", then(&cosine)),
            ("cosine_with_restarts", then(&cosine)),
            ("polynomial", then(&polynomial)),
            ("constant", vec![1.0; 10]),
            ("constant_with_warmup", then(&[1.0; 6])),
        ];
        for (name, want) in expected {
            let schedule = name.parse::<HfScheduler>().unwrap().schedule(1.0, 3, 10);
            let got: Vec<f64> = (0..10).map(|done| schedule.lr(done)).collect();
            for (update, (g, w)) in got.iter().zip(&want).enumerate() {
                assert!((g - w).abs() <= 1e-15, "{name}, update {}: {g} where transformers gives {w}", update + 1);
            }
        }
    }

    #[test]
    fn a_schedule_in_samples_of_whole_iterations_is_the_schedule_in_iterations() {
        for style in [DecayStyle::Linear, DecayStyle::Cosine, DecayStyle::Constant] {
            let iterations = sched(style);
            let samples =
                LrSchedule { warmup_iters: 80, decay_iters: 880, samples_per_iteration: 8, ..iterations.clone() };
            for done in 0..120 {
                assert_eq!(samples.lr(done), iterations.lr(done), "{style:?} after {done}");
            }
        }
        // Between whole iterations: a warm-up over 20 samples of batches of 8 is at 8/20 after one.
        let s = LrSchedule { warmup_iters: 20, decay_iters: 90, samples_per_iteration: 8, ..sched(DecayStyle::Linear) };
        assert_eq!((s.lr(1), s.lr(2)), (0.4, 0.8));
        assert_eq!(s.lr(12), 0.1, "past the decay's 90 samples");
    }

    #[test]
    fn warmup_is_linear_from_0() {
        let s = sched(DecayStyle::Cosine);
        assert_eq!(s.lr(0), 0.0);
        assert_eq!(s.lr(1), 0.1);
        assert_eq!(s.lr(5), 0.5);
        assert_eq!(s.lr(10), 1.0);
    }

    #[test]
    fn cosine_linear_and_constant_decay_hand_computed() {
        let c = sched(DecayStyle::Cosine);
        // Halfway through the decay (iteration 60), cosine is at the midpoint 0.55.
        assert!((c.lr(60) - 0.55).abs() < 1e-12);
        // A quarter through: 0.1 + 0.9 * 0.5 * (1 + cos(pi/4)).
        assert!((c.lr(35) - (0.1 + 0.45 * (1.0 + std::f64::consts::FRAC_1_SQRT_2))).abs() < 1e-12);
        assert_eq!(c.lr(110), 0.1);
        assert_eq!(c.lr(500), 0.1, "after the decay, the floor");
        let l = sched(DecayStyle::Linear);
        assert!((l.lr(35) - (0.1 + 0.9 * 0.75)).abs() < 1e-12);
        let k = sched(DecayStyle::Constant);
        assert_eq!(k.lr(35), 1.0);
        assert_eq!(k.lr(500), 1.0);
    }
}
