//! The training side of the hybrid engine: AdamW and gradient accumulation (`optim`), mixed
//! precision and loss scaling (`precision`), learning-rate schedules, the forward/backward of a
//! micro-batch (`train_step`), the optimizer step with its accumulation boundary (`trainer`),
//! data parallelism with ZeRO stages (`zero`; stage 3, parameters sharded at rest, `zero3`), the memory plan, the metrics log and
//! Megatron's early exits (`early_exit`).

pub mod early_exit;
pub mod memory;
pub mod metrics;
pub mod optim;
pub mod precision;
pub mod schedule;
pub mod tensor_parallel;
pub mod train_step;
pub mod trainer;
pub mod zero;
pub mod zero3;
