//! Where a run's metrics go besides `metrics.jsonl`; imports point down this list:
//!
//! - `tfrecord`: the TFRecord framing (length, data, masked CRC-32C) of event files;
//! - `tensorboard`: TensorBoard's Event/Summary messages, an event-file writer and reader, and the
//!   mapping from a metrics record to scalars;
//! - `plots`: the same scalars as a PNG grid of training curves.

pub mod plots;
pub mod tensorboard;
pub mod tfrecord;
