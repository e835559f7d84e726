//! CPU kernels, the CUDA kernels, and the dispatch that chooses them. Imports point down this
//! list: `rowops` (per-row arithmetic, vectorised) <- `parallel` (rows over threads, gemm) <-
//! `dropout` (counter-based masks) <- `cuda` (the CUDA kernels, with the `cuda` feature) <-
//! `decode` (generation's few-row kernels) <- `sample_pick` (sampling's choice of a token) <-
//! `fused` (the training kernels, each a candle custom op with its backward) <- `ops` (what the
//! model calls: a fused kernel where it applies, else a composed reference candle can
//! differentiate).

#[cfg(feature = "cuda")]
pub mod cuda;
pub mod decode;
pub mod dropout;
pub mod fused;
pub mod ops;
pub mod parallel;
pub mod rowops;
pub mod sample_pick;
