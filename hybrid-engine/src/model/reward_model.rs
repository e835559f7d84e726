//! DS-Chat's reward model (step 2, and step 3's critic): the GPT-2 trunk plus a bias-free linear
//! score head `C -> 1` reading the final LayerNorm's output, one score per token. Saved as HF
//! `GPT2ForSequenceClassification` (`transformer.*` + `score.weight`, `num_labels` 1,
//! `pad_token_id` set), so transformers loads it and pools the same score we report.
//!
//! Shapes: B rows, T tokens, C `n_embd`.

use crate::model::gpt2::{Gpt2, Gpt2Config};
use crate::model::params::ParamStore;
use anyhow::{bail, Result};
use candle_core::{DType, Device, Tensor};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

/// The head's tensor name, as in HF `GPT2ForSequenceClassification`.
pub const SCORE_WEIGHT: &str = "score.weight";

/// A reward model (or critic) over a parameter store holding the trunk and `score.weight`.
pub struct RewardModel {
    pub trunk: Gpt2,
    /// (1, C): shares storage with the store's `score.weight` variable.
    pub score: Tensor,
}

impl RewardModel {
    /// The model over `params`, which must hold `score.weight` of shape (1, C).
    pub fn new(params: &ParamStore, cfg: &Gpt2Config) -> Result<Self> {
        Self::from_trunk(params.model(cfg)?, params, cfg)
    }

    /// The model of `trunk` (over `params`, or this rank's slices of them under tensor
    /// parallelism) with the score head in `params`, which every TP rank holds whole.
    pub fn from_trunk(trunk: Gpt2, params: &ParamStore, cfg: &Gpt2Config) -> Result<Self> {
        let Some(score) = params.get(SCORE_WEIGHT) else {
            bail!("internal error: the reward model's parameters lack {SCORE_WEIGHT}");
        };
        if score.dims() != [1, cfg.n_embd] {
            bail!("{SCORE_WEIGHT} has shape {:?}; a reward model needs (1, {})", score.dims(), cfg.n_embd);
        }
        Ok(Self { trunk, score: score.as_tensor().clone() })
    }

    /// Scores of every token from the trunk's last hidden state (B, T, C) -> (B, T), in f32
    /// (with `fp32_loss` the head itself runs in f32; else its output is upcast).
    pub fn token_scores(&self, hidden: &Tensor) -> candle_core::Result<Tensor> {
        self.heads().token_scores(hidden)
    }

    /// The weights its heads read.
    pub fn heads(&self) -> Heads<'_> {
        Heads { trunk: &self.trunk, score: Some(&self.score) }
    }
}

/// What a loss head reads besides the trunk's hidden states: the trunk (its final LayerNorm and
/// the tied LM head) and, for a reward model or a critic, the score head. Under ZeRO stage 3
/// these are the weights gathered for the head (the trunk then has no blocks).
#[derive(Clone, Copy)]
pub struct Heads<'a> {
    pub trunk: &'a Gpt2,
    pub score: Option<&'a Tensor>,
}

impl Heads<'_> {
    /// [`RewardModel::token_scores`].
    pub fn token_scores(&self, hidden: &Tensor) -> candle_core::Result<Tensor> {
        let Some(score) = self.score else {
            candle_core::bail!("internal error: scores asked of a model without {SCORE_WEIGHT}")
        };
        let (b, t, c) = hidden.dims3()?;
        let normed = self.trunk.final_norm(hidden)?.reshape((b * t, c))?; // (B*T, C)
        let normed = self.trunk.loss_input(&normed)?;
        let score = score.to_dtype(normed.dtype())?;
        normed.matmul(&score.t()?)?.reshape((b, t))?.to_dtype(DType::F32) // (B, T)
    }
}

/// Adds a freshly initialised `score.weight` (1, C) to a trunk's parameters: normal(0,
/// initializer_range), as HF `_init_weights` initialises a `Linear` (DS-Chat's `v_head` likewise).
pub fn add_score_head(params: &mut ParamStore, cfg: &Gpt2Config, seed: u64, device: &Device) -> Result<()> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x5c0e_5c0e);
    let values: Vec<f32> =
        (0..cfg.n_embd).map(|_| (crate::model::params::normal(&mut rng) * cfg.initializer_range) as f32).collect();
    params.push(SCORE_WEIGHT, &Tensor::from_vec(values, (1, cfg.n_embd), device)?)
}

/// The config fields that make transformers build `GPT2ForSequenceClassification` with one
/// label and pool at the last token that is not `pad_token_id`.
pub fn sequence_classification_config(cfg: &Gpt2Config, pad_token_id: u32) -> Gpt2Config {
    let mut cfg = cfg.clone();
    let extra = &mut cfg.extra;
    extra.insert("architectures".into(), serde_json::json!(["GPT2ForSequenceClassification"]));
    extra.insert("num_labels".into(), 1.into());
    extra.insert("id2label".into(), serde_json::json!({"0": "LABEL_0"}));
    extra.insert("label2id".into(), serde_json::json!({"LABEL_0": 0}));
    extra.insert("pad_token_id".into(), pad_token_id.into());
    cfg
}

/// The config of a causal LM saved from `cfg`, which may come from a reward model's directory.
pub fn causal_lm_config(cfg: &Gpt2Config) -> Gpt2Config {
    let mut cfg = cfg.clone();
    for key in ["num_labels", "id2label", "label2id"] {
        cfg.extra.remove(key);
    }
    cfg.extra.insert("architectures".into(), serde_json::json!(["GPT2LMHeadModel"]));
    cfg
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::positions::Positions;
    use candle_core::Var;

    fn small() -> Gpt2Config {
        Gpt2Config { n_layer: 2, n_embd: 16, n_head: 2, n_positions: 16, vocab_size: 40, ..Gpt2Config::tiny() }
    }

    #[test]
    fn token_scores_are_the_head_applied_to_the_final_norm() -> Result<()> {
        let cfg = small();
        let mut params = ParamStore::init(&cfg, 1, &Device::Cpu)?;
        add_score_head(&mut params, &cfg, 1, &Device::Cpu)?;
        let rm = RewardModel::new(&params, &cfg)?;
        let ids = Tensor::new(&[[1u32, 5, 7, 9], [2, 4, 6, 8]], &Device::Cpu)?;
        let hidden = rm.trunk.forward_blocks(&ids, &Positions::default(), None, None)?;
        let scores = rm.token_scores(&hidden)?;
        assert_eq!(scores.dims(), [2, 4]);
        // By hand for one position: ln_f(h[1, 2]) . w
        let h = rm.trunk.final_norm(&hidden.get(1)?.get(2)?.unsqueeze(0)?)?.squeeze(0)?;
        let w = params.get(SCORE_WEIGHT).unwrap().as_tensor().squeeze(0)?;
        let want: f32 = (h * w)?.sum_all()?.to_scalar()?;
        let got: f32 = scores.get(1)?.get(2)?.to_scalar()?;
        assert!((want - got).abs() < 1e-5, "{want} vs {got}");
        Ok(())
    }

    #[test]
    fn score_head_gets_the_finite_difference_gradient() -> Result<()> {
        let cfg = small();
        let mut params = ParamStore::init(&cfg, 2, &Device::Cpu)?;
        add_score_head(&mut params, &cfg, 2, &Device::Cpu)?;
        let rm = RewardModel::new(&params, &cfg)?;
        let ids = Tensor::new(&[[3u32, 1, 4, 1, 5]], &Device::Cpu)?;
        let loss = |rm: &RewardModel| -> Result<Tensor> {
            let h = rm.trunk.forward_blocks(&ids, &Positions::default(), None, None)?;
            Ok(rm.token_scores(&h)?.sqr()?.sum_all()?)
        };
        let grads = loss(&rm)?.backward()?;
        let var: &Var = params.get(SCORE_WEIGHT).unwrap();
        let g: Vec<f32> = grads.get(var.as_tensor()).expect("score.weight has a gradient").flatten_all()?.to_vec1()?;
        let w0: Vec<f32> = var.flatten_all()?.to_vec1()?;
        let eps = 1e-2f32;
        for i in [0usize, 7, 15] {
            let mut w = w0.clone();
            w[i] += eps;
            var.set(&Tensor::from_vec(w.clone(), (1, 16), &Device::Cpu)?)?;
            let up: f32 = loss(&rm)?.to_scalar()?;
            w[i] -= 2.0 * eps;
            var.set(&Tensor::from_vec(w, (1, 16), &Device::Cpu)?)?;
            let down: f32 = loss(&rm)?.to_scalar()?;
            var.set(&Tensor::from_vec(w0.clone(), (1, 16), &Device::Cpu)?)?;
            let fd = (up - down) / (2.0 * eps);
            assert!((fd - g[i]).abs() < 1e-3 * (1.0 + fd.abs()), "entry {i}: fd {fd} vs autograd {}", g[i]);
        }
        // And the trunk: every parameter receives a gradient through the head.
        for (name, v) in params.iter() {
            assert!(grads.get(v.as_tensor()).is_some(), "{name} got no gradient");
        }
        Ok(())
    }
}
