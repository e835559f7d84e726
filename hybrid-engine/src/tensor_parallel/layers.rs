//! Megatron's parallel linears (`tensor_parallel/layers.py`), each with its conjugate
//! communication op from [`super::mappings`] around its matmul, for Hugging Face's Conv1D layout
//! (weight `(in, out)`) with an optional unfused LoRA adapter.
//!
//! - [`column_parallel_linear`] (`c_attn`, `c_fc`): the weight's output columns split over the
//!   ranks; the whole input enters through `f`.
//! - [`row_parallel_linear`] (`c_proj`): the weight's input rows split; the partial outputs are
//!   summed by `g`, and the bias, whole, added once.

use crate::comm::ProcessGroup;
use crate::kernels::ops;
use crate::tensor_parallel::mappings::{copy_to_tensor_parallel_region, reduce_from_tensor_parallel_region};
use candle_core::{Result, Tensor};
use lora::LoraLinear;
use std::sync::Arc;

/// `x W + b` (B, T, in) -> (B, T, out / T) with this rank's output columns of `weight` and
/// `bias`, the input entered through `f` (its gradient the sum of the ranks' parts). A LoRA
/// adapter's `A` is whole and its `B` holds this rank's output rows: the rank-r bottleneck
/// `x A^T`, the same on every rank, enters `B` through `f` too, so that `A` and the input get
/// the whole gradient through it once.
pub fn column_parallel_linear(
    x: &Tensor,
    weight: &Tensor,
    bias: &Tensor,
    lora: Option<&LoraLinear>,
    tp: &Arc<ProcessGroup>,
) -> Result<Tensor> {
    let y = ops::linear(&copy_to_tensor_parallel_region(x, tp)?, weight, bias)?;
    let Some(lora) = lora else { return Ok(y) };
    let (b, t, c) = x.dims3()?;
    let bottleneck = x.reshape((b * t, c))?.matmul(&lora.a.t()?)?; // (B T, r)
    let delta = (copy_to_tensor_parallel_region(&bottleneck, tp)?.matmul(&lora.b.t()?)? * lora.scaling)?;
    y + delta.reshape((b, t, ()))?
}

/// `x W + b` from this rank's slice of the input (B, T, in / T) and its rows of `weight`, summed
/// over `tp` (`g`), then `bias`, whole, added once. A LoRA adapter's `A` holds this rank's input
/// columns: its partial bottlenecks are summed over `tp` too, and `B`, whole, maps the sum once.
pub fn row_parallel_linear(
    x: &Tensor,
    weight: &Tensor,
    bias: &Tensor,
    lora: Option<&LoraLinear>,
    tp: &Arc<ProcessGroup>,
) -> Result<Tensor> {
    let (b, t, d_in) = x.dims3()?;
    let x = x.reshape((b * t, d_in))?;
    let partial = x.matmul(weight)?.reshape((b, t, ()))?;
    let y = reduce_from_tensor_parallel_region(&partial, tp)?.broadcast_add(bias)?;
    let Some(lora) = lora else { return Ok(y) };
    let bottleneck = reduce_from_tensor_parallel_region(&x.matmul(&lora.a.t()?)?, tp)?; // (B T, r)
    y + (bottleneck.matmul(&lora.b.t()?)? * lora.scaling)?.reshape((b, t, ()))?
}
