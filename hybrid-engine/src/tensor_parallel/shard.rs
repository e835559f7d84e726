//! Cutting a parameter over the ranks of a tensor-parallel group and putting it back, by its
//! [`Split`]: which split each parameter has is the model's (`crate::model::gpt2::layout`, read
//! through the config's `split_of`), how a split cuts is here.

use crate::comm::{ProcessGroup, ReduceOp};
use anyhow::{bail, Result};
use candle_core::{DType, Tensor};

/// How a parameter is cut over the ranks of a TP group.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Split {
    /// The same on every rank.
    Whole,
    /// The last dimension holds `segments` equal blocks (q, k and v of a packed projection), each cut
    /// into equal consecutive pieces: rank r takes piece r of every block.
    Columns { segments: usize },
    /// The same cut of the first dimension (a row-parallel linear's weight, the LoRA `B` of a
    /// column-parallel one).
    Rows { segments: usize },
    /// The token embedding's rows, padded first with zero rows to
    /// [`crate::tensor_parallel::vocab::padded_vocab_size`].
    VocabRows,
}

/// Rank `rank`'s slice of the whole parameter `t` cut as `split` over `ranks` ranks.
pub fn shard(t: &Tensor, split: Split, rank: usize, ranks: usize) -> Result<Tensor> {
    Ok(match split {
        Split::Whole => t.clone(),
        Split::Columns { segments } => cut(t, t.rank() - 1, segments, rank, ranks)?,
        Split::Rows { segments } => cut(t, 0, segments, rank, ranks)?,
        Split::VocabRows => {
            let (v, c) = t.dims2()?;
            let padded = crate::tensor_parallel::vocab::padded_vocab_size(v, ranks);
            let t = match padded > v {
                true => Tensor::cat(&[t.clone(), Tensor::zeros((padded - v, c), t.dtype(), t.device())?], 0)?,
                false => t.clone(),
            };
            shard(&t, Split::Rows { segments: 1 }, rank, ranks)?
        }
    })
}

/// Rank `rank`'s piece of every one of the `segments` equal blocks of dimension `dim` of `t`.
fn cut(t: &Tensor, dim: usize, segments: usize, rank: usize, ranks: usize) -> Result<Tensor> {
    let block = t.dim(dim)? / segments;
    let piece = block / ranks;
    let parts: Vec<Tensor> =
        (0..segments).map(|s| t.narrow(dim, s * block + rank * piece, piece)).collect::<candle_core::Result<_>>()?;
    Ok(Tensor::cat(&parts, dim)?.contiguous()?)
}

/// The inverse of [`cut`]: every rank's pieces of dimension `dim` put back block by block.
fn join(pieces: &[Tensor], dim: usize, segments: usize) -> Result<Tensor> {
    let width = pieces[0].dim(dim)? / segments;
    let mut parts = Vec::with_capacity(segments * pieces.len());
    for s in 0..segments {
        for piece in pieces {
            parts.push(piece.narrow(dim, s * width, width)?);
        }
    }
    Ok(Tensor::cat(&parts, dim)?)
}

/// The whole parameter from every rank's slice (`pieces[r]` is rank r's): the inverse of
/// [`shard`]. `rows` is the parameter's real first dimension, which drops the vocabulary padding.
pub fn unshard(pieces: &[Tensor], split: Split, rows: usize) -> Result<Tensor> {
    Ok(match split {
        Split::Whole => pieces[0].clone(),
        Split::Columns { segments } => join(pieces, pieces[0].rank() - 1, segments)?,
        Split::Rows { segments } => join(pieces, 0, segments)?,
        Split::VocabRows => Tensor::cat(pieces, 0)?.narrow(0, 0, rows)?.contiguous()?,
    })
}

/// The whole parameter cut as `split` from this rank's slice `local`, gathered from the ranks of
/// `tp` (a collective), in f32: what a consolidated save writes. `rows` as for [`unshard`].
pub fn gather_parameter(split: Split, local: &Tensor, rows: usize, tp: &ProcessGroup) -> Result<Tensor> {
    if tp.world() == 1 || split == Split::Whole {
        return Ok(local.to_dtype(DType::F32)?);
    }
    let all = tp.all_gather(&local.to_dtype(DType::F32)?.contiguous()?)?;
    let n = local.elem_count();
    let pieces: Vec<Tensor> =
        (0..tp.world()).map(|r| all.narrow(0, r * n, n)?.reshape(local.shape())).collect::<candle_core::Result<_>>()?;
    unshard(&pieces, split, rows)
}

/// The squared global norm of the gradients `grads` of the parameters cut as `splits`, each this
/// rank's slice, over the TP group: sliced parameters' squares are summed over the ranks, whole
/// ones (the same gradient on every rank) counted once. A collective; non-finite values stay so.
pub fn grad_norm_squared(splits: &[Split], grads: &[Tensor], tp: &ProcessGroup) -> Result<f64> {
    let mut share = 0f64;
    for (&split, g) in splits.iter().zip(grads) {
        share += norm_share(split, crate::kernels::ops::sum_of_squares(g)?, tp.world());
    }
    let mut total = [share];
    tp.all_reduce_scalars(&mut total, ReduceOp::Sum)?;
    Ok(total[0])
}

/// What `sum_of_squares`, one TP rank's squared gradient of a parameter cut as `split`, adds to
/// the squared norm summed over the `ranks` ranks: a slice all of it, a whole (replicated)
/// parameter, whose gradient every rank holds alike, its share, so that it counts once.
pub fn norm_share(split: Split, sum_of_squares: f64, ranks: usize) -> f64 {
    match split {
        Split::Whole => sum_of_squares / ranks as f64,
        _ => sum_of_squares,
    }
}

/// The shape of rank's slice of a whole parameter of shape `whole` cut as `split` over `ranks`
/// ranks (the embedding's rows padded first), as [`shard`] cuts it.
pub fn local_shape(split: Split, whole: &[usize], ranks: usize) -> Vec<usize> {
    let mut shape = whole.to_vec();
    match split {
        Split::Whole => {}
        Split::Columns { .. } => *shape.last_mut().expect("a sliced parameter has a dimension") /= ranks,
        Split::Rows { .. } => shape[0] /= ranks,
        Split::VocabRows => shape[0] = crate::tensor_parallel::vocab::padded_vocab_size(shape[0], ranks) / ranks,
    }
    shape
}

/// The inverse of [`local_shape`]: the whole parameter's shape from a slice of shape `local`,
/// `vocab` rows for the embedding (its padding dropped).
pub fn whole_shape(split: Split, local: &[usize], ranks: usize, vocab: usize) -> Vec<usize> {
    let mut shape = local.to_vec();
    match split {
        Split::Whole => {}
        Split::Columns { .. } => *shape.last_mut().expect("a sliced parameter has a dimension") *= ranks,
        Split::Rows { .. } => shape[0] *= ranks,
        Split::VocabRows => shape[0] = vocab,
    }
    shape
}

/// [`whole_shape`] by element counts: the whole parameter's from `local`, a rank's slice's over
/// `ranks` ranks; on one rank, which holds every parameter whole (the embedding unpadded),
/// `local` itself.
pub fn whole_numel(split: Split, local: usize, ranks: usize, vocab: usize) -> usize {
    match split {
        _ if ranks <= 1 => local,
        Split::Whole => local,
        Split::Columns { .. } | Split::Rows { .. } => local * ranks,
        Split::VocabRows => local / (crate::tensor_parallel::vocab::padded_vocab_size(vocab, ranks) / ranks) * vocab,
    }
}

/// Whether a model of `heads` heads and an MLP `inner` wide splits over `ranks` TP ranks.
pub fn check_divides(heads: usize, inner: usize, ranks: usize) -> Result<()> {
    if !heads.is_multiple_of(ranks) {
        bail!(
            "--tensor-model-parallel-size {ranks} does not divide the model's {heads} attention heads: use a divisor of {heads}"
        );
    }
    if !inner.is_multiple_of(ranks) {
        bail!("--tensor-model-parallel-size {ranks} does not divide the MLP width {inner}");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::gpt2::layout::split_of;
    use candle_core::Device;

    /// `unshard` inverts `shard` for every split, over 1 to 4 ranks, and `whole_numel` counts the
    /// whole from a slice; gathered over real ranks the slices give the whole parameter, and the
    /// gradient norm counts whole parameters once.
    #[test]
    fn slices_put_back_together_give_the_whole_parameter() -> Result<()> {
        let cpu = Device::Cpu;
        let cases = [
            ("h.0.attn.c_attn.weight", (8usize, 24usize)),
            ("h.0.attn.c_attn.bias", (1, 24)),
            ("h.0.mlp.c_fc.weight", (8, 32)),
            ("h.0.mlp.c_proj.weight", (32, 8)),
            ("h.0.ln_1.weight", (1, 8)),
            ("wte.weight", (300, 8)),
            ("h.0.attn.c_attn.lora_B.weight", (24, 4)),
            ("h.0.mlp.c_fc.lora_B.weight", (32, 4)),
            ("h.0.mlp.c_proj.lora_A.weight", (4, 32)),
        ];
        for ranks in [1, 2, 4] {
            for (name, (r, c)) in cases {
                let t = Tensor::arange(0f32, (r * c) as f32, &cpu)?.reshape((r, c))?;
                let t = if r == 1 { t.squeeze(0)? } else { t };
                let pieces: Vec<Tensor> =
                    (0..ranks).map(|k| shard(&t, split_of(name), k, ranks)).collect::<Result<_>>()?;
                let back = unshard(&pieces, split_of(name), t.dim(0)?)?;
                assert_eq!(
                    back.flatten_all()?.to_vec1::<f32>()?,
                    t.flatten_all()?.to_vec1::<f32>()?,
                    "{name} / {ranks}"
                );
                if ranks > 1 {
                    let whole = whole_numel(split_of(name), pieces[0].elem_count(), ranks, t.dim(0)?);
                    assert_eq!(whole, t.elem_count(), "{name} / {ranks}: the whole count from a slice's");
                }
            }
        }
        // Without tensor parallelism every parameter is whole, the embedding unpadded (50257
        // rows, not a multiple of 128).
        assert_eq!(whole_numel(Split::VocabRows, 50257 * 8, 1, 50257), 50257 * 8);
        assert_eq!(whole_numel(Split::Columns { segments: 1 }, 8 * 32, 1, 50257), 8 * 32);
        let w = Tensor::arange(0f32, 8.0 * 24.0, &cpu)?.reshape((8, 24))?;
        let ln = Tensor::new(&[3f32, 4.0], &cpu)?;
        let splits = [split_of("h.0.attn.c_attn.weight"), split_of("h.0.ln_1.weight")];
        for res in crate::comm::on_groups(2, |tp| {
            let local = shard(&w, splits[0], tp.rank(), 2)?;
            let whole = gather_parameter(splits[0], &local, 8, &tp)?;
            let norm = grad_norm_squared(&splits, &[local, ln.clone()], &tp)?;
            Ok((whole.flatten_all()?.to_vec1::<f32>()?, norm))
        }) {
            let (whole, norm) = res?;
            assert_eq!(whole, w.flatten_all()?.to_vec1::<f32>()?);
            let want = f64::from(w.sqr()?.sum_all()?.to_scalar::<f32>()?) + 25.0;
            assert!((norm - want).abs() < 1e-6 * want, "{norm} vs {want}");
        }
        Ok(())
    }

    #[test]
    fn heads_that_do_not_divide_are_one_line() {
        check_divides(12, 3072, 4).unwrap();
        let err = check_divides(12, 3072, 5).unwrap_err().to_string();
        assert!(err.contains("12 attention heads"), "{err}");
    }
}
