//! The core of the RLHF system: GPT-2 on candle, its parameters and optimizer, schedules,
//! checkpoints and generation. Later issues add precision, parallelism, ZeRO and the engine
//! that switches one model between training and generation.

pub mod checkpoint;
pub mod cli;
pub mod decode;
pub mod device;
pub mod durable;
pub mod engine;
pub mod fused;
pub mod generate;
pub mod gpt2;
pub mod hf_io;
pub mod kv_cache;
pub mod memory;
pub mod metrics;
pub mod ops;
pub mod optim;
pub mod params;
pub mod precision;
pub mod reward_model;
pub mod rowops;
pub mod runtime;
pub mod schedule;
pub mod step_args;
pub mod train_step;
pub mod trainer;

pub use gpt2::{Gpt2, Gpt2Config};
/// LoRA's pure core and PEFT I/O, for the steps.
pub use lora;
pub use params::ParamStore;
