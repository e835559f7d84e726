//! The generation side of the hybrid engine: batched sampling with the KV cache (`generate`) and
//! the engine that switches one trained model into generation mode once per rollout (`engine`);
//! on a GPU, the decoding step replayed from a CUDA graph (`decode_graph`).

pub mod decode_graph;
pub mod engine;
pub mod generate;
