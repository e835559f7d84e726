//! What a run reads and writes: Hugging Face model directories (`hf_io`) and resumable
//! checkpoints, a model directory plus the optimizer and trainer state (`resume`), the optimizer
//! state as one file per rank (`optimizer_shards`), a ZeRO-3 model's weights read by slices and
//! written unit by unit (`sharded_io`). Every write
//! goes through `crate::durable`, so a crash leaves the previous save intact.

pub mod hf_io;
pub mod optimizer_shards;
pub mod resume;
pub mod sharded_io;
