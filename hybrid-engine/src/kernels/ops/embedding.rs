//! The embedding lookup, an op for its backward: on a GPU one block sums each row's gradient
//! (cuda/embedding.cu) over the ids grouped by row on the host, in the order of the positions as
//! candle's CPU `index_add` adds them; the CPU kernel adds in that order too.

use crate::kernels::rowops;
use crate::storage::contiguous_f32;
use candle_core::{CpuStorage, CustomOp1, CustomOp2, Layout, Result, Shape, Tensor};

/// Rows of a table: `weight` (V, C) at `ids` (N,) gives (N, C), by the backend's own gather
/// (what `index_select` computes). The op exists for its backward, [`EmbeddingGrad`].
struct Embedding {
    /// The ids grouped by row ([`group_ids`]), read from a GPU when the forward ran, where the
    /// stream is nearly empty: read in backward, they would make the host wait for every queued
    /// kernel of the backward before it could queue the rest. None on the CPU or without a
    /// gradient to come.
    grouped: Option<Grouped>,
}

/// [`group_ids`]'s packed groups and their count.
type Grouped = std::sync::Arc<(Vec<u32>, usize)>;

/// The gradient of [`Embedding`]'s table, dw (V, C): row v the sum of dy's rows at the positions
/// whose id is v, added in f32 in the order of the positions (as candle's `index_add` adds them
/// on the CPU) and rounded once; zeros for absent ids. On a GPU candle's `index_add` gives each of
/// C threads all N ids in turn (4.6 ms a step for gpt2's two tables at 8192 tokens on an H100);
/// here the ids are grouped by row on the host ([`group_ids`]) and one block sums each group.
struct EmbeddingGrad {
    vocab: usize,
    ids: Tensor,
    grouped: Option<Grouped>,
}

/// The positions of `ids` grouped by id, ascending, packed as the GPU kernel reads them: the G
/// distinct ids, then the G + 1 starts of their groups, then the N positions, each group's in
/// ascending order. Returns (packed, G); an error for an id outside the table's `vocab` rows.
fn group_ids(ids: &[u32], vocab: usize) -> Result<(Vec<u32>, usize)> {
    if let Some(bad) = ids.iter().find(|&&id| id as usize >= vocab) {
        candle_core::bail!("embedding: id {bad} is outside the table's {vocab} rows");
    }
    let n = u32::try_from(ids.len()).map_err(|_| candle_core::Error::Msg("embedding: over 2^32 ids".into()))?;
    let mut positions: Vec<u32> = (0..n).collect();
    positions.sort_by_key(|&p| ids[p as usize]); // stable: positions stay ascending within an id
    let (mut rows, mut starts) = (Vec::new(), Vec::new());
    for (k, &p) in positions.iter().enumerate() {
        let id = ids[p as usize];
        if rows.last() != Some(&id) {
            rows.push(id);
            starts.push(k as u32);
        }
    }
    starts.push(n);
    let groups = rows.len();
    rows.extend(starts);
    rows.extend(positions);
    Ok((rows, groups))
}

/// `ids` read to the host and grouped by row ([`group_ids`]) for a table of `vocab` rows.
fn grouped_ids(ids: &Tensor, vocab: usize) -> Result<Grouped> {
    let ids = ids.flatten_all()?.to_dtype(candle_core::DType::U32)?.to_vec1::<u32>()?;
    Ok(std::sync::Arc::new(group_ids(&ids, vocab)?))
}

impl CustomOp2 for Embedding {
    fn name(&self) -> &'static str {
        "embedding"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        use candle_core::backend::BackendStorage;
        let (n, c) = (l2.shape().elem_count(), l1.shape().dims2()?.1);
        Ok((s1.index_select(s2, l1, l2, 0)?, Shape::from((n, c))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        use candle_core::backend::BackendStorage;
        let (n, c) = (l2.shape().elem_count(), l1.shape().dims2()?.1);
        Ok((s1.index_select(s2, l1, l2, 0)?, Shape::from((n, c))))
    }

    fn bwd(
        &self,
        weight: &Tensor,
        ids: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let op = EmbeddingGrad { vocab: weight.dim(0)?, ids: ids.clone(), grouped: self.grouped.clone() };
        Ok((Some(grad.contiguous()?.apply_op1_no_bwd(&op)?), None))
    }
}

impl EmbeddingGrad {
    /// The ids grouped by row ([`group_ids`]): as the forward read them, or read now.
    fn groups(&self, n: usize) -> Result<Grouped> {
        let grouped = match &self.grouped {
            Some(grouped) => grouped.clone(),
            None => grouped_ids(&self.ids, self.vocab)?,
        };
        let ids = grouped.0.len() - 2 * grouped.1 - 1;
        if ids != n {
            candle_core::bail!("embedding backward: {ids} ids for {n} gradient rows");
        }
        Ok(grouped)
    }
}

impl CustomOp1 for EmbeddingGrad {
    fn name(&self) -> &'static str {
        "embedding-grad"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let dy = contiguous_f32(s, l, "embedding gradient")?;
        let (n, c) = l.shape().dims2()?;
        let grouped = self.groups(n)?;
        let (groups, g) = (&grouped.0, grouped.1);
        let (rows, rest) = groups.split_at(g);
        let (starts, positions) = rest.split_at(g + 1);
        let mut dw = vec![0f32; self.vocab * c];
        for (i, &row) in rows.iter().enumerate() {
            let out = &mut dw[row as usize * c..(row as usize + 1) * c];
            for &p in &positions[starts[i] as usize..starts[i + 1] as usize] {
                rowops::add_assign(out, &dy[p as usize * c..(p as usize + 1) * c]);
            }
        }
        Ok((CpuStorage::F32(dw), Shape::from((self.vocab, c))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s: &candle_core::CudaStorage, l: &Layout) -> Result<(candle_core::CudaStorage, Shape)> {
        let (n, c) = l.shape().dims2()?;
        let grouped = self.groups(n)?;
        let dw = cuda::embedding_grad((s, l), &grouped.0, grouped.1, self.vocab)?;
        Ok((dw, Shape::from((self.vocab, c))))
    }
}

/// Rows `ids` (N,) u32 of `weight` (V, C): (N, C), any dtype on the CPU or a GPU; its backward
/// sums per row as described at [`EmbeddingGrad`] (f32 on the CPU; f32, bf16, f16 on a GPU).
pub fn embedding(weight: &Tensor, ids: &Tensor) -> Result<Tensor> {
    let grouped = match weight.device().is_cuda() && weight.track_op() {
        true => Some(grouped_ids(ids, weight.dim(0)?)?),
        false => None,
    };
    weight.contiguous()?.apply_op2(&ids.contiguous()?, Embedding { grouped })
}

/// The gradient [`embedding`]'s backward gives a table of `vocab` rows from the ids (N,) u32 and
/// the gradient of its output, `grad` (N, C), alone: the table's values are not read (ZeRO-3's
/// embedding backward gathers no weights for it). f32 on the CPU, f32/bf16/f16 on a GPU.
pub fn embedding_grad(vocab: usize, ids: &Tensor, grad: &Tensor) -> Result<Tensor> {
    let op = EmbeddingGrad { vocab, ids: ids.contiguous()?, grouped: None };
    grad.contiguous()?.apply_op1_no_bwd(&op)
}

/// The launchers of the CUDA kernels (`cuda_fwd` above calls them).
#[cfg(feature = "cuda")]
pub mod cuda {
    use crate::kernels::cuda::{for_float_dtype, ptx, BLOCK};
    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
    use candle_core::cuda_backend::WrapErr;
    use candle_core::{CudaStorage, Layout, Result};

    /// The embedding table's gradient (cuda/embedding.cu): dw (vocab, C) in dy's dtype from contiguous
    /// dy (N, C) and the ids grouped by row on the host (`groups`: the G rows, the G + 1 starts of
    /// their positions, the N positions; `group_ids` above), each row's sum in f32 in the order
    /// of the positions, zeros for the rows of absent ids. Deterministic.
    pub fn embedding_grad(
        (dy, ldy): (&CudaStorage, &Layout),
        groups: &[u32],
        n_groups: usize,
        vocab: usize,
    ) -> Result<CudaStorage> {
        let (n, c) = ldy.shape().dims2()?;
        if groups.len() != 2 * n_groups + 1 + n {
            candle_core::bail!(
                "embedding gradient on CUDA: {} group entries for {n_groups} groups of {n} ids",
                groups.len()
            );
        }
        Ok(for_float_dtype!(dy, ldy, "embedding gradient", |src: Elem, suffix| {
            let dev = dy.device();
            let dw = dev.alloc_zeros::<Elem>(vocab * c)?;
            if n_groups > 0 {
                let groups = dev.clone_htod(groups)?;
                let func =
                    dev.get_or_load_custom_func(&format!("embedding_grad_{suffix}"), "rlhf_embedding", ptx::EMBEDDING)?;
                let mut launch = func.builder();
                let (g32, c32) = (n_groups as u32, c as u32);
                launch.arg(src).arg(&groups).arg(&g32).arg(&dw).arg(&c32);
                let cfg = LaunchConfig { grid_dim: (g32, 1, 1), block_dim: (BLOCK, 1, 1), shared_mem_bytes: 0 };
                // SAFETY: the arguments match the kernel's signature; the groups' rows are below vocab
                // and their positions below N (group_ids checks both).
                unsafe { launch.launch(cfg) }.w()?;
            }
            Ok::<_, candle_core::Error>(dw)
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::ops::test_support::*;
    use candle_core::Var;

    #[test]
    fn ids_are_grouped_by_row_with_their_positions_in_order() -> Result<()> {
        // ids 3 1 3 0 1 3: rows 0, 1, 3; positions [3], [1, 4], [0, 2, 5].
        let (packed, g) = group_ids(&[3, 1, 3, 0, 1, 3], 4)?;
        assert_eq!(g, 3);
        assert_eq!(packed, vec![0, 1, 3, /* starts */ 0, 1, 3, 6, /* positions */ 3, 1, 4, 0, 2, 5]);
        assert_eq!(group_ids(&[], 4)?, (vec![0], 0));
        let err = group_ids(&[1, 4], 4).unwrap_err().to_string();
        assert!(err.contains("id 4 is outside the table's 4 rows"), "{err}");
        Ok(())
    }

    #[test]
    fn embedding_and_its_gradient_are_index_select_and_index_add_bit_for_bit() -> Result<()> {
        // Repeated ids (a row summed from several positions), absent rows (zero gradient).
        let weight = randn(0f32, 1.0, (50, 24), &dev())?;
        let ids = Tensor::new((0..300u32).map(|i| (i * i * 7) % 41).collect::<Vec<_>>(), &dev())?;
        let grads_of = |fused_op: bool| -> Result<(Tensor, Tensor)> {
            let w = Var::from_tensor(&weight)?;
            let y = match fused_op {
                true => embedding(w.as_tensor(), &ids)?,
                false => w.as_tensor().index_select(&ids, 0)?,
            };
            // The same output weights for both: a function of the element's index.
            let fixed: Vec<f32> = (0..y.elem_count()).map(|i| (i * 7919 % 1000) as f32 / 500.0 - 1.0).collect();
            let dy = Tensor::from_vec(fixed, y.shape(), &dev())?;
            let grads = y.mul(&dy)?.sum_all()?.backward()?;
            Ok((y, grads.get(w.as_tensor()).expect("the table has a gradient").clone()))
        };
        let (y, g) = grads_of(true)?;
        let (y_ref, g_ref) = grads_of(false)?;
        assert_eq!(y.dims(), &[300, 24]);
        assert_eq!(y.flatten_all()?.to_vec1::<f32>()?, y_ref.flatten_all()?.to_vec1::<f32>()?);
        assert_eq!(g.dims(), &[50, 24]);
        assert_eq!(g.flatten_all()?.to_vec1::<f32>()?, g_ref.flatten_all()?.to_vec1::<f32>()?);
        let absent = g.get(49)?.abs()?.sum_all()?.to_scalar::<f32>()?;
        assert_eq!(absent, 0.0, "row 49 has no id: its gradient is zero");
        Ok(())
    }
}

/// On a GPU against the CPU (the CUDA build's unit tests, which `scripts/gpu-check.sh` runs from
/// the package); without one they pass after saying so on stderr.
#[cfg(test)]
#[cfg(feature = "cuda")]
mod cuda_tests {
    use crate::kernels::ops::test_support::*;
    use candle_core::{DType, Device, Result, Tensor};

    #[test]
    #[ignore = "needs a GPU: scripts/gpu-check.sh runs it (cargo test --features cuda -- --include-ignored)"]
    fn embedding_gradient_is_the_cpu_sum_per_row_bit_for_bit() -> Result<()> {
        let gpu = gpu();
        // 3000 ids over 467 of 500 rows (the rest absent), many repeated; 300 columns stride
        // past a block of 256 threads.
        let table = Tensor::randn(0f32, 1f32, (500, 300), &Device::Cpu)?;
        let ids = Tensor::new((0..3000u32).map(|i| (i * i * 13 + 7) % 467).collect::<Vec<_>>(), &Device::Cpu)?;
        let f = |t: &[Tensor]| crate::kernels::ops::embedding(&t[0], &ids.to_device(t[0].device())?);
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            let table = table.to_dtype(dtype)?;
            let (y, g) = value_and_grads(&[&table], &gpu, f)?;
            assert_eq!(max_diff(&y, &table.index_select(&ids, 0)?)?, 0.0, "{dtype:?} rows");
            // value_and_grads' output weights in this dtype, added per row in f32 in the order of
            // the positions by candle's CPU index_add, rounded once.
            let fixed: Vec<f32> = (0..y.elem_count()).map(|i| (i * 7919 % 1000) as f32 / 500.0 - 1.0).collect();
            let dy = Tensor::from_vec(fixed, y.shape(), &Device::Cpu)?.to_dtype(dtype)?.to_dtype(DType::F32)?;
            let want = Tensor::zeros((500, 300), DType::F32, &Device::Cpu)?.index_add(&ids, &dy, 0)?.to_dtype(dtype)?;
            assert_eq!(max_diff(&g[0], &want)?, 0.0, "{dtype:?} gradient");
        }
        Ok(())
    }
}
