//! The ranks as a T x D grid (Megatron's `initialize_model_parallel`): tensor-parallel groups of
//! T consecutive ranks, which stay on one node because they all-reduce inside every layer, and
//! data-parallel groups of the ranks at the same place in each TP group, across which ZeRO
//! shards and gradients are averaged.

use crate::comm::ProcessGroup;
use anyhow::{bail, Result};
use std::sync::Arc;

/// This rank's two groups.
#[derive(Clone)]
pub struct ParallelLayout {
    /// The T ranks that split each layer with this one.
    pub tp: Arc<ProcessGroup>,
    /// The D ranks that hold the same slice of the model and see other data.
    pub dp: Arc<ProcessGroup>,
}

impl ParallelLayout {
    /// Cuts `world` into TP groups of `tp_size` consecutive ranks (every rank calls it
    /// together). A size that does not divide the world, or the ranks of a node, is one line.
    pub fn new(world: &ProcessGroup, tp_size: usize) -> Result<Self> {
        check_tp_size(tp_size, world.world(), world.env.local_world)?;
        let rank = world.rank();
        let tp = world.split(rank / tp_size)?;
        let dp = world.split(rank % tp_size)?;
        Ok(Self { tp: Arc::new(tp), dp: Arc::new(dp) })
    }
}

/// Whether T ranks per TP group fit `world` ranks of which `per_node` run on each node.
pub fn check_tp_size(tp_size: usize, world: usize, per_node: usize) -> Result<()> {
    if tp_size == 0 || !world.is_multiple_of(tp_size) {
        bail!("--tensor-model-parallel-size {tp_size} does not divide the {world} ranks: use a divisor of {world}");
    }
    if !per_node.is_multiple_of(tp_size) {
        bail!(
            "--tensor-model-parallel-size {tp_size} would split a tensor-parallel group across nodes ({per_node} ranks per node): use a divisor of {per_node}"
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::{on_groups, ReduceOp};

    #[test]
    fn bad_sizes_are_one_line_each() {
        check_tp_size(2, 4, 4).unwrap();
        check_tp_size(1, 3, 3).unwrap();
        let err = check_tp_size(3, 4, 4).unwrap_err().to_string();
        assert!(err.contains("does not divide the 4 ranks"), "{err}");
        let err = check_tp_size(4, 8, 2).unwrap_err().to_string();
        assert!(err.contains("across nodes") && err.contains("2 ranks per node"), "{err}");
        assert!(check_tp_size(0, 4, 4).is_err());
    }

    /// 4 ranks at T = 2: TP groups {0, 1} and {2, 3}, DP groups {0, 2} and {1, 3}.
    #[test]
    fn tp_groups_are_consecutive_ranks_and_dp_groups_stride_across_them() -> Result<()> {
        let results = on_groups(4, |world| {
            let layout = ParallelLayout::new(&world, 2)?;
            let who = |g: &ProcessGroup| -> Result<Vec<f64>> {
                let mut v = vec![0.0; 4];
                v[world.rank()] = 1.0;
                g.all_reduce_scalars(&mut v, ReduceOp::Sum)?;
                Ok(v)
            };
            Ok((who(&layout.tp)?, who(&layout.dp)?))
        });
        let members = |v: &[f64]| (0..4).filter(|&i| v[i] == 1.0).collect::<Vec<_>>();
        for (r, res) in results.into_iter().enumerate() {
            let (tp, dp) = res?;
            assert_eq!(members(&tp), if r < 2 { vec![0, 1] } else { vec![2, 3] }, "rank {r}");
            assert_eq!(members(&dp), if r % 2 == 0 { vec![0, 2] } else { vec![1, 3] }, "rank {r}");
        }
        Ok(())
    }
}
