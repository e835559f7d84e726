//! The generation side of the hybrid engine: batched sampling with the KV cache (`generate`, over
//! `batch`'s prompts and settings), on a GPU through a CUDA graph of the decoding step
//! (`decode_graph`), and the engine that switches one trained model into generation mode once
//! per rollout (`engine`).

pub mod batch;
pub mod decode_graph;
pub mod engine;
pub mod generate;
