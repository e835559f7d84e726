//! What a run reads and writes: Hugging Face model directories (`hf_io`) and resumable
//! checkpoints, a model directory plus the optimizer and trainer state (`resume`). Every write
//! goes through `crate::durable`, so a crash leaves the previous save intact.

pub mod hf_io;
pub mod resume;
