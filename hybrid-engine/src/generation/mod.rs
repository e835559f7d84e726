//! The generation side of the hybrid engine: batched sampling with the KV cache (`generate`, over
//! `batch`'s prompts and settings), on a GPU through a CUDA graph of the decoding step
//! (`decode_graph`), and the hybrid engine's generation mode, which switches one trained model
//! into generation once per rollout (`mode`: gathered, LoRA fused, dropout off, the KV cache kept).

pub mod batch;
pub mod decode_graph;
pub mod generate;
pub mod mode;
