//! The core of the RLHF system, one module per concern; imports point down this list:
//!
//! - `runtime`, `durable`, `storage`: process setup, crash-safe files, candle's CPU storages read in
//!   place (what the collectives, kernels and optimizer read and write);
//! - `comm`: process groups from the launcher's environment, rendezvous, collectives (CPU ring,
//!   NCCL);
//! - `device`: where to compute (a rank's GPU is its local rank's);
//! - `kernels`: CPU kernels with their backward and the dispatch between them and candle's ops;
//! - `tensor_parallel`: the TP x DP layout of the ranks and the differentiable collectives of
//!   Megatron's tensor-parallel layers;
//! - `model`: GPT-2, its parameters, KV cache and reward head;
//! - `training`: optimizer, mixed precision, schedules, the training step, memory plan, metrics;
//! - `checkpoints`: Hugging Face model directories and resumable checkpoints;
//! - `generation`: sampling with the KV cache and the hybrid engine's generation mode;
//! - `engine`: the hybrid engine's training side, one owner of a trained model and its
//!   optimizer, ZeRO and tensor-parallel state ([`engine::Engine`]);
//! - `cli`: the flags every step shares and their validation.

pub mod checkpoints;
pub mod cli;
pub mod comm;
pub mod device;
pub mod engine;
pub use durable;
pub mod generation;
pub mod kernels;
pub mod model;
pub mod runtime;
pub mod storage;
pub mod tensor_parallel;
pub mod training;

/// LoRA's pure core and PEFT I/O, for the steps.
pub use lora;
pub use model::gpt2::{Gpt2, Gpt2Config};
pub use model::params::ParamStore;
/// TensorBoard event files, for the steps.
pub use telemetry;
