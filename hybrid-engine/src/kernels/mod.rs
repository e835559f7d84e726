//! CPU kernels, the CUDA kernels, and the ops that choose them. Imports point down this list:
//! `rowops` (per-row arithmetic, vectorised) <- `parallel` (rows over threads, gemm) <- `dropout`
//! (counter-based masks) <- `cuda` (what the CUDA launchers share, with the `cuda` feature) and
//! `cublaslt` (cuBLASLt's gemms with a fused epilogue, likewise) <-
//! `decode` (generation's few-row CPU kernels) <- `ops/*.rs` (one op a file: its candle custom
//! op with the backward, the CPU kernel and the CUDA launcher, and its tests) <- `ops` (what the
//! model calls: a fused kernel where it applies, else a composed reference candle can
//! differentiate).

#[cfg(feature = "cuda")]
pub mod cublaslt;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod decode;
pub mod dropout;
pub mod ops;
pub mod parallel;
pub mod rowops;
