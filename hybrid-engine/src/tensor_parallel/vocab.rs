//! The vocabulary split over a TP group (Megatron's `VocabParallelEmbedding` and
//! `vocab_parallel_cross_entropy`): rank r holds rows `r * V / T ..` of the (tied) token
//! embedding, embeds the ids in its range and the ranks sum the rows; its LM head computes only
//! its slice of the logits, and the cross-entropy combines the slices through three reductions of
//! one number per row (the max, the sum of exponentials, the target's logit), so that the full
//! logits never exist on any rank.

use crate::comm::{ProcessGroup, ReduceOp};
use crate::tensor_parallel::mappings::{copy_to_tensor_parallel_region, reduce_from_tensor_parallel_region};
use candle_core::{DType, Result, Tensor, D};
use std::sync::Arc;

/// The vocabulary size padded so that every rank holds an equal slice of whole 128-row blocks
/// (Megatron's `make_vocab_size_divisible_by` x T).
pub fn padded_vocab_size(vocab: usize, ranks: usize) -> usize {
    vocab.next_multiple_of(128 * ranks)
}

/// The token rows `wte_local` (V / T, C) of rank `tp.rank()` looked up for `ids` (any shape, u32):
/// ids outside the slice give zero rows, and the ranks' rows are summed (`g`). (.., C)
pub fn vocab_parallel_embedding(ids: &Tensor, wte_local: &Tensor, tp: &ProcessGroup) -> Result<Tensor> {
    let rows = wte_local.dim(0)?;
    let start = (tp.rank() * rows) as f64;
    let flat = ids.flatten_all()?.to_dtype(DType::F32)?;
    let local = (&flat - start)?;
    let inside = local.ge(0.0)?.mul(&local.lt(rows as f64)?)?; // (N,) u8
    let index = inside.where_cond(&local, &local.zeros_like()?)?.to_dtype(DType::U32)?;
    let emb = wte_local.index_select(&index, 0)?; // (N, C)
    let emb = emb.broadcast_mul(&inside.to_dtype(emb.dtype())?.unsqueeze(1)?)?;
    let mut dims = ids.dims().to_vec();
    dims.push(wte_local.dim(1)?);
    reduce_from_tensor_parallel_region(&emb.reshape(dims)?, tp)
}

/// This rank's slice (N, V / T) of the tied LM head's logits for rows `x` (N, C), whole on
/// every rank (entered through `f`), in f32; the padding rows' logits (global index `vocab` and
/// beyond) are pushed to -1e9, so that they take no probability, as if they did not exist.
pub fn vocab_parallel_logits(x: &Tensor, wte_local: &Tensor, vocab: usize, tp: &Arc<ProcessGroup>) -> Result<Tensor> {
    let rows = wte_local.dim(0)?;
    let x = copy_to_tensor_parallel_region(x, tp)?;
    let logits = x.matmul(&wte_local.t()?)?.to_dtype(DType::F32)?;
    let start = tp.rank() * rows;
    if start + rows <= vocab {
        return Ok(logits);
    }
    let real = vocab.saturating_sub(start);
    let mask: Vec<f32> = (0..rows).map(|i| if i < real { 0.0 } else { -1e9 }).collect();
    logits.broadcast_add(&Tensor::from_vec(mask, (1, rows), logits.device())?)
}

/// Every rank's logits slices (N, V / T) put together, without the padding: (N, `vocab`). Not
/// differentiable: for generation, which needs the whole distribution of a few rows.
pub fn gather_vocab_parallel_logits(local: &Tensor, vocab: usize, tp: &ProcessGroup) -> Result<Tensor> {
    let (n, rows) = local.dims2()?;
    let all = tp.all_gather(&local.to_dtype(DType::F32)?.contiguous()?).map_err(external)?;
    let all = all.reshape((tp.world(), n, rows))?.transpose(0, 1)?.reshape((n, tp.world() * rows))?;
    all.narrow(1, 0, vocab)?.contiguous()
}

/// Mean cross-entropy of the tied LM head over rows `x` (N, C), whole on every rank, against
/// `targets` (N,) u32, with this rank's embedding rows `wte_local` (V / T, C) of a vocabulary
/// of `vocab` real tokens. Each rank forms its (N, V / T) logits only; the loss and every
/// gradient equal the one-rank ones.
pub fn vocab_parallel_cross_entropy(
    x: &Tensor,
    wte_local: &Tensor,
    targets: &Tensor,
    vocab: usize,
    tp: &Arc<ProcessGroup>,
) -> Result<Tensor> {
    vocab_parallel_log_probs(x, wte_local, targets, vocab, tp, false, 1.0)?.log_probs.neg()?.mean_all()
}

/// What [`vocab_parallel_log_probs`] gives for N rows.
pub struct TokenLogProbs {
    /// log p(target) of each row, f32 and differentiable. (N,)
    pub log_probs: Tensor,
    /// The entropy of each row's distribution, f32 and detached (a diagnostic). (N,)
    pub entropy: Option<Tensor>,
}

/// The tied LM head's log-probability of each row's target, as [`vocab_parallel_cross_entropy`]
/// computes it (rows `x` (N, C) whole on every rank, `targets` (N,) u32, this rank's embedding
/// rows `wte_local`), and with `with_entropy` each row's entropy, from one more reduction of
/// two numbers per row, of the distribution softmax(logits / `temperature`). No rank forms the
/// full logits.
pub fn vocab_parallel_log_probs(
    x: &Tensor,
    wte_local: &Tensor,
    targets: &Tensor,
    vocab: usize,
    tp: &Arc<ProcessGroup>,
    with_entropy: bool,
    temperature: f64,
) -> Result<TokenLogProbs> {
    let rows = wte_local.dim(0)?;
    let logits = vocab_parallel_logits(x, wte_local, vocab, tp)?; // (N, V / T)
    let logits = tempered(logits, temperature)?;
    // The max over the whole vocabulary, a constant to autograd (log p does not depend on it).
    let local_max = logits.max_keepdim(D::Minus1)?.detach(); // (N, 1)
    let max = tp.all_reduce(&local_max, ReduceOp::Max).map_err(external)?.reshape(local_max.shape())?;
    let shifted = logits.broadcast_sub(&max)?;
    let sum_exp = reduce_from_tensor_parallel_region(&shifted.exp()?.sum_keepdim(D::Minus1)?, tp)?; // (N, 1)
                                                                                                    // The target's shifted logit, from the rank whose slice holds it.
    let start = (tp.rank() * rows) as f64;
    let local = (targets.to_dtype(DType::F32)? - start)?;
    let inside = local.ge(0.0)?.mul(&local.lt(rows as f64)?)?;
    let index = inside.where_cond(&local, &local.zeros_like()?)?.to_dtype(DType::U32)?;
    let picked = shifted.gather(&index.unsqueeze(1)?, D::Minus1)?; // (N, 1)
    let picked = picked.broadcast_mul(&inside.to_dtype(DType::F32)?.unsqueeze(1)?)?;
    let target = reduce_from_tensor_parallel_region(&picked, tp)?;
    let log_probs = (target - sum_exp.log()?)?.squeeze(1)?;
    // H = log S - sum_i e^z_i z_i / S over the shifted logits z (the padding's e^z is 0).
    let entropy = match with_entropy {
        false => None,
        true => {
            let z = shifted.detach();
            let e = z.exp()?;
            let local = Tensor::cat(&[e.sum_keepdim(D::Minus1)?, (&e * &z)?.sum_keepdim(D::Minus1)?], 1)?; // (N, 2)
            let sums = tp.all_reduce(&local.contiguous()?, ReduceOp::Sum).map_err(external)?.reshape(local.shape())?;
            let (s, ez) = (sums.narrow(1, 0, 1)?, sums.narrow(1, 1, 1)?);
            Some((s.log()? - (ez / &s)?)?.squeeze(1)?)
        }
    };
    Ok(TokenLogProbs { log_probs, entropy })
}

/// `logits / temperature` (the logits themselves at 1, bit for bit).
pub fn tempered(logits: Tensor, temperature: f64) -> Result<Tensor> {
    if temperature == 1.0 {
        return Ok(logits);
    }
    logits / temperature
}

fn external(e: anyhow::Error) -> candle_core::Error {
    candle_core::Error::Msg(format!("{e:#}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::on_groups;
    use crate::tensor_parallel::shard::{shard, Split};
    use candle_core::{Device, Var};

    #[test]
    fn the_vocabulary_pads_to_whole_blocks_per_rank() {
        assert_eq!(padded_vocab_size(50257, 1), 50304);
        assert_eq!(padded_vocab_size(50257, 2), 50432);
        assert_eq!(padded_vocab_size(50257, 4), 50688);
        assert_eq!(padded_vocab_size(256, 2), 256);
    }

    /// Over 2 and 4 ranks (V = 16): the embedding and the loss are the one-rank ones, the
    /// hidden rows' gradient is whole on every rank and each rank's embedding gradient is its
    /// slice of the one-rank gradient (tied head and lookup together).
    #[test]
    fn vocab_parallel_embedding_and_cross_entropy_match_one_rank() -> anyhow::Result<()> {
        let cpu = Device::Cpu;
        let (v, c) = (16usize, 4usize);
        let wte: Vec<f32> = (0..v * c).map(|i| ((i * 37 % 23) as f32 - 11.0) * 0.1).collect();
        let ids = Tensor::new(&[[3u32, 15, 0], [8, 7, 12]], &cpu)?;
        let targets = Tensor::new(&[15u32, 0, 4, 9, 1, 7], &cpu)?;
        let hidden: Vec<f32> = (0..6 * c).map(|i| ((i * 11 % 13) as f32 - 6.0) * 0.2).collect();
        // One rank: lookup, then the tied head's loss on (embeddings + hidden).
        let one_rank = |w: &Tensor, h: &Tensor| -> Result<(Tensor, Tensor)> {
            let emb = w.index_select(&ids.flatten_all()?, 0)?.reshape((2, 3, c))?;
            let x = (emb.reshape((6, c))? + h)?;
            let logits = x.matmul(&w.t()?)?;
            Ok((emb, candle_nn::loss::cross_entropy(&logits, &targets)?))
        };
        let (w, h) = (Var::from_slice(&wte, (v, c), &cpu)?, Var::from_slice(&hidden, (6, c), &cpu)?);
        let (want_emb, want_loss) = one_rank(w.as_tensor(), h.as_tensor())?;
        let grads = want_loss.backward()?;
        let (want_gw, want_gh) = (grads.get(w.as_tensor()).unwrap().clone(), grads.get(h.as_tensor()).unwrap().clone());
        for ranks in [2, 4] {
            let results = on_groups(ranks, |group| {
                let tp = Arc::new(group);
                let whole = Tensor::from_slice(&wte, (v, c), &cpu)?;
                let w = Var::from_tensor(&shard(&whole, Split::Rows { segments: 1 }, tp.rank(), ranks)?)?;
                let h = Var::from_slice(&hidden, (6, c), &cpu)?;
                let emb = vocab_parallel_embedding(&ids, w.as_tensor(), &tp)?;
                let x = (emb.reshape((6, c))? + h.as_tensor())?;
                let loss = vocab_parallel_cross_entropy(&x, w.as_tensor(), &targets, v, &tp)?;
                let logits = vocab_parallel_logits(&x, w.as_tensor(), v, &tp)?;
                assert_eq!(gather_vocab_parallel_logits(&logits, v, &tp)?.dims(), [6, v]);
                let g = loss.backward()?;
                let gw = g.get(w.as_tensor()).unwrap().clone();
                let gh = g.get(h.as_tensor()).unwrap().clone();
                Ok((emb, loss.to_scalar::<f32>()?, gw, gh))
            });
            for (rank, res) in results.into_iter().enumerate() {
                let (emb, loss, gw, gh) = res?;
                let close = |a: &Tensor, b: &Tensor| -> anyhow::Result<f32> {
                    Ok((a - b)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?)
                };
                assert!(close(&emb, &want_emb)? < 1e-6, "{ranks} ranks, rank {rank}: embedding");
                assert!((loss - want_loss.to_scalar::<f32>()?).abs() < 1e-5, "{ranks} ranks, rank {rank}: loss");
                assert!(close(&gh, &want_gh)? < 1e-6, "{ranks} ranks, rank {rank}: hidden gradient");
                let want = shard(&want_gw, Split::Rows { segments: 1 }, rank, ranks)?;
                assert!(close(&gw, &want)? < 1e-6, "{ranks} ranks, rank {rank}: embedding gradient");
            }
        }
        Ok(())
    }
    /// Over 2 and 4 ranks (V = 13, padded): each row's log-probability of its target and its
    /// entropy are the one-rank log-softmax's, and so is the gradient of a weighted sum of the
    /// log-probs with respect to the rows.
    #[test]
    fn vocab_parallel_log_probs_and_entropy_match_one_rank() -> anyhow::Result<()> {
        let cpu = Device::Cpu;
        let (v, c, n) = (13usize, 4usize, 5usize);
        let wte: Vec<f32> = (0..v * c).map(|i| ((i * 29 % 17) as f32 - 8.0) * 0.15).collect();
        let hidden: Vec<f32> = (0..n * c).map(|i| ((i * 7 % 11) as f32 - 5.0) * 0.3).collect();
        let targets = Tensor::new(&[12u32, 0, 6, 7, 12], &cpu)?;
        let weights = Tensor::new(&[1.0f32, -0.5, 2.0, 0.25, -1.5], &cpu)?;
        // At temperature 1, and at 0.6 (a rollout sampled from softmax(logits / 0.6)).
        for (temperature, ranks) in [(1.0, 2), (1.0, 4), (0.6, 2)] {
            let h = Var::from_slice(&hidden, (n, c), &cpu)?;
            let w = Tensor::from_slice(&wte, (v, c), &cpu)?;
            let logp_all = candle_nn::ops::log_softmax(&(h.as_tensor().matmul(&w.t()?)? / temperature)?, D::Minus1)?;
            let want_logp = logp_all.gather(&targets.unsqueeze(1)?, 1)?.squeeze(1)?;
            let want_entropy = (logp_all.exp()? * &logp_all)?.sum(1)?.neg()?;
            let want_grad = (&want_logp * &weights)?.sum_all()?.backward()?.get(h.as_tensor()).unwrap().clone();
            let results = on_groups(ranks, |group| {
                let tp = Arc::new(group);
                let w = shard(&Tensor::from_slice(&wte, (v, c), &cpu)?, Split::VocabRows, tp.rank(), ranks)?;
                let h = Var::from_slice(&hidden, (n, c), &cpu)?;
                let out = vocab_parallel_log_probs(h.as_tensor(), &w, &targets, v, &tp, true, temperature)?;
                let grad = (&out.log_probs * &weights)?.sum_all()?.backward()?.get(h.as_tensor()).unwrap().clone();
                Ok((out.log_probs, out.entropy.unwrap(), grad))
            });
            for (rank, res) in results.into_iter().enumerate() {
                let (logp, entropy, grad) = res?;
                let close = |a: &Tensor, b: &Tensor| -> anyhow::Result<f32> {
                    Ok((a - b)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?)
                };
                let at = format!("{ranks} ranks, rank {rank}, temperature {temperature}");
                assert!(close(&logp, &want_logp)? < 1e-6, "{at}: log-probs");
                assert!(close(&entropy, &want_entropy)? < 1e-5, "{at}: entropy");
                assert!(close(&grad, &want_grad)? < 1e-6, "{at}: gradient");
            }
        }
        Ok(())
    }
}
