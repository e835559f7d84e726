//! The conjugate communication operators of tensor parallelism (Megatron's `mappings.py`), as
//! differentiable ops, each the other's transpose:
//!
//! - [`copy_to_tensor_parallel_region`] (Megatron's `f`): identity forward, all-reduce of the
//!   gradient backward. A replicated activation enters the column-parallel linears here; each
//!   rank's backward through its own heads or columns yields only its part of the input's
//!   gradient, and the parts are summed.
//! - [`reduce_from_tensor_parallel_region`] (`g`): all-reduce forward, identity backward. The
//!   partial outputs of row-parallel linears are summed here; every rank then holds the whole
//!   activation, and its gradient is the same on every rank.

use crate::comm::{ProcessGroup, ReduceOp};
use candle_core::backend::{BackendDevice, BackendStorage};
use candle_core::{CpuStorage, CustomOp1, Layout, Result, Shape, Tensor};
use std::sync::Arc;

/// `f`: `x` itself, whose gradient is all-reduced over `tp` in backward.
pub fn copy_to_tensor_parallel_region(x: &Tensor, tp: &Arc<ProcessGroup>) -> Result<Tensor> {
    if tp.world() == 1 {
        return Ok(x.clone());
    }
    x.apply_op1_arc(Arc::new(Box::new(CopyToRegion { tp: tp.clone() })))
}

/// `g`: the sum of `x` over `tp`, whose gradient passes through unchanged. The sum is a constant
/// to autograd and `x - x.detach()`, exactly zero, carries the identity backward to `x`.
pub fn reduce_from_tensor_parallel_region(x: &Tensor, tp: &ProcessGroup) -> Result<Tensor> {
    if tp.world() == 1 {
        return Ok(x.clone());
    }
    let sum = tp.all_reduce(&x.detach(), ReduceOp::Sum).map_err(external)?;
    let sum = sum.reshape(x.shape())?.to_dtype(x.dtype())?;
    sum + (x - x.detach())?
}

fn external(e: anyhow::Error) -> candle_core::Error {
    candle_core::Error::Msg(format!("{e:#}"))
}

/// The op behind [`copy_to_tensor_parallel_region`].
struct CopyToRegion {
    tp: Arc<ProcessGroup>,
}

/// A contiguous copy of the tensor `storage` and `layout` describe, on any backend.
fn identity<S>(storage: &S, layout: &Layout) -> Result<(S, Shape)>
where
    S: BackendStorage,
    S::Device: BackendDevice<Storage = S>,
{
    let mut out = storage.device().zeros_impl(layout.shape(), storage.dtype())?;
    storage.copy_strided_src(&mut out, 0, layout)?;
    Ok((out, layout.shape().clone()))
}

impl CustomOp1 for CopyToRegion {
    fn name(&self) -> &'static str {
        "copy-to-tensor-parallel-region"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        identity(storage, layout)
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        storage: &candle_core::CudaStorage,
        layout: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        identity(storage, layout)
    }

    fn bwd(&self, _arg: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let sum = self.tp.all_reduce(grad, ReduceOp::Sum).map_err(external)?;
        Ok(Some(sum.reshape(grad.shape())?.to_dtype(grad.dtype())?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::on_groups;
    use candle_core::{Device, Var};

    /// Two ranks, each with its own weight w_r on a replicated input x:
    /// `loss = sum(g(f(x) * w_r))` is `sum(x * (w_0 + w_1))` on one rank. Forward, every rank
    /// gets the one-rank loss; backward, x gets `w_0 + w_1` (f's all-reduce) and w_r gets x
    /// (g passes the gradient through once, not summed).
    #[test]
    fn f_and_g_give_the_one_rank_loss_and_gradients() -> anyhow::Result<()> {
        let x_values = [0.5f32, -1.0, 2.0, 0.25, 3.0, -0.75];
        let w = |r: usize| -> Vec<f32> { (0..6).map(|i| (i as f32 - 2.0) * 0.3 + r as f32).collect() };
        let results = on_groups(2, |group| {
            let tp = Arc::new(group);
            let x = Var::from_slice(&x_values, (2, 3), &Device::Cpu)?;
            let wr = Var::from_slice(&w(tp.rank()), (2, 3), &Device::Cpu)?;
            // A strided view, so the identity copy must follow the layout.
            let xt = x.as_tensor().t()?;
            let partial = (copy_to_tensor_parallel_region(&xt, &tp)?.t()? * wr.as_tensor())?;
            let loss = reduce_from_tensor_parallel_region(&partial, &tp)?.sum_all()?;
            let grads = loss.backward()?;
            let gx: Vec<f32> = grads.get(x.as_tensor()).unwrap().flatten_all()?.to_vec1()?;
            let gw: Vec<f32> = grads.get(wr.as_tensor()).unwrap().flatten_all()?.to_vec1()?;
            Ok((loss.to_scalar::<f32>()?, gx, gw))
        });
        let (w0, w1) = (w(0), w(1));
        let want_loss: f32 = (0..6).map(|i| x_values[i] * (w0[i] + w1[i])).sum();
        for res in results {
            let (loss, gx, gw) = res?;
            assert!((loss - want_loss).abs() < 1e-5, "{loss} vs {want_loss}");
            for i in 0..6 {
                assert!((gx[i] - (w0[i] + w1[i])).abs() < 1e-6, "dx {gx:?}");
                assert_eq!(gw[i], x_values[i], "dw {gw:?}");
            }
        }
        Ok(())
    }
}
