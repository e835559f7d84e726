//! Forward and backward of the language-model loss on one micro-batch, with optional activation
//! checkpointing (Megatron `--checkpoint-activations`, HF `gradient_checkpointing`).
//!
//! candle has no hook to recompute a subgraph, so checkpointing is done by hand: the forward
//! keeps only each block's input (B, T, C) and drops the block's activations; the backward then
//! walks the blocks in reverse, recomputes one block from its saved input, and back-propagates
//! the incoming gradient through it with the surrogate `sum(out * grad_out)`. Only one block's
//! activations are alive at a time. Dropout masks are a pure function of their
//! [`crate::kernels::ops::DropoutKey`], so the recomputation draws the same masks as the forward.

use crate::model::gpt2::{Dropout, Gpt2};
use crate::model::positions::Positions;
use crate::model::reward_model::{Heads, RewardModel};
use crate::training::optim::GradAccumulator;
use crate::training::zero3::ShardedModel;
use anyhow::{anyhow, Result};
use candle_core::{Tensor, Var};
use std::rc::Rc;

/// The model a step trains: whole on every rank, or sharded at rest (ZeRO stage 3, whose
/// gradients go to the model's own shard rather than to the accumulator).
///
/// Step 3's frozen models (the reference, the reward model) are held the same way, whole or
/// sharded at rest, with no optimizer.
pub enum TrainedModel {
    /// The trunk and, for a reward model or critic, its score head.
    Whole {
        trunk: Box<Gpt2>,
        score: Option<Tensor>,
    },
    Sharded(Rc<ShardedModel>),
}

impl TrainedModel {
    /// Under ZeRO-3, the whole model's fp32 weights on rank 0 for saving (every rank must call
    /// it: each unit is gathered); `None` on the other ranks and for a whole model, whose
    /// masters the step holds.
    pub fn gather_sharded_params(&self) -> Result<Option<crate::model::params::ParamStore>> {
        match self {
            Self::Sharded(model) => model.gather_params(),
            Self::Whole { .. } => Ok(None),
        }
    }

    /// The trunk of a whole model (`None` when sharded).
    pub fn whole_trunk(&self) -> Option<&Gpt2> {
        match self {
            Self::Whole { trunk, .. } => Some(trunk),
            Self::Sharded(_) => None,
        }
    }

    /// A whole language model.
    pub fn lm(trunk: Gpt2) -> Self {
        Self::Whole { trunk: Box::new(trunk), score: None }
    }

    /// A whole reward model or critic.
    pub fn reward(model: RewardModel) -> Self {
        Self::Whole { trunk: Box::new(model.trunk), score: Some(model.score) }
    }

    /// [`forward_backward`] with a head that gets the weights it reads ([`Heads`]): the whole
    /// model's, or under stage 3 those gathered for the head.
    #[allow(clippy::too_many_arguments)]
    pub fn forward_backward(
        &self,
        ids: &Tensor,
        pos: &Positions,
        dropout: Option<&Dropout>,
        how: Backward,
        acc: &mut GradAccumulator,
        head: impl Fn(&Heads, &Tensor) -> candle_core::Result<Tensor>,
    ) -> Result<f32> {
        match self {
            Self::Whole { trunk, score } => {
                let heads = Heads { trunk, score: score.as_ref() };
                forward_backward(trunk, ids, pos, dropout, how, acc, |h| head(&heads, h))
            }
            Self::Sharded(model) => model.forward_backward(ids, pos, dropout, how.loss_scale, head),
        }
    }

    /// [`lm_forward_backward`] on either kind of model.
    pub fn lm_forward_backward(
        &self,
        ids: &Tensor,
        targets: &Tensor,
        dropout: Option<&Dropout>,
        how: Backward,
        acc: &mut GradAccumulator,
    ) -> Result<f32> {
        match self {
            Self::Whole { trunk, .. } => lm_forward_backward(trunk, ids, targets, dropout, how, acc),
            Self::Sharded(model) => {
                let targets = targets.flatten_all()?;
                model.forward_backward(ids, &Positions::default(), dropout, how.loss_scale, |w, h| {
                    w.trunk.lm_head_loss(h, &targets)
                })
            }
        }
    }

    /// Runs `f` on the trunk's last hidden state of `ids` (no dropout, no gradient wanted) and
    /// the weights of the heads that read it (see [`Self::forward_backward`]): evaluation.
    pub fn with_hidden<R>(
        &self,
        ids: &Tensor,
        pos: &Positions,
        f: impl FnOnce(&Heads, &Tensor) -> Result<R>,
    ) -> Result<R> {
        match self {
            Self::Whole { trunk, score } => {
                f(&Heads { trunk, score: score.as_ref() }, &trunk.forward_blocks(ids, pos, None, None)?)
            }
            Self::Sharded(model) => {
                let hidden = model.forward_blocks(ids, pos)?;
                let (outer, gathered) = model.outer()?;
                let score = gathered.tensor(crate::model::reward_model::SCORE_WEIGHT);
                f(&Heads { trunk: &outer, score: score.as_ref() }, &hidden)
            }
        }
    }
}

/// How a micro-batch's backward runs.
#[derive(Clone, Copy, Debug)]
pub struct Backward {
    /// Recompute each block in backward instead of keeping its activations.
    pub checkpoint_activations: bool,
    /// The gradients accumulated are those of `loss * loss_scale` (1 / accumulation steps).
    pub loss_scale: f64,
}

/// Computes the mean LM loss of `ids` (B, T) against `targets` (B, T) and adds the gradients
/// of `loss * how.loss_scale` to `acc`. Returns the (unscaled) loss.
pub fn lm_forward_backward(
    model: &Gpt2,
    ids: &Tensor,
    targets: &Tensor,
    dropout: Option<&Dropout>,
    how: Backward,
    acc: &mut GradAccumulator,
) -> Result<f32> {
    if !how.checkpoint_activations && !acc.streams() {
        // The whole-model path keeps the (B, T, V) logits in one graph: no leaf needed.
        let loss = model.lm_loss(ids, targets, dropout)?;
        acc.add(&(&loss * how.loss_scale)?.backward()?)?;
        return Ok(loss.to_scalar::<f32>()?);
    }
    let targets = targets.flatten_all()?;
    forward_backward(model, ids, &Positions::default(), dropout, how, acc, |hidden| {
        model.lm_head_loss(hidden, &targets)
    })
}

/// Runs the trunk on `ids` (B, T), hands its last hidden state (B, T, C), before `ln_f`, to
/// `head`, which returns a scalar loss, and adds the gradients of `loss * how.loss_scale` to
/// `acc`. Returns the (unscaled) loss. Every step's loss (SFT, reward, and later the PPO actor
/// and critic) is a head on the same trunk, so activation checkpointing lives here once.
///
/// Backward runs in one call, or block by block where activations are recomputed or the
/// accumulator hands each part's gradients on as it ends (ZeRO-2's buckets: [`GradAccumulator::part_done`]).
#[allow(clippy::too_many_arguments)]
pub fn forward_backward(
    model: &Gpt2,
    ids: &Tensor,
    pos: &Positions,
    dropout: Option<&Dropout>,
    how: Backward,
    acc: &mut GradAccumulator,
    head: impl Fn(&Tensor) -> candle_core::Result<Tensor>,
) -> Result<f32> {
    let Backward { checkpoint_activations, loss_scale: scale } = how;
    if !checkpoint_activations && !acc.streams() {
        let hidden = model.forward_blocks(ids, pos, None, dropout)?; // (B, T, C)
        let loss = head(&hidden)?;
        acc.add(&(&loss * scale)?.backward()?)?;
        return Ok(loss.to_scalar::<f32>()?);
    }

    let (b, t) = ids.dims2()?;
    let bias = model.attention_bias(b, t, 0, pos, ids.device())?; // (B or 1, 1, T, T)

    // Forward, each block's input a leaf of the block's own graph. With checkpointing only the
    // inputs are kept, detached (each block's activations are dropped and recomputed in
    // backward); otherwise each block's graph is kept with its leaf, as one backward would.
    let embedded = model.embed(ids, pos, 0, dropout)?; // (B, T, C)
    let mut x = embedded.detach();
    let embedded = (!checkpoint_activations).then_some(embedded);
    let mut inputs = Vec::with_capacity(model.h.len());
    let mut kept = Vec::with_capacity(model.h.len());
    for block in &model.h {
        if checkpoint_activations {
            inputs.push(x.clone());
            x = block.forward(&x, &bias, None, dropout)?.detach();
        } else {
            let input = Var::from_tensor(&x)?;
            let out = block.forward(input.as_tensor(), &bias, None, dropout)?;
            x = out.detach();
            kept.push((input, out));
        }
    }

    // Head and loss, with the last hidden state as a leaf so its gradient is returned.
    let last = Var::from_tensor(&x)?;
    let loss = head(last.as_tensor())?;
    let store = (&loss * scale)?.backward()?;
    acc.add(&store)?;
    let mut grad = leaf_grad(&store, &last)?;
    drop(store);

    // Backward through the blocks with the surrogate `sum(out * grad_out)`, each recomputed
    // from its input or from its kept graph; each part's gradients complete as it ends.
    for (i, block) in model.h.iter().enumerate().rev() {
        let (input, out) = match kept.pop() {
            Some(pair) => pair,
            None => {
                let input = Var::from_tensor(&inputs[i])?;
                let out = block.forward(input.as_tensor(), &bias, None, dropout)?;
                (input, out)
            }
        };
        let store = out.mul(&grad)?.sum_all()?.backward()?;
        drop(out);
        acc.add(&store)?;
        grad = leaf_grad(&store, &input)?;
        drop(store);
        acc.part_done()?;
    }

    // Embeddings (wte also got the LM head's gradient above: the sum is the tied gradient).
    let emb = match embedded {
        Some(emb) => emb,
        None => model.embed(ids, pos, 0, dropout)?,
    };
    // The lookup's dwte is formed afresh: the head's is added into it in place.
    acc.add_formed(emb.mul(&grad)?.sum_all()?.backward()?)?;
    acc.part_done()?;
    Ok(loss.to_scalar::<f32>()?)
}

/// The gradient that reached a leaf, detached: candle leaves the gradients of variables attached
/// to the graph that computed them, and feeding such a tensor into the next block's surrogate
/// would make each backward walk (and keep alive) every earlier block's backward graph.
fn leaf_grad(store: &candle_core::backprop::GradStore, leaf: &Var) -> Result<Tensor> {
    store
        .get(leaf.as_tensor())
        .map(Tensor::detach)
        .ok_or_else(|| anyhow!("internal error: no gradient reached a checkpointed block boundary"))
}
