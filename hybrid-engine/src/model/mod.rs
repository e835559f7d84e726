//! GPT-2 itself: the configuration and layers (`gpt2`), the KV cache of generation, the trainable
//! parameters (`params`: one `Var` per HF tensor, LoRA adapters beside them) and the reward
//! model's score head. Built on `kernels`; knows nothing of optimizers, files or processes.

pub mod config;
pub mod gpt2;
pub mod kv_cache;
pub mod params;
pub mod positions;
pub mod reward_model;
