//! Where a run's metrics go besides `metrics.jsonl`; imports point down this list:
//!
//! - `tfrecord`: the TFRecord framing (length, data, masked CRC-32C) of event files;
//! - `tensorboard`: TensorBoard's Event/Summary messages, an event-file writer and reader, and the
//!   mapping from a metrics record to scalars;
//! - `wandb`: the same scalars as wandb history rows, kept on disk and uploaded over HTTP;
//! - `plots`: the same scalars as a PNG grid of training curves;
//! - `progress`: bars (on a terminal) or log lines for long phases.

pub mod plots;
pub mod progress;
pub mod tensorboard;
pub mod tfrecord;
pub mod wandb;
